"""Character-level GPT training and sampling: the app behind ``attnlab train`` / ``generate``.

`train` fits a `GPT` to a text file (default: the shipped public-domain ``alice.txt``) with
AdamW, linear warmup then cosine decay (or the inverse-square-root "noam" schedule of Vaswani et
al. 2017), gradient clipping, optional bf16 or fp16 autocast (fp16 with dynamic loss scaling by
`torch.amp.GradScaler`) and gradient checkpointing. It reports the loss in nats per character
next to the text's unigram entropy (the loss of the best model that ignores context) and the
gradient norm of every layer, saves a verified checkpoint atomically (one safetensors file with
model, optimizer, loss-scaler and RNG state and the torch thread count, so ``--resume``
continues bit-exactly) plus a checksummed ``config.json``, a loss-curve PNG and a per-layer
gradient-norm PNG, all written atomically (a killed run leaves no temp file that the next run
does not remove). `sweep` runs a grid of small runs over learning rate and warmup (the ablation
behind ``attnlab train --sweep``).
Launched by ``torchrun``, `train` runs data- or context-parallel on every rank
(`attnlab.distributed.ddp`). `load` reads a checkpoint back (verified, as every app's;
`vocab_of` gives its vocabulary) and `sample_text` continues a prompt.

The run's parts live beside this module: `attnlab.apps.gpt_settings` (settings, text, batches,
schedule, gradient norms, evaluation), `attnlab.apps.gpt_files` (checkpoint, temp files, PNGs)
and `attnlab.apps.gpt_sweep` (the ablation's grid and results); their public names are this
module's too.

Example:
    $ attnlab train --steps 600 --out runs/alice
    $ attnlab train --steps 200 --schedule noam --precision fp16 --out runs/noam16
    $ attnlab train --steps 200 --out runs/sweep --sweep lr=1e-3,3e-3 warmup=0,50
    $ attnlab generate --checkpoint runs/alice/ckpt.safetensors --prompt "Alice said"
    $ torchrun --nproc-per-node=2 -m attnlab train --out runs/ddp
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._files import loads, save_json
from .._fit import build_checked
from .._shapes import check_int
from ..checkpoint import load_checkpoint
from ..distributed.ddp import Parallel
from ..models import GPT
from ..utils import Progress, Timer
from ..viz.training import plot_grad_norms, plot_losses, plot_sweep
from .gpt_files import (
    KIND,
    THREADS_KEY,
    load,
    remove_stale_run_temps,
    save_run,
    stored_settings,
    stored_threads,
    vocab_of,
    write_png,
)
from .gpt_settings import (
    AUTOCAST_DTYPES,
    CHECKPOINT_NAME,
    PRECISIONS,
    SCHEDULES,
    TrainSettings,
    check_precision,
    evaluate,
    get_batch,
    layer_grad_norms,
    layer_parameters,
    load_text,
    lr_at,
    sample_chars,
    unigram_entropy,
    wide_logits,
)
from .gpt_sweep import SWEEP_AXES, SweepResult, SweepRun, sweep_plan
from .loop import param_groups


@dataclass
class TrainResult:
    """What `train` returns: the model, its vocabulary and the loss history (nats/char)."""

    model: GPT
    vocab: list[str]
    train_losses: list[float]
    val_history: list[tuple[int, float, float]]  # (step, train loss, val loss) at evaluations
    unigram_entropy: float
    step: int
    seconds: float
    checkpoint: Path
    grad_norm_layers: list[str] = field(default_factory=list)
    grad_norms: list[list[float]] = field(default_factory=list)  # per step: one norm per layer
    grad_norm_total: list[float] = field(default_factory=list)  # per step: the global norm


def train(
    settings: TrainSettings | None = None,
    *,
    resume: str | os.PathLike | None = None,
    stop_at: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
    plots: bool = True,
    context_parallel: bool = False,
    threads: int | None = None,
) -> TrainResult:
    """Trains a character-level `GPT`; see the module docstring.

    Args:
        settings: the run (default `TrainSettings()`).
        resume: a checkpoint written by `train`: model, optimizer, RNG states, loss history and
            settings are restored, so the continued run equals an uninterrupted one bit for bit.
            Only ``out_dir`` is taken from ``settings``.
        stop_at: stop (and save) after this step, e.g. to split a run into parts.
        progress: show a tqdm progress bar with loss and tokens/s (if tqdm is installed).
        log: receives one line per evaluation and the summary.
        device: where the model, the text and every batch live (default cpu). The model is
            initialised on the host and moved, and batches are drawn with a CPU generator, so
            the initial weights and batch order do not depend on the device; ``device`` is not a
            setting (a run may resume on another device). The checkpoint stores the CPU RNG
            state; on an accelerator, dropout draws from that device's RNG, which a resume does
            not restore, so there a resumed run equals an uninterrupted one only without dropout.
        plots: write ``loss.png`` and ``grad_norm.png`` with each checkpoint (`sweep` turns
            this off: its runs share one ``sweep.png``).
        context_parallel: with several ranks, shard every sequence across them (ring
            attention) instead of the batch; see `attnlab.distributed.ddp`. The returned model
            then keeps its ring attention (a collective call on shards); `load_model` of the
            checkpoint gives the plain GPT.
        threads: torch intra-op threads for the run (None: as set). Every checkpoint stores the
            count it was trained with, because the float results depend on it (reductions are
            split across threads); resuming with None restores the stored count, so the
            continued run is bit-exact whatever the process's default; a ``threads`` that
            differs from the stored count is used and logged as a warning (the continuation is
            then not bit-exact). The process's count is put back when `train` returns.

    Several ranks: when a default process group is initialised (``torchrun``), every rank calls
    `train` with the same arguments and trains with DistributedDataParallel; every rank draws the
    same global batch and takes its part (`attnlab.distributed.ddp.Parallel`), so the run equals
    one process's up to rounding (without dropout). Rank 0 reads ``resume`` and sends its bytes to
    the others, and alone logs, shows the progress bar and writes files; every rank returns the
    result, with the losses averaged over the ranks.
    """
    previous = torch.get_num_threads()
    try:
        return _train(
            settings,
            resume=resume,
            stop_at=stop_at,
            progress=progress,
            log=log,
            device=device,
            plots=plots,
            context_parallel=context_parallel,
            threads=threads,
        )
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


def _set_threads(
    threads: int | None, stored: int | None, resume: object, log: Callable[[str], None]
) -> None:
    """Sets the run's torch thread count: ``threads``, else the checkpoint's ``stored`` one."""
    if threads is not None:
        check_int("threads", threads, minimum=1)
        torch.set_num_threads(threads)
        if stored is not None and stored != threads:
            log(
                f"warning: {resume} was trained with {stored} torch threads, this run uses "
                f"{threads}: the resumed run will not be bit-exact"
            )
    elif stored is not None and stored != torch.get_num_threads():
        torch.set_num_threads(stored)


def _char_data(s: TrainSettings, ck: Any, device: torch.device) -> tuple[list[str], Tensor, Tensor]:
    """The text's vocabulary (the checkpoint's when resuming) and its train / validation ids.

    Raises:
        ValueError: characters outside a checkpoint's vocabulary; fewer than 10·(seq_len + 1).
    """
    text = load_text(s.text)
    vocab = sorted(set(text)) if ck is None else vocab_of(ck)
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(f"the text has characters {unknown} outside the checkpoint's vocabulary")
    data = torch.tensor([index[c] for c in text], dtype=torch.long, device=device)  # (N,)
    if len(data) < 10 * (s.seq_len + 1):
        raise ValueError(
            f"the text has {len(data)} characters; seq_len={s.seq_len} needs at least "
            f"{10 * (s.seq_len + 1)}"
        )
    n_val = len(data) // 10
    return vocab, data[:-n_val], data[-n_val:]


def _check_stored_settings(ck: Any, resume: str | os.PathLike | None, config: Any) -> None:
    """Raises unless a GPT of the stored settings has exactly the checkpoint's tensors (a
    resumed run; nothing to check for a new one, ``ck`` None)."""
    if ck is None:
        return
    build_checked(
        resume,
        lambda: GPT(config),
        {k: (t.dtype, tuple(t.shape)) for k, t in ck.tensors.items()},
        prefix="model.",
        layers=("blocks", config.n_layers),
        what="the stored settings",
    )


def _restore_run(
    ck: Any,
    resume: str | os.PathLike,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    batch_rng: torch.Generator,
    par: Parallel,
    seed: int,
) -> int:
    """Loads a checkpoint's weights, optimizer, scaler and random states; returns its step."""
    ck.load_into(model, prefix="model.")
    state = opt.state_dict()
    for key, value in ck.tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            state["state"].setdefault(int(i), {})[name] = value
    opt.load_state_dict(state)
    batch_rng.set_state(ck.tensors["rng.batch"])
    torch.set_rng_state(ck.tensors["rng.torch"])
    step = int(ck.metadata["step"])
    if par.mode != "single":
        par.restore_rng(ck.tensors.get("rng.torch_ranks"), seed, step)
    if scaler.is_enabled():
        scaler.load_state_dict(loads(resume, ck.metadata["grad_scaler"], "the scaler", 1))
    return step


def _restored_logs(
    ck: Any, resume: str | os.PathLike, layers: list[str], step: int
) -> tuple[list[float], list[tuple[int, float, float]], list[list[float]], list[float]]:
    """A checkpoint's loss, validation and gradient-norm logs (NaN norms before that log)."""
    losses = ck.tensors["log.train_loss"].tolist()
    val = [(int(a), b, c) for a, b, c in ck.tensors["log.val"].tolist()]
    stored_layers = loads(resume, ck.metadata.get("grad_norm_layers", "[]"), "the layers", 1)
    if "log.grad_norm" in ck.tensors and stored_layers == layers:
        norms = ck.tensors["log.grad_norm"].tolist()
        totals = ck.tensors["log.grad_norm_total"].tolist()
    else:  # a checkpoint from before the gradient-norm log: those steps are unknown
        norms = [[math.nan] * len(layers) for _ in range(step)]
        totals = [math.nan] * step
    return losses, val, norms, totals


def _train(
    settings: TrainSettings | None,
    *,
    resume: str | os.PathLike | None,
    stop_at: int | None,
    progress: bool,
    log: Callable[[str], None],
    device: torch.device | str,
    plots: bool,
    context_parallel: bool,
    threads: int | None,
) -> TrainResult:
    """`train` without putting the process's thread count back."""
    device = torch.device(device)
    s = settings if settings is not None else TrainSettings()
    par = Parallel.current(context_parallel)
    if not par.is_main:
        progress, plots = False, False
        log = lambda _line: None  # noqa: E731
    ck = None
    if resume is not None:
        ck = par.load_shared(resume, load_checkpoint)  # rank 0's file, on every rank
        # settings added later (schedule, precision) take their defaults in older checkpoints
        s = replace(stored_settings(resume, ck.metadata), out_dir=s.out_dir)
    _set_threads(threads, stored_threads(ck.metadata) if ck else None, resume, log)
    if par.is_main and Path(s.out_dir).is_dir():
        remove_stale_run_temps(Path(s.out_dir))  # what a killed run left (SIGKILL, power loss)
    check_precision(s.precision, device)
    par.check(
        batch_size=s.batch_size, seq_len=s.seq_len, dropout=s.dropout, positional=s.positional
    )
    vocab, train_data, val_data = _char_data(s, ck, device)
    entropy = unigram_entropy(train_data, len(vocab))

    config = s.model_config(len(vocab))
    _check_stored_settings(ck, resume, config)  # a resumed run's settings vs its tensors
    torch.manual_seed(s.seed)
    model = par.prepare(GPT(config).to(device))  # context parallel: ring attention
    model.gradient_checkpointing = s.grad_checkpointing
    par.seed(s.seed)  # several ranks: a dropout stream each
    opt = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.lr, betas=(0.9, 0.99))
    scaler = torch.amp.GradScaler(device.type, enabled=s.precision == "fp16")
    groups = layer_parameters(model)
    layers = list(groups)
    batch_rng = torch.Generator().manual_seed(s.seed)
    losses: list[float] = []
    val: list[tuple[int, float, float]] = []
    norms: list[list[float]] = []
    totals: list[float] = []
    step = 0
    if ck is not None:
        assert resume is not None
        step = _restore_run(ck, resume, model, opt, scaler, batch_rng, par, s.seed)
        losses, val, norms, totals = _restored_logs(ck, resume, layers, step)
        log(f"resumed from {resume} at step {step} (torch threads: {torch.get_num_threads()})")
    net = par.wrap(model)  # DistributedDataParallel on several ranks

    if stop_at is not None:
        check_int("stop_at", stop_at, minimum=step + 1, maximum=s.steps)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"GPT: {n_params / 1e6:.2f}M parameters, {len(vocab)} characters, "
        f"{len(train_data)} training / {len(val_data)} validation characters; "
        f"unigram entropy {entropy:.3f} nats/char ({entropy / math.log(2):.2f} bits)"
        + ("" if par.mode == "single" else f"; {par.describe()}")
    )
    out = Path(s.out_dir)
    last = stop_at if stop_at is not None else s.steps
    bar = Progress(
        range(step, last), desc="train", initial=step, total=s.steps, unit="step", enabled=progress
    )
    write = bar.write if bar.active else log
    ckpt = out / CHECKPOINT_NAME
    model.train()
    timer = Timer()
    tokens = 0
    autocast_dtype = AUTOCAST_DTYPES.get(s.precision, torch.float32)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x, y = get_batch(train_data, s.batch_size, s.seq_len, batch_rng)  # the global batch
        x_local, y_local = par.local(x, y)  # this rank's rows or sequence shards
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=s.precision != "fp32"):
            logits = net(x_local)  # (B_local, L_local, V)
        loss = nn.functional.cross_entropy(wide_logits(logits).flatten(0, 1), y_local.flatten())
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # fp16: loss × scale, so small gradients do not flush to 0
        scaler.unscale_(opt)  # true gradients from here on (a no-op unless fp16)
        layer_norms = layer_grad_norms(groups)  # (n_layers,) before clipping
        if s.grad_clip > 0:
            total = nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        else:
            total = torch.linalg.vector_norm(layer_norms)
        scaler.step(opt)  # fp16: skipped when a gradient is inf/NaN (the scale then shrinks)
        scaler.update()
        losses.append(par.mean(loss.detach()).item())  # the global batch's mean loss
        norms.append(layer_norms.tolist())
        totals.append(float(total))
        tokens += x.numel()
        done = step + 1
        if bar.active:
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}",
                gnorm=f"{totals[-1]:.3g}",
                tok_s=f"{tokens / timer.lap():.0f}",
            )
            tokens = 0
        if done % s.eval_interval == 0 or done == s.steps:
            v = evaluate(model, val_data, s, seed=s.seed + 1, parallel=par)
            tr = evaluate(model, train_data, s, seed=s.seed + 2, parallel=par)
            val.append((done, tr, v))
            per_layer = ", ".join(f"{n} {g:.3g}" for n, g in zip(layers, norms[-1], strict=True))
            scale = f" · loss scale {scaler.get_scale():g}" if scaler.is_enabled() else ""
            write(
                f"step {done}/{s.steps}: train {tr:.3f}, val {v:.3f} nats/char "
                f"(unigram entropy {entropy:.3f}) · lr {lr_at(step, s):.2e} · "
                f"{timer.seconds:.0f} s\n  grad norm {totals[-1]:.3g} ({per_layer}){scale}"
            )
        if (s.save_interval and done % s.save_interval == 0) or done in (s.steps, last):
            rng_ranks = par.rng_states()  # collective: every rank takes part
            if par.is_main:
                ckpt = save_run(
                    out, model, opt, batch_rng, s, vocab, done, losses, val, entropy,
                    layers, norms, totals, scaler, rng_ranks,
                )  # fmt: skip
            if plots:
                write_png(out / "loss.png", lambda p: plot_losses(p, losses, val, entropy))
                write_png(
                    out / "grad_norm.png", lambda p: plot_grad_norms(p, layers, norms, totals)
                )
    bar.close()
    seconds = timer.seconds
    step = len(losses)
    if val:
        v = val[-1][2]
        log(
            f"done: step {step}, val loss {v:.3f} nats/char vs unigram entropy {entropy:.3f} "
            f"({v / math.log(2):.2f} vs {entropy / math.log(2):.2f} bits/char) in {seconds:.0f} s"
            f"; checkpoint {ckpt}"
        )
    return TrainResult(
        model, vocab, losses, val, entropy, step, seconds, ckpt, layers, norms, totals
    )


# ------------------------------------------------------------------------------------ ablation
def sweep(
    base: TrainSettings,
    grid: dict[str, Sequence[float | int]],
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
) -> SweepResult:
    """The learning-rate / warmup ablation: one `train` run per point of the grid.

    Every point of the Cartesian product of ``grid`` (axes ``lr`` and/or ``warmup``) is trained
    from ``base`` (same seed, so the same initial weights and batches) into
    ``base.out_dir/<axis>=<value>_...`` (a checkpoint each, no per-run PNGs); the result lists
    each run's final train and validation loss. All settings are checked before the first run
    starts.

    Args:
        base: the settings every run shares (its ``out_dir`` holds the runs).
        grid: e.g. ``{"lr": [1e-3, 3e-3], "warmup": [0, 100]}``.
        progress: a progress bar over the runs. log: one line per finished run.
        device: as in `train`.

    Returns:
        A `SweepResult` (``table()``, ``to_dict()``, ``best()``).
    """
    clean, points, settings = sweep_plan(base, grid)
    bar = Progress(total=len(settings), desc="sweep", unit="run", enabled=progress)
    write = bar.write if bar.active else log
    runs = []
    entropy = math.nan
    for point, s in zip(points, settings, strict=True):
        bar.step(", ".join(f"{k}={v:g}" for k, v in point.items()))
        r = train(s, log=lambda _line: None, device=device, plots=False)
        entropy = r.unigram_entropy
        _, tr, v = r.val_history[-1]
        runs.append(SweepRun(point, tr, v, r.train_losses, r.seconds, s.out_dir))
        bar.set_postfix(val=f"{v:.3f}")
        write(f"{s.out_dir}: final train {tr:.4f}, val {v:.4f} nats/char ({r.seconds:.1f} s)")
    bar.close()
    return SweepResult(base, clean, runs, entropy)


def write_sweep(result: SweepResult, out_dir: str | os.PathLike) -> list[Path]:
    """Writes ``sweep.json`` (strict JSON), ``sweep.txt`` (the table) and ``sweep.png`` (when
    matplotlib is installed) into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.txt"]
    save_json(paths[0], result.to_dict())
    paths[1].write_text(result.table() + "\n", encoding="utf-8")
    if write_png(out / "sweep.png", lambda p: plot_sweep(p, result)):
        paths.append(out / "sweep.png")
    return paths


# ------------------------------------------------------------------------------------ sampling
def sample_text(
    model: GPT,
    vocab: list[str],
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
    seed: int = 0,
) -> str:
    """Continues ``prompt`` (every character must be in ``vocab``) by sampling the model on its
    device (`attnlab.apps.gpt_settings.sample_chars`; ``use_cache``: a KV cache per layer)."""
    return sample_chars(
        model,
        vocab,
        prompt,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        use_cache=use_cache,
    )


__all__ = [
    "CHECKPOINT_NAME",
    "KIND",
    "PRECISIONS",
    "SCHEDULES",
    "SWEEP_AXES",
    "THREADS_KEY",
    "SweepResult",
    "SweepRun",
    "TrainResult",
    "TrainSettings",
    "check_precision",
    "evaluate",
    "get_batch",
    "layer_grad_norms",
    "layer_parameters",
    "load",
    "load_text",
    "lr_at",
    "remove_stale_run_temps",
    "sample_text",
    "stored_settings",
    "stored_threads",
    "sweep",
    "sweep_plan",
    "train",
    "unigram_entropy",
    "vocab_of",
    "write_sweep",
]
