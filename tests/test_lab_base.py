"""The lab's shared parts: checks judge margin against spread, the verdict flips with the numbers,
settings refuse bad input, results write metrics.json and figures, the CLI keeps the textbook and
lab options apart."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from attnlab.lab import Check, Claim, LabResult, LabSettings, SeedStats, Verdict, machine

CLAIM = Claim("Someone et al., 2099, A Paper", "Fig. 1", "a beats b")


def test_seed_stats_mean_spread_and_range():
    s = SeedStats.of([1.0, 2.0, 3.0])
    assert (s.mean, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.std == pytest.approx(1.0)
    assert SeedStats.of([5.0]).std == 0.0
    assert str(SeedStats.of([1.0, 3.0])).startswith("2 ± 1.4")
    with pytest.raises(ValueError, match="values"):
        SeedStats.of([])


def test_check_passes_only_when_the_margin_beats_the_spread():
    assert Check.greater("a > b", [3.0, 3.1, 2.9], [1.0, 1.1, 0.9]).passed
    assert not Check.greater("a > b", [1.0, 1.1, 0.9], [3.0, 3.1, 2.9]).passed  # wrong way
    noisy = Check.greater("a > b", [1.0, 5.0, -3.0], [0.5, 0.6, 0.4])  # right way, inside noise
    assert noisy.margin > 0 and not noisy.passed
    assert not Check("nan", math.nan, 0.0).passed


def test_verdict_is_computed_from_its_checks_and_flips():
    good = Check.greater("a > b", [3.0, 3.1], [1.0, 1.1])
    bad = Check.greater("a > b", [1.0, 1.1], [3.0, 3.1])
    assert Verdict(CLAIM, (good,)).label == "reproduced"
    assert Verdict(CLAIM, (good, bad)).label == "not reproduced"
    assert Verdict(CLAIM, (bad,), quick=True).label == "not reproduced at this scale"
    assert "NOT REPRODUCED" in str(Verdict(CLAIM, (bad,)))
    assert "a beats b" in str(Verdict(CLAIM, (good,)))
    with pytest.raises(ValueError, match="checks"):
        Verdict(CLAIM, ())


def test_settings_refuse_bad_input():
    with pytest.raises(ValueError, match="seeds"):
        LabSettings(seeds=0)
    with pytest.raises(ValueError, match="quick and full"):
        LabSettings(quick=True, full=True)
    assert LabSettings().seed_count(3) == 3
    assert LabSettings(quick=True).seed_count(3) == 1
    assert LabSettings(seeds=5, quick=True).seed_count(3) == 5


def test_result_writes_metrics_and_figures(tmp_path):
    drawn = []
    verdict = Verdict(CLAIM, (Check.greater("a > b", [2.0, 2.1], [1.0, 1.0]),))
    result = LabResult(
        "demo",
        LabSettings(seeds=2),
        {"a": [2.0, 2.1]},
        verdict,
        1.5,
        {"cpu": "X", "threads": 2, "torch": "2"},
        figures={"curve.png": lambda p: (drawn.append(p), p.write_bytes(b"png"))},
    )
    paths = result.write(tmp_path / "out")
    data = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert data["verdict"]["label"] == "reproduced" and data["metrics"] == {"a": [2.0, 2.1]}
    assert data["verdict"]["checks"][0]["passed"] is True
    assert paths[-1] == tmp_path / "out" / "curve.png" and drawn == [paths[-1]]
    assert "default run: 2 s on X, 2 threads, torch 2" in str(result)
    result.machine["matmul_gflops"] = 208.4
    assert "default run: 2 s on X, 2 threads (float32 matmul 208 GFLOP/s), torch 2" in str(result)


def test_the_machine_carries_the_matmul_rate():
    m = machine()
    assert m["matmul_gflops"] > 0 and m["threads"] >= 1 and m["cpu"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["scaling", "--quick"], "--quick"),
        (["scaling", "--out", "x"], "--out"),
        (["scaling", "--seeds", "2"], "--seeds"),
    ],
)
def test_cli_keeps_textbook_and_lab_options_apart(argv, flag):
    run = subprocess.run(
        [sys.executable, "-m", "attnlab", "experiment", *argv], capture_output=True, text=True
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}" in lines[0], run.stderr


def test_every_registered_experiment_has_its_parts_and_the_cli_lists_them():
    from pathlib import Path

    from attnlab.cli.experiment import lab_experiments
    from attnlab.lab import EXPERIMENTS

    assert lab_experiments() == {n: e.summary for n, e in EXPERIMENTS.items()}
    tutorials = Path(__file__).resolve().parent.parent / "docs" / "tutorials"
    for entry in EXPERIMENTS.values():
        module = entry.load()
        assert callable(module.run) and callable(module.judge), entry.name
        assert (tutorials / entry.tutorial).is_file(), entry.tutorial
        assert entry.claim.paper and entry.claim.where and entry.claim.text
