"""What does ``attnlab.attention(backend="auto")`` cost over the kernel it picks?

Times auto against ``torch.nn.functional.scaled_dot_product_attention`` side by side,
interleaved, in float32 and bfloat16:

- prefill/training shapes (B=4 L=512 up to L=4096), plain and causal: target auto/sdpa <= 1.05;
- decoding, one query against S=4096 cached keys, GQA 8/2, D=64: no mask (target <= 1.1) and a
  key-padding mask (target <= 1.2 against SDPA given the same boolean mask).

The NaN rule (`attnlab.functional.nan_rule`) is part of what auto pays. Prints the CPU, whether
it has AMX, and the matmul rate of each dtype (the physical limit).

On a shared machine: ``--clock cpu`` times the process's CPU time (``time.process_time``: other
processes' load does not count; with one thread it is the uncontended time), ``--stat min`` takes
the best of the interleaved rounds, and ``--ext-ab`` adds auto with the C++ NaN-rule operators
switched off (``ATTNLAB_EXT=0``, `attnlab._ext`) to the same rounds.

Run: python benchmarks/bench_overhead.py [--repeats 30] [--threads N] [--clock wall|cpu]
     [--stat median|min] [--ext-ab] [--cases prefill decode] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from common import matmul_gflops, print_machine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ext(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the C++ operators on (the default) or off (``ATTNLAB_EXT=0``)."""

    def run() -> object:
        os.environ["ATTNLAB_EXT"] = "auto" if on else "0"
        attnlab.refresh_settings()  # read once per process: read again after the change
        return fn()

    return run


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, clock: str, stat: str
) -> dict[str, float]:
    """Seconds per call of each function (median or min over rounds), one warm-up call each,
    measured round by round (interleaved) so that drift of the machine hits all alike."""
    timer = time.process_time if clock == "cpu" else time.perf_counter
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = timer()
            fn()
            samples[name].append(timer() - t0)
    pick = min if stat == "min" else statistics.median
    return {name: pick(s) for name, s in samples.items()}


def _row(case: str, t: dict[str, float], base: str, ours: str, target: float, chosen: str) -> None:
    ratio = t[ours] / t[base]
    mark = "ok" if ratio <= target else "OVER"
    off = t.get(f"{ours} (no C++)")
    extra = "" if off is None else f"  without C++: {off / t[base]:.3f}"
    print(
        f"{case:<44} {t[base] * 1e3:9.3f} {t[ours] * 1e3:9.3f} {ratio:7.3f} "
        f"(<= {target}: {mark})  {chosen}{extra}"
    )


def _with_ab(fns: dict[str, Callable[[], object]], names: tuple[str, ...], ab: bool):
    """Adds ``name (no C++)`` variants of ``names`` when ``ab``; ours run with the C++ on."""
    out = {n: (_ext(True, f) if n in names else f) for n, f in fns.items()}
    if ab:
        out.update({f"{n} (no C++)": _ext(False, fns[n]) for n in names})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--ext-ab", action="store_true", help="also time auto without C++")
    parser.add_argument(
        "--cases", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"]
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print_machine()
    print(
        f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
        f"clock {args.clock}, {args.stat} of {args.repeats} interleaved rounds"
    )
    for name in args.dtypes:
        dtype = DTYPES[name]
        print(f"\n{name}: matmul rate {matmul_gflops(dtype=dtype):.1f} GFLOP/s")
        print(f"{'case':<44} {'sdpa ms':>9} {'auto ms':>9} {'ratio':>7}")
        prefill = ((4, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 4096, 64))
        for B, H, L, D in prefill if "prefill" in args.cases else ():
            q, k, v = (torch.randn(B, H, L, D, dtype=dtype) for _ in range(3))
            for label, mask, causal in (("plain", None, False), ("causal", masks.causal(), True)):
                fns = {
                    "sdpa": lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c
                    ),
                    "auto": lambda q=q, k=k, v=v, m=mask: attnlab.attention(q, k, v, mask=m),
                }
                t = interleaved(
                    _with_ab(fns, ("auto",), args.ext_ab), args.repeats, args.clock, args.stat
                )
                chosen = attnlab.explain(q, k, v, mask=mask).backend
                _row(f"{label} B={B} H={H} L={L} D={D}", t, "sdpa", "auto", 1.05, chosen)
        for B in (1, 4) if "decode" in args.cases else ():
            q = torch.randn(B, 8, 1, 64, dtype=dtype)
            k, v = (torch.randn(B, 2, 4096, 64, dtype=dtype) for _ in range(2))
            lengths = [4096 - 1000 * b for b in range(B)]
            pad = masks.padding(lengths)
            dense = pad.to_dense(1, 4096, batch=B)  # (B, 1, 1, S) bool
            fns = {
                "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True
                ),
                "auto": lambda q=q, k=k, v=v: attnlab.attention(q, k, v),
                "sdpa+mask": lambda q=q, k=k, v=v, m=dense: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, enable_gqa=True
                ),
                "auto+padding": lambda q=q, k=k, v=v, m=pad: attnlab.attention(q, k, v, mask=m),
            }
            t = interleaved(
                _with_ab(fns, ("auto", "auto+padding"), args.ext_ab),
                args.repeats * 10,
                args.clock,
                args.stat,
            )
            chosen = attnlab.explain(q, k, v).backend
            _row(f"decode B={B} S=4096 GQA 8/2, no mask", t, "sdpa", "auto", 1.1, chosen)
            _row(
                f"decode B={B} S=4096 GQA 8/2, padding {lengths}",
                t,
                "sdpa+mask",
                "auto+padding",
                1.2,
                chosen,
            )


if __name__ == "__main__":
    main()
