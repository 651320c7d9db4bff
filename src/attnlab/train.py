"""Character-level GPT training and sampling (the library behind ``attnlab train`` / ``generate``).

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
(`attnlab.distributed.ddp`).

Example:
    $ attnlab train --steps 600 --out runs/alice
    $ attnlab train --steps 200 --schedule noam --precision fp16 --out runs/noam16
    $ attnlab train --steps 200 --out runs/sweep --sweep lr=1e-3,3e-3 warmup=0,50
    $ attnlab generate --checkpoint runs/alice/ckpt.safetensors --prompt "Alice said"
    $ torchrun --nproc-per-node=2 -m attnlab train --out runs/ddp
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ._files import STALE_SECONDS, atomic_write, loads, remove_stale_temps
from .apps.loop import cosine_lr, param_groups
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    build_checked,
    checkpoint_specs,
    justify_config,
    load_checkpoint,
    read_header,
    save_checkpoint,
    save_json,
)
from .distributed.ddp import Parallel
from .models import GPT, TransformerConfig
from .models.config import checkpoint_rules
from .utils import Progress, Timer
from .viz.training import plot_grad_norms, plot_losses, plot_sweep

CHECKPOINT_NAME = "ckpt.safetensors"
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("cosine", "noam")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainSettings:
    """Everything a training run depends on (stored in the checkpoint for ``--resume``).

    Attributes:
        text: path of a UTF-8 text file; None = the shipped ``alice.txt``.
        out_dir: where ``ckpt.safetensors``, ``config.json`` and ``loss.png`` go.
        steps: optimizer steps in total. batch_size, seq_len: B and L of each batch.
        d_model, n_layers, n_heads, n_kv_heads, dropout, positional: the `TransformerConfig`.
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
    grad_norm_layers: list[str] = field(default_factory=list)
    grad_norms: list[list[float]] = field(default_factory=list)  # per step: one norm per layer
    grad_norm_total: list[float] = field(default_factory=list)  # per step: the global norm


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


def _check_precision(precision: str, device: torch.device) -> None:
    """Raises ValueError if ``device`` cannot autocast to ``precision`` (checked before training,
    by entering an autocast region and reading back the dtype torch actually enabled)."""
    if precision == "fp32":
        return
    dtype = _AUTOCAST_DTYPES[precision]
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


def _wide(logits: Tensor) -> Tensor:
    """Logits for the loss in float32 or wider (bf16/fp16 autocast logits are upcast)."""
    return logits if logits.dtype == torch.float64 else logits.float()


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
        losses.append(nn.functional.cross_entropy(_wide(logits).flatten(0, 1), y.flatten()))
    model.train(was_training)
    return float(par.mean(torch.stack(losses).mean()))


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
    layers: list[str],
    norms: list[list[float]],
    totals: list[float],
    scaler: torch.amp.GradScaler,
    rng_ranks: Tensor | None = None,
) -> Path:
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optim.{i}.{name}"] = value
    tensors["rng.batch"] = batch_rng.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if rng_ranks is not None:  # several ranks: each one's dropout stream, (W, n)
        tensors["rng.torch_ranks"] = rng_ranks
    tensors["log.train_loss"] = torch.tensor(losses, dtype=torch.float64)
    tensors["log.val"] = torch.tensor(val, dtype=torch.float64).reshape(-1, 3)
    tensors["log.grad_norm"] = torch.tensor(norms, dtype=torch.float64).reshape(-1, len(layers))
    tensors["log.grad_norm_total"] = torch.tensor(totals, dtype=torch.float64)
    config = model.config.to_dict()
    meta = {
        "config": json.dumps(config),
        "vocab": json.dumps(vocab),
        "settings": json.dumps(asdict(s)),
        "step": str(step),
        "unigram_entropy": repr(entropy),
        "grad_norm_layers": json.dumps(layers),
        "grad_scaler": json.dumps(scaler.state_dict() if scaler.is_enabled() else {}),
        THREADS_KEY: str(torch.get_num_threads()),  # the float results depend on it
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / CHECKPOINT_NAME
    save_checkpoint(path, tensors, meta)
    save_json(out / "config.json", {"config": config, "vocab": vocab, "step": step})
    return path


#: Checkpoint metadata key of the torch intra-op thread count the run was trained with.
THREADS_KEY = "torch_threads"


def _type_name(kind: object) -> str:
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _field_types() -> dict[str, tuple[type, ...]]:
    """The JSON types each `TrainSettings` field accepts (from its annotation)."""
    hints = typing.get_type_hints(TrainSettings)
    out: dict[str, tuple[type, ...]] = {}
    for f in fields(TrainSettings):
        hint = hints[f.name]
        kinds = typing.get_args(hint) if typing.get_args(hint) else (hint,)
        if float in kinds and int not in kinds:
            kinds = (*kinds, int)  # JSON writes 1.0 as 1
        out[f.name] = tuple(kinds)
    return out


def stored_settings(path: str | os.PathLike, meta: dict[str, str]) -> TrainSettings:
    """The `TrainSettings` stored in a checkpoint's metadata by `train`, checked field by field.

    The JSON is parsed with its nesting bounded (a flat object; deeper nesting is refused
    before parsing, never a RecursionError), every field must have its annotated type (an int
    is not a bool, a str is not a number) and then pass `TrainSettings`' value checks. Settings
    added after a checkpoint was written take their defaults.

    Raises:
        CheckpointError: no settings, not JSON, nested too deeply, not an object.
        TypeError: a field of the wrong type (naming the field, expected and received types).
        ValueError: a field of the right type but a bad value (naming it).
    """
    path = Path(os.fspath(path))
    if "settings" not in meta:
        raise CheckpointError(path, "not a checkpoint written by attnlab train (no settings)")
    data = loads(path, meta["settings"], "the stored settings", 2)
    if not isinstance(data, dict):
        raise CheckpointError(
            path, f"the stored settings must be a JSON object, got {type(data).__name__}"
        )
    types = _field_types()
    for name, value in data.items():
        kinds = types.get(name)
        if kinds is None:
            continue  # a setting of a later version: ignored, as before
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok:
            expected = " or ".join(_type_name(k) for k in kinds)
            raise TypeError(
                f"{path}: the stored settings: field {name!r} must be {expected}, got "
                f"{type(value).__name__} {str(value)[:40]!r}"
            )
    try:
        return TrainSettings(
            **{f.name: data[f.name] for f in fields(TrainSettings) if f.name in data}
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: the stored settings: {e}") from None


def _resumed_vocab(path: str | os.PathLike, meta: dict[str, str]) -> list[str]:
    """The vocabulary stored in a checkpoint of `train` (a flat JSON list of strings)."""
    vocab = loads(path, meta.get("vocab", "null"), "the stored vocab", 1)
    if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
        raise CheckpointError(Path(os.fspath(path)), "the stored vocab must be a list of strings")
    return vocab


def stored_threads(meta: dict[str, str]) -> int | None:
    """The torch thread count a checkpoint of `train` was written with (None: not recorded)."""
    text = meta.get(THREADS_KEY, "")
    return int(text) if text.isdigit() and 0 < int(text) <= 2**16 else None


#: Temp files older attnlab versions (and `attnlab.viz.training` alone) leave beside a PNG
#: when killed mid-write: ``.<name>.<8 characters>.png`` (`tempfile.mkstemp`).
_PNG_TEMP = re.compile(r"\.(loss|grad_norm|sweep)\.png\.[a-z0-9_]{8}\.png")


def remove_stale_run_temps(out: Path) -> list[str]:
    """Removes the temp files a killed run left in ``out``; returns their names.

    Temp directories of `atomic_write` (checkpoint, config.json, the PNGs) whose writer is gone
    go at once (`remove_stale_temps`: their pid is dead or their lock is free for long); PNG
    temp files of the older naming, which carries no pid, once `STALE_SECONDS` old.
    """
    removed = remove_stale_temps(out, CHECKPOINT_NAME)
    try:
        entries = list(os.scandir(out))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        if not _PNG_TEMP.fullmatch(e.name):
            continue
        try:
            if e.is_file(follow_symlinks=False) and now - e.stat().st_mtime > STALE_SECONDS:
                os.unlink(e.path)
                removed.append(e.name)
        except OSError:
            continue
    return removed


class _NoPictureError(Exception):
    """Raised inside `atomic_write` when matplotlib is missing: nothing replaces the file."""


def _write_png(path: Path, draw: Callable[[Path], bool]) -> bool:
    """``draw(file)`` into a private temp directory beside ``path``, then renamed over it
    (`atomic_write`): a run killed while drawing leaves ``path`` as it was, and its temp
    directory is removed by the next write or run. False (nothing written) without matplotlib.
    """

    def fill(tmp: str) -> None:
        if not draw(Path(tmp)):
            raise _NoPictureError

    try:
        atomic_write(path, fill)
    except _NoPictureError:
        return False
    return True


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
    must hold exactly ``n_layers`` blocks; every integer field is first justified by the tensors,
    `attnlab.models.config.checkpoint_rules`), so a crafted config (``d_model=4096``,
    ``n_layers=10**6``, ``vocab_size=10**12``) is refused at once with a `CheckpointError`
    listing what differs (`attnlab.checkpoint.build_checked`). Only then is the file verified
    and decoded (`load_checkpoint`) and the model built.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a damaged file, a config the tensors do not justify or an integer
            field of the wrong type (naming it), a bad vocab.
        TypeError, ValueError: another stored config field of the wrong type or value.
    """
    path = Path(os.fspath(path))
    header = read_header(path)
    specs = checkpoint_specs(header)
    if "config" in header.metadata:  # every field against the tensors, before any parsing
        raw = loads(path, header.metadata["config"], "the stored config", 4)
        if isinstance(raw, dict):
            justify_config(path, raw, specs, checkpoint_rules(), prefix="model.")
    config, vocab = _stored_config(path, header.metadata)
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
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        torch.set_num_threads(threads)
        if stored is not None and stored != threads:
            log(
                f"warning: {resume} was trained with {stored} torch threads, this run uses "
                f"{threads}: the resumed run will not be bit-exact"
            )
    elif stored is not None and stored != torch.get_num_threads():
        torch.set_num_threads(stored)


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
    _check_precision(s.precision, device)
    par.check(
        batch_size=s.batch_size, seq_len=s.seq_len, dropout=s.dropout, positional=s.positional
    )
    text = load_text(s.text)
    vocab = sorted(set(text)) if ck is None else _resumed_vocab(resume, ck.metadata)
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
        ck.load_into(model, prefix="model.")
        state = opt.state_dict()
        for key, value in ck.tensors.items():
            if key.startswith("optim."):
                _, i, name = key.split(".", 2)
                state["state"].setdefault(int(i), {})[name] = value
        opt.load_state_dict(state)
        batch_rng.set_state(ck.tensors["rng.batch"])
        torch.set_rng_state(ck.tensors["rng.torch"])
        if par.mode != "single":
            par.restore_rng(ck.tensors.get("rng.torch_ranks"), s.seed, int(ck.metadata["step"]))
        losses = ck.tensors["log.train_loss"].tolist()
        val = [(int(a), b, c) for a, b, c in ck.tensors["log.val"].tolist()]
        step = int(ck.metadata["step"])
        stored_layers = loads(resume, ck.metadata.get("grad_norm_layers", "[]"), "the layers", 1)
        if "log.grad_norm" in ck.tensors and stored_layers == layers:
            norms = ck.tensors["log.grad_norm"].tolist()
            totals = ck.tensors["log.grad_norm_total"].tolist()
        else:  # a checkpoint from before the gradient-norm log: those steps are unknown
            norms = [[math.nan] * len(layers) for _ in range(step)]
            totals = [math.nan] * step
        if scaler.is_enabled():
            scaler.load_state_dict(loads(resume, ck.metadata["grad_scaler"], "the scaler", 1))
        log(f"resumed from {resume} at step {step} (torch threads: {torch.get_num_threads()})")
    net = par.wrap(model)  # DistributedDataParallel on several ranks

    if stop_at is not None and not (
        isinstance(stop_at, int) and not isinstance(stop_at, bool) and step < stop_at <= s.steps
    ):
        raise ValueError(f"stop_at must be an int in ({step}, {s.steps}], got {stop_at!r}")
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
    autocast_dtype = _AUTOCAST_DTYPES.get(s.precision, torch.float32)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x, y = get_batch(train_data, s.batch_size, s.seq_len, batch_rng)  # the global batch
        x_local, y_local = par.local(x, y)  # this rank's rows or sequence shards
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=s.precision != "fp32"):
            logits = net(x_local)  # (B_local, L_local, V)
        loss = nn.functional.cross_entropy(_wide(logits).flatten(0, 1), y_local.flatten())
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
                ckpt = _save(
                    out, model, opt, batch_rng, s, vocab, done, losses, val, entropy,
                    layers, norms, totals, scaler, rng_ranks,
                )  # fmt: skip
            if plots:
                _write_png(out / "loss.png", lambda p: plot_losses(p, losses, val, entropy))
                _write_png(
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
SWEEP_AXES = ("lr", "warmup")


@dataclass
class SweepRun:
    """One run of a `sweep`: its grid point, final losses (nats/char) and where it was saved.

    Attributes:
        point: the swept settings of this run, e.g. ``{"lr": 0.003, "warmup": 50}``.
        final_train, final_val: the last evaluation's train / validation loss (NaN if diverged).
        train_losses: the per-step batch losses. seconds: wall time. out_dir: its run directory.
    """

    point: dict[str, float | int]
    final_train: float
    final_val: float
    train_losses: list[float]
    seconds: float
    out_dir: str

    @property
    def diverged(self) -> bool:
        """True when the final validation loss is not finite."""
        return not math.isfinite(self.final_val)


@dataclass
class SweepResult:
    """What `sweep` returns: the base settings, the grid and one `SweepRun` per grid point."""

    base: TrainSettings
    grid: dict[str, list[float | int]]
    runs: list[SweepRun]
    unigram_entropy: float

    def best(self) -> SweepRun:
        """The run with the lowest finite final validation loss (the first run if all diverged)."""
        finite = [r for r in self.runs if not r.diverged]
        return min(finite, key=lambda r: r.final_val) if finite else self.runs[0]

    def table(self) -> str:
        """A plain-text table: one row per run, the best marked with ``*``."""
        best = self.best()
        keys = list(self.grid)
        head = [*keys, "final train", "final val", "seconds"]
        rows = []
        for r in self.runs:
            cells = [f"{r.point[k]:g}" for k in keys]
            cells += [f"{r.final_train:.4f}", f"{r.final_val:.4f}", f"{r.seconds:.1f}"]
            rows.append([*cells, "*" if r is best else ""])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
        lines += [
            "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)) + " " + row[-1]
            for row in rows
        ]
        s = self.base
        lines.append(
            f"({s.schedule} schedule, {s.steps} steps of {s.batch_size}×{s.seq_len} characters, "
            f"d_model={s.d_model}, {s.n_layers} layers, {s.precision}; unigram entropy "
            f"{self.unigram_entropy:.3f} nats/char; * = lowest final validation loss)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: non-finite losses become None (strict JSON has no NaN)."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "base": asdict(self.base),
            "grid": self.grid,
            "unigram_entropy": self.unigram_entropy,
            "runs": [
                {
                    **r.point,
                    "final_train_loss": num(r.final_train),
                    "final_val_loss": num(r.final_val),
                    "diverged": r.diverged,
                    "seconds": r.seconds,
                    "out_dir": r.out_dir,
                    "train_losses": [num(x) for x in r.train_losses],
                }
                for r in self.runs
            ],
        }


def _check_grid(base: TrainSettings, grid: dict[str, Sequence[float | int]]) -> dict[str, list]:
    if not isinstance(grid, dict) or not grid:
        raise ValueError(f"grid must be a non-empty dict of {list(SWEEP_AXES)}, got {grid!r}")
    clean: dict[str, list] = {}
    for name, values in grid.items():
        if name not in SWEEP_AXES:
            raise ValueError(f"grid axis must be one of {list(SWEEP_AXES)}, got {name!r}")
        values = list(values)
        if not values or len(set(values)) != len(values):
            raise ValueError(f"grid[{name!r}] must be non-empty without repeats, got {values}")
        if name == "lr" and base.schedule == "noam":
            raise ValueError(
                "grid axis 'lr' has no effect with schedule='noam' (its rate is "
                "d_model^-0.5 · min(t^-0.5, t · warmup^-1.5)); sweep 'warmup' or use 'cosine'"
            )
        clean[name] = values
    return clean


def sweep_plan(
    base: TrainSettings, grid: dict[str, Sequence[float | int]]
) -> tuple[dict[str, list], list[dict[str, float | int]], list[TrainSettings]]:
    """Checks a `sweep` grid without training: the cleaned grid, its points (the Cartesian
    product, first axis slowest) and each point's `TrainSettings` (``out_dir`` a subfolder of
    ``base.out_dir``). Raises ValueError naming the axis or the grid point that is invalid."""
    clean = _check_grid(base, grid)
    keys = list(clean)
    points = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*clean.values())]
    settings = []
    for point in points:
        try:
            s = TrainSettings(**{**asdict(base), **point})
        except (TypeError, ValueError) as e:
            raise type(e)(f"grid point {point}: {e}") from None
        name = "_".join(f"{k}={v:g}" for k, v in point.items())
        settings.append(replace(s, out_dir=str(Path(base.out_dir) / name)))
    return clean, points, settings


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
    if _write_png(out / "sweep.png", lambda p: plot_sweep(p, result)):
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
    "PRECISIONS",
    "SCHEDULES",
    "SWEEP_AXES",
    "SweepResult",
    "SweepRun",
    "TrainResult",
    "TrainSettings",
    "evaluate",
    "get_batch",
    "layer_grad_norms",
    "layer_parameters",
    "load_model",
    "load_text",
    "lr_at",
    "plot_losses",
    "sample_text",
    "sweep",
    "sweep_plan",
    "train",
    "unigram_entropy",
    "write_sweep",
]
