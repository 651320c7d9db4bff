"""Checks of the sinusoidal positional encoding: its formula, frequencies, periods, the shift by a
rotation and the tables the texts print (subjects ``sinusoid``, ``sin-cos``, ``frequencies``,
``periods``, ``exponent``, ``sinusoid-width``, ``sinusoid-rows``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import AGREES, Derivation, Finding, check, fmt, judged, tiny
from ..derivations import np  # NumPy on first use (the textbook extra)
from ._shared import (
    _PERIODIC_CALL,
    F64,
    _close,
    _err,
    _found,
    _gen,
    _periodic,
    _randn,
    _seq,
    _sine_only_residual,
    _unit_pair,
    _verdict,
)


@check("001-3.2-a")
def _same_word_differs() -> Finding:
    from ...positional import sinusoidal

    e = _seq(1, 64, 31)[0, 0]
    x = e + sinusoidal(512, 64, dtype=torch.float64)  # (512, 64): the word at every position
    dist = torch.cdist(x, x)
    closest = float(dist[~torch.eye(512, dtype=torch.bool)].min())
    return Finding(
        computed=f"512 copies of one word: the closest two differ by {closest:.3f} (L2)",
        call="e + sinusoidal(512, 64); torch.cdist",
        **judged(closest > 0.1, "two positions give the word the same representation"),
    )


#: The sinusoidal-encoding formula as each text's claim is checked: the API the text shows (the
#: module or the table function), the positions and width compared, and the claim's wording.
_PE_FORMULA = {
    "001-3.3-a": ("SinusoidalEmbedding", 2048, 512, "attnlab's encoding differs from the formula"),
    "002-8.2.2-a": ("sinusoidal", 64, 16, "the table differs from the formula"),
}


@check("001-3.3-a", "002-8.2.2-a")
def _pe_formula(cid: str) -> Finding:
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(…): attnlab's encoding against the
    formula, through the API and at the size of claim ``cid`` (`_PE_FORMULA`).

    Args:
        cid: the claim id.

    Returns:
        The finding: the largest difference from the formula.
    """
    from ...positional import SinusoidalEmbedding, sinusoidal

    api, n, d, why = _PE_FORMULA[cid]
    if api == "sinusoidal":
        pe = sinusoidal(n, d, dtype=F64)
        call, where = f"sinusoidal({n}, {d}, dtype=torch.float64)", ""
    else:
        pe = SinusoidalEmbedding(d, dtype=F64)(torch.arange(n))  # (n, d)
        call = f"SinusoidalEmbedding({d}, dtype=torch.float64)(torch.arange({n}))"
        where = f" over {n} positions"
    pos = torch.arange(n, dtype=F64)[:, None]
    angle = pos / 10000 ** (torch.arange(0, d, 2, dtype=F64) / d)
    err = max(
        float((pe[:, 0::2] - angle.sin()).abs().max()),
        float((pe[:, 1::2] - angle.cos()).abs().max()),
    )
    return _found(f"max |{api} − formula| = {_err(err)}{where}", call, err < 1e-12, why)


@check("001-3.3-b")
def _pe_unique_relative() -> Finding:
    from ... import SinusoidalEmbedding

    d, n, k = 64, 4096, 7
    pe = SinusoidalEmbedding(d, dtype=torch.float64)(torch.arange(n + k))
    dist = torch.cdist(pe[:n], pe[:n])
    dist.fill_diagonal_(float("inf"))
    nearest = float(dist.min())
    theta = k / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = theta.cos(), theta.sin()
    a, b = pe[:n, 0::2], pe[:n, 1::2]  # sin, cos of pos·ω
    shifted = torch.stack((a * c + b * s, b * c - a * s), dim=-1).flatten(-2)  # rotation by kω
    err = float((shifted - pe[k:]).abs().max())
    ok = nearest > 1e-3 and err < 1e-9
    return Finding(
        computed=f"smallest distance between two of 4096 codes {nearest:.4f}; PE(pos+7) = "
        f"R_7 PE(pos) for every pos to {tiny(err, 1e-9)}",
        call="SinusoidalEmbedding(64)(torch.arange(4103)); torch.cdist; rotation by 7ω_i",
        **judged(ok, "codes repeat or the shift is not a fixed rotation"),
    )


@check("001-3.3-c")
def _pe_zero_crossings() -> Finding:
    from ... import SinusoidalEmbedding

    pe = SinusoidalEmbedding(128, dtype=torch.float64)(torch.arange(1000))[:, 0::2]  # sines
    flips = (pe[1:].sign() != pe[:-1].sign()).sum(0)  # (64,) zero crossings
    ok = bool((flips[1:] <= flips[:-1]).all()) and int(flips[0]) > 100 * max(int(flips[-1]), 1)
    return Finding(
        computed=f"zero crossings over 1000 positions: dimension 0: {int(flips[0])}, 32: "
        f"{int(flips[16])}, 126: {int(flips[-1])} (non-increasing with the dimension)",
        call="SinusoidalEmbedding(128)(torch.arange(1000))[:, 0::2].sign() changes",
        **judged(ok, "the frequencies do not fall with the dimension"),
    )


@check("001-3.3-e")
def _binary_like() -> Finding:
    from ...positional import sinusoidal

    d, n = 128, 1024
    pe = sinusoidal(n, d, dtype=torch.float64)
    p = torch.arange(n, dtype=torch.float64)[:, None]
    omega = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    fit = float((pe[:, 0::2] - torch.sin(p * omega)).abs().max())  # digit i: sin(p·ω_i)
    ratio = omega[:-1] / omega[1:]  # the same factor between neighbouring digits
    closest = float(torch.pdist(pe).min())
    signs = len({tuple(r) for r in (pe > 0).to(torch.int64).tolist()})
    ok = fit < 1e-12 and float(ratio.max() - ratio.min()) < 1e-9 and closest > 0.1
    return Finding(
        computed=f"period ratio between neighbouring pairs {float(ratio[0]):.4f} for every pair "
        f"(binary digits: 2); closest two of {n} positions {closest:.3f} apart; unlike binary "
        f"digits the signs alone are not a unique code ({signs} distinct sign patterns)",
        call="sinusoidal(1024, 128) vs sin(p·10000^(−2i/d)); torch.pdist; (pe > 0) rows",
        **judged(ok, "the dimensions do not form a geometric ladder of periodic digits"),
    )


@check("001-3.4-a")
def _pe_geometry() -> Finding:
    from ... import SinusoidalEmbedding

    pe = SinusoidalEmbedding(512, dtype=torch.float64)(torch.arange(200))
    dist = (pe - pe[0]).norm(dim=-1)  # ‖PE(0) − PE(k)‖, the same for every start position
    drops = [k for k in range(1, 199) if dist[k + 1] < dist[k]]
    closed = all(abs(float(dist[k]) - ind.sinusoid_distance(k, 512)) < 1e-9 for k in range(200))
    wrong = bool(drops) and float(dist[1]) < float(dist[10])
    first = drops[0] if drops else None
    return Finding(
        computed=f"‖PE(p) − PE(p+k)‖: {float(dist[1]):.2f} (k=1), {float(dist[10]):.2f} (10), "
        f"{float(dist[100]):.2f} (100); first decrease at k={first}"
        + (f" ({float(dist[first]):.3f} → {float(dist[first + 1]):.3f})" if first else ""),
        call="SinusoidalEmbedding(512)(torch.arange(200)); (pe - pe[0]).norm(dim=-1)",
        **judged(
            not wrong,
            f"near positions are close, but the distance is not monotone in the offset: "
            f"it first falls at k={first}, so a farther position can be nearer in encoding space",
            Derivation(
                closed,
                "closed form ‖PE(p) − PE(p+k)‖ = √Σ(2 − 2cos(k/10000^(2i/d))) equals attnlab's "
                "distances for k = 0…199",
            ),
        ),
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
def _pe_geometric_frequencies() -> Finding:
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


@check("002-8.2.3-b", "001-3.3-d")
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


def _table_is_closed_form() -> bool:
    """attnlab's sinusoidal(300, 16), the sin/cos table these exercises compare with, equals
    the closed form."""
    from ...positional import sinusoidal

    return ind.close(sinusoidal(300, 16, dtype=F64).numpy(), ind.sinusoid(300, 16), 1e-9)


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
            abs(w_sin - r_sin) < 1e-9 and abs(w_pe - r_pe) < 1e-9 and _table_is_closed_form(),
            "attnlab's sinusoidal(300, 16) equals sin/cos(p/10000^(2i/16)) by math.sin and "
            f"math.cos; numpy least squares on the closed-form tables: residuals {fmt(w_sin)} "
            f"(sines) and {tiny(w_pe)} (sin/cos)",
        ),
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
            witness and abs(ind.shift_residual(closed) - resid) < 1e-9 and _table_is_closed_form(),
            "the closed-form modes cos(πk(j+½)/n) equal torch's eigenvectors at n = 16 and 32, "
            "with the same shift residual; attnlab's sin/cos table compared with equals its "
            "closed form",
        ),
    )


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
