"""The design page's layer listing is generated from the tree and names every package.

`scripts/architecture.py` places each subpackage and top-level module of attnlab in a layer by
its imports (all of them: deferred and TYPE_CHECKING too) and describes it by its docstring's
first line; docs/design.md holds its output between two markers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "design.md"


@pytest.fixture(scope="module")
def arch():
    spec = importlib.util.spec_from_file_location("architecture", REPO / "scripts/architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_listing_is_current(arch) -> None:
    text = PAGE.read_text()
    assert arch.replaced(text, arch.listing()) == text, (
        "docs/design.md's layer listing is stale: "
        "run python scripts/architecture.py --write docs/design.md"
    )


def test_every_package_is_named(arch) -> None:
    section = PAGE.read_text().split(arch.BEGIN, 1)[1].split(arch.END, 1)[0]
    for node in arch.nodes():
        assert f"`{node}`" in section, f"docs/design.md's Layers section does not name {node}"


def test_layers_follow_imports(arch, tmp_path) -> None:
    """A package importing a later layer (even inside a function) moves up; a cycle is refused."""
    pkg = tmp_path / "attnlab"
    for name, body in {
        "a": "",
        "b": "def f():\n    from attnlab.a import x\n",
        "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import y\n",
    }.items():
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text(f'"""Package {name}."""\n{body}')
    (pkg / "__init__.py").write_text('"""Root."""\nfrom attnlab import a, b, c\n')
    assert arch.layers(arch.dependencies(pkg)) == [["a/"], ["b/"], ["c/"]]
    (pkg / "a" / "__init__.py").write_text('"""Package a."""\nimport attnlab.c\n')
    with pytest.raises(ValueError, match="import cycle"):
        arch.layers(arch.dependencies(pkg))
