"""The flash backend's fast paths (issue 19): batched document segments, the plan cache, the
low-precision policy and the scan that cleans inputs only when they hold NaN/±inf.

Every path is forced here on any CPU (``ATTNLAB_FLASH_LOWP``, ``ATTNLAB_EXT``,
``ATTNLAB_FLASH_PLAN_CACHE``), and each is checked against the float64 reference with the
tolerance rule, or bit for bit against the path it replaces.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from attnlab import _ext, attention, masks
from attnlab.functional import flash_attention, nan_rule
from attnlab.functional.flash import band_kernel
from attnlab.functional.flash import plan as flash_plan
from attnlab.functional.flash.calls import SegmentCall
from attnlab.functional.flash.tiling import build_plan
from helpers import call_backend, check_against_reference, mean_factor_for, reference_for, seeded

LOW = [torch.bfloat16, torch.float16]
KERNEL_DTYPES = [torch.float32, *LOW]  # the C++ band kernel's (float16 widened as packed)


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
@pytest.mark.parametrize("policy", flash_plan.LOW_PRECISION_SETTINGS)
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
    """On a merge-free plan "native" calls the kernels in bfloat16; "widen" in float32 — torch's
    kernel (``ATTNLAB_FLASH_BAND_ENGINE=aten``) and attnlab's C++ band kernel alike."""
    seen: list[torch.dtype] = []
    from attnlab.functional.flash import band, engines

    real, real_band = engines.kernel_forward, band_kernel.forward_into

    def spy(q, k, v, logits):
        seen.append(q.dtype)
        return real(q, k, v, logits)

    def spy_band(out, lse, q, *rest):
        seen.append(q.dtype)
        return real_band(out, lse, q, *rest)

    monkeypatch.setattr(band, "kernel_forward", spy)
    monkeypatch.setattr(band_kernel, "forward_into", spy_band)
    q, k, v = qkv(128, torch.bfloat16)
    engines_ = ["aten"] + (["auto"] if band_kernel.ready(q, band_kernel.block(q)) else [])
    for engine in engines_:
        monkeypatch.setenv(band_kernel.ENGINE_ENV, engine)
        for policy, want in (("native", torch.bfloat16), ("widen", torch.float32)):
            monkeypatch.setenv(flash_plan.LOW_PRECISION_ENV, policy)
            seen.clear()
            out, _ = flash_attention(q, k, v, mask=masks.sliding_window(16))
            assert seen and set(seen) == {want}, (engine, policy, seen)
            assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "flags, bf16, fp16",
    [
        ("avx2 fma", False, False),
        ("avx512f avx512_bf16", True, False),
        ("amx_bf16 amx_fp16", True, True),
    ],
)
def test_auto_policy_widens_torchs_kernel_without_native_products(
    monkeypatch, flags, bf16, fp16
) -> None:
    """``auto`` (the default) hands torch's kernel a 16-bit forward call in its dtype where the
    CPU multiplies that dtype natively, else widened to float32 in the passes of `SLOW_16_BIT`;
    the backward of a flash job is widened under every policy (torch's 16-bit backward sums
    dK/dV per query block in the input dtype: `FlashJob._widen`, issue #38): forward and
    backward of a merge-free BigBird plan, and the values equal the ``native`` run's within the
    dtype's rounding."""
    from attnlab.functional.flash import engines

    monkeypatch.setattr(_ext, "cpu_flags", lambda: f"x86_64|cpu|{flags}")
    _ext.native_products.cache_clear()
    seen: list[tuple[str, torch.dtype]] = []
    real_fwd, real_bwd = engines._KERNEL_FWD, engines._KERNEL_BWD

    def spy_fwd(q, *a, **kw):
        seen.append(("fwd", q.dtype))
        return real_fwd(q, *a, **kw)

    def spy_bwd(dout, q, *a, **kw):
        seen.append(("bwd", q.dtype))
        return real_bwd(dout, q, *a, **kw)

    monkeypatch.setattr(engines, "_KERNEL_FWD", spy_fwd)
    monkeypatch.setattr(engines, "_KERNEL_BWD", spy_bwd)
    mask = masks.bigbird(64, 3, 2, 3, seed=2)  # one call per query block: merge-free
    try:
        for dtype, native in ((torch.bfloat16, bf16), (torch.float16, fp16)):
            monkeypatch.delenv(flash_plan.LOW_PRECISION_ENV, raising=False)  # the default
            for backward in (False, True):
                slow = (dtype, backward) in engines.SLOW_16_BIT
                assert engines.kernel_widens(dtype, backward) is (slow and not native)
            runs = {}
            for policy in ("auto", "native"):
                monkeypatch.setenv(flash_plan.LOW_PRECISION_ENV, policy)
                seen.clear()
                q, k, v = (x.requires_grad_() for x in qkv(1024, dtype))
                out = attention(q, k, v, mask=mask, backend="flash")
                out.backward(torch.ones_like(out))
                runs[policy] = [out, q.grad, k.grad, v.grad]
                for p in ("fwd", "bwd"):
                    slow = (dtype, p == "bwd") in engines.SLOW_16_BIT
                    wide = p == "bwd" or (policy == "auto" and slow and not native)
                    want = torch.float32 if wide else dtype
                    assert {d for q_, d in seen if q_ == p} == {want}, (policy, p, seen)
            for a, b in zip(runs["auto"], runs["native"], strict=True):
                assert a.dtype == dtype
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert not engines.kernel_widens(torch.float32, backward=True)
    finally:
        _ext.native_products.cache_clear()


def test_bad_low_precision_setting_is_named(monkeypatch) -> None:
    monkeypatch.setenv(flash_plan.LOW_PRECISION_ENV, "fast")
    q, k, v = qkv(16, torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"ATTNLAB_FLASH_LOWP must be 'auto', 'native' or 'widen', got 'fast'",
    ):
        flash_attention(q, k, v, mask=masks.causal())


# --------------------------------------------------------------------------- plan cache
def test_plan_cache_hits_and_invalidation(monkeypatch) -> None:
    flash_plan.clear_plan_cache()
    kw = dict(B=1, H=2, L=64, S=64, block_q=16, block_k=16, band_block=16, bias=None)
    ids = torch.arange(64) // 16
    mask = masks.document(ids)
    first = flash_plan.cached_plan(mask, **kw)
    assert flash_plan.cached_plan(mask, **kw) is first  # same structure, same values: a hit
    assert flash_plan.cached_plan(masks.document(ids), **kw) is first  # same ids tensor
    other = masks.document(torch.arange(64) // 16)  # equal values in another tensor: shared
    assert flash_plan.cached_plan(other, **kw) is first
    assert flash_plan.cached_plan(mask, **{**kw, "H": 4}) is not first  # other shape
    ids.copy_(torch.arange(64) // 32)  # new values: another key
    second = flash_plan.cached_plan(mask, **kw)
    assert second is not first
    assert [(c.start, c.n, c.count) for g in second.groups for c in g.calls] == [(0, 32, 2)]
    fn_mask = masks.from_fn(lambda b, h, i, j: i >= j)  # no spec: never cached
    assert flash_plan.cached_plan(fn_mask, **kw) is not flash_plan.cached_plan(fn_mask, **kw)
    monkeypatch.setenv(flash_plan.PLAN_CACHE_ENV, "0")
    assert flash_plan.cached_plan(mask, **kw) is not flash_plan.cached_plan(mask, **kw)


def test_plan_cache_sees_memory_written_behind_torch() -> None:
    """Issue 38 item 1: mask tensors refilled through NumPy views (no version bump, same data
    pointer) with a permutation of the same values — a sum or a count cannot tell — are planned
    again: the answer follows the values it runs on, for every mask family holding data."""
    flash_plan.clear_plan_cache()
    torch.manual_seed(0)
    q, k, v = (x.expand(2, -1, -1, -1) for x in torch.randn(3, 1, 2, 600, 16))
    ids, lengths, table = np.zeros(600, np.int64), np.zeros(2, np.int64), np.zeros((600, 600), bool)
    tri = np.tril(np.ones((600, 600), bool))
    family = {
        "causal & document": masks.causal() & masks.document(torch.from_numpy(ids)),
        "document": masks.document(torch.from_numpy(ids)),
        "padding": masks.padding(torch.from_numpy(lengths)),
        "tensor": masks.from_tensor(torch.from_numpy(table)),
    }
    # each second fill permutes the first: same multiset of ids, lengths and True counts
    fills = [
        ([0] * 300 + [1] * 300, [600, 450], tri),
        ([0] * 100 + [1] * 300 + [0] * 200, [450, 600], tri.T),
    ]
    for name, mask in family.items():
        for ids_now, lengths_now, table_now in fills:
            held = mask.spec()[1][0]
            before = (held.data_ptr(), held._version)
            ids[:], lengths[:], table[:] = ids_now, lengths_now, table_now
            assert (held.data_ptr(), held._version) == before  # invisible to torch
            got = attention(q, k, v, mask=mask, backend="flash")
            want = attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=name)
    # one plan per contents; padding plans hold no values (the kernel reads the lengths as a
    # key mask: `tiling.key_mask_plan`) and never enter the cache
    assert len(flash_plan._PLANS) >= 2 * (len(family) - 1)


def test_plan_cache_serves_inference_tensors() -> None:
    """Inference tensors (no version counter, as in a transformers forward under
    ``torch.inference_mode``) are cached by their contents too, and flash runs on them."""
    flash_plan.clear_plan_cache()
    kw = dict(B=1, H=2, L=64, S=64, block_q=16, block_k=16, band_block=16, bias=None)
    with torch.inference_mode():
        mask = masks.causal() & masks.document(torch.arange(64) // 16)
        first = flash_plan.cached_plan(mask, **kw)
        assert flash_plan.cached_plan(mask, **kw) is first
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
    if _ext.mode() == "off" or not _ext.load("flash_rule"):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW], ids=str)
def test_known_finite_reads_strided_inputs(ext, dtype) -> None:
    x = seeded(2, 3, 37, 5, dtype=dtype, seed=1)
    block = x[:, :, 10:20]  # a non-contiguous slice, as the causal linear scan asks about
    assert nan_rule.known_finite(block) and nan_rule.known_finite(x[:, :, :0])
    for val in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 15, 4] = val
        assert not nan_rule.known_finite(y[:, :, 10:20])
        assert nan_rule.known_finite(y[:, :, :15])  # the bad entry is outside the slice
    assert not nan_rule.known_finite(torch.empty(2, 3, device="meta", dtype=dtype))


#: views the operator reads in place (no contiguous copy): permutations of a dense block as one
#: span, else rows of contiguous values found from the other dims' strides, long rows in
#: pieces, short rows in runs
STRIDED_VIEWS = {
    "heads-last (HF layout)": lambda b: b.permute(0, 2, 1, 3),
    "last dim transposed": lambda b: b.transpose(2, 3),
    "every other value of a row": lambda b: b[..., ::2],  # rows of one value
    "every third position": lambda b: b[:, :, ::3],
    "expanded heads": lambda b: b[:, :1].expand(-1, 4, -1, -1),
    "one head of three": lambda b: b[:, 1:2],  # a size-1 dim inside the rows
    "rows longer than a piece": lambda b: b.flatten(2)[:, :, 7:-9],  # 19999 of 20015 values
}


@pytest.mark.parametrize("view", list(STRIDED_VIEWS), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_known_finite_walks_strides(ext, view, dtype) -> None:
    base = seeded(2, 3, 4003, 5, dtype=dtype, seed=2)
    make = STRIDED_VIEWS[view]
    assert not make(base).is_contiguous() and nan_rule.known_finite(make(base))
    n = base.numel()
    spots = torch.randperm(n, generator=torch.Generator().manual_seed(3))[:40].tolist()
    row = 4003 * 5  # a head's values; the last view keeps [7, row - 9) of each
    for spot in [0, n - 1, 6, 7, row - 10, row - 9, row + 6, row + 7, *spots]:
        y = base.clone()
        y.view(-1)[spot] = float("nan")
        x = make(y)
        inside = not bool(torch.isfinite(x).all())  # the bad entry is in the view, or not
        assert nan_rule.known_finite(x) is not inside, spot
        cleaned, bad = nan_rule.clean_flagged(x)
        assert bad is inside and (cleaned is x) is not inside
        assert torch.equal(cleaned, torch.nan_to_num(x, 0.0, 0.0, 0.0))


def test_known_finite_without_the_extension(monkeypatch) -> None:
    monkeypatch.setenv(_ext.ENV, "0")
    assert not nan_rule.known_finite(seeded(2, 3, 8, 5, dtype=torch.float32, seed=1))


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
    # ATTNLAB_EXT=0 also turns off the C++ band kernel: keep torch's on both sides, so only the
    # scan differs (the band kernel's own checks: test_band_kernel_*)
    monkeypatch.setenv(band_kernel.ENGINE_ENV, "aten")
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
    from attnlab.functional.request import plain_request

    q, k, v = qkv(192, torch.bfloat16)
    mask = masks.sliding_window(24)
    native = band_kernel.ready(q, band_kernel.block(q))  # the kernel's own block if it runs
    default = band_kernel.block(q) if native else flash_plan.BAND_BLOCK_FWD
    for raw, want in (("", default), ("16", 16), ("64", 64)):
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
    from attnlab.functional.request import plain_request

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


# --------------------------------------------------------------------------- C++ band kernel
@pytest.fixture
def band_ext(monkeypatch):
    """The C++ band kernel, built and selected (whatever ATTNLAB_FLASH_BAND_ENGINE says)."""
    if _ext.mode() == "off" or not _ext.load(band_kernel.EXT):
        pytest.skip(f"C++ extension unavailable: {_ext.status(band_kernel.EXT)}")
    monkeypatch.setenv(band_kernel.ENGINE_ENV, "auto")


def _count_calls(monkeypatch, name: str) -> list[int]:
    """A spy on ``band_kernel.<name>``: the returned list grows by one per call."""
    return _count_calls_of(monkeypatch, band_kernel, name)


def _count_band_kernel(monkeypatch) -> list[int]:
    return _count_calls(monkeypatch, "forward_into")


BAND_CASES = {
    # odd L, odd window, GQA (qkv: H=4, H_kv=2), head dim 16
    "window": (lambda: masks.sliding_window(37), None),
    "window non-causal": (lambda: masks.sliding_window(21, causal=False), None),
    "window + alibi": (lambda: masks.sliding_window(29), "alibi"),
    "wide window": (lambda: masks.sliding_window(150), None),
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(BAND_CASES))
def test_band_kernel_matches_reference(band_ext, monkeypatch, dtype, name) -> None:
    """Sliding windows run on the C++ kernel, forward and backward (the spies see both; the
    backward of 16-bit inputs runs widened to float32) and equal the float64 reference with
    the tolerance rule, with a bias too (rows without keys: `test_band_kernel_rows_without_keys`,
    `test_band_kernel_backward_operator`)."""
    from attnlab.positional import ALiBi

    make, bias_kind = BAND_CASES[name]
    bias = ALiBi(4) if bias_kind == "alibi" else None
    calls = _count_band_kernel(monkeypatch)
    backward_calls = _count_calls(monkeypatch, "backward_into")
    mask = make()
    check_against_reference(
        call_backend("flash", mask, bias),
        reference_for(mask, bias),
        list(qkv(203, dtype)),
        mean_factor=mean_factor_for("flash", dtype),
    )
    assert calls, "the C++ band kernel did not run"
    assert backward_calls, "the C++ band backward did not run (float32, widened 16-bit too)"


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_bias_band_plans_keep_their_inputs(band_ext, monkeypatch, dtype) -> None:
    """ALiBi on a causal mask in bfloat16/float16 (band calls per offset, merged): the C++ kernel
    gets the inputs in their dtype and writes float32 partial outputs (merged in float32, rounded
    once), where before the whole forward ran widened to float32; the result equals the widened
    run (``ATTNLAB_FLASH_BAND_ENGINE=aten``: torch's kernel in float32) within the dtype's
    rounding and the float64 reference with the tolerance rule
    (`test_band_kernel_matches_reference`)."""
    from attnlab.positional import ALiBi

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = band_kernel.forward_into

    def spy(out, lse, q, *a, **kw):
        seen.append((q.dtype, out.dtype))
        return real(out, lse, q, *a, **kw)

    monkeypatch.setattr(band_kernel, "forward_into", spy)
    q, k, v = qkv(2048, dtype, D=32)  # two band calls per row, merged
    with torch.no_grad():
        fast = attention(q, k, v, mask=masks.causal(), bias=ALiBi(4), backend="flash")
        assert seen and set(seen) == {(dtype, torch.float32)}
        monkeypatch.setenv(band_kernel.ENGINE_ENV, "aten")
        wide = attention(q, k, v, mask=masks.causal(), bias=ALiBi(4), backend="flash")
    assert fast.dtype == dtype
    assert (fast.float() - wide.float()).abs().max() <= 1.6e-2


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_band_kernel_and_aten_agree(band_ext, monkeypatch, dtype) -> None:
    """The two forward engines of band calls give the same output within the dtype's rounding,
    and ``aten`` keeps the C++ kernel out (the spy sees no call)."""
    q, k, v = qkv(333, dtype, D=32)
    mask = masks.sliding_window(64)
    calls = _count_band_kernel(monkeypatch)
    outs = {}
    for engine in ("aten", "auto"):
        monkeypatch.setenv(band_kernel.ENGINE_ENV, engine)
        calls.clear()
        outs[engine], _ = flash_attention(q, k, v, mask=mask)
        assert bool(calls) == (engine == "auto")
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    assert (outs["aten"].float() - outs["auto"].float()).abs().max() <= tol


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_band_kernel_streams_a_long_band(band_ext, monkeypatch, dtype) -> None:
    """A band longer than the kernel's per-thread key buffer (L = 4128, whole blocks: each
    thread's blocks slide it several times), GQA (two query heads per key head) and two batch
    items: the C++ kernel equals torch's kernel on the same plan (``aten``) within the dtype's
    rounding, and a NaN planted in a late key, packed after slides, is found by the in-kernel
    check and poisons exactly the rows whose window holds it (the NaN rule)."""
    L, w = 4128, 61
    q, k, v = qkv(L, dtype, B=2, H=4, H_kv=2, D=32)
    mask = masks.sliding_window(w)
    calls = _count_band_kernel(monkeypatch)
    outs = {}
    with torch.no_grad():
        for engine in ("aten", "auto"):
            monkeypatch.setenv(band_kernel.ENGINE_ENV, engine)
            calls.clear()
            outs[engine] = attention(q, k, v, mask=mask, backend="flash")
            assert bool(calls) == (engine == "auto")
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    assert (outs["aten"].float() - outs["auto"].float()).abs().max() <= tol
    k[1, 0, 3900, 7] = float("nan")
    lists, scans = _spy_checks(monkeypatch)
    with torch.no_grad():
        out = attention(q, k, v, mask=mask, backend="flash")
    assert lists and any(lists[0]) and len(scans) == 3  # found in the kernel, then re-run
    rows = out.isnan().any(-1)  # (B, H, L)
    want = torch.zeros_like(rows)
    want[1, :2, 3900 : 3900 + w] = True  # key head 0 serves query heads 0 and 1
    assert torch.equal(rows, want)


@pytest.mark.parametrize(
    ("dtype", "out_dtype", "atol"),
    # float16 inputs are widened exactly: only the output's rounding (half a step, |out| < 4)
    [
        (torch.float32, torch.float32, 2e-6),
        (torch.float16, torch.float16, 2e-3),
        (torch.float16, torch.float32, 2e-6),
    ],
    ids=str,
)
def test_band_kernel_rows_without_keys_and_clipped_windows(band_ext, dtype, out_dtype, atol):
    """The operator itself against the float64 formula of its inputs: scale, additive tile,
    GQA, a view as destination, windows reaching before key 0 and past ``limit`` (clipped), a
    fully masked row and rows past ``limit`` (out 0, lse −inf); float16 inputs with a float16
    or a float32 output (partial outputs that a plan merges)."""
    g = torch.Generator().manual_seed(0)
    H, H_kv, L, D, Dv, bq, W, nblk, r0, ks, limit = 4, 2, 90, 8, 12, 4, 11, 20, 5, -7, 60
    q = torch.randn(H, L, D, generator=g).to(dtype)
    k = torch.randn(H_kv, L, D, generator=g).to(dtype)
    v = torch.randn(H_kv, L, Dv, generator=g).to(dtype)
    add = torch.randn(nblk, 1, bq, W, generator=g)
    add[:, :, :, ::4] = float("-inf")
    add[2, 0, 1] = float("-inf")  # block 2, row 1: no key
    big = torch.zeros(nblk, H, bq + 3, Dv, dtype=out_dtype)
    out, lse = big[:, :, :bq], torch.empty(nblk, H, bq)
    torch.ops.attnlab_band.forward_into(out, lse, q, k, v, add, r0, nblk, bq, ks, W, limit, 0.7)
    dead = 0
    for t in range(nblk):
        keys = torch.arange(ks + t * bq, ks + t * bq + W)
        live = (keys >= 0) & (keys < limit)
        idx = keys.clamp(0, L - 1)
        qq = q[:, r0 + t * bq : r0 + (t + 1) * bq].double()
        kk = k[:, idx].double().repeat_interleave(2, 0)
        vv = v[:, idx].double().repeat_interleave(2, 0)
        s = (qq @ kk.transpose(-1, -2) * 0.7 + add[t].double()).masked_fill(~live, -torch.inf)
        want_lse = torch.logsumexp(s, -1)
        want = torch.softmax(s, -1).nan_to_num(0.0) @ vv
        assert torch.allclose(out[t].double(), want, rtol=0, atol=atol), t
        assert torch.equal(torch.isneginf(lse[t]), torch.isneginf(want_lse)), t
        fin = torch.isfinite(want_lse)
        assert torch.allclose(lse[t].double()[fin], want_lse[fin], rtol=0, atol=2e-6), t
        dead += int((~fin).sum())
    assert dead > H  # block 2's masked row and the rows whose window is past `limit`
    assert torch.equal(out[2, :, 1], torch.zeros(H, Dv, dtype=out_dtype))
    assert not big[:, :, bq:].any()  # nothing written outside


@pytest.mark.parametrize(
    ("sizes", "threads"),
    [
        # H, H_kv, L, D, Dv, bq, W, nblk, r0, k_start, limit, per-block tile
        ((4, 2, 90, 8, 12, 4, 11, 20, 5, -7, 60, True), 2),  # clipped windows, dead rows
        ((2, 1, 300, 16, 16, 16, 37, 17, 0, -21, 290, True), 2),  # one head split by threads
        ((2, 1, 300, 16, 16, 16, 37, 17, 0, -21, 290, True), 4),  # short ranges per thread
        ((4, 4, 2100, 16, 24, 8, 29, 250, 60, 40, 2100, False), 2),  # slides the accumulators
    ],
)
def test_band_kernel_backward_operator(band_ext, sizes, threads) -> None:
    """The backward operator against autograd on the float64 formula of the forward operator's
    blocks: dq, dk, dv added into what they held, GQA, Dv != D, windows clipped before key 0
    and at ``limit``, masked columns, a row with no key (lse +inf: no gradient), several
    threads sharing a key head's columns (their ends added under a lock) and more threads
    than blocks per head, and per-thread accumulators that slide along a long band; ten runs
    give the same bits (the shared columns are added in a fixed order)."""
    H, H_kv, L, D, Dv, bq, W, nblk, r0, ks, limit, per_block = sizes
    g = torch.Generator().manual_seed(5)
    q = torch.randn(H, L, D, generator=g)
    k = torch.randn(H_kv, L, D, generator=g)
    v = torch.randn(H_kv, L, Dv, generator=g)
    add = torch.randn(nblk if per_block else 1, 1, bq, W, generator=g)
    add[:, :, :, ::4] = float("-inf")
    add[0, 0, 1] = float("-inf")  # block 0 (every block without a per-block tile), row 1
    out, lse = torch.zeros(nblk, H, bq, Dv), torch.empty(nblk, H, bq)
    torch.ops.attnlab_band.forward_into(out, lse, q, k, v, add, r0, nblk, bq, ks, W, limit, 0.7)
    dout = torch.randn(nblk, H, bq, Dv, generator=g)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    loss = torch.zeros((), dtype=torch.float64)
    for t in range(nblk):
        keys = torch.arange(ks + t * bq, ks + t * bq + W)
        live = (keys >= 0) & (keys < limit)
        idx = keys.clamp(0, L - 1)
        kk = kd[:, idx].repeat_interleave(H // H_kv, 0)
        vv = vd[:, idx].repeat_interleave(H // H_kv, 0)
        qq = qd[:, r0 + t * bq : r0 + (t + 1) * bq]
        s = (qq @ kk.transpose(-1, -2) * 0.7 + add[t if per_block else 0].double()).masked_fill(
            ~live, -torch.inf
        )
        dead = s.isneginf().all(-1, keepdim=True)  # a row without a key: output 0, no gradient
        p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
        loss = loss + (p @ vv * dout[t].double()).sum()
    loss.backward()
    whole = {  # (H, L, ·) tensors holding the call's rows; lse +inf on rows without a key
        "out": torch.zeros(H, L, Dv),
        "dout": torch.zeros(H, L, Dv),
        "lse": torch.full((H, L), float("inf")),
    }
    for t in range(nblk):
        rows = slice(r0 + t * bq, r0 + (t + 1) * bq)
        whole["out"][:, rows], whole["dout"][:, rows] = out[t], dout[t]
        whole["lse"][:, rows] = lse[t].masked_fill(lse[t].isneginf(), float("inf"))
    assert whole["lse"].isinf().sum() > L - nblk * bq  # a row of the call has no key
    held = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    op = torch.ops.attnlab_band.backward_into
    args = (q, k, v, *whole.values(), add, r0, nblk, bq, ks, W, limit, 0.7)
    grads = _backward_runs(held, threads, 10, lambda grads: op(*grads, *args))
    for got, was, want in zip(grads, held, (qd.grad, kd.grad, vd.grad), strict=True):
        torch.testing.assert_close((got - was).double(), want, atol=2e-5, rtol=1e-5)


def _backward_runs(held: list[torch.Tensor], threads: int, n: int, run) -> list[torch.Tensor]:
    """``run(grads)`` n times on ``threads`` threads, each time on copies of ``held`` (the
    operators add into what the gradients hold): asserts that every run gives the same bits
    and returns the gradients of the first."""
    runs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(n):
            grads = [x.clone() for x in held]
            run(grads)
            runs.append(grads)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))
    return runs[0]


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_band_kernel_backward_reads_16_bit_inputs(band_ext, monkeypatch, dtype) -> None:
    """16-bit q, k, v, dout are widened as the backward packs them: the same bits as the
    operator on their float32 copies; and the flash job hands them over as they are (the spy
    sees the input dtype) with the gradients of the widened run."""
    g = torch.Generator().manual_seed(4)
    H, H_kv, L, D, Dv, bq, W, nblk, r0, ks, limit = 4, 2, 800, 32, 48, 16, 61, 40, 30, -20, 690
    shapes = ((H, D), (H_kv, D), (H_kv, Dv))
    q, k, v = (torch.randn(h, L, d, generator=g).to(dtype) for h, d in shapes)
    dout = torch.randn(H, L, Dv, generator=g).to(dtype)
    out, lse = torch.randn(H, L, Dv, generator=g), torch.rand(H, L, generator=g) + 4
    add = torch.randn(nblk, 1, bq, W, generator=g)
    add[..., ::5] = float("-inf")
    runs = []
    for x in ((q, k, v, dout), tuple(t.float() for t in (q, k, v, dout))):
        grads = [torch.zeros(H, L, D), torch.zeros(H_kv, L, D), torch.zeros(H_kv, L, Dv)]
        torch.ops.attnlab_band.backward_into(
            *grads, *x[:3], out, x[3], lse, add, r0, nblk, bq, ks, W, limit, 0.7
        )
        runs.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert runs[0][1].abs().sum() > 0

    seen: list[torch.dtype] = []
    real = band_kernel.backward_into

    def spy(grads, parts, *a, **kw):
        seen.append(parts[0].dtype)
        return real(grads, parts, *a, **kw)

    monkeypatch.setattr(band_kernel, "backward_into", spy)
    # whole blocks (768 rows): a plan of band calls only, whose backward takes the inputs as
    # they are (rows past the last block would be a plain call on torch's kernel: widened)
    qq, kk, vv = (t[None, :, :768].clone().requires_grad_() for t in (q, k, v))
    dO = torch.randn(1, H, 768, Dv, generator=g).to(dtype)
    attention(qq, kk, vv, mask=masks.sliding_window(61), backend="flash").backward(dO)
    assert seen and set(seen) == {dtype}
    wide = [t.detach().float().requires_grad_() for t in (qq, kk, vv)]
    attention(*wide, mask=masks.sliding_window(61), backend="flash").backward(dO.float())
    for a, b in zip((qq, kk, vv), wide, strict=True):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.float(), b.grad, atol=2e-2, rtol=2e-2)


def test_band_kernel_backward_checks_its_arguments(band_ext) -> None:
    """Bad backward calls are refused by the operator before any work, with the reason."""
    q = torch.randn(2, 64, 8)
    out, lse, add = torch.randn(2, 64, 8), torch.zeros(2, 64), torch.zeros(1, 1, 8, 15)
    grads = [torch.zeros(2, 64, 8) for _ in range(3)]
    op = torch.ops.attnlab_band.backward_into
    args = (q, q, q, out, out, lse, add, 0, 8, 8, -7, 15, 64, 1.0)
    b = q.bfloat16()
    with pytest.raises(RuntimeError, match="backward_into: out must be float32, got BFloat16"):
        op(*grads, b, b, b, out.bfloat16(), b, *args[5:])
    with pytest.raises(RuntimeError, match="float32 lse, dq, dk, dv, got BFloat16"):
        op(grads[0].bfloat16(), *grads[1:], b, b, b, out, b, *args[5:])
    with pytest.raises(RuntimeError, match="dout must have q's dtype, got Float"):
        op(*grads, b, b, b, out, out, *args[5:])
    with pytest.raises(RuntimeError, match="out must have q's dtype or float32, got Half"):
        torch.ops.attnlab_band.segments_backward_into(
            *grads, b, b, b, out.half(), b, lse, 0, 32, 2, True, 16, 1.0
        )
    with pytest.raises(RuntimeError, match=r"lse must be \(H, L\)"):
        op(*grads, *args[:5], lse[:, :10], *args[6:])
    with pytest.raises(RuntimeError, match="rows out of range"):
        op(*grads, *args[:7], 8, *args[8:])
    with pytest.raises(RuntimeError, match=r"add must be \(1\|nblk, 1\|H, bq, width\)"):
        op(*grads, *args[:6], add[..., :9], *args[7:])
    op(*grads, *args)  # the same call with good arguments runs
    assert grads[0].abs().sum() > 0


def test_band_kernel_not_for_meta_float64_or_bad_setting(monkeypatch) -> None:
    """Meta tensors and float64 stay on torch's kernel, and so do odd head dims and blocks in
    bfloat16 pairs (widened bfloat16 takes them); an unknown ``ATTNLAB_FLASH_BAND_ENGINE`` is
    named."""
    assert not band_kernel.ready(torch.empty(1, 2, 8, 4, device="meta"))
    assert not band_kernel.ready(torch.empty(1, 2, 8, 4, dtype=torch.float64))
    if _ext.mode() != "off" and _ext.load(band_kernel.EXT):
        for engine in ("auto", "widen"):
            monkeypatch.setenv(band_kernel.ENGINE_ENV, engine)
            odd_ok = not band_kernel.pairs(torch.bfloat16)
            assert band_kernel.ready(torch.empty(1, 2, 8, 5, dtype=torch.bfloat16)) == odd_ok
            assert band_kernel.ready(torch.empty(1, 2, 8, 4, dtype=torch.bfloat16), 7) == odd_ok
    monkeypatch.setenv(band_kernel.ENGINE_ENV, "fast")
    with pytest.raises(
        ValueError, match=r"ATTNLAB_FLASH_BAND_ENGINE must be one of auto, aten, widen"
    ):
        band_kernel.ready(torch.empty(1, 2, 8, 4))


# --------------------------------------------------------------------------- C++ segment kernel
def _count_segment_kernel(monkeypatch) -> list[int]:
    return _count_calls(monkeypatch, "segments_into")


SEGMENT_CASES = {
    # odd segment lengths (37) that the 64-row block does not divide; bfloat16 even ones (38)
    "documents causal": lambda n: masks.causal() & masks.document.from_lengths([n] * 4),
    "documents full": lambda n: masks.document.from_lengths([n] * 4),
    "documents mixed": lambda n: masks.causal() & masks.document.from_lengths([n, n, 2 * n]),
    "tiny documents": lambda n: masks.causal() & masks.document.from_lengths([2] * (2 * n)),
    "dense causal": lambda n: masks.causal(),
    "no mask": lambda n: None,
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SEGMENT_CASES))
def test_segment_kernel_matches_reference(band_ext, monkeypatch, dtype, name) -> None:
    """Packed documents, and one causal or unmasked call with L = S, run on the C++ segment
    kernel (the spies see it; float32 backward too) and equal the float64 reference with the
    tolerance rule, forward and backward (which reads the kernel's lse); GQA, head dim 16."""
    n = 38 if dtype == torch.bfloat16 else 37  # bfloat16 needs even segments
    calls = _count_segment_kernel(monkeypatch)
    backward_calls = _count_calls(monkeypatch, "segments_backward_into")
    mask = SEGMENT_CASES[name](n)
    check_against_reference(
        call_backend("flash", mask),
        reference_for(mask, None),
        list(qkv(4 * n, dtype)),
        mean_factor=mean_factor_for("flash", dtype),
    )
    assert calls, "the C++ segment kernel did not run"
    # the backward on the C++ kernel in float32: 16-bit inputs widened as it packs them, or (the
    # flash backward is always widened, issue #38) on float32 copies where the CPU multiplies
    # bfloat16 in pairs (AVX512-BF16/AMX) and the kernel takes no 16-bit backward itself
    assert backward_calls


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_segment_kernel_and_aten_agree(band_ext, monkeypatch, dtype) -> None:
    """Both engines of segment calls agree within the dtype's rounding (lse too); ``aten`` and
    segments longer than `band_kernel.SEGMENT_MAX` keep the C++ kernel out."""
    q, k, v = qkv(400, dtype, D=32)
    mask = masks.causal() & masks.document.from_lengths([200, 200])
    calls = _count_segment_kernel(monkeypatch)
    runs = {}
    for engine, limit, want in (("aten", 4096, False), ("auto", 199, False), ("auto", 4096, True)):
        monkeypatch.setenv(band_kernel.ENGINE_ENV, engine)
        monkeypatch.setattr(band_kernel, "SEGMENT_MAX", limit)
        calls.clear()
        runs[(engine, limit)] = flash_attention(q, k, v, mask=mask)
        assert bool(calls) == want, (engine, limit)
    (o_a, l_a), (o_c, l_c) = runs[("aten", 4096)], runs[("auto", 4096)]
    # the two kernels round bfloat16 products in different places: lse moves by ~1e-4
    tol, tol_lse = (2e-6, 2e-5) if dtype == torch.float32 else (1.6e-2, 1e-3)
    assert (o_a.float() - o_c.float()).abs().max() <= tol
    assert (l_a - l_c).abs().max() <= tol_lse
    torch.testing.assert_close(runs[("auto", 199)], runs[("aten", 4096)], rtol=0, atol=0)


def _long_segment() -> tuple[int, int, int, int]:
    """``(L, start, n, count)`` for one segment over two whole score spans and part of a third
    (`attnlab_band::segment_span`: the forward merges their softmax online)."""
    n = 2 * torch.ops.attnlab_band.segment_span() + 37
    return n + 9, 5, n, 1


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("long", [False, True], ids=["short", "spans"])
def test_segment_kernel_operator(band_ext, causal, long) -> None:
    """The operator itself against the float64 formula: segments from an offset, a block that
    does not divide them, GQA, Dv != D, a strided destination; rows outside the segments keep
    what they held; a segment longer than two score spans."""
    g = torch.Generator().manual_seed(1)
    H, H_kv, L, D, Dv, start, n, count = 4, 2, 120, 8, 12, 5, 33, 3
    if long:
        L, start, n, count = _long_segment()
    q = torch.randn(H, L, D, generator=g)
    k = torch.randn(H_kv, L, D, generator=g)
    v = torch.randn(H_kv, L, Dv, generator=g)
    big = torch.full((H, L, Dv + 3), 7.0)
    out, lse = big[..., :Dv], torch.full((H, L), 7.0)
    torch.ops.attnlab_band.segments_into(out, lse, q, k, v, start, n, count, causal, 16, 0.6)
    for s in range(count):
        rows = slice(start + s * n, start + (s + 1) * n)
        qq = q[:, rows].double()
        kk = k[:, rows].double().repeat_interleave(2, 0)
        vv = v[:, rows].double().repeat_interleave(2, 0)
        sc = qq @ kk.transpose(-1, -2) * 0.6
        if causal:
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        assert torch.allclose(out[:, rows].double(), torch.softmax(sc, -1) @ vv, atol=2e-6)
        assert torch.allclose(lse[:, rows].double(), torch.logsumexp(sc, -1), atol=2e-6)
    end = start + count * n
    for t in (out[:, :start], out[:, end:], lse[:, :start], lse[:, end:], big[..., Dv:]):
        assert torch.equal(t, torch.full_like(t, 7.0))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("threads", "long"), [(1, False), (2, False), (2, True)])
def test_segment_kernel_backward_operator(band_ext, causal, threads, long) -> None:
    """The segment backward operator against autograd on the float64 formula: segments from an
    offset, a block that does not divide them, GQA, Dv != D, gradients added into what they
    held (rows and keys outside the segments keep it), the same bits on every run; a segment
    longer than two score spans."""
    g = torch.Generator().manual_seed(2)
    H, H_kv, L, D, Dv, start, n, count, bq = 4, 2, 120, 8, 12, 5, 33, 3, 16
    if long:
        L, start, n, count = _long_segment()
    q = torch.randn(H, L, D, generator=g)
    k = torch.randn(H_kv, L, D, generator=g)
    v = torch.randn(H_kv, L, Dv, generator=g)
    out, lse = torch.zeros(H, L, Dv), torch.full((H, L), float("inf"))
    torch.ops.attnlab_band.segments_into(out, lse, q, k, v, start, n, count, causal, bq, 0.6)
    dout = torch.randn(H, L, Dv, generator=g)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    loss = torch.zeros((), dtype=torch.float64)
    for s in range(count):
        rows = slice(start + s * n, start + (s + 1) * n)
        kk = kd[:, rows].repeat_interleave(2, 0)
        vv = vd[:, rows].repeat_interleave(2, 0)
        sc = qd[:, rows] @ kk.transpose(-1, -2) * 0.6
        if causal:
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        loss = loss + (torch.softmax(sc, -1) @ vv * dout[:, rows].double()).sum()
    loss.backward()
    held = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    op = torch.ops.attnlab_band.segments_backward_into
    args = (q, k, v, out, dout, lse, start, n, count, causal, bq, 0.6)
    grads = _backward_runs(held, threads, 3, lambda grads: op(*grads, *args))
    for got, was, want in zip(grads, held, (qd.grad, kd.grad, vd.grad), strict=True):
        torch.testing.assert_close((got - was).double(), want, atol=2e-5, rtol=1e-5)
        end = start + count * n
        assert torch.equal(got[:, :start], was[:, :start]) and torch.equal(
            got[:, end:], was[:, end:]
        )


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_segment_kernel_backward_reads_16_bit_inputs(band_ext, dtype) -> None:
    """16-bit q, k, v, dout are widened as the segment backward packs them: the same bits as the
    operator on their float32 copies, with out float32 or in q's dtype (δ reads it widened); the
    head dim and segments are odd (no pairs here)."""
    g = torch.Generator().manual_seed(5)
    H, H_kv, L, D, Dv, start, n, count, bq = 4, 2, 130, 15, 9, 3, 41, 3, 16
    q, k, v = (
        torch.randn(h, L, d, generator=g).to(dtype) for h, d in ((H, D), (H_kv, D), (H_kv, Dv))
    )
    dout = torch.randn(H, L, Dv, generator=g).to(dtype)
    out, lse = torch.randn(H, L, Dv, generator=g), torch.rand(H, L, generator=g) + 4
    op = torch.ops.attnlab_band.segments_backward_into
    for o in (out, out.to(dtype)):
        runs = []
        for x in ((q, k, v, dout, o), tuple(t.float() for t in (q, k, v, dout, o))):
            grads = [torch.zeros(H, L, D), torch.zeros(H_kv, L, D), torch.zeros(H_kv, L, Dv)]
            op(*grads, *x[:3], x[4], x[3], lse, start, n, count, True, bq, 0.7)
            runs.append(grads)
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        assert all(t.abs().sum() > 0 for t in runs[0])


def test_segment_kernel_checks_its_arguments(band_ext) -> None:
    """Bad calls are refused by the operator before any work, with the reason."""
    q = torch.randn(2, 64, 8)
    out, lse = torch.empty(2, 64, 8), torch.empty(2, 64)
    op = torch.ops.attnlab_band.segments_into
    with pytest.raises(RuntimeError, match="segments out of range"):
        op(out, lse, q, q, q, 10, 30, 2, True, 16, 1.0)
    qb = q.bfloat16()
    if band_kernel.pairs(torch.bfloat16):  # bfloat16 pairs need even segments
        with pytest.raises(RuntimeError, match="even segment length"):
            op(out.bfloat16(), lse, qb, qb, qb, 0, 31, 2, True, 16, 1.0)
    op(out.bfloat16(), lse, qb, qb, qb, 0, 31, 2, True, 16, 1.0, True)  # widened: any length
    with pytest.raises(RuntimeError, match=r"out must be \(H, L, Dv\)"):
        op(out[:, :10], lse, q, q, q, 0, 32, 2, True, 16, 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 only, got Double"):
        qd = q.double()
        op(out.double(), lse, qd, qd, qd, 0, 32, 2, True, 16, 1.0)
    assert band_kernel.segments_usable(qb, qb, qb, 31) == (not band_kernel.pairs(torch.bfloat16))


@pytest.mark.parametrize("name", ["window", "window + alibi", "documents", "dense causal"])
def test_bfloat16_widened_forward_matches_reference(band_ext, monkeypatch, name) -> None:
    """``ATTNLAB_FLASH_BAND_ENGINE=widen`` (what CPUs without AVX512-BF16/AMX run: an AVX2-only
    AMD EPYC) runs bfloat16 band and segment calls on the C++ kernel with the inputs widened to
    float32 as they are packed, on any CPU: an odd head dim and odd segments (which bfloat16
    pairs refuse), float32's query block, the float64 reference with the tolerance rule; the
    backward runs attnlab's C++ kernel too (band and segment backwards read bfloat16 widened)."""
    from attnlab.positional import ALiBi

    monkeypatch.setenv(band_kernel.ENGINE_ENV, "widen")
    assert not band_kernel.pairs(torch.bfloat16)
    q = torch.zeros(1, 1, 8, 15, dtype=torch.bfloat16)
    assert band_kernel.ready(q, 17) and band_kernel.block(q) == band_kernel.BLOCK
    cases = {
        "window": (masks.sliding_window(37), None, "forward_into"),
        "window + alibi": (masks.sliding_window(29), ALiBi(4), "forward_into"),
        "documents": (
            masks.causal() & masks.document.from_lengths([37] * 4),
            None,
            "segments_into",
        ),
        "dense causal": (masks.causal(), None, "segments_into"),
    }
    mask, bias, op = cases[name]
    calls = _count_calls(monkeypatch, op)
    backward_op = "backward_into" if op == "forward_into" else "segments_backward_into"
    backward_calls = _count_calls(monkeypatch, backward_op)
    check_against_reference(
        call_backend("flash", mask, bias),
        reference_for(mask, bias),
        list(qkv(148, torch.bfloat16, D=15)),
        mean_factor=mean_factor_for("flash", torch.bfloat16),
    )
    assert calls, f"the C++ kernel's {op} did not run"
    assert backward_calls, f"the C++ kernel's {backward_op} did not run"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_auto_sends_one_segment_to_flash_when_the_kernel_runs_it(band_ext, monkeypatch, dtype):
    """A causal or unmasked call with L = S goes to flash from the ``sparse`` threshold (L = 512
    by default) when the C++ segment kernel runs it, and stays on sdpa below it, with a bias,
    with L != S, or when torch's kernel would run it (``ATTNLAB_FLASH_BAND_ENGINE=aten``)."""
    from attnlab import explain
    from attnlab.functional import thresholds

    monkeypatch.setenv(thresholds.ENV, "off")  # the built-in thresholds, whatever is cached

    def picked(L: int, S: int | None = None, **kw) -> str:
        q = torch.zeros(1, 2, L, 8, dtype=dtype)
        k = torch.zeros(1, 2, L if S is None else S, 8, dtype=dtype)
        return explain(q, k, k, **kw).backend

    assert picked(512, mask=masks.causal()) == "flash"
    assert picked(512) == "flash"
    assert picked(256, mask=masks.causal()) == "sdpa"
    assert picked(512, 520) == "sdpa"  # unmasked, L != S: not one segment
    assert picked(512, bias=torch.zeros(512, 512, dtype=dtype)) == "sdpa"
    monkeypatch.setenv(band_kernel.ENGINE_ENV, "aten")
    assert picked(512, mask=masks.causal()) == "sdpa"


def _spy_checks(monkeypatch) -> tuple[list[list[bool]], list[int]]:
    """Spies on ``band_kernel.checking_inputs`` (the lists it yields) and on the NaN rule's
    scans (``nan_rule.clean_flagged`` calls)."""
    import contextlib

    lists: list[list[bool]] = []
    real = band_kernel.checking_inputs

    @contextlib.contextmanager
    def spy():
        with real() as found:
            lists.append(found)
            yield found

    monkeypatch.setattr(band_kernel, "checking_inputs", spy)
    return lists, _count_calls_of(monkeypatch, nan_rule, "clean_flagged")


@contextlib.contextmanager
def _finding():
    """`band_kernel.checking_inputs` as if the kernel had found a non-finite entry."""
    yield [True]


def _count_calls_of(monkeypatch, module, name: str) -> list[int]:
    """A spy on ``module.<name>``: the returned list grows by one per call."""
    calls: list[int] = []
    real = getattr(module, name)

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("where", ["none", "q nan", "k nan", "k inf", "v nan", "unread k"])
def test_band_kernel_checks_the_inputs_it_reads(band_ext, monkeypatch, dtype, where) -> None:
    """A plan of band calls skips the NaN rule's three scans (with or without autograd): the C++
    kernel tests the q, k, v entries it reads, and a find re-runs the call on the scanning path.
    Finite inputs give the scanning path's result bit for bit; with a non-finite entry the
    output follows the NaN rule (the float64 reference: NaN exactly on the rows that attend
    it)."""
    L, S = 192, 229  # whole blocks; bottom-right windows of 37 keys: key 0 is in no window
    mask = masks.sliding_window(37)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g).to(dtype) for n in (L, S, S))
    bad = {"q nan": (q, 50, float("nan")), "k nan": (k, 120, float("nan"))}
    bad |= {"k inf": (k, 7, float("inf")), "v nan": (v, 200, float("nan"))}
    bad |= {"unread k": (k, 0, float("nan"))}
    if where in bad:
        x, row, value = bad[where]
        x[1, 2, row, 5] = value
    lists, scans = _spy_checks(monkeypatch)
    with torch.no_grad():
        out = attention(q, k, v, mask=mask, backend="flash")
    assert lists and lists[0], "the checked band path did not run"
    found = any(lists[0])
    assert found == (where not in ("none", "unread k"))
    assert (len(scans) == 3) == found  # the scanning path ran exactly when the kernel found one
    ref = attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert torch.equal(out.isnan(), ref.isnan())
    if where != "none":
        assert out.isnan().any() == (where != "unread k")
    fin = ~ref.isnan()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double()[fin] - ref[fin]).abs().max() <= tol
    if where == "none":  # with autograd: the same checked path, the same bits, and the
        # gradient of the scanning path (forced: `checking_inputs` reports a find)
        qg = q.clone().requires_grad_()
        fast = attention(qg, k, v, mask=mask, backend="flash")
        assert not scans and torch.equal(out, fast.detach())
        (grad,) = torch.autograd.grad(fast.sum(), qg)
        monkeypatch.setattr(band_kernel, "checking_inputs", _finding)
        slow = attention(qg, k, v, mask=mask, backend="flash")
        assert len(scans) == 3 and torch.equal(slow.detach(), out)
        assert torch.equal(torch.autograd.grad(slow.sum(), qg)[0], grad)


def test_band_kernel_check_needs_a_plan_of_band_calls_only(band_ext, monkeypatch) -> None:
    """Rows past the last whole block run as a plain call on torch's kernel: such a plan keeps
    the NaN rule's scans (the kernel cannot vouch for inputs it does not read)."""
    q, k, v = qkv(203, torch.float32)
    lists, scans = _spy_checks(monkeypatch)
    with torch.no_grad():
        attention(q, k, v, mask=masks.sliding_window(37), backend="flash")
    assert not lists and len(scans) == 3
