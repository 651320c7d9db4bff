"""Seed 004, the kernel-regression and statistical-physics views (Nadaraya–Watson, Gibbs).

The checks of claims whose metadata is in ``claims/seed004.toml``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core import Finding, check, fmt
from .seed004 import F64, _close, _gen, _randn, _verdict


# ------------------------------------------------------------ 核回归视角 (kernel regression)
def _nadaraya_watson(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(f̂(q), w)`` of the Nadaraya–Watson estimator with K(q, k) = exp(q·k/√d), by the book."""
    kern = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))  # K(q_i, k_j)
    w = kern / kern.sum(-1, keepdim=True)  # w_j(q_i)
    return w @ v, w


@check("004-3.1-a")
def _nw_weights() -> Finding:
    from ... import attention

    g = _gen(12)
    q, k, v = _randn(g, 1, 6, 5), _randn(g, 1, 10, 5), _randn(g, 1, 10, 3)
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
    q, k, v = _randn(g, 1, 6, 5), _randn(g, 1, 10, 5), _randn(g, 1, 10, 3)
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
    k = _randn(g, 1, 16, 32)
    k = k / k.norm(dim=-1, keepdim=True)
    v = _randn(g, 1, 16, 4)
    errs = []
    for beta in (1.0, 16.0, 256.0):
        out = attention(beta * k[:, 5:6], k, v)
        errs.append(float((out[0, 0] - v[0, 5]).norm()))
    small = [_randn(g, 1, 1, n, 3).requires_grad_() for n in (2, 3, 3)]
    grads = torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c), small)
    ok = errs[0] > errs[1] > errs[2] and errs[2] < 1e-6 and grads
    return Finding(
        computed=f"‖attention(β·k_5, K, V) − v_5‖ = {fmt(errs[0], 2)} at β = 1, "
        f"{fmt(errs[1], 2)} at β = 16, < 1e-6 at β = 256: {errs[2] < 1e-6}"
        f"; torch.autograd.gradcheck passes: {grads}",
        call="attention(beta * k[:, 5:6], k, v); gradcheck(attention, (q, k, v))",
        **_verdict(ok, "a matching query does not retrieve its value"),
    )


# -------------------------------------------------------- 统计物理视角 (Gibbs, temperature)
@check("004-3.2-a")
def _gibbs() -> Finding:
    from ... import attention

    g = _gen(14)
    q, k, v = _randn(g, 1, 1, 5, 8), _randn(g, 1, 1, 12, 8), _randn(g, 1, 1, 12, 2)
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
    q, k, v = _randn(g, 1, 1, 8, 8), _randn(g, 1, 1, 12, 8), _randn(g, 1, 1, 12, 3)
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
    q, k, v = _randn(g, 1, 1, 8, 8), _randn(g, 1, 1, 12, 8), _randn(g, 1, 1, 12, 3)
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
    q, k = _randn(g, 1, 1, 8, 8), _randn(g, 1, 1, 12, 8)
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


@check("004-3.2-e")
def _max_entropy() -> Finding:
    from ... import attention, attention_stats

    g = _gen(17)
    q, k = _randn(g, 1, 1, 1, 6), _randn(g, 1, 1, 10, 6)
    _, w = attention(q, k, k, return_weights=True)
    st = attention_stats(q, k, k)
    p = w[0, 0, 0]
    s = (q @ k.transpose(-1, -2))[0, 0, 0] / math.sqrt(6)
    free = float(st.lse[0, 0, 0] - (p * s).sum())
    identity = abs(free - float(st.entropy[0, 0, 0])) < 1e-12
    # perturbations keeping Σp = 1 and E_p[s]: project random directions off span{1, s}
    basis, _ = torch.linalg.qr(torch.stack([torch.ones_like(s), s], dim=1))  # (10, 2)
    d = _randn(g, 2000, 10)
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
