"""End to end against the libraries users compare with (issue 19 item 6), on small inputs.

- MiniLM ``encode`` in bfloat16 (``minilm().to(torch.bfloat16)``) stays within cosine 0.999 of
  sentence-transformers' float32 embeddings, sentence by sentence (the real all-MiniLM-L6-v2).
- `GPT.generate` (greedy, KV caches) gives exactly the tokens of transformers'
  ``LlamaForCausalLM.generate`` (sdpa) holding the same weights (``to_llama`` of
  benchmarks/bench_generate_hf.py, which the benchmark times), on a tiny config.
- `GPT.generate` computes the head on the last position only: its logits are the forward's.

The throughput comparisons are benchmarks/bench_minilm.py and benchmarks/bench_generate_hf.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from attnlab.models import GPT, TransformerConfig

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

SENTENCES = [
    "A man is playing a guitar on the street.",
    "The quick brown fox jumps over the lazy dog while the farmer watches.",
    "Attention weights show which tokens a head reads.",
    "Un chat est assis sur le tapis.",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading.",
    "Why?",
]


def bench_module(name: str):
    """A module of benchmarks/ (which import their sibling ``common``), loaded by path."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_minilm_bf16_encode_is_within_cosine_0999_of_sentence_transformers_fp32():
    st = pytest.importorskip("sentence_transformers")
    from attnlab.models.minilm import minilm, model_path

    ref = st.SentenceTransformer(str(model_path()), device="cpu").encode(
        SENTENCES, batch_size=4, convert_to_tensor=True
    )  # (N, 384) float32
    model = minilm().to(torch.bfloat16)
    e = model.encode(SENTENCES, batch_size=4)
    assert e.dtype == torch.bfloat16 and e.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(e.float(), ref)  # (N,)
    assert (cos >= 0.999).all(), cos
    # bf16 really ran: not bit-equal to the float32 embeddings (which are within 1e-5)
    assert not torch.equal(e.float(), ref)


@pytest.fixture(scope="module")
def tiny_llama_pair():
    pytest.importorskip("transformers")
    bench = bench_module("bench_generate_hf")
    cfg = bench.llama_like(
        vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64
    )
    model = bench.random_gpt(cfg, head_std=1.0, seed=0)
    return bench, model, bench.to_llama(model)


def test_to_llama_gives_the_same_logits(tiny_llama_pair):
    _, model, hf = tiny_llama_pair
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_greedy_generate_gives_llama_generate_tokens(tiny_llama_pair):
    bench, model, hf = tiny_llama_pair
    prompt = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(2))
    ours = bench.attnlab_generate(model, prompt, 40)
    theirs = bench.hf_generate(hf, prompt, 40)
    assert ours.shape == theirs.shape == (3, 47)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 7:].flatten().tolist())) > 5  # not one repeated token


def test_to_llama_refuses_a_config_llama_cannot_express():
    pytest.importorskip("transformers")
    bench = bench_module("bench_generate_hf")
    with pytest.raises(ValueError, match=r"this config has \{'norm': 'layernorm'"):
        bench.llama_config(TransformerConfig(vocab_size=10, d_model=8, n_heads=2))


@pytest.mark.parametrize("positional", ["rope", "learned"])
def test_generate_uses_the_forward_logits_of_the_last_position(positional):
    """The head runs on the last position only; the next token is the forward's argmax, and
    prompts of any integer dtype give int64 sequences that start with the prompt."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=50,
        d_model=16,
        n_layers=2,
        n_heads=4,
        max_seq_len=40,
        positional=positional,
        tie_embeddings=False,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)  # clear top-2 margins: argmax is well defined
    prompt = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        full = model(prompt)[:, -1]  # (B, V)
        last = model._next_logits(prompt, None)
    torch.testing.assert_close(last, full, rtol=1e-6, atol=1e-6)
    out = model.generate(prompt.to(torch.int32), 30, top_k=1)
    assert out.dtype == torch.long and torch.equal(out[:, :6], prompt)
    assert torch.equal(out[:, 6], full.argmax(-1))
    # every token is the argmax of the uncached forward over its own context (sequence fits)
    with torch.no_grad():
        logits = model(out[:, :-1])  # (B, 35, V)
    assert torch.equal(out[:, 6:], logits[:, 5:].argmax(-1))


def test_generate_runs_in_inference_mode_but_returns_an_ordinary_tensor():
    """`generate` decodes under ``torch.inference_mode``; what it returns and what it leaves in
    the model (RoPE's table memo) still work with autograd afterwards."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_seq_len=24)
    model = GPT(cfg)
    seen: list[bool] = []
    model.lm_head.register_forward_hook(
        lambda m, i, o: seen.append(torch.is_inference_mode_enabled())
    )
    out = model.generate(torch.tensor([[1, 2, 3]]), 5, top_k=1)
    assert seen and all(seen) and model.training
    assert not out.is_inference()
    out[:, 0] = 7  # an inference tensor would refuse this in-place write
    loss = torch.nn.functional.cross_entropy(model(out[:, :-1]).flatten(0, 1), out[:, 1:].flatten())
    loss.backward()  # RoPE tables memoised during generate are ordinary tensors
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
