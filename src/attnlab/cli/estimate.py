"""``attnlab estimate``: parameters, FLOPs and memory of attention (naive, flash, linear)."""

from __future__ import annotations

import argparse

from ._args import UsageError, add_device_argument, positive_int

#: Memory `--measure` may use for its runs (the naive run holds the L×S scores and their grads).
MEASURE_LIMIT_BYTES = 4 * 2**30


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ..analysis import estimate, measure_estimate

    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.d_model % args.heads:
        divisors = [h for h in range(1, min(args.d_model, 64) + 1) if args.d_model % h == 0]
        raise UsageError(
            "--heads",
            f"must divide --d-model {args.d_model}, got {args.heads} (e.g. one of {divisors})",
        )
    if args.heads % kv_heads:
        divisors = [h for h in range(1, args.heads + 1) if args.heads % h == 0]
        raise UsageError(
            "--kv-heads", f"must divide --heads {args.heads}, got {kv_heads} (one of {divisors})"
        )
    est = estimate(
        args.seq,
        args.d_model,
        args.heads,
        batch=args.batch,
        layers=args.layers,
        dtype=args.dtype,
        kv_heads=args.kv_heads,
        causal=args.causal,
        window=args.window,
        decode=args.decode,
        bias=not args.no_bias,
    )
    c = est.config
    if args.measure:
        # One layer, forward + backward: the naive run keeps its activations plus the scores
        # and their gradient at once. Refused before anything is allocated.
        need = est.value("activations kept for backward", "naive") / c["layers"]
        need += 2 * est.value("score matrix", "naive")
        if need > MEASURE_LIMIT_BYTES:
            raise UsageError(
                "--measure",
                f"the naive run would need about {need / 2**30:,.1f} GiB, above the limit of "
                f"{MEASURE_LIMIT_BYTES / 2**30:.0f} GiB (lower --seq, --batch or --heads, or "
                "drop --measure)",
            )
    print(
        f"B={c['B']} L={c['L']} S={c['S']} E={c['E']} H={c['H']} H_kv={c['H_kv']} D={c['D']} "
        f"layers={c['layers']} {c['dtype']}: {c['attended_pairs']:,} of {c['dense_pairs']:,} "
        "pairs attended per head\n"
    )
    if args.measure:
        measure_estimate(est, device=args.device)
    print(est.table())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab estimate`` to the ``attnlab`` command's subparsers."""
    est = sub.add_parser(
        "estimate",
        help="parameters, FLOPs and memory of attention (naive, flash, linear)",
        description=(
            "Estimates parameters, FLOPs and memory of multi-head attention for the naive, tiled "
            "(flash) and linear implementations, counting exactly the attended pairs of the mask."
        ),
    )
    est.add_argument(
        "--seq", type=positive_int, default=1024, help="sequence length L (default 1024)"
    )
    est.add_argument(
        "--d-model", type=positive_int, default=768, help="model dimension E (default 768)"
    )
    est.add_argument(
        "--heads", type=positive_int, default=12, help="attention heads H (default 12)"
    )
    est.add_argument("--kv-heads", type=positive_int, default=None, help="key/value heads (GQA)")
    est.add_argument("--batch", type=positive_int, default=1)
    est.add_argument("--layers", type=positive_int, default=1)
    est.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"]
    )
    est.add_argument("--causal", action="store_true", help="causal mask")
    est.add_argument(
        "--window", type=positive_int, default=None, help="causal sliding window of W keys"
    )
    est.add_argument(
        "--decode", action="store_true", help="one new token against a KV cache of --seq"
    )
    est.add_argument("--no-bias", action="store_true", help="projections without biases")
    est.add_argument(
        "--measure", action="store_true", help="also run it and print measured time and peak memory"
    )
    add_device_argument(est)
    est.set_defaults(func=_cmd_estimate)
