"""The tolerance rule for comparing a fast path with the float64 reference (like `torch.testing`).

One implementation, used by the test suite (through tests/helpers.py) and by `attnlab check`.

Rule 1: the golden value is the float64 reference on CPU.
Rule 2: ``err(impl) <= c · err(naive) + floor`` where ``err(naive)`` is the error of the same naive
formula run in the input dtype, ``c`` is 2 forward and 3 for gradients, and ``floor`` is
``2 · max|(g + 0.3 − 0.3) − g|`` in the input dtype. Any NaN/inf where golden is finite fails.
Separately every comparison must pass the fixed per-dtype table, so a broken naive reference
cannot make the threshold loose.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shapes import check_qkv
from .functional import reference
from .functional.request import dense_mask_and_bias

# dtype -> (fwd atol, fwd rtol, grad atol, grad rtol): the fixed ceiling table.
FIXED_TABLE: dict[torch.dtype, tuple[float, float, float, float]] = {
    torch.float64: (1e-10, 1e-7, 1e-9, 1e-7),
    torch.float32: (2e-5, 1.3e-6, 1e-4, 1e-5),
    torch.float16: (4e-3, 1e-3, 1e-2, 1e-2),
    torch.bfloat16: (3e-2, 1.6e-2, 6e-2, 2e-2),
}

ODD_SIZES = (1, 17, 97, 113, 1025)
HEAD_DIMS = (8, 40, 64, 80, 128)


def _floor(golden: Tensor, dtype: torch.dtype) -> float:
    g = golden.to(dtype)
    if g.numel() == 0:
        return 0.0
    return 2.0 * float(((g + 0.3) - 0.3 - g).abs().max().to(torch.float64))


def _max_err(x: Tensor, golden: Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return float((x.to(torch.float64) - golden.to(torch.float64)).abs().max())


def assert_close_rule(
    impl: Tensor,
    golden: Tensor,
    naive: Tensor,
    *,
    kind: str = "fwd",
    name: str = "output",
    mean_factor: float | None = None,
) -> None:
    """Asserts the tolerance rule for one tensor.

    Args:
        impl: the fast path's result (in the input dtype).
        golden: the float64 reference result.
        naive: the reference formula run in the input dtype.
        kind: "fwd" (factor 2) or "grad" (factor 3).
        name: what is compared, for the message.
        mean_factor: for tiled fp32 kernels, additionally allow 10× the naive *mean* error instead
            of the max rule (FlexAttention's rule); None = max rule only.
    """
    assert impl.shape == golden.shape, f"{name}: shape {tuple(impl.shape)} != {tuple(golden.shape)}"
    dtype = impl.dtype
    g64 = golden.to(torch.float64)
    finite = torch.isfinite(g64)
    bad = finite & ~torch.isfinite(impl.to(torch.float64))
    assert not bool(bad.any()), (
        f"{name}: NaN/inf at {int(bad.sum())} positions where golden is finite"
    )
    nonfinite_match = torch.equal(torch.isnan(impl.to(torch.float64)), torch.isnan(g64))
    assert nonfinite_match, f"{name}: NaN pattern differs from golden"
    i64 = torch.where(finite, impl.to(torch.float64), 0.0)
    g64 = torch.where(finite, g64, 0.0)
    n64 = torch.where(finite, naive.to(torch.float64), 0.0)
    factor = 2.0 if kind == "fwd" else 3.0
    err_impl = _max_err(i64, g64)
    err_naive = _max_err(n64, g64)
    floor = _floor(g64, dtype)
    bound = factor * err_naive + floor
    if err_impl > bound and mean_factor is not None and i64.numel():
        mean_impl = float((i64 - g64).abs().mean())
        mean_naive = float((n64 - g64).abs().mean())
        ok = mean_impl <= mean_factor * mean_naive + floor
        assert ok, (
            f"{name}: mean err {mean_impl:.3e} > {mean_factor}·{mean_naive:.3e} + {floor:.1e}"
        )
    else:
        assert err_impl <= bound, (
            f"{name} ({dtype}, {kind}): max err {err_impl:.3e} > {factor}·naive {err_naive:.3e} "
            f"+ floor {floor:.3e}"
        )
    fa, fr, ga, gr = FIXED_TABLE[dtype]
    atol, rtol = (fa, fr) if kind == "fwd" else (ga, gr)
    torch.testing.assert_close(
        i64, g64, atol=atol, rtol=rtol, msg=lambda m: f"{name} ({dtype}, {kind}) fixed table: {m}"
    )


def seeded(
    *shape: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    scale: float = 1.0,
    device: torch.device | str | None = None,
) -> Tensor:
    """A reproducible unit-normal tensor: drawn on the CPU generator (the same values on every
    device), then moved to ``device`` (default cpu)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def _forward(fn, inputs: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    return fn(*xs), xs


def _backward(out: Tensor, xs: list[Tensor], dout: Tensor) -> list[Tensor]:
    grads = torch.autograd.grad(out, xs, dout.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]


def check_against_reference(
    impl_fn,
    ref_fn,
    inputs: list[Tensor],
    *,
    grads: bool = True,
    mean_factor: float | None = None,
    seed: int = 1,
) -> dict[str, float]:
    """Checks ``impl_fn`` on ``inputs`` against the float64 golden and the same-dtype naive run.

    ``ref_fn(*inputs, compute_dtype=dtype, reorder=bool)`` is the reference: called on float64
    copies for the golden value, and on the inputs with ``compute_dtype`` = the input dtype and
    ``reorder=True`` (scale folded into k, normalisation after the weighted sum) for the naive
    value.
    Checks the output and, if ``grads``, every input gradient for one random ``dout``.

    Returns:
        The max absolute error against golden of the output and of each gradient.

    Raises:
        AssertionError: the rule or the fixed table is violated.
    """
    dtype = inputs[0].dtype
    golden, xs64 = _forward(
        lambda *x: ref_fn(*x, compute_dtype=torch.float64, reorder=False),
        [x.to(torch.float64) for x in inputs],
    )
    naive, xsn = _forward(lambda *x: ref_fn(*x, compute_dtype=dtype, reorder=True), inputs)
    impl, xsi = _forward(impl_fn, inputs)
    assert impl.dtype == dtype, f"output dtype {impl.dtype} != input dtype {dtype}"
    assert_close_rule(impl.detach(), golden.detach(), naive.detach(), mean_factor=mean_factor)
    errors = {"out": _max_err(impl.detach(), golden.detach())}
    if grads:
        # the golden backward sees the same dout as the others: rounded to the input dtype
        dout = seeded(*golden.shape, seed=seed, device=golden.device).to(dtype)
        triples = zip(
            _backward(impl, xsi, dout),
            _backward(golden, xs64, dout),
            _backward(naive, xsn, dout),
            strict=True,
        )
        for idx, (a, b, c) in enumerate(triples):
            name = f"grad[{idx}]"
            assert_close_rule(a, b, c, kind="grad", name=name, mean_factor=mean_factor)
            errors[name] = _max_err(a, b)
    return errors


def reference_for(mask: Any = None, bias: Any = None, **kwargs: Any):
    """The ``ref_fn`` for `check_against_reference` of ``attention(…, mask, bias, **kwargs)``.

    Float masks and biases are cast to the dtype of each run (float64 for the golden value).
    """

    def ref(
        q: Tensor, k: Tensor, v: Tensor, *, compute_dtype: torch.dtype, reorder: bool
    ) -> Tensor:
        dims = check_qkv(q, k, v)
        m = mask.to(q.dtype) if isinstance(mask, Tensor) and mask.is_floating_point() else mask
        b = bias.to(q.dtype) if isinstance(bias, Tensor) else bias
        allowed, additive = dense_mask_and_bias(m, b, dims, q.dtype, q.device)
        out, _ = reference.attention(
            q,
            k,
            v,
            mask=allowed,
            bias=additive,
            compute_dtype=compute_dtype,
            reorder=reorder,
            **kwargs,
        )
        return out

    return ref


def mean_factor_for(backend: str, dtype: torch.dtype) -> float | None:
    """10 for float32 on a tiled (online-softmax) backend, else None: see `assert_close_rule`."""
    from .functional.registry import get_backend

    tiled = backend == "auto" or get_backend(backend).tiled
    return 10.0 if tiled and dtype == torch.float32 else None
