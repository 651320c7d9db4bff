"""What every lab experiment shares: claim, settings, seed statistics, verdict and result.

A lab experiment is a module with two functions (see `attnlab.lab.registry`):

- ``run(settings: LabSettings, progress: Progress) -> LabResult`` trains / probes, fills
  ``metrics`` (plain JSON: numbers, lists, dicts of str) and registers its figures;
- ``judge(metrics: dict, quick: bool) -> Verdict`` turns the metrics into `Check`s — each a
  measured *margin* (how far the result goes the paper's way) against the *spread* over seeds
  — so a test can hand it a synthetic counter-example and see the verdict flip.

A check passes when ``margin > spread``: the effect is larger than the seed-to-seed noise. The
verdict is "reproduced" when every check passes, otherwise "not reproduced"; a ``--quick`` run
(a smaller model, fewer steps) says "not reproduced at this scale" instead. Nothing here imports
torch at module level (``attnlab experiment --help`` must stay fast).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._files import atomic_write

__all__ = ["Check", "Claim", "LabResult", "LabSettings", "SeedStats", "Verdict", "machine"]


@dataclass(frozen=True)
class Claim:
    """A published result, quoted: who, where in the paper, and what it says.

    Attributes:
        paper: authors, venue and year, title (``"Press, Smith & Lewis, ICLR 2022, Train Short,
            Test Long"``).
        where: the figure or table reproduced (``"Fig. 1, Table 1"``).
        text: the claim, quoted or closely paraphrased.
    """

    paper: str
    where: str
    text: str

    def __str__(self) -> str:
        return f'{self.paper} ({self.where}): "{self.text}"'


@dataclass(frozen=True)
class LabSettings:
    """How big a lab run is.

    Attributes:
        quick: the ≤ 1-minute version (smaller model, fewer steps; its verdict may say "not
            reproduced at this scale").
        full: the paper's whole grid where an experiment has one beyond its default (longer).
        seeds: independent runs per configuration; None = the experiment's default (≥ 3 where
            a spread is judged, fewer under ``quick``).
        device: where tensors live (``"cpu"``).
    """

    quick: bool = False
    full: bool = False
    seeds: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.quick and self.full:
            raise ValueError("quick and full: expected at most one of them, received both")
        if self.seeds is not None and (
            isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1
        ):
            raise ValueError(f"seeds: expected an int >= 1 or None, received {self.seeds!r}")

    def seed_count(self, default: int, quick: int = 1) -> int:
        """``seeds`` if given, else ``quick`` under `quick`, else ``default``."""
        if self.seeds is not None:
            return self.seeds
        return quick if self.quick else default

    @property
    def scale(self) -> str:
        """``"quick"``, ``"default"`` or ``"full"``."""
        return "quick" if self.quick else "full" if self.full else "default"


@dataclass(frozen=True)
class SeedStats:
    """Mean and spread of one quantity over seeds.

    Attributes:
        mean: the sample mean. std: the sample standard deviation (0 for one seed).
        low, high: the smallest and largest value. n: the number of seeds.
    """

    mean: float
    std: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> SeedStats:
        """The statistics of ``values`` (at least one finite or infinite float)."""
        xs = [float(x) for x in values]
        if not xs:
            raise ValueError("values: expected at least one value, received none")
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return cls(statistics.fmean(xs), std, min(xs), max(xs), len(xs))

    def __str__(self) -> str:
        return f"{self.mean:.4g} ± {self.std:.2g}" if self.n > 1 else f"{self.mean:.4g}"

    def as_dict(self) -> dict[str, float]:
        """``{"mean", "std", "low", "high", "n"}`` for metrics.json."""
        return {"mean": self.mean, "std": self.std, "low": self.low, "high": self.high, "n": self.n}


@dataclass(frozen=True)
class Check:
    """One measured part of a claim: an effect (margin) against the seed noise (spread).

    Attributes:
        name: what is checked, in the paper's words (``"ALiBi stays flat to 16× the length"``).
        margin: how far the measurement goes the claimed way (> 0 = the claimed direction), in
            the units of the metric.
        spread: the seed-to-seed noise of the same quantity (e.g. the larger of the compared
            standard deviations); 0 with one seed.
        detail: the numbers behind it (``"ALiBi 1.92 ± 0.02 vs sinusoidal 3.10 ± 0.10 nats"``).
    """

    name: str
    margin: float
    spread: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        """``margin > spread`` (a NaN margin fails)."""
        return math.isfinite(self.margin) and self.margin > self.spread

    @classmethod
    def greater(cls, name: str, a: Sequence[float], b: Sequence[float], unit: str = "") -> Check:
        """The claim "a is larger than b" over seeds: margin = mean(a) − mean(b), spread = the
        larger standard deviation."""
        sa, sb = SeedStats.of(a), SeedStats.of(b)
        detail = f"{sa} vs {sb}{' ' + unit if unit else ''}"
        return cls(name, sa.mean - sb.mean, max(sa.std, sb.std), detail)

    def __str__(self) -> str:
        mark = "✓" if self.passed else "✗"
        tail = f" — {self.detail}" if self.detail else ""
        return f"{mark} {self.name}: margin {self.margin:.3g} vs spread {self.spread:.2g}{tail}"


@dataclass(frozen=True)
class Verdict:
    """Whether a run reproduced its claim, computed from its checks.

    Attributes:
        claim: the published result. checks: the measured parts. quick: a ``--quick`` run.
    """

    claim: Claim
    checks: tuple[Check, ...]
    quick: bool = False

    def __post_init__(self) -> None:
        if not self.checks:
            raise ValueError("checks: expected at least one Check, received none")

    @property
    def reproduced(self) -> bool:
        """Every check passed."""
        return all(c.passed for c in self.checks)

    @property
    def label(self) -> str:
        """``"reproduced"``, ``"not reproduced"`` or (quick runs) ``"not reproduced at this
        scale"``."""
        if self.reproduced:
            return "reproduced"
        return "not reproduced at this scale" if self.quick else "not reproduced"

    def __str__(self) -> str:
        lines = [f"Claim: {self.claim}", f"Verdict: {self.label.upper()}"]
        lines += [f"  {c}" for c in self.checks]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The verdict for metrics.json."""
        return {
            "label": self.label,
            "reproduced": self.reproduced,
            "claim": {
                "paper": self.claim.paper,
                "where": self.claim.where,
                "text": self.claim.text,
            },
            "checks": [
                {
                    "name": c.name,
                    "margin": c.margin,
                    "spread": c.spread,
                    "passed": c.passed,
                    "detail": c.detail,
                }
                for c in self.checks
            ],
        }


def machine() -> dict[str, Any]:
    """The machine a result was measured on: CPU model and SIMD flags, threads, the float32
    matmul rate (GFLOP/s of a 1024² ``torch.mm``, measured now: the yardstick that lets a run's
    seconds be compared across CPUs), torch and Python versions."""
    import torch

    from ..functional.thresholds import cpu_info
    from ..utils import matmul_rate

    model, flags = cpu_info()
    simd = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return {
        "cpu": model,
        "simd": " ".join(simd),
        "threads": torch.get_num_threads(),
        "matmul_gflops": round(matmul_rate(1024, 3), 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


Drawer = Callable[[Path], None]


@dataclass
class LabResult:
    """One lab run: its metrics, its verdict, the machine and how long it took.

    Attributes:
        name: the experiment's registry name. settings: the run's `LabSettings`.
        metrics: plain JSON data (the measured values per configuration and seed).
        verdict: `Verdict` computed by the experiment's ``judge`` from ``metrics``.
        seconds: wall-clock time of the run. machine: `machine()`.
        table: ``(columns, rows)`` to print (rows of str/float), the paper's table or figure as
            numbers.
        figures: ``{file name: draw(path)}``, the PNGs written by `write`.
    """

    name: str
    settings: LabSettings
    metrics: dict[str, Any]
    verdict: Verdict
    seconds: float
    machine: dict[str, Any]
    table: tuple[list[str], list[list[Any]]] = ((), ())  # type: ignore[assignment]
    figures: dict[str, Drawer] = field(default_factory=dict, repr=False)

    @classmethod
    def judged(
        cls,
        name: str,
        settings: LabSettings,
        metrics: dict[str, Any],
        judge: Callable[[dict[str, Any], bool], Verdict],
        table: tuple[list[str], list[list[Any]]],
        figures: dict[str, Drawer],
    ) -> LabResult:
        """A run's result with its verdict ``judge(metrics, settings.quick)`` and this machine
        (`run_experiment` fills in ``seconds``)."""
        verdict = judge(metrics, settings.quick)
        return cls(name, settings, metrics, verdict, 0.0, machine(), table, figures)

    def as_dict(self) -> dict[str, Any]:
        """Everything but the figures, as metrics.json holds it."""
        return {
            "experiment": self.name,
            "scale": self.settings.scale,
            "seeds": self.settings.seeds,
            "metrics": self.metrics,
            "verdict": self.verdict.as_dict(),
            "seconds": self.seconds,
            "machine": self.machine,
        }

    def write(self, out: str | Path) -> list[Path]:
        """Writes ``metrics.json`` and every figure into ``out`` (created); returns the paths."""
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "metrics.json"
        text = json.dumps(self.as_dict(), indent=2, allow_nan=True) + "\n"
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        written = [path]
        for file_name, draw in self.figures.items():
            target = folder / file_name
            draw(target)
            written.append(target)
        return written

    def footer(self) -> str:
        """``"<scale> run: 612 s on <CPU>, 2 threads (float32 matmul 208 GFLOP/s), torch
        2.13.0"``."""
        m = self.machine
        rate = m.get("matmul_gflops")
        mm = f" (float32 matmul {rate:.0f} GFLOP/s)" if rate is not None else ""
        return (
            f"{self.settings.scale} run: {self.seconds:.0f} s on {m.get('cpu', '?')}, "
            f"{m.get('threads', '?')} threads{mm}, torch {m.get('torch', '?')}"
        )

    def __str__(self) -> str:
        return f"{self.name}\n{self.verdict}\n{self.footer()}"
