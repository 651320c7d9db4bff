"""Seed 002 — 第8章：Transformer与注意力机制 (chapter 8: Transformer and attention).

Every quantitative or checkable statement of the chapter, checked live against attnlab, and the
worked solutions of its exercises 8.1–8.8 (§8.8). Checks run in float64 with seeded generators on
small sizes; a claim's verdict is computed from what the library returns (``ok`` → ``agrees``,
else ``text error``), so a library regression flips a verdict and fails the test suite.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from .. import derivations as ind
from ..core import (
    AGREES,
    NOT_CHECKABLE,
    Derivation,
    Finding,
    check,
    fmt,
    judged,
    tiny,
)
from ..exercises import exercise

F64 = torch.float64


def _randn(*shape: int, seed: int = 0) -> Tensor:
    """Seeded float64 standard-normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _qkv(B: int = 1, H: int = 2, L: int = 8, D: int = 8, seed: int = 0) -> tuple[Tensor, ...]:
    """Seeded q, k, v of shape (B, H, L, D) in float64."""
    return tuple(_randn(B, H, L, D, seed=seed + i) for i in range(3))


def _found(
    computed: str, call: str, ok: bool, why: str, derivation: Derivation | None = None
) -> Finding:
    """``agrees`` when the text's statement holds (``ok``); else ``text error`` with ``why`` if
    ``derivation`` backs attnlab's value, ``disagrees`` if not (`attnlab.textbook.core.judged`)."""
    return Finding(computed, call, **judged(ok, why, derivation))


def _mha_by_hand(mha, x: Tensor) -> Derivation:
    """``mha(x)`` against multi-head attention computed in numpy from the module's weights."""
    weights = (mha.qkv_proj.weight, mha.qkv_proj.bias, mha.out_proj.weight, mha.out_proj.bias)
    e = mha.out_proj.weight.shape[0]
    weights = [
        w.detach().numpy() if w is not None else np.zeros(n)
        for w, n in zip(weights, (3 * e, 3 * e, e, e), strict=True)
    ]
    with torch.no_grad():
        y = mha(x)
    ok = all(
        ind.close(y[b].numpy(), ind.mha(x[b].numpy(), *weights, heads=mha.num_heads))
        for b in range(x.shape[0])
    )
    return Derivation(
        ok,
        "multi-head attention in numpy from the module's weight matrices "
        "equals its output to 1e-12",
    )


_err = tiny  # a round-off-sized difference as ≈0 (< tol)


def _softmax_ref(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """softmax(QKᵀ·scale)V in plain torch, scale 1/√d_k by default."""
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(q @ k.transpose(-1, -2) * s, -1) @ v


def _mha(E: int = 16, H: int = 4, *, bias: bool = True, seed: int = 0):
    """A seeded float64 `attnlab.MultiHeadAttention`."""
    from ...modules import MultiHeadAttention

    torch.manual_seed(seed)
    mha = MultiHeadAttention(E, H, bias=bias).double().eval()
    return mha.requires_grad_(False)


def _mha_parts(mha) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W_q, W_k, W_v, W_o) of an attnlab MHA as torch Linear weights (out × in)."""
    (wq, _), (wk, _), (wv, _) = mha._weights()
    return wq.detach(), wk.detach(), wv.detach(), mha.out_proj.weight.detach()


# ------------------------------------------------------------------------------------ 8.1
@check("002-8.1.1-a")
def _weighted_sum() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    out, w = attention(q, k, v, return_weights=True)
    err = float((out - w @ v).abs().max())
    rows = float((w.sum(-1) - 1).abs().max())
    ok = err < 1e-12 and rows < 1e-12 and bool((w >= 0).all())
    return _found(
        f"max |y − αV| = {_err(err)}; max |Σ_j α_ij − 1| = {_err(rows)}; all α_ij >= 0",
        "out, w = attention(q, k, v, return_weights=True); (out - w @ v).abs().max()",
        ok,
        "the output is not the α-weighted sum of the values",
    )


@check("002-8.1.1-b")
def _rows_independent() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    full = attention(q, k, v)
    err = max(
        float((attention(q[:, :, i : i + 1], k, v) - full[:, :, i : i + 1]).abs().max())
        for i in range(q.shape[2])
    )
    return _found(
        f"max |attention(q[i:i+1], K, V) − attention(Q, K, V)[i]| over the 8 rows = {_err(err)}",
        "attention(q[:, :, i:i+1], k, v) vs attention(q, k, v)[:, :, i:i+1]",
        err < 1e-12,
        "a row computed alone differs from the same row of the full call",
    )


@check("002-8.1.2-a")
def _dot_scores() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    _, w = attention(q, k, v, scale=1.0, return_weights=True)
    e = q @ k.transpose(-1, -2)
    # log α_ij − log α_ik = e_ij − e_ik: the weights rank the keys exactly as the dot products do.
    diff = (w.log() - w.log()[..., :1]) - (e - e[..., :1])
    same_order = bool((w.argsort(-1) == e.argsort(-1)).all())
    err = float(diff.abs().max())
    return _found(
        f"max |(log α_ij − log α_i1) − (q_i·k_j − q_i·k_1)| = {_err(err)}; the weights rank the "
        f"keys as the dot products do in every row: {same_order}",
        "attention(q, k, v, scale=1.0, return_weights=True)",
        err < 1e-12 and same_order,
        "the weights are not a monotone function of q_i·k_j",
    )


@check("002-8.1.3-a")
def _var_dk() -> Finding:
    from ...analysis import scaling_experiment

    r = scaling_experiment(d_ks=(16, 64, 256), samples=1024, keys=16, seed=0)
    d, var = r.column("d_k"), r.column("var q·k")
    ok = all(abs(v / dk - 1) < 0.06 for dk, v in zip(d, var, strict=True))
    return _found(
        "; ".join(f"d_k={dk}: Var(q·k)={fmt(v)}" for dk, v in zip(d, var, strict=True)),
        "scaling_experiment(d_ks=(16, 64, 256), samples=1024, keys=16).column('var q·k')",
        ok,
        "the variance of q·k does not track d_k",
    )


@check("002-8.1.3-b")
def _sdpa_formula() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    ref = _softmax_ref(q, k, v)
    errs = {
        b: float((attention(q, k, v, backend=b) - ref).abs().max())
        for b in ("reference", "sdpa", "flash")
    }
    return _found(
        "max |attention − softmax(QKᵀ/√d_k)V|: "
        + ", ".join(f"{b} {_err(e)}" for b, e in errs.items()),
        "attention(q, k, v, backend=b) vs torch.softmax(q @ k.mT / d**0.5, -1) @ v",
        max(errs.values()) < 1e-12,
        "attention differs from softmax(QKᵀ/√d_k)V",
    )


@check("002-8.1.3-c")
@check("002-8.7-f")
def _scaled_var() -> Finding:
    from ...analysis import scaling_experiment
    from ...functional.scores import get_score

    r = scaling_experiment(d_ks=(16, 128, 512), samples=512, keys=16, seed=0)
    var, ent = r.column("var q·k/√d_k"), r.column("entropy scaled")
    raw_ent = r.column("entropy")
    default = get_score("dot").default_scale(256)
    ok = (
        all(abs(v - 1) < 0.06 for v in var)
        and max(ent) - min(ent) < 0.05
        and raw_ent[-1] < 0.5 * ent[-1]
        and abs(default - 1 / 16) < 1e-15
    )
    return _found(
        "scaled Var = "
        + ", ".join(fmt(v) for v in var)
        + "; softmax entropy scaled "
        + ", ".join(fmt(e) for e in ent)
        + " vs unscaled "
        + ", ".join(fmt(e) for e in raw_ent)
        + f" nats (d_k = 16, 128, 512); attnlab's default scale at d_k=256 = {fmt(default)}",
        "scaling_experiment(d_ks=(16, 128, 512), samples=512, keys=16); "
        "get_score('dot').default_scale(256)",
        ok,
        "the scaled logits do not keep unit variance or the softmax still saturates",
    )


@check("002-8.1.3-d")
def _saturation_grad() -> Finding:
    from ...analysis import scaling_experiment

    r = scaling_experiment(d_ks=(4, 64, 512), samples=512, keys=16, seed=0)
    raw, sc = r.column("grad norm"), r.column("grad norm scaled")
    ok = raw[0] > raw[1] > raw[2] and raw[2] < 0.5 * sc[2]
    return _found(
        "‖J‖_F unscaled "
        + ", ".join(fmt(x) for x in raw)
        + " vs scaled "
        + ", ".join(fmt(x) for x in sc)
        + " at d_k = 4, 64, 512",
        "scaling_experiment(d_ks=(4, 64, 512), samples=512, keys=16).column('grad norm')",
        ok,
        "the softmax gradient does not shrink as the unscaled logit variance grows",
    )


@check("002-8.1.3-e")
def _pipeline() -> Finding:
    mha = _mha(8, 1, bias=False)
    x = _randn(1, 6, 8, seed=1)
    wq, wk, wv, wo = _mha_parts(mha)
    q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    y = (a @ v) @ wo.T
    err = float((mha(x) - y).abs().max())
    return _found(
        f"max |MultiHeadAttention(x) − (softmax(QKᵀ/√d_k)V)W_o| = {_err(err)}",
        "MultiHeadAttention(8, 1, bias=False)(x) vs the step-by-step pipeline",
        err < 1e-12,
        "the module's forward differs from the pipeline",
    )


@check("002-8.1.4-a")
def _probability() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    _, w = attention(q, k, v, return_weights=True)
    e = q @ k.transpose(-1, -2) / math.sqrt(8)
    p = e.exp() / e.exp().sum(-1, keepdim=True)
    err = float((w - p).abs().max())
    ok = err < 1e-12 and bool((w >= 0).all()) and float((w.sum(-1) - 1).abs().max()) < 1e-12
    return _found(
        f"max |α − exp(e/√d_k)/Σexp| = {_err(err)}; rows are non-negative and sum to 1",
        "attention(q, k, v, return_weights=True)[1]",
        ok,
        "the weights are not this distribution",
    )


@check("002-8.1.4-b")
def _expectation() -> Finding:
    from ... import attention

    q, k, v = _qkv(H=1)
    out, w = attention(q, k, v, return_weights=True)
    p, y = w[0, 0, 0], out[0, 0, 0]
    n = 400_000
    j = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(0))
    samples = v[0, 0][j]  # (n, D)
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(n)
    z = float(((mean - y) / se).abs().max())
    return _found(
        f"max |mean of sampled v_j − y_i| / standard error = {fmt(z, 3)} (of {n:,} samples)",
        "attention(q, k, v, return_weights=True); torch.multinomial(p_i, n) → v[j].mean(0)",
        z < 5,
        "the sampled mean of v_j does not converge to y_i",
    )


@check("002-8.1.4-c")
def _entropy_extremes() -> Finding:
    from ... import attention
    from ...analysis import entropy

    q, k, v = _qkv(L=16)
    res = {}
    for t in (0.001, 1.0, 1000.0):
        _, w = attention(q, k, v, temperature=t, return_weights=True)
        res[t] = (float(entropy(w).mean()), float(w.max(-1).values.mean()))
    lo, mid, hi = res[0.001], res[1.0], res[1000.0]
    ok = (
        lo[0] < 0.05
        and lo[1] > 0.98
        and abs(hi[0] - math.log(16)) < 1e-3
        and lo[0] < mid[0] < hi[0]
    )
    return _found(
        "; ".join(
            f"T={t:g}: entropy {fmt(e)} nats, max weight {fmt(m)}" for t, (e, m) in res.items()
        )
        + f"; ln 16 = {fmt(math.log(16))}",
        "entropy(attention(q, k, v, temperature=T, return_weights=True)[1])",
        ok,
        "entropy does not separate concentrated and uniform attention",
    )


@check("002-8.1.4-d")
def _nadaraya_watson() -> Finding:
    from ... import attention

    q, k, v = _qkv(H=1, D=4)
    bias = -0.5 * (k * k).sum(-1).unsqueeze(-2)  # (B, H, 1, S)
    out = attention(q, k, v, scale=1.0, bias=bias)
    kern = torch.exp(-0.5 * torch.cdist(q, k) ** 2)  # Gaussian kernel K(q_i, k_j)
    nw = kern @ v / kern.sum(-1, keepdim=True)
    err = float((out - nw).abs().max())
    return _found(
        f"max |attention(q, k, v, scale=1, bias=−‖k‖²/2) − Σ K(q,k_j) v_j / Σ K(q,k_j)| = "
        f"{_err(err)}",
        "attention(q, k, v, scale=1.0, bias=-0.5 * (k * k).sum(-1).unsqueeze(-2))",
        err < 1e-12,
        "attention is not the Nadaraya–Watson estimator",
    )


# ------------------------------------------------------------------------------------ 8.2
def _permutation_outputs() -> tuple[Tensor, Tensor, Tensor]:
    """attention(Q, K, V), attention of the row-permuted inputs, and the permutation."""
    from ... import attention

    q, k, v = _qkv(H=1, L=6)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    out = attention(q, k, v)
    out_p = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    return out, out_p, perm


@check("002-8.2.1-a")
def _equivariance() -> Finding:
    out, out_p, perm = _permutation_outputs()
    err = float((out_p - out[:, :, perm]).abs().max())
    return _found(
        f"max |Attention(PQ, PK, PV) − P·Attention(Q, K, V)| = {_err(err)}",
        "attention(q[:, :, perm], k[:, :, perm], v[:, :, perm]) vs attention(q, k, v)[:, :, perm]",
        err < 1e-12,
        "the output is not permuted with the input",
    )


@check("002-8.2.1-b")
@check("002-8.5-b")
@check("002-8.7-a")
@check("002-ex8.3-b")
def _invariance_claim() -> Finding:
    """The text's word 'invariance' (置换不变性): the output would be unchanged by a permutation."""
    out, out_p, perm = _permutation_outputs()
    q, k, v = (t.numpy() for t in _qkv(H=1, L=6))
    p = perm.numpy()
    by_hand = ind.close(out.numpy(), ind.sdpa(q, k, v)) and ind.close(
        out_p.numpy(), ind.sdpa(q[:, :, p], k[:, :, p], v[:, :, p])
    )
    changed = float((out_p - out).abs().max())
    equi = float((out_p - out[:, :, perm]).abs().max())
    return _found(
        f"max |Attention(PQ, PK, PV) − Attention(Q, K, V)| = {fmt(changed)} (not invariant); "
        f"max |Attention(PQ, PK, PV) − P·Attention(Q, K, V)| = {_err(equi)} (equivariant)",
        "attention(q[:, :, perm], k[:, :, perm], v[:, :, perm]) vs attention(q, k, v)",
        changed < 1e-12,
        "the property is permutation equivariance (the output is permuted the same way), not "
        "invariance (an unchanged output)",
        Derivation(
            by_hand,
            "softmax(QKᵀ/√d)V in numpy equals attention on the inputs and on the permuted inputs",
        ),
    )


@check("002-8.2.1-c")
def _dog_bites_man() -> Finding:
    from ...positional import sinusoidal

    mha = _mha(16, 4)
    dog, bite, man = _randn(3, 16, seed=5)
    s1 = torch.stack([dog, bite, man])[None]  # 狗咬人
    s2 = torch.stack([man, bite, dog])[None]  # 人咬狗
    no_pe = float((mha(s1)[0, 0] - mha(s2)[0, 2]).abs().max())
    pe = sinusoidal(3, 16, dtype=F64)
    with_pe = float((mha(s1 + pe)[0, 0] - mha(s2 + pe)[0, 2]).abs().max())
    return _found(
        f"output at '狗': max difference between the sentences {_err(no_pe)} without positions, "
        f"{fmt(with_pe)} with sinusoidal positions added",
        "mha(s1)[0, 0] vs mha(s2)[0, 2]; mha(s + sinusoidal(3, 16))",
        no_pe < 1e-12 and with_pe > 1e-3,
        "the two orders are (in)distinguishable contrary to the text",
    )


@check("002-8.2.2-a")
def _pe_formula() -> Finding:
    from ...positional import sinusoidal

    pe = sinusoidal(64, 16, dtype=F64)
    pos = torch.arange(64, dtype=F64)[:, None]
    ang = pos / 10000 ** (torch.arange(0, 16, 2, dtype=F64) / 16)
    err = max(
        float((pe[:, 0::2] - ang.sin()).abs().max()), float((pe[:, 1::2] - ang.cos()).abs().max())
    )
    return _found(
        f"max |sinusoidal − formula| = {_err(err)}",
        "sinusoidal(64, 16, dtype=torch.float64)",
        err < 1e-12,
        "the table differs from the formula",
    )


@check("002-8.2.2-b")
def _pe_bounded_unique() -> Finding:
    from ...positional import sinusoidal

    pe = sinusoidal(2048, 64, dtype=F64)
    big = float(pe.abs().max())
    dist = torch.cdist(pe, pe)
    dist.fill_diagonal_(float("inf"))
    dmin = float(dist.min())
    return _found(
        f"max |PE| = {fmt(big)}; smallest distance between two of 2048 positions = {fmt(dmin)}",
        "pe = sinusoidal(2048, 64, dtype=torch.float64); torch.cdist(pe, pe)",
        big <= 1.0 and dmin > 1e-3,
        "the encodings leave [−1, 1] or two positions coincide",
    )


@check("002-8.2.2-c")
def _pe_shift() -> Finding:
    from ...positional import sinusoidal, sinusoidal_shift

    pe = sinusoidal(240, 16, dtype=F64)
    err = orth = 0.0
    for k in (1, 5, 37):
        m = sinusoidal_shift(k, 16)
        err = max(err, float((pe[:200] @ m.T - pe[k : k + 200]).abs().max()))
        orth = max(orth, float((m @ m.T - torch.eye(16, dtype=F64)).abs().max()))
    return _found(
        f"max |PE_pos·M_kᵀ − PE_pos+k| = {_err(err)}; max |M_k M_kᵀ − I| = {_err(orth)}",
        "sinusoidal_shift(k, 16); sinusoidal(240, 16, dtype=torch.float64)",
        err < 1e-12 and orth < 1e-12,
        "no position-independent rotation maps PE_pos to PE_pos+k",
    )


@check("002-8.2.2-d")
def _pe_frequencies() -> Finding:
    from ...positional import sinusoidal

    pe = sinusoidal(2, 64, dtype=F64)
    omega = torch.atan2(pe[1, 0::2], pe[1, 1::2])  # angle 1·ω_i (all < π)
    ratio = omega[1:] / omega[:-1]
    wl = 2 * math.pi / omega
    ok = float((ratio - ratio[0]).abs().max()) < 1e-12 and abs(float(wl[0]) - 2 * math.pi) < 1e-9
    return _found(
        f"ω_(i+1)/ω_i = {fmt(float(ratio[0]), 6)} for every i (10000^(−2/64) = "
        f"{fmt(10000 ** (-2 / 64), 6)}); wavelengths {fmt(float(wl[0]))} … {fmt(float(wl[-1]))}",
        "pe = sinusoidal(2, 64); torch.atan2(pe[1, 0::2], pe[1, 1::2])",
        ok,
        "the frequencies are not geometrically spaced",
    )


_PE_TABLE = [
    [0.00, 1.00, 0.00, 1.00, 0.00, 1.00, 0.00, 1.00],
    [0.84, 0.54, 0.10, 0.99, 0.01, 1.00, 0.00, 1.00],
    [0.91, -0.42, 0.20, 0.98, 0.02, 1.00, 0.00, 1.00],
    [0.14, -0.99, 0.30, 0.96, 0.03, 1.00, 0.00, 1.00],
]


def _pe_table(d_model: int) -> tuple[Tensor, Derivation]:
    """attnlab's first 4 positions × 8 dims of the sinusoidal table, and the closed form's."""
    from ...positional import sinusoidal

    pe = sinusoidal(4, d_model, dtype=F64)
    ok = ind.close(pe.numpy(), ind.sinusoid(4, d_model), 1e-12)
    return pe[:, :8], Derivation(
        ok, f"sin/cos(p/10000^(2i/{d_model})) by math.sin and math.cos equals attnlab's table"
    )


def _pe_mismatches(d_model: int) -> list[str]:
    pe = _pe_table(d_model)[0]
    bad = []
    for p in range(4):
        for d in range(8):
            shown = f"{float(pe[p, d]):.2f}".replace("-0.00", "0.00")
            if shown != f"{_PE_TABLE[p][d]:.2f}":
                bad.append(
                    f"pos {p} dim {d} = {float(pe[p, d]):.6f} → {shown}, text {_PE_TABLE[p][d]:.2f}"
                )
    return bad


@check("002-8.2.2-e")
def _pe_table_rounding() -> Finding:
    bad = _pe_mismatches(8)
    return _found(
        f"{32 - len(bad)} of 32 entries match; mismatches: {'; '.join(bad) or 'none'}",
        "sinusoidal(4, 8, dtype=torch.float64), each entry formatted with '.2f'",
        not bad,
        "the table's rounding is off at " + "; ".join(bad),
        _pe_table(8)[1],
    )


@check("002-8.2.2-f")
def _pe_table_width() -> Finding:
    bad512 = _pe_mismatches(512)
    bad8 = _pe_mismatches(8)
    pe512, witness = _pe_table(512)
    row = ", ".join(f"{float(x):.2f}" for x in pe512[1])
    return _found(
        f"first 8 dims of d_model=512: {32 - len(bad512)} of 32 entries match the table; "
        f"d_model=8: {32 - len(bad8)} of 32",
        "sinusoidal(4, 512)[:, :8] and sinusoid(4, 8), formatted with '.2f'",
        len(bad512) <= 1,
        f"the values are the encoding of d_model = 8 ({32 - len(bad8)} of 32 entries match); "
        f"the first 8 dims of a wider model differ (d_model=512, pos 1: {row})",
        Derivation(
            witness.agrees and _pe_table(8)[1].agrees,
            "sin/cos(p/10000^(2i/d)) by math.sin and math.cos equals attnlab's table at "
            "d_model = 8 and 512",
        ),
    )


@check("002-8.2.3-a")
def _learned() -> Finding:
    from ...positional import LearnedPositionalEmbedding

    emb = LearnedPositionalEmbedding(512, 64)
    n = sum(p.numel() for p in emb.parameters())
    try:
        emb(torch.tensor([512]))
        refused = "no error"
    except ValueError as e:
        refused = f"ValueError: {e}"
    ok = n == 512 * 64 and refused.startswith("ValueError")
    return _found(
        f"{n:,} parameters (= 512·64); position 512 → {refused}",
        "LearnedPositionalEmbedding(512, 64); emb(torch.tensor([512]))",
        ok,
        "the learned table's size or its length limit differ",
    )


@check("002-8.2.3-b")
def _sinusoidal_extrapolates() -> Finding:
    from ...positional import sinusoidal, sinusoidal_shift

    pe = sinusoidal(4096 + 7, 32, dtype=F64)
    m = sinusoidal_shift(7, 32)
    err = float((pe[512:4096] @ m.T - pe[519 : 4096 + 7]).abs().max())
    return _found(
        f"positions 512…4095 (beyond 512) encoded; max |PE_p·M_7ᵀ − PE_(p+7)| there = "
        f"{_err(err, 1e-10)}",
        "sinusoidal(4103, 32); sinusoidal_shift(7, 32)",
        err < 1e-10,
        "the encoding does not keep its shift structure beyond the training length",
    )


@check("002-8.2.4-a")
def _shaw_key_term() -> Finding:
    from ...functional.reference import shaw_attention as shaw_reference
    from ...positional import shaw_attention

    q, k, v = _qkv(H=1, D=4)
    n = 8
    r = _randn(2 * n - 1, 4, seed=9)  # r_{i−j}, offsets −(n−1) … n−1
    off = torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1
    e = q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, r[off])  # the text's e_ij
    rel_v = torch.zeros(2 * n - 1, 4, dtype=F64)
    out = shaw_attention(q, k, v, r.flip(0), rel_v, scale=1.0)
    ref, _ = shaw_reference(q, k, v, r.flip(0), rel_v, scale=1.0)
    err = float((out - torch.softmax(e, -1) @ v).abs().max())
    err_ref = float((ref - torch.softmax(e, -1) @ v).abs().max())
    return _found(
        "max |shaw_attention(q, k, v, a^K = r flipped, a^V = 0, scale=1) − "
        f"softmax(q_i·k_j + q_i·r_(i−j))V| = {_err(err)} (reference: {_err(err_ref)})",
        "shaw_attention(q, k, v, r.flip(0), zeros, scale=1.0)",
        err < 1e-12 and err_ref < 1e-12,
        "the relative-key score is not reproduced",
    )


@check("002-8.2.4-b")
def _t5() -> Finding:
    from ... import attention
    from ...positional import T5RelativeBias

    torch.manual_seed(0)
    t5 = T5RelativeBias(2).double()
    m = t5.matrix(12).detach()
    toeplitz = float((m[:, 1:, 1:] - m[:, :-1, :-1]).abs().max())
    q, k, v = _qkv(L=12)
    out = attention(q, k, v, bias=t5).detach()
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + m, -1) @ v
    err = float((out - ref).abs().max())
    return _found(
        f"b[i+1, j+1] − b[i, j] max {_err(toeplitz)} (depends on i − j only); max |attention(…, "
        f"bias=t5) − softmax(QKᵀ/√d + b)V| = {_err(err)}",
        "t5 = T5RelativeBias(2); t5.matrix(12); attention(q, k, v, bias=t5)",
        toeplitz < 1e-15 and err < 1e-12,
        "the T5 bias is not a function of i − j",
    )


@check("002-8.2.4-c")
def _relative_advantages() -> Finding:
    from ...positional import ALiBi, T5RelativeBias

    alibi = ALiBi(4)
    a = alibi.matrix(32).to(F64)
    row = a[:, -1, :]  # last query: keys at distance 31 … 0
    decreasing = bool((row[:, 1:] > row[:, :-1]).all())
    shift = float((a[:, 1:, 1:] - a[:, :-1, :-1]).abs().max())
    torch.manual_seed(0)
    t5 = T5RelativeBias(2).double()
    small, large = t5.matrix(16).detach(), t5.matrix(1024).detach()
    same = float((large[:, :16, :16] - small).abs().max())
    ok = decreasing and shift == 0 and same == 0
    return _found(
        f"ALiBi: bias strictly increasing toward the query ({decreasing}), shift-invariant "
        f"(max diagonal change {_err(shift)}); T5: one {tuple(t5.weight.shape)} table serves "
        f"n=16 and n=1024 (max difference on the shared block {_err(same)})",
        "ALiBi(4).matrix(32); T5RelativeBias(2).matrix(16), .matrix(1024)",
        ok,
        "the relative biases lack one of the three properties",
    )


@check("002-8.2.4-d")
def _rope_relative() -> Finding:
    from ...positional import RoPE

    rope = RoPE(16)
    q, k = _randn(1, 1, 1, 16, seed=1), _randn(1, 1, 1, 16, seed=2)

    def score(i: int, j: int) -> float:
        return float((rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum())

    ref = float((q * rope(k, torch.tensor([7]))).sum())  # qᵀ R_7 k (R_0 = I)
    got = [score(3, 10), score(50, 57), score(1000, 1007)]
    err = max(abs(g - ref) for g in got)
    return _found(
        f"scores at (3,10), (50,57), (1000,1007): {', '.join(fmt(g, 10) for g in got)}; "
        f"qᵀR_7k = {fmt(ref, 10)}",
        "rope = RoPE(16); (rope(q, [i]) * rope(k, [j])).sum()",
        err < 1e-9,
        "the RoPE score depends on the absolute positions",
    )


# ------------------------------------------------------------------------------------ 8.3
def _heads_by_hand(mha, x: Tensor) -> list[Tensor]:
    """head_i = softmax(x W_i^Q (x W_i^K)ᵀ/√d_k) x W_i^V, one head at a time (no biases)."""
    wq, wk, wv, _ = _mha_parts(mha)
    D, out = mha.head_dim, []
    for i in range(mha.num_heads):
        sl = slice(i * D, (i + 1) * D)
        out.append(_softmax_ref(x @ wq[sl].T, x @ wk[sl].T, x @ wv[sl].T))
    return out


@check("002-8.3.1-a")
def _multihead_formula() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(1, 6, 16, seed=1)
    y = torch.cat(_heads_by_hand(mha, x), -1) @ _mha_parts(mha)[3].T
    err = float((mha(x) - y).abs().max())
    return _found(
        f"max |MultiHeadAttention(x) − Concat(head_1..head_4)W^O| = {_err(err)}",
        "MultiHeadAttention(16, 4, bias=False)(x) vs torch.cat(heads, -1) @ W_o.T",
        err < 1e-12,
        "the module is not Concat(heads)·W^O",
    )


@check("002-8.3.1-b")
def _heads_same_compute() -> Finding:
    from ...analysis import estimate

    mm = {}
    for h in (1, 2, 4, 8, 12):
        e = estimate(512, 768, h)
        mm[h] = (
            e.value("QKV + output projections", "naive")
            + e.value("scores QKᵀ", "naive")
            + e.value("weighted sum PV", "naive"),
            e.value("softmax", "naive"),
            e.value("total", "naive"),
        )
    same = len({v[0] for v in mm.values()}) == 1
    sm = mm[12][1] / mm[12][2]
    return _found(
        f"matmul FLOPs {fmt(mm[1][0])} for every h; softmax adds 5·h·n² "
        f"({fmt(100 * sm, 3)} % of the total at h=12)",
        "estimate(512, 768, h).value('scores QKᵀ' / 'weighted sum PV' / …, 'naive')",
        same and sm < 0.02,
        "the matmul FLOPs depend on the number of heads",
    )


@check("002-8.3.2-a")
def _bilinear() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(1, 5, 16, seed=1)
    q, k, _ = mha.project(x)
    wq, wk, _, _ = _mha_parts(mha)
    err = 0.0
    for i in range(4):
        sl = slice(4 * i, 4 * i + 4)
        m = wq[sl].T @ wk[sl]  # (E, E) = W_i^Q (W_i^K)ᵀ in the text's (d_model × d_k) layout
        err = max(err, float((q[0, i] @ k[0, i].T - x[0] @ m @ x[0].T).abs().max()))
    return _found(
        f"max |q_i·k_j (from MultiHeadAttention.project) − x_iᵀ M y_j| over 4 heads = {_err(err)}",
        "q, k, _ = mha.project(x); M_h = W_q[h].T @ W_k[h]",
        err < 1e-12,
        "the per-head score is not a bilinear form of the inputs",
    )


@check("002-8.3.2-b")
def _metric_shape() -> Finding:
    mha = _mha(16, 4, bias=False)
    wq, wk, _, _ = _mha_parts(mha)
    WQ, WK = wq[:4].T, wk[:4].T  # the text's layout: (d_model, d_k)
    text_m, right_m = WQ.T @ WK, WQ @ WK.T
    rank = int(torch.linalg.matrix_rank(right_m))
    x = _randn(1, 5, 16, seed=3)
    q, k, _ = mha.project(x)  # (1, H, 5, 4): attnlab's head-0 queries and keys
    xn = x[0].numpy()
    bilinear = xn @ (WQ.numpy() @ WK.numpy().T) @ xn.T  # xᵀ W^Q (W^K)ᵀ y for every pair
    return _found(
        f"(W^Q)ᵀW^K has shape {tuple(text_m.shape)}; W^Q(W^K)ᵀ has shape "
        f"{tuple(right_m.shape)} and rank {rank}",
        "W_q[:4].T and W_k[:4].T of MultiHeadAttention(16, 4); shapes of both products",
        tuple(text_m.shape) == (16, 16),
        "the two sides mix conventions: with W_i^Q ∈ R^{d_model×d_k} (8.3.1), (xW^Q)ᵀ(yW^K) = "
        "xᵀW^Q(W^K)ᵀy, so M_i = W_i^Q(W_i^K)ᵀ (d_model×d_model, rank ≤ d_k); (W^Q)ᵀW^K is "
        "d_k×d_k (right only in 8.1.2's W ∈ R^{d_k×d} layout)",
        Derivation(
            ind.close((q[0, 0] @ k[0, 0].mT).numpy(), bilinear, 1e-10),
            "xᵀ(W^Q(W^K)ᵀ)y in numpy equals attnlab's head-0 q·k for every pair of 5 tokens",
        ),
    )


@check("002-8.3.2-c")
def _heads_redundant() -> Finding:
    from ...analysis.heads import pruning_sweep

    sweep = pruning_sweep(tuple(i / 20 for i in range(21)), threshold=0.95)
    kept = sweep.kept_fraction("importance")  # largest fraction pruned with cosine ≥ 0.95
    rand = sweep.kept_fraction("random")
    matter = 1.0 - kept
    ok = 0.3 <= matter <= 0.5
    return Finding(
        f"cosine ≥ 0.95 holds up to {kept:.0%} of the heads pruned in importance order "
        f"({rand:.0%} in random order): {matter:.0%} of the heads matter at that bar",
        "pruning_sweep(fractions=0, 0.05, …, 1, threshold=0.95).kept_fraction('importance')",
        **judged(
            ok,
            f"in the distilled 6-layer MiniLM about {matter:.0%} of the heads matter at "
            "cosine 0.95 — the 30–50 % rule comes from larger models (Michel et al.) and depends "
            "on the model and the metric's bar",
        ),
    )


_SENTENCES = (
    "The quick brown fox jumps over the lazy dog because it was hungry.",
    "Attention lets every position look at every other position in one step.",
    "She put the book she had borrowed from the library back on the shelf.",
)


@functools.lru_cache(maxsize=1)
def _minilm_head_profile() -> dict[str, Tensor]:
    """Per (layer, head) of all-MiniLM-L6-v2, averaged over `_SENTENCES`: the mean weight on the
    previous token, on the next token, on [CLS], and the entropy relative to ln T."""
    from ...analysis import entropy
    from ...models.minilm import minilm

    model = minilm()
    parts: dict[str, list[Tensor]] = {"prev": [], "next": [], "cls": [], "entropy": []}
    for text in _SENTENCES:
        _, w = model.attentions(text)  # (layers, heads, T, T)
        w = w.to(F64)
        i = torch.arange(w.shape[-1])
        parts["prev"].append(w[..., i[1:], i[:-1]].mean(-1))
        parts["next"].append(w[..., i[:-1], i[1:]].mean(-1))
        parts["cls"].append(w[..., 0].mean(-1))
        parts["entropy"].append(entropy(w).mean(-1) / math.log(w.shape[-1]))
    return {k: torch.stack(v).mean(0) for k, v in parts.items()}


@check("002-8.3.4-b")
def _specialisation() -> Finding:
    prof = _minilm_head_profile()
    named = {
        "previous-token": prof["prev"] > 0.5,
        "next-token": prof["next"] > 0.5,
        "[CLS]-sink": prof["cls"] > 0.5,
        "broad (global)": prof["entropy"] > 0.8,
    }
    found = {k: [f"L{int(a)}H{int(b)}" for a, b in v.nonzero()] for k, v in named.items()}
    best_prev = float(prof["prev"].max())
    ok = bool(found["previous-token"] or found["next-token"]) and bool(found["broad (global)"])
    return _found(
        "; ".join(
            f"{k} heads: {len(v)} ({', '.join(v[:4])}{', …' if len(v) > 4 else ''})"
            for k, v in found.items()
        )
        + f"; largest previous-token weight {fmt(best_prev)}",
        "minilm().attentions(text) → per-head mean weight on i−1, i+1, [CLS]; entropy / ln T",
        ok,
        "MiniLM shows no positional or no broad heads",
    )


@check("002-8.3.3-a")
def _param_count() -> Finding:
    from ...analysis import estimate

    E = 768
    est = {h: estimate(128, E, h, bias=False).value("projection weights", "naive") for h in (1, 12)}
    counted = {h: sum(p.numel() for p in _mha(E, h, bias=False).parameters()) for h in (1, 12)}
    qkv = _mha(E, 12, bias=False).qkv_proj.weight.numel()
    # the text: one head takes 3d² (Q, K, V only), several heads 4d² (the extra W^O)
    split = est[1] == 3 * E * E and est[12] == 4 * E * E
    return _found(
        f"QKV weights {qkv:,} = 3·768²; the layer's projection weights: {int(est[1]):,} with one "
        f"head, {int(est[12]):,} with 12 (= 4·768² both)",
        "estimate(128, 768, h, bias=False).value('projection weights', 'naive'), h = 1, 12; "
        "MultiHeadAttention(768, h, bias=False).parameters()",
        split,
        "the output projection W^O belongs to the attention layer whatever the number of heads: "
        "one head with W^O has 4d² as well, and multi-head attention without it 3d²; the "
        "heads split d_model and add no weights",
        Derivation(
            counted == est and qkv == 3 * E * E,
            "the weight count of MultiHeadAttention(768, h) summed over its parameters equals "
            f"estimate's at h = 1 and 12 ({counted[1]:,} and {counted[12]:,})",
        ),
    )


@check("002-8.3.3-b")
def _score_cost() -> Finding:
    from ...analysis import estimate

    vals = {
        (n, h): estimate(n, 768, h).value("scores QKᵀ", "naive")
        for n in (512, 1024)
        for h in (1, 12)
    }
    ok = all(v == 2 * n * n * 768 for (n, _), v in vals.items())
    return _found(
        "QKᵀ FLOPs: "
        + ", ".join(f"n={n} h={h}: {fmt(v)}" for (n, h), v in vals.items())
        + " (= 2·n²·d_model)",
        "estimate(n, 768, h).value('scores QKᵀ', 'naive')",
        ok,
        "the score cost is not 2·n²·d_model independent of h",
    )


@check("002-8.3.3-c")
def _fused_vs_loop() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(2, 6, 16, seed=1)
    serial = torch.cat(_heads_by_hand(mha, x), -1) @ _mha_parts(mha)[3].T  # for i in range(h)
    fused = mha(x)  # one (E × 3E) matmul, view (B, L, H, D), transpose, one attention call
    err = float((fused - serial).abs().max())
    return _found(
        f"max |fused − serial loop| = {_err(err)}",
        "MultiHeadAttention(16, 4, bias=False)(x) vs a per-head loop over weight slices",
        err < 1e-12,
        "the fused and serial forms differ",
    )


@check("002-8.3.3-d")
def _head_dim() -> Finding:
    from ...modules import MultiHeadAttention

    dims = {h: MultiHeadAttention(768, h).head_dim for h in (4, 12, 32, 96)}
    return _found(
        "d_k = " + ", ".join(f"{d} at h={h}" for h, d in dims.items()),
        "MultiHeadAttention(768, h).head_dim",
        all(d == 768 // h for h, d in dims.items()),
        "head_dim is not d_model/h",
    )


@check("002-8.3.3-e")
def _heads_survey() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a historical fact: the configurations of published models (e.g. GPT-3 175B uses 96 "
        "heads, outside 16–32)",
    )


@check("002-8.3.4-a")
def _diversity() -> Finding:
    from ... import attention
    from ...analysis import head_diversity

    q, k, v = _qkv(H=4)
    _, w = attention(q, k, v, return_weights=True)
    a = w[0].flatten(1)
    cos = torch.nn.functional.cosine_similarity(a[:, None], a[None, :], dim=-1)
    h = 4
    ref = 1 - (cos.sum() - cos.diagonal().sum()) / (h * (h - 1))
    got = float(head_diversity(w)[0])
    err = abs(got - float(ref))
    return _found(
        f"head_diversity = {fmt(got, 8)}; formula = {fmt(float(ref), 8)}",
        "head_diversity(attention(q, k, v, return_weights=True)[1])",
        err < 1e-12,
        "head_diversity differs from the formula",
    )


@check("002-8.3.4-c")
def _importance() -> Finding:
    from ...analysis import output_norm

    mha = _mha(16, 4)
    wo = _mha_parts(mha)[3]
    ref = torch.stack([wo[:, 4 * i : 4 * i + 4].norm() for i in range(4)])
    got = output_norm(mha)[0].to(F64)
    err = float((got - ref).abs().max())
    return _found(
        "output_norm = [" + ", ".join(fmt(float(x)) for x in got) + f"]; max |Δ| vs formula "
        f"{_err(err)}",
        "output_norm(mha)",
        err < 1e-12,
        "output_norm is not the slice norm",
    )


@check("002-8.3.4-d")
def _no_interactions() -> Finding:
    mha = _mha(16, 4)
    x = _randn(1, 6, 16, seed=1)
    q, k, v = mha.project(x)
    heads = _softmax_ref(q, k, v)  # (1, H, L, D)
    wo, bo = mha.out_proj.weight.detach(), mha.out_proj.bias.detach()
    parts = sum(heads[0, i] @ wo[:, 4 * i : 4 * i + 4].T for i in range(4)) + bo
    resid = float((mha(x)[0] - parts).abs().max())
    return _found(
        f"max |MultiHeadAttention(x) − (Σ_i head_i W_i^O + b)| = {_err(resid)}",
        "mha(x) vs sum(head_i @ W_o[:, i·d_v:(i+1)·d_v].T) + b_o",
        resid > 1e-9,
        "W^O is linear: y = Σ_i head_i W_i^O + b exactly (residual 0), so there is no "
        "interaction term and no confidence-dependent weighting of heads",
        _mha_by_hand(mha, x),
    )


# ------------------------------------------------------------------------------------ 8.4
def _est(n: int, E: int = 768, H: int = 12, **kw):
    from ...analysis import estimate

    return estimate(n, E, H, **kw)


@check("002-8.4.1-a")
def _proj_cost() -> Finding:
    p = {
        (n, E): _est(n, E).value("QKV + output projections", "naive")
        for n, E in ((512, 768), (1024, 768), (512, 1536))
    }
    rn, rd = p[1024, 768] / p[512, 768], p[512, 1536] / p[512, 768]
    ok = rn == 2 and rd == 4 and p[512, 768] == 8 * 512 * 768**2
    return _found(
        f"{fmt(p[512, 768])} FLOPs at n=512, d=768 (= 8·n·d²); ×{fmt(rn)} for 2n, ×{fmt(rd)} "
        "for 2d",
        "estimate(n, d, 12).value('QKV + output projections', 'naive')",
        ok,
        "the projection cost is not linear in n and quadratic in d",
    )


@check("002-8.4.1-b")
def _score_pv_cost() -> Finding:
    s = {
        n: (
            _est(n, 64, 1).value("scores QKᵀ", "naive"),
            _est(n, 64, 1).value("weighted sum PV", "naive"),
        )
        for n in (512, 1024)
    }
    ok = all(a == b == 2 * n * n * 64 for n, (a, b) in s.items())
    return _found(
        "; ".join(f"n={n}: QKᵀ {fmt(a)}, PV {fmt(b)} FLOPs (2·n²·d)" for n, (a, b) in s.items()),
        "estimate(n, 64, 1).value('scores QKᵀ' / 'weighted sum PV', 'naive')",
        ok,
        "the score or weighted-sum cost is not 2·n²·d",
    )


@check("002-8.4.1-c")
def _total_cost() -> Finding:
    vals = {n: _est(n).value("total", "naive") for n in (256, 1024, 4096)}
    ok = all(v == 8 * n * 768**2 + 4 * n * n * 768 + 5 * 12 * n * n for n, v in vals.items())
    return _found(
        "; ".join(f"n={n}: {fmt(v)} FLOPs" for n, v in vals.items()) + " = 8nd² + 4n²d + 5hn²",
        "estimate(n, 768, 12).value('total', 'naive')",
        ok,
        "the total is not 8nd² + 4n²d + 5hn²",
    )


def _rnn_flops(n: int, d: int) -> int:
    """FLOPs of an Elman RNN (torch.nn.RNN, d → d): two d×d mat-vecs per step."""
    rnn = torch.nn.RNN(d, d, bias=False)
    return 2 * n * sum(p.numel() for p in rnn.parameters())


@check("002-8.4.1-d")
def _rnn_crossover() -> Finding:
    def core(n: int) -> float:
        e = _est(n)
        return sum(e.value(r, "naive") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))

    ratio = {n: core(n) / _rnn_flops(n, 768) for n in (256, 512, 768, 1024, 2048)}
    ok = ratio[256] < 1 < ratio[1024] and 0.5 < ratio[512] < 2
    return _found(
        "attention core / RNN FLOPs: " + ", ".join(f"n={n}: {fmt(r, 3)}" for n, r in ratio.items()),
        "estimate(n, 768, 12) scores+softmax+PV vs 2·n·numel(torch.nn.RNN(768, 768))",
        ok,
        "the crossover is not near n = d_model",
    )


@check("002-8.4.2-a")
def _forward_memory() -> Finding:
    sm = {
        (n, h): _est(n, 768, h).value("score matrix", "naive") for n in (512, 1024) for h in (6, 12)
    }
    ok = all(v == 4 * h * n * n for (n, h), v in sm.items())
    return _found(
        "score matrix bytes: "
        + ", ".join(f"n={n} h={h}: {int(v):,}" for (n, h), v in sm.items())
        + " (= 4·h·n²)",
        "estimate(n, 768, h).value('score matrix', 'naive')",
        ok,
        "the score matrix memory is not h·n² elements",
    )


@check("002-8.4.2-b")
def _backward_memory() -> Finding:
    one = _est(2048).value("activations kept for backward", "naive")
    twelve = _est(2048, layers=12).value("activations kept for backward", "naive")
    p = 12 * 2048**2 * 4
    ok = twelve == 12 * one and p / one > 0.85
    return _found(
        f"kept activations {fmt(one / 2**20)} MiB for 1 layer, {fmt(twelve / 2**20)} MiB for 12 "
        f"(×{fmt(twelve / one)}); the n²·h probabilities are {fmt(100 * p / one, 3)} % of it",
        "estimate(2048, 768, 12, layers=L).value('activations kept for backward', 'naive')",
        ok,
        "the kept activations do not scale as L·n²·h",
    )


@check("002-8.4.2-c")
def _memory_techniques() -> Finding:
    f32 = _est(4096).value("score matrix", "naive")
    f16 = _est(4096, dtype="float16").value("score matrix", "naive")
    tiled = {n: _est(n).value("score matrix", "flash") for n in (1024, 4096, 16384)}
    ok = f16 * 2 == f32 and len(set(tiled.values())) == 1 and tiled[4096] < f32 / 100
    return _found(
        f"n=4096 scores: float32 {fmt(f32 / 2**20)} MiB, float16 {fmt(f16 / 2**20)} MiB; "
        f"tiled {fmt(tiled[4096] / 2**20)} MiB at n = 1024, 4096 and 16384 alike",
        "estimate(n, 768, 12, dtype=…).value('score matrix', 'naive' / 'flash')",
        ok,
        "fp16 or tiling do not reduce the memory as stated",
    )


@check("002-8.4.2-d")
@check("002-8.7-e")
def _memory_doubling() -> Finding:
    kept = {
        i: _est(2048, 768, 12).value("activations kept for backward", i)
        / _est(1024, 768, 12).value("activations kept for backward", i)
        for i in ("naive", "flash")
    }
    scores = _est(2048).value("score matrix", "naive") / _est(1024).value("score matrix", "naive")
    ok = abs(kept["naive"] - 4) < 0.2 and abs(kept["flash"] - 4) < 0.2
    closed = all(
        _est(n, 768, 12).value("activations kept for backward", i)
        == ind.attention_kept_bytes(n, 768, 12, 4, tiled=i == "flash")
        for n in (1024, 2048)
        for i in ("naive", "flash")
    )
    return _found(
        f"n 1024 → 2048 (d_model=768, h=12): score matrix ×{fmt(scores)}; activations kept "
        f"for backward ×{fmt(kept['naive'], 3)} (naive), ×{fmt(kept['flash'], 3)} (tiled)",
        "estimate(n, 768, 12).value('activations kept for backward', impl), n = 1024, 2048",
        ok,
        f"only the n×n score matrix grows 4×; a naive layer's kept activations grow "
        f"{kept['naive']:.2f}× (the O(n·d) Q/K/V/output part doubles) and a tiled one's "
        f"{kept['flash']:.2f}×",
        Derivation(
            closed,
            "closed form 4·n·d_model·bytes (Q, K, V, output) + h·n²·bytes (P) or h·n·4 (the "
            "log-sum-exp) equals estimate's bytes at n = 1024 and 2048",
        ),
    )


@check("002-8.4.3-a")
def _parallel_vs_sequential() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 10, 16, seed=1)
    full = mha(x, mask=masks.causal())
    cache = KVCache()
    steps = torch.cat(
        [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(10)], 1
    )
    err = float((full - steps).abs().max())
    return _found(
        f"1 parallel call vs 10 sequential cached steps: max |Δ| = {_err(err)}",
        "mha(x, mask=masks.causal()) vs mha(x[:, t:t+1], mask=masks.causal(), cache=KVCache())",
        err < 1e-12,
        "the parallel and sequential results differ",
    )


@check("002-8.4.3-b")
def _utilisation() -> Finding:
    return Finding(
        "nothing computed",
        "measure_estimate(estimate(...)) on the target accelerator",
        NOT_CHECKABLE,
        "a GPU/TPU with a known peak FLOPS (this CPU run is shared and unrepresentative)",
    )


@check("002-8.4.4-a")
def _long_table() -> Finding:
    table = {
        512: (262_144, 0.5),
        2048: (4 * 2**20, 8),
        8192: (64 * 2**20, 128),
        32768: (1024 * 2**20, 2048),
        131072: (16384 * 2**20, 32768),
    }
    got, ok = [], True
    for n, (entries, mib) in table.items():
        e = _est(n, 64, 1, dtype="float16")
        b = e.value("score matrix", "naive")
        pairs = e.value("attended pairs per head", "naive")
        ok &= pairs == entries and b == mib * 2**20
        got.append(f"n={n}: {int(pairs):,} entries, {fmt(b / 2**20)} MiB")
    return _found(
        "; ".join(got),
        "estimate(n, 64, 1, dtype='float16').value('score matrix', 'naive')",
        ok,
        "the sizes differ from the table",
    )


@check("002-8.4.4-b")
def _sparse_cost() -> Finding:
    from ... import masks

    r = {}
    for n in (256, 1024, 2304):
        m = masks.strided(math.isqrt(n))
        r[n] = _est(n, 64, 1, mask=m).value("attended pairs per head", "flash") / n**1.5
    ok = max(r.values()) / min(r.values()) < 1.1
    return _found(
        "attended pairs / n^1.5: " + ", ".join(f"n={n}: {fmt(v)}" for n, v in r.items()),
        "estimate(n, 64, 1, mask=masks.strided(isqrt(n))).value('attended pairs per head', "
        "'flash')",
        ok,
        "the strided pattern's cost does not grow as n√n",
    )


@check("002-8.4.4-c")
def _sparse_patterns() -> Finding:
    from ... import masks

    w = masks.sliding_window(8).to_dense(64, 64)[0, 0]
    s = masks.strided(8).to_dense(64, 64)[0, 0]
    row = w.sum(-1)
    far = s[63, : 63 - 7].nonzero().flatten().tolist()  # keys beyond the local block
    b0 = masks.bigbird(8, 1, 1, 1, seed=0).to_dense(64, 64)[0, 0]
    b1 = masks.bigbird(8, 1, 1, 1, seed=1).to_dense(64, 64)[0, 0]
    ok = int(row[8:].min()) == int(row[8:].max()) == 8 and all((63 - j) % 8 == 0 for j in far)
    ok = ok and bool((b0 != b1).any())
    return _found(
        f"window: every row past 8 attends {int(row[8:].max())} keys; strided: query 63's "
        f"far keys {far} (63 − j ≡ 0 mod 8); bigbird's random blocks change with the seed: "
        f"{bool((b0 != b1).any())}",
        "masks.sliding_window(8), masks.strided(8), masks.bigbird(8, 1, 1, 1, seed)",
        ok,
        "a pattern does not select the keys described",
    )


@check("002-8.4.4-d")
def _linear_formula() -> Finding:
    from ...linear import linear_attention

    q, k, v = _qkv(H=1, L=256, D=16)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    text = phi(q) @ (phi(k).transpose(-1, -2) @ v)
    lin = linear_attention(q, k, v)
    norm = phi(q) @ phi(k).sum(-2, keepdim=True).transpose(-1, -2)  # φ(q_i)ᵀ Σ_j φ(k_j)
    err_norm = float((text / norm - lin).abs().max())
    rel = float((text - lin).norm() / lin.norm())
    witness = ind.close(lin.numpy(), ind.linear_attention(q.numpy(), k.numpy(), v.numpy()), 1e-9)
    return _found(
        f"‖φ(Q)(φ(K)ᵀV) − linear_attention‖/‖linear_attention‖ = {fmt(rel)}; divided by "
        f"φ(Q)(φ(K)ᵀ1) it matches to {_err(err_norm, 1e-9)}",
        "linear_attention(q, k, v) vs phi(q) @ (phi(k).mT @ v)",
        rel < 1e-6,
        "the normaliser is missing: φ(Q)(φ(K)ᵀV) must be divided row-wise by φ(Q)(φ(K)ᵀ1), "
        "else rows are sums, not weighted averages (here ~n·mean times too large)",
        Derivation(
            witness,
            "φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1)) with φ = elu + 1 in numpy equals linear_attention "
            "to 1e-9",
        ),
    )


@check("002-8.4.4-e")
def _linear_cost() -> Finding:
    def core(n: int, d: int) -> float:
        e = _est(n, d, 1)
        return sum(e.value(r, "linear") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))

    rn, rd = core(2048, 64) / core(1024, 64), core(1024, 128) / core(1024, 64)
    return _found(
        f"×{fmt(rn)} for 2n, ×{fmt(rd)} for 2d (4 for a pure d² term; the O(n·d) normaliser "
        "and feature map make it a little less)",
        "estimate(n, d, 1) rows 'scores QKᵀ' + 'softmax' + 'weighted sum PV', 'linear'",
        rn == 2 and 3.8 < rd <= 4,
        "the linear form's cost is not linear in n and quadratic in d",
    )


@check("002-8.4.4-f")
def _hierarchical() -> Finding:
    from ...functional import reference
    from ...linear import hierarchical_attention

    q, k, v = _qkv(H=1, L=64)
    out = hierarchical_attention(q, k, v, block_size=8)
    ref = reference.hierarchical_attention(q, k, v, block_size=8)
    err = float((out - ref).abs().max())
    dense = float((out - _softmax_ref(q, k, v)).abs().max())
    return _found(
        f"output {tuple(out.shape)}; max |fast − reference| = {_err(err)}; differs from dense "
        f"attention by up to {fmt(dense)} (an approximation)",
        "hierarchical_attention(q, k, v, block_size=8)",
        err < 1e-12 and out.shape == q.shape,
        "the hierarchical scheme does not produce n outputs from n/k summaries",
    )


@check("002-8.4.4-g")
def _flash_memory() -> Finding:
    from ... import attention

    q, k, v = _qkv(L=300, D=16)
    err = float((attention(q, k, v, backend="flash") - _softmax_ref(q, k, v)).abs().max())
    kept = {n: _est(n).value("activations kept for backward", "flash") for n in (2048, 4096)}
    tile = {n: _est(n).value("score matrix", "flash") for n in (2048, 4096)}
    ok = err < 1e-12 and kept[4096] == 2 * kept[2048] and tile[2048] == tile[4096]
    return _found(
        f"max |flash − softmax(QKᵀ/√d)V| = {_err(err)}; kept activations ×"
        f"{fmt(kept[4096] / kept[2048])} for 2n; score tile {fmt(tile[2048] / 2**20)} MiB at "
        "any n",
        "attention(q, k, v, backend='flash'); estimate(n, 768, 12) 'flash' rows",
        ok,
        "the tiled form is not exact or not O(n) in memory",
    )


@check("002-8.4.4-h")
def _flash_speed() -> Finding:
    naive = _est(65536, 64, 1, dtype="float16").value("score matrix", "naive")
    tiled = _est(65536, 64, 1, dtype="float16").value("activations kept for backward", "flash")
    return Finding(
        f"memory side at n=65536, one head, fp16: naive scores {fmt(naive / 2**30)} GiB; tiled "
        f"keeps {fmt(tiled / 2**20)} MiB",
        "estimate(65536, 64, 1, dtype='float16')",
        NOT_CHECKABLE,
        "a GPU with HBM/SRAM (the 2–4× is a GPU kernel measurement)",
    )


# ------------------------------------------------------------------------------ 8.5 – 8.7
@check("002-8.5-a")
def _history() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a historical fact (authors, year, page count of the paper)",
    )


@check("002-8.6-a")
def _flash_blocks() -> Finding:
    from ... import attention, attention_weights

    q, k, v = _qkv(L=200, D=16)
    _, lse = attention(q, k, v, backend="flash", return_lse=True)
    w = attention_weights(q, k, lse, rows=[0, 199])
    p = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)[:, :, [0, 199]]
    err = float((w - p).abs().max())
    naive = _est(8192).value("score matrix", "naive")
    tile = _est(8192).value("score matrix", "flash")
    return _found(
        f"weights of rows 0 and 199 from the lse match P to {_err(err)}; scores held at n=8192: "
        f"{fmt(naive / 2**20)} MiB naive vs {fmt(tile / 2**20)} MiB in 128×128 tiles",
        "attention(q, k, v, backend='flash', return_lse=True); attention_weights(q, k, lse, "
        "rows=[0, 199]); estimate(8192, 768, 12)",
        err < 1e-12 and tile * 100 < naive,
        "the tiled form needs the full matrices",
    )


@check("002-8.6-b")
def _gpu_numbers() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a GPU (A100 memory sizes and bandwidths, and a GPU speed-up measurement)",
    )


@check("002-8.6-c")
def _flash_variants() -> Finding:
    from ... import attention, masks

    q = _randn(1, 8, 150, 16, seed=1)
    k, v = _randn(1, 2, 150, 16, seed=2), _randn(1, 2, 150, 16, seed=3)
    out = attention(q, k, v, mask=masks.causal(), backend="flash")
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    s = q @ kk.transpose(-1, -2) / 4
    s = s.masked_fill(~torch.ones(150, 150, dtype=torch.bool).tril(), float("-inf"))
    err = float((out - torch.softmax(s, -1) @ vv).abs().max())
    return _found(
        f"causal GQA (8 query / 2 KV heads) on the flash backend: max |Δ| vs dense = {_err(err)}",
        "attention(q, k, v, mask=masks.causal(), backend='flash') with k, v of 2 heads",
        err < 1e-12,
        "the tiled backend does not support causal GQA exactly",
    )


@check("002-8.6-d")
def _rope_linear() -> Finding:
    from ...positional import RoPE

    base, scaled = RoPE(64), RoPE(64, scaling={"rope_type": "linear", "factor": 16.0})
    x = _randn(1, 1, 1, 64, seed=1)
    err = max(
        float((scaled(x, torch.tensor([16 * p])) - base(x, torch.tensor([p]))).abs().max())
        for p in (1, 100, 2047)
    )
    return _found(
        f"rotation at position 16·p (scaled) vs p (original), p ∈ {{1, 100, 2047}}: max |Δ| = "
        f"{_err(err)}; position 32,767 maps inside the original 2K range",
        "RoPE(64, scaling={'rope_type': 'linear', 'factor': 16.0})(x, [16 * p]) vs RoPE(64)(x, "
        "[p])",
        err < 1e-9,
        "linear scaling does not map 32K positions onto the 2K range",
    )


@check("002-8.6-e")
def _rope_ntk_yarn() -> Finding:
    from ...positional import compute_rope_parameters

    plain, _ = compute_rope_parameters(None, 64, 10000.0)
    ntk, _ = compute_rope_parameters({"rope_type": "ntk", "factor": 16.0}, 64, 10000.0)
    yarn, _ = compute_rope_parameters(
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048},
        64,
        10000.0,
    )
    ntk_hi, ntk_lo = float(ntk[0] / plain[0]), float(plain[-1] / ntk[-1])
    y_hi, y_lo = float(yarn[0] / plain[0]), float(plain[-1] / yarn[-1])
    ok = abs(ntk_hi - 1) < 1e-12 and abs(ntk_lo - 16) < 1e-9 and abs(y_hi - 1) < 1e-12
    ok = ok and abs(y_lo - 16) < 1e-9
    return _found(
        f"NTK: highest frequency ×{fmt(ntk_hi)}, lowest ÷{fmt(ntk_lo)} (a new base); YaRN: "
        f"highest ×{fmt(y_hi)} (extrapolated), lowest ÷{fmt(y_lo)} (interpolated)",
        "compute_rope_parameters({'rope_type': 'ntk' / 'yarn', 'factor': 16.0, …}, 64, 10000.0)",
        ok,
        "the scalings do not treat high and low frequencies as described",
    )


@check("002-8.6-f")
def _sliding_window() -> Finding:
    from ... import masks

    a = masks.sliding_window(4).to_dense(64, 64)[0, 0].to(F64)
    reach, r = [], torch.eye(64, dtype=F64)
    for _ in range(4):
        r = ((r @ a) > 0).to(F64)
        reach.append(int(r[-1].sum()))
    pairs = {
        n: _est(n, 4096, 32, window=4096).value("attended pairs per head", "flash")
        for n in (16384, 32768)
    }
    ratio = pairs[32768] / pairs[16384]
    ok = reach == [4, 7, 10, 13] and 2 <= ratio < 2.2
    return _found(
        f"last token's reach after 1–4 layers: {reach} tokens (= L·(W−1)+1); attended pairs "
        f"×{fmt(ratio, 4)} from n=16K to 32K",
        "masks.sliding_window(4).to_dense(64, 64); estimate(n, 4096, 32, window=4096)",
        ok,
        "the window's reach or cost do not behave as described",
    )


@check("002-8.6-g")
def _ring() -> Finding:
    from ... import attention, merge_partials

    q, k, v = _qkv(L=64)
    parts = [
        attention(q, k[:, :, s : s + 16], v[:, :, s : s + 16], return_lse=True)
        for s in range(0, 64, 16)
    ]
    out, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    err = float((out - _softmax_ref(q, k, v)).abs().max())
    return _found(
        f"merge of 4 KV-block partials vs full attention: max |Δ| = {_err(err)}",
        "merge_partials([attention(q, k_b, v_b, return_lse=True)…])",
        err < 1e-12,
        "merging the ring's partial results is not exact",
    )


@check("002-8.6-h")
def _streaming() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 10, 16, seed=2)
    cache = KVCache()
    outs = [mha(x[:, :6], mask=masks.causal(), cache=cache)]
    outs += [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(6, 10)]
    err = float((torch.cat(outs, 1) - mha(x, mask=masks.causal())).abs().max())
    return _found(
        f"prefill + 4 cached steps vs one full call: max |Δ| = {_err(err)}; cache holds "
        f"{len(cache)} tokens",
        "mha(x_t, mask=masks.causal(), cache=KVCache())",
        err < 1e-12 and len(cache) == 10,
        "cached incremental decoding differs from the full computation",
    )


@check("002-8.7-b")
def _summary_cost() -> Finding:
    t = {n: _est(n).value("total", "naive") for n in (1024, 4096)}
    t_ok = all(v == 8 * n * 768**2 + 4 * n * n * 768 + 60 * n * n for n, v in t.items())
    m1 = _est(4096).value("activations kept for backward", "naive")
    m12 = _est(4096, layers=12).value("activations kept for backward", "naive")
    share = 12 * 4096**2 * 4 / m1
    return _found(
        f"FLOPs {fmt(t[1024])} at n=1024, {fmt(t[4096])} at 4096 (8nd² + 4n²d + 5hn²); kept "
        f"activations ×{fmt(m12 / m1)} for 12 layers, {fmt(100 * share, 3)} % of it n²·h",
        "estimate(n, 768, 12, layers=L).value('total' / 'activations kept for backward', 'naive')",
        t_ok and m12 == 12 * m1 and share > 0.9,
        "the totals do not follow O(n²d + nd²) and O(n²hL)",
    )


@check("002-8.7-c")
def _typical_heads() -> Finding:
    from ...modules import MultiHeadAttention

    dims = {h: MultiHeadAttention(1024, h).head_dim for h in (4, 8, 16, 32)}
    cfg = {h: _est(128, 1024, h).config["D"] for h in (4, 8, 16, 32)}
    return _found(
        "d_k = " + ", ".join(f"{d} (h={h})" for h, d in dims.items()),
        "MultiHeadAttention(1024, h).head_dim; estimate(128, 1024, h).config['D']",
        all(d == 1024 // h == cfg[h] for h, d in dims.items()),
        "d_k is not d_model/h",
    )


@check("002-8.7-d")
def _params_heads() -> Finding:
    base = _est(128, 768, 12, bias=False).value("projection weights", "naive")
    best = min(
        range(13, 30),
        key=lambda h: abs(
            _est(128, 64 * h, h, bias=False).value("projection weights", "naive") / base - 2
        ),
    )
    ratio = _est(128, 64 * best, best, bias=False).value("projection weights", "naive") / base
    return _found(
        f"h=12 → h={best}: parameters ×{fmt(ratio, 4)}, heads ×{fmt(best / 12, 3)} "
        f"(exactly √2 = {fmt(math.sqrt(2), 4)} in the continuum)",
        "estimate(128, 64 * h, h, bias=False).value('projection weights', 'naive')",
        abs(best / 12 - 1.4) < 0.05 and abs(ratio - 2) < 0.1,
        "doubling the parameters does not mean ~1.4× the heads",
    )


# ------------------------------------------------------------------------ more of 8.2–8.7
@check("002-8.2.2-g")
def _pe_scales() -> Finding:
    from ...positional import sinusoidal

    pe = sinusoidal(4096, 64, dtype=F64)
    hi, lo = pe[:, 0:2], pe[:, 62:64]
    # High frequency: positions 44 apart (≈ 7 periods of 2π) look alike; neighbours differ.
    alias = float((hi[44:] - hi[:-44]).norm(dim=-1).max())
    near = float((hi[1:] - hi[:-1]).norm(dim=-1).min())
    # Low frequency: the angle grows monotonically over the whole range (a global coordinate).
    angle = torch.atan2(lo[:, 0], lo[:, 1])
    mono = bool((angle[1:] > angle[:-1]).all())
    ok = alias < 0.05 and near > 0.9 and mono
    return _found(
        f"dims 0–1: positions p and p+44 differ by at most {fmt(alias)}, neighbours by at least "
        f"{fmt(near)}; dims 62–63: angle strictly increasing over 0–4095: {mono}",
        "pe = sinusoidal(4096, 64); norms of pe[p + 44, :2] − pe[p, :2]; atan2 of pe[:, 62:64]",
        ok,
        "the frequency bands do not split into local and global position information",
    )


@check("002-8.3.1-c")
def _param_shapes() -> Finding:
    mha = _mha(512, 8)
    wq, wk, wv, wo = _mha_parts(mha)
    per_head = [tuple(w[:64].T.shape) for w in (wq, wk, wv)]
    ok = per_head == [(512, 64)] * 3 and tuple(wo.T.shape) == (512, 512) and mha.head_dim == 64
    return _found(
        f"W_i^Q, W_i^K, W_i^V (transposed head slices): {per_head}; W^O (transposed): "
        f"{tuple(wo.T.shape)} = (h·d_v, d_model)",
        "MultiHeadAttention(512, 8): qkv_proj.weight split per head, out_proj.weight",
        ok,
        "the projection shapes differ",
    )


@check("002-8.3.4-e")
def _pruning() -> Finding:
    from ...analysis import head_importance

    mha = _mha(16, 4)
    x, target = _randn(2, 6, 16, seed=1), _randn(2, 6, 16, seed=2)

    def loss_fn(m, batch):
        return ((m(batch[0]) - batch[1]) ** 2).sum()

    imp = head_importance(mha, (x, target), loss_fn, ablation=True)["ablation"][0]
    base = float(loss_fn(mha, (x, target)))
    pruned = []
    for h in range(4):
        m = _mha(16, 4)
        m.prune_heads([h])
        with torch.no_grad():
            pruned.append(float(loss_fn(m, (x, target))) - base)
    err = max(abs(float(a) - b) for a, b in zip(imp, pruned, strict=True))
    order = [int(i) for i in imp.argsort(descending=True)]
    return _found(
        "loss increase per pruned head: "
        + ", ".join(fmt(b) for b in pruned)
        + f"; head_importance ablation matches to {_err(err, 1e-9)}; ranking {order}",
        "head_importance(mha, (x, t), loss_fn, ablation=True); mha.prune_heads([h])",
        err < 1e-9,
        "the gated ablation does not equal pruning the head",
    )


@check("002-8.4.2-e")
def _checkpointing() -> Finding:
    from ...models import GPT, TransformerConfig

    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    grads, calls = {}, {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
        model = GPT(cfg).double().train()
        model.gradient_checkpointing = ckpt
        count = [0]
        for blk in model.blocks:
            blk.register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model(idx).sum().backward()
        grads[ckpt] = torch.cat([p.grad.flatten() for p in model.parameters()])
        calls[ckpt] = count[0]
    err = float((grads[True] - grads[False]).abs().max())
    return _found(
        f"block forwards: {calls[False]} without, {calls[True]} with checkpointing "
        f"(recomputed in backward); max |Δ grad| = {_err(err)}",
        "GPT(cfg).gradient_checkpointing = True; forward pre-hooks on model.blocks",
        err < 1e-12 and calls[True] == 2 * calls[False],
        "checkpointing does not recompute or changes the gradients",
    )


@check("002-8.7-g")
def _summary_sinusoidal() -> Finding:
    a, b = _sinusoidal_extrapolates(), _pe_scales()
    both = a.verdict == AGREES and b.verdict == AGREES
    return _found(
        f"{a.computed}; {b.computed}",
        f"{a.call}; {b.call}",
        both,
        "the encoding fails beyond the training length or lacks the scales",
    )


# ------------------------------------------------------------------------ 8.8 exercises
def _unscaled_saturation() -> tuple[float, float, float, float]:
    """d_k=512: P(|q·k| > 20), std of q·k, mean max weight unscaled and scaled (64 keys)."""
    from ... import attention

    q, k = _randn(1, 1, 256, 512, seed=3), _randn(1, 1, 64, 512, seed=4)
    v = _randn(1, 1, 64, 4, seed=5)
    dots = q @ k.transpose(-1, -2)
    frac = float((dots.abs() > 20).to(F64).mean())
    _, raw = attention(q, k, v, scale=1.0, return_weights=True)
    _, sc = attention(q, k, v, return_weights=True)
    return frac, float(dots.std()), float(raw.amax(-1).mean()), float(sc.amax(-1).mean())


@check("002-ex8.1-a")
def _ex81_claim() -> Finding:
    frac, std, raw, sc = _unscaled_saturation()
    return _found(
        f"std(q·k) = {fmt(std)} (√512 = {fmt(math.sqrt(512))}); {fmt(100 * frac, 3)} % of |q·k| "
        f"exceed 20; mean max weight {fmt(raw)} unscaled vs {fmt(sc)} with 1/√d_k",
        "attention(q, k, v, scale=1.0, return_weights=True) vs attention(q, k, v, "
        "return_weights=True)",
        std > 20 and frac > 0.2 and raw > 0.7 and sc < 0.3,
        "the unscaled logits do not reach ±20 or softmax does not saturate",
    )


@check("002-ex8.2-a")
def _ex82a() -> Finding:
    e = _est(1024, 768, 12, batch=32, dtype="float16")
    w, wb = e.value("projection weights", "naive"), e.value("projection weights + biases", "naive")
    return _found(
        f"{int(w):,} weights; {int(wb):,} with biases",
        "estimate(1024, 768, 12, batch=32, dtype='float16').value('projection weights', 'naive')",
        w == 2_359_296,
        "the weight count is not 2,359,296",
    )


@check("002-ex8.2-b")
def _ex82b() -> Finding:
    b = _est(1024, 768, 12, batch=32, dtype="float16").value("score matrix", "naive")
    return _found(
        f"{int(b):,} bytes = {fmt(b / 2**20)} MiB",
        "estimate(1024, 768, 12, batch=32, dtype='float16').value('score matrix', 'naive')",
        b == 768 * 2**20,
        "the score matrices do not take 768 MiB",
    )


@check("002-ex8.3-a")
def _ex83_shapes() -> Finding:
    from ... import attention

    d, n = 8, 5
    X = _randn(d, n, seed=1)
    WQ, WK, WV = (_randn(d, d, seed=s) for s in (2, 3, 4))
    Q, K, V = WQ @ X, WK @ X, WV @ X  # (d_k, n): tokens are columns
    qk = tuple((Q @ K.T).shape)
    # The right column form: Attention(X) = V softmax_cols(KᵀQ/√d_k), and it is P-equivariant.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    out = attention(Q.T[None], K.T[None], V.T[None])[0].T  # (d_v, n)
    out_p = attention(Q.T[perm][None], K.T[perm][None], V.T[perm][None])[0].T
    err = float((out_p - out[:, perm]).abs().max())
    qn, kn, vn = Q.numpy().T, K.numpy().T, V.numpy().T
    witness = ind.close(out.numpy(), ind.sdpa(qn, kn, vn).T)
    return _found(
        f"with X ∈ R^(d×n): QKᵀ has shape {qk} (features × features), not (n, n); the token "
        f"form V·softmax(KᵀQ/√d_k) gives Attention(XP) = Attention(X)P to {_err(err)}",
        "Q, K = W_q @ X, W_k @ X; (Q @ K.T).shape; attention(Q.T, K.T, V.T) permuted",
        qk == (n, n),
        "with tokens as columns QKᵀ is d_k×d_k, so the derivation permutes features; it must "
        "use KᵀQ (n×n): (KP)ᵀ(QP) = Pᵀ(KᵀQ)P, and softmax commutes with the permutation",
        Derivation(witness, "V·softmax(KᵀQ/√d_k) in numpy equals attnlab's token-form output"),
    )


def _local(n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Exercise 8.4: the text's loop, attnlab with a band mask, attnlab with an additive −∞ M."""
    from ... import attention, masks

    q, k_, v = _qkv(H=1, L=n)
    loop = torch.zeros_like(q)
    for i in range(n):
        s, e = max(0, i - k), min(n, i + k + 1)
        loop[:, :, i] = _softmax_ref(q[:, :, i : i + 1], k_[:, :, s:e], v[:, :, s:e])[:, :, 0]
    band = attention(q, k_, v, mask=masks.sliding_window(k + 1, causal=False))
    idx = torch.arange(n)
    m = torch.zeros(n, n, dtype=F64).masked_fill((idx[:, None] - idx).abs() > k, float("-inf"))
    additive = attention(q, k_, v, mask=m)
    return loop, band, additive


@check("002-ex8.4-a")
def _ex84() -> Finding:
    from ... import masks

    loop, band, additive = _local(32, 3)
    err = max(float((band - loop).abs().max()), float((additive - loop).abs().max()))
    e = _est(4096, 64, 1, mask=masks.sliding_window(65, causal=False))
    pairs = e.value("attended pairs per head", "flash")
    ratio = e.value("scores QKᵀ", "flash") / e.value("scores QKᵀ", "naive")
    want = 4096 * 129 - 64 * 65
    return _found(
        f"loop vs band mask vs −∞ matrix: max |Δ| = {_err(err)}; n=4096, k=64: {int(pairs):,} "
        f"pairs (= n(2k+1) − k(k+1)), score FLOPs {fmt(100 * ratio, 3)} % of dense",
        "attention(q, k, v, mask=masks.sliding_window(k + 1, causal=False)); "
        "estimate(4096, 64, 1, mask=…)",
        err < 1e-12 and pairs == want,
        "the local-attention forms or their cost differ",
    )


@check("002-ex8.5-a")
def _ex85() -> Finding:
    from ...positional import RoPE

    rope = RoPE(32, interleaved=True)
    w = rope.inv_freq.to(F64)
    want = 10000.0 ** (-torch.arange(0, 32, 2, dtype=F64) / 32)
    freq_err = float((w - want).abs().max())

    def rot(a: float) -> Tensor:
        c, s = math.cos(a), math.sin(a)
        return torch.tensor([[c, -s], [s, c]], dtype=F64)

    om = float(w[3])
    group = float((rot(11 * om).T @ rot(4 * om) - rot(-7 * om)).abs().max())
    q, k = _randn(1, 1, 1, 32, seed=1), _randn(1, 1, 1, 32, seed=2)
    s1 = float((rope(q, torch.tensor([11])) * rope(k, torch.tensor([4]))).sum())
    s2 = float((rope(q, torch.tensor([111])) * rope(k, torch.tensor([104]))).sum())
    return _found(
        f"max |ω_i − 10000^(−2i/d)| = {_err(freq_err)}; max |R_mᵀR_n − R_(n−m)| = {_err(group)}; "
        f"scores at (11, 4) and (111, 104): {fmt(s1, 10)}, {fmt(s2, 10)}",
        "RoPE(32, interleaved=True).inv_freq; rope(q, [m]) · rope(k, [n])",
        freq_err < 1e-15 and group < 1e-12 and abs(s1 - s2) < 1e-9,
        "the rotation algebra or the frequencies differ",
    )


def _io_flash(N: int, d: int, B: float) -> float:
    """DRAM traffic (elements) of tiled attention with B-row blocks, from attnlab's IO model
    (`attnlab.analysis.costs.io_tiled`: Q and O once, K and V once per query block)."""
    from ...analysis.costs import io_tiled

    block = max(1, round(B))
    return float(io_tiled(N, d, sram=4 * block * d, block=block))


def _io_fit(block, io=None) -> float:
    """Slope of log IO against log M at N=2^20, d=64 for a block-size rule ``block(M, d)``
    (attnlab's IO model, or ``io(N, d, B)``)."""
    io = _io_flash if io is None else io
    Ms = (2**14, 2**16, 2**18)
    ios = [io(2**20, 64, block(M, 64)) for M in Ms]
    return (math.log(ios[-1]) - math.log(ios[0])) / (math.log(Ms[-1]) - math.log(Ms[0]))


def _io_closed(N: int, d: int, B: float) -> float:
    return float(ind.tiled_io(N, d, max(1, round(B))))


@check("002-ex8.6-a")
def _ex86() -> Finding:
    text = _io_fit(lambda M, d: math.sqrt(M / d))
    right = _io_fit(lambda M, d: M / (4 * d))  # K_j, V_j, Q_i, O_i blocks of B×d in SRAM
    closed = (
        _io_fit(lambda M, d: math.sqrt(M / d), _io_closed),
        _io_fit(lambda M, d: M / (4 * d), _io_closed),
    )
    return _found(
        f"IO ∝ M^{fmt(text, 3)} with B = √(M/d); IO ∝ M^{fmt(right, 3)} with B = M/(4d)",
        "io_tiled(N, d, sram, block=B) at B = sqrt(M/d) and B = M/(4d)",
        abs(text + 1) < 0.05,
        "B = √(M/d) gives O(N²d^1.5/√M); O(N²d²/M) needs B = Θ(M/d) (B×d blocks of Q, K, V, "
        "O filling the SRAM)",
        Derivation(
            abs(closed[0] - text) < 1e-9 and abs(closed[1] - right) < 1e-9,
            "FlashAttention's Algorithm 1 IO 2Nd + ⌈N/B⌉(3Nd + 4N) in closed form gives slopes "
            f"{fmt(closed[0], 3)} and {fmt(closed[1], 3)}",
        ),
    )


def _sine_only_residual(k: int = 1) -> tuple[float, float]:
    """Least-squares relative residual of PE(p+k) ≈ PE(p)·M for sine-only and sin/cos features."""
    from ...positional import sinusoidal

    p = torch.arange(300, dtype=F64)[:, None]
    w = 2.0 ** -torch.arange(8, dtype=F64)
    sines = torch.sin(p * w)  # PE_base(pos, i) = sin(pos·2^−i), the exercise's proposal
    a, b = sines[: 300 - k], sines[k:]
    m = torch.linalg.lstsq(a, b).solution
    r_sin = float((a @ m - b).norm() / b.norm())
    pe = sinusoidal(300, 16, dtype=F64)
    m2 = torch.linalg.lstsq(pe[: 300 - k], pe[k:]).solution
    r_pe = float((pe[: 300 - k] @ m2 - pe[k:]).norm() / pe[k:].norm())
    return r_sin, r_pe


@check("002-ex8.7-a")
def _ex87() -> Finding:
    r_sin, r_pe = _sine_only_residual()
    pos = np.arange(300, dtype=np.float64)[:, None]
    w_sin = ind.shift_residual(np.sin(pos * 2.0 ** -np.arange(8)))
    w_pe = ind.shift_residual(ind.sinusoid(300, 16))
    return _found(
        f"relative residual of the best linear map PE(p) → PE(p+1): {fmt(r_sin)} for sines only, "
        f"{_err(r_pe)} for sin/cos pairs",
        "torch.linalg.lstsq(PE[:-1], PE[1:]) for sin(pos·2^−i) and for sinusoidal(300, 16)",
        r_sin < 1e-6,
        "with sines alone no fixed linear map sends PE(p) to PE(p+k) (each sine needs its "
        "cosine, as in 8.2.2), so relative offsets are not linearly accessible",
        Derivation(
            abs(w_sin - r_sin) < 1e-9 and abs(w_pe - r_pe) < 1e-9,
            f"numpy least squares on the closed-form tables: residuals {fmt(w_sin)} (sines) and "
            f"{tiny(w_pe)} (sin/cos)",
        ),
    )


def _single_head_copy() -> tuple[Tensor, Tensor, Tensor]:
    """A one-head MHA built to output x_1 + x_n at every position: (y, target, weights)."""
    from ... import attention

    E, n, c = 8, 6, 200.0
    x = _randn(1, n, E, seed=7)
    x[..., 6] = 0.0
    x[:, [0, n - 1], 6] = 1.0  # marker on the first and last tokens
    x[..., 7] = 1.0  # a constant feature
    mha = _mha(E, 1, bias=False)
    with torch.no_grad():
        w = torch.zeros(3 * E, E, dtype=F64)
        w[0, 7] = c  # q = c·e_0 for every token
        w[E, 6] = 1.0  # k = e_0 on the marked tokens, 0 elsewhere
        w[2 * E :] = torch.eye(E, dtype=F64)  # v = x
        mha.qkv_proj.weight.copy_(w)
        mha.out_proj.weight.copy_(2 * torch.eye(E, dtype=F64))  # W^O = 2I
    y = mha(x)
    q, k, v = mha.project(x)
    _, a = attention(q, k, v, return_weights=True)
    _SINGLE_HEAD_WITNESS[0] = _mha_by_hand(mha, x)
    return y, (x[:, 0] + x[:, -1]).unsqueeze(1).expand_as(y), a[0, 0]


_SINGLE_HEAD_WITNESS: list[Derivation] = [Derivation(False, "not computed")]


@check("002-ex8.8-a")
def _ex88_single() -> Finding:
    y, target, a = _single_head_copy()
    err = float((y - target).abs().max())
    a1, an, rest = float(a[:, 0].min()), float(a[:, -1].min()), float(a[:, 1:-1].max())
    return _found(
        f"α_i1 = {fmt(a1, 6)}, α_in = {fmt(an, 6)} in every row, other weights {_err(rest)}; "
        f"max |y_i − (x_1 + x_n)| = {_err(err)}",
        "MultiHeadAttention(8, 1, bias=False) with hand-set weights; attention(…, "
        "return_weights=True)",
        not (abs(a1 - 0.5) < 1e-12 and abs(an - 0.5) < 1e-12 and err < 1e-12),
        "one head does it: equal logits on x_1 and x_n and much lower elsewhere give 0.5/0.5, "
        "and W^O = 2I outputs x_1 + x_n exactly",
        _SINGLE_HEAD_WITNESS[0],
    )


@check("002-ex8.8-b")
def _ex88_rank() -> Finding:
    from ... import attention

    _, _, a = _single_head_copy()
    r_copy = int(torch.linalg.matrix_rank(a))
    q, k, v = _qkv(H=1, L=16, D=16)
    _, w = attention(q, k, v, return_weights=True)
    r_rand = int(torch.linalg.matrix_rank(w[0, 0]))
    w_ind = ind.attention_weights(q.numpy(), k.numpy())[0, 0]
    witness = ind.close(w[0, 0].numpy(), w_ind) and _SINGLE_HEAD_WITNESS[0].agrees
    return _found(
        f"rank of the 0.5/0.5 matrix = {r_copy}; rank of one random head's 16×16 weights = "
        f"{r_rand}",
        "torch.linalg.matrix_rank(attention(q, k, v, return_weights=True)[1][0, 0])",
        r_copy >= 2 and r_rand == 1,
        "the 0.5/0.5 pattern has rank 1, and a single head's n×n weights are generically of "
        "full rank n, not rank 1",
        Derivation(
            witness,
            f"softmax(QKᵀ/√d) in numpy equals attnlab's weights (numpy rank "
            f"{int(np.linalg.matrix_rank(w_ind))}), and the copy head matches numpy",
        ),
    )


@check("002-ex8.8-c")
def _ex88_two_heads() -> Finding:
    from ... import attention

    n = 6
    x = _randn(1, 1, n, 8, seed=7)
    m1 = torch.zeros(n, n, dtype=torch.bool)
    m1[:, 0] = True
    m2 = torch.zeros(n, n, dtype=torch.bool)
    m2[:, -1] = True
    h1, h2 = attention(x, x, x, mask=m1), attention(x, x, x, mask=m2)
    xn = x.numpy()
    witness = ind.close(h1.numpy(), ind.sdpa(xn, xn, xn, keep=m1.numpy())) and ind.close(
        h2.numpy(), ind.sdpa(xn, xn, xn, keep=m2.numpy())
    )
    y = 0.5 * h1 + 0.5 * h2  # Σ_i head_i W_i^O with W_i^O = 0.5·I
    target = x[:, :, :1] + x[:, :, -1:]
    gap = float((y - target).abs().max())
    half = float((y - 0.5 * target).abs().max())
    return _found(
        f"max |y − (x_1 + x_n)| = {fmt(gap)}; max |y − 0.5(x_1 + x_n)| = {_err(half)}",
        "attention(x, x, x, mask=first/last column) per head; 0.5·head_1 + 0.5·head_2",
        gap < 1e-12,
        "W^O = 0.5·I gives 0.5(x_1 + x_n), half the stated target; W_i^O = I gives x_1 + x_n",
        Derivation(witness, "masked softmax(QKᵀ/√d)V in numpy equals both heads"),
    )


@check("002-8.3.2-d")
def _h_distributions() -> Finding:
    from ... import attention
    from ...analysis import head_diversity

    q, k, v = _qkv(H=4)
    _, w = attention(q, k, v, return_weights=True)
    sums = float((w.sum(-1) - 1).abs().max())
    div = float(head_diversity(w)[0])
    distinct = bool(
        (w[0, :, None] - w[0, None, :]).abs().amax((-1, -2)).add(torch.eye(4)).gt(1e-3).all()
    )
    return _found(
        f"weights {tuple(w.shape)}: one distribution per (head, query) (sums 1 ± {_err(sums)}), "
        f"the 4 heads' maps pairwise different: {distinct}; head_diversity {fmt(div)}",
        "attention(q, k, v, return_weights=True)[1]; head_diversity(w)",
        sums < 1e-12 and distinct,
        "the heads do not give separate distributions",
    )


@check("002-8.4.3-c")
def _mostly_matmul() -> Finding:
    share = {}
    for n in (512, 4096):
        e = _est(n)
        share[n] = 1 - e.value("softmax", "naive") / e.value("total", "naive")
    return _found(
        "matmul share of the FLOPs: "
        + ", ".join(f"n={n}: {fmt(100 * s, 4)} %" for n, s in share.items()),
        "1 − estimate(n, 768, 12).value('softmax') / .value('total')",
        min(share.values()) > 0.95,
        "the non-matmul work is not small",
    )


@check("002-ex8.5-b")
def _ex85_planes() -> Finding:
    from ...positional import RoPE

    rope = RoPE(16, interleaved=True)
    x = _randn(1, 1, 1, 16, seed=3)
    got = rope(x, torch.tensor([5]))[0, 0, 0]
    blocks = []
    for i, w in enumerate(rope.inv_freq.to(F64).tolist()):
        a = 5 * w
        r = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=F64)
        blocks.append(r @ x[0, 0, 0, 2 * i : 2 * i + 2])
    err = float((got - torch.cat(blocks)).abs().max())
    return _found(
        f"8 planes, frequencies {fmt(rope.inv_freq[0].item())} … {fmt(rope.inv_freq[-1].item())}; "
        f"max |RoPE(x, 5) − blockdiag(R_(5ω_i)) x| = {_err(err)}",
        "RoPE(16, interleaved=True)(x, torch.tensor([5]))",
        err < 1e-12,
        "RoPE is not a rotation per plane",
    )


@check("002-ex8.7-b")
def _ex87_laplacian() -> Finding:
    def codes(n: int) -> Tensor:
        lap = torch.diag(torch.tensor([1.0] + [2.0] * (n - 2) + [1.0], dtype=F64))
        lap -= torch.diag(torch.ones(n - 1, dtype=F64), 1) + torch.diag(
            torch.ones(n - 1, dtype=F64), -1
        )
        _, vec = torch.linalg.eigh(lap)
        vec = vec[:, 1:9]
        return vec * vec[0].sign()  # fix each eigenvector's sign

    c16, c32 = codes(16), codes(32)
    a, b = c32[:-1], c32[1:]
    m = torch.linalg.lstsq(a, b).solution
    resid = float((a @ m - b).norm() / b.norm())
    closed = ind.path_laplacian_modes(32, 8)
    witness = ind.close(c32.numpy(), closed, 1e-9) and ind.close(
        c16.numpy(), ind.path_laplacian_modes(16, 8), 1e-9
    )
    length = float((c16[3] - c32[3]).abs().max())
    return _found(
        f"position 3's code differs between n=16 and n=32 by up to {fmt(length)}; best linear "
        f"map code(p) → code(p+1) leaves a relative residual {fmt(resid)} (sin/cos: "
        f"{_err(_sine_only_residual()[1])})",
        "torch.linalg.eigh(path Laplacian); torch.linalg.lstsq(code[:-1], code[1:])",
        resid < 1e-6 and length < 1e-6,
        "the path Laplacian's eigenvectors are cos(πk(j+½)/n): they depend on the length n and "
        "have no fixed linear shift map (no sine partners, reflecting ends)",
        Derivation(
            witness and abs(ind.shift_residual(closed) - resid) < 1e-9,
            "the closed-form modes cos(πk(j+½)/n) equal torch's eigenvectors at n = 16 and 32, "
            "with the same shift residual",
        ),
    )


# ------------------------------------------------------------------------- 8.9 pitfalls
@check("002-8.9-a")
def _same_word() -> Finding:
    from ...positional import sinusoidal

    mha = _mha(16, 4)
    x = _randn(1, 6, 16, seed=3)
    x[0, 4] = x[0, 1]
    plain = mha(x)
    pe = mha(x + sinusoidal(6, 16, dtype=F64))
    d0 = float((plain[0, 1] - plain[0, 4]).abs().max())
    d1 = float((pe[0, 1] - pe[0, 4]).abs().max())
    return _found(
        f"outputs at the two copies differ by {_err(d0)} without PE, {fmt(d1)} with PE",
        "mha(x)[0, 1] vs mha(x)[0, 4]; mha(x + sinusoidal(6, 16))",
        d0 < 1e-12 and d1 > 1e-3,
        "the copies are (in)distinguishable contrary to the text",
    )


@check("002-8.9-b")
def _dim_mismatch() -> Finding:
    from ...positional import SinusoidalEmbedding

    x = torch.zeros(10, 512)
    try:
        _ = x + SinusoidalEmbedding(256)(10)
        got = "no error"
    except RuntimeError as e:
        got = f"RuntimeError: {str(e).splitlines()[0]}"
    ok_same = (x + SinusoidalEmbedding(512)(10)).shape == (10, 512)
    return _found(
        f"512 + 256: {got}; 512 + 512: shape (10, 512)",
        "torch.zeros(10, 512) + SinusoidalEmbedding(256)(10)",
        got.startswith("RuntimeError") and ok_same,
        "the mismatched widths add without error",
    )


@check("002-8.9-c")
def _scale_snippet() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    _, w = attention(q, k, v, return_weights=True)
    snippet = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(8), -1)
    _, w1 = attention(q, k, v, scale=1.0, return_weights=True)
    err = float((w - snippet).abs().max())
    unscaled = float((w1 - snippet).abs().max())
    return _found(
        f"max |attnlab weights − snippet| = {_err(err)}; without the division they differ by "
        f"{fmt(unscaled)}",
        "attention(q, k, v, return_weights=True)[1] vs softmax(Q Kᵀ / sqrt(d_k))",
        err < 1e-12,
        "attnlab's default does not divide by √d_k",
    )


@check("002-8.9-d")
def _softmax_dim() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    wrong = torch.softmax(s, -2)
    _, w = attention(q, k, v, return_weights=True)
    rows_wrong = float((wrong.sum(-1) - 1).abs().max())
    err = float((w - torch.softmax(s, -1)).abs().max())
    return _found(
        f"dim=-2: row sums miss 1 by up to {fmt(rows_wrong)} (the columns sum to 1); "
        "attnlab equals dim=-1 to "
        f"{_err(err)}",
        "torch.softmax(scores, -2) vs attention(q, k, v, return_weights=True)[1]",
        rows_wrong > 0.1 and err < 1e-12,
        "the two softmax dimensions agree",
    )


@check("002-8.9-e")
def _mask_snippets() -> Finding:
    from ... import attention, masks

    q, k, v = _qkv()
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    mask01 = masks.causal().to_dense(8, 8)[0, 0].to(F64)  # 1 = may attend
    times = torch.softmax(s * mask01, -1)
    plus = torch.softmax(s + mask01.masked_fill(mask01 == 0, -1e9), -1)
    _, w = attention(q, k, v, mask=masks.causal(), return_weights=True)
    leak = float((times * (1 - mask01)).sum(-1).max())
    err = float((plus - w).abs().max())
    return _found(
        f"scores·mask leaves up to {fmt(leak)} of a row's weight on masked keys; scores + "
        f"(−1e9 where 0, +1 elsewhere) equals attnlab's causal weights to {_err(err)}",
        "attention(q, k, v, mask=masks.causal(), return_weights=True)",
        leak > 0.1 and err < 1e-12,
        "the snippets behave otherwise",
    )


@check("002-8.9-f")
def _tril() -> Finding:
    from ... import masks

    m = masks.causal().to_dense(7, 7)[0, 0]
    tril = bool((m == torch.tril(torch.ones(7, 7, dtype=torch.bool))).all())
    triu = bool((m == torch.triu(torch.ones(7, 7, dtype=torch.bool))).all())
    return _found(
        f"masks.causal().to_dense(7, 7) == tril: {tril}; == triu: {triu}",
        "masks.causal().to_dense(7, 7)",
        tril and not triu,
        "the causal mask is not the lower triangle",
    )


@check("002-8.9-g")
def _divisible() -> Finding:
    from ...modules import MultiHeadAttention

    try:
        MultiHeadAttention(512, 7)
        got = "accepted"
    except ValueError as e:
        got = f"ValueError: {e}"
    d8 = MultiHeadAttention(512, 8).head_dim
    return _found(
        f"h=7: {got}; h=8: d_k = {d8}",
        "MultiHeadAttention(512, 7); MultiHeadAttention(512, 8).head_dim",
        got.startswith("ValueError") and d8 == 64,
        "the module accepts 7 heads or gives another d_k",
    )


@check("002-8.9-h")
def _reshape() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(2, 5, 16, seed=1)
    q, _, _ = mha.project(x)
    flat = x @ _mha_parts(mha)[0].T  # (B, L, E)
    right = flat.reshape(2, 5, 4, 4).transpose(1, 2)
    wrong = flat.reshape(2, 5, 4, 4).permute(0, 3, 1, 2)  # reshape(B, L, d_k, h)-style split
    e_right, e_wrong = float((q - right).abs().max()), float((q - wrong).abs().max())
    return _found(
        f"project() vs reshape+transpose: {_err(e_right)}; vs the scrambled split: {fmt(e_wrong)}",
        "mha.project(x)[0] vs (x @ W_q.T).reshape(B, L, h, d_k).transpose(1, 2)",
        e_right < 1e-12 and e_wrong > 1e-3,
        "the head split differs",
    )


@check("002-8.9-i")
def _ten_thousand() -> Finding:
    b = _est(10000, 512, 8).value("score matrix", "naive")
    one = _est(10000, 64, 1).value("score matrix", "naive")
    return _found(
        f"{fmt(b / 2**30)} GiB ({fmt(b / 1e9)} GB) for 8 heads; {fmt(one / 2**30)} GiB per head",
        "estimate(10000, 512, 8).value('score matrix', 'naive')",
        2.5e9 < b < 3.5e9,
        "the matrix is far from 3 GB",
    )


@check("002-8.9-j")
def _pre_post_ln() -> Finding:
    from ...models import GPT, TransformerConfig

    spread = {}
    for pre in (True, False):
        torch.manual_seed(0)
        cfg = TransformerConfig(
            vocab_size=64,
            d_model=32,
            n_layers=8,
            n_heads=4,
            max_seq_len=16,
            prenorm=pre,
            attn_backend="reference",
        )
        model = GPT(cfg).double()
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = model(idx)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1)
        )
        loss.backward()
        norms = []
        for blk in model.blocks:
            g = torch.cat([p.grad.flatten() for p in blk.parameters() if p.grad is not None])
            norms.append(float(g.norm()))
        spread[pre] = max(norms) / min(norms)
    return _found(
        f"per-layer gradient-norm spread (max/min over 8 layers): Pre-LN {fmt(spread[True])}, "
        f"Post-LN {fmt(spread[False])}",
        "GPT(TransformerConfig(n_layers=8, prenorm=True/False)); per-block gradient norms",
        spread[True] < spread[False],
        "Post-LN's layer gradients are not more uneven than Pre-LN's at initialisation",
    )


@check("002-8.9-k")
def _kv_recompute() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 8, 16, seed=4)
    cache = KVCache()
    inc = [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(8)]
    rec = [mha(x[:, : t + 1], mask=masks.causal())[:, -1:] for t in range(8)]  # recompute all
    err = float((torch.cat(inc, 1) - torch.cat(rec, 1)).abs().max())
    return _found(
        f"cached vs recomputed, 8 steps: max |Δ| = {_err(err)}",
        "mha(x_t, mask=masks.causal(), cache=KVCache()) vs mha(x[:, :t+1], "
        "mask=masks.causal())[:, -1:]",
        err < 1e-12,
        "the cache changes the outputs",
    )


@check("002-8.9-l")
def _entropy_snippet() -> Finding:
    from ... import attention, masks
    from ...analysis import entropy

    q, k, v = _qkv()
    _, weights = attention(q, k, v, mask=masks.causal(), return_weights=True)
    snippet = float(-(weights * weights.log()).sum(-1).mean())
    lib = float(entropy(weights).mean())
    w_ind = ind.attention_weights(q.numpy(), k.numpy(), keep=ind.causal_keep(q.shape[-2]))
    witness = (
        ind.close(weights.numpy(), w_ind) and abs(lib - float(ind.entropy(w_ind).mean())) < 1e-12
    )
    return _found(
        f"snippet: {snippet}; attnlab.analysis.entropy: {fmt(lib)} nats",
        "-(weights * weights.log()).sum(-1).mean() vs entropy(weights).mean()",
        math.isfinite(snippet) and abs(snippet - lib) < 1e-9,
        "a weight of exactly 0 (any masked key) gives 0·log 0 = 0·(−inf) = NaN, so the snippet "
        "prints nan for masked attention; treat 0·log 0 as 0 (as analysis.entropy does)",
        Derivation(
            witness,
            "causal softmax(QKᵀ/√d) in numpy and its entropy with 0·log 0 = 0 equal attnlab's",
        ),
    )


@check("002-8.9-m")
def _position_cosine() -> Finding:
    from ...positional import sinusoidal

    e = _randn(64, seed=8)
    pe = sinusoidal(11, 64, dtype=F64)
    cos = float(torch.nn.functional.cosine_similarity(e + pe[0], e + pe[10], dim=0))
    return _found(
        f"cos(e + PE_0, e + PE_10) = {fmt(cos)}",
        "cosine_similarity(e + sinusoidal(11, 64)[0], e + sinusoidal(11, 64)[10])",
        cos < 1 - 1e-3,
        "the representations coincide",
    )


# ------------------------------------------------------------------ exercise solutions (§8.8)
_SRC = "seed 002 §8.8"


def _lines(*parts: str) -> str:
    return "\n".join(parts)


@exercise("8.1", title="Why the 1/√d_k scale", source=_SRC)
def _solve_81() -> str:
    from ...analysis import scaling_experiment

    frac, std, raw, sc = _unscaled_saturation()
    r = scaling_experiment(d_ks=(64, 512), samples=1024, keys=64, seed=0)
    return _lines(
        "For q, k with independent zero-mean unit-variance entries, q·k = Σ_i q_i k_i is a sum",
        "of d_k independent terms of variance 1, so Var(q·k) = d_k; q·k/√d_k has variance 1.",
        f"At d_k = 512: std(q·k) = {fmt(std)} (√512 = {fmt(math.sqrt(512))}), and "
        f"{fmt(100 * frac, 3)} % of the logits exceed ±20.",
        "Unscaled, softmax is pushed towards one-hot: its Jacobian diag(p) − ppᵀ → 0, so",
        "gradients vanish and attention degenerates to a hard choice.",
        f"Check (attnlab.attention, 64 keys): mean largest weight {fmt(raw)} unscaled vs "
        f"{fmt(sc)} scaled.",
        "Check (attnlab.analysis.scaling_experiment, 64 keys, d_k = 64 / 512):",
        f"  Var(q·k) {fmt(r.rows[0][1])} / {fmt(r.rows[1][1])}, scaled "
        f"{fmt(r.rows[0][2])} / {fmt(r.rows[1][2])};",
        f"  softmax Jacobian norm unscaled {fmt(r.rows[0][5])} / {fmt(r.rows[1][5])} vs scaled "
        f"{fmt(r.rows[0][6])} / {fmt(r.rows[1][6])}.",
    )


@exercise("8.2", title="Parameters and attention-matrix memory", source=_SRC)
def _solve_82() -> str:
    from ...analysis import estimate

    e = estimate(1024, 768, 12, batch=32, dtype="float16")
    mha = _mha(768, 12)
    n_mod = sum(p.numel() for p in mha.parameters())
    return _lines(
        "a) Q, K, V projections 3·768·768 = 1,769,472; output projection 768·768 = 589,824;",
        "   total 4·d_model² = 2,359,296 weights (independent of h). With biases +4·768.",
        f"   attnlab: estimate(...).value('projection weights') = "
        f"{int(e.value('projection weights', 'naive')):,}; MultiHeadAttention(768, 12) has "
        f"{n_mod:,} parameters with biases.",
        "b) One n×n matrix per head and batch item: 32·12·1024·1024 = 402,653,184 entries;",
        "   ×2 bytes (FP16) = 805,306,368 B = 768 MiB.",
        f"   attnlab: estimate(1024, 768, 12, batch=32, dtype='float16').value('score matrix') = "
        f"{int(e.value('score matrix', 'naive')):,} B = "
        f"{fmt(e.value('score matrix', 'naive') / 2**20)} MiB; the tiled backend holds "
        f"{fmt(e.value('score matrix', 'flash') / 2**20)} MiB of scores instead.",
    )


@exercise("8.3", title="Permutation equivariance (the text says invariance)", source=_SRC)
def _solve_83() -> str:
    f = _ex83_shapes()
    inv = _invariance_claim()
    return _lines(
        "Write tokens as rows: X ∈ R^{n×d}, Q = XW_Q, K = XW_K, V = XW_V, and let P be an n×n",
        "permutation matrix acting on rows. Then (PX)W = P(XW), so",
        "  Attention(PX) = softmax(PQ (PK)ᵀ/√d_k) PV = softmax(P QKᵀ Pᵀ/√d_k) PV.",
        "Softmax acts row-wise, and permuting rows and columns of its input permutes its",
        "output the same way: softmax(P S Pᵀ) = P softmax(S) Pᵀ. With PᵀP = I:",
        "  Attention(PX) = P softmax(QKᵀ/√d_k) Pᵀ P V = P · Attention(X).",
        "This is equivariance (the output is permuted), not invariance (an unchanged output).",
        "(With tokens as columns, as the text writes X ∈ R^{d×n}, QKᵀ is d_k×d_k — the",
        "attention matrix is KᵀQ, and the same argument runs with Pᵀ(KᵀQ)P.)",
        f"Check: {f.computed}.",
        f"Check: {inv.computed}.",
    )


@exercise("8.4", title="Local (banded) attention", source=_SRC)
def _solve_84() -> str:
    f = _ex84()
    return _lines(
        "Mask: M_ij = 0 if |i − j| <= k, −∞ otherwise; softmax(QKᵀ/√d_k + M)V. In attnlab:",
        "  attention(q, k, v, mask=masks.sliding_window(k + 1, causal=False))",
        "(a bool mask; the tiled backend skips tiles outside the band, so the cost follows the",
        "attended pairs). Per-row loop: row i attends keys max(0, i−k) … min(n, i+k+1).",
        "Cost: n(2k+1) − k(k+1) pairs, each d multiply-adds for scores and for PV:",
        "O(n·k·d) time and O(n·k) weights, against O(n²·d) and O(n²) dense.",
        f"Check: {f.computed}.",
    )


@exercise("8.5", title="RoPE and translation invariance", source=_SRC)
def _solve_85() -> str:
    f = _ex85()
    rel = _rope_relative()
    return _lines(
        "2-D: R_θ = [[cos θ, −sin θ], [sin θ, cos θ]] is orthogonal and R_aᵀ R_b = R_(b−a).",
        "With q'_m = R_(mω) q and k'_n = R_(nω) k:",
        "  q'_mᵀ k'_n = qᵀ R_(mω)ᵀ R_(nω) k = qᵀ R_((n−m)ω) k,",
        "a function of n − m only. In d dims: d/2 independent planes with ω_i = 10000^(−2i/d),",
        "block-diagonal R, so the same identity holds plane by plane.",
        f"Check: {f.computed}.",
        f"Check: {rel.computed}.",
    )


@exercise("8.6", title="IO complexity of tiled (flash) attention", source=_SRC)
def _solve_86() -> str:
    from ...analysis.estimate import FLASH_TILE

    N, d, M = 4096, 64, 2**17
    naive = 4 * N * d + 4 * N * N  # read Q, K, V + write O; write/read S and P
    b_text, b_right = math.sqrt(M / d), M / (4 * d)
    f = _ex86()
    return _lines(
        "Standard: read Q, K, V (3Nd), write and read S (2N²), write and read P (2N²), write O",
        "(Nd): Θ(N² + Nd).",
        "Tiled: blocks of B query rows; for each of the N/B query blocks stream all of K and V",
        "(2Nd) through SRAM; Q and O move once. IO = 2Nd + (N/B)·2Nd = Θ(N²d/B).",
        "SRAM of M elements must hold the B×d blocks of Q_i, K_j, V_j, O_i: 4Bd <= M, so the",
        "largest block is B = Θ(M/d) (not Θ(√(M/d)) as the text says), giving",
        "  IO = Θ(N²d / (M/d)) = Θ(N²d²/M).",
        "With B = √(M/d) the same count gives Θ(N² d^1.5 / √M), which is not N²d²/M.",
        f"Numbers (N={N}, d={d}, M={M:,} elements): standard {fmt(naive)} elements; tiled "
        f"{fmt(_io_flash(N, d, b_right))} at B = M/(4d) = {int(b_right)}, "
        f"{fmt(_io_flash(N, d, b_text))} at B = √(M/d) = {fmt(b_text)}.",
        f"Check: {f.computed}.",
        f"attnlab's tiled backend uses {FLASH_TILE[0]}×{FLASH_TILE[1]} tiles on CPU (caches, "
        "not SRAM); its memory side: " + _flash_memory().computed + ".",
    )


@exercise("8.7", title="Designing a positional encoding (open question)", source=_SRC)
def _solve_87() -> str:
    r_sin, r_pe = _sine_only_residual()
    rel = _rope_relative()
    t5 = _relative_advantages()
    return _lines(
        "Requirement (3), relative positions, asks for PE(p+k) = f_k(PE(p)) with f_k independent",
        "of p — for a linear f_k that needs sin and cos at each frequency (a rotation per plane).",
        f"The text's sine-only layers fail it: best linear map residual {fmt(r_sin)} vs "
        f"{_err(r_pe)} for sin/cos pairs (attnlab.positional.sinusoidal).",
        "Designs that meet (1)–(3): RoPE (rotate q and k; the score depends on n − m only,",
        "any length, O(n·d)); or a relative bias b(i − j) (T5 buckets, ALiBi slopes).",
        f"Check RoPE: {rel.computed}.",
        f"Check the biases: {t5.computed}.",
    )


@exercise("8.8", title="Multi-head versus single-head expressiveness", source=_SRC)
def _solve_88() -> str:
    y, target, a = _single_head_copy()
    r = _ex88_rank()
    two = _ex88_two_heads()
    return _lines(
        "The text's example does not separate one head from two: one head can output",
        "y_i = x_1 + x_n. Mark tokens 1 and n with a feature m, let q = c·e_0 for every token",
        "and k = m·e_0: the logits are c/√d_k on tokens 1 and n and 0 elsewhere, so the weights",
        "are 1/2, 1/2 (and e^(−c/√d_k) ≈ 0 elsewhere); W_V = I and W_O = 2I give x_1 + x_n.",
        f"Check: weights {fmt(float(a[0, 0]), 6)}, {fmt(float(a[0, -1]), 6)}; max |y − (x_1 + "
        f"x_n)| = {_err(float((y - target).abs().max()))}.",
        "Nor is one head 'rank 1': " + r.computed + ".",
        "The text's two-head answer with W^O = 0.5·I gives half its target: " + two.computed + ".",
        "A separating example needs two different averages for the same query, e.g.",
        "y_i = [x_1 ; x_n] (x_1's content in one output block, x_n's in another, both tokens",
        "using the same input dimensions): one head's row output is W_O W_V Σ_j α_ij x_j, a",
        "single average, which mixes the two contents in the same dimensions; two heads (one",
        "attending token 1, one token n, W_O placing them in separate blocks) give it exactly.",
    )


# ----------------------------------------------------- the practice rules: memory and lengths
#: The 12-layer model of §8.4.2's memory rule: GPT-2 small (d=768, 12 heads, tied head).
_GPT2_SMALL = dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50257, batch=1)


def _eager_saved_per_layer(seq_len: int, d_model: int, n_heads: int, dropout: float) -> tuple:
    """(bytes, number of B·H·L·L tensors) one attnlab `TransformerBlock` with the reference
    (eager, L×L-materialising) backend saves for backward at batch 1 × ``seq_len`` in float32,
    counted per saved tensor with autograd's saved-tensor hooks on the meta device (no data)."""
    from ...models import TransformerBlock, TransformerConfig

    cfg = TransformerConfig(
        d_model=d_model,
        n_heads=n_heads,
        d_ff=4 * d_model,
        positional=None,
        attn_backend="reference",
        dropout=dropout,
    )
    with torch.device("meta"):
        block = TransformerBlock(cfg).train()
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        saved[id(t)] = t  # one entry per tensor object, however many ops save it
        return t

    x = torch.empty(1, seq_len, d_model, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    nbytes = sum(t.numel() * t.element_size() for t in saved.values())
    square = sum(1 for t in saved.values() if t.numel() == n_heads * seq_len * seq_len)
    return nbytes, square


def _plain_squares(seq_len: int, n_heads: int, head_dim: int) -> int:
    """How many (1, H, L, L) tensors plain PyTorch attention as the texts write it (§8.9's
    ``softmax(Q Kᵀ / √d_k)``, seed 003's dropout 0.1, ``· V``) saves for backward, counted on the
    meta device."""
    q, k, v = (
        torch.empty(1, n_heads, seq_len, head_dim, device="meta", requires_grad=True)
        for _ in range(3)
    )
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        saved[id(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        p = torch.nn.functional.dropout(torch.softmax(s, dim=-1), 0.1, training=True)
        torch.matmul(p, v)
    return sum(1 for t in saved.values() if t.numel() == n_heads * seq_len * seq_len)


@check("002-8.4.2-f")
def _sixteen_gb() -> Finding:
    from ...analysis.costs import model_cost

    L, gb = 2048, 1e9
    low = model_cost(L, train=True, dtype="float32", attention="naive", **_GPT2_SMALL)
    mixed = model_cost(L, train=True, dtype="float16", attention="naive", **_GPT2_SMALL)
    tiled = model_cost(L, train=True, dtype="float32", attention="flash", **_GPT2_SMALL)
    layers = _GPT2_SMALL["n_layers"]
    model_layer = low.memory["activations"] / layers  # one L×L per head: the probabilities
    eager_layer, squares = _eager_saved_per_layer(L, 768, 12, 0.1)
    eager = low.memory["total"] + layers * (eager_layer - model_layer)
    square = 12 * L * L * 4  # one float32 (1, H, L, L) tensor
    plain_sq = _plain_squares(L, 12, 64)
    plain = low.memory["total"] + layers * (plain_sq - 1) * square
    ok = abs(eager / (16 * gb) - 1) <= 0.15  # the one implementation named in advance
    return _found(
        f"cost model (one L×L per head kept): {fmt(low.memory['total'] / gb, 3)} GB float32, "
        f"{fmt(mixed.memory['total'] / gb, 3)} GB mixed float16, "
        f"{fmt(tiled.memory['total'] / gb, 3)} GB float32 with tiled attention; plain "
        f"PyTorch attention keeps {plain_sq} tensors of 12×2048×2048 floats per layer: "
        f"{fmt(plain / gb, 3)} GB; attnlab's reference layer keeps {squares} "
        f"({fmt(eager_layer / 2**20, 4)} MiB instead of {fmt(model_layer / 2**20, 4)} MiB): "
        f"{fmt(eager / gb, 3)} GB",
        "model_cost(2048, d_model=768, n_layers=12, n_heads=12, vocab_size=50257, train=True, "
        "dtype=…, attention='naive'|'flash').memory['total']; saved_tensors_hooks around "
        "TransformerBlock(attn_backend='reference', dropout=0.1) and the plain code on the meta "
        "device",
        ok,
        f"attnlab's reference implementation needs {fmt(eager / gb, 3)} GB, not about 16",
    )


#: The hardware and model assumed for §8.6's length rule: a 7B-class decoder served from
#: 80 GB GPUs (an A100-80GB's bf16 peak is 312 TFLOP/s; half of it is assumed sustained).
_LLM = dict(d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, dtype="bfloat16")
_GPU = dict(budget="80GB", gflops=156e3, max_seconds=10.0, window=4096, devices=8)
_GPU_SMALL = dict(_GPU, budget="24GB", gflops=82e3)  # an RTX 4090-class card (165 TFLOP/s peak)
_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)


def _k(n: int) -> str:
    return f"{n // 1024}K"


def _length_scan(gpu: dict) -> dict[int, object]:
    """`advise` for every length of `_LENGTHS` on ``gpu`` (one forward of one sequence)."""
    from ...analysis.advise import advise

    return {n: advise(n, **gpu, **_LLM) for n in _LENGTHS}


def _flops_witness(*scans: dict) -> Derivation:
    """advise's exact-attention FLOPs against the closed form of a decoder forward."""
    ok = all(
        a.options[o]["flops"] == ind.decoder_forward_flops(n, 4096, 32, 32000)
        for scan in scans
        for n, a in scan.items()
        for o in ("dense", "tiled")
    )
    return Derivation(
        ok,
        "closed form 24nLd² + 4Ln²d + 2ndV equals advise's dense and tiled FLOPs at every "
        "length (the time side of the advice)",
    )


def _in_time(a) -> bool:
    """Some option meets the time limit (else the advice is a fallback)."""
    return any(o["fits"] and o["fast enough"] for o in a.options.values())


def _scan_text(scan: dict) -> str:
    return ", ".join(
        f"{_k(n)} {a.choice}" + ("" if _in_time(a) else " (none in time)") for n, a in scan.items()
    )


@functools.cache
def _this_machine() -> tuple[str, float]:
    """This machine, live: (`machine_info` and its float32 matmul rate as text, the rate in
    GFLOP/s), measured once per process — for a finding's ``measured``, never a verdict."""
    from ...analysis.advise import machine_info
    from ...utils.timing import best_times

    m = machine_info()
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    rate = 2 * n**3 / best_times({"mm": lambda: torch.mm(a, b)}, 3)["mm"] / 1e9
    return (
        f"this machine: {m['cpu']}, {m['cores']} cores, AVX-512 {m['avx512']}, AMX {m['amx']}; "
        f"float32 {n}² matmul {rate:,.1f} GFLOP/s (measured now; a lower bound under load)",
        rate,
    )


def _machine_note() -> str:
    """`_this_machine`'s text."""
    return _this_machine()[0]


@check("002-8.6-i")
def _length_bands() -> Finding:
    scan, small = _length_scan(_GPU), _length_scan(_GPU_SMALL)
    want = {4096: ("dense", "tiled"), 16384: ("sparse",), 65536: ("ring",)}
    bands = {n: scan[n].choice in c for n, c in want.items()}
    bands[262144] = not _in_time(scan[262144])  # no standard option meets the limit
    wrong = [_k(n) for n, ok in bands.items() if not ok]
    exact = [_k(n) for n in _LENGTHS if 8192 < n <= 32768 and scan[n].choice != "sparse"]

    def first(choice: str) -> str:
        return next((_k(n) for n, a in small.items() if a.choice == choice), "never")

    return Finding(
        computed=f"advise on the 80 GB GPU: {_scan_text(scan)}; on the 24 GB card: "
        f"{_scan_text(small)}",
        call="advise(n, '80GB', gflops=156e3, d_model=4096, n_layers=32, n_heads=32, "
        "vocab_size=32000, dtype='bfloat16', max_seconds=10, window=4096, devices=8).choice",
        **judged(
            not wrong,
            f"the bands at {', '.join(wrong)} disagree: at {', '.join(exact)} exact attention "
            "(dense, or tiled = FlashAttention) still fits and meets the limit, so a window is "
            f"optional there; the band edges move with the memory (24 GB: tiled from "
            f"{first('tiled')}, ring from {first('ring')})",
            _flops_witness(scan, small),
        ),
        measured=_machine_note(),
    )


@check("002-8.7-h")
def _eight_k() -> Finding:
    scans = {"80 GB": _length_scan(_GPU), "24 GB": _length_scan(_GPU_SMALL)}
    first = {
        gpu: min((n for n, a in scan.items() if a.choice != "dense"), default=None)
        for gpu, scan in scans.items()
    }
    sparse = [
        f"{_k(n)} on {gpu}"
        for gpu, s in scans.items()
        for n, a in s.items()
        if a.choice == "sparse"
    ]
    dense_below = all(s[4096].choice == "dense" for s in scans.values())
    ok = dense_below and bool(sparse)
    return _found(
        "standard (dense) attention is the advice up to "
        + ", ".join(f"{_k(n // 2)} on the {gpu} GPU" for gpu, n in first.items() if n)
        + "; beyond it: "
        + "; ".join(
            f"{gpu}: " + ", ".join(f"{_k(n)} {a.choice}" for n, a in s.items() if n >= first[gpu])
            for gpu, s in scans.items()
        )
        + f"; sparse is chosen at: {', '.join(sparse) or 'no length'}",
        "advise(n, budget, gflops=…, d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, "
        "dtype='bfloat16', window=4096, devices=8).choice for n = 4K … 256K",
        ok,
        "past 8K the advice is exact attention that scales — tiled (FlashAttention) while one "
        "device's memory holds the sequence, then ring — and never the sparse variant",
        _flops_witness(*scans.values()),
    )


# ------------------------------------------------------------ the practice rules: learning rate
@check("002-8.9-n")
def _noam_peak() -> Finding:
    from ...train import TrainSettings, lr_at

    s = TrainSettings(schedule="noam", warmup=4000, d_model=512, steps=100_000)
    at = {t: lr_at(t, s) for t in (0, 999, 3999, 15999, 99999)}
    peak = max(at.values())
    ok = at[3999] == peak and 0.5 <= peak / 5e-4 <= 2
    return _found(
        "noam schedule, d_model=512, warmup 4000: "
        + ", ".join(f"step {t + 1}: {lr:.3g}" for t, lr in at.items())
        + f"; the peak {peak:.3g} is {peak / 5e-4:.2f}× the text's 5e-4 and {1e-2 / peak:.0f}× "
        "below its 'too large' 1e-2",
        "lr_at(t, TrainSettings(schedule='noam', warmup=4000, d_model=512))",
        ok,
        "the 2017 warmup schedule does not peak near 5e-4",
    )


#: The small char-LM of the learning-rate / warmup ablation (the shipped Alice text).
_SWEEP = dict(
    steps=300,
    batch_size=16,
    seq_len=64,
    d_model=64,
    n_layers=2,
    n_heads=4,
    dropout=0.0,
    min_lr=5e-5,
    eval_interval=100,
    eval_batches=8,
    save_interval=0,
    seed=0,
)


@functools.cache
def _lr_sweep() -> dict[tuple[float, int], float]:
    """Final validation loss (nats/char) per (lr, warmup) of `attnlab.train.sweep` over
    lr ∈ {1e-2, 5e-4} × warmup ∈ {0, 30} (`_SWEEP`), on one thread."""
    import tempfile

    from ...train import TrainSettings, sweep

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # oversubscribed threads slow a tiny model down by 10× or more
    try:
        with tempfile.TemporaryDirectory() as out:
            base = TrainSettings(out_dir=out, lr=5e-4, warmup=0, **_SWEEP)
            result = sweep(base, {"lr": [1e-2, 5e-4], "warmup": [0, 30]}, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return {(r.point["lr"], r.point["warmup"]): r.final_val for r in result.runs}


@functools.cache
def _no_clip_val() -> float:
    """Final validation loss of the lr 1e-2, warmup 0 run of `_lr_sweep` without gradient
    clipping (`attnlab.train.train` with ``grad_clip=0``), on one thread."""
    import tempfile

    from ...train import TrainSettings, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            s = TrainSettings(out_dir=out, lr=1e-2, warmup=0, grad_clip=0.0, **_SWEEP)
            return train(s, log=lambda _: None, plots=False).val_history[-1][2]
    finally:
        torch.set_num_threads(threads)


def _sweep_text(val: dict[tuple[float, int], float]) -> str:
    return "final validation loss (nats/char): " + ", ".join(
        f"lr {lr:g} warmup {w}: {v:.3f}" for (lr, w), v in val.items()
    )


_SWEEP_CALL = (
    "sweep(TrainSettings(steps=300, batch_size=16, seq_len=64, d_model=64, n_layers=2, n_heads=4, "
    "…), {'lr': [1e-2, 5e-4], 'warmup': [0, 30]}).runs[i].final_val"
)


@check("002-8.9-o")
def _lr_too_large() -> Finding:
    val = _lr_sweep()
    too_large = all(
        not math.isfinite(val[(1e-2, w)]) or val[(1e-2, w)] > val[(5e-4, w)] for w in (0, 30)
    )
    return _found(
        _sweep_text(val),
        _SWEEP_CALL,
        too_large,
        "for this small pre-LN model 1e-2 trains stably and ends below 5e-4 with or without "
        "warmup: how large is too large depends on the model (depth, post-LN or pre-LN) and the "
        "run, so 1e-2 is not too large for Transformers in general",
    )


@check("002-8.7-i")
def _warmup_helps() -> Finding:
    val = _lr_sweep()
    gain = {lr: val[(lr, 0)] - val[(lr, 30)] for lr in (1e-2, 5e-4)}
    no_clip = _no_clip_val()
    clip_gain = no_clip - val[(1e-2, 0)] if math.isfinite(no_clip) else math.inf
    ok = gain[1e-2] > 0 and gain[5e-4] > -0.02 and clip_gain > 0
    return _found(
        _sweep_text(val)
        + "; warmup lowers it by "
        + ", ".join(f"{g:.3f} at lr {lr:g}" for lr, g in gain.items())
        + f"; without clipping (lr 1e-2, warmup 0) it ends at {no_clip:.3f}",
        _SWEEP_CALL + "; train(TrainSettings(lr=1e-2, warmup=0, grad_clip=0, …))",
        ok,
        "warmup or clipping does not help the large learning rate here",
    )


@check("002-8.9-p")
def _grad_thresholds() -> Finding:
    from ...models import GPT
    from ...train import TrainSettings, get_batch, layer_grad_norms, layer_parameters, load_text

    text = load_text(None)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text[:20_000]])
    x, y = get_batch(data, 8, 64, torch.Generator().manual_seed(15))
    torch.manual_seed(15)
    model = GPT(TrainSettings(d_model=64, n_layers=2, n_heads=4).model_config(len(vocab))).double()
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    per_param = {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
    layers = layer_grad_norms(layer_parameters(model))
    lo, hi = min(per_param, key=per_param.get), max(per_param, key=per_param.get)
    ok = per_param[lo] > 1e-6 and per_param[hi] < 1000
    return _found(
        f"{len(per_param)} parameters: gradient norms from {fmt(per_param[lo], 3)} ({lo}) to "
        f"{fmt(per_param[hi], 3)} ({hi}); per layer " + ", ".join(fmt(float(v), 3) for v in layers),
        "loss.backward(); {n: p.grad.norm() for n, p in model.named_parameters()}; "
        "layer_grad_norms(layer_parameters(model))",
        ok,
        "a freshly initialised model already reads as vanishing or exploding",
    )


@functools.cache
def _ln_runs() -> dict[str, float]:
    """The training text's unigram entropy and the final validation loss (nats/char, NaN if
    diverged) of a 6-layer char-LM trained by
    `attnlab.apps.loop.fit` at lr 1e-2: Pre-LN and Post-LN without warmup, Post-LN with 30
    warmup steps; same seed, batches and settings otherwise, one thread."""
    from ...apps.loop import FitSettings, fit
    from ...models import GPT, TransformerConfig
    from ...train import get_batch, load_text, unigram_entropy

    text = load_text(None)
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([index[c] for c in text])
    cut = int(0.9 * len(data))
    train_data, val_data = data[:cut], data[cut:]

    def run(prenorm: bool, warmup: int) -> float:
        torch.manual_seed(0)
        cfg = TransformerConfig(
            vocab_size=len(index),
            d_model=64,
            n_layers=6,
            n_heads=4,
            max_seq_len=64,
            prenorm=prenorm,
            dropout=0.0,
            positional="rope",
        )
        model = GPT(cfg)
        g = torch.Generator().manual_seed(0)

        def loss(x: Tensor, y: Tensor) -> Tensor:
            return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

        def evaluate() -> dict[str, float]:
            gv = torch.Generator().manual_seed(1)
            return {"val": sum(float(loss(*get_batch(val_data, 16, 64, gv))) for _ in range(8)) / 8}

        s = FitSettings(steps=300, lr=1e-2, min_lr=5e-5, warmup=warmup, grad_clip=1.0, seed=0)
        try:
            h = fit(
                model,
                lambda _: loss(*get_batch(train_data, 16, 64, g)),
                s,
                evaluate=evaluate,
                log=lambda _: None,
            )
        except ValueError:  # fit refuses a non-finite loss: the run diverged
            return math.nan
        return h.evals[-1]["val"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            "unigram entropy": unigram_entropy(train_data, len(index)),
            "Pre-LN, warmup 0": run(True, 0),
            "Post-LN, warmup 0": run(False, 0),
            "Post-LN, warmup 30": run(False, 30),
        }
    finally:
        torch.set_num_threads(threads)


@check("002-8.9-q")
def _pre_ln_training() -> Finding:
    val = dict(_ln_runs())
    entropy = val.pop("unigram entropy")
    pre, post = val["Pre-LN, warmup 0"], val["Post-LN, warmup 0"]
    ok = math.isfinite(pre) and (not math.isfinite(post) or pre < post)
    return _found(
        "final validation loss (nats/char): "
        + ", ".join(f"{k}: {v:.3f}" for k, v in val.items())
        + f" (the text's unigram entropy: {entropy:.3f})",
        "fit(GPT(TransformerConfig(n_layers=6, prenorm=True|False, …)), loss_at, "
        "FitSettings(steps=300, lr=1e-2, warmup=0|30)).evals[-1]['val']",
        ok,
        "Post-LN trains as well as Pre-LN at this learning rate",
    )
