"""Inspecting attention: weight statistics, head importance, cost estimates, experiments, and
the texts' readings of attention (bilinear forms, score terms, kernel regression, Gibbs), and
MiniLM's heads (a head classifier and a head-pruning sweep), and induction-head scores (prefix
matching, previous-token attention, the OV circuit's copying)."""

from .capture import capture_attentions, module_attentions
from .estimate import Estimate, estimate, measure_estimate
from .experiments import (
    ExperimentResult,
    kernel_regression_experiment,
    scaling_experiment,
    temperature_experiment,
)
from .heads import HeadReport, PruningSweep, alice_sentences, classify_heads, pruning_sweep
from .importance import attention_modules, head_gates, head_importance, output_norm
from .induction import (
    copying_score,
    ov_circuits,
    prefix_match_targets,
    prefix_matching_score,
    previous_token_score,
)
from .views import Gibbs, ScoreTerms, bilinear_metric, gibbs, nadaraya_watson, score_decomposition
from .weights import (
    differential_maps,
    entropy,
    head_diversity,
    head_entropy,
    head_sink_share,
    row_is_attended,
    sink_share,
    top_weights,
)

__all__ = [
    "Estimate",
    "ExperimentResult",
    "Gibbs",
    "HeadReport",
    "PruningSweep",
    "ScoreTerms",
    "alice_sentences",
    "attention_modules",
    "bilinear_metric",
    "capture_attentions",
    "classify_heads",
    "copying_score",
    "differential_maps",
    "entropy",
    "estimate",
    "gibbs",
    "head_diversity",
    "head_entropy",
    "head_gates",
    "head_importance",
    "head_sink_share",
    "kernel_regression_experiment",
    "measure_estimate",
    "module_attentions",
    "nadaraya_watson",
    "output_norm",
    "ov_circuits",
    "prefix_match_targets",
    "prefix_matching_score",
    "previous_token_score",
    "pruning_sweep",
    "row_is_attended",
    "scaling_experiment",
    "score_decomposition",
    "sink_share",
    "temperature_experiment",
    "top_weights",
]
