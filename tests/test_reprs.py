"""What people print and display reads well (issue #41): `Estimate`, the KV caches,
`AttentionStats`, `Explanation` (what `attnlab.explain` returns), flash plans, and the figures of
`attnlab.viz`, which Jupyter shows as they are returned."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional.flash import flash_job
from attnlab.functional.request import build_request
from attnlab.functional.stats import AttentionStats
from attnlab.modules import KVCache, SinkCache, SlidingWindowCache


def _one_line(text: str, limit: int = 240) -> None:
    assert "\n" not in text and len(text) <= limit, text
    assert "tensor(" not in text, text


# ------------------------------------------------------------------------------------- Estimate
def test_estimate_prints_its_configuration_and_table():
    est = attnlab.estimate(1024, 768, 12, batch=32, dtype="float16", mask=masks.causal())
    text = str(est)
    head, table = text.split("\n", 1)
    assert head.startswith("Estimate of multi-head attention: ")
    assert "B=32, L=1024, S=1024, E=768, H=12, H_kv=12, D=64, layers=1, float16" in head
    assert "mask causal()" in head
    assert table == est.table()
    short = repr(est)
    _one_line(short)
    assert short.startswith("Estimate(B=32, L=1024,") and f"{len(est.rows)} quantities" in short
    est.measured["flash"] = {"seconds": 0.5, "peak_bytes": 1.0}
    assert "measured=['flash']" in repr(est) and "measured time" in str(est)


def test_one_class_is_named_estimate():
    """The CLI's training-memory record has its own name; `Estimate` is the estimator's."""
    from attnlab.analysis import Estimate
    from attnlab.cli import _budget

    assert "Estimate" not in _budget.__all__ and "TrainingMemory" in _budget.__all__
    assert _budget.TrainingMemory.__name__ == "TrainingMemory"
    assert isinstance(attnlab.estimate(8, 16, 2), Estimate)


# ------------------------------------------------------------------------------------ KV caches
def _kv(T: int, *, B: int = 1, H: int = 2, D: int = 64, Dv: int = 64, **kw):
    return torch.randn(B, H, T, D, **kw), torch.randn(B, H, T, Dv, **kw)


def test_kv_cache_repr_names_layout_dtype_length_and_capacity():
    cache = KVCache(capacity=16)
    assert repr(cache) == "KVCache(S=0, seen=0, capacity=16)"
    cache.update(*_kv(12, Dv=32))
    assert repr(cache) == (
        "KVCache(B=1, H_kv=2, S=12, D=64, Dv=32, dtype=torch.float32, seen=12, capacity=16)"
    )
    cache.update(*_kv(1, Dv=32), positions=torch.tensor([40]))
    assert "S=13" in repr(cache) and "positions=stored" in repr(cache)


def test_eviction_caches_repr_their_window_and_sinks():
    window = SlidingWindowCache(4)
    window.update(*_kv(12))
    assert repr(window) == (
        "SlidingWindowCache(B=1, H_kv=2, S=4, D=64, dtype=torch.float32, seen=12, window=4)"
    )
    sinks = SinkCache(2, 4)
    for _ in range(3):
        sinks.update(*_kv(5, dtype=torch.bfloat16))
    assert repr(sinks) == (
        "SinkCache(B=1, H_kv=2, S=6, D=64, dtype=torch.bfloat16, seen=15, sink_tokens=2, window=4)"
    )
    assert str(sinks) == repr(sinks)


def test_kv_cache_repr_reads_no_value():
    """A cache of meta tensors (no values to read) prints its metadata."""
    cache = KVCache(rotate_at_insert=True)
    cache.update(*_kv(3, B=2, D=8, Dv=8, device="meta"))
    assert repr(cache) == (
        "KVCache(B=2, H_kv=2, S=3, D=8, dtype=torch.float32, device=meta, seen=3, "
        "capacity=None, rotate_at_insert=True)"
    )


# ------------------------------------------------------------------------------ AttentionStats
def test_attention_stats_print_shapes_and_summaries_not_values():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 128, 32, generator=g)
    stats = attnlab.attention_stats(q, q, q, mask=masks.causal())
    short = repr(stats)
    _one_line(short)
    assert short.startswith("AttentionStats((B, H, L) = (2, 4, 128), float32; means over rows: ")
    for name in ("entropy", "max_weight", "sink_mass", "mean_distance"):
        assert f"{name}={getattr(stats, name).mean().item():.4g}" in short
    lines = str(stats).splitlines()
    assert lines[0] == "AttentionStats (B, H, L) = (2, 4, 128), float32"
    assert len(lines) == 3 + 5  # title, header, rule, one line per statistic
    for line, (name, t) in zip(lines[3:], stats.as_dict().items(), strict=True):
        x = t.double()
        want = [name, *(f"{v.item():.4g}" for v in (x.mean(), x.min(), x.max())), "0"]
        assert line.split() == want


def test_attention_stats_repr_on_meta_and_dead_rows():
    m = torch.empty(2, 3, 4, device="meta")
    assert (
        repr(AttentionStats(m, m, m, m, m))
        == "AttentionStats((B, H, L) = (2, 3, 4), float32 on meta)"
    )
    q = torch.randn(2, 1, 8, 4)
    stats = attnlab.attention_stats(q, q, q, mask=masks.padding([8, 0]))  # item 1: no keys
    lse = str(stats).splitlines()[-1].split()
    assert lse[0] == "lse" and lse[-1] == "8"  # 8 rows with lse −inf, left out of the summary


# --------------------------------------------------------------------------------- Explanation
def test_explain_returns_an_explanation_with_fields_and_a_paragraph():
    q = torch.randn(1, 4, 512, 64)
    from attnlab.functional.explanation import Explanation

    e = attnlab.explain(q, q, q, mask=masks.causal(), backend="flash")
    assert isinstance(e, Explanation)
    assert (e.backend, e.requested, e.reason) == ("flash", "flash", "backend='flash' was requested")
    assert e.plan is not None and e.plan.startswith("causal plan, ")
    assert e.engines[0].startswith("forward: ") and e.thresholds is None
    assert (e.dtype, e.shapes, e.mask, e.bias) == (
        torch.float32,
        ((1, 4, 512, 64),) * 3,
        "causal()",
        None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.backend = "sdpa"  # type: ignore[misc]
    lines = str(e).splitlines()
    assert lines == [
        "backend: flash (float32; q (1, 4, 512, 64), k (1, 4, 512, 64), v (1, 4, 512, 64); "
        "mask causal())",
        "why: backend='flash' was requested",
        f"plan: {e.plan}",
        f"engines: {'; '.join(e.engines)}",
        f"kernels: {e.kernels}",
    ]
    _one_line(repr(e))
    assert repr(e).startswith(f"Explanation(backend='flash', requested='flash', plan={e.plan!r}")


def test_auto_explanation_says_why_and_where_thresholds_come_from():
    q = torch.randn(1, 2, 1, 16)
    k = torch.randn(1, 2, 64, 16)
    bias = torch.zeros(1, 2, 1, 64)
    e = attnlab.explain(q, k, k, bias=bias)
    assert e.requested == "auto" and e.reason.startswith(f"auto picked {e.backend!r}")
    assert e.plan is None or e.backend == "flash"
    assert e.bias == "float32 tensor (1, 2, 1, 64)"
    lines = str(e).splitlines()
    assert lines[0].endswith("mask none; bias float32 tensor (1, 2, 1, 64))")
    assert lines[-1] == f"thresholds: {e.thresholds}" and e.thresholds.startswith("auto's float32")


# ---------------------------------------------------------------------------------- flash plans
def _job(q, **kw):
    args = {"mask": None, "bias": None, "scale": None, "temperature": 1.0, "score": "dot"}
    args |= {"dropout_p": 0.0, "return_weights": False, "softcap": None, **kw}
    return flash_job(build_request(q, q, q, **args))


def test_plan_repr_is_a_summary_not_a_dump_of_its_calls():
    plan = _job(torch.randn(1, 2, 512, 16), mask=masks.sliding_window(16)).plan
    assert repr(plan) == (
        f"Plan(kind='band', calls=1, groups=1, block_q={plan.block_q}, block_k={plan.block_k}, "
        "band_calls=1)"
    )
    docs = torch.arange(600).div(6, rounding_mode="floor").view(1, 600)  # 100 documents
    many = _job(torch.randn(1, 2, 600, 16), mask=masks.document(docs)).plan
    _one_line(repr(many))
    assert repr(many).startswith(f"Plan(kind={many.kind!r}, calls={many.num_calls}, ")
    assert "Call(" not in repr(many)
    group = repr(many.groups[0])
    assert group == f"Group(b0=0, b1=1, r0=0, r1=600, {len(many.groups[0].calls)} call(s))"


def test_flash_job_repr_holds_no_tensor_values():
    job = _job(torch.randn(2, 2, 256, 16), mask=masks.padding([256, 100]))
    assert job.keys is not None  # the key mask the kernel reads
    text = repr(job)
    _one_line(text, limit=600)
    assert text.startswith(f"FlashJob(plan={job.plan!r}, ")


# -------------------------------------------------------------------------------------- figures
def _displayed_png(obj: object) -> bytes:
    """The PNG a notebook shows for ``obj``: IPython's own formatter when IPython is installed,
    else the ``_repr_png_`` it would call."""
    if importlib.util.find_spec("IPython") is not None:
        from IPython.core.formatters import DisplayFormatter

        data, _ = DisplayFormatter().format(obj)
        assert "image/png" in data, sorted(data)
        return data["image/png"]
    return obj._repr_png_()  # type: ignore[attr-defined]


def _figures():
    from types import SimpleNamespace

    from attnlab import viz
    from attnlab.analysis.experiments import scaling_experiment
    from attnlab.positional import ALiBi, RoPE
    from attnlab.viz.experiments import SCALING_PANELS

    bench = [SimpleNamespace(case="c", name=n, seconds=s) for n, s in (("a", 1.0), ("b", 2.0))]
    return {
        "heatmap": lambda: viz.heatmap_figure(torch.rand(5, 7)),
        "heatmaps": lambda: viz.heatmaps_figure(torch.rand(3, 4, 4), ncols=2),
        "sinusoidal": lambda: viz.sinusoidal_figure(16, 8),
        "rope_spectrum": lambda: viz.rope_spectrum_figure(RoPE(8), 16),
        "bias": lambda: viz.bias_figure(ALiBi(2), 6),
        "attention": lambda: viz.attention_figure(list("abc"), torch.full((1, 2, 3, 3), 1 / 3)),
        "experiment": lambda: viz.experiment_figure(
            scaling_experiment(d_ks=(4, 8), samples=8, keys=4), SCALING_PANELS[:1]
        ),
        "bench": lambda: viz.bench_figure(bench),
        "losses": lambda: viz.losses_figure([3.0, 2.5, 2.0], [(2, 2.4, 2.3)], 3.1),
    }


FIGURES = ["heatmap", "heatmaps", "sinusoidal", "rope_spectrum", "bias", "attention"]
FIGURES += ["experiment", "bench", "losses"]


@pytest.mark.parametrize("name", FIGURES)
def test_figures_display_in_a_notebook_without_matplotlib_inline(name):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = _figures()[name]()
    assert isinstance(fig, Figure)  # still a real matplotlib Figure
    png = _displayed_png(fig)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_explanation_shows_its_paragraph_in_ipython():
    pytest.importorskip("IPython")
    from IPython.lib.pretty import pretty

    q = torch.randn(1, 2, 16, 8)
    e = attnlab.explain(q, q, q)
    assert pretty(e) == str(e)
