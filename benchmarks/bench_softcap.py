"""What logit soft-capping costs on the tiled backend.

torch's fused CPU flash kernel cannot apply ``softcap·tanh(s / softcap)`` to its logits, so a
soft-capped call runs flash's pure-PyTorch tile engine (same plan, same O(L) memory). This times,
interleaved and at growing L, forward and forward+backward of:

- ``flash`` without a cap (the fused kernel: the target),
- ``flash`` with ``softcap`` (the torch tile engine, what auto picks: sdpa declines it),
- ``reference`` with ``softcap`` (the materialised L×S definition, the only other option),

and prints the ratios cap/no-cap and reference/flash for causal and a Gemma-2-like local window.

Run: python benchmarks/bench_softcap.py [--repeats 5] [--lengths 1024 2048 4096] [--threads 1]

On a loaded machine use ``--threads 1``: the tile engine issues many small ops, and with several
threads each op waits at a barrier for a descheduled thread, which a busy machine turns into a
several-fold slowdown that a quiet one does not have.
"""

from __future__ import annotations

import argparse

import torch

import attnlab
from attnlab import masks
from common import interleaved_medians, print_machine

CAP = 50.0  # Gemma 2's attn_logit_softcapping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print_machine()
    print(
        f"B=1 H={args.heads} D={args.dim} fp32, softcap={CAP}; medians of {args.repeats} "
        f"interleaved; fwd = no grad, fwd+bwd = out.backward(ones)\n"
    )
    print(
        f"{'mask':14} {'L':>5} {'pass':8} {'flash ms':>9} {'flash+cap':>10} {'ref+cap':>9} "
        f"{'cap/nocap':>9} {'ref/flash':>9}"
    )
    for L in args.lengths:
        q, k, v = (torch.randn(1, args.heads, L, args.dim, requires_grad=True) for _ in range(3))
        for name, mask in (
            ("causal", masks.causal()),
            ("window", masks.sliding_window(args.window)),
        ):
            runs = {
                "flash": {"backend": "flash"},
                "flash+cap": {"backend": "flash", "softcap": CAP},
                "ref+cap": {"backend": "reference", "softcap": CAP},
            }
            for kind in ("fwd", "fwd+bwd"):

                def make(kw, kind=kind, mask=mask, x=(q, k, v)):
                    def fn():
                        if kind == "fwd":
                            with torch.no_grad():
                                return attnlab.attention(*x, mask=mask, **kw)
                        out = attnlab.attention(*x, mask=mask, **kw)
                        out.backward(torch.ones_like(out))
                        return out

                    return fn

                t = interleaved_medians({n: make(kw) for n, kw in runs.items()}, args.repeats)
                print(
                    f"{name:14} {L:5d} {kind:8} {t['flash'] * 1e3:9.1f} "
                    f"{t['flash+cap'] * 1e3:10.1f} {t['ref+cap'] * 1e3:9.1f} "
                    f"{t['flash+cap'] / t['flash']:9.2f} {t['ref+cap'] / t['flash+cap']:9.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
