"""Test helpers: the tolerance rule (RELIABILITY.md section c) and seeded inputs.

The rule is implemented once in `attnlab.testing` (so `attnlab check` applies the very same rule)
and used by every numeric test through this module.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnlab
from attnlab.testing import (
    FIXED_TABLE,
    HEAD_DIMS,
    ODD_SIZES,
    assert_close_rule,
    check_against_reference,
    mean_factor_for,
    reference_for,
    seeded,
)

SPECIALISED_BACKENDS = ("decode",)
"""Backends that run only a niche of calls (decode: a few query rows, key prefixes, no grad);
tests/test_decode.py holds their tests, the generic suites run every other backend."""

GENERAL_BACKENDS = [b for b in attnlab.backends() if b != "auto" and b not in SPECIALISED_BACKENDS]
"""Every registered backend that runs any call (the reference included)."""


def call_backend(backend: str, mask=None, bias=None, **kw):
    """``impl(q, k, v)``: `attnlab.attention` on ``backend``, float masks/biases in q's dtype."""

    def impl(q, k, v):
        m = (
            mask.to(q.dtype)
            if isinstance(mask, torch.Tensor) and mask.is_floating_point()
            else mask
        )
        b = bias.to(q.dtype) if isinstance(bias, torch.Tensor) else bias
        return attnlab.attention(q, k, v, mask=m, bias=b, backend=backend, **kw)

    return impl


def run_cli(argv, capsys):
    """``(exit code, stdout, stderr)`` of ``attnlab ARGV`` run in this process."""
    from attnlab import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def fwd_bwd(fn, inputs, dout_seed=7):
    """``(out, grads)`` of ``fn(*inputs)`` for a seeded dout; zeros for unused inputs."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    dout = seeded(*out.shape, dtype=out.dtype, seed=dout_seed)
    grads = torch.autograd.grad(out, xs, dout, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]
    return out.detach(), grads


def assert_exact_in_fp64(impl, ref, inputs, atol=1e-12):
    """``impl(*inputs)`` equals ``ref(*inputs, compute_dtype=float64, reorder=False)`` within
    ``atol`` (rtol 0), forward and the input gradients of one seeded dout: a float64 fast path
    against its definition."""
    inputs = list(inputs)
    got, got_grads = fwd_bwd(impl, inputs, dout_seed=5)
    want, want_grads = fwd_bwd(
        lambda *x: ref(*x, compute_dtype=torch.float64, reorder=False), inputs, dout_seed=5
    )
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


__all__ = [
    "FIXED_TABLE",
    "HEAD_DIMS",
    "ODD_SIZES",
    "assert_close_rule",
    "assert_exact_in_fp64",
    "call_backend",
    "check_against_reference",
    "fwd_bwd",
    "mean_factor_for",
    "reference_for",
    "run_cli",
    "seeded",
]


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (``.largest``):
    a test that no L×S tensor is formed runs its code under this mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
