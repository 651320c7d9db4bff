"""Issue 13 item 5: inputs are checked before any work, with messages naming what was expected.

Devices of mask/bias tensors, what mask and bias functions return, window arithmetic that must
not overflow int64, the logit multiplier ``scale / temperature``, and head counts of function
biases.
"""

from __future__ import annotations

import sys

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional.request import check_bias_output
from attnlab.positional import ALiBi, T5RelativeBias
from helpers import GENERAL_BACKENDS, seeded

BACKENDS = GENERAL_BACKENDS


def qkv(B=2, H=2, L=9, S=9, D=8, dtype=torch.float64):
    return (
        seeded(B, H, L, D, seed=1, dtype=dtype),
        seeded(B, H, S, D, seed=2, dtype=dtype),
        seeded(B, H, S, D, seed=3, dtype=dtype),
    )


@pytest.fixture
def no_kernel(monkeypatch):
    """Fails the test if torch's SDPA kernel or a bias function evaluation runs."""
    calls = []
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1)
    )
    return calls


# ----------------------------------------------------------------------------- (a) devices
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind", ["bool_mask", "float_mask", "bias", "from_tensor", "combined", "negated"]
)
def test_mask_or_bias_on_another_device_names_both_devices(backend, kind, no_kernel):
    q, k, v = qkv()
    meta_bool = torch.ones(9, 9, dtype=torch.bool, device="meta")
    kw = {
        "bool_mask": {"mask": meta_bool},
        "float_mask": {"mask": torch.zeros(9, 9, dtype=q.dtype, device="meta")},
        "bias": {"bias": torch.zeros(9, 9, dtype=q.dtype, device="meta")},
        "from_tensor": {"mask": masks.from_tensor(meta_bool)},
        "combined": {"mask": masks.causal() & masks.from_tensor(meta_bool)},
        "negated": {"mask": ~(masks.padding([3, 9]) | masks.from_tensor(meta_bool))},
    }[kind]
    name = "bias" if kind == "bias" else r"mask( from_tensor\(shape=\(1, 1, 9, 9\)\))?"
    with pytest.raises(
        ValueError, match=rf"^{name} must be on the query's device cpu, got device meta$"
    ):
        attnlab.attention(q, k, v, backend=backend, **kw)
    assert no_kernel == []


def test_meta_query_with_cpu_mask_is_refused_too():
    q, k, v = (t.to("meta") for t in qkv())
    with pytest.raises(
        ValueError, match=r"mask must be on the query's device meta, got device cpu"
    ):
        attnlab.attention(q, k, v, mask=torch.ones(9, 9, dtype=torch.bool))


# ------------------------------------------------------------------ (b) function results
def wrong_shape(b, h, i, j):
    return torch.ones(3, 5, dtype=torch.bool)


def wrong_bias(b, h, i, j):
    return torch.zeros(3, 5, dtype=torch.float64)


def bias_on_meta(b, h, i, j):
    return (j - i).double().to("meta")


class WrongShapeMask(masks.Mask):
    """A user subclass whose `evaluate` ignores the index shapes."""

    def evaluate(self, b, h, i, j, L, S):
        return torch.ones(2, 1, 1, dtype=torch.bool)

    def __repr__(self) -> str:
        return "WrongShapeMask()"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combine", [False, True])
def test_mask_function_wrong_shape_names_function_and_both_shapes(backend, combine):
    q, k, v = qkv()
    m = masks.from_fn(wrong_shape)
    m = masks.causal() & m if combine else m
    with pytest.raises(
        ValueError,
        match=r"^mask function wrong_shape returned shape \(3, 5\), which does not broadcast to "
        r"the index grid \(B, H, L, S\) = \(1, 1, 9, 9\) it was called on$",
    ):
        attnlab.attention(q, k, v, mask=m, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_subclass_wrong_shape_is_named_by_repr(backend):
    with pytest.raises(
        ValueError,
        match=r"mask function WrongShapeMask\(\) returned shape \(2, 1, 1\), which does not "
        r"broadcast to the index grid \(B, H, L, S\) = \(1, 1, 4, 6\)",
    ):
        WrongShapeMask().to_dense(4, 6)
    q, k, v = qkv(L=300, S=300)  # flash: large enough for its tiled block map
    with pytest.raises(
        ValueError,
        match=r"^mask function WrongShapeMask\(\) returned shape \(2, 1, 1\), which does not "
        r"broadcast to the index grid \(B, H, L, S\) = \(1, 1, 300, 300\)",
    ):  # named inside a combination, not as the combination
        attnlab.attention(q, k, v, mask=masks.causal() & ~WrongShapeMask(), backend=backend)


def test_mask_function_must_not_grow_an_undeclared_batch_dimension():
    """Returning per-batch values without ``batch_size=`` would break tiled evaluation."""
    per_item = torch.tensor([3, 6]).view(2, 1, 1, 1)

    def by_captured_lengths(b, h, i, j):
        return j < per_item  # ignores b: (2, 1, 1, S) on a (1, 1, L, S) grid

    with pytest.raises(ValueError, match=r"returned shape \(2, 1, 1, 6\).*\(1, 1, 4, 6\)"):
        masks.from_fn(by_captured_lengths).to_dense(4, 6)
    # declared and indexed by b, it is fine
    ok = masks.from_fn(lambda b, h, i, j: j < per_item.view(-1)[b], batch_size=2)
    assert ok.to_dense(4, 6).sum().item() == 4 * (3 + 6)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_bias_function_wrong_shape_names_function_and_both_shapes(backend):
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=r"^bias function wrong_bias returned shape \(3, 5\), which does not broadcast to "
        r"the index grid \(B, H, L, S\) = \(2, 2, 9, 9\) it was called on$",
    ):
        attnlab.attention(q, k, v, bias=wrong_bias, backend=backend)
    with pytest.raises(
        ValueError,
        match=r"bias function bias_on_meta returned a tensor on meta, expected the indices' "
        r"device cpu",
    ):
        attnlab.attention(q, k, v, bias=bias_on_meta, backend=backend)


def test_check_bias_output_on_a_tile():
    """The helper the tiled backend calls per tile: the grid is the tile's index grid."""
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(4).view(1, 4, 1, 1)
    i = torch.arange(16, 32).view(1, 1, 16, 1)
    j = torch.arange(8).view(1, 1, 1, 8)
    good = torch.zeros(1, 4, 16, 8)
    assert check_bias_output(wrong_bias, good, b, h, i, j) is good
    assert check_bias_output(wrong_bias, torch.zeros(16, 1), b, h, i, j).shape == (16, 1)
    with pytest.raises(
        ValueError, match=r"wrong_bias returned shape \(4, 16, 9\).*\(1, 4, 16, 8\)"
    ):
        check_bias_output(wrong_bias, torch.zeros(4, 16, 9), b, h, i, j)
    with pytest.raises(ValueError, match=r"returned shape \(1, 1, 4, 16, 8\)"):
        check_bias_output(wrong_bias, torch.zeros(1, 1, 4, 16, 8), b, h, i, j)
    with pytest.raises(
        TypeError,
        match=r"bias function must return a float tensor, got dtype "
        r"torch.int64 from wrong_bias",
    ):
        check_bias_output(wrong_bias, torch.zeros(1, 4, 16, 8, dtype=torch.long), b, h, i, j)


# ------------------------------------------------------------------ (c) window arithmetic
HUGE = [sys.maxsize, sys.maxsize - 1, 2**62, 2**63 + 5, 2**70]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("w", HUGE)
def test_huge_windows_equal_the_unbounded_mask(backend, w):
    """p + window used to wrap around int64: sliding_window(sys.maxsize) masked most rows."""
    q, k, v = qkv(L=7, S=11)
    none = attnlab.attention(q, k, v, backend=backend)
    causal = attnlab.attention(q, k, v, mask=masks.causal(), backend=backend)
    cases = [
        (masks.sliding_window(w, causal=False), none),
        (masks.sliding_window(w, causal=True), causal),
        (masks.strided(w, causal=False), none),
        (masks.strided(w, causal=True), causal),
        (masks.global_local(w, 0), none),
        (masks.bigbird(w, 2 * w + 1, 0, 0), none),
    ]
    for m, want in cases:
        got = attnlab.attention(q, k, v, mask=m, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=lambda s, m=m: f"{m!r}: {s}")


@pytest.mark.parametrize("w", HUGE)
def test_huge_windows_render_and_count_exactly(w):
    L, S = 7, 11
    full = torch.ones(1, 1, L, S, dtype=torch.bool)
    tril = masks.causal().to_dense(L, S)
    for m, want in (
        (masks.sliding_window(w, causal=False), full),
        (masks.sliding_window(w), tril),
        (masks.strided(w, causal=False), full),
        (masks.global_local(w, [2]), full),
    ):
        assert torch.equal(m.to_dense(L, S).expand(1, 1, L, S), want.expand(1, 1, L, S)), m
        assert torch.equal(m.row_counts(L, S), want.sum(-1)), m
        assert m.attended_pairs(L, S) == int(want.sum())
    # a window just below the lengths still cuts (the cap does not change small windows)
    assert masks.sliding_window(3, causal=False).row_counts(4, 4).tolist() == [[[3, 4, 4, 3]]]


# ---------------------------------------------------------- (d) scale / temperature bound
@pytest.mark.parametrize(
    ("dtype", "kw", "shown"),
    [
        (torch.float64, {"scale": 1e300}, r"1\.34e\+154 .* torch.float64 .* = 1e\+300"),
        (torch.float32, {"temperature": 1e-40}, r"1\.84e\+19 .* torch.float32 .* = 3\.5\de\+39"),
        (torch.bfloat16, {"scale": 2.0**64 * 1.5}, r"1\.84e\+19 .* torch.bfloat16"),
        (torch.float16, {"scale": -1e30}, r"1\.84e\+19 .* torch.float16 .* = -1e\+30"),
        (torch.float32, {"scale": 1e300, "temperature": 1e-300}, r".* = inf"),
    ],
)
def test_logit_multiplier_that_overflows_is_refused(dtype, kw, shown, no_kernel):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(ValueError, match=rf"^scale / temperature must be at most {shown}"):
        attnlab.attention(q, k, v, **kw)
    assert no_kernel == []


def test_logit_multiplier_underflowing_to_zero_is_refused():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=r"scale / temperature must be non-zero, got scale=1e-300 / temperature=1e\+300, "
        r"which underflows to 0",
    ):
        attnlab.attention(q, k, v, scale=1e-300, temperature=1e300)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("dtype", "temperature"),
    [
        (torch.float64, 1e-40),  # 1/√8 · 1e40 < 2^512
        (torch.float32, 2.0**-62),  # just inside 2^64 for float32 logits
        (torch.bfloat16, 2.0**-62),
    ],
)
def test_logit_multiplier_at_the_bound_gives_the_one_hot_limit(backend, dtype, temperature):
    """Inside the bound the forward is finite and equals the T → 0 limit: v at the argmax."""
    q, k, v = qkv(B=2, H=2, L=13, S=17, dtype=dtype)
    out = attnlab.attention(q, k, v, temperature=temperature, backend=backend)
    scores = q.double() @ k.double().transpose(-1, -2)  # (B, H, L, S); no ties here
    top2 = scores.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1e-3).all()
    want = torch.gather(v, 2, scores.argmax(-1, keepdim=True).expand(-1, -1, -1, v.shape[-1]))
    assert torch.equal(out, want)


# ---------------------------------------------------------------- (e) bias head counts
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("built, H", [(8, 4), (4, 8), (2, 1)])
def test_function_bias_head_count_must_match_the_call(backend, built, H):
    calls = []

    class CountingALiBi(ALiBi):
        def forward(self, *idx):
            calls.append(1)
            return super().forward(*idx)

    q, k, v = qkv(H=H)
    for fn, name in ((CountingALiBi(built), "CountingALiBi"), (T5RelativeBias(built), "T5")):
        with pytest.raises(
            ValueError,
            match=rf"^{name}\w* was built with num_heads={built}, but the attention call has "
            rf"H={H} query heads$",
        ):
            attnlab.attention(q, k, v, bias=fn, backend=backend)
    assert calls == []  # refused before the bias was ever evaluated


def test_function_bias_head_count_three_d_inputs():
    q, k, v = (t[:, 0] for t in qkv())  # (B, L, D): one head
    out = attnlab.attention(q, k, v, bias=ALiBi(1, causal=False))
    assert out.shape == (2, 9, 8)
    with pytest.raises(ValueError, match=r"ALiBi was built with num_heads=2, .* H=1"):
        attnlab.attention(q, k, v, bias=ALiBi(2))


# ------------------------------------------------- issue 39 item 5: one validation kit
def test_the_kit_names_the_argument_the_expected_and_the_received_value():
    from attnlab._shapes import ArgumentTypeError, check_bool, check_int, check_number

    assert check_int("n", 3, minimum=1, maximum=3) == 3
    cases = [
        (lambda: check_int("n", 2.0), r"^n must be an int, got float 2\.0$"),
        (lambda: check_int("n", True), r"^n must be an int, got bool True$"),
        (lambda: check_int("n", 0, minimum=1), r"^n must be >= 1, got 0$"),
        (lambda: check_int("n", 5, maximum=4), r"^n must be <= 4, got 5$"),
        (lambda: check_int("n", 5, minimum=0, maximum=4), r"^n must be in \[0, 4\], got 5$"),
        (lambda: check_number("x", "1"), r"^x must be a real number, got str '1'$"),
        (lambda: check_number("x", float("nan")), r"^x must be finite, got nan$"),
        (lambda: check_number("x", 0, positive=True), r"^x must be > 0, got 0$"),
        (lambda: check_number("x", 1.0, greater=1.0), r"^x must be > 1, got 1$"),
        (lambda: check_number("x", -1, at_least=0.0), r"^x must be >= 0, got -1$"),
        (lambda: check_bool("b", 1), r"^b must be a bool, got int 1$"),
    ]
    for call, pattern in cases:
        with pytest.raises((TypeError, ValueError), match=pattern):
            call()
    with pytest.raises(ArgumentTypeError) as info:  # a wrong type is both, for old callers
        check_int("n", "3")
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_statistics_are_float32_or_wider():
    from attnlab._shapes import stat_dtype

    for dtype, expected in [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ]:
        assert stat_dtype(dtype) == expected
