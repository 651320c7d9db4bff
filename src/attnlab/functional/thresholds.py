"""Auto's size thresholds per dtype: built-in defaults, or measured on this machine and cached.

``backend="auto"`` sends a call to flash once ``L·S`` reaches a threshold (`flash_declines` in
``functional/backends.py``): ``band`` for sliding windows without bias, ``sparse`` for the other
structured masks and bias functions, ``long`` for every call. Where flash starts to win depends
on the CPU (AMX or not), torch's kernels and the dtype, so the values can be measured once per
machine and dtype (`attnlab.analysis.calibrate`: ``python -m attnlab.analysis.calibrate`` or
``attnlab bench --calibrate``) and kept in a JSON cache. An entry is used only when its key —
CPU model, a digest of the CPU's feature flags, torch's version and the dtype — equals this
process's; any other entry, a missing file, or a dtype never measured gives the built-in
defaults (`BUILTIN`, from docs/results). A file that cannot be read or parsed gives
the defaults and one warning, never an error.

The file is read once per process, lazily: the first time auto decides outside a compiled region
(`for_dtype`); later calls look up a dict. Inside ``torch.compile`` nothing is read: before the
first eager decision a compiled region uses the built-in defaults (call `load` first to compile
with the cached values).

Environment:
    ``ATTNLAB_THRESHOLDS``: unset/``auto`` — use the cache; ``0``/``off`` — built-in defaults
    only, the file is never read (the test suite sets this).
    ``ATTNLAB_THRESHOLDS_FILE``: the cache file (default
    ``$XDG_CACHE_HOME/attnlab/thresholds.json`` or ``~/.cache/attnlab/thresholds.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _settings
from .._shapes import check_int

ENV = _settings.THRESHOLDS
FILE_ENV = _settings.THRESHOLDS_FILE
FORMAT = "attnlab-auto-thresholds"
VERSION = 1
KEYS = ("band", "sparse", "long")
#: Largest threshold a cache entry may hold (an L·S beyond any tensor).
MAX_THRESHOLD = 1 << 62


@dataclass(frozen=True)
class Thresholds:
    """The ``L·S`` sizes from which auto prefers flash, and where they came from.

    Attributes:
        band: sliding windows (finite bands) without a bias.
        sparse: other structured masks and bias functions.
        long: every call.
        source: one phrase for `attnlab.explain`, e.g. ``"built-in defaults
            (docs/results/bench_crossover.md)"`` or ``"the cache file PATH, measured on CPU at
            DATE"``.
    """

    band: int
    sparse: int
    long: int
    source: str


BUILTIN_SOURCE = "built-in defaults (docs/results/bench_crossover.md)"
#: fp32 crossovers measured with benchmarks/bench_crossover.py (docs/results, issues #3 and #19);
#: the same values hold in bfloat16 and float16 (issue #19's measurement, docs/results).
BUILTIN = Thresholds(band=1 << 16, sparse=1 << 18, long=1 << 24, source=BUILTIN_SOURCE)

_TABLE: dict[torch.dtype, Thresholds] | None = None  # this machine's entries, once loaded
_WHY: str = ""  # why the cache is not in use (for `describe`), once loaded
# What compiled code reads: the entries loaded so far, one dict updated in place. Compiled code
# never reads `_TABLE`: Dynamo would guard on ``_TABLE is None``, and the first eager call after
# a compiled one (it loads the file) would recompile every compiled graph, even when the file
# holds nothing (tests/test_inductor_models.py). A guard on this dict's entries fails only when
# loading really added some, and then the recompile sees them, as eager does.
_LOADED: dict[torch.dtype, Thresholds] = {}


def enabled() -> bool:
    """False when ``ATTNLAB_THRESHOLDS`` turns the cache off (``0``, ``off``, ``false``, ``no``)."""
    return not _settings.turned_off(_settings.text("thresholds"))


def cache_file() -> Path:
    """The cache file's path (``ATTNLAB_THRESHOLDS_FILE`` or the user's cache directory)."""
    env = _settings.text("thresholds_file")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "thresholds.json"


def cpu_info(cpuinfo: str | None = None) -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags (``/proc/cpuinfo`` or the text given).

    Returns:
        ``(model, flags)``; the model falls back to `platform` and the flags to empty off Linux.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", frozenset()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and not model:
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def machine_key(dtype: torch.dtype, cpuinfo: str | None = None) -> dict[str, str]:
    """What a cache entry must match: CPU model, flags digest, torch version and dtype."""
    model, flags = cpu_info(cpuinfo)
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    return {
        "cpu": model,
        "flags": f"{platform.machine()}:{digest}",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _entry_thresholds(entry: dict[str, Any], path: Path) -> Thresholds:
    """An entry's values, checked (ValueError naming the field otherwise)."""
    values = {}
    for key in KEYS:
        values[key] = check_int(
            f"entry field {key!r}", entry.get(key), minimum=1, maximum=MAX_THRESHOLD
        )
    when = entry.get("measured_at")
    if not isinstance(when, str):
        raise ValueError(f"entry field 'measured_at' must be a string, got {when!r}")
    source = f"the cache file {path}, measured on {entry['cpu']} at {when}"
    return Thresholds(**values, source=source)


def read_entries(path: Path, fmt: str, version: int, what: str) -> list[dict[str, Any]]:
    """The ``entries`` of one of attnlab's per-machine JSON caches (``{"format": fmt,
    "version": version, "entries": [...]}``: these thresholds, `attnlab.analysis.rates`).

    Raises:
        OSError: the file cannot be read. ValueError: it is not a valid ``what`` file.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise ValueError(f'not a {what} (no "format": "{fmt}")')
    if data.get("version") != version:
        raise ValueError(f"version {data.get('version')!r}, this attnlab reads {version}")
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("'entries' must be a list of objects")
    return entries


def read_cache(path: Path, cpuinfo: str | None = None) -> dict[torch.dtype, Thresholds]:
    """The entries of ``path`` that match this machine, by dtype.

    Raises:
        OSError: the file cannot be read. ValueError: it is not a valid cache file.
    """
    entries = read_entries(path, FORMAT, VERSION, "thresholds cache")
    found: dict[torch.dtype, Thresholds] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        key = machine_key(dtype, cpuinfo)
        for entry in entries:
            if all(entry.get(k) == v for k, v in key.items()):
                found[dtype] = _entry_thresholds(entry, path)
    return found


def load(*, reload: bool = False) -> dict[torch.dtype, Thresholds]:
    """Reads the cache once (again with ``reload``); this machine's entries by dtype.

    Never raises: a disabled cache gives ``{}``; an unreadable or invalid file gives ``{}`` and
    one `UserWarning` naming the file and the problem.
    """
    global _TABLE, _WHY
    if _TABLE is not None and not reload:
        return _TABLE
    table: dict[torch.dtype, Thresholds] = {}
    path = cache_file()
    if not enabled():
        why = f"{ENV}={_settings.text('thresholds')} turns the cache off"
    elif not path.exists():
        why = f"no cache file {path}"
    else:
        try:
            table = read_cache(path)
            why = ""
        except (OSError, ValueError) as e:
            why = f"the cache file {path} is unusable"
            warnings.warn(
                f"attnlab: ignoring the auto-threshold cache {path}: {e}; using the built-in "
                "defaults (re-measure with `python -m attnlab.analysis.calibrate`)",
                UserWarning,
                stacklevel=2,
            )
    _TABLE, _WHY = table, why
    _LOADED.clear()
    _LOADED.update(table)
    return table


def reset() -> None:
    """Forgets what was loaded: the next `for_dtype` outside a compiled region reads again."""
    global _TABLE, _WHY
    _TABLE, _WHY = None, ""
    _LOADED.clear()


def for_dtype(dtype: torch.dtype) -> Thresholds:
    """Auto's thresholds for inputs of ``dtype`` (no file I/O after the first call)."""
    if torch.compiler.is_compiling():  # never read a file inside a compiled region
        return _LOADED.get(dtype, BUILTIN)
    table = _TABLE
    if table is None:
        table = load()
    return table.get(dtype, BUILTIN)


def describe(dtype: torch.dtype) -> str:
    """Where ``dtype``'s thresholds come from, with the values (one sentence for `explain`)."""
    t = for_dtype(dtype)
    name = str(dtype).removeprefix("torch.")
    source = t.source
    if t is BUILTIN:
        why = _WHY or f"the cache file {cache_file()} has no {name} entry for this machine"
        source = f"{source}; {why}"
    return (
        f"auto's {name} thresholds (L·S: band {t.band}, sparse {t.sparse}, long {t.long}) are "
        f"{source}"
    )


def write_entries(path: Path, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``entries`` to the cache file at ``path``, replacing those with the same key.

    An existing valid file keeps its other entries (other machines, other dtypes); an invalid
    one is replaced. Written atomically (temp file + rename).

    Returns:
        Every entry now in the file.
    """
    from .._files import atomic_write

    old: list[dict[str, Any]] = []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("format") == FORMAT:
            old = [e for e in data.get("entries", []) if isinstance(e, dict)]
    except (OSError, ValueError):
        pass
    fields = ("cpu", "flags", "torch", "dtype")
    new_keys = {tuple(e.get(k) for k in fields) for e in entries}
    kept = [e for e in old if tuple(e.get(k) for k in fields) not in new_keys]
    merged = kept + list(entries)
    text = json.dumps({"format": FORMAT, "version": VERSION, "entries": merged}, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))
    return merged
