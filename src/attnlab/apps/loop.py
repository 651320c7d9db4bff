"""One training loop for the applications (translation, classification, vision, RNN baselines).

`fit` runs AdamW with linear warmup + cosine decay, gradient clipping, optional bf16 autocast, a
wall-clock budget, periodic evaluation and a progress bar; the task supplies only
``loss_at(step) -> loss`` (drawing its own batch from its own seeded generator) and an
``evaluate() -> {metric: value}``. `save_model` / `load_model` write and read a model of any
registered kind as a verified safetensors checkpoint whose metadata names the kind and the
config (`load_model` is every app's one loader, the GPT's of ``attnlab train`` included, whose
files name no kind: "gpt"); `write_metrics` writes ``DIR/metrics.json`` with the machine it ran on.

Example:
    >>> s = FitSettings(steps=200, lr=3e-3, warmup=20)
    >>> history = fit(model, lambda step: loss_of(next_batch()), s, evaluate=held_out)
    >>> save_model(out / "ckpt.safetensors", model, kind="vit", config=cfg.to_dict())
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._files import atomic_write, loads
from .._fit import ConfigRule, build_checked, justify_config
from .._shapes import check_int, check_number
from ..checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_specs,
    load_checkpoint,
    read_header,
    save_checkpoint,
)
from ..utils.progress import Progress

#: Autocast dtypes of `FitSettings.precision` ("fp32" runs without autocast).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}

#: Metadata key naming a checkpoint's model kind (files of ``attnlab train`` have none: "gpt").
KIND_KEY = "model_kind"


@dataclass
class FitSettings:
    """Optimisation settings of `fit`.

    Attributes:
        steps: optimizer steps (the cosine schedule's length even when the budget stops first).
        lr: peak learning rate; min_lr: the cosine decay's floor; warmup: linear warmup steps.
        weight_decay: AdamW decay of matrices (biases, gains and embeddings' 1-D params: none).
        grad_clip: max global gradient norm (0 = off).
        eval_every: steps between evaluations (0 = only at the end).
        seed: seeds ``torch.manual_seed`` before the first step (the task seeds its batches).
        time_budget: stop after this many seconds of training (None = no limit); the stop
            is recorded in `FitHistory.stopped_by`.
        precision: "fp32" or "bf16" (autocast; parameters and optimizer state stay fp32).
        betas: AdamW's betas.
        schedule: "steps" (the cosine runs over ``steps``) or "time" (it runs over the
            ``time_budget`` seconds instead: step t at elapsed training time e gets
            ``cosine_lr`` at the fraction e / time_budget, after the same step warmup, so a
            slower machine takes fewer steps but still ends at ``min_lr``; ``steps`` is then
            only an upper bound).
        clock: what ``time_budget`` (and ``schedule="time"``) counts: "wall" seconds, or "cpu",
            the process's CPU seconds (all threads; `time.process_time`), which on a shared,
            loaded machine measures the work a quiet machine would do in that wall time.
    """

    steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 0
    seed: int = 0
    time_budget: float | None = None
    precision: str = "fp32"
    betas: tuple[float, float] = (0.9, 0.98)
    schedule: str = "steps"
    clock: str = "wall"

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        check_int("eval_every", self.eval_every, minimum=0)
        check_int("seed", self.seed, minimum=-(2**63))
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            check_number(name, getattr(self, name), at_least=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr={self.lr}, got {self.min_lr}")
        if self.time_budget is not None:
            check_number("time_budget", self.time_budget, at_least=0.0)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.schedule not in ("steps", "time"):
            raise ValueError(f"schedule must be 'steps' or 'time', got {self.schedule!r}")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {self.clock!r}")
        if self.schedule == "time" and self.time_budget is None:
            raise ValueError("schedule='time' needs a time_budget (seconds), got None")
        b = tuple(self.betas)
        if len(b) != 2 or not all(isinstance(x, float) and 0 <= x < 1 for x in b):
            raise ValueError(f"betas must be two floats in [0, 1), got {self.betas!r}")


@dataclass
class FitHistory:
    """What `fit` did.

    Attributes:
        steps: optimizer steps taken; seconds: training time on `FitSettings.clock` (wall
            seconds by default; evaluation excluded).
        train_loss: the loss of every step; evals: ``{"step": n, **metrics}`` per evaluation.
        stopped_by: "steps" or "time_budget".
    """

    steps: int = 0
    seconds: float = 0.0
    train_loss: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    stopped_by: str = "steps"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cosine_lr(step: int, steps: int, lr: float, min_lr: float, warmup: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps to
    ``lr``, then cosine decay to ``min_lr`` at ``steps``.

    ``lr_t = lr·(t+1)/w`` for t < w, else
    ``min_lr + ½(1 + cos(π·min(1, (t−w)/(T−w))))·(lr − min_lr)``.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (lr - min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (dim >= 2), none on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def fit(
    model: nn.Module,
    loss_at: Callable[[int], Tensor],
    s: FitSettings,
    *,
    evaluate: Callable[[], Mapping[str, float]] | None = None,
    desc: str = "train",
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> FitHistory:
    """Trains ``model`` in place: ``loss_at(step)`` (a scalar) is minimised for ``s.steps`` steps.

    The model is put in train mode for the steps and in eval mode (under ``torch.no_grad``) for
    ``evaluate``. The loss is read back once per step for the history and the progress bar.

    Args:
        model: the module whose parameters are optimised.
        loss_at: the step's loss; draws its batch itself (so the data order is the task's).
        s: the optimisation settings.
        evaluate: held-out metrics, run every ``s.eval_every`` steps and at the end.
        desc: the progress bar's label.
        progress: show a progress bar (tqdm, on stderr) with the loss.
        log: receives one line per evaluation.

    Returns:
        The `FitHistory`.

    Raises:
        ValueError: a non-finite loss (naming the step), so a diverged run does not save
            garbage silently.
    """
    torch.manual_seed(s.seed)
    opt = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.lr, betas=s.betas)
    dtype = PRECISIONS[s.precision]
    device_type = next(model.parameters()).device.type
    history = FitHistory()
    bar = Progress(range(s.steps), desc=desc, total=s.steps, unit="step", enabled=progress)
    write = bar.write if bar.active else log
    clock = time.process_time if s.clock == "cpu" else time.perf_counter
    start = clock()
    spent_evaluating = 0.0

    def run_eval(step: int) -> None:
        nonlocal spent_evaluating
        if evaluate is None:
            return
        t0 = clock()
        model.eval()
        with torch.no_grad():
            metrics = {k: float(v) for k, v in evaluate().items()}
        model.train()
        spent_evaluating += clock() - t0
        history.evals.append({"step": step, **metrics})
        write(f"{desc} step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    model.train()
    for step in bar:
        if s.schedule == "time":
            elapsed = clock() - start - spent_evaluating
            budget = s.time_budget or 0.0
            frac = min(1.0, elapsed / budget) if budget > 0 else 1.0
            lr = min(1.0, (step + 1) / max(1, s.warmup)) * cosine_lr(
                round(frac * 10**6), 10**6, s.lr, s.min_lr, 0
            )
        else:
            lr = cosine_lr(step, s.steps, s.lr, s.min_lr, s.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.float().backward()
        if s.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            bar.close()
            raise ValueError(f"{desc}: the loss is {value} at step {step} (lr {lr:.3g})")
        history.train_loss.append(value)
        history.steps = step + 1
        if bar.active:
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{lr:.2e}")
        if s.eval_every and history.steps % s.eval_every == 0 and history.steps < s.steps:
            run_eval(history.steps)
        elapsed = clock() - start - spent_evaluating
        if s.time_budget is not None and elapsed >= s.time_budget and history.steps < s.steps:
            history.stopped_by = "time_budget"
            write(f"{desc}: time budget {s.time_budget:g} s reached at step {history.steps}")
            break
    bar.close()
    history.seconds = clock() - start - spent_evaluating
    run_eval(history.steps)
    return history


# --------------------------------------------------------------------------- files of any kind
def save_model(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    kind: str,
    config: Mapping[str, Any],
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Saves ``model``'s state (``model.*`` tensors) with metadata naming its kind and config.

    Args:
        path: the ``.safetensors`` file (written atomically and verified on load).
        model: the module.
        kind: the model kind, a module name in `attnlab.apps` whose ``load`` reads it back.
        config: the JSON-able config that rebuilds the model.
        extra: more metadata strings (e.g. a JSON vocabulary).

    Returns:
        The path written.
    """
    reserved = {KIND_KEY, "config"} & set(extra or {})
    if reserved:
        raise ValueError(f"extra must not set the reserved keys {sorted(reserved)}")
    meta = {KIND_KEY: kind, "config": json.dumps(dict(config)), **(extra or {})}
    path = Path(os.fspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    save_checkpoint(path, tensors, meta)
    return path


def read_kind(path: str | os.PathLike) -> str:
    """The model kind stored in a checkpoint (its header only); "gpt" for ``attnlab train``'s."""
    return read_header(path).metadata.get(KIND_KEY, "gpt")


def load_model(
    path: str | os.PathLike,
    kind: str,
    build: Callable[[dict[str, Any]], nn.Module],
    *,
    layers: Callable[[dict[str, Any]], tuple[str, int] | None] | None = None,
    rules: Sequence[ConfigRule] = (),
    device: torch.device | str = "cpu",
) -> tuple[nn.Module, dict[str, Any], Checkpoint]:
    """Reads a checkpoint written by `save_model`, checking the kind and that the tensors justify
    the stored config before anything is built: field by field from the header
    (`attnlab._fit.justify_config` with ``rules``), then names and shapes of a build on
    ``meta`` (`attnlab._fit.build_checked`).

    Args:
        path: the file.
        kind: the kind it must hold.
        build: ``config -> model`` (raises TypeError/ValueError for a bad config).
        layers: ``config -> (name, n)``: the file must hold exactly n ``model.{name}.{i}.*``
            layers (so a config claiming 10**6 layers is refused from the names alone).
        rules: the kind's table of integer config fields (types, layer counts, sizes) that
            the tensors must justify, relative to the ``model.`` prefix.
        device: where the model goes after verification.

    Returns:
        ``(model in eval mode, config, checkpoint)``.

    Raises:
        FileNotFoundError, CheckpointError: a missing or damaged file, another kind, a config
            its tensors do not justify, a file whose config or tensors changed between the
            header check and the load.
        TypeError, ValueError: a bad stored config field (naming it).
    """
    path = Path(os.fspath(path))
    header = read_header(path)
    found = header.metadata.get(KIND_KEY, "gpt")
    if found != kind:
        raise CheckpointError(path, f"holds a {found!r} model, expected {kind!r}")
    if "config" not in header.metadata:
        raise CheckpointError(path, "has no stored config")
    config = loads(path, header.metadata["config"], "the stored config", 4)
    if not isinstance(config, dict):
        raise CheckpointError(path, f"the stored config must be a JSON object, got {config!r}")
    specs = checkpoint_specs(header)
    justify_config(path, config, specs, rules, prefix="model.")
    try:
        build_checked(
            path,
            lambda: build(config),
            specs,
            prefix="model.",
            layers=layers(config) if layers is not None else None,
            what="the stored config",
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise type(e)(f"{path}: the stored config: {e}") from None
    ck = load_checkpoint(path)
    same = ck.metadata.get("config") == header.metadata["config"] and specs == {
        k: (t.dtype, tuple(t.shape)) for k, t in ck.tensors.items()
    }
    if not same:
        raise CheckpointError(path, "the file changed while it was being loaded")
    model = build(config)
    ck.load_into(model, prefix="model.", strict=True)
    return model.to(device).eval(), config, ck


def machine() -> dict[str, Any]:
    """The machine a run was measured on: CPU model, AMX, threads, torch and Python versions."""
    from ..analysis.advise import machine_info

    info = machine_info()
    return {
        "cpu": info["cpu"],
        "amx": info["amx"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_metrics(out_dir: str | os.PathLike, metrics: Mapping[str, Any]) -> Path:
    """Writes ``OUT/metrics.json`` (plain JSON, atomically): ``metrics`` plus ``"machine"``."""
    path = Path(os.fspath(out_dir)) / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**dict(metrics), "machine": machine()}, indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


__all__ = [
    "KIND_KEY",
    "PRECISIONS",
    "FitHistory",
    "FitSettings",
    "cosine_lr",
    "fit",
    "load_model",
    "machine",
    "param_groups",
    "read_kind",
    "save_model",
    "write_metrics",
]
