"""Issue 15, items 6 and 12: exact pair counts at any size, bounded mask printing, honest plots."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab import cli
from attnlab import masks as M
from attnlab.analysis import estimate
from attnlab.masks import counts

# ----------------------------------------------------------------------------- pair counts


def brute_pairs(mask: M.Mask, L: int, S: int) -> int:
    dense = mask.to_dense(L, S)
    return int(dense.expand(mask.batch_size or 1, mask.num_heads or 1, L, S).sum())


def closed_form_masks(S: int) -> list[M.Mask]:
    """Every kind with a closed form (and their & combinations) on key length S."""
    third = S // 3
    docs = M.document.from_lengths([third, 0, S - third - min(S - third, 1), min(S - third, 1)])
    return [
        M.causal(),
        M.sliding_window(1),
        M.sliding_window(3),
        M.sliding_window(4, causal=False),
        M.sliding_window(10**30, causal=False),
        M.strided(1),
        M.strided(3),
        M.strided(2, causal=False),
        M.strided(5, causal=False),
        M.padding([3, 0, 7]),
        M.causal() & M.sliding_window(5, causal=False),
        M.causal() & M.padding([2, 5, 9]),
        M.sliding_window(3, causal=False) & M.padding([4, 1]),
        M.strided(3) & M.sliding_window(5, causal=False),
        M.strided(2, causal=False) & M.causal() & M.padding([S - 1, 1]),
        docs,
        docs & M.causal(),
        docs & M.sliding_window(2, causal=False),
        docs & M.padding([max(S - 2, 0)]) & M.causal(),
        docs & M.strided(2),
        M.document(torch.stack([torch.zeros(S), torch.arange(S) % 2]).long()),  # (B, S) ids
        M.document(torch.arange(S) % 3),  # raw ids: counted from the ids, no L×S work
    ]


SIZES = list(itertools.product([1, 2, 3, 5, 8, 13], [1, 2, 4, 7, 11, 16]))


@pytest.mark.parametrize("L,S", SIZES)
def test_closed_form_counts_equal_brute_force(L, S):
    for mask in closed_form_masks(S):
        geometry = mask.geometry(L, S)
        assert (geometry is not None and geometry.pairs is None) or isinstance(mask, M.DocumentMask)
        assert mask.attended_pairs(L, S) == brute_pairs(mask, L, S), (mask, L, S)


@pytest.mark.parametrize("L,S", SIZES)
def test_longformer_and_bigbird_counts_equal_brute_force(L, S):
    # counted from their structure: inclusion-exclusion over globals, block cells
    for mask in [
        M.global_local(1, 0),
        M.global_local(2, [0, S - 1]),
        M.global_local(3, [5, 1, 1, 20]),
        M.global_local(10**20, 3),
        M.bigbird(2, 3, 1, 1),
        M.bigbird(3, 1, 0, 2, seed=3),
        M.bigbird(1, 3, 2, 0),
        M.bigbird(4, 5, 1, 1),
    ]:
        assert mask.geometry(L, S).pairs is not None  # counted from the data it holds
        assert mask.attended_pairs(L, S) == brute_pairs(mask, L, S), (mask, L, S)
    n, w = 10**12, 512  # globals 0..3 lie inside each other's band: no double count
    extra = 2 * sum(n - (g + w) for g in range(4))
    assert M.global_local(w, 4).attended_pairs(n, n) == (2 * w - 1) * n - w * (w - 1) + extra


@pytest.mark.parametrize("L,S", [(1, 1), (5, 3), (3, 7), (9, 9), (12, 5)])
def test_counts_of_other_combinations_equal_brute_force(L, S):
    # unions, complements, tensor data and the bounded fallback (diagonals, key intervals, rows)
    for mask in [
        M.strided(2) | M.sliding_window(3),
        M.document(torch.arange(S) % 2) & M.causal(),
        M.global_local(2, [0, S - 1]) & M.causal(),
        M.bigbird(2, 3, 1, 1) | M.causal(),
        ~M.causal(),
        M.from_tensor(torch.rand(2, 3, L, S) > 0.5),
        M.from_tensor(torch.rand(1, S) > 0.5) & M.causal(),
        M.from_fn(lambda b, h, i, j: (i + j) % 3 == 0, num_heads=2),
    ]:
        assert mask.geometry(L, S) is None or mask.geometry(L, S).pairs is not None
        assert mask.attended_pairs(L, S) == brute_pairs(mask, L, S), (mask, L, S)
    assert M.padding([2, 3]).attended_pairs(L, S, heads=4) == 4 * L * (min(2, S) + min(3, S))


@pytest.mark.parametrize("L,S", SIZES)
def test_unions_and_complements_count_in_closed_form(L, S):
    # a | b = a + b − (a & b); ~a = L·S − a: prefix-LM, chunked attention and friends
    prefix_lm = M.causal() | M.padding([3])
    chunked = M.document.from_lengths([4] * (S // 4) + [S % 4]) & M.causal()
    for mask in [
        prefix_lm,
        M.causal() | M.padding([2, 9, 0]),
        chunked,
        chunked | M.padding([1]),
        ~M.causal(),
        ~(M.causal() & M.padding([3, 1])),
        M.sliding_window(2) | M.strided(3),
    ]:
        assert mask.geometry(L, S) is not None, mask
        assert mask.attended_pairs(L, S) == brute_pairs(mask, L, S), (mask, L, S)
    # at 10**12: row i < p sees the p prefix keys (p − 1 − i more than causal), later rows i + 1
    n, p = 10**12, 4096
    assert (M.causal() | M.padding([p])).attended_pairs(n, n) == n * (n + 1) // 2 + p * (p - 1) // 2
    assert (~M.causal()).attended_pairs(n, n) == n * (n - 1) // 2


def test_closed_form_counts_are_exact_at_any_size():
    n = 10**12  # a tensor of n positions would be 8 TB
    assert M.causal().attended_pairs(n, n) == n * (n + 1) // 2
    L, S = n, 3 * n + 7  # bottom-right: row i sees S − L + i + 1 keys
    assert M.causal().attended_pairs(L, S) == L * (S - L) + L * (L + 1) // 2
    assert M.causal().attended_pairs(S, L) == L * (L + 1) // 2  # the first S − L rows: none
    w = 4096
    assert M.sliding_window(w).attended_pairs(n, n) == w * n - w * (w - 1) // 2
    both = 2 * w - 1
    assert M.sliding_window(w, causal=False).attended_pairs(n, n) == both * n - w * (w - 1)
    assert (M.causal() & M.padding([5, n])).attended_pairs(n, n) == 5 * n - 10 + n * (n + 1) // 2

    # strided causal: row p sees min(p + 1, s) keys of its block plus p // s strided keys
    def strided_pairs(m: int, s: int) -> int:
        q, r = divmod(m, s)
        return s * (s + 1) // 2 + s * (m - s) + s * q * (q - 1) // 2 + r * q

    assert strided_pairs(50, 7) == sum(min(p + 1, 7) + p // 7 for p in range(50))
    s, m = 1000, 10**12 + 17
    want = strided_pairs(m, s)
    assert M.strided(s).attended_pairs(m, m) == want


def test_diagonal_pairs_matches_a_loop():
    for L, N, lo, hi, step, anchor in itertools.product(
        [1, 4, 7], [1, 3, 8], [None, -5, 0, 2], [None, -1, 3, 9], [1, 2, 3], [0, 1, -2]
    ):
        want = sum(
            1
            for i in range(L)
            for j in range(N)
            if (lo is None or j - i >= lo)
            and (hi is None or j - i <= hi)
            and (j - i - anchor) % step == 0
        )
        assert counts.diagonal_pairs(L, N, lo, hi, step, anchor) == want


def test_count_without_closed_form_above_the_budget_is_a_clear_error():
    mask = M.from_fn(lambda b, h, i, j: i >= j)
    with pytest.raises(ValueError, match=r"L=1000000, S=1000000 .* limit of 1,073,741,824"):
        mask.attended_pairs(10**6, 10**6)
    # cheaper structure is used first: a band-like | union counts over its L+S diagonals
    n = 10**6
    assert (M.causal() | M.sliding_window(2, causal=False)).attended_pairs(n, n) == (
        n * (n + 1) // 2 + n - 1
    )


def test_estimate_counts_huge_lengths_in_closed_form():
    n = 10**12
    est = estimate(n, 768, 12, mask=M.causal())
    assert est.config["attended_pairs"] == n * (n + 1) // 2
    assert est.value("attended pairs per head", "flash") == n * (n + 1) // 2
    est = estimate(2 * 10**8, 768, 12, layers=12, mask=M.sliding_window(4096))
    assert est.value("attended pairs per head", "flash") == 4096 * 2 * 10**8 - 4096 * 4095 // 2


def test_estimate_cli_huge_seq_and_bounded_measure(capsys):
    assert cli.main(["estimate", "--seq", "1000000000000", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "500,000,000,000,500,000,000,000 of 1,000,000,000,000,000,000,000,000 pairs" in out
    code = cli.main(["estimate", "--seq", "200000000", "--causal", "--measure"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "argument --measure" in err and "limit of 4 GiB" in err


# ----------------------------------------------------------------------------- printing masks


def test_printing_a_large_mask_is_summarised():
    lengths = [700, 1300, 1000]
    mask = M.document.from_lengths(lengths) & M.causal()
    text = str(mask)
    assert len(text) < 1000  # was 18M characters
    header, *rows = text.split("\n")
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    assert f"(L=3000, S=3000; {pairs:,} of 9,000,000 pairs attended" in header
    assert rows[3] == "..."
    assert rows[0] == "■ ⬚ ⬚ ... ⬚ ⬚ ⬚" and rows[-1] == "⬚ ⬚ ⬚ ... ■ ■ ■"
    # huge default sizes evaluate only the shown cells
    assert len(str(M.padding([10**9]))) < 1000
    # no closed form and above the counting budget: still prints, without the count
    fn = M.from_fn(lambda b, h, i, j: i >= j) & M.padding([10**6])
    assert "above the counting budget" in str(fn).split("\n")[0]


def test_small_masks_still_render_fully():
    mask = M.causal()
    assert str(mask) == "causal()  (L=8, S=8)\n" + mask.render(8, 8)
    doc = M.document.from_lengths([30, 34])  # 64 x 64: the largest size drawn in full
    text = str(doc)
    assert text == f"{doc!r}  (L=64, S=64)\n" + doc.render(64, 64)
    assert len(text.split("\n")) == 65 and "..." not in text


# ----------------------------------------------------------------------------- plots


def _overlapping(boxes) -> list:
    return [(a, b) for n, a in enumerate(boxes) for b in boxes[n + 1 :] if a.overlaps(b)]


def _tick_boxes(ax, renderer, axis: str) -> list:
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_window_extent(renderer) for t in labels if t.get_visible() and t.get_text()]


def test_bench_plot_is_linear_from_zero_with_readable_ticks(tmp_path):
    pytest.importorskip("matplotlib")
    from types import SimpleNamespace

    from attnlab.viz.bench import bench_figure, plot_bench

    names = ["flash", "sdpa (math)", "reference", "local-attention", "flex (compiled)"]
    rows = [
        SimpleNamespace(case=f"case {c}", name=f"{n} contender", seconds=s)
        for c in range(3)
        for n, s in zip(names, [1.00, 1.06, 12345.6, 0.0004, 3.3], strict=True)
    ]
    rows.append(SimpleNamespace(case="case 0", name="skipped", seconds=None))
    fig = bench_figure(rows)
    renderer = fig.canvas.get_renderer()
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
        widths = sorted(p.get_width() for p in ax.patches)
        assert widths == sorted([1.00, 1.06, 12345.6, 0.0004, 3.3])  # bars proportional to time
        for axis in "xy":
            boxes = _tick_boxes(ax, renderer, axis)
            assert len(boxes) >= 2 and not _overlapping(boxes), (axis, ax.get_title())
        values = sorted(t.get_text().strip() for t in ax.texts)
        assert values == sorted(["1 s", "1.06 s", "1.23e+04 s", "0.4 ms", "3.3 s"])
    assert plot_bench(rows, tmp_path / "b.png").stat().st_size > 1000


def _inside(inner, outer) -> bool:
    return (
        inner.x0 >= outer.x0
        and inner.x1 <= outer.x1
        and inner.y0 >= outer.y0
        and inner.y1 <= outer.y1
    )


@pytest.mark.parametrize("T,layers,heads", [(40, 2, 3), (24, 1, 2), (7, 1, 1), (130, 1, 1)])
def test_attention_grid_labels_every_input_and_keeps_its_title(T, layers, heads):
    pytest.importorskip("matplotlib")
    import sys

    import attnlab.viz.attention_png  # noqa: F401  (the name is shadowed by the function)

    ap = sys.modules["attnlab.viz.attention_png"]
    tokens = [f"token{i}" for i in range(T)]
    w = torch.softmax(
        torch.randn(layers, heads, T, T, generator=torch.Generator().manual_seed(0)), -1
    )
    title = (
        "runs/some-long-checkpoint-name/ckpt.safetensors · " + f"{T} tokens · 2 layers × 3 heads"
    )
    fig = ap.attention_figure(tokens, w, title=title)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert _inside(fig._suptitle.get_window_extent(renderer), fig.bbox)
    ax = fig.axes[0]
    step = ap.label_step(T, 1.5)
    assert step == 1 if T <= 11 else step > 1  # every token while they fit
    per_panel = len(range(0, T, step))
    assert per_panel >= min(T, 8)  # present above 24 tokens (was none)
    xs = [t.get_text() for t in ax.get_xticklabels()]
    assert len(xs) == heads * per_panel and all(xs)
    assert len(ax.get_yticklabels()) == layers * per_panel
    for axis in "xy":
        boxes = _tick_boxes(ax, renderer, axis)
        assert not _overlapping(boxes), axis
        assert all(_inside(b, fig.bbox) for b in boxes)


def _captured_figures(monkeypatch) -> list:
    import sys

    import attnlab.viz.heatmap  # noqa: F401  (the name is shadowed by the function)

    heatmap = sys.modules["attnlab.viz.heatmap"]
    figures = []
    real = heatmap.save_figure

    def capture(fig, path, dpi):
        figures.append(fig)
        return real(fig, path, dpi)

    monkeypatch.setattr(heatmap, "save_figure", capture)
    return figures


@pytest.mark.parametrize("L,S", [(6, 6), (5, 9)])
def test_causal_alibi_plot_blanks_the_future_keys(tmp_path, monkeypatch, L, S):
    pytest.importorskip("matplotlib")
    from attnlab import viz
    from attnlab.positional import ALiBi

    viz.plot_bias(tmp_path / "a.png", ALiBi(2), L, S)
    figures = [viz.bias_figure(ALiBi(2), L, S)]  # the figure plot_bias saves
    above = torch.ones(L, S, dtype=torch.bool).triu(S - L + 1).numpy()  # j > i + S − L
    panels = [ax for ax in figures[-1].axes if ax.images and ax.get_title().startswith("head")]
    assert len(panels) == 2
    for ax in panels:
        drawn = ax.images[0].get_array()
        assert (drawn.mask == above).all()  # masked exactly above the bottom-right diagonal
        assert (drawn.compressed() <= 0).all()  # ALiBi's real biases are never positive
    assert "masked by causal()" in figures[-1]._suptitle.get_text()
    if L != S:
        return
    # non-causal ALiBi, or mask=None, draws every cell
    for bias, mask in ((ALiBi(2, causal=False), "auto"), (ALiBi(2), None)):
        viz.plot_bias(tmp_path / "b.png", bias, L, S, mask=mask)
        figures.append(viz.bias_figure(bias, L, S, mask=mask))
        for ax in figures[-1].axes:
            if ax.images and ax.get_title().startswith("head"):
                assert not ax.images[0].get_array().mask.any()
    with pytest.raises(ValueError, match="mask must be a Mask, None or 'auto', got 'causal'"):
        viz.plot_bias(tmp_path / "c.png", ALiBi(2), L, mask="causal")


def test_heatmap_grid_title_stays_inside_the_figure(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from attnlab import viz

    figures = _captured_figures(monkeypatch)
    title = "a long grid title that is much wider than one small panel of three inches " * 2
    viz.heatmaps(torch.rand(1, 4, 4), tmp_path / "h.png", suptitle=title)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figures[-1]
    FigureCanvasAgg(fig).draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert _inside(box, fig.bbox)


def test_repr_of_masks_holding_long_lists_is_summarised():
    assert repr(M.padding([3, 4])) == "padding([3, 4])"  # short lists print in full
    long = M.padding(list(range(10_000)))
    assert repr(long) == "padding([0, 1, 2, ..., 9997, 9998, 9999] (10000 values))"
    assert len(str(long & M.causal())) < 1000
    many = M.global_local(3, list(range(0, 1000, 7)))
    assert (
        repr(many) == "global_local(3, global_tokens=[0, 7, 14, ..., 980, 987, 994] (143 values))"
    )
