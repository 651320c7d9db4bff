"""Positional encodings (issue #4; RELIABILITY D1–D4, H5): sinusoidal, learned, T5, ALiBi, RoPE."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import masks
from attnlab.positional import (
    ROPE_SCALING,
    ALiBi,
    LearnedPositionalEmbedding,
    RoPE,
    SinusoidalEmbedding,
    T5RelativeBias,
    alibi_slopes,
    compute_rope_parameters,
    dense_bias,
    register_rope_scaling,
    rope_scaling,
    sinusoidal,
    sinusoidal_shift,
    t5_bucket,
)
from helpers import assert_close_rule, seeded

F64 = torch.float64
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "ntk", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    YARN,
    LLAMA3,
]


# ============================================================================ sinusoidal
def test_sinusoidal_row_of_position_1_is_the_papers():
    row = sinusoidal(2, 8)[1]
    expected = torch.tensor([0.84, 0.54, 0.10, 0.99, 0.01, 1.00, 0.00, 1.00])
    # cos(0.1) = 0.995004 sits on the rounding boundary (the issue prints 0.99), hence 6e-3.
    torch.testing.assert_close(row, expected, atol=6e-3, rtol=0)
    assert row[3].item() == pytest.approx(math.cos(0.1), abs=1e-7)
    assert sinusoidal(2, 8).dtype == torch.float32
    assert torch.equal(sinusoidal(3, 8)[0], torch.tensor([0.0, 1.0] * 4))


def test_sinusoidal_equals_the_formula_elementwise():
    P, E, base = 9, 6, 100.0
    table = sinusoidal(P, E, base, dtype=F64)
    for p in range(P):
        for i in range(E // 2):
            w = 1.0 / base ** (2 * i / E)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(p * w), abs=1e-15)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p * w), abs=1e-15)


def test_sinusoidal_is_accurate_at_large_positions_in_float32():
    # Angles are formed in float64, so float32 tables are correctly rounded even at p ~ 1e5.
    table = sinusoidal(100_001, 16)[-1]
    p = 100_000
    exact = [f(p / 10000.0 ** (2 * i / 16)) for i in range(8) for f in (math.sin, math.cos)]
    torch.testing.assert_close(table.double(), torch.tensor(exact, dtype=F64), atol=1e-7, rtol=0)


@pytest.mark.parametrize("bad", [7, 1, 0, -2])
def test_sinusoidal_odd_or_nonpositive_dim_raises(bad):
    with pytest.raises(ValueError, match=rf"dim must be (even|>= 1).*got {bad}"):
        sinusoidal(4, bad)
    with pytest.raises(ValueError, match=rf"dim must be (even|>= 1).*got {bad}"):
        SinusoidalEmbedding(bad)


def test_sinusoidal_bad_length_and_base_raise():
    with pytest.raises(ValueError, match=r"length must be >= 0, got -1"):
        sinusoidal(-1, 8)
    with pytest.raises(ValueError, match=r"base must be > 1, got 1"):
        sinusoidal(4, 8, base=1.0)
    with pytest.raises(TypeError, match=r"length must be an int, got float"):
        sinusoidal(4.0, 8)


@SETTINGS
@given(
    k=st.integers(-300, 300),
    half=st.integers(1, 12),
    base=st.sampled_from([10.0, 100.0, 10000.0]),
)
def test_sinusoidal_shift_is_a_fixed_linear_map(k, half, base):
    E = 2 * half
    table = sinusoidal(700, E, base, dtype=F64)  # (P, E)
    M = sinusoidal_shift(k, E, base)  # (E, E)
    p = torch.arange(max(0, -k), min(700, 700 - k))
    # The same matrix maps every row p to row p + k: PE[p + k] = M_k · PE[p].
    torch.testing.assert_close(table[p] @ M.T, table[p + k], atol=1e-10, rtol=0)
    # ... and it is a rotation: M_a M_b = M_{a+b}, M_k orthogonal.
    torch.testing.assert_close(M @ sinusoidal_shift(7, E, base), sinusoidal_shift(k + 7, E, base))
    torch.testing.assert_close(M @ M.T, torch.eye(E, dtype=F64), atol=1e-12, rtol=0)


def test_sinusoidal_embedding_module():
    pe = SinusoidalEmbedding(12, base=500.0)
    table = sinusoidal(20, 12, 500.0)
    positions = torch.tensor([[3, 0, 19], [7, 7, 1]])
    assert torch.equal(pe(positions), table[positions])
    assert torch.equal(pe(20), table)
    assert list(pe.parameters()) == [] and list(pe.buffers()) == []
    assert torch.equal(pe.to(torch.bfloat16)(5), table[:5])  # nothing for .to() to round
    assert pe(positions).shape == (2, 3, 12)
    with pytest.raises(
        TypeError, match=r"positions must be an integer tensor, got dtype torch.float32"
    ):
        pe(torch.zeros(3))


# ============================================================================ learned
def test_learned_embedding_looks_up_rows_and_trains_only_those():
    emb = LearnedPositionalEmbedding(16, 4)
    assert emb.weight.shape == (16, 4)
    positions = torch.tensor([[0, 5], [15, 5]])
    out = emb(positions)
    assert torch.equal(out, emb.weight[positions])
    out.sum().backward()
    used = torch.zeros(16)
    used[[0, 5, 15]] = torch.tensor([1.0, 2.0, 1.0])
    assert torch.equal(emb.weight.grad, used[:, None].expand(16, 4))
    assert torch.equal(emb(3), emb.weight[:3])


def test_learned_embedding_out_of_range_names_both_numbers():
    emb = LearnedPositionalEmbedding(512, 8)
    with pytest.raises(ValueError, match=r"position 600 .*max_len=512"):
        emb(torch.tensor([3, 600, 2]))
    with pytest.raises(ValueError, match=r"position 512 .*max_len=512"):
        emb(513)
    with pytest.raises(ValueError, match=r"positions must be >= 0, got -1"):
        emb(torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"max_len must be >= 1, got 0"):
        LearnedPositionalEmbedding(0, 8)


# ============================================================================ T5
RELS = torch.tensor([-200, -9, -1, 0, 1, 9, 200])


def test_t5_bucket_hand_values_bidirectional():
    # 32 buckets, 16 per direction, 8 exact; rel > 0 adds 16.
    # −9: 8 + ⌊ln(9/8)/ln(128/8)·8⌋ = 8 + ⌊0.34⌋ = 8;  −200: 8 + ⌊9.29⌋ = 17 → clipped to 15.
    expected = torch.tensor([15, 8, 1, 0, 17, 24, 31])
    assert torch.equal(t5_bucket(RELS), expected)
    assert torch.equal(T5RelativeBias(2).bucket(RELS), expected)


def test_t5_bucket_hand_values_causal():
    # Future keys (rel > 0) share bucket 0; 16 exact buckets; −200: 16 + ⌊19.4⌋ = 35 → 31.
    expected = torch.tensor([31, 9, 1, 0, 0, 0, 0])
    assert torch.equal(t5_bucket(RELS, bidirectional=False), expected)


@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 20), (64, 300)])
def test_t5_beyond_max_distance_is_the_last_bucket(num_buckets, max_distance):
    far = torch.arange(max_distance, 20 * max_distance, 7)
    half = num_buckets // 2
    assert torch.equal(
        t5_bucket(-far, num_buckets=num_buckets, max_distance=max_distance),
        torch.full_like(far, half - 1),
    )
    assert torch.equal(
        t5_bucket(far, num_buckets=num_buckets, max_distance=max_distance),
        torch.full_like(far, num_buckets - 1),
    )
    causal = t5_bucket(
        -far, num_buckets=num_buckets, max_distance=max_distance, bidirectional=False
    )
    assert torch.equal(causal, torch.full_like(far, num_buckets - 1))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_are_monotone_and_in_range(bidirectional):
    rel = torch.arange(-1000, 1001)
    b = t5_bucket(rel, num_buckets=32, max_distance=128, bidirectional=bidirectional)
    assert int(b.min()) == 0 and int(b.max()) == 31
    past = b[:1001].flip(0)  # distances 0, 1, ..., 1000 looking back
    assert bool((past[1:] >= past[:-1]).all())
    assert torch.equal(
        past[: 16 if not bidirectional else 8], torch.arange(16 if not bidirectional else 8)
    )


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_num_buckets_1_puts_everything_in_bucket_0(bidirectional):
    b = t5_bucket(
        torch.arange(-500, 500), num_buckets=1, max_distance=1, bidirectional=bidirectional
    )
    assert torch.equal(b, torch.zeros(1000, dtype=torch.long))
    t5 = T5RelativeBias(3, num_buckets=1, max_distance=128, bidirectional=bidirectional)
    q = k = v = seeded(1, 3, 5, 4)
    out = attnlab.attention(q, k, v, bias=t5)
    bias = t5.weight[0].view(1, 3, 1, 1).to(F64).expand(1, 3, 5, 5)
    torch.testing.assert_close(out, attnlab.attention(q, k, v, bias=bias.detach()))


def test_t5_bad_settings_raise():
    with pytest.raises(ValueError, match=r"max_distance must be > 8 .*num_buckets=32.*got 8"):
        T5RelativeBias(4, num_buckets=32, max_distance=8)
    with pytest.raises(ValueError, match=r"num_buckets must be >= 1, got 0"):
        t5_bucket(RELS, num_buckets=0)


# ============================================================================ ALiBi
def paper_get_slopes(n):
    """`get_slopes` of the ALiBi paper's code (ofirpress/attention_with_linear_biases), verbatim."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + paper_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


@pytest.mark.parametrize("n", [1, 2, 4, 5, 6, 8, 12, 16])
def test_alibi_slopes_equal_the_papers(n):
    assert alibi_slopes(n) == pytest.approx(paper_get_slopes(n), rel=1e-15, abs=0)
    assert ALiBi(n).slopes.tolist() == pytest.approx(paper_get_slopes(n), rel=1e-15, abs=0)


def test_alibi_slopes_8_heads_and_non_power_of_two():
    assert alibi_slopes(8) == [2.0**-k for k in range(1, 9)]
    # 6 heads: the 4-head sequence, then every other slope of the 8-head sequence.
    assert alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_values_with_bottom_right_alignment(causal):
    alibi = ALiBi(4, causal=causal, dtype=F64)
    L, S = 3, 5
    m = alibi.matrix(L, S)  # (H, L, S)
    slopes = alibi.slopes
    for h in range(4):
        for r in range(L):
            i = r + S - L  # query row r sits at key position r + 2
            for j in range(S):
                d = (i - j) if causal else abs(i - j)
                assert m[h, r, j].item() == -slopes[h].item() * d
    assert m.dtype == F64 and ALiBi(4).matrix(3).dtype == torch.float32


def test_alibi_is_unaffected_by_module_dtype_casts():
    alibi = ALiBi(6).to(torch.bfloat16)
    assert alibi.slopes.dtype == F64
    assert torch.equal(alibi.matrix(40), ALiBi(6).matrix(40))
    assert alibi.matrix(40).dtype == torch.float32


def reference_with_bias(q, k, v, bias, mask=None):
    return attnlab.functional.reference.attention(q, k, v, bias=bias, mask=mask)[0]


@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
@pytest.mark.parametrize(("L", "S"), [(5, 9), (9, 9), (1, 7)])
def test_function_biases_in_attention_equal_hand_built_dense_biases(backend, L, S):
    H = 4
    q, k, v = seeded(2, H, L, 8, seed=1), seeded(2, H, S, 8, seed=2), seeded(2, H, S, 6, seed=3)
    alibi = ALiBi(H, causal=True, dtype=F64)
    t5 = T5RelativeBias(H, num_buckets=8, max_distance=6).double()
    torch.nn.init.normal_(t5.weight)
    i = torch.arange(L).view(L, 1) + (S - L)
    j = torch.arange(S).view(1, S)
    hand_alibi = -alibi.slopes.view(H, 1, 1) * (i - j)  # (H, L, S)
    hand_t5 = t5.weight.detach()[t5_bucket(j - i, num_buckets=8, max_distance=6)].permute(2, 0, 1)
    causal = masks.causal().to_dense(L, S)
    for fn, hand, mask in ((alibi, hand_alibi, masks.causal()), (t5, hand_t5, None)):
        with torch.no_grad():
            out = attnlab.attention(q, k, v, bias=fn, mask=mask, backend=backend)
        dense_mask = causal if mask is not None else None
        expected = reference_with_bias(q, k, v, hand[None], dense_mask)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_t5_bias_gradients_flow_into_its_weight():
    t5 = T5RelativeBias(2, num_buckets=6, max_distance=10).double()
    q, k, v = seeded(1, 2, 7, 4, seed=4), seeded(1, 2, 7, 4, seed=5), seeded(1, 2, 7, 4, seed=6)
    attnlab.attention(q, k, v, bias=t5, backend="reference").pow(2).sum().backward()
    g_fn = t5.weight.grad.clone()
    t5.weight.grad = None
    dense = t5.matrix(7)[None]  # (1, H, L, S) built from the same weight, keeps the graph
    reference_with_bias(q, k, v, dense).pow(2).sum().backward()
    assert g_fn.abs().sum() > 0
    torch.testing.assert_close(g_fn, t5.weight.grad, atol=1e-12, rtol=0)


@SETTINGS
@given(
    data=st.data(),
    which=st.sampled_from(["alibi", "alibi-bi", "t5", "t5-causal"]),
)
def test_function_biases_are_tile_local(data, which):
    """A tiled backend calls the bias on sub-ranges of i and j: it must equal the full slice."""
    H = 3
    fn = {
        "alibi": ALiBi(H),
        "alibi-bi": ALiBi(H, causal=False),
        "t5": T5RelativeBias(H, num_buckets=10, max_distance=20),
        "t5-causal": T5RelativeBias(H, num_buckets=10, max_distance=20, bidirectional=False),
    }[which]
    L, S = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    i0 = data.draw(st.integers(0, L - 1))
    i1 = data.draw(st.integers(i0 + 1, L))
    j0 = data.draw(st.integers(0, S - 1))
    j1 = data.draw(st.integers(j0 + 1, S))
    full = dense_bias(fn, H, L, S).detach()  # (H, L, S)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(H).view(1, H, 1, 1)
    i = (torch.arange(i0, i1) + (S - L)).view(1, 1, -1, 1)
    j = torch.arange(j0, j1).view(1, 1, 1, -1)
    tile = fn(b, h, i, j).detach()
    assert torch.equal(tile[0], full[:, i0:i1, j0:j1])


def test_function_biases_reject_a_head_count_mismatch():
    q = k = v = seeded(1, 8, 4, 4)
    with pytest.raises(ValueError, match=r"ALiBi was built with num_heads=4.*H=8"):
        attnlab.attention(q, k, v, bias=ALiBi(4))
    with pytest.raises(ValueError, match=r"T5RelativeBias was built with num_heads=2.*H=8"):
        attnlab.attention(q, k, v, bias=T5RelativeBias(2))


# ============================================================================ RoPE: layouts
def hand_rotate(x, pos, pairs, thetas):
    """Rotates each pair (a, b) of x (a list of floats) by the 2×2 matrix [[c, −s], [s, c]]."""
    out = list(x)
    for (a, b), theta in zip(pairs, thetas, strict=True):
        c, s = math.cos(pos * theta), math.sin(pos * theta)
        out[a] = c * x[a] - s * x[b]
        out[b] = s * x[a] + c * x[b]
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_layouts_match_a_hand_written_2x2_rotation(interleaved):
    D, base = 6, 100.0
    thetas = [base ** (-2 * i / D) for i in range(D // 2)]
    pairs = (
        [(2 * i, 2 * i + 1) for i in range(3)] if interleaved else [(i, i + 3) for i in range(3)]
    )
    rope = RoPE(D, base=base, interleaved=interleaved)
    x = seeded(1, 1, 4, D, seed=11)
    positions = torch.tensor([0, 1, 5, 37])
    out = rope(x, positions)
    for row, p in enumerate(positions.tolist()):
        expected = hand_rotate(x[0, 0, row].tolist(), p, pairs, thetas)
        assert out[0, 0, row].tolist() == pytest.approx(expected, abs=1e-14)


def test_rope_layouts_differ_by_a_permutation_of_dims():
    D = 8
    x = seeded(2, 3, 5, D, seed=12)
    half, inter = RoPE(D), RoPE(D, interleaved=True)
    # Pair i is (i, i + D/2) in the half layout and (2i, 2i + 1) in the interleaved one.
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # interleaved dim n <- half dim perm[n]
    torch.testing.assert_close(inter(x[..., perm]), half(x)[..., perm], atol=1e-14, rtol=0)
    assert not torch.allclose(inter(x), half(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_dim": 7}, r"rotary_dim must be even .*got 7 \(from head_dim=7\)"),
        ({"head_dim": 8, "rotary_dim": 5}, r"rotary_dim must be even .*got 5"),
        ({"head_dim": 8, "rotary_dim": 10}, r"rotary_dim must be <= head_dim=8, got 10"),
        ({"head_dim": 8, "base": 1.0}, r"base must be > 1, got 1"),
        (
            {
                "head_dim": 8,
                "scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
                "rotary_dim": 6,
            },
            r"rotary_dim=6 disagrees with partial_rotary_factor=0.5",
        ),
    ],
)
def test_rope_bad_dims_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoPE(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_partial_rotary_leaves_the_tail_bit_exact(dtype, interleaved):
    x = seeded(2, 3, 9, 16, seed=13).to(dtype)
    rope = RoPE(16, rotary_dim=6, interleaved=interleaved)
    out = rope(x, torch.arange(100, 109))
    assert out.dtype == dtype
    assert torch.equal(out[..., 6:], x[..., 6:])
    assert torch.equal(
        out[..., :6], RoPE(6, interleaved=interleaved)(x[..., :6], torch.arange(100, 109))
    )
    assert not torch.equal(out[..., :6], x[..., :6])
    scaling = {"rope_type": "default", "partial_rotary_factor": 0.375}
    from_factor = RoPE(16, scaling=scaling, interleaved=interleaved)
    assert from_factor.rotary_dim == 6 and torch.equal(from_factor(x, torch.arange(100, 109)), out)


# ============================================================================ RoPE: precision (D1)
def test_rope_tables_stay_float32_after_to_bfloat16_and_phase_is_accurate():
    rope = RoPE(128).to(torch.bfloat16)
    positions = torch.arange(0, 32769)
    cos, sin = rope.cos_sin(positions)
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32
    assert rope.inv_freq.dtype == F64
    exact = positions.to(F64)[:, None] * (10000.0 ** (-torch.arange(0, 128, 2, dtype=F64) / 128))
    phase = torch.atan2(sin.double(), cos.double())
    err = torch.remainder(phase - exact + math.pi, 2 * math.pi) - math.pi
    assert float(err.abs().max()) <= 3e-3
    # The check is sensitive: a table built the naive way in bfloat16 fails it badly.
    inv_bf16 = rope.inv_freq.to(torch.bfloat16)
    naive = positions.to(torch.bfloat16)[:, None] * inv_bf16
    naive_err = torch.remainder(naive.double() - exact + math.pi, 2 * math.pi) - math.pi
    assert float(naive_err.abs().max()) > 3e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_low_precision_inputs_meet_the_tolerance_rule(dtype):
    rope = RoPE(64).to(dtype)
    x64 = seeded(2, 4, 33, 64, seed=14)
    positions = torch.arange(32736, 32769)  # far positions, where bad tables show
    golden = rope(x64, positions)
    out = rope(x64.to(dtype), positions)
    assert out.dtype == dtype
    cos, sin = rope.cos_sin(positions, dtype=F64)
    xd = x64.to(dtype)
    a, b = xd[..., :32], xd[..., 32:]
    c, s = cos.to(dtype), sin.to(dtype)
    naive = torch.cat((a * c - b * s, b * c + a * s), dim=-1)  # the formula in the input dtype
    assert_close_rule(out, golden, naive, name="rope")


# ============================================================================ RoPE: H5
def rope_matrix(rope: RoPE, m: int) -> torch.Tensor:
    """R(m) as a (D, D) matrix: column n is the rotation of the n-th basis vector."""
    eye = torch.eye(rope.head_dim, dtype=F64).view(1, 1, rope.head_dim, rope.head_dim)
    rows = rope(eye, torch.full((rope.head_dim,), m), seq_len=64)  # row n = R(m) e_n
    return rows[0, 0].T


@SETTINGS
@given(
    m=st.integers(0, 4096),
    n=st.integers(0, 4096),
    t=st.integers(-4096, 4096),
    half=st.integers(1, 8),
    interleaved=st.booleans(),
    scaling=st.sampled_from(
        [*SCALINGS, {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}]
    ),
    seed=st.integers(0, 1000),
)
def test_rope_scores_depend_only_on_relative_position(m, n, t, half, interleaved, scaling, seed):
    D = 2 * half + (2 if scaling and scaling.get("rope_type") in ("ntk", "dynamic") else 0)
    if scaling and "partial_rotary_factor" in scaling:
        D = 4 * half
    assume(min(m, n) + t >= 0)
    rope = RoPE(D, scaling=scaling, interleaved=interleaved)
    q, k = seeded(1, 1, 1, D, seed=seed), seeded(1, 1, 1, D, seed=seed + 1)

    def score(a, b):
        qm = rope(q, torch.tensor([a]), seq_len=9000)
        kn = rope(k, torch.tensor([b]), seq_len=9000)
        return float((qm * kn).sum())

    assert score(m, n) == pytest.approx(score(m + t, n + t), abs=1e-9, rel=0)


@SETTINGS
@given(
    m=st.integers(-5000, 5000),
    n=st.integers(-5000, 5000),
    half=st.integers(1, 6),
    interleaved=st.booleans(),
    scaling=st.sampled_from(SCALINGS),
    seed=st.integers(0, 1000),
)
def test_rope_is_a_group_of_rotations(m, n, half, interleaved, scaling, seed):
    D = 2 * half + 2
    rope = RoPE(D, scaling=scaling, interleaved=interleaved)
    a = rope.attention_scaling  # R(m) = a · rotation (a = 1 except for YaRN)
    eye = torch.eye(D, dtype=F64)
    torch.testing.assert_close(rope_matrix(rope, 0), a * eye, atol=1e-14, rtol=0)
    Rm, Rn = rope_matrix(rope, m) / a, rope_matrix(rope, n) / a
    torch.testing.assert_close(Rm @ Rn, rope_matrix(rope, m + n) / a, atol=1e-10, rtol=0)
    torch.testing.assert_close(Rm @ Rm.T, eye, atol=1e-12, rtol=0)
    x = seeded(3, 1, 1, D, seed=seed)
    rx = rope(x, torch.tensor([m]), seq_len=64)
    torch.testing.assert_close(rx.norm(dim=-1), a * x.norm(dim=-1), atol=1e-12, rtol=0)


def test_yarn_scores_scale_by_attention_scaling_squared():
    rope, plain = RoPE(16, scaling=YARN), RoPE(16)
    a = rope.attention_scaling
    assert a == pytest.approx(0.1 * math.log(4.0) + 1.0)
    q, k = seeded(1, 1, 5, 16, seed=20), seeded(1, 1, 5, 16, seed=21)
    s = rope(q) @ rope(k).transpose(-1, -2)
    s_unit = (rope(q) / a) @ (rope(k) / a).transpose(-1, -2)
    torch.testing.assert_close(s, a * a * s_unit)
    assert not torch.allclose(s_unit, plain(q) @ plain(k).transpose(-1, -2))


# ============================================================================ RoPE: positions
def test_rope_position_forms():
    rope = RoPE(8)
    x = seeded(2, 3, 5, 8, seed=30)
    arange = rope(x, torch.arange(5))
    assert torch.equal(rope(x), arange)
    assert torch.equal(rope(x, 7), rope(x, torch.arange(7, 12)))
    per_item = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    batched = rope(x, per_item)  # (B, L): shared by the heads
    assert torch.equal(batched[0], rope(x[:1], torch.arange(5))[0])
    assert torch.equal(batched[1], rope(x[1:], torch.arange(10, 15))[0])
    assert torch.equal(rope(x[:, 0], per_item), batched[:, 0])  # 3-D (B, L, D) input
    # Decode: the last token at offset L − 1 equals the last row of the full run; ±1 does not.
    assert torch.equal(rope(x[:, :, -1:], 4), arange[:, :, -1:])
    for wrong in (3, 5):
        assert not torch.allclose(rope(x[:, :, -1:], wrong), arange[:, :, -1:])


def test_rope_bad_inputs_raise():
    rope = RoPE(8)
    x = seeded(2, 3, 5, 8)
    with pytest.raises(
        TypeError, match=r"positions must be an integer tensor, got dtype torch.float32"
    ):
        rope(x, torch.arange(5.0))
    with pytest.raises(ValueError, match=r"positions must have shape .*\(2, 3, 5\), got \(4,\)"):
        rope(x, torch.arange(4))
    with pytest.raises(
        ValueError, match=r"x must be \(\.\.\., L, head_dim=8\), got shape \(2, 3, 5, 6\)"
    ):
        rope(seeded(2, 3, 5, 6))
    with pytest.raises(TypeError, match=r"x must be a floating tensor, got dtype torch.int64"):
        rope(torch.zeros(1, 1, 2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"dtype must be float32 or float64 .*got torch.bfloat16"):
        rope.cos_sin(torch.arange(3), dtype=torch.bfloat16)


def test_rope_gradient_is_the_transposed_rotation():
    rope = RoPE(6, interleaved=True)
    x = seeded(1, 1, 3, 6, seed=31).requires_grad_(True)
    g = seeded(1, 1, 3, 6, seed=32)
    rope(x, torch.tensor([2, 40, 900])).backward(g)
    # R is orthogonal, so dL/dx = R(p)^T g = R(−p) g.
    torch.testing.assert_close(x.grad, rope(g, torch.tensor([-2, -40, -900])), atol=1e-14, rtol=0)


# ============================================================================ RoPE scaling
def test_scaling_registry_has_every_type():
    assert set(ROPE_SCALING) == {
        "default",
        "linear",
        "ntk",
        "dynamic",
        "yarn",
        "llama3",
        "longrope",
    }


def test_linear_and_ntk_frequencies():
    theta = RoPE(16).inv_freq
    assert torch.equal(
        RoPE(16, scaling={"rope_type": "linear", "factor": 4.0}).inv_freq, theta / 4.0
    )
    ntk = RoPE(16, scaling={"rope_type": "ntk", "factor": 4.0}).inv_freq
    assert ntk[0] == theta[0] == 1.0  # the fastest pair is unchanged
    assert ntk[-1].item() == pytest.approx(
        theta[-1].item() / 4.0, rel=1e-12
    )  # the slowest / factor
    expected = (10000.0 * 4.0 ** (16 / 14)) ** (-torch.arange(0, 16, 2, dtype=F64) / 16)
    torch.testing.assert_close(ntk, expected, atol=0, rtol=1e-14)


def test_dynamic_recomputes_only_beyond_the_original_length():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    rope, plain = RoPE(8, scaling=scaling), RoPE(8)
    x = seeded(1, 2, 64, 8, seed=40)
    assert torch.equal(rope(x), plain(x))  # max position 63 < 64: unscaled
    assert torch.equal(rope.frequencies(64)[0], plain.inv_freq)
    long_x = seeded(1, 2, 200, 8, seed=41)
    inv200, _ = rope.frequencies(200)
    new_base = 10000.0 * (2.0 * 200 / 64 - 1.0) ** (8 / 6)
    torch.testing.assert_close(inv200, new_base ** (-torch.arange(0, 8, 2, dtype=F64) / 8))
    out = rope(long_x)  # seq_len = 200 from the positions
    assert torch.equal(out, rope(long_x, seq_len=200))
    assert not torch.allclose(out, plain(long_x))
    assert not torch.allclose(out, rope(long_x, seq_len=400))


def test_yarn_keeps_fast_and_interpolates_slow_frequencies():
    theta = RoPE(64).inv_freq
    yarn = RoPE(
        64, scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    ).inv_freq
    rotations = 4096 * theta / (2 * math.pi)
    fast, slow = rotations > 32, rotations < 1
    assert fast.any() and slow.any()
    torch.testing.assert_close(yarn[fast], theta[fast], atol=0, rtol=1e-12)
    torch.testing.assert_close(yarn[slow], theta[slow] / 8.0, atol=0, rtol=1e-12)
    assert bool((yarn <= theta).all() and (yarn >= theta / 8.0 - 1e-18).all())


def test_llama3_keeps_high_and_divides_low_frequencies():
    theta = RoPE(128, base=500000.0).inv_freq
    scaled = RoPE(
        128, base=500000.0, scaling={**LLAMA3, "original_max_position_embeddings": 8192}
    ).inv_freq
    wavelen = 2 * math.pi / theta
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], theta[high])
    torch.testing.assert_close(scaled[low], theta[low] / 8.0, atol=0, rtol=1e-14)
    mid = ~high & ~low
    assert bool(((scaled[mid] < theta[mid]) & (scaled[mid] > theta[mid] / 8.0)).all())


def test_longrope_switches_factors_at_the_original_length():
    short, long = [1.0, 1.5, 2.0, 3.0], [2.0, 4.0, 8.0, 16.0]
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 32,
        "factor": 4.0,
    }
    rope = RoPE(8, scaling=scaling)
    theta = RoPE(8).inv_freq
    torch.testing.assert_close(rope.inv_freq, theta / torch.tensor(short, dtype=F64))
    torch.testing.assert_close(rope.frequencies(33)[0], theta / torch.tensor(long, dtype=F64))
    assert rope.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(32)))
    x = seeded(1, 1, 40, 8, seed=42)
    assert not torch.equal(rope(x)[..., :32, :], rope(x, seq_len=32)[..., :32, :])  # long factors
    assert torch.equal(rope(x[..., :32, :]), rope(x, seq_len=32)[..., :32, :])
    assert torch.equal(rope(x), rope(x, seq_len=40))
    with_af = RoPE(8, scaling={**scaling, "attention_factor": 1.25})
    assert with_af.attention_scaling == 1.25


def _bad(scaling: dict, **drop_or_set):
    out = dict(scaling)
    for key, value in drop_or_set.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0] * 4,
    "long_factor": [2.0] * 4,
    "original_max_position_embeddings": 32,
    "factor": 4.0,
}
BAD_SCALINGS = [
    ({"rope_type": "linear", "factor": 0.5}, r"linear: factor must be >= 1, got 0.5"),
    ({"rope_type": "ntk", "factor": 0.9}, r"ntk: factor must be >= 1, got 0.9"),
    (_bad(SCALINGS[3], factor=0.5), r"dynamic: factor must be >= 1, got 0.5"),
    (_bad(YARN, factor=0.25), r"yarn: factor must be >= 1, got 0.25"),
    (_bad(LLAMA3, factor=0.5), r"llama3: factor must be >= 1, got 0.5"),
    (_bad(LONGROPE, factor=0.5), r"longrope: factor must be >= 1, got 0.5"),
    ({"rope_type": "linear", "factor": "2"}, r"linear: factor must be a real number, got str"),
    ({"rope_type": "linear"}, r"rope_type 'linear' requires the field\(s\) \['factor'\]"),
    (
        _bad(YARN, original_max_position_embeddings=None),
        r"requires the field\(s\) \['original_max_position_embeddings'\]",
    ),
    (
        _bad(LLAMA3, low_freq_factor=None, high_freq_factor=None),
        r"requires the field\(s\) \['high_freq_factor', 'low_freq_factor'\]",
    ),
    (_bad(LONGROPE, short_factor=None), r"requires the field\(s\) \['short_factor'\]"),
    (
        _bad(LONGROPE, factor=None),
        r"longrope: factor is required when attention_factor is not given",
    ),
    ({"rope_type": "warp", "factor": 2.0}, r"rope_type must be one of \[.*'yarn'\], got 'warp'"),
    ({"factor": 2.0}, r"scaling is missing the field 'rope_type'"),
    (_bad(YARN, betafast=32), r"unknown field\(s\) \['betafast'\] for rope_type 'yarn'"),
    (_bad(YARN, beta_fast=1.0, beta_slow=4.0), r"beta_fast must be >= beta_slow, got beta_fast=1"),
    (_bad(YARN, mscale=0.7), r"mscale and mscale_all_dim must be given together, mscale_all_dim"),
    (_bad(YARN, attention_factor=-1.0), r"yarn: attention_factor must be > 0, got -1"),
    (_bad(LLAMA3, high_freq_factor=1.0), r"high_freq_factor must be > low_freq_factor"),
    (_bad(LONGROPE, long_factor=[2.0] * 3), r"long_factor must have dim/2 = 4 entries, got 3"),
    (
        _bad(LONGROPE, original_max_position_embeddings=0),
        r"original_max_position_embeddings must be >= 1, got 0",
    ),
    (_bad(YARN, rope_theta=500000.0), r"rope_theta=500000.0 disagrees with base=10000.0"),
]


@pytest.mark.parametrize(("scaling", "message"), BAD_SCALINGS)
def test_bad_scaling_settings_raise_value_error_naming_the_field(scaling, message):
    with pytest.raises(ValueError, match=message):
        RoPE(8, scaling=scaling)


def test_scaling_functions_take_explicit_arguments():
    inv, a = rope_scaling.yarn(64, 10000.0, factor=4.0, original_max_position_embeddings=4096)
    via_dict, a2 = compute_rope_parameters(
        YARN | {"original_max_position_embeddings": 4096}, 64, 1e4
    )
    assert torch.equal(inv, via_dict) and a == a2
    assert inv.dtype == F64 and inv.shape == (32,)
    with pytest.raises(
        ValueError, match=r"ntk: dim \(the rotary dim\) must be an even int >= 4, got 2"
    ):
        rope_scaling.ntk(2, 10000.0, factor=2.0)
    ok = {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }  # a matching rope_theta is accepted (pasted HF dicts)
    assert RoPE(8, scaling=ok).attention_scaling == pytest.approx(0.1 * math.log(2.0) + 1)
    old_spelling = {"type": "linear", "factor": 2.0}
    assert torch.equal(RoPE(8, scaling=old_spelling).inv_freq, RoPE(8).inv_freq / 2)


def test_register_rope_scaling_adds_a_type():
    def halve_base(dim, base, *, shift):
        return rope_scaling.default(dim, base / 2)[0] * shift, 1.0

    register_rope_scaling("test-halve-base", halve_base)
    try:
        rope = RoPE(8, scaling={"rope_type": "test-halve-base", "shift": 1.0})
        assert torch.equal(rope.inv_freq, RoPE(8, base=5000.0).inv_freq)
        with pytest.raises(ValueError, match=r"requires the field\(s\) \['shift'\]"):
            RoPE(8, scaling={"rope_type": "test-halve-base"})
        with pytest.raises(ValueError, match=r"already registered"):
            register_rope_scaling("test-halve-base", halve_base)
    finally:
        ROPE_SCALING.pop("test-halve-base")


# ============================================================================ permutation (item 7)
def _permute_run(x, perm, encode):
    """Attention of the permuted sequence, mapped back to the original order."""
    inverse = torch.argsort(perm)
    return encode(x[:, :, perm])[:, :, inverse]


def _encodings(H, L, D):
    gen = torch.Generator().manual_seed(0)
    learned = LearnedPositionalEmbedding(L, D).double()
    rope = RoPE(D)
    alibi = ALiBi(H, causal=False, dtype=F64)
    t5 = T5RelativeBias(H, num_buckets=8, max_distance=16).double()
    with torch.no_grad():
        learned.weight.copy_(torch.randn(L, D, generator=gen, dtype=F64))
        t5.weight.copy_(torch.randn(8, H, generator=gen, dtype=F64))

    def attend(x, bias=None):
        return attnlab.attention(x, x, x, bias=bias, backend="reference")

    return {
        "none": attend,
        "sinusoidal": lambda x: attend(x + sinusoidal(L, D, dtype=F64)),
        "learned": lambda x: attend(x + learned(L).detach()),
        "rope": lambda x: attnlab.attention(rope(x), rope(x), x, backend="reference"),
        "alibi": lambda x: attend(x, alibi),
        "t5": lambda x: attend(x, t5),
    }


@SETTINGS
@given(perm=st.permutations(list(range(6))), seed=st.integers(0, 10_000))
def test_attention_without_positions_is_permutation_equivariant_and_with_any_encoding_is_not(
    perm, seed
):
    L, H, D = 6, 2, 8
    perm = torch.tensor(perm)
    assume(not torch.equal(perm, torch.arange(L)))
    # Reversal preserves |i − j| (bidirectional ALiBi is symmetric), so leave it out.
    assume(not torch.equal(perm, torch.arange(L).flip(0)))
    x = seeded(1, H, L, D, seed=seed)
    with torch.no_grad():
        encodings = _encodings(H, L, D)
        plain = encodings.pop("none")
        torch.testing.assert_close(_permute_run(x, perm, plain), plain(x), atol=1e-12, rtol=0)
        for name, encode in encodings.items():
            diff = float((_permute_run(x, perm, encode) - encode(x)).abs().max())
            assert diff > 1e-6, f"{name}: permuting the sequence did not change the output"


def test_pos_is_an_alias_of_positional():
    import attnlab.pos as pos
    import attnlab.positional as positional

    assert pos.__all__ == positional.__all__
    for name in positional.__all__:
        assert getattr(pos, name) is getattr(positional, name)


def test_sinusoidal_amplitude_and_periods_alias_and_coprime_periods_separate():
    from attnlab.positional.sinusoidal import SinusoidalEmbedding, sinusoidal

    base = sinusoidal(9, 8, dtype=torch.float64)
    torch.testing.assert_close(sinusoidal(9, 8, amplitude=3.0, dtype=torch.float64), 3 * base)
    # one pair with period T: p_i·p_j = A² cos(2π(i − j)/T), and position j + T aliases j
    pe = sinusoidal(40, 2, amplitude=2.0, periods=[7], dtype=torch.float64)
    gram = pe @ pe.T
    i = torch.arange(40, dtype=torch.float64)
    torch.testing.assert_close(gram, 4.0 * torch.cos(2 * torch.pi * (i[:, None] - i) / 7))
    torch.testing.assert_close(pe[3], pe[10])
    # coprime periods 3 and 5: 15 distinct codes, then the pattern repeats
    m = SinusoidalEmbedding(4, periods=(3, 5), dtype=torch.float64)(31)
    d = torch.cdist(m[:15], m[:15]) + torch.eye(15) * 9
    assert float(d.min()) > 0.1
    torch.testing.assert_close(m[15:30], m[:15])
    assert "periods=[3.0, 5.0]" in repr(SinusoidalEmbedding(4, periods=(3, 5)))
    with pytest.raises(ValueError, match="dim/2 = 2 wavelengths, got 3"):
        sinusoidal(4, 4, periods=[1, 2, 3])
    with pytest.raises(ValueError, match="periods\\[1\\] must be > 0"):
        sinusoidal(4, 4, periods=[2, 0])
    with pytest.raises(ValueError, match="base or periods, not both"):
        sinusoidal(4, 4, 500.0, periods=[2, 3])
    with pytest.raises(ValueError, match="amplitude"):
        SinusoidalEmbedding(4, amplitude=0.0)
