"""The lab: published results about attention, reproduced on a CPU in one command each.

Each experiment trains or probes small models, computes its metrics over several seeds and
judges them against a quoted claim of the paper it reproduces (`Claim`, `Verdict`); the verdict
is computed from the run — margin against seed spread — never written in advance. The
experiments are listed in `attnlab.lab.registry` (names only, no torch import: ``attnlab
experiment --help`` stays fast) and run by ``attnlab experiment NAME``.

- `base`: the claim, the run's settings, seed statistics, checks, the verdict and the result
  (``metrics.json`` and PNGs under ``--out``).
- `registry`: one `LabExperiment` entry per experiment (name, claim, module, defaults).
"""

from .base import Check, Claim, LabResult, LabSettings, SeedStats, Verdict, machine
from .registry import EXPERIMENTS, LabExperiment, experiment, run_experiment

__all__ = [
    "EXPERIMENTS",
    "Check",
    "Claim",
    "LabExperiment",
    "LabResult",
    "LabSettings",
    "SeedStats",
    "Verdict",
    "experiment",
    "machine",
    "run_experiment",
]
