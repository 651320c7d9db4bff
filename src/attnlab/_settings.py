"""Every ``ATTNLAB_*`` setting of the attention path, read in this one module (`settings`).

A setting is the stripped text of its environment variable (None when unset). The variables are
read once per process, on first use, into one frozen `Settings` record (`settings`); `text` and
`choice` read one setting from it. `refresh` reads the environment again (a test's
``monkeypatch.setenv``, a user who changes ``os.environ`` after the first attention call) and
clears every value derived from the settings: modules that keep one register its reset with
`on_refresh` (the flash options, whether the C++ kernels run). The modules that own a setting turn
its text into a value and raise on a bad one, where the setting is used (`attnlab._ext.mode`,
`functional.flash.engines.low_precision`, `functional.flash.band_kernel.engine_setting`,
`functional.flash.plan.flash_options`, `functional.thresholds.enabled`); the fixed choices of
`functional.gemv` and `models.fused_step` are read with `choice`.

Core code imports only `os` here (no torch): `import attnlab` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields

EXT_MODE = "ATTNLAB_EXT"
EXT_CACHE = "ATTNLAB_EXT_CACHE"
EXT_QUIET = "ATTNLAB_EXT_QUIET"
FLASH_LOWP = "ATTNLAB_FLASH_LOWP"
FLASH_BAND_ENGINE = "ATTNLAB_FLASH_BAND_ENGINE"
FLASH_BAND_BLOCK = "ATTNLAB_FLASH_BAND_BLOCK"
FLASH_PLAN_CACHE = "ATTNLAB_FLASH_PLAN_CACHE"
THRESHOLDS = "ATTNLAB_THRESHOLDS"
THRESHOLDS_FILE = "ATTNLAB_THRESHOLDS_FILE"
GEMV = "ATTNLAB_GEMV"
GEMV_ROWS = "ATTNLAB_GEMV_ROWS"
LINEAR_WIDEN = "ATTNLAB_LINEAR_WIDEN"
BLOCK_STEP = "ATTNLAB_BLOCK_STEP"

_OFF = ("0", "off", "false", "no", "never")


@dataclass(frozen=True)
class Settings:
    """The text of each ``ATTNLAB_*`` variable (stripped; None when unset or empty).

    Attributes:
        ext: ``ATTNLAB_EXT`` (attnlab's C++ kernels: auto / off / require).
        ext_cache: ``ATTNLAB_EXT_CACHE`` (the kernels' build directory).
        ext_quiet: ``ATTNLAB_EXT_QUIET`` (no build notices).
        flash_lowp: ``ATTNLAB_FLASH_LOWP`` (flash's low-precision policy).
        flash_band_engine: ``ATTNLAB_FLASH_BAND_ENGINE`` (who runs band calls).
        flash_band_block: ``ATTNLAB_FLASH_BAND_BLOCK`` (forward query block of band calls).
        flash_plan_cache: ``ATTNLAB_FLASH_PLAN_CACHE`` (the plan cache on or off).
        thresholds: ``ATTNLAB_THRESHOLDS`` (auto's per-machine thresholds on or off).
        thresholds_file: ``ATTNLAB_THRESHOLDS_FILE`` (their cache file).
        gemv: ``ATTNLAB_GEMV`` (attnlab's few-row matrix product: auto / off).
        gemv_rows: ``ATTNLAB_GEMV_ROWS`` (its weight rows per pass: auto / 1 / 2 / 4).
        linear_widen: ``ATTNLAB_LINEAR_WIDEN`` (16-bit linear layers widened: auto / on / off).
        block_step: ``ATTNLAB_BLOCK_STEP`` (the fused decoding block step: auto / off).
    """

    ext: str | None = None
    ext_cache: str | None = None
    ext_quiet: str | None = None
    flash_lowp: str | None = None
    flash_band_engine: str | None = None
    flash_band_block: str | None = None
    flash_plan_cache: str | None = None
    thresholds: str | None = None
    thresholds_file: str | None = None
    gemv: str | None = None
    gemv_rows: str | None = None
    linear_widen: str | None = None
    block_step: str | None = None

    @property
    def plan_cache_on(self) -> bool:
        """False when ``ATTNLAB_FLASH_PLAN_CACHE`` turns the plan cache off (0, off, no...)."""
        return not turned_off(self.flash_plan_cache)

    @property
    def thresholds_on(self) -> bool:
        """False when ``ATTNLAB_THRESHOLDS`` turns auto's per-machine thresholds off."""
        return not turned_off(self.thresholds)


def turned_off(text: str | None) -> bool:
    """Whether a setting's text turns its feature off (``0``, ``off``, ``false``, ``no``,
    ``never``; any case)."""
    return (text or "").lower() in _OFF


VARIABLES: dict[str, str] = {
    "ext": EXT_MODE,
    "ext_cache": EXT_CACHE,
    "ext_quiet": EXT_QUIET,
    "flash_lowp": FLASH_LOWP,
    "flash_band_engine": FLASH_BAND_ENGINE,
    "flash_band_block": FLASH_BAND_BLOCK,
    "flash_plan_cache": FLASH_PLAN_CACHE,
    "thresholds": THRESHOLDS,
    "thresholds_file": THRESHOLDS_FILE,
    "gemv": GEMV,
    "gemv_rows": GEMV_ROWS,
    "linear_widen": LINEAR_WIDEN,
    "block_step": BLOCK_STEP,
}
"""`Settings` field -> environment variable."""

assert set(VARIABLES) == {f.name for f in fields(Settings)}

_CURRENT: list[Settings] = []
"""The record read from the environment (empty until the first read and after `refresh`)."""

_RESETS: list[Callable[[], object]] = []
"""What `refresh` calls: the resets of values derived from the settings (`on_refresh`)."""


def on_refresh(reset: Callable[[], object]) -> None:
    """Registers ``reset`` (e.g. a dict's ``clear``) to be called by `refresh`: a module that
    keeps a value derived from the settings forgets it when they are read again."""
    _RESETS.append(reset)


def settings() -> Settings:
    """The `Settings` of this process: read from the environment on first use (`refresh`)."""
    return _CURRENT[0] if _CURRENT else refresh()


def refresh() -> Settings:
    """Reads every variable again and resets the values derived from them (`on_refresh`);
    public as ``attnlab.refresh_settings()``: call it after changing an ``ATTNLAB_*`` variable
    in a process that already ran attention (the first use reads them anyway).

    Returns:
        The new `Settings` record.
    """
    raw = [os.environ.get(name) for name in VARIABLES.values()]
    text = [None if r is None else (r.strip() or None) for r in raw]
    record = Settings(**dict(zip(VARIABLES, text, strict=True)))
    _CURRENT[:] = [record]
    forget()
    return record


def forget() -> None:
    """Resets the values derived from the settings (`on_refresh`) without reading them again:
    the next call asks again (`attnlab._ext.reporting` does this on entry and exit, so the
    kernels a call involves are asked, and recorded, inside it)."""
    for reset in _RESETS:
        reset()


def text(name: str) -> str | None:
    """One setting's text: ``name`` is a `Settings` field (``"ext"``, ``"flash_lowp"``, ...);
    stripped, None when unset or empty."""
    return getattr(settings(), name)


def choice(name: str, allowed: tuple[str, ...]) -> str:
    """One setting read now as one of ``allowed`` (any case; unset or empty = ``allowed[0]``).

    Raises:
        ValueError: the variable holds something else (naming it, the choices and the text).
    """
    value = (text(name) or allowed[0]).lower()
    if value not in allowed:
        names = [repr(a) for a in allowed]
        expected = ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"{VARIABLES[name]} must be {expected}, got {value!r}")
    return value


__all__ = [
    "VARIABLES",
    "Settings",
    "choice",
    "forget",
    "on_refresh",
    "refresh",
    "settings",
    "text",
    "turned_off",
]
