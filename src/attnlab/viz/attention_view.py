"""A self-contained HTML attention viewer, per-head entropy, and a plain-text top-k report.

`show` turns ``(tokens, weights)`` — T token strings and attention weights
``(layers, heads, T, S)`` (row i = query token i, column j = key token j; ``S == T`` for
self-attention, or S ``key_tokens`` for cross-attention), or transformers' ``output_attentions``
tuple as it comes — into an `AttentionView`: Jupyter renders it inline (``_repr_html_``) and
``.save(path)`` writes ONE HTML file (`attention_html`) with every script, style and datum inline
(no network: the page's Content-Security-Policy forbids any fetch). The viewer has:

- a head view: pick a layer and a head; a line joins each query token (left) to each key token
  (right) it attends to, its opacity and width growing with the weight; or all heads of the
  layer overlaid, one colour per head, each toggled in a legend; for a sentence pair
  (``sentence_b_start``) filters All, A→A, A→B, B→A, B→B keep the lines of one block;
- a model view: a grid of layers × heads thumbnails; clicking one selects that head;
- per-head entropy: ``mean over query rows i of −Σ_j p_ij log p_ij`` in nats, skipping masked
  (and all-zero) rows (`attnlab.analysis.entropy`, see `entropies`); at most ``log S``;
- hover details: hovering a token highlights its attention and lists its top weights; clicking
  pins it (Esc unpins, in that viewer only).

Every rendering is one ``<div class="attnlab-viewer" id=uid>``: its CSS is scoped under that
class, its element lookups stay inside it and its data sits in its own
``<script type="application/json" data-role="attnlab-data">`` (see `attention_data` for the
fields; weights are rounded to ``decimals`` places, by default 4) — so several viewers share a
notebook page. Inputs up to ``max_tokens`` tokens embed every weight. Longer inputs stay
responsive: each query row keeps only its exact ``topk`` largest weights (what the head view
draws and the hover lists; nothing L×S is embedded), thumbnails are max-pooled to at most
``thumb_size`` pixels a side, and the page says so.

Example:
    >>> tokens = ["[CLS]", "the", "cat", "[SEP]"]
    >>> w = torch.softmax(torch.randn(2, 4, 4, 4), dim=-1)      # (layers, heads, T, T)
    >>> view = show(tokens, w, title="toy")                    # a notebook cell shows it
    >>> view.save("attention.html")
    PosixPath('attention.html')
    >>> print(attention_text(tokens, w, k=2, layers=[0], heads=[0]))
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
import math
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._shapes import check_int
from ..analysis.weights import entropy, top_weights

if TYPE_CHECKING:
    from ..analysis.model_attentions import LongAttentions

PathLike = str | os.PathLike[str]

DEFAULT_DECIMALS = 4
MIN_LINE_WEIGHT = 0.005  # the head view omits lines below this weight (said on the page)
MAX_FULL_TOKENS = 64  # longer inputs keep only each row's top-k weights


# ------------------------------------------------------------------------------------ checking
def _token_list(tokens: Sequence[str], name: str) -> list[str]:
    """``tokens`` as a list of str, or TypeError naming ``name``."""
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a sequence of str, got {type(tokens).__name__}")
    bad = [i for i, t in enumerate(tokens) if not isinstance(t, str)]
    if bad:
        raise TypeError(
            f"{name} must be a sequence of str, got {type(tokens[bad[0]]).__name__} at "
            f"index {bad[0]}"
        )
    return list(tokens)


def _bool_mask(
    mask: Sequence[bool] | Tensor | None, n: int, name: str, what: str, batch: int | None
) -> Tensor:
    """``mask`` as ``(n,)`` bool (all True for None), or TypeError/ValueError naming ``name``.

    Besides ``(n,)`` booleans, transformers' ``attention_mask`` is accepted: integers 0/1
    (1 = real token), ``(n,)`` or ``(B, n)`` (row ``batch``, default 0).
    """
    if mask is None:
        return torch.ones(n, dtype=torch.bool)
    m = mask.detach().cpu() if isinstance(mask, Tensor) else torch.as_tensor(list(mask))
    if m.dtype != torch.bool:
        if m.is_floating_point() or m.is_complex():
            raise TypeError(
                f"{name} must be booleans (True = real token) or transformers' 0/1 "
                f"attention_mask, got dtype {m.dtype}"
            )
        bad = m[(m != 0) & (m != 1)]
        if bad.numel():
            raise ValueError(
                f"{name} as integers must be 0/1 (transformers' attention_mask, 1 = real "
                f"token), got {bad[0].item()}"
            )
        m = m == 1
    if m.dim() == 2:  # (B, n): transformers' attention_mask for the batch
        b = 0 if batch is None else batch
        _check_batch(b, m.shape[0], f"{name} of shape {tuple(m.shape)}")
        m = m[b]
    if tuple(m.shape) != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) or (B, {n}), one per {what}, got "
            f"{tuple(mask.shape) if isinstance(mask, Tensor) else tuple(m.shape)}"
        )
    return m


def _layer_tuple(weights: Sequence[Any], batch: int) -> Tensor:
    """Batch item ``batch`` of HF's ``output_attentions``: ``layers`` × ``(B, H, T, S)`` tensors.

    Returns ``(layers, H, T, S)`` (not yet converted); raises naming the offending index.
    """
    hint = "one (B, H, T, S) tensor per layer, like transformers' output_attentions"
    if len(weights) == 0:
        raise ValueError(f"weights must hold {hint}, got an empty {type(weights).__name__}")
    first: Tensor | None = None
    for n, t in enumerate(weights):
        if t is None:
            raise ValueError(
                f"weights[{n}] is None, expected a (B, H, T, S) tensor: transformers returns no "
                'weights from fused kernels; load the model with attn_implementation="eager"'
            )
        if not isinstance(t, Tensor):
            raise TypeError(f"weights[{n}] must be a torch.Tensor ({hint}), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"weights[{n}] must be (B, H, T, S) ({hint}), got shape {tuple(t.shape)}"
            )
        if first is None:
            first = t
        elif t.shape != first.shape:
            raise ValueError(
                f"weights[{n}] has shape {tuple(t.shape)}, but weights[0] has "
                f"{tuple(first.shape)}: every layer must have the same (B, H, T, S)"
            )
    assert first is not None
    _check_batch(batch, first.shape[0], f"weights[0] of shape {tuple(first.shape)}")
    return torch.stack([t.detach()[batch].cpu() for t in weights])  # (layers, H, T, S)


def _check_batch(batch: int, size: int, what: str) -> None:
    check_int(f"batch for {what}", batch, minimum=0, maximum=size - 1)


def _as_weights(weights: Tensor | Sequence[Any] | Any, batch: int | None) -> Tensor:
    """``weights`` in any accepted form (see `check_inputs`) as a ``(layers, heads, T, S)``
    tensor, not yet converted or checked for values."""
    if isinstance(weights, tuple | list):
        for n, t in enumerate(weights):
            if isinstance(t, tuple | list) and any(isinstance(x, Tensor) for x in t):
                raise ValueError(
                    f"weights[{n}] is a {type(t).__name__} of tensors, expected one (B, H, T, S) "
                    "tensor per layer: generate() returns one tuple of layers per generated "
                    "token; pass one step's tuple (e.g. out.attentions[0]) or run the model's "
                    "forward on the whole sequence with output_attentions=True"
                )
    if isinstance(weights, tuple | list) and (
        not weights or any(t is None or isinstance(t, Tensor) for t in weights)
    ):
        w = _layer_tuple(weights, 0 if batch is None else batch)
    else:
        try:
            w = weights.detach() if isinstance(weights, Tensor) else torch.as_tensor(weights)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"weights must be a tensor or array of numbers, got {e}") from None
        if w.dim() == 5:  # (layers, B, H, T, S): torch.stack(output_attentions)
            batch = 0 if batch is None else batch
            _check_batch(batch, w.shape[1], f"weights of shape {tuple(w.shape)}")
            w = w[:, batch]
        elif batch is not None and batch != 0:
            raise ValueError(
                f"batch picks an item of weights with a batch dimension (a tuple of (B, H, T, S) "
                f"tensors or (layers, B, H, T, S)), got batch={batch!r} for weights of shape "
                f"{tuple(w.shape)}"
            )
    if w.is_complex() or w.dtype == torch.bool:
        raise TypeError(f"weights must hold real numbers, got dtype {w.dtype}")
    if w.dim() == 3:
        w = w.unsqueeze(0)  # (1, H, T, S)
    if w.dim() != 4:
        raise ValueError(
            f"weights must be (layers, heads, T, S) or (heads, T, S), got shape {tuple(w.shape)}"
        )
    return w


@dataclass(frozen=True)
class AttentionInputs:
    """Checked viewer inputs (see `check_inputs`).

    Attributes:
        tokens: T query tokens. weights: ``(layers, heads, T, S)`` float64 on CPU.
        mask: ``(T,)`` bool, True = real query token.
        key_tokens: S key tokens, None for self-attention (the keys are ``tokens``).
        key_mask: ``(S,)`` bool, True = real key token (``mask`` for self-attention).
    """

    tokens: list[str]
    weights: Tensor
    mask: Tensor
    key_tokens: list[str] | None
    key_mask: Tensor


def check_inputs(
    tokens: Sequence[str],
    weights: Tensor | Sequence[Tensor] | Any,
    mask: Sequence[bool] | Tensor | None = None,
    *,
    key_tokens: Sequence[str] | None = None,
    key_mask: Sequence[bool] | Tensor | None = None,
    batch: int | None = None,
) -> AttentionInputs:
    """Validates the viewer's inputs, self- or cross-attention, before any work.

    Args:
        tokens: T query strings.
        weights: attention weights in ``[0, 1]``, finite, row i = query i, column j = key j:
            ``(layers, heads, T, S)``, ``(heads, T, S)`` (one layer), transformers'
            ``output_attentions`` / ``cross_attentions`` (a tuple or list of ``layers`` tensors
            ``(B, H, T, S)``) or their stack ``(layers, B, H, T, S)``; a tensor or anything
            `torch.as_tensor` accepts.
        mask: None (every query token is real), T booleans (True = real token), or
            transformers' ``attention_mask`` (0/1 integers, ``(T,)`` or ``(B, T)``: row
            ``batch``). Rows of masked queries are left out of entropies, reports and the
            viewer's lines.
        key_tokens: None for self-attention (``S == T``, keys are ``tokens``), else S strings
            (cross-attention: e.g. the encoder's tokens for a decoder's cross-attention).
        key_mask: for ``key_tokens``, like ``mask`` (default all real; e.g. the encoder's
            ``attention_mask`` for cross-attention); None for self-attention.
        batch: the batch item to show from weights with a batch dimension (default 0).

    Returns:
        `AttentionInputs`.

    Raises:
        TypeError: tokens not a sequence of str, weights not numeric (or a tuple element not a
            tensor, named by index), or a mask not boolean.
        ValueError: wrong rank or sizes (named with the shapes and, for a tuple, the index),
            batch out of range, non-finite values or values outside ``[0, 1]``, or no
            tokens/heads/layers at all.
    """
    tokens = _token_list(tokens, "tokens")
    keys = None if key_tokens is None else _token_list(key_tokens, "key_tokens")
    if keys is None and key_mask is not None:
        raise ValueError("key_mask needs key_tokens (cross-attention); for self-attention use mask")
    w = _as_weights(weights, batch)
    T = len(tokens)
    S = T if keys is None else len(keys)
    if tuple(w.shape[-2:]) != (T, S):
        if keys is None:
            raise ValueError(
                f"weights must end in (T, T) = ({T}, {T}) for {T} tokens, got shape "
                f"{tuple(w.shape)}"
                + (
                    f"; for cross-attention pass the {w.shape[-1]} key_tokens"
                    if w.shape[-2] == T
                    else ""
                )
            )
        raise ValueError(
            f"weights must end in (T, S) = ({T}, {S}) for {T} tokens and {S} key_tokens, got "
            f"shape {tuple(w.shape)}"
        )
    if T == 0 or S == 0 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(
            f"need at least one token, key, layer and head, got {T} tokens and weights of shape "
            f"{tuple(w.shape)}"
        )
    m = _bool_mask(mask, T, "mask", "token", batch)
    km = m if keys is None else _bool_mask(key_mask, S, "key_mask", "key token", batch)
    w = w.to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weights must be finite, got NaN or inf")
    lo, hi = float(w.min()), float(w.max())
    if lo < 0.0 or hi > 1.0 + 1e-6:
        raise ValueError(f"weights must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}]")
    return AttentionInputs(tokens, w, m, keys, km)


def check_attention(
    tokens: Sequence[str],
    weights: Tensor | Sequence[Tensor] | Any,
    mask: Sequence[bool] | Tensor | None = None,
    *,
    batch: int | None = None,
) -> tuple[list[str], Tensor, Tensor]:
    """Validates self-attention ``(tokens, weights, mask)``; returns ``(list, float64, bool)``.

    Args:
        tokens: T strings.
        weights: ``(layers, heads, T, T)``, ``(heads, T, T)``, transformers'
            ``output_attentions`` tuple or its stack (see `check_inputs`).
        mask: None (every token is real), T booleans (True = real token) or transformers'
            0/1 ``attention_mask`` (see `check_inputs`).
        batch: the batch item of weights with a batch dimension (default 0).

    Returns:
        ``(tokens, weights (layers, heads, T, T) float64 on CPU, mask (T,) bool)``.

    Raises:
        TypeError, ValueError: see `check_inputs`.
    """
    got = check_inputs(tokens, weights, mask, batch=batch)
    return got.tokens, got.weights, got.mask


# ------------------------------------------------------------------------------------ analysis
def entropies(weights: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Row and head entropies in nats, mask-aware, from `attnlab.analysis` (one definition).

    ``rows[l, h, i] = −Σ_j w[l, h, i, j] · log w[l, h, i, j]`` (``0 log 0 = 0``) for valid rows —
    real tokens (``mask[i]``) whose weights are not all zero (a fully masked query) — and NaN for
    the others; ``heads[l, h]`` is the mean of ``rows[l, h]`` over the valid rows (NaN if none).
    A uniform row over n keys has entropy ``log n``; a one-hot row has 0.

    Args:
        weights: ``(layers, heads, T, T)`` float64 (as `check_attention` returns).
        mask: None or ``(T,)`` bool, True = real token.

    Returns:
        ``(rows (layers, heads, T), heads (layers, heads))`` float64.
    """
    w = weights.to(torch.float64)
    # one layer at a time: the L×S temporaries of one layer, not of all of them
    rows = torch.cat([entropy(w[n : n + 1]) for n in range(w.shape[0])])  # (layers, heads, T)
    if mask is not None:
        rows = torch.where(mask.to(rows.device), rows, torch.nan)
    return rows, rows.nanmean(dim=-1)


def pooled_thumbnails(weights: Tensor, size: int) -> Tensor:
    """Thumbnails of at most ``size`` pixels a side: each pixel is the largest weight in its block.

    Max-pooling (not averaging) keeps a sharp single-token attention visible after shrinking.
    A non-square (cross-attention) matrix stays non-square.

    Args:
        weights: ``(layers, heads, T, S)``. size: the largest side in pixels.

    Returns:
        ``(layers, heads, min(T, size), min(S, size))``, in the weights' dtype.
    """
    Ly, H, T, S = weights.shape
    rows, cols = min(T, size), min(S, size)
    if (rows, cols) == (T, S):
        return weights.clone()
    flat = weights.reshape(Ly * H, 1, T, S)  # (layers·heads, 1, T, S)
    pooled = torch.nn.functional.adaptive_max_pool2d(flat, (rows, cols))  # (·, 1, rows, cols)
    return pooled.reshape(Ly, H, rows, cols)


def _rounded(t: Tensor, decimals: int) -> Any:
    """Nested lists of ``round(x, decimals)`` in float64; NaN becomes None (JSON null)."""
    r = torch.round(t.double(), decimals=decimals)
    if not bool(torch.isnan(r).any()):
        return r.tolist()

    def clean(x: Any) -> Any:
        return [clean(v) for v in x] if isinstance(x, list) else (None if math.isnan(x) else x)

    return clean(r.tolist())


# ----------------------------------------------------------------------------------------- data
def attention_data(
    tokens: Sequence[str],
    weights: Tensor | Sequence[Tensor] | Any,
    *,
    mask: Sequence[bool] | Tensor | None = None,
    key_tokens: Sequence[str] | None = None,
    key_mask: Sequence[bool] | Tensor | None = None,
    batch: int | None = None,
    sentence_b_start: int | None = None,
    title: str | None = None,
    subtitle: str | None = None,
    notes: Sequence[str] = (),
    layer: int = 0,
    head: int = 0,
    topk: int = 8,
    max_tokens: int = MAX_FULL_TOKENS,
    thumb_size: int = 64,
    decimals: int = DEFAULT_DECIMALS,
) -> dict[str, Any]:
    """The JSON document that the viewer embeds (``data-role="attnlab-data"``).

    Fields:
        ``tokens`` (T strings), ``mask`` (T bools), ``layers``, ``heads``, ``T``, ``S``;
        ``cross``: True for cross-attention, with ``key_tokens`` (S strings) and ``key_mask``
            (S bools); both None for self-attention (the keys are the tokens);
        ``sentence_b_start``: None, or the first token of sentence B (the pair filters);
        ``mode``: ``"full"`` when ``max(T, S) <= max_tokens``, else ``"topk"``;
        ``weights``: full mode, ``(layers, heads, T, S)`` nested lists, each weight rounded to
            ``decimals`` places (``round(w, decimals)`` in float64); None in top-k mode;
        ``topk``, ``top_idx``, ``top_val``: top-k mode, each row's ``k = min(topk, S)`` largest
            weights (largest first, ties by lower index) and their key indices,
            ``(layers, heads, T, k)``; None in full mode;
        ``thumb_shape`` ``[r, c]`` (``r = min(T, thumb_size)``, ``c = min(S, thumb_size)``),
            ``thumb_size`` (``max(r, c)``), ``thumbs``: top-k mode, max-pooled thumbnails as
            integers ``round(255 · w)``, ``(layers, heads, r·c)`` row-major;
        ``entropy``: per-head entropy in nats (`entropies`), ``(layers, heads)`` rounded to
            ``decimals`` (null for a head without valid rows);
        ``row_entropy``: ``(layers, heads, T)`` rounded, null for rows that are not valid;
        ``min_line``: lines below this weight are not drawn; ``selected``: ``[layer, head]``;
        ``title``, ``subtitle``, ``notes`` (strings shown on the page), ``decimals``.

    Args:
        tokens, weights, mask, key_tokens, key_mask, batch: see `check_inputs` (weights may be
            transformers' ``output_attentions`` tuple; ``batch`` picks its item).
        sentence_b_start: for a sentence pair (self-attention), the index of sentence B's first
            token, in ``[1, T)``: the viewer offers bertviz's filters All, A→A, A→B, B→A, B→B.
        title, subtitle: page heading and the line under it.
        notes: extra remarks shown on the page (e.g. "input truncated to 256 tokens").
        layer, head: the head selected when the page opens.
        topk: weights kept per query row for long inputs (>= 1).
        max_tokens: the longest input (queries or keys) that embeds every weight.
        thumb_size: the largest thumbnail side in pixels for long inputs.
        decimals: decimal places of embedded weights and entropies (1 to 8).

    Example:
        >>> out = model(**inputs, output_attentions=True)     # a transformers model, eager
        >>> data = attention_data(tokens, out.attentions, batch=0)
        >>> data["layers"], data["heads"], data["T"] == data["S"]
        (6, 12, True)
    """
    got = check_inputs(tokens, weights, mask, key_tokens=key_tokens, key_mask=key_mask, batch=batch)
    w = got.weights
    Ly, H, T, S = w.shape
    check_int("topk", topk, minimum=1)
    check_int("max_tokens", max_tokens, minimum=1)
    check_int("thumb_size", thumb_size, minimum=4)
    check_int("decimals", decimals, minimum=1, maximum=8)
    check_int("layer", layer, minimum=0, maximum=Ly - 1)
    check_int("head", head, minimum=0, maximum=H - 1)
    if sentence_b_start is not None:
        if got.key_tokens is not None:
            raise ValueError(
                "sentence_b_start applies to self-attention over a sentence pair, got it with "
                "key_tokens (cross-attention)"
            )
        # both sentences non-empty
        check_int("sentence_b_start", sentence_b_start, minimum=1, maximum=T - 1)
    rows, entropy = entropies(w, got.mask)  # (layers, heads, T), (layers, heads)
    data: dict[str, Any] = {
        "version": 2,
        "title": title or "Attention",
        "subtitle": subtitle or "",
        "tokens": got.tokens,
        "mask": got.mask.tolist(),
        "cross": got.key_tokens is not None,
        "key_tokens": got.key_tokens,
        "key_mask": None if got.key_tokens is None else got.key_mask.tolist(),
        "sentence_b_start": sentence_b_start,
        "layers": Ly,
        "heads": H,
        "T": T,
        "S": S,
        "decimals": decimals,
        "min_line": MIN_LINE_WEIGHT,
        "selected": [layer, head],
        "entropy": _rounded(entropy, decimals),
        "row_entropy": _rounded(rows, decimals),
        "notes": [str(n) for n in notes],
        "mode": "full",
        "weights": None,
        "topk": None,
        "top_idx": None,
        "top_val": None,
        "thumb_size": None,
        "thumb_shape": None,
        "thumbs": None,
    }
    if max(T, S) <= max_tokens:
        data["weights"] = _rounded(w, decimals)
        return data
    k = min(topk, S)
    values, indices = top_weights(w, k)  # (layers, heads, T, k) each
    thumbs = pooled_thumbnails(w, thumb_size)  # (layers, heads, r, c)
    r, c = thumbs.shape[-2:]
    data.update(
        mode="topk",
        topk=k,
        top_idx=indices.tolist(),
        top_val=_rounded(values, decimals),
        thumb_size=max(r, c),
        thumb_shape=[r, c],
        thumbs=torch.round(thumbs * 255).to(torch.int64).reshape(Ly, H, r * c).tolist(),
    )
    size = f"{T} tokens" if S == T and got.key_tokens is None else f"{T} × {S} tokens"
    data["notes"].insert(
        0,
        f"Long input ({size} > {max_tokens}): the head view draws and the hover lists only "
        f"each token's top {k} weights, which is all the page stores; the thumbnails are "
        f"max-pooled to {r}×{c} pixels.",
    )
    return data


def long_view_data(
    run: LongAttentions, *, title: str, subtitle: str, layer: int = 0, head: int = 0
) -> dict[str, Any]:
    """The viewer's JSON document (top-k mode, see `attention_data`) for a
    `attnlab.analysis.model_attentions.LongAttentions`, built from its top-k rows and
    thumbnails (no L×S)."""
    Ly, H, T, S = run.shape
    k = run.top_val.shape[-1]
    r, c = run.thumbs.shape[-2:]
    rows = run.row_entropy
    decimals = DEFAULT_DECIMALS
    size = f"{T} tokens" if run.key_tokens is None else f"{T} × {S} tokens"
    notes = [
        f"Long input ({size}): the head view draws and the hover lists only each token's top {k} "
        f"weights (exact, computed row by row without the {T}×{S} matrix), which is all the page "
        f"stores; the thumbnails are max-pooled to {r}×{c} pixels.",
        *run.notes,
    ]
    return {
        "version": 2,
        "title": title,
        "subtitle": subtitle,
        "tokens": run.tokens,
        "mask": [True] * T,
        "cross": run.key_tokens is not None,
        "key_tokens": run.key_tokens,
        "key_mask": None if run.key_tokens is None else [True] * S,
        "sentence_b_start": None,
        "layers": Ly,
        "heads": H,
        "T": T,
        "S": S,
        "decimals": decimals,
        "min_line": MIN_LINE_WEIGHT,
        "selected": [layer, head],
        "entropy": _rounded(rows.nanmean(dim=-1), decimals),
        "row_entropy": _rounded(rows, decimals),
        "notes": notes,
        "mode": "topk",
        "weights": None,
        "topk": k,
        "top_idx": run.top_idx.tolist(),
        "top_val": _rounded(run.top_val, decimals),
        "thumb_size": max(r, c),
        "thumb_shape": [r, c],
        "thumbs": torch.round(run.thumbs * 255).to(torch.int64).reshape(Ly, H, r * c).tolist(),
    }


def _json_for_script(data: Any) -> str:
    """JSON safe inside a <script> element: ``<``, ``>`` and ``&`` become ``\\u`` escapes."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


# ----------------------------------------------------------------------------------------- HTML
_UID = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


class AttentionView:
    """An attention viewer: renders inline in Jupyter (``_repr_html_``) and saves as a page.

    Each rendering is one ``<div class="attnlab-viewer" id=uid>`` holding its own style (every
    rule scoped under ``.attnlab-viewer``), data (``<script type="application/json">``) and
    script, which looks up elements only inside that div. Element ids derive from the uid, so
    any number of viewers share a page; ``window.attnlabViewers[uid]`` is each one's state and
    ``window.attnlabViewer`` the last one created. No network: everything is inline.

    Build it with `show`. Attributes: ``data``, the embedded JSON (see `attention_data`).

    Example:
        >>> view = attnlab.show(tokens, out.attentions)   # last line of a notebook cell: shown
        >>> view.save("attention.html")                   # the same viewer as a page
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def __repr__(self) -> str:
        d = self.data
        return (
            f"AttentionView({d['title']!r}, layers={d['layers']}, heads={d['heads']}, "
            f"T={d['T']}, S={d['S']}, mode={d['mode']!r})"
        )

    def fragment(self, uid: str | None = None) -> str:
        """The viewer as an HTML fragment (no ``<html>``/``<body>``) to embed in any page.

        Args:
            uid: the root element's id, ``[A-Za-z][A-Za-z0-9_-]*`` up to 64 characters;
                default a fresh random one, so the same view shown twice stays two viewers.
        """
        if uid is None:
            uid = "attnlab-" + secrets.token_hex(6)
        elif not isinstance(uid, str) or not _UID.fullmatch(uid):
            raise ValueError(
                f"uid must match [A-Za-z][A-Za-z0-9_-]* (at most 64 characters), got {uid!r}"
            )
        parts = {
            "UID": uid,
            "CSS": _asset("attention_view.css"),
            "JS": _asset("attention_view.js"),
            "DATA": _json_for_script(self.data),
        }
        # One pass over the template: text that contains a placeholder name (a title or token
        # "__JS__") is inserted as it is, never substituted again.
        return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("attention_view_fragment.html"))

    def _repr_html_(self) -> str:
        """Jupyter's inline rendering: `fragment` with a fresh uid."""
        return self.fragment()

    def html(self, uid: str | None = None) -> str:
        """A standalone page (a Content-Security-Policy forbids any fetch) with the viewer.

        Args:
            uid: see `fragment`; default derived from the data, so the same input gives the
                same page byte for byte.
        """
        if uid is None:
            digest = hashlib.sha1(_json_for_script(self.data).encode("utf-8")).hexdigest()
            uid = "attnlab-" + digest[:12]
        parts = {"TITLE": html.escape(self.data["title"]), "VIEWER": self.fragment(uid)}
        return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("attention_view.html"))

    def save(self, path: PathLike) -> Path:
        """Writes `html` to ``path`` (UTF-8, parents created); returns it.

        Raises:
            ValueError: ``path`` does not end in ``.html``/``.htm``.
        """
        out = Path(path)
        if out.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"path must end in .html, got {str(out)!r}")
        text = self.html()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        return out


def _looks_like_weights(x: Any) -> bool:
    """A tensor or array, or a sequence holding tensors (transformers' output_attentions)."""
    if isinstance(x, Tensor) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return True
    return isinstance(x, tuple | list) and any(isinstance(t, Tensor) for t in x)


def _looks_like_tokens(x: Any) -> bool:
    """A non-empty list or tuple of str."""
    return isinstance(x, tuple | list) and bool(x) and all(isinstance(t, str) for t in x)


def _described(x: Any) -> str:
    """What a show() argument holds, in a few words, for an error message."""
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, tuple | list) and x:
        kinds = sorted({type(t).__name__ for t in x})
        return f"a {type(x).__name__} of {len(x)} {'/'.join(kinds)}"
    return f"{type(x).__name__} {x!r:.40}"


_ORDERS = (
    "attnlab's order is show(tokens, weights); bertviz's head_view(attention, tokens) order works "
    "by keyword: show(attention=..., tokens=...)"
)


def _show_arguments(
    positional: tuple[Any, ...], tokens: Any, weights: Any, attention: Any
) -> tuple[Any, Any]:
    """``(tokens, weights)`` from `show`'s positional and keyword forms, or a TypeError that
    names the argument, what it expects and what it got, before any work."""
    if len(positional) > 2:
        raise TypeError(
            f"show() takes at most 2 positional arguments (tokens, weights), got {len(positional)}"
        )
    keywords = [n for n, v in (("tokens", tokens), ("weights", weights)) if v is not None]
    keywords += ["attention"] if attention is not None else []
    if len(positional) == 2 and keywords:
        raise TypeError(
            f"show() got tokens and weights positionally and {', '.join(keywords)} by keyword: "
            f"pass each once; {_ORDERS}"
        )
    if len(positional) == 1 and tokens is not None:
        raise TypeError(
            f"show() got one positional argument ({_described(positional[0])}) and tokens= by "
            f"keyword: the first positional argument is tokens; {_ORDERS}"
        )
    if weights is not None and attention is not None:
        raise TypeError(
            "show() got both weights= (attnlab's name) and attention= (bertviz's name) for the "
            "attention weights: pass one"
        )
    if positional:
        tokens = positional[0]
    if len(positional) == 2:
        weights = positional[1]
    name, w = ("attention", attention) if attention is not None else ("weights", weights)
    if _looks_like_weights(tokens):
        swapped = " (tokens and weights swapped?)" if _looks_like_tokens(w) else ""
        raise TypeError(
            f"tokens must be a sequence of T str, got {_described(tokens)}{swapped}; {_ORDERS}"
        )
    if tokens is None:
        raise TypeError(f"show() is missing tokens, the T token strings; {_ORDERS}")
    if w is None:
        raise TypeError(f"show() is missing the attention weights; {_ORDERS}")
    if _looks_like_tokens(w):
        raise TypeError(
            f"{name} must be attention weights ((layers, heads, T, S) or transformers' "
            f"output_attentions tuple), got {_described(w)}; {_ORDERS}"
        )
    return tokens, w


def show(
    *positional: Any,
    tokens: Sequence[str] | None = None,
    weights: Tensor | Sequence[Tensor] | Any = None,
    attention: Tensor | Sequence[Tensor] | Any = None,
    mask: Sequence[bool] | Tensor | None = None,
    key_tokens: Sequence[str] | None = None,
    key_mask: Sequence[bool] | Tensor | None = None,
    batch: int | None = None,
    sentence_b_start: int | None = None,
    title: str | None = None,
    subtitle: str | None = None,
    notes: Sequence[str] = (),
    layer: int = 0,
    head: int = 0,
    topk: int = 8,
    max_tokens: int = MAX_FULL_TOKENS,
    thumb_size: int = 64,
    decimals: int = DEFAULT_DECIMALS,
) -> AttentionView:
    """The attention viewer for a notebook: an `AttentionView` that Jupyter renders inline.

    Head view (one head, or all heads of a layer overlaid, one colour per head with toggles),
    model view (layers × heads thumbnails), per-head entropy and hover details; sentence-pair
    filters (All, A→A, A→B, B→A, B→B) when ``sentence_b_start`` is given; cross-attention
    (queries left, ``key_tokens`` right) when ``L != S``. Entropy per row:
    ``−Σ_j p_ij log p_ij`` nats (its maximum, uniform attention, is ``log S``).

    Called ``show(tokens, weights)`` (positionally, attnlab's order), or by keyword:
    ``show(tokens=..., weights=...)`` or bertviz's names ``show(attention=..., tokens=...)``
    (``head_view(attention, tokens)``'s order). Anything ambiguous raises a TypeError naming the
    argument, what it expects and what it got: tokens where the weights go (or the reverse, the
    bertviz order passed positionally), one positional argument beside ``tokens=``, both
    ``weights=`` and ``attention=``.

    Args:
        *positional: ``tokens, weights`` (at most two; or pass them by keyword).
        tokens: T (query) token strings, shown as text, never interpreted as HTML.
        weights: ``(layers, heads, T, S)`` weights in ``[0, 1]`` (row i = query i), or
            transformers' ``output_attentions`` / ``cross_attentions`` tuple (each
            ``(B, H, T, S)``) as returned, or its stack ``(layers, B, H, T, S)``.
        attention: bertviz's name for ``weights`` (give one of the two).
        mask, key_tokens, key_mask, batch, sentence_b_start, title, subtitle: see `attention_data`.
        notes, layer, head, topk, max_tokens, thumb_size, decimals: see `attention_data`.

    Returns:
        An `AttentionView` (``.save(path)`` writes the standalone page).

    Example:
        >>> from transformers import AutoModel, AutoTokenizer
        >>> tok = AutoTokenizer.from_pretrained(path)
        >>> model = AutoModel.from_pretrained(path, attn_implementation="eager")
        >>> enc = tok("The cat sat.", "It was tired.", return_tensors="pt")
        >>> out = model(**enc, output_attentions=True)
        >>> tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
        >>> b = enc["token_type_ids"][0].tolist().index(1)
        >>> attnlab.show(tokens, out.attentions, sentence_b_start=b)   # renders in the cell
        >>> attnlab.show(attention=out.attentions, tokens=tokens)      # bertviz's names
    """
    tokens, weights = _show_arguments(positional, tokens, weights, attention)
    return AttentionView(
        attention_data(
            tokens,
            weights,
            mask=mask,
            key_tokens=key_tokens,
            key_mask=key_mask,
            batch=batch,
            sentence_b_start=sentence_b_start,
            title=title,
            subtitle=subtitle,
            notes=notes,
            layer=layer,
            head=head,
            topk=topk,
            max_tokens=max_tokens,
            thumb_size=thumb_size,
            decimals=decimals,
        )
    )


def attention_html(
    tokens: Sequence[str], weights: Tensor | Sequence[Tensor] | Any, **options: Any
) -> str:
    """One self-contained HTML page that shows ``weights`` over ``tokens`` (see the module doc).

    ``attention_html(tokens, weights, **options) == show(tokens, weights, **options).html()``.

    Args:
        tokens: T token strings (shown as text; never interpreted as HTML).
        weights: ``(layers, heads, T, S)`` attention weights in ``[0, 1]``, row i = query i
            (``(heads, T, S)`` is one layer), or transformers' ``output_attentions`` tuple.
        **options: the keywords of `show` (title, subtitle, notes, mask, key_tokens, key_mask,
            batch, sentence_b_start, layer, head, topk, max_tokens, thumb_size, decimals).

    Returns:
        The HTML text (UTF-8; no external references).
    """
    return show(tokens, weights, **options).html()


def save_attention_html(
    tokens: Sequence[str], weights: Tensor | Sequence[Tensor] | Any, path: PathLike, **options: Any
) -> Path:
    """Writes `attention_html` ``(tokens, weights, **options)`` to ``path`` (UTF-8); returns it.

    Raises:
        ValueError: ``path`` does not end in ``.html``/``.htm``, or bad inputs (see
            `attention_html`).
    """
    out = Path(path)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path must end in .html, got {str(out)!r}")
    return show(tokens, weights, **options).save(out)


# ----------------------------------------------------------------------------------------- text
def attention_text(
    tokens: Sequence[str],
    weights: Tensor | Any,
    *,
    k: int = 3,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    mask: Sequence[bool] | Tensor | None = None,
    decimals: int = 3,
    key_tokens: Sequence[str] | None = None,
    batch: int | None = None,
) -> str:
    """A terminal report: for every head, each query token's top-``k`` keys with their weights.

    One block per (layer, head), headed ``layer l, head h · entropy x.xxx nats``, then one line
    per real query token: ``query → key₁ w₁   key₂ w₂   key₃ w₃`` (largest first, ties by lower
    key index; weights with ``decimals`` places; keys with weight exactly 0 — masked, e.g. the
    future under a causal mask — are not listed, so early causal rows list fewer).

    Args:
        tokens, weights, mask: see `check_inputs` (weights may be transformers'
            ``output_attentions`` tuple; ``batch`` picks its item).
        k: keys listed per query (at most S).
        layers, heads: which to print (default all).
        decimals: decimal places of the weights.
        key_tokens: S key strings for cross-attention (default: the keys are ``tokens``).
        batch: see `check_inputs`.
    """
    got = check_inputs(tokens, weights, mask, key_tokens=key_tokens, batch=batch)
    tokens, w, m = got.tokens, got.weights, got.mask
    Ly, H, T, S = w.shape
    check_int("k", k, minimum=1)
    chosen = []
    for name, sel, size in (("layers", layers, Ly), ("heads", heads, H)):
        picked = list(range(size)) if sel is None else list(sel)
        bad = [x for x in picked if isinstance(x, bool) or not isinstance(x, int)]
        bad += [x for x in picked if isinstance(x, int) and not 0 <= x < size]
        if bad or not picked:
            raise ValueError(
                f"{name} must be a non-empty list of indices in [0, {size}), got {sel!r}"
            )
        chosen.append(picked)
    values, indices = top_weights(w, min(k, S))  # (layers, heads, T, k)
    rows, entropy = entropies(w, m)  # (layers, heads, T), (layers, heads)
    shown = [_display(t) for t in tokens]
    keys = shown if got.key_tokens is None else [_display(t) for t in got.key_tokens]
    width = min(max(len(s) for s in shown), 16)
    lines: list[str] = []
    for layer in chosen[0]:
        for head in chosen[1]:
            if lines:
                lines.append("")
            lines.append(f"layer {layer}, head {head} · entropy {entropy[layer, head]:.3f} nats")
            for i in range(T):
                if math.isnan(rows[layer, head, i]):  # a masked query
                    continue
                pairs = "   ".join(
                    f"{keys[j]} {v:.{decimals}f}"
                    for v, j in zip(
                        values[layer, head, i].tolist(),
                        indices[layer, head, i].tolist(),
                        strict=True,
                    )
                    if v > 0  # a zero weight is a masked key, not an attended one
                )
                lines.append(f"  {shown[i]:<{width}} → {pairs}")
    return "\n".join(lines)


def _display(token: str) -> str:
    """A token as printed: whitespace made visible, so every token has at least one character."""
    out = token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    return out if out else "∅"


# ------------------------------------------------------------------------------- page template
_PLACEHOLDER = re.compile(r"__(TITLE|VIEWER|UID|CSS|JS|DATA)__")


@functools.cache
def _asset(name: str) -> str:
    """A file of the viewer (``assets/attention_view*.{html,css,js}``, package data) as text."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


__all__ = [
    "AttentionInputs",
    "AttentionView",
    "attention_data",
    "attention_html",
    "attention_text",
    "check_attention",
    "check_inputs",
    "entropies",
    "long_view_data",
    "pooled_thumbnails",
    "save_attention_html",
    "show",
    "top_weights",
]
