"""Memory estimates of ``attnlab train``: refuse a run that cannot fit before building anything.

A training run needs its parameters, their gradients and AdamW's two moment buffers (4 fp32
tensors: 16 bytes per parameter) plus the activations autograd keeps for the backward pass.
`parameter_count` counts the parameters of the real model, built on the ``meta`` device (shapes
only, no memory) with one and two layers: every model here grows linearly in its layer count,
so a request for 10**8 layers costs two tiny builds. `check_fits` compares the estimate with the
memory this process can use (`available_memory`) and raises `UsageError` naming the size
argument most responsible, the estimated bytes and the bytes available, one line, exit code 2.

The estimate is a floor of what the run needs (activations count the main saved tensors of each
layer only), so a refused run could never have run here; one that passes may still be too big.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ._args import UsageError

#: Bytes per trainable parameter during training: fp32 weight, gradient and AdamW's exp_avg and
#: exp_avg_sq.
TRAIN_BYTES_PER_PARAM = 16


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units with 2-3 significant digits: ``"1.2 PB"``, ``"23 GB"``."""
    if not math.isfinite(n):
        return "more bytes than can be counted"
    units = ("bytes", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    if i == 0:
        return f"{int(n)} bytes"
    return f"{n:.2g} {units[i]}" if n < 10 else f"{n:.0f} {units[i]}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo_available() -> int | None:
    text = _read("/proc/meminfo")
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def _cgroup_room() -> int | None:
    """The memory left under this process's cgroup limit (v2, then v1); None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None or not limit.isdigit() or not usage.isdigit():
            continue
        if int(limit) >= 2**60:  # cgroup v1 writes "no limit" as a huge number
            continue
        return max(0, int(limit) - int(usage))
    return None


def _address_space_room() -> int | None:
    """The room left under ``ulimit -v`` (RLIMIT_AS); None when unlimited."""
    try:
        import resource  # POSIX only

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    statm = _read("/proc/self/statm")
    used = int(statm.split()[0]) * os.sysconf("SC_PAGE_SIZE") if statm else 0
    return max(0, soft - used)


def _sysconf_available() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes a new allocation on ``device`` can use now; None when it cannot be told.

    CUDA: the device's free memory (``torch.cuda.mem_get_info``). Host memory: the smallest of
    /proc/meminfo's MemAvailable (else free physical pages from ``os.sysconf``), the room under
    the cgroup's memory limit, and the room under ``ulimit -v``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError, ValueError):
            return None
    host = _meminfo_available()
    if host is None:
        host = _sysconf_available()
    found = [x for x in (host, _cgroup_room(), _address_space_room()) if x is not None]
    return min(found) if found else None


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """``torch.nn.init``'s in-place initialisers as no-ops: meta tensors have no values, and
    the first meta ``normal_`` of a process is slow: torch imports its reference ops (measured:
    benchmarks/RESULTS.md)."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *_args, **_kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _count(build: Callable[[int], nn.Module], layers: int) -> tuple[int, int]:
    """``(parameters, buffer bytes)`` of ``build(layers)`` built on the meta device."""
    with torch.device("meta"), _no_init():
        model = build(layers)
    params = sum(p.numel() for p in model.parameters())  # tied weights count once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params, buffers


def parameter_count(build: Callable[[int], nn.Module], layers: int) -> tuple[int, int]:
    """``(parameters, buffer bytes)`` of ``build(layers)``, without building ``layers`` layers.

    ``build(n)`` must return the model with ``n`` layers (per stack); it is built on the meta
    device with 1 and 2 layers and the count extrapolated linearly, exactly for models whose
    layers are copies of one another.
    """
    p1, b1 = _count(build, 1)
    if layers == 1:
        return p1, b1
    p2, b2 = _count(build, 2)
    return p1 + (layers - 1) * (p2 - p1), b1 + (layers - 1) * (b2 - b1)


@dataclass(frozen=True)
class TrainingMemory:
    """A training run's estimated memory (not `attnlab.analysis.Estimate`, the attention layer's
    parameters, FLOPs and memory).

    Attributes:
        parameters: trainable parameters (counted once when tied).
        buffer_bytes: the model's buffers.
        activation_bytes: what autograd keeps for the backward pass (the main saved tensors).
    """

    parameters: int
    buffer_bytes: int
    activation_bytes: int

    @property
    def state_bytes(self) -> int:
        """Weights, gradients and AdamW state (`TRAIN_BYTES_PER_PARAM` per parameter)."""
        return self.parameters * TRAIN_BYTES_PER_PARAM + self.buffer_bytes

    @property
    def total(self) -> int:
        """Everything estimated, in bytes."""
        return self.state_bytes + self.activation_bytes


# The former name, until the subcommands import `TrainingMemory` (then this line goes).
Estimate = TrainingMemory


def _culprit(sizes: Sequence[tuple[str, int, int]]) -> tuple[str, int]:
    """The size argument furthest above its default: ``(flag, value)``."""
    flag, value, _ = max(sizes, key=lambda s: s[1] / max(1, s[2]))
    return flag, value


def check_fits(
    estimate: TrainingMemory,
    sizes: Sequence[tuple[str, int, int]],
    device: torch.device | str = "cpu",
    *,
    available: int | None = None,
) -> None:
    """Raises `UsageError` when ``estimate`` exceeds the memory available on ``device``.

    Args:
        estimate: the run's `TrainingMemory`.
        sizes: ``(flag, value, default)`` of the size arguments; the error names the one whose
            value is the largest multiple of its default.
        device: where the run would allocate.
        available: bytes available (default: `available_memory` of ``device``; None there
            means unknown, and nothing is refused).
    """
    room = available_memory(device) if available is None else available
    if room is None or estimate.total <= room:
        return
    flag, value = _culprit(sizes)
    others = ", ".join(f"{f} {v}" for f, v, _ in sizes if f != flag)
    where = "this machine has" if torch.device(device).type == "cpu" else f"{device} has"
    raise UsageError(
        flag,
        f"{value}{f' (with {others})' if others else ''} needs ≈ {format_bytes(estimate.total)}: "
        f"{estimate.parameters:.3g} parameters with their gradients and AdamW state "
        f"≈ {format_bytes(estimate.state_bytes)}, activations "
        f"≈ {format_bytes(estimate.activation_bytes)}; {where} {format_bytes(room)} available",
    )


def transformer_activation_bytes(
    tokens: int, layers: int, d_model: int, vocab: int, *, checkpointing: bool = False
) -> int:
    """Activations of a Transformer's training step on ``tokens`` tokens (fp32).

    Per layer and token a pre-norm block saves about 16 vectors of width ``d_model`` (norms,
    q, k, v, attention output, residuals, the MLP's 4·E hidden twice); the head saves the
    logits and their gradient. With gradient checkpointing a layer keeps its input only, plus
    one layer's full set while it is recomputed.
    """
    per_layer = 16 * d_model
    kept = layers * d_model + per_layer if checkpointing else layers * per_layer
    return 4 * tokens * (kept + 2 * vocab)


__all__ = [
    "TRAIN_BYTES_PER_PARAM",
    "TrainingMemory",
    "available_memory",
    "check_fits",
    "format_bytes",
    "parameter_count",
    "transformer_activation_bytes",
]
