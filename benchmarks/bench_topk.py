"""What content-dependent sparse attention costs against dense attention with the same mask.

Three calls on the same causal inputs (B = 1, GQA H = 8 on H_kv = 2, D = 64, fp32), timed
interleaved at growing L:

- ``dense``: `attnlab.attention(..., mask=causal(), backend="flash")`, the tiled backend;
- ``topk``: exact top-k per row (`functional.topk.topk_attention`, k_top keys): a threshold
  pass and an online-softmax pass over the same causal tiles — it reads every allowed logit
  twice, so it costs more than dense, never less; what it saves is the L×S matrix;
- ``routed``: block routing (`functional.routing.routing_attention`: block keys, k_blocks blocks
  per query block, MoBA / NSA), on the flash backend skipping the unselected tiles: its work
  grows as L · k_blocks · block instead of L² / 2.

Each row prints milliseconds, the ratio to dense, and the attended pairs' rate as a fraction of
the machine's fp32 matmul rate (4·D FLOPs per attended pair forward, 2.5× that forward +
backward; the pairs are those each call computes: all causal pairs for dense and top-k).

Run: python benchmarks/bench_topk.py [--lengths 1024 2048 4096] [--k-top 32] [--block 64]
[--k-blocks 4] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

import attnlab
from attnlab import masks
from attnlab.functional import routing_attention, topk_attention
from common import interleaved_medians, print_machine


def _run(fn, x, kind):
    def call():
        if kind == "fwd":
            with torch.no_grad():
                return fn(*x)
        out = fn(*x)
        out.backward(torch.ones_like(out))
        return out

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--k-top", type=int, default=32)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--k-blocks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rate = print_machine()[torch.float32]
    H, Hk, D = args.heads, args.kv_heads, args.dim
    print(
        f"B=1 H={H} H_kv={Hk} D={D} fp32 causal; k_top={args.k_top}; block={args.block}, "
        f"k_blocks={args.k_blocks}; medians of {args.repeats} interleaved\n"
    )
    calls = {
        "dense": lambda q, k, v: attnlab.attention(q, k, v, mask=masks.causal(), backend="flash"),
        "topk": lambda q, k, v: topk_attention(q, k, v, k_top=args.k_top, mask=masks.causal()),
        "routed": lambda q, k, v: routing_attention(
            q, k, v, block=args.block, k_blocks=args.k_blocks
        ),
    }
    print(f"{'L':>5} {'pass':8} {'call':7} {'ms':>9} {'vs dense':>9} {'of matmul':>10}")
    for L in args.lengths:
        q = torch.randn(1, H, L, D, requires_grad=True)
        k, v = (torch.randn(1, Hk, L, D, requires_grad=True) for _ in range(2))
        causal_pairs = H * L * (L + 1) / 2
        routed_pairs = H * min(causal_pairs / H, L * args.k_blocks * args.block)
        for kind in ("fwd", "fwd+bwd"):
            runs = {name: _run(fn, (q, k, v), kind) for name, fn in calls.items()}
            t = interleaved_medians(runs, args.repeats)
            for name in calls:
                pairs = routed_pairs if name == "routed" else causal_pairs
                flops = 4 * D * pairs * (1.0 if kind == "fwd" else 2.5)
                share = flops / t[name] / 1e9 / rate
                print(
                    f"{L:5d} {kind:8} {name:7} {t[name] * 1e3:9.2f} "
                    f"{t[name] / t['dense']:9.3f} {share:10.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
