"""What does ``attnlab.attention(backend="auto")`` cost over the kernel it picks?

Times auto against ``torch.nn.functional.scaled_dot_product_attention`` side by side, interleaved,
on plain and causal inputs, and prints the ratio (target <= 1.05) plus the machine's fp32 matmul
rate as the physical limit.

Run: python benchmarks/bench_overhead.py [--repeats 30]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from common import interleaved_medians, print_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    print_machine()
    print()
    print(f"{'case':<34} {'sdpa ms':>9} {'auto ms':>9} {'auto/sdpa':>10}  backend")
    for B, H, L, D in ((4, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 4096, 64)):
        q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
        for label, mask, causal in (("plain", None, False), ("causal", masks.causal(), True)):
            t = interleaved_medians(
                {
                    "sdpa": lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c
                    ),
                    "auto": lambda q=q, k=k, v=v, m=mask: attnlab.attention(q, k, v, mask=m),
                },
                args.repeats,
            )
            chosen = attnlab.explain(q, k, v, mask=mask).split(":")[0]
            case = f"{label} B={B} H={H} L={L} D={D}"
            ratio = t["auto"] / t["sdpa"]
            print(
                f"{case:<34} {t['sdpa'] * 1e3:9.3f} {t['auto'] * 1e3:9.3f} {ratio:10.3f}  {chosen}"
            )


if __name__ == "__main__":
    main()
