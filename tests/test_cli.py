"""The attnlab command: --help everywhere, --version, and check's table and exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attnlab
from attnlab import cli
from attnlab.cli.check import _check_cases
from attnlab.functional import registry


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnlab {attnlab.__version__}"
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "check" in sub.choices
    for name in sub.choices:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        assert "usage: attnlab " + name in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "check" in out.stdout


def test_check_passes_and_prints_table(capsys):
    code = cli.main(["check", "--backend", "sdpa", "--dtype", "float32", "-L", "17", "-S", "23"])
    out = capsys.readouterr().out
    assert code == 0
    assert "backend" in out and "max err out" in out
    rows = [line for line in out.splitlines() if line.startswith("sdpa ")]
    assert len(rows) == len(_check_cases(2, 17, 23))
    assert all(line.rstrip().endswith("pass") for line in rows)
    assert f"{len(rows)} passed, 0 failed" in out


def test_check_fails_on_a_wrong_backend(capsys, monkeypatch):
    def wrong(req):
        out, _ = registry.get_backend("sdpa").run(req)
        return out * (1 + 1e-3), None

    monkeypatch.setitem(
        registry._BACKENDS,
        "broken",
        registry.Backend("broken", wrong, lambda r: None, "off by 0.1%"),
    )
    code = cli.main(["check", "--backend", "broken", "--dtype", "float64", "-L", "9", "-S", "9"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "0 passed" in out


def test_check_unknown_backend(capsys):
    assert cli.main(["check", "--backend", "nope"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_torch_is_the_only_runtime_import():
    code = (
        "import sys, attnlab; "
        "print([m for m in ('matplotlib', 'transformers', 'safetensors') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert torch.__version__
