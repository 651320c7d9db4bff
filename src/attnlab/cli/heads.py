"""``attnlab heads``: what all-MiniLM-L6-v2's heads do, and how many of them matter.

- ``attnlab heads classify``: one row per (layer, head) — positional / sink / rare-token /
  broad / other — from attention statistics over Alice sentences (``entropy`` in nats, as
  everywhere in attnlab; ``normalised_entropy`` = entropy / ln T, in [0, 1]).
- ``attnlab heads prune``: the head-pruning sweep (importance order vs random order, embedding
  cosine to the unpruned model), a table, optionally a PNG and JSON.
"""

from __future__ import annotations

import argparse
import json

from ._args import add_device_argument, check_output_file, float_in, int_at_least
from ._output import fitted, print_json, working, wrap


def _fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated fractions in [0, 1], got {text!r}"
        ) from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated fractions in [0, 1], got {text!r}"
        )
    return values


def _cmd_heads(args: argparse.Namespace) -> int:
    from ..analysis.heads import alice_sentences, classify_heads, pruning_sweep

    to_stdout = args.json == "-"
    if args.json and not to_stdout:
        check_output_file(args.json, "--json", (".json",))
    if args.action == "prune" and args.png:
        check_output_file(args.png, "--png", (".png",))
    with working(f"attnlab heads {args.action}", quiet=args.quiet):
        if args.action == "classify":
            result = classify_heads(alice_sentences(args.sentences), device=args.device)
            data: object = result.rows()
        else:
            result = pruning_sweep(
                args.fractions,
                eval_sentences=args.sentences,
                importance_sentences=args.importance_sentences,
                seeds=args.seeds,
                threshold=args.threshold,
                device=args.device,
            )
            data = result.as_dict()
    if to_stdout:
        print_json(data)
    else:
        print(fitted(result.table_parts()))
    written = []
    if args.action == "prune" and args.png:
        from ..viz.heads import plot_pruning

        written.append(str(plot_pruning(args.png, result)))
    if args.json and not to_stdout:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        written.append(args.json)
    if written and not to_stdout:
        print("\n" + "\n".join(wrap(f"wrote {path}", indent="  ") for path in written))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab heads`` to the ``attnlab`` command's subparsers."""
    p = sub.add_parser(
        "heads",
        help="MiniLM's heads: a head classifier and a head-pruning sweep",
        description="Classifies all-MiniLM-L6-v2's 72 heads from their attention over Alice "
        "sentences (classify), or prunes fractions of them in importance order and in random "
        "order against the embedding cosine to the unpruned model (prune).",
    )
    p.add_argument("action", choices=["classify", "prune"])
    p.add_argument(
        "--sentences",
        type=int_at_least(1),
        default=16,
        help="Alice sentences the statistics / the metric average over (default 16)",
    )
    p.add_argument(
        "--importance-sentences",
        type=int_at_least(1),
        default=6,
        help="prune: the next Alice sentences, where head importance is measured (default 6)",
    )
    p.add_argument(
        "--fractions",
        type=_fractions,
        default=[i / 10 for i in range(11)],
        help="prune: comma-separated fractions of heads to prune (default 0,0.1,…,1)",
    )
    p.add_argument(
        "--seeds", type=int_at_least(1), default=3, help="prune: random orders (default 3)"
    )
    p.add_argument(
        "--threshold",
        type=float_in(0.0, 1.0, low_open=True, high_open=False),
        default=0.95,
        help="prune: the cosine level reported (default 0.95)",
    )
    p.add_argument("--png", default=None, help="prune: also write the plot to this PNG file")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print the rows as JSON instead of the table, or with PATH also write them there "
        "(classify: entropy in nats, normalised_entropy = entropy / ln T)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    add_device_argument(p)
    p.set_defaults(func=_cmd_heads)
