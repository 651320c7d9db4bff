"""The picture of "the same run": several `attnlab train` runs of the same training (one process,
`torchrun` data parallel, context parallel) read back from their checkpoints' per-step loss log
(``log.train_loss``, float64) and drawn by `attnlab.viz.runs.plot_same_run`: the loss curves and
each run's distance from the first, per step.

Run: python benchmarks/plot_same_run.py OUT.png "one process=runs/one/ckpt.safetensors" \
         "2 ranks, data=runs/ddp/ckpt.safetensors" "2 ranks, context=runs/cp/ckpt.safetensors"
"""

from __future__ import annotations

import argparse
import sys

from attnlab.checkpoint import load_checkpoint
from attnlab.viz.runs import plot_same_run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the PNG to write")
    p.add_argument("runs", nargs="+", metavar="NAME=CHECKPOINT", help="the reference first")
    p.add_argument("--dpi", type=int, default=80)
    args = p.parse_args(argv)
    curves = []
    for spec in args.runs:
        name, sep, path = spec.rpartition("=")
        if not sep or not name:
            print(f"error: runs must be NAME=CHECKPOINT, got {spec!r}", file=sys.stderr)
            return 2
        losses = load_checkpoint(path).tensors["log.train_loss"].tolist()
        curves.append((name, losses))
        print(f"{name}: {len(losses)} steps, final loss {losses[-1]:.6f}")
    ref = curves[0][1]
    for name, losses in curves[1:]:
        worst = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
        print(f"max |{name} - {curves[0][0]}| = {worst:.2e}")
    print(f"wrote {plot_same_run(args.out, curves, dpi=args.dpi)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
