"""Seed 002, §8.2: positional encodings (the checks of the claims in claims/seed002.toml)."""

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
)
from .seed002 import F64, _err, _found, _mha, _qkv, _randn


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
