"""Attention weights from the same forward pass: ``need_weights`` on blocks/models, and capture.

- `TransformerBlock`, `Encoder`, `GPT` with ``need_weights=True`` return the weights their own
  attention calls computed: equal to a hand computation from the projections, with outputs
  equal to the plain call, and exactly one attention call per layer.
- `attnlab.analysis.capture.module_attentions` gives the same weights without running any
  attention twice, leaves the model's outputs as they are, and refuses what it refused before.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo as dynamo

import attnlab.modules.mha as mha_module
from attnlab import masks
from attnlab.analysis.capture import capture_attentions, module_attentions
from attnlab.models import GPT, Encoder, TransformerBlock, TransformerConfig
from attnlab.modules import KVCache, MultiHeadAttention


def _cfg(**kw) -> TransformerConfig:
    base = dict(vocab_size=29, d_model=24, n_layers=3, n_heads=4, max_seq_len=32)
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(_cfg(**kw)).double().eval()
    with torch.no_grad():  # larger weights than GPT-2's init, so the weights are far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
    return model


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the `attnlab.attention` calls made by `MultiHeadAttention` (with return_weights)."""
    calls: list[bool] = []
    real = mha_module.attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("return_weights", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(mha_module, "attention", counting)
    return calls


def _hand_weights(block: TransformerBlock, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√D) over the allowed keys, from the block's projections: ``(B, H, L, S)``."""
    attn = block.attn
    h = block.norm1(x) if block.prenorm else x
    B, L, _ = h.shape
    H, D = attn.num_heads, attn.head_dim
    q, k, _ = (
        t.view(B, L, H, D).transpose(1, 2) for t in attn.qkv_proj(h).split(H * D, dim=-1)
    )  # (B, H, L, D)
    s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, -math.inf)
    return s.softmax(-1)


def _hand_gpt_weights(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    L = idx.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(L))
    out = []
    for block in model.blocks:
        out.append(_hand_weights(block, x, causal))
        x = block(x, mask=masks.causal())
    return out


# ------------------------------------------------------------------------ need_weights outputs


def test_block_need_weights_is_the_same_pass_as_the_plain_call(attention_calls):
    torch.manual_seed(0)
    for prenorm in (True, False):
        block = TransformerBlock(_cfg(prenorm=prenorm, positional=None)).double().eval()
        x = torch.randn(2, 7, 24, dtype=torch.float64)
        attention_calls.clear()
        y, w = block(x, mask=masks.causal(), need_weights=True)
        assert attention_calls == [True]  # one attention call, which returned the weights
        torch.testing.assert_close(y, block(x, mask=masks.causal()), atol=1e-12, rtol=0)
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        torch.testing.assert_close(w, _hand_weights(block, x, causal), atol=1e-12, rtol=0)


def test_gpt_need_weights_returns_every_layers_weights_from_one_pass(attention_calls):
    model = _gpt(positional="learned")
    idx = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(idx)
    attention_calls.clear()
    logits_w, weights = model(idx, need_weights=True)
    assert attention_calls == [True] * 3
    torch.testing.assert_close(logits_w, logits, atol=1e-12, rtol=0)
    assert isinstance(weights, tuple) and len(weights) == 3
    with torch.no_grad():
        want = _hand_gpt_weights(model, idx)
    for got, ref in zip(weights, want, strict=True):
        assert got.shape == (2, 4, 9, 9)
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    assert max(w.max().item() for w in weights) > 0.5  # far from uniform: a real test


def test_gpt_need_weights_with_a_cache_equals_the_last_row_of_the_full_pass():
    model = _gpt(positional="rope", n_kv_heads=2)
    idx = torch.randint(0, 29, (1, 10), generator=torch.Generator().manual_seed(2))
    _, full = model(idx, need_weights=True)
    caches = model.new_caches(32)
    model(idx[:, :-1], caches=caches)
    _, step = model(idx[:, -1:], caches=caches, need_weights=True)
    for a, b in zip(step, full, strict=True):
        assert a.shape == (1, 4, 1, 10)
        torch.testing.assert_close(a, b[:, :, -1:], atol=1e-12, rtol=0)


def test_encoder_need_weights_masks_padding_and_matches_the_plain_call(attention_calls):
    torch.manual_seed(0)
    enc = Encoder(_cfg(positional="alibi")).double().eval()
    idx = torch.randint(0, 29, (2, 6))
    pad = torch.arange(6) < torch.tensor([[6], [4]])  # (2, 6)
    h = enc(idx, padding_mask=pad)
    attention_calls.clear()
    h_w, weights = enc(idx, padding_mask=pad, need_weights=True)
    assert attention_calls == [True] * 3
    torch.testing.assert_close(h_w, h, atol=1e-12, rtol=0)
    assert len(weights) == 3 and weights[0].shape == (2, 4, 6, 6)
    for w in weights:
        assert (w[1, :, :, 4:] == 0).all()  # padded keys get no weight
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64))


def test_bert_need_weights_runs_each_attention_once(attention_calls):
    from attnlab.models.bert import BertConfig, BertEncoder

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=24,
        max_position_embeddings=16,
    )
    enc = BertEncoder(cfg).double().eval()
    ids = torch.randint(0, 30, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    plain = enc(ids, mask).last_hidden_state
    attention_calls.clear()
    out = enc(ids, mask, need_weights=True)
    assert attention_calls == [True, True]
    torch.testing.assert_close(out.last_hidden_state, plain, atol=1e-12, rtol=0)
    captured = module_attentions(enc, lambda: enc(ids[1:], mask[1:]))
    torch.testing.assert_close(captured, torch.stack([w[1] for w in out.attentions]))
    assert (captured[:, :, :, 3:] == 0).all()


def test_gradient_checkpointing_keeps_the_weights():
    model = _gpt(positional="learned").train()
    idx = torch.randint(0, 29, (1, 8), generator=torch.Generator().manual_seed(3))
    _, plain = model(idx, need_weights=True)
    model.gradient_checkpointing = True
    logits, ckpt = model(idx, need_weights=True)
    logits.sum().backward()
    for a, b in zip(ckpt, plain, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_gpt_and_bert_need_weights_compile_without_graph_breaks():
    dynamo.reset()
    try:
        model = _gpt(positional="learned", n_layers=1).float()
        idx = torch.randint(0, 29, (1, 5))
        e = dynamo.explain(lambda i: model(i, need_weights=True))(idx)
        assert e.graph_break_count == 0, [r.reason for r in e.break_reasons]
        # BertEncoder: its token-id range check (a host read) is skipped while compiling.
        from attnlab.models.bert import BertConfig, BertEncoder

        cfg = BertConfig(
            vocab_size=30,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=24,
            max_position_embeddings=16,
        )
        enc = BertEncoder(cfg).eval()
        mask = torch.tensor([[1, 1, 1, 0, 0]])
        e = dynamo.explain(lambda i, m: enc(i, m, need_weights=True).attentions)(idx, mask)
        assert e.graph_break_count == 0, [r.reason for r in e.break_reasons]
    finally:
        dynamo.reset()


# ------------------------------------------------------------------------- module_attentions


def test_module_attentions_equals_the_reference_and_runs_each_attention_once(attention_calls):
    model = _gpt(positional="learned")
    idx = torch.randint(0, 29, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(idx)
        want = _hand_gpt_weights(model, idx)
        attention_calls.clear()
        seen = []
        captured = module_attentions(model, lambda: seen.append(model(idx)))
    # One attention call per module per forward pass; none runs twice.
    assert attention_calls == [True] * 3
    assert captured.shape == (3, 4, 11, 11)
    for got, ref in zip(captured, want, strict=True):
        torch.testing.assert_close(got, ref[0], atol=1e-12, rtol=0)
    # The model's own output is what it is without the capture (a tensor, not a tuple).
    assert isinstance(seen[0], torch.Tensor)
    torch.testing.assert_close(seen[0], logits, atol=1e-12, rtol=0)
    # Equal to the model's own need_weights path.
    _, weights = model(idx, need_weights=True)
    torch.testing.assert_close(captured, torch.stack([w[0] for w in weights]), atol=0, rtol=0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_capture_gives_each_caller_what_it_asked_for():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).double().eval()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    plain = mha(x)
    with capture_attentions(mha) as captured:
        y = mha(x)
        y2, w2 = mha(x, need_weights=True)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, plain, atol=1e-12, rtol=0)
    torch.testing.assert_close(y2, plain, atol=1e-12, rtol=0)
    assert [n for n, _ in captured] == ["", ""]
    torch.testing.assert_close(captured[1][1], w2, atol=0, rtol=0)
    torch.testing.assert_close(captured[0][1], w2, atol=0, rtol=0)
    assert mha(x) is not None and len(captured) == 2  # hooks gone after the block


def test_refusals_as_before():
    with pytest.raises(ValueError, match="no attnlab MultiHeadAttention"):
        module_attentions(torch.nn.Linear(2, 2), lambda: None)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        module_attentions("gpt", lambda: None)  # type: ignore[arg-type]
    model = _gpt(positional="learned")
    with pytest.raises(ValueError, match=r"run\(\) did not call any attnlab MultiHeadAttention"):
        module_attentions(model, lambda: None)
    # A call with a KV cache is refused before it runs: the cache is left untouched.
    caches = model.new_caches(32)
    idx = torch.randint(0, 29, (1, 4))
    with pytest.raises(ValueError, match="cannot read weights from a call with a KV cache"):
        module_attentions(model, lambda: model(idx, caches=caches))
    assert all(c.seen == 0 for c in caches)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    model(idx, caches=caches)  # still usable, without hooks
    assert isinstance(caches[0], KVCache) and caches[0].seen == 4
