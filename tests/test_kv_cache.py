"""KV-cache decoding equals recomputation (RELIABILITY C6–C9, H9)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _ext, masks
from attnlab.modules import (
    CacheOverflowError,
    KVCache,
    MultiHeadAttention,
    SinkCache,
    SlidingWindowCache,
)
from attnlab.positional import RoPE


def _mha(dtype=torch.float64, num_kv_heads=None, rope=None, seed=0, E=32, H=4):
    torch.manual_seed(seed)
    return MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, rope=rope).to(dtype).eval()


def _decode(mha, x, prefill, cache, mask_fn=masks.causal, positions_shift=0):
    """Prefill ``prefill`` tokens, then one token at a time; returns the concatenated outputs."""
    outs = []
    if prefill:
        outs.append(mha(x[:, :prefill], mask=mask_fn(), cache=cache))
    for t in range(prefill, x.shape[1]):
        pos = None if not positions_shift else torch.tensor([t + positions_shift])
        outs.append(mha(x[:, t : t + 1], mask=mask_fn(), cache=cache, positions=pos))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("prefill", [0, 1, 7, 63])
@pytest.mark.parametrize("kv_heads,rope", [(None, False), (2, False), (1, True), (2, True)])
def test_c6_prefill_then_decode_equals_full_forward_fp64(prefill, kv_heads, rope):
    mha = _mha(num_kv_heads=kv_heads, rope=RoPE(8) if rope else None)
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    full = mha(x, mask=masks.causal())
    got = _decode(mha, x, prefill, KVCache())
    torch.testing.assert_close(got, full, atol=1e-12, rtol=0)


def test_decode_float32_within_1e5_and_preallocated_cache():
    mha = _mha(torch.float32, num_kv_heads=2, rope=RoPE(8))
    x = torch.randn(3, 40, 32)
    full = mha(x, mask=masks.causal())
    for cache in (KVCache(), KVCache(capacity=40)):
        got = _decode(mha, x, 5, cache)
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
        assert len(cache) == 40 and cache.seen == 40


def test_c7_overflow_names_capacity_and_request():
    mha = _mha()
    cache = KVCache(capacity=8)
    mha(torch.randn(1, 6, 32, dtype=torch.float64), mask=masks.causal(), cache=cache)
    with pytest.raises(
        CacheOverflowError, match=r"capacity is 8 positions, 6 are cached and 3 more"
    ):
        mha(torch.randn(1, 3, 32, dtype=torch.float64), mask=masks.causal(), cache=cache)
    assert len(cache) == 6  # nothing was written or wrapped


@pytest.mark.parametrize("shift", [-1, 1])
def test_c8_rope_offset_is_the_cache_length_and_a_shifted_offset_is_detected(shift):
    mha = _mha(rope=RoPE(8))
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    full = mha(x, mask=masks.causal())
    good = _decode(mha, x, 4, KVCache())
    torch.testing.assert_close(good, full, atol=1e-12, rtol=0)
    # The same check with the decode positions off by one must fail.
    bad = _decode(mha, x, 4, KVCache(), positions_shift=shift)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(bad, full, atol=1e-12, rtol=0)


def test_c9_ragged_batch_left_padded_equals_each_sequence_alone():
    mha = _mha(num_kv_heads=2, rope=RoPE(8))
    lengths = [5, 9, 2]
    P = max(lengths)
    seqs = [torch.randn(1, n + 4, 32, dtype=torch.float64) for n in lengths]  # prompt + 4 new
    alone = [mha(s, mask=masks.causal()) for s in seqs]
    # left-pad the prompts; positions count real tokens only
    x = torch.zeros(3, P, 32, dtype=torch.float64)
    valid = torch.zeros(3, P, dtype=torch.bool)
    for b, n in enumerate(lengths):
        x[b, P - n :] = seqs[b][0, :n]
        valid[b, P - n :] = True
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
    cache = KVCache()
    kmask = masks.from_tensor(valid[:, None, None, :])
    outs = [mha(x, mask=masks.causal() & kmask, cache=cache, positions=pos)]
    for t in range(4):
        step = torch.cat([s[:, n + t : n + t + 1] for s, n in zip(seqs, lengths, strict=True)])
        valid = torch.cat([valid, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        p = torch.tensor(lengths).view(3, 1) + t
        kmask = masks.from_tensor(valid[:, None, None, :])
        outs.append(mha(step, mask=masks.causal() & kmask, cache=cache, positions=p))
    got = torch.cat(outs, dim=1)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, P - n : P], alone[b][0, :n], atol=1e-12, rtol=0)
        torch.testing.assert_close(got[b, P:], alone[b][0, n:], atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [1, 4, 9])
@pytest.mark.parametrize("prefill", [0, 3, 12])
def test_sliding_window_cache_equals_windowed_full_forward(window, prefill):
    mha = _mha(num_kv_heads=2, rope=RoPE(8))
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    full = mha(x, mask=masks.sliding_window(window))
    cache = SlidingWindowCache(window)
    got = _decode(mha, x, prefill, cache, mask_fn=masks.causal)
    torch.testing.assert_close(got, full, atol=1e-12, rtol=0)
    assert len(cache) == min(window, 20)


def test_sink_cache_equals_streamingllm_recompute_in_cache_positions():
    """Keys cached before RoPE, rotated by cache position: equal to recomputing the kept tokens."""
    mha = _mha(rope=RoPE(8))
    n_sink, window = 2, 5
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    cache = SinkCache(n_sink, window)
    outs = _decode(mha, x, 0, cache)
    for t in range(16):
        kept = sorted(set(range(min(n_sink, t + 1))) | set(range(max(0, t + 1 - window), t + 1)))
        xs = x[:, kept]  # the tokens in the cache at step t, as one contiguous sequence
        want = mha(xs, mask=masks.causal())[:, -1]
        torch.testing.assert_close(outs[:, t], want, atol=1e-12, rtol=0)
    assert len(cache) == n_sink + window


def test_sink_cache_prompt_attends_to_sinks_and_window_then_decodes():
    mha = _mha(rope=RoPE(8))
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    sink_or_window = masks.causal() & (
        masks.from_fn(lambda b, h, i, j: j < 2) | masks.sliding_window(3)
    )
    want = mha(x[:, :10], mask=sink_or_window)
    cache = SinkCache(2, 3)
    got = mha(x[:, :10], mask=masks.causal(), cache=cache)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert len(cache) == 5
    step = mha(x[:, 10:11], mask=masks.causal(), cache=cache)  # sinks 0,1 + tokens 8,9,10
    kept = mha(x[:, [0, 1, 8, 9, 10]], mask=masks.causal())[:, -1:]
    torch.testing.assert_close(step, kept, atol=1e-12, rtol=0)


def test_dynamic_ntk_rope_with_cache_stays_consistent():
    rope = RoPE(
        8, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6}
    )
    mha = _mha(rope=rope)
    x = torch.randn(1, 14, 32, dtype=torch.float64)
    full = mha(x, mask=masks.causal())
    got = _decode(mha, x, 3, KVCache())
    # dynamic NTK depends on the current length: a cache of pre-RoPE keys re-rotated each step
    # equals recomputing at that length
    for t in range(3, 14):
        want = mha(x[:, : t + 1], mask=masks.causal())[:, -1]
        torch.testing.assert_close(got[:, t], want, atol=1e-12, rtol=0)
    # and the length matters: row 8 at length 9 differs from row 8 of the length-14 forward
    assert not torch.allclose(got[:, 8], full[:, 8], atol=1e-6)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(split=st.integers(0, 20), kv=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_h9_random_split_decode_equals_full(split, kv, seed):
    mha = _mha(num_kv_heads=kv, rope=RoPE(8), seed=seed)
    x = torch.randn(2, 21, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(
        _decode(mha, x, split, KVCache()), mha(x, mask=masks.causal()), atol=1e-11, rtol=0
    )


def test_cache_bad_input():
    with pytest.raises(ValueError, match=r"capacity must be >= 1, got 0"):
        KVCache(capacity=0)
    with pytest.raises(ValueError, match=r"window must be >= 1, got"):
        SlidingWindowCache(0)
    cache = KVCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"does not match the cached"):
        cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    mha = _mha()
    with pytest.raises(ValueError, match=r"cache is for self-attention"):
        x = torch.randn(1, 2, 32, dtype=torch.float64)
        mha(x, x, x, cache=KVCache())


@pytest.mark.parametrize(
    "positions", [torch.tensor([5.0]), torch.tensor([5.5], dtype=torch.float64)]
)
def test_float_positions_with_a_cache_are_refused_before_any_work(positions):
    mha = _mha(rope=RoPE(8))
    cache = KVCache()
    mha(torch.randn(1, 5, 32, dtype=torch.float64), mask=masks.causal(), cache=cache)
    k_before = cache._stored(cache._k, cache._v)[0].clone()
    with pytest.raises(ValueError, match=r"positions must be an integer tensor when a KV cache"):
        mha(torch.randn(1, 1, 32, dtype=torch.float64), cache=cache, positions=positions)
    with pytest.raises(ValueError, match=r"got dtype torch\.float"):
        cache.update(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), positions)
    assert len(cache) == 5 and cache.seen == 5
    assert torch.equal(cache._stored(cache._k, cache._v)[0], k_before)


@pytest.mark.parametrize("prefill", [0, 4])
@pytest.mark.parametrize(
    "make", [KVCache, lambda: KVCache(8), lambda: SlidingWindowCache(3), lambda: SinkCache(1, 2)]
)
def test_empty_update_leaves_the_cache_unchanged_and_returns_no_rows(make, prefill):
    mha = _mha(num_kv_heads=2, rope=RoPE(8))
    x = torch.randn(2, prefill + 1, 32, dtype=torch.float64)
    cache, twin = make(), make()
    if prefill:
        mha(x[:, :prefill], mask=masks.causal(), cache=cache)
        mha(x[:, :prefill], mask=masks.causal(), cache=twin)
    state = (len(cache), cache.seen)
    stored = (
        None if cache._k is None else [t.clone() for t in cache._stored(cache._k, cache._v)[:2]]
    )
    out = mha(x[:, :0], mask=masks.causal(), cache=cache)
    assert out.shape == (2, 0, 32)
    assert (len(cache), cache.seen) == state
    if stored is not None:
        for a, b in zip(cache._stored(cache._k, cache._v)[:2], stored, strict=True):
            assert torch.equal(a, b)
    # the next real step is exactly what it is without the empty update
    nxt = x[:, prefill : prefill + 1]
    assert torch.equal(
        mha(nxt, mask=masks.causal(), cache=cache), mha(nxt, mask=masks.causal(), cache=twin)
    )


def test_dynamic_rope_with_explicit_cache_positions_uses_their_maximum():
    # Explicit position tensors: the cache cannot know max(position) + 1 on the host (here it is
    # not the token count), so the module reads it from the tensor (eager only) and must agree
    # with the uncached forward at each length.
    rope = RoPE(
        8, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6}
    )
    mha = _mha(rope=rope)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    pos = torch.arange(12) + 3
    cache = KVCache()
    mha(x[:, :3], mask=masks.causal(), cache=cache, positions=pos[:3])
    for t in range(3, 12):
        got = mha(x[:, t : t + 1], cache=cache, positions=pos[t : t + 1])[:, -1]
        want = mha(x[:, : t + 1], mask=masks.causal(), positions=pos[: t + 1])[:, -1]
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert cache.update(*(2 * [torch.zeros(1, 4, 0, 8, dtype=torch.float64)])).start is None


@pytest.mark.parametrize(
    "make", [KVCache, lambda: KVCache(12), lambda: SlidingWindowCache(3), lambda: SinkCache(2, 3)]
)
def test_host_side_start_matches_the_stored_positions(make):
    """The module rotates by ``view.start`` (host int) instead of reading positions: it must be
    exactly the first stored position, with the positions contiguous from it."""
    cache = make()
    for T in (4, 1, 1, 2, 1, 0, 1):
        k = torch.randn(1, 2, T, 8)
        view = cache.update(k, torch.randn(1, 2, T, 8))
        S = view.k.shape[2]
        assert view.start is not None
        want = torch.arange(view.start, view.start + S).view(1, S)
        assert torch.equal(view.k_positions, want)
        assert torch.equal(view.q_positions, want[:, S - T :])


def test_positions_become_explicit_after_the_first_caller_given_ones():
    cache = KVCache()
    kv = [torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)]
    assert cache.update(*kv).start == 0
    one = [t[:, :, :1] for t in kv]
    view = cache.update(*one, torch.tensor([10]))  # the implied 0, 1, 2 are materialised
    assert view.start is None and view.k_positions.tolist() == [[0, 1, 2, 10]]
    view = cache.update(*one)  # default again: the next position is the token count
    assert view.k_positions.tolist() == [[0, 1, 2, 10, 4]] and view.q_positions.tolist() == [[4]]


@pytest.mark.parametrize("ext", ["0", "require"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_at_insert_equals_the_pre_rope_cache_bit_for_bit(monkeypatch, ext, interleaved):
    """``KVCache(rotate_at_insert=True)`` rotates each key once, at its position, when it is
    cached; re-rotating the pre-RoPE keys at every step computes the same rotation of the same
    values, so every output is bit-equal — prefill, decode steps, caller-given positions, and
    the decode backend's fused step (≥ 512 keys) with and without the C++ operators (which
    also rotate the new keys: ``attnlab_nan::rope_rows``)."""
    if ext == "require" and (_ext.mode() == "off" or not _ext.load("nan_rule")):
        pytest.skip(f"C++ extension unavailable: {_ext.status('nan_rule')}")
    monkeypatch.setenv("ATTNLAB_EXT", ext)
    mha = _mha(torch.float32, num_kv_heads=2, rope=RoPE(8, interleaved=interleaved))
    x = torch.randn(2, 515, 32)
    with torch.no_grad():
        for prefill, stop, shift in ((5, 20, 0), (5, 12, 3), (512, 515, 0)):
            got = _decode(
                mha, x[:, :stop], prefill, KVCache(rotate_at_insert=True), positions_shift=shift
            )
            want = _decode(mha, x[:, :stop], prefill, KVCache(), positions_shift=shift)
            assert torch.equal(got, want), (prefill, shift)


def test_rotate_at_insert_refuses_seq_len_dependent_rope_and_keeps_its_mode():
    """Keys rotated once go stale when the frequencies change with the length (dynamic NTK,
    LongRoPE): refused before any work, naming the option. ``reset`` keeps the mode."""
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6}
    mha = _mha(rope=RoPE(8, scaling=scaling))
    cache = KVCache(8, rotate_at_insert=True)
    with pytest.raises(ValueError, match="rotate_at_insert"):
        mha(torch.randn(1, 3, 32, dtype=torch.float64), mask=masks.causal(), cache=cache)
    assert len(cache) == 0 and cache.seen == 0
    with pytest.raises(TypeError, match="rotate_at_insert must be a bool, got int"):
        KVCache(rotate_at_insert=1)
    cache.reset()
    assert cache.rotate_at_insert and cache.capacity == 8
    assert not SlidingWindowCache(4).rotate_at_insert and not SinkCache(1, 4).rotate_at_insert
