"""Architecture rules of src/attnlab (issue 14): no import cycle between its modules, and
(issue 39) none between its packages even through deferred and ``TYPE_CHECKING`` imports.

Modules are discovered from the package directory (new packages and moved modules are picked up
without editing this file). An edge A → B means that executing A's module body imports B: every
``import``/``from … import`` statement at module level (also inside module-level ``if``/``try``
blocks, but not under ``if TYPE_CHECKING:``), resolved to the module it loads — ``from .pkg import
name`` loads ``pkg.name`` when that is a module, else ``pkg`` — plus the packages on the way
(importing ``a.b.c`` runs ``a/b/__init__`` first) that are not already packages of A. Imports
inside functions are deferred to call time and are not edges.

The package rule (`package_graph`) counts every import, wherever it stands, between the nodes
``attnlab.<name>`` (a subpackage with everything below it, or a top-level module). The root
``attnlab/__init__`` is not a node: it is the package's face and imports every subpackage on
purpose, so counting it would make each ``from attnlab import name`` a trivial cycle. Such an
import is an edge to the module the root takes ``name`` from, so a dependency through a
re-export still counts.
"""

from __future__ import annotations

import ast
import io
import itertools
import tokenize
from pathlib import Path

import pytest

import attnlab

ROOT = Path(attnlab.__file__).parent


def discover(root: Path) -> dict[str, tuple[Path, bool]]:
    """``{module name: (path, is_package)}`` of every ``.py`` file under the package ``root``."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements executed with the module body (not in functions or TYPE_CHECKING)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                out += _module_level(node.body)
            out += _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                out += _module_level(block)
            for handler in node.handlers:
                out += _module_level(handler.body)
    return out


def _resolve(name: str, is_pkg: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = name.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _with_packages(target: str, importer: str, mods: dict) -> set[str]:
    """``target`` and its packages that importing it runs (not the importer's own packages)."""
    parts = target.split(".")
    chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    own = importer.split(".")
    own_pkgs = {".".join(own[:i]) for i in range(1, len(own) + 1)}
    return {m for m in chain if m in mods and m not in own_pkgs}


def import_graph(root: Path, *, deferred: bool = False) -> dict[str, set[str]]:
    """Module-level import edges between the modules of the package at ``root``.

    ``deferred``: also the imports inside functions (run at call time).
    """
    mods = discover(root)
    edges: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        out: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if deferred:
            nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        else:
            nodes = _module_level(tree.body)
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(name, is_pkg, node.level, node.module)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for t in targets:
                out |= _with_packages(t, name, mods)
        edges[name] = out - {name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle ``[a, b, …, a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(edges):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def test_src_attnlab_has_no_import_cycle():
    edges = import_graph(ROOT)
    assert "attnlab.functional.flash.engines" in edges  # the walk sees the subpackages
    assert "attnlab.functional.flash" in edges["attnlab.functional.backends"]
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_attention_math_has_no_circle_even_through_deferred_imports():
    """functional/ and distributed/ do not hide a circle in an import inside a function (the old
    ``api → backends → flash → api`` circle was one)."""
    scope = ("attnlab.functional", "attnlab.distributed")
    edges = {
        m: {t for t in targets if t.startswith(scope)}
        for m, targets in import_graph(ROOT, deferred=True).items()
        if m.startswith(scope)
    }
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_flash_and_ring_modules_are_small_and_ring_uses_public_engines():
    """Issue 14's size target (≈600 lines) for the modules of this refactor; ring attention
    imports nothing private from the flash package."""
    for pkg in ("functional/flash", "distributed"):
        for path in (ROOT / pkg).glob("*.py"):
            n = len(path.read_text(encoding="utf-8").splitlines())
            assert n <= 600, f"{path.relative_to(ROOT)} has {n} lines"
    for path in (ROOT / "distributed").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and "flash" in (node.module or ""):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private {private} from {node.module}"


#: Issue 39 item 5 asks for checkpoint code of at most 400 lines over the safetensors library.
#: Everything that knows safetensors or attnlab's checkpoint metadata is in checkpoint.py: its
#: code (lines that are not blank, comments or docstrings) is held to 400, the whole file (with
#: the docstrings the contract needs) to what it is today.
CHECKPOINT_CODE_LINES = 400
CHECKPOINT_LINES = 512


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: not blank, not only a comment, not a docstring."""
    text = path.read_text(encoding="utf-8")
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):  # a docstring
            docs.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (*skip, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - docs)


def test_code_lines_counts_only_code(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Doc\nstring."""\n\n# a comment\nx = (\n    1\n)\n\n\ndef g():\n    """D."""\n')
    assert code_lines(f) == 4  # x = (, 1, ), def g():


def test_safetensors_is_known_to_checkpoint_py_alone():
    """The safetensors library, its headers, pickle refusal, the checkpoint metadata: one module.
    `attnlab._files` holds file utilities for any format and never names safetensors."""
    n = len((ROOT / "checkpoint.py").read_text(encoding="utf-8").splitlines())
    assert n <= CHECKPOINT_LINES, f"checkpoint.py has {n} lines"
    code = code_lines(ROOT / "checkpoint.py")
    assert code <= CHECKPOINT_CODE_LINES, f"checkpoint.py has {code} lines of code"
    assert "safetensors" not in (ROOT / "_files.py").read_text(encoding="utf-8").lower()
    users = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "require":
                names += [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
            if any(str(m).split(".")[0] == "safetensors" for m in names):
                users.append(path.relative_to(ROOT).as_posix())
    assert sorted(set(users)) == ["checkpoint.py"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root / "pkg"


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        (  # a direct circle through a relative import
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from .b import x\n",
                "pkg/b.py": "from . import a\n",
            },
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        (  # importing a submodule runs its package's __init__, which imports back
            {
                "pkg/__init__.py": "",
                "pkg/sub/__init__.py": "from .c import y\n",
                "pkg/sub/c.py": "from ..d import z\n",
                "pkg/d.py": "import pkg.sub.c\n",
            },
            ["pkg.d", "pkg.sub", "pkg.sub.c", "pkg.d"],
        ),
        (  # inside module-level try/if, not under TYPE_CHECKING
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "try:\n    from .b import x\nexcept ImportError:\n    pass\n",
                "pkg/b.py": "import sys\nif sys:\n    from .a import y\n",
            },
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
    ],
)
def test_cycle_finder_reports_cycles(tmp_path, files, cycle):
    assert find_cycle(import_graph(_write(tmp_path, files))) == cycle


def test_cycle_finder_ignores_deferred_imports(tmp_path):
    files = {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nfrom .b import g\n"
        "if TYPE_CHECKING:\n    from .b import h\n\ndef f():\n    return g\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n\n"
        "def g():\n    from .a import f\n    return f\n",
    }
    edges = import_graph(_write(tmp_path, files))
    assert edges == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycle(edges) is None
    assert find_cycle(import_graph(tmp_path / "pkg", deferred=True)) == ["pkg.a", "pkg.b", "pkg.a"]


# ------------------------------------------------------------------- package-level cycles
def _node(module: str) -> str:
    """``attnlab.functional.flash.run`` -> ``attnlab.functional``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def _all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: module level, inside functions and under ``if TYPE_CHECKING:``."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def root_names(root: Path) -> dict[str, str]:
    """``{name: module}`` for every name the root ``__init__`` imports from its submodules
    (anywhere in the file: the lazily built namespaces such as ``attnlab.linear`` count too)."""
    mods = discover(root)
    names: dict[str, str] = {}
    for node in _all_imports(ast.parse((root / "__init__.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(root.name, True, node.level, node.module)
            for a in node.names:
                full = f"{base}.{a.name}"
                names[a.asname or a.name] = full if full in mods else base
    return names


def package_graph(root: Path) -> dict[str, dict[str, set[str]]]:
    """Package-level edges over ALL imports: ``{node: {node: {"importer -> imported", ...}}}``.

    The nodes are `_node` of the modules below the root; the root itself is left out as a
    source and resolved through `root_names` as a target (see the module docstring).
    """
    mods = discover(root)
    top = root.name
    names = root_names(root)
    graph: dict[str, dict[str, set[str]]] = {}
    for name, (path, is_pkg) in mods.items():
        if name == top:
            continue
        for node in _all_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            else:
                base = _resolve(name, is_pkg, node.level, node.module)
                pairs = [(base, a.name) for a in node.names]
            for base, imported in pairs:
                if base != top and not base.startswith(top + "."):
                    continue  # another library
                full = f"{base}.{imported}" if imported else base
                if full in mods:
                    target = full
                elif base in mods and base != top:
                    target = base
                elif imported in names:  # a name the root (or its namespaces) hands on
                    target = names[imported]
                else:
                    continue  # the root itself, by no name: nothing to resolve
                if _node(target) not in (top, _node(name)):
                    edge = graph.setdefault(_node(name), {}).setdefault(_node(target), set())
                    edge.add(f"{name} -> {target}")
    return graph


def package_cycles(graph: dict[str, dict[str, set[str]]], limit: int = 50) -> list[list[str]]:
    """The elementary cycles ``[a, b, …, a]`` of ``graph`` (at most ``limit``), each starting at
    its smallest node."""
    cycles: list[list[str]] = []

    def walk(start: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], {})):
            if len(cycles) >= limit:
                return
            if nxt == start:
                cycles.append([*path, start])
            elif nxt > start and nxt not in path:
                walk(start, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def describe(graph: dict[str, dict[str, set[str]]], cycle: list[str]) -> str:
    """One cycle with the module imports behind each of its edges."""
    lines = [" → ".join(cycle)]
    for a, b in itertools.pairwise(cycle):
        lines.append(f"  {a} → {b}: " + "; ".join(sorted(graph[a][b])))
    return "\n".join(lines)


def test_no_package_level_cycle_through_any_import():
    """Issue 39: layers point one way — no cycle between attnlab's packages, counting imports
    inside functions and under ``TYPE_CHECKING`` too."""
    graph = package_graph(ROOT)
    assert "attnlab.apps" in graph and "attnlab.functional" in graph["attnlab.modules"]
    cycles = package_cycles(graph)
    for cycle in cycles:
        print(describe(graph, cycle))
    assert not cycles, f"{len(cycles)} package-level cycle(s):\n" + "\n".join(
        describe(graph, c) for c in cycles
    )


@pytest.mark.parametrize(
    ("files", "cycles"),
    [
        (  # a deferred import closes the circle
            {
                "pkg/__init__.py": "",
                "pkg/a/__init__.py": "",
                "pkg/a/x.py": "from ..b import y\n",
                "pkg/b.py": "def f():\n    from .a import x\n",
            },
            [["pkg.a", "pkg.b", "pkg.a"]],
        ),
        (  # so does one under TYPE_CHECKING
            {
                "pkg/__init__.py": "",
                "pkg/a.py": (
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import y\n"
                ),
                "pkg/b.py": "import pkg.a\n",
            },
            [["pkg.a", "pkg.b", "pkg.a"]],
        ),
        (  # the root's re-exports are no cycle; the name leads to the module that defines it
            {
                "pkg/__init__.py": "from .a import f\nfrom .b import g\n",
                "pkg/a.py": "def f():\n    from . import g\n",
                "pkg/b.py": "from pkg import f\ndef g(): ...\n",
            },
            [["pkg.a", "pkg.b", "pkg.a"]],
        ),
        (
            {
                "pkg/__init__.py": "from .a import f\nfrom .b import g\n",
                "pkg/a.py": "import pkg\ndef f():\n    from . import g\n",
                "pkg/b.py": "def g(): ...\n",
            },
            [],
        ),
    ],
    ids=["deferred", "type-checking", "through-the-root", "root-is-no-node"],
)
def test_package_cycle_finder(tmp_path, files, cycles):
    assert package_cycles(package_graph(_write(tmp_path, files))) == cycles
