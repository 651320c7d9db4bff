"""``attnlab train translate``: number words English -> German / French with a seq2seq model.

Example:
    $ attnlab train translate --out runs/translate
    $ attnlab translate --checkpoint runs/translate/ckpt.safetensors --lang de "twenty-three"
"""

from __future__ import annotations

import argparse

from .._args import (
    MAX_SIZE,
    MAX_THREADS,
    UsageError,
    check_output_dir,
    float_in,
    int_in,
    seed_int,
    size_int,
    step_count,
    step_interval,
)
from .._output import wrap

HELP = "encoder–decoder Transformer: number words English -> German/French (characters)"
DESCRIPTION = (
    "Trains a seq2seq model (default: the encoder–decoder Transformer) on number words written "
    "by num2words, character level on both sides (--pieces: number pieces such as "
    "dreiundzwanzig, hundert, Millionen): English -> German (units before tens: "
    "twenty-three -> dreiundzwanzig) and English -> French, chosen by a target-language token, "
    "numbers 0 .. 10**max_digits - 1 with a uniform number of digits. 2,000 held-out numbers "
    "(>= 1,000) never seen in training are translated by batched greedy decoding; OUT gets "
    "metrics.json (exact match per language, on the German reordering cases and on the longest "
    "10%), loss.png, alignment.png (the cross-attention of held-out examples) and "
    "ckpt.safetensors. Training stops at --minutes (the learning rate's cosine follows the "
    "clock) or at --steps, whichever comes first. A model whose parameters, gradients, AdamW "
    "state and activations need more memory than is available is refused before anything is "
    "built (one line naming the argument and the estimated bytes)."
)

#: Vocabulary size assumed by the memory estimate (characters: ~60; --pieces: a few hundred).
_ESTIMATE_VOCAB = 512

ARCHS = ("transformer",)
_MAX_POOL = 10_000_000  # ~70 minutes of num2words
_MAX_HELD_OUT = 1_000_000  # the lead adds "rnn" with apps.translate.ARCHITECTURES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/translate", help="output directory (default %(default)s)")
    p.add_argument(
        "--arch",
        default="transformer",
        help="transformer, or rnn: the textbook's baseline, GRUs with additive (Bahdanau) "
        "attention (default %(default)s)",
    )
    p.add_argument(
        "--minutes",
        type=float_in(0.0, low_open=True),
        default=9.0,
        help="training time budget in minutes (default %(default)s); data and evaluation "
        "come on top (about 1-2 minutes on one core)",
    )
    p.add_argument(
        "--steps",
        type=step_count,
        default=100000,
        help="maximum optimizer steps (default %(default)s)",
    )
    p.add_argument(
        "--d-model", type=size_int, default=128, help="model width (default %(default)s)"
    )
    p.add_argument(
        "--layers",
        type=size_int,
        default=2,
        help="encoder and decoder layers (default %(default)s)",
    )
    p.add_argument(
        "--heads", type=size_int, default=4, help="attention heads (default %(default)s)"
    )
    p.add_argument(
        "--positional",
        choices=("sinusoidal", "rope"),
        default="sinusoidal",
        help="position encoding (default %(default)s)",
    )
    p.add_argument(
        "--separate-embeddings",
        action="store_true",
        help="separate source, target and output matrices (default: one shared table)",
    )
    p.add_argument(
        "--lr",
        type=float_in(0.0, low_open=True),
        default=1e-3,
        help="peak learning rate (default %(default)s)",
    )
    p.add_argument(
        "--warmup", type=step_interval, default=100, help="warmup steps (default %(default)s)"
    )
    p.add_argument(
        "--label-smoothing",
        type=float_in(0.0, 1.0, high_open=True),
        default=0.0,
        help="label smoothing of the cross-entropy (default %(default)s)",
    )
    p.add_argument(
        "--batch-tokens",
        type=int_in(200, MAX_SIZE),
        default=800,
        help="padded source + target tokens per batch (default %(default)s)",
    )
    p.add_argument(
        "--pool",
        type=int_in(100, _MAX_POOL),
        default=60000,
        help="distinct training pairs drawn (num2words writes ~2,500 pairs/s; at most "
        f"{_MAX_POOL:,}; default %(default)s)",
    )
    p.add_argument(
        "--max-digits",
        type=int_in(2, 12),
        default=9,
        help="numbers below 10**N, N in [2, 12] (default %(default)s)",
    )
    p.add_argument(
        "--held-out",
        type=int_in(1, _MAX_HELD_OUT),
        default=2000,
        help="held-out numbers (default %(default)s)",
    )
    p.add_argument(
        "--langs", default="de,fr", help="target languages, comma-separated (default %(default)s)"
    )
    p.add_argument(
        "--lang-weights",
        default="fr=2",
        help="how often each target language is drawn for training, relative, as LANG=W pairs "
        "(missing languages: 1; default %(default)s: French, the harder direction, twice as "
        "often as German)",
    )
    p.add_argument(
        "--precision", choices=("fp32", "bf16"), default="bf16", help="(default %(default)s)"
    )
    p.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        default=None,
        help="torch threads (default: torch's)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what --minutes counts: wall time (default) or this process's CPU time (for a "
        "measurement on a shared, loaded machine)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="training seed (default %(default)s)")
    p.add_argument(
        "--pieces",
        action="store_true",
        help="number pieces (words of 0-99, hundert, Millionen, ...) as tokens instead of "
        "characters: 3-4x shorter sequences",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _lang_weights(text: str, langs: tuple[str, ...]) -> dict[str, float]:
    """``"fr=2,de=1"`` -> ``{"fr": 2.0, "de": 1.0}`` (known languages outside ``langs`` are
    dropped, so the default works with ``--langs de``; unknown names are refused)."""
    from ...data.numbers import TARGET_LANGS

    out: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        lang, sep, value = item.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = float("nan")
        if not sep or lang.strip() not in TARGET_LANGS or not 0 < w < float("inf"):
            raise UsageError(
                "--lang-weights",
                f"must be LANG=W pairs, LANG in {list(TARGET_LANGS)}, W > 0 (e.g. fr=2), "
                f"got {text!r}",
            )
        if lang.strip() in langs:
            out[lang.strip()] = w
    return out


def _check_memory(args: argparse.Namespace, model: dict) -> None:
    """Refuses (`UsageError` naming the size argument) a transformer that cannot fit."""
    from ...apps.translate import default_config
    from ...models.seq2seq import build_seq2seq_transformer
    from .._budget import Estimate, check_fits, parameter_count, transformer_activation_bytes

    def build(layers: int):
        config = {**model, "enc_layers": layers, "dec_layers": layers}
        return build_seq2seq_transformer(default_config("transformer", _ESTIMATE_VOCAB, **config))

    params, buffers = parameter_count(build, args.layers)
    acts = transformer_activation_bytes(
        args.batch_tokens, 2 * args.layers, args.d_model, _ESTIMATE_VOCAB
    )
    sizes = [
        ("--d-model", args.d_model, 128),
        ("--layers", args.layers, 2),
        ("--batch-tokens", args.batch_tokens, 800),
    ]
    check_fits(Estimate(params, buffers, acts), sizes)


def run(args: argparse.Namespace) -> int:
    from ...apps.loop import FitSettings
    from ...apps.translate import ARCHITECTURES, TranslateSettings, train_translate
    from ...data.numbers import TARGET_LANGS

    if args.arch not in ARCHITECTURES:
        raise UsageError("--arch", f"must be one of {sorted(ARCHITECTURES)}, got {args.arch!r}")
    langs = tuple(x.strip() for x in args.langs.split(",") if x.strip())
    if not langs or any(x not in TARGET_LANGS for x in langs) or len(set(langs)) != len(langs):
        raise UsageError(
            "--langs", f"must be distinct names from {list(TARGET_LANGS)}, got {args.langs!r}"
        )
    weights = _lang_weights(args.lang_weights, langs)
    if args.d_model % args.heads:
        raise UsageError("--heads", f"must divide --d-model={args.d_model}, got {args.heads}")
    if args.held_out > (10**args.max_digits) // 4:
        raise UsageError(
            "--held-out",
            f"must be <= {(10**args.max_digits) // 4} for --max-digits {args.max_digits}, "
            f"got {args.held_out}",
        )
    out = check_output_dir(args.out, "--out")
    model: dict = {}
    if args.arch == "transformer":
        model = {
            "d_model": args.d_model,
            "n_heads": args.heads,
            "enc_layers": args.layers,
            "dec_layers": args.layers,
            "positional": args.positional,
            "tie_embeddings": not args.separate_embeddings,
            "attn_backend": "reference",
        }
        _check_memory(args, model)
    fit = FitSettings(
        steps=args.steps,
        lr=args.lr,
        min_lr=min(args.lr, 5e-5),
        warmup=args.warmup,
        weight_decay=0.01,
        grad_clip=1.0,
        time_budget=args.minutes * 60.0,
        schedule="time",
        clock=args.clock,
        precision=args.precision,
        seed=args.seed,
    )
    s = TranslateSettings(
        arch=args.arch,
        model=model,
        max_digits=args.max_digits,
        held_out=args.held_out,
        langs=langs,
        pool=args.pool,
        batch_tokens=args.batch_tokens,
        label_smoothing=args.label_smoothing,
        fit=fit,
        threads=args.threads,
        pieces=args.pieces,
        lang_weights=weights,
    )
    result = train_translate(out, s, progress=not args.quiet)
    m = result.metrics
    em = ", ".join(f"{k} {v:.2%}" for k, v in m["exact_match"].items())
    line = (
        f"held-out exact match: {em}; reordering (de) "
        f"{m['reordering_de'] if m['reordering_de'] is None else format(m['reordering_de'], '.2%')}"
        f"; {m['steps']} steps ({m['stopped_by']}) in {m['train_seconds']:.0f} s, "
        f"{m['seconds']:.0f} s in all"
    )
    print(wrap(line, indent="  "))
    written = f"wrote {out / 'ckpt.safetensors'}, metrics.json, loss.png, alignment.png"
    print(wrap(written, indent="  "))
    return 0
