"""Inspecting attention: weight statistics, head importance, cost estimates and experiments."""

from .capture import capture_attentions, module_attentions
from .estimate import Estimate, estimate, measure_estimate
from .experiments import ExperimentResult, scaling_experiment, temperature_experiment
from .importance import attention_modules, head_gates, head_importance, output_norm
from .weights import entropy, head_diversity, head_entropy, row_is_attended

__all__ = [
    "Estimate",
    "ExperimentResult",
    "attention_modules",
    "capture_attentions",
    "entropy",
    "estimate",
    "head_diversity",
    "head_entropy",
    "head_gates",
    "head_importance",
    "measure_estimate",
    "module_attentions",
    "output_norm",
    "row_is_attended",
    "scaling_experiment",
    "temperature_experiment",
]
