"""Every picture of attnlab.viz is also a matplotlib Figure; single-panel ones draw into ax=."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")
from matplotlib.figure import Figure

from attnlab import viz
from attnlab.analysis.experiments import scaling_experiment
from attnlab.positional import ALiBi, RoPE
from attnlab.viz.experiments import SCALING_PANELS


def _own_axes(n: int = 1):
    fig = Figure(figsize=(4, 3))
    return fig, fig.subplots(1, n) if n > 1 else fig.add_subplot()


def test_heatmap_figure_draws_the_matrix_into_a_given_axes():
    m = torch.rand(5, 7, dtype=torch.float64)
    fig, ax = _own_axes()
    assert viz.heatmap_figure(m, ax=ax, title="w") is fig
    assert ax.get_title() == "w" and len(ax.images) == 1
    assert (ax.images[0].get_array() == m.numpy()).all()
    alone = viz.heatmap_figure(m)
    assert isinstance(alone, Figure) and alone is not fig and len(alone.axes) == 2  # + colorbar


def test_grids_return_figures_with_one_axes_per_panel():
    grid = viz.heatmaps_figure(torch.rand(3, 4, 4), ncols=2)
    assert isinstance(grid, Figure) and sum(1 for a in grid.axes if a.images) == 3
    bias = viz.bias_figure(ALiBi(4), 6)
    assert sum(1 for a in bias.axes if a.images) == 4
    assert isinstance(viz.attention_figure(list("abc"), torch.full((1, 2, 3, 3), 1 / 3)), Figure)


def test_positional_figures_take_axes():
    fig, ax = _own_axes()
    assert viz.sinusoidal_figure(16, 8, ax=ax) is fig and ax.images[0].get_array().shape == (16, 8)
    fig2, (left, right) = _own_axes(2)
    assert viz.rope_spectrum_figure(RoPE(8), 16, axes=(left, right)) is fig2
    assert left.images and right.get_yscale() == "log" and right.lines


def test_line_plots_take_axes():
    fig, ax = _own_axes()
    assert viz.losses_figure([3.0, 2.5, 2.0], [(2, 2.4, 2.3)], 3.1, ax=ax) is fig
    assert [len(line.get_xdata()) for line in ax.lines][:2] == [3, 1]
    result = scaling_experiment(d_ks=(4, 8), samples=8, keys=4)
    exp = viz.experiment_figure(result, SCALING_PANELS[:1])
    assert isinstance(exp, Figure) and exp.axes[0].lines


def test_saving_functions_still_write_their_png(tmp_path):
    out = viz.heatmap(torch.eye(3), tmp_path / "h.png")
    assert out == tmp_path / "h.png" and out.stat().st_size > 500
    with pytest.raises(ValueError, match=r"must end in \.png"):
        viz.heatmap(torch.eye(3), tmp_path / "h.jpg")


def _labels(fig) -> list:
    """Every title and axis label drawn on ``fig`` (colour bars included), with text."""
    texts = []
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
    return [t for t in texts if t.get_text()]


def test_two_panels_in_a_callers_figure_keep_their_labels_apart_and_inside():
    """The user guide's pictures example, as written there: a plain Figure with two panels, a
    colour bar on each. Every label stays inside the figure and no two labels overlap."""
    fig = Figure(figsize=(8, 3))
    left, right = fig.subplots(1, 2)
    viz.sinusoidal_figure(64, 32, ax=left)
    viz.heatmap_figure(torch.softmax(torch.randn(6, 6), -1), ax=right, title="softmax rows")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lays the figure out as savefig does
    renderer = canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _labels(fig)]
    inside = fig.bbox
    for text, box in boxes:
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1, f"{text!r} cut at the sides"
        assert inside.y0 <= box.y0 and box.y1 <= inside.y1, f"{text!r} cut at the top or bottom"
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
