"""Ring attention on 1, 2 and 4 local gloo ranks: time and peak memory per rank.

Fixed global sequence (causal, zigzag layout, float32); forward + backward. Peak memory is the
growth of the resident set from before the inputs are allocated to the end of the step
(`attnlab.analysis.measure`): inputs, outputs, gradients and every buffer of the call, but not the
interpreter and torch themselves. (The time includes creating the inputs.) On one 2-core
machine the ranks share the cores, so times show overhead, not speed-up; the memory column is the
point: each rank holds 1/W of the sequence.

Run: python benchmarks/bench_ring.py [--seq 16384] [--heads 8] [--dim 64] [--pieces P]
(``--pieces``: `ring_attention`'s ``pieces``; default: its default.)
"""

from __future__ import annotations

import argparse

import torch

import attnlab
from attnlab.analysis.measure import measure
from attnlab.distributed import ring_attention
from attnlab.distributed.launch import run_local


def _measure(make_inputs, step) -> tuple[float, float]:
    """(seconds of step, peak RSS growth in MiB from before make_inputs to after step)."""
    _, seconds, peak = measure(lambda: step(*make_inputs()))
    return seconds, peak / 2**20


def _warm_up(step, H: int, D: int) -> None:
    """First-call costs (thread pools, gloo connections, kernels) on a tiny problem."""
    step(*(torch.randn(1, H, 64, D).requires_grad_() for _ in range(3)))


def _rank(rank: int, world: int, N: int, H: int, D: int, pieces: int | None) -> dict:
    L = N // world
    options = {} if pieces is None else {"pieces": pieces}

    def step(q, k, v):
        mask = attnlab.masks.causal()
        ring_attention(q, k, v, mask=mask, layout="zigzag", **options).sum().backward()

    _warm_up(step, H, D)
    g = torch.Generator().manual_seed(rank)
    seconds, mib = _measure(
        lambda: [torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3)], step
    )
    return {"seconds": seconds, "peak_mib": mib}


def _single(N: int, H: int, D: int, backend: str) -> dict:
    def step(q, k, v):
        attnlab.attention(q, k, v, mask=attnlab.masks.causal(), backend=backend).sum().backward()

    _warm_up(step, H, D)
    seconds, mib = _measure(
        lambda: [torch.randn(1, H, N, D).requires_grad_() for _ in range(3)], step
    )
    return {"seconds": seconds, "peak_mib": mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--pieces", type=int, default=None)
    args = parser.parse_args()
    N, H, D = args.seq, args.heads, args.dim
    pieces = "default" if args.pieces is None else args.pieces
    print(
        f"global sequence N={N}, B=1, H={H}, D={D}, float32, causal, zigzag, pieces={pieces}; "
        "fwd+bwd"
    )
    backend = "flash" if "flash" in attnlab.backends() else "sdpa"
    single = _single(N, H, D, backend)
    print(
        f"single process ({backend}): {single['seconds']:.2f} s, peak +{single['peak_mib']:.0f} MiB"
    )
    print(f"{'ranks':>5} {'max s/rank':>11} {'peak MiB/rank':>14} {'vs single':>10}")
    for world in (1, 2, 4):
        results = run_local(
            _rank, world, N, H, D, args.pieces, timeout=1800, threads=max(1, 2 // world)
        )
        bad = [p for s, p in results if s != "ok"]
        if bad:
            raise SystemExit(f"world {world} failed: {bad[0]}")
        secs = max(p["seconds"] for _, p in results)
        peak = max(p["peak_mib"] for _, p in results)
        print(f"{world:>5} {secs:>11.2f} {peak:>14.0f} {peak / single['peak_mib']:>10.2f}")


if __name__ == "__main__":
    main()
