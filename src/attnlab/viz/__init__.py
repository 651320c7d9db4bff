"""Pictures of attention: PNG heatmaps drawn with matplotlib (the optional ``viz`` extra).

matplotlib is imported inside the functions, so ``import attnlab.viz`` stays light; a missing
matplotlib raises ImportError naming the extra to install.

- `heatmap`, `heatmaps`: any 2-D matrix, or a grid of them (one per head), as a PNG.
- `plot_sinusoidal`, `plot_rope_spectrum`, `plot_bias`: positional encodings.

Example:
    >>> from attnlab.positional import ALiBi
    >>> from attnlab.viz import plot_bias
    >>> plot_bias("alibi.png", ALiBi(8), 64)
    PosixPath('alibi.png')
"""

from .heatmap import heatmap, heatmaps
from .positional import plot_bias, plot_rope_spectrum, plot_sinusoidal

__all__ = ["heatmap", "heatmaps", "plot_bias", "plot_rope_spectrum", "plot_sinusoidal"]
