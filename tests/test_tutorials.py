"""The docs site's tutorials (``docs/tutorials/plot_*.py``, sphinx-gallery scripts) run.

Each script runs by itself in a fresh interpreter with the Agg backend, as
``python docs/tutorials/plot_x.py`` would, and must exit 0: every ``torch.testing.assert_close``
inside it (attnlab against its definition, compiled against eager, attnlab against transformers'
eager and sdpa) holds. The runs are slow (compiling, timing tables, a pretrained model), so they
are marked ``slow``; the shape of each script — what sphinx-gallery needs to render it — is
checked in the default run.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS_DIR = Path(__file__).resolve().parents[1] / "docs" / "tutorials"

#: The tutorials of issue #41; any other ``plot_*.py`` in the folder is run too.
EXPECTED = (
    "plot_from_scratch_to_flash.py",
    "plot_masks_and_block_map.py",
    "plot_compile_your_model.py",
    "plot_transformers_model.py",
    "plot_why_sqrt_dk.py",
    "plot_sparse_linear_exact.py",
)
SCRIPTS = sorted(set(EXPECTED) | {p.name for p in TUTORIALS_DIR.glob("plot_*.py")})


def run_script(path: Path, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs ``python PATH`` in a fresh interpreter that imports the attnlab under test."""
    import attnlab

    src = str(Path(attnlab.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_tutorial_is_a_gallery_script(name: str):
    """A reST title underlined with ``=`` in the module docstring (what sphinx-gallery needs);
    the tutorials of `EXPECTED` also teach in ``# %%`` cells, show a figure and link the API."""
    path = TUTORIALS_DIR / name
    assert path.is_file(), f"{path} is missing"
    text = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(text))
    assert doc, f"{name}: no module docstring (sphinx-gallery takes the title and intro from it)"
    title, underline = doc.splitlines()[:2]
    assert set(underline) == {"="} and len(underline) >= len(title), (
        f"{name}: the docstring must open with a title underlined by '=' at least as long as it, "
        f"got {title!r} / {underline!r}"
    )
    if name not in EXPECTED:
        return
    assert text.count("\n# %%\n") >= 3, f"{name}: expected '# %%' cells"
    assert "plt.show()" in text, f"{name}: no figure is shown"
    assert ":func:`attnlab." in text or ":mod:`attnlab." in text, f"{name}: no link to the API"


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_tutorial_runs_standalone(name: str, tmp_path: Path):
    path = TUTORIALS_DIR / name
    assert path.is_file(), f"{path} is missing"
    r = run_script(path, tmp_path)
    assert r.returncode == 0, (
        f"{name} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    )
