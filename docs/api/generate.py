"""The API reference pages, written from the installed package at every docs build.

Public modules are ``attnlab`` and every module one level below it whose name has no leading
underscore — files and subpackages, and the names registered in ``sys.modules``
(``attnlab.pos``, ``attnlab.linear``) — plus any module that one of them lists in ``__all__``.
Each gets one page with its docstring, a summary table and an entry for every name in its
``__all__``, so a new public name is in the reference as soon as it is exported.

An object exported by several public modules is documented once, at its home: the public module
that its ``__module__`` lies in (``attnlab.masks`` for ``attnlab.masks.base.Mask``), else the
deepest module exporting it. Every other export gets a short entry that links to the home
(``attnlab.attention`` -> ``attnlab.functional.attention``). ``attnlab.pos`` is
``attnlab.positional`` itself, so all of its entries link there.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "attnlab"

#: Values whose identity says nothing about where they come from (small ints and strings are
#: shared by the interpreter), so they are documented wherever they are exported.
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


@dataclass(frozen=True)
class Entry:
    """One name of one public module's ``__all__``."""

    module: str
    name: str
    obj: object

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def public_modules(package: str = PACKAGE) -> list[str]:
    """Names of the public modules of ``package``, sorted (the package itself first)."""
    root = importlib.import_module(package)
    names = {package}
    for info in pkgutil.iter_modules(root.__path__, package + "."):
        if not info.name.rsplit(".", 1)[1].startswith("_"):
            importlib.import_module(info.name)
            names.add(info.name)
    for name in getattr(root, "__all__", ()):  # the names that are not files load on first use
        getattr(root, name)
    names |= {
        n
        for n in list(sys.modules)
        if n.startswith(package + ".") and n.count(".") == 1 and not n.split(".")[1].startswith("_")
    }
    todo = sorted(names)
    while todo:  # modules listed in a public module's __all__ are public too
        module = sys.modules[todo.pop()]
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) and obj.__name__ not in names:
                names.add(obj.__name__)
                todo.append(obj.__name__)
    return sorted(names, key=lambda n: (n != package, n))


def _kind(obj: object) -> str:
    """The Python domain's object type for ``obj``: module, exception, class, function, data."""
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isroutine(obj):
        return "function"
    return "data"


def _entries(modules: list[str]) -> list[Entry]:
    out = []
    for name in modules:
        module = sys.modules[name]
        for attr in getattr(module, "__all__", ()):
            out.append(Entry(name, attr, getattr(module, attr)))
    return out


def homes(modules: list[str]) -> dict[str, str]:
    """``{qualname: home qualname}`` for every export that is documented elsewhere."""
    canonical_module = {}  # an alias module (attnlab.pos) -> the module's own name
    for name in modules:
        own = sys.modules[name].__name__
        if own != name and own in modules:
            canonical_module[name] = own
    entries = _entries(modules)
    by_object: dict[int, list[Entry]] = {}
    for e in entries:
        if e.module in canonical_module or isinstance(e.obj, _SCALARS):
            continue
        by_object.setdefault(id(e.obj), []).append(e)
    out = {}
    for e in sorted(entries, key=lambda e: e.module in canonical_module):  # alias modules last
        if e.module in canonical_module:
            home = f"{canonical_module[e.module]}.{e.name}"
            home = out.get(home, home)
        elif isinstance(e.obj, types.ModuleType):
            home = e.obj.__name__
        elif isinstance(e.obj, _SCALARS):
            continue
        else:
            home = _home(by_object[id(e.obj)]).qualname
        if home != e.qualname and e.qualname not in modules:  # attnlab.pos has its own page
            out[e.qualname] = home
    return out


def _home(exports: list[Entry]) -> Entry:
    """The export that documents an object: the public module its ``__module__`` lies in (the
    deepest such), else the deepest module exporting it (then the first name)."""
    origin = getattr(exports[0].obj, "__module__", None) or ""

    def rank(e: Entry) -> tuple:
        inside = origin == e.module or origin.startswith(e.module + ".")
        return (not inside, -e.module.count("."), e.module, e.name)

    return min(exports, key=rank)


def _heading(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


def _entry_rst(e: Entry) -> str:
    """The autodoc directive of an export documented on its own module's page."""
    kind = _kind(e.obj)
    if kind in ("class", "exception"):
        return f".. auto{kind}:: {e.name}\n   :members:\n   :show-inheritance:\n"
    return f".. auto{kind}:: {e.name}\n"


def _alias_rst(e: Entry, home: str) -> str:
    role = {"module": "mod", "class": "class", "exception": "exc", "function": "func"}
    return f"- ``{e.name}``: :py:{role.get(_kind(e.obj), 'data')}:`{home}`\n"


def module_page(name: str, alias_of: dict[str, str], pages: list[str]) -> str:
    """The reST source of the reference page of public module ``name``."""
    module = sys.modules[name]
    parts = [
        f".. Generated by docs/api/generate.py from {name}.__all__; edits are overwritten.\n",
        _heading(name),
    ]
    if module.__name__ != name:
        parts.append(
            f".. py:module:: {name}\n\n"
            f"``{name}`` is the module :py:mod:`{module.__name__}` under a second name: every "
            f"entry below links to it.\n"
        )
    exported = getattr(module, "__all__", None)
    if exported is None:  # no __all__: autodoc takes the members defined in the module
        parts.append(f".. automodule:: {name}\n   :members:\n")
        return "\n".join(parts)
    if module.__name__ == name:
        parts.append(f".. automodule:: {name}\n   :no-members:\n")
    parts.append(f".. currentmodule:: {name}\n")
    if not exported:
        return "\n".join(parts)
    entries = [Entry(name, attr, getattr(module, attr)) for attr in exported]
    # A module under a second name is left out of the table: importing it by that name
    # (``attnlab.pos.rope_scaling``) would load a second copy of the module.
    table = "".join(
        f"   {e.name}\n"
        for e in entries
        if not (e.qualname in alias_of and isinstance(e.obj, types.ModuleType))
    )
    parts.append(_heading("Summary", "-") + f"\n.. autosummary::\n   :nosignatures:\n\n{table}")
    here = [e for e in entries if e.qualname not in alias_of and e.qualname not in pages]
    if here:
        parts.append(_heading("Reference", "-"))
        parts.extend(_entry_rst(e) for e in here)
    elsewhere = [e for e in entries if e.qualname in alias_of]
    if elsewhere:
        parts.append(
            _heading("Documented elsewhere", "-")
            + f"\nThese names of ``{name}`` are the objects documented at:\n\n"
            + "".join(_alias_rst(e, alias_of[e.qualname]) for e in elsewhere)
        )
    return "\n".join(parts)


def write_pages(outdir: Path, package: str = PACKAGE) -> list[str]:
    """Writes one ``<module>.rst`` per public module into ``outdir`` (only files whose text
    changed, so that incremental builds stay incremental) and removes stale pages."""
    outdir.mkdir(parents=True, exist_ok=True)
    modules = public_modules(package)
    alias_of = homes(modules)
    wanted = {}
    for name in modules:
        wanted[outdir / f"{name}.rst"] = module_page(name, alias_of, modules)
    for path in outdir.glob("*.rst"):
        if path not in wanted:
            path.unlink()
    for path, text in wanted.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    return modules
