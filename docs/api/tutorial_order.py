"""The order of the tutorials in the gallery: from a first call to a whole model, then the rest
by name (sphinx-gallery's ``within_subsection_order``)."""

from __future__ import annotations

ORDER = (
    "plot_quickstart.py",
    "plot_from_scratch_to_flash.py",
    "plot_masks_and_block_map.py",
    "plot_why_sqrt_dk.py",
    "plot_sparse_linear_exact.py",
    "plot_compile_your_model.py",
    "plot_transformers_model.py",
    "plot_lab_induction.py",
    "plot_lab_length.py",
    "plot_lab_recall.py",
)


class TutorialOrder:
    """Sort key: a tutorial's place in `ORDER`, unlisted ones after them by file name."""

    def __init__(self, src_dir: str) -> None:
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple[int, str]:
        return (ORDER.index(filename) if filename in ORDER else len(ORDER), filename)

    def __repr__(self) -> str:  # sphinx-gallery puts it in the config's hash
        return f"TutorialOrder({ORDER})"
