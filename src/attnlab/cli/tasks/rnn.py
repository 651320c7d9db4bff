"""``attnlab train rnn``: the GRU/LSTM character-LM baseline on the GPT's text and protocol.

Example:
    $ attnlab train rnn --out runs/rnn
    $ attnlab train rnn --cell lstm --budget 120 --out runs/lstm
"""

from __future__ import annotations

import argparse

from .._args import (
    UsageError,
    add_device_argument,
    check_output_dir,
    existing_file,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
)

HELP = "a GRU/LSTM character LM: the RNN baseline of the GPT (same text, split and loss)"
DESCRIPTION = (
    "Trains a recurrent character-level language model (stacked GRU or LSTM layers) on the GPT "
    "trainer's text (default: the shipped Alice text), with its split (last tenth held out), "
    "batches (16 random windows of 128 characters) and loss (cross-entropy in nats/char, next to "
    "the text's unigram entropy), through the shared training loop (AdamW, warmup + cosine, "
    "clipping, optional time budget). Writes OUT/ckpt.safetensors (kind 'rnn'), "
    "OUT/metrics.json (held-out loss) and OUT/loss.png, and prints a sample. The defaults "
    "(600 steps, 2 GRU layers of 256, the GPT's parameter count within 0.5 %) take a few "
    "minutes on 2 CPU cores."
)

_DEFAULTS = {  # mirrors RNNTrainSettings (the module imports no torch at import time)
    "steps": 600,
    "batch_size": 16,
    "seq_len": 128,
    "cell": "gru",
    "d_embed": 224,
    "d_hidden": 256,
    "n_layers": 2,
    "dropout": 0.1,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 50,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_interval": 100,
    "eval_batches": 8,
    "seed": 1337,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declares the options of ``attnlab train rnn``."""
    p.add_argument(
        "--text", type=existing_file, help="UTF-8 text file (default: the shipped alice.txt)"
    )
    p.add_argument(
        "--out", dest="out_dir", default="runs/rnn", help="output directory (default runs/rnn)"
    )
    p.add_argument("--cell", choices=["gru", "lstm"], default="gru", help="recurrent cell")
    for name, kind, text in (
        ("steps", positive_int, "optimizer steps"),
        ("batch_size", positive_int, "sequences per batch"),
        ("seq_len", positive_int, "characters per sequence"),
        ("d_embed", positive_int, "character embedding width"),
        ("d_hidden", positive_int, "state width of each layer"),
        ("n_layers", positive_int, "stacked recurrent layers"),
        ("dropout", probability, "dropout on embeddings, between layers and before the head"),
        ("lr", nonnegative_float, "peak learning rate"),
        ("min_lr", nonnegative_float, "final learning rate of the cosine decay"),
        ("warmup", nonnegative_int, "linear warmup steps"),
        ("weight_decay", nonnegative_float, "AdamW weight decay of matrices"),
        ("grad_clip", nonnegative_float, "max gradient norm (0 = off)"),
        ("eval_interval", positive_int, "steps between evaluations"),
        ("eval_batches", positive_int, "batches per evaluation"),
        ("seed", int, "random seed"),
    ):
        flag = "--" + name.replace("_", "-")
        p.add_argument(
            flag, dest=name, type=kind, default=_DEFAULTS[name],
            help=f"{text} (default {_DEFAULTS[name]})",
        )  # fmt: skip
    p.add_argument(
        "--budget",
        dest="time_budget",
        type=positive_float,
        help="stop training after this many seconds (the schedule still spans --steps)",
    )
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="autocast")
    p.add_argument(
        "--sample",
        type=nonnegative_int,
        default=200,
        help="characters to sample after training (0 = none; default 200)",
    )
    p.add_argument("--prompt", default="Alice ", help="the sample's prompt (default 'Alice ')")
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch intra-op threads (default: torch's choice); 1 avoids thread stalls when "
        "other processes keep the cores busy",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    """Trains, writes the checkpoint, metrics.json and loss.png, prints a sample."""
    if args.min_lr > args.lr:
        raise UsageError("--min-lr", f"must be <= --lr {args.lr}, got {args.min_lr}")
    if args.sample and not args.prompt:
        raise UsageError("--prompt", "must not be empty when --sample > 0")
    check_output_dir(args.out_dir, "--out")
    import torch

    from ...apps.rnn import RNNTrainSettings, char_data, sample, train_rnn

    if args.sample:
        vocab = set(char_data(args.text, args.seq_len).vocab)
        unknown = sorted(set(args.prompt) - vocab)
        if unknown:
            raise UsageError("--prompt", f"has characters {unknown} that are not in the text")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fields = (*_DEFAULTS, "text", "out_dir", "time_budget", "precision")
    settings = RNNTrainSettings(**{name: getattr(args, name) for name in fields})
    result = train_rnn(settings, progress=not args.quiet, device=args.device)
    if args.sample:
        text = sample(result.model, result.vocab, args.prompt, args.sample, top_k=10)
        print(f"sample (top-k 10):\n{text}")
    out = result.checkpoint.parent
    print(f"wrote {result.checkpoint}, {out / 'metrics.json'}, {out / 'loss.png'}")
    return 0
