"""The tiled backend's front: the registry's hooks, `flash_attention` and `explain_plan`.

`flash_run_lse` runs the eager computation with the NaN rule around it (`eager.flash_run_marked`,
whose autograd function recomputes the job backward); under ``torch.compile`` (and on ``meta``
tensors) the same computation runs as one custom operator (`functional.flash.ops`), whose kernel
is `eager.flash_run_marked` again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks import Mask
from .. import nan_rule, reference
from ..request import BiasFn, Request, is_relative_bias, request_dense
from ..validate import plain_request
from .eager import band_kernel_covers, flash_run_marked, kernel_checks_inputs, needs_grad
from .plan import flash_job


def flash_run_lse(req: Request, **options: object) -> tuple[Tensor, Tensor]:
    """Runs a validated request on the tiled backend: ``(out (B, H, L, Dv), lse (B, H, L))``.

    ``options`` are `flash_job`'s (block_q, block_k, band_block, engine). The NaN rule
    (`functional.nan_rule`): the tiles run on inputs whose non-finite entries are 0, and NaN is
    added back where the rule puts it (lse is NaN on those rows).
    """
    if torch.compiler.is_compiling() or req.q.is_meta:
        # the same computation as custom operators; imported on first use, so `import attnlab`
        # does not register operators it may never need
        from .ops import compiled_flash

        return compiled_flash(req)
    return flash_run_marked(req, **options)[:2]


def flash_run(req: Request) -> tuple[Tensor, None]:
    """The registry's ``run``: output only."""
    return flash_run_lse(req)[0], None


def _compile_declines(req: Request) -> str | None:
    """What flash cannot run under torch.compile (see `functional.flash.ops`)."""
    terms = req.terms
    if terms.bias_fn is not None and not is_relative_bias(terms.bias_fn):
        return (
            "under torch.compile flash takes bias tensors and relative bias functions "
            "(fn.relative = True: ALiBi, T5), not other bias functions"
        )
    if terms.structured is not None and terms.structured.spec() is None:
        return "under torch.compile flash needs a mask with a spec (not from_fn)"
    if any(needs_grad(t) for t in terms.additive):
        return "under torch.compile flash computes no gradient for mask/bias tensors"
    return None


def flash_supports(req: Request) -> str | None:
    """None if the tiled backend computes this request, else the reason it does not."""
    if req.return_weights:
        return (
            "flash never materialises the (B, H, L, S) weights (return_weights=True); use "
            "attention(..., return_lse=True) and attention_weights(q, k, lse, rows=...)"
        )
    if req.dropout_p > 0:
        return f"flash does not implement dropout (dropout_p={req.dropout_p})"
    if torch.compiler.is_compiling():
        why = _compile_declines(req)
        if why is not None:
            return why
    fn = req.terms.bias_fn
    if fn is not None and torch.is_grad_enabled():
        d = req.dims
        one = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=req.q.device)
        probe = fn(one, one, one + (d.S - d.L), one)
        if isinstance(probe, Tensor) and probe.requires_grad:
            return "flash computes no gradient for a bias function whose values require grad"
    return None


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
    return flash_run_lse(
        req, block_q=block_q, block_k=block_k, band_block=band_block, engine=engine
    )


def explain_plan(req: Request) -> str:
    """How flash would tile a request and which engine runs each part (for `explain`): the
    plan, the engines of its forward (and backward, when an input needs a gradient), and how
    the NaN rule finds non-finite inputs."""
    job = flash_job(req)
    text = job.plan.describe()
    if job.softcap is not None:
        text += ", soft-capped logits on the pure-PyTorch tile engine"
    grad = any(needs_grad(x) for x in (req.q, req.k, req.v))
    engines = job.engines(req.q, req.k, req.v, grad=grad)
    checked = kernel_checks_inputs(req) and not grad
    if checked and band_kernel_covers(job.plan, req.q, req.k, req.v):
        engines.append("NaN/inf check: inside attnlab's band kernel, as it reads q, k, v")
    elif nan_rule.flash_ext_ready(req.q):
        engines.append("NaN/inf scan of q, k, v: attnlab's C++ scan (a copy only if one is found)")
    else:
        engines.append("NaN/inf handling: PyTorch ops (a cleaned copy of q, k, v)")
    return f"{text}; engines: {'; '.join(engines)}"


__all__ = [
    "explain_plan",
    "flash_attention",
    "flash_run",
    "flash_run_lse",
    "flash_supports",
]
