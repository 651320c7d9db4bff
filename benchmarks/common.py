"""Shared pieces of the benchmark scripts: wall-clock timing and the machine's matmul rate."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_gflops(n: int = 4096, repeats: int = 5) -> float:
    """fp32 ``torch.mm`` rate on n×n matrices, GFLOP/s (best of ``repeats``): the physical limit."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9
