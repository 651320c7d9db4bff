"""The call path of one warm `attnlab.attention` call: library files, hops, longest function.

Runs ``attnlab.attention(q, k, v, mask=..., bias=..., backend=...)`` twice to warm it (plan
cache, kernel loading), then once more under `sys.setprofile` and reports, over the Python
functions of the ``attnlab`` package that the call enters:

- ``files``: the library files entered (``src/attnlab/...``, relative to the package);
- ``hops``: the calls that cross from one library file into another (the caller is the nearest
  library frame on the stack: a call that torch makes back into the library, such as an autograd
  ``Function.forward``, counts from the library file that called torch);
- ``edges``: the distinct ``caller file → callee file`` pairs among those hops;
- ``longest``: the longest function entered, as ``(lines, "file:function")``; a function's
  lines run from its ``def`` (or first decorator) to its last line, minus its docstring;
- ``over``: every function entered that is longer than `LONG` lines.

With ``grad=True`` q, k and v require grad and the measured call also runs ``out.sum()``'s
backward (torch runs a CPU backward on the calling thread, so the profile sees it).

The C++ kernels are on or off per process (``ATTNLAB_EXT=off``: `attnlab._ext.mode`), so
`measure_all` runs one subprocess per setting; ``python benchmarks/call_path.py`` prints the
table for both settings (``--json`` for the raw records); ``--time`` prints what one warm call
of each case costs in this process instead. Importable by the tests (tests/test_call_path.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import CodeType, FrameType

CASES = ("causal", "sliding_window", "document", "bool_tensor", "alibi")
"""The masks the call-path limit is held for (tests/test_call_path.py)."""

LONG = 60
"""A function on the path longer than this many lines (docstring excluded) is listed in
``over``."""

B, H, L, D = 1, 2, 512, 32
WINDOW = 64


def _package_dir() -> str:
    import attnlab

    return str(Path(attnlab.__file__).resolve().parent)


def make_call(case: str, grad: bool) -> tuple[tuple, dict]:
    """The arguments ``(q, k, v), kwargs`` of the call for one case (a fixed seed)."""
    import torch

    import attnlab
    from attnlab import masks
    from attnlab.positional import ALiBi

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3))
    kwargs: dict[str, object] = {}
    if case == "causal":
        kwargs["mask"] = masks.causal()
    elif case == "sliding_window":
        kwargs["mask"] = masks.sliding_window(WINDOW)
    elif case == "document":
        ids = torch.arange(L).div(L // 4, rounding_mode="floor").unsqueeze(0)  # (1, L): 4 docs
        kwargs["mask"] = masks.document(ids) & masks.causal()
    elif case == "bool_tensor":
        kwargs["mask"] = torch.rand(L, L, generator=g) < 0.5  # (L, S)
        kwargs["mask"][:, 0] = True
    elif case == "alibi":
        kwargs["mask"] = masks.causal()
        kwargs["bias"] = ALiBi(H)
    else:
        raise ValueError(f"unknown case {case!r}; one of {CASES}")
    del attnlab
    return (q, k, v), kwargs


@cache
def _function_lines(filename: str) -> dict[int, tuple[int, str]]:
    """``first line -> (lines without docstring, qualified name)`` of every function in a file.

    The first line is the ``def`` line's or the first decorator's (a code object's
    ``co_firstlineno`` is either, depending on the Python version: both are keyed).
    """
    tree = ast.parse(Path(filename).read_text(encoding="utf-8"))
    found: dict[int, tuple[int, str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                lines = (child.end_lineno or child.lineno) - start + 1
                doc = child.body[0] if child.body else None
                if (
                    isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)
                ):
                    lines -= (doc.end_lineno or doc.lineno) - doc.lineno + 1
                name = f"{prefix}{child.name}"
                found[start] = found[child.lineno] = (lines, name)
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def profile_path(call: Callable[[], object], package: str) -> dict[str, object]:
    """Profiles ``call()`` and summarises the library functions it enters (see the module)."""
    root = package + os.sep
    files: list[str] = []
    hops = 0
    edges: set[tuple[str, str]] = set()
    codes: set[CodeType] = set()

    def rel(filename: str) -> str:
        return filename[len(root) :]

    def hook(frame: FrameType, event: str, _arg: object) -> None:  # sys.setprofile's signature
        nonlocal hops
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(root):
            return
        here = rel(filename)
        if here not in files:
            files.append(here)
        codes.add(frame.f_code)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(root):
            caller = caller.f_back
        if caller is not None:
            there = rel(caller.f_code.co_filename)
            if there != here:
                hops += 1
                edges.add((there, here))

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    longest = (0, "")
    over: set[str] = set()
    for code in codes:
        entry = _function_lines(code.co_filename).get(code.co_firstlineno)
        if entry is None:
            continue
        where = f"{rel(code.co_filename)}:{entry[1]}"
        if entry[0] > LONG:
            over.add(f"{where} ({entry[0]})")
        if entry[0] > longest[0]:
            longest = (entry[0], where)
    return {
        "files": files,
        "hops": hops,
        "edges": sorted(f"{a} -> {b}" for a, b in edges),
        "longest": list(longest),
        "over": sorted(over),
    }


def measure(case: str, grad: bool, backend: str = "flash") -> dict[str, object]:
    """One warm call of ``case`` in this process (its `attnlab._ext.mode`): `profile_path`."""
    import torch

    import attnlab
    from attnlab._ext import mode as ext_mode

    (q, k, v), kwargs = make_call(case, grad)

    def call() -> object:
        out = attnlab.attention(q, k, v, backend=backend, **kwargs)
        if grad:
            assert isinstance(out, torch.Tensor)
            out.sum().backward()
        return out

    for _ in range(2):
        call()
    record = profile_path(call, _package_dir())
    record.update(case=case, grad=grad, backend=backend, ext=ext_mode())
    return record


def measure_here(backend: str = "flash") -> list[dict[str, object]]:
    """Every case, without and with grad, in this process."""
    return [measure(case, grad, backend) for case in CASES for grad in (False, True)]


def measure_all(backend: str = "flash") -> list[dict[str, object]]:
    """`measure_here` in one subprocess with the C++ kernels on (``ATTNLAB_EXT`` unset) and
    one with them off (``ATTNLAB_EXT=off``)."""
    records: list[dict[str, object]] = []
    for ext in (None, "off"):
        env = dict(os.environ)
        env.pop("ATTNLAB_EXT", None)
        if ext is not None:
            env["ATTNLAB_EXT"] = ext
        done = subprocess.run(
            [sys.executable, __file__, "--here", "--json", "--backend", backend],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        records.extend(json.loads(done.stdout))
    return records


def time_here(repeats: int = 7, calls: int = 50) -> dict[str, float]:
    """Microseconds per warm call of each case without grad, in this process: the median over
    ``repeats`` rounds of ``calls`` calls (the path's overhead plus the work of a small call)."""
    import time

    import attnlab

    out: dict[str, float] = {}
    for case in CASES:
        (q, k, v), kwargs = make_call(case, False)
        for _ in range(3):
            attnlab.attention(q, k, v, backend="flash", **kwargs)
        rounds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                attnlab.attention(q, k, v, backend="flash", **kwargs)
            rounds.append((time.perf_counter() - t0) / calls * 1e6)
        out[case] = sorted(rounds)[len(rounds) // 2]
    return out


def _table(records: list[dict[str, object]]) -> str:
    rows = [f"{'case':<15} {'grad':<5} {'ext':<7} {'files':>5} {'hops':>5}  longest function"]
    for r in records:
        lines, where = r["longest"]  # type: ignore[misc]
        rows.append(
            f"{r['case']:<15} {r['grad']!s:<5} {r['ext']:<7} {len(r['files']):>5} "  # type: ignore[arg-type]
            f"{r['hops']:>5}  {lines} {where}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="flash")
    parser.add_argument("--json", action="store_true", help="print the raw records")
    parser.add_argument("--here", action="store_true", help="this process's ATTNLAB_EXT only")
    parser.add_argument("--files", action="store_true", help="list each call's files")
    parser.add_argument(
        "--time", action="store_true", help="microseconds per warm call (no grad), this process"
    )
    args = parser.parse_args(argv)
    if args.time:
        from common import print_machine

        print_machine()
        for case, us in time_here().items():
            print(f"{case:<15} {us:8.1f} us per call (B={B}, H={H}, L={L}, D={D}, float32)")
        return
    records = measure_here(args.backend) if args.here else measure_all(args.backend)
    if args.json:
        print(json.dumps(records))
        return
    print(_table(records))
    over = sorted({f for r in records for f in r["over"]})  # type: ignore[attr-defined]
    print(f"functions over {LONG} lines on some path: {', '.join(over) or 'none'}")
    if args.files:
        for r in records:
            print(f"{r['case']} grad={r['grad']} ext={r['ext']}: {' '.join(r['files'])}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
