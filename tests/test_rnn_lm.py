"""`RNNLM` and ``attnlab train rnn``: the recurrent character-LM baseline (issue 17 item 5)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from attnlab.apps import load_any
from attnlab.apps.gpt import evaluate, load_text
from attnlab.apps.loop import save_model
from attnlab.apps.rnn import RNNTrainSettings, char_data, load, sample, train_rnn, vocab_of
from attnlab.checkpoint import CheckpointError
from attnlab.cli import main
from attnlab.cli.tasks import rnn as rnn_task
from attnlab.models import RNNLM, RNNLMConfig, build_rnn_lm


@pytest.fixture(autouse=True)
def _one_thread():
    """Small recurrent steps: one thread is ~10× faster than two when other processes load the
    cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lm(cell: str = "gru", **kw) -> RNNLM:
    torch.manual_seed(0)
    return RNNLM(RNNLMConfig(vocab_size=17, d_embed=12, d_hidden=20, n_layers=2, cell=cell, **kw))


def _tiny(out, **kw) -> RNNTrainSettings:
    sizes = dict(steps=60, batch_size=16, seq_len=32, d_embed=32, d_hidden=96, n_layers=1)
    rates = dict(lr=1e-2, min_lr=1e-3, warmup=5, eval_interval=20, eval_batches=4, dropout=0.0)
    return RNNTrainSettings(out_dir=str(out), **{**sizes, **rates, **kw})


def test_config_round_trip_and_errors():
    cfg = RNNLMConfig(vocab_size=9, d_hidden=16, n_layers=3, cell="lstm", dropout=0.2)
    assert RNNLMConfig.from_dict(cfg.to_dict()) == cfg
    model = build_rnn_lm(cfg.to_dict())
    assert len(model.layers) == 3 and isinstance(model.layers[0], torch.nn.LSTM)
    with pytest.raises(ValueError, match=r"cell must be one of \['gru', 'lstm'\], got 'rnn'"):
        RNNLMConfig(cell="rnn")
    with pytest.raises(ValueError, match="n_layers must be >= 1, got 0"):
        RNNLMConfig(n_layers=0)
    with pytest.raises(ValueError, match=r"unknown RNNLMConfig field\(s\) \['heads'\]"):
        build_rnn_lm({**cfg.to_dict(), "heads": 2})
    with pytest.raises(ValueError, match=r"idx holds token ids in \[\d+, 17\]"):
        _lm()(torch.full((1, 3), 17))
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        _lm().generate(torch.zeros(1, 1, dtype=torch.long), 3, temperature=0)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_state_carries_the_context(cell):
    """Running a sequence in two pieces with the carried state equals running it whole, and a
    position never sees later tokens."""
    model = _lm(cell).eval()
    x = torch.randint(0, 17, (3, 12), generator=torch.Generator().manual_seed(1))
    whole = model(x)
    first, state = model.run(x[:, :5])
    second, _ = model.run(x[:, 5:], state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole)
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 17
    changed = model(y)
    torch.testing.assert_close(changed[:, :7], whole[:, :7])
    assert not torch.allclose(changed[:, 7:], whole[:, 7:])


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_generate_with_state_equals_recomputation(cell):
    """Decoding with the carried state (one step per token) equals recomputing the whole
    context for every token: greedily, and when sampling with the same generator."""
    model = _lm(cell)
    prompt = torch.randint(0, 17, (2, 4), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(prompt, 10, top_k=1)
    sampled = model.generate(
        prompt, 10, temperature=0.8, generator=torch.Generator().manual_seed(3)
    )
    assert model.training  # generate restores the mode
    model.eval()
    ref_greedy, ref_sampled = prompt, prompt
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(10):
            nxt = model(ref_greedy)[:, -1].argmax(-1, keepdim=True)
            ref_greedy = torch.cat([ref_greedy, nxt], 1)
            probs = torch.softmax(model(ref_sampled)[:, -1] / 0.8, -1)
            ref_sampled = torch.cat([ref_sampled, torch.multinomial(probs, 1, generator=g)], 1)
    assert torch.equal(greedy, ref_greedy)
    assert torch.equal(sampled, ref_sampled)


def test_train_rnn_learns_and_writes_its_files(tmp_path):
    s = _tiny(tmp_path / "run")
    result = train_rnn(s, log=lambda _line: None)
    first, last = result.val_history[0][2], result.val_history[-1][2]
    entropy = result.unigram_entropy
    data = char_data(None, s.seq_len)
    torch.manual_seed(s.seed)  # the run's initial weights
    untrained = evaluate(RNNLM(s.model_config(len(data.vocab))), data.val, s, seed=s.seed + 1)
    # untrained ≈ ln(V) = 4.3 nats/char; 60 steps beat the unigram entropy (the best
    # context-free model, 3.12) by a margin and keep improving between evaluations
    assert untrained > 4.0
    assert last < first < untrained
    assert last < entropy - 0.4
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["val_loss"] == pytest.approx(last, rel=0, abs=0)
    assert metrics["unigram_entropy"] == pytest.approx(entropy)
    assert metrics["steps"] == 60 and metrics["machine"]["cpu"]
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    # the checkpoint: kind "rnn", read by load_any, the same model and vocabulary
    kind, model, ck = load_any(result.checkpoint)
    assert kind == "rnn" and isinstance(model, RNNLM) and not model.training
    assert vocab_of(ck) == result.vocab
    x = torch.randint(0, len(result.vocab), (2, 16), generator=torch.Generator().manual_seed(4))
    result.model.eval()
    torch.testing.assert_close(model(x), result.model(x), rtol=0, atol=0)
    # the metric is the GPT trainer's evaluation protocol, recomputed on the loaded model
    assert evaluate(model, data.val, s, seed=s.seed + 1) == pytest.approx(last, abs=1e-6)
    text = sample(model, result.vocab, "Alice ", 40, top_k=5, seed=1)
    assert text.startswith("Alice ") and len(text) == 46


def test_split_is_the_gpt_trainers():
    data = char_data(None, 128)
    text = load_text(None)
    n_val = len(text) // 10
    assert data.vocab == sorted(set(text))
    assert "".join(data.vocab[i] for i in data.val.tolist()) == text[-n_val:]
    assert "".join(data.vocab[i] for i in data.train[:50].tolist()) == text[:50]
    assert len(data.train) + len(data.val) == len(text)
    counts = torch.bincount(data.train, minlength=len(data.vocab)).double()
    p = counts[counts > 0] / counts.sum()
    assert data.entropy == pytest.approx(float(-(p * p.log()).sum()))
    assert 2.5 < data.entropy < math.log(len(data.vocab))


def test_load_refuses_a_config_its_tensors_do_not_justify(tmp_path):
    model = _lm()
    lie = {**model.config.to_dict(), "n_layers": 10**6}
    extra = {"vocab": json.dumps([chr(97 + i) for i in range(17)])}
    save_model(tmp_path / "lie.safetensors", model, kind="rnn", config=lie, extra=extra)
    with pytest.raises(CheckpointError, match="it says 1000000 layer"):
        load(tmp_path / "lie.safetensors")
    wide = {**model.config.to_dict(), "d_hidden": 4096}
    save_model(tmp_path / "wide.safetensors", model, kind="rnn", config=wide, extra=extra)
    with pytest.raises(CheckpointError, match=r"do not justify|differ|shape"):
        load(tmp_path / "wide.safetensors")
    short = {"vocab": json.dumps(["a", "b"])}
    save_model(tmp_path / "v.safetensors", model, kind="rnn", config=model.config.to_dict(),
               extra=short)  # fmt: skip
    with pytest.raises(CheckpointError, match="the stored vocab has 2 entries"):
        load(tmp_path / "v.safetensors")


def test_cli_defaults_mirror_the_settings():
    defaults = asdict(RNNTrainSettings())
    assert {k: defaults[k] for k in rnn_task._DEFAULTS} == rnn_task._DEFAULTS


def test_cli_trains_and_reports_errors_on_one_line(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["train", "rnn", "--steps", "8", "--seq-len", "16", "--d-hidden", "16", "--d-embed"]
    argv += ["8", "--eval-interval", "4", "--eval-batches", "1", "--quiet", "--sample", "10"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sample (top-k 10):\nAlice " in printed
    assert {p.name for p in out.iterdir()} >= {"ckpt.safetensors", "metrics.json", "loss.png"}
    assert json.loads((out / "metrics.json").read_text())["steps"] == 8
    for extra, message in (
        (["--min-lr", "0.1", "--lr", "0.01"], "argument --min-lr: must be <= --lr 0.01, got 0.1"),
        (["--prompt", "Alice §"], "argument --prompt: has characters ['§']"),
        (["--cell", "rnn"], "argument --cell: invalid choice: 'rnn'"),
    ):
        try:
            code = main([*argv, "--out", str(tmp_path / "bad"), *extra])
        except SystemExit as e:  # the parser's own errors
            code = e.code
        assert code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad").exists()
