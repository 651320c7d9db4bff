"""Training diagnostics (issue 18 item 5): per-layer gradient norms, fp16 with loss scaling, the
2017 paper's inverse-square-root schedule and the learning-rate / warmup sweep."""

from __future__ import annotations

import argparse
import functools
import json
import math

import pytest
import torch
from torch import nn

from attnlab._files import load_json
from attnlab.apps.gpt import (
    TrainSettings,
    check_precision,
    get_batch,
    layer_grad_norms,
    layer_parameters,
    load_text,
    lr_at,
    sweep,
    train,
)
from attnlab.checkpoint import load_checkpoint, save_checkpoint
from attnlab.cli._args import UsageError
from attnlab.cli.train import register as register_train
from attnlab.models import GPT

SMALL = dict(
    steps=4,
    batch_size=4,
    seq_len=16,
    d_model=16,
    n_layers=2,
    n_heads=2,
    dropout=0.0,
    eval_interval=2,
    eval_batches=1,
    save_interval=0,
)
PNG = b"\x89PNG\r\n\x1a\n"


def _quiet(_line: str) -> None:
    pass


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is ~10× faster than two when other processes load the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnlab")
    register_train(parser.add_subparsers(dest="command"))
    return parser


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


# ------------------------------------------------------------------------------------- schedule
def test_noam_schedule_is_the_2017_formula():
    s = TrainSettings(d_model=512, warmup=4000, schedule="noam")
    for step in (0, 1, 99, 3998, 3999, 4000, 9999, 99_999):
        t = step + 1
        want = 512**-0.5 * min(t**-0.5, t * 4000**-1.5)
        assert lr_at(step, s) == pytest.approx(want, rel=1e-15)
    # the peak is at t = warmup: (d_model · warmup)^-0.5 = 6.988e-4 (the paper's base model)
    assert lr_at(3999, s) == pytest.approx(1 / math.sqrt(512 * 4000), rel=1e-15)
    assert lr_at(3999, s) == pytest.approx(6.988e-4, abs=1e-7)
    assert lr_at(0, s) == pytest.approx(lr_at(3999, s) / 4000)  # linear growth from t = 1
    assert lr_at(4 * 4000 - 1, s) == pytest.approx(lr_at(3999, s) / 2)  # then t^-0.5
    # lr and min_lr do not enter the formula
    other = TrainSettings(d_model=512, warmup=4000, schedule="noam", lr=1.0, min_lr=0.5)
    assert [lr_at(i, other) for i in (0, 5000)] == [lr_at(i, s) for i in (0, 5000)]


def test_schedule_and_precision_settings_are_checked():
    with pytest.raises(ValueError, match=r"warmup must be >= 1 with schedule='noam', got 0"):
        TrainSettings(schedule="noam", warmup=0)
    with pytest.raises(ValueError, match=r"schedule must be one of \['cosine', 'noam'\], got 'x'"):
        TrainSettings(schedule="x")
    with pytest.raises(ValueError, match=r"precision must be one of .*, got 'fp8'"):
        TrainSettings(precision="fp8")
    with pytest.raises(ValueError, match=r"bf16=True is the alias of precision='bf16'; got"):
        TrainSettings(bf16=True, precision="fp16")
    # the old flag and the new setting are one setting
    assert TrainSettings(bf16=True).precision == "bf16"
    assert TrainSettings(precision="bf16").bf16 is True
    assert TrainSettings(precision="fp16").bf16 is False


# ---------------------------------------------------------------------------- gradient norms
def test_layer_grad_norms_recompose_the_total_of_clip_grad_norm():
    torch.manual_seed(0)
    model = GPT(TrainSettings(**SMALL).model_config(vocab_size=11))
    x = torch.randint(0, 11, (3, 16))
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    groups = layer_parameters(model)
    assert list(groups) == ["tok_emb", "blocks.0", "blocks.1", "norm_f"]  # lm_head is tied
    norms = layer_grad_norms(groups)
    assert norms.shape == (4,) and norms.dtype == torch.float64
    for i, name in enumerate(groups):  # each layer by hand, from the named parameters
        squares = sum(
            float(p.grad.double().pow(2).sum())
            for n, p in model.named_parameters()
            if n == name or n.startswith(name + ".")
        )
        assert float(norms[i]) == pytest.approx(math.sqrt(squares), rel=1e-12)
    total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    assert float(torch.linalg.vector_norm(norms)) == pytest.approx(float(total), rel=1e-6)


def test_train_logs_per_layer_grad_norms_of_the_real_gradients(tmp_path, capsys):
    s = TrainSettings(out_dir=str(tmp_path), **{**SMALL, "grad_clip": 0.05})
    result = train(s, log=print)
    printed = capsys.readouterr().out
    assert result.grad_norm_layers == ["tok_emb", "blocks.0", "blocks.1", "norm_f"]
    assert len(result.grad_norms) == len(result.grad_norm_total) == 4
    for row, total in zip(result.grad_norms, result.grad_norm_total, strict=True):
        # clip_grad_norm_'s total (before clipping; clipping is active: total > 0.05)
        assert total > 0.05
        assert math.sqrt(sum(g * g for g in row)) == pytest.approx(total, rel=1e-6)
    # step 1 by hand: the same initial model and first batch give the same layer norms
    text = load_text(None)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text])
    train_data = data[: -(len(data) // 10)]
    torch.manual_seed(s.seed)
    model = GPT(s.model_config(len(vocab)))
    x, y = get_batch(train_data, s.batch_size, s.seq_len, torch.Generator().manual_seed(s.seed))
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    assert layer_grad_norms(layer_parameters(model)).tolist() == result.grad_norms[0]
    # printed at each evaluation, stored in the checkpoint, plotted next to loss.png
    assert printed.count("grad norm ") == 2 and "blocks.1 " in printed
    ck = load_checkpoint(tmp_path / "ckpt.safetensors")
    assert json.loads(ck.metadata["grad_norm_layers"]) == result.grad_norm_layers
    assert ck.tensors["log.grad_norm"].tolist() == result.grad_norms
    assert ck.tensors["log.grad_norm_total"].tolist() == result.grad_norm_total
    assert (tmp_path / "grad_norm.png").read_bytes()[:8] == PNG


# --------------------------------------------------------------------------------------- fp16
def test_fp16_autocast_with_unscaled_gradients_matches_fp32_closely(tmp_path):
    kw = {**SMALL, "steps": 2, "eval_interval": 2}
    full = train(TrainSettings(out_dir=str(tmp_path / "a"), **kw), log=_quiet, plots=False)
    half = train(
        TrainSettings(out_dir=str(tmp_path / "b"), precision="fp16", **kw), log=_quiet, plots=False
    )
    # autocast is on (the loss differs in its low bits) ...
    assert half.train_losses[0] != full.train_losses[0]
    assert half.train_losses[0] == pytest.approx(full.train_losses[0], rel=1e-2)
    # ... and the logged gradients are unscaled (not 65536 × the fp32 ones)
    for a, b in zip(full.grad_norms[0], half.grad_norms[0], strict=True):
        assert b == pytest.approx(a, rel=5e-2)
    ck = load_checkpoint(tmp_path / "b" / "ckpt.safetensors")
    assert json.loads(ck.metadata["grad_scaler"])["scale"] == 2.0**16  # no overflow, no growth
    assert json.loads(ck.metadata["settings"])["precision"] == "fp16"


def test_precision_without_autocast_support_is_refused(monkeypatch):
    check_precision("fp16", torch.device("cpu"))  # this torch supports CPU fp16 autocast
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda _device: torch.bfloat16)
    with pytest.raises(ValueError, match=r"precision='fp16' needs torch.float16 autocast on cpu"):
        check_precision("fp16", torch.device("cpu"))


# ------------------------------------------------------------------------------ noam + resume
def test_resume_with_noam_and_fp16_loss_scaling_is_bit_exact(tmp_path, monkeypatch):
    # a start scale of 2^20 overflows fp16 for the first 3 steps (the scale halves each time),
    # so a resume that did not restore the loss scale would skip steps 3 and 4 again
    monkeypatch.setattr(
        torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**20)
    )
    kw = {**SMALL, "steps": 5, "dropout": 0.1, "eval_interval": 5, "precision": "fp16"}
    kw.update(schedule="noam", warmup=3)
    straight = train(TrainSettings(out_dir=str(tmp_path / "a"), **kw), log=_quiet, plots=False)
    assert [math.isfinite(t) for t in straight.grad_norm_total] == [False] * 3 + [True] * 2
    ck = load_checkpoint(tmp_path / "a" / "ckpt.safetensors")
    assert json.loads(ck.metadata["grad_scaler"])["scale"] == 2.0**17
    part = TrainSettings(out_dir=str(tmp_path / "b"), **kw)
    first = train(part, stop_at=2, log=_quiet, plots=False)
    torch.manual_seed(part.seed)
    _same_weights(first.model, GPT(part.model_config(len(first.vocab))))  # skipped: untouched
    stored = json.loads(load_checkpoint(tmp_path / "b" / "ckpt.safetensors").metadata["settings"])
    assert (stored["schedule"], stored["warmup"], stored["precision"]) == ("noam", 3, "fp16")
    resume = tmp_path / "b" / "ckpt.safetensors"
    resumed = train(TrainSettings(out_dir=str(tmp_path / "b")), resume=resume, log=_quiet,
                    plots=False)  # fmt: skip
    assert resumed.train_losses == straight.train_losses
    assert resumed.val_history == straight.val_history
    assert str(resumed.grad_norms) == str(straight.grad_norms)  # nan == nan
    _same_weights(straight.model, resumed.model)


# -------------------------------------------------------------------------------------- sweep
def test_sweep_trains_each_grid_point_and_reports_its_final_losses(tmp_path):
    base = TrainSettings(out_dir=str(tmp_path), **{**SMALL, "steps": 2, "min_lr": 0.0})
    result = sweep(base, {"lr": [1e-4, 3e-2], "warmup": [0, 2]}, log=_quiet)
    assert [r.point for r in result.runs] == [
        {"lr": 1e-4, "warmup": 0},
        {"lr": 1e-4, "warmup": 2},
        {"lr": 3e-2, "warmup": 0},
        {"lr": 3e-2, "warmup": 2},
    ]
    for r in result.runs:  # each final loss is that run's last evaluation
        ck = load_checkpoint(tmp_path / f"lr={r.point['lr']:g}_warmup={r.point['warmup']}" /
                             "ckpt.safetensors")  # fmt: skip
        assert ck.tensors["log.val"][-1, 1:].tolist() == [r.final_train, r.final_val]
        settings = json.loads(ck.metadata["settings"])
        assert (settings["lr"], settings["warmup"]) == (r.point["lr"], r.point["warmup"])
    # the same seed: the first batch loss is the same everywhere, then lr makes a difference
    assert len({r.train_losses[0] for r in result.runs}) == 1
    assert result.runs[2].final_val < result.runs[0].final_val - 0.05
    assert result.best() is min(result.runs, key=lambda r: r.final_val)
    table = result.table()
    assert table.count("\n") == 5 and "0.0001" in table and "*" in table
    with pytest.raises(ValueError, match=r"grid axis must be one of \['lr', 'warmup'\], got 'x'"):
        sweep(base, {"x": [1]})
    with pytest.raises(ValueError, match=r"grid axis 'lr' has no effect with schedule='noam'"):
        sweep(TrainSettings(schedule="noam"), {"lr": [1e-3]})
    with pytest.raises(ValueError, match=r"grid point \{'lr': 0.0001\}: min_lr must be <="):
        sweep(TrainSettings(min_lr=1e-3), {"lr": [1e-4]})
    with pytest.raises(ValueError, match=r"grid point \{'warmup': 1.5\}: warmup must be an int"):
        sweep(TrainSettings(), {"warmup": [1.5]})


def test_cli_sweep_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "sw"
    args = _parser().parse_args(
        ["train", "--out", str(out), "--steps", "2", "--batch-size", "4", "--seq-len", "16",
         "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--eval-batches", "1",
         "--schedule", "noam", "--sweep", "warmup=1,4", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    doc = load_json(out / "sweep.json")  # checksummed
    assert [r["warmup"] for r in doc["runs"]] == [1, 4] and doc["grid"] == {"warmup": [1, 4]}
    assert doc["base"]["schedule"] == "noam"
    vals = [r["final_val_loss"] for r in doc["runs"]]
    assert all(isinstance(v, float) for v in vals) and vals[0] != vals[1]
    assert f"{vals[0]:.4f}" in printed and "noam schedule" in printed
    assert (out / "sweep.txt").read_text().startswith("warmup  final train")
    assert (out / "sweep.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precision", "fp16", "--bf16"], "argument --bf16: is the alias of --precision bf16"),
        (["--schedule", "noam", "--lr", "0.01"], "argument --lr: is not used by --schedule noam"),
        (["--schedule", "noam", "--warmup", "0"], "argument --warmup: must be >= 1 with"),
        (["--sweep", "lr=1e-3", "--lr", "0.01"], "argument --sweep: sweeps lr; remove --lr"),
        (["--sweep", "depth=1,2"], "argument --sweep: expects AXIS=V1,V2,... with AXIS in"),
        (["--sweep", "warmup=1,x"], "argument --sweep: warmup: expected an int >= 0, got 'x'"),
        (["--sweep", "lr=1e-3,1e-3"], "argument --sweep: lr has repeated values"),
        (["--sweep", "lr=1e-3", "--resume"], "argument --sweep: cannot be combined with"),
    ],
)
def test_cli_refuses_bad_diagnostic_options(tmp_path, argv, message):
    args = _parser().parse_args(["train", "--out", str(tmp_path / "r"), *argv])
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(".", r"\.")):
        args.func(args)


def test_a_checkpoint_from_before_the_diagnostics_still_resumes(tmp_path):
    """Old checkpoints lack schedule/precision in their settings and the gradient-norm log: the
    settings take their defaults (``bf16`` still maps to a precision) and the unknown norms are
    NaN, while the training itself continues bit-exactly."""
    kw = {**SMALL, "steps": 3, "eval_interval": 3, "bf16": True}
    straight = train(TrainSettings(out_dir=str(tmp_path / "a"), **kw), log=_quiet, plots=False)
    train(TrainSettings(out_dir=str(tmp_path / "b"), **kw), stop_at=1, log=_quiet, plots=False)
    path = tmp_path / "b" / "ckpt.safetensors"
    ck = load_checkpoint(path)
    settings = json.loads(ck.metadata["settings"])
    del settings["schedule"], settings["precision"]
    meta = {k: v for k, v in ck.metadata.items() if k not in ("grad_norm_layers", "grad_scaler")}
    meta["settings"] = json.dumps(settings)
    tensors = {k: v for k, v in ck.tensors.items() if not k.startswith("log.grad_norm")}
    save_checkpoint(path, tensors, meta)
    resumed = train(
        TrainSettings(out_dir=str(tmp_path / "b")), resume=path, log=_quiet, plots=False
    )
    assert resumed.train_losses == straight.train_losses
    _same_weights(straight.model, resumed.model)
    assert all(math.isnan(g) for g in resumed.grad_norms[0]) and math.isnan(
        resumed.grad_norm_total[0]
    )
    assert resumed.grad_norms[1:] == straight.grad_norms[1:]
    stored = json.loads(load_checkpoint(path).metadata["settings"])
    assert (stored["precision"], stored["schedule"], stored["bf16"]) == ("bf16", "cosine", True)
