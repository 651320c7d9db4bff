"""``attnlab check``: every backend against the float64 reference on this machine.

By default the check is quick and shows what applies to this machine and install:

- the calls each backend can run (a call one refuses, such as ``decode`` with gradients, is
  counted in the summary, not listed);
- the dtypes this device computes natively: float64, float32, and bfloat16 / float16 where the
  CPU multiplies them natively (AVX512-BF16 or AMX; AVX512-FP16 or AMX-FP16), all four on an
  accelerator;
- attnlab's C++ kernels as they are: built ones are checked; one that is not built yet is not
  built now (10–40 s each) — its pure-PyTorch engine is checked and the summary says so
  (``attnlab build``, then ``attnlab check``, checks the kernels).

``--all`` checks everything: every dtype, every call (the refused ones listed as ``n/a`` with
the backend's reason) and every kernel (built first where needed). ``--json`` prints the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, TextIO

from ._args import UsageError, add_device_argument, positive_int
from ._output import Col, print_json, steps, table, wrap

DTYPES = ("float64", "float32", "bfloat16", "float16")
COLUMNS = (
    Col("backend"),
    Col("mask"),
    Col("dtype"),
    Col("max err out", right=True),
    Col("max err grad", right=True),
    Col("result", wide=True),
)


def _check_cases(B: int, L: int, S: int) -> dict[str, tuple[object, object, dict, bool]]:
    """``name -> (mask, bias, kwargs, step)``; ``step`` cases are one decode step: a single
    query row, forward only under ``torch.no_grad()``."""
    import torch

    from .. import masks

    g = torch.Generator().manual_seed(0)
    return {
        "none": (None, None, {}, False),
        "causal": (masks.causal(), None, {}, False),
        "sliding_window(7)": (masks.sliding_window(7), None, {}, False),
        "causal & padding": (masks.causal() & masks.padding([S, S // 2][:B]), None, {}, False),
        "strided(8)": (masks.strided(8), None, {}, False),
        "bigbird": (masks.bigbird(16, 3, 1, 1, seed=0), None, {}, False),
        "bool tensor": (torch.rand(B, 1, L, S, generator=g) > 0.3, None, {}, False),
        "bias tensor": (
            None,
            torch.randn(1, 4, L, S, generator=g, dtype=torch.float64),
            {},
            False,
        ),
        "cosine, T=0.5": (masks.causal(), None, {"score": "cosine", "temperature": 0.5}, False),
        "decode step": (None, None, {}, True),
        "decode step, padding": (masks.padding([S, S // 2][:B]), None, {}, True),
    }


def native_dtypes(device: Any = "cpu") -> list[str]:
    """The dtypes of `DTYPES` that ``device`` computes natively: all on an accelerator; on the
    cpu float64, float32 and the 16-bit types whose products the CPU has units for."""
    import torch

    from .. import _ext

    if torch.device(device).type != "cpu":
        return list(DTYPES)
    return [name for name in DTYPES if _ext.native_products(getattr(torch, name))]


def _unsupported(backend: str, inputs: list[Any], step: bool, **kw: object) -> str:
    """Why ``backend`` cannot run the call (gradients on unless ``step``), or "" if it can."""
    import torch

    from ..functional import explain

    if backend == "auto":
        return ""
    q, k, v = (x.detach().requires_grad_(not step) for x in inputs)
    with torch.set_grad_enabled(not step):
        try:
            explain(q, k, v, backend=backend, **kw)
        except ValueError as e:
            return str(e).split("cannot run this call: ", 1)[-1]
    return ""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def check_rows(
    backend_names: list[str],
    dtype_names: list[str],
    L: int,
    S: int,
    *,
    device: Any = "cpu",
    quiet: bool = True,
) -> list[dict[str, Any]]:
    """Compares each backend with the float64 reference on every case and dtype.

    Inputs are drawn on the CPU generator (the same values on every device) and moved to
    ``device``, where the backends and the reference both run.

    Returns:
        One dict per (backend, case, dtype): ``backend``, ``mask``, ``dtype``, ``max_err_out``
        and ``max_err_grad`` (floats, None when not computed), ``result`` (``"pass"``,
        ``"FAIL"`` or ``"n/a"``) and ``reason`` (why it failed or cannot run, whole; "" for a
        pass).
    """
    import torch

    from ..functional import attention
    from ..testing import check_against_reference, mean_factor_for, reference_for, seeded

    B, H, H_kv, D = 2, 4, 2, 40
    rows: list[dict[str, Any]] = []
    cases = _check_cases(B, L, S)
    jobs = [(b, c, d) for b in backend_names for c in cases for d in dtype_names]
    for backend, case, dtype_name in steps(jobs, desc="attnlab check", quiet=quiet):
        mask, bias, kw, step = cases[case]
        dtype = getattr(torch, dtype_name)
        row: dict[str, Any] = {"backend": backend, "mask": case, "dtype": dtype_name}
        row.update(max_err_out=None, max_err_grad=None, result="pass", reason="")
        q = seeded(B, H, 1 if step else L, D, dtype=dtype, seed=1, device=device)
        k = seeded(B, H_kv, S, D, dtype=dtype, seed=2, device=device)
        v = seeded(B, H_kv, S, D, dtype=dtype, seed=3, device=device)
        if isinstance(bias, torch.Tensor):
            bias = bias.to(device)
        b = bias.to(dtype) if isinstance(bias, torch.Tensor) else bias
        if isinstance(mask, torch.Tensor):
            mask = mask.to(device)
        why_not = _unsupported(backend, [q, k, v], step, mask=mask, bias=b, **kw)
        if why_not:
            rows.append({**row, "result": "n/a", "reason": _one_line(why_not)})
            continue

        def impl(q, k, v, mask=mask, b=b, kw=kw, backend=backend, step=step):
            with torch.set_grad_enabled(not step):
                return attention(q, k, v, mask=mask, bias=b, backend=backend, **kw)

        try:
            errors = check_against_reference(
                impl,
                reference_for(mask, bias, **kw),
                [q, k, v],
                grads=not step,
                mean_factor=mean_factor_for(backend, dtype),
            )
        except (AssertionError, ValueError, RuntimeError) as e:
            rows.append({**row, "result": "FAIL", "reason": _one_line(e)})
            continue
        grad_err = max((e for n, e in errors.items() if n != "out"), default=None)
        rows.append({**row, "max_err_out": errors["out"], "max_err_grad": grad_err})
    return rows


def _cell(x: float | None) -> str:
    return "" if x is None else f"{x:.2e}"


def format_rows(rows: list[dict[str, Any]], *, show_na: bool) -> str:
    """The rows as a table that fits the terminal (``n/a`` rows only with ``show_na``); a
    failure's or a refusal's reason is printed whole in the result column."""
    body = [
        (
            r["backend"],
            r["mask"],
            r["dtype"],
            _cell(r["max_err_out"]),
            _cell(r["max_err_grad"]),
            r["result"] + (f": {r['reason']}" if r["reason"] else ""),
        )
        for r in rows
        if show_na or r["result"] != "n/a"
    ]
    return table(COLUMNS, body)


def summary(rows: list[dict[str, Any]], *, show_na: bool) -> str:
    """``N passed, M failed, K not supported`` (+ where the unlisted ones are)."""
    count = {k: sum(r["result"] == k for r in rows) for k in ("pass", "FAIL", "n/a")}
    text = f"{count['pass']} passed, {count['FAIL']} failed, {count['n/a']} not supported"
    if count["n/a"] and not show_na:
        text += " (calls a backend refuses, e.g. decode with gradients; --all lists them)"
    return text


def run_check(
    backend_names: list[str],
    dtype_names: list[str],
    L: int,
    S: int,
    out: TextIO | None = None,
    *,
    device: Any = "cpu",
    show_na: bool = True,
    quiet: bool = True,
    as_json: bool = False,
) -> int:
    """Compares each backend with the float64 reference (`check_rows`) and prints the table and
    the summary (with ``as_json``, the rows as JSON) on ``out`` (default stdout).

    Returns:
        The number of failures.
    """
    out = sys.stdout if out is None else out
    rows = check_rows(backend_names, dtype_names, L, S, device=device, quiet=quiet)
    if as_json:
        print_json(rows, out)
    else:
        print(format_rows(rows, show_na=show_na), file=out)
        print("\n" + wrap(summary(rows, show_na=show_na), indent="  "), file=out)
    return sum(r["result"] == "FAIL" for r in rows)


def _unbuilt_kernels() -> list[str]:
    """attnlab's C++ kernels that are not built yet (a call that needs one would build it)."""
    from .. import _ext

    return [name for name in _ext.KERNELS if _ext.state(name).startswith("not built yet")]


def _cmd_check(args: argparse.Namespace) -> int:
    if args.env:
        from .info import environment, print_environment

        print_environment(environment())
        return 0
    import torch

    from .. import __version__, _ext
    from ..functional import backends
    from ..utils import Timer

    names = args.backend or [b for b in backends() if b not in ("reference", "auto")] + ["auto"]
    unknown = [n for n in names if n not in backends()]
    if unknown:
        known = ", ".join(backends())
        raise UsageError("--backend", f"unknown backend(s) {unknown} (choose from {known})")
    dtypes = args.dtype or (list(DTYPES) if args.all else native_dtypes(args.device))
    skipped_dtypes = [] if args.dtype or args.all else [d for d in DTYPES if d not in dtypes]
    unbuilt = [] if args.all else _unbuilt_kernels()
    timer = Timer()
    if not args.json:
        head = (
            f"attnlab {__version__} · torch {torch.__version__} · {torch.get_num_threads()} "
            f"threads · {args.device} · L={args.L}, S={args.S}, B=2, H=4, H_kv=2, D=40 · "
            "tolerance rule vs float64 reference"
        )
        print(wrap(head) + "\n")
    # By default an unbuilt C++ kernel is not built here (its pure-PyTorch engine is checked).
    building = contextlib.nullcontext() if args.all else _ext.reporting()
    with building:
        failures = run_check(
            names,
            dtypes,
            args.L,
            args.S,
            device=args.device,
            show_na=args.all,
            quiet=args.quiet,
            as_json=args.json,
        )
    if args.json:
        return 1 if failures else 0
    notes = []
    if skipped_dtypes:
        notes.append(
            f"not checked: {', '.join(skipped_dtypes)} (this CPU has no native units for "
            "it; --dtype NAME or --all checks it)"
        )
    if unbuilt:
        notes.append(
            f"C++ kernels not built yet: {', '.join(unbuilt)} — their pure-PyTorch engines were "
            "checked; `attnlab build` builds them (10–40 s each, once per machine), then "
            "`attnlab check` checks them (--all builds and checks them in one run)"
        )
    for note in notes:
        print(wrap(note))
    print(f"({timer.seconds:.1f} s)")
    return 1 if failures else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab check`` to the ``attnlab`` command's subparsers."""
    check = sub.add_parser(
        "check",
        help="run every backend against the float64 reference on this machine",
        description=(
            "Runs every backend against the float64 reference (forward and gradients) for a grid "
            "of masks and dtypes, prints backend × mask × dtype → max error and pass/fail under "
            "the tolerance rule, and exits non-zero on any failure. By default it is quick and "
            "shows what applies here: the calls each backend can run, the dtypes this machine "
            "computes natively, and the C++ kernels that are built (an unbuilt one is not built "
            "now; its pure-PyTorch engine is checked). --all checks everything."
        ),
    )
    check.add_argument(
        "--backend", action="append", help="backend to check (repeatable; default: all)"
    )
    check.add_argument(
        "--dtype",
        action="append",
        choices=list(DTYPES),
        help="dtype (repeatable; default: those this machine computes natively)",
    )
    check.add_argument(
        "-L", type=positive_int, default=97, help="query length (default 97, odd on purpose)"
    )
    check.add_argument("-S", type=positive_int, default=113, help="key length (default 113)")
    check.add_argument(
        "--all",
        action="store_true",
        help="check everything: every dtype, every call (those a backend refuses listed as "
        "n/a with its reason), every C++ kernel (built first where needed)",
    )
    check.add_argument("--json", action="store_true", help="print the rows as JSON")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(check)
    check.add_argument(
        "--env",
        action="store_true",
        help="only print the machine as attnlab sees it (as `attnlab info`) and exit",
    )
    check.set_defaults(func=_cmd_check)
