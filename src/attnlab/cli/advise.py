"""``attnlab advise``: which attention (dense, tiled, ring, sparse, linear) for a sequence length,
a memory budget and this machine — with the reason and the numbers.

The machine enters through its matmul rate: ``--gflops``, else the rate measured once on this
machine and cached (`attnlab.analysis.rates`; ``--recalibrate`` measures it again), so the same
arguments give the same advice on every run."""

from __future__ import annotations

import argparse
import json

from ._args import UsageError, float_in, int_at_least, positive_float, positive_int
from ._output import fitted, wrap

#: Side of the square fp32 matmul timed for the rate when --gflops is not given.
RATE_MATMUL_N = 1024


def matmul_rate(dtype: str, n: int = RATE_MATMUL_N, repeats: int = 3) -> float:
    """GFLOP/s of an n×n ``torch.mm`` in ``dtype`` (a name: ``"bfloat16"``) on the cpu
    (`attnlab.utils.matmul_rate`); in bfloat16 this is where AMX shows."""
    import torch

    from ..utils import matmul_rate as rate

    return rate(n, repeats, dtype=getattr(torch, dtype))


def _budget(text: str) -> int:
    from .estimate import _budget as parse

    return parse(text)


def _cmd_advise(args: argparse.Namespace) -> int:
    from ..analysis.advise import advise, machine_info

    if args.d_model % args.heads:
        raise UsageError("--heads", f"must divide --d-model {args.d_model}, got {args.heads}")
    if args.recalibrate and args.gflops is not None:
        raise UsageError("--recalibrate", "measures the rate that --gflops gives; drop one")
    machine = machine_info()
    if args.gflops is None:
        from ..analysis.rates import machine_rate

        try:
            rate = machine_rate(
                args.dtype,
                matmul_rate,
                what=f"{RATE_MATMUL_N}² {args.dtype} matmul on this cpu",
                recalibrate=args.recalibrate,
            )
        except ValueError as e:
            raise UsageError("--recalibrate", str(e)) from None
        gflops, source = rate.gflops, rate.source
    else:
        gflops, source = args.gflops, "given"
    advice = advise(
        args.seq,
        args.budget,
        gflops,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        vocab_size=args.vocab,
        batch=args.batch,
        train=args.train,
        dtype=args.dtype,
        max_seconds=args.max_seconds,
        window=args.window,
        devices=args.devices,
        machine=machine,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "choice": advice.choice,
                    "reason": advice.reason,
                    "options": advice.options,
                    "inputs": advice.inputs,
                    "rate_source": source,
                },
                indent=2,
            )
        )
        return 0
    amx = "AMX" if machine["amx"] else "no AMX"
    lines = (
        f"machine: {machine['cpu']} ({amx}, {machine['cores']} logical cores); matmul rate "
        f"{gflops:,.1f} GFLOP/s ({source})",
        f"model: {args.layers} layers, E={args.d_model}, H={args.heads}, V={args.vocab}; batch "
        f"{args.batch}, L={args.seq:,}, {args.dtype}, {'training' if args.train else 'inference'}"
        f"; budget {args.budget:,} bytes, at most {args.max_seconds:g} s per step",
    )
    print("\n".join(wrap(line, indent="  ") for line in lines) + "\n")
    print(fitted(advice.table_parts()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab advise`` to the ``attnlab`` command's subparsers."""
    p = sub.add_parser(
        "advise",
        help="recommend dense / tiled / ring / sparse / linear attention for a length",
        description=(
            "Recommends an attention form for a sequence length, a memory budget and this "
            "machine's matmul rate, with the reason and the numbers (memory and FLOPs from the "
            "cost model, time = FLOPs / rate). The rate is --gflops, else this machine's rate in "
            "--dtype, measured on the first run and cached (matmul_rates.json beside the "
            "auto-threshold cache; ATTNLAB_THRESHOLDS_FILE, ATTNLAB_THRESHOLDS=off), so the same "
            "arguments give the same advice; --recalibrate measures it again."
        ),
    )
    p.add_argument("--seq", type=positive_int, default=4096, help="sequence length L")
    p.add_argument("--budget", type=_budget, default="16GB", help="memory budget (default 16GB)")
    p.add_argument(
        "--gflops",
        type=positive_float,
        default=None,
        help="matmul rate in GFLOP/s (default: this cpu's cached rate in --dtype, measured on "
        "first use)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="time the matmul in --dtype again and replace the cached rate",
    )
    p.add_argument("--d-model", type=positive_int, default=768)
    p.add_argument("--layers", type=positive_int, default=12)
    p.add_argument("--heads", type=positive_int, default=12)
    p.add_argument(
        "--vocab", type=int_at_least(0), default=0, help="vocabulary (embedding and head)"
    )
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--train", action="store_true", help="a training step (default: inference)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"]
    )
    p.add_argument(
        "--max-seconds",
        type=float_in(0.0, low_open=True),
        default=10.0,
        help="time one step may take (default 10)",
    )
    p.add_argument("--window", type=positive_int, default=512, help="keys of the sparse option")
    p.add_argument("--devices", type=positive_int, default=1, help="devices a ring could use")
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.set_defaults(func=_cmd_advise)
