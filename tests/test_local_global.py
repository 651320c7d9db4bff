"""Concat(local, global) attention (issue #43 item 4): local heads in a window, global heads over
every key, concatenated over heads (seed 003 §4.3's ``Concat(LocalAttention, GlobalAttention)``).

- `reference.local_global_attention` is the formula, written out here head by head.
- The fast path (`attnlab.functional.local_global.local_global_attention`: one band call for the
  local heads, one call for the global heads) equals the reference under the tolerance rule,
  forward and backward, on odd sizes, with causal and padding masks, GQA, both window kinds.
- Rows with no key are zeros with zero gradients; the NaN rule holds head by head (a NaN key
  outside the window never reaches a local head's row, it does reach a global head's).
- Bad input raises before any work, naming the argument.
- `LocalGlobalAttention`: the module's heads split as stated, its weights, cached decoding.
- Inductor (``torch.compile(fullgraph=True)``), forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks
from attnlab.functional import reference
from attnlab.functional.local_global import local_global_attention
from attnlab.modules import KVCache, LocalGlobalAttention
from helpers import check_against_reference, seeded

pytestmark = pytest.mark.usefixtures("one_thread")


def test_reference_is_the_formula():
    """Head by head: local heads softmax over ``0 <= p − j < W`` and the mask, global heads over
    the mask; GQA head h reads key/value head h // G."""
    B, H, H_kv, L, S, D, W = 2, 4, 2, 9, 13, 8, 3
    q, k, v = seeded(B, H, L, D, seed=1), seeded(B, H_kv, S, D, seed=2), seeded(B, H_kv, S, 6)
    keep = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(3)) < 0.8
    p = torch.arange(L)[:, None] + S - L
    j = torch.arange(S)[None, :]
    band = (p - j >= 0) & (p - j < W)
    outs = []
    for h in range(H):
        allowed = keep[:, 0] & band if h < 2 else keep[:, 0]  # (B, L, S)
        s = q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(D)
        w = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        outs.append(w @ v[:, h // 2])
    want = torch.stack(outs, dim=1)
    got = reference.local_global_attention(q, k, v, local_heads=2, window=W, mask=keep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


CASES = [
    # (L, S, mask, causal_window)
    (1, 17, None, True),
    (17, 17, masks.causal(), True),
    (97, 113, masks.causal() & masks.padding([113, 60]), True),
    (97, 97, masks.padding([97, 50]), False),
]


@pytest.mark.parametrize("L,S,mask,causal_window", CASES)
@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_fast_path_matches_reference(L, S, mask, causal_window, backend):
    def ref(q, k, v, *, compute_dtype, reorder):
        return reference.local_global_attention(
            q,
            k,
            v,
            local_heads=2,
            window=7,
            mask=mask,
            causal_window=causal_window,
            compute_dtype=compute_dtype,
            reorder=reorder,
        )

    def impl(q, k, v):
        return local_global_attention(
            q,
            k,
            v,
            local_heads=2,
            window=7,
            mask=mask,
            causal_window=causal_window,
            backend=backend,
        )

    shapes = [(2, 4, L, 40), (2, 2, S, 40), (2, 2, S, 24)]
    inputs = [seeded(*shape, seed=i).float() for i, shape in enumerate(shapes)]
    check_against_reference(impl, ref, inputs, mean_factor=10.0)


def test_all_local_or_all_global_is_plain_attention():
    import attnlab

    q, k, v = seeded(1, 4, 20, 8, seed=1), seeded(1, 4, 20, 8, seed=2), seeded(1, 4, 20, 8)
    causal = masks.causal()
    all_local = local_global_attention(q, k, v, local_heads=4, window=5, mask=causal)
    want = attnlab.attention(q, k, v, mask=masks.sliding_window(5))
    torch.testing.assert_close(all_local, want, rtol=0, atol=1e-12)
    all_global = local_global_attention(q, k, v, local_heads=0, window=5, mask=causal)
    torch.testing.assert_close(all_global, attnlab.attention(q, k, v, mask=causal))


def test_rows_without_keys_are_zeros_with_zero_gradients():
    q, k, v = (seeded(2, 4, 11, 8, seed=i).requires_grad_(True) for i in range(3))
    mask = masks.causal() & masks.padding([11, 0])  # batch item 1 has no key at all
    out, w = local_global_attention(
        q, k, v, local_heads=2, window=3, mask=mask, return_weights=True
    )
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(
        w[1], torch.zeros_like(w[1])
    )
    out.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad[1], torch.zeros_like(t.grad[1]))
    # local heads: weights only inside the window; global heads: every earlier key
    assert (w[0, :2].tril(-3) == 0).all() and (w[0, 2:].tril(-3) > 0).any()


def test_nan_rule_head_by_head():
    q, k, v = seeded(1, 4, 12, 8, seed=1), seeded(1, 4, 12, 8, seed=2), seeded(1, 4, 12, 8)
    k[0, :, 0] = float("nan")  # key 0: outside the local window of rows 3 …
    out = local_global_attention(q, k, v, local_heads=2, window=3, mask=masks.causal())
    assert torch.isfinite(out[0, :2, 3:]).all()  # local heads, rows whose window misses key 0
    assert torch.isnan(out[0, :2, :3]).all()  # local rows that attend key 0
    assert torch.isnan(out[0, 2:]).all()  # global heads attend key 0 from every row


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"local_heads": 1}, ValueError, r"local_heads must be a multiple of H / H_kv = 2 in "),
        ({"local_heads": 6}, ValueError, r"in \[0, H=4\] .*got 6"),
        ({"local_heads": 2.0}, TypeError, r"local_heads must be an int, got float"),
        ({"window": 0}, ValueError, r"window must be >= 1, got 0"),
        ({"causal_window": 1}, TypeError, r"causal_window must be a bool, got int"),
        ({"mask": torch.zeros(7, 7)}, TypeError, r"mask must be an attnlab Mask, a bool tensor"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(kw, error, match):
    q, k, v = seeded(1, 4, 7, 8), seeded(1, 2, 7, 8), seeded(1, 2, 7, 8)
    with pytest.raises(error, match=match):
        local_global_attention(q, k, v, **{"local_heads": 2, "window": 3, **kw})


def test_module_equals_its_heads_and_decodes_with_a_cache():
    torch.manual_seed(0)
    attn = LocalGlobalAttention(32, 4, window=4, num_kv_heads=2).double().eval()
    assert attn.local_heads == 2
    x = seeded(2, 15, 32, seed=4)
    out, w = attn(x, mask=masks.causal(), need_weights=True)
    q, k, v = attn.project(x)
    want = reference.local_global_attention(q, k, v, local_heads=2, window=4, mask=masks.causal())
    want = attn.out_proj(want.transpose(1, 2).reshape(2, 15, 32))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert (w[:, :2].tril(-4) == 0).all()
    cache = KVCache()
    with torch.no_grad():
        steps = [attn(x[:, :3], mask=masks.causal(), cache=cache)]
        steps += [attn(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(3, 15)]
    torch.testing.assert_close(torch.cat(steps, dim=1), out.detach(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"local_heads must be a multiple of H / H_kv = 2"):
        LocalGlobalAttention(32, 4, window=4, num_kv_heads=2, local_heads=3)


def test_compiles_fullgraph_with_inductor(fresh_dynamo):
    q, k, v = (seeded(1, 4, 33, 8, seed=i).float() for i in range(3))
    mask = masks.causal() & masks.padding([30])

    def f(q, k, v):
        return local_global_attention(q, k, v, local_heads=2, window=5, mask=mask)

    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.compile(f, fullgraph=True)(*xs)  # Inductor; raises on a graph break
    got = torch.autograd.grad(out.square().sum(), xs)
    ys = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want_out = f(*ys)
    want = torch.autograd.grad(want_out.square().sum(), ys)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_per_head_bool_mask_is_split_with_the_heads():
    """A bool mask with one slice per head: local heads get theirs (and the band), global
    heads theirs."""
    q, k, v = seeded(2, 4, 17, 8, seed=1), seeded(2, 2, 19, 8, seed=2), seeded(2, 2, 19, 8)
    keep = torch.rand(2, 4, 17, 19, generator=torch.Generator().manual_seed(5)) < 0.7
    got = local_global_attention(q, k, v, local_heads=2, window=6, mask=keep)
    want = reference.local_global_attention(q, k, v, local_heads=2, window=6, mask=keep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    other = local_global_attention(q, k, v, local_heads=2, window=6, mask=keep.flip(1))
    assert (other - got).abs().amax(dim=(0, 2, 3)).min() > 1e-3  # every head reads its own slice


def test_pruning_keeps_each_remaining_head_local_or_global():
    torch.manual_seed(1)
    attn = LocalGlobalAttention(32, 4, window=3).double()
    x = seeded(1, 12, 32, seed=6)
    with torch.no_grad():
        zeroed = LocalGlobalAttention(32, 4, window=3).double()
        zeroed.load_state_dict(attn.state_dict())
        zeroed.out_proj.weight[:, 0:8] = 0.0  # head 0 (local) silenced
        zeroed.out_proj.weight[:, 24:32] = 0.0  # head 3 (global) silenced
        want = zeroed(x, mask=masks.causal())
        attn.prune_heads([0, 3])
        assert (attn.num_heads, attn.local_heads) == (2, 1)
        torch.testing.assert_close(attn(x, mask=masks.causal()), want, rtol=0, atol=1e-12)
