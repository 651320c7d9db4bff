"""The learning-rate / warmup ablation of the GPT app: its grid, checked, and its results.

`sweep_plan` checks a grid and gives every point's `TrainSettings` without training;
`attnlab.apps.gpt.sweep` trains them into a `SweepResult` (a table, strict JSON, the best run).

A part of the GPT app: `attnlab.apps.gpt` hands on its public names.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .gpt_settings import TrainSettings

SWEEP_AXES = ("lr", "warmup")


@dataclass
class SweepRun:
    """One run of a `sweep`: its grid point, final losses (nats/char) and where it was saved.

    Attributes:
        point: the swept settings of this run, e.g. ``{"lr": 0.003, "warmup": 50}``.
        final_train, final_val: the last evaluation's train / validation loss (NaN if diverged).
        train_losses: the per-step batch losses. seconds: wall time. out_dir: its run directory.
    """

    point: dict[str, float | int]
    final_train: float
    final_val: float
    train_losses: list[float]
    seconds: float
    out_dir: str

    @property
    def diverged(self) -> bool:
        """True when the final validation loss is not finite."""
        return not math.isfinite(self.final_val)


@dataclass
class SweepResult:
    """What `sweep` returns: the base settings, the grid and one `SweepRun` per grid point."""

    base: TrainSettings
    grid: dict[str, list[float | int]]
    runs: list[SweepRun]
    unigram_entropy: float

    def best(self) -> SweepRun:
        """The run with the lowest finite final validation loss (the first run if all diverged)."""
        finite = [r for r in self.runs if not r.diverged]
        return min(finite, key=lambda r: r.final_val) if finite else self.runs[0]

    def table(self) -> str:
        """A plain-text table: one row per run, the best marked with ``*``."""
        best = self.best()
        keys = list(self.grid)
        head = [*keys, "final train", "final val", "seconds"]
        rows = []
        for r in self.runs:
            cells = [f"{r.point[k]:g}" for k in keys]
            cells += [f"{r.final_train:.4f}", f"{r.final_val:.4f}", f"{r.seconds:.1f}"]
            rows.append([*cells, "*" if r is best else ""])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
        lines += [
            "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)) + " " + row[-1]
            for row in rows
        ]
        s = self.base
        lines.append(
            f"({s.schedule} schedule, {s.steps} steps of {s.batch_size}×{s.seq_len} characters, "
            f"d_model={s.d_model}, {s.n_layers} layers, {s.precision}; unigram entropy "
            f"{self.unigram_entropy:.3f} nats/char; * = lowest final validation loss)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: non-finite losses become None (strict JSON has no NaN)."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "base": asdict(self.base),
            "grid": self.grid,
            "unigram_entropy": self.unigram_entropy,
            "runs": [
                {
                    **r.point,
                    "final_train_loss": num(r.final_train),
                    "final_val_loss": num(r.final_val),
                    "diverged": r.diverged,
                    "seconds": r.seconds,
                    "out_dir": r.out_dir,
                    "train_losses": [num(x) for x in r.train_losses],
                }
                for r in self.runs
            ],
        }


def _check_grid(base: TrainSettings, grid: dict[str, Sequence[float | int]]) -> dict[str, list]:
    if not isinstance(grid, dict) or not grid:
        raise ValueError(f"grid must be a non-empty dict of {list(SWEEP_AXES)}, got {grid!r}")
    clean: dict[str, list] = {}
    for name, values in grid.items():
        if name not in SWEEP_AXES:
            raise ValueError(f"grid axis must be one of {list(SWEEP_AXES)}, got {name!r}")
        values = list(values)
        if not values or len(set(values)) != len(values):
            raise ValueError(f"grid[{name!r}] must be non-empty without repeats, got {values}")
        if name == "lr" and base.schedule == "noam":
            raise ValueError(
                "grid axis 'lr' has no effect with schedule='noam' (its rate is "
                "d_model^-0.5 · min(t^-0.5, t · warmup^-1.5)); sweep 'warmup' or use 'cosine'"
            )
        clean[name] = values
    return clean


def sweep_plan(
    base: TrainSettings, grid: dict[str, Sequence[float | int]]
) -> tuple[dict[str, list], list[dict[str, float | int]], list[TrainSettings]]:
    """Checks a `sweep` grid without training: the cleaned grid, its points (the Cartesian
    product, first axis slowest) and each point's `TrainSettings` (``out_dir`` a subfolder of
    ``base.out_dir``). Raises ValueError naming the axis or the grid point that is invalid."""
    clean = _check_grid(base, grid)
    keys = list(clean)
    points = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*clean.values())]
    settings = []
    for point in points:
        try:
            s = TrainSettings(**{**asdict(base), **point})
        except (TypeError, ValueError) as e:
            raise type(e)(f"grid point {point}: {e}") from None
        name = "_".join(f"{k}={v:g}" for k, v in point.items())
        settings.append(replace(s, out_dir=str(Path(base.out_dir) / name)))
    return clean, points, settings
