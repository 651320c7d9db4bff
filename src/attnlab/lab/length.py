"""Train short, test long (Press, Smith & Lewis, ICLR 2022): which positions extrapolate.

The same small causal byte-level LM (`attnlab.models.GPT`) is trained at one length ``L`` with
each positional encoding of the paper's Fig. 1 — sinusoidal, learned, RoPE, T5 bias, ALiBi —, with
none (NoPE) and with RoPE and a sliding window of ``L`` keys in every layer, then evaluated on
held-out text at ``1×, 2×, 4×, 8×, 16× L``.

Data: Python's standard-library sources (``sysconfig.get_paths()["stdlib"]``, the top-level
``*.py`` files, ~4.7 MB), read as UTF-8 bytes (vocabulary 256). The files are sorted by name;
every 8th file is the test split, never trained on; the others are the training split.

Training: random windows of ``L + 1`` bytes from the training split, AdamW with warmup and
cosine decay (`attnlab.apps.loop.fit`), the same steps, batch and learning rate for every
encoding and seed.

Evaluation, as the paper's "nonoverlapping inference": the test split's first ``T`` bytes are
cut into ``T / L_eval`` non-overlapping windows of ``L_eval`` bytes (plus the next byte as the
last target); every window is one forward pass from position 0, and the loss is the mean
cross-entropy (nats per byte) over *all* tokens of all windows. ``T`` is the same for every
``L_eval``, so every length scores the same bytes.

Where an encoding is undefined: learned positions exist only for the ``L`` trained rows (the
model is built with ``max_seq_len = L`` and refuses longer input), so their loss beyond ``1×``
is recorded as ``None`` ("undefined") — never as a number from untrained rows. Every other
model is built with ``max_seq_len = 16 L``: sinusoidal and RoPE are functions of the position,
T5 buckets saturate at ``t5_max_distance``, ALiBi and NoPE need no table.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import Check, LabResult, LabSettings, SeedStats, Verdict

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from ..models import GPT
    from ..utils import Progress

__all__ = [
    "ENCODINGS",
    "FACTORS",
    "SCALES",
    "LengthScale",
    "corpus",
    "evaluate",
    "judge",
    "run",
    "run_scale",
    "train_one",
]

#: The models compared: the encodings of the paper's Fig. 1 in its order, then NoPE, then RoPE
#: with a sliding window of L keys in every layer (Mistral's answer to length: no query ever
#: sees a distance it was not trained on); each entry is ``(positional, window)`` of the GPT.
ENCODINGS: dict[str, tuple[str | None, bool]] = {
    "sinusoidal": ("sinusoidal", False),
    "learned": ("learned", False),
    "rope": ("rope", False),
    "t5": ("t5", False),
    "alibi": ("alibi", False),
    "nope": (None, False),
    "rope_window": ("rope", True),
}
#: Evaluation lengths as multiples of the training length.
FACTORS = (1, 2, 4, 8, 16)
#: The rise (nats per byte) beyond the training length that still counts as "flat".
FLAT = 0.02
#: The encodings the paper's Fig. 1 shows degrading beyond the training length.
DEGRADING = ("sinusoidal", "rope", "t5")
LABELS = {
    "sinusoidal": "Sinusoidal",
    "learned": "Learned",
    "rope": "RoPE",
    "t5": "T5 bias",
    "alibi": "ALiBi",
    "nope": "NoPE",
    "rope_window": "RoPE, window L",
}


@dataclass(frozen=True)
class LengthScale:
    """The size of one run: model, training and evaluation.

    Attributes:
        train_len: L, the training length (bytes per window).
        d_model, n_layers, n_heads: the GPT's width, depth and heads.
        batch: windows per step. steps: optimizer steps. lr: peak learning rate.
        warmup: linear warmup steps.
        eval_tokens: T, the test bytes scored at every evaluation length (a multiple of
            ``16 L``).
        t5_buckets, t5_max_distance: T5's buckets (``t5_max_distance <= L``, so every bucket is
            trained, as in the paper where 128 < L).
    """

    train_len: int
    d_model: int
    n_layers: int
    n_heads: int
    batch: int
    steps: int
    lr: float
    warmup: int
    eval_tokens: int
    t5_buckets: int
    t5_max_distance: int

    def __post_init__(self) -> None:
        longest = FACTORS[-1] * self.train_len
        if self.eval_tokens % longest:
            raise ValueError(
                f"eval_tokens: expected a multiple of {FACTORS[-1]}·train_len = {longest}, "
                f"received {self.eval_tokens}"
            )


SCALES: dict[str, LengthScale] = {
    "quick": LengthScale(32, 32, 2, 4, 16, 400, 5e-3, 30, 4096, 16, 32),
    "default": LengthScale(64, 64, 2, 4, 32, 900, 3e-3, 60, 16384, 16, 64),
    "full": LengthScale(64, 96, 3, 4, 32, 2400, 2e-3, 120, 32768, 16, 64),
}


# ----------------------------------------------------------------------------------- data
@functools.lru_cache(maxsize=1)
def corpus() -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``(train, test, info)``: the standard library's top-level sources as byte ids.

    Returns:
        ``train`` and ``test`` Long tensors of byte values ``(N,)``; ``info`` names the folder,
        the file counts and the split sizes (for metrics.json).

    Raises:
        FileNotFoundError: no ``*.py`` file in the standard-library folder.
    """
    import torch

    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"))
    if len(files) < 16:
        raise FileNotFoundError(
            f"stdlib: expected the standard library's *.py sources in {folder}, "
            f"received {len(files)} files"
        )
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    for i, f in enumerate(files):
        parts[i % 8 == 7].append(f.read_bytes())
    train, test = (
        torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8).long() for p in parts
    )
    info = {
        "source": "Python standard library (top-level *.py, UTF-8 bytes)",
        "folder": str(folder),
        "train_files": len(parts[0]),
        "test_files": len(parts[1]),
        "train_bytes": int(train.numel()),
        "test_bytes": int(test.numel()),
    }
    return train, test, info


# ------------------------------------------------------------------------------ one model
def _model(encoding: str, scale: LengthScale) -> GPT:
    from ..models import GPT, TransformerConfig

    positional, window = ENCODINGS[encoding]
    longest = scale.train_len * (1 if positional == "learned" else FACTORS[-1])
    return GPT(
        TransformerConfig(
            vocab_size=256,
            d_model=scale.d_model,
            n_layers=scale.n_layers,
            n_heads=scale.n_heads,
            max_seq_len=longest,
            positional=positional,
            t5_buckets=scale.t5_buckets,
            t5_max_distance=scale.t5_max_distance,
            sliding_window=scale.train_len if window else None,
        )
    )


def train_one(
    encoding: str, scale: LengthScale, seed: int, train: Tensor
) -> tuple[GPT, list[float]]:
    """Trains one GPT with ``encoding`` on random ``L + 1``-byte windows of ``train``.

    Args:
        encoding: a key of `ENCODINGS` ("alibi", "rope", …, "nope", "rope_window").
        scale: the run's size. seed: seeds the initialisation and the batches.
        train: the training bytes ``(N,)``.

    Returns:
        ``(model in eval mode, per-step training losses)``.
    """
    import torch
    import torch.nn.functional as F

    from ..apps.loop import FitSettings, fit

    torch.manual_seed(seed)
    model = _model(encoding, scale)
    g = torch.Generator().manual_seed(10_000 + seed)
    span = torch.arange(scale.train_len + 1)  # (L + 1,)

    def loss_at(step: int) -> Tensor:  # noqa: ARG001 (the batches come from the generator)
        high = train.numel() - scale.train_len - 1
        starts = torch.randint(0, high, (scale.batch, 1), generator=g)  # (B, 1)
        windows = train[starts + span]  # (B, L + 1)
        logits = model(windows[:, :-1])  # (B, L, V)
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())

    s = FitSettings(
        steps=scale.steps,
        lr=scale.lr,
        min_lr=scale.lr / 10,
        warmup=scale.warmup,
        seed=seed,
        betas=(0.9, 0.95),
    )
    history = fit(model, loss_at, s, desc=f"{encoding} seed {seed}")
    return model.eval(), history.train_loss


def evaluate(model: GPT, test: Tensor, length: int, tokens: int, batch: int = 8) -> float:
    """Mean loss (nats per byte) over non-overlapping windows of ``length`` bytes of ``test``.

    The first ``tokens`` bytes of ``test`` are cut into ``tokens / length`` windows; window w
    predicts bytes ``w·length + 1 … (w + 1)·length`` from the bytes before them *in its own
    window* (each window starts at position 0). Every token of every window counts::

        loss = −(1 / tokens) · Σ_w Σ_t log p(x[w·length + t + 1] | x[w·length … w·length + t])

    Args:
        model: a `attnlab.models.GPT` (eval mode).
        test: held-out bytes ``(N,)``, ``N > tokens``.
        length: the evaluation length (must divide ``tokens``).
        tokens: how many bytes are scored.
        batch: windows per forward pass.

    Returns:
        The loss in nats per byte.
    """
    import torch
    import torch.nn.functional as F

    if tokens % length or test.numel() <= tokens:
        raise ValueError(
            f"length/tokens: expected length dividing tokens < len(test) = {test.numel()}, "
            f"received length={length}, tokens={tokens}"
        )
    inputs = test[:tokens].view(-1, length)  # (W, L_eval)
    targets = test[1 : tokens + 1].view(-1, length)  # (W, L_eval)
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, inputs.shape[0], batch):
            logits = model(inputs[i : i + batch])  # (b, L_eval, V)
            total += F.cross_entropy(
                logits.flatten(0, 1).float(), targets[i : i + batch].flatten(), reduction="sum"
            ).double()
    return float(total) / tokens


# ---------------------------------------------------------------------------------- a run
def run_scale(
    scale: LengthScale,
    seeds: int,
    progress: Progress,
    *,
    encodings: Sequence[str] = tuple(ENCODINGS),
) -> dict[str, Any]:
    """Trains every encoding over ``seeds`` seeds and evaluates it at every factor.

    Args:
        scale: the run's size. seeds: seeds 0 … seeds − 1 per encoding.
        progress: stepped once per trained model (``progress.total`` is set here).
        encodings: names of `ENCODINGS` to run (the tests run a subset).

    Returns:
        The metrics: ``loss[encoding]`` is ``seeds`` lists of one loss per factor (None where
        the encoding is undefined), ``train_loss[encoding]`` the first and last 10-step mean
        training loss per seed, plus the corpus, the scale, the factors and the lengths.
    """
    train, test, info = corpus()
    lengths = [f * scale.train_len for f in FACTORS]
    loss: dict[str, list[list[float | None]]] = {}
    train_loss: dict[str, list[dict[str, float]]] = {}
    progress.total = len(encodings) * seeds
    for name in encodings:
        loss[name], train_loss[name] = [], []
        for seed in range(seeds):
            model, history = train_one(name, scale, seed, train)
            k = min(10, len(history))
            train_loss[name].append({"first": sum(history[:k]) / k, "last": sum(history[-k:]) / k})
            loss[name].append(
                [
                    evaluate(model, test, n, scale.eval_tokens)
                    if n <= model.config.max_seq_len
                    else None
                    for n in lengths
                ]
            )
            progress.step(f"{name} seed {seed}")
    return {
        "corpus": info,
        "scale": asdict(scale),
        "factors": list(FACTORS),
        "lengths": lengths,
        "encodings": list(encodings),
        "loss": loss,
        "train_loss": train_loss,
    }


def run(settings: LabSettings, progress: Progress) -> LabResult:
    """The experiment at ``settings``' scale (3 seeds by default, 1 with ``--quick``)."""
    scale = SCALES[settings.scale]
    metrics = run_scale(scale, settings.seed_count(default=3), progress)
    from ..viz import lab_length

    return LabResult.judged(
        "train-short-test-long",
        settings,
        metrics,
        judge,
        table(metrics),
        {"length_curves.png": lambda path: lab_length.draw(path, metrics)},
    )


# ------------------------------------------------------------------------ table and verdict
def _stats(metrics: dict[str, Any], name: str, k: int) -> SeedStats | None:
    values = [row[k] for row in metrics["loss"].get(name, [])]
    if not values or any(v is None for v in values):
        return None
    return SeedStats.of(values)


def table(metrics: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)``: one row per encoding, its held-out loss (nats/byte, mean ± seed
    standard deviation) at every evaluation length; "undefined" where the encoding is."""
    columns = ["encoding"] + [
        f"{f}× ({n})" for f, n in zip(metrics["factors"], metrics["lengths"], strict=True)
    ]
    rows = []
    for name in metrics["encodings"]:
        cells: list[Any] = [name]
        for k in range(len(metrics["factors"])):
            s = _stats(metrics, name, k)
            cells.append("undefined" if s is None else f"{s.mean:.3f} ± {s.std:.3f}")
        rows.append(cells)
    return columns, rows


def _rise(metrics: dict[str, Any], name: str, last_only: bool) -> list[float]:
    """Per seed: the loss beyond the training length minus the loss at 1× (at the longest
    length, or the largest over all longer lengths)."""
    out = []
    for row in metrics["loss"][name]:
        beyond = [v if v is not None else math.nan for v in row[1:]]
        out.append((beyond[-1] if last_only else max(beyond)) - row[0])
    return out


def judge(metrics: dict[str, Any], quick: bool) -> Verdict:
    """The paper's shape and order of the curves, from the measured losses.

    Checks (each a margin against the seed spread, in nats per byte):

    - ALiBi stays flat or falls beyond L: ``FLAT − mean_seeds(max_k>1 (loss_k − loss_1))``;
    - sinusoidal, RoPE and T5 degrade: their loss at 16× minus at 1× is above ``FLAT``;
    - ALiBi's loss at 16× is below sinusoidal's, RoPE's and T5's.

    Learned positions (undefined beyond L), NoPE and RoPE with a window of L keys (not in the
    paper's figure) are reported, not judged.
    """
    from .registry import experiment

    s = SeedStats.of(_rise(metrics, "alibi", last_only=False))
    checks = [
        Check(
            "ALiBi's loss stays flat or falls beyond the training length",
            FLAT - s.mean,
            s.std,
            f"largest rise {s} nats/byte (flat: ≤ {FLAT})",
        )
    ]
    for name in DEGRADING:
        checks.append(
            Check.greater(
                f"{LABELS[name]}'s loss rises beyond the training length (16× − 1× > {FLAT})",
                _rise(metrics, name, last_only=True),
                [FLAT] * s.n,
                "nats/byte",
            )
        )
    alibi_long = [row[-1] for row in metrics["loss"]["alibi"]]
    for name in DEGRADING:
        other = [row[-1] for row in metrics["loss"][name]]
        checks.append(
            Check.greater(
                f"ALiBi's loss at 16× L is below {LABELS[name]}'s", other, alibi_long, "nats/byte"
            )
        )
    claim = experiment("train-short-test-long").claim
    return Verdict(claim, tuple(checks), quick=quick)
