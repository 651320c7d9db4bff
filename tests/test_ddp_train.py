"""Training on several ranks (issue 17 item 6): DDP and context parallel equal one process.

Two gloo ranks are spawned once for the module (`run_local`); they run every scenario and return
what the tests compare with one-process runs made here. Tolerances: the DESIGN.md rule
(`attnlab.testing.assert_close_rule`): the two-rank fp32 result may differ from the float64 run of
the same training by at most 2× (values) / 3× (gradients) the one-process fp32 run's difference,
plus a floor, and it must pass the fixed fp32 table; float64 comparisons use the float64 table.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attnlab.apps.gpt as train_mod
from attnlab import cli
from attnlab.apps.gpt import TrainSettings, load, train
from attnlab.distributed.ddp import Parallel
from attnlab.distributed.launch import free_port, run_local
from attnlab.models import GPT, TransformerConfig
from attnlab.testing import FIXED_TABLE, assert_close_rule

SRC = Path(__file__).resolve().parents[1] / "src"


def _settings(out: Path, **changes: object) -> TrainSettings:
    """A tiny GPT run on the Alice text: 8 steps of 4 × 16 characters, evaluated twice."""
    base = dict(
        out_dir=str(out),
        steps=8,
        batch_size=4,
        seq_len=16,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        dropout=0.0,
        warmup=2,
        eval_interval=4,
        eval_batches=1,
        save_interval=0,
        seed=3,
    )
    return TrainSettings(**{**base, **changes})


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(settings: TrainSettings, **kwargs: object) -> dict:
    lines: list[str] = []
    r = train(settings, log=lines.append, plots=False, **kwargs)
    return {
        "losses": r.train_losses,
        "val": r.val_history,
        "gnorm": r.grad_norm_total,
        "log": lines,
        "params": _params(r.model),
    }


# ------------------------------------------------------------------ run on the spawned ranks
CURVES = {"data": False, "context": True}  # 2 sequences / 8 positions of each per rank


def _curves(root: Path) -> dict:
    return {name: _run(_settings(root / name), context_parallel=cp) for name, cp in CURVES.items()}


def _resume(root: Path) -> dict:
    """6 steps with dropout at once, and as 3 + 3 steps through a checkpoint."""
    whole = _run(_settings(root / "whole", steps=6, dropout=0.1))
    first = _settings(root / "parts", steps=6, dropout=0.1)
    train(first, stop_at=3, log=lambda _line: None, plots=False)
    parts = _run(first, resume=root / "parts" / train_mod.CHECKPOINT_NAME)
    return {"whole": whole, "parts": parts}


def _half(root: Path) -> None:
    """The first 4 of the 8 steps of `_settings` on the ranks, kept in ``root/half``."""
    train(_settings(root / "half"), stop_at=4, log=lambda _line: None, plots=False)


def _missing_resume(root: Path) -> str:
    """Resuming from a file rank 0 cannot read: the error each rank raises."""
    try:
        train(_settings(root / "missing"), resume=root / "no-such.safetensors", log=print)
    except Exception as e:  # the test compares the type and the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, par: Parallel) -> tuple:
    """The mean cross-entropy over the global batch and the gradients of every parameter."""
    net = par.wrap(model)
    x_local, y_local = par.local(x, y)
    logits = net(x_local)  # (B, L_local, V)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), y_local.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return par.mean(loss.detach()), grads


def _context_exactness() -> dict:
    """Forward and backward of a GPT, context parallel versus one process, per positional."""
    results = {}
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 50, (3, 16), generator=g)  # (B, L)
    y = torch.randint(0, 50, (3, 16), generator=g)  # (B, L)
    for positional in ("rope", "learned", "sinusoidal", None):
        cfg = TransformerConfig(
            vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
            positional=positional,
        )  # fmt: skip
        torch.manual_seed(0)
        base = GPT(cfg)
        out = {}
        for dtype in (torch.float32, torch.float64):
            model = copy.deepcopy(base).to(dtype)
            one = _loss_and_grads(copy.deepcopy(model), x, y, Parallel())
            par = Parallel.current(context_parallel=True)
            cp = _loss_and_grads(par.prepare(copy.deepcopy(model)), x, y, par)
            out[dtype] = {"one": one, "cp": cp}
        results[positional] = out
    return results


class _Array:
    """A tensor sent back from a rank by value (numpy), not through shared memory."""

    def __init__(self, t: torch.Tensor) -> None:
        self.array = t.detach().cpu().numpy()


def _map(obj: object, fn) -> object:
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return fn(obj)


def _send(obj: object) -> object:
    return _map(obj, lambda v: _Array(v) if isinstance(v, torch.Tensor) else v)


def _receive(obj: object) -> object:
    return _map(obj, lambda v: torch.from_numpy(v.array) if isinstance(v, _Array) else v)


def _scenarios(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    result = {
        "curves": _curves(root / "curves"),
        "resume": _resume(root / "resume"),
        "exact": _context_exactness(),  # collective: every rank takes part
        "missing": _missing_resume(root),
        "half": _half(root),
    }
    return _send(result)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("ddp")
    results = run_local(_scenarios, 2, str(root), timeout=240, threads=1)
    for status, payload in results:
        assert status == "ok", payload
    return [_receive(payload) for _, payload in results], root


# ------------------------------------------------------------------------------ one process
def _double_gpt(config: TransformerConfig) -> GPT:
    """The GPT that `train` builds (same fp32 initial weights), in float64."""
    return GPT(config).double()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process fp32 run of `_settings` and its float64 twin (same initial weights)."""
    root = tmp_path_factory.mktemp("one")
    fp32 = _run(_settings(root / "fp32"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "GPT", _double_gpt)
        fp64 = _run(_settings(root / "fp64"))
    return {"fp32": fp32, "fp64": fp64}


def _curve(run: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-step losses and the evaluations' (train, val) losses as float64 tensors."""
    losses = torch.tensor(run["losses"], dtype=torch.float64)
    val = torch.tensor([[t, v] for _, t, v in run["val"]], dtype=torch.float64)
    return losses, val


@pytest.mark.parametrize("name", list(CURVES))
def test_two_ranks_follow_the_one_process_loss_curve(ranks, one_process, name):
    """DDP and context parallel: the loss curve and the evaluations of one process (rule)."""
    per_rank, _ = ranks
    ref = one_process
    got = [_curve(r["curves"][name]) for r in per_rank]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])  # all ranks
    gold, naive = _curve(ref["fp64"]), _curve(ref["fp32"])
    assert len(got[0][0]) == 8 and [s for s, _, _ in per_rank[0]["curves"][name]["val"]] == [4, 8]
    for i, what in enumerate(("train loss curve", "evaluations")):
        impl = got[0][i].float()  # each value is a float32 loss
        assert_close_rule(impl, gold[i], naive[i].float(), kind="fwd", name=f"{name}: {what}")
    # the gradient is the global batch mean's: a sum over the ranks would double its norm, which
    # Adam's invariance to the gradient's scale would hide from the losses
    norms = [
        torch.tensor(r["gnorm"], dtype=torch.float64)
        for r in (per_rank[0]["curves"][name], ref["fp64"], ref["fp32"])
    ]
    assert_close_rule(norms[0].float(), norms[1], norms[2].float(), kind="grad", name="grad norm")
    # the run learns (so the curve compared is not flat)
    assert got[0][0][-1] < got[0][0][0] - 0.1


def test_only_rank_zero_logs_and_the_checkpoint_is_a_plain_gpt(ranks):
    per_rank, root = ranks
    for name in CURVES:
        assert per_rank[0]["curves"][name]["log"] and not per_rank[1]["curves"][name]["log"]
        path = root / "curves" / name / train_mod.CHECKPOINT_NAME
        model, _ = load(path)  # no "module." prefix, attention stored as usual
        for n, p in model.named_parameters():
            assert torch.equal(p, per_rank[0]["curves"][name]["params"][n]), n
            assert torch.equal(p, per_rank[1]["curves"][name]["params"][n]), n
    assert "data parallel on 2 ranks" in per_rank[0]["curves"]["data"]["log"][0]
    assert (
        "context parallel (ring attention) on 2 ranks" in per_rank[0]["curves"]["context"]["log"][0]
    )


def test_two_rank_run_resumes_bit_exactly_with_dropout(ranks):
    """3 + 3 steps through a checkpoint = 6 steps, with dropout: each rank's RNG is restored."""
    per_rank, _ = ranks
    for r in per_rank:
        whole, parts = r["resume"]["whole"], r["resume"]["parts"]
        assert parts["losses"] == whole["losses"] and parts["val"] == whole["val"]
        for n, p in whole["params"].items():
            assert torch.equal(parts["params"][n], p), n
    # every rank reports the global batch's mean loss
    assert per_rank[0]["resume"]["whole"]["losses"] == per_rank[1]["resume"]["whole"]["losses"]


def test_one_process_continues_a_two_rank_checkpoint(ranks, one_process, tmp_path):
    """4 steps on 2 ranks + 4 in one process: the one-process curve, by the rule."""
    _, root = ranks
    r = _run(_settings(tmp_path), resume=root / "half" / train_mod.CHECKPOINT_NAME)
    got, gold, naive = _curve(r), _curve(one_process["fp64"]), _curve(one_process["fp32"])
    assert len(got[0]) == 8
    assert_close_rule(got[0].float(), gold[0], naive[0].float(), kind="fwd", name="loss curve")
    assert_close_rule(got[1].float(), gold[1], naive[1].float(), kind="fwd", name="evaluations")


def test_a_checkpoint_rank_zero_cannot_read_fails_on_every_rank(ranks):
    per_rank, root = ranks
    assert per_rank[0]["missing"].startswith("FileNotFoundError: ")
    assert "no-such.safetensors" in per_rank[0]["missing"]
    assert per_rank[1]["missing"] == (
        f"RuntimeError: rank 0 could not read {str(root / 'no-such.safetensors')!r}"
    )


@pytest.mark.parametrize("positional", ["rope", "learned", "sinusoidal", None])
def test_context_parallel_forward_and_backward_equal_one_process(ranks, positional):
    per_rank, _ = ranks
    out = per_rank[0]["exact"][positional]
    # float64: the fixed float64 table (loss forward, parameter gradients backward)
    (loss1, grads1), (loss2, grads2) = out[torch.float64]["one"], out[torch.float64]["cp"]
    fa, fr, ga, gr = FIXED_TABLE[torch.float64]
    torch.testing.assert_close(loss2, loss1, atol=fa, rtol=fr)
    assert grads2.keys() == grads1.keys()
    for n in grads1:
        torch.testing.assert_close(grads2[n], grads1[n], atol=ga, rtol=gr, msg=n)
    # float32: the rule against the float64 run of the same weights
    (naive_loss, naive_grads), (loss, grads) = out[torch.float32]["one"], out[torch.float32]["cp"]
    assert_close_rule(loss, loss1, naive_loss, kind="fwd", name="loss")
    for n in grads1:
        assert_close_rule(grads[n], grads1[n], naive_grads[n], kind="grad", name=n)
        assert grads1[n].abs().max() > 0, n  # every parameter is reached


# ---------------------------------------------------------------------- checks and the CLI
def test_parallel_slices_the_global_batch():
    x = torch.arange(4 * 6).view(4, 6)  # (B, L)
    y = x + 100
    for mode, dim in (("data", 0), ("context", 1)):
        parts = [Parallel(r, 2, mode).local(x, y) for r in range(2)]
        assert torch.equal(torch.cat([p[0] for p in parts], dim), x)
        assert torch.equal(torch.cat([p[1] for p in parts], dim), y)
        assert parts[1][0].shape[dim] == [4, 6][dim] // 2
    assert Parallel().local(x, y) == (x, y)


def test_context_parallel_attention_keeps_the_weights_and_refuses_what_it_cannot_do():
    from attnlab import masks
    from attnlab.distributed.ddp import _ring_of
    from attnlab.modules import KVCache, MultiHeadAttention
    from attnlab.positional import RoPE

    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, num_kv_heads=2, rope=RoPE(8))
    ring = _ring_of(attn, None)
    assert ring.rope is attn.rope and ring.layout == "contiguous"
    want = attn.state_dict()
    assert ring.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[k]) for k, t in ring.state_dict().items())
    x = torch.randn(1, 4, 32)  # (B, L_local, E)
    for kwargs, word in (
        ({"cache": KVCache()}, "cache"),
        ({"need_weights": True}, "need_weights"),
        ({"mask": masks.sliding_window(2)}, "SlidingWindowMask"),
    ):
        with pytest.raises(ValueError, match=word):
            ring(x, **kwargs)


@pytest.mark.parametrize(
    "mode, changes, words",
    [
        ("data", {"batch_size": 3}, ["batch_size", "divisible", "2 data-parallel", "got 3"]),
        ("context", {"seq_len": 15}, ["seq_len", "divisible", "2 context-parallel", "got 15"]),
        ("context", {"dropout": 0.1}, ["dropout=0", "got 0.1"]),
        ("context", {"positional": "alibi"}, ["positional", "ALiBi", "got 'alibi'"]),
    ],
)
def test_parallel_refuses_splits_it_cannot_do(mode, changes, words):
    args = {"batch_size": 4, "seq_len": 16, "dropout": 0.0, "positional": "rope", **changes}
    with pytest.raises(ValueError) as e:
        Parallel(0, 2, mode).check(**args)
    for w in words:
        assert w in str(e.value)
    Parallel(0, 2, mode).check(batch_size=4, seq_len=16, dropout=0.0, positional="rope")


def test_sweep_under_torchrun_is_a_usage_error(monkeypatch, tmp_path, capsys):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    code = cli.main(["train", "--out", str(tmp_path / "s"), "--sweep", "lr=1e-3,3e-3"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attnlab train: error: argument --sweep: trains one process per grid point; "
                   "run it without torchrun"]  # fmt: skip
    assert not (tmp_path / "s").exists()


def _python(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_python_m_attnlab_runs_the_command():
    top = _python("-m", "attnlab", "--help")
    assert top.returncode == 0 and top.stdout.startswith("usage: attnlab"), top.stderr
    assert "train" in top.stdout
    sub = _python("-m", "attnlab", "train", "--help")
    assert sub.returncode == 0 and sub.stdout.startswith("usage: attnlab train"), sub.stderr
    assert "--context-parallel" in sub.stdout and "torchrun" in sub.stdout


def _torchrun() -> str | None:
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else shutil.which("torchrun")


@pytest.mark.slow  # two fresh interpreters importing torch: ~10 s idle, 30 s on busy cores
@pytest.mark.skipif(_torchrun() is None, reason="torchrun is not installed")
@pytest.mark.parametrize("mode", ["data", "context"])
def test_torchrun_trains_end_to_end(tmp_path, mode):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(SRC), "GLOO_SOCKET_IFNAME": "lo"}
    args = [
        _torchrun(), "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "-m", "attnlab", "train", "--steps", "2",
        "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--n-layers", "1",
        "--eval-interval", "2", "--eval-batches", "1", "--quiet", "--out", str(out),
    ]  # fmt: skip
    if mode == "context":
        args += ["--context-parallel", "--dropout", "0"]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:  # torchrun and its workers: one process group, ended together
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.count("wrote ") == 1  # rank 0 alone reports
    kind = "data parallel" if mode == "data" else "context parallel (ring attention)"
    assert f"{kind} on 2 ranks" in stdout
    _, ck = load(out / train_mod.CHECKPOINT_NAME)
    assert ck.metadata["step"] == "2" and ck.tensors["rng.torch_ranks"].shape[0] == 2
    assert (out / "loss.png").stat().st_size > 0
