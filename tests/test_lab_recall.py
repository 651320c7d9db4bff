"""attnlab experiment associative-recall: MQAR data as in Zoology, every mixer builds and trains,
a tiny model learns, the verdict flips on synthetic counter-examples, the metrics' shape."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from attnlab.lab import LabSettings, experiment
from attnlab.lab import recall as lab
from attnlab.utils import Progress


def test_mqar_batch_pairs_then_queries_answered_by_their_values():
    task = lab.RecallTask(length=40, pairs=5, keys=12, values=7)
    tokens, targets = lab.mqar_batch(task, 16, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (16, 40) and task.vocab == 20
    for toks, tgts in zip(tokens.tolist(), targets.tolist(), strict=True):
        keys, vals = toks[0:10:2], toks[1:10:2]
        assert len(set(keys)) == 5 and all(1 <= k <= 12 for k in keys)
        assert all(13 <= v <= 19 for v in vals)
        pairs = dict(zip(keys, vals, strict=True))
        asked = [t for t, y in enumerate(tgts) if y != -100]
        assert len(asked) == 5 and min(asked) >= 10  # every key queried once, after the pairs
        assert sorted(toks[t] for t in asked) == sorted(keys)
        for t in asked:
            assert tgts[t] == pairs[toks[t]] == toks[t + 1]
    with pytest.raises(ValueError, match="task"):
        lab.RecallTask(length=12, pairs=4)


def test_a_tiny_attention_model_learns_the_task():
    task = lab.RecallTask(length=16, pairs=2, keys=8, values=8)
    grid = lab.RecallGrid((task,), (16,), ("attention",), steps=60, batch=16, test=64)
    r = lab.train_recall("attention", task, 16, 0, grid)
    assert r["loss_last"] < r["loss_first"] - 0.3 and not r["diverged"]


def test_a_diverged_training_is_reported_and_marked_in_the_table():
    task = lab.RecallTask(length=16, pairs=2, keys=8, values=8)
    grid = lab.RecallGrid((task,), (16,), ("attention",), steps=4, batch=4, test=8, lr=1e10)
    assert lab.train_recall("attention", task, 16, 0, grid)["diverged"]
    metrics = _metrics()
    metrics["diverged"] = {"gru": {"64": {"16": [False, True]}}}
    rows = {row[0]: row[1:] for row in lab.table(metrics)[1]}
    assert rows["gru"][2].endswith("(1 NaN)") and "NaN" not in " ".join(rows["ssm"])


def _metrics(attn=0.99, window_long=0.2, fixed_small=0.3, fixed_large=0.8):
    """Synthetic metrics: two lengths (the window covers the first), two widths, two seeds."""

    def cells(short, long_small, long_large):
        return {
            "32": {"16": [short, short], "64": [short, short]},
            "64": {"16": [long_small, long_small + 0.02], "64": [long_large, long_large]},
        }

    acc = {
        "attention": cells(attn, attn, attn),
        "window": cells(0.99, window_long, window_long),
        "gru": cells(0.9, fixed_small, fixed_large),
        "ssm": cells(0.9, fixed_small, fixed_large),
    }
    return {
        "tasks": [[32, 4], [64, 8]],
        "widths": [16, 64],
        "mixers": list(acc),
        "fixed_state": ["gru", "ssm"],
        "window": 32,
        "accuracy": acc,
    }


def test_judge_reproduces_on_zoologys_picture_and_flips_on_counter_examples():
    assert lab.judge(_metrics(), quick=False).label == "reproduced"
    bad = {
        "attention fails somewhere": _metrics(attn=0.6),
        "the window is as good as attention": _metrics(window_long=0.99),
        "fixed state as good as attention": _metrics(fixed_small=0.99, fixed_large=0.99),
        "width does not help": _metrics(fixed_small=0.5, fixed_large=0.5),
    }
    for why, metrics in bad.items():
        verdict = lab.judge(metrics, quick=False)
        assert not verdict.reproduced, why
    noisy = _metrics()
    noisy["accuracy"]["window"]["64"]["16"] = [0.0, 1.0]  # the effect within the seed noise
    noisy["accuracy"]["window"]["64"]["64"] = [0.0, 1.0]
    assert not lab.judge(noisy, quick=False).reproduced
    assert lab.judge(_metrics(attn=0.6), quick=True).label == "not reproduced at this scale"


def test_judge_uses_only_what_ran():
    metrics = copy.deepcopy(_metrics())
    for m in ("gru", "ssm"):
        del metrics["accuracy"][m]
    metrics["mixers"], metrics["fixed_state"] = ["attention", "window"], []
    names = [c.name for c in lab.judge(metrics, quick=True).checks]
    assert len(names) == 3 and not any("fixed-state" in n for n in names)


def test_every_mixer_runs_and_the_metrics_have_their_shape(monkeypatch, tmp_path):
    tiny = lab.RecallGrid(
        (lab.RecallTask(16, 2, 8, 8), lab.RecallTask(24, 3, 8, 8)),
        (16,),
        tuple(lab.MIXERS),
        steps=2,
        batch=4,
        test=8,
        window=16,
        block=4,
    )
    monkeypatch.setattr(lab.RecallGrid, "for_settings", classmethod(lambda cls, s: tiny))
    progress = Progress(enabled=False)
    result = lab.run(LabSettings(seeds=1), progress)
    m = result.metrics
    assert progress.n == progress.total == 2 * len(lab.MIXERS)
    assert set(m["accuracy"]) == set(lab.MIXERS) == set(m["mixers"])
    assert m["fixed_state"] == ["linear", "favor", "gru", "ssm"]
    for mixer in lab.MIXERS:
        for n in ("16", "24"):
            (acc,) = m["accuracy"][mixer][n]["16"]
            assert 0.0 <= acc <= 1.0 and m["diverged"][mixer][n]["16"] == [False]
    columns, rows = result.table
    assert columns[0] == "mixer" and len(columns) == 3 and len(rows) == len(lab.MIXERS)
    assert result.verdict.checks and json.dumps(result.as_dict())
    pytest.importorskip("matplotlib")
    written = result.write(tmp_path)
    assert (tmp_path / "recall_accuracy.png").stat().st_size > 1000 and len(written) == 2


def test_the_three_scales_grids():
    quick = lab.RecallGrid.for_settings(LabSettings(quick=True))
    default = lab.RecallGrid.for_settings(LabSettings())
    full = lab.RecallGrid.for_settings(LabSettings(full=True))
    assert quick.widths == (32, 64) and len(quick.tasks) == 1
    assert default.widths == (32, 48, 64) and default.mixers == lab.PAPER_MIXERS
    assert [(t.length, t.pairs) for t in default.tasks] == [(32, 4), (64, 8)]
    # --full: Zoology's Fig. 2 grid, every mixer (a key for each of the 64 pairs)
    assert [(t.length, t.pairs) for t in full.tasks] == list(lab.ZOOLOGY_TASKS)
    assert full.widths == (64, 128, 256, 512) and full.mixers == tuple(lab.MIXERS)
    assert all(t.keys >= t.pairs for t in full.tasks)


def test_the_registry_names_the_experiment_and_the_mixers_refuse_bad_names():
    entry = experiment("associative-recall")
    assert entry.module == "attnlab.lab.recall" and "Zoology" in entry.claim.paper
    assert lab.CLAIM is entry.claim
    with pytest.raises(ValueError, match="mixer: expected one of attention"):
        lab.RecallModel("transformer", lab.RecallTask(16, 2), 16)
    with pytest.raises(ValueError, match="width: expected a multiple of 16, received 24"):
        lab.RecallModel("gru", lab.RecallTask(16, 2), 24)


@pytest.mark.slow
def test_the_quick_cli_run_prints_a_verdict_and_writes_its_files(tmp_path, capsys):
    from helpers import run_cli

    code, out, _ = run_cli(
        ["experiment", "associative-recall", "--quick", "--out", str(tmp_path)], capsys
    )
    assert code == 0 and "Verdict:" in out and "Zoology" in out
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["experiment"] == "associative-recall" and data["scale"] == "quick"
    assert (tmp_path / "recall_accuracy.png").exists()
