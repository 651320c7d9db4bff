"""attnlab.apps.loop: the shared training loop, checkpoints of any kind, metrics.json."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from attnlab.apps import load_any
from attnlab.apps.loop import (
    FitSettings,
    cosine_lr,
    fit,
    load_model,
    param_groups,
    read_kind,
    save_model,
    write_metrics,
)
from attnlab.checkpoint import CheckpointError


def _regression(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 4, generator=g)
    w = torch.randn(4, 1, generator=g)
    return x, x @ w


def test_fit_learns_and_records_history():
    x, y = _regression()
    model = nn.Linear(4, 1)
    before = float(nn.functional.mse_loss(model(x), y).detach())
    modes = []
    s = FitSettings(steps=150, lr=0.05, min_lr=0.0, warmup=5, eval_every=50, weight_decay=0.0)
    h = fit(
        model,
        lambda step: nn.functional.mse_loss(model(x), y),
        s,
        evaluate=lambda: (
            modes.append((model.training, torch.is_grad_enabled()))
            or {"mse": nn.functional.mse_loss(model(x), y)}
        ),
        log=lambda _: None,
    )
    assert h.steps == 150 and h.stopped_by == "steps" and len(h.train_loss) == 150
    assert [e["step"] for e in h.evals] == [50, 100, 150]
    assert h.evals[-1]["mse"] < 1e-3 * before
    assert modes == [(False, False)] * 3  # evaluation in eval mode without autograd
    assert model.training  # training mode restored


def test_fit_is_reproducible_with_a_seed():
    def run():
        torch.manual_seed(123)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        x, y = _regression()
        s = FitSettings(steps=20, lr=0.01, warmup=2, seed=7)
        return fit(model, lambda _: nn.functional.mse_loss(model(x), y), s, log=print).train_loss

    assert run() == run()


def test_fit_stops_at_the_time_budget():
    x, y = _regression()
    model = nn.Linear(4, 1)
    s = FitSettings(steps=10**6, time_budget=0.0)
    h = fit(model, lambda _: nn.functional.mse_loss(model(x), y), s, log=lambda _: None)
    assert h.steps == 1 and h.stopped_by == "time_budget"


def test_fit_refuses_a_non_finite_loss():
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="loss is nan at step 0"):
        fit(model, lambda _: model.weight.sum() * float("nan"), FitSettings(steps=3))


def test_cosine_lr_schedule():
    assert cosine_lr(0, 100, 1.0, 0.1, 10) == pytest.approx(0.1)
    assert cosine_lr(9, 100, 1.0, 0.1, 10) == pytest.approx(1.0)
    assert cosine_lr(55, 100, 1.0, 0.1, 10) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi / 2))
    )
    assert cosine_lr(100, 100, 1.0, 0.1, 10) == pytest.approx(0.1)


def test_param_groups_decay_only_matrices():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    decay, rest = param_groups(model, 0.1)
    assert [p.dim() for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert sorted(p.dim() for p in rest["params"]) == [1, 1, 1] and rest["weight_decay"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": 0}, ValueError, "steps must be >= 1, got 0"),
        ({"steps": 2.0}, TypeError, "steps must be an int, got float"),
        ({"lr": float("nan")}, ValueError, "lr must be finite, got nan"),
        ({"lr": 1e-3, "min_lr": 1e-2}, ValueError, "min_lr must be <= lr"),
        ({"precision": "fp16"}, ValueError, r"precision must be one of \['fp32', 'bf16'\]"),
        ({"time_budget": -1}, ValueError, "time_budget must be >= 0, got -1"),
        ({"betas": (0.9, 1.0)}, ValueError, "betas must be two floats"),
    ],
)
def test_fit_settings_refuse_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        FitSettings(**kwargs)


class _Stack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))


def _build(config):
    return _Stack(config["width"], config["depth"])


def test_save_and_load_a_model_of_a_kind(tmp_path):
    model = _Stack(3, 2)
    path = save_model(
        tmp_path / "m.safetensors", model, kind="toy", config={"width": 3, "depth": 2}
    )
    assert read_kind(path) == "toy"
    back, config, _ = load_model(path, "toy", _build, layers=lambda c: ("layers", c["depth"]))
    assert config == {"width": 3, "depth": 2} and not back.training
    for a, b in zip(model.state_dict().values(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="holds a 'toy' model, expected 'vit'"):
        load_model(path, "vit", _build)


def test_load_refuses_a_config_the_tensors_do_not_justify(tmp_path):
    path = save_model(
        tmp_path / "m.safetensors", _Stack(3, 2), kind="toy", config={"width": 3, "depth": 2}
    )
    from attnlab.checkpoint import load_checkpoint, save_checkpoint

    ck = load_checkpoint(path)
    meta = {**ck.metadata, "config": json.dumps({"width": 4096, "depth": 10**6})}
    save_checkpoint(tmp_path / "bad.safetensors", dict(ck.tensors), meta)
    with pytest.raises(CheckpointError, match="it says 1000000 layer"):
        load_model(
            tmp_path / "bad.safetensors", "toy", _build, layers=lambda c: ("layers", c["depth"])
        )
    meta = {**ck.metadata, "config": json.dumps({"width": 4096, "depth": 2})}
    save_checkpoint(tmp_path / "wide.safetensors", dict(ck.tensors), meta)
    with pytest.raises(CheckpointError, match="do not justify"):
        load_model(tmp_path / "wide.safetensors", "toy", _build)


def test_load_any_refuses_an_unknown_kind(tmp_path):
    path = save_model(tmp_path / "m.safetensors", _Stack(3, 1), kind="no_such_kind", config={})
    with pytest.raises(CheckpointError, match="unknown model kind 'no_such_kind'"):
        load_any(path)
    path = save_model(tmp_path / "n.safetensors", _Stack(3, 1), kind="../loop", config={})
    with pytest.raises(CheckpointError, match="unknown model kind"):
        load_any(path)


def test_load_any_reads_a_gpt_checkpoint(tmp_path):
    from attnlab.apps.gpt import TrainSettings, train

    s = TrainSettings(
        steps=2,
        batch_size=2,
        seq_len=16,
        d_model=16,
        n_layers=1,
        n_heads=2,
        eval_interval=2,
        eval_batches=1,
        out_dir=str(tmp_path),
    )
    result = train(s, log=lambda _: None, plots=False)
    kind, model, _ = load_any(result.checkpoint)
    assert kind == "gpt" and type(model).__name__ == "GPT"
    assert torch.equal(model.tok_emb.weight, result.model.tok_emb.weight)


def test_write_metrics_records_the_machine(tmp_path):
    path = write_metrics(tmp_path / "run", {"accuracy": 0.5})
    data = json.loads(path.read_text())
    assert data["accuracy"] == 0.5
    assert set(data["machine"]) == {"cpu", "amx", "threads", "torch", "python"}
