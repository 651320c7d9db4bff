"""``attnlab train classify``: language identification of single words, three classifiers."""

from __future__ import annotations

import argparse

from .._args import (
    MAX_THREADS,
    UsageError,
    add_device_argument,
    check_output_dir,
    int_in,
    nonnegative_int,
    positive_float,
    probability,
    seed_int,
    size_int,
    step_count,
)
from .._output import wrap

HELP = "text classification: the language of a word (MiniLM head, char Transformer, n-grams)"

DESCRIPTION = (
    "Language identification of single words from wordfreq's per-language word lists (words "
    "listed by more than one language dropped, split by word, stratified, seeded). Trains a "
    "classification head (attention pooling or [CLS]) on the pretrained all-MiniLM-L6-v2 "
    "(the head and its top --minilm-layers layers) and a small character-level Transformer "
    "from scratch, measures a scikit-learn character n-gram baseline in the same run, and "
    "removes each encoder head in turn to show which heads the classifiers use. Writes "
    "OUT/metrics.json (held-out accuracy of the three), OUT/char.safetensors, "
    "OUT/minilm.safetensors (kind 'classify'; attnlab.apps.load_any reads them), "
    "OUT/confusion.png and OUT/heads.png. A character model whose parameters, gradients, "
    "AdamW state and activations need more memory than is available is refused before "
    "anything is built (one line naming --char-layers and the estimated bytes)."
)
_MAX_WORDS = 1_000_000

_DEFAULT_LANGUAGES = "de,en,es,fr,it,nl,pl,pt,sv,tr"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``attnlab train classify``."""
    p.add_argument("--out", default="runs/classify", help="output directory (default %(default)s)")
    p.add_argument(
        "--languages",
        default=_DEFAULT_LANGUAGES,
        help="comma-separated wordfreq language codes, Latin script (default %(default)s)",
    )
    p.add_argument(
        "--words",
        type=int_in(1, _MAX_WORDS),
        default=3000,
        help=f"most frequent words read per language (at most {_MAX_WORDS:,}; default %(default)s)",
    )
    p.add_argument(
        "--test-fraction",
        type=probability,
        default=0.2,
        help="share of each language's words held out (default %(default)s)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="data split, init and batch order seed")
    p.add_argument(
        "--pooling",
        choices=["attention", "cls"],
        default="attention",
        help="classification head: a learned query attending over the tokens, or the [CLS] "
        "state (default %(default)s)",
    )
    p.add_argument(
        "--char-steps", type=step_count, default=1500, help="char model steps (default 1500)"
    )
    p.add_argument("--char-layers", type=size_int, default=3, help="char model layers (default 3)")
    p.add_argument(
        "--minilm-steps", type=step_count, default=600, help="MiniLM steps (default 600)"
    )
    p.add_argument(
        "--minilm-layers",
        type=nonnegative_int,  # at most 6: checked in run ("MiniLM has 6 layers")
        default=2,
        help="top MiniLM layers trained with the head, 0-6 (0 = the head only; default 2)",
    )
    p.add_argument("--no-minilm", action="store_true", help="skip the MiniLM classifier")
    p.add_argument(
        "--ablation-words",
        type=int_in(0, _MAX_WORDS),
        default=1000,
        help="held-out words the head ablation scores (0 = no ablation; default 1000)",
    )
    p.add_argument(
        "--time-budget",
        type=positive_float,
        help="seconds of training per model (default: no limit)",
    )
    p.add_argument("--threads", type=int_in(1, MAX_THREADS), help="torch intra-op threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_device_argument(p)


def _check_memory(args: argparse.Namespace) -> None:
    """Refuses (`UsageError` naming ``--char-layers``) a character model that cannot fit."""
    from ...apps.classify import ClassifySettings
    from ...models.classifier import char_classifier
    from .._budget import Estimate, check_fits, parameter_count, transformer_activation_bytes

    s = ClassifySettings(char_layers=args.char_layers)
    chars = "".join(chr(c) for c in range(97, 97 + 64))  # the words' characters: a few dozen

    def build(layers: int):
        return char_classifier(
            chars,
            ["a", "b"],
            d_model=s.char_d_model,
            n_layers=layers,
            n_heads=s.char_heads,
            max_len=s.char_max_len,
        )

    params, buffers = parameter_count(build, s.char_layers)
    acts = transformer_activation_bytes(
        s.char_batch * s.char_max_len, s.char_layers, s.char_d_model, len(chars)
    )
    check_fits(Estimate(params, buffers, acts), [("--char-layers", s.char_layers, 3)], args.device)


def run(args: argparse.Namespace) -> int:
    """Runs the experiment; prints the held-out accuracies and the files written."""
    languages = tuple(x.strip() for x in args.languages.split(",") if x.strip())
    from ...data.languages import LANGUAGE_NAMES

    unknown = [x for x in languages if x not in LANGUAGE_NAMES]
    if unknown or len(languages) < 2 or len(set(languages)) != len(languages):
        raise UsageError(
            "--languages",
            f"expected at least 2 distinct codes of {','.join(sorted(LANGUAGE_NAMES))}, "
            f"got {args.languages!r}",
        )
    if not 0.0 < args.test_fraction < 1.0:
        raise UsageError("--test-fraction", f"must be in (0, 1), got {args.test_fraction}")
    if args.minilm_layers > 6:
        raise UsageError("--minilm-layers", f"MiniLM has 6 layers, got {args.minilm_layers}")
    out = check_output_dir(args.out, "--out")

    import torch

    from ...apps.classify import ClassifySettings
    from ...apps.classify import run as run_classify

    _check_memory(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = ClassifySettings(
        languages=languages,
        n_words=args.words,
        test_fraction=args.test_fraction,
        seed=args.seed,
        pooling=args.pooling,
        char_steps=args.char_steps,
        char_layers=args.char_layers,
        minilm=not args.no_minilm,
        minilm_steps=args.minilm_steps,
        minilm_layers=args.minilm_layers,
        ablation_words=args.ablation_words,
        time_budget=args.time_budget,
    )
    result = run_classify(settings, out, progress=not args.quiet, device=args.device)
    acc = result.metrics["accuracy"]
    line = (
        "held-out accuracy: "
        + ", ".join(f"{k} {100 * v:.2f} %" for k, v in acc.items())
        + f" (chance {100 * result.metrics['chance']:.1f} %)"
    )
    print(wrap(line, indent="  "))
    print(wrap("wrote " + ", ".join(str(p) for p in result.files), indent="  "))
    return 0
