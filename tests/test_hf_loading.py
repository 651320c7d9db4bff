"""attnlab.hf.from_pretrained / check_model: unsupported models are refused at load time."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_supported_model_loads_on_attnlab(llama_folder):
    model = attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, llama_folder)
    assert model.config._attn_implementation == "attnlab" and not model.training
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        llama_folder, attn_implementation="eager"
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, eager(input_ids=ids).logits)


def test_unsupported_attention_is_refused_at_load_time(tmp_path, monkeypatch):
    """A feature attnlab does not compute (here a position_bias keyword, patched into GPT-OSS's
    attention: its sinks are supported since issue 42) is refused at load time."""
    config = transformers.GptOssConfig(
        vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1,
    )  # fmt: skip
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path)
    attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)  # sinks: loads
    forward = attnlab.hf.bridge.attention_forward

    def with_bias(module, *args, **kwargs):
        return forward(module, *args, **kwargs, position_bias=torch.zeros(1))

    monkeypatch.setattr(attnlab.hf.bridge, "attention_forward", with_bias)
    attnlab.hf.bridge.register()
    with pytest.raises(attnlab.hf.UnsupportedAttentionError, match="position bias"):
        attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    # loaded the plain way, the same check refuses it before any use
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="attnlab"
    )
    with pytest.raises(attnlab.hf.UnsupportedAttentionError, match="GptOssAttention"):
        attnlab.hf.check_model(model)
    monkeypatch.undo()
    attnlab.hf.bridge.register()


def test_loading_rules_cannot_be_overridden_and_eager_models_are_named(llama_folder):
    for key, value in (("attn_implementation", "eager"), ("trust_remote_code", True)):
        with pytest.raises(ValueError, match=f"{key} must be"):
            attnlab.hf.from_pretrained(
                transformers.AutoModelForCausalLM, llama_folder, **{key: value}
            )
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        llama_folder, attn_implementation="eager"
    )
    with pytest.raises(ValueError, match="attn_implementation='attnlab', got 'eager'"):
        attnlab.hf.check_model(eager)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        attnlab.hf.check_model(torch.nn.Linear(2, 2))


def test_a_pickle_only_folder_is_refused(llama_folder, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a pickle, the old format
    with pytest.raises(OSError, match="safetensors"):
        attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
