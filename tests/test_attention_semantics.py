"""The semantics pinned by the core issue and RELIABILITY sections A11 and B."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import reference
from helpers import GENERAL_BACKENDS, check_against_reference, seeded

BACKENDS = [*GENERAL_BACKENDS, "auto"]


def _grads(out, *xs, dout=None):
    dout = torch.ones_like(out) if dout is None else dout
    return torch.autograd.grad(out, xs, dout, allow_unused=True)


# --------------------------------------------------------------------- fully masked rows (B9)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "additive", "mask_object"])
def test_b9_fully_masked_row_is_zero_with_zero_grads(backend, kind):
    q = seeded(2, 3, 6, 8, seed=1).requires_grad_()
    k = seeded(2, 3, 7, 8, seed=2).requires_grad_()
    v = seeded(2, 3, 7, 5, seed=3).requires_grad_()
    allowed = torch.rand(2, 3, 6, 7, generator=torch.Generator().manual_seed(0)) > 0.4
    allowed[:, :, 2] = False  # row 2 fully masked
    allowed[1, 0, 4] = False
    if kind == "bool":
        mask = allowed
    elif kind == "additive":
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    else:
        mask = masks.from_tensor(allowed)
    out = attnlab.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(out[1, 0, 4], torch.zeros_like(out[1, 0, 4]))
    dq, dk, dv = _grads(out, q, k, v)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2]))
    if backend in ("reference", "auto"):
        _, w = attnlab.attention(q, k, v, mask=mask, return_weights=True)
        assert torch.equal(w[:, :, 2], torch.zeros_like(w[:, :, 2]))
    lse = reference.logsumexp(q, k, mask=allowed)
    assert torch.isneginf(lse[:, :, 2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_b10_finfo_min_row_is_uniform(backend):
    q, k, v = seeded(1, 2, 4, 8, seed=1), seeded(1, 2, 5, 8, seed=2), seeded(1, 2, 5, 3, seed=3)
    add = torch.zeros(4, 5, dtype=torch.float64)
    add[1] = torch.finfo(torch.float64).min
    out = attnlab.attention(q, k, v, mask=add, backend=backend)
    torch.testing.assert_close(out[:, :, 1], v.mean(dim=2), atol=1e-12, rtol=0)


# --------------------------------------------------------------------- NaN/inf hygiene (A11)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a11_nan_in_masked_key_value_never_reaches_output(backend, poison):
    q, k, v = seeded(2, 2, 5, 8, seed=4), seeded(2, 2, 6, 8, seed=5), seeded(2, 2, 6, 4, seed=6)
    pad = masks.padding([4, 6])
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 4:] = poison
    v_bad[0, :, 4:] = poison
    k_zero, v_zero = k.clone(), v.clone()
    k_zero[0, :, 4:] = 0
    v_zero[0, :, 4:] = 0
    qs = [x.clone().requires_grad_() for x in (q, k_bad, v_bad)]
    out_bad = attnlab.attention(*qs, mask=pad, backend=backend)
    out_zero = attnlab.attention(q, k_zero, v_zero, mask=pad, backend=backend)
    assert torch.isfinite(out_bad).all()
    assert torch.equal(out_bad, out_zero)
    grads = _grads(out_bad, *qs)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_real_inputs_propagates(backend):
    q, k, v = seeded(1, 1, 4, 8, seed=1), seeded(1, 1, 4, 8, seed=2), seeded(1, 1, 4, 8, seed=3)
    q[0, 0, 1, 3] = float("nan")
    out = attnlab.attention(q, k, v, backend=backend)
    assert torch.isnan(out[0, 0, 1]).all()
    assert torch.isfinite(out[0, 0, [0, 2, 3]]).all()
    v2 = v.clone()
    v2[0, 0, 2, 0] = float("nan")
    out2 = attnlab.attention(seeded(1, 1, 4, 8, seed=1), k, v2, backend=backend)
    assert torch.isnan(out2[..., 0]).all() and torch.isfinite(out2[..., 1:]).all()


# --------------------------------------------------------------------- empty inputs (B1–B4)
@pytest.mark.parametrize("backend", BACKENDS)
def test_b1_zero_queries(backend):
    q = torch.randn(2, 3, 0, 8, requires_grad=True)
    k = torch.randn(2, 3, 5, 8, requires_grad=True)
    v = torch.randn(2, 3, 5, 4, requires_grad=True)
    out = attnlab.attention(q, k, v, backend=backend)
    assert out.shape == (2, 3, 0, 4)
    dq, dk, dv = torch.autograd.grad(out.sum() + 0 * (k.sum() + v.sum()), (q, k, v))
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))
    assert dq.shape == q.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_b2_zero_keys_gives_exact_zeros(backend):
    q = torch.randn(2, 3, 4, 8, requires_grad=True)
    k = torch.randn(2, 3, 0, 8, requires_grad=True)
    v = torch.randn(2, 3, 0, 6, requires_grad=True)
    out = attnlab.attention(q, k, v, backend=backend, mask=masks.causal())
    assert out.shape == (2, 3, 4, 6) and torch.equal(out, torch.zeros_like(out))
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.equal(dq, torch.zeros_like(dq))
    _, w = attnlab.attention(q, k, v, return_weights=True)
    assert w.shape == (2, 3, 4, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,H,H_kv", [(0, 2, 2), (2, 0, 1), (0, 0, 0)])
def test_b3_empty_batch_or_heads(backend, B, H, H_kv):
    q, k, v = torch.randn(B, H, 3, 4), torch.randn(B, H_kv, 5, 4), torch.randn(B, H_kv, 5, 2)
    out = attnlab.attention(q, k, v, backend=backend)
    assert out.shape == (B, H, 3, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_b4_single_key_returns_value_exactly(backend):
    q, k, v = seeded(2, 3, 7, 8, seed=1), seeded(2, 3, 1, 8, seed=2), seeded(2, 3, 1, 5, seed=3)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        out = attnlab.attention(q.to(dtype), k.to(dtype), v.to(dtype), backend=backend)
        assert torch.equal(out, v.to(dtype).expand(2, 3, 7, 5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_b4_decode_shape_single_query(backend):
    q, k, v = (
        seeded(2, 4, 1, 16, seed=1),
        seeded(2, 2, 33, 16, seed=2),
        seeded(2, 2, 33, 16, seed=3),
    )
    out = attnlab.attention(q, k, v, mask=masks.causal(), backend=backend)
    want, _ = reference.attention(q, k, v)  # the last query sees every key
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


# --------------------------------------------------------------------- layout (B5, B7)
@pytest.mark.parametrize("backend", BACKENDS)
def test_b5_non_contiguous_inputs_bit_equal(backend):
    base_q = seeded(2, 7, 3, 16, seed=1, dtype=torch.float32)  # (B, L, H, D) storage
    q_nc = base_q.transpose(1, 2)  # (B, H, L, D), non-contiguous
    k_big = seeded(2, 3, 9, 24, seed=2, dtype=torch.float32)
    k_nc = k_big[..., :16]  # sliced last dim
    v_nc = seeded(1, 3, 9, 8, seed=3, dtype=torch.float32).expand(2, 3, 9, 8)  # stride-0 batch
    dout_base = seeded(2, 7, 3, 8, seed=4, dtype=torch.float32)
    dout_nc = dout_base.transpose(1, 2)
    runs = []
    for q, k, v, dout in (
        (q_nc, k_nc, v_nc, dout_nc),
        (q_nc.contiguous(), k_nc.contiguous(), v_nc.contiguous(), dout_nc.contiguous()),
    ):
        xs = [
            x.detach().clone().requires_grad_()
            if x.is_contiguous()
            else x.detach().requires_grad_()
            for x in (q, k, v)
        ]
        out = attnlab.attention(*xs, mask=masks.causal(), backend=backend)
        runs.append((out, *torch.autograd.grad(out, xs, dout)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_b7_value_dim_differs_from_key_dim(backend):
    q, k, v = (
        seeded(2, 2, 9, 64, seed=1),
        seeded(2, 2, 11, 64, seed=2),
        seeded(2, 2, 11, 32, seed=3),
    )
    out = attnlab.attention(q, k, v, backend=backend)
    assert out.shape == (2, 2, 9, 32)
    torch.testing.assert_close(out, reference.attention(q, k, v)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_d_inputs_are_one_head(backend):
    q, k, v = seeded(3, 5, 8, seed=1), seeded(3, 6, 8, seed=2), seeded(3, 6, 4, seed=3)
    mask = torch.rand(3, 5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    out = attnlab.attention(q, k, v, mask=mask, backend=backend)
    want = attnlab.attention(
        q[:, None], k[:, None], v[:, None], mask=mask[:, None], backend=backend
    )
    assert out.shape == (3, 5, 4)
    torch.testing.assert_close(out, want[:, 0], atol=0, rtol=0)


# --------------------------------------------------------------------- broadcasting (B8)
@pytest.mark.parametrize("backend", BACKENDS)
def test_b8_all_sixteen_mask_broadcast_patterns(backend):
    B, H, L, S = 2, 3, 5, 6
    q, k, v = seeded(B, H, L, 8, seed=1), seeded(B, H, S, 8, seed=2), seeded(B, H, S, 4, seed=3)
    g = torch.Generator().manual_seed(7)
    for pattern in itertools.product(*[(n, 1) for n in (B, H, L, S)]):
        m = torch.rand(*pattern, generator=g) > 0.3
        full = m.expand(B, H, L, S).contiguous()
        a = attnlab.attention(q, k, v, mask=m, backend=backend)
        b = attnlab.attention(q, k, v, mask=full, backend=backend)
        ran = [attnlab.explain(q, k, v, mask=x, backend=backend).backend for x in (m, full)]
        if ran[0] == ran[1]:
            assert torch.equal(a, b), pattern
        else:  # auto: a mask over keys alone (B|1, 1, 1, S) runs on the decode path
            assert ran == ["decode", "sdpa"] and pattern[1:3] == (1, 1), (pattern, ran)
            torch.testing.assert_close(a, b, atol=1e-14, rtol=0)
        bias = torch.randn(*pattern, generator=g, dtype=torch.float64)
        a = attnlab.attention(q, k, v, bias=bias, backend=backend)
        b = attnlab.attention(q, k, v, bias=bias.expand(B, H, L, S).contiguous(), backend=backend)
        torch.testing.assert_close(a, b, atol=1e-14, rtol=0)


# --------------------------------------------------------------------- large logits (B11)
@pytest.mark.parametrize("backend", BACKENDS)
def test_b11_large_logits_stay_finite(backend):
    bf = torch.full((1, 1, 4, 8), 133120.0, dtype=torch.bfloat16)
    out = attnlab.attention(bf, bf, bf, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), bf.double(), atol=0, rtol=0)
    g = torch.Generator().manual_seed(0)
    q16 = (torch.randn(1, 2, 16, 32, generator=g) * 300).half()
    k16 = (torch.randn(1, 2, 16, 32, generator=g) * 300).half()
    v16 = (torch.randn(1, 2, 16, 32, generator=g) * 300).half()
    out = attnlab.attention(q16, k16, v16, backend=backend)
    assert torch.isfinite(out).all()
    want, _ = reference.attention(q16.double(), k16.double(), v16.double())
    # scores ~1e4: softmax is nearly one-hot; fp16 values ~300 have a spacing of 0.25.
    torch.testing.assert_close(out.double(), want, atol=0.5, rtol=2e-3)


# --------------------------------------------------------------------- causal alignment (B12)
@pytest.mark.parametrize("backend", BACKENDS)
def test_b12_causal_equals_tril_and_aligns_bottom_right(backend):
    q, k, v = seeded(1, 2, 6, 8, seed=1), seeded(1, 2, 6, 8, seed=2), seeded(1, 2, 6, 4, seed=3)
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    a = attnlab.attention(q, k, v, mask=masks.causal(), backend=backend)
    b = attnlab.attention(q, k, v, mask=tril, backend=backend)
    torch.testing.assert_close(a, b, atol=1e-14, rtol=0)
    # L < S: the last query sees every key.
    qs = q[:, :, -2:]
    out = attnlab.attention(qs, k, v, mask=masks.causal(), backend=backend)
    torch.testing.assert_close(out, a[:, :, -2:], atol=1e-14, rtol=0)
    # L > S: the first L − S rows have no keys and are exactly 0.
    out = attnlab.attention(q, k[:, :, :4], v[:, :, :4], mask=masks.causal(), backend=backend)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    want, _ = reference.attention(
        q[:, :, 2:], k[:, :, :4], v[:, :, :4], mask=torch.ones(4, 4, dtype=torch.bool).tril()
    )
    torch.testing.assert_close(out[:, :, 2:], want, atol=1e-14, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_scale_with_causal_mask_matches_reference(backend):
    q, k, v = seeded(1, 2, 7, 8, seed=1), seeded(1, 2, 7, 8, seed=2), seeded(1, 2, 7, 4, seed=3)
    out = attnlab.attention(q, k, v, mask=masks.causal(), scale=-0.4, backend=backend)
    tril = torch.ones(7, 7, dtype=torch.bool).tril()
    want, _ = reference.attention(q, k, v, mask=tril, scale=-0.4)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


# --------------------------------------------------------------------- weights and temperature
def test_weights_rows_sum_to_one_and_are_nonnegative():
    q, k, v = seeded(2, 4, 9, 8, seed=1), seeded(2, 2, 11, 8, seed=2), seeded(2, 2, 11, 8, seed=3)
    m = masks.causal() & masks.padding([11, 7])
    out, w = attnlab.attention(q, k, v, mask=m, return_weights=True)
    assert (w >= 0).all()
    torch.testing.assert_close(
        w.sum(-1), torch.ones(2, 4, 9, dtype=torch.float64), atol=1e-12, rtol=0
    )
    dense = m.to_dense(9, 11, batch=2)
    assert torch.equal(w > 0, dense.expand(2, 4, 9, 11))
    # out is exactly weights @ v (with GQA: heads 2h, 2h+1 share kv head h)
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, dim=1), atol=1e-12, rtol=0)


def test_temperature_limits():
    q, k, v = seeded(1, 1, 5, 8, seed=1), seeded(1, 1, 7, 8, seed=2), seeded(1, 1, 7, 8, seed=3)
    _, hot = attnlab.attention(q, k, v, temperature=1e6, return_weights=True)
    torch.testing.assert_close(hot, torch.full_like(hot, 1 / 7), atol=1e-6, rtol=0)
    _, cold = attnlab.attention(q, k, v, temperature=1e-6, return_weights=True)
    logits = q @ k.transpose(-1, -2)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), 7).double()
    torch.testing.assert_close(cold, onehot, atol=1e-9, rtol=0)
    entropies = []
    for t in (0.25, 0.5, 1.0, 2.0, 4.0):
        _, w = attnlab.attention(q, k, v, temperature=t, return_weights=True)
        entropies.append(float(-(w * w.clamp_min(1e-300).log()).sum(-1).mean()))
    assert entropies == sorted(entropies), entropies


def test_scaling_keeps_logit_variance_near_one():
    g = torch.Generator().manual_seed(0)
    for D in (16, 64, 256):
        q = torch.randn(4, 8, 256, D, generator=g, dtype=torch.float64)
        k = torch.randn(4, 8, 256, D, generator=g, dtype=torch.float64)
        raw = (q @ k.transpose(-1, -2)).var().item()
        scaled = (q @ k.transpose(-1, -2) / math.sqrt(D)).var().item()
        assert abs(raw / D - 1) < 0.05, (D, raw)
        assert abs(scaled - 1) < 0.05, (D, scaled)
    # and attnlab's default scale is exactly 1/sqrt(D)
    q, k, v = seeded(1, 1, 4, 64, seed=1), seeded(1, 1, 4, 64, seed=2), seeded(1, 1, 4, 64, seed=3)
    torch.testing.assert_close(
        attnlab.attention(q, k, v), attnlab.attention(q, k, v, scale=1 / 8), atol=0, rtol=0
    )


def test_cosine_score_is_scale_invariant_in_inputs():
    q, k, v = seeded(1, 2, 5, 8, seed=1), seeded(1, 2, 6, 8, seed=2), seeded(1, 2, 6, 4, seed=3)
    a, w = attnlab.attention(q, k, v, score="cosine", return_weights=True)
    b = attnlab.attention(q * 7.0, k * 0.01, v, score="cosine")
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    cos = torch.nn.functional.cosine_similarity(q.unsqueeze(3), k.unsqueeze(2), dim=-1)
    torch.testing.assert_close(w, torch.softmax(cos, -1), atol=1e-12, rtol=0)


# --------------------------------------------------------------------- dropout (B13)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_dropout_p0_bit_equal_and_seeded_reproducible(backend):
    q, k, v = (
        seeded(2, 2, 16, 8, seed=1, dtype=torch.float32),
        seeded(2, 2, 16, 8, seed=2, dtype=torch.float32),
        seeded(2, 2, 16, 8, seed=3, dtype=torch.float32),
    )
    assert torch.equal(
        attnlab.attention(q, k, v, dropout_p=0.0, backend=backend),
        attnlab.attention(q, k, v, backend=backend),
    )
    torch.manual_seed(5)
    a = attnlab.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(5)
    b = attnlab.attention(q, k, v, dropout_p=0.3, backend=backend)
    assert torch.equal(a, b)
    assert not torch.allclose(a, attnlab.attention(q, k, v, backend=backend))


def test_dropout_kept_fraction_and_unbiased():
    q, k, v = (
        seeded(4, 4, 128, 8, seed=1),
        seeded(4, 4, 128, 8, seed=2),
        seeded(4, 4, 128, 8, seed=3),
    )
    torch.manual_seed(0)
    _, w = attnlab.attention(q, k, v, dropout_p=0.25, return_weights=True, backend="reference")
    kept = (w > 0).double().mean().item()
    assert abs(kept - 0.75) <= 0.01  # 262144 elements
    _, w0 = attnlab.attention(q, k, v, return_weights=True)
    torch.testing.assert_close(w[w > 0], (w0 / 0.75)[w > 0], atol=1e-12, rtol=0)


# --------------------------------------------------------------------- cross-check helper
@pytest.mark.parametrize("backend", ["sdpa"])
def test_cross_attention_with_gqa_float32_rule(backend):
    q = seeded(3, 8, 31, 64, dtype=torch.float32, seed=1)
    k = seeded(3, 2, 47, 64, dtype=torch.float32, seed=2)
    v = seeded(3, 2, 47, 48, dtype=torch.float32, seed=3)

    def ref(q, k, v, compute_dtype, reorder):
        return reference.attention(q, k, v, compute_dtype=compute_dtype, reorder=reorder)[0]

    check_against_reference(
        lambda q, k, v: attnlab.attention(q, k, v, backend=backend), ref, [q, k, v]
    )
