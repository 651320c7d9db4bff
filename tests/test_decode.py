"""The decode backend: few query rows against many keys, no gradient (issue 13's decode target).

It runs only decode-shaped calls, so the generic backend suites skip it (helpers.GENERAL_BACKENDS)
and this file checks it the same way: the tolerance rule against the float64 reference on odd
sizes and every dtype, the log-sum-exp, the NaN rule (planted reproducers and random plantings),
auto's choice, compile and meta.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from attnlab.functional import decode
from helpers import check_against_reference, reference_for, seeded

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
MASKS = {
    "none": lambda B: None,
    "causal": lambda B: masks.causal(),
    "padding": lambda B: masks.padding([600, 1, 0, 10_000][:B]),
}


def _qkv(B, H, H_kv, L, S, D=40, Dv=24, dtype=torch.float32, seed=0):
    return (
        seeded(B, H, L, D, dtype=dtype, seed=seed),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 1),
        seeded(B, H_kv, S, Dv, dtype=dtype, seed=seed + 2),
    )


def _no_grad_decode(mask, **kw):
    def impl(q, k, v):
        with torch.no_grad():
            return attnlab.attention(q, k, v, mask=mask, backend="decode", **kw)

    return impl


SHAPES = [(4, 4, 1, 613), (8, 2, 1, 1025), (6, 1, 3, 517)]  # H, H_kv, L, S


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "mask_name,H,H_kv,L,S",
    # causal with L > 1 is not a key prefix (test_declines)
    [(m, *shape) for m in MASKS for shape in SHAPES if not (m == "causal" and shape[2] > 1)],
)
def test_matches_reference(dtype, mask_name, H, H_kv, L, S):
    B = 3
    mask = MASKS[mask_name](B)
    q, k, v = _qkv(B, H, H_kv, L, S, dtype=dtype, seed=L + S)
    check_against_reference(_no_grad_decode(mask), reference_for(mask), [q, k, v], grads=False)


def test_scale_temperature_and_lse():
    q, k, v = _qkv(2, 4, 2, 5, 700, dtype=torch.float64)
    mask = masks.padding([700, 333])
    kw = dict(mask=mask, scale=0.3, temperature=0.7, return_lse=True)
    out, lse = attnlab.attention(q, k, v, backend="decode", **kw)
    want, want_lse = attnlab.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)
    assert lse.dtype == torch.float64
    # float32 inputs give a float32 lse; an item with no key gives lse −inf and zeros
    q, k, v = (x.float() for x in (q, k, v))
    out, lse = attnlab.attention(q, k, v, mask=masks.padding([0, 700]), return_lse=True)
    assert lse.dtype == torch.float32
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], torch.full_like(lse[0], float("-inf")))


def test_half_inputs_compute_logits_in_float32():
    """bf16 logits would be rounded to 8 bits; the decode path keeps them in float32 and so is
    at least as accurate as torch's fused kernel (its error is that of p and v in bf16)."""
    q, k, v = _qkv(1, 8, 2, 1, 4096, D=64, Dv=64, dtype=torch.bfloat16, seed=3)
    k = k * 4  # peaked rows: |logits| up to ~30, where a bf16 logit is off by ~0.1
    with torch.no_grad():
        ours = attnlab.attention(q, k, v, backend="decode")
        fused = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    gold = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    err_ours = (ours.double() - gold).abs().max()
    err_fused = (fused.double() - gold).abs().max()
    assert err_ours <= 1.5 * err_fused, (err_ours, err_fused)


# ------------------------------------------------------------------------------ the NaN rule
def _compare_with_reference(q, k, v, mask):
    with torch.no_grad():
        got = attnlab.attention(q, k, v, mask=mask, backend="decode")
    want = attnlab.attention(q, k, v, mask=mask, backend="reference")
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-12, rtol=1e-10)
    return got


def test_nan_rule_reproducers():
    q, k, v = _qkv(3, 4, 2, 1, 600, dtype=torch.float64)
    # a −inf key entry makes a −inf logit, which a softmax would silently drop
    k[0, 0, 7, 3] = float("-inf")
    # NaN/inf in the padding of item 1 (keys ≥ 400) never reaches it
    k[1, 1, 450] = float("nan")
    v[1, 0, 500] = float("inf")
    # NaN in one value column reaches only that column
    v[2, 1, 20, 5] = float("nan")
    mask = masks.padding([600, 400, 600])
    got = _compare_with_reference(q, k, v, mask)
    assert torch.isnan(got[0, :2]).all() and torch.isfinite(got[0, 2:]).all()
    assert torch.isfinite(got[1]).all()
    assert torch.isnan(got[2, 2:, :, 5]).all() and torch.isfinite(got[2, :, :, :5]).all()
    # a non-finite query row is NaN; the rows of an item with nothing to attend are zeros
    q[0, 3, 0, 0] = float("inf")
    q[1, 0, 0, 1] = float("nan")
    got = _compare_with_reference(q, k, v, masks.padding([600, 0, 600]))
    assert torch.isnan(got[0, 3]).all() and torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("seed", range(12))
def test_nan_rule_random_plantings(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, H_kv, L, S = 2, 4, 2, 2, 520
    q, k, v = _qkv(B, H, H_kv, L, S, dtype=torch.float64, seed=seed)
    values = torch.tensor([float("nan"), float("inf"), float("-inf")])
    for t in (q, k, v):
        for _ in range(int(torch.randint(0, 3, (), generator=g))):
            idx = tuple(int(torch.randint(0, n, (), generator=g)) for n in t.shape)
            t[idx] = values[int(torch.randint(0, 3, (), generator=g))]
    lengths = [int(x) for x in torch.randint(0, S + 1, (B,), generator=g)]
    for mask in (None, masks.padding(lengths)):
        _compare_with_reference(q, k, v, mask)


# -------------------------------------------------------------------------- auto's choice
def test_auto_picks_decode_for_decode_steps():
    q, k, v = _qkv(1, 8, 2, 1, 4096, D=64, Dv=64)
    for mask in (None, masks.causal(), masks.padding([4000])):
        assert attnlab.explain(q, k, v, mask=mask).backend == "decode"
    with torch.inference_mode():
        assert attnlab.explain(q, k, v).backend == "decode"


@pytest.mark.parametrize(
    "case,reason",
    [
        ("grad", "inference-only"),
        ("long", "at most 8 query rows"),
        ("tensor_mask", "same keys"),
        ("causal_L2", "same keys"),
        ("bias", "same keys"),
        ("weights", "weights"),
        ("cosine", "dot-product"),
    ],
)
def test_declines(case, reason):
    q, k, v = _qkv(1, 4, 2, 1, 1024)
    kw: dict = {}
    if case == "grad":
        q.requires_grad_(True)
    elif case == "long":
        q = seeded(1, 4, 9, 40, dtype=torch.float32)
    elif case == "tensor_mask":  # a mask per query row (rows may differ)
        q = seeded(1, 4, 2, 40, dtype=torch.float32)
        kw["mask"] = torch.ones(1, 1, 2, 1024, dtype=torch.bool)
    elif case == "causal_L2":
        q, kw["mask"] = seeded(1, 4, 2, 40, dtype=torch.float32), masks.causal()
    elif case == "bias":
        kw["bias"] = torch.zeros(1, 1, 1, 1024)
    elif case == "weights":
        kw["return_weights"] = True
    elif case == "cosine":
        kw["score"] = "cosine"
    assert attnlab.explain(q, k, v, **kw).backend != "decode"
    with pytest.raises(ValueError, match=reason):
        attnlab.attention(q, k, v, backend="decode", **kw)


@pytest.mark.parametrize(
    ("dtype", "B", "S", "want"),
    [
        (torch.float32, 1, 255, "sdpa"),  # B·S below DECODE_MIN_KEYS[float32] = 256
        (torch.float32, 1, 256, "decode"),
        (torch.float32, 4, 64, "decode"),
        (torch.bfloat16, 1, 1, "decode"),  # half precision: always the decode path
        (torch.float16, 2, 3, "decode"),
        (torch.float64, 4, decode.DECODE_MIN_S - 1, "sdpa"),  # float64: S below DECODE_MIN_S
        (torch.float64, 1, decode.DECODE_MIN_S, "decode"),
    ],
)
def test_auto_size_rule_for_decode_steps(dtype, B, S, want, monkeypatch):
    """Without the C++ step, auto takes the decode path from `DECODE_MIN_KEYS` keys over the
    batch (per dtype), from `DECODE_MIN_S` keys in float64, and says why it does not below."""
    monkeypatch.setenv("ATTNLAB_EXT", "0")
    q, k, v = _qkv(B, 4, 2, 1, S, dtype=dtype)
    with torch.no_grad():
        why = attnlab.explain(q, k, v)
    assert why.backend == want, why
    if want == "sdpa":
        assert "fewer than" in why.reason


def test_auto_takes_the_cpp_step_at_every_float32_size(monkeypatch):
    """With the C++ step built, auto runs every float32 and 16-bit decode step on it (faster than
    SDPA at every size: `DECODE_MIN_KEYS`), float64 keeps `DECODE_MIN_S`."""
    from attnlab import _ext

    if _ext.mode() == "off" or not _ext.load("nan_rule"):
        pytest.skip(f"C++ extension unavailable: {_ext.status('nan_rule')}")
    with torch.no_grad():
        for dtype, S, want in [
            (torch.float32, 8, "decode"),
            (torch.bfloat16, 8, "decode"),
            (torch.float64, decode.DECODE_MIN_S - 1, "sdpa"),
        ]:
            why = attnlab.explain(*_qkv(1, 4, 2, 1, S, dtype=dtype))
            assert why.backend == want, (dtype, why)


@pytest.mark.parametrize("ext", ["0", "auto"])
def test_key_masks_take_the_decode_path(ext, monkeypatch):
    """A step whose rows share their keys — a key-padding tensor (transformers' 2-D mask), with
    `causal()` at one row, or tensor lengths — runs on the decode path under auto (SDPA would
    render the mask and run the NaN rule's passes), equal to the reference; rows that differ
    (causal with 3 rows) do not."""
    monkeypatch.setenv("ATTNLAB_EXT", ext)
    B, S = 3, 50
    keep = torch.rand(B, S, generator=torch.Generator().manual_seed(0)) > 0.3
    keys = masks.from_tensor(keep[:, None, None, :])
    cases = [
        (1, masks.causal() & keys, "decode"),
        (4, keys, "decode"),
        (2, masks.padding(torch.tensor([50, 20, 0])), "decode"),
        (1, masks.sliding_window(9) & keys, "decode"),
        (3, masks.causal() & keys, None),
    ]
    for L, mask, want in cases:
        q, k, v = _qkv(B, 4, 2, L, S)
        with torch.no_grad():
            why = attnlab.explain(q, k, v, mask=mask)
            assert (why.backend == "decode") == (want == "decode"), (L, mask, why)
        check_against_reference(
            lambda q, k, v, m=mask: attnlab.attention(q, k, v, mask=m),
            reference_for(mask),
            [q, k, v],
            grads=False,
        )


def test_key_masks_give_the_reference_lse():
    """The decode path's log-sum-exp over a key mask (tensor ops: the C++ step returns no lse)
    equals the reference's, an item with no key −inf and zeros."""
    B, S = 3, 40
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :25] = False
    keep[2] = False
    mask = masks.causal() & masks.from_tensor(keep[:, None, None, :])
    q, k, v = _qkv(B, 4, 2, 1, S, dtype=torch.float64)
    with torch.no_grad():
        out, lse = attnlab.attention(q, k, v, mask=mask, backend="decode", return_lse=True)
        r_out, r_lse = attnlab.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    torch.testing.assert_close(out, r_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, r_lse, atol=1e-12, rtol=1e-12)
    assert torch.isneginf(lse[2]).all() and not out[2].any()


# --------------------------------------------------------------------------- compile, meta
def test_compile_fullgraph_and_meta():
    q, k, v = _qkv(2, 8, 2, 1, 600)
    mask = masks.padding([600, 300])

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, backend="decode")

    with torch.no_grad():
        explained = torch._dynamo.explain(f)(q, k, v)
        assert explained.graph_break_count == 0
        compiled = torch.compile(f, fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), atol=1e-6, rtol=1e-6)
    meta = [x.to("meta") for x in (q, k, v)]
    assert f(*meta).shape == (2, 8, 1, 24) and f(*meta).device.type == "meta"


def test_key_mask_step_compiles_fullgraph_with_inductor_and_runs_on_meta():
    """transformers' decoding mask (causal & a key-padding tensor, an item with no key) under
    ``torch.compile(fullgraph=True)`` with Inductor: the traced key-mask path (tensor ops), equal
    to eager's C++ step; and on meta tensors."""
    q, k, v = _qkv(3, 8, 2, 1, 70)
    keep = torch.ones(3, 70, dtype=torch.bool)
    keep[1, :30] = False
    keep[2] = False
    k[1, :, 5] = float("nan")  # masked: never reaches a row
    mask = masks.causal() & masks.from_tensor(keep[:, None, None, :])

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=mask)

    torch._dynamo.reset()
    with torch.no_grad():
        want = f(q, k, v)
        got = torch.compile(f, fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    assert torch.isfinite(got).all() and not got[2].any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    meta = [x.to("meta") for x in (q, k, v)]
    mask = masks.causal() & masks.from_tensor(keep.to("meta")[:, None, None, :])
    assert f(*meta).shape == (3, 8, 1, 24) and f(*meta).device.type == "meta"
