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

import html
import json
import math
import os
from collections.abc import Sequence
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
    page_title = html.escape(data["title"])
    return (
        _PAGE.replace("__TITLE__", page_title)
        .replace("__CSS__", _CSS)
        .replace("__JS__", _JS)
        .replace("__DATA__", _json_for_script(data))
    )


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
_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__CSS__</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <p id="subtitle" class="muted"></p>
  <ul id="notes"></ul>
</header>
<div class="controls">
  <label>Layer <select id="layer-select"></select></label>
  <label>Head <select id="head-select"></select></label>
  <span id="selection-info"></span>
  <span class="muted hint">Hover a token to see its attention · click to pin · Esc to unpin</span>
</div>
<main>
  <section id="head-panel" class="panel">
    <h2>Head view</h2>
    <p class="muted legend" id="head-legend"></p>
    <div class="scroll"><svg id="head-view"></svg></div>
  </section>
  <section id="side">
    <div id="details" class="panel"></div>
    <div class="panel">
      <h2>Model view</h2>
      <p class="muted legend" id="model-legend"></p>
      <div id="model-view"></div>
    </div>
    <div class="panel">
      <h2>Entropy per head (nats)</h2>
      <p class="muted legend" id="entropy-legend"></p>
      <table id="entropy-table"></table>
    </div>
  </section>
</main>
<script type="application/json" id="attn-data">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""

_CSS = """
:root { --fg: #1d2330; --muted: #5f6b7a; --line: #d8dde5; --bg: #f6f7f9; --accent: #1f6feb; }
* { box-sizing: border-box; }
body { margin: 0; padding: 16px 24px; font: 14px/1.4 system-ui, -apple-system, "Segoe UI",
  Roboto, "Helvetica Neue", Arial, sans-serif; color: var(--fg); background: var(--bg); }
h1 { font-size: 20px; margin: 0 0 2px; }
h2 { font-size: 15px; margin: 0 0 6px; }
.muted { color: var(--muted); }
header p { margin: 0 0 6px; }
#notes { margin: 6px 0; padding: 0; list-style: none; }
#notes li { background: #fff7e0; border: 1px solid #f0d68a; border-radius: 6px; padding: 6px 10px;
  margin: 4px 0; max-width: 1100px; }
.controls { display: flex; gap: 16px; align-items: center; flex-wrap: wrap; margin: 10px 0; }
.controls select { font: inherit; padding: 2px 6px; }
#selection-info { font-weight: 600; }
.hint { font-size: 12px; }
main { display: flex; gap: 16px; align-items: flex-start; flex-wrap: wrap; }
.panel { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px; }
#head-panel { flex: 0 0 auto; width: 530px; }
#head-panel .scroll { max-height: 80vh; overflow: auto; }
#side { flex: 1 1 560px; display: flex; flex-direction: column; gap: 16px; min-width: 0; }
.legend { font-size: 12px; margin: 0 0 8px; max-width: 760px; }
svg text { font: 13px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  dominant-baseline: middle; cursor: pointer; user-select: none; }
.tok rect { fill: var(--accent); }
.tok.pinned text { font-weight: 700; }
.tok.focus rect { fill: #ffd54a; }
.tok.dim text { fill: #9aa3ae; }
#details { min-height: 150px; display: flex; gap: 16px; align-items: flex-start; }
#details .info { flex: 1 1 auto; min-width: 0; }
.matrix-wrap { position: relative; width: 180px; height: 180px; flex: 0 0 auto;
  border: 1px solid var(--line); }
#details canvas { width: 100%; height: 100%; display: block; image-rendering: pixelated; }
#matrix-focus { position: absolute; display: none; pointer-events: none;
  outline: 2px solid #f0a500; background: rgba(255, 213, 74, 0.18); }
.bars { margin: 6px 0 0; padding: 0; list-style: none; }
.bars li { display: flex; align-items: center; gap: 8px; margin: 2px 0;
  font: 13px ui-monospace, Menlo, Consolas, monospace; }
.bars .k { width: 120px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap;
  text-align: right; }
.bars .bar { height: 10px; background: var(--accent); border-radius: 2px; }
.bars .v { color: var(--muted); }
.bars .n { color: var(--muted); font-size: 11px; }
#model-view { display: grid; gap: 4px; align-items: center; justify-items: center;
  justify-content: start; overflow-x: auto; }
#model-view .lab { font-size: 11px; color: var(--muted); }
.thumb { padding: 0; border: 2px solid transparent; border-radius: 4px; background: none;
  cursor: pointer; line-height: 0; }
.thumb:hover { border-color: #9fc3ff; }
.thumb.selected { border-color: var(--accent); }
.thumb canvas { width: 48px; height: 48px; image-rendering: pixelated; border: 1px solid #e3e6ea; }
#entropy-table { border-collapse: collapse; font-size: 12px; }
#entropy-table th { font-weight: 500; color: var(--muted); padding: 2px 4px; }
#entropy-table td { padding: 3px 6px; text-align: right; cursor: pointer; border: 1px solid #fff;
  font-variant-numeric: tabular-nums; }
#entropy-table td.selected { outline: 2px solid var(--accent); outline-offset: -2px; }
"""

_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("attn-data").textContent);
  const T = D.T, ROW = 20, PAD = 12, LEFT_X = 150, RIGHT_X = 330, WIDTH = 480;
  const SVGNS = "http://www.w3.org/2000/svg";
  const state = { layer: D.selected[0], head: D.selected[1], pinned: null, hover: null };
  const $ = (id) => document.getElementById(id);
  const shown = D.tokens.map((t) => {
    const s = t.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
    return s.length ? s : "\u2205";
  });
  const short = (s) => (s.length > 16 ? s.slice(0, 15) + "\u2026" : s);
  const fmt = (w) => w.toFixed(Math.min(D.decimals, 3));
  const headColor = (h) => "hsl(" + Math.round((h * 360) / Math.max(D.heads, 1) + 210) % 360 +
    ", 70%, 42%)";

  // Sparse row of one head: [[key, weight], ...] (every weight in full mode, top-k otherwise).
  function row(l, h, i) {
    if (D.mode === "full") {
      const r = D.weights[l][h][i], out = [];
      for (let j = 0; j < r.length; j++) if (r[j] > 0) out.push([j, r[j]]);
      return out;
    }
    const idx = D.top_idx[l][h][i], val = D.top_val[l][h][i];
    return idx.map((j, n) => [j, val[n]]);
  }
  function column(l, h, j) {
    const out = [];
    for (let i = 0; i < T; i++) {
      if (!D.mask[i]) continue;
      for (const [k, w] of row(l, h, i)) if (k === j) out.push([i, w]);
    }
    return out;
  }
  function matrix(l, h) {  // {n, values (n*n, in [0, 1])}
    if (D.mode === "full") return { n: T, values: D.weights[l][h].flat() };
    return { n: D.thumb_size, values: D.thumbs[l][h].map((v) => v / 255) };
  }
  function paint(canvas, l, h) {
    const m = matrix(l, h), n = m.n;
    canvas.width = n; canvas.height = n;
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(n, n);
    let max = 0;
    for (const v of m.values) if (v > max) max = v;
    for (let p = 0; p < n * n; p++) {
      const t = max > 0 ? Math.sqrt(m.values[p] / max) : 0;  // sqrt: small weights stay visible
      img.data[4 * p] = Math.round(255 - t * (255 - 16));
      img.data[4 * p + 1] = Math.round(255 - t * (255 - 72));
      img.data[4 * p + 2] = Math.round(255 - t * (255 - 160));
      img.data[4 * p + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  // ---------------------------------------------------------------- static parts
  $("title").textContent = D.title;
  $("subtitle").textContent = D.subtitle;
  document.title = D.title;
  for (const note of D.notes) {
    const li = document.createElement("li");
    li.textContent = note;
    $("notes").appendChild(li);
  }
  for (const [id, n, name] of [["layer-select", D.layers, "layer"], ["head-select", D.heads,
                                                                       "head"]]) {
    const sel = $(id);
    for (let x = 0; x < n; x++) {
      const o = document.createElement("option");
      o.value = String(x); o.textContent = name + " " + x;
      sel.appendChild(o);
    }
    sel.addEventListener("change", () => {
      select(Number($("layer-select").value), Number($("head-select").value));
    });
  }
  $("head-legend").textContent = "Left: queries, right: keys. A line's opacity is the weight " +
    "(lines below " + D.min_line + " omitted)" +
    (D.mode === "topk" ? "; only each token's top " + D.topk + " weights are drawn." : ".");
  $("model-legend").textContent = "Rows are layers, columns heads; click a thumbnail to select " +
    "it. Each thumbnail is scaled to its own maximum" + (D.mode === "topk" ?
    " and max-pooled to " + D.thumb_size + "\u00d7" + D.thumb_size + " pixels." : ".");
  const maxEnt = Math.log(Math.max(2, D.mask.filter(Boolean).length));
  $("entropy-legend").textContent = "Mean over query rows of \u2212\u03a3 p log p (masked rows " +
    "skipped). 0 = every token attends to one key; log T = " + maxEnt.toFixed(2) +
    " = uniform over all " + D.mask.filter(Boolean).length + " tokens. Click a cell to select.";

  // Head view: two token columns and a layer of lines between them.
  const svg = $("head-view");
  const height = 2 * PAD + ROW * T + 16;
  svg.setAttribute("width", WIDTH); svg.setAttribute("height", height);
  svg.setAttribute("viewBox", "0 0 " + WIDTH + " " + height);
  const y = (i) => PAD + 16 + ROW * i + ROW / 2;
  for (const [x, anchor, label] of [[LEFT_X, "end", "query"], [RIGHT_X, "start", "key"]]) {
    const t = document.createElementNS(SVGNS, "text");
    t.setAttribute("x", x); t.setAttribute("y", PAD); t.setAttribute("text-anchor", anchor);
    t.setAttribute("fill", "#5f6b7a"); t.style.cursor = "default";
    t.textContent = label;
    svg.appendChild(t);
  }
  const lines = document.createElementNS(SVGNS, "g");
  lines.setAttribute("id", "lines");
  svg.appendChild(lines);
  const qTok = [], kTok = [];
  for (const side of ["q", "k"]) {
    for (let i = 0; i < T; i++) {
      const g = document.createElementNS(SVGNS, "g");
      g.setAttribute("class", "tok " + side);
      g.setAttribute("data-i", i);
      const rect = document.createElementNS(SVGNS, "rect");
      const w = 136;
      rect.setAttribute("x", side === "q" ? LEFT_X - w : RIGHT_X - 4);
      rect.setAttribute("y", y(i) - ROW / 2 + 1);
      rect.setAttribute("width", w + 4); rect.setAttribute("height", ROW - 2);
      rect.setAttribute("rx", 3);
      const t = document.createElementNS(SVGNS, "text");
      t.setAttribute("x", side === "q" ? LEFT_X - 2 : RIGHT_X);
      t.setAttribute("y", y(i));
      t.setAttribute("text-anchor", side === "q" ? "end" : "start");
      t.textContent = short(shown[i]);
      const tip = document.createElementNS(SVGNS, "title");
      tip.textContent = shown[i] + " (#" + i + ")";
      g.append(rect, t, tip);
      if (!D.mask[i]) g.classList.add("dim");
      g.addEventListener("mouseenter", () => { state.hover = { side: side, i: i }; render(); });
      g.addEventListener("mouseleave", () => { state.hover = null; render(); });
      g.addEventListener("click", () => {
        const same = state.pinned && state.pinned.side === side && state.pinned.i === i;
        state.pinned = same ? null : { side: side, i: i };
        render();
      });
      svg.appendChild(g);
      (side === "q" ? qTok : kTok).push(g);
    }
  }
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") { state.pinned = null; render(); }
  });

  // Model view and entropy table.
  const mv = $("model-view");
  mv.style.gridTemplateColumns = "auto repeat(" + D.heads + ", auto)";
  mv.appendChild(document.createElement("span"));
  for (let h = 0; h < D.heads; h++) {
    const s = document.createElement("span");
    s.className = "lab"; s.textContent = "H" + h;
    mv.appendChild(s);
  }
  const thumbs = [];
  for (let l = 0; l < D.layers; l++) {
    const s = document.createElement("span");
    s.className = "lab"; s.textContent = "L" + l;
    mv.appendChild(s);
    thumbs.push([]);
    for (let h = 0; h < D.heads; h++) {
      const b = document.createElement("button");
      b.className = "thumb"; b.type = "button";
      b.setAttribute("data-layer", l); b.setAttribute("data-head", h);
      const e = D.entropy[l][h];
      b.title = "layer " + l + ", head " + h + (e === null ? "" : " \u00b7 entropy " +
        e.toFixed(3) + " nats");
      const c = document.createElement("canvas");
      paint(c, l, h);
      b.appendChild(c);
      b.addEventListener("click", () => select(l, h));
      mv.appendChild(b);
      thumbs[l].push(b);
    }
  }
  const table = $("entropy-table"), cells = [];
  const headRow = table.insertRow();
  headRow.appendChild(document.createElement("th"));
  for (let h = 0; h < D.heads; h++) {
    const th = document.createElement("th");
    th.textContent = "H" + h;
    headRow.appendChild(th);
  }
  for (let l = 0; l < D.layers; l++) {
    const tr = table.insertRow();
    const th = document.createElement("th");
    th.textContent = "L" + l;
    tr.appendChild(th);
    cells.push([]);
    for (let h = 0; h < D.heads; h++) {
      const td = tr.insertCell(), e = D.entropy[l][h];
      td.setAttribute("data-layer", l); td.setAttribute("data-head", h);
      td.textContent = e === null ? "\u2013" : e.toFixed(2);
      td.title = e === null ? "no valid rows" : e.toFixed(D.decimals) + " nats";
      const t = e === null ? 0 : Math.min(1, e / maxEnt);  // light = diffuse, dark = focused
      td.style.background = "hsl(215, 70%, " + Math.round(40 + 55 * t) + "%)";
      td.style.color = t < 0.45 ? "#fff" : "#1d2330";
      td.addEventListener("click", () => select(l, h));
      cells[l].push(td);
    }
  }

  // ---------------------------------------------------------------- dynamic parts
  function select(l, h) {
    state.layer = l; state.head = h;
    render();
  }
  function focus() { return state.hover || state.pinned; }

  function render() {
    const l = state.layer, h = state.head, f = focus(), color = headColor(h);
    $("layer-select").value = String(l); $("head-select").value = String(h);
    svg.setAttribute("data-layer", l); svg.setAttribute("data-head", h);
    svg.setAttribute("data-token", state.pinned && state.pinned.side === "q" ? state.pinned.i : -1);
    svg.setAttribute("data-key", state.pinned && state.pinned.side === "k" ? state.pinned.i : -1);
    svg.setAttribute("data-focus", f ? f.side + f.i : "");
    const e = D.entropy[l][h];
    $("selection-info").textContent = "Layer " + l + ", head " + h + " \u00b7 entropy " +
      (e === null ? "\u2013" : e.toFixed(3) + " nats");
    // Lines: all queries, or only the focused query (its row) / key (its column).
    const frag = document.createDocumentFragment();
    let pairs = [];
    if (f && f.side === "q") pairs = row(l, h, f.i).map(([j, w]) => [f.i, j, w]);
    else if (f && f.side === "k") pairs = column(l, h, f.i).map(([i, w]) => [i, f.i, w]);
    else {
      for (let i = 0; i < T; i++) {
        if (D.mask[i]) for (const [j, w] of row(l, h, i)) pairs.push([i, j, w]);
      }
    }
    pairs = pairs.filter((p) => p[2] >= D.min_line && D.mask[p[0]]);
    const strong = f ? 1 : 0.85;
    for (const [i, j, w] of pairs) {
      const ln = document.createElementNS(SVGNS, "line");
      ln.setAttribute("x1", LEFT_X + 4); ln.setAttribute("y1", y(i));
      ln.setAttribute("x2", RIGHT_X - 8); ln.setAttribute("y2", y(j));
      ln.setAttribute("stroke", color);
      ln.setAttribute("stroke-opacity", (strong * Math.min(1, w)).toFixed(4));
      ln.setAttribute("stroke-width", (1 + 3 * w).toFixed(2));
      ln.setAttribute("data-q", i); ln.setAttribute("data-k", j); ln.setAttribute("data-w", w);
      frag.appendChild(ln);
    }
    lines.replaceChildren(frag);
    svg.setAttribute("data-lines", pairs.length);
    // Token shading: the focused token in yellow, the other side by weight.
    const shade = new Map();
    for (const [i, j, w] of pairs) shade.set(f && f.side === "k" ? i : j, w);
    for (let i = 0; i < T; i++) {
      for (const [side, g] of [["q", qTok[i]], ["k", kTok[i]]]) {
        const isFocus = f && f.side === side && f.i === i;
        g.classList.toggle("focus", !!isFocus);
        g.classList.toggle("pinned", !!(state.pinned && state.pinned.side === side &&
                                        state.pinned.i === i));
        const other = f && f.side !== side;
        const r = g.firstChild;
        r.style.fillOpacity = isFocus ? "0.9" : other ? (0.6 * (shade.get(i) || 0)).toFixed(3)
          : "0";
        r.style.fill = isFocus ? "" : color;
      }
    }
    for (let a = 0; a < D.layers; a++) {
      for (let b = 0; b < D.heads; b++) {
        const on = a === l && b === h;
        thumbs[a][b].classList.toggle("selected", on);
        cells[a][b].classList.toggle("selected", on);
      }
    }
    renderDetails(l, h, f);
  }

  const big = document.createElement("canvas");
  big.id = "head-matrix";
  const wrap = document.createElement("div");
  wrap.className = "matrix-wrap";
  const band = document.createElement("div");
  band.id = "matrix-focus";
  wrap.append(big, band);
  const info = document.createElement("div");
  info.className = "info";
  $("details").append(wrap, info);
  let painted = "";

  function renderDetails(l, h, f) {
    if (painted !== l + "," + h) { paint(big, l, h); painted = l + "," + h; }
    // Outline the focused token's row (query) or column (key) on the matrix.
    band.style.display = f ? "block" : "none";
    if (f) {
      const a = (100 * f.i) / T + "%", b = 100 / T + "%";
      Object.assign(band.style, f.side === "q" ? { top: a, height: b, left: "0", width: "100%" }
        : { left: a, width: b, top: "0", height: "100%" });
    }
    big.title = "layer " + l + ", head " + h + ": rows are queries, columns keys";
    info.replaceChildren();
    const head = document.createElement("h2");
    info.appendChild(head);
    const p = document.createElement("p");
    p.className = "muted";
    info.appendChild(p);
    if (!f) {
      head.textContent = "Layer " + l + ", head " + h;
      p.textContent = "Hover over a token (left: as a query, right: as a key) to see its " +
        "strongest weights here. The square is this head's attention matrix (rows: queries).";
      return;
    }
    let items;
    if (f.side === "q") {
      head.textContent = "\u201c" + shown[f.i] + "\u201d (#" + f.i + ") attends to";
      const re = D.row_entropy[l][h][f.i];
      p.textContent = "layer " + l + ", head " + h + (re === null ? " \u00b7 masked row" :
        " \u00b7 row entropy " + re.toFixed(3) + " nats") +
        (D.mode === "topk" ? " \u00b7 top " + D.topk + " stored" : "");
      items = row(l, h, f.i);
    } else {
      head.textContent = "Attention to \u201c" + shown[f.i] + "\u201d (#" + f.i + ") from";
      p.textContent = "layer " + l + ", head " + h;
      items = column(l, h, f.i);
    }
    items.sort((a, b) => b[1] - a[1] || a[0] - b[0]);
    const ul = document.createElement("ul");
    ul.className = "bars"; ul.id = "top-weights";
    for (const [j, w] of items.slice(0, 8)) {
      const li = document.createElement("li");
      li.setAttribute("data-index", j); li.setAttribute("data-w", w);
      const k = document.createElement("span");
      k.className = "k"; k.textContent = shown[j];
      const n = document.createElement("span");
      n.className = "n"; n.textContent = "#" + j;
      k.append(" ", n);
      const bar = document.createElement("span");
      bar.className = "bar"; bar.style.width = Math.max(1, Math.round(200 * w)) + "px";
      bar.style.background = headColor(h);
      const v = document.createElement("span");
      v.className = "v"; v.textContent = fmt(w);
      li.append(k, bar, v);
      ul.appendChild(li);
    }
    info.appendChild(ul);
  }

  window.attnlabViewer = { data: D, state: state, select: select, render: render };
  render();
  document.body.setAttribute("data-ready", "1");
})();
"""

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
