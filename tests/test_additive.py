"""AdditiveAttention (Bahdanau) against its formula, with the library's mask semantics."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import reference
from helpers import seeded


def _module(dq=6, dk=5, hd=7, seed=0):
    torch.manual_seed(seed)
    return attnlab.AdditiveAttention(dq, dk, hd).double()


def _by_hand(m, query, key, value, allowed=None):
    """e_ij = vᵀ tanh(W_q q_i + W_k k_j + b), written out with explicit loops."""
    B, L, _ = query.shape
    S = key.shape[1]
    e = torch.empty(B, L, S, dtype=query.dtype)
    for b in range(B):
        for i in range(L):
            for j in range(S):
                h = (
                    m.query_proj.weight @ query[b, i]
                    + m.key_proj.weight @ key[b, j]
                    + m.key_proj.bias
                )
                e[b, i, j] = m.v @ torch.tanh(h)
    if allowed is not None:
        e = e.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(e, -1)
    return w @ value, w


def test_matches_formula():
    m = _module()
    q, k, v = seeded(2, 3, 6, seed=1), seeded(2, 4, 5, seed=2), seeded(2, 4, 3, seed=3)
    out, w = m(q, k, v)
    want_out, want_w = _by_hand(m, q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, want_w, atol=1e-12, rtol=0)
    # value defaults to key; a 2-D query is one query per batch item
    out_k, _ = m(q, k)
    torch.testing.assert_close(out_k, _by_hand(m, q, k, k)[0], atol=1e-12, rtol=0)
    out1, w1 = m(q[:, 0], k, v)
    assert out1.shape == (2, 3) and w1.shape == (2, 4)
    torch.testing.assert_close(out1, out[:, 0], atol=1e-12, rtol=0)


def test_masks_and_fully_masked_rows():
    m = _module()
    q, k, v = seeded(2, 5, 6, seed=4), seeded(2, 5, 5, seed=5), seeded(2, 5, 3, seed=6)
    mask = masks.causal() & masks.padding([5, 3])
    out, w = m(q, k, v, mask=mask)
    allowed = mask.to_dense(5, 5, batch=2)[:, 0]
    want_out, want_w = _by_hand(m, q, k, v, allowed)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(w, want_w, atol=1e-12, rtol=0)
    rows = torch.ones(5, 5, dtype=torch.bool)
    rows[2] = False
    qg = q.clone().requires_grad_()
    out, w = m(qg, k, v, mask=rows)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2])) and torch.equal(
        w[:, 2], torch.zeros_like(w[:, 2])
    )
    (dq,) = torch.autograd.grad(out.sum(), (qg,))
    assert torch.isfinite(dq).all() and torch.equal(dq[:, 2], torch.zeros_like(dq[:, 2]))


def test_nan_in_padded_keys_does_not_leak():
    m = _module()
    q, k, v = seeded(1, 3, 6, seed=7), seeded(1, 4, 5, seed=8), seeded(1, 4, 3, seed=9)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, 3], v_bad[0, 3] = float("nan"), float("nan")
    k_zero, v_zero = k.clone(), v.clone()
    k_zero[0, 3], v_zero[0, 3] = 0.0, 0.0
    pad = masks.padding([3])
    assert torch.equal(m(q, k_bad, v_bad, mask=pad)[0], m(q, k_zero, v_zero, mask=pad)[0])


def test_gradcheck():
    m = _module(4, 3, 5)
    q = seeded(2, 3, 4, seed=1).requires_grad_()
    k = seeded(2, 4, 3, seed=2).requires_grad_()
    v = seeded(2, 4, 2, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v: m(q, k, v, mask=masks.causal())[0], (q, k, v))


def test_float32_close_to_float64():
    m64 = _module()
    m32 = attnlab.AdditiveAttention(6, 5, 7)
    m32.load_state_dict({n: p.float() for n, p in m64.state_dict().items()})
    q, k = seeded(2, 9, 6, seed=1), seeded(2, 11, 5, seed=2)
    torch.testing.assert_close(
        m32(q.float(), k.float())[0].double(), m64(q, k)[0], atol=2e-6, rtol=1e-5
    )


def test_bad_input():
    with pytest.raises(ValueError, match=r"hidden_dim must be >= 1, got 0"):
        attnlab.AdditiveAttention(4, 4, 0)
    m = _module()
    with pytest.raises(
        ValueError, match=r"query last dim must be query_dim=6, got shape \(2, 3, 5\)"
    ):
        m(torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"key last dim must be key_dim=5"):
        m(torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 3\) is not broadcastable"):
        m(
            torch.randn(2, 3, 6, dtype=torch.float64),
            torch.randn(2, 4, 5, dtype=torch.float64),
            mask=torch.ones(3, 3, dtype=torch.bool),
        )
    with pytest.raises(TypeError, match=r"share one float dtype"):
        m(torch.randn(2, 3, 6), torch.randn(2, 4, 5, dtype=torch.float64))


def test_nan_rule_additive_attention():
    """A NaN value of a key that a row may not attend never reaches it (no 0 · NaN leak)."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 6), torch.randn(1, 5, 6), torch.randn(1, 5, 3)
    value[0, 4, 1] = float("nan")
    key[0, 3, 0] = float("inf")
    keep = torch.tensor([[True, True, False, False, False]] * 2 + [[True] * 5] * 2)
    hd = 7
    out, w = reference.additive_attention(
        query,
        key,
        value,
        w_q=torch.randn(hd, 6),
        w_k=torch.randn(hd, 6),
        b_k=None,
        w_v=torch.randn(hd),
        mask=keep.unsqueeze(0),
    )
    bad = ~torch.isfinite(out[0])
    assert not bad[:2].any()  # rows 0, 1 attend keys 0, 1 only
    assert bad[2:].all()  # rows 2, 3 attend key 3 (k = inf): whole rows
    assert torch.isfinite(w[0, :2]).all()


def test_bias_false_is_the_textbook_form_with_2d2_plus_d_parameters():
    torch.manual_seed(0)
    d = 12
    m = attnlab.AdditiveAttention(d, d, d, bias=False).double()
    assert m.key_proj.bias is None
    assert sum(p.numel() for p in m.parameters()) == 2 * d * d + d
    assert (
        sum(p.numel() for p in attnlab.AdditiveAttention(d, d, d).parameters()) == 2 * d * d + 2 * d
    )
    q, k, v = (torch.randn(2, n, d, dtype=torch.float64) for n in (3, 5, 5))
    e = torch.einsum(
        "h,blsh->bls",
        m.v,
        torch.tanh(
            (q @ m.query_proj.weight.T).unsqueeze(2) + (k @ m.key_proj.weight.T).unsqueeze(1)
        ),
    )  # vᵀ tanh(W_q q_i + W_k k_j), no bias
    w = torch.softmax(e, -1)
    out, weights = m(q, k, v)
    torch.testing.assert_close(weights, w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, w @ v, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="bias must be a bool"):
        attnlab.AdditiveAttention(d, d, d, bias=1)
