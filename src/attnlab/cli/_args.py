"""Shared pieces of the ``attnlab`` command: argument types and output-path checks.

Argument types raise `argparse.ArgumentTypeError`, so a bad value is reported by the parser
(one line, exit code 2) before a command starts; this includes ``--device`` (`device_type`,
declared by `add_device_argument`), so an unavailable device never costs a model load.
`check_output_file` and `check_output_dir` run at the start of a command, before any long
work, and raise `UsageError`.

This module imports no torch at import time (``attnlab --help`` loads it): the device checks
import it when they run.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class UsageError(ValueError):
    """A bad argument found by a command: ``argument FLAG: MESSAGE`` on one line, exit code 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)

#: Upper bound of the size arguments of ``attnlab train`` (widths, layers, heads, batch,
#: sequence length): far above anything that fits a machine, so a value in range is judged by
#: its estimated memory (`attnlab.cli._budget`), and low enough that no size computation
#: overflows int64.
MAX_SIZE = 2**30
#: Upper bound of step counts and intervals (steps, warmup, evaluation and save intervals).
MAX_STEPS = 10**9
#: Upper bound of seeds: numpy's and scikit-learn's ``random_state`` range, [0, 2**32 - 1].
MAX_SEED = 2**32 - 1
#: Upper bound of ``--threads``.
MAX_THREADS = 1024


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in ``[low, high]``.

    Below ``low`` (or not an int) the error reads as `int_at_least`'s; above ``high`` it names
    both bounds: ``expected an int in [1, 1073741824], got 2147483648``.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also Python's limit on the digits of an int string
            raise argparse.ArgumentTypeError(
                f"expected an int >= {low}, got {_clip(text)!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {_clip(str(value))}")
        if value > high:
            raise argparse.ArgumentTypeError(
                f"expected an int in [{low}, {high}], got {_clip(str(value))}"
            )
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def _clip(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters (a 5,000-digit argument stays one short line)."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…({len(text)} characters)"


size_int = int_in(1, MAX_SIZE)
step_count = int_in(1, MAX_STEPS)
step_interval = int_in(0, MAX_STEPS)
seed_int = int_in(0, MAX_SEED)


def float_in(
    low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = True
) -> Callable[[str], float]:
    """An argparse type: a finite float in the interval from ``low`` to ``high``."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(
                f"expected a finite number in {interval}, got {text!r}"
            )
        return value

    parse.__name__ = f"number in {interval}"
    return parse


positive_float = float_in(0.0, low_open=True)
nonnegative_float = float_in(0.0)
probability = float_in(0.0, 1.0)


def existing_file(text: str) -> str:
    """An argparse type: the path of an existing regular file."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"not a regular file: {text!r}")
    return text


#: Device types a computing command can run on when torch reports them available.
_ACCELERATORS = ("cuda", "mps", "xpu")


def _accelerator_count(kind: str) -> int:
    """How many devices of type ``kind`` torch can use here (0 when unavailable or unknown)."""
    import torch

    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return 1 if mps is not None and mps.is_available() else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    return 0


def available_devices() -> list[str]:
    """The devices the commands accept on this machine, e.g. ``["cpu"]`` or
    ``["cpu", "cuda:0", "cuda:1"]``."""
    found = ["cpu"]
    for kind in _ACCELERATORS:
        n = _accelerator_count(kind)
        found += [kind] if kind == "mps" and n else [f"{kind}:{i}" for i in range(n)]
    return found


def device_type(text: str) -> torch.device:
    """An argparse type: a torch device that is available on this machine.

    ``cpu`` always; ``cuda``/``cuda:N``, ``mps``, ``xpu``/``xpu:N`` when torch reports them
    available (and N exists). ``meta`` is refused: meta tensors have shapes but no values, so
    there would be nothing to print or write. A malformed or unavailable device is reported by
    the parser (one line naming ``--device``, the value and what is available; exit code 2)
    before any model, checkpoint or tensor is loaded.
    """
    import torch

    available = ", ".join(available_devices())
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda or cuda:0 (available here: {available}), "
            f"got {text!r}"
        ) from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise argparse.ArgumentTypeError(
                f"there is one cpu device (cpu or cpu:0), got {text!r}"
            )
        return torch.device("cpu")
    if device.type == "meta":
        raise argparse.ArgumentTypeError(
            "meta tensors have shapes but no values, so a command has nothing to print or "
            f"write; choose one of: {available}; got {text!r}"
        )
    count = _accelerator_count(device.type)
    if count == 0:
        raise argparse.ArgumentTypeError(
            f"{device.type} is not available on this machine (available: {available}), got {text!r}"
        )
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(
            f"{device.type} has {count} device(s) here (available: {available}), got {text!r}"
        )
    return device


device_type.__name__ = "device"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """Declares ``--device`` (default cpu, checked by `device_type`) on a computing command.

    The default is the text ``"cpu"``, which argparse passes through `device_type` like a given
    value, so ``args.device`` is always a `torch.device` while ``--help`` imports no torch.
    """
    parser.add_argument(
        "--device",
        type=device_type,
        default="cpu",
        metavar="DEVICE",
        help="torch device to compute on: cpu (default), cuda, cuda:N, mps or xpu when torch "
        "reports them available (a device that is not names the ones that are)",
    )


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried for real, then removed)."""
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".attnlab-probe-"):
            return True
    except OSError:
        return False


def check_output_file(
    path: str | os.PathLike, flag: str, suffixes: tuple[str, ...] | None = None
) -> Path:
    """Raises `UsageError` unless ``path`` can be written: it ends in one of ``suffixes`` (any
    when None), its directory exists and is writable, and it is not a directory (an existing file
    is overwritten). Writes nothing."""
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise UsageError(flag, f"{str(path)!r} is a directory; expected a file path")
    if suffixes is not None and out.suffix.lower() not in suffixes:
        raise UsageError(flag, f"must end in {' or '.join(suffixes)}, got {str(path)!r}")
    if not parent.is_dir():
        raise UsageError(flag, f"cannot write {str(path)!r}: no directory {str(parent)!r}")
    if out.exists():
        try:
            with open(out, "ab"):
                pass
        except OSError as e:
            raise UsageError(flag, f"cannot write {str(path)!r}: {e.strerror}") from None
    elif not _can_create_in(parent):
        raise UsageError(
            flag, f"cannot write {str(path)!r}: directory {str(parent)!r} is read-only"
        )
    return out


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Raises `UsageError` unless ``path`` is a writable directory or can be created (with its
    missing parents) under a writable directory. Creates nothing."""
    out = Path(path)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            flag, f"cannot create directory {str(path)!r}: {str(existing)!r} is a file"
        )
    if not _can_create_in(existing):
        raise UsageError(flag, f"cannot write in {str(path)!r}: {str(existing)!r} is read-only")
    return out
