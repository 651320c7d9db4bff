"""Checks of the attention weights: rows that are distributions, one softmax per query, the
weighted sum of values, entropy and the Nadaraya–Watson and retrieval views (subjects
``weights``, ``weights-3d``, ``query-softmax``, ``entropy``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny
from ._shared import (
    F64,
    _close,
    _err,
    _found,
    _gen,
    _heads_seq,
    _qkv,
    _qkv_nm,
    _randn_from,
    _scores,
    _verdict,
)


@check("000-steps-a")
def _rows_are_distributions() -> Finding:
    from ... import attention

    q, k, v = _qkv_nm(6, 9, 8, 5, seed=1)
    out, w = attention(q, k, v, return_weights=True)
    row_sum = float((w.sum(-1) - 1).abs().max())
    avg = float((out - w @ v).abs().max())
    ok = row_sum < 1e-12 and avg < 1e-12 and bool((w >= 0).all()) and bool((w <= 1).all())
    return Finding(
        computed=f"max |Σⱼ αᵢⱼ − 1| = {tiny(row_sum)}; weights in [{float(w.min()):.3g}, "
        f"{float(w.max()):.3g}]; max |out − αV| = {tiny(avg)}",
        call="out, w = attention(q, k, v, return_weights=True); w.sum(-1); w @ v",
        **judged(ok, "the weights are not a distribution or out ≠ αV"),
    )


@check("000-cos-b")
def _cosine_dimension() -> Finding:
    from ... import attention
    from ...analysis.weights import entropy

    spreads, ents, by_hand = [], [], True
    for d in (16, 1024):
        q, k, v = _qkv_nm(64, 128, d, 2, seed=7)
        _, w = attention(q, k, v, score="cosine", return_weights=True)
        qn, kn = (t[0, 0].numpy() / t[0, 0].norm(dim=-1, keepdim=True).numpy() for t in (q, k))
        c = qn @ kn.T  # cos θ between every query and key, numpy
        spreads.append(float(c.std(ddof=1)))
        ents.append(float(entropy(w).mean()))
        by_hand &= abs(ents[-1] - float(ind.entropy(ind.softmax(c)).mean())) < 1e-9
    uniform = torch.log(torch.tensor(128.0, dtype=torch.float64)).item()
    shrinks = spreads[1] < spreads[0] / 4 and ents[1] > ents[0]
    return Finding(
        computed=f"std of cos θ: {spreads[0]:.3f} at d=16, {spreads[1]:.4f} at d=1024 (≈ 1/√d); "
        f"mean weight entropy {ents[0]:.4f} → {ents[1]:.4f} nats (uniform: {uniform:.4f})",
        call="attention(q, k, v, score='cosine', return_weights=True); entropy(w)",
        **judged(
            not shrinks,
            "the range [-1, 1] does not depend on d, but the spread of cos θ between "
            "random vectors is 1/√d, so without a learned scale (temperature) the weights flatten "
            "towards uniform as d grows",
            Derivation(
                by_hand,
                "the entropy of softmax(cos θ) computed in numpy from the normalised q and k "
                "equals attnlab's at both d to 1e-9",
            ),
        ),
    )


@check("001-4.1-a")
def _shapes() -> Finding:
    from ... import attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    out, w = attention(q[None], k[None], v[None], return_weights=True)  # 3-D: (1, 4, ·)
    shapes = (tuple(w.shape[1:]), tuple(out.shape[1:]))
    ok = shapes == ((4, 4), (4, 6))
    return Finding(
        computed=f"weights {shapes[0]}, output {shapes[1]}",
        call="attention(q[None], k[None], v[None], return_weights=True) with q, k, v (4, 6)",
        **judged(ok, "the shapes differ"),
    )


@check("001-7.2-a")
def _softmax_gradient() -> Finding:
    from ... import attention

    grads = {}
    for gap in (0.0, 5.0, 20.0, 50.0):
        q = torch.tensor([[[[1.0]]]], dtype=torch.float64, requires_grad=True)
        k = torch.tensor([[[[gap], [0.0]]]], dtype=torch.float64)
        v = torch.tensor([[[[1.0], [0.0]]]], dtype=torch.float64)  # out = weight of key 0
        attention(q, k, v, scale=1.0).sum().backward()
        grads[gap] = float(q.grad.abs().sum())  # ∂p₀/∂(gap) · gap-direction: p₀(1 − p₀)·gap
    ok = grads[0.0] == 0.0 and grads[5.0] > grads[20.0] > grads[50.0] and grads[50.0] < 1e-15
    return Finding(
        computed="|∂p₀/∂q| for logit gaps "
        + ", ".join(f"{g:g}: {v:.2e}" for g, v in grads.items()),
        call="attention(q, k, v, scale=1.0).sum().backward() with k = [[gap], [0]]",
        **judged(ok, "the gradient does not vanish at the extremes"),
    )


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


@check("003-2.2-a")
def _q_equals_k() -> Finding:
    from ... import MultiHeadAttention, attention

    x = _heads_seq(16, 64, seed=0)
    _, w_same = attention(x, x, x, return_weights=True)
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 1).double()
    with torch.no_grad():
        _, w_proj = mha(x[0], need_weights=True)
    d_same = float(w_same.diagonal(dim1=-2, dim2=-1).mean())
    d_proj = float(w_proj.diagonal(dim1=-2, dim2=-1).mean())
    xn = x[0, 0].numpy()
    qkv = xn @ mha.qkv_proj.weight.detach().numpy().T + mha.qkv_proj.bias.detach().numpy()
    witness = ind.close(w_same[0, 0].numpy(), ind.attention_weights(xn, xn)) and ind.close(
        w_proj.reshape(16, 16).numpy(), ind.attention_weights(qkv[:, :64], qkv[:, 64:128])
    )
    wrong = d_same > 0.9 and d_proj < 0.5
    return Finding(
        computed=f"mean diagonal weight with Q = K = V = X: {d_same:.3f}; with three projections: "
        f"{d_proj:.3f} (uniform 1/16 = 0.0625)",
        call="attention(x, x, x, return_weights=True) vs MultiHeadAttention(64, 1)(x, "
        "need_weights=True)",
        **judged(
            not wrong,
            "Q, K and V come from the same X through three different projections "
            "(§3.1's Q = XW^Q, K = XW^K, V = XW^V); with Q = K literally, q_i·q_i dominates and "
            "each token attends almost only to itself",
            Derivation(
                witness,
                "softmax(QKᵀ/√d) in numpy, with Q = K = X and with the module's projections, "
                "equals both weight matrices",
            ),
        ),
    )


@check("004-1-d")
def _softmax_distribution() -> Finding:
    from ... import attention

    g = _gen(3)
    q, k, v = _randn_from(g, 1, 1, 6, 8), _randn_from(g, 1, 1, 9, 8), _randn_from(g, 1, 1, 9, 2)
    ok, parts = True, []
    for c in (1.0, 100.0, 1000.0):
        _, w = attention(q * c, k, v, return_weights=True)
        s = (q * c) @ k.transpose(-1, -2)
        sums = w.sum(-1)
        # s_a > s_b implies w_a >= w_b (saturated weights may tie at 0)
        higher = s.unsqueeze(-1) > s.unsqueeze(-2)
        rank_ok = bool((higher <= (w.unsqueeze(-1) >= w.unsqueeze(-2))).all())
        valid = bool(torch.isfinite(w).all() and (w >= 0).all())
        ok &= valid and rank_ok and _close(sums, torch.ones_like(sums), 1e-12)
        parts.append(
            f"×{c:g}: max |row sum − 1| < 1e-12, min weight ≥ 0, monotone in the score: {rank_ok}"
        )
    return Finding(
        computed="; ".join(parts),
        call="_, w = attention(c * q, k, v, return_weights=True); w.sum(-1); ranks of w vs q·k",
        **_verdict(ok, "the weights are not a distribution monotone in the scores"),
    )


@check("004-1-e")
def _output_is_weights_at_values() -> Finding:
    from ... import attention

    g = _gen(4)
    q, k, v = _randn_from(g, 2, 2, 5, 4), _randn_from(g, 2, 2, 6, 4), _randn_from(g, 2, 2, 6, 3)
    out, w = attention(q, k, v, return_weights=True)
    ok = _close(out, w @ v)
    return Finding(
        computed=f"out == weights @ V within 1e-12: {ok}",
        call="out, w = attention(q, k, v, return_weights=True); w @ v",
        **_verdict(ok, "the output is not the weighted sum of the values"),
    )


def _nadaraya_watson(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(f̂(q), w)`` of the Nadaraya–Watson estimator with K(q, k) = exp(q·k/√d), by the book."""
    kern = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))  # K(q_i, k_j)
    w = kern / kern.sum(-1, keepdim=True)  # w_j(q_i)
    return w @ v, w


@check("004-3.1-a")
def _nw_weights() -> Finding:
    from ... import attention

    g = _gen(12)
    q, k, v = _randn_from(g, 1, 6, 5), _randn_from(g, 1, 10, 5), _randn_from(g, 1, 10, 3)
    _, w = attention(q, k, v, return_weights=True)
    ok = _close(w, _nadaraya_watson(q, k, v)[1])
    return Finding(
        computed=f"NW weights K(q, k_i)/Σ_j K(q, k_j) == attention weights within 1e-12: {ok}",
        call="_, w = attention(q, k, v, return_weights=True) vs exp(q @ k.mT / √d) normalised",
        **_verdict(ok, "the Nadaraya–Watson weights differ from the attention weights"),
    )


@check("004-3.1-b")
def _nw_output() -> Finding:
    from ... import attention

    g = _gen(12)
    q, k, v = _randn_from(g, 1, 6, 5), _randn_from(g, 1, 10, 5), _randn_from(g, 1, 10, 3)
    ok = _close(attention(q, k, v), _nadaraya_watson(q, k, v)[0])
    return Finding(
        computed=f"f̂(q) = Σ_i w_i(q) v_i == attention(q, k, v) within 1e-12: {ok}",
        call="attention(q, k, v) vs (exp(q @ k.mT / √d) normalised) @ v",
        **_verdict(ok, "the Nadaraya–Watson estimate differs from the attention output"),
    )


@check("004-3.1-c")
def _retrieval() -> Finding:
    from ... import attention

    g = _gen(13)
    k = _randn_from(g, 1, 16, 32)
    k = k / k.norm(dim=-1, keepdim=True)
    v = _randn_from(g, 1, 16, 4)
    errs = []
    for beta in (1.0, 16.0, 256.0):
        out = attention(beta * k[:, 5:6], k, v)
        errs.append(float((out[0, 0] - v[0, 5]).norm()))
    small = [_randn_from(g, 1, 1, n, 3).requires_grad_() for n in (2, 3, 3)]
    grads = torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c), small)
    ok = errs[0] > errs[1] > errs[2] and errs[2] < 1e-6 and grads
    return Finding(
        computed=f"‖attention(β·k_5, K, V) − v_5‖ = {fmt(errs[0], 2)} at β = 1, "
        f"{fmt(errs[1], 2)} at β = 16, < 1e-6 at β = 256: {errs[2] < 1e-6}"
        f"; torch.autograd.gradcheck passes: {grads}",
        call="attention(beta * k[:, 5:6], k, v); gradcheck(attention, (q, k, v))",
        **_verdict(ok, "a matching query does not retrieve its value"),
    )


@check("004-3.2-e")
def _max_entropy() -> Finding:
    from ... import attention, attention_stats

    g = _gen(17)
    q, k = _randn_from(g, 1, 1, 1, 6), _randn_from(g, 1, 1, 10, 6)
    _, w = attention(q, k, k, return_weights=True)
    st = attention_stats(q, k, k)
    p = w[0, 0, 0]
    s = (q @ k.transpose(-1, -2))[0, 0, 0] / math.sqrt(6)
    free = float(st.lse[0, 0, 0] - (p * s).sum())
    identity = abs(free - float(st.entropy[0, 0, 0])) < 1e-12
    # perturbations keeping Σp = 1 and E_p[s]: project random directions off span{1, s}
    basis, _ = torch.linalg.qr(torch.stack([torch.ones_like(s), s], dim=1))  # (10, 2)
    d = _randn_from(g, 2000, 10)
    d = d - (d @ basis) @ basis.T
    d = 1e-3 * d / d.norm(dim=-1, keepdim=True)
    pp = p + d
    h = -(pp * pp.log()).sum(-1)
    h0 = float(-(p * p.log()).sum())
    maximal = bool((h < h0).all())
    ok = identity and maximal
    return Finding(
        computed=f"H(p) = {fmt(float(st.entropy[0, 0, 0]))} = lse − E_p[s] = {fmt(free)}: "
        f"{identity}; all 2,000 feasible perturbations lower the entropy: {maximal}",
        call="st = attention_stats(q, k, k); st.lse − Σ p·s vs st.entropy",
        **_verdict(ok, "the softmax weights are not the maximum-entropy distribution"),
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


@check("004-5.1-b")
def _masked_grad() -> Finding:
    from ... import attention, masks

    g = _gen(23)
    q, k, v, dout = (_randn_from(g, 1, 1, 7, 4) for _ in range(4))
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
