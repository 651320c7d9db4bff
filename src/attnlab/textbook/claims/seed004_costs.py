"""Seed 004, the causal mask, the comparison with additive attention and the computational cost.

The checks of claims whose metadata is in ``claims/seed004.toml``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core import NOT_CHECKABLE, Finding, check, fmt
from ..exercises import exercise
from .seed004 import F64, _close, _gen, _randn, _verdict


# ------------------------------------------------------------------ 掩码机制 (causal mask)
@check("004-5.1-a")
def _causal_weights() -> Finding:
    from ... import attention, masks

    g = _gen(22)
    q, k, v = _randn(g, 2, 2, 9, 4), _randn(g, 2, 2, 9, 4), _randn(g, 2, 2, 9, 3)
    out, w = attention(q, k, v, mask=masks.causal(), return_weights=True)
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    zero = bool((w[..., future] == 0).all())
    sums = _close(w.sum(-1), torch.ones(2, 2, 9, dtype=F64))
    l_ij = (q @ k.transpose(-1, -2) / 2).masked_fill(future, float("-inf"))
    ref = torch.softmax(l_ij, -1) @ v
    # the strongest form: NaN keys and values at positions 5… leave rows 0–4 bit-identical
    # (values of width d = 4 here, on every backend)
    vd = _randn(g, 2, 2, 9, 4)
    k_nan, v_nan = k.clone(), vd.clone()
    k_nan[..., 5:, :], v_nan[..., 5:, :] = float("nan"), float("nan")
    isolated = True
    for be in ("auto", "reference", "flash"):
        plain = attention(q, k, vd, mask=masks.causal(), backend=be)
        out_nan = attention(q, k_nan, v_nan, mask=masks.causal(), backend=be)
        isolated &= bool((out_nan[..., :5, :] == plain[..., :5, :]).all())
    ok = zero and sums and _close(out, ref) and isolated
    return Finding(
        computed=f"weights at j > i exactly 0: {zero}; rows sum to 1: {sums}; output == "
        f"softmax(l) V with l_ij = −∞ for j > i: {_close(out, ref)}; NaN keys/values at "
        f"positions ≥ 5 leave rows 0–4 bit-identical (auto, reference, flash): {isolated}",
        call="attention(q, k, v, mask=masks.causal(), return_weights=True)",
        **_verdict(ok, "the causal weights leak to the future"),
    )


@check("004-5.1-b")
def _masked_grad() -> Finding:
    from ... import attention, masks

    g = _gen(23)
    q, k, v, dout = (_randn(g, 1, 1, 7, 4) for _ in range(4))
    future = torch.ones(7, 7, dtype=torch.bool).triu(1)
    grads = []
    for m in (10.0, 30.0, 1e9, float("inf")):
        b = torch.zeros(7, 7, dtype=F64).masked_fill(future, -m).requires_grad_()
        (attention(q, k, v, bias=b) * dout).sum().backward()
        grads.append(float(b.grad[future].abs().max()))
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = attention(q, kk, vv, mask=masks.causal())
    (out[..., :4, :] * dout[..., :4, :]).sum().backward()  # rows 0..3 only
    leak = float(kk.grad[..., 4:, :].abs().max() + vv.grad[..., 4:, :].abs().max())
    ok = grads[0] > grads[1] > 0 and grads[2] == 0 and grads[3] == 0 and leak == 0
    return Finding(
        computed=f"max |∂L/∂l_ij| over masked entries: M=10: {fmt(grads[0], 2)}, M=30: "
        f"{fmt(grads[1], 2)}, M=1e9: {grads[2]:g}, M=∞: {grads[3]:g}; gradient of rows 0–3 "
        f"w.r.t. k_j, v_j for j ≥ 4: {leak:g}",
        call="b = zeros(7, 7).masked_fill(future, -M).requires_grad_(); "
        "(attention(q, k, v, bias=b) * g).sum().backward(); b.grad",
        **_verdict(ok, "gradient flows through masked logits"),
    )


@check("004-5.1-c")
def _minus_1e9() -> Finding:
    from ... import attention, masks

    g = _gen(24)
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)
    parts, ok = [], True
    q, k, v = (_randn(g, 1, 2, 8, 4) for _ in range(3))
    for dt in (torch.float32, torch.float64):
        qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
        add = torch.zeros(8, 8, dtype=dt).masked_fill(future, -1e9)
        o1, w1 = attention(qq, kk, vv, mask=add, backend="reference", return_weights=True)
        o2 = attention(qq, kk, vv, mask=masks.causal(), backend="reference")
        zero = bool((w1[..., future] == 0).all())
        same = bool((o1 == o2).all())
        ok &= zero and same
        parts.append(
            f"{str(dt).removeprefix('torch.')}: masked weights exactly 0: {zero}, "
            f"output bit-equal to −∞ masking: {same}"
        )
    try:
        torch.zeros(2, dtype=torch.float16).masked_fill(torch.tensor([True, False]), -1e9)
        half = "float16 masked_fill(-1e9) works"
    except RuntimeError:
        half = "float16 cannot hold −1e9 (masked_fill(-1e9) raises; use torch.finfo(dtype).min)"
    return Finding(
        computed="; ".join(parts) + f"; {half}",
        call="attention(q, k, v, mask=zeros(8, 8).masked_fill(future, -1e9), "
        "backend='reference') vs attention(q, k, v, mask=masks.causal(), backend='reference')",
        **_verdict(ok, "−1e9 does not reproduce −∞ masking"),
    )


@check("004-5.1-d")
def _parallel_prefix() -> Finding:
    from ... import attention, masks

    g = _gen(34)
    q, k, v = (_randn(g, 2, 2, 10, 4) for _ in range(3))
    full = attention(q, k, v, mask=masks.causal())
    rows = torch.cat(
        [attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in range(10)],
        dim=2,
    )
    ok = _close(full, rows)
    return Finding(
        computed=f"one causal pass == 10 prefix-only calls, row by row: {ok}",
        call="attention(q, k, v, mask=masks.causal()) vs attention(q[:, :, i:i+1], "
        "k[:, :, :i+1], v[:, :, :i+1]) for each i",
        **_verdict(ok, "the causal pass differs from attending to the prefix"),
    )


# ---------------------------------------------------------- 与加性注意力的对比 (additive)
def _additive(dq: int, dk: int, hidden: int, seed: int, *, zero_bias: bool = True):
    """An `AdditiveAttention` in float64 with seeded init; ``zero_bias`` builds it with
    ``bias=False`` (the text's e = vᵀ tanh(W_1 q + W_2 k) has no bias)."""
    from ... import AdditiveAttention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AdditiveAttention(dq, dk, hidden, bias=not zero_bias).to(F64)


def _centred(w: Tensor) -> Tensor:
    """Logits up to a per-row constant: log w minus its row mean (softmax forgets the rest)."""
    lw = w.log()
    return lw - lw.mean(-1, keepdim=True)


@check("004-5.2-a")
def _additive_formula() -> Finding:
    attn = _additive(6, 6, 10, 25)
    g = _gen(25)
    q, k = _randn(g, 1, 4, 6), _randn(g, 1, 5, 6)
    with torch.no_grad():
        out, w = attn(q, k)
        w1, w2, vv = attn.query_proj.weight, attn.key_proj.weight, attn.v
        e = torch.tanh((q @ w1.T).unsqueeze(2) + (k @ w2.T).unsqueeze(1)) @ vv  # (1, 4, 5)
    ref = torch.softmax(e, -1)
    ok = _close(w, ref) and _close(out, ref @ k)
    return Finding(
        computed=f"weights == softmax(vᵀ tanh(W_1 q + W_2 k)): {_close(w, ref)}; output == "
        f"weights @ values: {_close(out, ref @ k)}",
        call="attn = AdditiveAttention(6, 6, 10, bias=False); attn(q, k)",
        **_verdict(ok, "AdditiveAttention does not compute vᵀ tanh(W_1 q + W_2 k)"),
    )


@check("004-5.2-b")
def _dot_even() -> Finding:
    from ... import attention

    g = _gen(26)
    wq, wk = _randn(g, 6, 4), _randn(g, 6, 4)
    q, k, v = _randn(g, 1, 4, 6), _randn(g, 1, 5, 6), _randn(g, 1, 5, 3)
    _, w = attention(q @ wq, k @ wk, v, return_weights=True)
    _, wn = attention(-q @ wq, -k @ wk, v, return_weights=True)
    ok = bool((w == wn).all())
    return Finding(
        computed=f"weights for (−q, −k) bit-equal to those for (q, k): {ok}",
        call="attention(-q @ wq, -k @ wk, v, return_weights=True) vs attention(q @ wq, k @ wk, …)",
        **_verdict(ok, "the bilinear score is not even"),
    )


@check("004-5.2-c")
def _additive_odd() -> Finding:
    g = _gen(27)
    q, k = _randn(g, 1, 4, 6), _randn(g, 1, 5, 6)
    res = {}
    for zero in (True, False):
        attn = _additive(6, 6, 10, 27, zero_bias=zero)
        with torch.no_grad():
            c, cn = _centred(attn(q, k)[1]), _centred(attn(-q, -k)[1])
        res[zero] = _close(cn, -c)
    ok = res[True] and not res[False]
    return Finding(
        computed=f"bias=False: centred logits of (−q, −k) == −(those of (q, k)): {res[True]}; with "
        f"AdditiveAttention's default key bias b ≠ 0 (vᵀ tanh(W_1 q + W_2 k + b)): {res[False]}",
        call="c = attn(q, k)[1].log(); attn(-q, -k)[1].log() (row-centred) vs -c",
        **_verdict(ok, "additive attention without bias is not odd"),
    )


@check("004-5.2-d")
def _not_equivalent() -> Finding:
    from ... import attention

    g = _gen(27)
    q, k = _randn(g, 1, 4, 6), _randn(g, 1, 5, 6)
    attn = _additive(6, 6, 10, 27)
    with torch.no_grad():
        wa, wan = attn(q, k)[1], attn(-q, -k)[1]
    _, wd = attention(q, k, k, return_weights=True)
    _, wdn = attention(-q, -k, k, return_weights=True)
    tv_add = float((wa - wan).abs().sum(-1).max() / 2)
    tv_dot = float((wd - wdn).abs().sum(-1).max() / 2)
    nonzero = float(_centred(wa).abs().max())
    ok = tv_dot == 0 and tv_add > 0.01 and nonzero > 0.01
    return Finding(
        computed=f"flipping (q, k) → (−q, −k) moves dot-product weights by TV {tv_dot:g} and "
        f"additive weights by TV up to {fmt(tv_add, 2)}; largest centred additive logit "
        f"{fmt(nonzero, 2)} (≠ 0): no dot-product score can match these weights at both inputs",
        call="attn(q, k)[1] vs attn(-q, -k)[1]; attention(±q, ±k, k, return_weights=True)",
        **_verdict(ok, "the parity argument does not separate the two forms"),
    )


@check("004-5.2-e")
def _additive_cost() -> Finding:
    from ... import attention
    from ...analysis import estimate
    from .seed000 import _measured

    n, d = 128, 64
    est = estimate(n, d, 1)
    dot_flops = est.value("scores QKᵀ", "naive") + est.value("weighted sum PV", "naive")
    attn = _additive(d, d, d, 28)
    g = _gen(28)
    q = _randn(g, 1, n, d)
    with torch.no_grad():
        out, w = attn(q, q)
    h = attn.query_proj.weight.shape[0]
    # measured on the module's own call: the matmuls (projections, weighted sum) and the largest
    # tensor it keeps, the (L, S, h) tanh layer; + its broadcast sum and vᵀ·tanh (3 per unit)
    with torch.device("meta"):
        meta = _additive(d, d, d, 28).float()
    matmul, tanh_evals = _measured(lambda x: meta(x, x), (1, n, d))
    add_flops = matmul + 3 * tanh_evals
    dot_mm, _ = _measured(lambda x: attention(x, x, x, backend="reference"), (1, 1, n, d))
    exp_evals = int(w.numel())
    ok = (
        tuple(out.shape) == (1, n, d)
        and tanh_evals >= h * exp_evals
        and add_flops > dot_flops
        and dot_mm == dot_flops  # the counted matmuls are the cost model's
    )
    return Finding(
        computed=f"FLOPs: dot {int(dot_flops):,} (QKᵀ + PV, all matmul), additive {add_flops:,} "
        f"(projections, the n×n×h sum, vᵀ·tanh, PV); transcendental evaluations: dot "
        f"{exp_evals:,} exp, additive {tanh_evals:,} tanh + {exp_evals:,} exp; largest "
        f"intermediate: dot n² = {n * n:,} elements, additive n²h = {tanh_evals:,}",
        call="estimate(128, 64, 1).value('scores QKᵀ' / 'weighted sum PV', 'naive'); "
        "AdditiveAttention(64, 64, 64)(q, q); FlopCounterMode and saved_tensors_hooks around it "
        "and attention(q, q, q, backend='reference') on meta",
        **_verdict(ok, "the additive form is not the costlier one"),
    )


@check("004-5.2-f")
def _different_dims() -> Finding:
    from ... import MultiHeadAttention, attention

    g = _gen(29)
    q, k = _randn(g, 1, 3, 5), _randn(g, 1, 4, 7)
    out, _ = _additive(5, 7, 6, 29)(q, k)
    try:
        attention(q, k, k)
        dot_raises = False
    except ValueError:
        dot_raises = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(29)
        mha = MultiHeadAttention(8, 2, kdim=7, vdim=7).to(F64)
    y = mha(_randn(g, 1, 3, 8), k, k)
    ok = tuple(out.shape) == (1, 3, 7) and dot_raises and tuple(y.shape) == (1, 3, 8)
    return Finding(
        computed=f"AdditiveAttention(5, 7, 6): out {tuple(out.shape)}; attention with q size 5 "
        f"and k size 7 raises ValueError: {dot_raises}; MultiHeadAttention(kdim=7) projects "
        f"both to one size: out {tuple(y.shape)}",
        call="AdditiveAttention(5, 7, 6)(q, k); attention(q, k, k); "
        "MultiHeadAttention(8, 2, kdim=7, vdim=7)(x, k, k)",
        **_verdict(ok, "additive attention does not accept different query and key sizes"),
    )


# ------------------------------------------------------------ 计算效率考量 (efficiency)
@check("004-5.3-a")
def _qk_flops() -> Finding:
    from ...analysis import estimate

    vals = {
        (n, d): estimate(n, d, 1).value("scores QKᵀ", "naive")
        for n in (1024, 2048)
        for d in (64, 128)
    }
    exact = all(v == 2 * n * n * d for (n, d), v in vals.items())
    ok = exact and vals[2048, 64] == 4 * vals[1024, 64] and vals[1024, 128] == 2 * vals[1024, 64]
    return Finding(
        computed="; ".join(f"n={n}, d={d}: {int(v):,} FLOPs" for (n, d), v in vals.items())
        + f" (= 2n²d: {exact}; 2× n → 4×, 2× d → 2×)",
        call="estimate(n, d, 1).value('scores QKᵀ', 'naive')",
        **_verdict(ok, "the QKᵀ cost is not quadratic in n and linear in d"),
    )


@check("004-5.3-b")
def _score_memory() -> Finding:
    from ... import attention
    from ...analysis import estimate

    mem = {n: estimate(n, 64, 1).value("score matrix", "naive") for n in (1024, 2048, 4096)}
    g = _gen(30)
    x = _randn(g, 1, 33, 8)
    _, w = attention(x, x, x, return_weights=True)
    ok = all(m == 4 * n * n for n, m in mem.items()) and tuple(w.shape) == (1, 33, 33)
    return Finding(
        computed="; ".join(f"n={n}: {int(m) // 2**20} MiB" for n, m in mem.items())
        + f" (= 4n² bytes); attention(..., return_weights=True) at n=33: {tuple(w.shape)}",
        call="estimate(n, 64, 1).value('score matrix', 'naive')",
        **_verdict(ok, "the score matrix is not n × n"),
    )


@check("004-5.3-c")
def _long_sequences() -> Finding:
    from ...analysis import estimate

    parts, shares = [], {}
    for n in (512, 1536, 4096, 8192):
        est = estimate(n, 768, 12)
        quad = sum(est.value(r, "naive") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))
        shares[n] = quad / est.value("total", "naive")
        parts.append(
            f"n={n}: n²-terms {fmt(100 * shares[n], 3)} % of the layer's FLOPs, score "
            f"matrix {est.value('score matrix', 'naive') / 2**20:,.0f} MiB"
        )
    ok = shares[512] < 0.5 < shares[4096] < shares[8192]
    return Finding(
        computed="; ".join(parts),
        call="estimate(n, 768, 12): rows 'scores QKᵀ' + 'softmax' + 'weighted sum PV' over "
        "'total'; 'score matrix'",
        **_verdict(ok, "the n² terms do not dominate at n > 4096"),
    )


@check("004-5.3-d")
def _flash_exact() -> Finding:
    from ... import attention, explain, masks

    g = _gen(31)
    q, k, v = (_randn(g, 2, 3, 200, 16) for _ in range(3))
    diffs = []
    for m in (None, masks.causal()):
        a = attention(q, k, v, mask=m, backend="flash")
        b = attention(q, k, v, mask=m, backend="reference")
        diffs.append(_close(a, b))
    plan = explain(q, k, v, mask=masks.causal(), backend="flash").split("; ", 1)[-1]
    try:
        attention(q, k, v, backend="flash", return_weights=True)
        no_matrix = False
    except ValueError:  # the tiled backend has no n × n weights to return
        no_matrix = True
    ok = all(diffs) and no_matrix
    return Finding(
        computed=f"flash == reference within 1e-12: unmasked {diffs[0]}, causal {diffs[1]}; "
        f"explain (causal): {plan}; asking it for the n × n weights raises ValueError (it never "
        f"forms them): {no_matrix}",
        call="attention(q, k, v, mask=m, backend='flash') vs backend='reference'",
        **_verdict(ok, "the tiled result differs from standard attention"),
    )


@check("004-5.3-e")
def _online_merge() -> Finding:
    from ... import attention, merge_partials

    g = _gen(32)
    q, k, v = _randn(g, 1, 2, 10, 5), _randn(g, 1, 2, 23, 5), _randn(g, 1, 2, 23, 3)
    parts = [
        attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
        for a, b in ((0, 8), (8, 16), (16, 23))
    ]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    full, full_lse = attention(q, k, v, return_lse=True)
    ok = _close(out, full) and _close(lse, full_lse)
    return Finding(
        computed=f"merge of 3 key blocks == full attention: out {_close(out, full)}, lse "
        f"{_close(lse, full_lse)}",
        call="merge_partials([o1, o2, o3], [l1, l2, l3]) vs attention(q, k, v, return_lse=True)",
        **_verdict(ok, "block results do not merge into the full result"),
    )


@check("004-5.3-f")
def _linear_memory() -> Finding:
    from ...analysis import estimate

    a, b = estimate(2048, 768, 12), estimate(4096, 768, 12)
    kept = {
        i: b.value("activations kept for backward", i) / a.value("activations kept for backward", i)
        for i in ("naive", "flash")
    }
    tile = (a.value("score matrix", "flash"), b.value("score matrix", "flash"))
    ok = abs(kept["flash"] - 2) < 1e-9 and kept["naive"] > 3.5 and tile[0] == tile[1]
    return Finding(
        computed=f"doubling n multiplies the memory kept for backward by {fmt(kept['naive'], 3)} "
        f"(naive) and {fmt(kept['flash'], 3)} (flash); flash's transient scores stay "
        f"{int(tile[0]) // 2**10} KiB at both lengths (one 128×128 float32 tile per head)",
        call="estimate(n, 768, 12).value('activations kept for backward', impl)",
        **_verdict(ok, "the tiled form's memory is not linear in n"),
    )


@check("004-5.3-g")
def _flash_backward() -> Finding:
    from ... import attention, masks

    g = _gen(33)
    base = [_randn(g, 1, 2, 150, 8) for _ in range(3)]
    dout = _randn(g, 1, 2, 150, 8)
    grads = {}
    for be in ("flash", "reference"):
        qkv = [t.clone().requires_grad_() for t in base]
        (attention(*qkv, mask=masks.causal(), backend=be) * dout).sum().backward()
        grads[be] = [t.grad for t in qkv]
    ok = all(_close(a, b) for a, b in zip(grads["flash"], grads["reference"], strict=True))
    return Finding(
        computed=f"flash (recomputing) gradients dq, dk, dv == reference within 1e-12: {ok}",
        call="(attention(q, k, v, mask=masks.causal(), backend='flash') * g).sum().backward()",
        **_verdict(ok, "the recomputing backward differs from the stored one"),
    )


@check("004-5.3-h")
def _sram_hbm() -> Finding:
    from ...functional.flash import BLOCK_K, BLOCK_Q

    return Finding(
        computed=f"attnlab's CPU tiled backend uses {BLOCK_Q}×{BLOCK_K} tiles (CPU caches, no "
        "HBM/SRAM split to count)",
        call="attnlab.functional.flash.BLOCK_Q, BLOCK_K",
        verdict=NOT_CHECKABLE,
        explanation="needs a GPU with SRAM/HBM and its memory-traffic counters; attnlab runs "
        "and measures on the CPU here",
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
    return _randn(g, 2, 4, L, 5), _randn(g, 2, 2, S, 5), _randn(g, 2, 2, S, 3)


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
    q, k, v = _randn(g, 2, 4, 13, 5), _randn(g, 2, 4, 29, 5), _randn(g, 2, 4, 29, 3)
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
        dout = _randn(g, 2, 4, L, 3)
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
    x = _randn(_gen(43), 2, 11, 12)
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
