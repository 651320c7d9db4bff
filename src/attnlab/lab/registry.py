"""The lab's experiments by name: one `LabExperiment` entry each, imported only when run.

The entries are the ``[[experiment]]`` tables of ``experiments.toml`` beside this module (name,
one-line summary, module, tutorial and the quoted claim). An entry names the module that holds
the experiment's ``run(settings, progress)`` and ``judge(metrics, quick)`` (see
`attnlab.lab.base`); the module is imported when the experiment runs. ``attnlab experiment
--help`` reads the same file without importing the library.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import tomllib

from .base import Claim, LabResult, LabSettings

__all__ = ["EXPERIMENTS", "TABLE", "LabExperiment", "experiment", "run_experiment"]

#: The data file of the entries.
TABLE = Path(__file__).with_name("experiments.toml")


@dataclass(frozen=True)
class LabExperiment:
    """One lab experiment.

    Attributes:
        name: the command-line name (``attnlab experiment NAME``).
        summary: one line for ``--help``.
        claim: the published result it reproduces.
        module: the module holding ``run`` and ``judge`` (imported on first use).
        tutorial: the docs tutorial's file name under docs/tutorials/.
    """

    name: str
    summary: str
    claim: Claim
    module: str
    tutorial: str = ""

    def load(self) -> ModuleType:
        """The experiment's module."""
        return importlib.import_module(self.module)


EXPERIMENTS: dict[str, LabExperiment] = {}


def _register(entry: LabExperiment) -> None:
    if entry.name in EXPERIMENTS:
        raise ValueError(f"name: expected a new experiment name, received {entry.name!r} again")
    EXPERIMENTS[entry.name] = entry


def experiment(name: str) -> LabExperiment:
    """The registry entry called ``name``.

    Raises:
        KeyError: no such experiment (the message lists the known names).
    """
    try:
        return EXPERIMENTS[name]
    except KeyError:
        known = ", ".join(sorted(EXPERIMENTS))
        raise KeyError(f"name: expected one of {known}, received {name!r}") from None


def run_experiment(name: str, settings: LabSettings | None = None, *, progress=None) -> LabResult:
    """Runs the experiment ``name`` and returns its `LabResult` (verdict computed from the run).

    Args:
        name: a key of `EXPERIMENTS`.
        settings: the run's size (default: the default run).
        progress: a `attnlab.utils.Progress` to step, or None for a silent run.

    Returns:
        The result; ``result.seconds`` is measured here.
    """
    from ..utils import Progress

    entry = experiment(name)
    settings = settings or LabSettings()
    module = entry.load()
    bar = progress if progress is not None else Progress(enabled=False)
    start = time.perf_counter()
    result = module.run(settings, bar)
    result.seconds = time.perf_counter() - start
    return result


def _read(path: Path = TABLE) -> None:
    """Registers every ``[[experiment]]`` of ``path`` (`experiments.toml`)."""
    for row in tomllib.loads(path.read_text(encoding="utf-8"))["experiment"]:
        claim = Claim(paper=row["paper"], where=row["where"], text=row["text"])
        _register(
            LabExperiment(
                name=row["name"],
                summary=row["summary"],
                claim=claim,
                module=row["module"],
                tutorial=row.get("tutorial", ""),
            )
        )


_read()
