"""Shared pieces of the benchmark scripts: wall-clock timing and the machine's matmul rate."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from attnlab.cli._bench_cases import matmul_size

#: ``--dtype`` names of the benchmark scripts.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: ``--clock`` names: wall clock, or this process's CPU time (with one thread: the uncontended
#: time on a shared machine).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call on ``clock`` (wall clock by default)."""
    t0 = clock()
    fn()
    return clock() - t0


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (``VmRSS``, ``VmHWM``; Linux)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_growth(fn: Callable[[], object]) -> tuple[object, int, float]:
    """``(fn(), peak RSS growth in bytes, seconds)`` of one call: the peak is reset to the current
    RSS first (``/proc/self/clear_refs``, Linux), so the growth is what the call itself held at
    its peak. Run it in a fresh process per measurement: memory an earlier call freed but the
    allocator kept would hide part of the next call's growth."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = proc_status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, proc_status("VmHWM") - before, seconds


def peak_tensor_growth(fn: Callable[[], object]) -> int:
    """Peak bytes of live CPU tensors during one call of ``fn`` above those live when it starts,
    from torch's profiler memory timeline (the allocator's own events: exact, and unaffected by
    memory the allocator keeps cached, unlike RSS). Costs a profiled call."""
    import json
    import os
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA; CPU has no other
        path = os.path.join(folder, "memory.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path, encoding="utf-8") as f:
            _, sizes = json.load(f)  # per time: bytes by category
    totals = [sum(row) for row in sizes]
    return max(totals) - totals[0] if totals else 0


def matmul_gflops(
    n: int = 4096,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """``torch.mm`` rate of ``dtype`` on n×n matrices, GFLOP/s (best of ``repeats``): the limit."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b), clock) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    stat: str = "median",
) -> dict[str, float]:
    """Median (or ``stat="min"``) seconds of each function after one warm-up call, measured
    round by round (interleaved) so that drift of the machine hits all of them alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn, clock))
    reduce = min if stat == "min" else statistics.median
    return {name: reduce(s) for name, s in samples.items()}


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


def matrix_features() -> str:
    """The CPU's matrix extensions as printed in headers: AMX flags, AVX512-FP16, AVX512-BF16."""
    flags = cpu_flags()
    amx = sorted(f for f in flags if f.startswith("amx"))
    return (
        f"AMX: {', '.join(amx) if amx else 'no'}; "
        f"AVX512-FP16: {'yes' if 'avx512_fp16' in flags else 'no'}; "
        f"AVX512-BF16: {'yes' if 'avx512_bf16' in flags else 'no'}"
    )


def print_machine(
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    clock: Callable[[], float] = time.perf_counter,
) -> dict[torch.dtype, float]:
    """The header every benchmark prints: CPU, matrix extensions, torch, threads, and the matmul
    rate of each measured dtype (the limit); returns the rates."""
    print(f"CPU: {cpu_model()}; {matrix_features()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rates = {}
    for dtype in dtypes:
        # 4096², or smaller for a dtype without native products (bfloat16 and float16 on an
        # AVX2-only CPU: ~1 GFLOP/s, minutes per 4096² product)
        n = matmul_size(dtype, clock=clock)
        rates[dtype] = matmul_gflops(n, dtype=dtype, clock=clock)
        name = SHORT.get(dtype, str(dtype).removeprefix("torch."))
        print(f"{name} matmul rate (torch.mm {n}²): {rates[dtype]:.1f} GFLOP/s")
    return rates
