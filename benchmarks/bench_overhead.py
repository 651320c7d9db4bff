"""What does ``attnlab.attention(backend="auto")`` cost over the kernel it picks?

Times auto against ``torch.nn.functional.scaled_dot_product_attention`` side by side,
interleaved, in float32 and bfloat16:

- prefill/training shapes (B=4 L=512 up to L=4096), plain and causal: target auto/sdpa <= 1.05;
- decoding, one query against S=4096 cached keys, GQA 8/2, D=64: no mask (target <= 1.1) and a
  key-padding mask (target <= 1.2 against SDPA given the same boolean mask).

The NaN rule (`attnlab.functional.nan_rule`) is part of what auto pays. Prints the CPU, whether
it has AMX, and the matmul rate of each dtype (the physical limit).

Run: python benchmarks/bench_overhead.py [--repeats 30]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from common import interleaved_medians, matmul_gflops, print_machine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _row(case: str, t: dict[str, float], base: str, ours: str, target: float, chosen: str) -> None:
    ratio = t[ours] / t[base]
    mark = "ok" if ratio <= target else "OVER"
    print(
        f"{case:<44} {t[base] * 1e3:9.3f} {t[ours] * 1e3:9.3f} {ratio:7.3f} "
        f"(<= {target}: {mark})  {chosen}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    torch.manual_seed(0)
    print_machine()
    for name in args.dtypes:
        dtype = DTYPES[name]
        print(f"\n{name}: matmul rate {matmul_gflops(dtype=dtype):.1f} GFLOP/s")
        print(f"{'case':<44} {'sdpa ms':>9} {'auto ms':>9} {'ratio':>7}")
        for B, H, L, D in ((4, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 4096, 64)):
            q, k, v = (torch.randn(B, H, L, D, dtype=dtype) for _ in range(3))
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
                _row(f"{label} B={B} H={H} L={L} D={D}", t, "sdpa", "auto", 1.05, chosen)
        for B in (1, 4):
            q = torch.randn(B, 8, 1, 64, dtype=dtype)
            k, v = (torch.randn(B, 2, 4096, 64, dtype=dtype) for _ in range(2))
            lengths = [4096 - 1000 * b for b in range(B)]
            pad = masks.padding(lengths)
            dense = pad.to_dense(1, 4096, batch=B)  # (B, 1, 1, S) bool
            t = interleaved_medians(
                {
                    "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                        q, k, v, enable_gqa=True
                    ),
                    "auto": lambda q=q, k=k, v=v: attnlab.attention(q, k, v),
                    "sdpa+mask": lambda q=q, k=k, v=v, m=dense: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=m, enable_gqa=True
                    ),
                    "auto+padding": lambda q=q, k=k, v=v, m=pad: attnlab.attention(q, k, v, mask=m),
                },
                args.repeats * 10,
            )
            chosen = attnlab.explain(q, k, v).split(":")[0]
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
