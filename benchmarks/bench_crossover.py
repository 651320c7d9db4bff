"""Where does the tiled backend start beating sdpa? The evidence behind auto's thresholds.

For structured masks (sliding window, causal document) and a function bias (ALiBi, causal), times
``backend="flash"`` against ``backend="sdpa"`` (which renders the mask/bias densely and runs one
fused call) side by side, interleaved, at growing L, and prints sdpa/flash ratios, what
``backend="auto"`` picks at each size (``AUTO_BAND_MIN``, ``AUTO_SPARSE_MIN`` in
``functional/backends.py``), and the machine's fp32 matmul rate.

Run: python benchmarks/bench_crossover.py [--repeats 15] [--lengths 256 384 512 724 1024]
"""

from __future__ import annotations

import argparse

import torch

import attnlab
from attnlab import masks
from attnlab.functional.backends import AUTO_BAND_MIN, AUTO_SPARSE_MIN
from attnlab.positional import ALiBi
from common import interleaved_medians, print_machine


def cases(L: int, H: int) -> dict[str, dict[str, object]]:
    """name -> keyword arguments of `attnlab.attention`."""
    return {
        "window 64": {"mask": masks.sliding_window(64)},
        "causal document (2 docs)": {
            "mask": masks.causal() & masks.document.from_lengths([L // 2, L - L // 2])
        },
        "ALiBi causal": {"mask": masks.causal(), "bias": ALiBi(H)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 384, 512, 724, 1024])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    print_machine()
    print(f"B=1 H={args.heads} D={args.dim} fp32 forward; medians of {args.repeats} interleaved")
    print(
        f"auto sends windows to flash from L·S >= {AUTO_BAND_MIN} (AUTO_BAND_MIN), the others "
        f"from L·S >= {AUTO_SPARSE_MIN} (AUTO_SPARSE_MIN)\n"
    )
    head = f"{'case':26} {'L':>5} {'flash ms':>9} {'sdpa ms':>9} {'sdpa/flash':>10}  auto picks"
    print(head)
    for L in args.lengths:
        q, k, v = (torch.randn(1, args.heads, L, args.dim) for _ in range(3))
        for name, kw in cases(L, args.heads).items():
            fns = {
                be: (lambda be=be, kw=kw, x=(q, k, v): attnlab.attention(*x, backend=be, **kw))
                for be in ("flash", "sdpa")
            }
            t = interleaved_medians(fns, args.repeats)
            picked = attnlab.explain(q, k, v, **kw).split(":")[0]
            print(
                f"{name:26} {L:5d} {t['flash'] * 1e3:9.2f} {t['sdpa'] * 1e3:9.2f} "
                f"{t['sdpa'] / t['flash']:10.2f}  {picked}"
            )


if __name__ == "__main__":
    main()
