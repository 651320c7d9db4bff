"""Autograd glue of the tiled backend: forward runs a `FlashJob`, backward recomputes it.

`run_clean` is the differentiable entry: ``(out, lse)`` of a request whose inputs are finite. Its
backward is itself an autograd function (`_FlashBackward`), so it can be vmapped (e.g.
``torch.autograd.grad(..., is_grads_batched=True)``); differentiating it raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..request import Request
from .engines import Residuals
from .job import FlashJob
from .plan import prepare_inputs


def needs_grad(x: Tensor) -> bool:
    """True when autograd records ``x`` (grad mode on and ``x.requires_grad``)."""
    return torch.is_grad_enabled() and x.requires_grad


def run_clean(job: FlashJob, req: Request) -> tuple[Tensor, Tensor]:
    """``(out (B, H, L, Dv), lse (B, H, L))`` of a request with finite inputs, differentiable.

    Bias tensors that require grad get their gradient (dS summed over broadcast dims).
    """
    q, k, v, Dv = prepare_inputs(req, job.engine)
    if job.scale < 0:
        # scale·(q·k) = |scale|·((−q)·k): the kernel fills causal −inf before it scales, so a
        # negative scale would turn masked logits into +inf
        q, job.scale = -q, -job.scale
    biases = job.source.bias_tensors
    job.grad_biases = tuple(i for i, t in enumerate(biases) if needs_grad(t))
    out, lse = _FlashFunction.apply(q, k, v, job, *(biases[i] for i in job.grad_biases))
    if out.shape[-1] != Dv:
        out = out[..., :Dv]
    return out, lse


class _FlashFunction(torch.autograd.Function):
    """``(out, lse)`` of a job; its backward is `_FlashBackward` (so it can be vmapped)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, job: FlashJob, *biases: Tensor):
        # biases: the bias tensors that need gradients (also held, in order, by job.source)
        return job.forward(q, k, v)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, job, *biases = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *biases)
        ctx.job = job
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse, *biases = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = _FlashBackward.apply(dout, dlse, q, k, v, out, lse, ctx.job, *biases)
        dq, dk, dv, *dbias = grads
        return (dq, dk, dv, None, *dbias)


_DOUBLE_BACKWARD = (
    "flash attention's backward is not differentiable: double backward (higher-order "
    "gradients, e.g. a gradient penalty) is not supported; use backend='reference'"
)


class _FlashBackward(torch.autograd.Function):
    """The recomputing backward of a job as a function of ``dout`` (and ``dlse``).

    Differentiating it raises (no double backward). Under `torch.vmap` — e.g.
    ``torch.autograd.grad(..., is_grads_batched=True)`` — it runs once per vmapped slice.
    """

    @staticmethod
    def forward(dout, dlse, q, k, v, out, lse, job: FlashJob, *biases):
        if torch._C._functorch.is_legacy_batchedtensor(dout):
            # autograd's is_grads_batched vmaps the backward graph with the legacy batching,
            # which bypasses `vmap` below: unwrap dout, run per slice, batch the results.
            level = torch._C._vmapmode_increment_nesting() - 1  # the innermost vmap level
            torch._C._vmapmode_decrement_nesting()
            plain = torch._remove_batch_dim(dout, level, 1, 0)  # (N, B, H, L, Dv)
            parts = [
                _FlashBackward.forward(plain[i], dlse, q, k, v, out, lse, job, *biases)
                for i in range(plain.shape[0])
            ]
            return tuple(
                torch._add_batch_dim(torch.stack(col), 0, level) for col in zip(*parts, strict=True)
            )
        with torch.no_grad():
            res = Residuals(dout=dout.contiguous(), q=q, k=k, v=v, out=out, lse=lse)
            dq, dk, dv = job.backward(res, dlse)
            dbias = [
                g.to(job.source.bias_tensors[i].dtype).reshape(job.source.bias_tensors[i].shape)
                for g, i in zip(job.bias_grads, job.grad_biases, strict=True)
            ]
        return (dq, dk, dv, *dbias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD)

    @staticmethod
    def vmap(info, in_dims, dout, dlse, q, k, v, out, lse, job, *biases):
        args = (dout, dlse, q, k, v, out, lse)

        def pick(x, dim, i):
            return x if dim is None or x is None else x.select(dim, i)

        parts = [
            _FlashBackward.forward(
                *(pick(x, d, i) for x, d in zip(args, in_dims[:7], strict=True)),
                job,
                *(pick(b, d, i) for b, d in zip(biases, in_dims[8:], strict=True)),
            )
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(col) for col in zip(*parts, strict=True))
        return stacked, (0,) * len(stacked)


__all__ = ["needs_grad", "run_clean"]
