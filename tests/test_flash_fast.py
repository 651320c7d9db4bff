"""The flash backend's fast paths (issue 19): batched document segments, the plan cache, the
low-precision policy and the scan that cleans inputs only when they hold NaN/±inf.

Every path is forced here on any CPU (``ATTNLAB_FLASH_LOWP``, ``ATTNLAB_EXT``,
``ATTNLAB_FLASH_PLAN_CACHE``), and each is checked against the float64 reference with the
tolerance rule, or bit for bit against the path it replaces.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import _ext, attention, masks
from attnlab.functional import nan_rule
from attnlab.functional.flash import flash_attention
from attnlab.functional.flash import plan as flash_plan
from attnlab.functional.tiling import SegmentCall, build_plan
from helpers import call_backend, check_against_reference, mean_factor_for, reference_for, seeded

LOW = [torch.bfloat16, torch.float16]


def qkv(L: int, dtype: torch.dtype, B: int = 2, H: int = 4, H_kv: int = 2, D: int = 16):
    return (
        seeded(B, H, L, D, dtype=dtype, seed=3),
        seeded(B, H_kv, L, D, dtype=dtype, seed=4),
        seeded(B, H_kv, L, D, dtype=dtype, seed=5),
    )


def segment_calls(mask, L: int, B: int = 2) -> list[SegmentCall]:
    plan = build_plan(mask, B=B, H=4, L=L, S=L, block_q=128, block_k=128, band_block=32, bias=None)
    return [c for g in plan.groups for c in g.calls if isinstance(c, SegmentCall)]


# --------------------------------------------------------------------------- documents
def test_equal_documents_are_one_batched_call_and_runs_split_by_length() -> None:
    L = 96
    calls = segment_calls(masks.causal() & masks.document.from_lengths([24] * 4), L)
    assert [(c.start, c.n, c.count, c.causal) for c in calls] == [(0, 24, 4, True)]
    mixed = masks.document.from_lengths([16, 16, 8, 8, 8, 40])
    calls = segment_calls(mixed, L)
    assert [(c.start, c.n, c.count, c.causal) for c in calls] == [
        (0, 16, 2, False),
        (32, 8, 3, False),
        (56, 40, 1, False),
    ]
    # an id in two runs is not block-diagonal; a window is not a document mask; nor L != S
    assert segment_calls(masks.document(torch.tensor([0] * 40 + [1] * 16 + [0] * 40)), L) == []
    assert segment_calls(masks.sliding_window(8) & masks.document.from_lengths([48] * 2), L) == []
    plan = build_plan(
        masks.document.from_lengths([48, 48]),
        B=1,
        H=1,
        L=90,
        S=96,
        block_q=32,
        block_k=32,
        band_block=32,
        bias=None,
    )
    assert plan.kind != "documents"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW], ids=str)
@pytest.mark.parametrize(
    "name", ["causal_equal", "causal_mixed", "full_mixed", "per_batch", "repeated_ids"]
)
def test_documents_match_reference_fwd_and_grads(dtype, name) -> None:
    L = 64
    mask = {
        "causal_equal": masks.causal() & masks.document.from_lengths([16] * 4),
        "causal_mixed": masks.document.from_lengths([8, 8, 20, 1, 27]) & masks.causal(),
        "full_mixed": masks.document.from_lengths([10, 10, 10, 34]),
        "per_batch": masks.causal()
        & masks.document(torch.stack([torch.arange(L) // 16, torch.arange(L) // 32])),
        "repeated_ids": masks.causal() & masks.document((torch.arange(L) // 8) % 3),
    }[name]
    check_against_reference(
        call_backend("flash", mask),
        reference_for(mask, None),
        list(qkv(L, dtype)),
        mean_factor=mean_factor_for("flash", dtype),
    )


# --------------------------------------------------------------------------- low precision
@pytest.mark.parametrize("policy", ["native", "widen"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", ["window", "causal", "documents", "bigbird"])
def test_low_precision_policies_match_reference(monkeypatch, policy, dtype, name) -> None:
    monkeypatch.setenv(flash_plan.LOW_PRECISION_ENV, policy)
    L = 160
    mask = {
        "window": masks.sliding_window(40),
        "causal": masks.causal(),
        "documents": masks.causal() & masks.document.from_lengths([40] * 4),
        "bigbird": masks.bigbird(16, 3, 1, 1, seed=2),
    }[name]
    check_against_reference(
        call_backend("flash", mask),
        reference_for(mask, None),
        list(qkv(L, dtype)),
        mean_factor=mean_factor_for("flash", dtype),
    )


def test_native_policy_runs_the_kernel_in_the_input_dtype(monkeypatch) -> None:
    """On a merge-free plan "native" calls the kernel in bfloat16; "widen" in float32."""
    seen: list[torch.dtype] = []
    from attnlab.functional.flash import band, engines

    real = engines.kernel_forward

    def spy(q, k, v, logits):
        seen.append(q.dtype)
        return real(q, k, v, logits)

    monkeypatch.setattr(band, "kernel_forward", spy)
    q, k, v = qkv(128, torch.bfloat16)
    for policy, want in (("native", torch.bfloat16), ("widen", torch.float32)):
        monkeypatch.setenv(flash_plan.LOW_PRECISION_ENV, policy)
        seen.clear()
        out, _ = flash_attention(q, k, v, mask=masks.sliding_window(16))
        assert seen and set(seen) == {want}, (policy, seen)
        assert out.dtype == torch.bfloat16


def test_bad_low_precision_setting_is_named(monkeypatch) -> None:
    monkeypatch.setenv(flash_plan.LOW_PRECISION_ENV, "fast")
    q, k, v = qkv(16, torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"ATTNLAB_FLASH_LOWP must be 'native' or 'widen', got 'fast'"
    ):
        flash_attention(q, k, v, mask=masks.causal())


# --------------------------------------------------------------------------- plan cache
def test_plan_cache_hits_and_invalidation(monkeypatch) -> None:
    flash_plan.clear_plan_cache()
    kw = dict(B=1, H=2, L=64, S=64, block_q=16, block_k=16, band_block=16, bias=None)
    ids = torch.arange(64) // 16
    mask = masks.document(ids)
    first = flash_plan.cached_plan(mask, **kw)
    assert flash_plan.cached_plan(mask, **kw) is first  # same structure, same tensors: a hit
    assert flash_plan.cached_plan(masks.document(ids), **kw) is first  # same ids tensor
    assert flash_plan.cached_plan(mask, **{**kw, "H": 4}) is not first  # other shape
    ids.copy_(torch.arange(64) // 32)  # in place: the version counter changes the key
    second = flash_plan.cached_plan(mask, **kw)
    assert second is not first
    assert [(c.start, c.n, c.count) for g in second.groups for c in g.calls] == [(0, 32, 2)]
    other = masks.document(torch.arange(64) // 16)  # equal values, another tensor: rebuilt
    assert flash_plan.cached_plan(other, **kw) is not first
    fn_mask = masks.from_fn(lambda b, h, i, j: i >= j)  # no spec: never cached
    assert flash_plan.cached_plan(fn_mask, **kw) is not flash_plan.cached_plan(fn_mask, **kw)
    monkeypatch.setenv(flash_plan.PLAN_CACHE_ENV, "0")
    assert flash_plan.cached_plan(mask, **kw) is not flash_plan.cached_plan(mask, **kw)


def test_plan_cache_skips_inference_tensors() -> None:
    """Inference tensors have no version counter: such a mask is planned every time, and flash
    runs on it (as in a transformers forward under ``torch.inference_mode``)."""
    flash_plan.clear_plan_cache()
    kw = dict(B=1, H=2, L=64, S=64, block_q=16, block_k=16, band_block=16, bias=None)
    with torch.inference_mode():
        mask = masks.causal() & masks.document(torch.arange(64) // 16)
        first = flash_plan.cached_plan(mask, **kw)
        assert flash_plan.cached_plan(mask, **kw) is not first  # planned again, no error
        q, k, v = torch.randn(3, 1, 2, 64, 8)
        out = attention(q, k, v, mask=mask, backend="flash")
        ref = attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(out, ref)


def test_plan_cache_is_bounded(monkeypatch) -> None:
    flash_plan.clear_plan_cache()
    monkeypatch.setattr(flash_plan, "PLAN_CACHE_SIZE", 3)
    kw = dict(B=1, H=1, S=64, block_q=16, block_k=16, band_block=16, bias=None)
    plans = [flash_plan.cached_plan(masks.causal(), L=64 - i, **kw) for i in range(5)]
    assert len(flash_plan._PLANS) == 3
    assert flash_plan.cached_plan(masks.causal(), L=64 - 4, **kw) is plans[4]  # recent: kept
    assert flash_plan.cached_plan(masks.causal(), L=64, **kw) is not plans[0]  # evicted


# --------------------------------------------------------------------------- cleaning scan
@pytest.fixture
def ext():
    if _ext.mode() == "off" or not _ext.load("flash_rule", wait=True):
        pytest.skip(f"C++ extension unavailable: {_ext.status('flash_rule')}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW], ids=str)
def test_clean_flagged_copies_only_non_finite_inputs(ext, dtype) -> None:
    x = seeded(2, 3, 37, 5, dtype=dtype, seed=1)
    same, bad = nan_rule.clean_flagged(x)
    assert same is x and not bad
    for val in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 36, 4] = val
        cleaned, bad = nan_rule.clean_flagged(y)
        assert bad and cleaned is not y
        assert torch.equal(cleaned, torch.nan_to_num(y, 0.0, 0.0, 0.0))
    t = x.transpose(2, 3)  # non-contiguous input
    t2 = t.clone()
    t2[0, 0, 0, 3] = float("nan")
    assert nan_rule.clean_flagged(t)[0] is t
    assert torch.equal(nan_rule.clean_flagged(t2)[0], torch.nan_to_num(t2, 0.0, 0.0, 0.0))


def test_clean_flagged_without_the_extension(monkeypatch) -> None:
    monkeypatch.setenv(_ext.ENV, "0")
    x = seeded(2, 3, 8, 5, dtype=torch.float32, seed=1)
    cleaned, bad = nan_rule.clean_flagged(x)
    assert bad and cleaned is not x and torch.equal(cleaned, x)


def test_clean_flagged_gradients(ext) -> None:
    x = seeded(2, 8, dtype=torch.float32, seed=1).requires_grad_()
    y, bad = nan_rule.clean_flagged(x)
    assert y is x and not bad
    z = x.detach().clone()
    z[0, 3] = float("nan")
    z.requires_grad_()
    y, bad = nan_rule.clean_flagged(z)
    assert bad
    y.backward(torch.ones_like(y))
    want = torch.ones_like(z)
    want[0, 3] = 0
    assert torch.equal(z.grad, want)


@pytest.mark.parametrize("name", ["window", "documents", "bigbird", "alibi"])
def test_flash_equal_with_and_without_the_scan(ext, monkeypatch, name) -> None:
    """NaN/inf planted in q, k, v: the same outputs and gradients (bit for bit) whether the
    inputs are scanned (C++) or always cleaned (PyTorch), and on finite inputs too."""
    from attnlab.positional import ALiBi

    L = 96
    mask, bias = {
        "window": (masks.sliding_window(20), None),
        "documents": (masks.causal() & masks.document.from_lengths([24] * 4), None),
        "bigbird": (masks.bigbird(16, 3, 1, 1, seed=2), None),
        "alibi": (masks.causal(), ALiBi(4)),
    }[name]
    q, k, v = qkv(L, torch.float32)
    planted = [x.clone() for x in (q, k, v)]
    planted[0][0, 1, 50, 3] = float("nan")
    planted[1][1, 0, 30, 2] = float("inf")
    planted[2][0, 1, 70, 5] = float("-inf")
    for inputs in ((q, k, v), planted):
        results = []
        for mode in ("0", "require"):
            monkeypatch.setenv(_ext.ENV, mode)
            xs = [x.clone().requires_grad_() for x in inputs]
            out = call_backend("flash", mask, bias)(*xs)
            out.backward(seeded(*out.shape, dtype=out.dtype, seed=9))
            results.append([out.detach(), *(x.grad for x in xs)])
        for a, b in zip(*results, strict=True):
            assert torch.equal(torch.isfinite(a), torch.isfinite(b))
            assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_band_block_override(monkeypatch) -> None:
    """ATTNLAB_FLASH_BAND_BLOCK sets the forward band block; results stay within the rule."""
    from attnlab.functional.flash import flash_job
    from attnlab.functional.validate import plain_request

    q, k, v = qkv(192, torch.bfloat16)
    mask = masks.sliding_window(24)
    for raw, want in (("", flash_plan.BAND_BLOCK_FWD), ("16", 16), ("64", 64)):
        monkeypatch.setenv(flash_plan.BAND_BLOCK_ENV, raw)
        req = plain_request(q, k, v, mask=mask, bias=None, scale=None, temperature=1.0, score="dot")
        job = flash_job(req)
        assert job.plan.kind == "band" and job.plan.block_q == want
        check_against_reference(
            call_backend("flash", mask),
            reference_for(mask, None),
            [q, k, v],
            mean_factor=mean_factor_for("flash", torch.bfloat16),
        )
    monkeypatch.setenv(flash_plan.BAND_BLOCK_ENV, "-3")
    with pytest.raises(
        ValueError, match=r"ATTNLAB_FLASH_BAND_BLOCK must be a positive int, got '-3'"
    ):
        flash_attention(q, k, v, mask=mask)


def test_a_mask_made_of_blocks_tiles_by_its_own_block(monkeypatch) -> None:
    """BigBird (alone or combined) tiles by its block size, so no tile is partial; the result
    is the reference's, forward and backward, and fp32 equals the 128-tile plan's."""
    from attnlab.functional.flash import flash_job
    from attnlab.functional.validate import plain_request

    assert masks.causal().natural_block() is None
    bb = masks.bigbird(64, 3, 1, 2)
    assert bb.natural_block() == 64 and (masks.causal() & bb).natural_block() == 64
    assert (bb | masks.bigbird(32, 3, 1, 1)).natural_block() is None  # two block sizes
    assert flash_plan.natural_tile(masks.bigbird(16, 3, 1, 1)) is None  # outside NATURAL_TILE
    q, k, v = qkv(448, torch.float32)
    for mask in (bb, masks.causal() & bb):
        req = plain_request(q, k, v, mask=mask, bias=None, scale=None, temperature=1.0, score="dot")
        plan = flash_job(req).plan
        assert (plan.block_q, plan.block_k) == (64, 64)
        if mask is bb:  # every tile fully attended or empty: no mask inside a call
            assert all(c.kind == "full" for g in plan.groups for c in g.calls)
        check_against_reference(call_backend("flash", mask), reference_for(mask, None), [q, k, v])
        natural = flash_attention(q, k, v, mask=mask)
        monkeypatch.setattr(flash_plan, "NATURAL_TILE", (1, 0))
        flash_plan.clear_plan_cache()
        assert flash_job(req).plan.block_q == flash_plan.BLOCK_Q
        torch.testing.assert_close(flash_attention(q, k, v, mask=mask), natural)
        monkeypatch.undo()
        flash_plan.clear_plan_cache()
