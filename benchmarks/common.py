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


def matmul_gflops(n: int = 4096, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """``torch.mm`` rate of ``dtype`` on n×n matrices, GFLOP/s (best of ``repeats``): the limit."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
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


def cpu_flags() -> set[str]:
    """The CPU's feature flags (from /proc/cpuinfo on Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def print_machine() -> None:
    """The header every benchmark prints: CPU, AMX, torch, threads, and the fp32 matmul rate (the
    limit; benchmarks of other dtypes print that dtype's rate too)."""
    amx = sorted(f for f in cpu_flags() if f.startswith("amx"))
    print(f"CPU: {cpu_model()}; AMX: {', '.join(amx) if amx else 'no'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"fp32 matmul rate (torch.mm 4096²): {matmul_gflops():.1f} GFLOP/s")
