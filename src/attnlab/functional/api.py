"""The entry points: `attention` validates, picks a backend and runs it; `explain` says which
and why; `flash_attention` runs the tiled backend with its knobs; `attention_weights` and
`attention_stats` read rows of the weights from a log-sum-exp."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _ext
from .._shapes import check_bool
from ..masks import Mask
from . import backends as _backends  # noqa: F401  (fills the registry)
from . import nan_rule, reference
from .decode import decode_run_sinks
from .explanation import Explanation, describe_term
from .flash import flash_job
from .flash.run import (
    band_kernel_covers,
    flash_run_lse,
    flash_supports,
    kernel_checks_inputs,
    needs_grad,
)
from .flash.sinks import flash_run_sinks, fused_sinks
from .registry import check_backend_name, select
from .request import BiasFn, Request, build_request, plain_request, request_dense
from .sinks import apply_sinks, check_sinks
from .stats import AttentionStats, as_index, compute_stats, compute_weights
from .thresholds import describe as describe_thresholds

#: torch SDPA's keywords that attnlab spells differently, and what attnlab says instead.
_SDPA_KEYWORDS = {
    "attn_mask": (
        "attnlab's is mask= (the same meaning: a bool tensor, True = may attend, or an additive "
        "float tensor; or an attnlab.masks Mask)"
    ),
    "is_causal": (
        "attnlab's is mask=attnlab.masks.causal() (or no mask for is_causal=False), which is "
        "bottom-right aligned when L != S (query i sees keys j <= i + S - L, as KV-cache "
        "decoding needs) where SDPA's is_causal is top-left (query i sees keys j <= i); for "
        "SDPA's alignment pass mask=torch.ones(L, S, dtype=torch.bool).tril()"
    ),
    "enable_gqa": (
        "attnlab has none: grouped-query attention is on whenever k and v have H_kv heads with "
        "H % H_kv == 0"
    ),
}


def _refuse_keywords(fn: str, keywords: dict[str, object]) -> None:
    """A one-line TypeError for ``fn``'s unknown ``keywords`` (if any); SDPA's get attnlab's
    spelling."""
    if not keywords:
        return
    name = next((n for n in keywords if n in _SDPA_KEYWORDS), next(iter(keywords)))
    if name not in _SDPA_KEYWORDS:
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
    value = keywords[name]
    got = (
        f"<{value.dtype} tensor of shape {tuple(value.shape)}>"
        if isinstance(value, Tensor)
        else " ".join(repr(value).split())[:40]
    )
    raise TypeError(f"{fn}() got torch SDPA's keyword {name}={got}; {_SDPA_KEYWORDS[name]}")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    **sdpa_keywords: object,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Attention as the textbooks define it: ``softmax(score(Q, K) · scale / T + bias) V``.

    With logit soft-capping: ``softmax(c · tanh(score(Q, K) · scale / T / c) + bias) V``,
    ``c = softcap`` — the cap acts on the scaled scores BEFORE the bias and the mask are added
    (Gemma 2; transformers' gemma2 ``eager_attention_forward`` caps ``q·kᵀ·scaling`` and then
    adds its additive causal/padding mask; flash-attn's ``softcap`` likewise).

    Defined to equal `attnlab.functional.reference.attention`; every backend agrees with it under
    the tolerance rule.

    Args:
        q: queries ``(B, H, L, D)``, or ``(B, L, D)`` for a single head. Also torch SDPA's other
            layouts: ``(L, D)`` (no batch), or ``(*batch, H, L, D)`` with any number of leading
            batch dims, e.g. ``(2, 3, 1, 16, 16)``: run as ``B = prod(batch)`` (the inputs'
            reshapes to 4-D are views whenever their batch dims can be merged) and returned
            in the caller's layout. q, k and v then share the rank and the batch dims (they are
            not broadcast against each other: expand them).
        k: keys ``(B, H_kv, S, D)`` (``(S, D)``, ``(*batch, H_kv, S, D)``); ``H % H_kv == 0``
            gives grouped-query / multi-query attention (k and v are shared by ``G = H / H_kv``
            consecutive query heads, not copied).
        v: values ``(B, H_kv, S, Dv)`` (``(S, Dv)``, ``(*batch, H_kv, S, Dv)``); ``Dv`` may
            differ from ``D``.
        mask: an `attnlab.masks.Mask`, a bool tensor (True = may attend) or an additive float
            tensor, broadcastable to ``(B, H, L, S)`` (``(L, S)``, ``(*batch, H, L, S)``: torch's
            broadcasting rules) and on q's device. Masks align bottom-right when L != S. With
            several batch dims, a batch- or head-dependent `Mask` and a bias function see the
            flattened batch index ``b`` in ``[0, prod(batch))``.
        bias: additive float tensor broadcastable like ``mask``, on q's device, or
            ``fn(b, h, i, j)`` returning a float tensor that broadcasts to the index grid it is
            given; a function with an int ``num_heads`` attribute (ALiBi, T5) must match H.
        scale: logit scale; default ``1/√D`` for ``score="dot"`` and 1 for ``"cosine"``.
        temperature: divides the logits (T → ∞: uniform weights; T → 0: one-hot). The
            multiplier ``scale / temperature`` must be non-zero and at most ``2**64`` (≈1.8e19)
            in magnitude for float32/float16/bfloat16 inputs, ``2**512`` (≈1.3e154) for float64,
            so the logits stay finite in the compute dtype for any ``|q·k|`` below the same bound;
            beyond it the call raises ValueError (inside it, a tiny temperature gives the
            one-hot limit). Gradients lose precision as ``|logits|·eps`` grows, as for any
            softmax in that dtype.
        score: ``"dot"`` (q·k) or ``"cosine"`` (cos(q, k)); see `functional.request.SCORES`.
        dropout_p: dropout on the weights, in [0, 1).
        backend: ``"auto"``, ``"sdpa"``, ``"reference"`` or another name in `attnlab.backends()`.
        return_weights: also return the weights ``(B, H, L, S)`` (computed by the reference;
            ``(..., L, S)`` in the layout of q).
        return_lse: also return the log-sum-exp of each query row's logits ``(B, H, L)``
            (``(..., L)`` in the layout of q), float32
            (float64 for float64 inputs), −inf for rows with no key. Backends that cannot compute
            it are skipped by ``backend="auto"``. With it, `attention_weights` recomputes any
            rows' weights exactly without the L×S matrix.
        softcap: logit soft-capping ``c > 0`` (a finite float; None = no cap): every logit
            becomes ``c · tanh(s / c)``, so ``|s| ≤ c`` before the bias. Runs on ``"flash"``
            (per tile, forward and backward, on its pure-PyTorch engine), ``"decode"`` and
            ``"reference"``; ``"sdpa"`` declines it (torch's fused kernel has no tanh stage) and
            ``backend="auto"`` picks another backend; ``lse``, weights and `attention_stats`
            are those of the capped logits.
        sinks: attention sinks (GPT-OSS), a float tensor ``(H,)`` (``(1,)`` for 3-D and 2-D
            inputs) on q's device, or None: one logit ``s_h`` per query head, in logit units
            (after the scale), that joins every row's softmax denominator,
            ``out_i = Σ_j e^{l_ij} v_j / (e^{s_h} + Σ_j e^{l_ij})``. Folded into the C++
            kernels' row normalisation where they write every row (flash, the decode step:
            `attnlab.functional.flash.sinks`), else computed exactly from the plain output and
            its log-sum-exp (`attnlab.functional.sinks`; backends without lse, such as
            ``"sdpa"``, are skipped), differentiable in q, k, v and the sinks; ``lse``
            and the weights include the sink (a row's weights sum to ``1 − e^{s_h − lse_i}``).
            A row with no key stays 0 (its lse is ``s_h``); a NaN or +inf sink makes every row
            of its head that has a key NaN, a −inf sink is no sink.
        **sdpa_keywords: none is accepted. torch SDPA's ``attn_mask=``, ``is_causal=`` and
            ``enable_gqa=`` raise a one-line TypeError naming attnlab's spelling (``mask=``;
            ``mask=masks.causal()``, bottom-right aligned where SDPA's ``is_causal`` is top-left
            when L != S; none: grouped-query attention follows the shapes); any other keyword
            raises Python's "unexpected keyword argument" TypeError.

    Returns:
        ``out (B, H, L, Dv)`` in the layout of q (3-D in, 3-D out; ``(L, D)`` in, ``(L, Dv)``
        out; ``(*batch, H, L, D)`` in, ``(*batch, H, L, Dv)`` out, a view of the 4-D result), or
        ``(out, weights)``, ``(out, lse)`` or ``(out, weights, lse)``. A query row with no key
        to attend outputs zeros, with zero weights and zero gradients.

    The NaN rule (every backend; `functional.nan_rule`): row i depends only on ``q_i`` and the
    keys/values it may attend. A non-finite ``q_i`` or attended ``k_j`` (or a NaN/+inf attended
    bias entry) makes row i NaN (and ``lse_i``); a non-finite attended ``v_j[d]`` makes only
    ``out[i, d]`` NaN; non-finite values elsewhere never reach row i. Gradients are those of the
    computation with non-finite inputs read as 0. No host synchronisation: the call traces under
    ``torch.compile(fullgraph=True)`` and runs on ``meta`` tensors.

    Memory layout never changes the result: q, k, v in any strided layout (transposed,
    channels-last-like, stride-0 expanded, a sliced last dim; a last dim that is not unit-stride
    is copied once) and any dout layout give the output and gradients of the call on contiguous
    copies, bit-equal on every backend for float32/float16/bfloat16 and on ``"flash"`` for
    float64; in float64 ``"reference"`` (with a dout whose last dim is not unit-stride) and
    ``"sdpa"`` (sliced or mixed layouts) may differ by a few ulp. ``.grad`` of a dense leaf
    keeps the leaf's strides.

    Raises:
        TypeError: an unknown keyword (SDPA's named with attnlab's spelling), non-tensor inputs,
            mixed or non-float dtypes, bad mask/bias dtype, a mask or bias function returning a
            non-bool / non-float result.
        ValueError: shape mismatches (a rank below 2, ranks or batch dims that differ between
            q, k and v, a mask/bias that does not broadcast), a mask/bias tensor on another
            device than q, a mask or bias function result that does not broadcast to its index
            grid, bad scale/temperature/dropout_p, an overflowing ``scale / temperature``, a
            function bias built for another head count, unknown score or backend, a ``softcap``
            that is not a finite number > 0 (TypeError for a bool or non-number), a backend
            that cannot run the call (``backend="sdpa"`` with ``softcap``).

    Example:
        >>> import torch, attnlab
        >>> q = k = v = torch.randn(2, 4, 16, 8)
        >>> attnlab.attention(q, k, v, mask=attnlab.masks.causal()).shape
        torch.Size([2, 4, 16, 8])
    """
    _refuse_keywords("attention", sdpa_keywords)
    req = build_request(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        dropout_p=dropout_p,
        return_weights=return_weights,
        softcap=softcap,
        leading=True,
    )
    check_backend_name(backend)
    check_bool("return_lse", return_lse)
    if sinks is not None:
        check_sinks(sinks, req.dims.H, q)
    out, weights, lse = _run(backend, req, return_lse, sinks)
    if req.dims.three_d:
        out = out.squeeze(1)  # (B, L, Dv)
        weights = None if weights is None else weights.squeeze(1)  # (B, L, S)
        lse = None if lse is None else lse.squeeze(1)  # (B, L)
    elif req.batch_shape is not None:  # the caller's (L, ·) or (*batch, H, L, ·)
        d, lead = req.dims, req.batch_shape
        out = out.reshape(*lead, d.L, d.Dv)  # splits B: a view
        weights = None if weights is None else weights.reshape(*lead, d.L, d.S)
        lse = None if lse is None else lse.reshape(*lead, d.L)
    if return_weights and return_lse:
        assert weights is not None and lse is not None
        return out, weights, lse
    if return_weights:
        assert weights is not None
        return out, weights
    if return_lse:
        assert lse is not None
        return out, lse
    return out


def _run(
    backend: str, req: Request, return_lse: bool, sinks: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(out, weights, lse)`` of a checked request on the selected backend (lse None unless
    asked for), the sinks applied from the plain output and its lse (`functional.sinks`)."""
    chosen, _ = select(backend, req, need_lse=return_lse or sinks is not None)
    if sinks is not None and chosen.name == "flash" and fused_sinks(chosen, req):
        out, lse = flash_run_sinks(req, sinks)  # eager: backward on the fused kernels
        return out, None, lse
    if sinks is not None and chosen.name == "decode" and not return_lse:
        step = decode_run_sinks(req, sinks)  # the C++ step, the sinks in its denominators
        if step is not None:
            return step, None, None
    if not return_lse and sinks is None:
        out, weights = chosen.run(req)
        return out, weights, None
    assert chosen.run_lse is not None
    out, weights, lse = chosen.run_lse(req)
    if sinks is not None:
        out, lse, weights = apply_sinks(out, lse, sinks, weights)
    return out, weights, lse


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Explanation:
    """Which backend ``attention(q, k, v, **kwargs)`` would run, why, and on which engines.

    Names the engine of each part of the plan: attnlab's C++ kernels with the vector path they
    were built for (AVX-512, AVX2), torch's kernels, or plain PyTorch ops; and the state of the
    C++ kernels the call asks for (loaded, built, not built yet, unavailable and why:
    `attnlab._ext.describe_kernels`). It never builds a kernel (`attnlab._ext.reporting`): for
    an unbuilt one it describes the call without it and says that the first call builds it.
    With ``backend="auto"`` it also says where auto's size thresholds for q's dtype come from
    (the built-in defaults, or the cache file measured on this CPU at a date:
    `attnlab.functional.thresholds`).

    Args:
        q, k, v: as in `attention`.
        **kwargs: `attention`'s keyword arguments (``mask``, ``bias``, ``backend``, ...).

    Returns:
        An `Explanation`: ``print()`` it for a short paragraph; its fields (``.backend``,
        ``.reason``, ``.plan``, ``.engines``, ...) hold the same facts.

    Raises:
        TypeError: a keyword `attention` does not take.
        ValueError: as `attention` (bad inputs, or a named backend that cannot run the call).
    """
    backend = kwargs.pop("backend", "auto")
    defaults = {
        "mask": None,
        "bias": None,
        "scale": None,
        "temperature": 1.0,
        "score": "dot",
        "dropout_p": 0.0,
        "return_weights": False,
        "softcap": None,
    }
    sinks = kwargs.pop("sinks", None)
    return_lse = bool(kwargs.pop("return_lse", False)) or sinks is not None  # sinks need lse
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}")
    with _ext.reporting() as asked:
        kw = {**defaults, **kwargs}
        req = build_request(q, k, v, leading=True, **kw)  # type: ignore[arg-type]
        check_backend_name(backend)
        if sinks is not None:
            check_sinks(sinks, req.dims.H, q)
        chosen, why = select(backend, req, need_lse=return_lse)  # type: ignore[arg-type]
        plan = None
        if chosen.name == "flash":
            plan, engines = explain_plan(req)
        else:
            engines = (_engine(chosen.name, req, return_lse),)
    mask, bias = kw["mask"], kw["bias"]
    return Explanation(
        backend=chosen.name,
        requested=str(backend),
        reason=why,
        plan=plan,
        engines=engines,
        kernels=_ext.describe_kernels(asked),
        thresholds=describe_thresholds(req.q.dtype) if backend == "auto" else None,
        dtype=q.dtype,
        shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape)),
        mask="none" if mask is None else describe_term(mask),
        bias=None if bias is None else describe_term(bias),
    )


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    block_q: int | None = None,
    block_k: int | None = None,
    band_block: int | None = None,
    engine: str | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Tiled exact attention with its log-sum-exp: ``softmax(cap(q·kᵀ·scale/T) + bias) v``, ``lse``.

    ``cap(s) = softcap · tanh(s / softcap)`` when ``softcap`` is given (else the identity),
    applied to every tile's logits before the bias and the mask, in forward and backward.

    Defined to equal `reference.attention` and `reference.logsumexp`; see `attnlab.attention` for
    the meaning of mask, bias, scale, temperature and score (bottom-right aligned masks, True =
    may attend, ``bias(b, h, i, j)`` with i the aligned query position).

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        mask, bias, scale, temperature, score: as in `attnlab.attention`.
        block_q, block_k: tile size of the block map (default 128 × 128, 256 × 256 with a bias;
            2048 × 2048 in float64, where tiles favour the reference's summation order).
        band_block: query block of batched band (sliding-window) calls (default 32 in forward,
            64 in backward: each kernel's fastest).
        engine: ``"kernel"`` (torch's CPU flash kernel, the default on CPU below float64) or
            ``"torch"`` (pure-PyTorch online softmax: the default for float64, off CPU and with
            ``softcap``, which the kernel cannot apply).
        softcap: logit soft-capping (> 0), or None; see `attnlab.attention`.

    Returns:
        ``(out (B, H, L, Dv), lse (B, H, L))``; lse is float32 (float64 for float64 inputs) and
        −inf for a query row with no key to attend (whose output row is 0).

    Raises:
        ValueError/TypeError: as `attnlab.attention`, plus bad block sizes or engine; flash
            cannot run dropout, return weights, or differentiate a bias.
    """
    if q.dim() != 4:
        raise ValueError(f"flash_attention expects 4-D q (B, H, L, D), got shape {tuple(q.shape)}")
    req = plain_request(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        softcap=softcap,
    )
    why_not = flash_supports(req)
    if why_not is not None:
        raise ValueError(f"flash_attention cannot run this call: {why_not}")
    if req.is_empty:
        dm, db = request_dense(req)
        logits = {"mask": dm, "bias": db, "scale": req.logit_scale, "temperature": 1.0}
        logits["softcap"] = req.softcap
        out, _ = reference.attention(q, k, v, **logits, score=req.score)
        lse = reference.logsumexp(q, k, **logits, score=req.score)
        return out, lse
    chosen, _ = select("flash", req, need_lse=True)
    if chosen.traced is None:  # traced, or on meta tensors: the operators (no tiling knobs)
        assert chosen.run_lse is not None
        out, _, lse = chosen.run_lse(req)
        return out, lse
    knobs = {"block_q": block_q, "block_k": block_k, "band_block": band_block, "engine": engine}
    return flash_run_lse(req, **knobs)


def explain_plan(req: Request) -> tuple[str, tuple[str, ...]]:
    """How flash would tile a request and which engine runs each part (for `explain`):
    ``(plan, engines)``, the plan in words and the engines of its forward (and backward, when
    an input needs a gradient) and of how the NaN rule finds non-finite inputs."""
    job = flash_job(req)
    text = job.plan.describe()
    if job.softcap is not None:
        where = (
            "attnlab's C++ kernels" if job.engine == "kernel" else "the pure-PyTorch tile engine"
        )
        text += f", soft-capped logits on {where}"
    grad = any(needs_grad(x) for x in (req.q, req.k, req.v))
    engines = job.engines(req.q, req.k, req.v, grad=grad)
    if kernel_checks_inputs(req) and band_kernel_covers(job, req.q, req.k, req.v):
        engines.append("NaN/inf check: inside attnlab's band kernel, as it reads q, k, v")
    elif nan_rule.flash_ext_ready(req.q):
        engines.append("NaN/inf scan of q, k, v: attnlab's C++ scan (a copy only if one is found)")
    else:
        engines.append("NaN/inf handling: PyTorch ops (a cleaned copy of q, k, v)")
    return text, tuple(engines)


def _engine(name: str, req: Request, want_lse: bool) -> str:
    """The engine of a backend other than flash, in words (for `explain`)."""
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (req.q, req.k, req.v))
    ours = not grad and nan_rule.ext_ready(req.q, req.k, req.v)
    if name == "sdpa":
        rule = "attnlab's C++ operators where they apply" if ours else "PyTorch ops"
        return (
            f"torch's scaled_dot_product_attention (its {torch.backends.cpu.get_cpu_capability()} "
            f"CPU build); the NaN rule's passes: {rule}"
        )
    if name == "decode":
        if ours and not want_lse:
            return "attnlab's C++ decode kernel (one pass per key/value head)"
        return "PyTorch tensor ops"
    return "plain PyTorch ops"


def _check_lse(lse: object, q: Tensor, req: Request) -> Tensor:
    """``lse`` in the layout of q (``(B, H, L)``, ``(B, L)``, ``(L,)``, ``(*batch, H, L)``)
    as ``(B, H, L)``."""
    dims, lead = req.dims, req.batch_shape
    if not isinstance(lse, Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lead is not None:
        want, letters = (*lead, dims.L), "(L,)" if not lead else "(..., H, L)"
    elif dims.three_d:
        want, letters = (dims.B, dims.L), "(B, L)"
    else:
        want, letters = (dims.B, dims.H, dims.L), "(B, H, L)"
    if tuple(lse.shape) != want:
        raise ValueError(
            f"lse must have shape {letters} = {want} for query {tuple(q.shape)}, got "
            f"{tuple(lse.shape)}"
        )
    if not lse.is_floating_point():
        raise TypeError(f"lse must be a float tensor, got {lse.dtype}")
    if lead is not None:
        return lse.reshape(dims.B, dims.H, dims.L)
    return lse.unsqueeze(1) if dims.three_d else lse  # (B, H, L)


def attention_weights(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    rows: int | Sequence[int] | Tensor | slice | None = None,
    heads: int | Sequence[int] | Tensor | slice | None = None,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    softcap: float | None = None,
) -> Tensor:
    """Exact attention weights of chosen query rows and heads, from the log-sum-exp.

    ``p_ij = exp(s_ij − lse_i)`` with ``s`` the scaled (soft-capped), biased, masked logits of
    `attention` — so only ``len(heads) × len(rows) × S`` values are formed, never the L×S matrix.
    Pass the same mask/bias/scale/temperature/score/softcap as the call that produced ``lse``.

    Args:
        q: ``(B, H, L, D)`` (or ``(B, L, D)``, ``(L, D)``, ``(*batch, H, L, D)`` as in
            `attention`). k: ``(B, H_kv, S, D)`` (or the matching layout).
        lse: ``(B, H, L)`` (or ``(B, L)``, ``(L,)``, ``(*batch, H, L)``) from
            ``attention(..., return_lse=True)``.
        rows: query rows (ints, a slice or a tensor); default all.
        heads: query heads; default all (ignored for 3-D and 2-D inputs).
        mask, bias, scale, temperature, score, softcap: as in `attention`.

    Returns:
        ``(B, len(heads), len(rows), S)`` (3-D in: ``(B, len(rows), S)``; 2-D in:
        ``(len(rows), S)``; ``(*batch, H, L, D)`` in: ``(*batch, len(heads), len(rows), S)``)
        in q's dtype; equal to
        ``attention(..., return_weights=True)[1][:, heads][:, :, rows]``. Masked pairs and rows
        with no key are exactly 0. The NaN rule: a NaN/±inf logit on a pair row i may attend
        (from q_i, k_j or the bias), or a NaN/+inf lse_i, makes row i's weights NaN; non-finite
        values on pairs it may not attend never reach it.

    Raises:
        ValueError: lse of the wrong shape, rows/heads out of range, and as `attention`.
        TypeError: as `attention`.
    """
    req = plain_request(
        q,
        k,
        k,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        softcap=softcap,
        leading=True,
    )
    d, lead = req.dims, req.batch_shape
    lse4 = _check_lse(lse, q, req)
    row_idx = as_index("rows", rows, d.L, q.device)
    one_head = d.three_d or lead == ()
    head_idx = as_index("heads", None if one_head else heads, d.H, q.device)
    with torch.no_grad():
        w = compute_weights(req, lse4, row_idx, head_idx)  # (B, nh, nr, S)
    if lead:
        return w.reshape(*lead[:-1], *w.shape[1:])  # (*batch, nh, nr, S)
    return w.squeeze(1) if d.three_d else w[0, 0] if lead == () else w


def attention_stats(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    lse: Tensor | None = None,
    softcap: float | None = None,
) -> AttentionStats:
    """Per-head, per-query statistics of the attention weights, without the L×S matrix.

    Computes the log-sum-exp with the tiled backend (unless ``lse`` is given), then streams over
    the same non-empty tiles once, accumulating for every query row i:
    entropy ``−Σ_j p_ij log p_ij``, the max weight, the attention-sink mass ``p_i0`` and the mean
    attention distance ``Σ_j p_ij |i' − j|`` (``i' = i + S − L``). Memory is O(B·H·L) plus one
    tile, so it runs at sequence lengths where the weights could never be stored.

    Args:
        q, k, v: as in `attention` (v is only used to compute lse when it is not given).
        mask, bias, scale, temperature, score, softcap: as in `attention`.
        lse: the log-sum-exp from ``attention(..., return_lse=True)``, to skip recomputing it.

    Returns:
        `AttentionStats` of ``(B, H, L)`` tensors (``(B, L)`` for 3-D inputs; ``(L,)``,
        ``(*batch, H, L)`` for those layouts) in float32
        (float64 for float64 inputs); rows with no key have every statistic 0. The NaN rule: a
        non-finite logit on a pair row i may attend, or a NaN/+inf lse_i, makes row i's
        statistics NaN; non-finite keys it may not attend never reach it.

    Raises:
        ValueError, TypeError: as `attention`.
    """
    req = plain_request(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        softcap=softcap,
        leading=True,
    )
    d = req.dims
    with torch.no_grad():
        if lse is None:
            chosen, _ = select("auto", req, need_lse=True)
            assert chosen.run_lse is not None
            lse4 = chosen.run_lse(req)[2]
        else:
            lse4 = _check_lse(lse, q, req)
        if req.is_empty:
            z = torch.zeros(d.B, d.H, d.L, dtype=lse4.dtype, device=q.device)
            st = AttentionStats(z, z.clone(), z.clone(), z.clone(), lse4)
        else:
            st = compute_stats(req, lse4)
    if d.three_d:
        st = AttentionStats(**{name: t.squeeze(1) for name, t in st.as_dict().items()})
    elif req.batch_shape is not None:
        lead = req.batch_shape
        st = AttentionStats(**{n: t.reshape(*lead, d.L) for n, t in st.as_dict().items()})
    return st
