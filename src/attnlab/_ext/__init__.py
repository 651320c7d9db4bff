"""attnlab's C++ kernels: built by an explicit step (or on first need), chosen once per process.

Each C++ source next to this file (``<name>.cpp``, `KERNELS`) registers ``torch.ops`` operators
with ``TORCH_LIBRARY``. They are compiled for the CPU at hand (``-march=native``) against the
installed torch, so they are not built when attnlab is installed but by ``attnlab build`` (the
README's set-up: one line per kernel with its time), and kept in a cache directory.

`load` answers, once per process and kernel, whether the kernel's operators are available; every
caller keeps a pure-PyTorch path that computes the same values, used whenever it answers False:

- a library built earlier on this machine is loaded at once (milliseconds);
- an unbuilt kernel is built by the call that needs it — only that kernel, synchronously, in the
  calling thread, under a file lock in the cache directory (a second process waits for the first
  one's build, then loads its library: a kernel is never built twice) — with one line on stderr:
  ``attnlab: building C++ kernel 'band_attn' for this CPU (once per machine, 10–40 s)… done in
  11.2 s``;
- with no compiler, with ``ATTNLAB_EXT=off``, or after a failed build, one line on stderr says so
  (once per process) and the callers run their pure-PyTorch paths.

No thread is started and no answer changes inside a running process: the engine of every call
is the one `attnlab.explain` names (it reports, and never builds: `reporting`). Only
``ATTNLAB_EXT`` is read on every call (``off`` then answers False whatever was loaded: the
suite switches it to compare both paths; set it before the process starts). Callers never load
under ``torch.compile`` or for meta tensors (they check first).

The cache entry is keyed on everything the binary depends on — the source text, the compiler
flags, torch's and Python's versions, the compiler, the architecture and **the CPU's feature
flags** (it is built with ``-march=native``), so a library built on one CPU (say, with AMX) is
never loaded on another: a different CPU builds its own. A build compiles in a private temporary
directory and moves the finished library into the cache atomically, so no process ever sees a
partial file; the lock is an OS file lock (released when its process dies, so none is left
behind). A failed build is remembered (a ``.failed`` file holding the compiler's message) and
not retried by `load` until the key changes or the file is deleted (``attnlab build`` retries).

A cached library is checked before it is loaded, never after: each build writes a record next
to the library (``<library>.json``: its file name, size and sha256), in the private directory
before either file gets its name in the cache, and every load (`_load_library`, the one place
that loads) compares the file with its record first — once per process and file, about 1 ms
per MB. A library that fails (truncated, zero bytes, overwritten, bits flipped, another
kernel's or another CPU's library under this name, a record of another library, or no record:
built by an attnlab before records) is never loaded: the call that needs it removes it and
rebuilds it under the lock, with one stderr line (``attnlab: cached C++ kernel 'gemv' failed its
check (PATH: size 4096, expected 256208), removed; rebuilding it (10–40 s)… done in 11.0 s``).
If the rebuild fails too, the same line ends with the reason and the pure-PyTorch engine runs
(the failure is remembered as for any build); with ``ATTNLAB_EXT=require``, as for an unbuilt
kernel, the rebuild is tried and its failure raises `ExtensionUnavailableError` naming the file,
what was expected and found, and why the rebuild failed. ``attnlab info`` and `state` show such
an entry as ``corrupt (…)``; ``attnlab build`` rebuilds it. The check is against damage, not
against someone who may write the cache directory (they could write a matching record too).

Environment:
    ``ATTNLAB_EXT``: unset/``auto`` — load, or build on first need; fall back (one line) on
    failure; ``0``/``off`` — never load (the pure-PyTorch paths run; one line says so);
    ``require`` — raise `ExtensionUnavailableError` instead of falling back (tests, benchmarks).
    ``ATTNLAB_EXT_CACHE``: the cache directory (default ``$XDG_CACHE_HOME/attnlab/ext`` or
    ``~/.cache/attnlab/ext``). ``ATTNLAB_EXT_QUIET``: ``1`` silences the one-line notices.
    ``CXX``: the compiler (default ``c++``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TextIO

import torch

from .. import _settings

ENV = _settings.EXT_MODE
CACHE_ENV = _settings.EXT_CACHE
QUIET_ENV = _settings.EXT_QUIET
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

_HERE = Path(__file__).resolve().parent
#: The kernels, one per ``_ext/<name>.cpp``.
KERNELS: tuple[str, ...] = tuple(sorted(p.stem for p in _HERE.glob("*.cpp")))
#: What one build takes (measured: 7–14 s each on a 2-core AMD EPYC, more on slower machines).
BUILD_TIME = "10–40 s"
STALE_SECONDS = 3600  # a build directory older than this was left by a killed process
LOCK_TIMEOUT = 900.0  # seconds to wait for another process's build before giving up

_LOCK = threading.RLock()  # one decision at a time in this process (a build holds it)
_STATE: dict[str, bool | str] = {}  # name -> True (loaded) or why not; set once per process
_SAID: set[str] = set()  # the once-per-process notices already printed
_REPORTING: ContextVar[dict[str, bool] | None] = ContextVar("attnlab_ext_reporting", default=None)


class ExtensionUnavailableError(RuntimeError):
    """``ATTNLAB_EXT=require`` and a kernel could not be built or loaded."""


class CorruptLibraryError(RuntimeError):
    """A cached library does not match the record its build wrote (it is not loaded)."""


def mode() -> str:
    """``"auto"``, ``"off"`` or ``"require"`` from ``ATTNLAB_EXT``."""
    raw = _settings.text("ext")
    if raw is None:
        return "auto"
    raw = raw.lower()
    if raw in ("0", "off", "false", "no", "never"):
        return "off"
    if raw in ("require", "required", "force", "1", "on", "yes"):
        return "require"
    return "auto"


def cpu_flags() -> str:
    """The CPU's model name and sorted feature flags (``/proc/cpuinfo``; else `platform`)."""
    model, flags = platform.processor() or "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


#: CPU flags with native products of a 16-bit dtype (torch's CPU matmul is fast with one).
NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}


@functools.cache
def native_products(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` natively (float32/float64 always; bfloat16 and
    float16 with the flags of `NATIVE_FLAGS`, read from ``/proc/cpuinfo``)."""
    if dtype not in NATIVE_FLAGS:
        return True
    flags = set(cpu_flags().split("|")[-1].split())
    return bool(flags & NATIVE_FLAGS[dtype])


def isa_path() -> str:
    """The vector path the kernels compile to on this CPU (``-march=native``): ``"AVX-512"``
    (``__AVX512F__``), ``"AVX2"`` (AVX2 and FMA, no AVX-512: the 8-lane loops), or
    ``"portable C++"`` (anything else, e.g. ARM: what the compiler vectorises itself)."""
    flags = set(cpu_flags().split("|")[-1].split())
    if "avx512f" in flags:
        return "AVX-512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "portable C++"


def compiler() -> str | None:
    """The C++ compiler's path (``$CXX`` or ``c++`` on PATH), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build_key(name: str, source: str) -> str:
    """Hex digest naming one build: source, flags, torch, Python, compiler and CPU flags."""
    parts = (
        name,
        source,
        " ".join(CFLAGS + LDFLAGS),
        torch.__version__,
        sys.version,
        str(compiler()),
        cpu_flags(),
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    env = _settings.text("ext_cache")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "ext"


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.h)"[ \t]*$', re.MULTILINE)


def source_text(name: str) -> str:
    """``_ext/<name>.cpp`` with each ``#include "x.h"`` of a header next to it pasted in (the
    build compiles one file in a private directory, and the cache key covers the headers)."""
    source = (_HERE / f"{name}.cpp").read_text(encoding="utf-8")
    return _LOCAL_INCLUDE.sub(lambda m: (_HERE / m.group(1)).read_text(encoding="utf-8"), source)


def _target(name: str) -> tuple[str, Path]:
    source = source_text(name)
    return source, cache_dir() / f"attnlab_{name}_{build_key(name, source)}.so"


def library_path(name: str) -> Path:
    """Where kernel ``name``'s library for this CPU, torch and source is (or would be) cached.

    Raises:
        ValueError: ``name`` is not one of `KERNELS`.
    """
    _check_name(name)
    return _target(name)[1]


def _check_name(name: str) -> None:
    if name not in KERNELS:
        raise ValueError(f"unknown C++ kernel {name!r} (choose from {', '.join(KERNELS)})")


# ------------------------------------------------------------------------------------ records
RECORD_FORMAT = 1
NO_RECORD = "no checksum record (built by an older attnlab, or the build was interrupted)"
_VERIFIED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # path -> the files checked


def _record_path(target: Path) -> Path:
    """The record of library ``target``: ``<library>.json`` beside it."""
    return target.with_suffix(".json")


def _digest(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex digest)`` of the file at ``path``, read in 1 MiB pieces (``read``,
    never a mapping: a truncated file cannot fault)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_library(target: Path) -> str | None:
    """None when the library at ``target`` is the one its record describes, else what is wrong.

    Compares the file's size and sha256 with its record (`_record_path`), which must name this
    file. A file and record that passed are not hashed again in this process while neither
    changes (device, inode, size, modification and change times).

    Args:
        target: the library's path in the cache.

    Returns:
        None, or one phrase without a colon, e.g. ``"size 4096, expected 99888"``,
        ``"sha256 1f2e3d4c5b6a…, expected 0a1b2c3d4e5f…"``, ``"missing"``, `NO_RECORD`,
        ``"its checksum record describes attnlab_gemv_….so"``.
    """
    record = _record_path(target)
    try:
        lib_sig = _signature(os.stat(target))
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({type(e).__name__})"
    try:
        rec_sig = _signature(os.stat(record))
        data = json.loads(record.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return NO_RECORD
    except (OSError, ValueError) as e:
        return f"unreadable checksum record ({type(e).__name__})"
    if _VERIFIED.get(str(target)) == (lib_sig, rec_sig):
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("size"), int)
        or not isinstance(data.get("sha256"), str)
        or not isinstance(data.get("file"), str)
    ):
        return "unreadable checksum record (fields missing)"
    if data["file"] != target.name:
        return f"its checksum record describes {_one_line(data['file'], 80)}"
    if lib_sig[2] != data["size"]:  # a cheap first test, before reading the file
        return f"size {lib_sig[2]}, expected {data['size']}"
    try:
        size, sha = _digest(target)
    except OSError as e:
        return f"unreadable ({type(e).__name__})"
    if size != data["size"]:
        return f"size {size}, expected {data['size']}"
    if sha != data["sha256"]:
        return f"sha256 {sha[:12]}…, expected {_one_line(data['sha256'], 80)[:12]}…"
    _VERIFIED[str(target)] = (lib_sig, rec_sig)
    return None


def _write_record(library: Path, record: Path, file_name: str) -> None:
    """Writes ``record``: the size and sha256 of ``library``, to be installed as ``file_name``."""
    size, sha = _digest(library)
    data = {"format": RECORD_FORMAT, "file": file_name, "size": size, "sha256": sha}
    record.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _discard(target: Path) -> None:
    """Removes library ``target`` and its record (a library that failed its check)."""
    _VERIFIED.pop(str(target), None)
    target.unlink(missing_ok=True)
    _record_path(target).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- notices
def _quiet() -> bool:
    return (_settings.text("ext_quiet") or "").lower() in ("1", "true", "yes", "on")


def _say(text: str, *, end: str = "\n") -> None:
    """Writes ``text`` to stderr (unless ``ATTNLAB_EXT_QUIET``), flushed at once."""
    if not _quiet():
        sys.stderr.write(text + end)
        sys.stderr.flush()


def _say_once(key: str, text: str) -> None:
    """`_say` the first time ``key`` comes up in this process."""
    if key not in _SAID:
        _SAID.add(key)
        _say(text)


def _one_line(text: object, limit: int = 240) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


_ERROR_LINE = re.compile(r"^.*\berror:.*$", re.MULTILINE | re.IGNORECASE)


def _brief(why: str) -> str:
    """A build failure in brief: torch's first line (``Error building extension 'x'``) without
    the command lines it quotes, and the compiler's first ``error:`` line (``g++: error: …``,
    ``x.cpp:3:1: error: …``); ``why`` itself when it has no such line."""
    lines = why.splitlines()
    found = _ERROR_LINE.search("\n".join(lines[1:]))
    if len(lines) < 2 or found is None:
        return why
    return f"{lines[0].split(': [', 1)[0]}: {found.group(0).strip()}"


# -------------------------------------------------------------------------------------- build
def _build(name: str, source: str, target: Path) -> None:
    """Compiles ``source`` in a private directory and moves the library to ``target`` (a path
    in `_build_staged`'s private directory, not yet in the cache)."""
    from torch.utils import cpp_extension

    if compiler() is None:
        raise RuntimeError(f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r})")
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=target.parent) as tmp:
        src = Path(tmp) / f"{name}.cpp"
        src.write_text(source, encoding="utf-8")
        cpp_extension.load(
            name=target.stem,
            sources=[str(src)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=tmp,
            is_python_module=False,
            verbose=False,
        )
        os.replace(Path(tmp) / f"{target.stem}.so", target)


def _build_staged(name: str, source: str, target: Path) -> None:
    """`_build` into a private directory of the cache, then the record (`_write_record`), then
    both moved to their names (``os.replace``: a reader sees the old file or the new one, never a
    part). The library is moved first: a reader that comes between the two moves finds a
    mismatch, waits for the lock this build holds, and checks again."""
    _remove_stale(target.parent, name)
    stage = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=target.parent))
    try:
        built = stage / target.name
        _build(name, source, built)
        record = stage / _record_path(target).name
        _write_record(built, record, target.name)
        _VERIFIED.pop(str(target), None)
        os.replace(built, target)
        os.replace(record, _record_path(target))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _remove_stale(directory: Path, name: str) -> None:
    """Deletes build directories that a killed process left behind (older than an hour)."""
    for d in directory.glob(f"{name}-*"):
        try:
            if d.is_dir() and time.time() - d.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _failed_note(target: Path) -> str | None:
    """The reason an earlier build of ``target`` failed, or None if none is remembered."""
    failed = target.with_suffix(".failed")
    try:
        text = failed.read_text(encoding="utf-8")
    except OSError:
        return None
    return f"an earlier build failed ({failed}): {_one_line(_brief(text), 300)}"


class _RebuildError(RuntimeError):
    """The rebuild of a library that failed its check failed: the message names the file, what
    was wrong and the build's reason; ``why`` is the build's reason alone."""

    def __init__(self, text: str, why: str) -> None:
        super().__init__(text)
        self.why = why


def _build_locked(
    name: str,
    source: str,
    target: Path,
    *,
    force: bool = False,
    line: Callable[[str], None] | None = None,
) -> str:
    """Builds ``target`` unless it exists and passes its check, holding the cache's file lock
    for ``name``'s key.

    Another process building the same key holds the lock: this one waits, then finds the
    library (or the other build's ``.failed`` note, raised). A library that fails its check
    (`_check_library`, done under the lock) is removed with its record and rebuilt.
    ``line(text)`` receives the start of the progress line (the caller ends it). Returns
    ``"built"``, ``"rebuilt"`` (a library that failed its check) or ``"found"`` (built by another
    process while this one waited).

    Raises:
        RuntimeError: the build failed (the compiler's message, also left in ``.failed``), or
            an earlier build of this key failed (without ``force``); `_RebuildError` when the
            build was the rebuild of a library that failed its check.
        TimeoutError: the other process's build did not end within `LOCK_TIMEOUT` seconds.
    """
    from filelock import FileLock, Timeout  # torch's own dependency

    show = line or (lambda _text: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.with_suffix(".lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        show(f"waiting for another process building C++ kernel {name!r}…")
        try:
            lock.acquire(timeout=LOCK_TIMEOUT)
        except Timeout:
            raise TimeoutError(
                f"another process held the build lock of {name!r} for {LOCK_TIMEOUT:.0f} s "
                f"({target.with_suffix('.lock')})"
            ) from None
    try:
        failed = target.with_suffix(".failed")
        problem = None
        if target.exists() and not force:
            problem = _check_library(target)
            if problem is None:
                return "found"
            _discard(target)  # never loaded: removed before anything else is tried
        bad = f"the cached library {target} failed its check ({problem}) and was removed"
        if not force:
            earlier = _failed_note(target)
            if earlier is not None:
                if problem is not None:
                    raise _RebuildError(f"{bad}; {earlier}", earlier)
                raise RuntimeError(earlier)
        if problem is None:
            show(f"building C++ kernel {name!r} for this CPU (once per machine, {BUILD_TIME})…")
        else:
            show(
                f"cached C++ kernel {name!r} failed its check ({target}: {problem}), removed; "
                f"rebuilding it ({BUILD_TIME})…"
            )
        try:
            _build_staged(name, source, target)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            if compiler() is not None:  # a real failure: remember it for this key
                failed.write_text(why, encoding="utf-8")
            if problem is not None:
                brief = _brief(why)
                raise _RebuildError(f"{bad}; rebuilding it failed: {brief}", brief) from None
            raise RuntimeError(why) from None
        failed.unlink(missing_ok=True)
        return "built" if problem is None else "rebuilt"
    finally:
        lock.release()


def _load_library(target: Path) -> None:
    """Loads a cached library into this process (its ``TORCH_LIBRARY`` registers the ops) after
    checking it against its record (`_check_library`): the one place that loads a library.

    Raises:
        CorruptLibraryError: the file does not match its record (or has none); nothing was
            loaded.
        OSError: the loader refused the file.
    """
    problem = _check_library(target)
    if problem is not None:
        raise CorruptLibraryError(f"{target} failed its check ({problem}); not loaded")
    torch.ops.load_library(str(target))


# --------------------------------------------------------------------------------------- load
def load(name: str) -> bool:
    """Makes the operators of ``_ext/<name>.cpp`` available; False if they are not.

    Decided on the first call in this process and never changed: a cached library loads at once;
    an unbuilt kernel is built now, in this call (see the module docstring: one stderr line,
    a file lock against concurrent builds); no compiler, ``ATTNLAB_EXT=off`` or a failed build
    answer False (one stderr line per process). Inside `reporting` nothing is built.

    Raises:
        ExtensionUnavailableError: only with ``ATTNLAB_EXT=require``, when the kernel could not
            be built or loaded.
    """
    how = mode()
    if how == "off":
        if "off" not in _SAID:
            _say_once(
                "off",
                f"attnlab: {ENV}={_settings.text('ext')}: attnlab's C++ kernels are off, the "
                "pure-PyTorch engines run in this process",
            )
        asked = _REPORTING.get()
        if asked is not None:
            asked.setdefault(name, False)
        return False
    state = _STATE.get(name)
    asked = _REPORTING.get()
    if state is None:
        if asked is not None and _needs_build(name):
            asked.setdefault(name, False)
            return False
        with _LOCK:
            state = _STATE.get(name)
            if state is None:
                state = _STATE[name] = _decide(name)
    if asked is not None:
        asked.setdefault(name, state is True)
    if state is not True and how == "require":
        raise ExtensionUnavailableError(f"attnlab C++ kernel {name!r} is unavailable: {state}")
    return state is True


def _needs_build(name: str) -> bool:
    """Whether `load` would build ``name`` now: a compiler, and no cached library and no failure
    note, or a cached library that fails its check."""
    try:
        _, target = _target(name)
    except Exception:  # `_decide` records the reason
        return False
    if compiler() is None:
        return False
    if target.exists():  # a library that fails its check is rebuilt
        return _check_library(target) is not None
    return _failed_note(target) is None


def _decide(name: str) -> bool | str:
    """This process's answer for ``name``: True once loaded, else why not (said on stderr)."""
    try:
        source, target = _target(name)
        if not target.exists():
            earlier = _failed_note(target)
            if earlier is not None:
                _say_once(
                    f"failed:{name}",
                    f"attnlab: C++ kernel {name!r} is not used in this process, the pure-PyTorch "
                    f"engine runs: {_one_line(earlier)} (retry: `attnlab build {name}`)",
                )
                return earlier
            cxx = compiler()
            if cxx is None:
                why = f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r})"
                _say_once(
                    "no-compiler",
                    f"attnlab: {why}: attnlab's C++ kernels that are not built are off in this "
                    "process, the pure-PyTorch engines run (install one and run `attnlab build`)",
                )
                return f"RuntimeError: {why}"
            _build_announced(name, source, target)
        elif _check_library(target) is not None:
            _build_announced(name, source, target)  # removes it, rebuilds it (one line)
        _load_library(target)
    except Exception as e:
        why = f"{type(e).__name__}: {e}" if not isinstance(e, _ReportedError) else str(e)
        if not isinstance(e, _ReportedError):
            _say(
                f"attnlab: C++ kernel {name!r} not loaded, the pure-PyTorch engine runs in this "
                f"process: {_one_line(why)}"
            )
        return why
    return True


class _ReportedError(RuntimeError):
    """A failure whose one line was already printed (`_build_announced`)."""


def _build_announced(name: str, source: str, target: Path) -> None:
    """`_build_locked` with its one progress line on stderr: ``attnlab: building … done in
    12.3 s`` (or ``… failed after 3.1 s: REASON``; ``attnlab: cached C++ kernel … failed its
    check (…), removed; rebuilding it …`` for a library that failed its check)."""
    t0 = time.perf_counter()
    started: list[str] = []

    def line(text: str) -> None:
        _say((" " if started else "attnlab: ") + text, end="")
        started.append(text)

    try:
        _build_locked(name, source, target, line=line)
    except Exception as e:
        dt = time.perf_counter() - t0
        why = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
        said = e.why if isinstance(e, _RebuildError) and started else why  # the line named it
        prefix = " " if started else "attnlab: "
        then = (
            f"{ENV}=require: an error follows"
            if mode() == "require"
            else "the pure-PyTorch engine runs in this process"
        )
        _say(f"{prefix}C++ kernel {name!r} failed after {dt:.1f} s, {then}: {_one_line(said)}")
        raise _ReportedError(why) from None
    if started:
        _say(f" done in {time.perf_counter() - t0:.1f} s")


@contextlib.contextmanager
def reporting() -> Iterator[dict[str, bool]]:
    """Inside, `load` never builds: an unbuilt kernel answers False for now (not recorded: a
    later `load` outside builds it). Cached libraries are loaded as by any call. Yields the
    kernels `load` was asked about inside, each with its answer (False for an unbuilt one);
    `attnlab.explain` runs inside and reports them with `describe_kernels`."""
    asked: dict[str, bool] = {}
    token = _REPORTING.set(asked)
    _settings.forget()  # the kernels' readiness, as callers keep it, is asked inside ...
    try:
        yield asked
    finally:
        _REPORTING.reset(token)
        _settings.forget()  # ... and not kept after (an unbuilt kernel answered False)


def describe_kernels(names: dict[str, bool] | list[str] | tuple[str, ...]) -> str:
    """One clause on the kernels ``names`` for `attnlab.explain`: the vector path they are built
    for, which are loaded, built, not built yet (the first call that needs one builds it) or
    unavailable and why (`state`)."""
    if not names:
        return "no attnlab C++ kernel is involved"
    groups: dict[str, list[str]] = {}
    reasons: list[str] = []
    for name in names:
        phrase = state(name)
        head = phrase.split(":", 1)[0]
        groups.setdefault(head, []).append(name)
        if head.startswith("unavailable"):
            reasons.append(f"{name}: {phrase.split(':', 1)[1].strip()}")
    parts = [f"{' and '.join(ns)} {head}" for head, ns in groups.items()]
    text = f"attnlab's C++ kernels ({isa_path()} path): {', '.join(parts)}"
    if "not built yet" in groups:
        text += (
            " — so this describes the call without them; the first call that needs one builds "
            f"it, in that call ({BUILD_TIME} each, once per machine), and runs on it from then "
            "on (`attnlab build` builds them ahead)"
        )
    if reasons:
        text += f" ({'; '.join(reasons)})"
    return text


def status(name: str) -> bool | str | None:
    """True if loaded in this process, the reason it is not, or None if never asked."""
    return _STATE.get(name)


def state(name: str) -> str:
    """One phrase on kernel ``name`` for `attnlab.explain` and ``attnlab info``, without building
    or loading anything: ``"loaded"``, ``"built (not loaded yet)"``, ``"not built yet: …"``,
    ``"off (ATTNLAB_EXT=0)"``, ``"unavailable: REASON"``, ``"corrupt (size 4096, expected
    99888) — …"`` (a cached library that fails its check: `_check_library`)."""
    if mode() == "off":  # `load` answers False then, whatever was loaded
        return f"off ({ENV}={_settings.text('ext')})"
    answer = _STATE.get(name)
    if answer is True:
        return "loaded"
    if isinstance(answer, str):
        return f"unavailable in this process: {_one_line(answer, 160)}"
    try:
        _, target = _target(name)
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {_one_line(e, 160)}"
    if target.exists():
        problem = _check_library(target)
        if problem is None:
            return "built (not loaded yet)"
        head = "unverified" if problem == NO_RECORD else "corrupt"
        if compiler() is None:
            return (
                f"{head} ({problem}) — not loaded, and no C++ compiler to rebuild it "
                f"(CXX={os.environ.get('CXX', 'c++')!r}): the pure-PyTorch engine runs"
            )
        return (
            f"{head} ({problem}) — not loaded; the first call that needs it rebuilds it "
            f"({BUILD_TIME}), or run `attnlab build {name}`"
        )
    earlier = _failed_note(target)
    if earlier is not None:
        return f"unavailable: {_one_line(earlier, 160)}"
    if compiler() is None:
        return f"unavailable: not built and no C++ compiler (CXX={os.environ.get('CXX', 'c++')!r})"
    return (
        f"not built yet: the first call that needs it builds it ({BUILD_TIME}, once per "
        "machine), or run `attnlab build`"
    )


def forget(name: str) -> None:
    """Forgets this process's answer for ``name`` (tests only; a loaded library stays loaded)."""
    with _LOCK:
        _STATE.pop(name, None)


# ------------------------------------------------------------------------------ explicit build
def build_kernels(
    names: list[str] | tuple[str, ...] | None = None,
    *,
    force: bool = False,
    out: TextIO | None = None,
) -> list[tuple[str, str]]:
    """Builds kernels now (default: all of `KERNELS`), one progress line each with its time.

    A kernel already built for this CPU and torch is loaded to check it (``--force`` rebuilds
    it); one whose library fails its check against its record is rebuilt; a failure note left by
    an earlier build is retried. The total time ends the output.

    Args:
        names: kernel names, each one of `KERNELS`.
        force: rebuild kernels that are already built.
        out: where the lines go (default stdout).

    Returns:
        ``[(name, why)]`` of the kernels that failed (empty when every one is ready).

    Raises:
        ValueError: an unknown kernel name (before anything is built).
    """
    out = sys.stdout if out is None else out
    chosen = list(KERNELS if not names else dict.fromkeys(names))
    for name in chosen:
        _check_name(name)
    cxx = compiler()
    model = cpu_flags().split("|")[1] or platform.machine()
    print(
        f"attnlab build: {len(chosen)} C++ kernel(s) for {model} ({isa_path()}), torch "
        f"{torch.__version__}, compiler {cxx or 'none'}, into {cache_dir()}",
        file=out,
        flush=True,
    )
    if mode() == "off":
        print(f"  note: {ENV}={_settings.text('ext')}: processes will not load them", file=out)
    width = max(len(n) for n in chosen)
    failures: list[tuple[str, str]] = []
    total = time.perf_counter()
    for name in chosen:
        t0 = time.perf_counter()
        print(f"  {name:<{width}}  ", end="", file=out, flush=True)
        try:
            source, target = _target(name)
            problem = _check_library(target) if target.exists() else None
            if target.exists() and problem is None and not force:
                verb = "already built"
            else:
                if cxx is None:
                    raise RuntimeError(
                        f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r})"
                        + (f"; the cached library failed its check ({problem})" if problem else "")
                    )
                doing = f"failed its check ({problem}), rebuilding… " if problem else "building… "
                print(doing, end="", file=out, flush=True)
                with _LOCK:
                    verb = _build_locked(name, source, target, force=force)
                verb = "built by another process" if verb == "found" else verb
            if _STATE.get(name) is not True:
                _load_library(target)  # it loads (a build has already loaded its own)
                _STATE.setdefault(name, True)
        except Exception as e:
            why = _one_line(e if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}")
            print(f"FAILED after {time.perf_counter() - t0:.1f} s: {why}", file=out, flush=True)
            failures.append((name, why))
            continue
        print(f"{verb} in {time.perf_counter() - t0:.1f} s  {target}", file=out, flush=True)
    ready = len(chosen) - len(failures)
    print(
        f"attnlab build: {ready} of {len(chosen)} kernel(s) ready in "
        f"{time.perf_counter() - total:.1f} s",
        file=out,
        flush=True,
    )
    return failures


__all__ = [
    "BUILD_TIME",
    "CACHE_ENV",
    "ENV",
    "KERNELS",
    "NATIVE_FLAGS",
    "QUIET_ENV",
    "CorruptLibraryError",
    "ExtensionUnavailableError",
    "build_kernels",
    "build_key",
    "cache_dir",
    "compiler",
    "cpu_flags",
    "describe_kernels",
    "forget",
    "isa_path",
    "library_path",
    "load",
    "mode",
    "native_products",
    "reporting",
    "state",
    "status",
]
