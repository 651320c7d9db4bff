"""Seed 004, positional information: sinusoidal encodings and their dot products.

The checks of claims whose metadata is in ``claims/seed004.toml``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged
from ..derivations import np  # NumPy on first use (the textbook extra)
from .seed004 import F64, _close, _gen, _randn, _scores, _verdict


# ------------------------------------------------------------ 位置信息的编码 (positions)
def _periodic(n: int, period: float) -> Tensor:
    """``(n, 2)`` = [sin(2πm/T), cos(2πm/T)] for m < n: attnlab's sinusoidal table with one
    explicit period (``periods=[T]``)."""
    from ...positional import sinusoidal

    return sinusoidal(n, 2, periods=[period], dtype=F64)


_PERIODIC_CALL = "sinusoidal(n, 2, periods=[T], dtype=torch.float64)"


@check("004-4-a")
def _permutation() -> Finding:
    from ... import MultiHeadAttention

    g = _gen(18)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(18)
        mha = MultiHeadAttention(16, 2).to(F64)
    x = _randn(g, 1, 7, 16)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    with torch.no_grad():
        y, w = mha(x, need_weights=True)
        yp, wp = mha(x[:, perm], need_weights=True)
    equivariant = _close(yp, y[:, perm])
    pair_scores = _close(wp, w[:, :, perm][:, :, :, perm])
    invariant = _close(yp, y)
    ok = equivariant and pair_scores and not invariant
    return Finding(
        computed=f"MHA(x[perm]) == MHA(x)[perm]: {equivariant}; every (query, key) pair keeps its "
        f"weight wherever it sits: {pair_scores}; MHA(x[perm]) == MHA(x) (invariance of the "
        f"sequence output): {invariant}",
        call="mha(x[:, perm], need_weights=True) vs mha(x, need_weights=True)[..][perm]",
        **_verdict(ok, "scores depend on the positions without a position encoding"),
    )


@check("004-4-b")
def _four_terms() -> Finding:
    from ... import attention
    from ...positional import sinusoidal

    g = _gen(19)
    x, v = _randn(g, 1, 9, 8), _randn(g, 1, 9, 3)
    p = sinusoidal(9, 8, dtype=F64).unsqueeze(0)
    xx, xp, px, pp = (a @ b.transpose(-1, -2) for a, b in ((x, x), (x, p), (p, x), (p, p)))
    s = (x + p) @ (x + p).transpose(-1, -2)
    split = _close(s, xx + xp + px + pp)
    scale = 1 / math.sqrt(8)
    full = attention(x + p, x + p, v)
    parts = attention(x, x, v, bias=(xp + px + pp) * scale)
    ok = split and _close(full, parts)
    return Finding(
        computed=f"(x+p)(x+p)ᵀ == xxᵀ + xpᵀ + pxᵀ + ppᵀ: {split}; attention(x+p, x+p, v) == "
        f"attention(x, x, v, bias=(xpᵀ + pxᵀ + ppᵀ)/√d): {_close(full, parts)}",
        call="attention(x + p, x + p, v) vs attention(x, x, v, bias=(x@p.mT + p@x.mT + "
        "p@p.mT) / math.sqrt(8)); p = sinusoidal(9, 8)",
        **_verdict(ok, "the four terms do not add up to the score"),
    )


def _unit_pair(g: torch.Generator, d: int) -> tuple[Tensor, Tensor]:
    basis, _ = torch.linalg.qr(_randn(g, d, 2))
    return basis[:, 0], basis[:, 1]


@check("004-4-c")
def _pe_dot() -> Finding:
    g = _gen(20)
    u, v = _unit_pair(g, 16)
    sc = _periodic(40, 10.0)  # (40, 2)
    p = 3.0 * (sc[:, :1] * u + sc[:, 1:] * v)  # (40, 16)
    i = torch.arange(40, dtype=F64)
    want = 9.0 * torch.cos(2 * math.pi * (i[:, None] - i[None, :]) / 10)
    ok = _close(p @ p.T, want)
    return Finding(
        computed=f"p_i·p_j == A² cos(2π(i−j)/T) for all 40×40 pairs: {ok}; e.g. p_0·p_3 = "
        f"{fmt(float(p[0] @ p[3]))}, p_10·p_13 = {fmt(float(p[10] @ p[13]))}",
        call=_PERIODIC_CALL + "; p = A * (sc[:, :1] * u + sc[:, 1:] * v); p @ p.T",
        **_verdict(ok, "p_i·p_j is not A² cos(2π(i−j)/T)"),
    )


@check("004-4-d")
def _orthogonal_only() -> Finding:
    g = _gen(20)
    u, v = _unit_pair(g, 16)
    v = 2 * v
    sc = _periodic(20, 10.0)
    p = sc[:, :1] * u + sc[:, 1:] * v
    gram = p @ p.T
    offsets = [float(gram[m, m + 3]) for m in (0, 1, 2)]
    depends_on_offset_only = max(offsets) - min(offsets) < 1e-12
    t = 2 * math.pi * np.arange(20) / 10.0
    closed = np.sin(t)[:, None] * np.sin(t)[None] * float(u @ u) + np.cos(t)[:, None] * np.cos(t)[
        None
    ] * float(v @ v)  # A²(|u|² sin_i sin_j + |v|² cos_i cos_j), u ⊥ v, A = 1
    return Finding(
        computed="|u| = 1, |v| = 2, u ⊥ v: p_m·p_(m+3) = "
        + ", ".join(f"{fmt(o)} (m={m})" for m, o in enumerate(offsets))
        + f"; a function of the offset alone: {depends_on_offset_only}",
        call=_PERIODIC_CALL + "; p = sc[:, :1] * u + sc[:, 1:] * (2 * v); p @ p.T",
        **judged(
            depends_on_offset_only,
            "the formula needs orthonormal u, v (|u| = |v| = 1): orthogonal u, v of different "
            "lengths give A²(|u|² sin_i sin_j + |v|² cos_i cos_j), which depends on i and j "
            "separately (equal lengths r give A²r² cos(2π(i − j)/T))",
            Derivation(
                ind.close(gram.numpy(), closed, 1e-12),
                "the closed form |u|² sin_i sin_j + |v|² cos_i cos_j with sin/cos(2πm/10) by "
                "numpy equals the Gram matrix of attnlab's encodings",
            ),
        ),
    )


@check("004-4-e")
def _relative() -> Finding:
    from ... import attention
    from ...positional import sinusoidal, sinusoidal_shift

    p = sinusoidal(24, 16, dtype=F64)
    _, w, lse = attention(
        p[None], p[None], p[None], scale=1.0, return_weights=True, return_lse=True
    )
    s = _scores(w, lse)[0]  # (24, 24)
    diag_spread = max(
        float(torch.diagonal(s, off).max() - torch.diagonal(s, off).min()) for off in range(-23, 24)
    )
    shift = sinusoidal_shift(5, 16)
    rotated = _close(p[5:], p[:-5] @ shift.T)
    ok = diag_spread < 1e-12 and rotated
    return Finding(
        computed=f"logits s_ij constant along every diagonal i − j (spread < 1e-12): "
        f"{diag_spread < 1e-12}; PE[m + 5] == M_5 · PE[m] (a fixed rotation): {rotated}",
        call="attention(p, p, p, scale=1.0, return_weights=True, return_lse=True); "
        "sinusoidal_shift(5, 16)",
        **_verdict(ok, "the scores of sinusoidal encodings depend on absolute positions"),
    )


@check("004-4-f")
def _dominance() -> Finding:
    from ... import attention

    g = _gen(21)
    d, n = 64, 128
    x, v = _randn(g, 1, n, d), _randn(g, 1, n, 2)
    u, w_ = _unit_pair(g, d)
    sc = _periodic(n, 16.0)
    off = ~torch.eye(n, dtype=torch.bool)  # pairs i != j (the self term x_i·x_i = dσ² aside)
    shares, tv_pos, tv_con = [], [], []
    _, w_content = attention(x, x, v, mask=off, return_weights=True)
    for c in (0.1, 1.0, 10.0):
        amp = math.sqrt(c * math.sqrt(d))
        p = amp * (sc[:, :1] * u + sc[:, 1:] * w_).unsqueeze(0)
        s = ((x + p) @ (x + p).transpose(-1, -2))[0][off]
        pos = (p @ p.transpose(-1, -2))[0][off]
        shares.append(1 - float((s - pos).var() / s.var()))
        _, w_full = attention(x + p, x + p, v, mask=off, return_weights=True)
        _, w_pos = attention(p, p, v, mask=off, return_weights=True)
        tv_pos.append(float((w_full - w_pos).abs().sum(-1).mean() / 2))
        tv_con.append(float((w_full - w_content).abs().sum(-1).mean() / 2))
    ok = shares[0] < 0.1 and shares[2] > 0.8 and 0.1 < shares[1] < 0.9
    ok &= tv_pos[0] > tv_con[0] and tv_pos[2] < tv_con[2]
    return Finding(
        computed="; ".join(
            f"A² = {c:g}·σ²√d: position share of score variance {fmt(sh, 2)}, TV to "
            f"position-only weights {fmt(tp, 2)}, to content-only {fmt(tc, 2)}"
            for c, sh, tp, tc in zip((0.1, 1, 10), shares, tv_pos, tv_con, strict=True)
        ),
        call="attention(x + p, x + p, v, mask=~eye, return_weights=True) vs attention(p, p, …) "
        "and attention(x, x, …); p = A·(sin·u + cos·v) from " + _PERIODIC_CALL,
        **_verdict(ok, "the position term does not take over around A² ≈ σ²√d"),
    )


@check("004-4-g")
def _aliasing() -> Finding:
    sc = _periodic(70, 7.0)
    same = _close(sc[7:], sc[:-7])
    distinct = bool(torch.cdist(sc[:7], sc[:7]).add(torch.eye(7, dtype=F64)).min() > 0.1)
    ok = same and distinct
    return Finding(
        computed=f"PE[j + 7] == PE[j] for j < 63: {same}; the 7 codes within one period are "
        f"distinct: {distinct}",
        call=_PERIODIC_CALL + " with T = 7",
        **_verdict(ok, "positions one period apart get different codes"),
    )


def _first_repeat(code: Tensor) -> int:
    """The smallest m > 0 with code[m] == code[0] (within 1e-9), or 0 if none."""
    hit = ((code[1:] - code[0]).abs().amax(-1) < 1e-9).nonzero()
    return int(hit[0, 0]) + 1 if hit.numel() else 0


@check("004-4-h")
def _coprime() -> Finding:
    parts, ok = [], True
    for t1, t2 in ((7, 9), (8, 12)):
        code = torch.cat([_periodic(200, float(t1)), _periodic(200, float(t2))], dim=1)
        rep = _first_repeat(code)
        ok &= rep == math.lcm(t1, t2)
        parts.append(
            f"T = ({t1}, {t2}): first repeat at {rep} (lcm {math.lcm(t1, t2)}, product {t1 * t2})"
        )
    return Finding(
        computed="; ".join(parts),
        call="torch.cat([" + _PERIODIC_CALL.replace("T", "T1") + ", … T2], dim=1)",
        **_verdict(ok, "the stacked code does not repeat at the lcm of the periods"),
    )


@check("004-4-i")
def _pe_breaks_symmetry() -> Finding:
    from ... import MultiHeadAttention, SinusoidalEmbedding

    g = _gen(18)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(18)
        mha = MultiHeadAttention(16, 2).to(F64)
    x = _randn(g, 1, 7, 16)
    pe = SinusoidalEmbedding(16, dtype=F64)(7)  # (7, 16)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    with torch.no_grad():
        plain = float((mha(x[:, perm]) - mha(x)[:, perm]).abs().max())
        with_pe = float((mha(x[:, perm] + pe) - mha(x + pe)[:, perm]).abs().max())
    ok = plain < 1e-12 and with_pe > 1e-6
    return Finding(
        computed=f"max change of a token's output when the sequence is reordered: without PE "
        f"< 1e-12: {plain < 1e-12}; with sinusoidal PE added {fmt(with_pe, 2)}",
        call="mha(x[:, perm] + pe) vs mha(x + pe)[:, perm]; pe = SinusoidalEmbedding(16)(7)",
        **_verdict(ok, "adding the position encoding does not make attention order-aware"),
    )
