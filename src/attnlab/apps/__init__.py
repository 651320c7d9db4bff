"""Applications of attention, trained end to end: one module per task, sharing `loop`.

Each task module ``attnlab.apps.<kind>`` (``gpt``: the character-level GPT of ``attnlab train``;
``translate``, ``classify``, ``vit``, ``rnn``) trains and evaluates one model kind on data that
ships with a package or with attnlab (nothing is downloaded) and defines
``load(path, device="cpu") -> (model, checkpoint)`` for its checkpoints, each through the one
verified loader `attnlab.apps.loop.load_model`. `load_any` reads a checkpoint of any kind: the
kind is stored in the file's metadata (``model_kind``; files written by ``attnlab train``, which
predate it, are "gpt"). Whatever the kind, the stored config is
justified by the tensors before anything is built: its integer fields by the kind's table of
`attnlab._fit.ConfigRule` (every layer count from the tensor names, every size from a
tensor shape, types and bounds), read from the header alone, then its names and shapes by a
build on ``meta``; a crafted value (``dec_layers=10**9``, ``max_seq_len=2**62``) is refused
with a `CheckpointError` in milliseconds.

Example:
    >>> kind, model, ck = load_any("runs/translate/ckpt.safetensors")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

import torch
from torch import nn

from ..checkpoint import Checkpoint, CheckpointError
from .loop import read_kind


def _loader(path: str | os.PathLike, kind: str):
    name = f"{__name__}.{kind}"
    if re.fullmatch(r"[a-z][a-z0-9_]*", kind) is None or importlib.util.find_spec(name) is None:
        raise CheckpointError(path, f"holds an unknown model kind {kind!r}")
    module = importlib.import_module(name)
    if not callable(getattr(module, "load", None)):
        raise CheckpointError(path, f"holds an unknown model kind {kind!r}")
    return module.load


def load_any(
    path: str | os.PathLike, *, device: torch.device | str = "cpu"
) -> tuple[str, nn.Module, Checkpoint]:
    """The model in a checkpoint of any kind, verified: ``(kind, model, checkpoint)``.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a damaged file, an unknown kind, a config its tensors do not justify.
    """
    kind = read_kind(path)
    model, ck = _loader(path, kind)(path, device)
    return kind, model, ck


__all__ = ["load_any"]
