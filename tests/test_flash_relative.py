"""Relative biases (ALiBi, T5, any ``fn.relative = True``) on the tiled backend: one shared bias
tile per window offset. Checked against the float64 reference under the tolerance rule, forward
and every gradient, with small blocks so that edge blocks, clipped windows and merges all occur;
the plan covers every attended pair exactly once; the bias is evaluated on O(tiles), not O(L·S)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import flash_attention
from attnlab.functional.flash import flash_job
from attnlab.functional.flash.calls import BandCall
from attnlab.functional.flash.tiling import build_plan
from attnlab.functional.request import is_relative_bias
from attnlab.positional import ALiBi, T5RelativeBias
from helpers import check_against_reference, mean_factor_for, reference_for, seeded


def qkv(B, H, H_kv, L, S, D, dtype, seed=3):
    return (
        seeded(B, H, L, D, dtype=dtype, seed=seed),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 1),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 2),
    )


def wavy(b, h, i, j):
    """A relative bias that is not monotone in the distance (and has −inf: head 0, j − i = 2)."""
    d = (j - i).to(torch.float32)
    val = 0.3 * torch.sin(d / 3.0 + h) - 0.01 * d.abs()
    return torch.where((h == 0) & (j - i == 2), float("-inf"), val)


wavy.relative = True  # type: ignore[attr-defined]


def t5_frozen(H: int, bidirectional: bool) -> T5RelativeBias:
    torch.manual_seed(0)
    t5 = T5RelativeBias(H, num_buckets=8, max_distance=20, bidirectional=bidirectional)
    t5.weight.data.normal_(std=0.5)
    return t5.requires_grad_(False)


CASES = {
    "alibi_causal": lambda H: (masks.causal(), ALiBi(H)),
    "alibi_bidir": lambda H: (None, ALiBi(H, causal=False)),
    "alibi_window": lambda H: (masks.sliding_window(9), ALiBi(H)),
    "alibi_wide_window": lambda H: (masks.sliding_window(60, causal=False), ALiBi(H, causal=False)),
    "t5_causal": lambda H: (masks.causal(), t5_frozen(H, False)),
    "t5_bidir": lambda H: (None, t5_frozen(H, True)),
    "wavy_causal": lambda H: (masks.causal(), wavy),
}

SIZES = [(1, 1), (17, 17), (97, 113), (113, 97), (5, 70), (70, 5)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("L,S", SIZES, ids=str)
def test_relative_bias_matches_reference_fp32(name, L, S):
    H = 4
    mask, bias = CASES[name](H)
    q, k, v = qkv(2, H, 2, L, S, 16, torch.float32)
    for bq, bk in ((4, 12), (8, 8), (16, 40)):

        def impl(q, k, v, bq=bq, bk=bk):
            return flash_attention(q, k, v, mask=mask, bias=bias, block_q=bq, block_k=bk)[0]

        try:
            check_against_reference(
                impl,
                reference_for(mask, bias),
                [q, k, v],
                mean_factor=mean_factor_for("flash", torch.float32),
            )
        except AssertionError as e:
            raise AssertionError(f"{name} L={L} S={S} blocks {bq}×{bk}: {e}") from e


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["alibi_causal", "t5_bidir"])
def test_relative_bias_matches_reference_other_dtypes(dtype, name):
    H = 4
    mask, bias = CASES[name](H)
    if isinstance(bias, ALiBi):
        bias = ALiBi(H, causal=bias.causal, dtype=torch.float64)
    q, k, v = qkv(1, H, 1, 97, 113, 16, dtype)
    # float64 keeps its wide default tiles (the rule compares with the reference's summation
    # order); its small-tile runs are held to 1e-12 in test_relative_bias_small_tiles_fp64
    blocks = {} if dtype == torch.float64 else {"block_q": 8, "block_k": 24}

    def impl(q, k, v):
        return flash_attention(q, k, v, mask=mask, bias=bias, **blocks)[0]

    check_against_reference(
        impl, reference_for(mask, bias), [q, k, v], mean_factor=mean_factor_for("flash", dtype)
    )


@pytest.mark.parametrize("name", list(CASES))
def test_relative_bias_small_tiles_fp64(name):
    H = 4
    mask, bias = CASES[name](H)
    if isinstance(bias, ALiBi):
        bias = ALiBi(H, causal=bias.causal, dtype=torch.float64)
    q, k, v = qkv(2, H, 2, 61, 77, 8, torch.float64)
    ref = reference_for(mask, bias)(q, k, v, compute_dtype=torch.float64, reorder=False)
    for engine in ("torch", "kernel"):
        out, _ = flash_attention(
            q, k, v, mask=mask, bias=bias, block_q=8, block_k=20, engine=engine
        )
        tol = 1e-12 if engine == "torch" else 1e-6  # the kernel's exp is approximate
        torch.testing.assert_close(out, ref, atol=tol, rtol=0)


def test_relative_bias_default_blocks_long_fp32():
    """Default tiles (256-row blocks, 1024-key windows) at an odd length past one window."""
    mask, bias = masks.causal(), ALiBi(2)
    q, k, v = qkv(1, 2, 1, 1025, 1300, 64, torch.float32)
    check_against_reference(
        lambda q, k, v: attnlab.attention(q, k, v, mask=mask, bias=bias, backend="flash"),
        reference_for(mask, bias),
        [q, k, v],
        mean_factor=mean_factor_for("flash", torch.float32),
    )


def test_relative_and_generic_plans_agree_and_lse_is_exact():
    """The same bias with and without ``relative``: same output and lse (different plans)."""

    def plain(b, h, i, j):
        return wavy(b, h, i, j)

    q, k, v = qkv(2, 4, 4, 130, 150, 16, torch.float32)
    a, la = flash_attention(q, k, v, mask=masks.causal(), bias=wavy, block_q=16, block_k=48)
    b, lb = flash_attention(q, k, v, mask=masks.causal(), bias=plain, block_q=16, block_k=48)
    torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    torch.testing.assert_close(la, lb, atol=2e-6, rtol=0)
    assert torch.equal(torch.isneginf(la), torch.isneginf(lb))


def test_alibi_and_t5_declare_relative():
    assert is_relative_bias(ALiBi(4)) and is_relative_bias(T5RelativeBias(4))
    assert not is_relative_bias(lambda b, h, i, j: i - j)
    assert is_relative_bias(wavy)


# --------------------------------------------------------------------------- the plan
def _allowed(mask, L, S) -> torch.Tensor:
    if mask is None:
        return torch.ones(L, S, dtype=torch.bool)
    return mask.to_dense(L, S).reshape(L, S)


@pytest.mark.parametrize(
    "mask", [None, masks.causal(), masks.sliding_window(30, causal=False)], ids=str
)
@pytest.mark.parametrize(
    "L,S,bq,wc", [(50, 50, 8, 16), (37, 90, 4, 12), (90, 37, 16, 16), (9, 9, 16, 32)]
)
def test_relative_plan_covers_each_pair_once(mask, L, S, bq, wc):
    plan = build_plan(
        mask, B=1, H=1, L=L, S=S, block_q=bq, block_k=wc, band_block=bq, bias="fn", relative=True
    )
    allowed = _allowed(mask, L, S)
    count = torch.zeros(L, S, dtype=torch.int64)
    for c in plan.simple_calls:
        k0, k1 = c.keys
        count[c.r0 : c.r1, k0:k1] += allowed[c.r0 : c.r1, k0:k1].long()
    assert torch.equal(count, allowed.long()), "a pair is missed or computed twice"
    # each band call's relative mask (c_lo, span) equals the real mask on its windows
    for g in plan.groups:
        for c in g.calls:
            if not isinstance(c, BandCall):
                continue
            r = torch.arange(c.bq).view(-1, 1)
            col = torch.arange(c.width).view(1, -1)
            rel = ((col - r) >= c.c_lo) & ((col - r) <= c.c_lo + c.span)
            for t in range(c.t0, c.t1):
                k0, _ = c.window(t)
                keys = k0 + col
                inside = (keys >= 0) & (keys < S)
                rows = t * c.bq + r
                want = allowed[rows.clamp(max=L - 1), keys.clamp(0, S - 1)] & inside
                assert torch.equal(rel & inside, want)


def test_plan_alone_marks_groups_that_share_no_row():
    """Backward takes δ from the tile only for a group alone on its rows with one call."""
    rel = build_plan(
        masks.causal(),
        B=1,
        H=1,
        L=70,
        S=70,
        block_q=16,
        block_k=32,
        band_block=16,
        bias="fn",
        relative=True,
    )
    alone = rel.alone
    bands = [isinstance(g.calls[0], BandCall) for g in rel.groups]
    assert rel.overlap and len(alone) == len(rel.groups)
    assert not any(a for a, band in zip(alone, bands, strict=True) if band)  # offsets share rows
    assert alone[-1] and not bands[-1]  # the partial last block (rows 64..69) is its own
    plain = build_plan(
        masks.causal(), B=1, H=1, L=70, S=70, block_q=16, block_k=32, band_block=16, bias="fn"
    )
    assert plain.alone == [True] * len(plain.groups)


class Counting:
    """ALiBi that counts how many bias values it computes."""

    relative = True

    def __init__(self, H: int) -> None:
        self.alibi = ALiBi(H)
        self.values = 0

    def __call__(self, b, h, i, j):
        out = self.alibi(b, h, i, j)
        self.values += out.numel()
        return out


def test_relative_bias_is_evaluated_once_per_window_offset():
    """At L = S = 4096 the bias is computed on a few (H, 256, 1024) tiles, not on L·S/2 pairs;
    and forward + backward reuse them (no second evaluation in backward)."""
    H, L = 2, 4096
    bias = Counting(H)
    q, k, v = (torch.randn(1, H, L, 8, requires_grad=True) for _ in range(3))
    out, _ = flash_attention(q, k, v, mask=masks.causal(), bias=bias)
    n_fwd = bias.values
    out.sum().backward()
    assert n_fwd <= 6 * H * 256 * 1024  # 5 window offsets (+ nothing per block)
    assert bias.values == n_fwd
    assert n_fwd < H * L * L // 8
    plain = lambda b, h, i, j: bias.alibi(b, h, i, j)  # noqa: E731 - same values, not declared
    ref, _ = flash_attention(q.detach(), k.detach(), v.detach(), mask=masks.causal(), bias=plain)
    torch.testing.assert_close(out.detach(), ref, atol=2e-6, rtol=0)


def test_relative_plan_describes_itself():
    q = k = v = torch.zeros(1, 2, 3000, 8)
    why = attnlab.explain(q, k, v, mask=masks.causal(), bias=ALiBi(2))
    assert "relative plan" in why.plan, why
    from attnlab.functional.request import build_request

    req = build_request(
        q,
        k,
        v,
        mask=masks.causal(),
        bias=ALiBi(2),
        scale=None,
        temperature=1.0,
        score="dot",
        dropout_p=0.0,
        return_weights=False,
    )
    assert flash_job(req).plan.overlap


def test_relative_bias_nan_in_values_propagates():
    """A NaN value at key 40 reaches every row that attends key 40 (the band path falls back to
    per-block calls); the other value columns stay finite and exact."""
    H, L = 2, 120
    q, k, v = qkv(1, H, H, L, L, 8, torch.float32)
    v = v.clone()
    v[0, :, 40, 0] = float("nan")
    mask = masks.causal()
    out, _ = flash_attention(q, k, v, mask=mask, bias=ALiBi(H), block_q=8, block_k=16)
    ref = reference_for(mask, ALiBi(H))(
        q.double(), k.double(), v.double(), compute_dtype=torch.float64, reorder=False
    )
    assert torch.isnan(out[0, :, 40:, 0]).all()
    torch.testing.assert_close(out[..., 1:].double(), ref[..., 1:], atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_long_range_alibi_keeps_precision(dtype):
    """Logits near −500 (ALiBi, L=1025 queries over 97 keys): float64 gradients need lse's
    rounding error carried to backward (lse_lo), bfloat16 needs the bias kept in float32 — the
    rounded bias alone moves logits by whole units (errors ≈ 0.5 against the golden)."""
    H = 4
    bias = ALiBi(H, causal=False, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    q, k, v = qkv(1, H, 2, 1025, 97, 16, dtype)
    check_against_reference(
        lambda q, k, v: attnlab.attention(q, k, v, bias=bias, backend="flash"),
        reference_for(None, bias),
        [q, k, v],
        mean_factor=mean_factor_for("flash", dtype),
    )
