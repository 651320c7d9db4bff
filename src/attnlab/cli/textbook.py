"""``attnlab textbook``: every checkable claim of the source texts, checked live, with a verdict.

$ attnlab textbook                      # all claims (training experiments excluded)
$ attnlab textbook --only 002-8.1       # one section (an id or an id prefix)
$ attnlab textbook --json > claims.json
$ attnlab textbook --markdown docs/textbook.md
$ attnlab textbook --exercise 8.2       # a worked exercise solution
$ attnlab textbook --list               # ids only
"""

from __future__ import annotations

import argparse
import re
import sys

from ._args import UsageError, check_output_file


def _cmd_textbook(args: argparse.Namespace) -> int:
    from ..textbook import DISAGREES, all_exercises, get_exercise, run_claim, select_claims
    from ..textbook.exercises import render as render_exercise
    from ..textbook.render import as_json, as_markdown, as_text, summary
    from ._output import steps, width

    if args.exercise is not None:
        try:
            text = render_exercise(get_exercise(args.exercise))
        except ValueError as e:
            raise UsageError("--exercise", str(e).removeprefix("id: ")) from None
        print(_wrap_items(text))
        return 0
    if args.markdown is not None:
        check_output_file(args.markdown, "--markdown", suffixes=(".md",))
    try:
        claims = select_claims(args.only or (), include_slow=args.with_training or args.list)
    except ValueError as e:
        raise UsageError("--only", str(e).removeprefix("only: ")) from None
    if args.list:
        listed = [
            (c.id, c.expected + (" (--with-training)" if c.slow else ""), c.section) for c in claims
        ]
        exercises = []
        for e in all_exercises() if not args.only else ():
            origin = "" if e.from_text else " (not from the text)"
            exercises.append((f"exercise {e.id}", e.source + origin, e.title))
        if sys.stdout.isatty():
            _print_list(listed, exercises)
        else:  # piped or written to a file: tab-separated lines, a claim or an exercise each
            print("\n".join("\t".join(row) for row in [*listed, *exercises]))
        return 0
    rows = []
    with steps(claims, desc="attnlab textbook", quiet=args.quiet) as bar:
        for c in bar:
            rows.append(run_claim(c))
    if args.markdown is not None:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(as_markdown(rows))
        print(f"wrote {args.markdown}: {summary(rows)}")
    elif args.json:
        print(as_json(rows))
    else:
        print(as_text(rows, width=width() or 100))
    bugs = [r.claim.id for r in rows if r.finding.verdict == DISAGREES]
    if bugs:
        print(
            f"attnlab textbook: library bugs (attnlab disagrees with the text and nothing "
            f"independent backs it): {bugs}",
            file=sys.stderr,
        )
    mismatched = [r.claim.id for r in rows if not r.ok]
    if mismatched:
        print(
            f"attnlab textbook: verdicts differ from the declared ones: {mismatched}",
            file=sys.stderr,
        )
    return 1 if bugs or mismatched else 0


def _print_list(claims: list[tuple[str, ...]], exercises: list[tuple[str, ...]]) -> None:
    """--list on a terminal: the claims, then the exercises, as tables that fit it (``COLUMNS``,
    else its width)."""
    from ._output import Col, table

    tables = []
    if claims:
        tables.append(table(["claim", "declared verdict", Col("section", wide=True)], claims))
    if exercises:
        columns = ["exercise", Col("source", wide=True), Col("title", wide=True)]
        tables.append(table(columns, exercises))
    print("\n\n".join(tables))


def _wrap_items(text: str) -> str:
    """Each line of ``text`` wrapped to the terminal, its later lines under its text: under the
    words after an item's marker (``a) ``, ``- ``) or its own indentation."""
    from ._output import wrap

    lines = []
    for line in text.split("\n"):
        lead = re.match(r"\s*(?:[a-z0-9]\) |- )?", line)  # matches every line (maybe empty)
        lines.append(wrap(line, indent=" " * lead.end()))
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab textbook`` to the ``attnlab`` command's subparsers."""
    p = sub.add_parser(
        "textbook",
        help="check every claim of the source texts live and print a verdict for each",
        description=(
            "Walks every quantitative or checkable claim of the five source texts and prints, "
            "under each text's number and title, per claim its id (seed + section), the "
            "section's title in English and as the text has it, the original sentence and an "
            "English paraphrase, "
            "what attnlab computes and the call that computed it, and a verdict: agrees, text "
            "error (with the reason and the independent derivation that backs attnlab), "
            "disagrees (a library bug) or not checkable here (naming what is missing). Exits 1 "
            "on any disagrees and if a verdict differs from the one the claim declares. The text "
            "wraps to the terminal's width and no field is cut; --json carries every field."
        ),
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the rows as JSON")
    out.add_argument("--markdown", metavar="PATH", help="write the rows as Markdown (docs)")
    out.add_argument(
        "--list",
        action="store_true",
        help="list claim and exercise ids only (tab-separated lines when piped)",
    )
    out.add_argument("--exercise", metavar="ID", help="print the worked solution of an exercise")
    p.add_argument(
        "--only",
        nargs="+",
        action="extend",
        metavar="ID",
        help="claims whose id equals or starts with an ID (e.g. 002 or 002-8.1.3; repeatable)",
    )
    p.add_argument(
        "--with-training",
        action="store_true",
        help="also run the claims that train a model (minutes)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_textbook)
