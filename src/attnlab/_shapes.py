"""Input checks that raise before any computation, naming the argument and the shapes involved.

The library's one validation kit for arguments: `check_int`, `check_number`, `check_bool`,
`check_probability` (scalars), `check_qkv` and the tensor checks, `stat_dtype`, and SDPA's
other layouts as 4-D views (`leading_to_4d`, `extra_to_4d`). Every error
names the argument, the expected and the received value: ``TypeError`` for a value of the wrong
type, ``ValueError`` for one out of range.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of statistics and accumulators for inputs of ``dtype``: float32 or wider.

    float64 for float64, else float32: 16-bit inputs (float16, bfloat16) are widened, as
    their sums, maxima and rotation tables lose digits, and float32 stays float32.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def static_int(x: int) -> int:
    """``x`` as a Python int, also while ``torch.compile(dynamic=True)`` traces.

    Dynamo then sees sizes and every int attribute (a mask's window, a block size) as symbolic;
    `operator.index` specialises one (a guard: another value recompiles), for the places that
    need a constant: plan and band tests, `Mask.spec` strings, a kernel's int arguments.
    """
    return operator.index(x)


def static_bool(b: bool) -> bool:
    """``b`` as a Python bool, also while ``torch.compile(dynamic=True)`` traces (``L == S`` of
    symbolic sizes is a SymBool, which torch's kernels do not take): the branch makes dynamo guard
    on the answer."""
    return True if b else False  # noqa: SIM210 - a branch, not bool(): it specialises a SymBool


@dataclass(frozen=True)
class Dims:
    """Sizes of one attention call. ``three_d`` is True when the inputs were ``(B, L, D)``."""

    B: int
    H: int
    H_kv: int
    L: int
    S: int
    D: int
    Dv: int
    three_d: bool

    @property
    def groups(self) -> int:
        """G = H / H_kv query heads per key/value head."""
        return self.H // self.H_kv if self.H_kv else 1


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(q: object, k: object, v: object) -> Dims:
    """Checks q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)`` (or 3-D).

    Raises:
        TypeError: a non-tensor, a non-float dtype, or dtypes that differ.
        ValueError: ranks, batch, head, length or head-dim mismatches, mixed devices.
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got query {q.dtype}, key {k.dtype}, "
            f"value {v.dtype}"
        )
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            "query/key/value dtype must be one of float64, float32, float16, bfloat16, "
            f"got {q.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"query, key and value must be on one device, got query on {q.device}, key on "
            f"{k.device}, value on {v.device}"
        )
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() not in (3, 4):
            raise ValueError(
                f"{name} must have rank 3 (B, L, D) or 4 (B, H, L, D), got rank {t.dim()} with "
                f"shape {_shape(t)}"
            )
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            f"query, key and value must have the same rank, got query {_shape(q)}, "
            f"key {_shape(k)}, "
            f"value {_shape(v)}"
        )
    three_d = q.dim() == 3
    qs = (q.shape[0], 1, *q.shape[1:]) if three_d else tuple(q.shape)
    ks = (k.shape[0], 1, *k.shape[1:]) if three_d else tuple(k.shape)
    vs = (v.shape[0], 1, *v.shape[1:]) if three_d else tuple(v.shape)
    B, H, L, D = qs
    if ks[0] != B or vs[0] != B:
        raise ValueError(
            f"batch sizes differ: query {_shape(q)}, key {_shape(k)}, value {_shape(v)}"
        )
    if ks[3] != D:
        raise ValueError(
            f"query head_dim {D} ≠ key head_dim {ks[3]} (query {_shape(q)}, key {_shape(k)})"
        )
    if ks[2] != vs[2]:
        raise ValueError(
            f"key length S={ks[2]} ≠ value length S={vs[2]} (key {_shape(k)}, value {_shape(v)})"
        )
    if ks[1] != vs[1]:
        raise ValueError(
            f"key heads {ks[1]} ≠ value heads {vs[1]} (key {_shape(k)}, value {_shape(v)})"
        )
    H_kv = ks[1]
    if (H_kv == 0 and H != 0) or (H_kv and H % H_kv):
        raise ValueError(
            f"query heads H={H} must be a multiple of key/value heads H_kv={H_kv} "
            f"(query {_shape(q)}, key {_shape(k)})"
        )
    return Dims(B=B, H=H, H_kv=H_kv, L=L, S=ks[2], D=D, Dv=vs[3], three_d=three_d)


def check_broadcast(name: str, t: Tensor, dims: Dims) -> None:
    """Checks that ``t`` broadcasts to ``(B, H, L, S)`` (``(B, L, S)`` for 3-D inputs)."""
    target = (dims.B, dims.L, dims.S) if dims.three_d else (dims.B, dims.H, dims.L, dims.S)
    letters = "(B, L, S)" if dims.three_d else "(B, H, L, S)"
    ok = t.dim() <= len(target) and all(
        a in (1, b) for a, b in zip(reversed(t.shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {_shape(t)} is not broadcastable to {letters} = {target}"
        )


def check_mask_tensor(name: str, t: Tensor, q_dtype: torch.dtype, dims: Dims) -> None:
    """A mask tensor must be bool (True = attend) or additive float in the query's dtype."""
    if t.dtype != torch.bool and not t.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = may attend) or a float additive mask of the query dtype "
            f"{q_dtype}, got {t.dtype}"
        )
    if t.is_floating_point() and t.dtype != q_dtype:
        raise TypeError(f"{name} float dtype must match the query dtype {q_dtype}, got {t.dtype}")
    check_broadcast(name, t, dims)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (`check_int`, `check_number`, `check_bool`).

    A ``TypeError``, and a ``ValueError`` too: several modules refused every bad argument with
    ValueError before they used this kit, and their callers keep catching what they caught.
    """


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """An int (not a bool) in ``[minimum, maximum]`` (either bound optional).

    Raises:
        ArgumentTypeError: not an int ("n must be an int, got float 2.0"); a TypeError.
        ValueError: out of range ("n must be >= 1, got 0", "n must be in [0, 9], got 10").
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bound = (
            f"in [{minimum}, {maximum}]"
            if minimum is not None and maximum is not None
            else f">= {minimum}"
            if minimum is not None
            else f"<= {maximum}"
        )
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    """A plain bool; raises TypeError naming the argument and the received value otherwise."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_number(
    name: str,
    value: object,
    *,
    positive: bool = False,
    nonzero: bool = False,
    greater: float | None = None,
    at_least: float | None = None,
) -> float:
    """A finite real number (not a bool), optionally > 0 (``positive``), != 0, ``> greater``
    or ``>= at_least``; raises naming the argument, the bound and the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"{name} must be a real number, got {type(value).__name__} {value!r}"
        )
    x = float(value)
    if torch.compiler.is_compiling():
        return x  # may be symbolic (torch.compile(dynamic=True)): checked in eager calls only
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and x <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonzero and x == 0:
        raise ValueError(f"{name} must be non-zero, got {value}")
    if greater is not None and not x > greater:
        raise ValueError(f"{name} must be > {greater:g}, got {x:g}")
    if at_least is not None and not x >= at_least:
        raise ValueError(f"{name} must be >= {at_least:g}, got {x:g}")
    return x


def check_probability(name: str, value: object) -> float:
    """A dropout probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            f"{name} must be a float in [0, 1), got {type(value).__name__} {value!r}"
        )
    x = float(value)
    if torch.compiler.is_compiling():
        return x  # may be symbolic (torch.compile(dynamic=True)): checked in eager calls only
    if not (0.0 <= x < 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return x


def check_same_device(name: str, t: Tensor, q: Tensor) -> None:
    """A tensor argument must live on the query's device (a `meta` mask on cpu reads garbage)."""
    if t.device != q.device:
        raise ValueError(f"{name} must be on the query's device {q.device}, got device {t.device}")


# Largest |scale / temperature| accepted, per compute dtype: 2^(maxexp / 2), so the logits
# q·k · scale / T stay finite for every |q·k| below the same bound. float16/bfloat16 logits are
# computed in float32.
MAX_LOGIT_MULTIPLIER = {torch.float64: 2.0**512, torch.float32: 2.0**64}


def check_logit_multiplier(scale: float, temperature: float, dtype: torch.dtype) -> float:
    """``scale / temperature``: finite, non-zero and at most `MAX_LOGIT_MULTIPLIER` in magnitude.

    Beyond the bound the logits overflow the compute dtype (float32, or float64 for float64
    inputs) and softmax turns ``inf − inf`` into NaN, so the call is refused before any work.
    """
    compute = stat_dtype(dtype)
    bound = MAX_LOGIT_MULTIPLIER[compute]
    m = scale / temperature  # Python floats: float64, inf on overflow, 0.0 on underflow
    if torch.compiler.is_compiling():
        return m  # may be symbolic (torch.compile(dynamic=True)): checked in eager calls only
    if not math.isfinite(m) or abs(m) > bound:
        raise ValueError(
            f"scale / temperature must be at most {bound:.3g} in magnitude for {dtype} inputs "
            f"(logits in {compute} would overflow), got scale={scale!r} / "
            f"temperature={temperature!r} = {m:.3g}"
        )
    if m == 0.0:
        raise ValueError(
            f"scale / temperature must be non-zero, got scale={scale!r} / "
            f"temperature={temperature!r}, which underflows to 0"
        )
    return m


def fn_name(fn: object) -> str:
    """A readable name of a user function: its ``__qualname__``/``__name__``, else its repr."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else repr(fn)


def _broadcast_shape(tensors: tuple[Tensor, ...]) -> tuple[int, ...]:
    """The broadcast shape of broadcastable tensors (torch.broadcast_shapes costs ~0.2 ms)."""
    nd = max(t.dim() for t in tensors)
    out = [1] * nd
    for t in tensors:
        for k, size in enumerate(t.shape, nd - t.dim()):
            if size != 1:
                out[k] = size
    return tuple(out)


def check_index_fn_output(
    kind: str, fn: object, out: object, index: tuple[Tensor, ...], *, want_bool: bool = True
) -> Tensor:
    """Checks what a mask/bias function returned on the index tensors ``index = (b, h, i, j)``.

    The result must be a tensor (bool for masks, float for biases) on the indices' device whose
    shape broadcasts to the broadcast of the index shapes (each dim 1 or equal), so it can never
    silently grow the grid.

    Args:
        kind: "mask function" or "bias function" (starts the message).
        fn: the user function (named in the message).
        out: its result.
        index: the broadcastable index tensors it was called with.
        want_bool: True for masks (bool), False for biases (floating point).

    Returns:
        ``out``, unchanged.

    Raises:
        TypeError: not a tensor, or the wrong dtype.
        ValueError: a shape that does not broadcast to the index grid, or another device.
    """
    ok_dtype = isinstance(out, Tensor) and (
        out.dtype == torch.bool if want_bool else out.is_floating_point()
    )
    if not ok_dtype:
        want = "a bool tensor" if want_bool else "a float tensor"
        got = f"dtype {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(f"{kind} must return {want}, got {got} from {fn_name(fn)}")
    assert isinstance(out, Tensor)
    grid = _broadcast_shape(index)
    shape = tuple(out.shape)
    if len(shape) > len(grid) or any(
        a not in (1, b) for a, b in zip(reversed(shape), reversed(grid), strict=False)
    ):
        raise ValueError(
            f"{kind} {fn_name(fn)} returned shape {shape}, which does not broadcast to the index "
            f"grid (B, H, L, S) = {grid} it was called on"
        )
    device = index[-1].device
    if out.dim() and out.device != device:
        raise ValueError(
            f"{kind} {fn_name(fn)} returned a tensor on {out.device}, expected the indices' device "
            f"{device}"
        )
    return out


# ---------------------------------------------------------------- SDPA's layouts
def _dims_of(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_extra(name: str, t: Tensor, target: tuple[int, ...]) -> None:
    """Raises ValueError, quoting both shapes, unless the mask or bias tensor ``t`` broadcasts
    to ``target = (*batch, H, L, S)`` (``(L, S)`` for 2-D inputs) by torch's rules: aligned at
    the right, every size 1 or equal, no more dims than the inputs."""
    if t.dim() > len(target) or not all(
        a in (1, b) for a, b in zip(reversed(t.shape), reversed(target), strict=False)
    ):
        letters = "(L, S)" if len(target) == 2 else "(..., H, L, S)"
        raise ValueError(
            f"{name} of shape {_dims_of(t)} is not broadcastable to {letters} = {target}"
        )


def extra_to_4d(t: Tensor, target: tuple[int, ...], B: int) -> Tensor:
    """A mask or bias tensor that broadcasts to ``target`` (`check_extra`) as one that
    broadcasts to ``(B, H, L, S)``, ``B = prod(batch)``: a view when its batch dims are all 1 or
    all full (and mergeable); one that broadcasts over some batch dims but not others is
    expanded over them and copied once."""
    r = len(target)
    t = t.reshape((1,) * (r - t.dim()) + _dims_of(t))  # (1|batch..., H|1, L|1, S|1)
    if r == 2:
        return t.reshape(1, 1, *t.shape)  # (1, 1, L|1, S|1)
    batch, tail = _dims_of(t)[:-3], _dims_of(t)[-3:]
    if all(n == 1 for n in batch):
        return t.reshape(1, *tail)  # (1, H|1, L|1, S|1)
    if batch != target[:-3]:
        t = t.expand(*target[:-3], *tail)  # broadcast over some batch dims only
    return t.reshape(B, *tail)  # (B, H|1, L|1, S|1)


class Leading(NamedTuple):
    """What `leading_to_4d` made of SDPA-style inputs."""

    q: Tensor  # (B, H, L, D)
    k: Tensor  # (B, H_kv, S, D)
    v: Tensor  # (B, H_kv, S, Dv)
    batch_shape: tuple[int, ...]  # the caller's (*batch, H), or () for 2-D inputs
    target: tuple[int, ...]  # (*batch, H, L, S), or (L, S) for 2-D inputs
    B: int  # prod(batch)


def leading_to_4d(q: Tensor, k: Tensor, v: Tensor) -> Leading | None:
    """SDPA's layouts beyond `attention`'s 3-D/4-D ones, as 4-D views (before any work).

    q ``(*batch, H, L, D)`` with ≥ 1 batch dims (rank ≥ 5), k ``(*batch, H_kv, S, D)`` and v
    ``(*batch, H_kv, S, Dv)`` become ``(B, H, L, D)``, ``(B, H_kv, S, D)``, ``(B, H_kv, S, Dv)``
    with ``B = prod(batch)``; 2-D inputs ``(L, D)``, ``(S, D)``, ``(S, Dv)`` become
    ``(1, 1, L, D)`` etc. Views, unless the batch dims of an input cannot be merged (then
    `Tensor.reshape` copies it once). The output is ``out.reshape(*batch_shape, L, Dv)``.

    Returns:
        None for 3-D/4-D inputs and non-tensors (`check_qkv` handles them).

    Raises:
        ValueError: a rank below 2, ranks that differ, or batch dims that differ between q, k and
            v (they are not broadcast: expand them, which is free), naming every shape.
    """
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    ranks = (q.dim(), k.dim(), v.dim())
    if all(r in (3, 4) for r in ranks):
        return None
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have rank 3 (B, L, D), 4 (B, H, L, D), 2 (L, D) or more "
                f"(..., H, L, D), got rank {t.dim()} with shape {_dims_of(t)}"
            )
    if len(set(ranks)) > 1:
        raise ValueError(
            f"query, key and value must have the same rank, got query {_dims_of(q)}, key "
            f"{_dims_of(k)}, value {_dims_of(v)}"
        )
    if q.dim() == 2:
        q4, k4, v4 = (t.reshape(1, 1, *t.shape) for t in (q, k, v))  # (1, 1, L|S, D|Dv)
        return Leading(q4, k4, v4, (), (q.shape[0], k.shape[0]), 1)
    batch = _dims_of(q)[:-3]
    if _dims_of(k)[:-3] != batch or _dims_of(v)[:-3] != batch:
        raise ValueError(
            f"query, key and value must share the batch dims {batch} before (H, L|S, D), got "
            f"query {_dims_of(q)}, key {_dims_of(k)}, value {_dims_of(v)}"
        )
    B = math.prod(batch)
    q4 = q.reshape(B, *q.shape[-3:])  # (B, H, L, D)
    k4 = k.reshape(B, *k.shape[-3:])  # (B, H_kv, S, D)
    v4 = v.reshape(B, *v.shape[-3:])  # (B, H_kv, S, Dv)
    target = (*batch, q.shape[-3], q.shape[-2], k.shape[-2])
    return Leading(q4, k4, v4, _dims_of(q)[:-2], target, B)


# ---------------------------------------------------------------- positions and the index grid
# Every index function of the library — a `Mask`, a bias function ``fn(b, h, i, j)``, the dense
# pictures of a bias — is evaluated on broadcastable Long index tensors. When L != S the queries
# are aligned bottom-right: query row ``r`` sits at key position ``p = r + S − L`` (the last
# query sees the last key), which is what KV-cache decoding needs.
def align(rows: Tensor, L: int, S: int) -> Tensor:
    """Key positions of raw query rows: ``p = rows + S − L`` (bottom-right alignment).

    Args:
        rows: raw query rows in ``[0, L)``, any shape (Long).
        L, S: query and key lengths.

    Returns:
        Tensor of the shape of ``rows``.
    """
    return rows + (S - L)


def query_positions(L: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """The aligned positions ``p = r + S − L`` of all L query rows, shape ``(L,)`` (int64)."""
    return align(torch.arange(L, device=device), L, S)


def index_grid(
    B: int,
    H: int,
    L: int,
    S: int,
    *,
    rows: Tensor | None = None,
    keys: Tensor | None = None,
    aligned: bool = True,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``i (1,1,R,1)``, ``j (1,1,1,K)``.

    The one grid for masks, bias functions and dense bias pictures.

    Args:
        B, H: batch and head counts (``arange`` of each).
        L, S: query and key lengths of the call (they fix the alignment).
        rows: the raw query rows to cover (default all L rows).
        keys: the key positions to cover (default all S keys).
        aligned: give ``i`` as aligned positions ``r + S − L`` (what bias functions and
            `attnlab.masks.from_fn` receive); False gives the raw rows (what `Mask.evaluate` takes).
        device: where to build the tensors (default: the device of ``rows``/``keys`` if given).

    Returns:
        ``(b, h, i, j)``, Long tensors broadcasting to ``(B, H, R, K)``.
    """
    if device is None:
        given = rows if rows is not None else keys
        device = given.device if given is not None else None
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    r = torch.arange(L, device=device) if rows is None else rows.to(device)
    i = (align(r, L, S) if aligned else r).reshape(1, 1, -1, 1)
    k = torch.arange(S, device=device) if keys is None else keys.to(device)
    j = k.reshape(1, 1, 1, -1)
    return b, h, i, j


def check_head_index(owner: str, num_heads: int, h: Tensor) -> None:
    """Raises if a function bias is evaluated on more heads than it was built for.

    Reads ``max(h)`` back to the host, so it runs in eager mode only: skipped under
    `torch.compile`/`torch.export` and for ``meta`` tensors (the head lookup then fails instead).
    """
    if torch.compiler.is_compiling() or h.is_meta:
        return
    if h.numel() and int(h.max()) >= num_heads:
        raise ValueError(
            f"{owner} was built with num_heads={num_heads}, but the attention call has "
            f"H={int(h.max()) + 1} query heads"
        )
