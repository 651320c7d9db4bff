"""``attnlab train vit``: a Vision Transformer on scikit-learn's 8×8 digits (`attnlab.apps.vit`).

Example:
    $ attnlab train vit --out runs/vit
    $ attnlab train vit --positional sinusoidal --seed 1 --out runs/vit-sin
"""

from __future__ import annotations

import argparse

from .._args import (
    MAX_THREADS,
    UsageError,
    add_device_argument,
    check_output_dir,
    float_in,
    int_in,
    nonnegative_float,
    positive_float,
    seed_int,
    size_int,
    step_count,
    step_interval,
)
from .._output import wrap

HELP = "a Vision Transformer on scikit-learn's 8×8 digits (held-out accuracy vs an SVM)"
DESCRIPTION = (
    "Trains a Vision Transformer (2×2-pixel patches by default: 16 patch tokens + [CLS], learned "
    "2-D or sinusoidal positions) on the 1,797 8×8 handwritten digits bundled with "
    "scikit-learn, split 80/20 stratified by class with seed 0, with random shifts of up to "
    "--shift pixels as augmentation. Reports the held-out accuracy next to an SVM (RBF kernel) "
    "fitted on the same split in the same run, and writes OUT/ckpt.safetensors (kind 'vit'), "
    "OUT/metrics.json, OUT/vit_attention.png (attention rollout ½(A+I) and each head's [CLS] "
    "map over the patches, drawn on held-out digits) and OUT/attention.html (the attention "
    "viewer with the patches as tokens). The default 3,000 steps cost about 155 CPU-seconds "
    "on one thread (AMD EPYC); --time-budget SECONDS stops training early. A model whose "
    "parameters, gradients, AdamW state and activations need more memory than is available "
    "is refused before anything is built (one line naming the argument and the estimated "
    "bytes)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declares the task's options (defaults from `VitSettings` and `ViTConfig`)."""
    # Defaults are written out here: the task module imports nothing heavy at module level.
    p.add_argument("--out", default="runs/vit", metavar="DIR", help="output directory")
    g = p.add_argument_group("model")
    g.add_argument(
        "--patch-size",
        type=int,
        choices=(1, 2, 4, 8),
        default=2,
        help="patch side in pixels (default 2: 16 patches; 1: 64 patches)",
    )
    g.add_argument(
        "--positional",
        choices=("learned", "sinusoidal"),
        default="learned",
        help="learned 2-D (row + column vectors, default) or fixed 2-D sinusoidal positions",
    )
    g.add_argument("--d-model", type=size_int, default=64, metavar="E", help="width (64)")
    g.add_argument("--layers", type=size_int, default=4, metavar="N", help="blocks (4)")
    g.add_argument("--heads", type=size_int, default=4, metavar="H", help="heads (4)")
    g.add_argument(
        "--dropout", type=float_in(0.0, 1.0), default=0.0, metavar="P", help="dropout (0)"
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=step_count, default=3000, help="optimizer steps (3000)")
    t.add_argument("--batch-size", type=size_int, default=64, metavar="B", help="(64)")
    t.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (2e-3)")
    t.add_argument("--warmup", type=step_interval, default=100, help="warmup steps (100)")
    t.add_argument(
        "--weight-decay", type=nonnegative_float, default=0.05, metavar="WD", help="(0.05)"
    )
    t.add_argument(
        "--shift",
        type=int_in(0, 7),
        default=1,
        metavar="PIXELS",
        help="augmentation: random shifts of up to this many pixels, 0-7 (default 1; 0 = none)",
    )
    t.add_argument(
        "--label-smoothing",
        type=float_in(0.0, 1.0),
        default=0.1,
        metavar="EPS",
        help="label smoothing of the cross-entropy (0.1)",
    )
    t.add_argument("--seed", type=seed_int, default=0, help="model and batch seed (0)")
    t.add_argument(
        "--time-budget",
        type=nonnegative_float,
        default=0.0,
        metavar="SECONDS",
        help="stop training after this many seconds of wall-clock time (default 0 = no limit; "
        "a stop before the last step ends the run with a high learning rate)",
    )
    t.add_argument("--eval-every", type=step_interval, default=500, metavar="STEPS", help="(500)")
    t.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="autocast (fp32)")
    t.add_argument(
        "--threads", type=int_in(1, MAX_THREADS), help="torch threads (default: torch's)"
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the scikit-learn SVM baseline")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)


def _check_memory(args: argparse.Namespace, config: object) -> None:
    """Refuses (`UsageError` naming the size argument) a ViT that cannot fit."""
    from dataclasses import replace

    from ...models.vit import VisionTransformer
    from .._budget import Estimate, check_fits, parameter_count, transformer_activation_bytes

    params, buffers = parameter_count(
        lambda layers: VisionTransformer(replace(config, n_layers=layers)), args.layers
    )
    tokens = args.batch_size * ((8 // args.patch_size) ** 2 + 1)  # patches + [CLS]
    acts = transformer_activation_bytes(tokens, args.layers, args.d_model, 10)
    sizes = [
        ("--d-model", args.d_model, 64),
        ("--layers", args.layers, 4),
        ("--batch-size", args.batch_size, 64),
    ]
    check_fits(Estimate(params, buffers, acts), sizes, args.device)


def run(args: argparse.Namespace) -> int:
    """Trains, evaluates and writes the files; prints the held-out accuracies."""
    if args.d_model % args.heads:
        raise UsageError("--heads", f"must divide --d-model {args.d_model}, got {args.heads}")
    if args.positional == "sinusoidal" and args.d_model % 4:
        raise UsageError(
            "--d-model", f"must be divisible by 4 with --positional sinusoidal, got {args.d_model}"
        )
    if args.warmup > args.steps:
        raise UsageError("--warmup", f"must be <= --steps {args.steps}, got {args.warmup}")
    out = check_output_dir(args.out, "--out")

    import torch

    from ...apps.vit import CHECKPOINT_NAME, HTML_NAME, PNG_NAME, VitSettings
    from ...apps.vit import run as run_vit
    from ...models.vit import ViTConfig

    config = ViTConfig(
        patch_size=args.patch_size,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=args.dropout,
        positional=args.positional,
    )
    _check_memory(args, config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = VitSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        min_lr=args.lr / 50,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        eval_every=args.eval_every,
        seed=args.seed,
        time_budget=args.time_budget or None,
        precision=args.precision,
        shift=args.shift,
        label_smoothing=args.label_smoothing,
    )
    m = run_vit(
        out,
        config,
        settings,
        baseline=not args.no_baseline,
        device=args.device,
        progress=not args.quiet,
    )
    line = (
        f"held-out accuracy {m['held_out_accuracy']:.4f} ({m['sizes']['test']} images) after "
        f"{m['steps']} steps in {m['train_seconds']:.0f} s ({m['train_cpu_seconds']:.0f} CPU-s)"
    )
    if "svm_accuracy" in m:
        line += f"; SVM baseline {m['svm_accuracy']:.4f} ({m['svm_seconds']:.2f} s)"
    print(wrap(line, indent="  "))
    names = (CHECKPOINT_NAME, "metrics.json", PNG_NAME, HTML_NAME)
    written = "wrote " + ", ".join(str(out / n) for n in names if (out / n).exists())
    print(wrap(written, indent="  "))
    return 0
