"""attnlab.apps.gpt: a tiny run learns, resume is bit-exact, the CLI trains and samples."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest
import torch

from attnlab._files import load_json
from attnlab.apps.gpt import (
    TrainSettings,
    load,
    lr_at,
    sample_text,
    train,
    unigram_entropy,
    vocab_of,
)
from attnlab.checkpoint import CheckpointError
from attnlab.cli.generate import register as register_generate
from attnlab.cli.train import register as register_train
from attnlab.data import default_text_path

TINY = dict(
    steps=40,
    batch_size=16,
    seq_len=32,
    d_model=32,
    n_layers=1,
    n_heads=2,
    dropout=0.0,
    lr=1e-2,
    min_lr=1e-3,
    warmup=5,
    eval_interval=10,
    eval_batches=2,
    save_interval=0,
)


def _quiet(_line: str) -> None:
    pass


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is ~10× faster than two when other processes load the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnlab")
    sub = parser.add_subparsers(dest="command")
    register_train(sub)
    register_generate(sub)
    return parser


def test_shipped_text_is_small_public_domain_alice():
    path = default_text_path()
    text = path.read_text(encoding="utf-8")
    assert path.stat().st_size < 1_000_000
    assert "ALICE'S ADVENTURES IN WONDERLAND" in text[:200] and "\r" not in text
    assert (path.parent / "README.md").read_text().count("public domain") >= 1


def test_unigram_entropy_matches_hand_value():
    ids = torch.tensor([0, 0, 1])
    want = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert unigram_entropy(ids, 5) == pytest.approx(want, abs=1e-12)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine():
    s = TrainSettings(steps=110, lr=1.0, min_lr=0.1, warmup=10)
    assert [lr_at(i, s) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(10, s) == pytest.approx(1.0)
    assert lr_at(60, s) == pytest.approx(0.55)  # halfway: min + (max − min)/2
    assert lr_at(110, s) == pytest.approx(0.1)
    lrs = [lr_at(i, s) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_settings_validation():
    with pytest.raises(ValueError, match=r"steps must be >= 1, got 0"):
        TrainSettings(steps=0)
    with pytest.raises(ValueError, match=r"min_lr must be <= lr=0.001, got 0.01"):
        TrainSettings(lr=1e-3, min_lr=1e-2)


def test_tiny_run_loss_falls_below_the_unigram_entropy(tmp_path):
    result = train(TrainSettings(out_dir=str(tmp_path), **TINY), log=_quiet)
    first_val, last_val = result.val_history[0][2], result.val_history[-1][2]
    assert len(result.train_losses) == 40
    assert result.train_losses[0] > math.log(result.model.config.vocab_size) - 0.5  # ~ uniform
    assert last_val < first_val - 0.2
    assert last_val < result.unigram_entropy  # it uses context, not just letter frequencies
    assert (tmp_path / "ckpt.safetensors").exists()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    side = load_json(tmp_path / "config.json")  # checksummed
    assert side["config"] == result.model.config.to_dict() and side["step"] == 40
    model, ck = load(tmp_path / "ckpt.safetensors")
    vocab = vocab_of(ck)
    assert vocab == result.vocab and ck.metadata["step"] == "40"
    idx = torch.randint(0, len(vocab), (2, 16))
    assert torch.equal(model(idx), result.model.eval()(idx))


def test_resume_continues_bit_exactly(tmp_path):
    kw = {**TINY, "steps": 8, "dropout": 0.1, "eval_interval": 4}
    straight = train(TrainSettings(out_dir=str(tmp_path / "a"), **kw), log=_quiet)
    part = TrainSettings(out_dir=str(tmp_path / "b"), **kw)
    first = train(part, stop_at=4, log=_quiet)
    assert len(first.train_losses) == 4
    resumed = train(part, resume=tmp_path / "b" / "ckpt.safetensors", log=_quiet)
    assert resumed.train_losses == straight.train_losses
    assert resumed.val_history == straight.val_history
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_bf16_autocast_and_gradient_checkpointing_still_learn(tmp_path):
    kw = {**TINY, "steps": 20, "bf16": True, "grad_checkpointing": True}
    result = train(TrainSettings(out_dir=str(tmp_path), **kw), log=_quiet)
    assert result.model.gradient_checkpointing
    assert all(math.isfinite(x) for x in result.train_losses)
    losses = result.train_losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_cli_train_then_generate(tmp_path, capsys):
    out = tmp_path / "run"
    args = _parser().parse_args(
        ["train", "--out", str(out), "--steps", "6", "--batch-size", "4", "--seq-len", "16",
         "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
         "--eval-interval", "3", "--eval-batches", "1", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "unigram entropy" in printed and "val loss" in printed
    ckpt = str(out / "ckpt.safetensors")
    texts = []
    for extra in ([], ["--no-cache"]):
        args = _parser().parse_args(
            ["generate", "--checkpoint", ckpt, "--prompt", "Alice", "--max-new-tokens", "30",
             "--top-k", "5", "--seed", "3", *extra]
        )  # fmt: skip
        assert args.func(args) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("Alice") and len(texts[0]) == len("Alice") + 30 + 1
    assert texts[0] == texts[1]  # the KV cache changes nothing but speed


def test_cli_resume_refuses_conflicting_settings(tmp_path, capsys):
    args = _parser().parse_args(["train", "--resume", "--steps", "9", "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert "remove ['--steps']" in capsys.readouterr().err


def test_cli_help_describes_the_commands():
    parser = _parser()
    for cmd in ("train", "generate"):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([cmd, "--help"])
        assert info.value.code == 0


def test_corrupted_checkpoint_is_refused_by_generate(tmp_path):
    train(TrainSettings(out_dir=str(tmp_path), **{**TINY, "steps": 2}), log=_quiet)
    path = tmp_path / "ckpt.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load(path)


def test_sample_text_rejects_unknown_characters(tmp_path):
    result = train(TrainSettings(out_dir=str(tmp_path), **{**TINY, "steps": 1}), log=_quiet)
    with pytest.raises(ValueError, match=r"prompt has characters \['€'\] that are not in"):
        sample_text(result.model, result.vocab, "A€", 5)
