"""The design page's layer listing (docs/design.md), generated from the package tree.

Every subpackage and top-level module of ``src/attnlab`` is a node; node A depends on node B when
any file of A imports from B — at module level, inside a function (deferred) or under
``if TYPE_CHECKING:`` — as tests/test_architecture.py's ``package_graph`` computes it (the one
definition: the root ``attnlab/__init__.py`` re-exports the public names and is not a node; a
name taken from it counts as an import of the module that defines it).
Nodes are placed in layers: layer 0 imports no other node, layer n imports only from layers
below n and from at least one node of layer n − 1. Each node is described by the first sentence of
its docstring (the package's ``__init__.py`` for a package). A cycle between nodes is an error.

Usage::

    python scripts/architecture.py                  # print the listing
    python scripts/architecture.py --write docs/design.md  # replace it between the markers
    python scripts/architecture.py --check docs/design.md  # exit 1 if the page's copy is stale
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "src" / "attnlab"
TESTS = REPO / "tests" / "test_architecture.py"
COMMAND = "python scripts/architecture.py --write docs/design.md"
BEGIN = f"<!-- architecture:begin ({COMMAND}) -->"
END = "<!-- architecture:end -->"


def nodes(root: Path = ROOT) -> dict[str, Path]:
    """``{node: file holding its docstring}``: each subpackage and top-level module of ``root``."""
    out = {}
    for path in sorted(root.iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            out[path.name + "/"] = path / "__init__.py"
        elif path.suffix == ".py" and path.name != "__init__.py":
            out[path.name] = path
    return out


def _import_graph():
    """tests/test_architecture.py, the one definition of attnlab's package-level import graph."""
    spec = importlib.util.spec_from_file_location("attnlab_architecture_test", TESTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dependencies(root: Path = ROOT) -> dict[str, set[str]]:
    """``{node: nodes it imports from}`` over every import of every file of the node
    (``package_graph`` of tests/test_architecture.py, which resolves names the root re-exports
    to the module that defines them)."""
    table = nodes(root)
    label = {f"{root.name}.{key.rstrip('/').removesuffix('.py')}": key for key in table}
    graph = _import_graph().package_graph(root)
    return {
        key: {label[t] for t in graph.get(dotted, {}) if t in label}
        for dotted, key in label.items()
    }


def layers(deps: dict[str, set[str]]) -> list[list[str]]:
    """Nodes by layer (longest import chain below them); raises ValueError on a cycle."""
    level: dict[str, int] = {}

    def depth(node: str, path: tuple[str, ...]) -> int:
        if node in path:
            cycle = " → ".join((*path[path.index(node) :], node))
            raise ValueError(f"import cycle between packages: {cycle}")
        if node not in level:
            below = [depth(d, (*path, node)) for d in sorted(deps[node])]
            level[node] = 1 + max(below, default=-1)
        return level[node]

    for node in deps:
        depth(node, ())
    out: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for node in sorted(level):
        out[level[node]].append(node)
    return out


def summary(path: Path) -> str:
    """The first sentence of the docstring of ``path`` (an error if it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path} has no docstring: the Architecture listing needs its summary")
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".") + "."


def listing(root: Path = ROOT) -> str:
    """The Markdown listing: one bullet per layer, each node with its docstring's first sentence."""
    table = nodes(root)
    lines = [
        BEGIN,
        "Layers, bottom up: a package imports only from layers before its own — every",
        "import counted, deferred ones and `TYPE_CHECKING` ones too (`tests/test_architecture.py`",
        "fails on a cycle; the root `attnlab/__init__.py` re-exports the public names and is not",
        "a layer).",
        "",
    ]
    for n, group in enumerate(layers(dependencies(root))):
        lines.append(f"- Layer {n}")
        lines.extend(f"  - `{node}` — {summary(table[node])}" for node in group)
    lines.append(END)
    return "\n".join(lines)


def replaced(text: str, block: str) -> str:
    """``text`` with the part between the markers (inclusive) replaced by ``block``."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the markers {BEGIN!r} … {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="PAGE", help="replace the listing in it")
    group.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if it is stale")
    args = parser.parse_args(argv)
    try:
        block = listing()
    except ValueError as err:
        print(f"architecture: {err}", file=sys.stderr)
        return 1
    if args.write:
        args.write.write_text(replaced(args.write.read_text(), block))
    elif args.check:
        if replaced(args.check.read_text(), block) != args.check.read_text():
            print(f"{args.check}: the Architecture listing is stale; run {COMMAND}")
            return 1
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
