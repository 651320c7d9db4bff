"""Sphinx configuration of attnlab's documentation (``make docs``; see about-docs.md).

The site is self-contained: the theme's fonts and icons come with pydata-sphinx-theme, MathJax 3
is copied from the ``django-static-mathjax`` package into ``_static/mathjax``, and the PyTorch
inventory for intersphinx is written from the installed torch, so neither the build nor the pages
it writes need the network.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import sys
import warnings
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "api"))
os.environ.setdefault("MPLBACKEND", "Agg")  # the tutorials draw without a display

import generate  # noqa: E402  (docs/api/generate.py)

import attnlab  # noqa: E402

project = "attnlab"
author = "the attnlab authors"
copyright = "the attnlab authors"
release = attnlab.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "Thumbs.db",
    ".DS_Store",
    "tutorials",  # the gallery's sources; its pages are built into gallery/
]
templates_path = ["_templates"]
default_role = "py:obj"  # `name` in a docstring links to the object when there is one

# -- API reference: one page per public module, written from the package at every build ------
generate.write_pages(DOCS / "api" / "generated")
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_class_signature = "separated"
autosummary_generate = False  # the pages come from docs/api/generate.py
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
napoleon_use_ivar = True  # "Attributes:" sections are fields, not a second entry per attribute

# -- Markdown pages ----------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# sphinx-gallery's cross-references probe every name a tutorial's code uses on the modules it
# imports; attnlab's deprecated spellings warn when they are read: not the tutorial's doing.
warnings.filterwarnings(
    "ignore", message=r".* is deprecated .*attnlab\.nn\.", category=FutureWarning
)

# -- Tutorials: sphinx-gallery runs docs/tutorials/*.py and keeps output, figures, notebooks --
sphinx_gallery_conf = {
    "examples_dirs": "tutorials",
    "gallery_dirs": "gallery",
    "filename_pattern": r"\.py$",  # every tutorial is executed, whatever its name
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "abort_on_example_error": True,
    "show_signature": False,
    "within_subsection_order": "tutorial_order.TutorialOrder",  # docs/api/tutorial_order.py
    "write_computation_times": False,  # its page loads jQuery and DataTables from CDNs
}

# -- Math: MathJax 3 from this machine, not from a CDN -----------------------------------------
mathjax_path = "mathjax/tex-chtml.js"


def _mathjax_dir() -> Path:
    try:
        import mathjax  # the django-static-mathjax package (pip install -e ".[docs]")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "MathJax is not installed: pip install -e '.[docs]' (package django-static-mathjax)"
        ) from e
    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


# -- Cross-links to PyTorch --------------------------------------------------------------------
# intersphinx reads PyTorch's names from an inventory written here from the installed torch (the
# build has no network to fetch PyTorch's objects.inv); the links follow the layout of PyTorch's
# pages: generated/<name>.html for functions and classes, a page per module, tensors.html ...
TORCH_DOCS = "https://docs.pytorch.org/docs/stable/"
_TORCH_MODULE_PAGES = {
    "torch": "torch.html",
    "torch.nn": "nn.html",
    "torch.nn.functional": "nn.functional.html",
    "torch.autograd": "autograd.html",
    "torch.distributed": "distributed.html",
    "torch.export": "export.html",
    "torch.fft": "fft.html",
    "torch.linalg": "linalg.html",
    "torch.special": "special.html",
    "torch.testing": "testing.html",
}
_TORCH_TENSOR_ATTRIBUTES = ("dtype", "device", "layout", "memory_format")


def _torch_inventory(path: Path) -> Path:
    """Writes an intersphinx inventory of PyTorch's documented names to ``path``."""
    import zlib

    import torch

    rows = {}
    for module, page in _TORCH_MODULE_PAGES.items():
        rows[module] = ("module", f"{page}#module-{module}")
    for module in ("torch", "torch.nn", "torch.nn.functional", "torch.fft", "torch.linalg"):
        namespace = importlib.import_module(module)
        names = getattr(namespace, "__all__", None) or dir(namespace)
        for name in names:
            obj = getattr(namespace, name, None)
            if name.startswith("_") or obj is None or inspect.ismodule(obj):
                continue
            full = f"{module}.{name}"
            if inspect.isclass(obj):
                rows[full] = ("class", f"generated/{full}.html#{full}")
                for member in vars(obj):
                    if module == "torch.nn" and not member.startswith("_"):
                        rows[f"{full}.{member}"] = (
                            "method",
                            f"generated/{full}.html#{full}.{member}",
                        )
            elif callable(obj):
                rows[full] = ("function", f"generated/{full}.html#{full}")
    for name in dir(torch.Tensor):
        if not name.startswith("_"):
            rows[f"torch.Tensor.{name}"] = (
                "method",
                f"generated/torch.Tensor.{name}.html#torch.Tensor.{name}",
            )
    rows["torch.Tensor"] = ("class", "tensors.html#torch.Tensor")
    rows["torch.Size"] = ("class", "size.html#torch.Size")
    for name in _TORCH_TENSOR_ATTRIBUTES:
        rows[f"torch.{name}"] = ("class", f"tensor_attributes.html#torch.{name}")
    body = "".join(f"{name} py:{role} 1 {uri} -\n" for name, (role, uri) in sorted(rows.items()))
    header = (
        "# Sphinx inventory version 2\n# Project: PyTorch\n"
        f"# Version: {torch.__version__.split('+')[0]}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + zlib.compress(body.encode()))
    return path


intersphinx_mapping = {
    "torch": (TORCH_DOCS, str(_torch_inventory(DOCS / "_build" / "inventories" / "torch.inv"))),
}

# -- HTML --------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"attnlab {release}"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc"],
}
html_context = {"default_mode": "auto"}  # light or dark as the reader's system says
html_favicon = "_static/favicon.svg"
html_show_sourcelink = False
html_copy_source = False


def _copy_mathjax(app, exception) -> None:
    """Puts MathJax's es5 build (the loader, TeX input, CommonHTML output and its fonts, and
    the components it loads on demand) into the build's ``_static/mathjax`` after an HTML
    build."""
    if exception is not None or app.builder.format != "html":
        return
    import shutil

    shutil.copytree(
        _mathjax_dir(),
        Path(app.outdir) / "_static" / "mathjax",
        dirs_exist_ok=True,
        # latest.js loads MathJax from a CDN; node-main.js is for Node; *.map for debuggers
        ignore=shutil.ignore_patterns("latest.js", "node-main.js", "*.map"),
    )


def _no_type_docstring(_app, _what, _name, obj, _options, lines) -> None:
    """A constant without a docstring of its own (``SCORES: dict``) gets no text rather than the
    docstring of its type (``dict``'s)."""
    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
        return
    doc = type(obj).__doc__
    inherited = inspect.cleandoc(doc).splitlines() if isinstance(doc, str) else []
    while lines and not lines[-1].strip():
        lines.pop()
    if inherited and lines == inherited:
        lines.clear()


def _register_aliases(_app, env) -> None:
    """Every export documented elsewhere (``attnlab.attention``) becomes a name of its home's
    entry: in objects.inv and for cross-references, it points where the object is documented.
    Registered as aliases, so a short reference (`Mask`) still resolves to the one home."""
    from sphinx.domains.python import ModuleEntry, ObjectEntry

    domain = env.domains["py"]
    for name in getattr(env, "attnlab_aliases", ()):
        domain.objects.pop(name, None)
        domain.modules.pop(name, None)
    added = []
    for name, home in generate.homes(generate.public_modules()).items():
        if home in domain.modules:
            if name not in domain.modules:
                m = domain.modules[home]
                domain.modules[name] = ModuleEntry(m.docname, m.node_id, m.synopsis, "", False)
                added.append(name)
        elif home in domain.objects:
            o = domain.objects[home]
            domain.objects[name] = ObjectEntry(o.docname, o.node_id, o.objtype, True)
            added.append(name)
        else:
            raise RuntimeError(f"{name} is documented at {home}, which the build did not write")
    env.attnlab_aliases = added


_GLOSSARY_LINK = re.compile(r"\[([^\]]*)\]\(@entry_id:\d+\)")
_OUTSIDE_LINK = re.compile(r"\[([^\]]*)\]\(\.\./([\w.-]+\.md)(#[\w-]*)?\)")


def _plain_links(_app, _docname, source) -> None:
    """Links that lead nowhere on this site become their text: the glossary links
    ``[text](@entry_id:N)`` inside the quoted source texts (textbook.md), and links from a page
    to Markdown files outside docs/ (README.md), which the site does not contain."""
    text = _GLOSSARY_LINK.sub(r"\1", source[0])
    source[0] = _OUTSIDE_LINK.sub(r"\1 (\2)", text)


class _EmptySection(logging.Filter):
    """The section indexes glob over pages that are added without editing them: a section that
    has no page yet is not a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        location = str(getattr(record, "location", ""))
        empty = "didn't match any documents" in record.getMessage()
        return not (empty and any(s in location for s in _GLOB_SECTIONS))


_GLOB_SECTIONS = ("guide/index", "results/index")


def setup(app) -> None:
    _mathjax_dir()  # fail at the start of the build, not after it
    logging.getLogger("sphinx.sphinx.directives.other").addFilter(_EmptySection())
    app.connect("source-read", _plain_links)
    app.connect("autodoc-process-docstring", _no_type_docstring)
    app.connect("env-updated", _register_aliases)
    app.connect("build-finished", _copy_mathjax)
