"""``attnlab train``: fit a character-level GPT to a text file (`attnlab.train.train`).

Example:
    $ attnlab train --steps 600 --out runs/alice
    $ attnlab train --out runs/alice --resume
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch

from ..train import CHECKPOINT_NAME, TrainSettings, train
from ._args import (
    UsageError,
    add_device_argument,
    check_output_dir,
    existing_file,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    probability,
)


def _cmd_train(args: argparse.Namespace) -> int:
    defaults = TrainSettings()
    values = {
        f.name: getattr(args, f.name)
        for f in fields(TrainSettings)
        if getattr(args, f.name, None) is not None
    }
    if args.positional == "none":
        values["positional"] = None
    if values.get("min_lr", defaults.min_lr) > values.get("lr", defaults.lr):
        raise UsageError(
            "--min-lr",
            f"must be <= --lr {values.get('lr', defaults.lr)}, "
            f"got {values.get('min_lr', defaults.min_lr)}",
        )
    heads = values.get("n_heads", defaults.n_heads)
    if values.get("d_model", defaults.d_model) % heads:
        raise UsageError(
            "--n-heads",
            f"must divide --d-model {values.get('d_model', defaults.d_model)}, got {heads}",
        )
    kv_heads = values.get("n_kv_heads") or heads
    if heads % kv_heads:
        raise UsageError("--n-kv-heads", f"must divide --n-heads {heads}, got {kv_heads}")
    settings = TrainSettings(**{**asdict(defaults), **values})
    check_output_dir(settings.out_dir, "--out")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    resume = None
    if args.resume is not None:
        resume = args.resume or str(Path(settings.out_dir) / CHECKPOINT_NAME)
        conflicting = sorted(set(values) - {"out_dir"})
        if conflicting:
            print(
                "attnlab train: error: argument --resume: continues with the checkpoint's "
                f"stored settings; remove {['--' + n.replace('_', '-') for n in conflicting]}",
                file=sys.stderr,
            )
            return 2
        if not Path(resume).is_file():
            raise UsageError("--resume", f"no checkpoint file {resume!r}")
    result = train(settings, resume=resume, progress=not args.quiet, device=args.device)
    print(f"wrote {result.checkpoint}, {Path(settings.out_dir) / 'loss.png'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab train`` to the CLI's subparsers."""
    d = TrainSettings()
    p = sub.add_parser(
        "train",
        help="train a character-level GPT on a text file (default: the shipped Alice text)",
        description=(
            "Trains a character-level GPT with AdamW, warmup + cosine LR, gradient clipping and "
            "optional bf16 autocast / gradient checkpointing. Prints train and validation loss "
            "next to the text's unigram entropy (nats/char), shows a progress bar, and writes "
            "OUT/ckpt.safetensors (verified, atomic), OUT/config.json and OUT/loss.png. "
            f"The defaults ({d.steps} steps) learn visibly in a few minutes on 2 CPU cores."
        ),
    )
    p.add_argument(
        "--text", type=existing_file, help="UTF-8 text file (default: the shipped alice.txt)"
    )
    p.add_argument("--out", dest="out_dir", help=f"output directory (default {d.out_dir})")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        help="continue from a checkpoint (default path: OUT/ckpt.safetensors); the stored "
        "settings are used",
    )
    for name, kind, text in (
        ("steps", positive_int, "optimizer steps"),
        ("batch_size", positive_int, "sequences per batch"),
        ("seq_len", positive_int, "characters per sequence (= max_seq_len)"),
        ("d_model", positive_int, "model width"),
        ("n_layers", positive_int, "Transformer blocks"),
        ("n_heads", positive_int, "attention heads"),
        ("n_kv_heads", positive_int, "key/value heads (GQA)"),
        ("dropout", probability, "dropout probability"),
        ("lr", nonnegative_float, "peak learning rate"),
        ("min_lr", nonnegative_float, "final learning rate of the cosine decay"),
        ("warmup", nonnegative_int, "linear warmup steps"),
        ("weight_decay", nonnegative_float, "AdamW weight decay of matrices"),
        ("grad_clip", nonnegative_float, "max gradient norm (0 = off)"),
        ("eval_interval", positive_int, "steps between evaluations"),
        ("eval_batches", positive_int, "batches per evaluation"),
        ("save_interval", nonnegative_int, "steps between checkpoints"),
        ("seed", int, "random seed"),
    ):
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=kind, help=f"{text} (default {getattr(d, name)})")
    p.add_argument(
        "--positional",
        choices=["rope", "learned", "sinusoidal", "alibi", "none"],
        help="position encoding (default rope)",
    )
    p.add_argument("--bf16", action="store_true", default=None, help="bfloat16 autocast")
    p.add_argument(
        "--grad-checkpointing",
        dest="grad_checkpointing",
        action="store_true",
        default=None,
        help="recompute each block in backward to save memory",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch intra-op threads (default: torch's choice, one per core); 1 avoids thread "
        "stalls when other processes keep the cores busy",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)
    p.set_defaults(func=_cmd_train)
