"""The first sliding-window call in a new process against a steady call, with the kernels built.

The C++ kernels are built by an explicit step, ``attnlab build``, and a process never changes its
engine, so the first call in a new process pays no hidden build. This
script times that step (into a fresh temporary cache by default: every kernel is compiled, the
time a new machine pays once; ``--cache user`` uses the user's cache, where they may be built
already), then, in new processes that use that cache, the first
``attnlab.attention(q, k, v, mask=masks.sliding_window(256))`` at (1, 8, 16384, 64) float32 and
the median of the steady calls after it, and prints the ratio first / steady (target: ≤ 1.5),
the engine `attnlab.explain` names, and whatever the process said on stderr (nothing, when the
kernel was built). The header gives the CPU model and flags and the fp32 matmul rate.

Run: python benchmarks/bench_first_call.py [--cache fresh|user] [--processes 3] [--steady 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from attnlab import _ext
from common import cpu_flags, print_machine

CHILD = r"""
import json, statistics, sys, threading, time
import torch
import attnlab
from attnlab import masks
B, H, L, D, window, steady = (int(x) for x in sys.argv[1:7])
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
mask = masks.sliding_window(window)
threads = {t.name for t in threading.enumerate()}
t0 = time.perf_counter()
first = attnlab.attention(q, k, v, mask=mask)
first_s = time.perf_counter() - t0
times, same = [], True
for _ in range(steady):
    t0 = time.perf_counter()
    out = attnlab.attention(q, k, v, mask=mask)
    times.append(time.perf_counter() - t0)
    same = same and torch.equal(out, first)
why = attnlab.explain(q, k, v, mask=mask)
print(json.dumps({
    "first": first_s,
    "steady": statistics.median(times),
    "same_bits": same,
    "new_threads": sorted({t.name for t in threading.enumerate()} - threads),
    "engines": "; ".join((*why.engines, why.kernels)),
}))
"""

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def run_build(env: dict[str, str]) -> float:
    """Runs ``attnlab build`` in a new process, echoing its lines; returns its wall time."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "attnlab.cli", "build"], env=env, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"attnlab build failed (exit {done.returncode}): nothing to measure")
    return seconds


def first_call(env: dict[str, str], args: argparse.Namespace) -> tuple[dict, str]:
    """One new process: its measurements and what it wrote on stderr."""
    sizes = (args.batch, args.heads, args.length, args.dim, args.window, args.steady)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, sizes)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"the measuring process failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", choices=("fresh", "user"), default="fresh")
    parser.add_argument("--processes", type=int, default=3, help="new processes measured")
    parser.add_argument("--steady", type=int, default=5, help="steady calls per process")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()

    print_machine()
    flags = cpu_flags()
    print("CPU flags: " + " ".join(f"{f}{'+' if f in flags else '-'}" for f in FLAGS))
    print(f"attnlab's kernels compile to the {_ext.isa_path()} path (-march=native)\n")
    env = {**os.environ}
    env.pop(_ext.ENV, None)  # auto: what a user gets
    with tempfile.TemporaryDirectory(prefix="attnlab-ext-") as tmp:
        if args.cache == "fresh":
            env[_ext.CACHE_ENV] = tmp
        build_s = run_build(env)
        print(f"`attnlab build` ({args.cache} cache): {build_s:.1f} s wall, process included\n")
        shape = f"({args.batch}, {args.heads}, {args.length}, {args.dim}) float32"
        print(f"first vs steady sliding_window({args.window}) call at {shape}, new processes:")
        ratios = []
        for i in range(args.processes):
            r, said = first_call(env, args)
            ratios.append(r["first"] / r["steady"])
            print(
                f"  process {i + 1}: first {r['first']:.3f} s, steady {r['steady']:.3f} s "
                f"(median of {args.steady}), ratio {ratios[-1]:.2f}; same bits "
                f"{r['same_bits']}; new threads {r['new_threads'] or 'none'}; stderr "
                f"{repr(said) if said else 'empty'}"
            )
        print(f"  engine: {r['engines']}")
    worst = max(ratios)
    verdict = "meets" if worst <= 1.5 else "misses"
    print(f"\nworst first/steady ratio {worst:.2f} ({verdict} the target ≤ 1.5)")


if __name__ == "__main__":
    main()
