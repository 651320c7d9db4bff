"""FNet Fourier mixing and two-level hierarchical attention (issue #6) against their references."""

from __future__ import annotations

import math
import re

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import reference
from attnlab.linear import FNetMixing, HierarchicalAttention, fnet_mixing, hierarchical_attention
from attnlab.masks.patterns import KERNEL_MASKS
from helpers import FIXED_TABLE, check_against_reference, fwd_bwd, seeded
from nan_rule_linear import as_mask

F64 = torch.float64
FWD_ATOL, FWD_RTOL, GRAD_ATOL, GRAD_RTOL = FIXED_TABLE[F64]


def assert_fp64_equal(fast, ref, inputs, scale=1.0):
    out_f, grads_f = fwd_bwd(fast, inputs)
    out_r, grads_r = fwd_bwd(ref, inputs)
    torch.testing.assert_close(out_f, out_r, atol=FWD_ATOL * scale, rtol=FWD_RTOL)
    for gf, gr in zip(grads_f, grads_r, strict=True):
        torch.testing.assert_close(gf, gr, atol=GRAD_ATOL * scale, rtol=GRAD_RTOL)


# ------------------------------------------------------------------------------------- FNet


@pytest.mark.parametrize("shape", [(1, 1), (2, 17, 8), (3, 97, 40), (2, 2, 113, 80), (1, 1025, 64)])
def test_fnet_matches_explicit_dft_fp64(shape):
    x = seeded(*shape, seed=sum(shape))
    # outputs grow like √(L·E): the fixed fp64 table is scaled to that magnitude
    assert_fp64_equal(
        fnet_mixing,
        lambda x: reference.fnet_mixing(x),
        [x],
        scale=math.sqrt(shape[-1] * shape[-2]),
    )


@pytest.mark.parametrize(
    "dtype,L,E",
    [(dt, *size) for dt in (torch.float16, torch.bfloat16) for size in ((17, 8), (97, 40))]
    + [(torch.float32, 17, 8), (torch.float32, 1025, 64)],
)
def test_fnet_tolerance_rule(dtype, L, E):
    """The rule on the unitary-scaled transform ``fnet(x) / √(L·E)`` (unit-size values)."""
    c = 1.0 / math.sqrt(L * E)
    check_against_reference(
        lambda x: fnet_mixing(x) * c,
        lambda x, compute_dtype, reorder: (
            reference.fnet_mixing(x, compute_dtype=compute_dtype, reorder=reorder) * c
        ),
        [seeded(2, L, E, dtype=dtype, seed=L)],
    )


def test_fnet_hand_values():
    x = torch.ones(1, 4, 6, dtype=F64)  # DFT of a constant: everything lands on frequency (0, 0)
    out = fnet_mixing(x)
    expected = torch.zeros_like(x)
    expected[0, 0, 0] = 24.0
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    # a single impulse at (1, 0): Re(exp(−2πi·j/L)) = cos(2πj/L) on every column
    y = torch.zeros(5, 3, dtype=F64)
    y[1, 0] = 1.0
    cos = torch.cos(2 * math.pi * torch.arange(5, dtype=F64) / 5)
    torch.testing.assert_close(fnet_mixing(y), cos[:, None].expand(5, 3), atol=1e-12, rtol=0)


def test_fnet_half_inputs_compute_in_fp32_and_module_matches():
    x = seeded(2, 33, 16, dtype=torch.float16)
    out = fnet_mixing(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, fnet_mixing(x.float()).half())
    mix = FNetMixing()
    assert list(mix.parameters()) == []
    assert torch.equal(mix(x), out)
    empty = torch.zeros(2, 0, 16, requires_grad=True)
    assert fnet_mixing(empty).shape == (2, 0, 16)


def test_fnet_errors():
    with pytest.raises(ValueError, match=r"x must have rank >= 2 \(..., L, E\), got shape \(5,\)"):
        fnet_mixing(torch.randn(5))
    with pytest.raises(TypeError, match=r"x dtype must be one of .* got torch.int64"):
        fnet_mixing(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        fnet_mixing([[1.0]])


# ----------------------------------------------------------------------------- hierarchical


def qkv(B=2, H=4, H_kv=2, L=17, D=8, Dv=5, dtype=F64, seed=0):
    return (
        seeded(B, H, L, D, dtype=dtype, seed=seed),
        seeded(B, H_kv, L, D, dtype=dtype, seed=seed + 1),
        seeded(B, H_kv, L, Dv, dtype=dtype, seed=seed + 2),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "L,D,block", [(1, 8, 1), (17, 40, 3), (17, 8, 4), (97, 8, 16), (113, 40, 10), (97, 3, 200)]
)
def test_hierarchical_matches_reference_fp64(causal, L, D, block):
    inputs = qkv(L=L, D=D, Dv=7, seed=L + block)
    assert_fp64_equal(
        lambda q, k, v: hierarchical_attention(
            q, k, v, block_size=block, mask=as_mask(causal, None)
        ),
        lambda q, k, v: reference.hierarchical_attention(
            q, k, v, block_size=block, mask=as_mask(causal, None)
        ),
        inputs,
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,L", [(torch.float32, 257), (torch.bfloat16, 97)])
def test_hierarchical_tolerance_rule(causal, dtype, L):
    check_against_reference(
        lambda q, k, v: hierarchical_attention(q, k, v, block_size=16, mask=as_mask(causal, None)),
        lambda q, k, v, compute_dtype, reorder: reference.hierarchical_attention(
            q,
            k,
            v,
            block_size=16,
            compute_dtype=compute_dtype,
            reorder=reorder,
            mask=as_mask(causal, None),
        ),
        list(qkv(L=L, D=64, Dv=64, dtype=dtype, seed=5)),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_hierarchical_equals_attention_with_block_mean_keys(causal):
    """A second, independent statement of the definition: full softmax attention in which
    every key/value outside the query's block is replaced by its block mean (for causal:
    earlier blocks only, and j <= i inside the block)."""
    L, b = 23, 5
    q, k, v = qkv(B=1, H=2, H_kv=2, L=L, seed=3)
    out = hierarchical_attention(q, k, v, block_size=b, mask=as_mask(causal, None))
    blk = torch.arange(L) // b
    for i in (0, 4, 5, 12, 22):
        same = blk == blk[i]
        k_eff, v_eff = k[:, :, :].clone(), v.clone()
        for J in blk.unique():
            cols = blk == J
            if blk[i] != J:
                k_eff[:, :, cols] = k[:, :, cols].mean(2, keepdim=True)
                v_eff[:, :, cols] = v[:, :, cols].mean(2, keepdim=True)
        allowed = torch.ones(L, dtype=torch.bool)
        if causal:
            allowed = (blk < blk[i]) | (same & (torch.arange(L) <= i))
        else:
            allowed = torch.ones(L, dtype=torch.bool)
        logits = (q[:, :, i : i + 1] @ k_eff.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        torch.testing.assert_close(out[:, :, i : i + 1], p @ v_eff, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [1, 64])
def test_hierarchical_degenerates_to_exact_attention(causal, block):
    """b = 1 (every summary is one token) and b >= L (one block) are exact softmax attention."""
    q, k, v = qkv(L=29)
    exact = attnlab.attention(q, k, v, mask=masks.causal() if causal else None, backend="reference")
    out = hierarchical_attention(q, k, v, block_size=block, mask=as_mask(causal, None))
    torch.testing.assert_close(out, exact, atol=1e-12, rtol=0)
    # an intermediate block size is an approximation, not exact attention
    approx = hierarchical_attention(q, k, v, block_size=4, mask=as_mask(causal, None))
    assert (approx - exact).abs().max() > 1e-3


def test_hierarchical_causal_ignores_the_future_and_three_d_and_module():
    q, k, v = qkv(L=20)
    out = hierarchical_attention(q, k, v, block_size=6, mask=masks.causal())
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 13:] = 5.0
    v2[:, :, 13:] = -5.0
    out2 = hierarchical_attention(q, k2, v2, block_size=6, mask=masks.causal())
    assert torch.equal(out[:, :, :13], out2[:, :, :13])
    out3 = hierarchical_attention(q[:, 0], k[:, 0], v[:, 0], block_size=6, mask=masks.causal())
    q1 = q[:, :1]
    one_head = hierarchical_attention(q1, k[:, :1], v[:, :1], block_size=6, mask=masks.causal())
    torch.testing.assert_close(out3, one_head[:, 0], atol=0, rtol=0)
    mod = HierarchicalAttention(6, scale=0.3)
    torch.testing.assert_close(
        mod(q, k, v, mask=masks.causal()),
        reference.hierarchical_attention(q, k, v, block_size=6, scale=0.3, mask=masks.causal()),
        atol=1e-12,
        rtol=0,
    )
    q0, k0, v0 = qkv(L=0)
    assert hierarchical_attention(q0, k0, v0, block_size=4).shape == (2, 4, 0, 5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "L,block,lengths", [(17, 4, [17, 9]), (97, 10, [0, 41]), (113, 16, [3, 96])]
)
def test_hierarchical_padding_matches_reference_fp64(causal, L, block, lengths):
    """Padded keys leave both levels: blocks average their real keys, an empty block is no
    summary, a row with no key is zeros (forward and backward against the float64 reference)."""
    mask = masks.padding(lengths) if not causal else masks.causal() & masks.padding(lengths)
    inputs = qkv(L=L, D=8, Dv=7, seed=L + block)
    assert_fp64_equal(
        lambda q, k, v: hierarchical_attention(q, k, v, block_size=block, mask=mask),
        lambda q, k, v: reference.hierarchical_attention(q, k, v, block_size=block, mask=mask),
        inputs,
    )


def test_hierarchical_padding_equals_the_truncated_sequence_and_hides_nan():
    """The real rows of a padded batch item equal hierarchical attention of its real prefix."""
    q, k, v = qkv(L=23, seed=4)
    n = 14
    out = hierarchical_attention(q, k, v, block_size=5, mask=masks.padding([n, 23]))
    short = hierarchical_attention(q[:1, :, :n], k[:1, :, :n], v[:1, :, :n], block_size=5)
    torch.testing.assert_close(out[:1, :, :n], short, atol=1e-12, rtol=0)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, n:], v_bad[0, :, n:] = float("nan"), float("inf")
    again = hierarchical_attention(q, k_bad, v_bad, block_size=5, mask=masks.padding([n, 23]))
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    empty = hierarchical_attention(q, k, v, block_size=5, mask=masks.padding([0, 23]))
    assert torch.equal(empty[0], torch.zeros_like(empty[0]))


@pytest.mark.parametrize(
    "mask",
    [masks.sliding_window(3), masks.causal() | masks.padding([3, 6]), torch.ones(6, 6).bool()],
    ids=["window", "union", "tensor"],
)
def test_hierarchical_refuses_other_masks_before_any_work(mask):
    q, k, v = qkv(L=6)
    with pytest.raises(
        ValueError,
        match=re.escape(f"hierarchical_attention: mask must be {KERNEL_MASKS}, got "),
    ):
        hierarchical_attention(q, k, v, block_size=2, mask=mask)


def test_hierarchical_errors():
    q, k, v = qkv(L=6)
    with pytest.raises(ValueError, match=r"query length L=6 must equal key length S=5"):
        hierarchical_attention(q, k[:, :, :5], v[:, :, :5], block_size=2)
    with pytest.raises(ValueError, match=r"block_size must be >= 1, got 0"):
        hierarchical_attention(q, k, v, block_size=0)
    with pytest.raises(TypeError, match=r"block_size must be an int, got float 2.0"):
        hierarchical_attention(q, k, v, block_size=2.0)
    with pytest.raises(ValueError, match=r"scale must be non-zero, got 0"):
        hierarchical_attention(q, k, v, block_size=2, scale=0)
    with pytest.raises(ValueError, match=r"query head_dim 8 ≠ key head_dim 7"):
        hierarchical_attention(q, k[..., :7], v, block_size=2)
    with pytest.raises(ValueError, match=r"block_size must be >= 1, got -3"):
        HierarchicalAttention(-3)
