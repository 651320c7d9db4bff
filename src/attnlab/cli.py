"""The ``attnlab`` command. Every subcommand has ``--help``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from . import __version__, masks
from .functional import attention, backends
from .testing import check_against_reference, mean_factor_for, reference_for, seeded

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def progress(items: Sequence, desc: str) -> Iterable:
    """A tqdm progress bar on stderr if tqdm is installed (the ``cli`` extra), else the items."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is part of the cli/dev extras
        return items
    return tqdm(items, desc=desc, file=sys.stderr, leave=False, disable=None)


def _check_cases(B: int, L: int, S: int) -> dict[str, tuple[object, object, dict]]:
    g = torch.Generator().manual_seed(0)
    return {
        "none": (None, None, {}),
        "causal": (masks.causal(), None, {}),
        "sliding_window(7)": (masks.sliding_window(7), None, {}),
        "causal & padding": (masks.causal() & masks.padding([S, S // 2][:B]), None, {}),
        "strided(8)": (masks.strided(8), None, {}),
        "bigbird": (masks.bigbird(16, 3, 1, 1, seed=0), None, {}),
        "bool tensor": (torch.rand(B, 1, L, S, generator=g) > 0.3, None, {}),
        "bias tensor": (None, torch.randn(1, 4, L, S, generator=g, dtype=torch.float64), {}),
        "cosine, T=0.5": (masks.causal(), None, {"score": "cosine", "temperature": 0.5}),
    }


def run_check(backend_names: list[str], dtype_names: list[str], L: int, S: int, out=None) -> int:
    """Compares each backend with the float64 reference; prints a table; returns failures."""
    out = sys.stdout if out is None else out
    B, H, H_kv, D = 2, 4, 2, 40
    rows: list[tuple[str, str, str, str, str]] = []
    failures = 0
    jobs = [(b, c, d) for b in backend_names for c in _check_cases(B, L, S) for d in dtype_names]
    cases = _check_cases(B, L, S)
    for backend, case, dtype_name in progress(jobs, "attnlab check"):
        mask, bias, kw = cases[case]
        dtype = _DTYPES[dtype_name]
        q = seeded(B, H, L, D, dtype=dtype, seed=1)
        k = seeded(B, H_kv, S, D, dtype=dtype, seed=2)
        v = seeded(B, H_kv, S, D, dtype=dtype, seed=3)

        def impl(q, k, v, mask=mask, bias=bias, kw=kw, backend=backend):
            b = bias.to(q.dtype) if isinstance(bias, torch.Tensor) else bias
            return attention(q, k, v, mask=mask, bias=b, backend=backend, **kw)

        try:
            errors = check_against_reference(
                impl,
                reference_for(mask, bias, **kw),
                [q, k, v],
                mean_factor=mean_factor_for(backend, dtype),
            )
            grad_err = max(e for n, e in errors.items() if n != "out")
            rows.append(
                (backend, case, dtype_name, f"{errors['out']:.2e}", f"{grad_err:.2e}", "pass")
            )
        except (AssertionError, ValueError, RuntimeError) as e:
            failures += 1
            rows.append((backend, case, dtype_name, str(e).splitlines()[0][:60], "", "FAIL"))
    header = ("backend", "mask", "dtype", "max err out", "max err grad", "result")
    rows.insert(0, header)
    widths = [max(len(str(r[i])) for r in rows) for i in range(6)]
    for n, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
    total = len(rows) - 1
    print(f"\n{total - failures} passed, {failures} failed", file=out)
    return failures


def _cmd_check(args: argparse.Namespace) -> int:
    names = args.backend or [b for b in backends() if b not in ("reference", "auto")] + ["auto"]
    unknown = [n for n in names if n not in backends()]
    if unknown:
        print(f"attnlab check: unknown backend(s) {unknown}; known: {backends()}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    print(
        f"attnlab {__version__} · torch {torch.__version__} · {torch.get_num_threads()} threads · "
        f"L={args.L}, S={args.S}, B=2, H=4, H_kv=2, D=40 · tolerance rule vs float64 reference\n"
    )
    failures = run_check(names, args.dtype or list(_DTYPES), args.L, args.S)
    print(f"({time.perf_counter() - start:.1f} s)")
    return 1 if failures else 0


def _cmd_estimate(args: argparse.Namespace) -> int:
    from .analysis import estimate, measure_estimate

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
    print(
        f"B={c['B']} L={c['L']} S={c['S']} E={c['E']} H={c['H']} H_kv={c['H_kv']} D={c['D']} "
        f"layers={c['layers']} {c['dtype']}: {c['attended_pairs']:,} of {c['dense_pairs']:,} "
        "pairs attended per head\n"
    )
    if args.measure:
        measure_estimate(est)
    print(est.table())
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    from .analysis import scaling_experiment, temperature_experiment

    if args.name == "scaling":
        result = scaling_experiment(samples=args.samples)
        panels_name = "SCALING_PANELS"
    else:
        result = temperature_experiment(samples=args.samples)
        panels_name = "TEMPERATURE_PANELS"
    print(result.table())
    if args.png:
        from .viz import experiments as viz_experiments

        path = viz_experiments.plot_experiment(
            args.png, result, getattr(viz_experiments, panels_name)
        )
        print(f"\nwrote {path}")
    return 0


def _add_analysis_commands(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser(
        "estimate",
        help="parameters, FLOPs and memory of attention (naive, flash, linear)",
        description=(
            "Estimates parameters, FLOPs and memory of multi-head attention for the naive, tiled "
            "(flash) and linear implementations, counting exactly the attended pairs of the mask."
        ),
    )
    est.add_argument("--seq", type=int, default=1024, help="sequence length L (default 1024)")
    est.add_argument("--d-model", type=int, default=768, help="model dimension E (default 768)")
    est.add_argument("--heads", type=int, default=12, help="attention heads H (default 12)")
    est.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA)")
    est.add_argument("--batch", type=int, default=1)
    est.add_argument("--layers", type=int, default=1)
    est.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"]
    )
    est.add_argument("--causal", action="store_true", help="causal mask")
    est.add_argument("--window", type=int, default=None, help="causal sliding window of W keys")
    est.add_argument(
        "--decode", action="store_true", help="one new token against a KV cache of --seq"
    )
    est.add_argument("--no-bias", action="store_true", help="projections without biases")
    est.add_argument(
        "--measure", action="store_true", help="also run it and print measured time and peak memory"
    )
    est.set_defaults(func=_cmd_estimate)
    exp = sub.add_parser(
        "experiment",
        help="the textbook experiments: scaling (why 1/√d_k) and temperature",
        description="Runs a textbook experiment, prints its table, optionally draws a PNG.",
    )
    exp.add_argument("name", choices=["scaling", "temperature"])
    exp.add_argument("--samples", type=int, default=4096, help="samples per point (default 4096)")
    exp.add_argument("--png", default=None, help="also write the plot to this PNG file")
    exp.set_defaults(func=_cmd_experiment)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnlab`` command."""
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="attnlab: attention mechanisms — exact, fast, verified, easy to inspect.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = sub.add_parser(
        "check",
        help="run every backend against the float64 reference on this machine",
        description=(
            "Runs every backend against the float64 reference (forward and gradients) for a grid "
            "of masks and dtypes, prints backend × mask × dtype → max error and pass/fail under "
            "the tolerance rule, and exits non-zero on any failure."
        ),
    )
    check.add_argument(
        "--backend", action="append", help="backend to check (repeatable; default: all)"
    )
    check.add_argument(
        "--dtype", action="append", choices=list(_DTYPES), help="dtype (repeatable; default: all)"
    )
    check.add_argument("-L", type=int, default=97, help="query length (default 97, odd on purpose)")
    check.add_argument("-S", type=int, default=113, help="key length (default 113)")
    check.set_defaults(func=_cmd_check)
    _add_analysis_commands(sub)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands contributed by other modules: each ``register(subparsers)`` sets ``func``."""
    from .bench import add_bench_parser
    from .train import register_generate, register_train
    from .visualize import register as register_visualize

    return [add_bench_parser, register_train, register_generate, register_visualize]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlab`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
