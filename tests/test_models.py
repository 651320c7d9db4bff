"""attnlab.models: config checks, blocks vs hand formulas, cached decoding, encoder padding."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab import masks
from attnlab.models import GPT, MLPS, NORMS, Encoder, TransformerBlock, TransformerConfig
from attnlab.models.gpt import context_start
from attnlab.modules import KVCache


def _cfg(**kw) -> TransformerConfig:
    base = dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, max_seq_len=48)
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(seed=0, dtype=torch.float32, **kw) -> GPT:
    """A GPT with large random weights, so greedy decoding is diverse rather than a fixed point."""
    torch.manual_seed(seed)
    kw.setdefault("tie_embeddings", False)  # a tied random model just repeats its last token
    model = GPT(_cfg(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
            elif "norm" not in name:
                p.normal_(0, 0.1)
        model.tok_emb.weight.normal_(0, 1.0)
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize("activation", ["silu", "relu", "gelu"])
def test_swiglu_without_autograd_is_the_same_function(activation) -> None:
    """SwiGLU without autograd writes the activation and the product into the gate's output
    (SiLU, ReLU): the same bits as the out-of-place ops on the same layers, float32 and
    bfloat16, a batch of prefill rows and a decode row; with autograd the gradient flows."""
    from torch.nn.functional import gelu, silu

    act = {"silu": silu, "relu": torch.relu, "gelu": gelu}[activation]
    torch.manual_seed(1)
    mlp = TransformerBlock(_cfg(mlp="swiglu", activation=activation)).mlp
    for dtype in (torch.float32, torch.bfloat16):
        mlp = mlp.to(dtype)
        for L in (9, 1):
            x = torch.randn(2, L, mlp.gate.in_features, dtype=dtype)
            with torch.no_grad():
                fast = mlp(x)
                want = mlp.down(act(mlp.gate(x)) * mlp.up(x))
            assert torch.equal(fast, want)
            slow = mlp(x.clone().requires_grad_())
            slow.sum().backward()
            assert mlp.gate.weight.grad is not None and mlp.gate.weight.grad.abs().sum() > 0
            mlp.zero_grad()
            torch.testing.assert_close(slow.detach(), fast)


@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        ({"d_model": 30, "n_heads": 4}, ValueError, r"d_model=30 must be divisible by n_heads=4"),
        ({"n_kv_heads": 3}, ValueError, r"n_heads=4 must be divisible by n_kv_heads=3"),
        (
            {"norm": "batchnorm"},
            ValueError,
            r"norm must be one of \['layernorm', 'rmsnorm'\], got 'batchnorm'",
        ),
        ({"mlp": "relu"}, ValueError, r"mlp must be one of \['gelu', 'swiglu'\], got 'relu'"),
        (
            {"positional": "xpos"},
            ValueError,
            r"positional must be one of .*'alibi', 't5', None\], got 'xpos'",
        ),
        ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        ({"dropout": float("nan")}, ValueError, r"dropout must be finite, got nan"),
        ({"vocab_size": 0}, ValueError, r"vocab_size must be >= 1, got 0"),
        ({"n_layers": 2.0}, TypeError, r"n_layers must be an int, got float 2.0"),
        ({"max_seq_len": True}, TypeError, r"max_seq_len must be an int, got bool True"),
        ({"prenorm": 1}, TypeError, r"prenorm must be a bool, got int 1"),
        (
            {"d_model": 12, "n_heads": 4},
            ValueError,
            r"even head dim, got d_model/n_heads = 12/4 = 3",
        ),
        ({"norm_eps": 0.0}, ValueError, r"norm_eps must be > 0, got 0.0"),
        ({"rope_scaling": "yarn"}, TypeError, r"rope_scaling must be a dict or None, got str"),
    ],
)
def test_config_validation_names_argument_expected_and_received(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _cfg(**kw)


def test_config_round_trips_through_dict_and_rejects_unknown_fields():
    cfg = _cfg(
        n_kv_heads=2,
        norm="rmsnorm",
        mlp="swiglu",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown TransformerConfig field\(s\) \['n_embd'\]"):
        TransformerConfig.from_dict({**cfg.to_dict(), "n_embd": 3})


def test_swiglu_default_width_keeps_the_gelu_parameter_count():
    assert _cfg(mlp="gelu").ff_dim == 128
    assert _cfg(mlp="swiglu").ff_dim == 88  # 8·32/3 = 85.3 -> nearest multiple of 8
    assert _cfg(mlp="swiglu", d_ff=50).ff_dim == 50


# --------------------------------------------------------------------------- hand formulas
def _layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rmsnorm(x, w, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w


def _hand_norm(norm: nn.Module, x):
    if isinstance(norm, nn.LayerNorm):
        return _layernorm(x, norm.weight, norm.bias, norm.eps)
    return _rmsnorm(x, norm.weight, norm.eps)


def _hand_mlp(mlp: nn.Module, x):
    if hasattr(mlp, "fc1"):
        h = x @ mlp.fc1.weight.T + mlp.fc1.bias
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # exact GELU
        return h @ mlp.fc2.weight.T + mlp.fc2.bias
    g = x @ mlp.gate.weight.T + mlp.gate.bias
    u = x @ mlp.up.weight.T + mlp.up.bias
    return (g * torch.sigmoid(g) * u) @ mlp.down.weight.T + mlp.down.bias


@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_block_matches_hand_formula(prenorm, norm, mlp):
    torch.manual_seed(0)
    cfg = _cfg(prenorm=prenorm, norm=norm, mlp=mlp)
    block = TransformerBlock(cfg).double().eval()
    with torch.no_grad():  # non-trivial norm gains and biases
        for p in (block.norm1.weight, block.norm2.weight):
            p.uniform_(0.5, 1.5)
        for n in (block.norm1, block.norm2):
            if getattr(n, "bias", None) is not None:
                n.bias.normal_()
    x = torch.randn(2, 9, 32, dtype=torch.float64) * 3 + 1
    mask = masks.causal()
    got = block(x, mask=mask)

    def attn(h):
        return block.attn(h, mask=mask)

    n1 = lambda h: _hand_norm(block.norm1, h)  # noqa: E731
    n2 = lambda h: _hand_norm(block.norm2, h)  # noqa: E731
    if prenorm:
        h = x + attn(n1(x))
        want = h + _hand_mlp(block.mlp, n2(h))
        other_h = n1(x + attn(x))
        other = n2(other_h + _hand_mlp(block.mlp, other_h))
    else:
        h = n1(x + attn(x))
        want = n2(h + _hand_mlp(block.mlp, h))
        other_h = x + attn(n1(x))
        other = other_h + _hand_mlp(block.mlp, n2(other_h))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert (got - other).abs().max() > 1e-3  # pre-LN and post-LN really differ
    if norm == "rmsnorm":  # RMSNorm does not centre: it differs from LayerNorm on this input
        assert (
            block.norm1(x) - _layernorm(x, block.norm1.weight, 0, block.norm1.eps)
        ).abs().max() > 1e-3


def test_rmsnorm_keeps_float32_statistics_for_bfloat16():
    norm = NORMS["rmsnorm"](64)
    x = torch.randn(4, 64) * 100
    torch.testing.assert_close(
        norm(x.bfloat16()).float(), norm(x), atol=0.05 * 100 / 100, rtol=1e-2
    )
    assert set(MLPS) == {"gelu", "swiglu"}


def test_post_ln_gpt_has_no_final_norm_and_pre_ln_has_one():
    assert isinstance(GPT(_cfg(prenorm=False)).norm_f, nn.Identity)
    assert isinstance(GPT(_cfg(prenorm=True)).norm_f, nn.LayerNorm)


# ---------------------------------------------------------------------- GPT and KV caching
CACHE_CONFIGS = [
    {"n_kv_heads": 2, "positional": "rope"},
    {"n_kv_heads": 1, "positional": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
    {"n_kv_heads": 2, "positional": "rope", "prenorm": False},
    {"n_kv_heads": 2, "positional": "learned"},
    {"positional": "alibi"},
    {"positional": "sinusoidal"},
    {"positional": None, "n_kv_heads": 4},
]
# dynamic NTK: the frequencies follow the current length, so decoding step by step equals
# recomputing the prefix (generate with and without cache), not one forward at the full length
DYNAMIC_ROPE = {
    "n_kv_heads": 2,
    "positional": "rope",
    "rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kw", CACHE_CONFIGS)
def test_cached_decode_logits_equal_full_forward_fp32(kw):
    model = _gpt(**kw)
    idx = torch.randint(0, 37, (3, 24), generator=torch.Generator().manual_seed(1))
    full = model(idx)  # (B, 24, V)
    caches = model.new_caches()
    steps = [model(idx[:, :7], caches=caches)]
    steps += [model(idx[:, t : t + 1], caches=caches) for t in range(7, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert all(len(c) == 24 for c in caches)


def test_new_caches_rotate_keys_at_insert_only_for_static_rope():
    """`GPT.new_caches` caches keys after RoPE when its frequencies are static (each key rotated
    once), before RoPE when they depend on the sequence length (dynamic NTK: re-rotated at every
    step) or without RoPE; decoding equals recomputing (the next test)."""
    assert all(c.rotate_at_insert for c in _gpt(**CACHE_CONFIGS[0]).new_caches())
    assert not any(c.rotate_at_insert for c in _gpt(**DYNAMIC_ROPE).new_caches())
    assert not any(c.rotate_at_insert for c in _gpt(**CACHE_CONFIGS[3]).new_caches())


@pytest.mark.parametrize("kw", [*CACHE_CONFIGS[:3], DYNAMIC_ROPE, CACHE_CONFIGS[4]])
def test_cached_generate_equals_uncached_greedy_token_for_token(kw):
    model = _gpt(**kw)
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(2))
    # 5 + 50 tokens > max_seq_len=48: the context restarts once; both modes must agree.
    cached = model.generate(prompt, 50, top_k=1, use_cache=True)
    recomputed = model.generate(prompt, 50, top_k=1, use_cache=False)
    assert cached.shape == (2, 55)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached[:, :5], prompt)
    assert len(set(cached[:, 5:].flatten().tolist())) > 5  # greedy decoding did not collapse


def test_cached_generate_matches_uncached_with_sampling_and_fixed_seed():
    model = _gpt(n_kv_heads=2)
    prompt = torch.randint(0, 37, (2, 4), generator=torch.Generator().manual_seed(3))

    def run(use_cache):
        g = torch.Generator().manual_seed(7)
        return model.generate(
            prompt, 30, temperature=0.7, top_k=10, use_cache=use_cache, generator=g
        )

    assert torch.equal(run(True), run(False))


def test_greedy_generation_follows_the_argmax_of_the_full_forward():
    model = _gpt(n_kv_heads=2)
    prompt = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, 20, top_k=1)
    logits = model(out[:, :-1])  # (1, 25, V)
    assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:])


def test_decode_with_a_shifted_cache_offset_is_detected():
    """The equality check above is sensitive: a cache that believes one extra token was seen
    (so RoPE rotates new tokens by a wrong offset) changes the logits."""
    model = _gpt(n_kv_heads=2)
    idx = torch.randint(0, 37, (1, 20), generator=torch.Generator().manual_seed(5))
    full = model(idx)

    class OffByOne(KVCache):  # assigns decode positions as if one more token had been seen
        def update(self, k, v, positions=None):
            if positions is None and self.seen:
                positions = torch.arange(self.seen + 1, self.seen + 1 + k.shape[2])
            return super().update(k, v, positions)

    caches = [OffByOne() for _ in model.blocks]
    steps = [model(idx[:, :10], caches=caches)]
    steps += [model(idx[:, t : t + 1], caches=caches) for t in range(10, 19)]
    assert (torch.cat(steps, 1) - full[:, :19]).abs().max() > 1e-3


def test_context_start_rule():
    assert context_start(10, 0, 16) == 0
    assert context_start(16, 0, 16) == 0
    assert context_start(17, 0, 16) == 9  # keep the last 16 // 2 = 8 tokens
    assert context_start(25, 9, 16) == 9
    assert context_start(26, 9, 16) == 18
    assert context_start(3, 0, 1) == 2


def test_tied_embeddings_share_one_parameter():
    tied = GPT(_cfg(tie_embeddings=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = GPT(_cfg(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 37 * 32


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda m: m(torch.zeros(1, 3)), TypeError, r"idx must be an integer tensor.*float32"),
        (
            lambda m: m(torch.zeros(3, dtype=torch.long)),
            ValueError,
            r"idx must be \(B, L\), got shape \(3,\)",
        ),
        (
            lambda m: m(torch.full((1, 3), 37)),
            ValueError,
            r"ids in \[37, 37\], expected ids in \[0, vocab_size=37\)",
        ),
        (
            lambda m: m(torch.zeros(1, 49, dtype=torch.long)),
            ValueError,
            r"49 positions \(0 cached \+ 49 new\) exceeds max_seq_len=48",
        ),
        (
            lambda m: m(torch.zeros(1, 2, dtype=torch.long), caches=[]),
            ValueError,
            r"caches must be a list of 2 KVCache, got 0",
        ),
        (
            lambda m: m.generate(torch.zeros(1, 2, dtype=torch.long), -1),
            ValueError,
            r"max_new_tokens must be >= 0, got -1",
        ),
        (
            lambda m: m.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=0),
            ValueError,
            r"temperature must be > 0, got 0",
        ),
        (
            lambda m: m.generate(torch.zeros(1, 2, dtype=torch.long), 3, top_k=0),
            ValueError,
            r"top_k must be >= 1, got 0",
        ),
        (
            lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), 3),
            ValueError,
            r"at least one token per row, got \(1, 0\)",
        ),
    ],
)
def test_gpt_input_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(GPT(_cfg()))


def test_cache_overflowing_max_seq_len_is_refused_before_compute():
    model = _gpt()
    caches = model.new_caches()
    model(torch.zeros(1, 45, dtype=torch.long), caches=caches)
    with pytest.raises(
        ValueError, match=r"50 positions \(45 cached \+ 5 new\) exceeds max_seq_len=48"
    ):
        model(torch.zeros(1, 5, dtype=torch.long), caches=caches)
    assert all(len(c) == 45 for c in caches)


def test_generate_restores_training_mode():
    model = _gpt().train()
    model.generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=1)
    assert model.training


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = GPT(_cfg(n_kv_heads=2)).double().train()
    idx = torch.randint(0, 37, (2, 16))

    def grads(flag):
        model.zero_grad()
        model.gradient_checkpointing = flag
        model(idx).logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------------- Encoder
@pytest.mark.parametrize("positional", ["rope", "learned", "alibi", "sinusoidal", None])
def test_encoder_padding_invariance(positional):
    torch.manual_seed(0)
    enc = Encoder(_cfg(positional=positional, n_kv_heads=2)).double().eval()
    g = torch.Generator().manual_seed(0)
    real = torch.randint(0, 37, (1, 6), generator=g)
    alone = enc(real)  # (1, 6, E), no padding at all
    for pad_len in (1, 5):
        for _ in range(2):  # different junk in the padded positions
            junk = torch.randint(0, 37, (1, pad_len), generator=g)
            idx = torch.cat((real, junk), dim=1)  # (1, 6 + pad, ...)
            pad = torch.arange(6 + pad_len) < 6  # (L,)
            out = enc(idx, padding_mask=pad[None])
            torch.testing.assert_close(out[:, :6], alone, atol=1e-12, rtol=0)
    # Sensitivity: without the padding mask the junk changes the real tokens' outputs.
    unmasked = enc(torch.cat((real, junk), dim=1))
    assert (unmasked[:, :6] - alone).abs().max() > 1e-6


def test_encoder_batch_of_ragged_lengths_equals_each_sequence_alone():
    torch.manual_seed(1)
    enc = Encoder(_cfg(n_kv_heads=2)).double().eval()
    g = torch.Generator().manual_seed(1)
    lengths = [9, 4, 1]
    idx = torch.randint(0, 37, (3, 9), generator=g)
    pad = torch.arange(9)[None] < torch.tensor(lengths)[:, None]  # (B, L)
    out = enc(idx, padding_mask=pad)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b : b + 1, :n], enc(idx[b : b + 1, :n]), atol=1e-12, rtol=0)


def test_encoder_is_bidirectional():
    torch.manual_seed(2)
    enc = Encoder(_cfg()).double().eval()
    idx = torch.randint(0, 37, (1, 8))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 37
    assert (enc(idx)[:, 0] - enc(changed)[:, 0]).abs().max() > 1e-6  # the first token sees the last


@pytest.mark.parametrize(
    "mask,exc,pattern",
    [
        (
            torch.ones(2, 5),
            TypeError,
            r"padding_mask must be a bool tensor \(True = real token\), got torch.float32",
        ),
        (
            torch.ones(2, 4, dtype=torch.bool),
            ValueError,
            r"padding_mask must have shape \(B, L\) = \(2, 5\), got \(2, 4\)",
        ),
    ],
)
def test_encoder_padding_mask_errors(mask, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Encoder(_cfg())(torch.zeros(2, 5, dtype=torch.long), padding_mask=mask)


# ------------------------------------------------- what BERT needs: activation, types, eps
def test_activation_registry_names_match_the_config_and_change_the_mlp():
    from attnlab.models import blocks, config

    assert set(blocks.ACTIVATIONS) == set(config.ACTIVATIONS)
    x = torch.randn(3, 5, 32, dtype=torch.float64) * 2
    hand = {
        "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))),
        "gelu_tanh": lambda h: (
            0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        ),
        "relu": lambda h: h.clamp(min=0),
        "silu": lambda h: h * torch.sigmoid(h),
    }
    outs = {}
    for name, act in hand.items():
        torch.manual_seed(0)
        mlp = TransformerBlock(_cfg(activation=name)).double().mlp
        assert mlp.activation == name
        want = act(x @ mlp.fc1.weight.T + mlp.fc1.bias) @ mlp.fc2.weight.T + mlp.fc2.bias
        outs[name] = mlp(x)
        torch.testing.assert_close(outs[name], want, atol=1e-12, rtol=0)
    assert (outs["gelu"] - outs["gelu_tanh"]).abs().max() > 1e-6  # the variants really differ
    # None keeps each MLP's own nonlinearity; SwiGLU's gate takes the activation (GeGLU).
    assert TransformerBlock(_cfg(mlp="swiglu")).mlp.activation == "silu"
    assert TransformerBlock(_cfg(mlp="swiglu", activation="gelu")).mlp.activation == "gelu"
    assert TransformerBlock(_cfg()).mlp.activation == "gelu"


@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        (
            {"activation": "mish"},
            ValueError,
            r"activation must be one of \['gelu', 'gelu_tanh', 'relu', 'silu'\], got 'mish'",
        ),
        ({"type_vocab_size": -1}, ValueError, r"type_vocab_size must be >= 0, got -1"),
        ({"pad_token_id": 37}, ValueError, r"pad_token_id must be < vocab_size=37, got 37"),
        ({"pad_token_id": 1.0}, TypeError, r"pad_token_id must be an int, got float 1.0"),
        ({"embed_norm": 1}, TypeError, r"embed_norm must be a bool, got int 1"),
        (
            {"attn_backend": "cuda"},
            ValueError,
            r"attn_backend must be one of \[.*'auto'\], got 'cuda'",
        ),
    ],
)
def test_new_config_fields_are_validated(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _cfg(**kw)


def test_config_fields_reach_the_modules():
    cfg = _cfg(norm_eps=1e-12, attn_backend="reference", bias=False, prenorm=False)
    block = TransformerBlock(cfg)
    assert block.norm1.eps == block.norm2.eps == 1e-12
    assert block.attn.backend == "reference"
    assert block.attn.qkv_proj.bias is None and block.mlp.fc1.bias is None
    enc = Encoder(_cfg(pad_token_id=3))
    assert enc.tok_emb.padding_idx == 3 and (enc.tok_emb.weight[3] == 0).all()


def test_encoder_token_types_and_embedding_norm_match_the_formula():
    torch.manual_seed(0)
    cfg = _cfg(positional="learned", type_vocab_size=3, embed_norm=True, prenorm=False)
    enc = Encoder(cfg).double().eval()
    with torch.no_grad():
        enc.emb_norm.weight.uniform_(0.5, 1.5)
        enc.emb_norm.bias.normal_()
    idx = torch.randint(0, 37, (2, 7))
    types = torch.randint(0, 3, (2, 7))
    x = enc.tok_emb.weight[idx] + enc.pos_emb.weight[:7] + enc.type_emb.weight[types]
    x = _hand_norm(enc.emb_norm, x)
    want = x
    for block in enc.blocks:
        want = block(want)
    torch.testing.assert_close(enc(idx, token_type_ids=types), want, atol=1e-12, rtol=0)
    zeros = torch.zeros_like(types)  # no types = type 0 everywhere
    torch.testing.assert_close(enc(idx), enc(idx, token_type_ids=zeros), atol=1e-12, rtol=0)
    assert (enc(idx) - enc(idx, token_type_ids=types)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"token_type_ids given but config.type_vocab_size = 0"):
        Encoder(_cfg())(idx, token_type_ids=types)
    with pytest.raises(TypeError, match=r"token_type_ids must be an int64 or int32 tensor"):
        enc(idx, token_type_ids=types.float())
    with pytest.raises(ValueError, match=r"token_type_ids must have shape \(B, L\) = \(2, 7\)"):
        enc(idx, token_type_ids=types[:, :3])


def test_gpt_trains_on_packed_documents_as_on_each_document_alone():
    """``GPT(idx, mask=masks.document(ids))``: every token's logits equal those of its document
    run alone (RoPE is relative, so positions need not restart), forward and gradients."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    model = GPT(cfg).double()
    lengths = [5, 11, 7]
    idx = torch.randint(0, 50, (1, sum(lengths)))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).unsqueeze(0)  # (1, L)
    packed = model(idx, mask=masks.document(ids))
    alone = torch.cat([model(part) for part in idx.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(packed, model(idx))  # the mask matters
    (g_packed,) = torch.autograd.grad(packed.square().sum(), model.tok_emb.weight)
    (g_alone,) = torch.autograd.grad(alone.square().sum(), model.tok_emb.weight)
    torch.testing.assert_close(g_packed, g_alone, rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="mask must be an attnlab Mask"):
        model(idx, mask=torch.ones(1, 23, dtype=torch.bool))
    with pytest.raises(ValueError, match="without caches"):
        model(idx, mask=masks.document(ids), caches=model.new_caches())
