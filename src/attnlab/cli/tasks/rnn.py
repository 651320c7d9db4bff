"""``attnlab train rnn``: the GRU/LSTM character-LM baseline on the GPT's text and protocol.

Example:
    $ attnlab train rnn --out runs/rnn
    $ attnlab train rnn --cell lstm --budget 120 --out runs/lstm
"""

from __future__ import annotations

import argparse

from .._args import (
    MAX_THREADS,
    UsageError,
    add_device_argument,
    check_output_dir,
    existing_file,
    int_in,
    nonnegative_float,
    positive_float,
    probability,
    seed_int,
    size_int,
    step_count,
    step_interval,
)
from .._output import wrap

HELP = "a GRU/LSTM character LM: the RNN baseline of the GPT (same text, split and loss)"
DESCRIPTION = (
    "Trains a recurrent character-level language model (stacked GRU or LSTM layers) on the GPT "
    "trainer's text (default: the shipped Alice text), with its split (last tenth held out), "
    "batches (16 random windows of 128 characters) and loss (cross-entropy in nats/char, next to "
    "the text's unigram entropy), through the shared training loop (AdamW, warmup + cosine, "
    "clipping, optional time budget). Writes OUT/ckpt.safetensors (kind 'rnn'), "
    "OUT/metrics.json (held-out loss) and OUT/loss.png, and prints a sample. The defaults "
    "(600 steps, 2 GRU layers of 256, the GPT's parameter count within 0.5 %) take a few "
    "minutes on 2 CPU cores. A model whose parameters, gradients, AdamW state and activations "
    "need more memory than is available is refused before anything is built (one line naming "
    "the argument and the estimated bytes)."
)

#: Characters assumed by the memory estimate (the text's own count is known once it is read).
_ESTIMATE_VOCAB = 256
_MAX_SAMPLE = 1_000_000

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
        ("steps", step_count, "optimizer steps"),
        ("batch_size", size_int, "sequences per batch"),
        ("seq_len", size_int, "characters per sequence"),
        ("d_embed", size_int, "character embedding width"),
        ("d_hidden", size_int, "state width of each layer"),
        ("n_layers", size_int, "stacked recurrent layers"),
        ("dropout", probability, "dropout on embeddings, between layers and before the head"),
        ("lr", nonnegative_float, "peak learning rate"),
        ("min_lr", nonnegative_float, "final learning rate of the cosine decay"),
        ("warmup", step_interval, "linear warmup steps"),
        ("weight_decay", nonnegative_float, "AdamW weight decay of matrices"),
        ("grad_clip", nonnegative_float, "max gradient norm (0 = off)"),
        ("eval_interval", step_count, "steps between evaluations"),
        ("eval_batches", step_count, "batches per evaluation"),
        ("seed", seed_int, "random seed"),
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
        type=int_in(0, _MAX_SAMPLE),
        default=200,
        help=f"characters to sample after training (0 = none, at most {_MAX_SAMPLE:,}; "
        "default 200)",
    )
    p.add_argument("--prompt", default="Alice ", help="the sample's prompt (default 'Alice ')")
    p.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        help="torch intra-op threads (default: torch's choice); 1 avoids thread stalls when "
        "other processes keep the cores busy",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)


def _check_memory(args: argparse.Namespace) -> None:
    """Refuses (`UsageError` naming the size argument) a recurrent LM that cannot fit.

    Activations: per layer and character a GRU/LSTM step keeps its gates and states (about 8
    vectors of ``d_hidden``), plus the embeddings and the logits with their gradient.
    """
    from ...models.rnn import RNNLM, RNNLMConfig
    from .._budget import Estimate, check_fits, parameter_count

    def build(layers: int):
        return RNNLM(
            RNNLMConfig(
                vocab_size=_ESTIMATE_VOCAB,
                d_embed=args.d_embed,
                d_hidden=args.d_hidden,
                n_layers=layers,
                cell=args.cell,
            )
        )

    params, buffers = parameter_count(build, args.n_layers)
    tokens = args.batch_size * args.seq_len
    acts = 4 * tokens * (8 * args.n_layers * args.d_hidden + args.d_embed + 2 * _ESTIMATE_VOCAB)
    sizes = [
        (f"--{name.replace('_', '-')}", getattr(args, name), _DEFAULTS[name])
        for name in ("d_hidden", "d_embed", "n_layers", "batch_size", "seq_len")
    ]
    check_fits(Estimate(params, buffers, acts), sizes, args.device)


def run(args: argparse.Namespace) -> int:
    """Trains, writes the checkpoint, metrics.json and loss.png, prints a sample."""
    if args.min_lr > args.lr:
        raise UsageError("--min-lr", f"must be <= --lr {args.lr}, got {args.min_lr}")
    if args.sample and not args.prompt:
        raise UsageError("--prompt", "must not be empty when --sample > 0")
    check_output_dir(args.out_dir, "--out")
    _check_memory(args)
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
    written = f"wrote {result.checkpoint}, {out / 'metrics.json'}, {out / 'loss.png'}"
    print(wrap(written, indent="  "))
    return 0
