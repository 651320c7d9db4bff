"""What the attnlab command prints: a --help without torch, tables that fit the terminal and
never cut a field, --json beside every table, progress that ends at its total, a quick check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.cells import cell_len

import attnlab
from attnlab import cli
from attnlab.cli import bench

SRC = Path(attnlab.__file__).parent.parent
SUBCOMMANDS = [m.__name__.rsplit(".", 1)[1] for m in cli.COMMANDS]
TASKS = ["classify", "rnn", "translate", "vit"]
DECODE_REASON = "it is inference-only (no backward) and an input requires grad"

# Runs the command's --help with the attnlab package replaced by an empty one of the same path:
# what `attnlab.cli` itself imports, whatever `attnlab/__init__.py` does.
_HELP_PROBE = """
import contextlib, io, json, sys, time, types
start = time.perf_counter()
package = types.ModuleType("attnlab")
package.__path__ = [sys.argv[1] + "/attnlab"]
sys.modules["attnlab"] = package
from attnlab import cli
found = {}
for argv in json.loads(sys.argv[2]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        cli.main(argv)
    found[" ".join(argv)] = text.getvalue().startswith("usage: attnlab")
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("torch", "numpy", "rich", "tqdm")
    or (m.startswith("attnlab.") and not m.startswith("attnlab.cli"))
)
print(json.dumps({"loaded": loaded, "usage": found, "seconds": time.perf_counter() - start}))
"""


def _lines_fit(text: str, columns: int) -> bool:
    return all(cell_len(line) <= columns for line in text.splitlines())


def _last_column(table: str, header: str) -> str:
    """The text of a table's last column (headed ``header``), its wrapped lines joined."""
    lines = table.splitlines()
    head = next(n for n, line in enumerate(lines) if line.rstrip().endswith(" " + header))
    start = len(lines[head].rstrip()) - len(header)
    return _joined(" ".join(line[start:] for line in lines[head + 2 :]))


def _joined(text: str) -> str:
    """The text with its line breaks and runs of spaces as one space (wrapped cells joined)."""
    return " ".join(text.split())


# ------------------------------------------------------------------------------------ --help
def test_help_of_the_command_and_every_subcommand_imports_neither_torch_nor_the_library():
    argvs = [["--help"], *([name, "--help"] for name in SUBCOMMANDS)]
    argvs += [["train", task, "--help"] for task in TASKS]
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE, str(SRC), json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["loaded"] == []
    assert all(result["usage"].values()) and len(result["usage"]) == len(argvs)
    assert result["seconds"] < 1.0  # all 18 of them (torch alone takes longer to import)


def test_python_dash_m_attnlab_help_imports_no_torch():
    """The real entry point — the package ``attnlab`` and its ``__main__`` — answers every
    ``--help`` without torch: ``import attnlab`` defers its public names to first use."""
    argvs = [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS]
    code = (
        "import contextlib, io, json, runpy, sys, time\n"
        "start = time.perf_counter()\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    sys.argv = ['attnlab', *argv]\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        runpy.run_module('attnlab', run_name='__main__', alter_sys=True)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "print(json.dumps({'heavy': heavy, 'seconds': time.perf_counter() - start}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["seconds"] < 1.0  # every --help, in one process


def test_the_help_texts_mirror_the_library_constants():
    from dataclasses import asdict

    from attnlab.apps import gpt
    from attnlab.apps import translate as translate_app
    from attnlab.cli import train, translate

    settings = asdict(gpt.TrainSettings())
    assert {k: settings[k] for k in train.DEFAULTS} == train.DEFAULTS
    assert (train.SCHEDULES, train.PRECISIONS) == (gpt.SCHEDULES, gpt.PRECISIONS)
    assert train.SWEEP_AXES == gpt.SWEEP_AXES
    assert translate.MAX_SOURCE_CHARS == translate_app.MAX_SOURCE_CHARS
    assert tuple(bench.DTYPES) == bench.DTYPE_NAMES and tuple(bench.CLOCKS) == bench.CLOCK_NAMES


# -------------------------------------------------------------------------------------- check
def _check(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["check", "--backend", "decode", "-L", "17", "-S", "23", *args])
    return code, capsys.readouterr().out


def test_check_lists_only_what_runs_here_unless_all(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out = _check(capsys, "--dtype", "float32")
    assert code == 0
    assert "n/a" not in out and "2 passed, 0 failed, 9 not supported" in out
    assert "--all lists them" in _joined(out)
    code, out = _check(capsys, "--dtype", "float32", "--all")
    assert code == 0
    na = [line for line in out.splitlines() if line.startswith("decode ") and "n/a:" in line]
    assert len(na) == 9
    # every reason whole, wrapped within its column, never cut
    assert _last_column(out.split("\n\n")[1], "result").count(f"n/a: {DECODE_REASON}") == 8


def test_check_tables_fit_the_terminal_and_stay_plain_text(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    code, out = _check(capsys, "--dtype", "float32", "--all")
    assert code == 0 and _lines_fit(out, 72) and "\x1b" not in out
    assert _last_column(out.split("\n\n")[1], "result").count(f"n/a: {DECODE_REASON}") == 8


def test_check_json_has_every_row_and_field_whole(capsys):
    code, out = _check(capsys, "--dtype", "float32", "--all", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 11
    assert {r["result"] for r in rows} == {"pass", "n/a"}
    assert [r["reason"] for r in rows if r["mask"] == "causal"] == [DECODE_REASON]
    passed = [r for r in rows if r["result"] == "pass"]
    assert all(0 <= r["max_err_out"] < 1e-5 and r["max_err_grad"] is None for r in passed)


def test_check_by_default_runs_the_native_dtypes(capsys, monkeypatch):
    from attnlab import _ext

    monkeypatch.setattr(_ext, "native_products", lambda dtype: dtype is not torch.float16)
    code, out = _check(capsys, "--json")
    assert code == 0
    assert sorted({r["dtype"] for r in json.loads(out)}) == ["bfloat16", "float32", "float64"]
    code, out = _check(capsys)
    assert "not checked: float16" in _joined(out)
    code, out = _check(capsys, "--json", "--all")
    assert code == 0 and len({r["dtype"] for r in json.loads(out)}) == 4


def test_check_builds_no_kernel_by_default(tmp_path):
    """A first run is quick: an unbuilt C++ kernel is not built (10–40 s each), its pure-PyTorch
    engine is checked, and the summary says how to check the kernel."""
    from attnlab import _ext

    if _ext.compiler() is None:
        pytest.skip("no C++ compiler: no kernel is ever built here")
    cache = tmp_path / "ext"
    argv = ["check", "--backend", "flash", "--dtype", "float32", "-L", "17", "-S", "23"]
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ATTNLAB_EXT_CACHE": str(cache), "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(cache.rglob("*.so")) and "building C++ kernel" not in proc.stderr
    out = _joined(proc.stdout)
    assert "C++ kernels not built yet:" in out and "`attnlab build` builds them" in out
    assert "11 passed, 0 failed" in out


class _Bar:
    """A stand-in progress bar that records its total and count."""

    def __init__(self, items=None, *, total=None, desc="", quiet=False):
        self.total, self.n, self.now = total, 0, []

    def step(self, what=None):
        self.n += 1

    def set_postfix(self, **values):
        self.now.append(values)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_bench_progress_ends_at_its_total(monkeypatch, capsys):
    bars = []

    def make(*args, **kwargs):
        bars.append(_Bar(*args, **kwargs))
        return bars[-1]

    real = bench.matmul_rate
    monkeypatch.setattr(bench, "steps", make)
    monkeypatch.setattr(bench, "matmul_rate", lambda **kw: real(**{**kw, "n": 64, "repeats": 1}))
    monkeypatch.setattr(bench, "matmul_size", lambda *a, **kw: 64)
    argv = ["bench", "--case", "causal", "--causal-length", "64", "--heads", "1", "--dim", "8"]
    assert cli.main([*argv, "--repeats", "1", "--dtype", "float32", "bfloat16"]) == 0
    capsys.readouterr()
    [bar] = bars
    assert bar.total == 4 and bar.n == bar.total
    assert any("warm-up flash" in str(v) for v in bar.now)  # the timed call is shown


def _report(note: str):
    rows = [
        bench.Row("window 256 L=16384 fwd", "flash", 0.5, 120.0, dtype="float32"),
        bench.Row("window 256 L=16384 fwd", "sdpa dense mask", 1.5, 40.0, note, 1e-7, "float32"),
        bench.Row("memory causal fwd+bwd L=65536", "flash", 9.0, 30.0, note, peak_bytes=2**27),
    ]
    rows[1].tolerance = 1e-5
    report = bench.Report(rows=rows)
    report.info.update(machine="AMD EPYC, 2 threads, torch 2.13", cpu="AMD EPYC; AMX: no")
    report.matmul_gflops["float32"] = 300.0
    return report


def test_bench_table_fits_the_terminal_and_keeps_notes_whole(monkeypatch):
    note = "skipped: FlexAttention did not compile on this machine: " + "a reason " * 12
    monkeypatch.setenv("COLUMNS", "90")
    text = bench.format_table(_report(note.strip()))
    assert _lines_fit(text, 90) and "\x1b" not in text
    assert _last_column(text.split("\n\n", 1)[1], "note").count(_joined(note)) == 2
    assert "3.00×" in text


def test_bench_json_alone_prints_the_rows(monkeypatch, capsys):
    monkeypatch.setattr(bench, "matmul_rate", lambda **kw: 1.0)
    monkeypatch.setattr(bench, "matmul_size", lambda *a, **kw: 64)

    def fake_case(args, report, progress):
        report.rows.append(bench.Row("causal L=8 fwd", "flash", 1.0, dtype="float32"))

    monkeypatch.setattr(bench, "case_causal", fake_case)
    assert cli.main(["bench", "--case", "causal", "--quiet", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in data["rows"]] == ["flash"] and data["matmul_gflops"]


def test_bench_memory_panels_draw_memory_not_seconds():
    pytest.importorskip("matplotlib")
    from attnlab.viz.bench import bench_figure

    fig = bench_figure(_report("n").rows)
    memory = next(ax for ax in fig.axes if ax.get_title().startswith("memory"))
    assert memory.get_xlabel() == "peak RSS growth (MiB)"
    assert [p.get_width() for p in memory.patches] == [128.0]
    assert [t.get_text().strip() for t in memory.texts] == ["128 MiB"]
    timing = next(ax for ax in fig.axes if ax.get_title().startswith("window"))
    assert timing.get_xlabel() == "seconds"


# ----------------------------------------------------------------------- experiment, estimate
def test_experiment_json_and_a_table_that_fits(capsys, monkeypatch):
    assert cli.main(["experiment", "scaling", "--samples", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["d_k"] for r in data["rows"]] == [4, 16, 64, 256, 1024]
    assert set(data["rows"][0]) == set(data["columns"])
    monkeypatch.setenv("COLUMNS", "70")
    assert cli.main(["experiment", "scaling", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert _lines_fit(out, 70) and "grad norm" in _joined(out)


def test_estimate_json_carries_the_rows_and_measurements(capsys):
    argv = ["estimate", "--seq", "16", "--d-model", "32", "--heads", "2", "--measure", "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["L"] == 16 and data["rows"][0]["values"]["naive"] > 0
    assert data["measured"]["naive"]["seconds"] > 0


class _Terminal:
    """stderr as a terminal: what a progress line writes there."""

    def __init__(self):
        self.text = []

    def write(self, s):
        self.text.append(s)
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return True

    def fileno(self):
        raise OSError("not a real terminal")


@pytest.mark.parametrize(
    "argv,shown",
    [
        (["experiment", "scaling", "--samples", "2"], "attnlab experiment scaling"),
        (
            ["estimate", "--seq", "16", "--d-model", "32", "--heads", "2", "--measure"],
            "attnlab estimate --measure",
        ),
    ],
)
def test_long_commands_show_progress_on_a_terminal_only(argv, shown, monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(argv) == 0
    assert shown in "".join(terminal.text)
    terminal.text.clear()
    assert cli.main([*argv, "--quiet"]) == 0
    assert terminal.text == []
    capsys.readouterr()


# -------------------------------------------------------------------------------------- textbook
def test_textbook_names_its_sources_titles_sections_in_english_and_wraps(monkeypatch):
    from attnlab.textbook import SEEDS, run_claim, select_claims
    from attnlab.textbook.render import as_text

    rows = [run_claim(c) for c in select_claims(["000-def-a", "002-8.1.3-a"])]
    long = rows[0].claim.quote
    assert len(long) > 60  # a field the old text cut at ~90 characters
    text = as_text(rows, width=64)
    assert _lines_fit(text, 64)
    assert f"Source text 000: {SEEDS['000']}" in _joined(text)
    assert f"Source text 002: {SEEDS['002']}" in _joined(text)
    assert "8.1.3 Scaled dot-product attention (8.1.3 缩放点积注意力)" in _joined(text)
    for r in rows:  # every field whole
        for field in (r.claim.paraphrase, r.finding.computed, r.claim.assumptions):
            assert _joined(field) in _joined(text), field


def test_every_section_has_an_english_title():
    from attnlab.textbook import all_claims
    from attnlab.textbook.titles import english

    missing = sorted({c.section for c in all_claims() if english(c.section) is None})
    assert missing == []


def test_textbook_command_wraps_to_the_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "70")
    assert cli.main(["textbook", "--only", "002-8.1.3-a", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert _lines_fit(out, 70) and "Source text 002" in out and "\x1b" not in out
