"""Key masks (padding) on the tiled backend: one keyed segment call per batch item whose C++
kernel reads the key mask — the plan reads no value (issue #40, Build 1).

transformers hands every model a 2-D ``attention_mask`` (all ones, left- or right-padded); the
bridge makes it ``causal() & from_tensor(valid[:, None, None, :])``. These tests hold the plan
to structure (built on meta tensors), the kernel to the float64 reference on every kind of 0/1
key mask (left, right, holes, all ones, a batch item with no key), forward and backward, in
every dtype the kernel takes, on its operator directly (segments from an offset, score spans),
under Inductor, and with the NaN rule.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import _ext, attention, explain, masks
from attnlab.functional.flash import band_kernel
from attnlab.functional.flash.calls import KEYED_ROWS, BandCall, SegmentCall
from attnlab.functional.flash.tiling import key_mask_plan
from helpers import check_against_reference, mean_factor_for, reference_for, seeded

KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def band_ext(monkeypatch):
    """The C++ band kernel, built and selected (whatever ATTNLAB_FLASH_BAND_ENGINE says)."""
    if _ext.mode() == "off" or not _ext.load(band_kernel.EXT):
        pytest.skip(f"C++ extension unavailable: {_ext.status(band_kernel.EXT)}")
    monkeypatch.setenv(band_kernel.ENGINE_ENV, "auto")


def _spy(monkeypatch, module, name: str) -> list[object]:
    """Records the ``keys`` argument of every ``module.<name>`` call."""
    seen: list[object] = []
    real = getattr(module, name)

    def spy(*a, **kw):
        seen.append(kw["keys"] if "keys" in kw else a[-1])
        return real(*a, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def key_masks(B: int, S: int) -> dict[str, torch.Tensor]:
    """``(B, S)`` 0/1 key masks of every kind transformers or a user hands over."""
    g = torch.Generator().manual_seed(11)
    left = torch.arange(S) >= torch.tensor([S // 4, 0, S - 37])[:B, None]
    right = torch.arange(S) < torch.tensor([S - S // 3, S, 41])[:B, None]
    holes = torch.rand(B, S, generator=g) > 0.4
    holes[:, :5] = False  # holes inside a run that starts late
    empty = left.clone()
    empty[1] = False  # a batch item without any key: its rows are zeros
    return {
        "left": left,
        "right": right,
        "holes": holes,
        "ones": torch.ones(B, S, dtype=torch.bool),
        "empty item": empty,
    }


def qkv(B: int, L: int, dtype: torch.dtype, H: int = 4, H_kv: int = 2, D: int = 16):
    return [seeded(B, h, L, D, dtype=dtype, seed=s) for h, s in ((H, 3), (H_kv, 4), (H_kv, 5))]


# --------------------------------------------------------------------------- the plan
def test_key_mask_plans_are_structure_only() -> None:
    """The keyed plan is built from the mask's structure: on meta tensors (no value exists to
    read) it is one keyed segment call per batch range, causal or not, for padding lengths,
    (B, 1, 1, S) tensors and their ``&``/``|``/``~``; masks that vary by row or head, windows,
    L != S and biases get none."""
    B, L = 3, 100
    meta = torch.ones(B, 1, 1, L, dtype=torch.bool, device="meta")
    lengths = torch.tensor([100, 40, 7], device="meta")
    keyed = {
        "tensor & causal": (masks.causal() & masks.from_tensor(meta), True),
        "tensor": (masks.from_tensor(meta), False),
        "padding & causal": (masks.padding(lengths) & masks.causal(), True),
        "two key masks": (masks.from_tensor(meta) & masks.padding(lengths), False),
        "or, not": ((masks.from_tensor(meta) | ~masks.padding(lengths)) & masks.causal(), True),
        "a window wider than L": (masks.sliding_window(L + 5) & masks.from_tensor(meta), True),
    }
    sizes = {"B": B, "H": 4, "L": L, "S": L, "band_block": 16, "bias": None}
    meta_dev = torch.device("meta")
    for name, (mask, causal) in keyed.items():
        found = key_mask_plan(mask, device=meta_dev, **sizes)
        assert found is not None, name
        p, keys, rows = found
        assert rows is None, name
        (call,) = [c for g in p.groups for c in g.calls]
        assert isinstance(call, SegmentCall) and call.keyed and call.causal == causal, name
        assert (call.n, call.count, call.start) == (L, 1, 0) and p.covers_all, name
        assert keys.shape[-1] == L and keys.dtype == torch.bool and keys.is_meta, name
    # a sliding window: its batched band plan, every band call keyed (any L <= S)
    for n in (L, L - 13):
        window = masks.sliding_window(9) & masks.from_tensor(meta)
        p, _, _ = key_mask_plan(window, device=meta_dev, **(sizes | {"L": n}))
        bands = [c for g in p.groups for c in g.calls if isinstance(c, BandCall)]
        assert bands and all(c.keyed for c in bands) and p.kind == "band, key mask"
    rowwise = torch.ones(B, 1, L, L, dtype=torch.bool, device="meta")
    for name, mask, kw in (
        ("rows differ", masks.from_tensor(rowwise) & masks.causal(), {}),
        ("causal alone", masks.causal(), {}),
        ("documents", masks.document(torch.zeros(L, dtype=torch.long)), {}),
        ("L != S, causal", masks.from_tensor(meta) & masks.causal(), {"L": L - 1}),
        ("bias", masks.from_tensor(meta), {"bias": "fn"}),
        (
            "a window as wide as the keys",
            masks.sliding_window(L - 3) & masks.from_tensor(meta),
            {"L": 50},
        ),
    ):
        assert key_mask_plan(mask, device=meta_dev, **(sizes | kw)) is None, name


def test_keyed_calls_as_simple_calls_cover_each_row_once() -> None:
    """Run as simple calls (the torch engine, the NaN rule, stats) a keyed segment call is one
    masked call per `KEYED_ROWS` rows over every key they may reach: no row is split."""
    for causal in (True, False):
        calls = SegmentCall(0, 2, 0, 150, 1, causal, keyed=True).block_calls()
        assert [c.r0 for c in calls] == list(range(0, 150, KEYED_ROWS))
        assert all(c.kind == "masked" and c.keys[0] == 0 for c in calls)
        assert [c.keys[1] for c in calls] == [c.r1 if causal else 150 for c in calls]


# --------------------------------------------------------------------------- the kernel
BANDS = {
    "causal": (masks.causal, "segments_into", "segments_backward_into"),
    "encoder": (None, "segments_into", "segments_backward_into"),
    "window": (lambda: masks.sliding_window(29), "forward_into", "backward_into"),
}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("kind", list(key_masks(3, 8)))
def test_key_masks_match_the_reference(band_ext, monkeypatch, dtype, band, kind) -> None:
    """Every kind of 0/1 key mask, causal, unmasked or with a sliding window, runs on attnlab's
    C++ kernels with the key mask, forward and backward (the spies see it: one segment call per
    item, or the window's band call), and equals the float64 reference with the tolerance rule
    (rows without a key: zeros); GQA, odd L (even in bfloat16 pairs)."""
    L = 202 if dtype == torch.bfloat16 else 201
    valid = key_masks(3, L)[kind]
    make, fwd_op, bwd_op = BANDS[band]
    mask = masks.from_tensor(valid[:, None, None, :])
    mask = make() & mask if make is not None else mask
    fwd = _spy(monkeypatch, band_kernel, fwd_op)
    bwd = _spy(monkeypatch, band_kernel, bwd_op)
    check_against_reference(
        lambda q, k, v: attention(q, k, v, mask=mask, backend="flash"),
        reference_for(mask, None),
        qkv(3, L, dtype),
        mean_factor=mean_factor_for("flash", dtype),
    )
    assert fwd and all(isinstance(k, torch.Tensor) and k.shape == (L,) for k in fwd)
    assert bwd and all(isinstance(k, torch.Tensor) for k in bwd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_and_key_mask_with_fewer_queries(band_ext, dtype) -> None:
    """A sliding window with a key mask and L < S (a chunk of queries after cached keys,
    bottom-right aligned), soft-capped without gradient too: the reference's values."""
    B, L, S = 3, 150, 211
    valid = key_masks(B, S)["holes"] | key_masks(B, S)["left"]
    mask = masks.sliding_window(40) & masks.from_tensor(valid[:, None, None, :])
    q, k, v = qkv(B, S, dtype)
    q = q[:, :, :L].contiguous()
    check_against_reference(
        lambda q, k, v: attention(q, k, v, mask=mask, backend="flash"),
        reference_for(mask, None),
        [q, k, v],
        mean_factor=mean_factor_for("flash", dtype),
    )
    with torch.no_grad():
        got = attention(q, k, v, mask=mask, backend="flash", softcap=5.0)
        ref = reference_for(mask, None, softcap=5.0)
        want = ref(q.double(), k.double(), v.double(), compute_dtype=torch.float64, reorder=False)
    assert (got.double() - want).abs().max() < (2e-6 if dtype == torch.float32 else 3e-2)


def test_padding_lengths_and_the_explanation(band_ext) -> None:
    """``masks.padding(lengths)`` (tensor lengths, one item empty) takes the keyed call too, and
    `explain` says the kernel reads the key mask."""
    q, k, v = qkv(3, 97, torch.float32)
    mask = masks.causal() & masks.padding(torch.tensor([97, 0, 30]))
    check_against_reference(
        lambda q, k, v: attention(q, k, v, mask=mask, backend="flash"),
        reference_for(mask, None),
        [q, k, v],
        mean_factor=mean_factor_for("flash", torch.float32),
    )
    text = explain(q, k, v, mask=mask, backend="flash")
    assert "key mask plan" in text.plan and "the kernel reads the key mask" in text.plan


def _segment_reference(q, k, v, keys, start, n, count, causal, scale):
    """float64 ``(out, lse)`` of each segment's rows over its kept keys (None where none)."""
    G = q.shape[0] // k.shape[0]
    outs = []
    for s in range(count):
        rows = slice(start + s * n, start + (s + 1) * n)
        kk = k[:, rows].double().repeat_interleave(G, 0)
        vv = v[:, rows].double().repeat_interleave(G, 0)
        sc = q[:, rows].double() @ kk.transpose(-1, -2) * scale
        keep = keys[rows].view(1, 1, n).expand(1, n, n)
        if causal:
            keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
        sc = sc.masked_fill(~keep, -torch.inf)
        lse = torch.logsumexp(sc, -1)
        out = torch.nan_to_num(torch.softmax(sc, -1)) @ vv
        outs.append((rows, out, lse))
    return outs


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("long", [False, True], ids=["short", "spans"])
def test_keyed_segment_operator(band_ext, causal, long) -> None:
    """The operator with a key mask against the float64 formula: several segments from an
    offset, each with its own run of keys (late start, holes, none at all), GQA, Dv != D, a
    block that does not divide the segments; a segment over more than two score spans whose
    keys start past the first span; the backward against autograd on the formula."""
    g = torch.Generator().manual_seed(4)
    H, H_kv, D, Dv, bq, scale = 4, 2, 8, 12, 16, 0.6
    if long:
        n = 2 * torch.ops.attnlab_band.segment_span() + 37
        start, count = 5, 1
        keys = torch.zeros(start + n + 9, dtype=torch.bool)
        keys[start + 2100 : start + n - 50] = True  # the first key lies in the second span
        keys[start + 3000 : start + 3100] = False  # and a hole
    else:
        start, n, count = 5, 33, 4
        keys = torch.rand(start + count * n + 7, generator=g) > 0.3
        keys[start : start + 9] = False  # segment 0 starts late
        keys[start + 2 * n : start + 3 * n] = False  # segment 2 has no key
        keys[start + 3 * n : start + 4 * n] = True  # segment 3 has every key
    L = keys.numel()
    q = torch.randn(H, L, D, generator=g)
    k = torch.randn(H_kv, L, D, generator=g)
    v = torch.randn(H_kv, L, Dv, generator=g)
    out, lse = torch.full((H, L, Dv), 7.0), torch.full((H, L), 7.0)
    args = (start, n, count, causal, bq, scale)
    torch.ops.attnlab_band.segments_into(out, lse, q, k, v, *args, keys=keys)
    want = _segment_reference(q, k, v, keys, start, n, count, causal, scale)
    for rows, o, l in want:
        torch.testing.assert_close(out[:, rows].double(), o, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse[:, rows].double(), l, atol=2e-6, rtol=0)
    assert torch.equal(out[:, :start], torch.full_like(out[:, :start], 7.0))
    # backward: lse +inf on rows without a key, as the job hands it over
    lse_b = torch.where(torch.isneginf(lse), torch.inf, lse)
    dout = torch.randn(H, L, Dv, generator=g)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    loss = sum(
        (o * dout[:, rows].double()).sum()
        for rows, o, _ in _segment_reference(qd, kd, vd, keys, start, n, count, causal, scale)
    )
    loss.backward()
    grads = [torch.zeros(x.shape) for x in (q, k, v)]
    op = torch.ops.attnlab_band.segments_backward_into
    op(*grads, q, k, v, out, dout, lse_b, *args, keys=keys)
    for got, want_g in zip(grads, (qd.grad, kd.grad, vd.grad), strict=True):
        torch.testing.assert_close(got.double(), want_g, atol=3e-5, rtol=1e-5)


def test_keyed_operator_checks_its_key_mask(band_ext) -> None:
    """A key mask of the wrong dtype, rank, length or stride is refused before any work."""
    q = torch.randn(2, 64, 8)
    out, lse = torch.empty(2, 64, 8), torch.empty(2, 64)
    op = torch.ops.attnlab_band.segments_into
    for keys, words in (
        (torch.ones(64), "1-D unit-stride bool"),
        (torch.ones(1, 64, dtype=torch.bool), "1-D unit-stride bool"),
        (torch.ones(128, dtype=torch.bool)[::2], "1-D unit-stride bool"),
        (torch.ones(63, dtype=torch.bool), "one entry per key"),
    ):
        with pytest.raises(RuntimeError, match=words):
            op(out, lse, q, q, q, 0, 64, 1, True, 16, 1.0, keys=keys)


# --------------------------------------------------------------------------- users' tools
def test_keyed_plan_under_inductor(band_ext, monkeypatch) -> None:
    """transformers' padded causal mask through ``torch.compile`` (Inductor, fullgraph): the
    compiled call runs the keyed C++ kernel and equals the reference, gradients too."""
    B, L = 3, 131
    valid = key_masks(B, L)["left"]

    def fn(q, k, v, valid):
        mask = masks.causal() & masks.from_tensor(valid[:, None, None, :])
        return attention(q, k, v, mask=mask, backend="flash")

    compiled = torch.compile(fn, fullgraph=True)
    fwd = _spy(monkeypatch, band_kernel, "segments_into")
    mask = masks.causal() & masks.from_tensor(valid[:, None, None, :])
    check_against_reference(
        lambda q, k, v: compiled(q, k, v, valid),
        reference_for(mask, None),
        qkv(B, L, torch.float32),
        mean_factor=mean_factor_for("flash", torch.float32),
    )
    assert fwd


@pytest.mark.parametrize("where", ["padded key", "attended key"])
def test_keyed_plan_keeps_the_nan_rule(band_ext, where) -> None:
    """A NaN in a padded key reaches no row; one in an attended key makes exactly the rows
    that attend it NaN (the NaN rule walks the keyed call as simple calls)."""
    B, L = 2, 150
    valid = key_masks(B, L)["left"]  # item 0 starts at key 37
    q, k, v = qkv(B, L, torch.float32)
    j = 10 if where == "padded key" else 90
    k[0, 1, j, 2] = float("nan")
    mask = masks.causal() & masks.from_tensor(valid[:, None, None, :])
    got = attention(q, k, v, mask=mask, backend="flash")
    want = attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert torch.equal(got.isnan(), want.isnan())
    assert got.isnan().any() == (where == "attended key")
    torch.testing.assert_close(got.nan_to_num(), want.float().nan_to_num(), atol=2e-6, rtol=0)


def test_keyed_plan_without_the_kernel(monkeypatch) -> None:
    """Where attnlab's C++ kernel does not run (``aten``), a key mask takes the block-map plan
    on torch's kernel: the same values."""
    monkeypatch.setenv(band_kernel.ENGINE_ENV, "aten")
    q, k, v = qkv(3, 99, torch.float32)
    valid = key_masks(3, 99)["holes"]
    mask = masks.causal() & masks.from_tensor(valid[:, None, None, :])
    check_against_reference(
        lambda q, k, v: attention(q, k, v, mask=mask, backend="flash"),
        reference_for(mask, None),
        [q, k, v],
        mean_factor=mean_factor_for("flash", torch.float32),
    )
    assert "key mask plan" not in explain(q, k, v, mask=mask, backend="flash").plan


# --------------------------------------------------------------------------- query padding
def test_query_masks_are_structure_only_too() -> None:
    """A mask over query rows (a ``(B, 1, L, 1)`` tensor, `Mask.over_queries`) with a band and
    key masks plans from structure (meta tensors): the same keyed calls (an all-ones key mask
    without one: run as simple calls they evaluate the whole mask) and the rows the job
    zeroes."""
    B, L = 3, 100
    dev = torch.device("meta")
    rows_t = masks.from_tensor(torch.ones(B, 1, L, 1, dtype=torch.bool, device=dev))
    keys_t = masks.from_tensor(torch.ones(B, 1, 1, L, dtype=torch.bool, device=dev))
    sizes = {"B": B, "H": 4, "L": L, "S": L, "band_block": 16, "bias": None, "device": dev}
    for mask in (masks.causal() & rows_t, rows_t & keys_t & ~rows_t):
        p, keys, rows = key_mask_plan(mask, **sizes)
        (call,) = [c for g in p.groups for c in g.calls]
        assert call.keyed and keys.shape[-1] == L and p.kind == "key/row mask"
        assert rows is not None and rows.shape == (B, L) and rows.is_meta
    assert rows_t.over_queries and not rows_t.over_keys and keys_t.over_keys
    assert not masks.from_tensor(torch.ones(B, 1, 1, 1, dtype=torch.bool)).over_queries


QUERY_CASES = {
    "rows, causal": lambda q, k: masks.causal() & q,
    "rows and keys, causal": lambda q, k: masks.causal() & q & k,
    "rows and keys": lambda q, k: q & k,
    "rows, window": lambda q, k: masks.sliding_window(29) & q & k,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(QUERY_CASES))
def test_query_masks_match_the_reference(band_ext, dtype, name) -> None:
    """Query padding (rows that attend nothing: zeros, no gradient) with or without key
    padding, causal, unmasked or windowed, on attnlab's kernels: the float64 reference with the
    tolerance rule, forward and backward; `explain` names the plan."""
    B, L = 3, 202
    rows = torch.ones(B, L, dtype=torch.bool)
    rows[0, 150:], rows[1, :20], rows[2, ::5] = False, False, False
    keys = key_masks(B, L)["left"]
    mask = QUERY_CASES[name](
        masks.from_tensor(rows[:, None, :, None]), masks.from_tensor(keys[:, None, None, :])
    )
    q, k, v = qkv(B, L, dtype)
    check_against_reference(
        lambda q, k, v: attention(q, k, v, mask=mask, backend="flash"),
        reference_for(mask, None),
        [q, k, v],
        mean_factor=mean_factor_for("flash", dtype),
    )
    assert "mask plan" in explain(q, k, v, mask=mask, backend="flash").plan


def test_a_masked_query_row_is_zeros_whatever_its_q(band_ext) -> None:
    """The NaN rule: a row that may attend nothing is zeros even when its q is NaN; a NaN q
    in a row that attends makes that row NaN only."""
    B, L = 2, 97
    rows = torch.ones(B, L, dtype=torch.bool)
    rows[0, 40:60] = False
    mask = masks.causal() & masks.from_tensor(rows[:, None, :, None])
    q, k, v = qkv(B, L, torch.float32)
    q[0, 1, 45, 3] = float("nan")  # a masked row
    q[1, 2, 70, 0] = float("nan")  # an attending row
    out = attention(q, k, v, mask=mask, backend="flash")
    assert torch.equal(out[0, :, 40:60], torch.zeros_like(out[0, :, 40:60]))
    assert out[1, 2, 70].isnan().all() and out.isnan().sum() == out.shape[-1]
