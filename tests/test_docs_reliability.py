"""docs/reliability.md names the tests that hold each guarantee: every one it names exists.

A page of guarantees whose tests were renamed or deleted would claim what nothing checks; this
test fails first. It also checks that every module the page names imports and every setting it
names is one attnlab reads.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reliability.md"


def _tests_named(text: str) -> list[tuple[str, str | None]]:
    """``(file, function or None)`` for every ``tests/x.py`` or ``tests/x.py::name`` on the page."""
    return [(m[1], m[2]) for m in re.finditer(r"(tests/[\w/]+\.py)(?:::(\w+))?", text)]


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}


def test_every_test_the_page_names_exists():
    text = PAGE.read_text(encoding="utf-8")
    named = _tests_named(text)
    assert len({f for f, _ in named}) >= 8  # the page is made of such references
    for file, function in named:
        path = ROOT / file
        assert path.is_file(), f"docs/reliability.md names {file}, which does not exist"
        if function is not None:
            assert function in _functions(path), f"docs/reliability.md names {file}::{function}"
    bare = re.findall(r"`(test_\w+)`", text)  # a test named without its file: in some test file
    everywhere = set().union(*(_functions(p) for p in (ROOT / "tests").glob("test_*.py")))
    missing = sorted(set(bare) - everywhere)
    # PyTorch's and flash-attention's test names are theirs (restated, named in docstrings)
    restated = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*.py"))
    assert [n for n in missing if n not in restated] == []


def test_every_module_and_setting_the_page_names_is_real():
    text = PAGE.read_text(encoding="utf-8")
    for dotted in sorted(set(re.findall(r"`(attnlab(?:\.\w+)+)`", text))):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                obj = getattr(obj, name)
            break
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "src").rglob("*.py"))
    for setting in sorted(set(re.findall(r"`(ATTNLAB_\w+)", text))):
        assert f'"{setting}"' in source, f"docs/reliability.md names {setting}, read nowhere"
