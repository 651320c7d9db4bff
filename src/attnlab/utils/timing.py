"""One way to time work: wall-clock seconds from ``time.perf_counter``."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._shapes import check_int

T = TypeVar("T")


class Timer:
    """Seconds since it was made (`seconds`) and since the last `lap`.

    Example:
        >>> t = Timer()
        >>> work()
        >>> print(f"({t.seconds:.1f} s)")
    """

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()

    @property
    def seconds(self) -> float:
        """Seconds since the timer was made."""
        return time.perf_counter() - self.start

    def lap(self) -> float:
        """Seconds since the previous `lap` (or since the timer was made)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds


def time_call(fn: Callable[[], T], clock: Callable[[], float] | None = None) -> tuple[T, float]:
    """Runs ``fn()`` once; returns ``(result, seconds)`` on ``clock`` (default
    ``time.perf_counter``, looked up at call time)."""
    clock = clock or time.perf_counter
    t0 = clock()
    result = fn()
    return result, clock() - t0


def best_times(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    warmup: bool = True,
    on_step: Callable[[str], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Best time of each function over ``repeats`` rounds, interleaved: one call of each per round.

    Interleaving lets machine noise hit every contender alike. With ``warmup`` each function is
    called once first (compilation, allocator) without being timed.

    Args:
        fns: name -> a function of no arguments.
        repeats: timed rounds (>= 1).
        warmup: call each function once before timing.
        on_step: called with a description after every call (e.g. a progress bar's step).
        clock: the timer (default ``time.perf_counter``; ``time.process_time`` for this
            process's CPU time).

    Returns:
        name -> the smallest time in seconds.
    """
    check_int("repeats", repeats, minimum=1)
    step = on_step if on_step is not None else (lambda _what: None)
    best = dict.fromkeys(fns, math.inf)
    if warmup:
        for name, fn in fns.items():
            fn()
            step(f"warm-up {name}")
    for r in range(repeats):
        for name, fn in fns.items():
            _, seconds = time_call(fn, clock)
            best[name] = min(best[name], seconds)
            step(f"round {r + 1} {name}")
    return best


def matmul_rate(
    n: int = 1024,
    repeats: int = 3,
    device: Any = "cpu",
    dtype: Any = None,
    clock: Callable[[], float] | None = None,
) -> float:
    """GFLOP/s of an n×n ``torch.mm`` in ``dtype`` (default float32) on ``device``: ``2n³`` over
    the best of ``repeats`` timed products (after one warm-up; CUDA work is waited for). The
    machine's yardstick: every benchmark and lab run prints it beside its own times.

    Args:
        n: the matrices' side. repeats: timed products (>= 1). device: where they live.
        dtype: a torch dtype (bfloat16 shows AMX). clock: the timer (default perf_counter).

    Returns:
        GFLOP/s.
    """
    import torch

    n = check_int("n", n, minimum=1)
    dtype = torch.float32 if dtype is None else dtype
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    cuda = torch.device(device).type == "cuda"

    def product() -> Any:
        out = torch.mm(a, b)
        if cuda:  # kernels are asynchronous: the timer must wait for them
            torch.cuda.synchronize(device)
        return out

    return 2 * n**3 / best_times({"mm": product}, repeats, clock=clock)["mm"] / 1e9
