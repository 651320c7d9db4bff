"""What ``attnlab bench`` measures and reports: rows, the report, dtypes, clocks, tolerances."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..testing import FIXED_TABLE

#: ``masks.bigbird`` arguments of the bigbird case: block size, window, global, random blocks.
BIGBIRD = (64, 3, 2, 3)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- measuring
@dataclass
class Row:
    """One contender's result in one case, in one dtype."""

    case: str
    name: str
    seconds: float | None
    useful_gflops: float | None = None
    note: str = ""
    max_err: float | None = None
    dtype: str = "float32"
    tolerance: float | None = None
    peak_bytes: int | None = None  # a memory row's peak RSS growth (what its plot panel draws)

    @property
    def within_tolerance(self) -> bool | None:
        """max|Δ| against flash within the dtype's tolerance (None: nothing compared)."""
        if self.max_err is None or self.tolerance is None:
            return None
        return self.max_err <= self.tolerance

    def to_dict(self) -> dict[str, object]:
        """The row as written by ``--json`` (with ``within_tolerance``)."""
        return {**self.__dict__, "within_tolerance": self.within_tolerance}


@dataclass
class Report:
    """Everything one `attnlab bench` run measured."""

    rows: list[Row] = field(default_factory=list)
    matmul_gflops: dict[str, float] = field(default_factory=dict)  # dtype name -> rate
    matmul_size: dict[str, int] = field(default_factory=dict)  # dtype name -> n of the n² mm
    info: dict[str, str] = field(default_factory=dict)


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    """Largest max|Δ| accepted between two exact contenders in ``dtype``: twice the fixed
    forward table's ``atol + rtol·max|out|`` (each may be that far from the truth)."""
    atol, rtol = FIXED_TABLE[dtype][:2]
    return 2 * (atol + rtol * float(reference.detach().abs().max().double()))
