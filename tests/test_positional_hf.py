"""RoPE scaling and T5 buckets against Hugging Face transformers (a test-only dependency).

Every scaling type must give the same ``inv_freq`` and attention factor as transformers'
``ROPE_INIT_FUNCTIONS`` for the same settings, to 1e-6 (relative), and RoPE must rotate q/k
exactly like Llama's ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

from transformers import LlamaConfig  # noqa: E402

from attnlab.positional import RoPE, compute_rope_parameters, t5_bucket  # noqa: E402

F64 = torch.float64
_NEW_API = "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters or hasattr(
    LlamaConfig(), "rope_parameters"
)


def hf_config(head_dim: int, base: float, max_pos: int, params: dict, partial: float = 1.0):
    """A small LlamaConfig carrying the RoPE settings, in the installed version's spelling."""
    kwargs = dict(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        max_position_embeddings=max_pos,
    )
    if _NEW_API:  # transformers >= 5: one rope_parameters dict holding rope_theta
        rope = {**params, "rope_theta": base}
        if partial != 1.0:
            rope["partial_rotary_factor"] = partial
        config = LlamaConfig(**kwargs, rope_parameters=rope)
    else:  # transformers 4.x: rope_theta and rope_scaling; the original length lives elsewhere
        original = params.get("original_max_position_embeddings")
        if params["rope_type"] == "yarn":  # 4.x YaRN reads it from max_position_embeddings
            kwargs["max_position_embeddings"] = original
        config = LlamaConfig(
            **kwargs,
            rope_theta=base,
            rope_scaling=params if params["rope_type"] != "default" else None,
        )
        if params["rope_type"] == "longrope":  # 4.x LongRoPE reads a config attribute
            config.original_max_position_embeddings = original
        config.partial_rotary_factor = partial
    return config


def hf_supports(params: dict) -> bool:
    """Whether the installed transformers knows the YaRN fields used (mscale, truncate: newer)."""
    if params["rope_type"] != "yarn":
        return True
    source = inspect.getsource(rope_utils.ROPE_INIT_FUNCTIONS["yarn"])
    return all(key in source for key in {"mscale", "mscale_all_dim", "truncate"} & set(params))


def hf_parameters(config, rope_type: str, seq_len: int | None) -> tuple[torch.Tensor, float]:
    if rope_type == "default":
        if "default" in rope_utils.ROPE_INIT_FUNCTIONS:
            return rope_utils.ROPE_INIT_FUNCTIONS["default"](config, "cpu")
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2, 2.7, 3.3, 4.0, 5.0, 6.0, 7.5, 9.0]
LONG = [1.1, 1.3, 1.6, 2.0, 2.6, 3.4, 4.5, 6.0, 8.0, 11.0, 14.0, 18.0, 23.0, 29.0, 36.0, 45.0]

# (id, head_dim, base, HF max_position_embeddings, HF params, our params, seq_len, partial factor)
CASES = [
    ("default", 64, 10000.0, 4096, {"rope_type": "default"}, {"rope_type": "default"}, None, 1.0),
    (
        "linear",
        64,
        10000.0,
        4096,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "linear", "factor": 4.0},
        None,
        1.0,
    ),
    (
        "linear-partial",
        80,
        10000.0,
        4096,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "linear", "factor": 2.0},
        None,
        0.5,
    ),
    # HF's dynamic uses max_position_embeddings as the original length.
    (
        "dynamic-beyond",
        64,
        10000.0,
        2048,
        {"rope_type": "dynamic", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 2048},
        3 * 2048 + 5,
        1.0,
    ),
    (
        "dynamic-within",
        64,
        10000.0,
        2048,
        {"rope_type": "dynamic", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 2048},
        1000,
        1.0,
    ),
    # Static NTK = HF's dynamic at seq_len s with factor·s/L0 − (factor − 1) = factor,
    # i.e. s = L0·(2·factor − 1)/factor (= 3584 for factor 4, L0 2048).
    (
        "ntk",
        64,
        10000.0,
        2048,
        {"rope_type": "dynamic", "factor": 4.0},
        {"rope_type": "ntk", "factor": 4.0},
        3584,
        1.0,
    ),
    (
        "yarn",
        64,
        10000.0,
        16384,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        None,
        1.0,
    ),
    (
        "yarn-deepseek",
        64,
        10000.0,
        163840,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        None,
        1.0,
    ),
    (
        "yarn-betas-notrunc",
        128,
        1000000.0,
        131072,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        None,
        1.0,
    ),
    (
        "yarn-attention-factor-partial",
        96,
        10000.0,
        8192,
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.5,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.5,
        },
        None,
        0.5,
    ),
    (
        "llama3",
        128,
        500000.0,
        131072,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        None,
        1.0,
    ),
    (
        "llama3-small",
        64,
        10000.0,
        8192,
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
        },
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
        },
        None,
        1.0,
    ),
]
for seq_len, tag in ((None, "short"), (2000, "short-2000"), (4097, "long")):
    CASES.append(
        (
            f"longrope-{tag}",
            32,
            10000.0,
            131072,
            {
                "rope_type": "longrope",
                "short_factor": SHORT,
                "long_factor": LONG,
                "original_max_position_embeddings": 4096,
                "factor": 32.0,
            },
            {
                "rope_type": "longrope",
                "short_factor": SHORT,
                "long_factor": LONG,
                "original_max_position_embeddings": 4096,
                "factor": 32.0,
            },
            seq_len,
            1.0,
        )
    )
CASES.append(
    (
        "longrope-attention-factor",
        32,
        10000.0,
        131072,
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.19,
        },
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 4096,
            "attention_factor": 1.19,
        },
        8192,
        1.0,
    )
)


@pytest.mark.parametrize(
    ("head_dim", "base", "max_pos", "hf_params", "ours", "seq_len", "partial"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_inv_freq_and_attention_factor_equal_transformers(
    head_dim, base, max_pos, hf_params, ours, seq_len, partial
):
    if not hf_supports(hf_params):
        pytest.skip(f"transformers {transformers.__version__} lacks a field of {sorted(hf_params)}")
    config = hf_config(head_dim, base, max_pos, dict(hf_params), partial)
    hf_inv, hf_factor = hf_parameters(config, hf_params["rope_type"], seq_len)
    rotary_dim = int(head_dim * partial)
    inv, factor = compute_rope_parameters(ours, rotary_dim, base, seq_len=seq_len)
    assert inv.shape == hf_inv.shape == (rotary_dim // 2,)
    torch.testing.assert_close(inv, hf_inv.to(F64), rtol=1e-6, atol=0)
    assert factor == pytest.approx(float(hf_factor), rel=1e-6, abs=0)
    # The module reads the same dict (partial rotary through rotary_dim).
    rope = RoPE(head_dim, base, scaling=ours, rotary_dim=rotary_dim)
    m_inv, m_factor = rope.frequencies(seq_len)
    assert torch.equal(m_inv, inv) and m_factor == factor


def test_cases_cover_every_scaling_type():
    covered = {c[5]["rope_type"] for c in CASES}
    from attnlab.positional import ROPE_SCALING

    assert covered == set(ROPE_SCALING)


def test_scaling_changes_the_frequencies_in_these_cases():
    # Guards the comparison above against trivially equal (unscaled) settings.
    for name, head_dim, base, _, _, ours, seq_len, partial in CASES:
        if name in ("default", "dynamic-within"):
            continue
        dim = int(head_dim * partial)
        inv, factor = compute_rope_parameters(ours, dim, base, seq_len=seq_len)
        plain, _ = compute_rope_parameters(None, dim, base)
        assert not torch.allclose(inv, plain) or factor != 1.0, name


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default"},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_rope_rotation_equals_llama_apply_rotary_pos_emb(params):
    from transformers.models.llama import modeling_llama as llama

    head_dim, base = 32, 10000.0
    config = hf_config(head_dim, base, 256, dict(params))
    hf_rope = llama.LlamaRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 20, head_dim, generator=gen)
    k = torch.randn(2, 3, 20, head_dim, generator=gen)
    positions = torch.stack((torch.arange(20), torch.arange(100, 120)))  # (B, L)
    cos, sin = hf_rope(q, positions)
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    rope = RoPE(head_dim, base, scaling=params)
    # HF forms angles in float32 (error ~ p·2^-24); ours are float64-exact, hence 2e-5.
    torch.testing.assert_close(rope(q, positions), hf_q, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rope(k, positions), hf_k, atol=2e-5, rtol=1e-5)
    assert rope.attention_scaling == pytest.approx(hf_rope.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 40), (64, 300)])
def test_t5_bucket_equals_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1).view(1, -1)
    hf = T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    ours = t5_bucket(
        rel, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
    )
    assert torch.equal(ours, hf)


def test_yarn_default_attention_factor_formula():
    # 0.1·ln(factor) + 1, as in the YaRN paper and transformers.
    _, factor = compute_rope_parameters(
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048}, 64, 1e4
    )
    assert factor == pytest.approx(0.1 * math.log(16.0) + 1.0, rel=1e-15)
