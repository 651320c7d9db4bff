"""``attnlab visualize``: see what a real model attends to, as HTML, PNG or text.

The command runs a model on a text, collects every layer's attention weights
``(layers, heads, T, T)`` and writes

- ``--format html`` (default): one self-contained page (`attnlab.viz.save_attention_html`) with
  a head view, a model view, per-head entropies and hover details;
- ``--format text``: per head, each token's top-3 attended tokens with weights;
- ``--png [FILE]``: additionally a grid of heatmaps, layers × heads (`attnlab.viz.attention_png`).

Models (loaded lazily, so this module imports only torch):

- ``minilm`` (default): the pretrained all-MiniLM-L6-v2 of `attnlab.models.minilm`, WordPiece
  tokens including [CLS] and [SEP].
- ``gpt``: a character-level `attnlab.models.GPT` checkpoint written by ``attnlab train``
  (``--checkpoint PATH``); tokens are characters (space shown as ␣). Weights are collected by
  `module_attentions`, which re-calls every attnlab `MultiHeadAttention` with
  ``need_weights=True`` during one ordinary forward pass.

Example:
    $ attnlab visualize "The animal didn't cross the street because it was too tired"
    $ attnlab visualize --checkpoint runs/alice/ckpt.safetensors "Alice was" --format text
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired"
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
    from .models.minilm import minilm

    return minilm()


def minilm_attentions(text: str) -> Attentions:
    """all-MiniLM-L6-v2's attention over ``text`` (the model is loaded once per process)."""
    model = _load_minilm()
    tokens, weights = model.attentions(text)  # (layers, heads, T, T)
    notes = []
    if len(tokens) >= model.max_seq_length and model.tokenizer.encode(text).overflowing:
        notes.append(f"The text was truncated to the model's {model.max_seq_length} tokens.")
    return Attentions(list(tokens), weights.detach().float().cpu(), "all-MiniLM-L6-v2", notes)


def module_attentions(model: nn.Module, run: Callable[[], Any]) -> Tensor:
    """Every attnlab `MultiHeadAttention`'s weights during ``run()``, stacked in call order.

    A forward hook on each `attnlab.modules.MultiHeadAttention` of ``model`` calls the module
    again with the same inputs and ``need_weights=True``; the model's own outputs are
    unchanged. Run the model in eval mode without KV caches (the hook refuses a cache, which the
    second call would extend twice).

    Args:
        model: a module built from attnlab's attention (e.g. `attnlab.models.GPT`).
        run: runs one forward pass of ``model`` on a batch of one sequence.

    Returns:
        ``(calls, heads, L, S)``: one row per attention call (= per layer for one pass).

    Raises:
        ValueError: the model has no attnlab `MultiHeadAttention`, or ``run`` did not call one.
    """
    from .modules import MultiHeadAttention

    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not modules:
        raise ValueError(
            f"model ({type(model).__name__}) has no attnlab MultiHeadAttention modules to read "
            "weights from"
        )
    captured: list[Tensor] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if kwargs.get("cache") is not None:
            raise ValueError("module_attentions cannot read weights from a call with a KV cache")
        _, weights = module.forward(*args, **{**kwargs, "need_weights": True})  # (B, H, L, S)
        captured.append(weights.detach()[0])  # (H, L, S)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        raise ValueError("run() did not call any attnlab MultiHeadAttention of the model")
    return torch.stack(captured)  # (calls, H, L, S)


def gpt_attentions(model: nn.Module, vocab: list[str], text: str) -> Attentions:
    """A character-level `attnlab.models.GPT`'s causal attention over ``text``.

    Characters are the tokens. The text is cut to the model's ``max_seq_len`` (with a note).

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
    idx = torch.tensor([[index[c] for c in text]], dtype=torch.long)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            weights = module_attentions(model, lambda: model(idx))  # (layers, H, T, T)
    finally:
        model.train(was_training)
    return Attentions(list(text), weights.float(), "character-level GPT", notes)


def checkpoint_attentions(path: str | Path, text: str) -> Attentions:
    """`gpt_attentions` of the GPT saved by ``attnlab train`` at ``path`` (verified on load)."""
    from .train import load_model

    model, vocab, _ = load_model(path)
    result = gpt_attentions(model, vocab, text)
    cfg = model.config
    result.model = (
        f"character-level GPT {Path(path).name} ({cfg.n_layers} layers, {cfg.n_heads} heads, "
        f"d_model {cfg.d_model})"
    )
    return result


def collect(text: str, *, model: str | None = None, checkpoint: str | None = None) -> Attentions:
    """Runs the chosen model on ``text``: ``minilm`` (default), or ``gpt`` with a checkpoint."""
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
        return checkpoint_attentions(checkpoint, text)
    if checkpoint is not None:
        raise ValueError(
            "--checkpoint is a GPT checkpoint written by attnlab train; drop --model minilm"
        )
    return minilm_attentions(text)


# ----------------------------------------------------------------------------------------- CLI
def _short(text: str, limit: int = 80) -> str:
    """The text on one line, cut to ``limit`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _cmd_visualize(args: argparse.Namespace) -> int:
    from .viz.attention_png import attention_png
    from .viz.attention_view import MAX_FULL_TOKENS, attention_text, save_attention_html

    try:
        run = collect(args.text, model=args.model, checkpoint=args.checkpoint)
        Ly, H, T, _ = run.weights.shape
        for name, value, size in (("--layer", args.layer, Ly), ("--head", args.head, H)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name} must be in [0, {size}), got {value}")
        summary = f"{run.model} · {T} tokens · {Ly} layers × {H} heads"
        if args.format == "text":
            print(summary + " · top-3 attended tokens per query (weight)\n")
            for note in run.notes:
                print(f"note: {note}")
            print(
                attention_text(
                    run.tokens,
                    run.weights,
                    k=3,
                    layers=None if args.layer is None else [args.layer],
                    heads=None if args.head is None else [args.head],
                )
            )
        else:
            out = save_attention_html(
                run.tokens,
                run.weights,
                args.out,
                title=f"Attention: {_short(args.text)}",
                subtitle=summary,
                notes=run.notes,
                layer=args.layer or 0,
                head=args.head or 0,
                topk=args.top_k,
            )
            size = out.stat().st_size
            print(f"wrote {out} ({size / 1e6:.2f} MB; {summary})")
            for note in run.notes:
                print(f"note: {note}")
            if T > MAX_FULL_TOKENS:
                print(f"note: long input, the viewer keeps each token's top {args.top_k} weights")
        if args.png is not None:
            png = Path(args.out).with_suffix(".png") if args.png is True else Path(args.png)
            attention_png(run.tokens, run.weights, png, title=summary)
            print(f"wrote {png}")
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"attnlab visualize: {e}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab visualize`` to the ``attnlab`` command's subparsers."""
    p = sub.add_parser(
        "visualize",
        help="show a model's attention on a text: HTML viewer, PNG heatmaps or text",
        description=(
            "Runs a model on TEXT and writes one self-contained HTML page (no network) with a "
            "head view (lines from each token to the tokens it attends to), a model view "
            "(layers × heads thumbnails; click to select), per-head entropy and hover "
            "details. Default model: the pretrained all-MiniLM-L6-v2; --checkpoint uses a "
            "character-level GPT written by `attnlab train`."
        ),
    )
    p.add_argument(
        "text",
        nargs="?",
        default=DEFAULT_TEXT,
        metavar="TEXT",
        help=f"the text to run (default: {DEFAULT_TEXT!r})",
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="minilm (default) or gpt (implied by --checkpoint)",
    )
    p.add_argument(
        "--checkpoint", metavar="PATH", help="a GPT checkpoint (.safetensors) from `attnlab train`"
    )
    p.add_argument(
        "--out",
        default="attention.html",
        metavar="FILE.html",
        help="where to write the HTML page (default attention.html)",
    )
    p.add_argument(
        "--format",
        choices=("html", "text"),
        default="html",
        help="html (default) or text: per head, each token's top-3 attended tokens",
    )
    p.add_argument(
        "--png",
        nargs="?",
        const=True,
        default=None,
        metavar="FILE.png",
        help="also write a PNG grid of heatmaps, layers × heads (default name: --out as .png)",
    )
    p.add_argument("--layer", type=int, help="text: only this layer; html: the layer shown first")
    p.add_argument("--head", type=int, help="text: only this head; html: the head shown first")
    p.add_argument(
        "--top-k",
        type=int,
        default=8,
        metavar="K",
        help="inputs over 64 tokens: weights kept and lines drawn per token (default 8)",
    )
    p.set_defaults(func=_cmd_visualize)


__all__ = [
    "DEFAULT_TEXT",
    "Attentions",
    "checkpoint_attentions",
    "collect",
    "gpt_attentions",
    "minilm_attentions",
    "module_attentions",
    "register",
]
