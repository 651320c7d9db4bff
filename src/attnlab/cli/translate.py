"""``attnlab translate``: translate English number words with a checkpoint of
``attnlab train translate``.

Example:
    $ attnlab translate --checkpoint runs/translate/ckpt.safetensors --lang de "twenty-three"
    dreiundzwanzig
"""

from __future__ import annotations

import argparse

from ._args import UsageError, add_device_argument, existing_file, positive_int


def _cmd_translate(args: argparse.Namespace) -> int:
    from ..apps import read_kind
    from ..apps.translate import langs_of, load, translate, vocab_of

    texts = list(args.text)
    if any(not t.strip() for t in texts):
        raise UsageError("TEXT", "must not be empty")
    try:
        kind = read_kind(args.checkpoint)
        if kind != "translate":
            raise ValueError(
                f"{args.checkpoint} holds a {kind!r} model, not a translate checkpoint "
                "(from `attnlab train translate`)"
            )
        model, ck = load(args.checkpoint, device=args.device)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        raise UsageError("--checkpoint", " ".join(str(e).split())) from e
    vocab = vocab_of(ck)
    langs = langs_of(ck)
    if args.lang not in langs:
        raise UsageError("--lang", f"must be one of {langs} for this checkpoint, got {args.lang!r}")
    for t in texts:
        unknown = sorted(set(t) - set(vocab.tokens))
        if unknown:
            raise UsageError(
                "TEXT",
                f"{t!r} has characters {unknown} outside the checkpoint's vocabulary "
                f"(English number words as num2words writes them, e.g. 'twenty-three')",
            )
    for line in translate(model, vocab, texts, lang=args.lang, beam=args.beam):
        print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab translate`` to the CLI's subparsers."""
    p = sub.add_parser(
        "translate",
        help="translate English number words with a checkpoint of `attnlab train translate`",
        description=(
            "Loads and verifies a translate checkpoint and prints one translation per TEXT "
            "(greedy decoding, or beam search with --beam N > 1). TEXT is English number words "
            "as num2words writes them, e.g. 'one hundred and twenty-three'."
        ),
    )
    p.add_argument("text", nargs="+", metavar="TEXT", help="English number words")
    p.add_argument(
        "--checkpoint",
        type=existing_file,
        required=True,
        help="a checkpoint (.safetensors) from `attnlab train translate`",
    )
    p.add_argument("--lang", default="de", help="target language: de (default) or fr")
    p.add_argument("--beam", type=positive_int, default=1, help="beam width (default 1: greedy)")
    add_device_argument(p)
    p.set_defaults(func=_cmd_translate)
