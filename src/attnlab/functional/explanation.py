"""`Explanation`: what `attnlab.explain` returns — which backend runs a call, why, and on what.

``print(attnlab.explain(q, k, v, mask=...))`` shows a few labelled lines; the same facts are
fields (``.backend``, ``.reason``, ``.plan``, ``.engines``, ...) for code that tests them.

Example:
    >>> e = attnlab.explain(q, q, q, mask=masks.causal())  # doctest: +SKIP
    >>> e.backend  # doctest: +SKIP
    'flash'
    >>> print(e)  # doctest: +SKIP
    backend: flash (float32; q (1, 4, 512, 64), k (1, 4, 512, 64), v (1, 4, 512, 64); mask causal())
    why: auto picked 'flash': the fastest backend that supports the call (...)
    plan: causal plan, 1 engine call(s)
    engines: forward: one call on attnlab's C++ band kernel (AVX-512, float32 products), ...
    kernels: attnlab's C++ kernels (AVX-512 path): band_attn and flash_rule loaded
    thresholds: auto's float32 thresholds (L·S: band 65536, ...) are built-in defaults (...)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Explanation:
    """Which backend ``attention(q, k, v, **kwargs)`` runs, why, and on which engines.

    ``str()`` is a short paragraph, one labelled line per fact; ``repr()`` is one line.

    Attributes:
        backend: the backend that runs the call (``"flash"``, ``"sdpa"``, ``"decode"``, ...).
        requested: the ``backend=`` that was asked for (``"auto"`` or a name).
        reason: why that backend runs it, e.g. ``"auto picked 'flash': the fastest backend that
            supports the call (not 'decode': ...)"`` or ``"backend='flash' was requested"``.
        plan: flash's tiling of the call, e.g. ``"causal plan, 1 engine call(s)"``; None for
            the other backends.
        engines: what runs each part of the call: forward, backward (when an input needs a
            gradient) and the NaN rule's passes for flash; the one engine of another backend.
        kernels: the state of attnlab's C++ kernels the call asks for
            (`attnlab._ext.describe_kernels`).
        thresholds: where auto's size thresholds for the dtype come from (with
            ``backend="auto"``), else None.
        dtype: the dtype of q, k and v.
        shapes: the shapes of q, k and v as given.
        mask: the mask in words: ``"none"``, a `Mask`'s repr, or a tensor's dtype and shape.
        bias: the bias in words (a tensor's dtype and shape, or the callable's repr), or None.
    """

    backend: str
    requested: str
    reason: str
    plan: str | None
    engines: tuple[str, ...]
    kernels: str
    thresholds: str | None
    dtype: torch.dtype
    shapes: tuple[Shape, Shape, Shape]
    mask: str
    bias: str | None = None

    def __str__(self) -> str:
        q, k, v = self.shapes
        call = f"{_dtype_name(self.dtype)}; q {q}, k {k}, v {v}; mask {self.mask}"
        if self.bias is not None:
            call += f"; bias {self.bias}"
        lines = [f"backend: {self.backend} ({call})", f"why: {self.reason}"]
        if self.plan is not None:
            lines.append(f"plan: {self.plan}")
        label = "engines" if len(self.engines) > 1 else "engine"
        lines.append(f"{label}: {'; '.join(self.engines)}")
        lines.append(f"kernels: {self.kernels}")
        if self.thresholds is not None:
            lines.append(f"thresholds: {self.thresholds}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        plan = "" if self.plan is None else f", plan={self.plan!r}"
        return (
            f"Explanation(backend={self.backend!r}, requested={self.requested!r}{plan}, "
            f"dtype={self.dtype}, mask={self.mask!r})"
        )

    def _repr_pretty_(self, p: object, _cycle: bool) -> None:
        """IPython shows the paragraph (`str`) when an explanation ends a cell."""
        p.text(str(self))  # type: ignore[attr-defined]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_term(term: object) -> str:
    """A mask or bias in words: a tensor's dtype and shape, else the object's repr."""
    if isinstance(term, Tensor):
        return f"{_dtype_name(term.dtype)} tensor {tuple(term.shape)}"
    return repr(term)


__all__ = ["Explanation", "describe_term"]
