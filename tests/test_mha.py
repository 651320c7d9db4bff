"""MultiHeadAttention against its formula; GQA (C1–C3), pruning, RoPE and bias plumbing."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.modules import MultiHeadAttention
from attnlab.positional import ALiBi, RoPE


def _by_hand(m: MultiHeadAttention, x: torch.Tensor, mask=None) -> torch.Tensor:
    """softmax(Q Kᵀ/√D + mask) V per head, with explicit per-head weight slices."""
    H, H_kv, D = m.num_heads, m.num_kv_heads, m.head_dim
    W = m.qkv_proj.weight
    b = m.qkv_proj.bias
    outs = []
    for h in range(H):
        g = h // (H // H_kv)
        wq, bq = W[h * D : (h + 1) * D], b[h * D : (h + 1) * D]
        ko = H * D + g * D
        vo = H * D + H_kv * D + g * D
        q = x @ wq.T + bq
        k = x @ W[ko : ko + D].T + b[ko : ko + D]
        v = x @ W[vo : vo + D].T + b[vo : vo + D]
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.softmax(s, -1) @ v)
    return m.out_proj(torch.cat(outs, dim=-1))


@pytest.mark.parametrize("kv_heads", [None, 4, 2, 1])
def test_matches_per_head_formula(kv_heads):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=kv_heads).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    tril = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(m(x), _by_hand(m, x), atol=1e-12, rtol=0)
    torch.testing.assert_close(m(x, mask=masks.causal()), _by_hand(m, x, tril), atol=1e-12, rtol=0)
    _, w = m(x, mask=masks.causal(), need_weights=True)
    assert w.shape == (2, 4, 9, 9) and torch.equal(w > 0, tril.expand(2, 4, 9, 9))


def test_c1_c2_errors_before_compute():
    with pytest.raises(ValueError, match=r"embed_dim=30 must be divisible by num_heads=4"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match=r"num_heads=6 must be divisible by num_kv_heads=4"):
        MultiHeadAttention(24, 6, num_kv_heads=4)
    m = MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match=r"query must be \(B, L, embed_dim=16\), got \(2, 3, 8\)"):
        m(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"backend must be one of"):
        MultiHeadAttention(16, 2, backend="gpu")


def test_c3_gqa_equals_mha_with_repeat_interleaved_kv_not_tiled():
    torch.manual_seed(1)
    gqa = MultiHeadAttention(32, 4, num_kv_heads=2).double()
    mha = MultiHeadAttention(32, 4).double()
    D = 8
    (wq, bq), (wk, bk), (wv, bv) = gqa.projection_weights()

    def interleave(t):
        return t.view(2, D, *t.shape[1:]).repeat_interleave(2, 0).reshape(4 * D, *t.shape[1:])

    with torch.no_grad():
        mha.qkv_proj.weight.copy_(torch.cat([wq, interleave(wk), interleave(wv)]))
        mha.qkv_proj.bias.copy_(torch.cat([bq, interleave(bk), interleave(bv)]))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(
        gqa(x, mask=masks.causal()), mha(x, mask=masks.causal()), atol=1e-12, rtol=0
    )
    with torch.no_grad():  # tiling (repeat) pairs query heads with the wrong kv heads

        def tile(t):
            return (
                t.view(2, D, *t.shape[1:]).repeat(2, *([1] * t.dim())).reshape(4 * D, *t.shape[1:])
            )

        mha.qkv_proj.weight.copy_(torch.cat([wq, tile(wk), tile(wv)]))
        mha.qkv_proj.bias.copy_(torch.cat([bq, tile(bk), tile(bv)]))
    assert not torch.allclose(gqa(x), mha(x))


def test_cross_attention_separate_projections():
    torch.manual_seed(2)
    m = MultiHeadAttention(16, 2, kdim=12, vdim=10).double()
    x, mem_k, mem_v = (
        torch.randn(2, 5, 16, dtype=torch.float64),
        torch.randn(2, 7, 12, dtype=torch.float64),
        torch.randn(2, 7, 10, dtype=torch.float64),
    )
    out = m(x, mem_k, mem_v, mask=masks.padding([7, 3]))
    q = m.q_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    k = m.k_proj(mem_k).view(2, 7, 2, 8).transpose(1, 2)
    v = m.v_proj(mem_v).view(2, 7, 2, 8).transpose(1, 2)
    ref = attnlab.attention(q, k, v, mask=masks.padding([7, 3]), backend="reference")
    torch.testing.assert_close(
        out, m.out_proj(ref.transpose(1, 2).reshape(2, 5, 16)), atol=1e-12, rtol=0
    )
    with pytest.raises(ValueError, match=r"self-attention needs kdim = vdim = embed_dim"):
        m(x)


def test_fused_projection_serves_cross_attention_too():
    torch.manual_seed(3)
    m = MultiHeadAttention(16, 4).double()
    x, mem = torch.randn(1, 3, 16, dtype=torch.float64), torch.randn(1, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x, x), m(x), atol=1e-12, rtol=0)
    assert m(x, mem).shape == (1, 3, 16)


def test_rope_and_bias_fn_are_applied():
    torch.manual_seed(4)
    rope, alibi = RoPE(8), ALiBi(4)
    m = MultiHeadAttention(32, 4, rope=rope, bias_fn=alibi).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q, k, v = m.project(x)
    ref = attnlab.attention(
        rope(q), rope(k), v, mask=masks.causal(), bias=alibi, backend="reference"
    )
    torch.testing.assert_close(
        m(x, mask=masks.causal()),
        m.out_proj(ref.transpose(1, 2).reshape(2, 6, 32)),
        atol=1e-12,
        rtol=0,
    )
    # with positions encoded, permuting tokens no longer permutes outputs
    perm = torch.tensor([3, 1, 0, 5, 2, 4])
    assert not torch.allclose(m(x[:, perm]), m(x)[:, perm])


@pytest.mark.parametrize(
    "kv_heads,prune", [(None, [1]), (None, [0, 3]), (2, [0, 1]), (2, [1, 3]), (1, [2])]
)
def test_prune_heads_shrinks_and_keeps_other_heads(kv_heads, prune):
    torch.manual_seed(5)
    m = MultiHeadAttention(32, 4, num_kv_heads=kv_heads).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    q, k, v = m.project(x)
    heads = attnlab.attention(q, k, v, mask=masks.causal())  # (B, H, L, D)
    keep = [h for h in range(4) if h not in prune]
    n_before = sum(p.numel() for p in m.parameters())
    m.prune_heads(prune)
    assert m.num_heads == len(keep)
    assert sum(p.numel() for p in m.parameters()) < n_before
    q2, k2, v2 = m.project(x)
    after = attnlab.attention(q2, k2, v2, mask=masks.causal())
    torch.testing.assert_close(after, heads[:, keep], atol=1e-12, rtol=0)
    assert m(x, mask=masks.causal()).shape == (2, 7, 32)


def test_prune_heads_errors():
    m = MultiHeadAttention(32, 4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
        m.prune_heads([4])
    with pytest.raises(ValueError, match=r"cannot prune all 4 heads"):
        m.prune_heads(range(4))
    with pytest.raises(ValueError, match=r"unequal sizes"):
        m.prune_heads([0])
    with pytest.raises(ValueError, match=r"per-head bias_fn"):
        MultiHeadAttention(32, 4, bias_fn=ALiBi(4)).prune_heads([0])
