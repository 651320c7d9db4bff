"""Seed 002 — 第8章：Transformer与注意力机制 (chapter 8: Transformer and attention).

Every quantitative or checkable statement of the chapter, checked live against attnlab, and the
worked solutions of its exercises 8.1–8.8 (§8.8). Checks run in float64 with seeded generators on
small sizes; a claim's verdict is computed from what the library returns by the rule of
`attnlab.textbook.core.judged` (``agrees``; ``text error`` only with an independent derivation
behind attnlab's value; else ``disagrees``), so a library regression flips a verdict and fails
the test suite. This module holds the shared helpers and §8.1; the other sections are in
``seed002_*`` beside it, the claims' metadata in ``seed002.toml``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import (
    Derivation,
    Finding,
    check,
    fmt,
    judged,
    tiny,
)
from ..derivations import np  # NumPy on first use (the textbook extra)

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
    (wq, _), (wk, _), (wv, _) = mha.projection_weights()
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
