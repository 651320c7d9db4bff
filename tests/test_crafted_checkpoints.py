"""Issue 38, items 3 and 4: crafted folders and checkpoints are refused, quickly and by name.

Item 3: every library entry point that loads a transformers folder (`attnlab.hf.from_pretrained`,
``attnlab visualize --model FOLDER`` through the shared `attnlab.hf.folder.check_folder`, and
`attnlab.models.bert.BertEncoder.from_pretrained`) reads only files inside the folder, and
refuses a config that the safetensors weights do not match (more or fewer layers, a tensor of
another shape, a missing or an extra tensor) before returning a model, naming the tensors; a
config claiming 20,000 layers is refused from the headers at once (before the fix: 67 s in the
CLI, more than 180 s in `from_pretrained`, which loaded a 3-layer config over 2 layers of
weights with the third layer random).

Item 4: `attnlab.apps.load_any` justifies a checkpoint's stored config by its tensors before
building anything, for every application kind: crafted layer counts (``dec_layers=10**9``
hung), sizes (``max_seq_len`` and ``type_vocab_size`` of 10**9 or 2**62 loaded), and values of
the wrong type or sign are refused with a `CheckpointError` naming the field and the value.

Only entry points that existed before the fix are used at module level, so that on the old
code every test runs (and fails) instead of the module failing to import.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from attnlab.apps import load_any
from attnlab.apps.loop import save_model
from attnlab.checkpoint import CheckpointError, save_checkpoint
from helpers import run_cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import attnlab.hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: A refusal must come well within this (the fixed code takes milliseconds; the old code took
#: 67 s, more than 180 s, or never finished).
QUICK = 5.0


def refused_quickly(load, match: str, error: type[BaseException] = CheckpointError) -> str:
    """Runs ``load()``, which must raise ``error`` matching ``match`` within `QUICK` seconds."""
    start = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        load()
    elapsed = time.perf_counter() - start
    assert elapsed < QUICK, f"refused after {elapsed:.1f} s"
    return str(info.value)


# ------------------------------------------------------------------ item 3: transformers folders
LLAMA = dict(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A 2-layer random Llama saved the normal way (``config.json`` + ``model.safetensors``)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(folder)
    model = attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, folder)
    assert len(model.model.layers) == 2  # the intact folder loads
    return folder


def crafted(src: Path, dst: Path, config: dict | None = None) -> Path:
    """A copy of the folder ``src`` with ``config`` merged into its config.json."""
    shutil.copytree(src, dst)
    if config:
        path = dst / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def rewrite(folder: Path, edit) -> None:
    """Rewrites ``model.safetensors`` with ``edit(tensors)`` applied (a consistent file)."""
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def from_pretrained(folder: Path):
    return attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, folder)


def refused_everywhere(folder: Path, tmp_path: Path, capsys, match: str) -> str:
    """``folder`` is refused, within `QUICK` seconds each, with one message matching ``match``
    by every entry point: `attnlab.hf.from_pretrained` (a `CheckpointError`), the checker of
    ``attnlab visualize --model`` and the command itself (exit 2, that message on one line, no
    traceback, no page). Returns the message."""
    from attnlab.apps.attentions import check_hf_folder

    msg = refused_quickly(lambda: from_pretrained(folder), match)
    assert msg.startswith(f"{folder}: ") or msg.startswith(f"{folder}/"), msg
    assert refused_quickly(lambda: check_hf_folder(folder), match, ValueError) == msg
    out = tmp_path / "page.html"
    argv = ["visualize", "--model", str(folder), "a b c", "--out", str(out)]
    start = time.perf_counter()
    code, _, err = run_cli(argv, capsys)
    assert time.perf_counter() - start < QUICK
    assert code == 2 and err == f"attnlab visualize: error: {' '.join(msg.split())}\n", err
    assert not out.exists()
    return msg


def test_a_config_with_more_layers_than_the_weights_is_refused(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "three", {"num_hidden_layers": 3})
    msg = refused_everywhere(folder, tmp_path, capsys, r"num_hidden_layers = 3")
    assert "at most 2 layer(s) (model.layers.<i>.*)" in msg
    assert "9 weights missing from the file (model.layers.2." in msg and "and 6 more" in msg


def test_a_config_with_fewer_layers_than_the_weights_is_refused(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "one", {"num_hidden_layers": 1})
    msg = refused_everywhere(folder, tmp_path, capsys, r"tensors in the file that \w+ does not")
    assert "(model.layers.1." in msg


def test_a_tensor_of_another_shape_is_refused(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "shape")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite(folder, lambda t: t.__setitem__(name, torch.zeros(24, 16)))
    msg = refused_everywhere(folder, tmp_path, capsys, "does not match the safetensors weights")
    assert f"{name}: the config gives shape (32, 16), the file (24, 16)" in msg


def test_a_missing_tensor_is_refused(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "missing")
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite(folder, lambda t: t.pop(name))
    msg = refused_everywhere(folder, tmp_path, capsys, "1 weights missing from the file")
    assert name in msg


def test_an_extra_tensor_is_refused(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "extra")
    rewrite(folder, lambda t: t.__setitem__("model.layers.0.self_attn.bogus.weight", torch.ones(2)))
    msg = refused_everywhere(folder, tmp_path, capsys, r"1 tensors in the file that \w+ does not")
    assert "model.layers.0.self_attn.bogus.weight" in msg


def test_twenty_thousand_layers_are_refused_from_the_headers(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "big", {"num_hidden_layers": 20_000})
    msg = refused_everywhere(folder, tmp_path, capsys, "num_hidden_layers = 20000")
    assert "at most 2 layer(s)" in msg and "refusing before building the model" in msg


def sharded(src: Path, dst: Path, shard: str) -> Path:
    """A copy of ``src`` split into two shards and an index naming the second one ``shard``;
    the second shard is written beside the folder (``dst.parent``), and its path returned."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    safetensors_torch.save_file(
        {k: tensors[k] for k in first}, dst / "model-00001.safetensors", metadata={"format": "pt"}
    )
    second_file = dst.parent / f"{dst.name}-second.safetensors"
    safetensors_torch.save_file(
        {k: tensors[k] for k in second}, second_file, metadata={"format": "pt"}
    )
    weight_map = {**dict.fromkeys(first, "model-00001.safetensors"), **dict.fromkeys(second, shard)}
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return second_file


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_shard_outside_the_folder_is_refused(llama, tmp_path, capsys, how):
    """The second shard is a valid file just outside the folder, which transformers read
    (named with ``..``, as an absolute path, or through a link in the folder); moved inside,
    the same shards load."""
    folder = tmp_path / "sharded"
    outside = tmp_path / "sharded-second.safetensors"
    shard = {
        "dotdot": "../sharded-second.safetensors",
        "absolute": str(outside),
        "symlink": "model-00002.safetensors",
    }[how]
    assert sharded(llama, folder, shard) == outside
    if how == "symlink":
        (folder / "model-00002.safetensors").symlink_to(outside)
    match = {
        "dotdot": r"model\.safetensors\.index\.json: names the file '\.\./sharded-second",
        "absolute": r"names the file '/.*sharded-second\.safetensors', an absolute path",
        "symlink": r"names the file 'model-00002\.safetensors', a link to .*outside",
    }[how]
    refused_everywhere(folder, tmp_path, capsys, match)
    # the same shards inside the folder load
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace(json.dumps(shard), '"model-00002.safetensors"'))
    (folder / "model-00002.safetensors").unlink(missing_ok=True)
    outside.rename(folder / "model-00002.safetensors")
    assert len(from_pretrained(folder).model.layers) == 2


def test_a_weights_file_linked_from_outside_is_refused(llama, tmp_path, capsys):
    folder = crafted(llama, tmp_path / "linked")
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    refused_everywhere(folder, tmp_path, capsys, r"'model\.safetensors', a link to .*elsewhere")


def test_transformers_loading_report_is_a_second_check(llama):
    """The folder is consistent, but the class asked for does not take every tensor: the
    base ``LlamaModel`` has no ``lm_head`` (transformers drops it and reports it unexpected)."""
    msg = refused_quickly(
        lambda: attnlab.hf.from_pretrained(transformers.AutoModel, llama),
        r"transformers loaded LlamaModel with weights that do not fit",
    )
    assert "1 unexpected (lm_head.weight)" in msg


def test_a_hub_cache_snapshot_may_link_into_its_blobs_only(llama, tmp_path):
    """A model id resolves to its snapshot in the Hugging Face cache, whose files link into the
    repository's ``blobs``: those links are inside; a link elsewhere is not."""
    repo = tmp_path / "cache" / "models--attnlab--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot.mkdir(parents=True)
    for f in llama.iterdir():
        shutil.copy(f, repo / "blobs" / f.name)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    cache = str(tmp_path / "cache")
    model = attnlab.hf.from_pretrained(
        transformers.AutoModelForCausalLM, "attnlab/tiny", cache_dir=cache, local_files_only=True
    )
    assert len(model.model.layers) == 2
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(llama / "model.safetensors")  # out of the repo
    refused_quickly(
        lambda: attnlab.hf.from_pretrained(
            transformers.AutoModelForCausalLM,
            "attnlab/tiny",
            cache_dir=cache,
            local_files_only=True,
        ),
        r"'model\.safetensors', a link to .*outside",
    )


def test_bert_encoder_refuses_weights_linked_from_outside(tmp_path):
    from attnlab.models.bert import BertEncoder
    from test_bert_minilm import TINY, tiny_state, write_checkpoint

    d = write_checkpoint(tmp_path / "bert", tiny_state(TINY))
    outside = tmp_path / "elsewhere.safetensors"
    (d / "model.safetensors").rename(outside)
    (d / "model.safetensors").symlink_to(outside)
    refused_quickly(
        lambda: BertEncoder.from_pretrained(d), r"'model\.safetensors', a link to .*elsewhere"
    )


def test_file_names_are_confined_in_every_spelling(tmp_path):
    from attnlab._fit import file_in_folder

    (tmp_path / "sub").mkdir()
    assert file_in_folder(tmp_path, "sub/x.safetensors") == tmp_path / "sub" / "x.safetensors"
    for name, why in [
        ("../x.safetensors", r"leaves .* \('\.\.'\)"),
        ("sub/../../x.safetensors", r"leaves"),
        ("..\\x.safetensors", r"leaves"),
        ("/etc/passwd", r"an absolute path"),
        ("C:\\x.safetensors", r"an absolute path"),
        ("", r"not a file name"),
        ("a\x00b", r"not a file name"),
        (7, r"not a file name"),
    ]:
        with pytest.raises(CheckpointError, match=why):
            file_in_folder(tmp_path, name)


# ------------------------------------------------------------ item 4: application checkpoints
VOCAB = ["<pad>", "<bos>", "<eos>", "<de>", "<fr>", "a", "b", "c"]


def _gpt(path: Path, config: dict | None = None) -> Path:
    from attnlab.models import GPT, TransformerConfig

    small = TransformerConfig(vocab_size=6, d_model=8, n_layers=1, n_heads=2, max_seq_len=16)
    model = GPT(small)
    meta = {"config": json.dumps(config or small.to_dict()), "vocab": json.dumps(list("abcdef"))}
    save_checkpoint(path, {f"model.{k}": v for k, v in model.state_dict().items()}, meta)
    return path


def _model(kind: str):
    """``(model, config dict, extra metadata)`` of a tiny model of each application kind."""
    torch.manual_seed(0)
    if kind == "translate":
        from attnlab.models.seq2seq import Seq2SeqConfig, build_seq2seq_transformer

        config = Seq2SeqConfig(
            src_vocab_size=8, tgt_vocab_size=8, d_model=8, n_heads=2, enc_layers=1, dec_layers=1
        ).to_dict()
        return build_seq2seq_transformer(config), config, {"arch": "transformer"}
    if kind == "translate-rnn":
        from attnlab.models.rnn import RNNSeq2SeqConfig, build_rnn_seq2seq

        sizes = dict(d_embed=4, d_encoder=4, d_decoder=6, d_attention=5, d_output=3)
        config = RNNSeq2SeqConfig(src_vocab_size=8, tgt_vocab_size=8, **sizes).to_dict()
        return build_rnn_seq2seq(config), config, {"arch": "rnn"}
    if kind == "rnn":
        from attnlab.models.rnn import RNNLMConfig, build_rnn_lm

        config = RNNLMConfig(vocab_size=5, d_embed=4, d_hidden=6, n_layers=1).to_dict()
        return build_rnn_lm(config), config, {"vocab": json.dumps(list("abcde"))}
    if kind == "vit":
        from attnlab.models.vit import VisionTransformer, ViTConfig

        model = VisionTransformer(
            ViTConfig(image_size=4, patch_size=2, d_model=8, n_layers=1, n_heads=2, num_classes=3)
        )
        return model, model.config.to_dict(), {}
    assert kind == "classify"
    from attnlab.models.classifier import char_classifier

    model = char_classifier("abc", ["x", "y"], d_model=8, n_layers=1, n_heads=2, max_len=6)
    return model, model.config.to_dict(), {}


APP_KINDS = {"translate": "translate", "translate-rnn": "translate"}


def app_file(path: Path, kind: str, edits: dict | None = None) -> Path:
    """A checkpoint of ``kind`` saved the normal way, re-saved with ``edits`` to its stored
    config (dotted keys reach into nested configs); every checksum is valid."""
    if kind == "gpt":
        from attnlab.models import TransformerConfig

        base = TransformerConfig(vocab_size=6, d_model=8, n_layers=1, n_heads=2, max_seq_len=16)
        return _gpt(path, _edited(base.to_dict(), edits or {}))
    model, config, extra = _model(kind)
    if kind.startswith("translate"):
        extra = {**extra, "vocab": json.dumps(VOCAB)}
    stored = APP_KINDS.get(kind, kind)
    return save_model(path, model, kind=stored, config=_edited(config, edits or {}), extra=extra)


def _edited(config: dict, edits: dict) -> dict:
    config = json.loads(json.dumps(config))
    for key, value in edits.items():
        *parents, last = key.split(".")
        target = config
        for p in parents:
            target = target[p]
        target[last] = value
    return config


@pytest.mark.parametrize("kind", ["gpt", "translate", "translate-rnn", "rnn", "vit", "classify"])
def test_every_kind_loads_when_its_config_fits(tmp_path, kind):
    """The justification accepts what the applications save (the tables match the models)."""
    path = app_file(tmp_path / f"{kind}.safetensors", kind)
    stored, model, _ = load_any(path)
    assert stored == APP_KINDS.get(kind, kind) and isinstance(model, torch.nn.Module)
    field = {
        "gpt": "n_layers",
        "translate": "dec_layers",
        "translate-rnn": "d_output",
        "rnn": "n_layers",
        "vit": "n_layers",
        "classify": "encoder.n_layers",
    }[kind]
    wrong = app_file(tmp_path / f"{kind}-2.safetensors", kind, {field: 2})  # one field off
    refused_quickly(lambda: load_any(wrong), rf"(: |; ){re.escape(field)}\b")


CRAFTED = [
    # (kind, stored config edits, the field the message must name, its shown value)
    ("translate", {"dec_layers": 10**9}, "dec_layers", "1000000000 layer(s)"),
    ("translate", {"enc_layers": 2**62}, "enc_layers", f"{2**62} layer(s)"),
    ("translate", {"d_model": 2**62}, "d_model", f"d_model = {2**62}"),
    ("translate", {"tgt_vocab_size": 10**9, "tie_embeddings": False}, "tgt_vocab_size", ""),
    ("translate", {"src_vocab_size": "8"}, "src_vocab_size", "got str '8'"),
    ("translate", {"dec_layers": True}, "dec_layers", "got bool True"),
    ("translate", {"n_heads": -2}, "n_heads", ">= 1, got -2"),
    ("translate-rnn", {"d_attention": 10**9}, "d_attention", "d_attention = 1000000000"),
    ("translate-rnn", {"d_encoder": 2**62}, "d_encoder", f"d_encoder = {2**62}"),
    ("translate-rnn", {"tgt_vocab_size": 8.0}, "tgt_vocab_size", "got float 8.0"),
    ("gpt", {"max_seq_len": 10**9}, "max_seq_len", "max_seq_len = 1000000000"),
    ("gpt", {"max_seq_len": 2**62}, "max_seq_len", f"max_seq_len = {2**62}"),
    ("gpt", {"type_vocab_size": 10**9}, "type_vocab_size", "type_vocab_size = 1000000000"),
    ("gpt", {"type_vocab_size": 2**62}, "type_vocab_size", "no model.type_emb.weight"),
    ("gpt", {"n_layers": 10**9}, "n_layers", "1000000000 layer(s)"),
    ("gpt", {"vocab_size": 2**62}, "vocab_size", "model.tok_emb.weight has shape (6, 8)"),
    ("gpt", {"n_heads": True}, "n_heads", "got bool True"),
    ("gpt", {"d_model": "8"}, "d_model", "got str '8'"),
    ("gpt", {"n_layers": -1}, "n_layers", ">= 0, got -1"),
    ("rnn", {"n_layers": 10**9}, "n_layers", "1000000000 layer(s)"),
    ("rnn", {"d_hidden": 2**62}, "d_hidden", f"d_hidden = {2**62}"),
    ("rnn", {"vocab_size": True}, "vocab_size", "got bool True"),
    ("vit", {"n_layers": 10**9}, "n_layers", "1000000000 layer(s)"),
    ("vit", {"d_model": 2**62}, "d_model", "model.cls_token has shape (1, 1, 8)"),
    ("vit", {"num_classes": -3}, "num_classes", ">= 1, got -3"),
    ("vit", {"image_size": "4"}, "image_size", "got str '4'"),
    ("classify", {"encoder.n_layers": 10**9}, "encoder.n_layers", "1000000000 layer(s)"),
    ("classify", {"encoder.max_seq_len": 2**62}, "encoder.max_seq_len", "has shape (6, 8)"),
    ("classify", {"encoder.type_vocab_size": 2**62}, "encoder.type_vocab_size", "must be 0"),
    ("classify", {"max_len": True}, "max_len", "got bool True"),
]


@pytest.mark.parametrize(
    ("kind", "edits", "field", "shown"),
    CRAFTED,
    ids=[f"{k}-{'-'.join(f'{f}={v!r:.12}' for f, v in e.items())}" for k, e, _, _ in CRAFTED],
)
def test_a_crafted_stored_config_is_refused_at_once_naming_the_field(
    tmp_path, kind, edits, field, shown
):
    path = app_file(tmp_path / "crafted.safetensors", kind, edits)
    msg = refused_quickly(lambda: load_any(path), rf"(: |; ){re.escape(field)}\b")
    assert msg.startswith(f"{path}: ") and shown in msg, msg


GPT_CRAFTED = [row for row in CRAFTED if row[0] == "gpt"]


@pytest.mark.parametrize(("kind", "edits", "field", "shown"), GPT_CRAFTED)
def test_every_gpt_loader_justifies_the_stored_config(tmp_path, kind, edits, field, shown):
    """`attnlab.apps.gpt.load` (behind ``attnlab generate`` and ``visualize --checkpoint``)
    refuses what `load_any` refuses, as fast."""
    from attnlab.apps.gpt import load

    path = app_file(tmp_path / "crafted.safetensors", kind, edits)
    msg = refused_quickly(lambda: load(path), rf"(: |; ){re.escape(field)}\b")
    assert shown in msg, msg
