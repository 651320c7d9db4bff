"""``attnlab check``: every backend against the float64 reference on this machine."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import torch

from .. import __version__, masks
from ..functional import attention, backends, explain
from ..testing import check_against_reference, mean_factor_for, reference_for, seeded
from ..utils import Timer, progress, text_table
from ._args import UsageError, add_device_argument, positive_int

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _check_cases(B: int, L: int, S: int) -> dict[str, tuple[object, object, dict, bool]]:
    """``name -> (mask, bias, kwargs, step)``; ``step`` cases are one decode step: a single
    query row, forward only under ``torch.no_grad()``."""
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


def _unsupported(backend: str, inputs: list[torch.Tensor], step: bool, **kw: object) -> str:
    """Why ``backend`` cannot run the call (gradients on unless ``step``), or "" if it can."""
    if backend == "auto":
        return ""
    q, k, v = (x.detach().requires_grad_(not step) for x in inputs)
    with torch.set_grad_enabled(not step):
        try:
            explain(q, k, v, backend=backend, **kw)
        except ValueError as e:
            return str(e).split("cannot run this call: ", 1)[-1]
    return ""


def run_check(
    backend_names: list[str],
    dtype_names: list[str],
    L: int,
    S: int,
    out: TextIO | None = None,
    *,
    device: torch.device | str = "cpu",
) -> int:
    """Compares each backend with the float64 reference; prints a table; returns failures.

    A call a backend does not support (e.g. ``"decode"`` with gradients) is listed as ``n/a``
    with the reason, not as a failure. Inputs are drawn on the CPU generator (the same values on
    every device) and moved to ``device``, where the backends and the reference both run.
    """
    out = sys.stdout if out is None else out
    B, H, H_kv, D = 2, 4, 2, 40
    rows: list[tuple[str, str, str, str, str, str]] = []
    failures = skipped = 0
    cases = _check_cases(B, L, S)
    jobs = [(b, c, d) for b in backend_names for c in cases for d in dtype_names]
    for backend, case, dtype_name in progress(
        jobs, desc="attnlab check", leave=False, tty_only=True
    ):
        mask, bias, kw, step = cases[case]
        dtype = DTYPES[dtype_name]
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
            skipped += 1
            rows.append((backend, case, dtype_name, "", "", f"n/a: {why_not[:60]}"))
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
            grad_err = max((e for n, e in errors.items() if n != "out"), default=None)
            grad_cell = "" if grad_err is None else f"{grad_err:.2e}"
            rows.append((backend, case, dtype_name, f"{errors['out']:.2e}", grad_cell, "pass"))
        except (AssertionError, ValueError, RuntimeError) as e:
            failures += 1
            rows.append((backend, case, dtype_name, str(e).splitlines()[0][:60], "", "FAIL"))
    header = ("backend", "mask", "dtype", "max err out", "max err grad", "result")
    print(text_table(header, rows), file=out)
    done = len(rows) - skipped
    print(f"\n{done - failures} passed, {failures} failed, {skipped} not supported", file=out)
    return failures


def _cmd_check(args: argparse.Namespace) -> int:
    if args.env:
        from .info import environment, print_environment

        print_environment(environment())
        return 0
    names = args.backend or [b for b in backends() if b not in ("reference", "auto")] + ["auto"]
    unknown = [n for n in names if n not in backends()]
    if unknown:
        known = ", ".join(backends())
        raise UsageError("--backend", f"unknown backend(s) {unknown} (choose from {known})")
    timer = Timer()
    print(
        f"attnlab {__version__} · torch {torch.__version__} · {torch.get_num_threads()} threads · "
        f"{args.device} · L={args.L}, S={args.S}, B=2, H=4, H_kv=2, D=40 · tolerance rule vs "
        "float64 reference\n"
    )
    failures = run_check(names, args.dtype or list(DTYPES), args.L, args.S, device=args.device)
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
            "the tolerance rule, and exits non-zero on any failure."
        ),
    )
    check.add_argument(
        "--backend", action="append", help="backend to check (repeatable; default: all)"
    )
    check.add_argument(
        "--dtype", action="append", choices=list(DTYPES), help="dtype (repeatable; default: all)"
    )
    check.add_argument(
        "-L", type=positive_int, default=97, help="query length (default 97, odd on purpose)"
    )
    check.add_argument("-S", type=positive_int, default=113, help="key length (default 113)")
    add_device_argument(check)
    check.add_argument(
        "--env",
        action="store_true",
        help="only print the machine as attnlab sees it (as `attnlab info`) and exit",
    )
    check.set_defaults(func=_cmd_check)
