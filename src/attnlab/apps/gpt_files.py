"""A GPT run's files: the checkpoint it writes and reads back, its temp files and its PNGs.

`save_run` writes one safetensors file with the model, the optimizer, the loss scaler, the RNG
states, the logs and the torch thread count (so ``--resume`` continues bit-exactly) plus a
checksummed ``config.json``; `stored_settings`, `vocab_of` and `stored_threads` read them back
checked; `load` reads the model through the apps' one verified loader
(`attnlab.apps.loop.load_model`, kind "gpt": files of ``attnlab train`` carry no kind);
`remove_stale_run_temps` clears what a killed run left and `write_png` draws a picture
atomically.

A part of the GPT app: `attnlab.apps.gpt` hands on its public names.
"""

from __future__ import annotations

import json
import os
import re
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._files import STALE_SECONDS, atomic_write, loads, remove_stale_temps, save_json
from ..checkpoint import Checkpoint, CheckpointError, save_checkpoint
from ..models import GPT, TransformerConfig
from ..models.config import checkpoint_rules
from .gpt_settings import CHECKPOINT_NAME, TrainSettings
from .loop import load_model

#: The kind `attnlab.apps.load_any` reads a GPT checkpoint as (its files store none).
KIND = "gpt"


def save_run(
    out: Path,
    model: GPT,
    opt: torch.optim.Optimizer,
    batch_rng: torch.Generator,
    s: TrainSettings,
    vocab: list[str],
    step: int,
    losses: list[float],
    val: list[tuple[int, float, float]],
    entropy: float,
    layers: list[str],
    norms: list[list[float]],
    totals: list[float],
    scaler: torch.amp.GradScaler,
    rng_ranks: Tensor | None = None,
) -> Path:
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optim.{i}.{name}"] = value
    tensors["rng.batch"] = batch_rng.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if rng_ranks is not None:  # several ranks: each one's dropout stream, (W, n)
        tensors["rng.torch_ranks"] = rng_ranks
    tensors["log.train_loss"] = torch.tensor(losses, dtype=torch.float64)
    tensors["log.val"] = torch.tensor(val, dtype=torch.float64).reshape(-1, 3)
    tensors["log.grad_norm"] = torch.tensor(norms, dtype=torch.float64).reshape(-1, len(layers))
    tensors["log.grad_norm_total"] = torch.tensor(totals, dtype=torch.float64)
    config = model.config.to_dict()
    meta = {
        "config": json.dumps(config),
        "vocab": json.dumps(vocab),
        "settings": json.dumps(asdict(s)),
        "step": str(step),
        "unigram_entropy": repr(entropy),
        "grad_norm_layers": json.dumps(layers),
        "grad_scaler": json.dumps(scaler.state_dict() if scaler.is_enabled() else {}),
        THREADS_KEY: str(torch.get_num_threads()),  # the float results depend on it
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / CHECKPOINT_NAME
    save_checkpoint(path, tensors, meta)
    save_json(out / "config.json", {"config": config, "vocab": vocab, "step": step})
    return path


#: Checkpoint metadata key of the torch intra-op thread count the run was trained with.
THREADS_KEY = "torch_threads"


def _type_name(kind: object) -> str:
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _field_types() -> dict[str, tuple[type, ...]]:
    """The JSON types each `TrainSettings` field accepts (from its annotation)."""
    hints = typing.get_type_hints(TrainSettings)
    out: dict[str, tuple[type, ...]] = {}
    for f in fields(TrainSettings):
        hint = hints[f.name]
        kinds = typing.get_args(hint) if typing.get_args(hint) else (hint,)
        if float in kinds and int not in kinds:
            kinds = (*kinds, int)  # JSON writes 1.0 as 1
        out[f.name] = tuple(kinds)
    return out


def stored_settings(path: str | os.PathLike, meta: dict[str, str]) -> TrainSettings:
    """The `TrainSettings` stored in a checkpoint's metadata by `train`, checked field by field.

    The JSON is parsed with its nesting bounded (a flat object; deeper nesting is refused
    before parsing, never a RecursionError), every field must have its annotated type (an int
    is not a bool, a str is not a number) and then pass `TrainSettings`' value checks. Settings
    added after a checkpoint was written take their defaults.

    Raises:
        CheckpointError: no settings, not JSON, nested too deeply, not an object.
        TypeError: a field of the wrong type (naming the field, expected and received types).
        ValueError: a field of the right type but a bad value (naming it).
    """
    path = Path(os.fspath(path))
    if "settings" not in meta:
        raise CheckpointError(path, "not a checkpoint written by attnlab train (no settings)")
    data = loads(path, meta["settings"], "the stored settings", 2)
    if not isinstance(data, dict):
        raise CheckpointError(
            path, f"the stored settings must be a JSON object, got {type(data).__name__}"
        )
    types = _field_types()
    for name, value in data.items():
        kinds = types.get(name)
        if kinds is None:
            continue  # a setting of a later version: ignored, as before
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok:
            expected = " or ".join(_type_name(k) for k in kinds)
            raise TypeError(
                f"{path}: the stored settings: field {name!r} must be {expected}, got "
                f"{type(value).__name__} {str(value)[:40]!r}"
            )
    try:
        return TrainSettings(
            **{f.name: data[f.name] for f in fields(TrainSettings) if f.name in data}
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: the stored settings: {e}") from None


def stored_threads(meta: dict[str, str]) -> int | None:
    """The torch thread count a checkpoint of `train` was written with (None: not recorded)."""
    text = meta.get(THREADS_KEY, "")
    return int(text) if text.isdigit() and 0 < int(text) <= 2**16 else None


#: Temp files older attnlab versions (and `attnlab.viz.training` alone) leave beside a PNG
#: when killed mid-write: ``.<name>.<8 characters>.png`` (`tempfile.mkstemp`).
_PNG_TEMP = re.compile(r"\.(loss|grad_norm|sweep)\.png\.[a-z0-9_]{8}\.png")


def remove_stale_run_temps(out: Path) -> list[str]:
    """Removes the temp files a killed run left in ``out``; returns their names.

    Temp directories of `atomic_write` (checkpoint, config.json, the PNGs) whose writer is gone
    go at once (`remove_stale_temps`: their pid is dead or their lock is free for long); PNG
    temp files of the older naming, which carries no pid, once `STALE_SECONDS` old.
    """
    removed = remove_stale_temps(out, CHECKPOINT_NAME)
    try:
        entries = list(os.scandir(out))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        if not _PNG_TEMP.fullmatch(e.name):
            continue
        try:
            if e.is_file(follow_symlinks=False) and now - e.stat().st_mtime > STALE_SECONDS:
                os.unlink(e.path)
                removed.append(e.name)
        except OSError:
            continue
    return removed


class _NoPictureError(Exception):
    """Raised inside `atomic_write` when matplotlib is missing: nothing replaces the file."""


def write_png(path: Path, draw: Callable[[Path], bool]) -> bool:
    """``draw(file)`` into a private temp directory beside ``path``, then renamed over it
    (`atomic_write`): a run killed while drawing leaves ``path`` as it was, and its temp
    directory is removed by the next write or run. False (nothing written) without matplotlib.
    """

    def fill(tmp: str) -> None:
        if not draw(Path(tmp)):
            raise _NoPictureError

    try:
        atomic_write(path, fill)
    except _NoPictureError:
        return False
    return True


def vocab_of(ck: Checkpoint) -> list[str]:
    """The vocabulary stored in a checkpoint of `train` (a flat JSON list of strings).

    Raises:
        ValueError: no vocabulary. CheckpointError: one that is not a list of strings.
    """
    path = Path(os.fspath(ck.path))
    if "vocab" not in ck.metadata:
        raise ValueError(f"{path}: not a checkpoint written by attnlab train (no 'vocab')")
    vocab = loads(path, ck.metadata["vocab"], "the stored vocab", 1)
    if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
        raise CheckpointError(path, "the stored vocab must be a JSON list of strings")
    return vocab


def _build(config: dict[str, Any]) -> GPT:
    return GPT(TransformerConfig.from_dict(config))


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> tuple[GPT, Checkpoint]:
    """The `GPT` saved by `train` in ``path``, verified, and its checkpoint (`vocab_of` gives
    the vocabulary).

    The apps' one loader, `attnlab.apps.loop.load_model`: the stored config is accepted only
    if the file's tensors justify it before anything is allocated — every integer field by
    `attnlab.models.config.checkpoint_rules` from the header alone, then the `GPT` built on
    ``meta`` must have exactly the file's parameter names, shapes and dtypes — so a crafted
    config (``d_model=4096``, ``n_layers=10**6``, ``vocab_size=10**12``) is refused at once with
    a `CheckpointError` listing what differs. Only then is the file verified and decoded, and
    the model built on the host and moved to ``device``.

    Returns:
        ``(model in eval mode, checkpoint)``.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a damaged file, a config the tensors do not justify or that builds
            no model (naming the field), a vocabulary that is not the config's.
    """
    model, config, ck = load_model(path, KIND, _build, rules=checkpoint_rules(), device=device)
    vocab = vocab_of(ck)
    if len(vocab) != config.get("vocab_size"):
        raise CheckpointError(
            Path(os.fspath(path)),
            f"the stored vocab has {len(vocab)} entries but the config's vocab_size is "
            f"{config.get('vocab_size')}",
        )
    return model, ck  # type: ignore[return-value]
