"""A self-contained HTML attention viewer, per-head entropy, and a plain-text top-k report.

`attention_html` turns ``(tokens, weights)`` — T token strings and attention weights
``(layers, heads, T, T)`` (row i = query token i, column j = key token j) — into ONE HTML file
with every script, style and datum inline (no network: a Content-Security-Policy forbids any
fetch). The page has:

- a head view: pick a layer and a head; a line joins each query token (left) to each key token
  (right) it attends to, its opacity and width growing with the weight;
- a model view: a grid of layers × heads thumbnails; clicking one selects that head;
- per-head entropy: ``mean over query rows i of −Σ_j p_ij log p_ij`` in nats, skipping masked
  (and all-zero) rows (`attnlab.analysis.entropy`, see `entropies`);
- hover details: hovering a token highlights its attention and lists its top weights; clicking
  pins it (Esc unpins).

The data sits in ``<script type="application/json" id="attn-data">`` (see `attention_data` for its
fields; weights are rounded to ``decimals`` places, by default 4). Inputs up to ``max_tokens``
tokens embed every weight. Longer inputs stay responsive: each query row keeps only its ``topk``
largest weights (what the head view draws and the hover lists), thumbnails are max-pooled to at
most ``thumb_size`` × ``thumb_size`` pixels, and the page says so.

Example:
    >>> tokens = ["[CLS]", "the", "cat", "[SEP]"]
    >>> w = torch.softmax(torch.randn(2, 4, 4, 4), dim=-1)      # (layers, heads, T, T)
    >>> save_attention_html(tokens, w, "attention.html", title="toy")
    PosixPath('attention.html')
    >>> print(attention_text(tokens, w, k=2, layers=[0], heads=[0]))
"""

from __future__ import annotations

import functools
import html
import json
import math
import os
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

PathLike = str | os.PathLike[str]

DEFAULT_DECIMALS = 4
MIN_LINE_WEIGHT = 0.005  # the head view omits lines below this weight (said on the page)
MAX_FULL_TOKENS = 64  # longer inputs keep only each row's top-k weights


# ------------------------------------------------------------------------------------ checking
def check_attention(
    tokens: Sequence[str], weights: Tensor | Any, mask: Sequence[bool] | Tensor | None = None
) -> tuple[list[str], Tensor, Tensor]:
    """Validates ``(tokens, weights, mask)``; returns them as ``(list, float64 tensor, bool)``.

    Args:
        tokens: T strings.
        weights: ``(layers, heads, T, T)`` (or ``(heads, T, T)``, taken as one layer), finite
            and in ``[0, 1]``; a tensor or anything `torch.as_tensor` accepts.
        mask: None (every token is real) or T booleans, True = real token. Query rows of
            masked tokens are left out of entropies, reports and the viewer's lines.

    Returns:
        ``(tokens, weights (layers, heads, T, T) float64 on CPU, mask (T,) bool)``.

    Raises:
        TypeError: tokens not a sequence of str, weights not numeric, or mask not boolean.
        ValueError: wrong rank or sizes (named with the shapes), non-finite values or values
            outside ``[0, 1]``, or no heads/layers at all.
    """
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a sequence of str, got {type(tokens).__name__}")
    bad = [i for i, t in enumerate(tokens) if not isinstance(t, str)]
    if bad:
        raise TypeError(
            f"tokens must be a sequence of str, got {type(tokens[bad[0]]).__name__} at "
            f"index {bad[0]}"
        )
    try:
        w = weights.detach() if isinstance(weights, Tensor) else torch.as_tensor(weights)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"weights must be a tensor or array of numbers, got {e}") from None
    if w.is_complex() or w.dtype == torch.bool:
        raise TypeError(f"weights must hold real numbers, got dtype {w.dtype}")
    if w.dim() == 3:
        w = w.unsqueeze(0)  # (1, H, T, T)
    if w.dim() != 4:
        raise ValueError(
            f"weights must be (layers, heads, T, T) or (heads, T, T), got shape {tuple(w.shape)}"
        )
    T = len(tokens)
    if tuple(w.shape[-2:]) != (T, T):
        raise ValueError(
            f"weights must end in (T, T) = ({T}, {T}) for {T} tokens, got shape {tuple(w.shape)}"
        )
    if T == 0 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(
            f"need at least one token, layer and head, got {T} tokens and weights of shape "
            f"{tuple(w.shape)}"
        )
    w = w.to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weights must be finite, got NaN or inf")
    lo, hi = float(w.min()), float(w.max())
    if lo < 0.0 or hi > 1.0 + 1e-6:
        raise ValueError(f"weights must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}]")
    if mask is None:
        m = torch.ones(T, dtype=torch.bool)
    else:
        m = mask.detach().cpu() if isinstance(mask, Tensor) else torch.as_tensor(list(mask))
        if m.dtype != torch.bool:
            raise TypeError(f"mask must be booleans (True = real token), got dtype {m.dtype}")
        if tuple(m.shape) != (T,):
            raise ValueError(f"mask must have shape ({T},), one per token, got {tuple(m.shape)}")
    return list(tokens), w, m


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
    from ..analysis.weights import entropy

    rows = entropy(weights.to(torch.float64))  # (layers, heads, T), NaN where fully masked
    if mask is not None:
        rows = torch.where(mask.to(rows.device), rows, torch.nan)
    return rows, rows.nanmean(dim=-1)


def top_weights(weights: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest weights of every row, largest first; ties keep the lower key index.

    Args:
        weights: ``(..., T, S)``. k: how many (at most S).

    Returns:
        ``(values, indices)``, each ``(..., T, k)``.
    """
    values, indices = torch.sort(weights, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def pooled_thumbnails(weights: Tensor, size: int) -> Tensor:
    """Thumbnails of at most ``size × size`` pixels: each pixel is the largest weight in its block.

    Max-pooling (not averaging) keeps a sharp single-token attention visible after shrinking.

    Args:
        weights: ``(layers, heads, T, T)``. size: the largest side in pixels.

    Returns:
        ``(layers, heads, n, n)`` with ``n = min(T, size)``, in the weights' dtype.
    """
    Ly, H, T, _ = weights.shape
    n = min(T, size)
    if n == T:
        return weights.clone()
    flat = weights.reshape(Ly * H, 1, T, T)  # (layers·heads, 1, T, T)
    pooled = torch.nn.functional.adaptive_max_pool2d(flat, n)  # (layers·heads, 1, n, n)
    return pooled.reshape(Ly, H, n, n)


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
    weights: Tensor | Any,
    *,
    mask: Sequence[bool] | Tensor | None = None,
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
    """The JSON document that `attention_html` embeds (``id="attn-data"``).

    Fields:
        ``tokens`` (T strings), ``mask`` (T bools), ``layers``, ``heads``, ``T``;
        ``mode``: ``"full"`` when ``T <= max_tokens``, else ``"topk"``;
        ``weights``: full mode, ``(layers, heads, T, T)`` nested lists, each weight rounded to
            ``decimals`` places (``round(w, decimals)`` in float64); None in top-k mode;
        ``topk``, ``top_idx``, ``top_val``: top-k mode, each row's ``k = min(topk, T)`` largest
            weights (largest first, ties by lower index) and their key indices,
            ``(layers, heads, T, k)``; None in full mode;
        ``thumb_size``, ``thumbs``: top-k mode, max-pooled thumbnails as integers
            ``round(255 · w)``, ``(layers, heads, n·n)`` row-major with ``n = min(T, thumb_size)``;
        ``entropy``: per-head entropy in nats (`entropies`), ``(layers, heads)`` rounded to
            ``decimals`` (null for a head without valid rows);
        ``row_entropy``: ``(layers, heads, T)`` rounded, null for rows that are not valid;
        ``min_line``: lines below this weight are not drawn; ``selected``: ``[layer, head]``;
        ``title``, ``subtitle``, ``notes`` (strings shown on the page), ``decimals``.

    Args:
        tokens, weights, mask: see `check_attention`.
        title, subtitle: page heading and the line under it.
        notes: extra remarks shown on the page (e.g. "input truncated to 256 tokens").
        layer, head: the head selected when the page opens.
        topk: weights kept per query row for long inputs (>= 1).
        max_tokens: the longest input that embeds every weight.
        thumb_size: the largest thumbnail side in pixels for long inputs.
        decimals: decimal places of embedded weights and entropies (1 to 8).
    """
    tokens, w, m = check_attention(tokens, weights, mask)
    Ly, H, T, _ = w.shape
    for name, value, lowest in (
        ("topk", topk, 1),
        ("max_tokens", max_tokens, 1),
        ("thumb_size", thumb_size, 4),
        ("decimals", decimals, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
    if decimals > 8:
        raise ValueError(f"decimals must be in [1, 8], got {decimals}")
    for name, value, size in (("layer", layer, Ly), ("head", head, H)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            raise ValueError(f"{name} must be an int in [0, {size}), got {value!r}")
    rows, entropy = entropies(w, m)  # (layers, heads, T), (layers, heads)
    data: dict[str, Any] = {
        "version": 1,
        "title": title or "Attention",
        "subtitle": subtitle or "",
        "tokens": tokens,
        "mask": m.tolist(),
        "layers": Ly,
        "heads": H,
        "T": T,
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
        "thumbs": None,
    }
    if len(tokens) <= max_tokens:
        data["weights"] = _rounded(w, decimals)
        return data
    k = min(topk, T)
    values, indices = top_weights(w, k)  # (layers, heads, T, k) each
    thumbs = pooled_thumbnails(w, thumb_size)  # (layers, heads, n, n)
    n = thumbs.shape[-1]
    data.update(
        mode="topk",
        topk=k,
        top_idx=indices.tolist(),
        top_val=_rounded(values, decimals),
        thumb_size=n,
        thumbs=torch.round(thumbs * 255).to(torch.int64).reshape(Ly, H, n * n).tolist(),
    )
    data["notes"].insert(
        0,
        f"Long input ({T} tokens > {max_tokens}): the head view draws and the hover lists only "
        f"each token's top {k} weights, which is all the page stores; the thumbnails are "
        f"max-pooled to {n}×{n} pixels.",
    )
    return data


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
def attention_html(
    tokens: Sequence[str],
    weights: Tensor | Any,
    *,
    title: str | None = None,
    subtitle: str | None = None,
    notes: Sequence[str] = (),
    mask: Sequence[bool] | Tensor | None = None,
    layer: int = 0,
    head: int = 0,
    topk: int = 8,
    max_tokens: int = MAX_FULL_TOKENS,
    thumb_size: int = 64,
    decimals: int = DEFAULT_DECIMALS,
) -> str:
    """One self-contained HTML page that shows ``weights`` over ``tokens`` (see the module doc).

    Args:
        tokens: T token strings (shown as text; never interpreted as HTML).
        weights: ``(layers, heads, T, T)`` attention weights in ``[0, 1]``, row i = query i
            (``(heads, T, T)`` is one layer).
        title: page title (default "Attention"). subtitle: a line under it (e.g. the model).
        notes: remarks shown in a box on the page.
        mask: None or T bools (True = real token).
        layer, head: the head selected when the page opens.
        topk, max_tokens, thumb_size: long-input limits, see `attention_data`.
        decimals: decimal places of the embedded weights (default 4).

    Returns:
        The HTML text (UTF-8; no external references).
    """
    data = attention_data(
        tokens,
        weights,
        mask=mask,
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
    parts = {
        "TITLE": html.escape(data["title"]),
        "CSS": _asset("attention_view.css"),
        "JS": _asset("attention_view.js"),
        "DATA": _json_for_script(data),
    }
    # One pass over the template: text that contains a placeholder name (a title or token
    # "__JS__") is inserted as it is, never substituted again.
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("attention_view.html"))


def save_attention_html(
    tokens: Sequence[str], weights: Tensor | Any, path: PathLike, **kwargs: Any
) -> Path:
    """Writes `attention_html` ``(tokens, weights, **kwargs)`` to ``path`` (UTF-8); returns it.

    Raises:
        ValueError: ``path`` does not end in ``.html``/``.htm``, or bad inputs (see
            `attention_html`).
    """
    out = Path(path)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path must end in .html, got {str(out)!r}")
    text = attention_html(tokens, weights, **kwargs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


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
) -> str:
    """A terminal report: for every head, each query token's top-``k`` keys with their weights.

    One block per (layer, head), headed ``layer l, head h · entropy x.xxx nats``, then one line
    per real query token: ``query → key₁ w₁   key₂ w₂   key₃ w₃`` (largest first, ties by lower
    key index; weights with ``decimals`` places; keys with weight exactly 0 — masked, e.g. the
    future under a causal mask — are not listed, so early causal rows list fewer).

    Args:
        tokens, weights, mask: see `check_attention`.
        k: keys listed per query (at most T).
        layers, heads: which to print (default all).
        decimals: decimal places of the weights.
    """
    tokens, w, m = check_attention(tokens, weights, mask)
    Ly, H, T, _ = w.shape
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
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
    values, indices = top_weights(w, min(k, T))  # (layers, heads, T, k)
    rows, entropy = entropies(w, m)  # (layers, heads, T), (layers, heads)
    shown = [_display(t) for t in tokens]
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
                    f"{shown[j]} {v:.{decimals}f}"
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
_PLACEHOLDER = re.compile(r"__(TITLE|CSS|JS|DATA)__")


@functools.cache
def _asset(name: str) -> str:
    """A file of the viewer (``assets/attention_view.{html,css,js}``, package data) as text."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


__all__ = [
    "attention_data",
    "attention_html",
    "attention_text",
    "check_attention",
    "entropies",
    "pooled_thumbnails",
    "save_attention_html",
    "top_weights",
]
