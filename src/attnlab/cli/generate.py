"""``attnlab generate``: sample text from a checkpoint written by ``attnlab train``.

Example:
    $ attnlab generate --checkpoint runs/alice/ckpt.safetensors --prompt "Alice said"
"""

from __future__ import annotations

import argparse
import sys

from ._args import (
    UsageError,
    add_device_argument,
    existing_file,
    nonnegative_int,
    positive_float,
    positive_int,
)
from ._lazy import lazy_attributes

#: `attnlab.apps.gpt.load`, imported on first use (`attnlab.cli._lazy`).
__getattr__ = lazy_attributes(__name__, {"load": "..apps.gpt"})


def _cmd_generate(args: argparse.Namespace) -> int:
    from ..apps.gpt import sample_text, vocab_of

    load = sys.modules[__name__].load
    if not args.prompt:
        raise UsageError("--prompt", "must not be empty")
    try:
        model, ck = load(args.checkpoint, device=args.device)
        vocab = vocab_of(ck)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        raise UsageError("--checkpoint", " ".join(str(e).split())) from e
    unknown = sorted(set(args.prompt) - set(vocab))
    if unknown:
        raise UsageError(
            "--prompt",
            f"characters {unknown} are not in the checkpoint's vocabulary of {len(vocab)} "
            f"characters: {''.join(vocab)!r}",
        )
    text = sample_text(
        model,
        vocab,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        use_cache=not args.no_cache,
        seed=args.seed,
    )
    print(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab generate`` to the CLI's subparsers."""
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint written by `attnlab train`",
        description=(
            "Loads and verifies a checkpoint written by `attnlab train` and continues the prompt, "
            "decoding one character at a time with a KV cache per layer."
        ),
    )
    p.add_argument(
        "--checkpoint", required=True, type=existing_file, help="path of ckpt.safetensors"
    )
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument(
        "--max-new-tokens", type=nonnegative_int, default=500, help="characters to generate"
    )
    p.add_argument("--temperature", type=positive_float, default=0.8, help="sampling temperature")
    p.add_argument(
        "--top-k", type=positive_int, default=None, help="sample among the k most likely"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-cache", action="store_true", help="recompute instead of a KV cache")
    add_device_argument(p)
    p.set_defaults(func=_cmd_generate)
