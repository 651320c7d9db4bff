"""Seed 000 — 13.2 自注意力机制的数学推导 (the mathematics of self-attention)."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator

import torch

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny


@check("000-scale-a")
def _variance() -> Finding:
    from ...functional.scores import get_score

    dot = get_score("dot")
    g = torch.Generator().manual_seed(0)
    parts, ok = [], True
    for d in (64, 512):
        q = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        k = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        raw = (dot.prepare(q) * dot.prepare(k)).sum(-1)  # q·k, one per pair
        scaled = raw * dot.default_scale(d)  # q·k / √d_k
        vr, vs = float(raw.var()), float(scaled.var())
        ok &= abs(vr / d - 1) < 0.05 and abs(vs - 1) < 0.05
        parts.append(f"d_k={d}: Var[q·k]={fmt(vr)}, Var[q·k/√d_k]={fmt(vs)}")
    return Finding(
        computed="; ".join(parts),
        call="s = get_score('dot'); raw = (s.prepare(q) * s.prepare(k)).sum(-1); "
        "(raw * s.default_scale(d)).var()",
        **judged(ok, "the sample variances do not match d_k and 1"),
    )


@check("000-scale-b")
def _saturation() -> Finding:
    from ... import attention

    logits = [0.1, 0.2, 10.0]
    q = torch.tensor([2.0, 0, 0, 0], dtype=torch.float64).view(1, 1, 1, 4)
    k = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    k[0, 0, :, 0] = torch.tensor(logits, dtype=torch.float64)  # q·k/√4 = the logits
    _, w = attention(q, k, k, return_weights=True)
    p = w[0, 0, 0].tolist()
    shown = [f"{x:.4f}" for x in p]
    exact = [f"{x:.3e}" for x in p]
    agrees = shown == ["0.0000", "0.0000", "1.0000"]
    closed = ind.softmax(logits)
    return Finding(
        computed=f"softmax = [{', '.join(exact)}], to four decimals [{', '.join(shown)}]",
        call="attention(q, k, v, return_weights=True) with q·k/√4 = [0.1, 0.2, 10.0]",
        **judged(
            agrees,
            f"the small weights are {p[0]:.1e} and {p[1]:.1e}, which round to "
            f"{p[0]:.4f} and {p[1]:.4f} and the largest to {p[2]:.4f} at four decimals; the "
            "saturation point itself stands",
            Derivation(
                ind.close(p, closed),
                "closed form e^x / Σe^x of [0.1, 0.2, 10.0] = ["
                + ", ".join(f"{x:.3e}" for x in closed)
                + "]",
            ),
        ),
    )


@check("000-space-a")
def _matrix_memory() -> Finding:
    from ...analysis import estimate

    table = {128: 64 * 2**10, 512: 2**20, 1024: 4 * 2**20, 4096: 64 * 2**20, 16384: 2**30}
    got, ok = [], True
    for n, want in table.items():
        nbytes = estimate(n, 64, 1, dtype="float32").value("score matrix", "naive")
        ok &= nbytes == want
        got.append(f"n={n}: {int(nbytes):,} B")
    return Finding(
        computed="; ".join(got),
        call="estimate(n, 64, 1, dtype='float32').value('score matrix', 'naive')",
        **judged(ok, "the byte counts differ from the table"),
    )


def _qkv(n: int, m: int, dk: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(1, 1, rows, cols, generator=g, dtype=torch.float64)
        for rows, cols in ((n, dk), (m, dk), (m, dv))
    )


@check("000-def-a")
def _definition() -> Finding:
    from ... import attention

    q, k, v = _qkv(5, 7, 4, 3)
    out = attention(q, k, v)
    formula = torch.softmax(q @ k.transpose(-1, -2) / 4**0.5, dim=-1) @ v
    err = float((out - formula).abs().max())
    ok = tuple(out.shape[-2:]) == (5, 3) and err < 1e-12
    return Finding(
        computed=f"output shape {tuple(out.shape[-2:])}; max |attention − formula| = {tiny(err)}",
        call="attention(q, k, v) vs torch.softmax(q @ k.mT / √d_k, -1) @ v",
        **judged(ok, "attnlab's attention differs from the formula"),
    )


@check("000-steps-a")
def _rows_are_distributions() -> Finding:
    from ... import attention

    q, k, v = _qkv(6, 9, 8, 5, seed=1)
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


@check("000-scale-c")
def _ranges() -> Finding:
    from ...functional.scores import get_score

    dot = get_score("dot")
    g = torch.Generator().manual_seed(2)
    parts, ok = [], True
    for d, raw_text, scaled_text in ((64, 25.0, 3.1), (512, 72.0, 3.2)):
        q = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        k = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        raw = (dot.prepare(q) * dot.prepare(k)).sum(-1)
        scaled = raw * dot.default_scale(d)
        r, s = (float(x.abs().quantile(0.998)) for x in (raw, scaled))
        ok &= abs(r / raw_text - 1) < 0.05 and abs(s / scaled_text - 1) < 0.05
        parts.append(f"d_k={d}: 99.8 % of |q·k| ≤ {fmt(r, 3)}, of |q·k/√d_k| ≤ {fmt(s, 3)}")
    return Finding(
        computed="; ".join(parts),
        call="(s.prepare(q) * s.prepare(k)).sum(-1).abs().quantile(0.998)",
        **judged(ok, "the observed ranges differ from the text's by more than 5 %"),
    )


@check("000-scale-d")
def _saturation_gradient() -> Finding:
    from ... import attention

    q, k, v = _qkv(1, 16, 512, 8, seed=3)
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


@check("000-dot-a")
def _dot_geometry() -> Finding:
    from ...functional.scores import get_score

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
    """``e(q_i, k_i) = vᵀ tanh(W_q q_i + W_k k_i (+ b))`` of an `AdditiveAttention`, per pair."""
    return torch.tanh(m.query_proj(q) + m.key_proj(k)) @ m.v


def _additive_by_hand(m, q: torch.Tensor, k: torch.Tensor):
    """The same score from the module's weight matrices in numpy (the independent side)."""
    import numpy as np

    wq, wk = m.query_proj.weight.numpy(), m.key_proj.weight.numpy()
    b = sum(lin.bias.numpy() for lin in (m.query_proj, m.key_proj) if lin.bias is not None)
    return np.tanh(q.numpy() @ wq.T + k.numpy() @ wk.T + b) @ m.v.numpy()


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
        computed=f"bias-free: max |e(q, k) + e(−q, −k)| = {tiny(odd[False])} (odd), its best "
        f"multiple fitting q·k on the symmetric sample is {tiny(abs(fit[False]))}; with the tanh "
        f"bias: {odd[True]:.3g} (not odd)",
        call="AdditiveAttention(8, 8, 64, bias=False|True): vᵀ tanh(query_proj(q) + key_proj(k)) "
        "at (q, k) and (−q, −k)",
        **judged(
            not wrong,
            "the formula as written (no bias) is odd in (q, k), so it cannot approximate an even "
            "score such as q·k at all; universal approximation needs the bias inside the tanh "
            "(a one-hidden-layer network of [q; k], 2d² + 2d parameters)",
            Derivation(
                by_hand,
                "vᵀ tanh(W_q q + W_k k (+ b)) in numpy from the module's weight matrices, "
                "equal to its scores to 1e-10",
            ),
        ),
    )


@check("000-add-c")
def _additive_limits() -> Finding:
    from ... import AdditiveAttention

    n, d = 512, 64
    c = _score_costs(n, d)
    params = sum(p.numel() for p in AdditiveAttention(d, d, d, bias=False).parameters())
    kept = c["additive"]["largest"] * 4  # float32 tanh hidden, kept for backward
    dot_kept = c["dot"]["largest"] * 4  # float32 weights, kept for backward
    ok = (
        c["additive"]["total"] > c["dot"]["total"]
        and params > 0
        and kept > dot_kept
        and c["dot"]["matmul"] == _estimate_matmul(n, d)
    )
    return Finding(
        computed=f"forward FLOPs {c['additive']['total']:,} vs {c['dot']['total']:,} for dot "
        f"(×{c['additive']['total'] / c['dot']['total']:.2f}); {params:,} parameters vs 0; the "
        f"backward keeps the tanh hidden, {kept / 2**20:.0f} MiB vs {dot_kept / 2**20:.0f} MiB of "
        "dot-product weights",
        call="AdditiveAttention(64, 64, 64, bias=False): parameters; FlopCounterMode and "
        "saved_tensors_hooks around it and attention(q, q, q, backend='reference') on meta",
        **judged(ok, "additive attention is not the costlier one"),
        measured=_train_timing_note(n, d),
    )


def _train_timing_note(n: int, d: int) -> str:
    """Best-of-3 forward + backward seconds of dot and additive attention, float32."""
    from ... import AdditiveAttention, attention
    from ...utils.timing import best_times

    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 1, n, d, generator=g).requires_grad_() for _ in range(3))
    torch.manual_seed(13)
    add = AdditiveAttention(d, d, d, bias=False)
    with _one_thread():
        t = best_times(
            {
                "dot": lambda: attention(q, k, v).sum().backward(),
                "additive": lambda: add(q[0], k[0], v[0])[0].sum().backward(),
            },
            3,
        )
    return (
        f"forward + backward at n={n}, d={d} on one thread of this machine (best of 3): dot "
        f"{1e3 * t['dot']:.2f} ms, additive {1e3 * t['additive']:.2f} ms (upper bounds under load)"
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


def _measured(fn, *shapes: tuple[int, ...]) -> tuple[int, int]:
    """What one call of ``fn`` on meta tensors of ``shapes`` does: (matmul FLOPs counted by
    FlopCounterMode, elements of the largest tensor autograd saves for backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    xs = [torch.empty(*s, device="meta", requires_grad=True) for s in shapes]
    saved: list[int] = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with (
        FlopCounterMode(display=False) as fc,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        fn(*xs)
    return fc.get_total_flops(), max(saved)


def _score_costs(n: int, d: int) -> dict[str, dict[str, int]]:
    """FLOPs of one head's attention (n queries, n keys, d = d_k = d_v, additive hidden h = d) by
    score: ``total``, ``matmul`` (what a BLAS runs) and ``largest`` (the biggest intermediate, in
    elements), measured on attnlab's calls: the matmuls counted by FlopCounterMode, the largest
    intermediate as the largest tensor kept for backward. The elementwise work is counted per
    element of what the calls build: softmax FLOPs from `estimate`, the cosine row norms, and
    for the additive form the broadcast sum, the tanh and vᵀ·tanh over its (n, n, h) hidden."""
    from ... import AdditiveAttention, attention
    from ...analysis import estimate

    with torch.device("meta"):
        add = AdditiveAttention(d, d, d, bias=False)
    runs = {
        "dot": _measured(lambda q: attention(q, q, q, backend="reference"), (1, 1, n, d)),
        "cosine": _measured(
            lambda q: attention(q, q, q, score="cosine", backend="reference"), (1, 1, n, d)
        ),
        "additive": _measured(lambda q: add(q, q, q), (1, n, d)),
    }
    sm = int(estimate(n, d, 1).value("softmax", "naive"))
    extra = {
        "dot": sm,
        "cosine": sm + 2 * n * (3 * d + 1),  # squares, sum, sqrt, divide for every q and k row
        "additive": sm + 4 * runs["additive"][1],  # sum, tanh, vᵀ multiply-add per hidden unit
    }
    return {
        k: {"total": mm + extra[k], "matmul": mm, "largest": largest}
        for k, (mm, largest) in runs.items()
    }


def _estimate_matmul(n: int, d: int) -> int:
    """`estimate`'s matmul FLOPs of one dot-product head (QKᵀ and PV)."""
    from ...analysis import estimate

    e = estimate(n, d, 1)
    return int(e.value("scores QKᵀ", "naive") + e.value("weighted sum PV", "naive"))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Times on one CPU thread: stable when other jobs share the cores (oversubscribed threads
    can make a small kernel 100× slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _score_times(n: int, d: int) -> dict[str, float]:
    """Best-of-3 wall-clock seconds of one forward of each score form, float32 (``measured``)."""
    from ... import AdditiveAttention, attention
    from ...utils.timing import best_times

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
    torch.manual_seed(11)
    add = AdditiveAttention(d, d, d, bias=False).eval()
    with torch.no_grad(), _one_thread():
        return best_times(
            {
                "dot": lambda: attention(q, k, v),
                "cosine": lambda: attention(q, k, v, score="cosine"),
                "additive": lambda: add(q[0], k[0], v[0]),
            },
            3,
        )


def _timing_note(n: int, d: int) -> str:
    import os

    t = _score_times(n, d)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"one float32 forward at n={n}, d={d} on one thread of this machine (best of 3): "
        + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in t.items())
        + f" (additive/dot ×{t['additive'] / t['dot']:.1f}); load average {load:.1f}, so these "
        "are upper bounds"
    )


@check("000-compare-b")
def _score_comparison() -> Finding:
    d = 64
    c, c2 = _score_costs(512, d), _score_costs(1024, d)
    growth = {k: c2[k]["total"] / c[k]["total"] for k in c}
    quadratic = all(3.5 < g <= 4.0 for g in growth.values())
    dot, cos, add = (c[k]["total"] for k in ("dot", "cosine", "additive"))
    order = dot < cos < 1.01 * dot and add > 1.5 * dot
    share = {k: c[k]["matmul"] / c[k]["total"] for k in c}
    counted = c["dot"]["matmul"] == _estimate_matmul(512, d)  # the counter and the cost model
    ok = quadratic and order and share["additive"] < 0.5 < share["dot"] and counted
    return Finding(
        computed="n=512: "
        + "; ".join(
            f"{k} {v['total']:,} FLOPs ({100 * share[k]:.0f} % matmul, largest intermediate "
            f"{v['largest']:,})"
            for k, v in c.items()
        )
        + "; ×"
        + ", ×".join(f"{growth[k]:.2f} ({k})" for k in c)
        + " when n doubles",
        call="FlopCounterMode and saved_tensors_hooks around attention(q, q, q, score=…, "
        "backend='reference') and AdditiveAttention(64, 64, 64, bias=False)(q, q, q) on meta; "
        "estimate(512, 64, 1).value('softmax', 'naive')",
        **judged(ok, "the FLOP counts do not rank dot < cosine < additive or do not grow as n²"),
        measured=_timing_note(512, d),
    )


@check("000-cos-a")
def _cosine_invariance() -> Finding:
    from ... import attention

    q, k, v = _qkv(4, 6, 32, 3, seed=6)
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


@check("000-cos-b")
def _cosine_dimension() -> Finding:
    from ... import attention
    from ...analysis.weights import entropy

    spreads, ents, by_hand = [], [], True
    for d in (16, 1024):
        q, k, v = _qkv(64, 128, d, 2, seed=7)
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


@check("000-temp-a")
def _temperature() -> Finding:
    from ... import attention
    from ...analysis.weights import entropy

    q, k, v = _qkv(8, 32, 16, 4, seed=8)
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


@check("000-code-a")
def _java_sample() -> Finding:
    from ... import MultiHeadAttention

    torch.manual_seed(18)
    mha = MultiHeadAttention(16, 1).double().eval().requires_grad_(False)
    (wq, bq), (wk, bk), (wv, bv) = mha._weights()
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(18), dtype=torch.float64)
    lin = torch.nn.functional.linear
    Q, K, V = lin(x, wq, bq), lin(x, wk, bk), lin(x, wv, bv)  # wQ/wK/wV.forward(input)
    scores = Q @ K.transpose(-2, -1)  # Q.dot(K.transpose(-2, -1))
    scores = scores / math.sqrt(16)  # scores.div(Math.sqrt(dKey))
    weights = scores.softmax(-1)  # scores.softmax(-1)
    output = weights @ V  # weights.dot(V)
    sample = mha.out_proj(output)  # wO.forward(output)
    err = float((sample - mha(x)).abs().max())
    return Finding(
        computed=f"max |sample − MultiHeadAttention(16, 1)(x)| = {tiny(err)}",
        call="the sample's six steps with mha._weights() and mha.out_proj vs mha(x)",
        **judged(err < 1e-12, "the code sample differs from attention with an output projection"),
    )


@check("000-time-a")
def _time_complexity() -> Finding:
    from ...analysis import estimate

    rows = ("scores QKᵀ", "softmax", "weighted sum PV")

    def flops(n: int, d: int) -> list[float]:
        e = estimate(n, d, 1)
        return [e.value(r, "naive") for r in rows]

    base = flops(512, 64)
    by_n = [b2 / b1 for b1, b2 in zip(base, flops(1024, 64), strict=True)]
    by_d = [b2 / b1 for b1, b2 in zip(base, flops(512, 128), strict=True)]
    ok = by_n == [4.0, 4.0, 4.0] and by_d == [2.0, 1.0, 2.0]
    return Finding(
        computed=f"n=512, d=64: QKᵀ {base[0]:,.0f}, softmax {base[1]:,.0f}, PV {base[2]:,.0f} "
        f"FLOPs; ×{by_n} when n doubles, ×{by_d} when d doubles",
        call="estimate(n, d, 1).value('scores QKᵀ' | 'softmax' | 'weighted sum PV', 'naive')",
        **judged(ok, "the FLOP counts do not scale as n²d, n², n²d"),
    )


@check("000-o2-b")
def _twelve_gb() -> Finding:
    from ...analysis.costs import max_seq_len

    bert = dict(
        d_model=768, n_layers=12, n_heads=12, vocab_size=30522, learned_positions=512, batch=1
    )
    naive32 = max_seq_len("12GB", dtype="float32", attention="naive", **bert)
    naive16 = max_seq_len("12GB", dtype="float16", attention="naive", **bert)
    tiled32 = max_seq_len("12GB", dtype="float32", attention="flash", **bert)
    ok = naive32 <= 4096 <= naive16 and tiled32 > 2 * 4096
    return Finding(
        computed=f"largest n in 12 GB: {naive32:,} (float32), {naive16:,} (mixed float16); "
        f"with tiled attention (the 'special optimisation') {tiled32:,} in float32",
        call="max_seq_len('12GB', dtype=…, attention='naive'|'flash', d_model=768, n_layers=12, "
        "n_heads=12, vocab_size=30522, learned_positions=512, batch=1)",
        **judged(ok, "the memory model does not put the limit near 4096"),
    )


@check("000-o2-a")
def _doubling() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...models import TransformerBlock, TransformerConfig

    # the reference backend: plain matmuls that FlopCounterMode sees (a fused kernel is opaque)
    cfg = TransformerConfig(
        d_model=768, n_heads=12, d_ff=3072, positional=None, attn_backend="reference"
    )
    with torch.device("meta"):
        block = TransformerBlock(cfg)
    counts = {}
    for n in (1024, 2048, 4096, 8192):
        with FlopCounterMode(display=False) as fc:
            block(torch.empty(1, n, 768, device="meta"))
        counts[n] = fc.get_total_flops()
    ratios = {n: counts[2 * n] / counts[n] for n in (1024, 2048, 4096)}
    formula = all(counts[n] == ind.transformer_layer_flops(n, 768, 3072) for n in counts)
    wrong = all(r < 3.5 for r in ratios.values())
    return Finding(
        computed="FLOPs per layer = 24nd² + 4n²d exactly; doubling n multiplies them by "
        + ", ".join(f"{r:.2f} at n={n}" for n, r in ratios.items()),
        call="FlopCounterMode(); TransformerBlock(cfg)(torch.empty(1, n, 768, device='meta'))",
        **judged(
            not wrong,
            "only the n² part (attention scores) quadruples; a whole layer at d=768 "
            f"grows {ratios[1024]:.2f}× (n=1024), {ratios[2048]:.2f}× (2048), {ratios[4096]:.2f}× "
            "(4096) and approaches 4× only when n ≫ 6d",
            Derivation(
                formula,
                "closed form 8nd² + 4n·d·d_ff + 4n²d (projections, FFN, scores and mixing) "
                "equals the counted FLOPs at every n",
            ),
        ),
    )


@check("000-o2-c")
def _decode_latency() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ... import KVCache, MultiHeadAttention, masks

    E = 64
    torch.manual_seed(16)
    mha = MultiHeadAttention(E, 4, backend="reference").eval()
    g = torch.Generator().manual_seed(16)
    flops = {}
    for t in (64, 256, 1024):
        cache = KVCache()
        with torch.no_grad():
            mha(torch.randn(1, t, E, generator=g), mask=masks.causal(), cache=cache)
            with FlopCounterMode(display=False) as fc:
                mha(torch.randn(1, 1, E, generator=g), mask=masks.causal(), cache=cache)
        flops[t] = fc.get_total_flops()
    ok = all(f == 8 * E * E + 4 * (t + 1) * E for t, f in flops.items())
    return Finding(
        computed="FLOPs of one decoding step: "
        + ", ".join(f"{f:,} after {t} tokens" for t, f in flops.items())
        + " = 8E² (projections) + 4(t + 1)E (attention over the cache): linear in the context, "
        "so a whole generation of n tokens is O(n²d)",
        call="FlopCounterMode(); mha(x_new, mask=masks.causal(), cache=cache) with t cached tokens",
        **judged(ok, "the per-step cost does not grow with the context"),
    )


@check("000-rnn-a")
def _rnn_table() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...analysis import estimate

    d = 512
    rnn = torch.nn.RNN(d, d, batch_first=True, device="meta")
    per_step = []
    for n in (16, 32):  # the recurrence costs the same every step: count two lengths
        with FlopCounterMode(display=False) as fc:
            rnn(torch.empty(1, n, d, device="meta"))
        per_step.append(fc.get_total_flops() / n)
    out = []
    for n in (128, 2048):
        e = estimate(n, d, 1)
        sa = e.value("scores QKᵀ", "naive") + e.value("weighted sum PV", "naive")
        out.append((n, sa, per_step[0] * n))
    linear = per_step[0] == per_step[1] == 4 * d * d
    ok = linear and out[0][1] < out[0][2] and out[1][1] > out[1][2]
    return Finding(
        computed="; ".join(
            f"n={n}: self-attention {sa:,.0f}, RNN {r:,.0f} FLOPs" for n, sa, r in out
        ),
        call="estimate(n, 512, 1) QKᵀ + PV rows vs FlopCounterMode over torch.nn.RNN(512, 512) "
        "(per step, 4d² FLOPs, times n)",
        **judged(ok, "the crossover is not at n ≈ d"),
    )


@check("000-rnn-b")
def _rnn_memory_path() -> Finding:
    from ...analysis import estimate
    from ...analysis.costs import complexity_table

    d, parts, ok = 512, [], True
    for n in (128, 2048):
        rows = {r["layer"]: r for r in complexity_table(n, d)}
        sa, rnn = rows["self-attention"], rows["recurrent"]
        scores = estimate(n, d, 1, dtype="float32").value("score matrix", "naive")
        states = n * d * 4
        ok &= (scores > states) == (n > d) and sa["path"] == 1 and rnn["path"] == n
        parts.append(
            f"n={n}: n×n weights {int(scores):,} B vs RNN states {states:,} B; path "
            f"{sa['path']} vs {rnn['path']}"
        )
    return Finding(
        computed="; ".join(parts),
        call="complexity_table(n, 512) rows 'self-attention' / 'recurrent' (path); "
        "estimate(n, 512, 1).value('score matrix', 'naive')",
        **judged(ok, "the memory crossover is not at n = d or the paths are not 1 and n"),
    )


@check("000-sparse-a")
def _sparse_cost() -> Finding:
    from ... import masks

    parts, ok = [], True
    for n in (1024, 4096):
        w, s = 64, int(n**0.5)
        local = masks.sliding_window(w).attended_pairs(n, n)
        strided = masks.strided(s).attended_pairs(n, n)
        ok &= 0.9 * n * w <= local <= n * w and 0.5 * n * s <= strided <= 2 * n * s
        parts.append(
            f"n={n}: window {local:,} pairs (nw = {n * w:,}), stride {s}: {strided:,} "
            f"(n√n = {n * s:,})"
        )
    return Finding(
        computed="; ".join(parts) + f"; dense causal {masks.causal().attended_pairs(4096, 4096):,}",
        call="masks.sliding_window(64).attended_pairs(n, n); "
        "masks.strided(√n).attended_pairs(n, n)",
        **judged(ok, "the pair counts do not scale as nw and n√n"),
    )


@check("000-linear-a")
def _linear_formula() -> Finding:
    from ...linear import linear_attention

    q, k, v = _qkv(64, 64, 16, 16, seed=9)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    ours = linear_attention(q, k, v, feature_map="elu", eps=0.0)
    right = ind.linear_attention(q.numpy(), k.numpy(), v.numpy())
    text = q @ (phi(k).mT @ phi(v))
    gap = float(abs(ours.numpy() - right).max())
    rel = float((text - ours).norm() / ours.norm())
    wrong = rel > 0.5
    return Finding(
        computed="linear_attention = φ(Q)(φ(K)ᵀV) / (φ(Q)φ(K)ᵀ1) to "
        f"{tiny(gap, 1e-10)}; the text's Q·φ(K)ᵀ·φ(V) differs from it by {rel:.3g} (relative)",
        call="linear_attention(q, k, v, feature_map='elu', eps=0.0) vs q @ (φ(k).mT @ φ(v))",
        **judged(
            not wrong,
            "φ belongs on Q and K, not V, and the row normaliser φ(Q)φ(K)ᵀ1 is missing: "
            "linear attention is φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1))",
            Derivation(
                gap < 1e-10,
                "φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1)) with φ = elu + 1 in numpy (Katharopoulos et "
                "al., eq. 6) equals linear_attention to 1e-10",
            ),
        ),
    )


@check("000-linear-b")
def _linear_works() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...functional.fnet import fnet_mixing
    from ...functional.performer import favor_attention
    from ...linear import linear_attention

    def count(fn) -> int:
        with FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()

    growth = {}
    for name, fn in (
        (
            "Performer",
            lambda q: favor_attention(
                q, q, q, num_features=64, generator=torch.Generator().manual_seed(17)
            ),
        ),
        ("Linear Transformer", lambda q: linear_attention(q, q, q, feature_map="elu")),
    ):
        f1, f2 = (count(lambda n=n, fn=fn: fn(torch.zeros(1, 1, n, 32))) for n in (512, 1024))
        growth[name] = f2 / f1
    x = torch.zeros(1, 8, 4, dtype=torch.float64)
    x[0, 3, 1] = 1.0
    mixed = fnet_mixing(x)[0]
    negative, reached = int((mixed < -1e-12).sum()), int((mixed.abs() > 1e-12).sum())
    wrong = all(abs(g - 2) < 0.01 for g in growth.values()) and negative > 0
    fft_ok = ind.close(mixed.numpy(), ind.fourier_mixing(x.numpy())[0], 1e-12)
    return Finding(
        computed="FLOPs ×"
        + ", ×".join(f"{g:.3f} ({k})" for k, g in growth.items())
        + " when n doubles (linear); FNet's fnet_mixing(x) takes no queries or keys: a one-hot "
        f"token reaches {reached} of {mixed.numel()} outputs, {negative} with negative weights (no "
        "softmax, not a distribution), by an FFT",
        call="FlopCounterMode over favor_attention(q, q, q, num_features=64) and "
        "linear_attention(q, q, q, feature_map='elu') at n = 512, 1024; fnet_mixing(one-hot)",
        **judged(
            not wrong,
            "Performer and the Linear Transformer are linear-time attention, but FNet is not "
            "attention at all (a fixed Fourier token mixing without queries, keys or softmax) "
            "and its FFT costs O(n log n), not O(n)",
            Derivation(
                fft_ok,
                "FNet's mixing Re(FFT_seq(FFT_hidden(x))) by numpy's FFT equals fnet_mixing on the "
                "one-hot token",
            ),
        ),
    )


@check("000-mem-a")
def _checkpointing() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...models import GPT, TransformerConfig

    torch.manual_seed(10)
    model = GPT(TransformerConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4)).double()
    idx = torch.randint(0, 50, (1, 128), generator=torch.Generator().manual_seed(10))
    saved, flops, losses = {}, {}, {}
    for on in (False, True):
        model.gradient_checkpointing = on
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with FlopCounterMode(display=False) as fc:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(idx).logsumexp(-1).mean()
            loss.backward()
        saved[on], flops[on], losses[on] = total, fc.get_total_flops(), float(loss.detach())
        model.zero_grad()
    ok = saved[True] < saved[False] / 2 and flops[True] > flops[False]
    return Finding(
        computed=f"saved for backward {saved[False] / 2**20:.2f} MiB → "
        f"{saved[True] / 2**20:.2f} MiB; forward + backward FLOPs "
        f"×{flops[True] / flops[False]:.3f}; same loss: {losses[True] == losses[False]}",
        call="model.gradient_checkpointing = True; saved_tensors_hooks; FlopCounterMode",
        **judged(ok, "checkpointing did not trade compute for memory"),
    )


@check("000-mem-b")
def _mixed_precision() -> Finding:
    from ...analysis.costs import model_cost

    kw = dict(d_model=768, n_layers=12, n_heads=12, vocab_size=30522, batch=8, train=True)
    mem = {dt: model_cost(512, dtype=dt, **kw).memory for dt in ("float32", "bfloat16")}
    scale = torch.amp.GradScaler("cpu").get_scale()
    g = torch.tensor(1e-8)
    fp16, bf16 = float(g.half()), float(g.bfloat16())
    scaled = float((g * scale).half()) / scale
    ok = (
        mem["bfloat16"]["total"] < mem["float32"]["total"]
        and mem["bfloat16"]["activations"] < 0.51 * mem["float32"]["activations"]
        and fp16 == 0.0
        and abs(scaled / 1e-8 - 1) < 1e-2
        and bf16 > 0
    )
    return Finding(
        computed=f"training memory {mem['float32']['total'] / 2**30:.2f} GiB float32 → "
        f"{mem['bfloat16']['total'] / 2**30:.2f} GiB mixed bfloat16 (activations "
        f"×{mem['bfloat16']['activations'] / mem['float32']['activations']:.3f}, float32 master "
        f"weights added); a 1e-8 gradient is {fp16:g} in float16, {scaled:.3g} after "
        f"scaling by {scale:g}, {bf16:.3g} in bfloat16 (which needs no scaling)",
        call="model_cost(512, dtype='float32'|'bfloat16', train=True, …).memory; "
        "torch.tensor(1e-8).half(), (g * GradScaler('cpu').get_scale()).half()",
        **judged(ok, "16-bit training does not save memory or fp16 does not need scaling"),
    )
