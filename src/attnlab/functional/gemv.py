"""A linear layer on a few rows (decode steps) on attnlab's streaming kernel (``_ext/gemv.cpp``).

With one to eight rows, ``x·Wᵀ`` is bound by reading W: torch's CPU kernel reads a decode step's
weights at 6–12 GB/s on one AMD EPYC core, attnlab's reads each weight row once, in order, with
a software prefetch a few rows ahead, against every row of x (float32 fused multiply-adds, or
AVX512-BF16 pair dot products for bfloat16: float32 accumulation, bias added and one rounding in
the kernel). At one row it reads the weights at the core's streaming-read rate, faster than
``torch.nn.functional.linear`` up to eight rows (measured: docs/results,
``benchmarks/bench_gemv.py``).

`linear` runs the kernel when all of these hold, else ``torch.nn.functional.linear`` (the same
product; the sums differ only in rounding order):

- at most `MAX_ROWS` rows (``x.numel() / in_features``), CPU, float32 or bfloat16 (x, weight
  and bias of one dtype), a contiguous weight, x with unit stride in its last dim; one float32
  row only against a weight of at least `FP32_ONE_ROW_MIN` elements;
- no autograd (grad disabled, or nothing requires grad), not while `torch.compile` traces nor
  under a ``TorchDispatchMode`` (``FlopCounterMode``, fake tensors: they see ``aten.mm``);
- the extension is built (`attnlab._ext.load`: ``attnlab build``, or the first call that needs
  it builds it, once per machine) and it has the kernel for the dtype (AVX-512F / AVX512-BF16
  loops where the CPU has them, else a portable 8-lane loop: AVX2 FMAs, bfloat16 widened
  exactly; on an AVX2-only AMD EPYC 1.0–2.0× ``F.linear``);
- ``ATTNLAB_GEMV`` is unset or ``auto``; ``off`` forces torch's kernel.

The kernel streams one row of the weight at a time on AMD CPUs; elsewhere four side by side in
float32 and two in bfloat16 (on a Xeon with AMX: one float32 row of x 0.87× → 1.04× torch's
kernel, four rows 1.42× → 1.75×; one bfloat16 row 1.63× → 1.9×; one core, docs/results);
``ATTNLAB_GEMV_ROWS`` (``1``, ``2`` or ``4``) forces a count on any CPU.

More rows (prefill, training) go to ``torch.nn.functional.linear``; in bfloat16 or float16 on a
CPU without native products of that dtype (no AVX512-BF16/AMX-BF16, no AVX512-FP16/AMX-FP16)
they are multiplied widened to float32 and rounded once (`widens`): torch's CPU kernel runs such
products at ~1 GFLOP/s on an AVX2-only AMD EPYC (float32: 130–170), and its sums are float32 as
well. ``ATTNLAB_LINEAR_WIDEN`` = ``auto`` (default), ``on`` or ``off`` forces the choice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .. import _ext, _settings
from .._ext import NATIVE_FLAGS, native_products

EXT = "gemv"
ENV = _settings.GEMV
WIDEN_ENV = _settings.LINEAR_WIDEN
ROWS_ENV = _settings.GEMV_ROWS
MAX_ROWS = 8
# One float32 row against a weight of fewer elements (1 MiB) stays on torch's kernel: on the
# 2.9M-parameter GPT (256-wide, weights in cache) its matrix products alone ran 2,613 tok/s on
# torch's kernel and 1,754 on this one (one thread, docs/results); bfloat16 and more
# rows were faster here at every size measured.
FP32_ONE_ROW_MIN = 1 << 18
_DTYPES = (torch.float32, torch.bfloat16)


def setting() -> str:
    """``$ATTNLAB_GEMV``: ``auto`` (default) or ``off``.

    Raises:
        ValueError: the variable holds something else.
    """
    return _settings.choice("gemv", ("auto", "off"))


def rows_per_pass() -> int:
    """``$ATTNLAB_GEMV_ROWS``: rows of the weight streamed side by side, ``1``, ``2`` or ``4``;
    ``0`` (unset or ``auto``) leaves the choice to the kernel (1 on AMD; elsewhere 4 in float32,
    2 in bfloat16).

    Raises:
        ValueError: the variable holds something else.
    """
    raw = _settings.choice("gemv_rows", ("auto", "1", "2", "4"))
    return 0 if raw == "auto" else int(raw)


def widen_setting() -> str:
    """``$ATTNLAB_LINEAR_WIDEN``: ``auto`` (default), ``on`` or ``off``.

    Raises:
        ValueError: the variable holds something else.
    """
    return _settings.choice("linear_widen", ("auto", "on", "off"))


def widens(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear` multiplies ``x·weightᵀ`` widened to float32 (off the streaming kernel):
    CPU tensors of one 16-bit dtype the CPU has no native products of, or the setting ``on``;
    never while `torch.compile` traces or under a ``TorchDispatchMode`` (they see torch's op)."""
    if x.dtype not in NATIVE_FLAGS or weight.dtype != x.dtype or not x.is_cpu:
        return False
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    setting = widen_setting()
    return setting == "on" or (setting == "auto" and not native_products(x.dtype))


@functools.cache
def _cpu_supports(dtype: torch.dtype) -> bool:
    answer: bool = torch.ops.attnlab_gemv.supported(dtype)
    return answer


def usable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `linear` runs ``x·weightᵀ + bias`` on the streaming kernel (see the module).

    The cheap checks run first: this sits on every projection of a decode step."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False  # before any size test: a traced size would get a guard
    if not x.is_cpu or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    K = weight.shape[-1]
    if weight.dim() != 2 or K == 0 or x.shape[-1] != K:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if x.stride(-1) != 1 and K > 1:
        return False
    return _weight_ok(x.numel() // K, weight, bias) and _ready(x.dtype)


def stream_mask(
    rows: int, dtype: torch.dtype, layers: Sequence[tuple[Tensor, Tensor | None]]
) -> int:
    """Bit i set iff `linear` would run ``rows`` contiguous CPU rows of ``dtype`` through
    ``layers[i] = (weight, bias)`` on the streaming kernel (`usable` without a tensor ``x``:
    `attnlab.models.fused_step` plans a whole block's step from the shapes)."""
    if not _ready(dtype):
        return 0
    mask = 0
    for i, (weight, bias) in enumerate(layers):
        if weight.dtype == dtype and _weight_ok(rows, weight, bias):
            mask |= 1 << i
    return mask


def _weight_ok(rows: int, weight: Tensor, bias: Tensor | None) -> bool:
    """The weight's and bias's part of `usable`, for ``rows`` rows of x of weight's dtype."""
    if not weight.is_cpu or weight.dim() != 2 or weight.shape[-1] == 0 or rows > MAX_ROWS:
        return False
    if weight.dtype == torch.float32 and rows == 1 and weight.numel() < FP32_ONE_ROW_MIN:
        return False  # torch's single-row float32 kernel is faster on cache-sized weights
    if torch.is_grad_enabled() and (
        weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    if not weight.is_contiguous():
        return False
    return bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())


def _ready(dtype: torch.dtype) -> bool:
    """The call-independent part of `usable`: eager mode, the setting, the built kernel."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False  # tracing, FLOP counting, fake tensors: the standard aten ops
    if dtype not in _DTYPES or setting() != "auto":
        return False
    return _ext.load(EXT) and _cpu_supports(dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x·weightᵀ + bias``, as ``torch.nn.functional.linear``: ``(..., K) -> (..., N)``.

    Args:
        x: ``(..., K)``. weight: ``(N, K)``. bias: ``(N,)`` or None.

    Returns:
        ``(..., N)`` in x's dtype; on attnlab's streaming kernel when `usable` (a few rows
        without autograd), else on torch's (widened to float32 when `widens`).
    """
    if not usable(x, weight, bias):
        if widens(x, weight):  # float32 products, one rounding: as torch's, ~100× faster here
            wide_bias = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
        return F.linear(x, weight, bias)
    out: Tensor = torch.ops.attnlab_gemv.linear(x, weight, bias, rows_per_pass())
    return out


__all__ = [
    "ENV",
    "EXT",
    "FP32_ONE_ROW_MIN",
    "MAX_ROWS",
    "NATIVE_FLAGS",
    "ROWS_ENV",
    "WIDEN_ENV",
    "linear",
    "native_products",
    "rows_per_pass",
    "setting",
    "stream_mask",
    "usable",
    "widen_setting",
    "widens",
]
