"""Backend registry: a name maps to one function with one signature, plus what it supports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .request import Request

RunFn = Callable[[Request], tuple[Tensor, Tensor | None]]
RunLseFn = Callable[[Request], tuple[Tensor, Tensor | None, Tensor]]
SupportsFn = Callable[[Request], str | None]


@dataclass(frozen=True)
class Backend:
    """An attention implementation.

    Attributes:
        name: the ``backend=`` string.
        run: computes ``(out (B, H, L, Dv), weights (B, H, L, S) or None)`` for a request.
        supports: returns None if the request is supported, else the reason it is not.
        description: one line for ``attnlab.backends()`` listings and ``attnlab check``.
        tiled: True if it accumulates the softmax online over key tiles; the tolerance rule then
            also accepts 10× the naive *mean* error in float32 (FlexAttention's allowance).
        run_lse: computes ``(out, weights or None, lse (B, H, L) float32+)``; None if the backend
            cannot return the log-sum-exp (auto then skips it for ``return_lse=True`` calls).
        declines: auto's preference: None if the backend is a good pick for the request, else why
            a later backend is faster. A declined backend still runs the call when every other
            supporting backend is a ``last_resort``.
        last_resort: picked by auto only when no other backend supports the call (the reference).
        softcap: the backend applies logit soft-capping (`Request.softcap`). A backend that does
            not declare it never sees a soft-capped request (`select` refuses it with a reason),
            so a backend registered before soft-capping existed cannot silently ignore the cap.
        traced: returns the backend as calls traced by ``torch.compile`` (and calls on ``meta``
            tensors) run it, when that differs (flash: custom operators, imported on first
            use); `select` hands it out for such requests. None: the same backend.
    """

    name: str
    run: RunFn
    supports: SupportsFn
    description: str
    tiled: bool = False
    run_lse: RunLseFn | None = None
    declines: SupportsFn | None = None
    last_resort: bool = False
    softcap: bool = False
    traced: Callable[[], Backend] | None = None


_BACKENDS: dict[str, Backend] = {}
# Order in which "auto" tries backends: fastest first.
_AUTO_ORDER: list[str] = []


def register_backend(backend: Backend, *, auto_rank: int | None = None) -> None:
    """Adds a backend. ``auto_rank`` places it in auto's preference order (0 = tried first)."""
    if backend.name in _BACKENDS or backend.name == "auto":
        raise ValueError(f"backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    if auto_rank is not None:
        _AUTO_ORDER.insert(auto_rank, backend.name)


def set_auto_order(names: tuple[str, ...] | list[str]) -> None:
    """Sets auto's preference order (fastest first) to ``names``, registered backend names.

    Registered backends that are not named keep their relative order after the named ones.
    """
    unknown = [n for n in names if n not in _BACKENDS]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; registered: {list(_BACKENDS)}")
    rest = [n for n in _AUTO_ORDER if n not in names]
    _AUTO_ORDER[:] = [*names, *rest]


def backends() -> list[str]:
    """Names accepted by ``backend=``: every registered backend plus ``"auto"``."""
    return [*_BACKENDS, "auto"]


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (not "auto")."""
    return _BACKENDS[name]


def check_backend_name(name: object) -> str:
    """Raises ValueError unless ``name`` is a known backend or "auto"."""
    if not isinstance(name, str) or (name != "auto" and name not in _BACKENDS):
        raise ValueError(f"backend must be one of {backends()}, got {name!r}")
    return name


def _why_not(backend: Backend, req: Request, need_lse: bool) -> str | None:
    if need_lse and backend.run_lse is None:
        return "it cannot return the log-sum-exp (return_lse=True, or sinks=)"
    why = backend.supports(req)
    if why is None and req.softcap is not None and not backend.softcap:
        why = f"it does not implement logit soft-capping (softcap={req.softcap})"
    return why


def select(name: str, req: Request, *, need_lse: bool = False) -> tuple[Backend, str]:
    """Chooses the backend for a request and says why (`choose`); a traced request (or one on
    ``meta`` tensors) gets the backend's traced form (`Backend.traced`)."""
    backend, why = choose(name, req, need_lse=need_lse)
    if backend.traced is not None and (torch.compiler.is_compiling() or req.q.is_meta):
        backend = backend.traced()
    return backend, why


def choose(name: str, req: Request, *, need_lse: bool = False) -> tuple[Backend, str]:
    """Chooses the backend for a request and says why.

    Auto tries backends in preference order and takes the first that supports the call and does
    not decline it (``Backend.declines``: "another backend is faster here"). If only the
    reference would be left, the first backend that declined runs the call instead.

    Args:
        name: a backend name or "auto".
        req: the validated request.
        need_lse: the caller asked for the log-sum-exp (``return_lse=True``).

    Raises:
        ValueError: an explicitly named backend does not support the request.
    """
    if req.is_empty:
        return _BACKENDS[
            "reference"
        ], "an empty dimension (B, H, L or S is 0) takes the reference path"
    if name != "auto":
        backend = _BACKENDS[name]
        why_not = _why_not(backend, req, need_lse)
        if why_not is not None:
            raise ValueError(f"backend={name!r} cannot run this call: {why_not}")
        return backend, f"backend={name!r} was requested"
    skipped: list[str] = []
    deferred: Backend | None = None
    for candidate in _AUTO_ORDER:
        backend = _BACKENDS[candidate]
        why_not = _why_not(backend, req, need_lse)
        if why_not is not None:
            skipped.append(f"not {candidate!r}: {why_not}")
            continue
        because = f" ({'; '.join(skipped)})" if skipped else ""
        if backend.last_resort and deferred is not None:
            return (
                deferred,
                f"auto picked {deferred.name!r}: it is not the fastest choice for this shape, but "
                f"the faster backends cannot run the call{because}",
            )
        reason = backend.declines(req) if backend.declines is not None else None
        if reason is not None:
            skipped.append(f"not {candidate!r}: {reason}")
            deferred = deferred or backend
            continue
        return (
            backend,
            f"auto picked {candidate!r}: the fastest backend that supports the call{because}",
        )
    if deferred is not None:  # pragma: no cover - the reference is registered as last resort
        return deferred, f"auto picked {deferred.name!r} ({'; '.join(skipped)})"
    raise AssertionError("the reference backend supports every request")  # pragma: no cover
