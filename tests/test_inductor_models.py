"""Models and external systems under Inductor, torch.compile's default compiler (issue #37, 1).

Every test compiles with the default backend (Inductor: C++ kernels), ``fullgraph=True`` where
the path claims one graph, runs forward and backward, and compares with eager under the
project's tolerance rule (`attnlab.testing.assert_close_rule`): the golden value is the same
module in float64, eager; the naive value is the eager float32 run (for Hugging Face models
also ``attn_implementation="sdpa"``); the compiled float32 run may miss golden by at most
2× (forward) / 3× (gradients) the naive error plus the rounding floor, and must pass the fixed
float32 table. Graph counts come from ``torch._dynamo.utils.counters`` (Inductor still compiles).

The default run holds a representative slice (one GPT training step, a Hugging Face Llama
forward + backward against eager and sdpa: ~28 s with a cold Inductor cache on 2 cores); every
other path is under ``-m slow``. Sizes are tiny: the time is Inductor's
C++ build (tens of seconds with a cold cache).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import masks
from attnlab.models import GPT, TransformerConfig
from attnlab.testing import assert_close_rule, seeded

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _run(module, fn, inputs, dout_seed: int = 7):
    """``fn(module, *inputs)`` forward and backward (a fixed seeded ``dout``): the output and
    the gradients of the floating inputs and of every parameter (zeros where none flowed)."""
    xs = [x.detach().clone().requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    module.zero_grad(set_to_none=True)
    out = fn(module, *xs)
    out.backward(seeded(*out.shape, seed=dout_seed).to(out.dtype))
    grads = [x.grad for x in xs if x.is_floating_point()]
    grads += [
        torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for p in module.parameters()
        if p.requires_grad
    ]
    return out.detach(), grads


def check_compiled(module, fn, inputs, *, compiled=None, backward: bool = True):
    """``fn(module, *inputs)`` compiled by Inductor (``fullgraph=True``; or the given
    ``compiled(*inputs)``) against eager float32 (naive) and float64 (golden) under the rule;
    returns the compiled output."""
    golden_m = copy.deepcopy(module).double()
    if compiled is None:
        compiled = torch.compile(lambda *a: fn(module, *a), fullgraph=True)
    if not backward:
        with torch.no_grad():
            got = compiled(*inputs)
            naive = fn(module, *inputs)
            golden = fn(golden_m, *[_f64(x) for x in inputs])
        assert_close_rule(got, golden, naive)
        return got
    got, g_got = _run(module, lambda m, *a: compiled(*a), inputs)
    naive, g_naive = _run(module, fn, inputs)
    golden, g_golden = _run(golden_m, fn, [_f64(x) for x in inputs])
    assert_close_rule(got, golden, naive)
    assert len(g_got) == len(g_golden)
    for i, (a, b, c) in enumerate(zip(g_got, g_golden, g_naive, strict=True)):
        assert_close_rule(a, b, c, kind="grad", name=f"grad[{i}]")
    assert any(bool(g.abs().sum() > 0) for g in g_got)  # gradients really flowed
    return got


# ------------------------------------------------------------------------------------- GPT


def _gpt(positional: str = "rope", backend: str = "auto", n_layers: int = 1, **kw) -> GPT:
    cfg = TransformerConfig(
        vocab_size=50,
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=40,
        positional=positional,
        attn_backend=backend,
        tie_embeddings=False,
        **kw,
    )
    torch.manual_seed(0)
    return GPT(cfg)


def _gpt_training_step(positional: str, backend: str, n_layers: int = 1) -> None:
    """One training step (forward, cross-entropy, backward, AdamW) through
    ``torch.compile(model, fullgraph=True)``: the loss and every gradient follow the rule
    against eager; after the AdamW step the second compiled loss equals eager's (the graph
    reads the updated parameters) without a recompile."""
    model = _gpt(positional, backend, n_layers).train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50, (2, 12), generator=g)
    tgt = torch.randint(0, 50, (2, 12), generator=g)

    def loss_of(m, ids):
        logits = m(ids)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())

    twin = copy.deepcopy(model)  # the eager run's own parameters and optimizer
    compiled = torch.compile(model, fullgraph=True)
    check_compiled(model, lambda m, ids: m(ids), [idx], compiled=compiled)
    assert _graphs() == 1
    losses = []
    for m, call in ((model, compiled), (twin, twin)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(call, idx)
            loss.backward()
            opt.step()
        losses.append(loss_of(call, idx).detach())
    # (a stale graph would miss by what the steps gained: ~0.6 here)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert losses[1] < loss_of(_gpt(positional, backend, n_layers).train(), idx)  # trained
    assert _graphs() == 1  # the steps reused the one graph (updated parameters are inputs)


@pytest.mark.parametrize("positional,backend", [("rope", "auto")])
def test_gpt_training_step_compiled_equals_eager(positional, backend):
    _gpt_training_step(positional, backend)


@pytest.mark.slow
@pytest.mark.parametrize(
    "positional,backend",
    [("rope", "flash"), ("rope", "sdpa"), ("alibi", "auto"), ("learned", "flash")],
)
def test_gpt_training_step_compiled_equals_eager_more(positional, backend):
    _gpt_training_step(positional, backend, n_layers=2)


@pytest.mark.slow
def test_compiled_gpt_decoding_gives_generate_tokens_with_two_graphs():
    """Greedy decoding through ``torch.compile(model, fullgraph=True)`` with preallocated
    caches (GPT's documented recipe) gives `generate`'s tokens (eager, fused C++ steps), with
    one graph for the prefill and one for all later tokens."""
    model = _gpt(n_layers=2).eval()
    with torch.no_grad():  # sharper logits than the init: varied tokens, no near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    idx = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    want = model.generate(idx, 20, top_k=1)
    step = torch.compile(model, fullgraph=True)
    out = idx
    with torch.no_grad():
        caches = model.new_caches(25)
        logits = step(idx, caches=caches)[:, -1]
        for t in range(20):
            nxt = logits.argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], 1)
            if t < 19:
                logits = step(nxt, caches=caches)[:, -1]
    assert torch.equal(out, want)
    assert len(set(want[0, 5:].tolist())) > 2  # not a fixed point
    assert _graphs() == 2


# ------------------------------------------------------------------- Seq2Seq, ViT


@pytest.mark.slow
@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
def test_seq2seq_forward_backward_compiled(positional):
    from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer

    torch.manual_seed(0)
    cfg = Seq2SeqConfig(
        src_vocab_size=13,
        tgt_vocab_size=13,
        d_model=32,
        n_heads=4,
        enc_layers=1,
        dec_layers=1,
        positional=positional,
    )
    model = Seq2SeqTransformer(cfg)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, 13, (3, 9), generator=g)
    src_mask = torch.arange(9)[None] < torch.tensor([[9], [5], [2]])  # padded sources
    tgt = torch.randint(3, 13, (3, 6), generator=g)
    check_compiled(model, lambda m, s, sm, t: m(s, sm, t), [src, src_mask, tgt])
    assert _graphs() == 1


@pytest.mark.slow
@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_vit_forward_backward_compiled(positional):
    from attnlab.models.vit import VisionTransformer, ViTConfig

    torch.manual_seed(0)
    model = VisionTransformer(
        ViTConfig(positional=positional, d_model=16, n_layers=2, n_heads=2, dropout=0.0)
    )
    c, s = model.config.channels, model.config.image_size
    x = seeded(2, c, s, s, seed=3).float()
    check_compiled(model, lambda m, im: m(im), [x])
    assert _graphs() == 1


# ------------------------------------------------------------------- Hugging Face Llama


def _llama(impl: str, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    import attnlab.hf

    if attnlab.hf.bridge._version_tuple(transformers.__version__) < attnlab.hf.MIN_TRANSFORMERS:
        pytest.skip("attnlab.hf needs transformers>=5.4")
    attnlab.hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl)
    with torch.no_grad():  # larger weights than the init: logits that vary
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    return model.to(dtype).eval()


IDS = torch.tensor([[5, 17, 33, 8, 41, 44, 12, 60], [0, 0, 23, 7, 9, 38, 50, 14]])  # left-padded
MASKS = {"padded": (IDS != 0).long(), "all_ones": torch.ones_like(IDS)}


def _llama_fwd_bwd(model, call, mask):
    """Logits at the real positions and every parameter's gradient of a fixed loss on them."""
    model.zero_grad(set_to_none=True)
    logits = call(input_ids=IDS, attention_mask=mask).logits  # (B, L, V)
    real = mask.bool()
    dout = seeded(*logits.shape, seed=5).to(logits.dtype) * real[..., None]
    logits.backward(dout)
    grads = [p.grad.clone() for p in model.parameters()]
    return logits.detach()[real], grads


def test_hf_llama_attnlab_compiled_forward_backward_equals_eager_and_sdpa():
    """A random `LlamaForCausalLM` with ``attn_implementation="attnlab"`` under
    ``torch.compile(fullgraph=True)``: logits and every gradient follow the rule against eager
    attnlab (float64, golden) and HF's own ``sdpa`` in float32 (naive), for a left-padded batch
    and an all-ones 2-D mask, in one graph (the mask's values do not recompile)."""
    model = _llama("attnlab")
    sdpa = _llama("sdpa")
    sdpa.load_state_dict(model.state_dict())
    golden_m = copy.deepcopy(model).double()
    compiled = torch.compile(model, fullgraph=True)
    for mask in MASKS.values():
        got, g_got = _llama_fwd_bwd(model, compiled, mask)
        eager, g_eager = _llama_fwd_bwd(model, model, mask)
        naive, g_naive = _llama_fwd_bwd(sdpa, sdpa, mask)
        golden, g_golden = _llama_fwd_bwd(golden_m, golden_m, mask)
        for impl, grads in ((got, g_got), (eager, g_eager)):
            assert_close_rule(impl, golden, naive)
            for i, (a, b, c) in enumerate(zip(grads, g_golden, g_naive, strict=True)):
                assert_close_rule(a, b, c, kind="grad", name=f"grad[{i}]")
    assert _graphs() == 1


@pytest.mark.slow
def test_hf_llama_sdpa_compiled_equals_attnlab_compiled():
    """The same model with HF's ``sdpa`` compiled too: both compiled runs follow the rule."""
    model, sdpa = _llama("attnlab"), _llama("sdpa")
    sdpa.load_state_dict(model.state_dict())
    golden_m = copy.deepcopy(model).double()
    c_model = torch.compile(model, fullgraph=True)
    c_sdpa = torch.compile(sdpa, fullgraph=True)
    mask = MASKS["padded"]
    got, g_got = _llama_fwd_bwd(model, c_model, mask)
    naive, g_naive = _llama_fwd_bwd(sdpa, c_sdpa, mask)
    golden, g_golden = _llama_fwd_bwd(golden_m, golden_m, mask)
    assert_close_rule(got, golden, naive)
    for i, (a, b, c) in enumerate(zip(g_got, g_golden, g_naive, strict=True)):
        assert_close_rule(a, b, c, kind="grad", name=f"grad[{i}]")


@pytest.mark.slow
@pytest.mark.parametrize("mask_kind", ["padded", "all_ones"])
def test_hf_llama_generate_static_cache_compiled(mask_kind):
    """``generate`` with ``cache_implementation="static"`` and a `CompileConfig`
    (``fullgraph=True``, Inductor, forced on CPU): the same greedy tokens as eager attnlab and
    eager sdpa, logits by the rule, and one graph for every decoding step."""
    from transformers import CompileConfig

    mask = MASKS[mask_kind]
    model, sdpa = _llama("attnlab"), _llama("sdpa")
    sdpa.load_state_dict(model.state_dict())
    golden_m = copy.deepcopy(model).double()
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise

    def generate(m, **kw):
        out = m.generate(
            IDS,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            cache_implementation="static",
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
        return out.sequences, torch.stack(out.logits, 1)  # (B, P + N), (B, N, V)

    tokens, logits = generate(model, compile_config=config)
    assert _graphs() == 1
    want_tokens, naive = generate(sdpa)
    eager_tokens, _ = generate(model)
    _, golden = generate(golden_m)
    assert torch.equal(tokens, want_tokens) and torch.equal(tokens, eager_tokens)
    assert len(set(tokens[0, 8:].tolist())) > 3  # not a fixed point
    assert_close_rule(logits, golden, naive)


# ------------------------------------------------------------------- export + AOTInductor


@pytest.mark.slow
@pytest.mark.parametrize(
    "positional,backend,dynamic",
    [("rope", "auto", False), ("rope", "flash", False), ("alibi", "auto", True)],
)
def test_export_gpt_then_aot_inductor_equals_eager(positional, backend, dynamic, tmp_path):
    """`torch.export` of a GPT forward, packaged by AOTInductor and loaded back, equals eager;
    with a dynamic length the one package serves other lengths. Flash passes a spec without
    tensors (AOTInductor once received None for the empty Tensor[]); a dynamic length once hit
    a guard on L // 16 (the NaN rule's block sums) and a ``SymInt`` refused as a mask length."""
    model = _gpt(positional, backend, n_layers=2).eval()
    idx = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    shapes = ({1: torch.export.Dim("L", min=2, max=40)},) if dynamic else None
    ep = torch.export.export(model, (idx,), dynamic_shapes=shapes)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "gpt.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    lengths = (7, 19, 33) if dynamic else (7,)
    golden_m = copy.deepcopy(model).double()
    with torch.no_grad():
        for L in lengths:
            x = torch.randint(0, 50, (2, L), generator=torch.Generator().manual_seed(L))
            assert_close_rule(runner(x), golden_m(x), model(x))


# ------------------------------------------------------------------- MHA with KV caches


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["fixed", "growing", "sliding", "sink"])
def test_compiled_mha_decode_loop_equals_eager(cache):
    """`MultiHeadAttention` (GQA, RoPE) decoding token by token through a compiled module:
    equal to the eager loop on its own cache; graphs stop growing (no recompile per token)."""
    from attnlab.modules import KVCache, MultiHeadAttention, SinkCache, SlidingWindowCache
    from attnlab.positional import RoPE

    make = {
        "fixed": lambda: KVCache(48),
        "growing": lambda: KVCache(),
        "sliding": lambda: SlidingWindowCache(8),
        "sink": lambda: SinkCache(2, 8),
    }[cache]
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, rope=RoPE(8)).eval()
    x = seeded(1, 44, 32, seed=2).float()
    step = torch.compile(mha, fullgraph=True)
    ce, cc = make(), make()
    graphs = []
    with torch.no_grad():
        want = [mha(x[:, :5], mask=masks.causal(), cache=ce)]
        got = [step(x[:, :5], mask=masks.causal(), cache=cc)]
        for t in range(5, 44):
            want.append(mha(x[:, t : t + 1], mask=masks.causal(), cache=ce))
            got.append(step(x[:, t : t + 1], mask=masks.causal(), cache=cc))
            graphs.append(_graphs())
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=1e-5, atol=1e-6)
    if cache != "growing":  # (a growing buffer recompiles when it doubles: 16, 32, 64 slots)
        assert graphs[-1] == graphs[-14], graphs  # the last 13 tokens compiled nothing
    assert graphs[-1] <= (2 if cache == "fixed" else 8), graphs  # not one per token (39)


# ------------------------------------------------------- the nn.MultiheadAttention drop-in

DROPIN_N, DROPIN_L, DROPIN_S, DROPIN_E = 2, 5, 7, 16


def _dropin_masks() -> dict[str, dict]:
    g = torch.Generator().manual_seed(2)
    N, L, S = DROPIN_N, DROPIN_L, DROPIN_S
    kpm = torch.rand(N, S, generator=g) > 0.6
    kpm[:, 0] = False  # no empty rows: torch's module (and the float64 golden) agree there
    am = torch.rand(L, S, generator=g) > 0.7
    am[:, 0] = False
    return {
        "kpm_bool": {"key_padding_mask": kpm},
        "kpm_float": {"key_padding_mask": torch.zeros(N, S).masked_fill(kpm, -1e9)},
        "am_bool": {"attn_mask": am},
        "am_float": {"attn_mask": seeded(L, S, seed=3).float()},
        "am3_float+kpm": {
            "attn_mask": seeded(N * 4, L, S, seed=4).float(),
            "key_padding_mask": kpm,
        },
        "is_causal": {"attn_mask": torch.ones(L, S, dtype=torch.bool).triu(1), "is_causal": True},
    }


def _dropin(dialect: str, need_weights: bool):
    from attnlab.nn import MultiheadAttention

    torch.manual_seed(0)
    mha = MultiheadAttention(DROPIN_E, 4, batch_first=True)
    kw = _dropin_masks()[dialect]
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(DROPIN_N, n, DROPIN_E, generator=g) for n in (DROPIN_L, DROPIN_S, DROPIN_S)
    )

    def fn(m, q, k, v):
        mk = {n: _f64(t) if q.dtype == torch.float64 else t for n, t in kw.items()}
        return m(q, k, v, need_weights=need_weights, **mk)[0]

    check_compiled(mha, fn, [q, k, v])


@pytest.mark.slow
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize(
    "dialect", ["kpm_bool", "kpm_float", "am_bool", "am_float", "am3_float+kpm", "is_causal"]
)
def test_dropin_multihead_attention_compiled_every_dialect(dialect, need_weights):
    _dropin(dialect, need_weights)


# ------------------------------------------------------------------- linear, FAVOR+, span, Shaw


class _Wrap(torch.nn.Module):
    """A parameter-free holder so `check_compiled` can cast a functional call to float64."""

    def __init__(self, **buffers):
        super().__init__()
        for name, t in buffers.items():
            self.register_buffer(name, t)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["linear", "favor", "favor+padding"])
def test_linear_and_favor_attention_compiled(kind, causal):
    from attnlab.functional.linear import linear_attention
    from attnlab.functional.performer import favor_attention, favor_projection

    q, k, v = (seeded(1, 2, 40, 8, seed=s).float() for s in (1, 2, 3))
    mask = masks.causal() if causal else None
    if kind.endswith("padding"):
        mask = masks.padding([30]) if mask is None else mask & masks.padding([30])
    w = favor_projection(16, 8, generator=torch.Generator().manual_seed(0))
    holder = _Wrap(w=w)

    def fn(m, q, k, v):
        if kind == "linear":
            return linear_attention(q, k, v, mask=mask)
        return favor_attention(q, k, v, num_features=16, projection=m.w, chunk_size=8, mask=mask)

    check_compiled(holder, fn, [q, k, v])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_adaptive_span_compiled(backend):
    """`AdaptiveSpanAttention`: the span parameter z gets its gradient through the compiled
    graph. (backend="flash" is refused under compile: flash computes no gradient for the span's
    bias tensor there, the documented limit.)"""
    from attnlab.modules.adaptive_span import AdaptiveSpanAttention

    torch.manual_seed(0)
    attn = AdaptiveSpanAttention(16, 2, 32, ramp=4.0, init_span=5.5, backend=backend)
    attn.span.z.data = torch.tensor([2.5, 9.25])
    attn.span.refresh_span()
    x = seeded(2, 13, 16, seed=4).float()
    check_compiled(attn, lambda m, x: m(x), [x])


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_shaw_relative_attention_compiled(causal):
    from attnlab.modules.shaw import ShawRelativeAttention

    torch.manual_seed(0)
    mha = ShawRelativeAttention(16, 2, max_distance=2, num_kv_heads=1)
    x = seeded(2, 7, 16, seed=5).float()
    check_compiled(mha, lambda m, x: m(x, mask=masks.causal() if causal else None), [x])
