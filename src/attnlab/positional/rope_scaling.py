"""RoPE frequency scaling: a registry of functions returning ``(inv_freq, attention_scaling)``.

Every function takes explicit arguments named in Hugging Face transformers' vocabulary
(``factor``, ``original_max_position_embeddings``, ``beta_fast``, …), computes in float64 and
returns ``inv_freq`` as a float64 tensor of shape ``(dim/2,)`` together with the factor that
multiplies cos and sin (so scores are scaled by its square). The values equal what transformers'
``ROPE_INIT_FUNCTIONS`` computes for the same settings (tests/test_positional_hf.py), but bad
settings raise `ValueError` naming the field instead of logging a warning.

Registry: `ROPE_SCALING` maps a ``rope_type`` to its function; `compute_rope_parameters` reads an
HF-style dict such as ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
4096}`` and calls the function with the dict's fields as keyword arguments.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from .._shapes import check_bool, check_int, check_number

RopeScalingFn = Callable[..., tuple[Tensor, float]]

_NOT_FIELDS = ("dim", "base", "seq_len")


# ----------------------------------------------------------------------------- argument checks
def _dim_base(where: str, dim: object, base: object, *, min_dim: int = 2) -> tuple[int, float]:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < min_dim or dim % 2:
        raise ValueError(
            f"{where}: dim (the rotary dim) must be an even int >= {min_dim}, got {dim!r}"
        )
    return dim, check_number(f"{where}: base", base, greater=1.0)


def _factors(where: str, name: str, values: object, dim: int) -> Tensor:
    if isinstance(values, Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise ValueError(f"{where}: {name} must be a list of {dim // 2} numbers, got {values!r}")
    if len(values) != dim // 2:
        raise ValueError(f"{where}: {name} must have dim/2 = {dim // 2} entries, got {len(values)}")
    for v in values:
        check_number(f"{where}: {name}", v, greater=0.0)
    return torch.tensor([float(v) for v in values], dtype=torch.float64)  # (dim/2,)


def _seq_len(where: str, seq_len: object) -> int | None:
    if seq_len is None:
        return None
    if isinstance(seq_len, Tensor) and seq_len.numel() == 1 and not seq_len.is_floating_point():
        seq_len = int(seq_len)
    return check_int(f"{where}: seq_len", seq_len, minimum=1)


def _inv_freq(dim: int, base: float) -> Tensor:
    """``θ_i = base^(−2i/dim)``, float64 ``(dim/2,)``."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


# ----------------------------------------------------------------------------- scaling functions
def default(dim: int, base: float) -> tuple[Tensor, float]:
    """Unscaled RoPE (Su et al.): ``θ_i = base^(−2i/dim)``, attention scaling 1."""
    dim, base = _dim_base("default", dim, base)
    return _inv_freq(dim, base), 1.0


def linear(dim: int, base: float, *, factor: float) -> tuple[Tensor, float]:
    """Position interpolation (Chen et al., 2023): ``θ_i / factor``, i.e. positions / factor."""
    dim, base = _dim_base("linear", dim, base)
    factor = check_number("linear: factor", factor, at_least=1.0)
    return _inv_freq(dim, base) / factor, 1.0


def ntk(dim: int, base: float, *, factor: float) -> tuple[Tensor, float]:
    """Static NTK-aware scaling: RoPE with the base changed to ``base · factor^(dim/(dim−2))``.

    The lowest frequency is then divided by exactly ``factor`` while the highest is unchanged.
    """
    dim, base = _dim_base("ntk", dim, base, min_dim=4)
    factor = check_number("ntk: factor", factor, at_least=1.0)
    return _inv_freq(dim, base * factor ** (dim / (dim - 2))), 1.0


def dynamic(
    dim: int,
    base: float,
    *,
    factor: float,
    original_max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """Dynamic NTK scaling: the NTK base change, recomputed for the current sequence length.

    With ``s = max(seq_len, original_max_position_embeddings)`` and ``L0`` the original length::

        base' = base · (factor · s / L0 − (factor − 1))^(dim/(dim−2))

    so sequences within the original length use the unscaled frequencies.
    """
    dim, base = _dim_base("dynamic", dim, base, min_dim=4)
    factor = check_number("dynamic: factor", factor, at_least=1.0)
    L0 = check_int(
        "dynamic: original_max_position_embeddings", original_max_position_embeddings, minimum=1
    )
    s = max(_seq_len("dynamic", seq_len) or L0, L0)
    new_base = base * (factor * s / L0 - (factor - 1.0)) ** (dim / (dim - 2))
    return _inv_freq(dim, new_base), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(
    dim: int,
    base: float,
    *,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    attention_factor: float | None = None,
    truncate: bool = True,
) -> tuple[Tensor, float]:
    """YaRN (Peng et al., 2023): interpolate slow frequencies, keep fast ones, ramp in between.

    Frequency i rotates ``r_i = L0 · θ_i / 2π`` times over the original length L0. Dimensions with
    more than ``beta_fast`` rotations keep ``θ_i``; those with fewer than ``beta_slow`` use
    ``θ_i / factor``; a linear ramp in the dimension index blends the two in between (the ramp
    ends are floored/ceiled when ``truncate``). The attention scaling is ``attention_factor`` if
    given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given
    (DeepSeek), else ``0.1·ln(factor) + 1``, with ``mscale(s, m) = 0.1·m·ln(s) + 1``.
    """
    where = "yarn"
    dim, base = _dim_base(where, dim, base)
    factor = check_number(f"{where}: factor", factor, at_least=1.0)
    L0 = check_int(
        f"{where}: original_max_position_embeddings", original_max_position_embeddings, minimum=1
    )
    beta_fast = check_number(f"{where}: beta_fast", beta_fast, greater=0.0)
    beta_slow = check_number(f"{where}: beta_slow", beta_slow, greater=0.0)
    if beta_fast < beta_slow:
        raise ValueError(
            f"{where}: beta_fast must be >= beta_slow, got beta_fast={beta_fast:g}, "
            f"beta_slow={beta_slow:g}"
        )
    check_bool(f"{where}: truncate", truncate)
    if attention_factor is not None:
        attention_factor = check_number(f"{where}: attention_factor", attention_factor, greater=0.0)
    elif mscale is not None or mscale_all_dim is not None:
        if mscale is None or mscale_all_dim is None:
            missing = "mscale_all_dim" if mscale_all_dim is None else "mscale"
            raise ValueError(
                f"{where}: mscale and mscale_all_dim must be given together, {missing} is missing"
            )
        m = check_number(f"{where}: mscale", mscale, greater=0.0)
        m_all = check_number(f"{where}: mscale_all_dim", mscale_all_dim, greater=0.0)
        attention_factor = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension index whose frequency makes `rotations` turns over L0 positions.
        return dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    index = torch.arange(dim // 2, dtype=torch.float64)  # (dim/2,)
    ramp = ((index - low) / (high - low)).clamp(0, 1)  # 0: keep θ_i, 1: θ_i / factor
    theta = _inv_freq(dim, base)
    inv_freq = theta / factor * ramp + theta * (1 - ramp)
    return inv_freq, float(attention_factor)


def llama3(
    dim: int,
    base: float,
    *,
    factor: float,
    original_max_position_embeddings: int,
    low_freq_factor: float,
    high_freq_factor: float,
) -> tuple[Tensor, float]:
    """Llama 3.1 scaling: frequencies whose wavelength exceeds ``L0 / low_freq_factor`` are divided
    by ``factor``, those below ``L0 / high_freq_factor`` are kept, and the band in between is
    interpolated smoothly::

        s = (L0 / λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor)
        θ'_i = (1 − s) · θ_i / factor + s · θ_i
    """
    where = "llama3"
    dim, base = _dim_base(where, dim, base)
    factor = check_number(f"{where}: factor", factor, at_least=1.0)
    L0 = check_int(
        f"{where}: original_max_position_embeddings", original_max_position_embeddings, minimum=1
    )
    low = check_number(f"{where}: low_freq_factor", low_freq_factor, greater=0.0)
    high = check_number(f"{where}: high_freq_factor", high_freq_factor, greater=0.0)
    if high <= low:
        raise ValueError(
            f"{where}: high_freq_factor must be > low_freq_factor, got "
            f"high_freq_factor={high:g}, low_freq_factor={low:g}"
        )
    theta = _inv_freq(dim, base)
    wavelen = 2 * math.pi / theta  # (dim/2,)
    low_freq_wavelen, high_freq_wavelen = L0 / low, L0 / high
    scaled = torch.where(wavelen > low_freq_wavelen, theta / factor, theta)
    smooth = (L0 / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def longrope(
    dim: int,
    base: float,
    *,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_max_position_embeddings: int,
    factor: float | None = None,
    attention_factor: float | None = None,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """LongRoPE (Ding et al., 2024; Phi-3): per-dimension factors, ``θ'_i = θ_i / ext_i``.

    ``ext = long_factor`` when ``seq_len > original_max_position_embeddings``, else
    ``short_factor``. The attention scaling is ``attention_factor`` if given, else
    ``√(1 + ln(factor) / ln(L0))`` (1 when factor is 1); ``factor`` is the context extension ratio
    (Phi-3: ``max_position_embeddings / original_max_position_embeddings``), needed only when
    ``attention_factor`` is not given.
    """
    where = "longrope"
    dim, base = _dim_base(where, dim, base)
    short = _factors(where, "short_factor", short_factor, dim)
    long = _factors(where, "long_factor", long_factor, dim)
    L0 = check_int(
        f"{where}: original_max_position_embeddings", original_max_position_embeddings, minimum=1
    )
    seq_len = _seq_len(where, seq_len)
    if attention_factor is not None:
        attention_factor = check_number(f"{where}: attention_factor", attention_factor, greater=0.0)
    elif factor is None:
        raise ValueError(
            f"{where}: factor is required when attention_factor is not given "
            "(Phi-3: max_position_embeddings / original_max_position_embeddings)"
        )
    else:
        factor = check_number(f"{where}: factor", factor, at_least=1.0)
        attention_factor = 1.0 if factor == 1.0 else math.sqrt(1 + math.log(factor) / math.log(L0))
    ext = long if seq_len is not None and seq_len > L0 else short
    return _inv_freq(dim, base) / ext, float(attention_factor)


# ----------------------------------------------------------------------------- registry
ROPE_SCALING: dict[str, RopeScalingFn] = {
    "default": default,
    "linear": linear,
    "ntk": ntk,
    "dynamic": dynamic,
    "yarn": yarn,
    "llama3": llama3,
    "longrope": longrope,
}
"""``rope_type`` → function ``fn(dim, base, *, <fields>) -> (inv_freq, attention_scaling)``."""


def register_rope_scaling(name: str, fn: RopeScalingFn) -> None:
    """Adds a scaling type: ``fn(dim, base, *, fields…[, seq_len]) -> (inv_freq, scaling)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name in ROPE_SCALING:
        raise ValueError(f"rope_type {name!r} is already registered")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    ROPE_SCALING[name] = fn


def _fields(fn: RopeScalingFn) -> tuple[set[str], set[str]]:
    """(required, optional) dict fields of a scaling function: parameters but dim/base/seq_len."""
    required, optional = set(), set()
    for p in list(inspect.signature(fn).parameters.values())[2:]:
        if p.name in _NOT_FIELDS or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        (required if p.default is p.empty else optional).add(p.name)
    return required, optional


def depends_on_seq_len(rope_type: str) -> bool:
    """True for types whose frequencies change with the sequence length (dynamic, longrope)."""
    return "seq_len" in inspect.signature(get_rope_scaling(rope_type)).parameters


def get_rope_scaling(rope_type: object) -> RopeScalingFn:
    """The function registered for ``rope_type``; ValueError listing the known types otherwise."""
    if not isinstance(rope_type, str) or rope_type not in ROPE_SCALING:
        raise ValueError(f"rope_type must be one of {sorted(ROPE_SCALING)}, got {rope_type!r}")
    return ROPE_SCALING[rope_type]


def rope_type_of(scaling: Mapping[str, object] | None) -> str:
    """The ``rope_type`` of an HF-style scaling dict (the old spelling ``"type"`` is accepted)."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise ValueError(
            "scaling must be a dict such as {'rope_type': 'linear', 'factor': 2.0}, "
            f"got {type(scaling).__name__}"
        )
    if "rope_type" not in scaling and "type" not in scaling:
        raise ValueError(f"scaling is missing the field 'rope_type', got fields {sorted(scaling)}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    get_rope_scaling(rope_type)
    return str(rope_type)


def compute_rope_parameters(
    scaling: Mapping[str, object] | None,
    dim: int,
    base: float,
    *,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """Reads an HF-style scaling dict and calls the registered function.

    Args:
        scaling: ``{"rope_type": name, <field>: value, ...}`` or None for unscaled RoPE. The fields
            are the function's keyword arguments; ``rope_theta``, if present, must equal ``base``.
        dim: rotary dim (even).
        base: RoPE base θ (HF's ``rope_theta``).
        seq_len: current sequence length, passed to types that depend on it (dynamic, longrope).

    Returns:
        ``(inv_freq (dim/2,) float64, attention_scaling)``.

    Raises:
        ValueError: unknown ``rope_type``, a missing or unknown field, a bad value (naming it).
    """
    rope_type = rope_type_of(scaling)
    fn = ROPE_SCALING[rope_type]
    fields = dict(scaling or {})
    fields.pop("rope_type", None)
    fields.pop("type", None)
    if "rope_theta" in fields:
        theta = fields.pop("rope_theta")
        if theta != base:
            raise ValueError(
                f"scaling field rope_theta={theta!r} disagrees with base={base!r}; "
                "pass the base once, as RoPE(base=...)"
            )
    required, optional = _fields(fn)
    missing = sorted(required - set(fields))
    if missing:
        raise ValueError(
            f"rope_type {rope_type!r} requires the field(s) {missing}, got {sorted(fields)}"
        )
    unknown = sorted(set(fields) - required - optional)
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown} for rope_type {rope_type!r}; accepted: "
            f"{sorted(required | optional | {'rope_type', 'rope_theta'})}"
        )
    if depends_on_seq_len(rope_type):
        fields["seq_len"] = seq_len
    return fn(dim, base, **fields)


__all__ = [
    "ROPE_SCALING",
    "RopeScalingFn",
    "compute_rope_parameters",
    "default",
    "depends_on_seq_len",
    "dynamic",
    "get_rope_scaling",
    "linear",
    "llama3",
    "longrope",
    "ntk",
    "register_rope_scaling",
    "rope_type_of",
    "yarn",
]
