"""The attnlab command with bad arguments: one stderr line, exit code 2, no traceback, no work.

Every probe runs in-process (`attnlab.cli.main`) with the heavy entry points of the commands
replaced by functions that raise: a probe that starts real work exits with 1, not 2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import attnlab.analysis
import attnlab.apps.gpt
from attnlab import cli
from attnlab.apps import attentions
from attnlab.checkpoint import save_checkpoint
from attnlab.cli import bench, check
from attnlab.models import GPT, TransformerConfig


class HeavyWorkError(RuntimeError):
    pass


def _heavy(*args, **kwargs):
    raise HeavyWorkError("a probe reached the long work")


@pytest.fixture
def no_heavy_work(monkeypatch):
    monkeypatch.setattr(bench, "matmul_rate", _heavy)
    monkeypatch.setattr(check, "check_rows", _heavy)
    monkeypatch.setattr(attnlab.apps.gpt, "train", _heavy)
    monkeypatch.setattr(attentions, "collect", _heavy)
    monkeypatch.setattr(attnlab.analysis, "scaling_experiment", _heavy)
    monkeypatch.setattr(attnlab.analysis, "temperature_experiment", _heavy)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint as `attnlab train` writes it (model tensors, config, vocab), untrained."""
    vocab = sorted(set("Alice was beginning\n"))
    config = TransformerConfig(
        vocab_size=len(vocab), d_model=16, n_layers=1, n_heads=2, max_seq_len=8
    )
    path = tmp_path_factory.mktemp("tiny") / "ckpt.safetensors"
    tensors = {f"model.{k}": v for k, v in GPT(config).state_dict().items()}
    meta = {"config": json.dumps(config.to_dict()), "vocab": json.dumps(vocab)}
    save_checkpoint(path, tensors, meta)
    return path


def run(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``attnlab ARGV`` (parser errors exit through SystemExit)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


# (argv, a text the single error line must contain); {tmp} is a fresh directory, {file} a file
PROBES = [
    (["nosuch"], "invalid choice: 'nosuch' (choose from 'check'"),
    (["check", "-L", "0"], "argument -L: expected an int >= 1, got 0"),
    (["check", "-S", "-3"], "argument -S: expected an int >= 1, got -3"),
    (["check", "--backend", "nope"], "argument --backend: unknown backend(s) ['nope'] (choose"),
    (["check", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["check", "--bogus"], "attnlab check: error: unrecognized arguments: --bogus"),
    (["estimate", "--heads", "7"], "argument --heads: must divide --d-model 768, got 7"),
    (["estimate", "--seq", "0"], "argument --seq: expected an int >= 1, got 0"),
    (["estimate", "--seq", "ten"], "argument --seq: expected an int >= 1, got 'ten'"),
    (["estimate", "--kv-heads", "5"], "argument --kv-heads: must divide --heads 12, got 5"),
    (["estimate", "--batch", "0"], "argument --batch: expected an int >= 1"),
    (["estimate", "--window", "-1"], "argument --window: expected an int >= 1"),
    (["estimate", "--mla", "512"], "argument --mla: expected kv_lora_rank,rope or kv_lora_"),
    (["estimate", "--mla", "0,64"], "argument --mla: kv_lora_rank must be an int >= 1, got 0"),
    (["estimate", "--mla", "512,64", "--io", "9999"], "argument --mla: adds the cache of one"),
    (["experiment", "scaling", "--samples", "0"], "argument --samples: expected an int >= 2"),
    (["experiment", "temperature", "--samples", "1"], "argument --samples: expected an int >= 2"),
    (["experiment", "scaling", "--png", "{tmp}/no/dir/x.png"], "argument --png: cannot write"),
    (["experiment", "scaling", "--png", "{tmp}/x.jpg"], "argument --png: must end in .png, got"),
    (["experiment", "nosuch"], "argument name: invalid choice: 'nosuch'"),
    (["bench", "--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
    (["bench", "--dim", "0"], "argument --dim: expected an int >= 1"),
    (["bench", "--causal-length", "0"], "argument --causal-length: expected an int >= 1"),
    (["bench", "--max-bias-gb", "-1"], "argument --max-bias-gb: expected a finite number in [0"),
    (["bench", "--json", "{tmp}/missing/x.json"], "argument --json: cannot write"),
    (["bench", "--json", "{file}/x.json"], "argument --json: cannot write"),
    (["bench", "--quick", "--plot", "{tmp}"], "argument --plot: '{tmp}' is a directory"),
    (["bench", "--plot", "{tmp}/b.jpeg"], "argument --plot: must end in .png or .svg or .pdf"),
    (["bench", "--case", "nope"], "argument --case: invalid choice: 'nope'"),
    (["train", "--steps", "-1"], "argument --steps: expected an int >= 1, got -1"),
    (["train", "--seq-len", "0"], "argument --seq-len: expected an int >= 1, got 0"),
    (["train", "--lr", "nan"], "argument --lr: expected a finite number in [0, inf), got 'nan'"),
    (["train", "--dropout", "1"], "argument --dropout: expected a finite number in [0, 1)"),
    (["train", "--d-model", "30"], "argument --n-heads: must divide --d-model 30, got 4"),
    (["train", "--n-kv-heads", "3"], "argument --n-kv-heads: must divide --n-heads 4, got 3"),
    (["train", "--lr", "0.01", "--min-lr", "0.1"], "argument --min-lr: must be <= --lr 0.01"),
    (["train", "--threads", "0"], "argument --threads: expected an int >= 1, got 0"),
    (["train", "--text", "{tmp}/missing.txt"], "argument --text: no such file: '"),
    (["train", "--out", "{file}/run"], "argument --out: cannot create directory '"),
    (["train", "--out", "{tmp}", "--resume"], "argument --resume: no checkpoint file '"),
    (["generate"], "the following arguments are required: --checkpoint"),
    (["generate", "--checkpoint", "{tmp}/none.safetensors"], "argument --checkpoint: no such"),
    (["generate", "--checkpoint", "{tmp}"], "argument --checkpoint: not a regular file"),
    (["generate", "--checkpoint", "{file}"], "argument --checkpoint: {file}: "),  # corrupt
    (["generate", "--checkpoint", "{file}", "--top-k", "0"], "argument --top-k: expected an int"),
    (["generate", "--checkpoint", "{file}", "--temperature", "0"], "argument --temperature: "),
    (["generate", "--checkpoint", "{file}", "--max-new-tokens", "-2"], "--max-new-tokens: exp"),
    (["visualize", "--layer", "-1"], "argument --layer: expected an int >= 0, got -1"),
    (["visualize", "--top-k", "0"], "argument --top-k: expected an int >= 1, got 0"),
    (["visualize", "--checkpoint", "{tmp}/none.safetensors"], "argument --checkpoint: no such"),
    (["visualize", "--out", "{tmp}"], "argument --out: '{tmp}' is a directory"),
    (["visualize", "--out", "{tmp}/no/dir/a.html"], "argument --out: cannot write"),
    (["visualize", "--out", "{tmp}/a.html", "--png", "{file}/a.png"], "argument --png: cannot"),
    (["visualize", "--out", "{tmp}/a.png"], "argument --out: must end in .html or .htm, got"),
    (["visualize", "--png", "{tmp}/a.jpg"], "argument --png: must end in .png, got"),
    (["visualize", "--format", "pdf"], "argument --format: invalid choice: 'pdf'"),
]


@pytest.mark.parametrize("argv, expected", PROBES, ids=[" ".join(p[0]) for p in PROBES])
def test_bad_arguments_give_one_line_and_exit_2(argv, expected, tmp_path, capsys, no_heavy_work):
    file = tmp_path / "a-file"
    file.write_bytes(b"not a checkpoint")
    fill = {"tmp": str(tmp_path), "file": str(file)}
    code, err = run([a.format(**fill) for a in argv], capsys)
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    prefix = "attnlab: error: " if argv[0] == "nosuch" else f"attnlab {argv[0]}: error: "
    assert err.startswith(prefix), err
    assert expected.format(**fill) in err, err
    assert code == 2
    assert not list(tmp_path.rglob("*.png")) + list(tmp_path.rglob("*.json"))  # nothing written


def test_generate_prompt_outside_the_vocabulary(tiny_checkpoint, capsys):
    code, err = run(
        ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "Alice€"], capsys
    )
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "argument --prompt: characters ['€'] are not in the checkpoint's vocabulary" in err
    assert "vocabulary of 13 characters: '\\n Aabcegilnsw'" in err  # the accepted ones
    code, err = run(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", ""], capsys)
    assert (code, err) == (2, "attnlab generate: error: argument --prompt: must not be empty\n")


def test_debug_shows_the_traceback(capsys):
    for argv in (["estimate", "--heads", "7", "--debug"], ["--debug", "estimate", "--heads", "7"]):
        with pytest.raises(ValueError, match="--heads: must divide --d-model 768"):
            cli.main(argv)


def test_an_unexpected_error_is_one_line_with_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(check, "check_rows", lambda *a, **k: 1 / 0)
    code, err = run(["check", "--backend", "sdpa"], capsys)
    assert code == 1
    assert err == (
        "attnlab check: internal error: ZeroDivisionError: division by zero "
        "(run again with --debug for the traceback)\n"
    )


def test_bench_quick_keeps_explicit_lengths(monkeypatch, capsys):
    monkeypatch.setattr(bench, "matmul_rate", lambda **kw: 1.0)
    seen = {}

    def record(args, report, progress):
        seen.update(window=args.window_length, causal=args.causal_length)

    monkeypatch.setattr(bench, "case_window", record)
    argv = ["bench", "--case", "window", "--quick", "--quiet", "--causal-length", "300"]
    assert cli.main(argv) == 0
    assert seen == {"window": 16384 // 8, "causal": 300}
    assert cli.main(["bench", "--case", "window", "--quiet", "--window-length", "512"]) == 0
    assert seen == {"window": 512, "causal": 8192}
    capsys.readouterr()


def test_bench_json_is_checked_before_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "matmul_rate", _heavy)
    code, err = run(["bench", "--json", str(tmp_path / "x" / "b.json")], capsys)
    assert code == 2 and "HeavyWorkError" not in err
    assert err.strip().endswith(f"no directory '{tmp_path / 'x'}'")


def test_entry_point_and_closed_pipe_are_quiet():
    """The real entry point: a bad argument is one line; a closed stdout is no BrokenPipeError."""
    bad = subprocess.run(
        [sys.executable, "-m", "attnlab", "estimate", "--heads", "7"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "attnlab estimate: error: argument --heads: must divide --d-model 768, got 7 "
        "(e.g. one of [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])"
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "estimate"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # like `| head` that has already exited: every write fails with EPIPE
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141
    assert err == ""
