"""Checks of an explicit scale or temperature: what softmax(s/τ) does to the weights, their
entropy and their gradient (subjects ``explicit-scale``, ``temperature``)."""

from __future__ import annotations

import itertools
import math

import torch

from ..core import Finding, check, fmt, judged
from ._shared import (
    _DKS,
    _SCALING_CALL,
    F64,
    _close,
    _err,
    _found,
    _gen,
    _qkv,
    _qkv_nm,
    _randn_from,
    _scaling,
    _scores,
    _unscaled_saturation,
    _verdict,
)


@check("000-scale-d")
def _saturation_gradient() -> Finding:
    from ... import attention

    q, k, v = _qkv_nm(1, 16, 512, 8, seed=3)
    norms = {}
    for label, scale in (("unscaled", 1.0), ("scaled", None)):
        qq = q.clone().requires_grad_(True)
        attention(qq, k, v, scale=scale).sum().backward()
        norms[label] = float(qq.grad.norm())
    ok = norms["unscaled"] < 0.05 * norms["scaled"]  # at least 20× smaller
    return Finding(
        computed=f"|∂out/∂q| = {norms['unscaled']:.2e} unscaled vs {norms['scaled']:.2e} with "
        "1/√d_k",
        call="attention(q, k, v, scale=1.0).sum().backward(); q.grad.norm()",
        **judged(ok, "the unscaled gradient is not close to zero"),
    )


@check("000-temp-a")
def _temperature() -> Finding:
    from ... import attention
    from ...analysis.weights import entropy

    q, k, v = _qkv_nm(8, 32, 16, 4, seed=8)
    temps = (0.1, 0.5, 1.0, 2.0, 10.0)
    ents = [
        float(entropy(attention(q, k, v, temperature=t, return_weights=True)[1]).mean())
        for t in temps
    ]
    ok = all(a < b for a, b in itertools.pairwise(ents))
    return Finding(
        computed="mean entropy "
        + ", ".join(f"T={t:g}: {e:.3f}" for t, e in zip(temps, ents, strict=True))
        + " nats (uniform 3.466)",
        call="entropy(attention(q, k, v, temperature=T, return_weights=True)[1])",
        **judged(ok, "entropy does not grow with T"),
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


@check("004-1-b")
def _scoring() -> Finding:
    from ... import attention

    g = _gen(1)
    q, k, v = _randn_from(g, 1, 1, 5, 4), _randn_from(g, 1, 1, 7, 4), _randn_from(g, 1, 1, 7, 4)
    _, w, lse = attention(q, k, v, scale=1.0, return_weights=True, return_lse=True)
    s = _scores(w, lse)[0, 0]
    loops = torch.tensor(
        [
            [float(sum(q[0, 0, i, t] * k[0, 0, j, t] for t in range(4))) for j in range(7)]
            for i in range(5)
        ],
        dtype=F64,
    )
    ok = _close(s, loops, 1e-12)
    return Finding(
        computed=f"logits log p_ij + lse_i equal Σ_t q_it k_jt (explicit loops) for all 5×7 "
        f"pairs: {ok}",
        call="_, w, lse = attention(q, k, v, scale=1.0, return_weights=True, return_lse=True); "
        "w.log() + lse[..., None]",
        **_verdict(ok, "the scores are not the query–key dot products"),
    )


@check("004-2-g")
def _saturation() -> Finding:
    from ... import attention_stats

    ent = _scaling().column("entropy")
    g = _gen(9)
    tops = []
    for d in _DKS:
        q, k = _randn_from(g, 1, 1, 64, d), _randn_from(g, 1, 1, 32, d)
        st = attention_stats(q, k, k, scale=1.0)
        tops.append(float(st.max_weight.mean()))
    ok = ent[0] > ent[1] > ent[2] and ent[2] < 0.1 * math.log(32) and tops[-1] > 0.9
    return Finding(
        computed="unscaled: "
        + "; ".join(
            f"d_k={d}: entropy {fmt(e, 3)} nats, mean max weight {fmt(t, 3)}"
            for d, e, t in zip(_DKS, ent, tops, strict=True)
        )
        + f" (uniform: {fmt(math.log(32), 3)} nats)",
        call=_SCALING_CALL + ".column('entropy'); attention_stats(q, k, k, scale=1.0).max_weight",
        **_verdict(ok, "unscaled softmax does not approach one-hot as d_k grows"),
    )


@check("004-2-i")
def _vanishing() -> Finding:
    from ... import attention

    jac = _scaling().column("grad norm")
    g = _gen(11)
    q, k, v, dout = (
        _randn_from(g, 1, 1, 1, 8),
        _randn_from(g, 1, 1, 16, 8),
        _randn_from(g, 1, 1, 16, 4),
        None,
    )
    dout = _randn_from(g, 1, 1, 1, 4)
    norms = []
    for c in (1.0, 10.0, 100.0):
        b = torch.zeros(1, 16, dtype=F64, requires_grad=True)
        out = attention(q, k, v, bias=b, scale=c / math.sqrt(8))
        (out * dout).sum().backward()
        norms.append(float(b.grad.norm()))
    ok = jac[1] > jac[2] and jac[2] < 0.5 * _scaling().column("grad norm scaled")[2]
    ok &= norms[0] > norms[1] > norms[2] and norms[2] < 1e-3 * norms[0]
    return Finding(
        computed="softmax Jacobian norm, unscaled logits: "
        + ", ".join(f"d_k={d}: {fmt(j, 3)}" for d, j in zip(_DKS, jac, strict=True))
        + f"; ‖∂(out·g)/∂logits‖ for logits ×1: {fmt(norms[0], 3)}, ×10: {fmt(norms[1], 3)}, "
        f"×100: < 1e-20 ({norms[2] < 1e-20})",
        call=_SCALING_CALL + ".column('grad norm'); attention(q, k, v, bias=b, scale=c/√8) "
        "then backward, b.grad.norm()",
        **_verdict(ok, "the gradient does not shrink as softmax saturates"),
    )


@check("004-3.2-a")
def _gibbs() -> Finding:
    from ... import attention

    g = _gen(14)
    q, k, v = _randn_from(g, 1, 1, 5, 8), _randn_from(g, 1, 1, 12, 8), _randn_from(g, 1, 1, 12, 2)
    energy = -(q @ k.transpose(-1, -2)) / math.sqrt(8)
    ok, parts = True, []
    for t in (0.5, 1.0, 2.0):
        _, w = attention(q, k, v, temperature=t, return_weights=True)
        gibbs = torch.exp(-energy / t) / torch.exp(-energy / t).sum(-1, keepdim=True)
        same = _close(w, gibbs)
        ok &= same
        parts.append(f"T={t:g}: weights == exp(−E/T)/Z: {same}")
    _, w1 = attention(q, k, v, return_weights=True)
    _, wt = attention(q, k, v, scale=1.0, temperature=math.sqrt(8), return_weights=True)
    ok &= _close(w1, wt)
    return Finding(
        computed="; ".join(parts) + f"; scale=1, T=√d_k equals the default: {_close(w1, wt)}",
        call="attention(q, k, v, temperature=T, return_weights=True) vs "
        "exp(−E/T)/Σ exp(−E/T), E = −q·k/√d",
        **_verdict(ok, "the weights are not the Gibbs distribution of E = −s"),
    )


@check("004-3.2-b")
def _cold() -> Finding:
    from ... import attention

    g = _gen(15)
    q, k, v = _randn_from(g, 1, 1, 8, 8), _randn_from(g, 1, 1, 12, 8), _randn_from(g, 1, 1, 12, 3)
    _, w = attention(q, k, v, temperature=1e-3, return_weights=True)
    top = (q @ k.transpose(-1, -2)).argmax(-1)
    onehot = torch.nn.functional.one_hot(top, 12).to(F64)
    err = float((w - onehot).abs().max())
    out = attention(q, k, v, temperature=1e-3)
    hard = torch.gather(v.expand(1, 1, 12, 3), 2, top.unsqueeze(-1).expand(1, 1, 8, 3))
    kt = torch.cat([k[:, :, :1], k[:, :, :1], k[:, :, 1:4]], dim=2)  # keys 0 and 1 tied
    _, wt = attention(k[:, :, :1] * 3, kt, kt, temperature=1e-3, return_weights=True)
    tie = [round(float(x), 6) for x in wt[0, 0, 0, :2]]
    ok = err < 1e-9 and _close(out, hard, 1e-9) and tie == [0.5, 0.5]
    return Finding(
        computed=f"T=1e-3: max |w − one_hot(argmax_j s_ij)| < 1e-9: {err < 1e-9}; output == "
        f"v[argmax]: {_close(out, hard, 1e-9)}; a tied top pair gets {tie}",
        call="attention(q, k, v, temperature=1e-3, return_weights=True)",
        **_verdict(ok, "the T → 0 limit is not the argmax"),
    )


@check("004-3.2-c")
def _hot() -> Finding:
    from ... import attention

    g = _gen(15)
    q, k, v = _randn_from(g, 1, 1, 8, 8), _randn_from(g, 1, 1, 12, 8), _randn_from(g, 1, 1, 12, 3)
    gaps = [
        float((attention(q, k, v, temperature=t, return_weights=True)[1] - 1 / 12).abs().max())
        for t in (10.0, 1e3, 1e6)
    ]
    ok = gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-6
    return Finding(
        computed="max |w − 1/12| at T = 10, 1e3, 1e6: " + ", ".join(fmt(x, 2) for x in gaps),
        call="attention(q, k, v, temperature=T, return_weights=True)",
        **_verdict(ok, "the T → ∞ limit is not uniform"),
    )


@check("004-3.2-d")
def _entropy_monotone() -> Finding:
    from ... import attention_stats

    g = _gen(16)
    q, k = _randn_from(g, 1, 1, 8, 8), _randn_from(g, 1, 1, 12, 8)
    q[0, 0, 0] = 0.0  # all scores equal in row 0
    temps = torch.logspace(-2, 2, 25, dtype=F64).tolist()
    ent = torch.stack([attention_stats(q, k, k, temperature=t).entropy[0, 0] for t in temps])
    steps = ent[1:] - ent[:-1]  # (24, 8)
    strict = bool((steps[:, 1:] > 0).all())
    flat = _close(ent[:, 0], torch.full_like(ent[:, 0], math.log(12)), 1e-12)
    ok = strict and flat
    return Finding(
        computed=f"rows with distinct scores: entropy strictly increasing over the grid: {strict} "
        f"(from {fmt(float(ent[0, 1:].mean()), 3)} to {fmt(float(ent[-1, 1:].mean()), 4)} nats, "
        f"mean); the all-equal row stays at log 12 = {fmt(math.log(12), 4)}: {flat}",
        call="attention_stats(q, k, k, temperature=T).entropy",
        **_verdict(ok, "the entropy is not increasing in T"),
    )
