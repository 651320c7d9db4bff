"""``attnlab experiment induction-heads``: a tiny run learns, the metrics have their shape, the
figures and the viewer page are written, and the verdict flips on synthetic counter-examples."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from attnlab.lab import LabSettings, experiment, run_experiment
from attnlab.lab import induction as lab

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = lab.InductionRecipe(
    seq_len=16,
    min_period=3,
    max_period=8,
    d_model=16,
    heads=2,
    steps=40,
    batch=16,
    eval_every=20,
    eval_batch=16,
)


def test_a_tiny_run_learns_and_records_every_head():
    record, model = lab.train_one(2, seed=0, recipe=TINY)
    assert record["step"] == [0, 20, 40]
    assert record["repeat"][-1] < record["repeat"][0] - 0.05  # the loss on the repeats falls
    for key in ("prefix", "previous", "copying"):
        assert len(record[key]) == 2 and all(len(row) == 2 for row in record[key])
        assert all(math.isfinite(v) for row in record[key] for v in row)
    layer, head = record["best_head"]
    assert record["best_prefix"] == record["prefix"][layer][head]
    assert -1 <= record["best_copying"] <= 1
    tokens, weights = lab.probe(model, TINY, seed=0)
    assert tokens.shape == (16,) and weights.shape == (2, 2, 16, 16)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 16))


def test_sequences_repeat_with_their_period():
    tokens, period = lab.repeated_sequences(5, TINY, torch.Generator().manual_seed(0))
    assert tokens.shape == (5, 16) and tokens.max() < lab.VOCAB
    for row, n in zip(tokens.tolist(), period.tolist(), strict=True):
        assert TINY.min_period <= n <= TINY.max_period
        assert all(row[i] == row[i - n] for i in range(n, 16))
    first, repeat = lab.target_parts(period, 16)
    assert (first & repeat).sum() == 0
    assert first[0].sum() == period[0] - 1 and repeat[0].sum() == 16 - 2 - period[0] + 1


def test_run_fills_metrics_table_and_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "QUICK", TINY)
    result = run_experiment("induction-heads", LabSettings(quick=True, seeds=2))
    models = result.metrics["models"]
    assert set(models) == {"1", "2"} and result.metrics["seeds"] == [0, 1]
    assert len(models["2"]["prefix"]) == 2 and len(models["2"]["prefix"][0]) == 2  # seeds, layers
    assert len(models["1"]["repeat"][1]) == 3  # the curve of seed 1
    columns, rows = result.table
    assert len(rows) == 2 and len(columns) == len(rows[0])
    written = result.write(tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(
        [
            "metrics.json",
            "loss_curves.png",
            "head_scores.png",
            "induction_stripe.png",
            "induction_view.html",
        ]
    )
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["experiment"] == "induction-heads" and len(data["verdict"]["checks"]) == 6
    assert (tmp_path / "induction_stripe.png").read_bytes()[:4] == b"\x89PNG"
    assert "<html" in (tmp_path / "induction_view.html").read_text(encoding="utf-8").lower()


def _metrics(pm1, pm2, rep1, rep2, copy2=(0.99, 0.98, 0.99)) -> dict:
    def model(pm, rep, copying):
        return {"best_prefix": list(pm), "repeat_loss": list(rep), "best_copying": list(copying)}

    return {
        "uniform_loss": math.log(64),
        "models": {"1": model(pm1, rep1, (0.99,) * 3), "2": model(pm2, rep2, copy2)},
    }


PAPER = _metrics((0.14, 0.13, 0.15), (0.90, 0.88, 0.92), (2.9, 3.0, 3.1), (0.30, 0.35, 0.28))


def test_judge_reproduces_the_paper_and_flips_on_counter_examples():
    assert lab.judge(PAPER, quick=False).label == "reproduced"
    # 1 layer solves it too (an induction head in one layer would refute the claim)
    both = _metrics((0.90, 0.88, 0.92), (0.90, 0.88, 0.92), (0.30, 0.35, 0.28), (0.3, 0.35, 0.3))
    # no phase change within the run: 2 layers stay like 1 layer
    neither = _metrics((0.14, 0.13, 0.15), (0.16, 0.12, 0.15), (2.9, 3.0, 3.1), (2.8, 3.0, 2.9))
    # an effect inside the seed noise: one seed of 2 layers never forms the head
    noisy = _metrics((0.14, 0.13, 0.15), (0.95, 0.95, 0.10), (2.9, 3.0, 3.1), (0.2, 0.2, 3.0))
    # a prefix-matching head that does not copy
    anti = copy.deepcopy(PAPER)
    anti["models"]["2"]["best_copying"] = [-0.9, -0.8, -0.95]
    for counter in (both, neither, noisy, anti):
        verdict = lab.judge(counter, quick=False)
        assert verdict.label == "not reproduced", verdict
    assert lab.judge(neither, quick=True).label == "not reproduced at this scale"


def test_registered_with_its_claim_and_tutorial():
    entry = experiment("induction-heads")
    assert entry.module == "attnlab.lab.induction" and entry.tutorial == "plot_lab_induction.py"
    assert "Olsson" in entry.claim.paper and "phase change" in entry.claim.text


def test_the_model_refuses_bad_sizes_and_ids():
    with pytest.raises(ValueError, match="n_layers"):
        lab.AttentionOnly(8, 8, n_layers=-1, n_heads=2, max_len=4)
    model = lab.AttentionOnly(8, 8, n_layers=1, n_heads=2, max_len=4)
    with pytest.raises(ValueError, match=r"idx holds token ids in \[0, 8\]"):
        model(torch.tensor([[0, 8]]))
    with pytest.raises(ValueError, match="idx must be"):
        model(torch.tensor([0, 1]))


@pytest.mark.slow
def test_attention_only_model_under_inductor_matches_eager_forward_and_backward():
    torch.manual_seed(0)
    model = lab.AttentionOnly(lab.VOCAB, 16, 2, 2, 16)
    tokens, _ = lab.repeated_sequences(4, TINY, torch.Generator().manual_seed(0))

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(tokens)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    eager_out, eager_grads = run(model)
    compiled_out, compiled_grads = run(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_cli_quick_run_prints_the_verdict(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnlab",
            "experiment",
            "induction-heads",
            "--quick",
            "--quiet",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny models: one thread (shared cores)
    )
    assert run.returncode == 0, run.stderr
    assert "Olsson" in run.stdout and "quick run:" in run.stdout
    assert (tmp_path / "induction_stripe.png").is_file()
