"""Checks of compute costs: FLOPs of the scores, the projections and a whole layer, counted by
`attnlab.analysis.estimate` and on the meta device (subjects ``score-flops``, ``flops``,
``projections``, ``projection-count``, ``estimate-pairs``, ``score-width``, ``ffn``,
``additive-cost``, ``softmax-width``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged
from ._shared import _additive, _est, _found, _gen, _mha, _randn_from, _verdict


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


@check("001-2.2-a")
def _traditional_cost() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ... import AdditiveAttention

    d = 64
    with torch.device("meta"):
        m = AdditiveAttention(d, d, d, bias=False)
    counts = {}
    for n in (256, 512, 1024):
        x = torch.empty(1, n, d, device="meta")
        with FlopCounterMode(display=False) as fc:
            m(x, x, x)
        counts[n] = fc.get_total_flops()
    growth = [counts[512] / counts[256], counts[1024] / counts[512]]
    quadratic = growth[1] > 3.5 and growth[1] > growth[0]  # → 4 once n ≫ d
    closed = all(c == ind.additive_attention_flops(n, n, d, d, d, d) for n, c in counts.items())
    return Finding(
        computed=f"FLOPs {counts[256]:,} (n=256), {counts[512]:,} (512), {counts[1024]:,} (1024): "
        f"×{growth[0]:.2f}, ×{growth[1]:.2f} per doubling of n",
        call="FlopCounterMode(); AdditiveAttention(64, 64, 64, bias=False)(x, x, x) on meta",
        **judged(
            not quadratic,
            "each decoder step scores all n encoder states, so the attention itself is O(n²d) "
            "in total (O(nd) per step); O(nd²) is the recurrence's (and the projections') cost",
            Derivation(
                closed,
                "closed form 4nd·h + 2n²d_v (the projections and the weighted sum) equals the "
                "counted FLOPs at every n",
            ),
        ),
    )


@check("002-8.3.1-b")
def _heads_same_compute() -> Finding:
    from ...analysis import estimate

    mm = {}
    for h in (1, 2, 4, 8, 12):
        e = estimate(512, 768, h)
        mm[h] = (
            e.value("QKV + output projections", "naive")
            + e.value("scores QKᵀ", "naive")
            + e.value("weighted sum PV", "naive"),
            e.value("softmax", "naive"),
            e.value("total", "naive"),
        )
    same = len({v[0] for v in mm.values()}) == 1
    sm = mm[12][1] / mm[12][2]
    return _found(
        f"matmul FLOPs {fmt(mm[1][0])} for every h; softmax adds 5·h·n² "
        f"({fmt(100 * sm, 3)} % of the total at h=12)",
        "estimate(512, 768, h).value('scores QKᵀ' / 'weighted sum PV' / …, 'naive')",
        same and sm < 0.02,
        "the matmul FLOPs depend on the number of heads",
    )


@check("002-8.3.3-a")
def _param_count() -> Finding:
    from ...analysis import estimate

    E = 768
    est = {h: estimate(128, E, h, bias=False).value("projection weights", "naive") for h in (1, 12)}
    counted = {h: sum(p.numel() for p in _mha(E, h, bias=False).parameters()) for h in (1, 12)}
    qkv = _mha(E, 12, bias=False).qkv_proj.weight.numel()
    # the text: one head takes 3d² (Q, K, V only), several heads 4d² (the extra W^O)
    split = est[1] == 3 * E * E and est[12] == 4 * E * E
    return _found(
        f"QKV weights {qkv:,} = 3·768²; the layer's projection weights: {int(est[1]):,} with one "
        f"head, {int(est[12]):,} with 12 (= 4·768² both)",
        "estimate(128, 768, h, bias=False).value('projection weights', 'naive'), h = 1, 12; "
        "MultiHeadAttention(768, h, bias=False).parameters()",
        split,
        "the output projection W^O belongs to the attention layer whatever the number of heads: "
        "one head with W^O has 4d² as well, and multi-head attention without it 3d²; the "
        "heads split d_model and add no weights",
        Derivation(
            counted == est and qkv == 3 * E * E,
            "the weight count of MultiHeadAttention(768, h) summed over its parameters equals "
            f"estimate's at h = 1 and 12 ({counted[1]:,} and {counted[12]:,})",
        ),
    )


@check("002-8.3.3-b")
def _score_cost() -> Finding:
    from ...analysis import estimate

    vals = {
        (n, h): estimate(n, 768, h).value("scores QKᵀ", "naive")
        for n in (512, 1024)
        for h in (1, 12)
    }
    ok = all(v == 2 * n * n * 768 for (n, _), v in vals.items())
    return _found(
        "QKᵀ FLOPs: "
        + ", ".join(f"n={n} h={h}: {fmt(v)}" for (n, h), v in vals.items())
        + " (= 2·n²·d_model)",
        "estimate(n, 768, h).value('scores QKᵀ', 'naive')",
        ok,
        "the score cost is not 2·n²·d_model independent of h",
    )


@check("002-8.4.1-a")
def _proj_cost() -> Finding:
    p = {
        (n, E): _est(n, E).value("QKV + output projections", "naive")
        for n, E in ((512, 768), (1024, 768), (512, 1536))
    }
    rn, rd = p[1024, 768] / p[512, 768], p[512, 1536] / p[512, 768]
    ok = rn == 2 and rd == 4 and p[512, 768] == 8 * 512 * 768**2
    return _found(
        f"{fmt(p[512, 768])} FLOPs at n=512, d=768 (= 8·n·d²); ×{fmt(rn)} for 2n, ×{fmt(rd)} "
        "for 2d",
        "estimate(n, d, 12).value('QKV + output projections', 'naive')",
        ok,
        "the projection cost is not linear in n and quadratic in d",
    )


@check("002-8.4.1-b")
def _score_pv_cost() -> Finding:
    s = {
        n: (
            _est(n, 64, 1).value("scores QKᵀ", "naive"),
            _est(n, 64, 1).value("weighted sum PV", "naive"),
        )
        for n in (512, 1024)
    }
    ok = all(a == b == 2 * n * n * 64 for n, (a, b) in s.items())
    return _found(
        "; ".join(f"n={n}: QKᵀ {fmt(a)}, PV {fmt(b)} FLOPs (2·n²·d)" for n, (a, b) in s.items()),
        "estimate(n, 64, 1).value('scores QKᵀ' / 'weighted sum PV', 'naive')",
        ok,
        "the score or weighted-sum cost is not 2·n²·d",
    )


@check("002-8.4.1-c")
def _total_cost() -> Finding:
    vals = {n: _est(n).value("total", "naive") for n in (256, 1024, 4096)}
    ok = all(v == 8 * n * 768**2 + 4 * n * n * 768 + 5 * 12 * n * n for n, v in vals.items())
    return _found(
        "; ".join(f"n={n}: {fmt(v)} FLOPs" for n, v in vals.items()) + " = 8nd² + 4n²d + 5hn²",
        "estimate(n, 768, 12).value('total', 'naive')",
        ok,
        "the total is not 8nd² + 4n²d + 5hn²",
    )


def _rnn_flops(n: int, d: int) -> int:
    """FLOPs of an Elman RNN (torch.nn.RNN, d → d): two d×d mat-vecs per step."""
    rnn = torch.nn.RNN(d, d, bias=False)
    return 2 * n * sum(p.numel() for p in rnn.parameters())


@check("002-8.4.1-d")
def _rnn_crossover() -> Finding:
    def core(n: int) -> float:
        e = _est(n)
        return sum(e.value(r, "naive") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))

    ratio = {n: core(n) / _rnn_flops(n, 768) for n in (256, 512, 768, 1024, 2048)}
    ok = ratio[256] < 1 < ratio[1024] and 0.5 < ratio[512] < 2
    return _found(
        "attention core / RNN FLOPs: " + ", ".join(f"n={n}: {fmt(r, 3)}" for n, r in ratio.items()),
        "estimate(n, 768, 12) scores+softmax+PV vs 2·n·numel(torch.nn.RNN(768, 768))",
        ok,
        "the crossover is not near n = d_model",
    )


@check("002-8.4.4-a")
def _long_table() -> Finding:
    table = {
        512: (262_144, 0.5),
        2048: (4 * 2**20, 8),
        8192: (64 * 2**20, 128),
        32768: (1024 * 2**20, 2048),
        131072: (16384 * 2**20, 32768),
    }
    got, ok = [], True
    for n, (entries, mib) in table.items():
        e = _est(n, 64, 1, dtype="float16")
        b = e.value("score matrix", "naive")
        pairs = e.value("attended pairs per head", "naive")
        ok &= pairs == entries and b == mib * 2**20
        got.append(f"n={n}: {int(pairs):,} entries, {fmt(b / 2**20)} MiB")
    return _found(
        "; ".join(got),
        "estimate(n, 64, 1, dtype='float16').value('score matrix', 'naive')",
        ok,
        "the sizes differ from the table",
    )


@check("002-8.7-b")
def _summary_cost() -> Finding:
    t = {n: _est(n).value("total", "naive") for n in (1024, 4096)}
    t_ok = all(v == 8 * n * 768**2 + 4 * n * n * 768 + 60 * n * n for n, v in t.items())
    m1 = _est(4096).value("activations kept for backward", "naive")
    m12 = _est(4096, layers=12).value("activations kept for backward", "naive")
    share = 12 * 4096**2 * 4 / m1
    return _found(
        f"FLOPs {fmt(t[1024])} at n=1024, {fmt(t[4096])} at 4096 (8nd² + 4n²d + 5hn²); kept "
        f"activations ×{fmt(m12 / m1)} for 12 layers, {fmt(100 * share, 3)} % of it n²·h",
        "estimate(n, 768, 12, layers=L).value('total' / 'activations kept for backward', 'naive')",
        t_ok and m12 == 12 * m1 and share > 0.9,
        "the totals do not follow O(n²d + nd²) and O(n²hL)",
    )


@check("002-8.7-d")
def _params_heads() -> Finding:
    base = _est(128, 768, 12, bias=False).value("projection weights", "naive")
    best = min(
        range(13, 30),
        key=lambda h: abs(
            _est(128, 64 * h, h, bias=False).value("projection weights", "naive") / base - 2
        ),
    )
    ratio = _est(128, 64 * best, best, bias=False).value("projection weights", "naive") / base
    return _found(
        f"h=12 → h={best}: parameters ×{fmt(ratio, 4)}, heads ×{fmt(best / 12, 3)} "
        f"(exactly √2 = {fmt(math.sqrt(2), 4)} in the continuum)",
        "estimate(128, 64 * h, h, bias=False).value('projection weights', 'naive')",
        abs(best / 12 - 1.4) < 0.05 and abs(ratio - 2) < 0.1,
        "doubling the parameters does not mean ~1.4× the heads",
    )


@check("002-ex8.2-a")
def _ex82a() -> Finding:
    e = _est(1024, 768, 12, batch=32, dtype="float16")
    w, wb = e.value("projection weights", "naive"), e.value("projection weights + biases", "naive")
    return _found(
        f"{int(w):,} weights; {int(wb):,} with biases",
        "estimate(1024, 768, 12, batch=32, dtype='float16').value('projection weights', 'naive')",
        w == 2_359_296,
        "the weight count is not 2,359,296",
    )


@check("002-ex8.2-b")
def _ex82b() -> Finding:
    b = _est(1024, 768, 12, batch=32, dtype="float16").value("score matrix", "naive")
    return _found(
        f"{int(b):,} bytes = {fmt(b / 2**20)} MiB",
        "estimate(1024, 768, 12, batch=32, dtype='float16').value('score matrix', 'naive')",
        b == 768 * 2**20,
        "the score matrices do not take 768 MiB",
    )


@check("002-8.4.3-c")
def _mostly_matmul() -> Finding:
    share = {}
    for n in (512, 4096):
        e = _est(n)
        share[n] = 1 - e.value("softmax", "naive") / e.value("total", "naive")
    return _found(
        "matmul share of the FLOPs: "
        + ", ".join(f"n={n}: {fmt(100 * s, 4)} %" for n, s in share.items()),
        "1 − estimate(n, 768, 12).value('softmax') / .value('total')",
        min(share.values()) > 0.95,
        "the non-matmul work is not small",
    )


@check("004-5.2-e")
def _additive_cost() -> Finding:
    from ... import attention
    from ...analysis import estimate

    n, d = 128, 64
    est = estimate(n, d, 1)
    dot_flops = est.value("scores QKᵀ", "naive") + est.value("weighted sum PV", "naive")
    attn = _additive(d, d, d, 28)
    g = _gen(28)
    q = _randn_from(g, 1, n, d)
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
