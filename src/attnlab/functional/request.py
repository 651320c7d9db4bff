"""What one attention call asks for, validated once: the score functions, the `Request` (its
logit scale and its mask and bias sorted by form, resolved once) and `build_request`, which
turns the arguments of the entry points into one — raising ValueError/TypeError that name the
argument, the expected and the received value before any work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
from torch import Tensor

from .._shapes import (
    Dims,
    Leading,
    check_bool,
    check_extra,
    check_index_fn_output,
    check_logit_multiplier,
    check_mask_tensor,
    check_number,
    check_probability,
    check_qkv,
    check_same_device,
    extra_to_4d,
    index_grid,
    leading_to_4d,
    stat_dtype,
    static_bool,
)
from ..masks import CausalMask, Mask, PaddingMask, TensorMask

_T = TypeVar("_T")


# ---------------------------------------------------------------- score functions
# A score function reduces to a dot product of *prepared* queries and keys, so that the fused
# kernels can run it: ``score(q, k) = prepare(q) · prepare(k)``. A score is a registry entry,
# not a flag.
_COSINE_EPS = 1e-12


@dataclass(frozen=True)
class Score:
    """A score function ``s(q, k) = prepare(q) · prepare(k)`` and its default scale.

    Attributes:
        name: registry name.
        prepare: maps q ``(…, L, D)`` or k ``(…, S, D)`` to the vectors that are dot-multiplied.
        default_scale: scale used when the caller passes ``scale=None``, as a function of D.
    """

    name: str
    prepare: Callable[[Tensor], Tensor]
    default_scale: Callable[[int], float]


def _identity(x: Tensor) -> Tensor:
    return x


def _unit(x: Tensor) -> Tensor:
    # x / max(‖x‖, eps): a zero vector has cosine 0 with everything.
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_COSINE_EPS)


def _inv_sqrt(d: int) -> float:
    return 1.0 / math.sqrt(d) if d > 0 else 1.0


SCORES: dict[str, Score] = {
    # s = q·k, scaled by 1/√D (Vaswani et al.: logit variance ≈ 1 for unit-variance inputs).
    "dot": Score("dot", _identity, _inv_sqrt),
    # s = cos(q, k) = q·k / (‖q‖‖k‖) in [−1, 1]; default scale 1 (sharpen via scale/temperature).
    "cosine": Score("cosine", _unit, lambda _d: 1.0),
}


def get_score(name: object) -> Score:
    """Looks up a score by name; raises ValueError listing the known names."""
    if not isinstance(name, str) or name not in SCORES:
        raise ValueError(f"score must be one of {sorted(SCORES)}, got {name!r}")
    return SCORES[name]


def register_score(
    name: str, prepare: Callable[[Tensor], Tensor], default_scale: Callable[[int], float]
) -> None:
    """Adds a dot-reducible score ``s(q, k) = prepare(q) · prepare(k)`` to the registry."""
    if name in SCORES:
        raise ValueError(f"score {name!r} is already registered")
    SCORES[name] = Score(name, prepare, default_scale)


# ---------------------------------------------------------------- the request
BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A bias given as ``fn(b, h, i, j) -> float tensor`` on broadcastable index tensors.

``i`` is the query position bottom-right aligned to the keys (``row + S − L``), ``j`` the key
position; the result is added to the logits. The tiled backend evaluates it per tile; the others
materialise it once.

A bias function that depends only on the head and the relative position ``j − i`` (ALiBi, T5's
relative bias) may declare it with an attribute ``relative = True``: the tiled backend then
evaluates one tile per window offset and shares it across all query blocks (see
`is_relative_bias`).

A bias function built for a fixed number of query heads (ALiBi, T5's relative bias) declares it
with an int attribute ``num_heads``; `attnlab.attention` refuses a call with another H
(`check_bias_heads`).
"""


def is_relative_bias(fn: object) -> bool:
    """True if a bias function declares ``fn.relative = True``.

    The declaration promises ``fn(b, h, i, j) == fn(0, h, i + d, j + d)`` for every batch index and
    integer shift ``d`` (also for positions outside ``[0, S)``): the value depends only on the head
    and on ``j − i``. Wrongly declared, the tiled backend computes a different bias.
    """
    return getattr(fn, "relative", False) is True


def check_bias_heads(fn: object, heads: int) -> None:
    """Raises if a bias function declaring ``fn.num_heads`` (an int) meets a call with other H.

    Without this, ``ALiBi(8)`` on a 4-head call would silently use the first 4 of the 8-head
    slopes (a different model), and on a 16-head call fail inside the function.
    """
    declared = getattr(fn, "num_heads", None)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared != heads:
        raise ValueError(
            f"{type(fn).__name__} was built with num_heads={declared}, but the attention call has "
            f"H={heads} query heads"
        )


def check_bias_output(
    fn: object, out: object, b: Tensor, h: Tensor, i: Tensor, j: Tensor
) -> Tensor:
    """What a bias function returned on ``(b, h, i, j)``: a float tensor of a broadcastable shape.

    For every place that evaluates a bias function (the whole grid here, a tile in the tiled
    backend): raises TypeError (not a float tensor) or ValueError (a shape that does not
    broadcast to the broadcast of the index shapes, or another device), naming the function and
    both shapes. Returns ``out`` unchanged.
    """
    return check_index_fn_output("bias function", fn, out, (b, h, i, j), want_bool=False)


@dataclass(frozen=True)
class LogitTerms:
    """A call's mask and bias sorted once by form (`sort_terms`): what masks the logits and
    what is added to them.

    Attributes:
        structured: the mask as a `Mask` (a bool mask tensor as a `TensorMask`), or None.
        bool_mask: the bool mask tensor as the caller gave it (True = may attend), or None.
        float_mask: an additive float mask tensor, broadcastable to ``(B, H, L, S)``, or None.
        bias_tensor: an additive bias tensor, broadcastable to ``(B, H, L, S)``, or None.
        bias_fn: a bias function ``fn(b, h, i, j)`` (`BiasFn`), or None.
    """

    structured: Mask | None = None
    bool_mask: Tensor | None = None
    float_mask: Tensor | None = None
    bias_tensor: Tensor | None = None
    bias_fn: BiasFn | None = None

    @property
    def given_mask(self) -> Mask | None:
        """The mask when the caller gave a `Mask` (not a bool tensor), else None."""
        return self.structured if self.bool_mask is None else None

    @property
    def additive(self) -> list[Tensor]:
        """The additive tensors, float mask first: ``s ← s + Σ additive``."""
        return [t for t in (self.float_mask, self.bias_tensor) if t is not None]


def sort_terms(mask: Mask | Tensor | None, bias: Tensor | BiasFn | None) -> LogitTerms:
    """The one place a mask and a bias are sorted by form: structured (a `Mask`, or a bool
    tensor wrapped as `TensorMask`), additive tensors (a float mask, a bias tensor) and a bias
    function."""
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        as4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, L|1, S|1)
        terms = LogitTerms(structured=TensorMask(as4), bool_mask=mask)
    elif isinstance(mask, Tensor):
        terms = LogitTerms(float_mask=mask)
    else:
        terms = LogitTerms(structured=mask)
    if isinstance(bias, Tensor):
        return replace(terms, bias_tensor=bias)
    return terms if bias is None else replace(terms, bias_fn=bias)


_UNSET = object()


@dataclass
class Request:
    """One validated attention call; q ``(B, H, L, D)``, k/v ``(B, H_kv, S, ·)`` (always 4-D).

    The logits are ``s = score(q, k) · logit_scale`` with ``logit_scale = scale / temperature``
    (resolved once, here), then the logit-transform stage (``softcap``:
    ``s ← softcap · tanh(s / softcap)``, `reference.softcap_logits`), then the bias and the
    mask (``terms``: sorted once by form, `sort_terms`); ``softcap`` is None for no transform.

    ``batch_shape`` is None for the caller's 3-D/4-D layouts; for SDPA's other layouts (2-D
    ``(L, D)`` or several leading batch dims, `validate.leading_to_4d`) it is the caller's
    ``(*batch, H)`` (``()`` for 2-D): q is ``(B, H, L, D)`` with ``B = prod(batch)`` and the
    caller gets ``out.reshape(*batch_shape, L, Dv)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    dims: Dims
    mask: Mask | Tensor | None
    bias: Tensor | BiasFn | None
    scale: float
    temperature: float
    score: str
    dropout_p: float
    return_weights: bool
    softcap: float | None = None
    batch_shape: tuple[int, ...] | None = None
    logit_scale: float = field(init=False, compare=False)
    terms: LogitTerms = field(init=False, compare=False)
    _keys: object = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.logit_scale = self.scale / self.temperature
        self.terms = sort_terms(self.mask, self.bias)
        self._keys = _UNSET  # `shared_keys`, computed on first use

    @property
    def is_empty(self) -> bool:
        """True when any of B, H, L, S is zero (handled by the reference path)."""
        d = self.dims
        return 0 in (d.B, d.H, d.L, d.S)

    @property
    def shared_keys(self) -> Tensor | None:
        """The keys every query row and head attends, when they are the same (`Mask.key_mask`).

        Bool ``(B|1, S)``, contiguous (True = may attend): one query row (decoding) under any
        mask with key intervals, or a mask over keys alone (padding) at any L. None with a bias
        or an additive float mask (their −inf entries could mask more), or when rows differ.
        Computed once per request (O(B·S) tensor ops, no host reads; a plain attribute, not
        ``functools.cached_property``, whose lock Dynamo cannot trace).
        """
        if self._keys is _UNSET:
            mask = self.terms.structured
            keep = None
            if mask is not None and self.bias is None and self.terms.float_mask is None:
                keep = mask.key_mask(self.dims.L, self.dims.S, device=self.q.device)
            self._keys = None if keep is None else keep.contiguous()
        return self._keys  # type: ignore[return-value]

    @property
    def is_plain_causal(self) -> bool:
        """A bare `causal()` mask with L == S, where bottom-right equals top-left alignment."""
        return isinstance(self.mask, CausalMask) and static_bool(self.dims.L == self.dims.S)


def logit_qk(req: Request) -> tuple[Tensor, Tensor, float]:
    """``(q', k', c)`` with ``score(q, k) · logit_scale = (q' · k'ᵀ) · c`` and ``c > 0``.

    q and k as the scores read them (`scores.Score.prepare`: cosine normalises their rows), and
    the sign of a negative logit scale folded into ``q' = −q`` (``scale·(q·k) =
    |scale|·((−q)·k)``, exact): a kernel that fills masked logits with −inf before it scales
    would turn them into +inf under a negative scale. Shapes as ``req.q``, ``req.k``.
    """
    q, k = req.q, req.k
    if req.score != "dot":
        s = get_score(req.score)
        q, k = s.prepare(q), s.prepare(k)
    if req.logit_scale < 0:
        return -q, k, -req.logit_scale
    return q, k, req.logit_scale


def _index_grid(B: int, H: int, L: int, S: int, device: torch.device) -> tuple[Tensor, ...]:
    return index_grid(B, H, L, S, device=device)  # i: aligned query positions


def materialize_bias(bias: BiasFn, dims: Dims, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Evaluates a function bias on the full grid: float, broadcastable to ``(B, H, L, S)``."""
    index = _index_grid(dims.B, dims.H, dims.L, dims.S, device)
    return check_bias_output(bias, bias(*index), *index).to(dtype)


def dense_mask_and_bias(
    mask: Mask | Tensor | None,
    bias: Tensor | BiasFn | None,
    dims: Dims,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """A mask as a bool tensor and the additive terms (float mask + bias) as one float tensor.

    Both are broadcastable to ``(B, H, L, S)``; either may be None.
    """
    return dense_terms(sort_terms(mask, bias), dims, dtype, device)


def dense_terms(
    terms: LogitTerms, dims: Dims, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """``(allowed, additive)`` of sorted terms: the structured mask rendered as a bool tensor
    (a bool tensor as given) and ``Σ terms.additive`` (+ the bias function on the full grid)."""
    allowed = terms.bool_mask
    if allowed is None and terms.structured is not None:
        allowed = terms.structured.to_dense(
            dims.L, dims.S, batch=dims.B, heads=dims.H, device=device
        )
    additive: Tensor | None = None
    for t in terms.additive:
        additive = t if additive is None else additive + t
    if terms.bias_fn is not None:
        bt = materialize_bias(terms.bias_fn, dims, dtype, device)
        additive = bt if additive is None else additive + bt
    return allowed, additive


def request_dense(req: Request) -> tuple[Tensor | None, Tensor | None]:
    """`dense_terms` of a request."""
    return dense_terms(req.terms, req.dims, req.q.dtype, req.q.device)


def request_interval(req: Request) -> tuple[Tensor | None, Tensor] | None:
    """Each row's keys as one interval (`Mask.key_interval`) when the request allows it.

    Only for a structured `Mask` without bias (a bias's −inf entries could mask more pairs);
    None otherwise (then the dense mask describes the attended pairs).
    """
    mask = req.terms.given_mask
    if mask is None or req.bias is not None:
        return None
    return mask.key_interval(req.dims.L, req.dims.S, device=req.q.device)


def key_prefixes(req: Request) -> tuple[int, ...] | None:
    """Per batch item b, the number ``n_b`` of leading keys that every query row attends.

    Known from Python ints alone for no mask (``n_b = S``), bottom-right `causal()` with one query
    row (it attends every key) and a padding mask built from a list of ints (``min(n_b, S)``);
    None for every other mask and whenever there is a bias (a −inf bias entry masks more). A
    backend can then run on views ``k[b, :, :n_b]`` with no mask at all.
    """
    d = req.dims
    if req.bias is not None:
        return None
    if req.mask is None or (isinstance(req.mask, CausalMask) and d.L == 1):
        return (d.S,) * d.B
    lengths = req.mask.py_lengths if isinstance(req.mask, PaddingMask) else None
    if lengths is None:
        return None
    return tuple(min(d.S, lengths[b] if len(lengths) > 1 else lengths[0]) for b in range(d.B))


def prefix_views(
    req: Request, prefixes: tuple[int, ...]
) -> list[tuple[Tensor, Tensor, Tensor] | None]:
    """The unmasked sub-calls of a request whose rows attend key prefixes (`key_prefixes`).

    One ``(q, k, v)`` for the whole batch when every ``n_b = S``; otherwise per batch item b the
    views ``(q[b:b+1], k[b:b+1, :, :n_b], v[b:b+1, :, :n_b])``, or None where ``n_b = 0`` (the
    item attends nothing). No copies.
    """
    q, k, v = req.q, req.k, req.v
    if all(n == req.dims.S for n in prefixes):
        return [(q, k, v)]
    return [
        None if n == 0 else (q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        for b, n in enumerate(prefixes)
    ]


# ---------------------------------------------------------------- building it
def _unit_stride_last(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def check_softcap(softcap: object, dtype: torch.dtype) -> float | None:
    """``softcap``: None, or a finite real number > 0 that stays a normal number in the logits'
    compute dtype (float32 for float32/float16/bfloat16 inputs, float64 for float64).

    ``softcap · tanh(s / softcap)`` with a cap that rounds to 0 (or a subnormal) in the compute
    dtype would divide by zero, and one that rounds to inf would give ``inf · 0``: both are
    refused before any work.

    Raises:
        TypeError: a bool, or anything but an int/float (e.g. a tensor), naming ``softcap``.
        ValueError: NaN, ±inf, a value <= 0, or outside the compute dtype's normal range.
    """
    if softcap is None:
        return None
    cap = check_number("softcap", softcap, positive=True)
    if torch.compiler.is_compiling():
        return cap  # may be symbolic (torch.compile(dynamic=True)): checked in eager calls only
    compute = stat_dtype(dtype)
    info = torch.finfo(compute)
    if not info.tiny <= cap <= info.max:
        raise ValueError(
            f"softcap must lie in [{info.tiny:.3g}, {info.max:.3g}] for {dtype} inputs (a normal "
            f"{compute} number: the logits are capped in {compute}), got {softcap!r}"
        )
    return cap


def build_request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None,
    bias: Tensor | BiasFn | None,
    scale: float | None,
    temperature: float,
    score: str,
    dropout_p: float,
    return_weights: bool,
    softcap: float | None = None,
    leading: bool = False,
) -> Request:
    """Validates every argument (before any computation) and returns the 4-D request.

    With ``leading=True`` (the entry points that restore the caller's layout on their outputs:
    `attention`, `attention_weights`, `attention_stats`, `explain`) q/k/v may also be 2-D or
    have several leading batch dims (`leading_to_4d`); ``Request.batch_shape`` records the
    caller's ``(*batch, H)``. Otherwise only 3-D and 4-D inputs are accepted.
    """
    lead = leading_to_4d(q, k, v) if leading else None
    dims, q, k, v = _qkv_dims(q, k, v, lead, mask, bias)
    s = get_score(score)
    temperature = check_number("temperature", temperature, positive=True)
    cap = check_softcap(softcap, q.dtype)
    dropout_p = check_probability("dropout_p", dropout_p)
    scale = s.default_scale(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    check_logit_multiplier(scale, temperature, q.dtype)
    check_bool("return_weights", return_weights)
    if lead is not None:
        mask = extra_to_4d(mask, lead.target, lead.B) if isinstance(mask, Tensor) else mask
        bias = extra_to_4d(bias, lead.target, lead.B) if isinstance(bias, Tensor) else bias
    _check_mask_bias(mask, bias, q, dims)
    # A last dim that is not unit-stride (column-major, channels-last-like) is copied once, so
    # every backend reads rows the same way as for the contiguous call (bit-equal results, B5).
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    if dims.three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L|S, D)
        mask, bias = _head_dim(mask), _head_dim(bias)
    return Request(
        q=q,
        k=k,
        v=v,
        dims=dims,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        dropout_p=dropout_p,
        return_weights=return_weights,
        softcap=cap,
        batch_shape=None if lead is None else lead.batch_shape,
    )


def _qkv_dims(
    q: Tensor, k: Tensor, v: Tensor, lead: Leading | None, mask: object, bias: object
) -> tuple[Dims, Tensor, Tensor, Tensor]:
    """``(dims, q, k, v)``: the checked sizes of a call, with q ``(B, H, L, D)``, k
    ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)`` taken from ``lead`` (`leading_to_4d`'s result
    for SDPA's other layouts, whose mask/bias tensors are checked against its target shape)
    when it is not None. A shape error then names the caller's shapes."""
    if lead is None:
        return check_qkv(q, k, v), q, k, v
    for name, t in (("mask", mask), ("bias", bias)):
        if isinstance(t, Tensor):
            check_extra(name, t, lead.target)
    try:
        return check_qkv(lead.q, lead.k, lead.v), lead.q, lead.k, lead.v
    except ValueError as e:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"{e} (inputs of shapes {shapes} read as (B, H, L|S, D))") from None


def _check_mask_bias(
    mask: Mask | Tensor | None, bias: Tensor | BiasFn | None, q: Tensor, dims: Dims
) -> None:
    """Raises unless ``mask`` is None, a `Mask` or a bool/float tensor and ``bias`` None, a
    float tensor or a callable, the tensors broadcastable to ``(B, H, L, S)`` on q's device and
    a bias function built for ``dims.H`` heads (`check_bias_heads`)."""
    if isinstance(mask, Tensor):
        check_mask_tensor("mask", mask, q.dtype, dims)
        check_same_device("mask", mask, q)
    elif mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be an attnlab Mask, a bool tensor or an additive float tensor, got "
            f"{type(mask).__name__}"
        )
    if isinstance(bias, Tensor):
        if not bias.is_floating_point():
            raise TypeError(
                f"bias must be a float tensor of the query dtype {q.dtype}, got {bias.dtype}"
            )
        check_mask_tensor("bias", bias, q.dtype, dims)
        check_same_device("bias", bias, q)
    elif bias is not None and not callable(bias):
        raise TypeError(
            f"bias must be a float tensor or a callable fn(b, h, i, j), got {type(bias).__name__}"
        )
    elif bias is not None:
        check_bias_heads(bias, dims.H)
    if isinstance(mask, Mask):
        # Renders nothing; checks that a batch- or head-dependent mask fits this call.
        mask.batch_heads(dims.B, dims.H)
        for what, t in mask.data_tensors():
            check_same_device(f"mask {what}", t, q)


def _head_dim(t: _T) -> _T:
    """A 3-D mask/bias tensor ``(B|1, L|1, S|1)`` of a 3-D call as ``(B|1, 1, L|1, S|1)``; any
    other argument unchanged."""
    if isinstance(t, Tensor) and t.dim() == 3:
        return t.unsqueeze(1)  # type: ignore[return-value]
    return t


def trusted_request(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0) -> Request:
    """The request of ``attention(q, k, v, dropout_p=dropout_p)`` (4-D, no mask, no bias, the
    default scale) WITHOUT its checks, for callers whose q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``
    and v ``(B, H_kv, S, Dv)`` are consistent by construction — `MultiHeadAttention`'s own
    projections — and whose ``dropout_p`` is already validated. Anything else goes through
    `build_request`, which raises on bad arguments.
    """
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    return Request(
        q=_unit_stride_last(q),
        k=_unit_stride_last(k),
        v=_unit_stride_last(v),
        dims=Dims(B=B, H=H, H_kv=H_kv, L=L, S=S, D=D, Dv=Dv, three_d=False),
        mask=None,
        bias=None,
        scale=get_score("dot").default_scale(D),
        temperature=1.0,
        score="dot",
        dropout_p=dropout_p,
        return_weights=False,
        softcap=None,
    )


def plain_request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None,
    bias: Tensor | BiasFn | None,
    scale: float | None,
    temperature: float,
    score: str,
    softcap: float | None = None,
    leading: bool = False,
) -> Request:
    """`build_request` without dropout or weights: the entry points that only need the logits."""
    return build_request(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        dropout_p=0.0,
        return_weights=False,
        softcap=softcap,
        leading=leading,
    )
