"""B5 / issue 13 item 8: memory layouts of q, k, v and dout never change the result.

Every backend's output and gradients for transposed, channels-last-like, column-major,
stride-0 expanded and sliced-last-dim inputs, and for non-contiguous dout, are compared with the
same backend's call on contiguous copies: bit-equal where the backend allows it (the table in
`bit_equal`, also stated in the `attnlab.attention` docstring), else within the fixed tolerance
table of the dtype.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from helpers import FIXED_TABLE, GENERAL_BACKENDS, seeded

BACKENDS = GENERAL_BACKENDS
B, H, H_KV, L, S, D, DV = 2, 4, 2, 37, 41, 16, 16  # Dv = D: torch SDPA takes its fused kernel


def transposed(x):  # (B, L, H, D) storage seen as (B, H, L, D): the usual projection output
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def channels_last(x):  # H innermost: the last dim has stride H
    return x.contiguous(memory_format=torch.channels_last)


def column_major(x):  # the last dim has stride L
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def sliced_last_dim(x):  # rows of a wider tensor; the unused columns hold NaN
    wide = torch.full((*x.shape[:-1], x.shape[-1] + 5), float("nan"), dtype=x.dtype)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


def expanded_batch(x):  # stride 0 over the batch
    return x[:1].expand(x.shape)


def expanded_heads(x):  # stride 0 over the heads (k/v shared as in GQA-by-expand)
    return x[:, :1].expand(x.shape)


LAYOUTS = [transposed, channels_last, column_major, sliced_last_dim, expanded_batch]
LAYOUTS += [expanded_heads]
DOUT_LAYOUTS = [transposed, column_major, expanded_batch, channels_last]


def bit_equal(backend: str, dtype: torch.dtype, layouts, dout_layout) -> bool:
    """Where the layout cannot change a single bit (measured on torch 2.13 CPU).

    Inputs whose last dim is not unit-stride are copied once by `attention`, so for
    float32/float16/bfloat16 every backend is bit-equal. In float64, torch's CPU SDPA kernel
    rounds sliced or mixed-layout inputs differently, and the reference's float64 matmuls round a
    dout whose last dim is not unit-stride differently (a few ulp); flash is always bit-equal.
    """
    if dtype != torch.float64 or backend == "flash":
        return True
    if backend == "reference":
        return dout_layout not in (column_major, channels_last)
    return False


def _run(backend, mask, q, k, v, dout):
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = attnlab.attention(*xs, mask=mask, backend=backend)
    return [out, *torch.autograd.grad(out, xs, dout)]


MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(5),  # flash: batched band calls over strided key windows
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_b5_every_layout_equals_the_contiguous_call(backend, dtype, mask):
    q0 = seeded(B, H, L, D, seed=1, dtype=dtype)
    k0 = seeded(B, H_KV, S, D, seed=2, dtype=dtype)
    v0 = seeded(B, H_KV, S, DV, seed=3, dtype=dtype)
    d0 = seeded(B, H, L, DV, seed=4, dtype=dtype)
    n = len(LAYOUTS)
    # every input sees every layout: all three in one layout, then three layouts mixed
    uniform = [(f, f, f) for f in LAYOUTS]
    mixed = [(LAYOUTS[r], LAYOUTS[(r + 1) % n], LAYOUTS[(r + 2) % n]) for r in range(n)]
    for r, lay in enumerate(uniform + mixed):
        dlay = DOUT_LAYOUTS[r % len(DOUT_LAYOUTS)]
        q, k, v, dout = (f(x) for f, x in zip((*lay, dlay), (q0, k0, v0, d0), strict=True))
        assert not any(t.is_contiguous() for t in (q, k, v, dout))
        got = _run(backend, MASKS[mask], q, k, v, dout)
        want = _run(backend, MASKS[mask], *(t.contiguous() for t in (q, k, v, dout)))
        names = [f.__name__ for f in (*lay, dlay)]
        if bit_equal(backend, dtype, lay, dlay):
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                assert torch.equal(a, b), f"{name} not bit-equal for layouts {names}"
        else:
            fa, fr, ga, gr = FIXED_TABLE[dtype]
            torch.testing.assert_close(got[0], want[0], atol=fa, rtol=fr)
            for a, b in zip(got[1:], want[1:], strict=True):
                torch.testing.assert_close(a, b, atol=ga, rtol=gr)


@pytest.mark.parametrize("backend", BACKENDS)
def test_b5_float16_layouts_bit_equal(backend):
    dtype = torch.float16
    q0 = seeded(B, H, L, D, seed=1, dtype=dtype)
    k0 = seeded(B, H_KV, S, D, seed=2, dtype=dtype)
    v0 = seeded(B, H_KV, S, DV, seed=3, dtype=dtype)
    d0 = seeded(B, H, L, DV, seed=4, dtype=dtype)
    for lay, dlay in zip(LAYOUTS, DOUT_LAYOUTS * 2, strict=False):
        q, k, v, dout = lay(q0), lay(k0), lay(v0), dlay(d0)
        got = _run(backend, masks.causal(), q, k, v, dout)
        want = _run(backend, masks.causal(), *(t.contiguous() for t in (q, k, v, dout)))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), lay.__name__


@pytest.mark.parametrize("backend", BACKENDS)
def test_b5_three_d_sequence_first_inputs(backend):
    """(B, L, D) views of (L, B, D) storage, as a sequence-first model produces them."""
    q, k, v = (seeded(n, B, D, seed=s).transpose(0, 1) for n, s in ((L, 1), (S, 2), (S, 3)))
    dout = seeded(L, B, D, seed=4).transpose(0, 1)
    got = _run(backend, masks.causal(), q, k, v, dout)
    want = _run(backend, masks.causal(), *(t.contiguous() for t in (q, k, v, dout)))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [transposed, channels_last, column_major])
def test_b5_leaf_grads_keep_the_inputs_strides(backend, layout):
    """``.grad`` of a dense leaf has the leaf's strides (torch's gradient layout contract).

    The gradients a backend hands to autograd come in its own layout (none of the three keeps
    the inputs' stride order there); accumulation into ``.grad`` restores it, for every backend.
    """
    xs = [
        layout(seeded(B, h, n, d, seed=s)).requires_grad_()
        for h, n, d, s in ((H, L, D, 1), (H_KV, S, D, 2), (H_KV, S, DV, 3))
    ]
    attnlab.attention(*xs, mask=masks.causal(), backend=backend).backward(
        seeded(B, H, L, DV, seed=4)
    )
    for x in xs:
        assert x.grad.stride() == x.stride()
