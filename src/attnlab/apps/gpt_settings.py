"""What a character-level GPT run depends on and measures: its settings, text, batches and
learning-rate schedule, per-layer gradient norms and the held-out loss (`attnlab.apps.gpt`).

The RNN language model (`attnlab.apps.rnn`) shares the text, the batches and the evaluation, so
the two are measured alike.

A part of the GPT app: `attnlab.apps.gpt` hands on its public names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number, stat_dtype
from ..distributed.ddp import Parallel
from ..models import GPT, TransformerConfig
from ..models.config import ATTENTIONS, interleaved_layer_types
from .loop import cosine_lr

CHECKPOINT_NAME = "ckpt.safetensors"
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("cosine", "noam")
#: Autocast dtypes of the 16-bit precisions ("fp32" runs without autocast).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainSettings:
    """Everything a training run depends on (stored in the checkpoint for ``--resume``).

    Attributes:
        text: path of a UTF-8 text file; None = the shipped ``alice.txt``.
        out_dir: where ``ckpt.safetensors``, ``config.json`` and ``loss.png`` go.
        steps: optimizer steps in total. batch_size, seq_len: B and L of each batch.
        d_model, n_layers, n_heads, n_kv_heads, dropout, positional: the `TransformerConfig`
            (with ``sliding_window``, ``local_per_global`` and ``attention`` below).
        lr, min_lr, warmup: peak LR, final LR and linear-warmup steps of the cosine schedule.
            The "noam" schedule uses only ``warmup`` (>= 1) and ``d_model`` (see `lr_at`).
        schedule: "cosine" (linear warmup, cosine decay) or "noam" (inverse square root).
        weight_decay: AdamW decay of weight matrices and embeddings (not biases or norm gains).
        grad_clip: max global gradient norm (0 = off).
        precision: "fp32", "bf16" (bfloat16 autocast of the forward pass) or "fp16" (float16
            autocast plus dynamic loss scaling with `torch.amp.GradScaler`).
        bf16: alias kept for old callers and checkpoints: True means ``precision="bf16"``; after
            construction it always equals ``precision == "bf16"``.
        grad_checkpointing: recompute blocks in backward.
        eval_interval, eval_batches: how often and on how many batches to measure val loss.
        save_interval: checkpoint every this many steps (and at the end).
        seed: seeds init, batch order and dropout.
        sliding_window: W of the sliding layers (`TransformerConfig.sliding_window`), None = none.
        local_per_global: with ``sliding_window``, sliding layers before each full one
            (`interleaved_layer_types`); None = every layer slides (Mistral).
        attention: "softmax" or "local_global" (`TransformerConfig.attention`: local heads
            within ``sliding_window``, global heads over every key).
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
    schedule: str = "cosine"
    precision: str = "fp32"
    bf16: bool = False
    grad_checkpointing: bool = False
    eval_interval: int = 100
    eval_batches: int = 8
    save_interval: int = 200
    seed: int = 1337
    sliding_window: int | None = None
    local_per_global: int | None = None
    attention: str = "softmax"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_interval", "eval_batches"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup", "save_interval"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            check_number(name, getattr(self, name), at_least=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr={self.lr}, got {self.min_lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "noam" and self.warmup < 1:
            raise ValueError(f"warmup must be >= 1 with schedule='noam', got {self.warmup}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.bf16, bool):
            raise TypeError(f"bf16 must be a bool, got {self.bf16!r}")
        if self.bf16 and self.precision not in ("fp32", "bf16"):
            raise ValueError(
                f"bf16=True is the alias of precision='bf16'; got precision={self.precision!r}"
            )
        if self.bf16:
            self.precision = "bf16"
        self.bf16 = self.precision == "bf16"
        self._check_windows()

    def _check_windows(self) -> None:
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, minimum=1)
        if self.local_per_global is not None:
            check_int("local_per_global", self.local_per_global, minimum=0)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {list(ATTENTIONS)}, got {self.attention!r}")
        if self.sliding_window is None and (
            self.local_per_global is not None or self.attention != "softmax"
        ):
            raise ValueError(
                f"local_per_global={self.local_per_global} and attention={self.attention!r} "
                "need sliding_window (the window W)"
            )
        if self.attention != "softmax" and self.local_per_global is not None:
            raise ValueError(
                "attention='local_global' puts local heads in every layer: local_per_global "
                f"must be None, got {self.local_per_global}"
            )

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
            sliding_window=self.sliding_window,
            layer_types=None
            if self.local_per_global is None
            else interleaved_layer_types(self.n_layers, self.local_per_global),
            attention=self.attention,
        )


# ------------------------------------------------------------------------------------- the data
def load_text(path: str | os.PathLike | None) -> str:
    """The training text (the shipped ``alice.txt`` when ``path`` is None)."""
    if path is None:
        from ..data import default_text_path

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
    """The learning rate of optimizer step ``step`` (0-based) under ``s.schedule``.

    "cosine": linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr``.
    "noam" (Vaswani et al. 2017, eq. 3), with t = step + 1 and w = warmup:
    ``lr_t = d_model^-0.5 · min(t^-0.5, t · w^-1.5)`` — linear growth for w steps up to the peak
    ``(d_model · w)^-0.5``, then decay as t^-0.5; ``lr`` and ``min_lr`` are not used.
    """
    if s.schedule == "noam":
        t = step + 1
        return s.d_model**-0.5 * min(t**-0.5, t * s.warmup**-1.5)
    return cosine_lr(step, s.steps, s.lr, s.min_lr, s.warmup)


def _layer_of(name: str) -> str:
    """The layer a parameter belongs to: ``blocks.3`` for ``blocks.3.attn.qkv_proj.weight``,
    else the top-level module (``tok_emb``, ``pos_emb``, ``norm_f``, ...)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else parts[0]


def layer_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters grouped by layer (`_layer_of`), in model order; a tied weight
    appears once, under its first name (as in ``model.parameters()``)."""
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(_layer_of(name), []).append(p)
    return groups


@torch.no_grad()
def layer_grad_norms(groups: dict[str, list[nn.Parameter]]) -> Tensor:
    """Per-layer L2 norms of the gradients, ``(n_layers,)`` float64 on the parameters' device.

    ``norm_l = sqrt(Σ_{p in layer l} ||∇p||²)`` (a parameter without a gradient counts 0), so
    ``sqrt(Σ_l norm_l²)`` is the global norm that `torch.nn.utils.clip_grad_norm_` returns.
    Sync-free: the result stays a tensor.
    """
    rows = []
    for params in groups.values():
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            rows.append(torch.zeros((), dtype=torch.float64, device=params[0].device))
            continue
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
        rows.append(torch.linalg.vector_norm(norms))
    return torch.stack(rows)  # (n_layers,)


def check_precision(precision: str, device: torch.device) -> None:
    """Raises ValueError if ``device`` cannot autocast to ``precision`` (checked before training,
    by entering an autocast region and reading back the dtype torch actually enabled)."""
    if precision == "fp32":
        return
    dtype = AUTOCAST_DTYPES[precision]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns and disables autocast for unknown dtypes
        try:
            with torch.autocast(device.type, dtype=dtype):
                ok = torch.is_autocast_enabled(device.type) and (
                    torch.get_autocast_dtype(device.type) == dtype
                )
        except (RuntimeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(
            f"precision={precision!r} needs {dtype} autocast on {device.type}, which this torch "
            f"({torch.__version__}) does not support; use precision='fp32' or another device"
        )
    if precision == "fp16":
        try:
            torch.amp.GradScaler(device.type)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(
                f"precision='fp16' needs torch.amp.GradScaler on {device.type}, which this "
                f"torch ({torch.__version__}) does not provide: {e}"
            ) from None


def wide_logits(logits: Tensor) -> Tensor:
    """Logits for the loss in float32 or wider (bf16/fp16 autocast logits are upcast)."""
    return logits.to(stat_dtype(logits.dtype))


@torch.no_grad()
def evaluate(
    model: GPT, data: Tensor, s: TrainSettings, seed: int, *, parallel: Parallel | None = None
) -> float:
    """Mean cross-entropy (nats/char) on ``eval_batches`` fixed random batches of ``data``.

    With ``parallel`` (several ranks; collective) each rank evaluates its part of the same
    batches and the ranks' means are averaged, which is the mean over the whole batches.
    """
    par = parallel if parallel is not None else Parallel()
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(s.eval_batches):
        x, y = par.local(*get_batch(data, s.batch_size, s.seq_len, g))
        logits = model(x)  # (B, L, V)
        losses.append(nn.functional.cross_entropy(wide_logits(logits).flatten(0, 1), y.flatten()))
    model.train(was_training)
    return float(par.mean(torch.stack(losses).mean()))


def sample_chars(
    model: nn.Module,
    vocab: list[str],
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    **options: object,
) -> str:
    """Continues ``prompt`` by sampling a character model on its device: its
    ``generate(idx, max_new_tokens, temperature, top_k, generator=g, **options)`` (the prompt and
    the sampling generator ``g``, seeded with ``seed``, are created there).

    Raises:
        ValueError: an empty prompt, or characters outside ``vocab`` (listed).
    """
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted(set(prompt) - set(index))
    if unknown:
        raise ValueError(f"prompt has characters {unknown} that are not in the vocabulary")
    if not prompt:
        raise ValueError("prompt must not be empty")
    device = next(model.parameters()).device
    idx = torch.tensor([[index[c] for c in prompt]], dtype=torch.long, device=device)  # (1, L)
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature, top_k, generator=g, **options)
    return "".join(vocab[i] for i in out[0].tolist())
