"""This machine's matmul rate per dtype, measured once and cached beside auto's thresholds.

``attnlab advise`` turns FLOPs into seconds with a matmul rate (GFLOP/s). Timed afresh on every
run, the rate of a shared or throttling machine moves by tens of percent, and advice near a
boundary flips between runs ("dense", then "linear"). So the rate is measured once per machine,
torch, thread count and dtype, and kept in a JSON file next to the threshold cache of
`attnlab.functional.thresholds` (the same settings, read there: ``ATTNLAB_THRESHOLDS_FILE``
names the threshold file and this one is ``matmul_rates.json`` in its directory;
``ATTNLAB_THRESHOLDS=off`` turns both caches off, and then every run measures). An entry is used
only when its key — CPU model, a digest of the CPU's flags, torch's version, the dtype (as
`thresholds.machine_key`) and torch's thread count — equals this process's. Re-measure with
``attnlab advise --recalibrate``; ``--gflops`` overrides the cache.

A file that cannot be read or parsed gives one warning and a new measurement (which replaces
it); a file that cannot be written gives one warning and the measurement — never an error.
"""

from __future__ import annotations

import datetime as _dt
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _settings
from .._shapes import check_number

FORMAT = "attnlab-matmul-rates"
VERSION = 1
FILE_NAME = "matmul_rates.json"
RECALIBRATE = "attnlab advise --recalibrate"
_KEY_FIELDS = ("cpu", "flags", "torch", "dtype", "threads")


@dataclass(frozen=True)
class Rate:
    """A matmul rate and where it came from.

    Attributes:
        gflops: GFLOP/s.
        source: one phrase for the command's output, e.g. ``"cached: measured 2026-11-29 04:57
            UTC on <cpu>, 2 threads; re-measure with `attnlab advise --recalibrate`"``.
        cached: True when read from the cache file.
    """

    gflops: float
    source: str
    cached: bool


def enabled() -> bool:
    """False when ``ATTNLAB_THRESHOLDS`` turns the per-machine caches off."""
    from ..functional import thresholds

    return thresholds.enabled()


def rates_file() -> Path:
    """The cache file: ``matmul_rates.json`` beside the threshold cache file."""
    from ..functional import thresholds

    return thresholds.cache_file().with_name(FILE_NAME)


def rate_key(dtype: str, threads: int | None = None) -> dict[str, Any]:
    """What an entry must match: `thresholds.machine_key` of ``dtype`` and torch's threads."""
    import torch

    from ..functional import thresholds

    key: dict[str, Any] = dict(thresholds.machine_key(getattr(torch, dtype)))
    key["threads"] = torch.get_num_threads() if threads is None else threads
    return key


def _entries(path: Path) -> list[dict[str, Any]]:
    """The file's entries. Raises OSError (unreadable) or ValueError (not a rate cache)."""
    from ..functional import thresholds

    return thresholds.read_entries(path, FORMAT, VERSION, "matmul-rate cache")


def read_rate(path: Path, key: dict[str, Any]) -> Rate | None:
    """The entry of ``path`` matching ``key`` as a `Rate`, or None (no file, no entry).

    Raises:
        OSError: the file cannot be read. ValueError: it is not a valid cache file, or the
            matching entry is invalid.
    """
    if not path.exists():
        return None
    for entry in _entries(path):
        if all(entry.get(k) == key[k] for k in _KEY_FIELDS):
            gflops, when = entry.get("gflops"), entry.get("measured_at")
            check_number("entry field 'gflops'", gflops, positive=True)
            if not isinstance(when, str):
                raise ValueError(f"entry field 'measured_at' must be a string, got {when!r}")
            source = (
                f"cached: measured {when} on {entry['cpu']}, {entry['threads']} threads; "
                f"re-measure with `{RECALIBRATE}`"
            )
            return Rate(float(gflops), source, cached=True)
    return None


def write_rate(path: Path, entry: dict[str, Any]) -> None:
    """Adds ``entry`` to ``path``, replacing the entry with the same key; other entries (other
    machines, dtypes, thread counts) are kept, an invalid file is replaced. Atomic."""
    from .._files import atomic_write

    try:
        old = _entries(path)
    except (OSError, ValueError):
        old = []
    same = tuple(entry[k] for k in _KEY_FIELDS)
    kept = [e for e in old if tuple(e.get(k) for k in _KEY_FIELDS) != same]
    text = json.dumps({"format": FORMAT, "version": VERSION, "entries": [*kept, entry]}, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))


def machine_rate(
    dtype: str,
    measure: Callable[[str], float],
    *,
    what: str,
    recalibrate: bool = False,
) -> Rate:
    """This machine's rate for ``dtype``: the cached one, else ``measure(dtype)`` (then cached).

    Args:
        dtype: a torch dtype's name, e.g. ``"bfloat16"``.
        measure: times the matmul and returns GFLOP/s.
        what: the measurement in words for the source, e.g. ``"1024² float32 matmul"``.
        recalibrate: measure even when an entry exists, and replace it.

    Raises:
        ValueError: ``recalibrate`` while the cache is off (nothing could be written).
    """
    from ..functional import thresholds

    path = rates_file()
    if not enabled():
        if recalibrate:
            raise ValueError(
                f"{thresholds.ENV}={_settings.text('thresholds')} turns the per-machine cache "
                "off, so there is nothing to re-measure into; unset it"
            )
        setting = f"{thresholds.ENV}={_settings.text('thresholds')}"
        return Rate(measure(dtype), f"measured now: {what}; not cached ({setting})", cached=False)
    key = rate_key(dtype)
    if not recalibrate:
        try:
            found = read_rate(path, key)
        except (OSError, ValueError) as e:
            warnings.warn(
                f"attnlab: ignoring the matmul-rate cache {path}: {e}; measuring again",
                UserWarning,
                stacklevel=2,
            )
            found = None
        if found is not None:
            return found
    gflops = measure(dtype)
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measured = f"measured now: {what}, {key['threads']} threads"
    try:
        write_rate(path, {**key, "gflops": gflops, "measured_at": when, "measurement": what})
    except OSError as e:
        warnings.warn(
            f"attnlab: cannot write the matmul-rate cache {path}: {e}", UserWarning, stacklevel=2
        )
        return Rate(gflops, f"{measured}; not cached (cannot write {path})", cached=False)
    return Rate(gflops, f"{measured}; cached in {path}", cached=False)
