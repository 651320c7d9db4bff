"""`InlineFigure`: the matplotlib Figure the ``*_figure`` functions return, shown by Jupyter as is.

The figures here are not registered with pyplot (no global state, no GUI backend). IPython
draws a plain ``matplotlib.figure.Figure`` only while its matplotlib integration is on
(``%matplotlib inline``, which registers an image printer for the Figure class); without it a
notebook cell that ends with a figure printed ``<Figure size 700x400 with 1 Axes>``. An
`InlineFigure` is a real ``Figure`` (``isinstance(fig, Figure)``, ``fig.savefig``, ``fig.axes``)
that also has ``_repr_png_``, which IPython's display machinery asks any object for.

matplotlib is an optional extra, so the class is made on first access of
``attnlab.viz.figure.InlineFigure`` (a module ``__getattr__``): importing this module loads no
matplotlib, and a missing one raises the error naming the ``viz`` extra.
"""

from __future__ import annotations

import io

from ..utils.extras import require


def _make_class() -> type:
    """`InlineFigure`, a subclass of matplotlib's ``Figure`` (imports matplotlib)."""
    figure = require("matplotlib.figure", "viz", "attnlab.viz")

    class InlineFigure(figure.Figure):  # type: ignore[name-defined,misc]
        """A matplotlib ``Figure`` that Jupyter and IPython display as a PNG without pyplot."""

        def _repr_png_(self) -> bytes:
            """The figure as PNG bytes (at its own dpi, trimmed to what is drawn, as
            ``%matplotlib inline`` shows figures)."""
            buf = io.BytesIO()
            self.savefig(buf, format="png", bbox_inches="tight")
            return buf.getvalue()

    InlineFigure.__qualname__ = "InlineFigure"  # pickled by reference as this module's name
    return InlineFigure


def __getattr__(name: str) -> type:
    if name == "InlineFigure":
        cls = _make_class()
        globals()[name] = cls  # made once
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["InlineFigure"]  # noqa: F822 (made on first access, by __getattr__)
