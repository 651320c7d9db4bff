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

import torch
from torch import Tensor

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
    assert not bool(bad.any()), f"{name}: NaN/inf at {int(bad.sum())} positions where golden is finite"
    nonfinite_match = torch.equal(
        torch.isnan(impl.to(torch.float64)), torch.isnan(g64)
    )
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
        assert ok, f"{name}: mean err {mean_impl:.3e} > {mean_factor}·{mean_naive:.3e} + {floor:.1e}"
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


def seeded(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0, scale: float = 1.0) -> Tensor:
    """A reproducible unit-normal tensor."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _run(fn, inputs: list[Tensor], dout: Tensor | None):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    if dout is None:
        return out.detach(), None
    grads = torch.autograd.grad(out, xs, dout.to(out.dtype), allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]


def check_against_reference(impl_fn, ref_fn, inputs: list[Tensor], *, grads: bool = True,
                            mean_factor: float | None = None, seed: int = 1) -> None:
    """Runs ``impl_fn`` on ``inputs`` (their dtype) against the float64 golden and the same-dtype naive.

    ``ref_fn(*inputs, compute_dtype=dtype)`` is the reference: called on float64 copies for the
    golden value and on the inputs with ``compute_dtype`` = the input dtype for the naive value.
    Checks the output and, if ``grads``, every input gradient for one random ``dout``.
    """
    dtype = inputs[0].dtype
    golden_out, _ = _run(lambda *x: ref_fn(*x, compute_dtype=torch.float64), [x.to(torch.float64) for x in inputs], None)
    dout = seeded(*golden_out.shape, seed=seed) if grads else None
    golden, ggrads = _run(lambda *x: ref_fn(*x, compute_dtype=torch.float64), [x.to(torch.float64) for x in inputs], dout)
    naive, ngrads = _run(lambda *x: ref_fn(*x, compute_dtype=dtype), inputs, dout)
    impl, igrads = _run(impl_fn, inputs, dout)
    assert impl.dtype == dtype, f"output dtype {impl.dtype} != input dtype {dtype}"
    assert_close_rule(impl, golden, naive, kind="fwd", mean_factor=mean_factor)
    if grads:
        for idx, (a, b, c) in enumerate(zip(igrads, ggrads, ngrads, strict=True)):
            assert_close_rule(a, b, c, kind="grad", name=f"grad[{idx}]", mean_factor=mean_factor)
