"""The mask function registered with transformers' ``AttentionMaskInterface``: HF masks → attnlab.

transformers describes every attention mask by an index function ``mask_function(b, h, q, kv)`` on
absolute positions (query ``q = q_offset + row``, key ``kv = kv_offset + column``), plus a 2-D
padding mask over the keys, and asks the registered mask function to render it. attnlab renders
nothing: `hf_mask` returns an `attnlab.masks.Mask` that the attention function receives and
`attnlab.attention` evaluates tile by tile (no L×S tensor).

The patterns transformers builds are recognised and become attnlab's structured masks, whose
geometry (band, key intervals, tile maps) the tiled backend uses:

=================================================  ===========================================
transformers ``mask_function``                     attnlab mask
=================================================  ===========================================
``causal_mask_function``                           ``causal()``
``bidirectional_mask_function``                    none (every key)
``sliding_window_causal_mask_function(w)``         ``sliding_window(w)``
``sliding_window_bidirectional_mask_function(w)``  ``sliding_window(w + 1, causal=False)``
packed sequences (``position_ids`` restarts)       ``document(ids)`` ``&`` the pattern above
padding (the 2-D ``attention_mask``)               ``from_tensor(valid[:, None, None, :])``
=================================================  ===========================================

Structured masks are bottom-right aligned (query row r sits at key ``r + S − L``); they are used
only when HF's own offsets say the same (``q_offset + L == kv_offset + S``, true for the dynamic
cache and its sliding-window layers). Anything else — a static cache (whose key buffer is longer
than the tokens seen), a custom ``or_mask_function``, chunked attention — evaluates HF's own
function at HF's own offsets, so the answer never changes silently: for one query row (a decoding
step) once, into a ``(B, 1, 1, S)`` key mask (decoding then reads only the attended keys); for
more rows as an exact `attnlab.masks.from_fn` mask evaluated tile by tile.

Padding query rows (left padding) may attend no key: attnlab gives them zero output and zero
weights, where HF's eager path gives a uniform distribution over masked keys. Those rows never
reach a real token (no real query attends a padding key), so every real token's output is equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import masks
from ..functional.decode import DECODE_MAX_L
from ..masks import Mask

_HF_MASKING = "transformers.masking_utils"
_FULL = "full"  # the pattern lets every query see every key


def _hf_name(fn: object) -> str | None:
    """The qualified name of a transformers masking primitive, None for anything else."""
    if getattr(fn, "__module__", None) != _HF_MASKING:
        return None
    return getattr(fn, "__qualname__", None)


def _cells(fn: object) -> dict[str, Any]:
    """The closure variables of a function, by name (empty if it has none)."""
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure, strict=True)}


def _flatten(fn: Callable) -> list[Callable]:
    """The operands of (nested) ``and_masks`` calls; a single function otherwise."""
    if _hf_name(fn) == "and_masks.<locals>.and_mask":
        parts = _cells(fn).get("mask_functions")
        if isinstance(parts, tuple):
            return [p for part in parts for p in _flatten(part)]
    return [fn]


def _window(fn: Callable) -> int | None:
    w = _cells(fn).get("sliding_window")
    return w if isinstance(w, int) and not isinstance(w, bool) and w >= 0 else None


@dataclass
class _Parts:
    """What the recognised operands of one HF mask function say, collected by `_read_part`."""

    causal: bool = False
    full: bool = False
    window: int | None = None
    bi_window: int | None = None
    docs: list[Tensor] = field(default_factory=list)
    remapped: bool = False


def _read_remapped(inner: Mask | str | None, parts: _Parts) -> bool:
    """Adds the pattern inside a packed-sequence remap; False when it is not recognised."""
    parts.remapped = True
    if inner == _FULL:
        parts.full = True
    elif isinstance(inner, masks.CausalMask):
        parts.causal = True
    elif isinstance(inner, masks.SlidingWindowMask) and parts.window is None is parts.bi_window:
        if inner.causal:
            parts.causal, parts.window = True, inner.window
        else:
            parts.full, parts.bi_window = True, inner.window - 1
    else:  # not recognised, or nested packing: HF's own function decides
        return False
    return True


def _read_part(
    part: Callable, parts: _Parts, *, aligned: bool, q_length: int, kv_length: int
) -> bool:
    """Adds one operand of HF's mask function to ``parts``; False when it is not recognised."""
    name = _hf_name(part)
    if name == "causal_mask_function":
        parts.causal = True
    elif name == "bidirectional_mask_function":
        parts.full = True
    elif name == "sliding_window_overlay.<locals>.inner_mask" and parts.window is None:
        parts.window = _window(part)
        return parts.window is not None and parts.window >= 1
    elif (
        name == "sliding_window_bidirectional_overlay.<locals>.inner_mask"
        and parts.bi_window is None
    ):
        parts.bi_window = _window(part)
        return parts.bi_window is not None
    elif name == "packed_sequence_mask_function.<locals>.inner_mask":
        ids = _cells(part).get("packed_sequence_mask")
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[-1] != kv_length:
            return False
        parts.docs.append(ids)
    elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        # Within one packed sequence, positions grow by exactly 1 per token (that is how HF
        # finds the sequences), so the inner pattern on positions equals it on indices.
        inner = _structured(
            _cells(part).get("mask_function"),
            aligned=aligned,
            q_length=q_length,
            kv_length=kv_length,
        )
        return _read_remapped(inner, parts)
    else:
        return False
    return True


def _buildable(parts: _Parts, *, aligned: bool, q_length: int, kv_length: int) -> bool:
    """Whether the parts form a pattern HF builds that attnlab can state at this alignment."""
    if parts.remapped and not parts.docs:
        return False
    if parts.window is not None and not parts.causal:
        return False  # a one-sided overlay alone is not a pattern HF builds
    if parts.bi_window is not None and not parts.full:
        return False
    positional = parts.causal or parts.window is not None or parts.bi_window is not None
    if (positional or parts.docs) and not aligned:
        return False
    return not (parts.docs and q_length != kv_length)


def _combined(parts: _Parts) -> Mask | str:
    """The attnlab mask of the parts (their ``&``), or `_FULL` when nothing restricts."""
    terms: list[Mask] = []
    if parts.window is not None:
        terms.append(masks.sliding_window(parts.window))
    elif parts.causal:
        terms.append(masks.causal())
    if parts.bi_window is not None:
        terms.append(masks.sliding_window(parts.bi_window + 1, causal=False))
    for ids in parts.docs:
        doc = masks.DocumentMask(ids)
        doc.runs_distinct = True  # HF numbers the sequences by a cumulative sum: one run each
        terms.append(doc)
    if not terms:
        return _FULL
    out = terms[0]
    for t in terms[1:]:
        out = out & t
    return out


def _structured(
    mask_function: Callable, *, aligned: bool, q_length: int, kv_length: int
) -> Mask | str | None:
    """The attnlab mask equal to ``mask_function``, `_FULL`, or None (not recognised).

    ``aligned``: HF's query/key offsets match attnlab's bottom-right alignment, so masks that
    depend on the query position may be used.
    """
    parts = _Parts()
    shape = {"aligned": aligned, "q_length": q_length, "kv_length": kv_length}
    for part in _flatten(mask_function):
        if not _read_part(part, parts, **shape):
            return None
    return _combined(parts) if _buildable(parts, **shape) else None


def _key_padding(attention_mask: Tensor, kv_length: int, kv_offset: int) -> Tensor:
    """The keys' validity ``(B, S)`` from HF's 2-D mask over absolute positions (False past it)."""
    valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask.bool()
    missing = kv_offset + kv_length - valid.shape[-1]
    if missing > 0:  # HF pads with False: cache slots past the mask are not tokens
        valid = torch.nn.functional.pad(valid, (0, missing), value=False)
    return valid[:, kv_offset : kv_offset + kv_length]  # (B, S)


def _exact_fn_mask(
    mask_function: Callable,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor,
    kv_offset: int,
) -> Mask:
    """HF's own index function at HF's offsets, as an attnlab mask (any pattern, any cache)."""
    shift = q_offset + q_length - kv_length  # absolute query position = aligned p + shift

    def hf_pattern(b: Tensor, h: Tensor, p: Tensor, j: Tensor) -> Tensor:
        out = mask_function(b, h, p + shift, j + kv_offset)
        out = out if isinstance(out, Tensor) else torch.as_tensor(out, device=p.device)
        return out.to(torch.bool)

    return masks.from_fn(hf_pattern, batch_size=batch_size)


def _one_row(
    mask_function: Callable, batch_size: int, kv_length: int, q_offset: int | Tensor, kv_offset: int
) -> Mask:
    """HF's own index function on the one query row of a decoding step, as a key mask.

    ``keep[b, j] = mask_function(b, 0, q_offset, kv_offset + j)`` evaluated once on broadcast
    index tensors (how transformers' sdpa path evaluates it too): ``(B, 1, 1, S)``, O(B·S). Exact
    for any pattern and any cache (a static cache's tensor ``q_offset`` included), and a mask
    over keys alone, so decoding reads only the attended keys (`Mask.key_mask`).
    """
    where = q_offset.device if isinstance(q_offset, Tensor) else None
    b = torch.arange(batch_size, device=where).view(batch_size, 1)
    j = torch.arange(kv_length, device=where).view(1, kv_length) + kv_offset
    q = torch.as_tensor(q_offset, device=where)
    keep = mask_function(b, torch.zeros((), dtype=torch.long, device=where), q, j)
    keep = torch.as_tensor(keep, device=where).to(torch.bool).expand(batch_size, kv_length)
    return masks.from_tensor(keep.reshape(batch_size, 1, 1, kv_length))


class HFMask:
    """The attnlab mask as transformers carries it from the mask function to the attention call.

    transformers treats what its mask function returns as a 4-D mask: generation with a static
    cache builds it ahead of the forward and calls ``.contiguous()`` on it, and the model passes
    a prepared 4-D mask through unchanged (``.ndim == 4``). This carrier answers those calls
    without rendering anything; `attnlab.hf.attention_forward` unwraps `mask`.

    Attributes:
        mask: the `attnlab.masks.Mask` of the call's S keys (True = may attend, bottom-right
            aligned): exact for every cache, used whenever `used` is not (and while compiling).
        shape: ``(B, 1, L, S)``, the shape transformers' dense mask would have.
        used: None, or ``(n, mask_n)`` for a static cache in eager mode: the call uses only
            its first ``n < S`` keys (the buffer past the last query's position, which a causal
            pattern never attends), whose structured mask is ``mask_n``; the attention function
            then runs on ``key[:, :, :n]`` (a view). Not read while compiling: n changes every
            step, and a compiled static-cache step keeps one graph for the whole buffer.
        step_keys: for a decoding step in eager mode, the keys every row attends (bool
            ``(B|1, n or S)``, `Mask.key_mask` of the mask the call uses), rendered once for
            every layer: the attention function then runs the C++ decode step directly.
    """

    ndim = 4
    dtype = torch.bool

    def __init__(
        self,
        mask: Mask,
        shape: tuple[int, int, int, int],
        device: torch.device,
        used: tuple[int, Mask] | None = None,
    ) -> None:
        self.mask = mask
        self.shape = torch.Size(shape)
        self.device = device
        self.used = used
        self.step_keys: Tensor | None = None

    def dim(self) -> int:
        """4, as for transformers' dense masks."""
        return 4

    def contiguous(self) -> HFMask:
        """Itself (nothing is stored densely)."""
        return self

    def __repr__(self) -> str:
        used = "" if self.used is None else f", used={self.used[0]} keys: {self.used[1]!r}"
        return f"HFMask({self.mask!r}, shape={tuple(self.shape)}{used})"


def hf_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | HFMask | None = None,
    device: torch.device | str | None = "cpu",
    **_kwargs: object,
) -> HFMask | None:
    """transformers' mask interface for ``attn_implementation="attnlab"``: an attnlab `Mask`.

    Called by transformers' ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
    ``create_bidirectional_mask`` (transformers >= 5.4 keywords). Returns the mask the attention
    function receives as ``attention_mask``: True = may attend, for query rows at absolute
    positions ``q_offset + r`` and keys at ``kv_offset + c``, ``c < kv_length``.

    Args:
        batch_size: B.
        q_length: L, the query rows of the attention call.
        kv_length: S, the keys of the attention call (a static cache's whole buffer).
        q_offset: absolute position of query row 0 (an int, or a 0-d tensor for a static cache).
        kv_offset: absolute position of key 0 (> 0 for a full sliding-window cache layer).
        mask_function: HF's index function ``fn(b, h, q, kv)`` (transformers always passes it).
        attention_mask: HF's 2-D padding mask ``(B, >= kv_offset)`` over absolute key positions
            (True/1 = a real token), None, or an `HFMask` this function built ahead of the forward
            (static-cache generation), returned as it is.
        device: where HF builds its masks (the padding mask's device is used when given).
        **_kwargs: the other keywords HF passes (``local_size``, ``dtype``, ``config``,
            ``allow_is_causal_skip``, ``use_vmap``...); they do not change the mask.

    Returns:
        An `HFMask` holding the `attnlab.masks.Mask` (see the module's table), or None when every
        query may attend every key (bidirectional attention without padding).

    Raises:
        TypeError: ``mask_function`` is not callable.
    """
    if isinstance(attention_mask, HFMask):
        return attention_mask
    if not callable(mask_function):
        raise TypeError(
            f"mask_function must be transformers' index function fn(b, h, q, kv), got "
            f"{type(mask_function).__name__}"
        )
    shape = (batch_size, 1, q_length, kv_length)
    where = attention_mask.device if attention_mask is not None else torch.device(device or "cpu")
    aligned = (
        isinstance(q_offset, int)
        and not isinstance(q_offset, bool)
        and q_offset + q_length == kv_offset + kv_length
    )
    pattern = _structured(mask_function, aligned=aligned, q_length=q_length, kv_length=kv_length)
    if pattern is None and q_length == 1:
        pattern = _one_row(mask_function, batch_size, kv_length, q_offset, kv_offset)
    elif pattern is None:
        pattern = _exact_fn_mask(
            mask_function, batch_size, q_length, kv_length, q_offset, kv_offset
        )
    result = _with_padding(pattern, attention_mask, kv_length, kv_offset)
    if result is None:
        return None
    static = _static_prefix(mask_function, q_length, kv_length, q_offset, kv_offset)
    used = None
    if static is not None:
        n, short = static
        used = (n, _with_padding(short, attention_mask, n, kv_offset))
    carrier = HFMask(result, shape, where, used=used)  # type: ignore[arg-type]
    if q_length <= DECODE_MAX_L and not torch.compiler.is_compiling():
        call, n = (result, kv_length) if used is None else (used[1], used[0])
        carrier.step_keys = call.key_mask(q_length, n, device=where)  # type: ignore[union-attr]
    return carrier


def _with_padding(
    pattern: Mask | str, attention_mask: Tensor | None, kv_length: int, kv_offset: int
) -> Mask | None:
    """The pattern ``&`` the keys' padding (a ``(B, 1, 1, S)`` key mask, never L×S); None for
    no restriction at all.

    A padding mask of all ones (every tokenizer call and ``generate`` pass one) is dropped in
    eager mode: one read of the ``(B, S)`` mask per forward, as transformers' own sdpa path reads
    it (``_ignore_causal_mask_sdpa``); the call is then the pattern alone (plain causal: torch's
    fused causal kernel, the segment kernel, the decode step without a key mask). While tracing
    (and on ``meta``) the values are never read.
    """
    result: Mask | None = None if pattern == _FULL else pattern  # type: ignore[assignment]
    if attention_mask is None:
        return result
    valid = _key_padding(attention_mask, kv_length, kv_offset)  # (B, S)
    if not torch.compiler.is_compiling() and not valid.is_meta and bool(valid.all()):
        return result
    keys = masks.from_tensor(valid[:, None, None, :])
    return keys if result is None else result & keys


def _static_prefix(
    mask_function: Callable, q_length: int, kv_length: int, q_offset: int | Tensor, kv_offset: int
) -> tuple[int, Mask] | None:
    """``(n, mask)``: a static cache's call on its first n keys and their mask, or None.

    A static cache passes its whole buffer (S = ``kv_length``) and its position as a 0-d tensor
    ``q_offset``. When HF's pattern is causal (a causal conjunct: no row attends a key past its
    own position), keys past the last query's position ``q_offset + L − 1`` are never attended,
    so the call equals the one on the first ``n = q_offset + L − kv_offset`` keys, whose
    offsets match attnlab's bottom-right alignment: its structured mask (causal, windows) then
    applies, and the unused buffer is never read. The tensor is read in eager mode only, as
    transformers' own mask code reads it; while tracing (and on ``meta``) None keeps the exact
    index-function mask.
    """
    if isinstance(q_offset, Tensor):
        if torch.compiler.is_compiling() or q_offset.is_meta or q_offset.numel() != 1:
            return None
        q_offset = int(q_offset)
    elif not isinstance(q_offset, int) or isinstance(q_offset, bool):
        return None
    n = q_offset + q_length - kv_offset
    if not q_length <= n < kv_length:
        return None
    pattern = _structured(mask_function, aligned=True, q_length=q_length, kv_length=n)
    if not isinstance(pattern, Mask) or not any(
        isinstance(m, masks.CausalMask) or (isinstance(m, masks.SlidingWindowMask) and m.causal)
        for m in pattern.conjuncts()
    ):
        return None
    return n, pattern


__all__ = ["HFMask", "hf_mask"]
