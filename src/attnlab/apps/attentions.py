"""The models ``attnlab visualize`` runs, loaded: MiniLM, a GPT checkpoint, a transformers folder.

The app layer of the viewer: it opens what the user names — ``minilm`` (the pretrained
all-MiniLM-L6-v2), ``gpt`` (a character-level checkpoint of ``attnlab train``, ``--checkpoint
PATH``, verified by `attnlab.apps.gpt.load`) or a local transformers folder (read from
safetensors only, ``use_safetensors=True``, ``trust_remote_code=False``,
``local_files_only=True``; the config is checked against the safetensors header(s) before any
weight is read, `check_hf_folder`) — and hands the loaded model to `attnlab.analysis.
model_attentions`, which collects the weights.

Example:
    >>> run = collect("The animal didn't cross the street because it was too tired")
    >>> tuple(run.weights.shape[:2])  # (layers, heads) of all-MiniLM-L6-v2
    (6, 12)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..analysis.model_attentions import (
    Attentions,
    LongAttentions,
    gpt_attentions,
    hf_model_attentions,
    minilm_attentions,
)

MODELS = ("minilm", "gpt")
_OFFLINE = {"use_safetensors": True, "trust_remote_code": False, "local_files_only": True}


def checkpoint_attentions(
    path: str | Path, text: str, *, device: torch.device | str = "cpu"
) -> Attentions:
    """`gpt_attentions` of the GPT saved by ``attnlab train`` at ``path`` (verified on load by
    `attnlab.apps.gpt.load`, then moved to ``device``)."""
    from .gpt import load, vocab_of

    model, ck = load(path, device=device)
    result = gpt_attentions(model, vocab_of(ck), text)
    cfg = model.config
    result.model = (
        f"character-level GPT {Path(path).name} ({cfg.n_layers} layers, {cfg.n_heads} heads, "
        f"d_model {cfg.d_model})"
    )
    return result


def collect(
    text: str,
    *,
    model: str | None = None,
    checkpoint: str | None = None,
    device: torch.device | str = "cpu",
) -> Attentions:
    """Runs the chosen model on ``text`` on ``device``: ``minilm`` (default), or ``gpt`` with a
    checkpoint. The weights are returned on the host (they are drawn or printed)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    kind = model if model is not None else ("gpt" if checkpoint is not None else "minilm")
    if kind not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {kind!r}")
    if kind == "gpt":
        if checkpoint is None:
            raise ValueError(
                "--model gpt needs --checkpoint PATH (a file written by attnlab train)"
            )
        return checkpoint_attentions(checkpoint, text, device=device)
    if checkpoint is not None:
        raise ValueError(
            "--checkpoint is a GPT checkpoint written by attnlab train; drop --model minilm"
        )
    return minilm_attentions(text, device=device)


def check_hf_folder(path: str | os.PathLike) -> tuple[Any, Any]:
    """Checks a local transformers folder before any weight is read; returns (config, class).

    The check `attnlab.hf.from_pretrained` runs too (`attnlab.hf.folder.check_folder`): every
    file inside the folder (shard indexes, links and ``..`` resolved), pickle weights refused,
    the config read with ``trust_remote_code=False``, its layer counts and then the names and
    shapes of the model built from it on the meta device (no memory, stopped once it
    outgrows the files) equal to the safetensors header(s).

    Raises:
        ValueError: not a folder; a file outside it, a missing / extra / differently shaped
            tensor, a config that needs remote code (`attnlab.checkpoint.CheckpointError`,
            each naming the cause).
        FileNotFoundError: no config.json, no safetensors weights (pickle files named).
        MissingExtraError: transformers is not installed.
    """
    from ..hf.folder import check_folder
    from ..utils.extras import require

    folder = Path(os.fspath(path))
    if not folder.is_dir():
        raise ValueError(f"--model must be minilm, gpt or a transformers folder, got {str(path)!r}")
    require("transformers", "hf", "attnlab visualize --model PATH")
    checked = check_folder(folder)
    return checked.config, checked.model_class


def hf_attentions(
    path: str | os.PathLike,
    text: str,
    *,
    device: torch.device | str = "cpu",
    long_from: int = 64,
    topk: int = 8,
    thumb_size: int = 64,
) -> list[Attentions | LongAttentions]:
    """A local transformers folder's attention over ``text``: one `Attentions` per part.

    The folder is checked (`check_hf_folder`), the tokenizer and model are loaded from it
    offline with safetensors only and with ``attn_implementation="attnlab"`` (attnlab's exact
    weights), the model is moved to ``device`` and run by
    `attnlab.analysis.model_attentions.hf_model_attentions` (which see for the parts, the
    truncation and the `LongAttentions` of inputs longer than ``long_from`` tokens).

    Raises:
        ValueError: see `check_hf_folder`; no tokenizer in the folder; empty text.
    """
    from ..hf import register
    from ..hf.folder import check_loading_info

    if not text:
        raise ValueError("text must not be empty")
    folder = Path(os.fspath(path))
    config, cls = check_hf_folder(folder)
    import transformers

    register()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            folder, trust_remote_code=False, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"{folder}: no usable tokenizer ({' '.join(str(e).split())[:200]})"
        ) from None
    try:
        model, info = cls.from_pretrained(
            folder, attn_implementation="attnlab", output_loading_info=True, **_OFFLINE
        )
    except OSError as e:
        raise ValueError(f"{folder}: cannot load the model ({' '.join(str(e).split())})") from e
    check_loading_info(folder, info, cls.__name__)
    model = model.to(device).eval()
    name = f"{cls.__name__} from {folder.name} ({config.model_type})"
    return hf_model_attentions(
        model, tokenizer, text, name=name, long_from=long_from, topk=topk, thumb_size=thumb_size
    )


__all__ = [
    "MODELS",
    "check_hf_folder",
    "checkpoint_attentions",
    "collect",
    "hf_attentions",
]
