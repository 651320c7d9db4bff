"""Which engine runs flash's band and segment calls faster on this CPU, measured side by side.

The same ``attnlab.attention(backend="flash")`` calls — a sliding window (band calls) and packed
causal documents (segment calls) — with ``ATTNLAB_FLASH_BAND_ENGINE`` switched between ``aten``
(torch's fused flash kernel) and ``auto`` (attnlab's C++ kernels, ``_ext/band_attn.cpp``, where
they run) round by round in one process, forward and forward + backward, per dtype. The plan
cache is off so that every call plans for the engine in force, and the extension is required
(``ATTNLAB_EXT=require`` unless set: a missing build fails instead of timing torch twice).
Prints the minimum (and median) seconds of each, and the ratio aten / auto (> 1: attnlab's
kernel is the faster one).

Run: python benchmarks/bench_engines.py [--dtype float32 bfloat16 float16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

ENGINE_ENV = "ATTNLAB_FLASH_BAND_ENGINE"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--doc-length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7, help="forward rounds (fwd+bwd: half)")
    args = parser.parse_args()
    if args.length % args.doc_length:
        parser.error(f"--length must be a multiple of --doc-length={args.doc_length}")
    # before attnlab plans anything: every call plans for the engine set for it
    os.environ["ATTNLAB_FLASH_PLAN_CACHE"] = "0"
    os.environ.setdefault("ATTNLAB_EXT", "require")

    import attnlab
    from attnlab import masks
    from common import print_machine

    print_machine((torch.float32,))
    L, H, D = args.length, args.heads, args.dim
    cases = {
        f"window {args.window}": masks.sliding_window(args.window),
        f"documents {L // args.doc_length}×{args.doc_length} causal": masks.causal()
        & masks.document.from_lengths([args.doc_length] * (L // args.doc_length)),
    }
    print(f"B=1 H={H} L={L} D={D}; min (median) seconds, engines interleaved round by round\n")
    print(f"{'case':<34} {'dtype':<9} {'pass':<8} {'aten':>16} {'auto':>16} {'aten/auto':>9}")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtype:
        dtype = DTYPES[name]
        q, k, v = (
            torch.randn(1, H, L, D, generator=gen).to(dtype).requires_grad_() for _ in range(3)
        )
        dout = torch.randn(1, H, L, D, generator=gen).to(dtype)
        for label, mask in cases.items():
            for backward in (False, True):
                times: dict[str, list[float]] = {"aten": [], "auto": []}
                rounds = max(args.rounds // 2, 1) if backward else args.rounds
                for r in range(rounds + 1):  # round 0 warms up
                    for engine in times:
                        os.environ[ENGINE_ENV] = engine
                        t = time.perf_counter()
                        if backward:
                            attnlab.attention(q, k, v, mask=mask, backend="flash").backward(dout)
                        else:
                            with torch.no_grad():
                                attnlab.attention(q, k, v, mask=mask, backend="flash")
                        if r:
                            times[engine].append(time.perf_counter() - t)
                cells = [f"{min(x):.3f} ({statistics.median(x):.3f})" for x in times.values()]
                ratio = min(times["aten"]) / min(times["auto"])
                step = "fwd+bwd" if backward else "fwd"
                print(
                    f"{label:<34} {name:<9} {step:<8} {cells[0]:>16} {cells[1]:>16} {ratio:>8.2f}×"
                )
    os.environ.pop(ENGINE_ENV, None)


if __name__ == "__main__":
    main()
