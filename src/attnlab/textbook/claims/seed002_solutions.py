"""Seed 002, the worked solutions of exercises 8.1–8.8 (§8.8).

The checks of claims whose metadata is in ``claims/seed002.toml``.
"""

from __future__ import annotations

import math

from ..core import (
    fmt,
)
from ..exercises import exercise
from .seed002 import _err, _mha
from .seed002_costs import _flash_memory
from .seed002_exercises import (
    _ex83_shapes,
    _ex84,
    _ex85,
    _ex86,
    _ex88_rank,
    _ex88_two_heads,
    _io_flash,
    _sine_only_residual,
    _single_head_copy,
    _unscaled_saturation,
)
from .seed002_positions import _invariance_claim, _relative_advantages, _rope_relative

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
