"""``attnlab experiment``: the textbook experiments (scaling, temperature, kernel regression) as
tables and plots, and the lab's reproductions of published results (`attnlab.lab`) with a
verdict computed from the run."""

from __future__ import annotations

import argparse
from pathlib import Path

import tomllib

from ._args import (
    UsageError,
    add_device_argument,
    check_output_dir,
    check_output_file,
    int_at_least,
)
from ._output import Col, print_json, steps, table, working, wrap

TEXTBOOK = ("scaling", "temperature", "kernel-regression")
#: The lab's entries (`attnlab.lab.registry` reads the same file; --help imports no library).
LAB_TABLE = Path(__file__).resolve().parent.parent / "lab" / "experiments.toml"


def lab_experiments() -> dict[str, str]:
    """``{name: summary}`` of the lab's experiments, in the file's order."""
    rows = tomllib.loads(LAB_TABLE.read_text(encoding="utf-8"))["experiment"]
    return {row["name"]: row["summary"] for row in rows}


def _number(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def format_result(result) -> str:
    """An `ExperimentResult` (or a lab result's table) as its title and a table that fits the
    terminal."""
    columns = [Col(name, right=True) for name in result.columns]
    rows = [[_number(x) for x in r] for r in result.rows]
    return f"{wrap(result.title)}\n{table(columns, rows)}"


def _textbook(args: argparse.Namespace) -> int:
    from ..analysis import (
        kernel_regression_experiment,
        scaling_experiment,
        temperature_experiment,
    )

    if args.png:
        check_output_file(args.png, "--png", (".png",))
    samples = 4096 if args.samples is None else args.samples
    with working(f"attnlab experiment {args.name}", quiet=args.quiet):
        if args.name == "scaling":
            result = scaling_experiment(samples=samples, device=args.device)
            panels_name = "SCALING_PANELS"
        elif args.name == "temperature":
            result = temperature_experiment(samples=samples, device=args.device)
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


def _lab(args: argparse.Namespace) -> int:
    from ..lab import LabSettings, run_experiment

    out = check_output_dir(args.out, "--out") if args.out else None
    settings = LabSettings(
        quick=args.quick, full=args.full, seeds=args.seeds, device=str(args.device)
    )
    bar = steps(desc=f"attnlab experiment {args.name}", quiet=args.quiet)
    with bar:
        result = run_experiment(args.name, settings, progress=bar)
    written = result.write(out) if out is not None else []
    if args.json:
        print_json(result.as_dict())
        return 0
    columns, rows = result.table
    if columns:
        print(
            table(
                [Col(c, right=i > 0) for i, c in enumerate(columns)],
                [[_number(x) for x in r] for r in rows],
            )
        )
        print()
    print(wrap(str(result.verdict)))
    print(result.footer())
    for path in written:
        print(f"wrote {path}")
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    if args.name in TEXTBOOK:
        for flag, given in (
            ("--quick", args.quick),
            ("--full", args.full),
            ("--seeds", args.seeds is not None),
            ("--out", args.out),
        ):
            if given:
                raise UsageError(
                    flag,
                    f"applies to the lab experiments "
                    f"({', '.join(lab_experiments())}), not to {args.name!r}",
                )
        return _textbook(args)
    for flag, given in (("--samples", args.samples is not None), ("--png", args.png)):
        if given:
            raise UsageError(
                flag,
                f"applies to {', '.join(TEXTBOOK)}, not to {args.name!r} "
                "(a lab experiment writes its PNGs with --out DIR)",
            )
    if args.quick and args.full:
        raise UsageError("--full", "expected at most one of --quick and --full, received both")
    return _lab(args)


def _epilog() -> str:
    import textwrap

    lines = ["lab experiments (published results, a verdict computed from the run):"]
    for name, summary in lab_experiments().items():
        lines += textwrap.wrap(
            f"{name}: {summary}", width=78, initial_indent="  ", subsequent_indent="      "
        )
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab experiment`` to the ``attnlab`` command's subparsers."""
    exp = sub.add_parser(
        "experiment",
        help="the textbook experiments (scaling, temperature, kernel regression) and the lab: "
        "published results about attention reproduced with a verdict",
        description="Runs a textbook experiment (prints its table, optionally a PNG) or a lab "
        "experiment (trains small models over seeds, prints the paper's claim and the verdict "
        "computed from the run, writes metrics.json and PNGs with --out).",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("name", choices=[*TEXTBOOK, *lab_experiments()])
    exp.add_argument(
        "--samples",
        type=int_at_least(2),
        default=None,
        help="textbook scaling/temperature: samples per point, >= 2 for a variance (default "
        "4096; kernel-regression uses the whole text)",
    )
    exp.add_argument("--png", default=None, help="textbook: also write the plot to this PNG")
    exp.add_argument("--quick", action="store_true", help="lab: the <= 1 minute version")
    exp.add_argument("--full", action="store_true", help="lab: the paper's whole grid (long)")
    exp.add_argument(
        "--seeds", type=int_at_least(1), default=None, help="lab: runs per configuration"
    )
    exp.add_argument("--out", default=None, help="lab: write metrics.json and PNGs here")
    exp.add_argument("--json", action="store_true", help="print the result as JSON")
    exp.add_argument("--quiet", action="store_true", help="no progress line")
    add_device_argument(exp)
    exp.set_defaults(func=_cmd_experiment)
