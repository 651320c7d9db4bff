"""attnlab.utils: the one progress bar, text table and timer shared by the library and the CLI."""

from __future__ import annotations

import sys

import pytest

from attnlab.utils import Progress, Timer, best_times, text_table, time_call


def test_text_table_pads_aligns_and_separates():
    table = text_table(
        ("name", "value"), [("a", 1.5), None, ("longer", 10)], align="<>", rule=True
    ).split("\n")
    assert table == [
        "name    value",
        "------  -----",
        "a         1.5",
        "",
        "longer     10",
    ]
    # left-aligned last column: no trailing spaces
    assert text_table(("x", "y"), [("1", "")], rule=False) == "x  y\n1"


def test_text_table_rejects_ragged_rows_and_bad_align():
    with pytest.raises(ValueError, match=r"must have 2 cells like the header, got \['1'\]"):
        text_table(("x", "y"), [("1",)])
    with pytest.raises(ValueError, match=r"align must be 2 characters of '<' or '>', got '<'"):
        text_table(("x", "y"), [], align="<")


def test_best_times_interleaves_and_keeps_the_minimum(monkeypatch):
    calls: list[str] = []
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 21.5, 30.0, 30.5])  # a: 3, 1.5; b: 1, 0.5

    import attnlab.utils.timing as timing

    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    steps: list[str] = []
    best = best_times(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        2,
        on_step=steps.append,
    )
    assert calls == ["a", "b", "a", "b", "a", "b"]  # warm-up, then one call of each per round
    assert best == {"a": 1.5, "b": 0.5}
    assert steps == ["warm-up a", "warm-up b", "round 1 a", "round 1 b", "round 2 a", "round 2 b"]
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        best_times({}, 0)


def test_timer_and_time_call(monkeypatch):
    import attnlab.utils.timing as timing

    clock = iter([100.0, 101.0, 102.5, 104.0, 200.0, 200.25])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    t = Timer()  # 100
    assert t.lap() == 1.0  # 101
    assert t.lap() == 1.5  # 102.5
    assert t.seconds == 4.0  # 104 - 100
    assert time_call(lambda: "done") == ("done", 0.25)


def test_progress_without_a_bar_counts_iterates_and_echoes(capsys, monkeypatch):
    bar = Progress(range(3), enabled=False)
    assert list(bar) == [0, 1, 2] and not bar.active
    bar.write("a line")
    assert capsys.readouterr().out == "a line\n"  # without a bar, write prints on stdout
    quiet = Progress(total=2, enabled=False, echo=True)
    quiet.step("x")
    assert quiet.n == 1 and capsys.readouterr().err == ""  # disabled: counts, prints nothing
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm not installed
    echo = Progress(total=2, echo=True)
    assert not echo.active
    echo.step("first")
    echo.step()
    assert capsys.readouterr().err == "[1/2] first\n[2/2]\n"
    with pytest.raises(TypeError, match="without items"):
        iter(Progress(total=2, enabled=False))


def test_progress_with_tqdm_draws_on_stderr(capsys):
    pytest.importorskip("tqdm")
    bar = Progress(["a", "b"], desc="job", unit="step")
    assert bar.active
    assert list(bar) == ["a", "b"]
    bar.close()
    err = capsys.readouterr().err
    assert "job" in err and "2/2" in err
    steps = Progress(total=3, echo=True)  # a bar replaces the echo lines
    steps.step("x")
    steps.close()
    err = capsys.readouterr().err
    assert "x" in err and "1/3" in err and "[1/3]" not in err


def test_progress_total_set_later_reaches_the_bar():
    bar = Progress(desc="x")  # a tqdm bar (stderr), total unknown at first
    bar.total = 3
    for _ in range(3):
        bar.step("a")
    assert bar.total == 3 and bar._bar.total == 3 and bar._bar.n == 3
    bar.close()
