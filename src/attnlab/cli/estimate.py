"""``attnlab estimate``: parameters, FLOPs and memory of attention (naive, flash, linear), of a
whole model (``--train`` / ``--infer``), the largest length for a memory budget (``--budget``), the
RNN vs self-attention table (``--complexity``), the IO model of tiled attention (``--io``) and the
bytes cached per token by multi-head latent attention against a per-head K/V cache (``--mla``)."""

from __future__ import annotations

import argparse

from ._args import UsageError, add_device_argument, int_at_least, positive_int
from ._output import fitted, print_json, working, wrap

#: Memory `--measure` may use for its runs (the naive run holds the L×S scores and their grads).
MEASURE_LIMIT_BYTES = 4 * 2**30


def _budget(text: str) -> int:
    """An argparse type: a memory size such as 12GB, 12GiB or 512MB."""
    from ..analysis.costs import parse_bytes

    try:
        return parse_bytes(text, "size")
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size ")) from None


def _mla(text: str) -> tuple[int, int, int | None, int | None]:
    """An argparse type: ``C,R`` or ``C,R,Dn,Dv`` (kv_lora_rank, rope dims, nope and value head
    dims; Dn and Dv default to D = E/H)."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 4):
        raise argparse.ArgumentTypeError(
            f"expected kv_lora_rank,rope or kv_lora_rank,rope,nope,v (ints), got {text!r}"
        )
    names = ("kv_lora_rank", "rope", "nope", "v")
    for name, value, low in zip(names, values, (1, 0, 0, 1), strict=False):
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be an int >= {low}, got {value}")
    c, r, *rest = values
    return (c, r, *rest) if rest else (c, r, None, None)  # type: ignore[return-value]


def _mla_data(args: argparse.Namespace, d: int) -> dict:
    """The ``--mla`` numbers: bytes per cached token and layer, and for the whole cache
    (B · S tokens · layers), latent against per-head K/V
    (`attnlab.analysis.estimate.cache_bytes_per_token`)."""
    from ..analysis.estimate import cache_bytes_per_token

    c, r, dn, dv = args.mla
    dn, dv = d if dn is None else dn, d if dv is None else dv
    per_token = cache_bytes_per_token(
        args.heads, kv_lora_rank=c, qk_rope_head_dim=r, qk_nope_head_dim=dn, v_head_dim=dv,
        dtype=args.dtype,
    )  # fmt: skip
    tokens = args.batch * args.seq * args.layers
    return {
        "H": args.heads, "kv_lora_rank": c, "rope": r, "nope": dn, "v": dv, "dtype": args.dtype,
        "latent_bytes_per_token": per_token["latent"],
        "per_head_kv_bytes_per_token": per_token["per-head K/V"],
        "cached_token_layers": tokens,
        "latent_bytes": per_token["latent"] * tokens,
        "per_head_kv_bytes": per_token["per-head K/V"] * tokens,
    }  # fmt: skip


def _mla_lines(m: dict) -> list[str]:
    """``_mla_data`` as the lines printed under the table."""
    ratio = m["per_head_kv_bytes_per_token"] / m["latent_bytes_per_token"]
    return [
        f"MLA cache per token and layer ({m['dtype']}): latent (C + R)·b = ({m['kv_lora_rank']} + "
        f"{m['rope']})·b = {m['latent_bytes_per_token']:,} bytes; per-head K/V "
        f"H·(Dn + R + Dv)·b = {m['H']}·({m['nope']} + {m['rope']} + {m['v']})·b = "
        f"{m['per_head_kv_bytes_per_token']:,} bytes ({ratio:,.1f}× the latent)",
        f"MLA cache of {m['cached_token_layers']:,} token-layers (B·S·layers): latent "
        f"{m['latent_bytes'] / 2**20:,.2f} MiB, per-head K/V "
        f"{m['per_head_kv_bytes'] / 2**20:,.2f} MiB",
    ]


def _check_mla(args: argparse.Namespace) -> None:
    """``--mla`` goes with the attention estimate only."""
    others = args.complexity or args.io is not None or args.model or args.infer
    if args.mla is not None and (others or args.budget is not None):
        raise UsageError(
            "--mla",
            "adds the cache of one attention layer to the attention estimate; drop "
            "--complexity/--io/--train/--infer/--budget",
        )


def _mask(args: argparse.Namespace, *, window: bool = True):
    """The mask of ``--causal`` and (with ``window``) ``--window W``: their ``&``, or None."""
    from .. import masks

    mask = masks.causal() if args.causal else None
    if window and args.window is not None:
        band = masks.sliding_window(args.window)
        mask = band if mask is None else mask & band
    return mask


def _model_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        kv_heads=args.kv_heads,
        d_ff=args.d_ff,
        vocab_size=args.vocab,
        batch=args.batch,
        train=not args.infer,
        dtype=args.dtype,
        optimizer=args.optimizer,
        mlp=args.mlp,
        bias=not args.no_bias,
        mask=_mask(args, window=False),  # the whole-model cost counts causal pairs only
    )


def _cmd_model(args: argparse.Namespace) -> int:
    from ..analysis.costs import max_seq_len, model_cost

    kw = _model_kwargs(args)
    if args.json:
        data = {
            attention: model_cost(args.seq, attention=attention, **kw).__dict__
            for attention in ("naive", "flash")
        }
        if args.budget is not None:
            for attention in ("naive", "flash"):
                data[attention]["max_seq_len"] = max_seq_len(args.budget, attention=attention, **kw)
        print_json(_jsonable(data))
        return 0
    mode = "inference" if args.infer else f"training ({args.optimizer})"
    model = (
        f"model: {args.layers} layers, E={args.d_model}, H={args.heads}, F={args.d_ff or 'default'}"
        f", V={args.vocab}, {args.mlp} MLP; batch {args.batch}, {args.dtype}, {mode}"
    )
    print(wrap(model, indent="  ") + "\n")
    for attention in ("naive", "flash"):
        print(f"attention={attention}, L={args.seq}:")
        print(fitted(model_cost(args.seq, attention=attention, **kw).table_parts()))
        print()
    if args.budget is not None:
        for attention in ("naive", "flash"):
            n = max_seq_len(args.budget, attention=attention, **kw)
            line = (
                f"largest sequence length in {args.budget:,} bytes ({args.budget / 2**30:,.2f} "
                f"GiB), attention={attention}: {n:,}"
            )
            print(wrap(line, indent="  "))
    return 0


def _jsonable(data: object) -> object:
    """``data`` with what JSON cannot hold (a mask, a dtype) as its text."""
    if isinstance(data, dict):
        return {str(k): _jsonable(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_jsonable(v) for v in data]
    if data is None or isinstance(data, bool | int | float | str):
        return data
    return str(data)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ..analysis import estimate, measure_estimate
    from ..analysis.costs import complexity_parts, complexity_table, io_naive, io_tiled

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
    if args.measure and (args.model or args.infer or args.budget is not None):
        raise UsageError(
            "--measure", "measures the attention layers only; drop --train/--infer/--budget"
        )
    _check_mla(args)
    if args.complexity:
        if args.json:
            rows = complexity_table(args.seq, args.d_model)
            print_json({"n": args.seq, "d": args.d_model, "rows": rows})
        else:
            print(fitted(complexity_parts(args.seq, args.d_model)))
        return 0
    if args.io is not None:
        d = args.d_model // args.heads
        if args.io < 4 * d:
            raise UsageError(
                "--io", f"the fast memory must hold 4·d = {4 * d} elements (d = E/H), got {args.io}"
            )
        naive = io_naive(args.seq, d)
        tiled = io_tiled(args.seq, d, args.io)
        block = args.io // (4 * d)
        if args.json:
            counts = {"naive": naive, "tiled": tiled}
            print_json({"N": args.seq, "d": d, "M": args.io, "B_c": block, **counts})
            return 0
        head = (
            f"slow-memory reads + writes (elements), N={args.seq}, d={d}, fast memory M={args.io:,}"
            f" elements, block B_c=M/(4d)={block:,}:"
        )
        print(
            f"{wrap(head, indent='  ')}\n"
            f"  naive  Θ(Nd + N²):   {naive:,}\n  tiled  Θ(N²d²/M):     {tiled:,}"
            f"  ({naive / tiled:,.2f}× less)"
        )
        return 0
    if args.model or args.infer or args.budget is not None:
        return _cmd_model(args)
    est = estimate(
        args.seq,
        args.d_model,
        args.heads,
        batch=args.batch,
        layers=args.layers,
        dtype=args.dtype,
        kv_heads=args.kv_heads,
        mask=_mask(args),
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
    if args.measure:
        with working("attnlab estimate --measure", quiet=args.quiet or args.json):
            measure_estimate(est, device=args.device)
    mla = None if args.mla is None else _mla_data(args, c["D"])
    if args.json:
        rows = [{"quantity": q, "unit": unit, "values": v} for q, unit, v in est.rows]
        data = {"config": c, "rows": rows, "measured": est.measured}
        print_json(_jsonable(data if mla is None else {**data, "mla": mla}))
        return 0
    config = (
        f"B={c['B']} L={c['L']} S={c['S']} E={c['E']} H={c['H']} H_kv={c['H_kv']} D={c['D']} "
        f"layers={c['layers']} {c['dtype']}: {c['attended_pairs']:,} of {c['dense_pairs']:,} "
        "pairs attended per head"
    )
    print(wrap(config, indent="  ") + "\n")
    print(fitted(est.table_parts()))
    if mla is not None:
        print("\n" + "\n".join(wrap(line, indent="  ") for line in _mla_lines(mla)))
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
    est.add_argument("--d-ff", type=positive_int, default=None, help="MLP width F (default 4E)")
    est.add_argument(
        "--vocab", type=int_at_least(0), default=0, help="vocabulary V (embedding and head)"
    )
    est.add_argument("--mlp", default="gelu", choices=["gelu", "swiglu"])
    mode = est.add_mutually_exclusive_group()
    mode.add_argument(
        "--train", dest="model", action="store_true", help="whole-model costs of a training step"
    )
    mode.add_argument("--infer", action="store_true", help="whole-model costs of inference")
    est.add_argument(
        "--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd-momentum", "none"]
    )
    est.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="memory budget (e.g. 12GB, 12GiB): print the largest sequence length that fits",
    )
    est.add_argument(
        "--complexity", action="store_true", help="the RNN vs self-attention cost table at --seq"
    )
    est.add_argument(
        "--io",
        type=positive_int,
        default=None,
        metavar="M",
        help="IO model of tiled vs naive attention with a fast memory of M elements",
    )
    est.add_argument(
        "--json",
        action="store_true",
        help="print the rows as JSON (with --complexity: its rows; with --io: the counts)",
    )
    est.add_argument(
        "--mla",
        type=_mla,
        default=None,
        metavar="C,R[,Dn,Dv]",
        help=(
            "multi-head latent attention: kv_lora_rank C, rope dims R (nope Dn and value Dv head "
            "dims default to E/H); print its latent cache bytes per token beside a per-head K/V "
            "cache's (DeepSeek-V3: --heads 128 --d-model 16384 --mla 512,64,128,128)"
        ),
    )
    est.add_argument("--quiet", action="store_true", help="no progress line (--measure)")
    add_device_argument(est)
    est.set_defaults(func=_cmd_estimate)
