"""Just-in-time C++ operators: built once per machine on first use, never required.

A C++ source next to this file (``<name>.cpp``) registers ``torch.ops`` operators with
``TORCH_LIBRARY``. `load` builds it with `torch.utils.cpp_extension.load` the first time a caller
asks for it, keeps the shared library in a cache directory, and loads it into the process. The
first build on a machine takes tens of seconds, so by default it runs in a separate process
(``python -m attnlab._ext NAME``, in its own session: it finishes even if the caller exits first),
watched by a background thread, and nobody waits for it: until it is done `load` answers False
and the callers run their PyTorch path (``load(name, wait=True)`` and ``ATTNLAB_EXT=require``
wait for it); every
caller keeps a pure-PyTorch fallback that computes the same values, used whenever `load` returns
False (no compiler, a failed build, ``ATTNLAB_EXT=0``, under ``torch.compile``, meta tensors).

The cache entry is keyed on everything the binary depends on — the source text, the compiler
flags, torch's and Python's versions, the architecture and **the CPU's feature flags** (it is
built with ``-march=native``), so a library built on one CPU (say, with AMX) is never loaded on
another: a different CPU builds its own. Builds run in a private temporary directory and the
finished library is moved into the cache atomically, so concurrent processes never see a partial
file and no lock can be left behind. A failed build is remembered (a ``.failed`` file holding the
compiler's message) and not retried until the key changes or the file is deleted.

Environment:
    ``ATTNLAB_EXT``: unset/``auto`` — load on first use, or build in the background (the
    PyTorch paths run meanwhile); fall back silently on failure (one logged warning);
    ``0``/``off`` — never load (the pure-PyTorch paths run);
    ``require`` — raise `ExtensionUnavailableError` instead of falling back (tests, benchmarks).
    ``ATTNLAB_EXT_CACHE``: the cache directory (default ``$XDG_CACHE_HOME/attnlab/ext`` or
    ``~/.cache/attnlab/ext``). ``CXX``: the compiler (default ``c++``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

ENV = "ATTNLAB_EXT"
CACHE_ENV = "ATTNLAB_EXT_CACHE"
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

_HERE = Path(__file__).resolve().parent
_LOCK = threading.Lock()
_STATE: dict[str, bool | str] = {}  # name -> True (loaded) or why not
_THREADS: dict[str, threading.Thread] = {}  # name -> its background build
BUILDING = "building in the background"
STALE_SECONDS = 3600  # a build directory older than this was left by a killed process
_log = logging.getLogger("attnlab.ext")


class ExtensionUnavailableError(RuntimeError):
    """``ATTNLAB_EXT=require`` and an extension could not be built or loaded."""


def mode() -> str:
    """``"auto"``, ``"off"`` or ``"require"`` from ``ATTNLAB_EXT``."""
    raw = os.environ.get(ENV)
    if raw is None:
        return "auto"
    raw = raw.strip().lower()
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
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "ext"


def _build(name: str, source: str, target: Path) -> None:
    """Compiles ``source`` in a private directory and moves the library to ``target``."""
    from torch.utils import cpp_extension

    if compiler() is None:
        raise RuntimeError(f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r})")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target.parent, name)
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


def _remove_stale(directory: Path, name: str) -> None:
    """Deletes build directories that a killed process left behind (older than an hour)."""
    import time

    for d in directory.glob(f"{name}-*"):
        try:
            if d.is_dir() and time.time() - d.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.h)"[ \t]*$', re.MULTILINE)


def source_text(name: str) -> str:
    """``_ext/<name>.cpp`` with each ``#include "x.h"`` of a header next to it pasted in (the
    build compiles one file in a private directory, and the cache key covers the headers)."""
    source = (_HERE / f"{name}.cpp").read_text(encoding="utf-8")
    return _LOCAL_INCLUDE.sub(lambda m: (_HERE / m.group(1)).read_text(encoding="utf-8"), source)


def _target(name: str) -> tuple[str, Path]:
    source = source_text(name)
    return source, cache_dir() / f"attnlab_{name}_{build_key(name, source)}.so"


def load(name: str, *, wait: bool | None = None) -> bool:
    """Makes the operators of ``_ext/<name>.cpp`` available; False if they are not (yet).

    A library built earlier on this machine loads at once (milliseconds). Otherwise the first
    call starts the build: in a background daemon thread (``wait=False``, the default in "auto"
    mode: this call and the calls during the build answer False and their callers use PyTorch),
    or in this call (``wait=True``, the default with ``ATTNLAB_EXT=require``). The answer is
    remembered for the process.

    Raises:
        ExtensionUnavailableError: only with ``ATTNLAB_EXT=require``, when the build or load failed.
    """
    how = mode()
    if how == "off":
        return False
    if wait is None:
        wait = how == "require"
    state = _STATE.get(name)
    if state is None:
        with _LOCK:
            state = _STATE.get(name)
            if state is None:
                state = _STATE[name] = _start(name, wait)
    if state == BUILDING and wait:
        thread = _THREADS.get(name)
        if thread is not None:
            thread.join()
        state = _STATE.get(name)
    if state is not True and how == "require":
        raise ExtensionUnavailableError(f"attnlab C++ extension {name!r} is unavailable: {state}")
    return state is True


def _build_detached(name: str) -> None:
    """Builds ``name`` in ``python -m attnlab._ext`` in its own session, so the build finishes
    (and the library lands in the cache) even if this process exits first."""
    import subprocess

    path = os.pathsep.join(p for p in (str(_HERE.parent.parent), os.environ.get("PYTHONPATH")) if p)
    subprocess.run(
        [sys.executable, "-m", "attnlab._ext", name],
        env={**os.environ, "PYTHONPATH": path},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        check=False,
    )


def _start(name: str, wait: bool) -> bool | str:
    """Loads a cached library now, or builds: now (``wait``) or in a background thread."""
    try:
        _, target = _target(name)
        quick = wait or target.exists() or target.with_suffix(".failed").exists()
    except Exception:  # the reason is recorded by `_load_now`
        quick = True
    if quick or compiler() is None:
        return _load_now(name)

    def build() -> None:
        _build_detached(name)
        _STATE[name] = _load_now(name)  # the library it left, or its ``.failed`` note

    thread = threading.Thread(target=build, name=f"attnlab-ext-{name}", daemon=True)
    _THREADS[name] = thread
    thread.start()
    return BUILDING


def _load_now(name: str) -> bool | str:
    try:
        source, target = _target(name)
        failed = target.with_suffix(".failed")
        if not target.exists():
            if failed.exists():
                return f"an earlier build failed ({failed}): {failed.read_text()[:300]}"
            try:
                _build(name, source, target)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                if compiler() is not None:  # a real failure: remember it for this key
                    failed.parent.mkdir(parents=True, exist_ok=True)
                    failed.write_text(why, encoding="utf-8")
                _log.warning("attnlab: C++ extension %r not built, using PyTorch: %s", name, why)
                return why
        torch.ops.load_library(str(target))
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        _log.warning("attnlab: C++ extension %r not loaded, using PyTorch: %s", name, why)
        return why
    return True


def status(name: str) -> bool | str | None:
    """True if loaded in this process, the reason it is not, or None if never asked."""
    return _STATE.get(name)


def forget(name: str) -> None:
    """Forgets this process's answer for ``name`` (tests; an already loaded library stays)."""
    with _LOCK:
        thread = _THREADS.pop(name, None)
    if thread is not None:
        thread.join()
    with _LOCK:
        _STATE.pop(name, None)


__all__ = [
    "BUILDING",
    "CACHE_ENV",
    "ENV",
    "NATIVE_FLAGS",
    "ExtensionUnavailableError",
    "build_key",
    "cache_dir",
    "compiler",
    "cpu_flags",
    "forget",
    "load",
    "mode",
    "native_products",
    "status",
]
