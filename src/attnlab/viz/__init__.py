"""Pictures of attention: PNG heatmaps drawn with matplotlib (the optional ``viz`` extra).

matplotlib is imported inside the functions, so ``import attnlab.viz`` stays light; a missing
matplotlib raises ImportError naming the extra to install. Drawing happens on the host: tensors
from any device are copied to the CPU (``.to("cpu")``) before they are drawn or written, which is
the one place the library moves data to the CPU on purpose.

- `heatmap`, `heatmaps`: any 2-D matrix, or a grid of them (one per head), as a PNG.

Every picture also comes as a matplotlib ``Figure`` without a file (`heatmap_figure`,
`heatmaps_figure`, `sinusoidal_figure`, `rope_spectrum_figure`, `bias_figure`,
`attention_figure`, `experiment_figure`, `bench_figure`, `losses_figure`, `pruning_figure`,
`sinks_figure`, `differential_figure`);
the single-panel ones take ``ax=`` (draw into your own Axes; its figure is returned) and
`rope_spectrum_figure` takes ``axes=(left, right)``. Figures are not registered with pyplot.

- `plot_sinusoidal`, `plot_rope_spectrum`, `plot_bias`: positional encodings.
- `show` (an `AttentionView`, rendered inline in Jupyter), `attention_html`,
  `save_attention_html`: a self-contained HTML attention viewer (head view, all-heads view,
  model view, per-head entropy, hover details) for ``(tokens, weights (layers, heads, T, S))``
  or transformers' ``output_attentions`` tuple; no matplotlib needed;
  `attention_text`: each token's top-k attended tokens per head; `attention_png`: one PNG grid
  of layers × heads (per-head entropies come from `attnlab.analysis`).
- `plot_sinks`, `plot_differential` (`sinks_figure`, `differential_figure`): the sink's share
  of attention per head and per row beside a head's weights; the two maps of differential
  attention and their difference with λ.
- `plot_experiment`: the scaling and temperature experiments as line plots.
- `plot_losses`: the loss curve of a training run; `plot_bench`: ``attnlab bench`` results;
  `plot_pruning`: MiniLM's head-pruning sweep (importance vs random order).

Example:
    >>> from attnlab.positional import ALiBi
    >>> from attnlab.viz import plot_bias
    >>> plot_bias("alibi.png", ALiBi(8), 64)
    PosixPath('alibi.png')
"""

from .attention_png import attention_figure, attention_png
from .attention_view import AttentionView, attention_html, attention_text, save_attention_html, show
from .bench import bench_figure, plot_bench
from .experiments import experiment_figure, plot_experiment
from .heads import plot_pruning, pruning_figure
from .heatmap import heatmap, heatmap_figure, heatmaps, heatmaps_figure
from .positional import (
    bias_figure,
    plot_bias,
    plot_rope_spectrum,
    plot_sinusoidal,
    rope_spectrum_figure,
    sinusoidal_figure,
)
from .training import losses_figure, plot_losses
from .variants import differential_figure, plot_differential, plot_sinks, sinks_figure

__all__ = [
    "AttentionView",
    "attention_figure",
    "attention_html",
    "attention_png",
    "attention_text",
    "bench_figure",
    "bias_figure",
    "differential_figure",
    "experiment_figure",
    "heatmap",
    "heatmap_figure",
    "heatmaps",
    "heatmaps_figure",
    "losses_figure",
    "plot_bench",
    "plot_bias",
    "plot_differential",
    "plot_experiment",
    "plot_losses",
    "plot_pruning",
    "plot_rope_spectrum",
    "plot_sinks",
    "plot_sinusoidal",
    "pruning_figure",
    "rope_spectrum_figure",
    "save_attention_html",
    "show",
    "sinks_figure",
    "sinusoidal_figure",
]
