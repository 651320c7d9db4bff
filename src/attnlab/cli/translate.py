"""``attnlab translate``: translate English number words with a checkpoint of
``attnlab train translate``.

Example:
    $ attnlab translate --checkpoint runs/translate/ckpt.safetensors --lang de "twenty-three"
    dreiundzwanzig
"""

from __future__ import annotations

import argparse

from ._args import UsageError, add_device_argument, existing_file, int_in

#: The longest TEXT accepted: `attnlab.apps.translate.MAX_SOURCE_CHARS`, written out because
#: ``--help`` imports no torch (a test holds the two equal).
MAX_SOURCE_CHARS = 256
#: Texts decoded together (a longer list is translated in batches of this many).
BATCH = 64
#: The widest beam ``--beam`` accepts (the decoding work grows with it).
MAX_BEAM = 16


def check_texts(texts: list[str]) -> None:
    """Refuses (`UsageError` naming TEXT) an empty text or one longer than `MAX_SOURCE_CHARS`
    characters, before the checkpoint is read."""
    for i, t in enumerate(texts):
        if not t.strip():
            raise UsageError("TEXT", "must not be empty")
        if len(t) > MAX_SOURCE_CHARS:
            which = f"TEXT {i + 1} of {len(texts)}" if len(texts) > 1 else "TEXT"
            raise UsageError(
                "TEXT",
                f"{which} has {len(t):,} characters; at most {MAX_SOURCE_CHARS} are accepted "
                "(the longest number word below 10**15 has 197): give one number per TEXT, "
                "e.g. split the input at its line breaks",
            )


def _cmd_translate(args: argparse.Namespace) -> int:
    from ..apps import read_kind
    from ..apps.translate import langs_of, load, translate, vocab_of

    texts = list(args.text)
    check_texts(texts)
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
    for start in range(0, len(texts), BATCH):
        for line in translate(
            model, vocab, texts[start : start + BATCH], lang=args.lang, beam=args.beam
        ):
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
            "as num2words writes them, e.g. 'one hundred and twenty-three'. Each TEXT may hold "
            f"at most {MAX_SOURCE_CHARS} characters (decoding time grows with the square of "
            "the length; the longest number word below 10**15 has 197): a longer TEXT is "
            "refused before the checkpoint is read, so give one number per TEXT. Any number of "
            f"TEXTs is translated, {BATCH} at a time."
        ),
    )
    p.add_argument(
        "text",
        nargs="+",
        metavar="TEXT",
        help=f"English number words, at most {MAX_SOURCE_CHARS} characters each",
    )
    p.add_argument(
        "--checkpoint",
        type=existing_file,
        required=True,
        help="a checkpoint (.safetensors) from `attnlab train translate`",
    )
    p.add_argument("--lang", default="de", help="target language: de (default) or fr")
    p.add_argument(
        "--beam",
        type=int_in(1, MAX_BEAM),
        default=1,
        help=f"beam width, 1-{MAX_BEAM} (default 1: greedy)",
    )
    add_device_argument(p)
    p.set_defaults(func=_cmd_translate)
