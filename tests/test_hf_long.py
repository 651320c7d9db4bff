"""`attnlab.hf.attention_stats`: per-head attention statistics of a transformers forward, no L×S.

Tiny random models (Llama with GQA, BART with cross-attention) are saved with ``save_pretrained``
and loaded back (offline). The statistics equal those computed from eager's ``output_attentions``
weights (eager's softmax runs in float32 even for float64 models, so the fixed fp32 forward
table applies; a left-padded batch compares real rows only); at a long input a dispatch spy sees
no tensor of L×S elements. The long-context memory benchmark is ``benchmarks/bench_hf_long.py``
(not run here).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from helpers import LargestTensor

transformers = pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402
import attnlab.masks.base  # noqa: E402

if attnlab.hf.bridge._version_tuple(transformers.__version__) < attnlab.hf.MIN_TRANSFORMERS:
    pytest.skip("attnlab.hf needs transformers>=5.4", allow_module_level=True)

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

attnlab.hf.register()

LLAMA = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.2,
    pad_token_id=0,
)
BART = dict(
    vocab_size=100,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    init_std=0.2,
    pad_token_id=0,
    decoder_start_token_id=2,
)
# eager computes its softmax in float32 even for a float64 model, so its weights are the reference
# only to float32 precision: the fixed fp32 forward table (atol, rtol) applies to every comparison.
TOL = (2e-5, 1.3e-6)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    out = {}
    for name, cls, cfg in (
        ("llama", transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA)),
        ("bart", transformers.BartForConditionalGeneration, transformers.BartConfig(**BART)),
        (
            "mistral",
            transformers.MistralForCausalLM,
            transformers.MistralConfig(**LLAMA, sliding_window=3),
        ),
    ):
        out[name] = tmp_path_factory.mktemp(name)
        cls(cfg).save_pretrained(out[name], safe_serialization=True)
    return out


def _load(folder, impl, dtype, cls=transformers.AutoModelForCausalLM):
    return cls.from_pretrained(folder, attn_implementation=impl, dtype=dtype).eval()


def weight_stats(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics from dense weights ``(B, H, L, S)`` (bottom-right aligned positions)."""
    L, S = w.shape[-2:]
    i = torch.arange(L, dtype=w.dtype)[:, None] + (S - L)
    j = torch.arange(S, dtype=w.dtype)[None, :]
    logw = torch.where(w > 0, w.log(), torch.zeros_like(w))
    return {
        "entropy": -(w * logw).sum(-1),
        "max_weight": w.amax(-1),
        "sink_mass": w[..., 0],
        "mean_distance": (w * (i - j).abs()).sum(-1),
    }


def _compare(call, weights, real_rows, dtype):
    atol, rtol = TOL
    want = weight_stats(weights)
    for name, ref in want.items():
        got = getattr(call.stats, name)
        assert got.dtype == dtype and got.shape == ref.shape, name
        torch.testing.assert_close(
            got[real_rows], ref[real_rows], atol=atol, rtol=rtol, msg=f"{call.name} {name}"
        )


@pytest.mark.parametrize("name", ["llama", "mistral"])  # mistral: a sliding window of 3 keys
def test_decoder_stats_equal_eager_float64(folders, name):
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 12, 60], [3, 9, 23, 71, 9, 38, 50, 14]])
    model = _load(folders[name], "attnlab", torch.float64)
    run = attnlab.hf.attention_stats(model, {"input_ids": ids})
    eager = _load(folders[name], "eager", torch.float64)
    ref = eager(input_ids=ids, output_attentions=True)
    assert [c.name for c in run.layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    every = torch.ones(2, 4, 8, dtype=torch.bool)
    for call, w in zip(run.layers, ref.attentions, strict=True):
        _compare(call, w, every, torch.float64)
    torch.testing.assert_close(run.output.logits, ref.logits, atol=2e-5, rtol=1.3e-6)
    if name == "mistral":  # the window bounds the distance: at most 2 keys back
        assert run.layers[0].stats.mean_distance.max() <= 2
    # per_head: the mean over rows (here every row attends something)
    per = run.per_head()
    assert per["sink_mass"].shape == (2, 4)
    torch.testing.assert_close(per["sink_mass"][1], ref.attentions[1][..., 0].mean(dim=(0, 2)))


def test_llama_stats_left_padded_float32(folders):
    ids = torch.tensor([[5, 17, 33, 8, 91, 44], [0, 0, 23, 71, 9, 38], [0, 0, 0, 0, 64, 29]])
    mask = (ids != 0).long()
    model = _load(folders["llama"], "attnlab", torch.float32)
    run = attnlab.hf.attention_stats(model, {"input_ids": ids, "attention_mask": mask})
    ref = _load(folders["llama"], "eager", torch.float32)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    )
    real = mask.bool()[:, None, :].expand(3, 4, 6)  # padding query rows are not compared
    for call, w in zip(run.layers, ref.attentions, strict=True):
        _compare(call, w, real, torch.float32)
        # padding rows attend nothing: lse −inf, statistics 0, and per_head leaves them out
        assert torch.equal(call.stats.lse[~real], torch.full_like(call.stats.lse[~real], -1e999))
        assert (call.stats.entropy[~real] == 0).all()
        den = real.sum(dim=(0, 2))
        want = (weight_stats(w)["entropy"] * real).sum(dim=(0, 2)) / den
        torch.testing.assert_close(call.per_head()["entropy"], want, atol=2e-5, rtol=1.3e-6)


def test_bart_cross_attention_stats_equal_eager(folders):
    cls = transformers.AutoModelForSeq2SeqLM
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 12, 60]])  # 8 encoder tokens
    dec = torch.tensor([[2, 7, 40]])  # 3 decoder tokens: cross-attention is 3 × 8
    model = _load(folders["bart"], "attnlab", torch.float64, cls)
    run = attnlab.hf.attention_stats(model, {"input_ids": ids, "decoder_input_ids": dec})
    ref = _load(folders["bart"], "eager", torch.float64, cls)(
        input_ids=ids, decoder_input_ids=dec, output_attentions=True
    )
    by_name = {c.name: c for c in run.layers}
    assert len(by_name) == len(run.layers) == 6
    every = lambda w: torch.ones(w.shape[:3], dtype=torch.bool)  # noqa: E731
    for i in range(2):
        pairs = (
            (f"model.encoder.layers.{i}.self_attn", ref.encoder_attentions[i]),
            (f"model.decoder.layers.{i}.self_attn", ref.decoder_attentions[i]),
            (f"model.decoder.layers.{i}.encoder_attn", ref.cross_attentions[i]),
        )
        for name, w in pairs:
            _compare(by_name[name], w, every(w), torch.float64)
    cross = by_name["model.decoder.layers.0.encoder_attn"]
    assert cross.keys == 8 and cross.stats.entropy.shape == (1, 4, 3)


def test_long_input_forms_no_lxs_tensor(folders, monkeypatch):
    L = 2048
    # The padding (key) mask's tile map is evaluated densely in bounded row chunks of
    # _CHUNK_ELEMENTS (4M) booleans; at this test's L that bound equals L², so it is lowered here
    # to show that nothing scales with L×S (at 16K tokens the chunk is 1/64 of L×S).
    monkeypatch.setattr(attnlab.masks.base, "_CHUNK_ELEMENTS", 1 << 18)
    model = _load(folders["llama"], "attnlab", torch.float32).model  # the base model: no logits
    ids = torch.randint(1, 100, (1, L))
    spy = LargestTensor()
    with spy:
        run = attnlab.hf.attention_stats(
            model, {"input_ids": ids, "attention_mask": torch.ones(1, L, dtype=torch.long)}
        )
    assert len(run.layers) == 2 and run.layers[0].stats.entropy.shape == (1, 4, L)
    # one head's L×S weights would be L² = 4.2M elements; the largest tensor is one statistics
    # tile, H × 128 rows × 1024 keys (compute_stats' chunks), whatever L is
    assert spy.largest <= 4 * 128 * 1024 < L * L, spy.largest
    # the statistics are the ones of the full computation: rows 0..63 against eager's weights
    short = _load(folders["llama"], "eager", torch.float32).model
    ref = short(input_ids=ids[:, :64], output_attentions=True).attentions[0]
    head = attnlab.hf.attention_stats(model, ids[:, :64]).layers[0]
    _compare(head, ref, torch.ones(1, 4, 64, dtype=torch.bool), torch.float32)


def test_interface_restored_and_errors(folders):
    before = ALL_ATTENTION_FUNCTIONS["attnlab"]
    model = _load(folders["llama"], "attnlab", torch.float32)
    with pytest.raises(ValueError, match="output_attentions"):
        attnlab.hf.attention_stats(model, torch.tensor([[1, 2]]), output_attentions=True)
    with pytest.raises(TypeError, match="input_ids tensor, got list"):
        attnlab.hf.attention_stats(model, [[1, 2]])
    with pytest.raises(IndexError):  # the forward fails inside the swap: it is undone
        attnlab.hf.attention_stats(model, torch.tensor([[1, 2, 500]]))
    assert ALL_ATTENTION_FUNCTIONS["attnlab"] is before is attnlab.hf.attention_forward
    assert "attnlab" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    eager = _load(folders["llama"], "eager", torch.float32)
    with pytest.raises(ValueError, match=r"attn_implementation='attnlab'.*got.*'eager'"):
        attnlab.hf.attention_stats(eager, torch.tensor([[1, 2]]))
