"""``attnlab experiment train-short-test-long`` (`attnlab.lab.length`): a tiny run learns and
has the metrics' shape, learned positions are undefined beyond the training length, the verdict
follows the numbers (a synthetic counter-example flips it), bad sizes are refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from attnlab.lab import LabSettings, run_experiment
from attnlab.lab import length as tstl

TINY = tstl.LengthScale(
    train_len=8,
    d_model=16,
    n_layers=1,
    n_heads=2,
    batch=8,
    steps=40,
    lr=1e-2,
    warmup=4,
    eval_tokens=256,
    t5_buckets=4,
    t5_max_distance=8,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The whole experiment at the tiny scale, through the registry: (result, written paths)."""
    mp = pytest.MonkeyPatch()
    mp.setitem(tstl.SCALES, "quick", TINY)
    try:
        result = run_experiment("train-short-test-long", LabSettings(quick=True, seeds=1))
    finally:
        mp.undo()
    return result, result.write(tmp_path_factory.mktemp("tstl"))


def test_tiny_run_learns_and_has_the_metrics_shape(tiny):
    result, _ = tiny
    m = result.metrics
    assert m["encodings"] == list(tstl.ENCODINGS) and m["factors"] == [1, 2, 4, 8, 16]
    assert m["lengths"] == [8, 16, 32, 64, 128]
    assert m["corpus"]["test_files"] > 0 and m["corpus"]["train_files"] > m["corpus"]["test_files"]
    for name in tstl.ENCODINGS:
        assert len(m["loss"][name]) == 1 and all(len(row) == 5 for row in m["loss"][name])
        for seed in m["train_loss"][name]:
            assert seed["last"] < seed["first"] - 0.5, (name, seed)  # the loss falls
        assert all(row[0] < math.log(256) - 0.5 for row in m["loss"][name])  # held out, learned
    # learned positions: no trained row beyond L, so undefined rather than a number
    assert all(row[1:] == [None] * 4 for row in m["loss"]["learned"])
    assert all(v is not None for row in m["loss"]["alibi"] for v in row)


def test_tiny_run_prints_its_table_and_writes_metrics_and_the_figure(tiny):
    result, paths = tiny
    columns, rows = result.table
    assert columns[0] == "encoding" and columns[-1] == "16× (128)"
    learned = next(r for r in rows if r[0] == "learned")
    assert learned[2:] == ["undefined"] * 4 and "±" in learned[1]
    names = sorted(p.name for p in paths)
    assert names == ["length_curves.png", "metrics.json"]
    data = json.loads(paths[0].read_text())
    assert data["metrics"]["loss"]["learned"][0][1] is None
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.verdict.label in ("reproduced", "not reproduced at this scale")


def _metrics(curves: dict[str, list[float]], jitter: float = 0.01) -> dict:
    """Synthetic metrics: 3 seeds of each curve, shifted by ±jitter."""
    loss = {
        name: [[v + d if v is not None else None for v in curve] for d in (-jitter, 0, jitter)]
        for name, curve in curves.items()
    }
    return {
        "factors": [1, 2, 4, 8, 16],
        "lengths": [64, 128, 256, 512, 1024],
        "encodings": list(curves),
        "scale": {"train_len": 64},
        "loss": loss,
    }


PAPER_LIKE = {
    "sinusoidal": [1.5, 2.4, 3.3, 4.0, 4.5],
    "learned": [1.5, None, None, None, None],
    "rope": [1.45, 1.7, 2.2, 2.6, 2.9],
    "t5": [1.45, 1.45, 1.5, 1.55, 1.6],
    "alibi": [1.45, 1.42, 1.41, 1.40, 1.40],
    "nope": [1.5, 1.8, 2.3, 2.7, 3.0],
}


def test_judge_reproduces_the_paper_shape_and_flips_on_counter_examples():
    assert tstl.judge(_metrics(PAPER_LIKE), quick=False).label == "reproduced"
    # ALiBi rising like the others: its flatness check fails
    rising = {**PAPER_LIKE, "alibi": [1.45, 1.6, 1.8, 2.0, 2.2]}
    verdict = tstl.judge(_metrics(rising), quick=False)
    assert verdict.label == "not reproduced"
    assert not verdict.checks[0].passed and verdict.checks[1].passed
    # RoPE flat and best: its rise and the order at 16× fail
    flat_rope = {**PAPER_LIKE, "rope": [1.45, 1.40, 1.38, 1.37, 1.36]}
    failed = [c.name for c in tstl.judge(_metrics(flat_rope), quick=True).checks if not c.passed]
    assert len(failed) == 2 and all("RoPE" in name for name in failed)
    assert tstl.judge(_metrics(flat_rope), quick=True).label == "not reproduced at this scale"
    # the same means with a seed spread larger than the effects: nothing is claimed
    assert tstl.judge(_metrics(PAPER_LIKE, jitter=3.0), quick=False).label == "not reproduced"


def test_bad_sizes_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"eval_tokens: expected a multiple of 16·train_len = 128"):
        tstl.LengthScale(8, 16, 1, 2, 8, 40, 1e-2, 4, 200, 4, 8)
    import torch

    with pytest.raises(ValueError, match=r"length/tokens: .*received length=7, tokens=64"):
        tstl.evaluate(None, torch.zeros(100, dtype=torch.long), 7, 64)


@pytest.mark.slow
def test_quick_cli_run_prints_the_verdict_and_writes_its_files(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "attnlab", "experiment", "train-short-test-long", "--quick"]
    proc = subprocess.run(
        [*cmd, "--quiet", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Press, Smith & Lewis" in proc.stdout and "Verdict:" in proc.stdout
    assert "quick run:" in proc.stdout and "undefined" in proc.stdout
    assert (out / "metrics.json").is_file() and (out / "length_curves.png").is_file()
