"""Checks of the score functions: dot product, additive (Bahdanau) and cosine scores, their
widths, parameters and geometry (subjects ``dot``, ``additive``, ``additive-bias``, ``widths``,
``cosine``, ``dot-feature-map``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny
from ..derivations import np  # NumPy on first use (the textbook extra)
from ._shared import _DKS, F64, _additive, _close, _gen, _heads_seq, _qkv_nm, _randn_from, _verdict


@check("000-dot-a")
def _dot_geometry() -> Finding:
    from ...functional.request import get_score

    dot, cos = get_score("dot"), get_score("cosine")
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 100, 16, generator=g, dtype=torch.float64)
    d = (dot.prepare(q) * dot.prepare(k)).sum(-1)
    c = (cos.prepare(q) * cos.prepare(k)).sum(-1)
    err = float((d - q.norm(dim=-1) * k.norm(dim=-1) * c).abs().max())
    e = torch.eye(2, dtype=torch.float64)
    ends = [float((e[0] * x).sum()) for x in (e[0], e[1], -e[0])]
    ok = err < 1e-12 and ends == [1.0, 0.0, -1.0]
    return Finding(
        computed=f"max |q·k − |q||k|cos θ| = {tiny(err)} over 100 pairs; unit vectors at 0°, 90°, "
        f"180°: {ends}",
        call="get_score('dot') vs norms × get_score('cosine')",
        **judged(ok, "q·k differs from |q||k|cos θ"),
    )


@check("000-add-a")
def _additive_formula() -> Finding:
    from ... import AdditiveAttention

    torch.manual_seed(5)
    m = AdditiveAttention(8, 8, 8, bias=False).double()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, 8, generator=g, dtype=torch.float64) for n in (3, 5, 5))
    hidden = (q @ m.query_proj.weight.T).unsqueeze(2) + (k @ m.key_proj.weight.T).unsqueeze(1)
    e = torch.tanh(hidden) @ m.v  # (1, 3, 5)
    _, w = m(q, k, v)
    err = float((w - torch.softmax(e, -1)).detach().abs().max())
    ok = err < 1e-12
    return Finding(
        computed=f"max |weights − softmax(vᵀ tanh(W_q q + W_k k))| = {tiny(err)}",
        call="AdditiveAttention(8, 8, 8, bias=False)(q, k, v)",
        **judged(ok, "the module's weights differ from the formula"),
    )


@check("000-add-b")
def _additive_dims() -> Finding:
    from ... import AdditiveAttention, attention

    torch.manual_seed(12)
    m = AdditiveAttention(5, 7, 6).double()
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 3, 5, generator=g, dtype=torch.float64)
    k = torch.randn(1, 4, 7, generator=g, dtype=torch.float64)
    out, w = m(q, k, k)
    try:
        attention(q[:, None], k[:, None], k[:, None])
        dot = "accepted"
    except ValueError:
        dot = "refused (ValueError)"
    ok = tuple(out.shape) == (1, 3, 7) and tuple(w.shape) == (1, 3, 4) and dot != "accepted"
    return Finding(
        computed=f"AdditiveAttention(5, 7, 6): weights {tuple(w.shape)}, output "
        f"{tuple(out.shape)}; the dot product of 5- and 7-vectors: {dot}",
        call="AdditiveAttention(5, 7, 6)(q, k, k) vs attention(q, k, v) with d_q=5, d_k=7",
        **judged(ok, "additive attention does not accept different query and key sizes"),
    )


def _additive_scores(m, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``D(q_i, k_i) = e(q_i, k_i) − e(q_i, 0)`` of an `AdditiveAttention` per pair, read from
    the module's own weights: each query attends to ``[k_i, 0]``, and the log-ratio of the two
    weights is the difference of their scores (softmax cancels the rest). With ``e`` odd in
    ``(q, k)`` (no bias), ``D`` is odd too; a bias inside the tanh makes both not odd."""
    keys = torch.stack([k, torch.zeros_like(k)], 1)  # (N, 2, d)
    _, w = m(q[:, None], keys, keys)  # (N, 1, 2)
    return (w[:, 0, 0].log() - w[:, 0, 1].log()).detach()


def _additive_by_hand(m, q: torch.Tensor, k: torch.Tensor):
    """The same differences from the module's weight matrices in numpy (the independent side)."""
    import numpy as np

    wq, wk = m.query_proj.weight.numpy(), m.key_proj.weight.numpy()
    b = sum(lin.bias.numpy() for lin in (m.query_proj, m.key_proj) if lin.bias is not None)

    def e(kk):
        return np.tanh(q.numpy() @ wq.T + kk @ wk.T + b) @ m.v.numpy()

    return e(k.numpy()) - e(np.zeros_like(k.numpy()))


@check("000-add-d")
def _additive_universal() -> Finding:
    from ... import AdditiveAttention

    g = torch.Generator().manual_seed(14)
    q, k = (torch.randn(2000, 8, generator=g, dtype=torch.float64) for _ in range(2))
    odd, fit, by_hand = {}, {}, True
    for bias in (False, True):
        torch.manual_seed(14)
        m = AdditiveAttention(8, 8, 64, bias=bias).double().requires_grad_(False)
        e, e_neg = _additive_scores(m, q, k), _additive_scores(m, -q, -k)
        by_hand &= ind.close(e.numpy(), _additive_by_hand(m, q, k), 1e-10)
        odd[bias] = float((e + e_neg).abs().max())
        # least-squares fit of q·k by the score over the symmetric sample {(q, k), (−q, −k)}
        x, s = torch.cat([e, e_neg]), torch.cat([(q * k).sum(-1)] * 2)
        fit[bias] = float((x @ s) / (x @ x))
    wrong = odd[False] < 1e-12 and abs(fit[False]) < 1e-12 and odd[True] > 1e-3
    return Finding(
        computed=f"bias-free: with D(q, k) = e(q, k) − e(q, 0) read from the module's weights, "
        f"max |D(q, k) + D(−q, −k)| = {tiny(odd[False])} (odd), its best "
        f"multiple fitting q·k on the symmetric sample is {tiny(abs(fit[False]))}; with the tanh "
        f"bias: {odd[True]:.3g} (not odd)",
        call="AdditiveAttention(8, 8, 64, bias=False|True)(q, [k, 0], [k, 0]): D = log w_k − "
        "log w_0 at (q, k) and (−q, −k)",
        **judged(
            not wrong,
            "the formula as written (no bias) is odd in (q, k), so it cannot approximate an even "
            "score such as q·k at all; universal approximation needs the bias inside the tanh "
            "(a one-hidden-layer network of [q; k], 2d² + 2d parameters)",
            Derivation(
                by_hand,
                "vᵀ tanh(W_q q + W_k k (+ b)) in numpy from the module's weight matrices, "
                "its differences equal to the module's to 1e-10",
            ),
        ),
    )


@check("000-compare-a")
def _additive_parameters() -> Finding:
    from ... import AdditiveAttention

    d = 64
    n = sum(p.numel() for p in AdditiveAttention(d, d, d, bias=False).parameters())
    with_bias = sum(p.numel() for p in AdditiveAttention(d, d, d).parameters())
    ok = n == 2 * d * d + d
    return Finding(
        computed=f"d=64: {n:,} parameters (2d² + d = {2 * d * d + d:,}); with the tanh bias "
        f"{with_bias:,}; attention(score='dot'|'cosine') has none",
        call="sum(p.numel() for p in AdditiveAttention(64, 64, 64, bias=False).parameters())",
        **judged(ok, "the parameter count differs from 2d² + d"),
    )


@check("000-cos-a")
def _cosine_invariance() -> Finding:
    from ... import attention

    q, k, v = _qkv_nm(4, 6, 32, 3, seed=6)
    q, k = q * 1000, k * 1000
    out, w = attention(q, k, v, score="cosine", return_weights=True)
    scaled = attention(q * 7.5, k * 0.01, v, score="cosine")
    logits = torch.log(w) - torch.log(w).amin(-1, keepdim=True)  # spread of the scores
    err = float((out - scaled).abs().max())
    ok = err < 1e-12 and float(logits.max()) <= 2.0 + 1e-12
    return Finding(
        computed=f"rescaling q by 7.5 and k by 0.01 changes the output by {tiny(err)}; the largest "
        f"score spread in a row is {float(logits.max()):.3f} ≤ 2 (scores in [-1, 1])",
        call="attention(q, k, v, score='cosine') vs attention(7.5 q, 0.01 k, v, score='cosine')",
        **judged(ok, "cosine attention depends on the lengths"),
    )


@check("003-4.3-b")
def _dynamic_range() -> Finding:
    from ...functional.reference import adaptive_span_attention, span_ramp

    q, k, v = (_heads_seq(12, 8, seed=5 + i) for i in range(3))
    z = torch.tensor([2.0], dtype=torch.float64)
    _, w = adaptive_span_attention(q, k, v, z, ramp=2.0)
    i = torch.arange(12)
    dist = (i[:, None] - i[None, :]).to(torch.float64)  # x = i − j
    m = torch.where(dist >= 0, span_ramp(dist, z, 2.0), 0.0)  # causal ramp, (12, 12)
    text = torch.softmax((q @ k.mT / 8**0.5) * m, dim=-1)  # the text's ⊙ f on the logits
    outside = m == 0
    leak = float((text * outside).sum(-1).max())  # weight on keys outside the span, per row
    ramp = np.where(dist.numpy() >= 0, ind.span_ramp(dist.numpy(), 2.0, 2.0), 0.0)
    a = ramp * np.exp(q[0, 0].numpy() @ k[0, 0].numpy().T / 8**0.5)  # a_ij ∝ m_ij·exp(s_ij)
    witness = ind.close(w.reshape(12, 12).numpy(), a / a.sum(-1, keepdims=True))
    ours = float(w[..., outside].abs().max())
    wrong = ours == 0.0 and leak > 0.1
    return Finding(
        computed=f"⊙ on the logits leaves up to {leak:.3f} of a row's weight on keys outside the "
        f"span (f = 0 gives logit 0, not −∞); the adaptive span's weights there: {ours:g}",
        call="adaptive_span_attention(q, k, v, z, ramp=2.0) vs softmax((q @ k.mT / √d) * m)",
        **judged(
            not wrong,
            "a range must scale the weights, not the logits: a_ij ∝ f_ij·exp(s_ij), i.e. "
            "softmax(QKᵀ/√d_k + log f)V (Sukhbaatar et al.); scaling a logit by f only changes its "
            "temperature and keeps every key",
            Derivation(
                witness,
                "a_ij ∝ m_z(i − j)·exp(q_i·k_j/√d) with the ramp in closed form, in numpy, "
                "equals the adaptive span's weights",
            ),
        ),
    )


@check("004-2-b")
def _mean_zero() -> Finding:
    from ...functional.request import get_score

    dot, g = get_score("dot"), _gen(6)
    ok, parts = True, []
    for d in (4, 64):
        ell = (dot.prepare(_randn_from(g, 20_000, d)) * dot.prepare(_randn_from(g, 20_000, d))).sum(
            -1
        )
        se = math.sqrt(d / 20_000)
        ok &= abs(float(ell.mean())) < 4 * se
        parts.append(
            f"d_k={d}: mean q·k = {fmt(float(ell.mean()), 2)} (standard error {fmt(se, 2)})"
        )
    return Finding(
        computed="; ".join(parts),
        call="s = get_score('dot'); (s.prepare(q) * s.prepare(k)).sum(-1).mean()",
        **_verdict(ok, "the sample mean of q·k is not 0"),
    )


@check("004-2-c")
def _term_variance() -> Finding:
    from ...functional.request import get_score

    dot, g = get_score("dot"), _gen(7)
    prod = (dot.prepare(_randn_from(g, 200_000, 1)) * dot.prepare(_randn_from(g, 200_000, 1))).sum(
        -1
    )
    var = float(prod.var())
    ok = abs(var - 1) < 0.02
    return Finding(
        computed=f"Var(q_i k_i) = {fmt(var)}",
        call="(s.prepare(q) * s.prepare(k)).sum(-1).var() with d_k = 1",
        **_verdict(ok, "the variance of one product term is not 1"),
    )


@check("004-2-f")
def _magnitude() -> Finding:
    from ...functional.request import get_score

    dot, g = get_score("dot"), _gen(8)
    ok, parts = True, []
    for d in _DKS:
        ell = (dot.prepare(_randn_from(g, 4000, d)) * dot.prepare(_randn_from(g, 4000, d))).sum(-1)
        mean_abs, want = float(ell.abs().mean()), math.sqrt(2 * d / math.pi)
        ok &= abs(mean_abs / want - 1) < 0.1
        parts.append(
            f"d_k={d}: mean |q·k| = {fmt(mean_abs, 3)}, max {fmt(float(ell.abs().max()), 3)}"
        )
    return Finding(
        computed="; ".join(parts),
        call="(s.prepare(q) * s.prepare(k)).sum(-1).abs().mean()",
        **_verdict(ok, "|q·k| does not grow like √d_k"),
    )


@check("004-2-k")
def _sum_of_variances() -> Finding:
    from ...functional.request import get_score

    dot, g = get_score("dot"), _gen(35)
    terms = dot.prepare(_randn_from(g, 50_000, 8)) * dot.prepare(
        _randn_from(g, 50_000, 8)
    )  # (n, 8)
    cov = torch.cov(terms.T)  # (8, 8)
    off = cov[~torch.eye(8, dtype=torch.bool)].abs().max()
    var_sum, sum_var = float(terms.sum(-1).var()), float(cov.diagonal().sum())
    ok = float(off) < 4 / math.sqrt(50_000) and abs(var_sum / sum_var - 1) < 0.03
    return Finding(
        computed=f"largest |Cov(q_i k_i, q_j k_j)|, i ≠ j: {fmt(float(off), 2)}; Var(Σ_i q_i k_i) "
        f"= {fmt(var_sum)}, Σ_i Var(q_i k_i) = {fmt(sum_var)}",
        call="terms = s.prepare(q) * s.prepare(k); torch.cov(terms.T); terms.sum(-1).var()",
        **_verdict(ok, "the product terms are correlated"),
    )


def _centred(w: Tensor) -> Tensor:
    """Logits up to a per-row constant: log w minus its row mean (softmax forgets the rest)."""
    lw = w.log()
    return lw - lw.mean(-1, keepdim=True)


@check("004-5.2-a")
def _additive_weights_and_output() -> Finding:
    attn = _additive(6, 6, 10, 25)
    g = _gen(25)
    q, k = _randn_from(g, 1, 4, 6), _randn_from(g, 1, 5, 6)
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
    wq, wk = _randn_from(g, 6, 4), _randn_from(g, 6, 4)
    q, k, v = _randn_from(g, 1, 4, 6), _randn_from(g, 1, 5, 6), _randn_from(g, 1, 5, 3)
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
    q, k = _randn_from(g, 1, 4, 6), _randn_from(g, 1, 5, 6)
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
    q, k = _randn_from(g, 1, 4, 6), _randn_from(g, 1, 5, 6)
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


@check("004-5.2-f")
def _different_dims() -> Finding:
    from ... import MultiHeadAttention, attention

    g = _gen(29)
    q, k = _randn_from(g, 1, 3, 5), _randn_from(g, 1, 4, 7)
    out, _ = _additive(5, 7, 6, 29)(q, k)
    try:
        attention(q, k, k)
        dot_raises = False
    except ValueError:
        dot_raises = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(29)
        mha = MultiHeadAttention(8, 2, kdim=7, vdim=7).to(F64)
    y = mha(_randn_from(g, 1, 3, 8), k, k)
    ok = tuple(out.shape) == (1, 3, 7) and dot_raises and tuple(y.shape) == (1, 3, 8)
    return Finding(
        computed=f"AdditiveAttention(5, 7, 6): out {tuple(out.shape)}; attention with q size 5 "
        f"and k size 7 raises ValueError: {dot_raises}; MultiHeadAttention(kdim=7) projects "
        f"both to one size: out {tuple(y.shape)}",
        call="AdditiveAttention(5, 7, 6)(q, k); attention(q, k, k); "
        "MultiHeadAttention(8, 2, kdim=7, vdim=7)(x, k, k)",
        **_verdict(ok, "additive attention does not accept different query and key sizes"),
    )


@check("004-5.3-d")
def _flash_exact() -> Finding:
    from ... import attention, explain, masks

    g = _gen(31)
    q, k, v = (_randn_from(g, 2, 3, 200, 16) for _ in range(3))
    diffs = []
    for m in (None, masks.causal()):
        a = attention(q, k, v, mask=m, backend="flash")
        b = attention(q, k, v, mask=m, backend="reference")
        diffs.append(_close(a, b))
    e = explain(q, k, v, mask=masks.causal(), backend="flash")
    plan = f"{e.plan}; engines: {'; '.join(e.engines)}; {e.kernels}"
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


@check("004-5.3-g")
def _flash_backward() -> Finding:
    from ... import attention, masks

    g = _gen(33)
    base = [_randn_from(g, 1, 2, 150, 8) for _ in range(3)]
    dout = _randn_from(g, 1, 2, 150, 8)
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
