"""Issue 15, item 2: a model config must be justified by the tensors in the file.

Before anything is allocated, a loader reads the safetensors header only (names, shapes and
dtypes; no tensor data), builds the model on the ``meta`` device and compares; a config the
file's tensors do not justify is refused at once with one `CheckpointError` naming what differs.
Each probe is crafted from a real small saved model: on the code before the fix, the GPT
probes built the configured model first (``d_model=4096, n_layers=4``: 3 GB, 15 s;
``vocab_size=10**12``: a raw allocator error; ``n_layers=10**6``: minutes) and the BERT probe
``num_hidden_layers: 1000000`` took 20 s and 3 GB listing the missing names.

The memory bound: no tensor of more than `_BIG` bytes is created while a probe runs
(``torch.empty``/``zeros``/... and ``nn.Parameter`` creation are watched on every device but
``meta``), and the probe takes well under a second.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import attnlab.checkpoint as ckmod
from attnlab import _files
from attnlab._fit import build_on_meta
from attnlab.apps.gpt import load, vocab_of
from attnlab.checkpoint import CheckpointError, save_checkpoint
from attnlab.models import GPT, TransformerConfig
from attnlab.models.bert import BertConfig, BertEncoder
from attnlab.models.config import MAX_UNSIZED_SEQ_LEN
from test_bert_minilm import TINY, tiny_state, write_checkpoint
from test_cli_errors import run

_BIG = 1 << 24  # 16 MB: far above any tensor of the tiny files, far below any probe's model
_FAST = 1.0  # seconds


@pytest.fixture
def no_big_allocation(monkeypatch):
    """Fails the test if a tensor of more than `_BIG` bytes is allocated off ``meta``."""
    seen: list[tuple[str, int]] = []

    def watch(name, fn):
        def wrapper(*args, **kwargs):
            t = fn(*args, **kwargs)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                nbytes = t.numel() * t.element_size()
                if nbytes > _BIG:
                    seen.append((name, nbytes))
            return t

        return wrapper

    # torch.device("meta") caches its set of factory functions on first use: fill it with the
    # real ones before they are wrapped (else the wrappers are cached and nothing goes to meta)
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in ("empty", "zeros", "ones", "randn", "rand", "full", "arange"):
        monkeypatch.setattr(torch, name, watch(name, getattr(torch, name)))
    original_new = nn.Parameter.__new__

    def new_parameter(cls, data=None, requires_grad=True):
        if data is not None and data.device.type != "meta":
            nbytes = data.numel() * data.element_size()
            if nbytes > _BIG:
                seen.append(("Parameter", nbytes))
        return original_new(cls, data, requires_grad)

    monkeypatch.setattr(nn.Parameter, "__new__", new_parameter)
    yield seen
    assert not seen, f"allocated before the config was checked: {seen}"


# ---------------------------------------------------------------------------------- GPT files
VOCAB = list("abcdef")
SMALL = TransformerConfig(vocab_size=len(VOCAB), d_model=8, n_layers=1, n_heads=2, max_seq_len=16)


def gpt_file(path: Path, *, vocab: list[str] = VOCAB, **edits) -> Path:
    """A checkpoint as `attnlab train` saves it (model tensors, config, vocab), whose stored
    config is then edited (resealed: a crafted file passes every checksum)."""
    model = GPT(SMALL)
    config = {**SMALL.to_dict(), **edits}
    meta = {"config": json.dumps(config), "vocab": json.dumps(vocab)}
    save_checkpoint(path, {f"model.{k}": v for k, v in model.state_dict().items()}, meta)
    return path


def test_a_valid_checkpoint_loads_exactly(tmp_path):
    model = GPT(SMALL)
    path = tmp_path / "ok.safetensors"
    meta = {"config": json.dumps(SMALL.to_dict()), "vocab": json.dumps(VOCAB)}
    save_checkpoint(path, {f"model.{k}": v for k, v in model.state_dict().items()}, meta)
    loaded, ck = load(path)
    vocab = vocab_of(ck)
    assert vocab == VOCAB and loaded.config == SMALL
    want, got = model.state_dict(), loaded.state_dict()
    assert list(want) == list(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert loaded.lm_head.weight is loaded.tok_emb.weight  # the tie survives


@pytest.mark.parametrize(
    ("edits", "pattern"),
    [
        (
            {"d_model": 4096, "n_layers": 4},
            r"do not justify the stored config: n_layers: it says 4 layer\(s\) but the file "
            r"holds tensors of 1 \(model\.blocks\.<i>\.\*\); d_model = 4096 but",
        ),
        ({"n_layers": 10**6}, r"it says 1000000 layer\(s\) but the file holds tensors of 1"),
        (
            {"d_model": 4096},
            r"d_model = 4096 but model\.tok_emb\.weight has shape \(6, 8\) \(size 8 along dim 1\)",
        ),
        (
            {"d_ff": 10**9},
            r"d_ff = 1000000000 but model\.blocks\.0\.mlp\.fc1\.weight has shape \(32, 8\)",
        ),
        ({"n_layers": 0}, r"it says 0 layer\(s\) but the file holds tensors of 1"),
        ({"n_kv_heads": 1}, r"model\.blocks\.0\.attn\.qkv_proj\.weight \(needs \(16, 8\)"),
        ({"positional": "learned"}, r"1 missing tensor\(s\) 'model\.pos_emb\.weight'"),
    ],
    ids=["d4096-4layers", "1e6-layers", "d4096", "huge-d_ff", "0-layers", "gqa", "learned"],
)
def test_a_config_the_tensors_do_not_justify_is_refused_at_once(
    tmp_path, edits, pattern, no_big_allocation
):
    path = gpt_file(tmp_path / "crafted.safetensors", **edits)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=pattern) as info:
        load(path)
    assert time.perf_counter() - start < _FAST
    assert str(info.value).startswith(f"{path}: ")


def test_a_huge_vocab_is_refused_by_the_shapes(tmp_path, no_big_allocation):
    vocab = [chr(0x4E00 + i) for i in range(100_000)]  # a consistent 100k-entry vocab
    path = gpt_file(tmp_path / "vocab.safetensors", vocab=vocab, vocab_size=len(vocab))
    with pytest.raises(
        CheckpointError, match=r"vocab_size = 100000 but model\.tok_emb\.weight has shape \(6, 8\)"
    ):
        load(path)
    path = gpt_file(tmp_path / "vocab2.safetensors", vocab_size=10**12)
    with pytest.raises(CheckpointError, match=r"vocab_size = 1000000000000 but model\.tok_emb"):
        load(path)
    path = gpt_file(tmp_path / "vocab3.safetensors", vocab=VOCAB[:-1])
    with pytest.raises(CheckpointError, match=r"stored vocab has 5 entries but the config's"):
        load(path)


def test_a_file_with_too_few_tensors_lists_them_with_a_count(tmp_path):
    model = GPT(SMALL)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items() if "blocks.0.mlp" not in k}
    meta = {"config": json.dumps(SMALL.to_dict()), "vocab": json.dumps(VOCAB)}
    save_checkpoint(tmp_path / "few.safetensors", tensors, meta)
    with pytest.raises(CheckpointError, match=r"4 missing tensor\(s\) 'model\.blocks\.0\.mlp"):
        load(tmp_path / "few.safetensors")


@pytest.mark.parametrize(
    ("edits", "error", "pattern"),
    [
        (
            {"n_layers": True},
            CheckpointError,
            r"config is invalid: n_layers must be an int, got bool",
        ),
        ({"n_layers": 1.0}, CheckpointError, r"n_layers must be an int, got float 1\.0"),
        ({"d_model": -8}, ValueError, r"d_model must be >= 1, got -8"),
        ({"n_heads": "2"}, CheckpointError, r"n_heads must be an int, got str '2'"),
        ({"bogus": 1}, ValueError, r"unknown TransformerConfig field\(s\) \['bogus'\]"),
    ],
)
def test_config_fields_are_type_checked_naming_the_field(tmp_path, edits, error, pattern):
    path = gpt_file(tmp_path / "typed.safetensors", **edits)
    with pytest.raises(error, match=pattern) as info:
        load(path)
    assert str(path) in str(info.value)


def test_a_deeply_nested_stored_config_is_a_clear_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    meta = {"config": "[" * 100_000 + "]" * 100_000, "vocab": json.dumps(VOCAB)}
    save_checkpoint(path, {f"model.{k}": v for k, v in GPT(SMALL).state_dict().items()}, meta)
    with pytest.raises(CheckpointError, match=r"the stored config nests deeper than 4 levels"):
        load(path)


@pytest.mark.parametrize("command", ["generate", "visualize"])
def test_the_cli_refuses_a_crafted_checkpoint_in_one_line(tmp_path, capsys, command):
    path = gpt_file(tmp_path / "crafted.safetensors", d_model=4096, n_layers=4)
    argv = {
        "generate": ["generate", "--checkpoint", str(path), "--prompt", "ab"],
        "visualize": [
            "visualize",
            "abc",
            "--checkpoint",
            str(path),
            "--out",
            str(tmp_path / "a.html"),
        ],
    }[command]
    start = time.perf_counter()
    code, err = run(argv, capsys)
    assert time.perf_counter() - start < _FAST
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "it says 4 layer(s) but the file holds tensors of 1" in err


# --------------------------------------------------------------------------------- BERT folders
@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            {"num_hidden_layers": 1_000_000},
            r"\(1000000 layers\): the file holds tensors of 2 layer\(s\); missing tensor\(s\) "
            r"'encoder\.layer\.2\.attention\.self\.query\.weight', .*\(15999968 in all\)",
        ),
        ({"hidden_size": 4096, "num_attention_heads": 4}, r"has shape \(40, 16\), expected"),
        ({"vocab_size": 10**12}, r"expected \(1000000000000, 16\) from the config"),
        ({"intermediate_size": 10**10}, r"intermediate\.dense\.weight' has shape \(24, 16\)"),
        ({"max_position_embeddings": 10**12}, r"position_embeddings\.weight' has shape \(32, 16\)"),
    ],
    ids=["1e6-layers", "hidden", "vocab", "intermediate", "positions"],
)
def test_a_bert_config_the_tensors_do_not_justify_is_refused_at_once(
    tmp_path, change, pattern, no_big_allocation
):
    d = write_checkpoint(tmp_path, tiny_state(TINY), {**TINY, **change})
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=pattern) as info:
        BertEncoder.from_pretrained(d)
    assert time.perf_counter() - start < _FAST
    assert str(d / "model.safetensors") in str(info.value)


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"num_hidden_layers": 1e6}, TypeError, r"num_hidden_layers must be an int, got float"),
        ({"num_hidden_layers": -1}, ValueError, r"num_hidden_layers must be >= 1, got -1"),
        ({"num_hidden_layers": True}, TypeError, r"num_hidden_layers must be an int, got bool"),
        ({"hidden_size": "16"}, TypeError, r"hidden_size must be an int, got str '16'"),
        ({"vocab_size": None}, TypeError, r"vocab_size must be an int, got NoneType"),
        ({"hidden_act": ["gelu"]}, ValueError, r"hidden_act must be one of .*got \['gelu'\]"),
        ({"layer_norm_eps": "x"}, ValueError, r"layer_norm_eps must be in \(0, 1\), got 'x'"),
        ({"pad_token_id": 40}, ValueError, r"pad_token_id must be in \[0, vocab_size=40\)"),
    ],
)
def test_bert_config_fields_are_type_checked(tmp_path, change, error, pattern):
    d = write_checkpoint(tmp_path, tiny_state(TINY), {**TINY, **change})
    with pytest.raises(error, match=pattern) as info:
        BertEncoder.from_pretrained(d)
    assert str(d / "config.json") in str(info.value)


def test_bert_config_json_is_read_bounded(tmp_path):
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    config = d / "config.json"
    config.write_text("[" * 100_000 + "]" * 100_000)  # json.loads: RecursionError
    with pytest.raises(CheckpointError, match=r"config\.json: the file nests deeper than 64"):
        BertEncoder.from_pretrained(d)
    config.write_text('["not an object"]')
    with pytest.raises(TypeError, match=r"config\.json must hold a JSON object, got list"):
        BertEncoder.from_pretrained(d)
    config.unlink()
    config.mkdir()
    with pytest.raises(CheckpointError, match=r"refusing a directory: expected a regular file"):
        BertEncoder.from_pretrained(d)
    config.rmdir()
    config.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"refusing a character device"):
        BertEncoder.from_pretrained(d)
    config.unlink()
    with config.open("wb") as f:
        f.truncate(_files.MAX_CONFIG_BYTES + 1)  # sparse: no disk used
    with pytest.raises(CheckpointError, match=r"more than the 16000000-byte limit"):
        BertEncoder.from_pretrained(d)


def test_bert_opens_the_weights_with_safe_open_only_through_the_checked_descriptor(
    tmp_path, monkeypatch
):
    """`read_header` hands safetensors the descriptor it opened and checked (a regular file),
    never the path again (which may have been swapped for a FIFO or a device meanwhile)."""
    import safetensors

    real = safetensors.safe_open

    def checked_only(filename, *args, **kwargs):
        if not str(filename).startswith("/proc/self/fd/"):
            raise AssertionError(f"safe_open on an unchecked file {filename}")
        return real(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", checked_only)
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    enc = BertEncoder.from_pretrained(d)
    assert enc.word_embeddings.weight.shape == (40, 16)
    assert not enc.word_embeddings.weight.is_meta


def test_a_bert_file_changed_after_its_header_was_checked_is_refused(tmp_path, monkeypatch):
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    bigger = tiny_state({**TINY, "vocab_size": 41})
    real = ckmod.read_safetensors

    def swap_then_read(path, *, header=None):
        import safetensors.torch

        safetensors.torch.save_file(bigger, str(path))  # a writer replaces the file
        return real(path, header=header)

    monkeypatch.setattr("attnlab.models.bert.read_safetensors", swap_then_read)
    with pytest.raises(CheckpointError, match=r"the file changed since its header was read"):
        BertEncoder.from_pretrained(d)


# ------------------------------------------------------------------------------- building on meta
def test_build_on_meta_allocates_nothing_and_matches_the_real_model(no_big_allocation):
    for positional in ("rope", "learned", "sinusoidal", "alibi", None):
        config = TransformerConfig(
            vocab_size=50_000, d_model=512, n_layers=2, n_heads=8, positional=positional
        )  # 100 MB of embeddings for real
        meta = build_on_meta(lambda config=config: GPT(config))
        assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
        small = TransformerConfig(vocab_size=7, d_model=16, n_layers=2, n_heads=2)
        small = TransformerConfig(**{**small.to_dict(), "positional": positional})
        real = GPT(small).state_dict()
        fake = build_on_meta(lambda small=small: GPT(small)).state_dict()
        assert {k: (v.shape, v.dtype) for k, v in fake.items()} == {
            k: (v.shape, v.dtype) for k, v in real.items()
        }


def test_read_header_reads_no_tensor_data(tmp_path):
    path = tmp_path / "big.safetensors"
    save_checkpoint(path, {"w": torch.zeros(1 << 20)})  # 4 MB of data
    header = ckmod.read_header(path)
    assert header.tensors == {"w": (torch.float32, (1 << 20,))}
    n = struct.unpack("<Q", header.raw[:8])[0]
    assert len(header.raw) == 8 + n < os.path.getsize(path) // 100


def test_bert_config_still_loads(tmp_path):
    d = write_checkpoint(tmp_path, tiny_state(TINY))
    assert BertConfig.from_json(d / "config.json").num_hidden_layers == 2


def test_generate_preallocates_only_what_it_can_use(tmp_path, monkeypatch):
    """``max_seq_len`` sizes no tensor under RoPE, so no file can justify it: `GPT.generate`
    preallocates its KV caches for at most the prompt plus the new tokens (before the fix a
    crafted ``max_seq_len=10**12`` made ``attnlab generate`` request 32 TB; such a file is now
    refused: `MAX_UNSIZED_SEQ_LEN` is the most a file without a position table may claim)."""
    path = gpt_file(tmp_path / "long.safetensors", max_seq_len=MAX_UNSIZED_SEQ_LEN)
    model, _ = load(path)
    capacities: list[int | None] = []
    new_caches = GPT.new_caches

    def record(self, capacity=None):
        capacities.append(capacity)
        return new_caches(self, capacity)

    monkeypatch.setattr(GPT, "new_caches", record)
    idx = torch.tensor([[1, 2, 3]])
    g = torch.Generator().manual_seed(0)
    cached = model.generate(idx, 5, top_k=1, generator=g)
    assert capacities == [3 + 5]
    assert torch.equal(cached, model.generate(idx, 5, top_k=1, use_cache=False))


def test_resume_refuses_settings_the_tensors_do_not_justify(tmp_path, no_big_allocation):
    """``train(resume=...)`` builds its model from the stored settings: they are checked
    against the stored tensors first (before the fix: a 4096-wide model was allocated)."""
    from dataclasses import asdict

    from attnlab.apps.gpt import TrainSettings, load_text, train

    vocab = sorted(set(load_text(None)))
    small = TrainSettings(d_model=8, n_heads=2, n_layers=1, seq_len=16)
    tensors = {f"model.{k}": v for k, v in GPT(small.model_config(len(vocab))).state_dict().items()}
    crafted = asdict(TrainSettings(d_model=4096, n_heads=2, n_layers=1, seq_len=16))
    path = tmp_path / "resume.safetensors"
    save_checkpoint(path, tensors, {"settings": json.dumps(crafted), "vocab": json.dumps(vocab)})
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"do not justify the stored settings: .*\(needs"):
        train(TrainSettings(out_dir=str(tmp_path / "out")), resume=path, log=lambda _: None)
    assert time.perf_counter() - start < _FAST
