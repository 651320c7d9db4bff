"""Shared pieces of the benchmark scripts: wall-clock timing and the machine's matmul rate."""

from __future__ import annotations

import platform
import statistics
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


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function after one warm-up call, measured round by round
    (interleaved) so that drift of the machine hits all of them alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def print_machine() -> None:
    """The header every benchmark prints: CPU, torch, threads, and the fp32 matmul rate (the
    limit)."""
    print(f"CPU: {cpu_model()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"fp32 matmul rate (torch.mm 4096²): {matmul_gflops():.1f} GFLOP/s")
