"""Windows in every layer and interleaved local/global layers (issue #43 item 4).

- `TransformerConfig`: ``sliding_window``, ``layer_types``, ``attention``, ``local_heads``
  checked on creation (each error names the field, the expected and the received value); the
  config round-trips through a checkpoint; `interleaved_layer_types` is Gemma 2/3's pattern.
- A windowed `GPT`, forward and backward on odd lengths, equals the same GPT run layer by layer
  with each layer's mask written out here by hand (causal band of W keys / causal) under the
  tolerance rule, on the auto and tiled backends.
- The same weights in transformers' ``MistralForCausalLM`` (a window in every layer) and
  ``MinistralForCausalLM`` (interleaved ``layer_types``) give the same logits and the same
  greedy tokens (their KV caches against attnlab's `SlidingWindowCache`).
- Decoding with caches equals the full forward; sliding layers keep W keys; full layers of an
  interleaved model keep the fused C++ decode step; compiled decoding traces in one graph (slow).
- Inductor (``torch.compile(fullgraph=True)``) on a windowed GPT, forward and backward (slow).
"""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.models import GPT, Encoder, TransformerConfig
from attnlab.models.config import interleaved_layer_types
from attnlab.modules import SlidingWindowCache
from attnlab.testing import assert_close_rule

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models gain nothing from threads

INTERLEAVED = ["sliding_attention", "full_attention", "sliding_attention"]


def small(**kw) -> TransformerConfig:
    base = {
        "vocab_size": 61,
        "d_model": 40,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 128,
        "sliding_window": 7,
        "layer_types": INTERLEAVED,
    }
    return TransformerConfig(**{**base, **kw})


# --------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"sliding_window": 0}, ValueError, r"sliding_window must be >= 1, got 0"),
        ({"sliding_window": 2.5}, TypeError, r"sliding_window must be an int, got float"),
        ({"layer_types": ["full_attention"]}, ValueError, r"n_layers=3 layers, got 1"),
        (
            {"layer_types": ["sliding_attention", "local", "full_attention"]},
            ValueError,
            r"layer_types\[1\] must be one of \['full_attention', 'sliding_attention'\], "
            r"got 'local'",
        ),
        ({"layer_types": "full_attention"}, TypeError, r"layer_types must be a list"),
        ({"sliding_window": None}, ValueError, r"'sliding_attention' layers but sliding_window"),
        ({"attention": "linear"}, ValueError, r"attention must be one of .*got 'linear'"),
        (
            {"attention": "local_global"},
            ValueError,
            r"local_global' puts local and global heads in every layer: layer_types must be None",
        ),
        (
            {"attention": "local_global", "layer_types": None, "local_heads": 1},
            ValueError,
            r"local_heads must be a multiple of n_heads / n_kv_heads = 2 in \[0, n_heads=4\], "
            r"got 1",
        ),
        (
            {"attention": "local_global", "layer_types": None, "sliding_window": None},
            ValueError,
            r"local_global' needs sliding_window",
        ),
        (
            {"attention": "local_global", "layer_types": None, "positional": "alibi"},
            ValueError,
            r"positional='alibi'",
        ),
        ({"local_heads": 2}, ValueError, r"local_heads=2 is for attention='local_global'"),
    ],
)
def test_config_refuses_bad_windows(kw, error, match):
    with pytest.raises(error, match=match):
        small(**kw)


def test_config_defaults_and_round_trip(tmp_path):
    mistral = small(layer_types=None)
    assert [mistral.layer_window(i) for i in range(3)] == [7, 7, 7]  # Mistral: every layer
    assert [small().layer_window(i) for i in range(3)] == [7, None, 7]
    assert [small(sliding_window=None, layer_types=None).layer_window(i) for i in range(3)] == [
        None
    ] * 3
    lg = small(attention="local_global", layer_types=None)
    assert lg.local_head_count == 2 and lg.layer_window(0) is None and lg.has_window
    assert small(attention="local_global", layer_types=None, n_kv_heads=1).local_head_count == 0
    for cfg in (small(), lg, small(layer_types=tuple(INTERLEAVED))):
        again = TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert again == cfg and again.layer_types == cfg.layer_types
    # a checkpoint written by `attnlab train`'s writer and read by its verifying loader
    from attnlab.apps import gpt_files
    from attnlab.apps.loop import save_model

    model = GPT(small()).eval()
    vocab = [chr(65 + i) for i in range(61)]
    path = save_model(
        tmp_path / "ckpt.safetensors",
        model,
        kind=gpt_files.KIND,
        config=model.config.to_dict(),
        extra={"vocab": json.dumps(vocab)},
    )
    loaded, _ = gpt_files.load(path)
    assert loaded.config == model.config
    assert [b.window for b in loaded.blocks] == [7, None, 7]


def test_interleaved_layer_types_is_gemmas_pattern():
    transformers = pytest.importorskip("transformers")
    assert (
        interleaved_layer_types(4, 1) == transformers.Gemma2Config(num_hidden_layers=4).layer_types
    )
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=12, sliding_window_pattern=6)
    assert interleaved_layer_types(12, 5) == gemma3.layer_types
    assert interleaved_layer_types(3, 0) == ["full_attention"] * 3


def test_encoder_refuses_windows():
    with pytest.raises(ValueError, match=r"Encoder is bidirectional: .*sliding_window=7"):
        Encoder(small())


# --------------------------------------------------------------------------- the windowed GPT
def hand_masked_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The GPT's logits with each layer's mask written out: key j is visible from query i iff
    ``j <= i`` and, in a sliding layer of window W, ``i − j < W`` (Mistral's convention)."""
    L = idx.shape[1]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    x = model._embed(idx, 0)  # (B, L, E)
    for block in model.blocks:
        W = block.window
        keep = (j <= i) & (i - j < W) if W is not None else j <= i  # (L, S)
        block.window = None  # the block's own window off: the hand-written mask alone
        try:
            x = block(x, mask=keep)
        finally:
            block.window = W
    return model.lm_head(model.norm_f(x))  # (B, L, V)


def _run(fn, model, idx, dout):
    model.zero_grad()
    out = fn(model, idx)
    out.backward(dout.to(out.dtype))
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.detach(), grads


@pytest.mark.parametrize("backend", ["auto", "flash"])
@pytest.mark.parametrize("L", [17, 97])
def test_windowed_gpt_equals_hand_written_masks(backend, L):
    torch.manual_seed(0)
    model = GPT(small(attn_backend=backend))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    gold = GPT(small(attn_backend="reference")).double()
    gold.load_state_dict(model.state_dict())
    idx = torch.randint(0, 61, (2, L), generator=torch.Generator().manual_seed(L))
    dout = torch.randn(2, L, 61, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    impl = _run(lambda m, x: m(x), model, idx, dout)
    golden = _run(hand_masked_logits, gold, idx, dout)
    naive = _run(hand_masked_logits, model, idx, dout)
    assert_close_rule(impl[0], golden[0], naive[0], name="logits", mean_factor=10.0)
    assert_close_rule(impl[1], golden[1], naive[1], kind="grad", name="grads", mean_factor=10.0)
    # the window matters: the full-attention GPT with the same weights differs
    full = GPT(small(sliding_window=None, layer_types=None)).double()
    full.load_state_dict(gold.state_dict())
    with torch.no_grad():
        assert (full(idx) - golden[0]).abs().max() > 1e-3


def test_sliding_layers_reach_the_band_kernel():
    """The mask a sliding layer attends with is a band: auto sends it to the tiled backend's
    band plan once L·S passes the band threshold (here L = S = 300); with packed documents
    (``GPT(idx, mask=masks.document(ids))``) from auto's threshold for structured masks."""
    import attnlab
    from attnlab import masks
    from attnlab.models.blocks import windowed

    q = torch.randn(1, 4, 300, 16)
    e = attnlab.explain(q, q, q, mask=windowed(masks.causal(), 7))
    assert e.backend == "flash" and "band plan" in str(e), str(e)
    q = torch.randn(1, 4, 600, 16)
    docs = masks.causal() & masks.document.from_lengths([250, 350])
    assert attnlab.explain(q, q, q, mask=windowed(docs, 7)).backend == "flash"


@pytest.mark.parametrize(
    "kw",
    [{}, {"layer_types": None}, {"attention": "local_global", "layer_types": None}],
    ids=["interleaved", "every-layer", "local-global"],
)
def test_decode_with_caches_equals_the_full_forward(kw):
    torch.manual_seed(1)
    model = GPT(small(**kw)).eval()
    idx = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)  # (2, 30, V)
        caches = model.new_caches(64)
        steps = [model(idx[:, :5], caches=caches)]
        steps += [model(idx[:, t : t + 1], caches=caches) for t in range(5, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)
    for block, cache in zip(model.blocks, caches, strict=True):
        if block.window is not None:  # a sliding layer keeps its last W keys only
            assert isinstance(cache, SlidingWindowCache) and len(cache) == block.window
        else:
            assert len(cache) == 30
    a = model.generate(idx[:, :3], 40, top_k=1)
    b = model.generate(idx[:, :3], 40, top_k=1, use_cache=False)
    assert torch.equal(a, b)


def test_generate_runs_full_layers_fused_and_sliding_layers_as_modules(monkeypatch):
    """In an interleaved model the full layers keep the one-call C++ decode step and the
    sliding layers (whose kernel would see every key) run their modules: the same tokens as
    the modules alone (``ATTNLAB_BLOCK_STEP=off``)."""
    from attnlab import _ext
    from attnlab.models import fused_step

    if _ext.mode() == "off" or not all(_ext.load(n) for n in ("nan_rule", "gemv", "block_step")):
        pytest.skip("C++ extension unavailable")
    torch.manual_seed(7)
    cfg = small(norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, sliding_window=4)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 2 else 1.0)
    ran = []
    real = fused_step.StepPlan.run

    def spy(self, x, cache):
        y = real(self, x, cache)
        ran.append(y is not None)
        return y

    monkeypatch.setattr(fused_step.StepPlan, "run", spy)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(8))
    fused = model.generate(prompt, 12, top_k=1)
    assert ran == [True] * 11  # the one full layer, at each of the 11 decode steps
    monkeypatch.setenv(fused_step.ENV, "off")
    assert torch.equal(fused, model.generate(prompt, 12, top_k=1))
    assert len(ran) == 11


@pytest.mark.slow  # 15-60 s of Dynamo tracing (a few recompiles while the caches grow)
@pytest.mark.parametrize(
    "kw", [{}, {"attention": "local_global", "layer_types": None}], ids=["interleaved", "lg"]
)
def test_compiled_decoding_traces_in_one_graph(kw, fresh_dynamo):
    """``torch.compile(model, fullgraph=True)`` decodes with sliding caches without a graph
    break (Dynamo's graphs run eagerly here; the Inductor build is the slow test below)."""
    torch.manual_seed(9)
    model = GPT(small(**kw)).eval()
    step = torch.compile(model, fullgraph=True, backend="eager")
    idx = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        caches = model.new_caches(20)
        outs = [step(idx[:, :6], caches=caches)]
        outs += [step(idx[:, t : t + 1], caches=caches) for t in range(6, 20)]
        torch.testing.assert_close(torch.cat(outs, 1), model(idx), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- transformers
def to_hf(model: GPT, cls_name: str):
    """``transformers.<cls_name>`` (Mistral / Ministral) holding ``model``'s weights, eager."""
    transformers = pytest.importorskip("transformers")
    cfg = model.config
    H, H_kv, D = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.head_dim
    kw = {} if cls_name.startswith("Mistral") else {"layer_types": cfg.layer_types}
    config = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=H,
        num_key_value_heads=H_kv,
        head_dim=D,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_base,
        sliding_window=cfg.sliding_window,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
        **kw,
    )
    hf = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.tok_emb.weight)
        for block, layer in zip(model.blocks, hf.model.layers, strict=True):
            q, k, v = block.attn.qkv_proj.weight.split([H * D, H_kv * D, H_kv * D])
            a = layer.self_attn
            a.q_proj.weight.copy_(q)
            a.k_proj.weight.copy_(k)
            a.v_proj.weight.copy_(v)
            a.o_proj.weight.copy_(block.attn.out_proj.weight)
            layer.input_layernorm.weight.copy_(block.norm1.weight)
            layer.post_attention_layernorm.weight.copy_(block.norm2.weight)
            layer.mlp.gate_proj.weight.copy_(block.mlp.gate.weight)
            layer.mlp.up_proj.weight.copy_(block.mlp.up.weight)
            layer.mlp.down_proj.weight.copy_(block.mlp.down.weight)
        hf.model.norm.weight.copy_(model.norm_f.weight)
        hf.lm_head.weight.copy_(model.lm_head.weight)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.mark.parametrize(
    "cls_name,layer_types",
    [("MistralForCausalLM", None), ("MinistralForCausalLM", INTERLEAVED)],
)
def test_same_logits_and_greedy_tokens_as_transformers(cls_name, layer_types):
    cfg = small(
        layer_types=layer_types,
        sliding_window=5,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_embeddings=False,
        d_ff=48,
    )
    torch.manual_seed(3)
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    hf = to_hf(model, cls_name)
    idx = torch.randint(0, 61, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(input_ids=idx).logits, atol=1e-5, rtol=1e-5)
        full = GPT(small(**{**cfg.to_dict(), "sliding_window": None, "layer_types": None}))
        full.load_state_dict(model.state_dict())
        assert (full.eval()(idx) - hf(input_ids=idx).logits).abs().max() > 1e-3
    prompt = idx[:, :4]
    ours = model.generate(prompt, 24, top_k=1)
    theirs = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
    )
    assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------- Inductor
@pytest.mark.slow  # ~3 min of Inductor builds on 2 cores; the default run compiles the
# local/global attention of tests/test_local_global.py (band and full calls)
def test_windowed_gpt_compiles_fullgraph_with_inductor(fresh_dynamo):
    torch.manual_seed(5)
    model = GPT(small(n_layers=2, layer_types=["sliding_attention", "full_attention"]))
    idx = torch.randint(0, 61, (2, 33), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(model, fullgraph=True)  # Inductor; raises on a graph break
    got = compiled(idx)
    got.square().mean().backward()
    got_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model(idx)
    want.square().mean().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- attnlab train
def test_train_flags_build_the_windowed_gpt(tmp_path, capsys):
    from attnlab.apps import gpt_files
    from attnlab.apps.gpt import TrainSettings
    from helpers import run_cli

    small_run = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16"]
    small_run += ["--n-layers", "2", "--eval-interval", "2", "--eval-batches", "1", "--quiet"]
    argv = ["train", *small_run, "--sliding-window", "4", "--local-per-global", "1"]
    code, _, err = run_cli([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    model, _ = gpt_files.load(tmp_path / "run" / "ckpt.safetensors")
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert [b.window for b in model.blocks] == [4, None]
    lg = TrainSettings(sliding_window=4, attention="local_global").model_config(50)
    assert lg.attention == "local_global" and lg.sliding_window == 4 and lg.layer_types is None
    for bad, flag in (
        (["--local-per-global", "1"], "--local-per-global: needs --sliding-window W"),
        (["--attention", "local_global"], "--attention: needs --sliding-window W"),
        (["--sliding-window", "0"], "--sliding-window"),
    ):
        code, _, err = run_cli(["train", *small_run, *bad, "--out", str(tmp_path / "x")], capsys)
        assert code == 2 and flag in err, err
