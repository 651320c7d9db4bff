"""The tiled backend as ``torch.library`` custom operators, for ``torch.compile`` and export.

Under ``torch.compile`` the flash backend cannot be traced line by line: its tiling plan is built
in Python from the mask's block map (values read on the host). So compiled code calls three
opaque operators instead — ``attnlab::flash_fwd``, ``attnlab::flash_bwd`` (its registered
gradient) and ``attnlab::flash_rule`` (which entries the NaN rule poisons) — each of which
rebuilds the request from tensors plus the mask's structure string (`Mask.spec`) and runs the
same eager code as the tiled backend. Plans are built when the graph RUNS, from the tensors it is
given, so masks holding tensors (padding lengths, document ids, bool tensors) stay correct from
call to call. Supported under compile: masks with a `Mask.spec` (every built-in mask, not
`from_fn`), bool/float mask tensors and bias tensors without gradient, and relative bias
functions (``fn.relative = True``: ALiBi, T5) whose values need no gradient — the graph evaluates
one such function once per offset ``d = j − i`` into a table ``(H, L + S − 1)`` (`offset_table`)
and the operators read it back as the same function (`OffsetTable`): O(H·(L + S)), never the
``(H, L, S)`` bias. Other bias functions and `from_fn` masks run on sdpa (`flash_supports` says
so).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._shapes import Dims, stat_dtype
from ...masks import Mask, from_spec
from .. import nan_rule
from ..request import BiasFn, Request, check_bias_output, logit_qk
from .eager import flash_run_marked
from .engines import Residuals
from .plan import flash_job, prepare_inputs


class OffsetTable:
    """A relative bias function read from its values per offset: ``bias(b, h, i, j) =
    table[h, j − i + S − 1]``, ``table (H, L + S − 1)`` over ``d = j − i ∈ [−(S − 1), L − 1]``
    (``i`` the query position aligned to the keys; `offset_table` makes it).

    Positions outside the grid (a tile's padding) read the nearest end of the table: they are
    masked or dropped by the tiled backend, which evaluates relative biases once per offset.
    """

    relative = True

    def __init__(self, table: Tensor, S: int) -> None:
        self.table, self.S = table, S

    def __call__(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:  # noqa: ARG002 (a bias function is fn(b, h, i, j))
        d = (j - i + (self.S - 1)).clamp(0, self.table.shape[-1] - 1)  # (…, Lt, St)
        return self.table[h, d]  # (1|B, H, Lt, St)


def offset_table(fn: BiasFn, H: int, L: int, S: int, device: torch.device) -> Tensor:
    """``(H, L + S − 1)``: a relative bias function (``fn.relative = True``) at every offset
    ``d = j − i`` of an ``L × S`` call, ``table[h, d + S − 1] = fn(0, h, 0, d)`` — one call of
    ``fn`` on O(H·(L + S)) indices, in the graph (gradients flow as through ``fn``)."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    d = torch.arange(-(S - 1), L, device=device).view(1, 1, 1, -1)
    out = check_bias_output(fn, fn(zero, h, zero, d), zero, h, zero, d)
    return out.expand(1, H, 1, d.shape[-1]).reshape(H, d.shape[-1])


def _request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask_tensors: list[Tensor],
    float_mask: Tensor | None,
    bias: Tensor | None,
    mask_spec: str,
    scale: float,
    softcap: float | None = None,
    rel_bias: Tensor | None = None,
) -> Request:
    """The eager request an operator stands for (mask rebuilt from its spec and tensors; a
    relative bias function from its `offset_table`)."""
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    mask: Mask | Tensor | None = from_spec(mask_spec, list(mask_tensors)) if mask_spec else None
    if float_mask is not None:
        mask = float_mask
    if rel_bias is not None:
        bias = OffsetTable(rel_bias, S)  # type: ignore[assignment]
    return Request(
        q=q,
        k=k,
        v=v,
        dims=Dims(B, H, H_kv, L, S, D, Dv, False),
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=1.0,
        score="dot",
        dropout_p=0.0,
        return_weights=False,
        softcap=softcap,
    )


@torch.library.custom_op("attnlab::flash_fwd", mutates_args=())
def flash_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    float_mask: Tensor | None,
    bias: Tensor | None,
    mask_spec: str,
    scale: float,
    softcap: float | None,
    rel_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out (B, H, L, Dv), lse (B, H, L), touched ())``: the eager flash call on the inputs as
    given, the NaN rule included (`eager.flash_run_marked`: finite inputs are read, not copied);
    ``touched`` says whether the rule cleaned or poisoned anything (then the backward recomputes
    the clean forward: `flash_bwd`)."""
    req = _request(
        q,
        k,
        v,
        mask_tensors=mask_tensors,
        float_mask=float_mask,
        bias=bias,
        mask_spec=mask_spec,
        scale=scale,
        softcap=softcap,
        rel_bias=rel_bias,
    )
    out, lse, touched = flash_run_marked(req)
    return out.contiguous(), lse.contiguous(), torch.tensor(bool(touched))


@flash_fwd.register_fake
def _(q, k, v, mask_tensors, float_mask, bias, mask_spec, scale, softcap, rel_bias):  # noqa: ARG001 (a custom op's fake kernel takes the op's arguments)
    B, H, L, _ = q.shape
    return (
        q.new_empty(B, H, L, v.shape[-1]),
        q.new_empty(B, H, L, dtype=stat_dtype(q.dtype)),
        q.new_empty((), dtype=torch.bool),
    )


@torch.library.custom_op("attnlab::flash_bwd", mutates_args=())
def flash_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    touched: Tensor,
    mask_tensors: list[Tensor],
    float_mask: Tensor | None,
    bias: Tensor | None,
    mask_spec: str,
    scale: float,
    softcap: float | None,
    rel_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of `flash_fwd`, recomputed tile by tile — as eager's autograd gives them.

    The gradients are those of the clean computation (the NaN rule's poison is a constant, a
    cleaned entry gets 0): untouched calls run the backward on the inputs and the saved ``out``
    and ``lse`` as they are; touched ones clean the inputs and recompute the clean forward
    first. Rows the rule poisoned pass no lse gradient (as through eager's ``where``).
    """
    if dlse is not None:
        dlse = torch.where(torch.isnan(lse), 0.0, dlse)
        if not bool(dlse.any()):
            # a compiled graph passes zeros for an lse nobody differentiates: the job's dS path
            # (for an lse gradient) would replace its C++ kernels (82x slower, sliding window
            # 256, L = 4096, benchmarks/bench_compile.py)
            dlse = None
    clean = bool(touched)
    raw = (q, k, v)
    if clean:
        q, k, v = (nan_rule.clean(x) for x in raw)
    req = _request(
        q,
        k,
        v,
        mask_tensors=mask_tensors,
        float_mask=None if float_mask is None else nan_rule.clean_bias(float_mask),
        bias=None if bias is None else nan_rule.clean_bias(bias),
        mask_spec=mask_spec,
        scale=scale,
        softcap=softcap,
        rel_bias=None if rel_bias is None else nan_rule.clean_bias(rel_bias),
    )
    job = flash_job(req)
    qp, kp, vp, Dv = prepare_inputs(req, job.engine)  # `compiled_flash` passes a scale > 0
    width = vp.shape[-1]
    if clean:  # the saved out/lse are poisoned: the clean ones, at the engine's width
        out, lse = job.forward(qp, kp, vp)
    elif width != Dv:  # the kernel engine ran on zero-padded values
        out = torch.nn.functional.pad(out, (0, width - Dv))
    if width != Dv:
        dout = torch.nn.functional.pad(dout, (0, width - Dv))
    res = Residuals(dout=dout.contiguous(), q=qp, k=kp, v=vp, out=out.contiguous(), lse=lse)
    dq, dk, dv = job.backward(res, dlse)
    D = q.shape[-1]
    grads = [dq[..., :D], dk[..., :D], dv[..., :Dv]]
    if clean:  # `nan_rule.clean`'s gradient: 0 at the entries it replaced
        grads = [torch.where(torch.isfinite(x), g, 0.0) for x, g in zip(raw, grads, strict=True)]
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@flash_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, t, tensors, float_mask, bias, spec, scale, softcap, rb):  # noqa: ARG001 (a custom op's fake kernel takes the op's arguments)
    # contiguous whatever the inputs' layout, as the real kernel returns them
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask_tensors, float_mask, bias, mask_spec, scale, softcap, rel_bias = inputs
    out, lse, touched = output
    ctx.save_for_backward(q, k, v, out, lse, touched, float_mask, bias, rel_bias, *mask_tensors)
    ctx.mask_spec, ctx.scale, ctx.softcap = mask_spec, scale, softcap


def _backward(ctx, dout: Tensor, dlse: Tensor, _touched: Tensor | None):
    q, k, v, out, lse, touched, float_mask, bias, rel_bias, *mask_tensors = ctx.saved_tensors
    dq, dk, dv = flash_bwd(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        touched,
        mask_tensors,
        float_mask,
        bias,
        ctx.mask_spec,
        ctx.scale,
        ctx.softcap,
        rel_bias,
    )
    return dq, dk, dv, [None] * len(mask_tensors), None, None, None, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_flash(req: Request) -> tuple[Tensor, Tensor]:
    """`flash_run_lse` as one custom operator (`flash_fwd`, its gradient `flash_bwd`)."""
    terms = req.terms
    mask, float_mask, bias = terms.structured, terms.float_mask, terms.bias_tensor
    spec = ("", []) if mask is None else mask.spec()
    if spec is None:
        if not req.q.is_meta:  # pragma: no cover - flash_supports declines these under compile
            raise ValueError(f"flash under torch.compile needs a mask with a spec, got {mask!r}")
        # meta tensors hold no values: the outputs' shapes do not depend on the mask (bias
        # functions are likewise not evaluated), so a mask without a spec needs no operator
        spec = ("", [])
    table = None
    if terms.bias_fn is not None:  # a relative function (`flash_supports` checked)
        d = req.dims
        table = offset_table(terms.bias_fn, d.H, d.L, d.S, req.q.device)
    # non-finite rows stay non-finite under scoring: the rule sees the same rows; the sign of
    # the scale is in q, so the operators always see a positive scale
    q, k, scale = logit_qk(req)
    # AOTInductor passes an empty Tensor[] to an operator as None (torch 2.13: its proxy executor
    # cannot tell [] from an absent list); `from_spec` ignores tensors past the spec's, so a
    # spec without tensors travels with one empty placeholder
    tensors = spec[1] or [req.q.new_empty(0)]
    out, lse, _ = flash_fwd(
        q, k, req.v, tensors, float_mask, bias, spec[0], scale, req.softcap, table
    )
    return out, lse


__all__ = ["OffsetTable", "compiled_flash", "flash_bwd", "flash_fwd", "offset_table"]
