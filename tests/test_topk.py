"""Content-dependent sparse attention (issue #43): exact top-k per row and block routing.

`reference.topk_attention` is checked against the definition written out row by row here (sort
by (−logit, key index), keep k, softmax), the tiled `functional.topk.topk_attention` against it
under the tolerance rule (odd sizes, forward and backward, masks, GQA, 3-D), plus ties, fully
masked rows, the NaN rule, memory (no L×S tensor), bad input and one Inductor compile.
`reference.routing_attention` is checked against MoBA's per-token gate written out here, and
`functional.routing.routing_attention` (flash backend, block-table mask) against it.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks
from attnlab.functional import reference, routing_attention, routing_mask, topk_attention
from attnlab.functional import topk as topk_mod
from attnlab.modules import RoutedAttention, TopKAttention
from helpers import (
    LargestTensor,
    assert_exact_in_fp64,
    check_against_reference,
    mean_factor_for,
    seeded,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tiles gain nothing from threads


def qkv(dtype=torch.float64, *, b=2, h=4, h_kv=2, l=17, s=23, d=8, dv=None, seed=0):
    q = seeded(b, h, l, d, seed=seed).to(dtype)
    k = seeded(b, h_kv, s, d, seed=seed + 1).to(dtype)
    v = seeded(b, h_kv, s, dv or d, seed=seed + 2).to(dtype)
    return q, k, v


def topk_ref(k_top, mask=None, **kw):
    def ref(q, k, v, *, compute_dtype, reorder):
        return reference.topk_attention(
            q, k, v, k_top=k_top, mask=mask, compute_dtype=compute_dtype, reorder=reorder, **kw
        )[0]

    return ref


def _cases(L: int, S: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(L * 1000 + S)
    dense = torch.rand(2, 4, L, S, generator=gen) > 0.5
    dense[:, :, : min(L, 3)] = False  # fully masked rows
    return {
        "none": None,
        "causal": masks.causal(),
        "sliding_window": masks.sliding_window(9),
        "padding": masks.padding(torch.tensor([S, max(1, S - 7)])),
        "tensor": dense,
    }


# ----------------------------------------------------------------------------- top-k: definition
def test_reference_topk_is_the_definition_row_by_row():
    """Written from the definition, not from attnlab: per row, the allowed keys sorted by
    (−logit, index), the first k kept, softmax over them; heads repeated for GQA."""
    q, k, v = qkv(l=9, s=13, d=8)
    keep = torch.rand(2, 1, 9, 13, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[0, 0, 0] = False  # a row with no key
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    logits = q @ kk.transpose(-1, -2) / math.sqrt(8)
    want = torch.zeros(2, 4, 9, 8, dtype=torch.float64)
    for b in range(2):
        for h in range(4):
            for i in range(9):
                allowed = [j for j in range(13) if keep[b, 0, i, j]]
                ranked = sorted(allowed, key=lambda j: (-float(logits[b, h, i, j]), j))[:4]
                if ranked:
                    w = torch.softmax(logits[b, h, i, ranked], dim=0)
                    want[b, h, i] = w @ vv[b, h, ranked]
    out, weights = reference.topk_attention(q, k, v, k_top=4, mask=keep)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-14)
    assert ((weights > 0).sum(-1) <= 4).all() and torch.equal(out[0, :, 0], torch.zeros(4, 8))


def test_ties_go_to_the_lowest_key_index():
    """Equal logits: the lowest indices are kept, in the reference and on tiles of every size."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0]])
    assert reference.topk_keep(logits, None, 2).tolist() == [[False, True, True] + [False] * 3]
    assert reference.topk_keep(logits, None, 4).tolist() == [[False] + [True] * 3 + [False, True]]
    # integer-valued q and k: exact logits, many ties across tile borders
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-2, 3, (1, 2, 11, 4), generator=gen).double()
    k = torch.randint(-2, 3, (1, 2, 37, 4), generator=gen).double()
    v = seeded(1, 2, 37, 3, seed=1)
    for k_top in (1, 2, 3, 6):
        want, w = reference.topk_attention(q, k, v, k_top=k_top)
        assert ((w > 0).sum(-1) == k_top).all()
        for bq, bk in ((4, 5), (3, 2), (128, 256)):
            got = topk_attention(q, k, v, k_top=k_top, block_q=bq, block_k=bk)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_k_at_least_the_allowed_count_is_ordinary_attention():
    q, k, v = qkv()
    for mask in (None, masks.causal()):
        want, _ = reference.attention(q, k, v, mask=None if mask is None else mask.to_dense(17, 23))
        torch.testing.assert_close(
            reference.topk_attention(q, k, v, k_top=23, mask=mask)[0], want, rtol=0, atol=1e-14
        )
        got = topk_attention(q, k, v, k_top=100, mask=mask, block_q=8, block_k=8)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


# ----------------------------------------------------------------------------- top-k: tiled path
_NAMES = ("none", "causal", "sliding_window", "padding", "tensor")
_DEFAULT = {(97, 113, n) for n in _NAMES} | {
    (1, 17, "tensor"),
    (17, 1, "padding"),
    (113, 97, "causal"),
}
_TOPK_CASES = [
    pytest.param(L, S, n, marks=() if (L, S, n) in _DEFAULT else pytest.mark.slow)
    for L, S in ((1, 17), (17, 1), (97, 113), (113, 97))
    for n in _NAMES
]


@pytest.mark.parametrize("L,S,name", _TOPK_CASES)
def test_tiled_topk_matches_reference(L, S, name):
    """float32 under the tolerance rule; float64 forward and backward to 1e-12; GQA, Dv != D."""
    mask = _cases(L, S)[name]
    k_top = 5

    def impl(q, k, v):
        return topk_attention(q, k, v, k_top=k_top, mask=mask, block_q=32, block_k=16)

    check_against_reference(
        impl, topk_ref(k_top, mask), list(qkv(torch.float32, l=L, s=S, d=40, dv=24))
    )
    assert_exact_in_fp64(impl, topk_ref(k_top, mask), qkv(l=L, s=S, d=40, dv=24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_top", [1, 8])
def test_tiled_topk_tolerance_rule_default_tiles(dtype, k_top):
    mask = masks.causal() & masks.padding(torch.tensor([113, 80]))
    q, k, v = qkv(dtype, l=113, s=113, d=64, seed=3)
    check_against_reference(
        lambda *x: topk_attention(*x, k_top=k_top, mask=mask), topk_ref(k_top, mask), [q, k, v]
    )


def test_three_d_inputs_and_scale():
    q, k, v = (x[:, 0] for x in qkv(torch.float32))  # (B, L, D)
    keep = torch.rand(2, 17, 23, generator=torch.Generator().manual_seed(1)) > 0.4
    got = topk_attention(q, k, v, k_top=3, mask=keep, scale=0.7)
    want, _ = reference.topk_attention(
        q[:, None], k[:, None], v[:, None], k_top=3, mask=keep[:, None], scale=0.7
    )
    assert got.shape == (2, 17, 8)
    torch.testing.assert_close(got, want[:, 0], rtol=0, atol=1e-6)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v = qkv()
    q[:, :, 0] = float("nan")  # a row that attends nothing is zeros whatever its q
    keep = torch.ones(1, 1, 17, 23, dtype=torch.bool)
    keep[..., :2, :] = False
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = topk_attention(*xs, k_top=4, mask=keep, block_q=8, block_k=8)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.equal(xs[0].grad[:, :, :2], torch.zeros_like(xs[0].grad[:, :, :2]))
    assert all(torch.isfinite(x.grad).all() for x in xs)


def test_gradient_flows_through_kept_logits_only():
    """A key no row keeps gets zero dk and dv; the kept keys' gradients are those of softmax
    over the kept set."""
    q, k, v = qkv(h=1, h_kv=1, l=1, s=23)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = topk_attention(*xs, k_top=3, block_q=1, block_k=4)
    out.sum().backward()
    _, w = reference.topk_attention(q, k, v, k_top=3)
    dropped = w[0, 0, 0] == 0
    assert int((~dropped).sum()) == 3
    assert xs[1].grad[0, 0, dropped].eq(0).all() and xs[2].grad[0, 0, dropped].eq(0).all()
    assert xs[2].grad[0, 0, ~dropped].ne(0).all()


def test_nan_rule():
    """Non-finite q_i / allowed k_j poison row i (kept or not: an unrankable logit); allowed
    v_j[d] poisons column d; packed documents stay isolated; gradients of the clean inputs."""
    L = 20
    mask = masks.document(torch.arange(L) // 10) & masks.causal()
    q, k, v = qkv(l=L, s=L, h=2, h_kv=1)
    k[0, 0, 3] = float("inf")  # doc 0, rows 3..9 may attend key 3
    v[1, 0, 12, 5] = float("nan")  # doc 1, rows 12..19 may attend key 12
    q[1, 1, 15] = float("nan")
    got = topk_attention(q, k, v, k_top=2, mask=mask, block_q=8, block_k=8)
    want, _ = reference.topk_attention(q, k, v, k_top=2, mask=mask)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[0, :, 3:10]).all() and not torch.isnan(got[0, :, :3]).any()
    assert not torch.isnan(got[0, :, 10:]).any()  # the other document never sees k_3
    assert torch.isnan(got[1, :, 12:, 5]).all() and not torch.isnan(got[1, 0, 12:, :5]).any()
    assert torch.isnan(got[1, 1, 15]).all() and not torch.isnan(got[1, 1, 14, :5]).any()
    fin = ~torch.isnan(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=0, atol=1e-14)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = topk_attention(*xs, k_top=2, mask=mask, block_q=8, block_k=8)
    torch.where(torch.isnan(out), 0.0, out).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in xs)
    assert xs[1].grad[0, 0, 3].eq(0).all()


def test_no_l_by_s_tensor_forward_or_backward():
    """At L = S = 2048 every tensor the passes form is far below L·S elements."""
    L = S = 2048
    q, k, v = qkv(torch.float32, b=1, h=2, h_kv=1, l=L, s=S, d=16)
    mask = masks.causal()
    with LargestTensor() as seen:
        out, lse, tau, quota = topk_mod._forward(q, k, v, mask, 8, 0.25, 128, 256)
        topk_mod._backward(
            torch.ones_like(out), q, k, v, out, lse, tau, quota, mask, 0.25, 128, 256
        )
    assert seen.largest < L * S // 8, seen.largest
    assert seen.largest >= 2 * L * 16  # it did watch the passes (q itself)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"k_top": 0}, "k_top must be >= 1"),
        ({"k_top": 2.0}, "k_top must be an int"),
        ({"k_top": 2, "scale": float("nan")}, "scale must be finite"),
        ({"k_top": 2, "block_q": 0}, "block_q must be >= 1"),
        ({"k_top": 2, "mask": torch.zeros(17, 23)}, "mask must be a bool tensor"),
        ({"k_top": 2, "mask": "causal"}, "mask must be an attnlab Mask"),
        ({"k_top": 2, "mask": torch.ones(17, 5, dtype=torch.bool)}, "not broadcastable to"),
        ({"k_top": 2, "mask": masks.from_fn(lambda b, h, i, j: i >= j)}, "structure spec"),
    ],
)
def test_topk_bad_input_is_named(kwargs, match):
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError), match=match):
        topk_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="head_dim"):
        topk_attention(q, k[..., :4], v, k_top=2)


@pytest.mark.usefixtures("fresh_dynamo")
def test_topk_inductor_fullgraph_forward_backward():
    mask = masks.causal() & masks.padding(torch.tensor([97, 60]))
    q, k, v = qkv(torch.float32, l=97, s=97, d=40)
    fn = torch.compile(lambda q, k, v: topk_attention(q, k, v, k_top=8, mask=mask), fullgraph=True)
    check_against_reference(fn, topk_ref(8, mask), [q, k, v])


# ----------------------------------------------------------------------------- routing
def _moba_per_token(q, k, v, block, k_blocks):
    """MoBA (Lu et al. 2025) written from the paper for one head, causal, L = S: query i gates
    block J < own by ``q_i · mean(K_J)``, keeps its own block and the top k − 1 (ties: lower
    block), then causal softmax attention over the selected blocks' keys."""
    L, D = q.shape
    n = -(-L // block)
    means = [k[J * block : (J + 1) * block].mean(0) for J in range(n)]
    out = torch.zeros(L, v.shape[-1], dtype=q.dtype)
    for i in range(L):
        own = i // block
        past = sorted(range(own), key=lambda J: (-float(q[i] @ means[J]), J))[: k_blocks - 1]
        keys = [j for J in [*past, own] for j in range(J * block, min(L, (J + 1) * block))]
        keys = [j for j in keys if j <= i]
        w = torch.softmax(q[i] @ k[keys].T / math.sqrt(D), dim=0)
        out[i] = w @ v[keys]
    return out


def test_routing_reference_is_mobas_per_token_gate():
    q, k, v = (x[0, 0] for x in qkv(b=1, h=1, h_kv=1, l=29, s=29))
    want = _moba_per_token(q, k, v, block=4, k_blocks=3)
    got, w = reference.routing_attention(
        q[None, None], k[None, None], v[None, None], block=4, k_blocks=3, query_block=1
    )
    torch.testing.assert_close(got[0, 0], want, rtol=0, atol=1e-14)
    assert ((w[0, 0] > 0).sum(-1) <= 12).all()


def test_routing_select_rules():
    """Own block always, past only when causal, k_blocks per cell, ties to the lower block."""
    q = torch.ones(1, 1, 16, 2, dtype=torch.float64)
    k = torch.ones(1, 1, 16, 2, dtype=torch.float64)  # every block scores the same: a tie
    table = reference.routing_select(q, k, block=4, k_blocks=2)[0, 0]
    assert table.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    table = reference.routing_select(q, k, block=4, k_blocks=2, causal=False)[0, 0]
    assert table.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    k[0, 0, 12:] = 5.0  # block 3 scores highest for every non-causal cell
    table = reference.routing_select(q, k, block=4, k_blocks=2, causal=False)[0, 0]
    assert table[:, 3].all() and table.sum(-1).eq(2).all()


def test_block_table_mask():
    """Dense rendering = the table expanded; block maps = the dense ones; spec round trip."""
    for L, S, qb in ((17, 23, 4), (23, 17, 1), (30, 30, 2)):
        q, k, _ = qkv(l=L, s=S)
        m = routing_mask(q, k, block=4, k_blocks=2, query_block=qb)
        cell = reference.routing_cells(L, S, qb)[0]
        want = m.table[:, :, cell][..., torch.arange(S) // 4]
        assert torch.equal(m.to_dense(L, S), want)
        for bq, bk in ((3, 5), (4, 4), (16, 16)):
            dense = m._dense_block_map(L, S, bq, bk, 2, 4, None)
            assert torch.equal(m.block_map(L, S, bq, bk), dense)
        assert torch.equal(masks.from_spec(*m.spec()).to_dense(L, S), want)
    with pytest.raises(ValueError, match="made for L=30, S=30"):
        m.to_dense(31, 30)
    with pytest.raises(ValueError, match="table must end in"):
        masks.BlockTableMask(torch.ones(3, 3, dtype=torch.bool), 4, 4, 16, 16)


_ROUTE_DEFAULT = {
    (97, 113, True, None),
    (113, 97, False, 1),
    (1, 17, True, 1),
    (17, 1, False, None),
}
_ROUTE_CASES = [
    pytest.param(L, S, c, qb, marks=() if (L, S, c, qb) in _ROUTE_DEFAULT else pytest.mark.slow)
    for L, S in ((1, 17), (17, 1), (97, 113), (113, 97))
    for c in (True, False)
    for qb in (None, 1)
]


@pytest.mark.parametrize("L,S,causal,query_block", _ROUTE_CASES)
def test_routing_matches_reference(L, S, causal, query_block):
    kw = {"block": 8, "k_blocks": 3, "causal": causal, "query_block": query_block}
    mask = masks.padding(torch.tensor([S, max(1, S - 7)]))

    def ref(q, k, v, *, compute_dtype, reorder):
        return reference.routing_attention(
            q, k, v, mask=mask, compute_dtype=compute_dtype, reorder=reorder, **kw
        )[0]

    def impl(q, k, v):
        return routing_attention(q, k, v, mask=mask, **kw)

    check_against_reference(impl, ref, list(qkv(torch.float32, l=L, s=S, d=40, dv=24)))
    assert_exact_in_fp64(impl, ref, qkv(l=L, s=S, d=40, dv=24))


def test_routing_skips_unselected_tiles_and_three_d():
    """At L = S = 512, block 64, 2 blocks per cell: most of flash's 64×64 tiles are EMPTY."""
    q, k, v = qkv(torch.float32, b=1, h=2, h_kv=1, l=512, s=512, d=16)
    m = masks.causal() & routing_mask(q, k, block=64, k_blocks=2)
    codes = m.block_map(512, 512, 64, 64, batch=1, heads=2)
    assert int((codes > 0).sum()) <= 2 * 2 * 8 < codes.numel()
    got = routing_attention(q[:, 0], k[:, 0], v[:, 0], block=64, k_blocks=2)
    want, _ = reference.routing_attention(q[:, :1], k, v, block=64, k_blocks=2)
    torch.testing.assert_close(got, want[:, 0], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block": 0}, "block must be >= 1"),
        ({"k_blocks": 1.5}, "k_blocks must be an int"),
        ({"block": 8, "query_block": 3}, "query_block must divide block"),
        ({"causal": 1}, "causal must be a bool"),
        ({"mask": "causal"}, "mask must be an attnlab Mask"),
    ],
)
def test_routing_bad_input_is_named(kwargs, match):
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError), match=match):
        routing_attention(q, k, v, **kwargs)


@pytest.mark.slow  # ~15 s of compiling; the default suite compiles the top-k case
@pytest.mark.usefixtures("fresh_dynamo")
def test_routing_inductor_fullgraph_forward_backward():
    """The selection is traced (sort, no host read); the mask reaches flash's operators."""
    q, k, v = qkv(torch.float32, l=97, s=97, d=16)
    kw = {"block": 16, "k_blocks": 2}
    fn = torch.compile(lambda q, k, v: routing_attention(q, k, v, **kw), fullgraph=True)

    def ref(q, k, v, *, compute_dtype, reorder):
        return reference.routing_attention(
            q, k, v, compute_dtype=compute_dtype, reorder=reorder, **kw
        )[0]

    check_against_reference(fn, ref, [q, k, v])


# ----------------------------------------------------------------------------- modules
def test_modules_are_the_functional_calls_with_projections():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 32)
    layer = TopKAttention(32, 4, k_top=5, num_kv_heads=2)
    routed = RoutedAttention(32, 4, block=8, k_blocks=2, num_kv_heads=2, query_block=1)
    for mod, fn in (
        (layer, lambda q, k, v: topk_attention(q, k, v, k_top=5, mask=masks.causal())),
        (routed, lambda q, k, v: routing_attention(q, k, v, block=8, k_blocks=2, query_block=1)),
    ):
        q = mod.q_proj(x).view(2, 40, 4, 8).transpose(1, 2)
        k = mod.k_proj(x).view(2, 40, 2, 8).transpose(1, 2)
        v = mod.v_proj(x).view(2, 40, 2, 8).transpose(1, 2)
        want = mod.o_proj(fn(q, k, v).transpose(1, 2).reshape(2, 40, 32))
        out = mod(x)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        out.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mod.parameters())
    assert "k_top=5" in repr(layer) and "k_blocks=2" in repr(routed)
    with pytest.raises(ValueError, match="query_block must divide block"):
        RoutedAttention(32, 4, block=8, k_blocks=2, query_block=3)
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(2, 40, 16))


def test_routing_nan_rule_and_memory():
    """The selection reads clean inputs; NaN reaches only the rows that attend it. No L×S
    tensor at L = S = 2048 (the table is (B, H, L / block, S / block))."""
    q, k, v = qkv(l=48, s=48, h=2, h_kv=1)
    q[0, 0, 5] = float("nan")  # row 5 only, though its cell's mean query reads it
    k[0, 0, 40] = float("inf")  # rows 40..47 (own block 5) and no row before 40
    kw = {"block": 8, "k_blocks": 2}
    got = routing_attention(q, k, v, **kw)
    want, _ = reference.routing_attention(q, k, v, **kw)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[0, 0, 5]).all() and not torch.isnan(got[0, 0, :5]).any()
    assert torch.isnan(got[0, :, 40:]).all() and not torch.isnan(got[0, 1, :40]).any()
    assert not torch.isnan(got[1]).any()
    fin = ~torch.isnan(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=0, atol=1e-12)
    L = 2048
    q, k, v = qkv(torch.float32, b=1, h=2, h_kv=1, l=L, s=L, d=16)
    xs = [x.requires_grad_(True) for x in (q, k, v)]
    with LargestTensor() as seen:
        routing_attention(*xs, block=64, k_blocks=4).sum().backward()
    assert seen.largest < L * L // 8, seen.largest


def test_routing_bf16_tolerance_rule():
    kw = {"block": 16, "k_blocks": 3}

    def ref(q, k, v, *, compute_dtype, reorder):
        return reference.routing_attention(
            q, k, v, compute_dtype=compute_dtype, reorder=reorder, **kw
        )[0]

    q, k, v = qkv(torch.bfloat16, l=113, s=113, d=64, seed=4)
    check_against_reference(lambda *x: routing_attention(*x, **kw), ref, [q, k, v])


@pytest.mark.slow
@pytest.mark.parametrize("L,S", [(1, 1025), (1025, 1), (17, 113), (1025, 1025), (113, 97)])
@pytest.mark.parametrize("D", [8, 40, 64, 80, 128])
@pytest.mark.parametrize("name", ["none", "causal", "sliding_window", "padding"])
def test_odd_size_sweep_default_tiles(L, S, D, name):
    """The tolerance rule's odd sizes and head dims on the default tiles (float32): top-k with
    k = 16, and routing (block 64, 3 blocks; per-token cells for the causal case)."""
    mask = masks.padding(torch.tensor([max(1, S - 7)])) if name == "padding" else _cases(L, S)[name]
    xs = list(qkv(torch.float32, b=1, l=L, s=S, d=D))
    # both are tiled online-softmax float32 paths: the rule's mean clause (`mean_factor_for`),
    # e.g. dq where one key is attended (exactly 0: δ = do·o and do·vᵀ round differently)
    mf = mean_factor_for("flash", torch.float32)
    check_against_reference(
        lambda *x: topk_attention(*x, k_top=16, mask=mask), topk_ref(16, mask), xs, mean_factor=mf
    )
    kw = {"block": 64, "k_blocks": 3, "causal": name == "causal"}
    kw["query_block"] = 1 if name == "causal" else 16
    extra = None if name == "causal" else mask

    def ref(q, k, v, *, compute_dtype, reorder):
        return reference.routing_attention(
            q, k, v, mask=extra, compute_dtype=compute_dtype, reorder=reorder, **kw
        )[0]

    check_against_reference(
        lambda *x: routing_attention(*x, mask=extra, **kw), ref, xs, mean_factor=mf
    )
