"""torch.compile / torch.export / meta for MultiHeadAttention, the KV caches and GPT (H16, #13).

Graph breaks are counted with `torch._dynamo.explain`, recompiles with a `CompileCounter`
backend; compiled forward+backward runs on ``aot_eager`` (AOTAutograd traces the backward, no
C++ build) and is compared with eager. Sizes are tiny: the file is about tracing. What users run,
Inductor, is tested in tests/test_inductor.py and tests/test_inductor_models.py.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter

from attnlab import masks
from attnlab.models import GPT, Encoder, TransformerConfig
from attnlab.modules import KVCache, MultiHeadAttention, SinkCache, SlidingWindowCache
from attnlab.positional import RoPE

E, H = 32, 4


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _mha(kind: str, dtype=torch.float32, backend: str = "sdpa") -> MultiHeadAttention:
    torch.manual_seed(0)
    kw: dict = {
        "self": {},
        "cross": {"kdim": 24, "vdim": 20},
        "gqa": {"num_kv_heads": 2},
        "rope": {"num_kv_heads": 2, "rope": RoPE(E // H)},
        "rope_dynamic": {
            "rope": RoPE(
                E // H,
                scaling={
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "original_max_position_embeddings": 4,
                },
            ),
        },
    }[kind]
    return MultiHeadAttention(E, H, backend=backend, **kw).to(dtype).eval()


def _inputs(kind: str, L: int = 7, S: int = 9, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, L, E, generator=g, dtype=dtype)
    if kind == "cross":
        return (
            x,
            torch.randn(2, S, 24, generator=g, dtype=dtype),
            torch.randn(2, S, 20, generator=g, dtype=dtype),
        )
    return (x,)


def _breaks(fn, *args, **kwargs) -> tuple[int, list[str]]:
    e = dynamo.explain(fn)(*args, **kwargs)
    return e.graph_break_count, [r.reason.splitlines()[0] for r in e.break_reasons]


# ---------------------------------------------------------------------------- graph breaks


@pytest.mark.parametrize("kind", ["self", "cross", "gqa", "rope", "rope_dynamic"])
def test_mha_forward_has_no_graph_break(kind):
    mha = _mha(kind)
    args = _inputs(kind)
    mask = None if kind == "cross" else masks.causal()
    n, why = _breaks(lambda *a: mha(*a, mask=mask), *args)
    assert n == 0, why


@pytest.mark.parametrize("kind", ["self", "rope", "rope_dynamic"])
@pytest.mark.parametrize("cache_cls", [KVCache, SlidingWindowCache, SinkCache])
def test_mha_decode_step_with_cache_has_no_graph_break(kind, cache_cls):
    mha = _mha(kind)
    cache = {KVCache: KVCache(), SlidingWindowCache: SlidingWindowCache(4)}.get(
        cache_cls, SinkCache(1, 4)
    )
    (x,) = _inputs(kind, L=6)
    mha(x[:, :5], mask=masks.causal(), cache=cache)  # eager prefill
    n, why = _breaks(lambda x, c: mha(x, mask=masks.causal(), cache=c), x[:, 5:], cache)
    assert n == 0, why


def _small_gpt(max_seq_len: int, positional: str) -> GPT:
    """A one-layer GQA GPT (seeded, eval mode) for the compile tests."""
    cfg = TransformerConfig(
        vocab_size=50,
        d_model=E,
        n_layers=1,
        n_heads=H,
        n_kv_heads=2,
        max_seq_len=max_seq_len,
        positional=positional,
    )
    torch.manual_seed(0)
    return GPT(cfg).eval()


@pytest.mark.parametrize("positional", ["rope", "learned", "alibi"])
def test_gpt_forward_and_cached_step_have_no_graph_break(positional):
    model = _small_gpt(32, positional)
    idx = torch.randint(0, 50, (2, 7))
    n, why = _breaks(model, idx)
    assert n == 0, why
    caches = model.new_caches(32)
    model(idx, caches=caches)
    n, why = _breaks(lambda i, c: model(i, caches=c), idx[:, :1], caches)
    assert n == 0, why


def test_encoder_forward_with_padding_has_no_graph_break():
    cfg = TransformerConfig(vocab_size=50, d_model=E, n_layers=1, n_heads=H, positional="rope")
    torch.manual_seed(0)
    enc = Encoder(cfg).eval()
    idx = torch.randint(0, 50, (2, 7))
    pad = torch.arange(7) < torch.tensor([[7], [4]])  # (2, 7)
    n, why = _breaks(lambda i, p: enc(i, padding_mask=p), idx, pad)
    assert n == 0, why


# ---------------------------------------------------------------------------- compiled = eager


@pytest.mark.parametrize("kind", ["self", "cross", "gqa", "rope", "rope_cache"])
def test_compiled_mha_forward_and_backward_equal_eager(kind):
    """Compiled forward + AOTAutograd backward equal eager (with a cache: one call on a cache
    holding 3 earlier tokens; gradients reach the new tokens and the projections)."""
    with_cache = kind == "rope_cache"
    mha = _mha("rope" if with_cache else kind, torch.float64)
    args = _inputs(kind, dtype=torch.float64)
    mask = None if kind == "cross" else masks.causal()
    g = torch.Generator().manual_seed(3)
    k0, v0 = (torch.randn(2, 2, 3, E // H, generator=g, dtype=torch.float64) for _ in range(2))

    def call(*a):
        if not with_cache:
            return mha(*a, mask=mask)
        cache = KVCache(16)
        cache.update(k0, v0)
        return mha(*a, mask=mask, cache=cache)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)

    def run(fn):
        xs = [a.detach().clone().requires_grad_(True) for a in args]
        mha.zero_grad()
        out = fn(*xs)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        grads = [x.grad for x in xs] + [p.grad.clone() for p in mha.parameters()]
        return out.detach(), grads

    out_c, grads_c = run(compiled)
    out_e, grads_e = run(call)
    torch.testing.assert_close(out_c, out_e, atol=1e-12, rtol=0)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, atol=1e-12, rtol=0)


@pytest.mark.parametrize("capacity", [80, None])
def test_compiled_decode_recompiles_only_in_the_first_steps(capacity):
    """A growing cache: the sequence length is dynamic after the first steps (no recompile per
    token); a preallocated cache needs one graph for the prefill and one for every later step."""
    mha = _mha("rope", torch.float64)
    x = torch.randn(1, 72, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    full = mha(x, mask=masks.causal())
    counter = CompileCounter()
    step = torch.compile(mha, backend=counter, fullgraph=True)
    cache = KVCache(capacity)
    outs = [step(x[:, :5], mask=masks.causal(), cache=cache)]
    frames = []  # frames[i]: compiled graphs after the step that brings the cache to 6 + i
    for t in range(5, 72):
        outs.append(step(x[:, t : t + 1], mask=masks.causal(), cache=cache))
        frames.append(counter.frame_count)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-12, rtol=0)
    if capacity is not None:
        assert frames[-1] == 2, frames  # the prefill graph and one decode graph
    else:
        # Recompiles while the buffer first fills and grows (16, then 32 slots), none from 40
        # cached tokens to 72, which crosses the growth to 64 and then 128 slots.
        assert frames[-1] == frames[34] <= 8, frames


def test_compiled_gpt_decoding_equals_eager_and_does_not_recompile_per_token():
    model = _small_gpt(40, "rope")
    idx = torch.randint(0, 50, (1, 12))
    full = model(idx)
    counter = CompileCounter()
    step = torch.compile(model, backend=counter, fullgraph=True)
    caches = model.new_caches(40)
    outs = [step(idx[:, :4], caches=caches)]
    for t in range(4, 12):
        outs.append(step(idx[:, t : t + 1], caches=caches))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 2, counter.frame_count


# ---------------------------------------------------------------------------- export, meta


def test_export_mha_self_attention_with_dynamic_length():
    mha = _mha("rope")
    (x,) = _inputs("rope")
    L = torch.export.Dim("L", min=2, max=128)
    ep = torch.export.export(mha, (x,), dynamic_shapes=({1: L},))
    y = torch.randn(2, 19, E)
    torch.testing.assert_close(ep.module()(y), mha(y), atol=1e-6, rtol=1e-6)


def test_export_mha_cross_attention_and_a_fixed_structured_mask():
    mha = _mha("cross")
    q, k, v = _inputs("cross")
    ep = torch.export.export(mha, (q, k, v))
    torch.testing.assert_close(ep.module()(q, k, v), mha(q, k, v), atol=1e-6, rtol=1e-6)

    class Causal(torch.nn.Module):  # a structured Mask is fixed in the module, not an input
        def __init__(self, inner: MultiHeadAttention) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, query: torch.Tensor) -> torch.Tensor:
            return self.inner(query, mask=masks.causal())

    self_mha = _mha("gqa")
    (x,) = _inputs("gqa")
    ep = torch.export.export(Causal(self_mha), (x,))
    want = self_mha(x, mask=masks.causal())
    torch.testing.assert_close(ep.module()(x), want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(want, self_mha(x))  # the mask was really applied


def test_export_gpt_forward():
    cfg = TransformerConfig(vocab_size=50, d_model=E, n_layers=2, n_heads=H, positional="rope")
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 50, (2, 7))
    ep = torch.export.export(model, (idx,))
    torch.testing.assert_close(ep.module()(idx), model(idx), atol=1e-6, rtol=1e-6)


def test_meta_tensors_give_the_output_shapes():
    mha = _mha("rope").to("meta")
    x = torch.empty(3, 11, E, device="meta")
    assert mha(x, mask=masks.causal()).shape == (3, 11, E)
    auto = _mha("rope", backend="auto").to("meta")  # weights come from the reference
    out, w = auto(x, mask=masks.causal(), need_weights=True)
    assert out.shape == (3, 11, E) and w.shape == (3, H, 11, 11) and w.is_meta
    cross = _mha("cross").to("meta")
    k, v = torch.empty(3, 5, 24, device="meta"), torch.empty(3, 5, 20, device="meta")
    assert cross(x, k, v).shape == (3, 11, E)
    cache = KVCache()
    mha(x, mask=masks.causal(), cache=cache)
    assert mha(x[:, :1], cache=cache).shape == (3, 1, E) and len(cache) == 12
    cfg = TransformerConfig(vocab_size=50, d_model=E, n_layers=2, n_heads=H, positional="learned")
    model = GPT(cfg).to("meta")
    logits = model(torch.zeros(2, 9, dtype=torch.long, device="meta"))
    assert logits.shape == (2, 9, 50) and logits.is_meta


def test_dynamic_true_traces_the_float_arguments_symbolically():
    """``torch.compile(dynamic=True)`` makes Python floats symbolic: the argument checks of
    `attention` (finite scale/temperature, dropout in [0, 1)) must not read them on the host."""
    mha = _mha("rope", backend="auto").eval()
    x = torch.randn(1, 9, E, generator=torch.Generator().manual_seed(3))
    counter = CompileCounter()
    step = torch.compile(mha, backend=counter, fullgraph=True, dynamic=True)
    cache, eager_cache = KVCache(16), KVCache(16)
    with torch.no_grad():
        got = [step(x[:, :5], mask=masks.causal(), cache=cache)]
        want = [mha(x[:, :5], mask=masks.causal(), cache=eager_cache)]
        for t in range(5, 9):
            got.append(step(x[:, t : t + 1], cache=cache))
            want.append(mha(x[:, t : t + 1], cache=eager_cache))
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-6, rtol=1e-6)
    assert counter.frame_count >= 1
