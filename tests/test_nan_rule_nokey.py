"""Issue 38 item 6: a row with no key to attend outputs zeros whatever its q, on every backend.

The NaN rule (DESIGN.md) applies to rows with at least one key; a row that may attend nothing
(bottom-right causal with L > S, a window or document that leaves it out, a padded-out batch
item, an all-False row of a bool mask, a −inf row of a float mask or bias) outputs zeros, with
zero weights, lse = −inf and zero gradients — even when its ``q_i`` is NaN or ±inf. torch's
fused kernel zeros such a row only for a finite ``q_i``: ``sdpa``/``auto`` returned NaN there,
and with k/v requiring gradient (q not) spread NaN into dk and dv.

Each case plants NaN/±inf in the q rows that attend nothing and compares the backend with its own
call on q with those rows zeroed (the same computation, since those rows reach nothing): no NaN
anywhere, the dead rows exactly zero, the other rows and every gradient equal. Eager on every
registered backend and mask family; compiled with Inductor on a fast slice, the full grid
(and float64/bfloat16) under ``-m slow``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import attnlab
from attnlab import masks
from attnlab._shapes import check_qkv
from attnlab.functional import reference
from attnlab.functional.request import dense_mask_and_bias
from helpers import FIXED_TABLE, GENERAL_BACKENDS, seeded

NAN, INF = float("nan"), float("inf")
B, H, H_KV, L, S, D = 2, 4, 2, 29, 19, 8  # L > S: bottom-right causal leaves rows 0..9 keyless
BACKENDS = [*GENERAL_BACKENDS, "auto"]


def _prefix_lm(b, h, i, j):
    """Bidirectional attention inside a 4-token prefix (rows aligned before the keys see none)."""
    return (i >= 0) & (i < 4) & (j < 4)


def _distance_bias(b, h, i, j):
    return -0.25 * (i - j).abs().to(torch.float32)


def _bool_rows() -> Tensor:
    keep = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(5)) > 0.5
    keep[0, :, [0, 7, 20]] = False
    keep[1, :, 3] = False
    return keep


def _neginf_rows(scale: float) -> Tensor:
    x = seeded(1, H, L, S, seed=6, dtype=torch.float32) * scale
    x[..., [1, 2, 15], :] = -INF
    return x


Family = Callable[[], tuple[object, object]]
Attn = Callable[[Tensor, Tensor, Tensor], Tensor]
FAMILIES: dict[str, Family] = {
    "causal": lambda: (masks.causal(), None),
    "causal&padding": lambda: (masks.causal() & masks.padding([S, 6]), None),
    "sliding_window": lambda: (masks.sliding_window(4), None),
    "sliding_window_noncausal": lambda: (masks.sliding_window(3, causal=False), None),
    "documents": lambda: (masks.document.from_lengths([8, S - 8]), None),
    "causal&document_ids": lambda: (
        masks.causal() & masks.document(torch.arange(S) // 3 % 4),
        None,
    ),
    "padding_list": lambda: (masks.padding([S, 0]), None),
    "padding_tensor": lambda: (masks.padding(torch.tensor([S, 0])), None),
    "strided": lambda: (masks.strided(4), None),
    "global_local&causal": lambda: (masks.global_local(3, 2) & masks.causal(), None),
    "bigbird&causal": lambda: (masks.bigbird(4, 1, 1, 1) & masks.causal(), None),
    "prefix_lm": lambda: (masks.causal() | masks.from_fn(_prefix_lm), None),
    "bool_tensor": lambda: (_bool_rows(), None),
    "float_mask": lambda: (_neginf_rows(0.0), None),
    "bias_tensor": lambda: (None, _neginf_rows(1.0)),
    "causal+bias_fn": lambda: (masks.causal(), _distance_bias),
}
FN_FAMILIES = {"prefix_lm", "causal+bias_fn"}  # a Python function as mask or bias
COMPILE_FAST = [
    ("sdpa", "causal"),
    ("sdpa", "bool_tensor"),
    ("sdpa", "bias_tensor"),
    ("auto", "sliding_window"),
    ("flash", "documents"),
    ("flash", "padding_tensor"),
    ("reference", "float_mask"),
]


def _inputs(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return (
        seeded(B, H, L, D, seed=1, dtype=dtype),
        seeded(B, H_KV, S, D, seed=2, dtype=dtype),
        seeded(B, H_KV, S, D, seed=3, dtype=dtype),
    )


def _cast(x: object, dtype: torch.dtype) -> object:
    return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x


def _dense(mask: object, bias: object, q: Tensor, k: Tensor, v: Tensor):
    """The mask and bias rendered as the reference takes them: ``(allowed, additive)``."""
    return dense_mask_and_bias(mask, bias, check_qkv(q, k, v), q.dtype, q.device)


def _keyless(mask: object, bias: object, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``(B, H, L)`` bool: the rows that may attend no key (mask False or bias −inf)."""
    allowed, additive = _dense(mask, bias, q, k, v)
    keep = torch.ones(B, H, L, S, dtype=torch.bool)
    if allowed is not None:
        keep = keep & allowed
    if additive is not None:
        keep = keep & ~torch.isneginf(additive)
    return ~keep.any(dim=-1)


def _planted(q: Tensor, dead: Tensor) -> tuple[Tensor, Tensor]:
    """``(q with NaN/±inf in every keyless row, q with those rows zeroed)``."""
    poison = torch.tensor([NAN, INF, -INF], dtype=q.dtype).repeat(D)[:D]
    bad, zero = q.clone(), q.clone()
    bad[dead] = poison
    zero[dead] = 0
    return bad, zero


def _case(family: str, dtype: torch.dtype):
    """``(mask, bias, q poisoned, q zeroed, k, v, keyless)`` of one family: q's keyless rows
    hold NaN/±inf or zeros, ``keyless`` is ``(B, H, L)`` bool."""
    mask, bias = FAMILIES[family]()
    mask, bias = _cast(mask, dtype), _cast(bias, dtype)
    q, k, v = _inputs(dtype)
    dead = _keyless(mask, bias, q, k, v)
    assert dead.any() and not dead.all(), f"{family}: the case must have keyless and live rows"
    bad, zero = _planted(q, dead)
    return mask, bias, bad, zero, k, v, dead


def _close(a: Tensor, b: Tensor, what: str) -> None:
    """Equal within the dtype's fixed table (forward row for the output, else gradients)."""
    fa, fr, ga, gr = FIXED_TABLE[a.dtype]
    atol, rtol = (fa, fr) if what == "output" else (ga, gr)
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _check_forward(
    fn: Attn, bad: Tensor, zero: Tensor, k: Tensor, v: Tensor, dead: Tensor, backend: str
) -> None:
    """No NaN, keyless rows exactly zero, the rest as with those q rows zeroed (no gradient)."""
    with torch.no_grad():
        out = fn(bad, k, v)
        want = fn(zero, k, v)
    assert not torch.isnan(out).any(), (
        f"{backend}: NaN in {int(torch.isnan(out).any(-1).sum())} rows (the keyless rows must be 0)"
    )
    assert torch.equal(out[dead], torch.zeros_like(out[dead])), "keyless rows are not zeros"
    _close(out, want, "output")


def _check_grads(
    fn: Attn, bad: Tensor, zero: Tensor, k: Tensor, v: Tensor, dead: Tensor, grad_q: bool
) -> None:
    """Finite gradients equal to those with the keyless q rows zeroed; dq of those rows is 0.

    With ``grad_q=False`` only k and v require gradient (the path that formed dk/dv from a NaN
    q_i on the old sdpa backend).
    """
    dout = seeded(B, H, L, D, seed=7, dtype=bad.dtype)
    got, want = [], []
    for qq, acc in ((bad, got), (zero, want)):
        xs = [qq.clone().requires_grad_(grad_q), k.clone().requires_grad_(), v.clone()]
        xs[2].requires_grad_()
        out = fn(*xs)
        assert not torch.isnan(out).any(), "NaN output with gradient enabled"
        wrt = xs if grad_q else xs[1:]
        acc.extend(torch.autograd.grad(out, wrt, dout))
    names = ["dq", "dk", "dv"] if grad_q else ["dk", "dv"]
    for name, g, w in zip(names, got, want, strict=True):
        assert torch.isfinite(g).all(), f"{name}: NaN/inf reached the gradient"
        _close(g, w, name)
    if grad_q:
        assert torch.equal(got[0][dead], torch.zeros_like(got[0][dead])), "dq of keyless rows != 0"


def _attention(backend: str, mask: object, bias: object) -> Attn:
    """``fn(q, k, v)``: `attnlab.attention` on ``backend`` with ``mask`` and ``bias``."""

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnlab.attention(q, k, v, mask=mask, bias=bias, backend=backend)

    return fn


# ----------------------------------------------------------------- eager, every backend
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_keyless_rows_are_zero_whatever_q(backend, family):
    mask, bias, bad, zero, k, v, dead = _case(family, torch.float32)
    fn = _attention(backend, mask, bias)
    _check_forward(fn, bad, zero, k, v, dead, backend)
    _check_grads(fn, bad, zero, k, v, dead, grad_q=True)
    # q without gradient: the kernel's backward must not form dk/dv from a NaN q_i
    _check_grads(fn, bad, zero, k, v, dead, grad_q=False)


@pytest.mark.parametrize("family", ["causal", "documents", "bool_tensor", "bias_tensor"])
def test_reference_definition_and_lse(family):
    """The reference is the definition: zeros, zero weights and lse = −inf on keyless rows; the
    backends that return the lse agree."""
    mask, bias, bad, _, k, v, dead = _case(family, torch.float64)
    allowed, additive = _dense(mask, bias, bad, k, v)
    out, w = reference.attention(bad, k, v, mask=allowed, bias=additive)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.equal(w[dead], torch.zeros_like(w[dead]))
    for backend in ("reference", "flash", "auto"):
        _, lse = attnlab.attention(
            bad, k, v, mask=mask, bias=bias, backend=backend, return_lse=True
        )
        assert torch.isneginf(lse[dead]).all(), backend
        assert not torch.isnan(lse).any(), backend


@pytest.mark.parametrize("Dv", [5], ids=["Dv!=D"])
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_keyless_rows_on_torchs_math_fallback(backend, Dv):
    """Dv != D sends torch's SDPA to its math path: the keyless rows are zeros there too."""
    mask = masks.causal()
    q, k, _ = _inputs(torch.float32)
    v = seeded(B, H_KV, S, Dv, seed=4, dtype=torch.float32)
    dead = _keyless(mask, None, q, k, v)
    bad, zero = _planted(q, dead)
    fn = _attention(backend, mask, None)
    with torch.no_grad():
        out = fn(bad, k, v)
    assert not torch.isnan(out).any()
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    _close(out, fn(zero, k, v), "output")


def test_decode_backend_keyless_batch_item():
    """decode runs key prefixes from Python ints: a batch item with length 0 is zeros."""
    q = seeded(3, H, 2, D, seed=1)
    k, v = seeded(3, H_KV, 40, D, seed=2), seeded(3, H_KV, 40, D, seed=3)
    q[1] = NAN
    mask = masks.padding([40, 0, 7])
    for backend in ("decode", "sdpa", "auto"):
        out = attnlab.attention(q, k, v, mask=mask, backend=backend)
        assert not torch.isnan(out).any(), backend
        assert torch.equal(out[1], torch.zeros_like(out[1])), backend


# ----------------------------------------------------------------- compiled with Inductor
def _compiled_case(backend: str, family: str, dtype: torch.dtype) -> None:
    if backend == "flash" and family in FN_FAMILIES:
        pytest.skip("flash refuses a mask/bias function under torch.compile (it says so)")
    mask, bias, bad, zero, k, v, dead = _case(family, dtype)
    eager = _attention(backend, mask, bias)
    compiled = torch.compile(eager, fullgraph=True)
    _check_forward(compiled, bad, zero, k, v, dead, backend)
    _check_grads(compiled, bad, zero, k, v, dead, grad_q=False)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    ("backend", "family"), COMPILE_FAST, ids=[f"{b}-{f}" for b, f in COMPILE_FAST]
)
def test_keyless_rows_compiled(backend, family):
    _compiled_case(backend, family, torch.float32)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_keyless_rows_compiled_full_grid(backend, family):
    _compiled_case(backend, family, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_keyless_rows_other_dtypes(backend, family, dtype):
    mask, bias, bad, zero, k, v, dead = _case(family, dtype)
    fn = _attention(backend, mask, bias)
    _check_forward(fn, bad, zero, k, v, dead, backend)
    _check_grads(fn, bad, zero, k, v, dead, grad_q=True)
    _check_grads(fn, bad, zero, k, v, dead, grad_q=False)
