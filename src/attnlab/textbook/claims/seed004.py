"""Seed 004 — 缩放点积注意力：原理与机制 (scaled dot-product attention: principles).

Checks run in float64 on seeded generators (float32/float16 only where a claim is about them)
and report counts, ratios, 2–4 significant digits or bounds — never raw rounding noise or
timings — so their text is the same on every run. ``seed004_costs`` ends with the hands-on exercises
H1–H4 that the seed announces but lacks (``from_text=False``).

This module holds the shared helpers and the first sections; the others are in ``seed004_*``
beside it, the claims' metadata in ``seed004.toml``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import NOT_CHECKABLE, Derivation, Finding, check, fmt, judged

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (checks never touch the global RNG)."""
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    """Standard normal float64 tensor of ``shape`` drawn from ``g``."""
    return torch.randn(*shape, generator=g, dtype=F64)


def _close(a: Tensor, b: Tensor, tol: float = 1e-12) -> bool:
    """``max |a − b| <= tol`` (False if any difference is NaN)."""
    return bool((a - b).abs().max() <= tol) if a.numel() else True


_verdict = judged  # the verdict keywords by the rule of attnlab.textbook.core.judged


def _scores(w: Tensor, lse: Tensor) -> Tensor:
    """The logits ``s_ij = log p_ij + lse_i`` recovered from attnlab's weights ``(…, L, S)`` and
    log-sum-exp ``(…, L)``."""
    return w.log() + lse.unsqueeze(-1)


# ------------------------------------------------------------------------------- 引言 (intro)
@check("004-0-a")
def _hands_on() -> Finding:
    from ..exercises import get_exercise

    ids = [e for e in ("H1", "H2", "H3", "H4") if get_exercise(e).from_text is False]
    return Finding(
        computed=f"the seed file ends after chapter 1 (原理与机制); attnlab supplies exercises "
        f"{', '.join(ids)} (forward, tiled online-softmax forward, backward by hand, KV-cache "
        "decoding), each checked against attnlab.attention / autograd "
        "(`attnlab textbook --exercise H1`)",
        call="get_exercise('H1') … get_exercise('H4')",
        verdict=NOT_CHECKABLE,
        explanation="the announced hands-on chapter 3 is not in the source file, so its "
        "exercises cannot be checked; H1–H4 are attnlab's own",
    )


@check("004-0-b")
def _applications() -> Finding:
    import importlib

    from ... import apps, models

    # the chapter's domains and what attnlab ships for each: model classes and apps, by name
    shipped = {
        "language": ["GPT", "MiniLM", "BertEncoder", "Seq2SeqTransformer"],
        "vision": ["VisionTransformer"],
        "biology": [n for n in models.__all__ if n.lower().startswith(("protein", "dna", "bio"))],
        "economics": [n for n in models.__all__ if n.lower().startswith(("econ", "timeseries"))],
    }
    shipped = {k: [n for n in v if hasattr(models, n)] for k, v in shipped.items()}
    runnable = {k: [m for d, m in _APP_DOMAINS if d == k] for k in shipped}
    for names in runnable.values():
        for m in names:
            importlib.import_module(f"{apps.__name__}.{m}")  # the app exists and imports
    have = [k for k, v in shipped.items() if v]
    missing = [k for k, v in shipped.items() if not v]
    parts = [
        f"{k}: {', '.join(shipped[k])}"
        + (f" (apps: {', '.join(runnable[k])})" if runnable[k] else "")
        for k in have
    ]
    return Finding(
        computed="attnlab ships models for "
        + "; ".join(parts)
        + " — none for "
        + (", ".join(missing) or "no domain"),
        call="attnlab.models.__all__; attnlab.apps (translate, classify, vit)",
        verdict=NOT_CHECKABLE,
        explanation="the applications chapter is not in the source file"
        + (f", and nothing for {' or '.join(missing)} ships with attnlab" if missing else ""),
    )


_APP_DOMAINS = (("language", "translate"), ("language", "classify"), ("vision", "vit"))


@check("004-1-a")
def _formula() -> Finding:
    from ... import attention

    g = _gen(0)
    q, k, v = _randn(g, 2, 3, 5, 4), _randn(g, 2, 3, 7, 4), _randn(g, 2, 3, 7, 3)
    out = attention(q, k, v)
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1) @ v
    ok = _close(out, ref)
    return Finding(
        computed=f"attnlab.attention equals softmax(QKᵀ/√d_k)V: {ok} (max |diff| < 1e-12), "
        f"out shape {tuple(out.shape)}",
        call="attention(q, k, v) vs torch.softmax(q @ k.mT / math.sqrt(4), -1) @ v",
        **_verdict(ok, "attnlab's attention differs from softmax(QKᵀ/√d_k)V"),
    )


@check("004-1-b")
def _scoring() -> Finding:
    from ... import attention

    g = _gen(1)
    q, k, v = _randn(g, 1, 1, 5, 4), _randn(g, 1, 1, 7, 4), _randn(g, 1, 1, 7, 4)
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


@check("004-1-c")
def _scaling_step() -> Finding:
    from ... import attention
    from ...functional.scores import get_score

    g = _gen(2)
    ok, parts = True, []
    for d in (1, 4, 64, 100):
        q, k, v = _randn(g, 1, 1, 3, d), _randn(g, 1, 1, 6, d), _randn(g, 1, 1, 6, 2)
        scale = get_score("dot").default_scale(d)
        same = _close(attention(q, k, v), attention(q, k, v, scale=1 / math.sqrt(d)), 0.0)
        ok &= abs(scale - 1 / math.sqrt(d)) < 1e-15 and same
        parts.append(f"d_k={d}: default scale {fmt(scale)}")
    return Finding(
        computed="; ".join(parts) + f"; attention(q, k, v) == attention(..., scale=1/√d_k): {ok}",
        call="get_score('dot').default_scale(d); attention(q, k, v, scale=1 / math.sqrt(d))",
        **_verdict(ok, "the default scale is not 1/√d_k"),
    )


@check("004-1-d")
def _softmax_distribution() -> Finding:
    from ... import attention

    g = _gen(3)
    q, k, v = _randn(g, 1, 1, 6, 8), _randn(g, 1, 1, 9, 8), _randn(g, 1, 1, 9, 2)
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
def _weighted_sum() -> Finding:
    from ... import attention

    g = _gen(4)
    q, k, v = _randn(g, 2, 2, 5, 4), _randn(g, 2, 2, 6, 4), _randn(g, 2, 2, 6, 3)
    out, w = attention(q, k, v, return_weights=True)
    ok = _close(out, w @ v)
    return Finding(
        computed=f"out == weights @ V within 1e-12: {ok}",
        call="out, w = attention(q, k, v, return_weights=True); w @ v",
        **_verdict(ok, "the output is not the weighted sum of the values"),
    )


@check("004-1-f")
def _worked_example() -> Finding:
    from ... import attention

    Q = torch.tensor([[1.0, 0], [0, 1], [1, 1], [-1, 2]], dtype=F64)
    K = torch.tensor([[1.0, 1], [0, 2], [2, 0], [-1, -1]], dtype=F64)
    V = torch.tensor([[1.0, 0], [0, 1], [2, 2], [-1, 3]], dtype=F64)
    raw = [float(Q[1] @ K[j]) for j in range(4)]
    e = [math.exp(r / math.sqrt(2)) for r in raw]
    alpha = [x / sum(e) for x in e]
    by_hand = sum(a * V[j] for j, a in enumerate(alpha))
    out = attention(Q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0))[0]  # (4, 2), 3-D in
    ok = _close(out[1], by_hand, 1e-14)
    return Finding(
        computed=f"q_2·k_j = {raw}; α_2j = [{', '.join(fmt(a) for a in alpha)}]; "
        f"Σ α_2j v_j = [{', '.join(fmt(float(x)) for x in by_hand)}]; attnlab row 2 = "
        f"[{', '.join(fmt(float(x)) for x in out[1])}]",
        call="attention(Q[None], K[None], V[None])[0, 1]",
        **_verdict(ok, "row 2 of attnlab's output differs from Σ α_2j v_j"),
    )


# ------------------------------------------------------------- 统计学原理 (why the scaling)
@check("004-2-a")
def _init_assumption() -> Finding:
    from ... import MultiHeadAttention

    g = _gen(5)
    parts, means, vars_, logit_vars = [], [], [], []
    for d in (32, 128, 512):
        with torch.random.fork_rng(devices=[]):  # the module's init, seeded, leaves no trace
            torch.manual_seed(5)
            mha = MultiHeadAttention(d, 1, bias=False).to(F64)
        with torch.no_grad():
            q, k, _ = mha.project(_randn(g, 1, 512, d))
        logits = (q[0, 0, :256] * k[0, 0, 256:]).sum(-1) / math.sqrt(d)  # independent pairs
        means.append(float(q.mean()))
        vars_.append(float(torch.cat([q.flatten(), k.flatten()]).var()))
        logit_vars.append(float(logits.var()))
        parts.append(
            f"d_k={d}: mean {fmt(means[-1], 2)}, Var(q_i) {fmt(vars_[-1], 3)}, "
            f"Var(q·k/√d_k) {fmt(logit_vars[-1], 3)}"
        )
    ok = all(abs(m) < 0.05 for m in means) and max(vars_) / min(vars_) < 1.1
    return Finding(
        computed="; ".join(parts) + " (PyTorch's default init gives Var(q_i) = 1/3, not 1: a "
        "constant factor, so the logit variance is 1/9 at every d_k)",
        call="q, k, _ = MultiHeadAttention(d, 1, bias=False).to(torch.float64).project(x)",
        **_verdict(ok, "at init the entries of q, k are not zero-mean with a d_k-free variance"),
    )


@check("004-2-b")
def _mean_zero() -> Finding:
    from ...functional.scores import get_score

    dot, g = get_score("dot"), _gen(6)
    ok, parts = True, []
    for d in (4, 64):
        ell = (dot.prepare(_randn(g, 20_000, d)) * dot.prepare(_randn(g, 20_000, d))).sum(-1)
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
    from ...functional.scores import get_score

    dot, g = get_score("dot"), _gen(7)
    prod = (dot.prepare(_randn(g, 200_000, 1)) * dot.prepare(_randn(g, 200_000, 1))).sum(-1)
    var = float(prod.var())
    ok = abs(var - 1) < 0.02
    return Finding(
        computed=f"Var(q_i k_i) = {fmt(var)}",
        call="(s.prepare(q) * s.prepare(k)).sum(-1).var() with d_k = 1",
        **_verdict(ok, "the variance of one product term is not 1"),
    )


_DKS = (4, 64, 1024)


@functools.cache
def _scaling():
    """`scaling_experiment` at d_k = 4, 64, 1024 (256 queries × 32 keys, seed 0), run once."""
    from ...analysis import scaling_experiment

    return scaling_experiment(d_ks=_DKS, samples=256, keys=32, seed=0)


_SCALING_CALL = "scaling_experiment(d_ks=(4, 64, 1024), samples=256, keys=32, seed=0)"


@check("004-2-d")
def _var_dk() -> Finding:
    r = _scaling()
    var = r.column("var q·k")
    ok = all(abs(v / d - 1) < 0.1 for v, d in zip(var, _DKS, strict=True))
    return Finding(
        computed="; ".join(f"d_k={d}: Var(q·k) = {fmt(v)}" for d, v in zip(_DKS, var, strict=True)),
        call=_SCALING_CALL + ".column('var q·k')",
        **_verdict(ok, "Var(q·k) is not d_k"),
    )


@check("004-2-e")
def _var_scaled() -> Finding:
    var = _scaling().column("var q·k/√d_k")
    ok = all(abs(v - 1) < 0.1 for v in var)
    return Finding(
        computed="; ".join(
            f"d_k={d}: Var(q·k/√d_k) = {fmt(v)}" for d, v in zip(_DKS, var, strict=True)
        ),
        call=_SCALING_CALL + ".column('var q·k/√d_k')",
        **_verdict(ok, "the scaled logits' variance is not 1"),
    )


@check("004-2-f")
def _magnitude() -> Finding:
    from ...functional.scores import get_score

    dot, g = get_score("dot"), _gen(8)
    ok, parts = True, []
    for d in _DKS:
        ell = (dot.prepare(_randn(g, 4000, d)) * dot.prepare(_randn(g, 4000, d))).sum(-1)
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


@check("004-2-g")
def _saturation() -> Finding:
    from ... import attention_stats

    ent = _scaling().column("entropy")
    g = _gen(9)
    tops = []
    for d in _DKS:
        q, k = _randn(g, 1, 1, 64, d), _randn(g, 1, 1, 32, d)
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


@check("004-2-h")
def _large_or_small() -> Finding:
    from ... import attention, attention_stats

    g = _gen(10)
    q, k, v = _randn(g, 1, 1, 4, 8), _randn(g, 1, 1, 16, 8), _randn(g, 1, 1, 16, 3)
    _, w0 = attention(q, k, v, return_weights=True)
    shift = [
        attention(q, k, v, bias=torch.full((4, 16), c, dtype=F64), return_weights=True)[1]
        for c in (1000.0, -1000.0)
    ]
    invariant = all(_close(w, w0, 1e-12) for w in shift)
    ent = {
        c: float(attention_stats(q, k, v, scale=c / math.sqrt(8)).entropy.mean())
        for c in (1e3, 1.0, 1e-3)
    }
    small_uniform = abs(ent[1e-3] - math.log(16)) < 1e-3
    large_onehot = ent[1e3] < 0.05
    error = invariant and small_uniform and large_onehot
    qn, kn = q[0, 0].numpy(), k[0, 0].numpy()
    witness = ind.close(w0[0, 0].numpy(), ind.attention_weights(qn, kn)) and all(
        abs(ent[c] - float(ind.entropy(ind.attention_weights(qn, kn, c / math.sqrt(8))).mean()))
        < 1e-9
        for c in ent
    )
    return Finding(
        computed=f"logits + 1000 and − 1000 give the same weights as the logits: {invariant}; "
        f"mean entropy with logits ×1000: < 0.05 ({large_onehot}), ×1: {fmt(ent[1.0], 3)}, ×0.001: "
        f"{fmt(ent[1e-3], 4)} nats (uniform: log 16 = {fmt(math.log(16), 4)})",
        call="attention(q, k, v, bias=torch.full((4, 16), ±1000.0), return_weights=True); "
        "attention_stats(q, k, v, scale=c / √8).entropy",
        **judged(
            not error,
            "softmax sees only differences of its inputs (softmax(x + c) = softmax(x)): a large "
            "spread of the logits gives one-hot, a small spread (small inputs) gives near-uniform "
            "weights (entropy → log n), never one-hot; the saturation argument itself stands",
            Derivation(
                witness,
                "softmax(QKᵀ·c/√8) and its entropy in numpy equal attnlab's weights and "
                "attention_stats' entropies at c = 1000, 1, 0.001",
            ),
        ),
    )


@check("004-2-i")
def _vanishing() -> Finding:
    from ... import attention

    jac = _scaling().column("grad norm")
    g = _gen(11)
    q, k, v, dout = _randn(g, 1, 1, 1, 8), _randn(g, 1, 1, 16, 8), _randn(g, 1, 1, 16, 4), None
    dout = _randn(g, 1, 1, 1, 4)
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


@check("004-2-j")
def _scaled_stable() -> Finding:
    r = _scaling()
    ent, jac = r.column("entropy scaled"), r.column("grad norm scaled")
    ok = max(ent) / min(ent) < 1.05 and max(jac) / min(jac) < 1.05
    return Finding(
        computed="scaled logits: "
        + "; ".join(
            f"d_k={d}: entropy {fmt(e, 3)}, Jacobian norm {fmt(j, 3)}"
            for d, e, j in zip(_DKS, ent, jac, strict=True)
        ),
        call=_SCALING_CALL + ".column('entropy scaled'), .column('grad norm scaled')",
        **_verdict(ok, "scaled softmax statistics still depend on d_k"),
    )


@check("004-2-k")
def _sum_of_variances() -> Finding:
    from ...functional.scores import get_score

    dot, g = get_score("dot"), _gen(35)
    terms = dot.prepare(_randn(g, 50_000, 8)) * dot.prepare(_randn(g, 50_000, 8))  # (n, 8)
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
