"""Measures where flash starts to beat sdpa on this machine per dtype; caches auto's thresholds.

For each threshold class of `attnlab.functional.thresholds` — ``band`` (a sliding window of 64)
and ``sparse`` (a causal mask of two packed documents; ALiBi + causal) — times
``attention(backend="flash")`` against ``attention(backend="sdpa")`` (the rendered mask/bias in
one fused call) side by side at growing L (B=1, H=8, D=64, forward, no grad), and takes as the
crossover the smallest measured L from which flash is at least as fast in every case of the class
at every larger measured L. The threshold is that L² (``L·S`` with S = L); when flash never wins
in the measured range it is (2·largest L)². ``long`` (every call goes to flash) bounds memory, not
speed, and keeps its built-in value.

Run: ``python -m attnlab.analysis.calibrate [--dtype float32 bfloat16] [--repeats 5]
[--threads 1] [--dry-run]`` (or ``attnlab bench --calibrate``). Timing uses this process's CPU
clock (``time.process_time``) with one thread by default, minima over interleaved rounds, so a
shared machine gives the uncontended crossover.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..functional import thresholds as _thr

#: Lengths measured (half octaves); the crossovers of docs/results lie between 256 and 724.
LADDER = (128, 181, 256, 362, 512, 724, 1024, 1448, 2048)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Timing:
    """flash and sdpa at one length for one case of a threshold class."""

    dtype: str
    cls: str
    case: str
    L: int
    flash_s: float
    sdpa_s: float

    @property
    def ratio(self) -> float:
        """sdpa / flash (> 1: flash is faster)."""
        return self.sdpa_s / self.flash_s


def cases(L: int, H: int) -> dict[str, tuple[str, dict[str, object]]]:
    """name -> (threshold class, keyword arguments of `attnlab.attention`) at length L."""
    from .. import masks
    from ..positional import ALiBi

    return {
        "window 64": ("band", {"mask": masks.sliding_window(64)}),
        "causal document (2 docs)": (
            "sparse",
            {"mask": masks.causal() & masks.document.from_lengths([L // 2, L - L // 2])},
        ),
        "ALiBi causal": ("sparse", {"mask": masks.causal(), "bias": ALiBi(H)}),
    }


def measure(
    dtype: torch.dtype,
    lengths: Sequence[int] = LADDER,
    repeats: int = 5,
    *,
    heads: int = 8,
    dim: int = 64,
    clock: Callable[[], float] = time.process_time,
    on_step: Callable[[str], None] | None = None,
) -> list[Timing]:
    """flash vs sdpa per case and length: the minimum of ``repeats`` interleaved rounds each."""
    from ..functional.api import attention

    gen = torch.Generator().manual_seed(0)
    rows = []
    for L in lengths:
        q, k, v = (torch.randn(1, heads, L, dim, generator=gen).to(dtype) for _ in range(3))
        for name, (cls, kw) in cases(L, heads).items():
            best = {"flash": math.inf, "sdpa": math.inf}
            with torch.no_grad():
                for backend in best:  # warm-up (plans, allocator)
                    attention(q, k, v, backend=backend, **kw)
                for _ in range(repeats):
                    for backend in best:
                        t0 = clock()
                        attention(q, k, v, backend=backend, **kw)
                        best[backend] = min(best[backend], clock() - t0)
            name_dtype = str(dtype).removeprefix("torch.")
            rows.append(Timing(name_dtype, cls, name, L, best["flash"], best["sdpa"]))
            if on_step is not None:
                on_step(f"{name_dtype} {name} L={L}")
    return rows


def crossovers(rows: Sequence[Timing]) -> dict[str, int | None]:
    """Per class, the smallest L from which flash is at least as fast in every case at every
    larger measured L (None: flash loses at the largest L)."""
    out: dict[str, int | None] = {}
    for cls in sorted({r.cls for r in rows}):
        lengths = sorted({r.L for r in rows if r.cls == cls})
        wins = {L: all(r.ratio >= 1.0 for r in rows if r.cls == cls and r.L == L) for L in lengths}
        found: int | None = None
        for L in reversed(lengths):
            if not wins[L]:
                break
            found = L
        out[cls] = found
    return out


def entry_for(dtype: torch.dtype, rows: Sequence[Timing], threads: int) -> dict[str, object]:
    """The cache entry (key, thresholds, evidence) that ``rows`` measured for ``dtype``."""
    cross = crossovers(rows)
    largest = max(r.L for r in rows)
    values = {cls: (L * L if L is not None else (2 * largest) ** 2) for cls, L in cross.items()}
    return {
        **_thr.machine_key(dtype),
        "band": values.get("band", _thr.BUILTIN.band),
        "sparse": values.get("sparse", _thr.BUILTIN.sparse),
        "long": _thr.BUILTIN.long,
        "measured_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "threads": threads,
        "crossover_L": cross,
        "lengths": sorted({r.L for r in rows}),
    }


def format_rows(rows: Sequence[Timing]) -> str:
    """The measurements as a plain-text table (ms, sdpa/flash)."""
    lines = [f"{'dtype':9} {'case':26} {'L':>5} {'flash ms':>9} {'sdpa ms':>9} {'sdpa/flash':>10}"]
    for r in rows:
        lines.append(
            f"{r.dtype:9} {r.case:26} {r.L:5d} {r.flash_s * 1e3:9.2f} {r.sdpa_s * 1e3:9.2f} "
            f"{r.ratio:10.2f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m attnlab.analysis.calibrate``."""
    p = argparse.ArgumentParser(
        prog="python -m attnlab.analysis.calibrate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"])
    p.add_argument("--lengths", type=int, nargs="+", default=list(LADDER))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    p.add_argument("--dry-run", action="store_true", help="measure and print; write nothing")
    return p


def calibrate(
    dtypes: Sequence[str],
    lengths: Sequence[int] = LADDER,
    repeats: int = 5,
    threads: int = 1,
    *,
    write: bool = True,
    out: Callable[[str], None] = print,
) -> list[dict[str, object]]:
    """Measures every dtype, prints the tables, writes the cache entries (unless not ``write``);
    returns the entries."""
    if any(n < 1 for n in lengths) or repeats < 1 or threads < 1:
        raise ValueError(
            f"lengths, repeats and threads must be >= 1, got {list(lengths)}, {repeats}, {threads}"
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    entries = []
    try:
        for name in dtypes:
            dtype = DTYPES[name]
            rows = measure(dtype, sorted(set(lengths)), repeats)
            out(format_rows(rows))
            entry = entry_for(dtype, rows, threads)
            out(
                f"{name}: crossover L {entry['crossover_L']} -> band {entry['band']}, "
                f"sparse {entry['sparse']}, long {entry['long']}\n"
            )
            entries.append(entry)
    finally:
        torch.set_num_threads(before)
    if write:
        path = _thr.cache_file()
        _thr.write_entries(path, entries)
        _thr.reset()
        out(f"wrote {len(entries)} entries to {path}")
    return entries


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m attnlab.analysis.calibrate``."""
    args = build_parser().parse_args(argv)
    model, flags = _thr.cpu_info()
    amx = sorted(f for f in flags if f.startswith("amx"))
    print(
        f"CPU: {model}; AMX: {', '.join(amx) or 'no'}; torch {torch.__version__}; "
        f"{args.threads} thread(s), CPU clock, min of {args.repeats} interleaved rounds"
    )
    calibrate(args.dtype, args.lengths, args.repeats, args.threads, write=not args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
