"""A damaged kernel cache never reaches the loader (issue #38, item 2).

A cached C++ library is checked against the record its build wrote (size and sha256) before it
is loaded. These tests damage a real, freshly built library in a private cache — truncated to
4096 bytes, emptied, overwritten with random bytes, 32 bits flipped, replaced by a foreign ELF
library, given the record of another library, or left without a record (an older attnlab's
build) — and run an attention call that needs the kernel in a fresh Python process (a bad load
may kill its process with SIGBUS: never pytest's). Each run must exit normally with the
reference's answer and say what happened in one stderr line: the library is rebuilt (and
the next process loads it without rebuilding), or, when the rebuild fails, the pure-PyTorch
engine runs; with ``ATTNLAB_EXT=require`` a failed rebuild is a clear error (exit code 1).

The kernel is ``flash_rule`` (the smallest: 7–11 s to build), the only one a float64 flash call
with gradients asks for; it is built once per module with a compiler wrapper that fails its
compile and link steps when ``ATTNLAB_TEST_CXX_FAIL`` is set (the build key names the compiler,
so the wrapper keeps the key while the rebuild fails). The cases that rebuild for real, and
those that build a second kernel, are marked slow.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import _ext, cli

KERNEL = "flash_rule"
OTHER = "gemv"  # a second kernel, built by the slow tests only
SRC = str(Path(attnlab.__file__).resolve().parent.parent)  # attnlab for the builds
RUN_SRC = SRC  # attnlab for the runs (point it at an older tree to see the old behaviour)
FAIL_ENV = "ATTNLAB_TEST_CXX_FAIL"
TIMEOUT = 240

WRAPPER = """#!/bin/sh
# The system's C++ compiler; its compile and link steps fail while $ATTNLAB_TEST_CXX_FAIL is set.
if [ -n "$ATTNLAB_TEST_CXX_FAIL" ]; then
  for a in "$@"; do
    if [ "$a" = "-o" ]; then echo "g++: error: simulated compiler failure" >&2; exit 1; fi
  done
fi
exec {real} "$@"
"""

CALL = """
import torch, attnlab
from attnlab import _ext
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 50, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
with torch.no_grad():
    v[1, 2, 7, 3] = float("nan")  # the NaN rule: column 3 of head (1, 2) is NaN
for _ in range(2):  # the second call says nothing more
    out = attnlab.attention(q, k, v, backend="flash")
ref = attnlab.attention(q, k, v, backend="reference")
assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().sum() == 50
torch.testing.assert_close(out.nan_to_num(0), ref.nan_to_num(0), rtol=1e-10, atol=1e-12)
print("answer: reference")
print("status:", _ext.status("flash_rule"))
"""


# ------------------------------------------------------------------------------------ fixtures
class Built:
    """A module's private compiler and the libraries built with it (the good cache entries)."""

    def __init__(self, root: Path, cxx: Path) -> None:
        self.root = root
        self.cxx = cxx
        self.golden = root / "golden"

    def env(self, cache: Path, **extra: str) -> dict[str, str]:
        """The environment of a run on ``cache`` (default mode, notices on)."""
        env = {k: v for k, v in os.environ.items() if k not in (_ext.ENV, _ext.QUIET_ENV)}
        env.pop(FAIL_ENV, None)
        return {
            **env,
            "PYTHONPATH": RUN_SRC,
            "CXX": str(self.cxx),
            _ext.CACHE_ENV: str(cache),
            **extra,
        }

    def build(self, name: str) -> Path:
        """Builds kernel ``name`` into the golden cache (once) and returns its library."""
        found = list(self.golden.glob(f"attnlab_{name}_*.so"))
        if not found:
            env = {**self.env(self.golden), "PYTHONPATH": SRC}
            r = subprocess.run(
                [sys.executable, "-m", "attnlab._ext", name],
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
            if r.returncode != 0:
                pytest.skip(f"cannot build {name}: {r.stdout}{r.stderr}")
            found = list(self.golden.glob(f"attnlab_{name}_*.so"))
        (library,) = found
        assert library.with_suffix(".json").exists()  # the build wrote its record
        return library

    def install(self, cache: Path, name: str = KERNEL) -> Path:
        """Copies kernel ``name``'s good library and record into ``cache``; returns the library."""
        library = self.build(name)
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, cache / library.name)
        shutil.copy2(library.with_suffix(".json"), cache / library.with_suffix(".json").name)
        return cache / library.name


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The compiler wrapper and ``flash_rule`` built with it (skips without a C++ compiler)."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    if real is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("ext_integrity")
    (root / "bin").mkdir()
    cxx = root / "bin" / "g++"  # a name torch's cpp_extension accepts without probing
    cxx.write_text(WRAPPER.format(real=real), encoding="utf-8")
    cxx.chmod(0o755)
    b = Built(root, cxx)
    b.build(KERNEL)
    return b


# --------------------------------------------------------------------------------- corruptions
def _foreign_elf() -> Path:
    """A valid ELF shared library that is not an attnlab kernel (one of torch's own)."""
    lib = Path(torch.__file__).parent / "lib"
    for name in ("libtorchbind_test.so", "libjitbackend_test.so", "libtorch_global_deps.so"):
        if (lib / name).exists():
            return lib / name
    pytest.skip("no foreign shared library found in torch/lib")


def _truncate(size: int) -> Callable[[Path, Built], str]:
    def damage(library: Path, built: Built) -> str:
        expected = library.stat().st_size
        os.truncate(library, size)
        return f"size {size}, expected {expected}"

    return damage


def _random_bytes(library: Path, built: Built) -> str:
    library.write_bytes(random.Random(1).randbytes(library.stat().st_size))
    return "sha256 "


def _flip_bits(library: Path, built: Built) -> str:
    data = bytearray(library.read_bytes())
    for bit in random.Random(2).sample(range(len(data) * 8), 32):
        data[bit // 8] ^= 1 << (bit % 8)
    library.write_bytes(bytes(data))
    return "sha256 "


def _foreign(library: Path, built: Built) -> str:
    expected = library.stat().st_size
    foreign = _foreign_elf()
    shutil.copyfile(foreign, library)
    return f"size {foreign.stat().st_size}, expected {expected}"


def _record_of_another(library: Path, built: Built) -> str:
    """A record naming another library (as when another build key's files, built for another
    CPU or compiler, are copied in under this key's names)."""
    record = library.with_suffix(".json")
    data = json.loads(record.read_text(encoding="utf-8"))
    data["file"] = f"attnlab_{KERNEL}_0123456789abcdef0123.so"
    record.write_text(json.dumps(data), encoding="utf-8")
    return f"its checksum record describes {data['file']}"


def _no_record(library: Path, built: Built) -> str:
    library.with_suffix(".json").unlink()
    return "no checksum record"


def _other_kernel(library: Path, built: Built) -> str:
    """Another kernel's library over this one's (its record kept)."""
    expected, other = library.stat().st_size, built.build(OTHER)
    shutil.copyfile(other, library)
    return f"size {other.stat().st_size}, expected {expected}"


def _other_kernel_with_record(library: Path, built: Built) -> str:
    """Another kernel's library and record over this one's."""
    other = built.build(OTHER)
    shutil.copyfile(other, library)
    shutil.copyfile(other.with_suffix(".json"), library.with_suffix(".json"))
    return f"its checksum record describes {other.name}"


DAMAGE: dict[str, Callable[[Path, Built], str]] = {
    "truncated": _truncate(4096),
    "zero-bytes": _truncate(0),
    "random-bytes": _random_bytes,
    "32-flipped-bits": _flip_bits,
    "foreign-elf": _foreign,
    "record-of-another": _record_of_another,
    "no-record": _no_record,
}
SLOW_DAMAGE = {"other-kernel": _other_kernel, "other-kernel-and-record": _other_kernel_with_record}
ALL = [*DAMAGE, *SLOW_DAMAGE]


def cases(*default: str) -> list:
    """Every damage as a parameter; those not in ``default`` (default: `DAMAGE`) marked slow."""
    fast = default or tuple(DAMAGE)
    return [k if k in fast else pytest.param(k, marks=pytest.mark.slow) for k in ALL]


def _damaged(built: Built, tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    """A private cache holding the kernel's library damaged by ``kind`` beside a good build of
    ``nan_rule``, the other kernel the call runs (its NaN poisons a column: the C++ poisoning
    pass): (cache, library, what the check must report)."""
    cache = tmp_path / "cache"
    built.install(cache, "nan_rule")
    library = built.install(cache)
    said = {**DAMAGE, **SLOW_DAMAGE}[kind](library, built)
    return cache, library, said


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-c", CALL], env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert r.returncode >= 0, f"killed by signal {-r.returncode}: {r.stderr[-2000:]}"
    return r


def _notices(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("attnlab:")]


def _verified(library: Path) -> bool:
    """Whether ``library`` passes its check (a fresh look: nothing remembered)."""
    _ext._VERIFIED.pop(str(library), None)
    return _ext._check_library(library) is None


# -------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", cases())
def test_the_check_names_the_damage(built, tmp_path, monkeypatch, capsys, kind) -> None:
    """In-process, nothing loaded: `_check_library` reports each damage, `state` and
    ``attnlab info`` show the entry as corrupt (or unverified) and rebuilt by the next call."""
    cache, library, said = _damaged(built, tmp_path, kind)
    monkeypatch.setenv("CXX", str(built.cxx))
    monkeypatch.setenv(_ext.CACHE_ENV, str(cache))
    monkeypatch.delenv(_ext.ENV, raising=False)
    monkeypatch.setattr(_ext, "_STATE", {})
    assert _ext.library_path(KERNEL) == library
    problem = _ext._check_library(library)
    assert problem is not None and said in problem, problem
    state = _ext.state(KERNEL)
    head = "unverified" if kind == "no-record" else "corrupt"
    assert state.startswith(f"{head} ({problem}) — not loaded; the first call that needs it")
    assert _ext._needs_build(KERNEL)
    monkeypatch.delenv("COLUMNS", raising=False)  # not a terminal: one line per kernel, read back
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"  {KERNEL}  {state}  {library}" in out.splitlines()
    assert library.exists()  # looking changes nothing


def test_a_good_entry_passes_and_is_hashed_once(built, tmp_path, monkeypatch) -> None:
    """The good entry passes; its verdict is kept while the files are unchanged (no second
    read) and dropped when the library changes."""
    library = built.install(tmp_path / "cache")
    reads: list[Path] = []
    digest = _ext._digest
    monkeypatch.setattr(_ext, "_digest", lambda p: reads.append(p) or digest(p))
    assert _verified(library) and _ext._check_library(library) is None and reads == [library]
    _flip_bits(library, built)
    assert _ext._check_library(library).startswith("sha256 ")


@pytest.mark.parametrize("kind", cases("truncated"))
def test_a_bad_library_is_rebuilt_then_loaded(built, tmp_path, kind) -> None:
    """Default mode with a working compiler: the run rebuilds the library (one stderr line
    naming the file and the damage), computes the reference's answer on the kernel; the new
    library passes its check, and the next process loads it without rebuilding or a word."""
    cache, library, said = _damaged(built, tmp_path, kind)
    r = _run(built.env(cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "answer: reference" in r.stdout and "status: True" in r.stdout, r.stdout
    (line,) = _notices(r)
    assert line.startswith(f"attnlab: cached C++ kernel '{KERNEL}' failed its check ({library}: ")
    assert said in line and "removed; rebuilding it" in line and " done in " in line, line
    assert _verified(library)
    stat = library.stat()
    again = _run(built.env(cache))
    assert again.returncode == 0 and "status: True" in again.stdout, again.stderr[-3000:]
    assert _notices(again) == [] and again.stderr == ""
    assert (library.stat().st_ino, library.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


@pytest.mark.parametrize("kind", cases())
def test_a_failed_rebuild_falls_back_with_one_line(built, tmp_path, kind) -> None:
    """Default mode, the rebuild fails: the bad library is removed (never loaded), the run
    computes the reference's answer on the pure-PyTorch engine and says so in ONE stderr line
    (file, damage, the compiler's reason); the failure is remembered (a ``.failed`` note)."""
    cache, library, said = _damaged(built, tmp_path, kind)
    r = _run(built.env(cache, **{FAIL_ENV: "1"}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "answer: reference" in r.stdout, r.stdout
    assert "status: the cached library" in r.stdout and said in r.stdout, r.stdout
    assert r.stderr.count("\n") == 1, r.stderr
    (line,) = _notices(r)
    assert line.startswith(f"attnlab: cached C++ kernel '{KERNEL}' failed its check ({library}: ")
    assert said in line and "rebuilding it" in line and "failed after" in line, line
    assert "the pure-PyTorch engine runs" in line and "simulated compiler failure" in line, line
    assert not library.exists() and not library.with_suffix(".json").exists()
    assert library.with_suffix(".failed").exists()


def test_the_next_run_after_a_failed_rebuild_falls_back(built, tmp_path) -> None:
    """After a failed rebuild the next process neither crashes nor retries: one line (the
    remembered failure) and the reference's answer."""
    cache, library, _ = _damaged(built, tmp_path, "truncated")
    env = built.env(cache, **{FAIL_ENV: "1"})
    assert _run(env).returncode == 0
    r = _run(env)
    assert r.returncode == 0 and "answer: reference" in r.stdout, r.stderr[-3000:]
    (line,) = _notices(r)
    assert f"an earlier build failed ({library.with_suffix('.failed')})" in line, line
    assert not library.exists()


@pytest.mark.parametrize("kind", cases("truncated", "32-flipped-bits", "foreign-elf"))
def test_require_raises_a_clear_error_when_the_rebuild_fails(built, tmp_path, kind) -> None:
    """``ATTNLAB_EXT=require``, the rebuild fails: `ExtensionUnavailableError` (exit code 1,
    never a signal) naming the file, what was expected and found, and the compiler's reason."""
    cache, library, said = _damaged(built, tmp_path, kind)
    r = _run(built.env(cache, **{FAIL_ENV: "1", _ext.ENV: "require"}))
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"attnlab._ext.ExtensionUnavailableError: attnlab C++ kernel '{KERNEL}' is unavailable: "
        f"the cached library {library} failed its check ("
    ), last
    assert said in last and "rebuilding it failed" in last and "simulated compiler" in last
    assert not library.exists()


@pytest.mark.slow
def test_require_rebuilds_when_it_can(built, tmp_path) -> None:
    """``ATTNLAB_EXT=require`` with a working compiler rebuilds a bad library, as it builds an
    unbuilt one, and runs on it."""
    cache, library, said = _damaged(built, tmp_path, "truncated")
    r = _run(built.env(cache, **{_ext.ENV: "require"}))
    assert r.returncode == 0 and "status: True" in r.stdout, r.stderr[-3000:]
    (line,) = _notices(r)
    assert said in line and " done in " in line
    assert _verified(library)


@pytest.mark.slow
def test_attnlab_build_rebuilds_a_bad_library(built, tmp_path) -> None:
    """``attnlab build`` (``python -m attnlab._ext``) rebuilds a library that fails its check,
    saying so on its line, and leaves one that passes."""
    cache, library, _ = _damaged(built, tmp_path, "32-flipped-bits")
    r = subprocess.run(
        [sys.executable, "-m", "attnlab._ext", KERNEL],
        env=built.env(cache),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.splitlines()[1]
    assert f"{KERNEL}  failed its check (sha256 " in line and " rebuilt in " in line, line
    assert _verified(library)
