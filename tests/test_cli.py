"""The attnlab command: --help everywhere, --version, and check's table and exit code."""

from __future__ import annotations

import ast
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import cli
from attnlab.cli import bench
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


def test_check_lists_calls_a_backend_cannot_run_as_not_supported(capsys):
    """decode runs only decode steps: those pass against the reference, the rest are n/a (listed
    with the backend's own reason with --all, counted otherwise)."""
    argv = ["check", "--backend", "decode", "--dtype", "float32", "-L", "17", "-S", "23"]
    code = cli.main([*argv, "--all", "--json"])
    rows = {r["mask"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0
    steps = {name for name, case in _check_cases(2, 17, 23).items() if case[3]}
    assert steps == {"decode step", "decode step, padding"}
    for name, row in rows.items():
        if name in steps:
            assert row["result"] == "pass", row
        else:
            assert row["result"] == "n/a" and row["reason"].startswith("it "), row
    assert rows["causal"]["reason"].startswith("it is inference-only")
    assert cli.main(argv) == 0
    n = len(rows)
    out = " ".join(capsys.readouterr().out.split())
    assert f"{len(steps)} passed, 0 failed, {n - len(steps)} not supported" in out


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


# ------------------------------------------------------------------------------- the package
SRC = Path(attnlab.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (at any depth, relative ones resolved)."""
    package = ["attnlab", *path.relative_to(SRC).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_the_library_never_imports_the_cli():
    library = [
        p
        for p in SRC.rglob("*.py")
        if "cli" not in p.relative_to(SRC).parts and p.name != "__main__.py"
    ]
    assert len(library) > 50
    offenders = {
        str(p.relative_to(SRC)): sorted(
            n for n in _imported_modules(p) if n.startswith("attnlab.cli")
        )
        for p in library
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    # and the scan sees imports: the CLI's own modules do import it
    assert "attnlab.cli.check" in _imported_modules(SRC / "cli" / "__init__.py")


def test_every_command_has_its_own_module():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == [
        "check",
        "build",
        "info",
        "estimate",
        "advise",
        "experiment",
        "heads",
        "bench",
        "train",
        "generate",
        "translate",
        "visualize",
        "textbook",
    ]
    assert [m.__name__.rsplit(".", 1)[1] for m in cli.COMMANDS] == list(sub.choices)
    assert all(len(p.read_text().splitlines()) <= 600 for p in (SRC / "cli").glob("*.py"))


def test_python_dash_m_attnlab_is_the_command(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["attnlab", "--version"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("attnlab", run_name="__main__")  # what `python -m attnlab` runs
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnlab {attnlab.__version__}"


def test_pos_and_linear_are_registered_names_not_files():
    assert not (SRC / "pos.py").exists() and not (SRC / "linear.py").exists()
    code = (
        "import attnlab.pos as pos, attnlab.positional as positional\n"
        "from attnlab.linear import LinearAttention, linear_attention, favor_attention\n"
        "from attnlab.modules.linear import LinearAttention as LA\n"
        "from attnlab.functional.linear import linear_attention as la\n"
        "from attnlab.functional.performer import favor_attention as fa\n"
        "import importlib, attnlab\n"
        "lin = importlib.import_module('attnlab.linear')\n"
        "print(pos is positional, attnlab.pos is positional, LinearAttention is LA,\n"
        "      linear_attention is la, favor_attention is fa, lin is attnlab.linear,\n"
        "      sorted(lin.__all__) == sorted(n for n in vars(lin) if not n.startswith('_')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"] * 7


# ------------------------------------------------------------------------------------- bench
def test_bench_prints_a_table_of_numbers(tmp_path, capsys, monkeypatch):
    real_rate = bench.matmul_rate
    monkeypatch.setattr(
        bench, "matmul_rate", lambda **kw: real_rate(**{**kw, "n": 256, "repeats": 1})
    )
    monkeypatch.setenv("COLUMNS", "200")  # one line per row: the cells can be read back
    L, B, H, D = 128, 1, 2, 16
    argv = ["bench", "--case", "causal", "--causal-length", str(L), "--batch", str(B)]
    argv += ["--heads", str(H), "--dim", str(D), "--repeats", "2", "--no-backward", "--quiet"]
    assert cli.main([*argv, "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("machine: ") and f"{torch.get_num_threads()} threads" in out[0]
    assert out[1].startswith("cpu: ") and "AMX: " in out[1]
    rate = float(re.fullmatch(r"fp32 matmul .*: ([0-9.]+) GFLOP/s .*", out[2]).group(1))
    assert rate > 0
    header = re.split(r"\s{2,}", out[4].strip())
    assert header == [
        "case",
        "dtype",
        "contender",
        "seconds",
        "useful GF/s",
        "% mm",
        "flash is ×",
        "note",
    ]
    assert set(out[5]) == {"─"}
    rows = {line.split("  ")[0].strip(): line for line in out[6:] if line}
    case = f"causal L={L} fwd"
    lines = [line for line in out[6:] if line.startswith(case)]
    assert [re.split(r"\s{2,}", line)[2] for line in lines] == ["flash", "sdpa is_causal"]
    report = json.loads((tmp_path / "b.json").read_text())
    by_name = {r["name"]: r for r in report["rows"]}
    pairs = B * H * L * (L + 1) // 2  # causal: row i attends i + 1 keys
    for line in lines:
        cells = re.split(r"\s{2,}", line)
        r = by_name[cells[2]]
        assert cells[1] == "fp32" and r["dtype"] == "float32"
        assert r["seconds"] > 0 and float(cells[3]) == pytest.approx(r["seconds"], abs=5e-4)
        assert r["useful_gflops"] * r["seconds"] == pytest.approx(4 * pairs * D / 1e9, rel=1e-9)
        mm = report["matmul_gflops"]["float32"]
        assert cells[5] == f"{100 * r['useful_gflops'] / mm:.0f}%"
    sdpa = re.split(r"\s{2,}", lines[1])
    ratio = by_name["sdpa is_causal"]["seconds"] / by_name["flash"]["seconds"]
    assert sdpa[6] == f"{ratio:.2f}×"
    err = float(re.match(r"max\|Δ\| vs flash (\S+) ok \(tol", sdpa[7]).group(1))
    assert err < 1e-5  # same attention, fp32
    assert rows and by_name["sdpa is_causal"]["max_err"] < 1e-5
