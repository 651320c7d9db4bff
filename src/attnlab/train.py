"""Character-level GPT training and sampling (the library behind ``attnlab train`` / ``generate``).

`train` fits a `GPT` to a text file (default: the shipped public-domain ``alice.txt``) with
AdamW, linear warmup then cosine decay, gradient clipping, optional bf16 autocast and gradient
checkpointing. It reports the loss in nats per character next to the text's unigram entropy
(the loss of the best model that ignores context), saves a verified checkpoint atomically (one
safetensors file with model, optimizer and RNG state, so ``--resume`` continues bit-exactly)
plus a checksummed ``config.json`` and a loss-curve PNG.

Example:
    $ attnlab train --steps 600 --out runs/alice
    $ attnlab generate --checkpoint runs/alice/ckpt.safetensors --prompt "Alice said"
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from ._files import loads
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    build_checked,
    checkpoint_specs,
    load_checkpoint,
    read_header,
    save_checkpoint,
    save_json,
)
from .models import GPT, TransformerConfig
from .utils import Progress, Timer
from .viz.training import plot_losses

CHECKPOINT_NAME = "ckpt.safetensors"


@dataclass
class TrainSettings:
    """Everything a training run depends on (stored in the checkpoint for ``--resume``).

    Attributes:
        text: path of a UTF-8 text file; None = the shipped ``alice.txt``.
        out_dir: where ``ckpt.safetensors``, ``config.json`` and ``loss.png`` go.
        steps: optimizer steps in total. batch_size, seq_len: B and L of each batch.
        d_model, n_layers, n_heads, n_kv_heads, dropout, positional: the `TransformerConfig`.
        lr, min_lr, warmup: peak LR, final LR and linear-warmup steps of the cosine schedule.
        weight_decay: AdamW decay of weight matrices and embeddings (not biases or norm gains).
        grad_clip: max global gradient norm (0 = off).
        bf16: bfloat16 autocast for the forward pass. grad_checkpointing: recompute blocks.
        eval_interval, eval_batches: how often and on how many batches to measure val loss.
        save_interval: checkpoint every this many steps (and at the end).
        seed: seeds init, batch order and dropout.
    """

    text: str | None = None
    out_dir: str = "runs/alice"
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    dropout: float = 0.1
    positional: str | None = "rope"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = False
    grad_checkpointing: bool = False
    eval_interval: int = 100
    eval_batches: int = 8
    save_interval: int = 200
    seed: int = 1337

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_interval", "eval_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("warmup", "save_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr={self.lr}, got {self.min_lr}")

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """The `TransformerConfig` of this run for a vocabulary of ``vocab_size`` characters."""
        return TransformerConfig(
            vocab_size=vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            max_seq_len=self.seq_len,
            dropout=self.dropout,
            positional=self.positional,
        )


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


# ------------------------------------------------------------------------------------- the data
def load_text(path: str | os.PathLike | None) -> str:
    """The training text (the shipped ``alice.txt`` when ``path`` is None)."""
    if path is None:
        from .data import default_text_path

        path = default_text_path()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    return path.read_text(encoding="utf-8")


def unigram_entropy(ids: Tensor, vocab_size: int) -> float:
    """``H = −Σ_c p(c) ln p(c)`` in nats over the token frequencies of ``ids``."""
    counts = torch.bincount(ids.flatten(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def get_batch(
    data: Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Random windows: inputs ``(B, L)`` and next-character targets ``(B, L)`` on ``data``'s
    device. The start positions are drawn with ``generator`` (a CPU generator gives the same
    batches on every device) and moved to that device."""
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)  # (B,)
    starts = starts.to(data.device)
    offsets = starts[:, None] + torch.arange(seq_len + 1, device=data.device)  # (B, L + 1)
    window = data[offsets]  # (B, L + 1)
    return window[:, :-1], window[:, 1:]


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (s.lr - s.min_lr)


def _groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (dim >= 2), none on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]


@torch.no_grad()
def evaluate(model: GPT, data: Tensor, s: TrainSettings, seed: int) -> float:
    """Mean cross-entropy (nats/char) on ``eval_batches`` fixed random batches of ``data``."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(s.eval_batches):
        x, y = get_batch(data, s.batch_size, s.seq_len, g)
        logits = model(x)  # (B, L, V)
        losses.append(nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))
    model.train(was_training)
    return float(torch.stack(losses).mean())


# ------------------------------------------------------------------------------- checkpointing
def _save(
    out: Path,
    model: GPT,
    opt: torch.optim.Optimizer,
    batch_rng: torch.Generator,
    s: TrainSettings,
    vocab: list[str],
    step: int,
    losses: list[float],
    val: list[tuple[int, float, float]],
    entropy: float,
) -> Path:
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optim.{i}.{name}"] = value
    tensors["rng.batch"] = batch_rng.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["log.train_loss"] = torch.tensor(losses, dtype=torch.float64)
    tensors["log.val"] = torch.tensor(val, dtype=torch.float64).reshape(-1, 3)
    config = model.config.to_dict()
    meta = {
        "config": json.dumps(config),
        "vocab": json.dumps(vocab),
        "settings": json.dumps(asdict(s)),
        "step": str(step),
        "unigram_entropy": repr(entropy),
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / CHECKPOINT_NAME
    save_checkpoint(path, tensors, meta)
    save_json(out / "config.json", {"config": config, "vocab": vocab, "step": step})
    return path


def _stored_config(path: Path, meta: dict[str, str]) -> tuple[TransformerConfig, list[str]]:
    """The `TransformerConfig` and vocabulary in a checkpoint's metadata, validated."""
    missing = [k for k in ("config", "vocab") if k not in meta]
    if missing:
        raise ValueError(f"{path}: not a checkpoint written by attnlab train (no {missing[0]!r})")
    data = loads(path, meta["config"], "the stored config", 4)
    try:
        config = TransformerConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: the stored config: {e}") from None
    vocab = loads(path, meta["vocab"], "the stored vocab", 1)
    if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
        raise CheckpointError(path, "the stored vocab must be a JSON list of strings")
    if len(vocab) != config.vocab_size:
        raise CheckpointError(
            path,
            f"the stored vocab has {len(vocab)} entries but the config's vocab_size is "
            f"{config.vocab_size}",
        )
    return config, vocab


def load_model(
    path: str | os.PathLike, *, device: torch.device | str = "cpu"
) -> tuple[GPT, list[str], Checkpoint]:
    """The `GPT` saved by `train` in ``path`` (verified), its vocabulary and the checkpoint.

    The file is read and verified on the host; the model is then moved to ``device``.

    The stored config is accepted only if the file's tensors justify it, before anything is
    allocated: the header alone is read (`read_header`), the `GPT` is built on the ``meta``
    device and its parameter names, shapes and dtypes must be exactly the file's (and the file
    must hold exactly ``n_layers`` blocks), so a crafted config (``d_model=4096``,
    ``n_layers=10**6``, ``vocab_size=10**12``) is refused at once with a `CheckpointError`
    listing what differs (`attnlab.checkpoint.build_checked`). Only then is the file verified
    and decoded (`load_checkpoint`) and the model built.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a damaged file, a config the tensors do not justify, a bad vocab.
        TypeError, ValueError: a stored config field of the wrong type or value (naming it).
    """
    path = Path(os.fspath(path))
    header = read_header(path)
    config, vocab = _stored_config(path, header.metadata)
    specs = checkpoint_specs(header)
    build_checked(
        path,
        lambda: GPT(config),
        specs,
        prefix="model.",
        layers=("blocks", config.n_layers),
        what="the stored config",
    )
    ck = load_checkpoint(path)
    same = ck.metadata.get("config") == header.metadata["config"] and specs == {
        k: (t.dtype, tuple(t.shape)) for k, t in ck.tensors.items()
    }
    if not same:
        raise CheckpointError(path, "the file changed while it was being loaded")
    model = GPT(config)
    ck.load_into(model, prefix="model.", strict=True)
    return model.to(device), vocab, ck


# ------------------------------------------------------------------------------------ training
def train(
    settings: TrainSettings | None = None,
    *,
    resume: str | os.PathLike | None = None,
    stop_at: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
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
    """
    device = torch.device(device)
    s = settings if settings is not None else TrainSettings()
    ck = None
    if resume is not None:
        ck = load_checkpoint(resume)
        if "settings" not in ck.metadata:
            raise ValueError(f"{resume}: not a checkpoint written by attnlab train (no settings)")
        stored = json.loads(ck.metadata["settings"])
        stored["out_dir"] = s.out_dir
        s = TrainSettings(**{f.name: stored[f.name] for f in fields(TrainSettings)})
    text = load_text(s.text)
    vocab = sorted(set(text)) if ck is None else json.loads(ck.metadata["vocab"])
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
    train_data, val_data = data[:-n_val], data[-n_val:]
    entropy = unigram_entropy(train_data, len(vocab))

    config = s.model_config(len(vocab))
    if ck is not None:  # the stored settings must be justified by the stored tensors
        build_checked(
            resume,
            lambda: GPT(config),
            {k: (t.dtype, tuple(t.shape)) for k, t in ck.tensors.items()},
            prefix="model.",
            layers=("blocks", config.n_layers),
            what="the stored settings",
        )
    torch.manual_seed(s.seed)
    model = GPT(config).to(device)
    model.gradient_checkpointing = s.grad_checkpointing
    opt = torch.optim.AdamW(_groups(model, s.weight_decay), lr=s.lr, betas=(0.9, 0.99))
    batch_rng = torch.Generator().manual_seed(s.seed)
    losses: list[float] = []
    val: list[tuple[int, float, float]] = []
    step = 0
    if ck is not None:
        ck.load_into(model, prefix="model.")
        state = opt.state_dict()
        for key, value in ck.tensors.items():
            if key.startswith("optim."):
                _, i, name = key.split(".", 2)
                state["state"].setdefault(int(i), {})[name] = value
        opt.load_state_dict(state)
        batch_rng.set_state(ck.tensors["rng.batch"])
        torch.set_rng_state(ck.tensors["rng.torch"])
        losses = ck.tensors["log.train_loss"].tolist()
        val = [(int(a), b, c) for a, b, c in ck.tensors["log.val"].tolist()]
        step = int(ck.metadata["step"])
        log(f"resumed from {resume} at step {step}")

    if stop_at is not None and not (
        isinstance(stop_at, int) and not isinstance(stop_at, bool) and step < stop_at <= s.steps
    ):
        raise ValueError(f"stop_at must be an int in ({step}, {s.steps}], got {stop_at!r}")
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"GPT: {n_params / 1e6:.2f}M parameters, {len(vocab)} characters, "
        f"{len(train_data)} training / {len(val_data)} validation characters; "
        f"unigram entropy {entropy:.3f} nats/char ({entropy / math.log(2):.2f} bits)"
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
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x, y = get_batch(train_data, s.batch_size, s.seq_len, batch_rng)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=s.bf16):
            logits = model(x)  # (B, L, V)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        losses.append(loss.item())
        tokens += x.numel()
        done = step + 1
        if bar.active:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / timer.lap():.0f}")
            tokens = 0
        if done % s.eval_interval == 0 or done == s.steps:
            v = evaluate(model, val_data, s, seed=s.seed + 1)
            tr = evaluate(model, train_data, s, seed=s.seed + 2)
            val.append((done, tr, v))
            write(
                f"step {done}/{s.steps}: train {tr:.3f}, val {v:.3f} nats/char "
                f"(unigram entropy {entropy:.3f}) · lr {lr_at(step, s):.2e} · "
                f"{timer.seconds:.0f} s"
            )
        if (s.save_interval and done % s.save_interval == 0) or done in (s.steps, last):
            ckpt = _save(out, model, opt, batch_rng, s, vocab, done, losses, val, entropy)
            plot_losses(out / "loss.png", losses, val, entropy)
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
    return TrainResult(model, vocab, losses, val, entropy, step, seconds, ckpt)


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
    device (the prompt and the sampling generator are created there)."""
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted(set(prompt) - set(index))
    if unknown:
        raise ValueError(f"prompt has characters {unknown} that are not in the vocabulary")
    if not prompt:
        raise ValueError("prompt must not be empty")
    device = next(model.parameters()).device
    idx = torch.tensor([[index[c] for c in prompt]], dtype=torch.long, device=device)  # (1, L)
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature, top_k, use_cache=use_cache, generator=g)
    return "".join(vocab[i] for i in out[0].tolist())


__all__ = [
    "CHECKPOINT_NAME",
    "TrainResult",
    "TrainSettings",
    "evaluate",
    "get_batch",
    "load_model",
    "load_text",
    "lr_at",
    "plot_losses",
    "sample_text",
    "train",
    "unigram_entropy",
]
