"""Bad input raises before any computation, naming the argument and the values (RELIABILITY A)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks


def qkv(B=2, H=4, L=5, S=6, D=8, Dv=8, H_kv=None, dtype=torch.float32):
    H_kv = H if H_kv is None else H_kv
    return (
        torch.randn(B, H, L, D, dtype=dtype),
        torch.randn(B, H_kv, S, D, dtype=dtype),
        torch.randn(B, H_kv, S, Dv, dtype=dtype),
    )


def test_a1_mixed_dtypes_type_error_names_all_three():
    q, k, v = qkv()
    with pytest.raises(
        TypeError, match=r"query torch.float32, key torch.float64, value torch.float16"
    ):
        attnlab.attention(q, k.double(), v.half())


def test_integer_dtype_rejected():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"dtype must be one of .* got torch.int64"):
        attnlab.attention(q.long(), k.long(), v.long())


def test_non_tensor_rejected():
    _, k, v = qkv()
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got list"):
        attnlab.attention([1.0], k, v)


def test_a2_head_dim_mismatch():
    q, _, v = qkv()
    k = torch.randn(2, 4, 6, 7)
    with pytest.raises(ValueError, match=r"query head_dim 8 ≠ key head_dim 7"):
        attnlab.attention(q, k, v)


def test_a3_key_value_length_mismatch():
    q, k, _ = qkv()
    v = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"key length S=6 ≠ value length S=5"):
        attnlab.attention(q, k, v)


@pytest.mark.parametrize("shape", [(8,), (0,), ()])
def test_a4_bad_rank(shape):
    """Ranks 2 and above are SDPA's layouts ((L, D), (..., H, L, D): tests/test_torch_suites.py);
    rank 0 and 1 are refused."""
    q = torch.randn(shape)
    with pytest.raises(
        ValueError, match=rf"query must have rank 3 .* got rank {len(shape)} with shape"
    ):
        attnlab.attention(q, q, q)


def test_rank_mismatch_between_inputs():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"same rank"):
        attnlab.attention(q, k[:, 0], v)


def test_a5_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"query on cpu, key on meta"):
        attnlab.attention(q, k.to("meta"), v)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_a6_dropout_out_of_range(p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got"):
        attnlab.attention(q, k, v, dropout_p=p)


def test_a6_exact_message():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\), got -0.1$"):
        attnlab.attention(q, k, v, dropout_p=-0.1)


def test_a8_mask_not_broadcastable_quotes_both_shapes():
    q, k, v = qkv()
    bad = torch.ones(3, 1, 5, 6, dtype=torch.bool)
    with pytest.raises(
        ValueError,
        match=r"mask of shape \(3, 1, 5, 6\) is not broadcastable to "
        r"\(B, H, L, S\) = \(2, 4, 5, 6\)",
    ):
        attnlab.attention(q, k, v, mask=bad)
    with pytest.raises(ValueError, match=r"bias of shape \(5, 5\)"):
        attnlab.attention(q, k, v, bias=torch.zeros(5, 5))


def test_mask_object_batch_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"expected a batch of 3 .* got batch=2"):
        attnlab.attention(q, k, v, mask=masks.padding([1, 2, 3]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_a9_integer_mask_type_error(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"mask must be bool .* got {dtype}"):
        attnlab.attention(q, k, v, mask=torch.ones(5, 6, dtype=dtype))


def test_a9_float_mask_of_other_dtype_type_error():
    q, k, v = qkv()
    with pytest.raises(
        TypeError,
        match=r"mask float dtype must match the query dtype torch.float32, got torch.float64",
    ):
        attnlab.attention(q, k, v, mask=torch.zeros(5, 6, dtype=torch.float64))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, 0])
def test_a10_bad_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"scale must be"):
        attnlab.attention(q, k, v, scale=scale)


def test_a10_negative_scale_matches_reference():
    q, k, v = qkv(dtype=torch.float64)
    got = attnlab.attention(q, k, v, scale=-0.3)
    want, _ = attnlab.functional.reference.attention(q, k, v, scale=-0.3)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, attnlab.attention(q, k, v, scale=0.3))


@pytest.mark.parametrize("t", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_temperature(t):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"temperature must be"):
        attnlab.attention(q, k, v, temperature=t)


def test_gqa_heads_not_divisible():
    q, k, v = qkv(H=4, H_kv=3)
    with pytest.raises(
        ValueError, match=r"query heads H=4 must be a multiple of key/value heads H_kv=3"
    ):
        attnlab.attention(q, k, v)


def test_unknown_score_and_backend():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"score must be one of \['cosine', 'dot'\], got 'additive'"
    ):
        attnlab.attention(q, k, v, score="additive")
    with pytest.raises(ValueError, match=r"backend must be one of .* got 'cuda'"):
        attnlab.attention(q, k, v, backend="cuda")


def test_backend_that_cannot_serve_the_request_says_why():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run this call: .*return_weights"):
        attnlab.attention(q, k, v, backend="sdpa", return_weights=True)


def test_batch_and_value_heads_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        attnlab.attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"key heads 4 ≠ value heads 2"):
        attnlab.attention(q, k, v[:, :2])


def test_mask_wrong_type():
    q, k, v = qkv()
    with pytest.raises(
        TypeError,
        match=r"mask must be an attnlab Mask, a bool tensor or an additive float tensor, got list",
    ):
        attnlab.attention(q, k, v, mask=[[True]])


def test_errors_raise_before_any_computation(monkeypatch):
    """A bad argument must never reach a kernel."""
    import torch.nn.functional as F

    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1))
    q, k, v = qkv()
    for kwargs in (
        {"dropout_p": 2.0},
        {"scale": 0.0},
        {"score": "x"},
        {"mask": torch.ones(9, 9, dtype=torch.bool)},
    ):
        with pytest.raises(ValueError):
            attnlab.attention(q, k, v, **kwargs)
    assert calls == []
