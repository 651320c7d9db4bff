"""What float32 accumulation costs the ``sdpa`` backend's 16-bit gradients, measured side by side.

With a gradient, ``attnlab.attention(backend="sdpa")`` runs torch's CPU kernel on float32 copies
of bfloat16/float16 inputs (its 16-bit backward sums probabilities, dS, δ and per-block dk/dv in
16 bits, which the tolerance rule rejects). This times, round by round in one process, forward
+ backward of: ``attnlab`` (bfloat16 in, float32 kernel), the anchor users would call instead —
``torch.nn.functional.scaled_dot_product_attention`` on the same bfloat16 inputs and the same
mask as a dense bool tensor (16-bit backward) — and ``attnlab`` in float32. Prints the machine,
the bfloat16 and float32 matmul rates, median seconds and the ratio attnlab / anchor.

Run: python benchmarks/bench_sdpa_grad.py [--length 1024 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--global-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import attnlab
    from attnlab import masks
    from common import interleaved_medians, print_machine

    print_machine((torch.bfloat16, torch.float32))
    B, H, D = args.batch, args.heads, args.dim
    mask = masks.global_local(args.window, args.global_tokens)
    print(f"B={B} H={H} D={D}, global_local({args.window}, {args.global_tokens}); fwd+bwd median s")
    head = ("L", "attnlab bf16", "torch SDPA bf16", "attnlab fp32", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 13, 16, 13, 6), strict=True)))
    gen = torch.Generator().manual_seed(0)
    for L in args.length:
        base = [torch.randn(B, H, L, D, generator=gen) for _ in range(3)]
        dense = mask.to_dense(L, L)  # (1, 1, L, L) bool, True = may attend
        bf = [x.to(torch.bfloat16).requires_grad_() for x in base]
        fp = [x.clone().requires_grad_() for x in base]

        def ours(xs=bf):
            attnlab.attention(*xs, mask=mask, backend="sdpa").sum().backward()

        def anchor(xs=bf, dense=dense):
            F.scaled_dot_product_attention(*xs, attn_mask=dense).sum().backward()

        def ours32(xs=fp):
            attnlab.attention(*xs, mask=mask, backend="sdpa").sum().backward()

        t = interleaved_medians({"ours": ours, "anchor": anchor, "fp32": ours32}, args.rounds)
        print(
            f"{L:>6} {t['ours']:>13.4f} {t['anchor']:>16.4f} {t['fp32']:>13.4f} "
            f"{t['ours'] / t['anchor']:>6.2f}"
        )


if __name__ == "__main__":
    main()
