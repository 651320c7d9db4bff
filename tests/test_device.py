"""``--device`` on every computing command, and library code that follows its inputs' device
(issue 15 item 9).

There is no GPU here, so devices are tested two ways:

- the command line with devices this machine does not have (``cuda``, ``mps``, ``xpu``), malformed
  strings and ``meta``: one stderr line naming ``--device``, exit code 2, before any work;
- the library with ``meta`` tensors (shapes, no values): forward passes on meta must not create
  tensors on the CPU (`CpuSpy` records every operator whose result lands on the CPU), so nothing
  on those paths hard-codes CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnlab
import attnlab.analysis
import attnlab.analysis.heads
from attnlab import cli, masks
from attnlab.analysis.experiments import scaling_experiment, temperature_experiment
from attnlab.apps.attentions import collect
from attnlab.apps.gpt import TrainSettings, get_batch, load, vocab_of
from attnlab.checkpoint import save_checkpoint
from attnlab.cli import _args, bench, check, generate, train, visualize
from attnlab.models import GPT, TransformerConfig
from attnlab.positional import LearnedPositionalEmbedding, SinusoidalEmbedding
from attnlab.testing import seeded

META = torch.device("meta")
CPU = torch.device("cpu")


class CpuSpy(TorchDispatchMode):
    """Records the operators that produce a CPU tensor (``made``) or read a CPU tensor with more
    than one element (``read``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []
        self.read: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        if any(_on_cpu(t) for t in tree_flatten(out)[0]):
            self.made.append(name)
        if any(_on_cpu(t) and t.numel() > 1 for t in tree_flatten((args, kwargs))[0]):
            self.read.append(name)
        return out


def _on_cpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint as `attnlab train` writes it (model tensors, config, vocab), untrained."""
    vocab = sorted(set("Alice was beginning\n"))
    config = TransformerConfig(
        vocab_size=len(vocab), d_model=16, n_layers=1, n_heads=2, max_seq_len=8
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "ckpt.safetensors"
    tensors = {f"model.{k}": v for k, v in GPT(config).state_dict().items()}
    save_checkpoint(
        path, tensors, {"config": json.dumps(config.to_dict()), "vocab": json.dumps(vocab)}
    )
    return path


# ------------------------------------------------------------------------------ the command line
#: Every subcommand and the smallest other arguments it needs (``{ckpt}``, ``{tmp}`` filled in).
COMMANDS = {
    "check": ["--backend", "sdpa", "--dtype", "float32", "-L", "5", "-S", "7"],
    "estimate": ["--seq", "16", "--d-model", "32", "--heads", "2", "--measure"],
    "experiment": ["scaling", "--samples", "2"],
    "bench": ["--case", "causal", "--quick", "--quiet", "--json", "{tmp}/b.json"],
    "train": ["--steps", "1", "--out", "{tmp}/run", "--quiet"],
    "generate": ["--checkpoint", "{ckpt}", "--prompt", "Alice", "--max-new-tokens", "3"],
    "translate": ["--checkpoint", "{ckpt}", "twenty-three"],
    "visualize": ["--checkpoint", "{ckpt}", "Alice", "--out", "{tmp}/a.html"],
    "heads": ["classify", "--sentences", "1"],
}
#: Commands without ``--device``, with the reason.
HOST_ONLY = {
    "advise": "arithmetic on the cost model; without --gflops it reads this machine's cached "
    "matmul rate (measured on the host once: the advice is for the machine it runs on)",
    "build": "compiles attnlab's C++ kernels for this CPU (host code, no tensors)",
    "info": "reports the host: its CPU, torch and the C++ kernels built for it",
    "textbook": "reproduces the texts' claims in float64 on the host: its printed numbers must be "
    "the same on every machine (docs/textbook.md is checked for drift)",
}
BAD_DEVICES = {
    "cuda": "cuda is not available on this machine (available: cpu), got 'cuda'",
    "cuda:0": "cuda is not available on this machine (available: cpu), got 'cuda:0'",
    "mps": "mps is not available on this machine (available: cpu), got 'mps'",
    "xpu": "xpu is not available on this machine (available: cpu), got 'xpu'",
    "nonsense": "expected a torch device such as cpu, cuda or cuda:0 (available here: cpu), "
    "got 'nonsense'",
    "": "expected a torch device such as cpu, cuda or cuda:0 (available here: cpu), got ''",
    "cpu:1": "there is one cpu device (cpu or cpu:0), got 'cpu:1'",
    "meta": "meta tensors have shapes but no values, so a command has nothing to print or "
    "write; choose one of: cpu; got 'meta'",
}


def _argv(name: str, ckpt, tmp) -> list[str]:
    return [name, *(a.format(ckpt=ckpt, tmp=tmp) for a in COMMANDS[name])]


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``attnlab ARGV`` in-process."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class WorkStartedError(RuntimeError):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work (and the checkpoint load) raises `WorkStartedError`."""

    def work(*args, **kwargs):
        raise WorkStartedError("a --device probe reached the work")

    for module, name in (
        (bench, "matmul_rate"),
        (check, "run_check"),
        (train, "train"),
        (generate, "load"),
        (visualize, "collect"),
        (attnlab.analysis, "measure_estimate"),
        (attnlab.analysis, "scaling_experiment"),
        (attnlab.analysis, "temperature_experiment"),
        (attnlab.analysis.heads, "classify_heads"),
    ):
        monkeypatch.setattr(module, name, work)


def test_device_is_available_as_a_flag_on_every_command():
    """Every subcommand computes something (estimate with --measure), so all take --device."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS) | set(HOST_ONLY)
    for name in HOST_ONLY:
        assert not any("--device" in a.option_strings for a in sub.choices[name]._actions)
    for name, subparser in sub.choices.items():
        if name in HOST_ONLY:
            continue
        action = next((a for a in subparser._actions if "--device" in a.option_strings), None)
        assert action is not None, f"attnlab {name} has no --device"
        assert action.type is _args.device_type and _args.device_type(action.default) == CPU, name


@pytest.mark.parametrize(
    "command,device",
    [(c, d) for c in COMMANDS for d in ("cuda", "nonsense", "meta")]
    + [("check", d) for d in BAD_DEVICES if d not in ("cuda", "nonsense", "meta")],
)
def test_an_unusable_device_is_one_line_exit_2_before_any_work(
    command, device, tiny_checkpoint, tmp_path, capsys, no_work
):
    argv = [*_argv(command, tiny_checkpoint, tmp_path), "--device", device]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert err == f"attnlab {command}: error: argument --device: {BAD_DEVICES[device]}\n"
    assert list(tmp_path.iterdir()) == []  # nothing written, no output directory created


def test_the_real_entry_point_refuses_cuda_before_training(tmp_path):
    """The console path (`python -m attnlab`): one line, no traceback, no output directory."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnlab",
            "train",
            "--device",
            "cuda",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "attnlab train: error: argument --device: cuda is not available on this machine "
        "(available: cpu), got 'cuda'"
    ]
    assert not (tmp_path / "r").exists()


def test_available_devices_lists_what_torch_reports(monkeypatch):
    assert _args.available_devices() == ["cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _args.available_devices() == ["cpu", "cuda:0", "cuda:1"]
    assert _args.device_type("cuda:1") == torch.device("cuda:1")
    assert _args.device_type("cuda") == torch.device("cuda")
    with pytest.raises(Exception, match=r"cuda has 2 device\(s\) here .* got 'cuda:2'"):
        _args.device_type("cuda:2")


@pytest.fixture
def seen_devices(monkeypatch):
    """Wraps each command's library entry point to record the ``device`` it receives."""
    seen: dict[str, object] = {}

    def spy(module, name, label):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            seen[label] = kwargs.get("device")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    spy(check, "run_check", "check")
    spy(attnlab.analysis, "measure_estimate", "estimate")
    spy(attnlab.analysis, "scaling_experiment", "experiment")
    spy(train, "train", "train")
    spy(generate, "load", "generate")
    spy(visualize, "collect", "visualize")
    spy(attnlab.analysis.heads, "classify_heads", "heads")
    real_rate = bench.matmul_rate
    monkeypatch.setattr(
        bench, "matmul_rate", lambda **kw: seen.update(bench=kw.get("device")) or real_rate(n=64)
    )
    return seen


@pytest.mark.parametrize(
    "command,flag",
    # (translate needs a translate checkpoint, not the GPT one: tests/test_translate.py runs it)
    [(c, ["--device", "cpu"]) for c in COMMANDS if c != "translate"]
    + [("generate", ["--device", "cpu:0"]), ("generate", [])],
)
def test_cpu_runs_and_reaches_the_library(
    command, flag, tiny_checkpoint, tmp_path, capsys, seen_devices
):
    if command == "bench":  # the smallest causal case
        flag = [*flag, "--causal-length", "64", "--heads", "1", "--dim", "8", "--repeats", "1"]
    if command == "train":
        flag = [*flag, "--seq-len", "8", "--d-model", "16", "--n-layers", "1", "--n-heads", "2"]
        flag += ["--batch-size", "2", "--eval-batches", "1"]
    code, out, err = _run([*_argv(command, tiny_checkpoint, tmp_path), *flag], capsys)
    assert (code, err) == (0, ""), err
    assert seen_devices == {command: CPU}
    if command == "check":
        assert "· cpu · L=5, S=7" in out and "passed, 0 failed" in out
    if command == "generate":
        assert out.startswith("Alice") and len(out.rstrip("\n")) >= len("Alice")


# ---------------------------------------------------------------------------- library on meta
def _qkv(device=META, L=9, S=11):
    return (
        torch.empty(2, 4, L, 8, device=device),
        torch.empty(2, 2, S, 8, device=device),
        torch.empty(2, 2, S, 8, device=device),
    )


MASKS = {
    "none": lambda: None,
    "causal": masks.causal,
    "sliding_window": lambda: masks.sliding_window(3),
    "padding": lambda: masks.padding([11, 5]),
    "document": lambda: masks.document(torch.tensor([0] * 4 + [1] * 7)),
    "strided": lambda: masks.strided(3),
    "global_local": lambda: masks.global_local(2, 3),
    "bigbird": lambda: masks.bigbird(4, 1, 1, 1, seed=0),
    "from_fn": lambda: masks.from_fn(lambda b, h, i, j: i >= j),
    "causal & ~sliding_window": lambda: masks.causal() & ~masks.sliding_window(2),
}


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flash", "auto"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_attention_on_meta_runs_without_cpu_tensors(backend, mask_name):
    """Forward and backward on meta: meta outputs and gradients, no operator result on the CPU
    (the mask's own small data may be copied to the device; it is built outside the spy)."""
    mask = MASKS[mask_name]()
    if mask is not None:  # first use builds host-side pattern data (bigbird's random table)
        mask.to_dense(9, 11)
    q, k, v = (x.requires_grad_() for x in _qkv())
    spy = CpuSpy()
    with spy:
        out = attnlab.attention(q, k, v, mask=mask, backend=backend)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == (2, 4, 9, 8) and out.is_meta
    assert all(g.is_meta for g in grads)
    assert spy.made == []


def test_flash_runs_a_mask_without_a_spec_on_meta():
    """Was: ValueError "flash under torch.compile needs a mask with a spec" on meta."""
    q, k, v = _qkv()
    out = attnlab.attention(q, k, v, mask=masks.from_fn(lambda b, h, i, j: i >= j), backend="flash")
    assert out.shape == (2, 4, 9, 8) and out.is_meta


@pytest.mark.parametrize("mask_name", ["bigbird", "global_local", "document", "causal", "padding"])
def test_block_map_on_meta_has_the_cpu_shape(mask_name):
    """Was: ``.item()`` (bigbird) or ``nonzero`` (tiles refined exactly) failing on meta."""
    mask = MASKS[mask_name]()
    for L, S in ((9, 11), (13, 11)):  # document ids cover S = 11 keys
        want = mask.block_map(L, S, 4, 4)
        got = mask.block_map(L, S, 4, 4, device=META)
        assert got.is_meta and got.shape == want.shape and got.dtype == want.dtype


def test_bigbird_block_map_is_unchanged_by_the_closed_form_first_cell():
    """The first query cell is ``(S − L) // block`` (was read from a tensor)."""
    mask = masks.bigbird(4, 1, 1, 1, seed=0)
    for L, S in ((9, 11), (11, 9), (13, 13), (3, 17), (17, 3)):
        dense = mask.to_dense(L, S)[0, 0]
        codes = mask.block_map(L, S, 4, 4)[0, 0]
        for qb in range(codes.shape[0]):
            for kb in range(codes.shape[1]):
                tile = dense[qb * 4 : (qb + 1) * 4, kb * 4 : (kb + 1) * 4]
                want = (
                    masks.EMPTY if not tile.any() else masks.FULL if tile.all() else masks.PARTIAL
                )
                assert codes[qb, kb] == want, (L, S, qb, kb)


def test_bigbird_table_is_copied_to_a_device_once():
    mask = masks.bigbird(4, 1, 1, 1, seed=0)
    first = mask.to_dense(9, 11, device=META)
    spy = CpuSpy()
    with spy:
        again = mask.to_dense(9, 11, device=META)
    assert first.is_meta and again.is_meta and again.shape == (1, 1, 9, 11)
    assert spy.read == [] and spy.made == []


def test_learned_positions_from_an_int_follow_the_weight_device():
    """Was: ``torch.arange(L)`` on the CPU and a host range check of it."""
    emb = LearnedPositionalEmbedding(16, 8)
    want = emb(5)
    torch.testing.assert_close(want, emb.weight[:5], rtol=0, atol=0)
    meta = emb.to(META)
    spy = CpuSpy()
    with spy:
        out = meta(9)
    assert out.is_meta and out.shape == (9, 8) and spy.made == []
    assert emb(0).shape == (0, 8)
    with pytest.raises(ValueError, match=r"position 16 is out of range .* max_len=16"):
        emb(17)


def test_sinusoidal_encoding_of_an_int_on_a_device():
    enc = SinusoidalEmbedding(8)
    spy = CpuSpy()
    with spy:
        out = enc(9, device=META)
    assert out.is_meta and out.shape == (9, 8) and spy.made == []
    torch.testing.assert_close(enc(9), enc(torch.arange(9)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"device is for an int L; .* got device='meta'"):
        enc(torch.arange(3), device="meta")


@pytest.mark.parametrize("positional", ["rope", "learned", "sinusoidal", "alibi", None])
def test_gpt_forward_and_generate_on_meta_create_no_cpu_tensors(positional):
    cfg = TransformerConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=4, positional=positional)
    model = GPT(cfg).to(META)
    idx = torch.zeros(2, 7, dtype=torch.long, device=META)
    spy = CpuSpy()
    with spy:
        logits = model(idx)
        out = model.generate(idx[:1, :3], 2, top_k=1)
    assert logits.shape == (2, 7, 50) and logits.is_meta and out.shape == (1, 5) and out.is_meta
    assert spy.made == []


def test_get_batch_builds_windows_on_the_data_device():
    """Only the B start positions are drawn on the CPU generator (device-independent batches)."""
    data = torch.arange(100)
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(data, 3, 5, g)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(x[:, 1:] - x[:, :-1], torch.ones(3, 4))
    spy = CpuSpy()
    with spy:
        xm, ym = get_batch(data.to(META), 3, 5, torch.Generator().manual_seed(0))
    assert xm.is_meta and ym.is_meta and xm.shape == ym.shape == (3, 5)
    assert spy.made == ["randint"]


def test_load_model_maps_the_model_after_the_verified_load(tiny_checkpoint):
    model, ck = load(tiny_checkpoint)
    vocab = vocab_of(ck)
    assert {p.device for p in model.parameters()} == {CPU}
    meta, ck_meta = load(tiny_checkpoint, device="meta")
    vocab_meta = vocab_of(ck_meta)
    assert vocab_meta == vocab and {p.device for p in meta.parameters()} == {META}


def test_train_on_an_explicit_device_equals_the_default(tmp_path):
    kw = dict(steps=2, batch_size=2, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    kw.update(eval_interval=2, eval_batches=1)
    a = attnlab.apps.gpt.train(TrainSettings(out_dir=str(tmp_path / "a"), **kw), log=lambda s: None)
    b = attnlab.apps.gpt.train(
        TrainSettings(out_dir=str(tmp_path / "b"), **kw), log=lambda s: None, device="cpu"
    )
    assert a.train_losses == b.train_losses and a.val_history == b.val_history


def test_experiments_seeded_and_collect_take_a_device(tiny_checkpoint):
    assert seeded(2, 3, seed=1, device=META).is_meta
    assert torch.equal(seeded(2, 3, seed=1, device="cpu"), seeded(2, 3, seed=1))
    one = scaling_experiment(d_ks=(4,), samples=8, device="cpu")
    assert one.rows == scaling_experiment(d_ks=(4,), samples=8).rows
    t = temperature_experiment(temperatures=(1.0,), samples=8, device="cpu")
    assert t.rows == temperature_experiment(temperatures=(1.0,), samples=8).rows
    run = collect("Alice", checkpoint=str(tiny_checkpoint), device="cpu")
    assert run.weights.device == CPU and run.weights.shape == (1, 2, 5, 5)
    est = attnlab.analysis.estimate(16, 32, 2)
    attnlab.analysis.measure_estimate(est, ("naive",), device="cpu")
    assert est.measured["naive"]["seconds"] > 0


@pytest.mark.parametrize("fused", [True, False])
def test_prune_heads_keeps_the_weights_device_and_dtype(fused):
    """Was: index rows and new projections built on the CPU in float32, then moved."""
    from attnlab.modules import MultiHeadAttention

    kw = {} if fused else {"kdim": 12}
    mha = MultiHeadAttention(16, 4, **kw).to(META, torch.float64)
    spy = CpuSpy()
    with spy:
        mha.prune_heads([1])
    params = list(mha.parameters())
    assert {p.device for p in params} == {META} and {p.dtype for p in params} == {torch.float64}
    assert mha.num_heads == 3 and mha.out_proj.weight.shape == (16, 12)
    assert spy.made == []


def test_head_output_norms_stay_on_the_model_device():
    """Was: the ``(modules, H)`` table built on the CPU (``.cpu()`` of each row)."""
    from attnlab.analysis.importance import output_norm

    cfg = TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    want = output_norm(model)
    assert want.shape == (2, 4) and bool(torch.isfinite(want).all())
    spy = CpuSpy()
    with spy:
        got = output_norm(model.to(META))
    assert got.is_meta and got.shape == want.shape and spy.made == []


def test_bench_waits_for_an_asynchronous_device_in_every_timed_call(monkeypatch):
    """CUDA kernels return before they finish: each timed call ends with a synchronize."""
    from attnlab.utils import Progress

    waits: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    calls: list[int] = []
    times = bench.interleaved(
        {"a": lambda: calls.append(1)}, 2, Progress(enabled=False), "x", torch.device("cuda")
    )
    assert len(calls) == 3 and waits == [torch.device("cuda")] * 3  # warm-up + 2 rounds
    assert times["a"] >= 0
    bench.interleaved({"a": lambda: calls.append(1)}, 1, Progress(enabled=False), "x", CPU)
    assert len(calls) == 5 and len(waits) == 3  # the cpu is synchronous: no wait


def test_resume_takes_a_device_without_calling_it_a_changed_setting(tmp_path, capsys, monkeypatch):
    """``--device`` is not a stored setting: a run may continue on another device."""
    seen = {}
    monkeypatch.setattr(train, "train", lambda settings, **kw: seen.update(kw) or 1 / 0)
    (tmp_path / "ckpt.safetensors").write_bytes(b"")
    code, _, err = _run(["train", "--out", str(tmp_path), "--resume", "--device", "cpu"], capsys)
    assert code == 1 and "ZeroDivisionError" in err  # reached train(...), which then failed
    assert seen["device"] == CPU and seen["resume"] == str(tmp_path / "ckpt.safetensors")


def _modules_on_meta():
    from attnlab.models import BertConfig, BertEncoder, Encoder
    from attnlab.modules import (
        AdditiveAttention,
        FNetMixing,
        KVCache,
        LinearAttention,
        MultiHeadAttention,
        PerformerAttention,
        SinkCache,
        SlidingWindowCache,
    )
    from attnlab.nn import MultiheadAttention
    from attnlab.positional import RoPE

    x = torch.empty(2, 9, 16, device=META)
    q = torch.empty(2, 4, 9, 8, device=META)
    ids = torch.zeros(2, 9, dtype=torch.long, device=META)
    bert = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=32,
    )
    mha = MultiHeadAttention(16, 4).to(META)
    torch_mha = MultiheadAttention(16, 4, batch_first=True).to(META)
    linear = LinearAttention().to(META)
    performer = PerformerAttention(8, seed=0).to(META)
    additive = AdditiveAttention(16, 16, 8).to(META)
    rope = RoPE(8).to(META)
    encoder = Encoder(TransformerConfig(vocab_size=50, d_model=16, n_heads=4)).to(META)
    bert_encoder = BertEncoder(bert).to(META)
    return {
        "MultiHeadAttention causal": lambda: mha(x, mask=masks.causal()),
        "MultiHeadAttention KVCache": lambda: mha(x, cache=KVCache()),
        "MultiHeadAttention SlidingWindowCache": lambda: mha(x, cache=SlidingWindowCache(4)),
        "MultiHeadAttention SinkCache": lambda: mha(x, cache=SinkCache(2, 4)),
        "torch-compatible MultiheadAttention": lambda: torch_mha(x, x, x)[0],
        "LinearAttention": lambda: linear(q, q, q),
        "PerformerAttention": lambda: performer(q, q, q),
        "AdditiveAttention": lambda: additive(x, x)[0],
        "FNetMixing": lambda: FNetMixing()(x),
        "RoPE": lambda: rope(q, torch.arange(9, device=META)),
        "Encoder": lambda: encoder(ids),
        "BertEncoder": lambda: bert_encoder(ids).last_hidden_state,
    }


def test_modules_and_models_run_on_meta_without_cpu_tensors():
    for name, forward in _modules_on_meta().items():
        spy = CpuSpy()
        with spy:
            out = forward()
        assert isinstance(out, torch.Tensor) and out.is_meta, name
        assert spy.made == [], (name, spy.made)
