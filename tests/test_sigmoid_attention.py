"""Sigmoid attention (issue #42): ``(sigmoid(q·kᵀ·scale + b) ⊙ keep) @ v``, ``b = −log S``.

`reference.sigmoid_attention` is the definition; it is checked against the paper's formula written
out here (Ramapuram et al. 2024), and the tiled `functional.sigmoid.sigmoid_attention` against it
under the tolerance rule (odd sizes, forward and backward, masks), plus the block map's skipping,
fully masked rows, the NaN rule, bad input and one Inductor compile.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks
from attnlab.functional import reference, sigmoid_attention
from attnlab.functional import sigmoid as sigmoid_mod
from helpers import assert_exact_in_fp64, check_against_reference, seeded

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tiles gain nothing from threads


def qkv(dtype=torch.float64, *, b=2, h=4, h_kv=2, l=17, s=23, d=8, dv=None, seed=0):
    q = seeded(b, h, l, d, seed=seed).to(dtype)
    k = seeded(b, h_kv, s, d, seed=seed + 1).to(dtype)
    v = seeded(b, h_kv, s, dv or d, seed=seed + 2).to(dtype)
    return q, k, v


def ref_fn(mask=None, **kw):
    def ref(q, k, v, *, compute_dtype, reorder):  # reorder: one rounding order only
        return reference.sigmoid_attention(q, k, v, mask=mask, compute_dtype=compute_dtype, **kw)[0]

    return ref


def test_reference_is_the_papers_formula():
    """Written from the paper, not from attnlab: heads repeated, −log S bias, masked weights 0."""
    q, k, v = qkv(l=17, s=23, d=8)
    keep = torch.rand(2, 1, 17, 23, generator=torch.Generator().manual_seed(4)) > 0.4
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    p = torch.sigmoid(q @ kk.transpose(-1, -2) / math.sqrt(8) - math.log(23)) * keep
    out, weights = reference.sigmoid_attention(q, k, v, mask=keep)
    torch.testing.assert_close(weights, p, rtol=0, atol=1e-15)
    torch.testing.assert_close(out, p @ vv, rtol=0, atol=1e-14)
    assert reference.sigmoid_bias(23) == -math.log(23) and reference.sigmoid_bias(1) == 0.0


def _cases(L: int, S: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(L * 1000 + S)
    dense = torch.rand(2, 4, L, S, generator=gen) > 0.5
    dense[:, :, : min(L, 3)] = False  # fully masked rows
    return {
        "none": None,
        "causal": masks.causal(),
        "sliding_window": masks.sliding_window(9),
        "document": masks.document(torch.arange(S) * 3 // S) & masks.causal() if L == S else None,
        "padding": masks.padding(torch.tensor([S, max(1, S - 7)])),
        "tensor": dense,
    }


@pytest.mark.parametrize("L,S", [(1, 17), (17, 1), (97, 113), (113, 97), (97, 97)])
@pytest.mark.parametrize(
    "name", ["none", "causal", "sliding_window", "document", "padding", "tensor"]
)
def test_tiled_matches_reference(L, S, name):
    """float32 under the tolerance rule; float64 to 1e-12 (its naive run IS the golden one)."""
    mask = _cases(L, S)[name]

    def impl(q, k, v):
        return sigmoid_attention(q, k, v, mask=mask, block_q=32, block_k=16)

    check_against_reference(impl, ref_fn(mask), list(qkv(torch.float32, l=L, s=S, d=40, dv=24)))
    assert_exact_in_fp64(impl, ref_fn(mask), qkv(l=L, s=S, d=40, dv=24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal", "tensor"])
def test_tiled_tolerance_rule_low_precision(dtype, name):
    mask = _cases(113, 97)[name]
    q, k, v = qkv(dtype, l=113, s=97, d=64, seed=3)
    check_against_reference(lambda *x: sigmoid_attention(*x, mask=mask), ref_fn(mask), [q, k, v])


def test_scale_and_bias_arguments():
    check_against_reference(
        lambda *x: sigmoid_attention(*x, scale=0.3, bias=-1.5, block_q=5, block_k=7),
        ref_fn(scale=0.3, bias=-1.5),
        list(qkv(torch.float32)),
    )
    q, k, v = qkv()
    default = sigmoid_attention(q, k, v)
    explicit = sigmoid_attention(q, k, v, bias=-math.log(23))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


def test_empty_tiles_are_skipped(monkeypatch):
    """A sliding window of 9 over 97 keys in 16×16 tiles touches only the band's tiles."""
    seen = []
    real = sigmoid_mod._weights
    monkeypatch.setattr(sigmoid_mod, "_weights", lambda *a: seen.append(a[2]) or real(*a))
    q, k, v = qkv(l=97, s=97)
    mask = masks.sliding_window(9)
    sigmoid_attention(q, k, v, mask=mask, block_q=16, block_k=16)
    codes = mask.block_map(97, 97, 16, 16)
    assert len(seen) == int((codes > 0).sum()) < codes.numel()
    assert sum(t[4] for t in seen) == int((codes == 2).sum())  # FULL tiles skip the mask


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v = qkv()
    q[:, :, 0] = float("nan")  # a row that attends nothing is zeros whatever its q
    keep = torch.ones(1, 1, 17, 23, dtype=torch.bool)
    keep[..., :2, :] = False
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = sigmoid_attention(*xs, mask=keep, block_q=8, block_k=8)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.equal(xs[0].grad[:, :, :2], torch.zeros_like(xs[0].grad[:, :, :2]))


def test_nan_rule():
    """Non-finite q_i / attended k_j poison row i; attended v_j[d] poisons column d only; packed
    documents stay isolated."""
    L = 20
    ids = torch.arange(L) // 10  # two documents of 10
    mask = masks.document(ids) & masks.causal()
    q, k, v = qkv(l=L, s=L, h=2, h_kv=1)
    k[0, 0, 3] = float("inf")  # doc 0, rows 3..9 attend key 3
    v[1, 0, 12, 5] = float("nan")  # doc 1, rows 12..19 attend key 12
    q[1, 1, 15] = float("nan")
    got = sigmoid_attention(q, k, v, mask=mask, block_q=8, block_k=8)
    want, _ = reference.sigmoid_attention(q, k, v, mask=mask)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[0, :, 3:10]).all() and not torch.isnan(got[0, :, :3]).any()
    assert not torch.isnan(got[0, :, 10:]).any()  # the other document never sees k_3
    assert torch.isnan(got[1, :, 12:, 5]).all() and not torch.isnan(got[1, 0, 12:, :5]).any()
    assert torch.isnan(got[1, 1, 15]).all() and not torch.isnan(got[1, 1, 14, :5]).any()
    fin = ~torch.isnan(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=0, atol=1e-14)
    # gradients are those of the clean computation: finite, and zero at the non-finite inputs
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = sigmoid_attention(*xs, mask=mask, block_q=8, block_k=8)
    torch.where(torch.isnan(out), 0.0, out).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in xs)
    assert xs[1].grad[0, 0, 3].eq(0).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"scale": float("nan")}, "scale must be finite"),
        ({"bias": "log"}, "bias must be a real number"),
        ({"block_q": 0}, "block_q must be >= 1"),
        ({"block_k": 2.0}, "block_k must be an int"),
        ({"mask": torch.zeros(17, 23)}, "mask must be a bool tensor"),
        ({"mask": "causal"}, "mask must be an attnlab Mask"),
        ({"mask": torch.ones(17, 5, dtype=torch.bool)}, "not broadcastable to"),
        ({"mask": masks.padding(torch.tensor([3, 4, 5]))}, "expected a batch of 3"),
        ({"mask": masks.from_fn(lambda b, h, i, j: i >= j)}, "mask must have a structure spec"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError), match=match):
        sigmoid_attention(q, k, v, **kwargs)


def test_bad_tensors_are_named():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="must be 4-D"):
        sigmoid_attention(q[:, 0], k[:, 0], v[:, 0])
    with pytest.raises(ValueError, match="head_dim"):
        sigmoid_attention(q, k[..., :4], v)


@pytest.mark.usefixtures("fresh_dynamo")
def test_inductor_fullgraph_forward_backward():
    mask = masks.causal() & masks.padding(torch.tensor([97, 60]))
    q, k, v = qkv(torch.float32, l=97, s=97, d=40)
    fn = torch.compile(lambda q, k, v: sigmoid_attention(q, k, v, mask=mask), fullgraph=True)
    check_against_reference(fn, ref_fn(mask), [q, k, v])


@pytest.mark.slow
@pytest.mark.parametrize("L,S", [(1, 1025), (1025, 1), (17, 113), (1025, 1025), (113, 97)])
@pytest.mark.parametrize("D", [8, 40, 64, 80, 128])
@pytest.mark.parametrize("name", ["none", "causal", "sliding_window", "padding", "tensor"])
def test_odd_size_sweep_default_tiles(L, S, D, name):
    """The tolerance rule's odd sizes and head dims on the default tiles (float32)."""
    mask = _cases(L, S)[name]
    q, k, v = qkv(torch.float32, l=L, s=S, d=D, seed=L + D)
    check_against_reference(lambda *x: sigmoid_attention(*x, mask=mask), ref_fn(mask), [q, k, v])
