"""The RNN language-model baseline (``attnlab train rnn``): a GRU/LSTM character LM on the GPT's
text, split, batches and loss protocol.

Everything but the model is the GPT trainer's (`attnlab.apps.gpt`): the text (`load_text`, default
the shipped Alice text), the vocabulary (its sorted characters), the split (the last tenth is
validation), random windows of ``seq_len`` characters (`get_batch` with a seeded generator), the
loss (cross-entropy in nats/char, compared with `unigram_entropy`), and the evaluation (`evaluate`:
``eval_batches`` fixed random batches of the validation / training text). The optimisation is
`attnlab.apps.loop.fit`. The checkpoint has kind "rnn", so `attnlab.apps.load_any` reads it.

Example:
    >>> result = train_rnn(RNNTrainSettings(steps=600, out_dir="runs/rnn"))
    >>> model, ck = load("runs/rnn/ckpt.safetensors")
    >>> sample(model, vocab_of(ck), "Alice ", 200, top_k=10)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._files import loads
from .._fit import ConfigRule
from .._shapes import check_int
from ..checkpoint import Checkpoint, CheckpointError
from ..models.rnn import RNNLM, RNNLMConfig, build_rnn_lm
from .gpt_settings import evaluate, get_batch, load_text, sample_chars, unigram_entropy
from .loop import FitHistory, FitSettings, fit, load_model, save_model, write_metrics

KIND = "rnn"
CHECKPOINT_NAME = "ckpt.safetensors"


@dataclass
class RNNTrainSettings:
    """A run of ``attnlab train rnn`` (the data and loss settings are the GPT trainer's defaults).

    Attributes:
        text: a UTF-8 text file; None = the shipped ``alice.txt``.
        out_dir: where ``ckpt.safetensors``, ``metrics.json`` and ``loss.png`` go.
        steps, batch_size, seq_len: optimizer steps and the B × L character windows.
        cell, d_embed, d_hidden, n_layers, dropout: the `RNNLMConfig` (the defaults have about
            the parameters of the default GPT: 800,041 vs 802,688 on the Alice text).
        lr, min_lr, warmup, weight_decay, grad_clip: AdamW with warmup + cosine decay.
        eval_interval, eval_batches: how often and on how many batches the losses are measured.
        seed: init, batch order and dropout. time_budget: stop after this many seconds.
        precision: "fp32" or "bf16".
    """

    text: str | None = None
    out_dir: str = "runs/rnn"
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    cell: str = "gru"
    d_embed: int = 224
    d_hidden: int = 256
    n_layers: int = 2
    dropout: float = 0.1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_batches: int = 8
    seed: int = 1337
    time_budget: float | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_interval", "eval_batches"):
            check_int(name, getattr(self, name), minimum=1)
        self.fit_settings()  # checks lr, warmup, clipping, budget, precision
        self.model_config(1)  # checks the model's fields

    def model_config(self, vocab_size: int) -> RNNLMConfig:
        """The `RNNLMConfig` of this run for ``vocab_size`` characters."""
        return RNNLMConfig(
            vocab_size=vocab_size,
            d_embed=self.d_embed,
            d_hidden=self.d_hidden,
            n_layers=self.n_layers,
            cell=self.cell,
            dropout=self.dropout,
        )

    def fit_settings(self) -> FitSettings:
        """The `FitSettings` of this run (betas as in the GPT trainer)."""
        return FitSettings(
            steps=self.steps,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup=self.warmup,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            eval_every=self.eval_interval,
            seed=self.seed,
            time_budget=self.time_budget,
            precision=self.precision,
            betas=(0.9, 0.99),
        )


@dataclass
class RNNTrainResult:
    """What `train_rnn` returns; losses in nats/char."""

    model: RNNLM
    vocab: list[str]
    history: FitHistory
    val_history: list[tuple[int, float, float]]  # (step, train loss, val loss)
    unigram_entropy: float
    checkpoint: Path
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class CharData:
    """The GPT trainer's data: vocabulary, train / validation ids, unigram entropy."""

    vocab: list[str]
    train: Tensor
    val: Tensor
    entropy: float


def char_data(text_path: str | None, seq_len: int, device: torch.device | str = "cpu") -> CharData:
    """The text split as `attnlab.apps.gpt.train` splits it (the last tenth is validation)."""
    text = load_text(text_path)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long, device=device)  # (N,)
    if len(data) < 10 * (seq_len + 1):
        raise ValueError(
            f"the text has {len(data)} characters; seq_len={seq_len} needs at least "
            f"{10 * (seq_len + 1)}"
        )
    n_val = len(data) // 10
    train, val = data[:-n_val], data[-n_val:]
    return CharData(vocab, train, val, unigram_entropy(train, len(vocab)))


def lm_loss_at(
    model: nn.Module, data: Tensor, batch_size: int, seq_len: int, seed: int
) -> Callable[[int], Tensor]:
    """``loss_at(step)`` for `fit`: next-character cross-entropy on a random window batch drawn
    from a generator seeded once with ``seed`` (the GPT trainer's batch order)."""
    g = torch.Generator().manual_seed(seed)

    def loss_at(_step: int) -> Tensor:
        x, y = get_batch(data, batch_size, seq_len, g)
        logits = model(x)  # (B, L, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return loss_at


def train_rnn(
    settings: RNNTrainSettings | None = None,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
    plots: bool = True,
) -> RNNTrainResult:
    """Trains an `RNNLM` and writes ``ckpt.safetensors``, ``metrics.json`` and ``loss.png``.

    Args:
        settings: the run (default `RNNTrainSettings()`).
        progress: a progress bar. log: one line per evaluation and a summary.
        device: where the model and the text live (batches drawn with a CPU generator).
        plots: write ``loss.png``.

    Returns:
        An `RNNTrainResult`; ``metrics`` is what ``metrics.json`` holds.
    """
    s = settings if settings is not None else RNNTrainSettings()
    device = torch.device(device)
    data = char_data(s.text, s.seq_len, device)
    torch.manual_seed(s.seed)
    model = RNNLM(s.model_config(len(data.vocab))).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"RNN LM ({s.cell.upper()}, {s.n_layers} × {s.d_hidden}): {n_params / 1e6:.2f}M "
        f"parameters, {len(data.vocab)} characters, {len(data.train)} training / "
        f"{len(data.val)} validation characters; unigram entropy {data.entropy:.3f} nats/char"
    )
    val_history: list[tuple[int, float, float]] = []

    def held_out() -> dict[str, float]:
        v = evaluate(model, data.val, s, seed=s.seed + 1)  # the GPT trainer's protocol
        tr = evaluate(model, data.train, s, seed=s.seed + 2)
        return {"train_loss": tr, "val_loss": v}

    history = fit(
        model,
        lm_loss_at(model, data.train, s.batch_size, s.seq_len, s.seed),
        s.fit_settings(),
        evaluate=held_out,
        desc="train rnn",
        progress=progress,
        log=log,
    )
    val_history = [(int(e["step"]), e["train_loss"], e["val_loss"]) for e in history.evals]
    out = Path(s.out_dir)
    ckpt = save_model(
        out / CHECKPOINT_NAME,
        model,
        kind=KIND,
        config=model.config.to_dict(),
        extra={
            "vocab": json.dumps(data.vocab),
            "settings": json.dumps(asdict(s)),
            "unigram_entropy": repr(data.entropy),
            "step": str(history.steps),
        },
    )
    final = history.evals[-1]
    metrics = {
        "task": "rnn",
        "metric": "val_loss",
        "val_loss": final["val_loss"],
        "train_loss": final["train_loss"],
        "unigram_entropy": data.entropy,
        "val_bits_per_char": final["val_loss"] / math.log(2),
        "steps": history.steps,
        "seconds": history.seconds,
        "stopped_by": history.stopped_by,
        "params": n_params,
        "settings": asdict(s),
        "evals": val_history,
    }
    write_metrics(out, metrics)
    if plots:
        from ..viz.rnn import plot_rnn_losses

        plot_rnn_losses(out / "loss.png", history.train_loss, val_history, data.entropy, s.cell)
    log(
        f"done: step {history.steps}, val loss {final['val_loss']:.3f} nats/char vs unigram "
        f"entropy {data.entropy:.3f} in {history.seconds:.0f} s; checkpoint {ckpt}"
    )
    return RNNTrainResult(model, data.vocab, history, val_history, data.entropy, ckpt, metrics)


# ------------------------------------------------------------------------------ files, sampling
#: How the tensors of an "rnn" checkpoint justify its stored `RNNLMConfig`
#: (`attnlab._fit.justify_config`; names below the ``model.`` prefix).
RULES = (
    ConfigRule("n_layers", low=1, layers="layers"),
    ConfigRule("vocab_size", low=1, tensor="embed.weight", dim=0),
    ConfigRule("d_embed", low=1, tensor="embed.weight", dim=1),
    ConfigRule("d_hidden", low=1, tensor="head.weight", dim=1),
)


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> tuple[RNNLM, Checkpoint]:
    """The `RNNLM` in a checkpoint of kind "rnn" (verified; the stored config must be justified
    by the tensors, layer count included, before anything is allocated) and the checkpoint."""
    model, _config, ck = load_model(
        path,
        KIND,
        build_rnn_lm,
        rules=RULES,
        device=device,
    )
    vocab_of(ck, model.config.vocab_size)
    return model, ck


def vocab_of(ck: Checkpoint, vocab_size: int | None = None) -> list[str]:
    """The characters stored with a checkpoint (checked against ``vocab_size`` when given)."""
    if "vocab" not in ck.metadata:
        raise CheckpointError(ck.path, "has no stored vocab")
    vocab = loads(ck.path, ck.metadata["vocab"], "the stored vocab", 1)
    if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
        raise CheckpointError(ck.path, "the stored vocab must be a JSON list of strings")
    if vocab_size is not None and len(vocab) != vocab_size:
        raise CheckpointError(
            ck.path,
            f"the stored vocab has {len(vocab)} entries but the config's vocab_size is "
            f"{vocab_size}",
        )
    return vocab


def sample(
    model: RNNLM,
    vocab: list[str],
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """Continues ``prompt`` (every character must be in ``vocab``) by sampling the model
    (`attnlab.apps.gpt_settings.sample_chars`, as the GPT app samples)."""
    return sample_chars(
        model, vocab, prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    )


__all__ = [
    "CHECKPOINT_NAME",
    "KIND",
    "CharData",
    "RNNTrainResult",
    "RNNTrainSettings",
    "char_data",
    "lm_loss_at",
    "load",
    "sample",
    "train_rnn",
    "vocab_of",
]
