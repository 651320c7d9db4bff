"""`attnlab bench`: the flash backend against its anchors, measured side by side in one run.

Each case times every contender in the same process, interleaved round by round (so machine noise
hits them alike), keeps the best of ``--repeats`` rounds, checks every contender's output against
flash's (max|Δ| judged against the dtype's tolerance), and prints ratios. "Useful GFLOP/s"
counts only attended pairs, ``4·B·H·pairs·D / seconds`` (`Mask.attended_pairs`); the matmul rate
of each measured dtype (``torch.mm`` on 4096² matrices of that dtype, smaller where that would
take over 2 s: `matmul_size`) is measured in the same run
as the physical limit, and the header names the CPU and its matrix units (AMX, AVX512-FP16/BF16).

Every case runs in each ``--dtype`` (float32 by default; bfloat16, float16; several in one run),
all contenders in that dtype. Timing is wall clock, or this process's CPU time with ``--clock
cpu`` (with ``--threads 1``: the uncontended time on a shared machine). ``--calibrate`` measures
``backend="auto"``'s thresholds per dtype instead and caches them
(`attnlab.analysis.calibrate`).

Cases (B=1, H=8, D=64):

- ``window``: causal sliding window (256) at L=16384 — flash vs sdpa with the dense bool mask,
  compiled FlexAttention with a BlockMask, local-attention, and the naive formula (when its L×S
  matrices fit in memory), and the kernel bound: one SDPA call on the (block, block+window−1)
  tiles flash's band forward uses, batched (a target is beyond the machine only with it);
- ``causal``: dense causal at L=8192 — flash vs sdpa ``is_causal=True``;
- ``documents``: packed documents, ``causal() & document.from_lengths([2048] * 8)`` at L=16384 —
  flash vs sdpa with the dense mask and compiled FlexAttention (the mask's own
  `Mask.mask_mod`), forward and forward + backward, and flash's peak memory (subprocess);
- ``bigbird``: BigBird (blocks of 64, window 3, 2 global, 3 random) at L=16384 — the same
  contenders and memory row;
- ``alibi``: ALiBi + causal at L=16384 — flash (one relative-bias tile per window offset) vs sdpa
  with the materialised bias, forward and forward + backward, and flash's peak memory;
- ``memory``: forward + backward of causal attention at L=65536, peak RSS growth (subprocess).

Optional dependencies are imported where used: tqdm (progress, ``cli`` extra), matplotlib
(``--plot``), local-attention (a benchmark anchor, ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ._args import (
    UsageError,
    add_device_argument,
    check_output_file,
    nonnegative_float,
    positive_int,
)
from ._lazy import lazy_attributes
from ._output import Col, print_json, steps, table, wrap

CASES = ("window", "causal", "documents", "bigbird", "alibi", "memory")
#: ``--dtype`` choices and ``--clock`` choices (`attnlab.cli._bench_rows.DTYPES`, `CLOCKS`).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
CLOCK_NAMES = ("wall", "cpu")
#: File types ``--plot`` can write (matplotlib's raster and vector formats).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
#: Sequence length of each case (``--window-length`` etc.); ``--quick`` divides the ones not given.
LENGTHS = {
    "window_length": 16384,
    "causal_length": 8192,
    "documents_length": 16384,
    "bigbird_length": 16384,
    "alibi_length": 16384,
    "memory_length": 65536,
}
#: What `attnlab.cli._bench_cases` measures with (it imports torch): attributes of this module,
#: loaded on first use, so ``attnlab bench --help`` imports no torch. `run_bench` looks them up
#: on the module, so a stand-in set on it (a test's) is what runs.
_MEASURING = (
    "CLOCKS",
    "DTYPES",
    "SHORT",
    "Report",
    "Row",
    "case_alibi",
    "case_bigbird",
    "case_causal",
    "case_documents",
    "case_memory",
    "case_window",
    "interleaved",
    "matmul_rate",
    "matmul_size",
)
COLUMNS = (
    Col("case"),
    Col("dtype"),
    Col("contender"),
    Col("seconds", right=True),
    Col("useful GF/s", right=True),
    Col("% mm", right=True),
    Col("flash is ×", right=True),
    Col("note", wide=True),
)


__getattr__ = lazy_attributes(__name__, dict.fromkeys(_MEASURING, "._bench_cases"))


class _CaseSteps:
    """What the cases report their timed calls to: the bar counts cases (so it ends at its
    total, whatever contenders a case finds to time) and shows the call being timed."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def step(self, what: str | None = None) -> None:
        if what:
            self.bar.set_postfix(now=what[:60])


# --------------------------------------------------------------------------- output
def _rate(gflops: float) -> str:
    """A rate as printed: whole GFLOP/s, two significant digits below 10 (never a bare 0)."""
    return f"{gflops:.0f}" if gflops >= 10 else f"{gflops:.2g}"


def matrix_units(flags: frozenset[str] | set[str]) -> str:
    """The header's matrix-unit line: AMX flags, AVX512-FP16, AVX512-BF16."""
    amx = sorted(f for f in flags if f.startswith("amx"))
    return (
        f"AMX: {', '.join(amx) if amx else 'no'}; "
        f"AVX512-FP16: {'yes' if 'avx512_fp16' in flags else 'no'}; "
        f"AVX512-BF16: {'yes' if 'avx512_bf16' in flags else 'no'}"
    )


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def format_table(report) -> str:
    """The results as a table that fits the terminal, with speed-ups against flash within each
    case; the header lines (machine, cpu, matmul rates) wrap like the notes."""
    lines = [
        wrap(f"machine: {report.info.get('machine', '')}", indent="  "),
        wrap(f"cpu: {report.info.get('cpu', '')}", indent="  "),
    ]
    for name, rate in report.matmul_gflops.items():
        n = report.matmul_size.get(name, 4096)
        lines.append(
            wrap(
                f"{_short(name)} matmul (torch.mm {n}², {name}): {_rate(rate)} GFLOP/s  "
                "<- the physical limit",
                indent="  ",
            )
        )
    lines.append("")
    rows: list[tuple[str, ...] | None] = []
    by_case: dict[tuple[str, str], list] = {}
    for r in report.rows:
        by_case.setdefault((r.case, r.dtype), []).append(r)
    for (case, dtype), case_rows in by_case.items():
        flash = next((r.seconds for r in case_rows if r.name == "flash"), None)
        mm = report.matmul_gflops.get(dtype)
        for r in case_rows:
            gf = r.useful_gflops
            ratio = ""
            if flash and r.seconds and r.name != "flash":
                ratio = f"{r.seconds / flash:.2f}×"
            note = r.note
            if r.max_err is not None:
                judged = {True: "ok", False: "EXCEEDS", None: ""}[r.within_tolerance]
                tol = f" {judged} (tol {r.tolerance:.1e})" if judged else ""
                note = (note + "; " if note else "") + f"max|Δ| vs flash {r.max_err:.1e}{tol}"
            rows.append(
                (
                    case,
                    _short(dtype),
                    r.name,
                    f"{r.seconds:.3f}" if r.seconds is not None else "n/a",
                    f"{gf:.1f}" if gf else "",
                    f"{100 * gf / mm:.0f}%" if gf and mm else "",
                    ratio,
                    note,
                )
            )
        rows.append(None)
    lines.append(table(COLUMNS, rows[:-1]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``attnlab bench`` on an argparse ``subparsers`` object and returns its parser."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the flash backend against sdpa, FlexAttention, local-attention, naive",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--case",
        choices=[*CASES, "all"],
        nargs="+",
        default=["all"],
        help="which cases to run (default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        nargs="+",
        default=["float32"],
        help="the dtype(s) of every contender (default: float32); several run one after another",
    )
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument(
        "--window", type=positive_int, default=256, help="sliding-window size (keys per query)"
    )
    for name, default in LENGTHS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=positive_int,
            default=None,
            help=f"default {default} ({default // 8} with --quick)",
        )
    p.add_argument(
        "--doc-length",
        type=positive_int,
        default=None,
        help="tokens per packed document in the documents case (default 2048, 256 with --quick)",
    )
    p.add_argument(
        "--max-bias-gb",
        type=nonnegative_float,
        default=10.0,
        help="skip sdpa with a materialised bias above this size",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed rounds per contender (best kept)"
    )
    p.add_argument(
        "--clock",
        choices=CLOCK_NAMES,
        default="wall",
        help="wall clock, or this process's CPU time (cpu; with --threads 1 on a shared machine)",
    )
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--no-flex", action="store_true", help="skip compiling FlexAttention")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (default L/8, at least 256) for a smoke run; lengths given explicitly "
        "are kept; the targets are for the defaults",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="instead of the cases: measure backend='auto''s flash/sdpa crossovers in each "
        "--dtype and cache them (python -m attnlab.analysis.calibrate)",
    )
    p.add_argument("--plot", metavar="PNG", help="also write a bar chart")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print the rows as JSON instead of the table, or with PATH also write them there",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    add_device_argument(p)
    p.set_defaults(func=run_bench)
    return p


def run_bench(args: argparse.Namespace) -> int:
    """Runs the selected cases in every dtype, prints the table; returns the exit code."""
    import torch

    from ..functional.thresholds import cpu_info

    this = sys.modules[__name__]  # the measuring pieces, looked up where a test can replace them
    cases = list(CASES) if "all" in args.case else list(dict.fromkeys(args.case))
    dtypes = list(dict.fromkeys(args.dtype))
    if args.json not in (None, "-"):
        check_output_file(args.json, "--json")
    if args.plot:
        check_output_file(args.plot, "--plot", PLOT_SUFFIXES)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.calibrate:
        from ..analysis.calibrate import calibrate

        calibrate(dtypes, repeats=args.repeats, threads=args.threads or 1)
        return 0
    for name, default in LENGTHS.items():  # explicit lengths are kept, --quick or not
        if getattr(args, name, None) is None:
            setattr(args, name, max(256, default // 8) if args.quick else default)
    report = this.Report()
    model, flags = cpu_info()
    report.info["machine"] = (
        f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"device {args.device}, {args.clock} clock"
    )
    report.info["cpu"] = f"{model}; {matrix_units(flags)}"
    report.info["command"] = "attnlab bench " + " ".join(sys.argv[2:])
    if args.doc_length is None:
        args.doc_length = 256 if args.quick else 2048
    if args.documents_length % args.doc_length:
        raise UsageError(
            "--documents-length",
            f"must be a multiple of --doc-length={args.doc_length}, got {args.documents_length}",
        )
    runners = {name: getattr(this, f"case_{name}") for name in CASES}
    clock = this.CLOCKS[args.clock]
    # one step per dtype's matmul rate and per case: the bar ends at its total
    bar = steps(total=len(dtypes) * (1 + len(cases)), desc="attnlab bench", quiet=args.quiet)
    progress = _CaseSteps(bar)
    with bar:
        for name_dt in dtypes:
            args.run_dtype = this.DTYPES[name_dt]
            progress.step(f"{name_dt} matmul rate")
            n = this.matmul_size(args.run_dtype, args.device, clock=clock)
            report.matmul_size[name_dt] = n
            report.matmul_gflops[name_dt] = this.matmul_rate(
                n=n, device=args.device, dtype=args.run_dtype, clock=clock
            )
            bar.step()
            for name in cases:
                runners[name](args, report, progress)
                bar.step()
    _write(args, report, multi_dtype=len(dtypes) > 1)
    return 0


def _write(args: argparse.Namespace, report, *, multi_dtype: bool) -> None:
    """The table (or with ``--json`` alone the JSON) on stdout, then the files asked for."""
    data = {
        "matmul_gflops": report.matmul_gflops,
        "info": report.info,
        "rows": [r.to_dict() for r in report.rows],
    }
    if args.json == "-":
        print_json(data)
    else:
        print(format_table(report))
    if args.json not in (None, "-"):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        from ..viz.bench import plot_bench

        rows = report.rows
        if multi_dtype:  # one panel per case and dtype
            rows = [replace(r, case=f"{r.case} {_short(r.dtype)}") for r in rows]
        plot_bench(rows, args.plot)
        if args.json != "-":
            print(f"wrote {args.plot}")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``benchmarks/bench_flash.py``): ``main(["bench", ...])``, the
    ``attnlab`` command's entry point (same errors and exit codes)."""
    from . import main as attnlab_main

    return attnlab_main(argv)
