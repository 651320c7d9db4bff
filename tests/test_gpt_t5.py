"""`TransformerConfig(positional="t5")`: T5's bucketed relative bias in `GPT` and `Encoder`, one
learned table shared by every layer, through `attnlab.attention`'s ``bias=`` (the flash path).

Checked against a hand computation whose buckets come from transformers' own T5 layer
(``T5Attention._relative_position_bucket``), by the tolerance rule (forward and the table's
gradient); cached decoding equals the full forward; checkpoints round-trip."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.apps.loop import load_model, save_model
from attnlab.checkpoint import CheckpointError
from attnlab.models import GPT, Encoder, TransformerConfig
from attnlab.models.config import checkpoint_rules
from attnlab.testing import assert_close_rule


def _cfg(**kw) -> TransformerConfig:
    base = dict(
        vocab_size=37,
        d_model=40,
        n_layers=2,
        n_heads=4,
        max_seq_len=128,
        positional="t5",
        t5_buckets=12,
        t5_max_distance=24,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(seed: int = 0, **kw) -> GPT:
    """Random weights large enough that the bias table matters (std 1 per bucket)."""
    torch.manual_seed(seed)
    model = GPT(_cfg(**kw))
    with torch.no_grad():
        model.blocks[0].attn.bias_fn.weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "bias_fn" not in name:
                p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
    return model.eval()


def _hand_logits(model: GPT, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The GPT's forward written out, with transformers' T5 buckets (causal)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    m = copy.deepcopy(model).to(dtype)
    cfg = m.config
    B, L = idx.shape
    H, D = cfg.n_heads, cfg.head_dim
    rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]  # (L, L): j − i
    bucket = T5Attention._relative_position_bucket(
        rel, bidirectional=False, num_buckets=cfg.t5_buckets, max_distance=cfg.t5_max_distance
    )
    causal = rel <= 0
    x = m.tok_emb(idx)  # (B, L, E)
    for blk in m.blocks:
        bias = blk.attn.bias_fn.weight[bucket].permute(2, 0, 1)  # (H, L, L)
        qkv = blk.attn.qkv_proj(blk.norm1(x)).view(B, L, 3 * H, D).transpose(1, 2)
        q, k, v = qkv.split([H, H, H], dim=1)  # (B, H, L, D) each
        s = q @ k.transpose(-1, -2) / math.sqrt(D) + bias  # (B, H, L, L)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        a = (p @ v).transpose(1, 2).reshape(B, L, H * D)  # (B, L, E)
        x = x + blk.attn.out_proj(a)
        x = x + blk.mlp(blk.norm2(x))
    return m.lm_head(m.norm_f(x)), m


def test_t5_buckets_are_transformers_buckets_and_the_table_is_shared():
    from transformers.models.t5.modeling_t5 import T5Attention

    model = _gpt()
    t5 = model.blocks[0].attn.bias_fn
    assert all(b.attn.bias_fn is t5 for b in model.blocks)  # one table, as in T5
    assert tuple(t5.weight.shape) == (12, 4) and not t5.bidirectional
    rel = torch.arange(-300, 5)
    ours = t5.bucket(rel)
    theirs = T5Attention._relative_position_bucket(
        rel, bidirectional=False, num_buckets=12, max_distance=24
    )
    assert torch.equal(ours, theirs)
    assert Encoder(_cfg()).blocks[0].attn.bias_fn.bidirectional  # encoders see both directions


@pytest.mark.parametrize("L", [1, 17, 97])
def test_gpt_t5_logits_and_table_gradient_follow_the_hand_computation(L):
    model = _gpt(L)
    idx = torch.randint(0, 37, (2, L), generator=torch.Generator().manual_seed(L))
    target = torch.randint(0, 37, (2, L), generator=torch.Generator().manual_seed(L + 1))

    def run(fn):
        logits, m = fn()
        F.cross_entropy(logits.flatten(0, 1).double(), target.flatten()).backward()
        return logits.detach(), m.blocks[0].attn.bias_fn.weight.grad

    impl = run(lambda: (model(idx), model))
    golden = run(lambda: _hand_logits(model, idx, torch.float64))
    naive = run(lambda: _hand_logits(model, idx, torch.float32))
    assert_close_rule(impl[0], golden[0], naive[0], name="logits")
    assert_close_rule(impl[1], golden[1], naive[1], kind="grad", name="t5 table grad")
    assert L == 1 or impl[1].abs().sum() > 0  # one key: softmax ignores its bias
    # inference on the tiled flash path (per-tile bias, no L × S matrix): the same logits
    tiled = GPT(_cfg(attn_backend="flash")).eval()
    tiled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_close_rule(tiled(idx), golden[0], naive[0], name="flash logits")


def test_gpt_t5_cached_decode_equals_full_forward():
    model = _gpt(3)
    idx = torch.randint(0, 37, (3, 40), generator=torch.Generator().manual_seed(4))
    full = model(idx)  # (B, 40, V)
    caches = model.new_caches()
    steps = [model(idx[:, :9], caches=caches)]
    steps += [model(idx[:, t : t + 1], caches=caches) for t in range(9, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def _build(config):
    return GPT(TransformerConfig.from_dict(config))


def test_gpt_t5_checkpoint_round_trips(tmp_path):
    model = _gpt(5)
    path = save_model(tmp_path / "t5.safetensors", model, kind="gpt", config=model.config.to_dict())
    loaded, config, _ = load_model(path, "gpt", _build, rules=checkpoint_rules())
    idx = torch.randint(0, 37, (2, 33), generator=torch.Generator().manual_seed(6))
    assert config["positional"] == "t5" and config["t5_buckets"] == 12
    assert torch.equal(loaded(idx), model(idx))
    assert all(b.attn.bias_fn is loaded.blocks[0].attn.bias_fn for b in loaded.blocks)
    # a stored t5_buckets that the table does not justify is refused before building
    bad = {**model.config.to_dict(), "t5_buckets": 4096}
    path2 = save_model(tmp_path / "bad.safetensors", model, kind="gpt", config=bad)
    with pytest.raises(CheckpointError, match="t5_buckets"):
        load_model(path2, "gpt", _build, rules=checkpoint_rules())


@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        ({"t5_buckets": 0}, ValueError, r"t5_buckets must be >= 1, got 0"),
        ({"t5_max_distance": 2.5}, TypeError, r"t5_max_distance must be an int, got float 2.5"),
    ],
)
def test_t5_config_errors_name_the_field(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _cfg(**kw)


def test_t5_max_distance_inside_the_exact_buckets_is_refused_when_building():
    with pytest.raises(ValueError, match=r"t5_max_distance must be > 6 .*t5_buckets=12, causal.*6"):
        GPT(_cfg(t5_max_distance=6))
    Encoder(_cfg(t5_max_distance=6))  # bidirectional: 3 exact buckets per direction


def test_gpt_t5_compiles_fullgraph_with_inductor():
    model = _gpt(7, n_layers=1)
    idx = torch.randint(0, 37, (2, 17), generator=torch.Generator().manual_seed(8))
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(idx), model(idx), atol=2e-5, rtol=1e-5)
