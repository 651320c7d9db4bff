"""Bad input to the attnlab command is refused up front (issue #38 item 5), and training runs
resume bit-exactly and leave no temp files when killed.

Every refusal: exit code 2, one stderr line naming the argument, no traceback, within seconds.
The in-process probes replace the commands' long work (`attnlab.apps.gpt.train`, the apps' training
functions, `translate`) with a function that raises, so a probe that gets past the checks ends
with exit code 1 instead of allocating terabytes or running for minutes. The resume and kill
tests run the command in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import attnlab.apps.classify
import attnlab.apps.rnn
import attnlab.apps.translate
import attnlab.apps.vit
from attnlab.cli import train as cli_train
from helpers import run_cli
from test_cli_errors import _heavy

FAST = 10.0  # seconds: a refusal comes before any model is built (imports on a loaded machine)


@pytest.fixture
def no_heavy_work(monkeypatch):
    monkeypatch.setattr(cli_train, "train", _heavy)
    monkeypatch.setattr(attnlab.apps.translate, "train_translate", _heavy)
    monkeypatch.setattr(attnlab.apps.translate, "translate", _heavy)
    monkeypatch.setattr(attnlab.apps.vit, "run", _heavy)
    monkeypatch.setattr(attnlab.apps.rnn, "train_rnn", _heavy)
    monkeypatch.setattr(attnlab.apps.classify, "run", _heavy)
    monkeypatch.setattr(torch, "set_num_threads", _heavy)  # e.g. --threads 100000 accepted


def _refused(argv, capsys, flag, *needles):
    """Runs ``attnlab ARGV`` in-process; asserts the one-line refusal naming ``flag``."""
    start = time.perf_counter()
    code, _, err = run_cli(argv, capsys)
    seconds = time.perf_counter() - start
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert f"argument {flag}" in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert seconds < FAST, f"{seconds:.1f} s"
    return lines[0]


# ------------------------------------------------------------------ sizes: the estimated bytes
SIZES = [
    (["train", "--d-model", "100000000"], "--d-model"),
    (["train", "--n-layers", "100000000"], "--n-layers"),
    (["train", "--batch-size", "100000000"], "--batch-size"),
    (["train", "--seq-len", "10000000", "--positional", "learned"], "--seq-len"),
    (["train", "translate", "--d-model", "100000000"], "--d-model"),
    (["train", "translate", "--layers", "100000000"], "--layers"),
    (["train", "vit", "--d-model", "10000000", "--heads", "1"], "--d-model"),
    (["train", "rnn", "--d-hidden", "100000000"], "--d-hidden"),
    (["train", "classify", "--char-layers", "100000000", "--no-minilm"], "--char-layers"),
]


@pytest.mark.usefixtures("no_heavy_work")
@pytest.mark.parametrize(("argv", "flag"), SIZES, ids=[" ".join(a[1:3]) for a, _ in SIZES])
def test_sizes_that_cannot_fit_are_refused_with_the_estimated_bytes(argv, flag, capsys, tmp_path):
    line = _refused([*argv, "--out", str(tmp_path / "run")], capsys, flag, "needs ≈", "available")
    assert "B" in line.split("needs ≈", 1)[1].split(":")[0]  # a byte count: "7.7 EB"
    assert not (tmp_path / "run").exists()


BOUNDS = [
    (["train", "--n-layers", str(2**31)], "--n-layers", "[1, 1073741824]"),
    (["train", "--seed", "1" + "0" * 30], "--seed", "[0, 4294967295]"),
    (["train", "--steps", str(10**12)], "--steps", "[1, 1000000000]"),
    (["train", "--threads", "100000"], "--threads", "[1, 1024]"),
    (["train", "translate", "--max-digits", "100"], "--max-digits", "[2, 12]"),
    (["train", "translate", "--pool", str(10**10)], "--pool", "[100, 10000000]"),
    (["train", "vit", "--shift", "1000000"], "--shift", "[0, 7]"),
    (["train", "rnn", "--sample", str(10**9)], "--sample", "[0, 1000000]"),
    (["train", "classify", "--seed", str(2**40)], "--seed", "[0, 4294967295]"),
]


@pytest.mark.usefixtures("no_heavy_work")
@pytest.mark.parametrize(
    ("argv", "flag", "bounds"), BOUNDS, ids=[" ".join(a[1:3]) for a, _, _ in BOUNDS]
)
def test_integer_arguments_have_upper_bounds(argv, flag, bounds, capsys, tmp_path):
    _refused([*argv, "--out", str(tmp_path / "run")], capsys, flag, bounds)


def test_translate_beam_is_bounded(capsys, tmp_path):
    ck = tmp_path / "x.safetensors"
    ck.write_bytes(b"not read")
    _refused(["translate", "--checkpoint", str(ck), "--beam", "1000", "one"], capsys, "--beam")


def test_the_parameter_count_is_exact_and_the_defaults_fit():
    from attnlab.apps.gpt import TrainSettings
    from attnlab.cli._budget import parameter_count
    from attnlab.models import GPT

    s = TrainSettings(n_layers=3)
    params, _ = parameter_count(lambda n: GPT(TrainSettings(n_layers=n).model_config(80)), 3)
    assert params == sum(p.numel() for p in GPT(s.model_config(80)).parameters())
    cli_train.check_memory(TrainSettings(), torch.device("cpu"))  # no refusal


def test_the_refusal_names_the_largest_size_and_both_byte_counts():
    from attnlab.cli._args import UsageError
    from attnlab.cli._budget import Estimate, check_fits

    sizes = [("--d-model", 4096, 128), ("--n-layers", 8, 4)]
    with pytest.raises(UsageError) as e:
        check_fits(Estimate(10**9, 0, 10**9), sizes, available=10 * 10**9)
    assert str(e.value) == (
        "argument --d-model: 4096 (with --n-layers 8) needs ≈ 17 GB: 1e+09 parameters with "
        "their gradients and AdamW state ≈ 16 GB, activations ≈ 1 GB; this machine has "
        "10 GB available"
    )
    check_fits(Estimate(10**9, 0, 10**9), sizes, available=18 * 10**9)  # fits


# ----------------------------------------------------------------- visualize --model FOLDER
WORDS = ["the", "cat", "sat", "on", "a", "mat"] + [f"w{i}" for i in range(20)]
SMALL = dict(
    vocab_size=20,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    type_vocab_size=2,
)


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A tiny BERT (vocab_size 20) with a word-level tokenizer of 29 tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**SMALL)).save_pretrained(
        folder, safe_serialization=True
    )
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
    ).save_pretrained(folder)
    return folder


def _copy(folder: Path, to: Path, **changes: object) -> Path:
    import shutil

    shutil.copytree(folder, to)
    config = json.loads((to / "config.json").read_text())
    config.update(changes)
    (to / "config.json").write_text(json.dumps(config))
    return to


def _visualize(folder, text, tmp_path):
    return ["visualize", "--model", str(folder), text, "--out", str(tmp_path / "a.html")]


def test_tokenizer_ids_beyond_the_model_vocabulary(bert_folder, capsys, tmp_path):
    line = _refused(_visualize(bert_folder, "the cat w15", tmp_path), capsys, "--model")
    assert "token id 24 ('w15')" in line
    assert "vocab_size 20" in line and "29 tokens" in line
    code, _, err = run_cli(_visualize(bert_folder, "the cat sat", tmp_path), capsys)
    assert code == 0, err  # ids below vocab_size pass


@pytest.mark.parametrize(
    ("field", "value", "expected", "received"),
    [
        ("num_hidden_layers", "1", "int", "str"),
        ("hidden_size", 16.5, "int", "float"),
        ("vocab_size", [20], "int", "list"),
    ],
)
def test_config_field_of_the_wrong_type(
    bert_folder, field, value, expected, received, capsys, tmp_path
):
    folder = _copy(bert_folder, tmp_path / "m", **{field: value})
    line = _refused(_visualize(folder, "the cat", tmp_path), capsys, "--model")
    assert f"'{field}'" in line and f"expected {expected}" in line and f"got {received}" in line
    assert "config.json" in line


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_deeply_nested_json_in_the_folder(bert_folder, name, capsys, tmp_path):
    folder = _copy(bert_folder, tmp_path / "m")
    text = (folder / name).read_text().rstrip()
    (folder / name).write_text(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = _refused(_visualize(folder, "the cat", tmp_path), capsys, "--model")
    assert name in line and "nests deeper than 64 levels" in line


# --------------------------------------------------------------------- attnlab translate: limit
@pytest.fixture(scope="module")
def translate_checkpoint(tmp_path_factory):
    from attnlab.apps.loop import FitSettings
    from attnlab.apps.translate import TranslateSettings, train_translate

    out = tmp_path_factory.mktemp("translate")
    s = TranslateSettings(
        model={"d_model": 16, "n_heads": 2, "enc_layers": 1, "dec_layers": 1},
        max_digits=3,
        held_out=10,
        pool=100,
        eval_batch=50,
        fit=FitSettings(steps=1, warmup=0, min_lr=1e-4, lr=1e-3),
        threads=1,  # tiny ops: one thread is several times faster on a loaded machine
    )
    before = torch.get_num_threads()
    try:
        train_translate(out, s, log=lambda _line: None)
    finally:
        torch.set_num_threads(before)
    return out / "ckpt.safetensors"


def test_translate_refuses_a_text_over_the_limit(translate_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(attnlab.apps.translate, "translate", _heavy)
    long = ("one hundred and twenty-three " * 250)[:7000]
    argv = ["translate", "--checkpoint", str(translate_checkpoint), "twenty-three", long]
    line = _refused(argv, capsys, "TEXT", "7,000 characters", "at most 256", "one number per TEXT")
    assert "TEXT 2 of 2" in line


def test_translate_limit_in_help_and_library(translate_checkpoint, capsys):
    from attnlab.apps.translate import MAX_SOURCE_CHARS, load, translate, vocab_of

    code, out, _ = run_cli(["translate", "--help"], capsys)
    assert code == 0 and f"at most {MAX_SOURCE_CHARS} characters" in " ".join(out.split())
    code, out, err = run_cli(
        ["translate", "--checkpoint", str(translate_checkpoint), "seven", "one"], capsys
    )
    assert code == 0 and len(out.splitlines()) == 2, err
    model, ck = load(translate_checkpoint)
    with pytest.raises(ValueError, match="more than the 256"):
        translate(model, vocab_of(ck), ["one " * 100], lang="de")


# ------------------------------------------------------------------------------- --resume
TINY = dict(
    steps=8,
    batch_size=4,
    seq_len=32,
    d_model=32,
    n_layers=1,
    n_heads=2,
    eval_interval=4,
    eval_batches=1,
    save_interval=4,
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished tiny run (its checkpoint at step 8)."""
    from attnlab.apps.gpt import TrainSettings, train

    out = tmp_path_factory.mktemp("gpt")
    train(TrainSettings(out_dir=str(out), **TINY), log=lambda _line: None, plots=False)
    return out


def _crafted(run: Path, to: Path, settings: str) -> Path:
    """A copy of ``run``'s checkpoint (sealed anew: it verifies) with other stored settings."""
    from attnlab.checkpoint import load_checkpoint, save_checkpoint

    ck = load_checkpoint(run / "ckpt.safetensors")
    meta = {k: v for k, v in ck.metadata.items() if not k.startswith("attnlab.")}
    meta["settings"] = settings
    to.mkdir()
    save_checkpoint(to / "ckpt.safetensors", dict(ck.tensors), meta)
    return to


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ({"d_model": "32"}, ["'d_model'", "must be int", "got str"]),
        ({"text": [1]}, ["'text'", "must be str or None", "got list"]),
        ({"grad_checkpointing": "yes"}, ["'grad_checkpointing'", "must be bool", "got str"]),
        ({"steps": 8.0}, ["'steps'", "must be int", "got float"]),
    ],
    ids=["d_model", "text", "grad_checkpointing", "steps"],
)
def test_resume_settings_of_the_wrong_type(tiny_run, change, needles, capsys, tmp_path):
    from attnlab.checkpoint import read_header

    settings = json.loads(read_header(tiny_run / "ckpt.safetensors").metadata["settings"])
    out = _crafted(tiny_run, tmp_path / "run", json.dumps({**settings, **change}))
    _refused(["train", "--out", str(out), "--resume", "--quiet"], capsys, "--resume", *needles)


def test_resume_settings_nested_too_deeply(tiny_run, capsys, tmp_path):
    deep = '{"steps": 8, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    out = _crafted(tiny_run, tmp_path / "run", deep)
    _refused(
        ["train", "--out", str(out), "--resume", "--quiet"], capsys, "--resume", "nests deeper"
    )


def _python(code: str, *args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _model_tensors(path: Path) -> dict[str, torch.Tensor]:
    from attnlab.checkpoint import load_checkpoint

    return {k: v for k, v in load_checkpoint(path).tensors.items() if k.startswith("model.")}


def test_resume_restores_the_thread_count_bit_exactly(tmp_path):
    """8 steps straight on 2 threads == 4 steps on 2 threads + a resume in a process whose
    default is 1 thread (OMP_NUM_THREADS=1): the checkpoint's count is restored."""
    from attnlab.apps.gpt import TrainSettings, train

    straight, split = tmp_path / "straight", tmp_path / "split"
    quiet = {"log": lambda _line: None, "plots": False}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(TrainSettings(out_dir=str(straight), **TINY), **quiet)
        train(TrainSettings(out_dir=str(split), **TINY), stop_at=4, **quiet)
    finally:
        torch.set_num_threads(before)
    resumed = _python(
        "import sys; from attnlab.cli import main; sys.exit(main(sys.argv[1:]))",
        *("train", "--out", str(split), "--resume", "--quiet"),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr
    a, b = _model_tensors(straight / "ckpt.safetensors"), _model_tensors(split / "ckpt.safetensors")
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert "at step 4 (torch threads: 2)" in resumed.stdout


def test_resume_with_other_threads_warns(tiny_run, capsys, tmp_path):
    import shutil

    from attnlab.checkpoint import read_header

    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    stored = int(read_header(out / "ckpt.safetensors").metadata["torch_threads"])
    other = 1 if stored != 1 else 2
    before = torch.get_num_threads()
    code, stdout, err = run_cli(
        ["train", "--out", str(out), "--resume", "--threads", str(other), "--quiet"], capsys
    )
    assert code == 0, err
    warnings = [x for x in stdout.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "will not be bit-exact" in warnings[0]
    assert f"trained with {stored} torch threads, this run uses {other}" in warnings[0]
    assert torch.get_num_threads() == before


# ------------------------------------------------------------------------- temp files on kill
KILLER = """
    import os, pathlib, signal, sys, time
    from matplotlib.figure import Figure

    target, sig = sys.argv[1], getattr(signal, sys.argv[2])
    savefig, write_bytes = Figure.savefig, pathlib.Path.write_bytes

    def kill():
        os.kill(os.getpid(), sig)
        time.sleep(60)

    def killing_savefig(self, fname, *args, **kwargs):
        if target == "png":
            with open(fname, "wb") as f:
                f.write(b"half a PNG")
            kill()
        return savefig(self, fname, *args, **kwargs)

    def killing_write_bytes(self, data):
        if target == "config" and self.name == "config.json":
            write_bytes(self, data[:10])
            kill()
        return write_bytes(self, data)

    Figure.savefig, pathlib.Path.write_bytes = killing_savefig, killing_write_bytes
    from attnlab.cli import main
    sys.exit(main(sys.argv[3:]))
"""
SMALLEST = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16"]
SMALLEST += ["--n-layers", "1", "--n-heads", "2", "--eval-interval", "2", "--eval-batches", "1"]


def _temps(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("target", ["png", "config"])
def test_sigterm_while_writing_leaves_no_temp_files(target, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    run = _python(KILLER, target, "SIGTERM", "train", "--out", str(out), *SMALLEST, "--quiet")
    assert (out / "ckpt.safetensors").is_file(), run.stderr  # the kill came after it
    assert _temps(out) == []
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "attnlab train: terminated"


def test_the_next_run_removes_what_a_sigkill_left(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    run = _python(KILLER, "png", "SIGKILL", "train", "--out", str(out), *SMALLEST, "--quiet")
    assert run.returncode == -signal.SIGKILL
    left = _temps(out)
    assert left, "the kill came before the first write"
    run = _python(
        "import sys; from attnlab.cli import main; sys.exit(main(sys.argv[1:]))",
        "train",
        "--out",
        str(out),
        "--resume",
        "--quiet",
    )
    assert run.returncode == 0, run.stderr
    assert _temps(out) == [], left
