"""Measured time and peak memory of a piece of work (Linux: peak resident set; else maxrss)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from typing import Any

from ..utils import time_call


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _return_freed_memory_to_os() -> None:
    """glibc keeps freed memory for reuse, which hides a second run's peak; make it give it back.

    Large blocks are then always mmap'd and unmapped on free (the default threshold adapts
    upwards after the first free, so a warm-up would otherwise keep its memory).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measurements may under-report after warm-up
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
        return True
    except OSError:
        return False


def measure(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """Runs ``fn()``; returns ``(result, seconds, peak memory growth in bytes)``.

    The growth is the peak resident set during the call minus the resident set before it. On
    Linux the peak is reset first (``/proc/self/clear_refs``), so earlier peaks do not hide it;
    elsewhere the process's lifetime maximum (``ru_maxrss``) is used and may under-report.
    """
    _return_freed_memory_to_os()
    exact = _reset_peak()
    before = _status_kb("VmRSS:")
    if not exact or before is None:
        scale = 1 if sys.platform == "darwin" else 1024
        before_b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    result, seconds = time_call(fn)
    if exact and before is not None:
        peak = _status_kb("VmHWM:") or 0
        return result, seconds, max(0, (peak - before) * 1024)
    after_b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return result, seconds, max(0, after_b - before_b)
