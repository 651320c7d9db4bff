"""The worked solutions of the texts' exercises: seed 002 §8.8 (exercises 8.1–8.8) and the
hands-on exercises seed 004 announces (registered with `attnlab.textbook.exercises.exercise`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core import fmt
from ..exercises import exercise
from ._shared import (
    F64,
    _err,
    _gen,
    _io_flash,
    _mha,
    _randn_from,
    _sine_only_residual,
    _single_head_copy,
    _unscaled_saturation,
)
from .heads import _ex88_rank
from .masks import _ex84, _ex88_two_heads
from .memory import _ex86, _flash_memory
from .order import _invariance_claim
from .relative import _ex85, _relative_advantages, _rope_relative
from .scale import _ex83_shapes

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


# ===================================================================== hands-on exercises
# Seed 004 announces a hands-on chapter (forward, optimisations, backward) that the file lacks;
# these are ours (``from_text=False``), each checked live against attnlab.
_SOURCE = "seed 004, chapter 3 “动手实践” (announced)"


def _bottom_right_causal(L: int, S: int) -> Tensor:
    """keep[i, j] = j <= i + S − L (True = may attend), ``(L, S)``."""
    i = torch.arange(L).unsqueeze(-1)
    return torch.arange(S) <= i + (S - L)


def _forward_by_hand(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, P)``: softmax(q kᵀ/√D, masked) v, grouped heads, empty rows → 0."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (B, H, S, ·)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)  # a row with no key: keep exp() at 0, not NaN
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z == 0, 1.0, z)
    return p @ v, p


def _qkv(seed: int, L: int, S: int) -> tuple[Tensor, Tensor, Tensor]:
    g = _gen(seed)
    return _randn_from(g, 2, 4, L, 5), _randn_from(g, 2, 2, S, 5), _randn_from(g, 2, 2, S, 3)


@exercise("H1", title="Attention forward by hand", source=_SOURCE, from_text=False)
def _h1() -> str:
    from ... import attention, masks

    lines = [
        "Task: implement out = softmax(QKᵀ/√d_k + mask) V for (B, H, L, D) queries and",
        "(B, H_kv, S, D|Dv) keys/values (grouped heads), with a bottom-right causal mask.",
        "",
        "Steps: repeat each k/v head for its G = H/H_kv query heads; s = QKᵀ/√d_k; set masked",
        "s_ij = −∞ (keep j ≤ i + S − L); subtract the row max m_i (exp never overflows; a row",
        "with no key uses m_i = 0 so exp(−∞) = 0, not NaN); p = e / Σe (rows with Σe = 0 stay",
        "0); out = p V.",
        "",
        "Check against attnlab.attention (float64, B=2, H=4, H_kv=2, D=5, Dv=3, seed 40):",
    ]
    for L, S in ((7, 11), (9, 6)):
        q, k, v = _qkv(40, L, S)
        keep = _bottom_right_causal(L, S)
        mine, _ = _forward_by_hand(q, k, v, keep)
        ref = attention(q, k, v, mask=masks.causal())
        err = float((mine - ref).abs().max())
        empty = int((~keep.any(-1)).sum())
        zeros = bool((mine[..., ~keep.any(-1), :] == 0).all())
        lines.append(
            f"  L={L}, S={S}: max |mine − attnlab| = {err:.1e} (< 1e-12: {err < 1e-12}); "
            f"{empty} rows with no key, all zeros: {zeros}"
        )
    return "\n".join(lines)


def _tiled_forward(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, block: int):
    """Online softmax over key blocks: ``(out, lse)`` without an L×S tensor (only L×block)."""
    B, H, L, D = q.shape
    m = torch.full((B, H, L, 1), float("-inf"), dtype=q.dtype)  # running max
    z = torch.zeros(B, H, L, 1, dtype=q.dtype)  # running Σ exp(s − m)
    acc = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)  # running Σ exp(s − m) v
    for a in range(0, k.shape[2], block):
        b = min(a + block, k.shape[2])
        s = q @ k[:, :, a:b].transpose(-1, -2) / math.sqrt(D)  # (B, H, L, block)
        s = s.masked_fill(~keep[:, a:b], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        alpha = torch.exp(m - safe)  # rescales the old sums (0 while nothing was seen)
        e = torch.exp(s - safe)
        z = alpha * z + e.sum(-1, keepdim=True)
        acc = alpha * acc + e @ v[:, :, a:b]
        m = m_new
    out = acc / torch.where(z == 0, 1.0, z)
    lse = torch.where(z == 0, float("-inf"), m + z.log()).squeeze(-1)
    return out, lse


@exercise(
    "H2",
    title="Tiled online-softmax forward (FlashAttention's recurrence)",
    source=_SOURCE,
    from_text=False,
)
def _h2() -> str:
    from ... import attention, masks

    lines = [
        "Task: compute attention one key block at a time, never holding the L×S scores.",
        "",
        "Per query row keep m (max logit so far), z = Σ exp(s − m) and acc = Σ exp(s − m)·v. For",
        "a new block with logits s_b: m' = max(m, max s_b); α = exp(m − m'); z ← α z + Σ exp(s_b −",
        "m'); acc ← α acc + exp(s_b − m') V_b. At the end out = acc / z and lse = m + log z.",
        "Memory: L×block scores instead of L×S; the result is exact, not an approximation.",
        "",
        "Check against attnlab.attention(..., return_lse=True) (float64, B=2, H=4, D=5, Dv=3,",
        "L=13, S=29, bottom-right causal, seed 41):",
    ]
    g = _gen(41)
    q, k, v = _randn_from(g, 2, 4, 13, 5), _randn_from(g, 2, 4, 29, 5), _randn_from(g, 2, 4, 29, 3)
    keep = _bottom_right_causal(13, 29)
    ref, ref_lse = attention(q, k, v, mask=masks.causal(), return_lse=True)
    for block in (1, 4, 7, 29):
        out, lse = _tiled_forward(q, k, v, keep, block)
        err = max(float((out - ref).abs().max()), float((lse - ref_lse).abs().max()))
        lines.append(
            f"  block {block:>2}: max |mine − attnlab| over out and lse = {err:.1e} "
            f"(< 1e-12: {err < 1e-12}); largest score tile 13×{block} instead of 13×29"
        )
    return "\n".join(lines)


def _backward_by_hand(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, dout: Tensor):
    """``(dq, dk, dv)`` of ``Σ out·dout`` for `_forward_by_hand` (grouped heads summed)."""
    B, H, _, D = q.shape
    H_kv, G = k.shape[1], H // k.shape[1]
    out, p = _forward_by_hand(q, k, v, keep)
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    dv = p.transpose(-1, -2) @ dout  # (B, H, S, Dv)
    dp = dout @ vr.transpose(-1, -2)  # (B, H, L, S)
    delta = (dout * out).sum(-1, keepdim=True)  # D_i = Σ_j p_ij dp_ij = dout_i · out_i
    ds = p * (dp - delta)  # softmax backward; masked p = 0 gives ds = 0
    scale = 1 / math.sqrt(D)
    dq = scale * ds @ kr
    dk = scale * ds.transpose(-1, -2) @ q

    def fold(t: Tensor) -> Tensor:  # sum the G query heads that share one k/v head
        return t.view(B, H_kv, G, *t.shape[2:]).sum(2)

    return dq, fold(dk), fold(dv)


@exercise("H3", title="Attention backward by hand", source=_SOURCE, from_text=False)
def _h3() -> str:
    from ... import attention, masks

    lines = [
        "Task: derive and implement dQ, dK, dV for out = softmax(QKᵀ/√d + mask) V.",
        "",
        "With P the weights and dO the output gradient: dV = Pᵀ dO; dP = dO Vᵀ; the softmax",
        "Jacobian diag(p) − ppᵀ gives dS = P ∘ (dP − D) with D_i = Σ_j P_ij dP_ij = dO_i · O_i;",
        "then dQ = dS K / √d and dK = dSᵀ Q / √d. Masked entries have P = 0, so dS = 0 there;",
        "with grouped heads, dK and dV add up over the G query heads sharing a key head.",
        "",
        "Check against torch.autograd through attnlab.attention (float64, B=2, H=4, H_kv=2,",
        "D=5, Dv=3, bottom-right causal, seed 42):",
    ]
    g = _gen(42)
    for L, S in ((7, 11), (9, 6)):
        q, k, v = _qkv(42 + L, L, S)
        dout = _randn_from(g, 2, 4, L, 3)
        keep = _bottom_right_causal(L, S)
        mine = _backward_by_hand(q, k, v, keep, dout)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        (attention(*leaves, mask=masks.causal()) * dout).sum().backward()
        errs = [float((a - t.grad).abs().max()) for a, t in zip(mine, leaves, strict=True)]
        lines.append(
            f"  L={L}, S={S}: max |mine − autograd| dq {errs[0]:.1e}, dk {errs[1]:.1e}, "
            f"dv {errs[2]:.1e} (all < 1e-12: {max(errs) < 1e-12})"
        )
    return "\n".join(lines)


@exercise("H4", title="KV cache: incremental decoding", source=_SOURCE, from_text=False)
def _h4() -> str:
    from ... import KVCache, MultiHeadAttention, masks

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(43)
        mha = MultiHeadAttention(12, 3, num_kv_heads=1).to(F64).eval()
    x = _randn_from(_gen(43), 2, 11, 12)
    with torch.no_grad():
        full = mha(x, mask=masks.causal())
        cache = KVCache()
        steps = [mha(x[:, :5], mask=masks.causal(), cache=cache)]  # prefill 5 tokens
        steps += [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(5, 11)]
    err = float((torch.cat(steps, dim=1) - full).abs().max())
    no_cache = sum(t * t for t in range(6, 12))  # (query, key) pairs recomputed without a cache
    with_cache = sum(range(6, 12))
    return "\n".join(
        [
            "Task: generate token by token without recomputing the keys and values of the prefix.",
            "",
            "Causal attention lets token t see keys 0…t only, and those keys/values never change o"
            "nce",
            "computed; so store them (the KV cache) and, per new token, project only that token an"
            "d",
            "attend from its one query to the cached keys: O(t·d) per step instead of O(t²·d).",
            "",
            "Check with attnlab.MultiHeadAttention(12, 3, num_kv_heads=1) and attnlab.KVCache",
            "(float64, batch 2, prefill 5 tokens, then 6 one-token steps, seed 43):",
            f"  max |cached steps − full causal forward| = {err:.1e} (< 1e-12: {err < 1e-12});",
            f"  cache holds {len(cache)} tokens; score pairs for the 6 steps: {with_cache} with",
            f"  the cache vs {no_cache} recomputing each prefix.",
        ]
    )
