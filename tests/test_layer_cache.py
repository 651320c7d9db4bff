"""DifferentialAttention and GatedAttention decode through a KV cache: token by token (and a
prompt then tokens) equals one call on the whole sequence; a sliding-window cache equals the
window mask; a rotate-at-insert cache equals a pre-RoPE one; Inductor compiles a cached step."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from attnlab.modules import DifferentialAttention, GatedAttention
from attnlab.modules.kv_cache import KVCache, SlidingWindowCache

torch.manual_seed(0)


def _layers():
    torch.manual_seed(1)
    diff = DifferentialAttention(32, 4, num_kv_heads=2, layer=3).double()
    gated = GatedAttention(32, 4, num_kv_heads=2, rotary_dim=4).double()
    return {"differential": diff, "gated": gated}


@pytest.fixture(params=["differential", "gated"])
def layer(request):
    return _layers()[request.param]


def _decode(layer, x, cache, prompt):
    outs = [layer(x[:, :prompt], cache=cache)]
    outs += [layer(x[:, t : t + 1], cache=cache) for t in range(prompt, x.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("prompt", [1, 4])
@pytest.mark.parametrize("rotate_at_insert", [False, True])
def test_decoding_through_a_cache_equals_one_call(layer, prompt, rotate_at_insert):
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    want = layer(x)
    got = _decode(layer, x, KVCache(rotate_at_insert=rotate_at_insert), prompt)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_sliding_window_cache_equals_the_window_mask(layer):
    x = torch.randn(1, 11, 32, dtype=torch.float64)
    want = layer(x, mask=masks.sliding_window(3))  # the current key and the two before it
    got = _decode(layer, x, SlidingWindowCache(3), 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_cache_keeps_the_keys_and_refuses_float_positions(layer):
    cache = KVCache()
    layer(torch.randn(1, 5, 32, dtype=torch.float64), cache=cache)
    assert len(cache) == 5 and cache.seen == 5
    with pytest.raises(ValueError, match="integer tensor"):
        layer(torch.randn(1, 1, 32, dtype=torch.float64), cache=cache, positions=torch.ones(1))


def test_inductor_compiles_a_cached_decode_step():
    torch.manual_seed(2)
    layer = GatedAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(1, 6, 32)
    want = layer(x)
    step = torch.compile(layer, fullgraph=True)
    cache = KVCache()
    with torch.no_grad():
        got = torch.cat(
            [layer(x[:, :4], cache=cache)] + [step(x[:, t : t + 1], cache=cache) for t in (4, 5)], 1
        )
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
