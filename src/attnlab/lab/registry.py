"""The lab's experiments by name: one `LabExperiment` entry each, imported only when run.

An entry names the module that holds the experiment's ``run(settings, progress)`` and
``judge(metrics, quick)`` (see `attnlab.lab.base`); the module is imported when the experiment
runs, so listing the experiments (``attnlab experiment --help``) imports no torch.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from types import ModuleType

from .base import Claim, LabResult, LabSettings

__all__ = ["EXPERIMENTS", "LabExperiment", "experiment", "run_experiment"]


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


_register(
    LabExperiment(
        name="induction-heads",
        summary="attention-only transformers of 1 and 2 layers on repeated random tokens: the "
        "phase change and the heads' prefix-matching and copying scores (Olsson et al. 2022)",
        claim=Claim(
            paper="Olsson et al., Transformer Circuits Thread 2022, In-context Learning and "
            "Induction Heads (with Elhage et al. 2021, A Mathematical Framework for Transformer "
            "Circuits)",
            where="Argument 1 (the phase change) and the attention-only models of 1 and 2 layers",
            text="Transformer language models undergo a “phase change” early in training, "
            "during which induction heads form and simultaneously in-context learning improves "
            "dramatically — seen in two-layer attention-only models; one-layer ones, which "
            "cannot compose two heads, form no induction heads and show no phase change",
        ),
        module="attnlab.lab.induction",
        tutorial="plot_lab_induction.py",
    )
)

_register(
    LabExperiment(
        name="train-short-test-long",
        summary="positional encodings trained at L, tested up to 16× L",
        claim=Claim(
            paper="Press, Smith & Lewis, ICLR 2022, Train Short, Test Long: Attention with "
            "Linear Biases Enables Input Length Extrapolation",
            where="Fig. 1 and its tables (WikiText-103, nonoverlapping evaluation)",
            text="as the (validation-set's) input sequence gets longer, current position "
            "methods (sinusoidal, rotary, and T5) show degraded perplexity, but our method "
            "[ALiBi] does not",
        ),
        module="attnlab.lab.length",
        tutorial="plot_lab_length.py",
    )
)

_register(
    LabExperiment(
        name="associative-recall",
        summary="multi-query associative recall against model width: attention, window, "
        "linear, FAVOR+, hierarchical, GRU, selective SSM (Zoology, Fig. 2)",
        claim=Claim(
            paper="Arora, Eyuboglu, Timalsina, Johnson, Poli, Zou, Rudra & Ré, ICLR 2024, "
            "Zoology: Measuring and Improving Recall in Efficient Language Models",
            where="Fig. 2 (MQAR accuracy against model dimension)",
            text="attention solves multi-query associative recall at every model dimension, "
            "while the efficient (fixed-state) models need a model dimension that grows with "
            "the sequence length and the number of key-value pairs",
        ),
        module="attnlab.lab.recall",
        tutorial="plot_lab_recall.py",
    )
)
