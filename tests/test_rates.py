"""Same question, same answer (issue #37, item 4): ``advise`` uses this machine's cached matmul
rate (`attnlab.analysis.rates`) or ``--gflops``; ``estimate`` measures nothing.

Every test points ``ATTNLAB_THRESHOLDS_FILE`` at a temporary directory (the rate cache is
``matmul_rates.json`` beside it): the user's ~/.cache is never read or written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.analysis import rates
from attnlab.cli import advise as advise_cli
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
ADVISE = ["advise", "--seq", "6144", "--budget", "4GB", "--max-seconds", "2"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_THRESHOLDS")}
    env["ATTNLAB_THRESHOLDS_FILE"] = str(tmp_path / "thresholds.json")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "attnlab", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    return done.stdout


def _first_line_without_source(out: str) -> tuple[str, str]:
    first, _, rest = out.partition("\n")
    head, sep, source = first.rpartition(" GFLOP/s (")
    assert sep, first
    return head + rest, source.removesuffix(")")


def test_advise_three_runs_in_separate_processes_give_the_same_advice(tmp_path):
    env = _env(tmp_path)
    cache = tmp_path / "matmul_rates.json"
    outs, stamps = [], []
    for _ in range(3):
        outs.append(_run(ADVISE, env))
        stamps.append(cache.stat().st_mtime_ns)
    # The first run measured and wrote the cache; the later ones read it and wrote nothing.
    first, source = _first_line_without_source(outs[0])
    assert source.startswith("measured now: 1024² float32 matmul on this cpu"), source
    assert source.endswith(f"cached in {cache}"), source
    assert stamps[0] == stamps[1] == stamps[2]
    assert outs[1] == outs[2]
    second, source = _first_line_without_source(outs[1])
    assert re.fullmatch(
        r"cached: measured \d{4}-\d\d-\d\d \d\d:\d\d UTC on .+, \d+ threads; "
        r"re-measure with `attnlab advise --recalibrate`",
        source,
    ), source
    assert first == second  # the same rate, the same table, the same choice
    (entry,) = json.loads(cache.read_text())["entries"]
    assert f"matmul rate {entry['gflops']:,.1f} GFLOP/s" in outs[0]
    assert "advice: " in outs[2]
    # --json reads the same cache.
    data = json.loads(_run([*ADVISE, "--json"], env))
    assert data["inputs"]["gflops"] == entry["gflops"]
    assert data["rate_source"].startswith("cached: measured ")
    assert f"advice: {data['choice']}" in outs[0]


def test_estimate_three_runs_in_separate_processes_print_the_same(tmp_path):
    env = _env(tmp_path)
    argv = ["estimate", "--seq", "2048", "--causal", "--heads", "8", "--d-model", "512"]
    outs = [_run(argv, env) for _ in range(3)]
    assert outs[0] == outs[1] == outs[2]
    assert not list(tmp_path.iterdir())  # estimate measures nothing, caches nothing


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_THRESHOLDS", "auto")
    monkeypatch.setenv("ATTNLAB_THRESHOLDS_FILE", str(tmp_path / "thresholds.json"))
    return tmp_path


def _measure_with(monkeypatch, values):
    seen = []

    def fake(dtype):
        seen.append(dtype)
        return values[len(seen) - 1]

    monkeypatch.setattr(advise_cli, "matmul_rate", fake)
    return seen


def test_the_cache_is_per_dtype_and_recalibrate_replaces_the_entry(cache_dir, monkeypatch, capsys):
    seen = _measure_with(monkeypatch, [100.0, 40.0, 55.5])
    json_args = [*ADVISE, "--json"]
    rate_of = {}
    for dtype in ("float32", "bfloat16", "float32", "bfloat16"):
        code, out, _ = run_cli([*json_args, "--dtype", dtype], capsys)
        assert code == 0
        rate_of.setdefault(dtype, []).append(json.loads(out)["inputs"]["gflops"])
    assert seen == ["float32", "bfloat16"]  # measured once per dtype
    assert rate_of == {"float32": [100.0, 100.0], "bfloat16": [40.0, 40.0]}
    code, out, _ = run_cli([*ADVISE, "--recalibrate"], capsys)
    assert code == 0 and seen == ["float32", "bfloat16", "float32"]
    assert "matmul rate 55.5 GFLOP/s (measured now: " in out
    code, out, _ = run_cli(json_args, capsys)
    assert json.loads(out)["inputs"]["gflops"] == 55.5 and len(seen) == 3
    entries = json.loads((cache_dir / rates.FILE_NAME).read_text())["entries"]
    assert sorted((e["dtype"], e["gflops"]) for e in entries) == [
        ("bfloat16", 40.0),
        ("float32", 55.5),
    ]


def test_gflops_overrides_and_writes_nothing(cache_dir, monkeypatch, capsys):
    seen = _measure_with(monkeypatch, [])
    code, out, _ = run_cli([*ADVISE, "--gflops", "80", "--json"], capsys)
    assert code == 0 and seen == [] and json.loads(out)["rate_source"] == "given"
    assert not list(cache_dir.iterdir())
    code, _, err = run_cli([*ADVISE, "--gflops", "80", "--recalibrate"], capsys)
    assert code == 2 and "argument --recalibrate: measures the rate that --gflops gives" in err


def test_an_entry_of_another_machine_or_thread_count_is_not_used(cache_dir, monkeypatch, capsys):
    path = cache_dir / rates.FILE_NAME
    key = rates.rate_key("float32")
    other = {**key, "threads": key["threads"] + 1, "gflops": 1.0, "measured_at": "x"}
    cpu = {**key, "cpu": "another CPU", "gflops": 2.0, "measured_at": "x"}
    rates.write_rate(path, other)
    rates.write_rate(path, cpu)
    seen = _measure_with(monkeypatch, [70.0])
    code, out, _ = run_cli([*ADVISE, "--json"], capsys)
    assert code == 0 and seen == ["float32"] and json.loads(out)["inputs"]["gflops"] == 70.0
    entries = json.loads(path.read_text())["entries"]
    assert [e["gflops"] for e in entries] == [1.0, 2.0, 70.0]  # the others are kept


def test_an_invalid_cache_warns_once_and_is_replaced(cache_dir, monkeypatch, capsys):
    path = cache_dir / rates.FILE_NAME
    path.write_text("{not json")
    seen = _measure_with(monkeypatch, [90.0])
    with pytest.warns(UserWarning, match=r"ignoring the matmul-rate cache .*not JSON"):
        code, out, _ = run_cli([*ADVISE, "--json"], capsys)
    assert code == 0 and seen == ["float32"] and json.loads(out)["inputs"]["gflops"] == 90.0
    assert json.loads(path.read_text())["format"] == rates.FORMAT
    key = rates.rate_key("float32")
    rates.write_rate(path, {**key, "gflops": "fast", "measured_at": "x"})
    with pytest.raises(ValueError, match="'gflops' must be a real number, got str 'fast'"):
        rates.read_rate(path, key)


def test_with_the_cache_off_every_run_measures_and_nothing_is_written(
    cache_dir, monkeypatch, capsys
):
    monkeypatch.setenv("ATTNLAB_THRESHOLDS", "off")
    seen = _measure_with(monkeypatch, [10.0, 11.0])
    for want in (10.0, 11.0):
        code, out, _ = run_cli([*ADVISE, "--json"], capsys)
        data = json.loads(out)
        assert code == 0 and data["inputs"]["gflops"] == want
        assert data["rate_source"].endswith("not cached (ATTNLAB_THRESHOLDS=off)")
    assert len(seen) == 2 and not list(cache_dir.iterdir())
    code, _, err = run_cli([*ADVISE, "--recalibrate"], capsys)
    assert code == 2 and "argument --recalibrate: ATTNLAB_THRESHOLDS=off turns" in err


def test_the_rate_file_sits_beside_the_threshold_cache(cache_dir):
    from attnlab.functional import thresholds

    assert rates.rates_file() == thresholds.cache_file().parent / "matmul_rates.json"
    assert rates.rates_file().parent == cache_dir
