"""``attnlab experiment``: the textbook experiments (scaling, temperature) as tables and plots."""

from __future__ import annotations

import argparse

from ._args import add_device_argument, check_output_file, int_at_least
from ._output import Col, print_json, table, working, wrap


def _number(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def format_result(result) -> str:
    """An `ExperimentResult` as its title and a table that fits the terminal."""
    columns = [Col(name, right=True) for name in result.columns]
    rows = [[_number(x) for x in r] for r in result.rows]
    return f"{wrap(result.title)}\n{table(columns, rows)}"


def _cmd_experiment(args: argparse.Namespace) -> int:
    from ..analysis import (
        kernel_regression_experiment,
        scaling_experiment,
        temperature_experiment,
    )

    if args.png:
        check_output_file(args.png, "--png", (".png",))
    with working(f"attnlab experiment {args.name}", quiet=args.quiet):
        if args.name == "scaling":
            result = scaling_experiment(samples=args.samples, device=args.device)
            panels_name = "SCALING_PANELS"
        elif args.name == "temperature":
            result = temperature_experiment(samples=args.samples, device=args.device)
            panels_name = "TEMPERATURE_PANELS"
        else:  # kernel-regression: the shipped text decides the sample size
            result = kernel_regression_experiment(device=args.device)
            panels_name = "KERNEL_REGRESSION_PANELS"
    if args.json:
        rows = [dict(zip(result.columns, r, strict=True)) for r in result.rows]
        print_json({"title": result.title, "columns": result.columns, "rows": rows})
    else:
        print(format_result(result))
    if args.png:
        from ..viz import experiments as viz_experiments

        path = viz_experiments.plot_experiment(
            args.png, result, getattr(viz_experiments, panels_name)
        )
        if not args.json:
            print(f"\nwrote {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab experiment`` to the ``attnlab`` command's subparsers."""
    exp = sub.add_parser(
        "experiment",
        help="the textbook experiments: scaling (why 1/√d_k), temperature (with the Gibbs "
        "energies) and kernel regression (attention as Nadaraya–Watson on the Alice text)",
        description="Runs a textbook experiment, prints its table, optionally draws a PNG.",
    )
    exp.add_argument("name", choices=["scaling", "temperature", "kernel-regression"])
    exp.add_argument(
        "--samples",
        type=int_at_least(2),
        default=4096,
        help="samples per point, >= 2 for a variance (default 4096; kernel-regression uses "
        "the whole text)",
    )
    exp.add_argument("--png", default=None, help="also write the plot to this PNG file")
    exp.add_argument("--json", action="store_true", help="print the rows as JSON")
    exp.add_argument("--quiet", action="store_true", help="no progress line")
    add_device_argument(exp)
    exp.set_defaults(func=_cmd_experiment)
