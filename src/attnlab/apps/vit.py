"""A Vision Transformer on scikit-learn's bundled 8×8 digits (``attnlab train vit``).

The data are the 1,797 handwritten digits that ship inside scikit-learn
(``sklearn.datasets.load_digits``: 8×8 grey images with values 0–16, ten classes), scaled to
[0, 1] and split 80/20 stratified by class with a fixed seed (`digits_split`), so every run and
every training seed is judged on the same 360 held-out images. Training draws random batches
from its own seeded generator; augmentation is a random translation of each image by at most
``shift`` pixels in each direction with zero fill (`shift_images`), a real transform of the
pixels. A scikit-learn SVM on the raw pixels (`svm_baseline`) is fitted and scored on the same
split in the same run.

`run` trains, evaluates, and writes ``OUT/ckpt.safetensors`` (kind "vit"; `load` reads it),
``OUT/metrics.json``, ``OUT/vit_attention.png`` (rollout and per-head [CLS] maps over the
patches, drawn on held-out images) and ``OUT/attention.html`` (attnlab's attention viewer, the
patches as tokens).

Example:
    >>> from attnlab.apps import vit
    >>> metrics = vit.run("runs/vit")                # the default run
    >>> model, ck = vit.load("runs/vit/ckpt.safetensors")
    >>> model(images / 16).argmax(-1)                # images: (B, 1, 8, 8) with values 0..16
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._fit import ConfigRule
from .._shapes import check_int, check_probability
from ..checkpoint import Checkpoint
from ..models.vit import VisionTransformer, ViTConfig, build_vit
from ..utils.extras import require
from .loop import FitHistory, FitSettings, fit, load_model, save_model, write_metrics

#: The checkpoint kind (``attnlab.apps.load_any`` dispatches on it).
KIND = "vit"
CHECKPOINT_NAME = "ckpt.safetensors"
PNG_NAME = "vit_attention.png"
HTML_NAME = "attention.html"
#: The held-out split is fixed: seed 0, 20 % of each class (360 of 1,797 images).
SPLIT_SEED = 0
TEST_FRACTION = 0.2
#: Pixel values of ``load_digits`` are integers 0..16; the model sees them divided by this.
PIXEL_MAX = 16.0


@dataclass
class DigitsSplit:
    """The digits, split: images ``(N, 1, 8, 8)`` float32 in [0, 1], labels ``(N,)`` int64."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.y_train), "test": len(self.y_test)}


def digits_split(seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION) -> DigitsSplit:
    """scikit-learn's 8×8 digits, scaled to [0, 1], split stratified by class.

    Args:
        seed: the split's ``random_state``.
        test_fraction: the held-out share of every class.

    Returns:
        A `DigitsSplit` (1,437 train and 360 test images with the defaults).
    """
    datasets = require("sklearn.datasets", "apps", "attnlab.apps.vit (the digits)")
    selection = require("sklearn.model_selection", "apps", "attnlab.apps.vit (the split)")

    x, y = datasets.load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = selection.train_test_split(
        x, y, test_size=test_fraction, stratify=y, random_state=seed
    )

    def images(a: Any) -> Tensor:
        return torch.tensor(a, dtype=torch.float32).reshape(-1, 1, 8, 8) / PIXEL_MAX

    return DigitsSplit(
        images(x_tr), torch.tensor(y_tr).long(), images(x_te), torch.tensor(y_te).long()
    )


def shift_images(images: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Translates each image by its own random ``(dy, dx)`` in ``[−s, s]²``, filling with 0.

    ``out[b, :, i, j] = images[b, :, i − dy_b, j − dx_b]`` where that pixel exists, else 0.

    Args:
        images: ``(B, C, H, W)``.
        max_shift: s >= 0 pixels (0 returns the images unchanged).
        generator: the source of the shifts (on the CPU).

    Returns:
        ``(B, C, H, W)``.
    """
    if max_shift == 0:
        return images
    B, C, H, W = images.shape
    s = max_shift
    padded = F.pad(images, (s, s, s, s))  # (B, C, H + 2s, W + 2s)
    dy = torch.randint(0, 2 * s + 1, (B,), generator=generator).to(images.device)
    dx = torch.randint(0, 2 * s + 1, (B,), generator=generator).to(images.device)
    rows = (dy[:, None] + torch.arange(H, device=images.device))[:, None, :, None]  # (B,1,H,1)
    cols = (dx[:, None] + torch.arange(W, device=images.device))[:, None, None, :]  # (B,1,1,W)
    b = torch.arange(B, device=images.device)[:, None, None, None]
    c = torch.arange(C, device=images.device)[None, :, None, None]
    return padded[b, c, rows, cols]  # (B, C, H, W)


@dataclass
class VitSettings:
    """Training settings of `train_vit` (the model's sizes are in `ViTConfig`).

    Attributes:
        steps, lr, min_lr, warmup, weight_decay, grad_clip, eval_every, seed, time_budget,
            precision: as in `attnlab.apps.loop.FitSettings`.
        batch_size: images per step, drawn uniformly with replacement from the train split.
        shift: augmentation, the largest random translation in pixels (0 = none).
        label_smoothing: of the cross-entropy loss.
    """

    steps: int = 3000
    batch_size: int = 64
    lr: float = 2e-3
    min_lr: float = 4e-5
    warmup: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    eval_every: int = 500
    seed: int = 0
    time_budget: float | None = None
    precision: str = "fp32"
    shift: int = 1
    label_smoothing: float = 0.1

    def __post_init__(self) -> None:
        self.fit_settings()  # every shared field checked once, by FitSettings
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("shift", self.shift, minimum=0)
        check_probability("label_smoothing", self.label_smoothing)

    def fit_settings(self) -> FitSettings:
        """The `FitSettings` part."""
        shared = {f.name for f in fields(FitSettings)}
        return FitSettings(**{k: v for k, v in asdict(self).items() if k in shared})


@torch.no_grad()
def predict(model: VisionTransformer, images: Tensor, batch_size: int = 512) -> Tensor:
    """The predicted classes ``(N,)`` of images ``(N, C, H, W)`` (in [0, 1]), in eval mode."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    out = [
        model(images[i : i + batch_size].to(device)).argmax(-1).cpu()
        for i in range(0, len(images), batch_size)
    ]
    model.train(was)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def accuracy(model: VisionTransformer, images: Tensor, labels: Tensor) -> float:
    """The share of ``images`` whose predicted class is ``labels``."""
    return float((predict(model, images) == labels).float().mean())


@dataclass
class VitResult:
    """What `train_vit` returns: the trained model (eval mode), its history and accuracy."""

    model: VisionTransformer
    history: FitHistory
    accuracy: float
    per_class: list[float] = field(default_factory=list)


def train_vit(
    config: ViTConfig,
    settings: VitSettings,
    split: DigitsSplit | None = None,
    *,
    device: torch.device | str = "cpu",
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> VitResult:
    """Trains a `VisionTransformer` on the digits' train split; scores the held-out split.

    The model is initialised under ``torch.manual_seed(settings.seed)`` and the batches (and
    their shifts) come from a generator seeded with ``settings.seed``, so a seed fixes the run.

    Args:
        config: the model. settings: the training. split: the data (default `digits_split`).
        device: where to train. progress: a progress bar. log: one line per evaluation.

    Returns:
        A `VitResult` with the held-out accuracy and the per-class accuracies.
    """
    split = digits_split() if split is None else split
    if (config.channels, config.image_size) != (1, 8):
        raise ValueError(
            "config must take the digits' (1, 8, 8) images: channels=1, image_size=8, got "
            f"channels={config.channels}, image_size={config.image_size}"
        )
    torch.manual_seed(settings.seed)
    model = VisionTransformer(config).to(device)
    gen = torch.Generator().manual_seed(settings.seed)
    x_tr, y_tr = split.x_train.to(device), split.y_train.to(device)
    n = len(y_tr)

    def loss_at(_step: int) -> Tensor:
        idx = torch.randint(0, n, (settings.batch_size,), generator=gen).to(device)
        x = shift_images(x_tr[idx], settings.shift, gen)  # (B, 1, 8, 8)
        return F.cross_entropy(model(x), y_tr[idx], label_smoothing=settings.label_smoothing)

    def evaluate() -> dict[str, float]:
        return {"held_out_accuracy": accuracy(model, split.x_test, split.y_test)}

    history = fit(
        model,
        loss_at,
        settings.fit_settings(),
        evaluate=evaluate,
        desc="vit",
        progress=progress,
        log=log,
    )
    model.eval()
    pred = predict(model, split.x_test)
    per_class = [
        float((pred[split.y_test == k] == k).float().mean()) for k in range(config.num_classes)
    ]
    return VitResult(model, history, float((pred == split.y_test).float().mean()), per_class)


def svm_baseline(split: DigitsSplit | None = None) -> dict[str, float]:
    """scikit-learn's ``SVC`` (RBF kernel, C=10, gamma "scale") on the raw 64 pixels.

    Returns:
        ``{"accuracy": held-out accuracy, "seconds": fit + predict time}``.
    """
    SVC = require("sklearn.svm", "apps", "the SVM baseline").SVC

    split = digits_split() if split is None else split
    t0 = time.perf_counter()
    svc = SVC(C=10.0, gamma="scale").fit(split.x_train.flatten(1).numpy(), split.y_train.numpy())
    pred = torch.as_tensor(svc.predict(split.x_test.flatten(1).numpy()))
    seconds = time.perf_counter() - t0
    return {"accuracy": float((pred == split.y_test).float().mean()), "seconds": seconds}


# ----------------------------------------------------------------------------------- files
#: How the tensors of a "vit" checkpoint justify its stored `ViTConfig`
#: (`attnlab._fit.justify_config`; names below the ``model.`` prefix). The image, patch
#: and channel sizes multiply into the patch projection and position tables, which the build
#: on ``meta`` compares.
RULES = (
    ConfigRule("n_layers", layers="blocks"),
    ConfigRule("d_model", low=1, tensor="cls_token", dim=2),
    ConfigRule("num_classes", low=1, tensor="head.weight", dim=0),
    ConfigRule("n_heads", low=1),
    ConfigRule("d_ff", low=1, tensor="blocks.0.mlp.fc1.weight", dim=0, optional=True),
    ConfigRule("image_size", low=1),
    ConfigRule("patch_size", low=1),
    ConfigRule("channels", low=1),
)


def save(path: str | os.PathLike, model: VisionTransformer, **info: Any) -> Path:
    """Writes ``model`` as a "vit" checkpoint (``info`` goes into the metadata as JSON)."""
    extra = {"vit_info": json.dumps(info)} if info else None
    return save_model(path, model, kind=KIND, config=model.config.to_dict(), extra=extra)


def load(
    path: str | os.PathLike, device: torch.device | str = "cpu"
) -> tuple[VisionTransformer, Checkpoint]:
    """Reads a "vit" checkpoint (verified; the config is checked against the tensors first).

    Returns:
        ``(model in eval mode, checkpoint)``; the model expects images in [0, 1].

    Raises:
        FileNotFoundError, CheckpointError: a missing or damaged file, another kind, a config
            its tensors do not justify.
    """
    model, _, ck = load_model(path, KIND, build_vit, rules=RULES, device=device)
    return model, ck  # type: ignore[return-value]


# ----------------------------------------------------------------------------------- the run
def example_indices(labels: Tensor, count: int) -> list[int]:
    """The first held-out image of each class 0, 1, …, count − 1 (classes cycle past 10)."""
    out: list[int] = []
    for k in range(count):
        hits = (labels == k % 10).nonzero().flatten().tolist()
        taken = [i for i in hits if i not in out]
        if taken:
            out.append(taken[0])
    return out


def write_pictures(
    out_dir: str | os.PathLike,
    model: VisionTransformer,
    split: DigitsSplit,
    *,
    examples: int = 6,
) -> list[Path]:
    """Writes the attention PNG and HTML page of ``model`` on held-out images.

    ``OUT/vit_attention.png``: for ``examples`` held-out images (one per class), the image,
    its attention rollout and each last-layer head's [CLS] map over the patches.
    ``OUT/attention.html``: attnlab's viewer for the first of them, the patches as tokens
    (``[CLS]``, ``r0c0``, ``r0c1``, …), every layer and head.

    Returns:
        The paths written (the PNG is skipped when matplotlib is missing).
    """
    from ..viz.attention_view import save_attention_html
    from ..viz.vit import patch_tokens, plot_vit_maps

    out = Path(os.fspath(out_dir))
    idx = example_indices(split.y_test, examples)
    images = split.x_test[idx]
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        logits, weights = model(images.to(device), need_weights=True)
    weights = tuple(w.cpu() for w in weights)
    pred = logits.argmax(-1).cpu().tolist()
    truth = split.y_test[idx].tolist()
    labels = [f"true {t} · pred {p}" for t, p in zip(truth, pred, strict=True)]
    cfg = model.config
    written: list[Path] = []
    with contextlib.suppress(ImportError):
        written.append(
            plot_vit_maps(
                out / PNG_NAME,
                images,
                weights,
                grid=cfg.grid,
                labels=labels,
                title=(
                    f"ViT on held-out digits: rollout ½(A+I) and layer {cfg.n_layers - 1}'s "
                    f"[CLS] attention per head over {cfg.grid}×{cfg.grid} patches"
                ),
            )
        )
    first = torch.stack([w[0] for w in weights])  # (layers, H, T, T)
    written.append(
        save_attention_html(
            patch_tokens(cfg.grid),
            first,
            out / HTML_NAME,
            title=f"ViT attention on a held-out digit ({labels[0]})",
            subtitle=(
                f"{cfg.grid}×{cfg.grid} patches of {cfg.patch_size}×{cfg.patch_size} pixels "
                f"(token rRcC = patch row R, column C) + [CLS]; {cfg.n_layers} layers × "
                f"{cfg.n_heads} heads"
            ),
        )
    )
    return written


def run(
    out_dir: str | os.PathLike,
    config: ViTConfig | None = None,
    settings: VitSettings | None = None,
    *,
    baseline: bool = True,
    device: torch.device | str = "cpu",
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole task: train, score, compare with the SVM, and write the files.

    Writes ``OUT/ckpt.safetensors``, ``OUT/metrics.json`` (held-out accuracy, per class, the
    SVM's accuracy, times, steps, config, settings, machine), ``OUT/vit_attention.png`` and
    ``OUT/attention.html``.

    Returns:
        The metrics written.
    """
    config = ViTConfig() if config is None else config
    settings = VitSettings() if settings is None else settings
    out = Path(os.fspath(out_dir))
    t0 = time.perf_counter()
    split = digits_split()
    cpu0 = time.process_time()
    result = train_vit(config, settings, split, device=device, progress=progress, log=log)
    cpu = time.process_time() - cpu0
    metrics: dict[str, Any] = {
        "task": "vit",
        "data": "sklearn.datasets.load_digits (8x8), stratified 80/20 split, seed 0",
        "sizes": split.sizes(),
        "held_out_accuracy": result.accuracy,
        "per_class_accuracy": result.per_class,
        "train_seconds": result.history.seconds,
        "train_cpu_seconds": cpu,
        "threads": torch.get_num_threads(),
        "steps": result.history.steps,
        "stopped_by": result.history.stopped_by,
        "final_train_loss": result.history.train_loss[-1],
        "evals": result.history.evals,
        "parameters": result.model.num_parameters(),
        "config": config.to_dict(),
        "settings": asdict(settings),
    }
    if baseline:
        svm = svm_baseline(split)
        metrics["svm_accuracy"] = svm["accuracy"]
        metrics["svm_seconds"] = svm["seconds"]
    out.mkdir(parents=True, exist_ok=True)
    ckpt = save(
        out / CHECKPOINT_NAME,
        result.model,
        held_out_accuracy=result.accuracy,
        pixels="load_digits values / 16, in [0, 1]",
    )
    files = [ckpt, *write_pictures(out, result.model, split)]
    metrics["wall_seconds"] = time.perf_counter() - t0
    metrics["files"] = [p.name for p in files]
    write_metrics(out, metrics)
    return metrics


__all__ = [
    "CHECKPOINT_NAME",
    "KIND",
    "DigitsSplit",
    "VitResult",
    "VitSettings",
    "accuracy",
    "digits_split",
    "load",
    "predict",
    "run",
    "save",
    "shift_images",
    "svm_baseline",
    "train_vit",
    "write_pictures",
]
