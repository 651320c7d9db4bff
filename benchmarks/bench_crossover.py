"""Where does the tiled backend start beating sdpa? Evidence for auto's thresholds per dtype.

For structured masks (sliding window, causal document) and a function bias (ALiBi, causal), times
``backend="flash"`` against ``backend="sdpa"`` (which renders the mask/bias densely and runs one
fused call) side by side, interleaved, at growing L, in each ``--dtype``, and prints sdpa/flash
ratios, what ``backend="auto"`` picks at each size (its thresholds for that dtype:
`attnlab.functional.thresholds`), the crossover L of each threshold class, and the machine's
matmul rate of each dtype. The measuring code is `attnlab.analysis.calibrate` (what
``python -m attnlab.analysis.calibrate`` caches); this script only prints, it never writes the
cache.

Run: python benchmarks/bench_crossover.py [--dtype float32 bfloat16] [--repeats 7]
     [--lengths 256 362 512 724 1024] [--clock cpu --threads 1]
"""

from __future__ import annotations

import argparse

import torch

import attnlab
from attnlab.analysis import calibrate
from attnlab.functional import thresholds
from common import CLOCKS, DTYPES, print_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(calibrate.LADDER))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    dtypes = [DTYPES[name] for name in args.dtype]
    print_machine(tuple(dtypes), clock)
    print(
        f"B=1 H={args.heads} D={args.dim} forward; min of {args.repeats} interleaved rounds, "
        f"{args.clock} clock"
    )
    for dtype in dtypes:
        limits = thresholds.for_dtype(dtype)
        print(
            f"\n{dtype}: auto sends windows to flash from L·S >= {limits.band}, the others from "
            f"L·S >= {limits.sparse}: {limits.source}"
        )
        rows = calibrate.measure(
            dtype, args.lengths, args.repeats, heads=args.heads, dim=args.dim, clock=clock
        )
        lines = calibrate.format_rows(rows).splitlines()
        print(f"{lines[0]}  auto picks")
        for line, r in zip(lines[1:], rows, strict=True):
            x = torch.empty(1, args.heads, r.L, args.dim, dtype=dtype)
            kw = calibrate.cases(r.L, args.heads)[r.case][1]
            picked = attnlab.explain(x, x, x, **kw).backend
            print(f"{line}  {picked}")
        cross = calibrate.crossovers(rows)
        print(f"crossover L (flash at least as fast from here on): {cross}")


if __name__ == "__main__":
    main()
