"""Seed 000 — 13.2 自注意力机制的数学推导 (the mathematics of self-attention).

This module holds the shared helpers and the first sections; the others are in ``seed000_*``
beside it, the claims' metadata in ``seed000.toml``.
"""

from __future__ import annotations

import contextlib
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
