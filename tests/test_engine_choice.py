"""One engine per process, chosen once, visible (issue #37, item 2).

`attnlab._ext.load` builds an unbuilt kernel in the call that needs it — no thread, one stderr
line, a file lock so that two processes never build the same kernel twice — and its answer never
changes inside a process; `attnlab.explain` names the engine of each part of the plan without
building anything; ``attnlab build`` and ``attnlab info`` do the explicit step and show the
machine. Most tests replace the compiler step (`_ext._build`) and the library load
(`_ext._load_library`) by stand-ins on a temporary cache, so they take no build time; the test
marked slow builds a real kernel in a fresh cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import _ext, cli, masks

SRC = str(Path(attnlab.__file__).resolve().parent.parent)
FAKE = "fake_kernel"  # a kernel name no caller asks for: its answer can be faked in-process


def _ext_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("attnlab")]


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """An empty cache, a "compiler" that exists, and stand-ins for the compiler step and the
    library load; yields the list of kernel names built (one entry per compiler run)."""
    built: list[str] = []

    def build(name: str, source: str, target: Path) -> None:
        built.append(name)
        target.write_bytes(b"stand-in library")

    monkeypatch.setenv(_ext.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable)  # exists; never run (the build is replaced)
    monkeypatch.delenv(_ext.ENV, raising=False)
    monkeypatch.delenv(_ext.QUIET_ENV, raising=False)
    monkeypatch.setattr(_ext, "_build", build)
    monkeypatch.setattr(_ext, "_load_library", lambda target: None)
    monkeypatch.setattr(_ext, "source_text", lambda name: f"// the source of {name}")
    monkeypatch.setattr(_ext, "_STATE", {})
    monkeypatch.setattr(_ext, "_SAID", set())
    return built


def test_first_load_builds_in_the_call_once_and_never_changes(fake_build, tmp_path, capsys):
    """The first `load` of an unbuilt kernel builds it synchronously in the calling thread (no
    thread is started), says so in one stderr line with its time, and the answer is kept: later
    calls neither build again nor change their answer when the cache changes under them."""
    before = set(threading.enumerate())
    assert _ext.state(FAKE).startswith("not built yet")
    assert _ext.load(FAKE) is True
    assert set(threading.enumerate()) == before and not _ext_threads()
    assert fake_build == [FAKE]
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n")
    assert re.fullmatch(
        r"attnlab: building C\+\+ kernel 'fake_kernel' for this CPU \(once per machine, "
        r".*\)… done in \d+\.\d s",
        lines[0],
    ), lines
    for library in tmp_path.glob("*.so"):
        library.unlink()  # the cache changes: this process's answer does not
    assert all(_ext.load(FAKE) is True for _ in range(3))
    assert fake_build == [FAKE] and capsys.readouterr().err == ""
    assert _ext.status(FAKE) is True and _ext.state(FAKE) == "loaded"


def test_a_failed_build_is_said_once_and_kept(fake_build, tmp_path, monkeypatch, capsys):
    """A build that fails answers False for the whole process (one stderr line, a ``.failed``
    note for the next process), even when a library appears in the cache afterwards."""

    def broken(name: str, source: str, target: Path) -> None:
        fake_build.append(name)
        raise RuntimeError("stand-in compiler failed")

    monkeypatch.setattr(_ext, "_build", broken)
    assert _ext.load(FAKE) is False
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "failed after" in lines[0] and "stand-in compiler" in lines[0]
    assert "pure-PyTorch engine runs" in lines[0]
    assert len(list(tmp_path.glob("*.failed"))) == 1
    _, target = _ext._target(FAKE)
    target.write_bytes(b"built by someone else")
    assert [_ext.load(FAKE) for _ in range(3)] == [False] * 3
    assert fake_build == [FAKE] and capsys.readouterr().err == ""
    monkeypatch.setenv(_ext.ENV, "require")
    with pytest.raises(_ext.ExtensionUnavailableError, match="stand-in compiler failed"):
        _ext.load(FAKE)


def test_threads_asking_at_once_build_once(fake_build, monkeypatch):
    """Threads asking for the same unbuilt kernel together: one build, every answer True."""
    gate = threading.Barrier(4)
    answers: list[bool] = []
    slow = _ext._build

    def build(name: str, source: str, target: Path) -> None:
        threading.Event().wait(0.3)  # the others arrive while this build runs
        slow(name, source, target)

    monkeypatch.setattr(_ext, "_build", build)

    def ask() -> None:
        gate.wait(10)
        answers.append(_ext.load(FAKE))

    workers = [threading.Thread(target=ask) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert answers == [True] * 4 and fake_build == [FAKE]


RACE = r"""
import os, sys, time
from pathlib import Path
from attnlab import _ext
role, out = sys.argv[1], Path(sys.argv[2])
def build(name, source, target):
    with open(out / "builds", "a") as f:
        f.write(f"{role}\n")
    deadline = time.time() + 60
    while not (out / "b-asks").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # b is at the lock by now
    target.write_bytes(b"stand-in library")
_ext._build = build
_ext._load_library = lambda target: None
_ext.source_text = lambda name: "// the source"
if role == "b":
    while not (out / "builds").exists():
        time.sleep(0.05)
    (out / "b-asks").touch()
print(role, _ext.load("fake_kernel"))
"""


def test_two_processes_never_build_the_same_kernel_twice(tmp_path) -> None:
    """Process a builds (slowly); process b asks for the same kernel meanwhile, waits on the
    cache's file lock (one stderr line), then loads a's library: one build in all."""
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        _ext.CACHE_ENV: str(cache),
        "CXX": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    env.pop(_ext.ENV, None)
    env.pop(_ext.QUIET_ENV, None)
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-c", RACE, role, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("a", "b")
    }
    done = {role: p.communicate(timeout=180) for role, p in procs.items()}
    for role, (out, err) in done.items():
        assert procs[role].returncode == 0, err
        assert out.strip() == f"{role} True", (out, err)
    assert (tmp_path / "builds").read_text().split() == ["a"]
    a_err, b_err = done["a"][1].splitlines(), done["b"][1].splitlines()
    assert len(a_err) == 1 and "building C++ kernel 'fake_kernel'" in a_err[0]
    assert len(b_err) == 1, b_err
    assert re.fullmatch(
        r"attnlab: waiting for another process building C\+\+ kernel 'fake_kernel'… done in "
        r"\d+\.\d s",
        b_err[0],
    ), b_err
    assert len(list(cache.glob("*.so"))) == 1


def test_off_says_one_line_per_process(monkeypatch, capsys) -> None:
    """``ATTNLAB_EXT=off``: every `load` answers False and one line (once) says PyTorch runs."""
    monkeypatch.setattr(_ext, "_SAID", set())
    monkeypatch.delenv(_ext.QUIET_ENV, raising=False)
    monkeypatch.setenv(_ext.ENV, "off")
    assert [_ext.load(n) for n in ("nan_rule", "band_attn", "nan_rule")] == [False] * 3
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "attnlab: ATTNLAB_EXT=off: attnlab's C++ kernels are off, the pure-PyTorch engines run "
        "in this process"
    ]
    monkeypatch.setenv(_ext.QUIET_ENV, "1")
    monkeypatch.setattr(_ext, "_SAID", set())
    assert _ext.load("nan_rule") is False and capsys.readouterr().err == ""


# -------------------------------------------------------------------------------------- explain
def _window_call(L: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, L, 16, generator=g) for _ in range(3))  # type: ignore[return-value]


def test_explain_never_builds_and_says_what_the_first_call_will_do(fake_build) -> None:
    """With the kernels unbuilt, explain builds nothing (the stand-in compiler is never run),
    describes the call on torch's kernel and says the first call builds attnlab's."""
    q, k, v = _window_call()
    text = str(attnlab.explain(q, k, v, mask=masks.sliding_window(32), backend="flash"))
    assert fake_build == [] and not list(Path(os.environ[_ext.CACHE_ENV]).glob("*.so"))
    assert "forward: 1 band call(s) on torch's CPU flash kernel" in text
    assert "band_attn" in text and "not built yet" in text
    assert "the first call that needs one builds it" in text and "attnlab build" in text
    assert _ext.status("band_attn") is None  # nothing decided: the first call decides


def test_explain_names_each_engine(monkeypatch) -> None:
    """The engine of each part: torch's kernel and the off state with ``ATTNLAB_EXT=0``; the
    pure-PyTorch tile engine in float64; torch's SDPA; plain PyTorch for the reference."""
    monkeypatch.setenv(_ext.ENV, "0")
    q, k, v = _window_call()
    text = str(attnlab.explain(q, k, v, mask=masks.sliding_window(32), backend="flash"))
    assert "engines: forward: 1 band call(s) on torch's CPU flash kernel" in text
    assert re.search(r"band_attn( and \w+)* off \(ATTNLAB_EXT=0\)", text), text
    assert "NaN/inf handling: PyTorch ops" in text
    q.requires_grad_()
    assert "backward: torch's CPU flash kernel" in str(
        attnlab.explain(q, k, v, mask=masks.sliding_window(32), backend="flash")
    )
    d = [x.detach().double() for x in (q, k, v)]
    text = str(attnlab.explain(*d, mask=masks.causal(), backend="flash"))
    assert "the pure-PyTorch tile engine" in text
    text = str(attnlab.explain(q, k, v, mask=masks.causal(), backend="sdpa"))
    assert "engine: torch's scaled_dot_product_attention" in text
    assert "engine: plain PyTorch ops" in str(attnlab.explain(q, k, v, backend="reference"))


def test_explain_names_attnlabs_kernel_with_its_isa_path() -> None:
    """With the band kernel built, explain names it with its vector path, as the call runs."""
    if _ext.mode() == "off" or not _ext.load("band_attn"):
        pytest.skip(f"C++ extension unavailable: {_ext.status('band_attn')}")
    q, k, v = _window_call(256)
    text = str(attnlab.explain(q, k, v, mask=masks.sliding_window(32), backend="flash"))
    isa = _ext.isa_path()
    assert f"band call(s) on attnlab's C++ band kernel ({isa}, float32 products)" in text
    assert "band_attn loaded" in text and f"({isa} path)" in text


FIRST_CALL = r"""
import sys, threading, torch, attnlab
from attnlab import masks
torch.manual_seed(0)
q, k, v = (torch.randn(1, 4, 2048, 32) for _ in range(3))
w = masks.sliding_window(128)
threads = {t.name for t in threading.enumerate()}
first = attnlab.attention(q, k, v, mask=w)
print("explain:", str(attnlab.explain(q, k, v, mask=w)).replace("\n", "; "))
same = all(torch.equal(first, attnlab.attention(q, k, v, mask=w)) for _ in range(3))
print("same:", same)
print("explain again:", str(attnlab.explain(q, k, v, mask=w)).replace("\n", "; "))
print("threads:", sorted({t.name for t in threading.enumerate()} - threads))
"""


def _first_call(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    full = {**os.environ, "PYTHONPATH": SRC, **env}
    full.pop(_ext.QUIET_ENV, None)
    r = subprocess.run(
        [sys.executable, "-c", FIRST_CALL], env=full, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    said = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    return said, [line for line in r.stderr.splitlines() if line.startswith("attnlab:")]


def _check_one_engine(said: dict[str, str]) -> None:
    assert said["threads"] == "[]"  # no thread was started, by a build or anything else
    assert said["same"] == "True"  # every call on one engine: the same bits
    assert said["explain"] == said["explain again"]


def test_first_call_in_a_new_process_keeps_one_engine() -> None:
    """The issue's first-call row, structurally: in a new process the first sliding-window call
    (with the machine's cache: the kernel built earlier, or built now in the call, one line)
    starts no thread, later calls give the same bits, and explain names attnlab's kernel."""
    said, lines = _first_call({})
    _check_one_engine(said)
    if _ext.mode() == "off" or "unavailable" in said["explain"]:
        assert "torch's CPU flash kernel" in said["explain"]
        return
    assert (
        "on attnlab's C++ band kernel" in said["explain"] and "band_attn loaded" in said["explain"]
    )
    assert all(re.search(r"building C\+\+ kernel 'band_attn'.*done in", x) for x in lines), lines


def test_first_call_without_a_compiler_runs_pytorch_for_its_whole_life(tmp_path) -> None:
    """No compiler and an empty cache: one line, torch's kernel from the first call to the
    last, and explain says so."""
    said, lines = _first_call({"CXX": "/nonexistent", _ext.CACHE_ENV: str(tmp_path)})
    _check_one_engine(said)
    assert "forward: 1 band call(s) on torch's CPU flash kernel" in said["explain"]
    assert re.search(r"band_attn( and \w+)* unavailable", said["explain"]), said["explain"]
    assert "band_attn: RuntimeError: no C++ compiler found" in said["explain"]
    assert len(lines) == 1 and "no C++ compiler found" in lines[0]


@pytest.mark.slow
def test_first_call_builds_the_kernel_it_needs_in_a_fresh_cache(tmp_path) -> None:
    """A real build: in a fresh cache the first call builds band_attn only (one line), in the
    call, and runs on it from that call on."""
    if _ext.compiler() is None:
        pytest.skip("no C++ compiler")
    said, lines = _first_call({_ext.CACHE_ENV: str(tmp_path), _ext.ENV: "auto"})
    _check_one_engine(said)
    assert len(lines) == 1 and "building C++ kernel 'band_attn'" in lines[0], lines
    assert "on attnlab's C++ band kernel" in said["explain"]
    assert [p.name.split("_")[1] for p in tmp_path.glob("*.so")] == ["band"]


# ------------------------------------------------------------------------------------------ CLI
def test_attnlab_build_builds_each_kernel_with_its_time(fake_build, capsys) -> None:
    """``attnlab build``: a header naming the CPU, one line per kernel (built, with its time and
    path), the total; built kernels are only loaded again, ``--force`` rebuilds them."""
    assert cli.main(["build", "gemv", "nan_rule"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("attnlab build: 2 C++ kernel(s) for ") and _ext.isa_path() in out[0]
    assert re.fullmatch(r"  gemv      building… built in \d+\.\d s  .*attnlab_gemv_\w+\.so", out[1])
    assert re.fullmatch(r"  nan_rule  building… built in \d+\.\d s  .*\.so", out[2])
    assert re.fullmatch(r"attnlab build: 2 of 2 kernel\(s\) ready in \d+\.\d s", out[3])
    assert fake_build == ["gemv", "nan_rule"]
    assert cli.main(["build", "gemv"]) == 0
    assert "gemv  already built in" in capsys.readouterr().out and fake_build == [
        "gemv",
        "nan_rule",
    ]
    assert cli.main(["build", "--force", "gemv"]) == 0
    assert fake_build == ["gemv", "nan_rule", "gemv"]


def test_attnlab_build_errors(fake_build, monkeypatch, capsys, tmp_path) -> None:
    """An unknown kernel: one line, exit 2, nothing built. A failing build: its line, one error
    line on stderr, exit 1, and the failure remembered for `load`."""
    assert cli.main(["build", "gemv", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"attnlab build: error: unknown C++ kernel 'nope' (choose from {', '.join(_ext.KERNELS)})"
    ]
    assert captured.out == "" and fake_build == []

    def broken(name: str, source: str, target: Path) -> None:
        raise RuntimeError("stand-in compiler failed\nsecond line")

    monkeypatch.setattr(_ext, "_build", broken)
    assert cli.main(["build", "gemv"]) == 1
    captured = capsys.readouterr()
    assert "gemv  building… FAILED after" in captured.out
    assert "stand-in compiler failed second line" in captured.out
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("attnlab build: error: 1 kernel(s) failed (gemv)")
    assert len(list(tmp_path.glob("*.failed"))) == 1
    assert _ext.state("gemv").startswith("unavailable: an earlier build failed")


def test_python_m_attnlab_ext_is_attnlab_build(tmp_path) -> None:
    """``python -m attnlab._ext NAME`` runs the same step; an unknown name exits 2."""
    env = {**os.environ, "PYTHONPATH": SRC, _ext.CACHE_ENV: str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "attnlab._ext", "nope"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("python -m attnlab._ext: error: unknown C++ kernel 'nope'")


def test_attnlab_info(fake_build, capsys) -> None:
    """``attnlab info``: the CPU and its flags, torch, every kernel's state and path, the mode,
    auto's thresholds; ``--json`` the same as one object; ``check --env`` prints the text."""
    assert cli.main(["build", "gemv"]) == 0
    capsys.readouterr()
    _ext._STATE.clear()  # as in a new process: built, not loaded
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    model, flags = attnlab.functional.thresholds.cpu_info()
    assert f"CPU: {model}" in out and f"torch {torch.__version__}" in out
    assert f"{torch.get_num_threads()} threads" in out
    if "avx2" in flags:
        assert re.search(r"flags: .*\bavx2\b", out)
    for name in _ext.KERNELS:
        assert re.search(rf"^  {name} ", out, re.MULTILINE)
    assert re.search(r"^  gemv +built \(not loaded yet\)  .*attnlab_gemv_\w+\.so$", out, re.M)
    assert re.search(r"^  band_attn +not built yet", out, re.MULTILINE)
    assert "mode auto (ATTNLAB_EXT unset)" in out and f"{_ext.isa_path()} path" in out
    assert "auto's float32 thresholds" in out
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"]["version"] == torch.__version__ and data["cpu"]["model"] == model
    gemv = data["ext"]["kernels"]["gemv"]
    assert gemv["built"] is True and gemv["loaded"] is False and gemv["path"].endswith(".so")
    assert data["ext"]["kernels"]["band_attn"]["built"] is False
    assert set(data["thresholds"]) == {"float32", "bfloat16", "float16"}
    assert cli.main(["check", "--env"]) == 0
    assert "C++ kernels: mode auto" in capsys.readouterr().out
