"""Hypothesis properties of attention (RELIABILITY H1–H4, H6, H10–H12), fp64, every backend."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import masks
from helpers import GENERAL_BACKENDS

BACKENDS = GENERAL_BACKENDS
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def problems(draw, min_len: int = 0, gqa: bool = True):
    B = draw(st.integers(1, 3))
    H_kv = draw(st.integers(1, 2)) if gqa else draw(st.integers(1, 4))
    H = H_kv * (draw(st.integers(1, 2)) if gqa else 1)
    L = draw(st.integers(min_len, 33))
    S = draw(st.integers(min_len, 33))
    D = draw(st.integers(1, 17))
    Dv = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_kv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, S, Dv, generator=g, dtype=torch.float64)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(draw(st.sampled_from([1, B])), 1, L, S, generator=g) > draw(
            st.floats(0.0, 0.8)
        )
    return q, k, v, mask, g


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(gqa=False))
def test_h1_permutation_equivariance(backend, p):
    q, k, v, mask, g = p
    L, S = q.shape[2], k.shape[2]
    out = attnlab.attention(q, k, v, mask=mask, backend=backend)
    pq, pk = torch.randperm(L, generator=g), torch.randperm(S, generator=g)
    m_perm = None if mask is None else mask[:, :, pq][:, :, :, pk]
    out_q = attnlab.attention(
        q[:, :, pq], k, v, mask=None if mask is None else mask[:, :, pq], backend=backend
    )
    _close(out_q, out[:, :, pq])
    out_k = attnlab.attention(
        q, k[:, :, pk], v[:, :, pk], mask=None if mask is None else mask[..., pk], backend=backend
    )
    _close(out_k, out)
    out_both = attnlab.attention(
        q[:, :, pq], k[:, :, pk], v[:, :, pk], mask=m_perm, backend=backend
    )
    _close(out_both, out[:, :, pq])


@SETTINGS
@given(p=problems())
def test_h2_softmax_rows(p):
    q, k, v, mask, _ = p
    _, w = attnlab.attention(q, k, v, mask=mask, return_weights=True)
    assert (w >= 0).all()
    B, H, L, S = w.shape
    allowed = torch.ones(B, H, L, S, dtype=torch.bool) if mask is None else mask.expand(B, H, L, S)
    has_key = allowed.any(-1)
    sums = w.sum(-1)
    assert torch.allclose(sums[has_key], torch.ones_like(sums[has_key]), atol=1e-12, rtol=0)
    assert torch.equal(sums[~has_key], torch.zeros_like(sums[~has_key]))
    assert torch.equal(w[~allowed], torch.zeros_like(w[~allowed]))


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(min_len=1))
def test_h3_convex_hull(backend, p):
    q, k, v, mask, _ = p
    out = attnlab.attention(q, k, v, mask=mask, backend=backend)
    B, H, L, _ = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    allowed = torch.ones(B, H, L, S, dtype=torch.bool) if mask is None else mask.expand(B, H, L, S)
    vv = v.repeat_interleave(H // H_kv, dim=1).unsqueeze(2)  # (B, H, 1, S, Dv)
    a = allowed.unsqueeze(-1)  # (B, H, L, S, 1)
    lo = torch.where(a, vv, torch.inf).amin(3)
    hi = torch.where(a, vv, -torch.inf).amax(3)
    has = allowed.any(-1)
    eps = 1e-12
    assert (out[has] >= lo[has] - eps).all() and (out[has] <= hi[has] + eps).all()
    assert torch.equal(out[~has], torch.zeros_like(out[~has]))


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(), shift=st.floats(-50, 50))
def test_h4_row_shift_invariance(backend, p, shift):
    q, k, v, mask, g = p
    B, H, L, _ = q.shape
    row_const = torch.randn(B, H, L, 1, generator=g, dtype=torch.float64) * shift
    a = attnlab.attention(q, k, v, mask=mask, backend=backend)
    b = attnlab.attention(q, k, v, mask=mask, bias=row_const, backend=backend)
    _close(a, b, 1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(), window=st.integers(1, 40))
def test_h6_mask_equivalences(backend, p, window):
    q, k, v, mask, _ = p
    L, S = q.shape[2], k.shape[2]
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
        _close(
            attnlab.attention(q, k, v, mask=mask, backend=backend),
            attnlab.attention(q, k, v, mask=additive, backend=backend),
        )
    # causal equals the bottom-right tril
    tril = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
    causal = attnlab.attention(q, k, v, mask=masks.causal(), backend=backend)
    _close(causal, attnlab.attention(q, k, v, mask=tril, backend=backend))
    if window >= S:
        _close(
            attnlab.attention(q, k, v, mask=masks.sliding_window(window), backend=backend), causal
        )
    # an all-True mask equals no mask
    everything = torch.ones(L, S, dtype=torch.bool)
    _close(
        attnlab.attention(q, k, v, mask=everything, backend=backend),
        attnlab.attention(q, k, v, backend=backend),
    )
    # a padding mask equals the matching dense mask
    B = q.shape[0]
    lengths = torch.randint(0, S + 1, (B,))
    dense = (torch.arange(S) < lengths.view(B, 1, 1, 1)).expand(B, 1, L, S)
    _close(
        attnlab.attention(q, k, v, mask=masks.padding(lengths), backend=backend),
        attnlab.attention(q, k, v, mask=dense, backend=backend),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems())
def test_h10_gqa_equals_repeat_interleave(backend, p):
    q, k, v, mask, _ = p
    G = q.shape[1] // k.shape[1]
    a = attnlab.attention(q, k, v, mask=mask, backend=backend)
    b = attnlab.attention(
        q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), mask=mask, backend=backend
    )
    _close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_groups_consecutive_heads_not_tiled(backend):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    a = attnlab.attention(q, k, v, backend=backend)
    tiled = attnlab.attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), backend=backend)
    assert not torch.allclose(a, tiled)  # query heads 0,1 share kv head 0 (C3)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(), a=st.floats(0.1, 5.0), s=st.floats(0.05, 2.0))
def test_h11_scale(backend, p, a, s):
    q, k, v, mask, _ = p
    _close(
        attnlab.attention(q * a, k, v, scale=s, mask=mask, backend=backend),
        attnlab.attention(q, k, v, scale=a * s, mask=mask, backend=backend),
        1e-9,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(), alpha=st.floats(-3, 3), beta=st.floats(-3, 3))
def test_h12_linearity_batch_independence_head_order(backend, p, alpha, beta):
    q, k, v, mask, g = p
    v2 = torch.randn(v.shape, generator=g, dtype=torch.float64)
    lhs = attnlab.attention(q, k, alpha * v + beta * v2, mask=mask, backend=backend)
    rhs = alpha * attnlab.attention(q, k, v, mask=mask, backend=backend) + beta * attnlab.attention(
        q, k, v2, mask=mask, backend=backend
    )
    _close(lhs, rhs, 1e-9)
    full = attnlab.attention(q, k, v, mask=mask, backend=backend)
    for b in range(q.shape[0]):
        mb = (
            None
            if mask is None
            else mask[b if mask.shape[0] > 1 else 0 : (b if mask.shape[0] > 1 else 0) + 1]
        )
        _close(
            attnlab.attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask=mb, backend=backend),
            full[b : b + 1],
        )
    # reversing the kv heads together with their query groups reverses the output heads
    H, H_kv = q.shape[1], k.shape[1]
    G = H // H_kv
    kv_order = torch.arange(H_kv).flip(0)
    q_order = (kv_order.view(-1, 1) * G + torch.arange(G)).flatten()
    out = attnlab.attention(
        q[:, q_order], k[:, kv_order], v[:, kv_order], mask=mask, backend=backend
    )
    _close(out, full[:, q_order])
