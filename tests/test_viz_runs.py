"""`attnlab.viz.runs`: several runs of the same training drawn together (the README's
distributed picture): each curve as given, and each run's distance from the first."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from attnlab.viz.runs import plot_same_run, same_run_figure


def test_curves_and_distances_are_the_runs_own_numbers(tmp_path) -> None:
    one = [4.0, 3.5, 3.0, 2.9]
    data = [4.0, 3.5 + 4.8e-7, 3.0, 2.9 - 1e-6]
    cp = [4.0 + 2e-7, 3.5, 3.0 - 3e-7, 2.9]
    fig = same_run_figure([("one", one), ("data", data), ("context", cp)])
    left, right = fig.axes
    assert [list(line.get_ydata()) for line in left.get_lines()] == [one, data, cp]
    assert [line.get_label() for line in left.get_lines()] == ["one", "data", "context"]
    got = [list(line.get_ydata()) for line in right.get_lines()]
    # |Δ| per step; an exact 0 sits at the log axis floor 1e-9
    assert got[0] == pytest.approx([1e-9, 4.8e-7, 1e-9, 1e-6], rel=1e-6)
    assert got[1] == pytest.approx([2e-7, 1e-9, 3e-7, 1e-9], rel=1e-6)
    assert right.get_yscale() == "log" and "one" in right.get_ylabel()
    png = plot_same_run(tmp_path / "s.png", [("one", one), ("data", data)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_curves_raise_naming_them() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        same_run_figure([("one", [1.0])])
    with pytest.raises(ValueError, match="'b' has 1"):
        same_run_figure([("a", [1.0, 2.0]), ("b", [1.0])])
    with pytest.raises(ValueError, match=r"curves\['b'\].*finite"):
        same_run_figure([("a", [1.0]), ("b", [float("nan")])])
