"""What attention sinks cost: the same call with and without ``sinks=``.

The sink joins each row's denominator inside attnlab's C++ kernels (flash's band and segment
kernels, the decode step) and flash's backward runs on ``(out', lse')`` on the fused kernels,
the sinks' gradient from the kernel's per-row δ (`attnlab.functional.flash.sinks`), so the
target is forward and forward+backward within 1.05× of the same call without sinks. Timed
interleaved, at growing L, for causal and a GPT-OSS-like sliding window (128), GQA (H = 8,
H_kv = 2), fp32:

- ``flash`` with and without sinks (the same backend: the target's ratio),
- ``auto`` with and without sinks (auto skips backends without lse, e.g. sdpa, for sinks: the
  ratio says what a user sees),
- one decoding step (L = 1 against S keys, no gradient) with and without sinks.

Run: python benchmarks/bench_sinks.py [--repeats 5] [--lengths 1024 2048 4096] [--threads 1]
[--cpu-time]. ``--cpu-time`` times each call by the calling thread's CPU time on one thread (the
time other processes take the core is left out: a ratio on a loaded machine); the recorded
figures are wall clock on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import torch

import attnlab
from attnlab import masks
from common import interleaved_medians, print_machine

TARGET = 1.05


def _call(x, sinks, mask, backend, kind):
    def fn():
        if kind == "fwd":
            with torch.no_grad():
                return attnlab.attention(*x, mask=mask, sinks=sinks, backend=backend)
        out = attnlab.attention(*x, mask=mask, sinks=sinks, backend=backend)
        out.backward(torch.ones_like(out))
        return out

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="thread CPU time on 1 thread (a loaded machine)"
    )
    args = parser.parse_args()
    if args.threads is not None or args.cpu_time:
        torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    print_machine()
    H, Hk, D = args.heads, args.kv_heads, args.dim
    print(
        f"B=1 H={H} H_kv={Hk} D={D} fp32; medians of {args.repeats} interleaved"
        f"{' (thread CPU time, 1 thread)' if args.cpu_time else ''}; fwd = no grad, "
        f"fwd+bwd = out.backward(ones); target: sinks/plain <= {TARGET}\n"
    )
    print(
        f"{'mask':8} {'L':>5} {'pass':8} {'backend':8} {'plain ms':>9} {'sinks ms':>9} "
        f"{'ratio':>6}  verdict"
    )
    worst = 0.0
    for L in args.lengths:
        q = torch.randn(1, H, L, D, requires_grad=True)
        k, v = (torch.randn(1, Hk, L, D, requires_grad=True) for _ in range(2))
        sinks = torch.randn(H, requires_grad=True)
        for name, mask in (
            ("causal", masks.causal()),
            ("window", masks.sliding_window(args.window)),
        ):
            for kind in ("fwd", "fwd+bwd"):
                for backend in ("flash", "auto"):
                    runs = {
                        "plain": _call((q, k, v), None, mask, backend, kind),
                        "sinks": _call((q, k, v), sinks, mask, backend, kind),
                    }
                    t = interleaved_medians(runs, args.repeats, clock)
                    ratio = t["sinks"] / t["plain"]
                    worst = max(worst, ratio) if backend == "flash" else worst
                    verdict = "ok" if ratio <= TARGET else "OVER"
                    print(
                        f"{name:8} {L:5d} {kind:8} {backend:8} {t['plain'] * 1e3:9.2f} "
                        f"{t['sinks'] * 1e3:9.2f} {ratio:6.3f}  {verdict}",
                        flush=True,
                    )
        step = (q.detach()[:, :, -1:], k.detach(), v.detach())
        runs = {
            "plain": _call(step, None, None, "auto", "fwd"),
            "sinks": _call(step, sinks.detach(), None, "auto", "fwd"),
        }
        t = interleaved_medians(runs, args.repeats, clock)
        print(
            f"{'decode':8} {L:5d} {'fwd':8} {'auto':8} {t['plain'] * 1e3:9.2f} "
            f"{t['sinks'] * 1e3:9.2f} {t['sinks'] / t['plain']:6.3f}",
            flush=True,
        )
    met = "met" if worst <= TARGET else "NOT met"
    print(f"\nworst flash ratio {worst:.3f} (target <= {TARGET}): {met}")


if __name__ == "__main__":
    main()
