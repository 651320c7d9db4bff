"""A model's attention over a text: tokens and weights ``(layers, heads, T, T)``.

This is what ``attnlab visualize`` draws. Models (loaded lazily, so this module imports only
torch):

- ``minilm`` (default): the pretrained all-MiniLM-L6-v2 of `attnlab.models.minilm`, WordPiece
  tokens including [CLS] and [SEP].
- ``gpt``: a character-level `attnlab.models.GPT` checkpoint written by ``attnlab train``
  (``--checkpoint PATH``); tokens are characters (space shown as ␣). Weights are collected by
  `attnlab.analysis.capture.module_attentions`, which re-calls every attnlab
  `MultiHeadAttention` with ``need_weights=True`` during one ordinary forward pass.

Example:
    >>> run = collect("The animal didn't cross the street because it was too tired")
    >>> tuple(run.weights.shape[:2])  # (layers, heads) of all-MiniLM-L6-v2
    (6, 12)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .capture import module_attentions

MODELS = ("minilm", "gpt")


@dataclass
class Attentions:
    """What a model attended to: tokens, weights ``(layers, heads, T, T)`` and a description.

    Attributes:
        tokens: T token strings (row/column order of the weights).
        weights: ``(layers, heads, T, T)`` float32/64 on CPU; row i = query token i.
        model: a short name of the model, shown on the page.
        notes: remarks about the run (e.g. truncation), shown on the page and printed.
    """

    tokens: list[str]
    weights: Tensor
    model: str
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ adapters
@functools.lru_cache(maxsize=1)
def _load_minilm() -> Any:
    from ..models.minilm import minilm

    return minilm()


def minilm_attentions(text: str, *, device: torch.device | str = "cpu") -> Attentions:
    """all-MiniLM-L6-v2's attention over ``text`` (the model is loaded once per process and run
    on ``device``; the weights come back on the host for drawing)."""
    model = _load_minilm().to(device)
    tokens, weights = model.attentions(text)  # (layers, heads, T, T)
    notes = []
    if len(tokens) >= model.max_seq_length and model.tokenizer.encode(text).overflowing:
        notes.append(f"The text was truncated to the model's {model.max_seq_length} tokens.")
    return Attentions(list(tokens), weights.detach().float().cpu(), "all-MiniLM-L6-v2", notes)


def gpt_attentions(model: nn.Module, vocab: list[str], text: str) -> Attentions:
    """A character-level `attnlab.models.GPT`'s causal attention over ``text``.

    Characters are the tokens. The text is cut to the model's ``max_seq_len`` (with a note).
    The model runs on its own device; the weights are copied to the host (``.cpu()``) because
    they are drawn or printed.

    Raises:
        ValueError: empty text, or characters outside ``vocab`` (listed).
    """
    if not text:
        raise ValueError("text must not be empty")
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(
            f"text has characters {unknown} that are not in the checkpoint's vocabulary of "
            f"{len(vocab)} characters"
        )
    notes = []
    limit = model.config.max_seq_len
    if len(text) > limit:
        notes.append(f"The text was cut to the model's max_seq_len = {limit} characters.")
        text = text[:limit]
    device = next(model.parameters()).device
    idx = torch.tensor([[index[c] for c in text]], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            weights = module_attentions(model, lambda: model(idx))  # (layers, H, T, T)
    finally:
        model.train(was_training)
    return Attentions(list(text), weights.float().cpu(), "character-level GPT", notes)


def checkpoint_attentions(
    path: str | Path, text: str, *, device: torch.device | str = "cpu"
) -> Attentions:
    """`gpt_attentions` of the GPT saved by ``attnlab train`` at ``path`` (verified on load, then
    moved to ``device``)."""
    from ..train import load_model

    model, vocab, _ = load_model(path, device=device)
    result = gpt_attentions(model, vocab, text)
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


__all__ = [
    "MODELS",
    "Attentions",
    "checkpoint_attentions",
    "collect",
    "gpt_attentions",
    "minilm_attentions",
]
