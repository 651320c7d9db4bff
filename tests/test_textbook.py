"""attnlab textbook: every claim's live check gives its declared verdict; docs/textbook.md is
current; quotes are verbatim; the command's outputs and errors."""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.textbook import (
    AGREES,
    DISAGREES,
    NOT_CHECKABLE,
    TEXT_ERROR,
    Finding,
    all_claims,
    all_exercises,
    run_claim,
    select_claims,
)
from attnlab.textbook.render import as_json, as_markdown, as_text

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "textbook.md"
SEEDS = Path(os.environ.get("ATTNLAB_SEEDS", ROOT.parent / "shared" / "seeds"))
CLAIMS = all_claims(include_slow=False)


@pytest.fixture(scope="module")
def rows():
    return {c.id: run_claim(c) for c in CLAIMS}


@pytest.mark.parametrize("claim", CLAIMS, ids=[c.id for c in CLAIMS])
def test_every_claim_gets_its_declared_verdict(claim, rows):
    row = rows[claim.id]
    assert row.finding.verdict == claim.expected, (row.finding.computed, row.finding.explanation)
    assert row.finding.computed.strip() and row.finding.call.strip()


def test_docs_textbook_md_is_current(rows):
    """The file was rendered in another process: any timing or unseeded number in a check's
    ``computed`` text shows up here as a difference."""
    want = as_markdown([rows[c.id] for c in CLAIMS])
    assert DOC.read_text(encoding="utf-8") == want, (
        "docs/textbook.md is stale: run `attnlab textbook --markdown docs/textbook.md`"
    )


def _seed_text(seed: str) -> str:
    files = sorted(SEEDS.glob(f"{seed}_*.txt"))
    assert len(files) == 1, files
    return " ".join(files[0].read_text(encoding="utf-8").split())


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the source texts (../shared/seeds) are not here")
@pytest.mark.parametrize("claim", all_claims(), ids=[c.id for c in all_claims()])
def test_quotes_are_verbatim_fragments_of_their_seed(claim):
    text = _seed_text(claim.seed)
    for fragment in claim.quote.split(" … "):
        assert " ".join(fragment.split()) in text, fragment


def _resolve(api: str) -> object:
    """The object named by the first dotted path of an ``api`` entry (``a.b.c(...)`` → a.b.c)."""
    path = re.match(r"[A-Za-z_][\w.]*", api.strip()).group(0).rstrip(".")
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


@pytest.mark.parametrize("claim", all_claims(), ids=[c.id for c in all_claims()])
def test_every_named_api_exists(claim):
    for entry in claim.api.split(","):
        if entry.strip().startswith(("attnlab", "torch")):
            assert _resolve(entry) is not None


def test_ids_are_unique_and_every_seed_is_covered():
    ids = [c.id for c in all_claims()]
    assert len(ids) == len(set(ids))
    assert {c.seed for c in all_claims()} <= {"000", "001", "002", "003", "004"}


def test_finding_rules():
    with pytest.raises(ValueError, match="needs an explanation"):
        Finding("x", "f()", TEXT_ERROR, derivation="closed form")
    with pytest.raises(ValueError, match="needs the independent derivation"):
        Finding("x", "f()", TEXT_ERROR, "the text is wrong")
    with pytest.raises(ValueError, match="needs an explanation"):
        Finding("x", "f()", DISAGREES)
    with pytest.raises(ValueError, match="needs an explanation"):
        Finding("x", "f()", NOT_CHECKABLE, " ")
    with pytest.raises(ValueError, match="verdict must be one of"):
        Finding("x", "f()", "maybe")
    with pytest.raises(ValueError, match="one line"):
        Finding("x", "f()", TEXT_ERROR, "a\nb", derivation="d")
    with pytest.raises(ValueError, match="one line"):
        Finding("x", "f()", TEXT_ERROR, "a", derivation="d\ne")
    assert Finding("x", "f()", AGREES).explanation == ""


def test_select_claims_by_prefix_and_bad_ids():
    first = CLAIMS[0]
    assert select_claims([first.id]) == [first]
    seed = select_claims([first.seed])
    assert first in seed and all(c.seed == first.seed for c in seed)
    with pytest.raises(ValueError, match=r"only: '9' matches no claim"):
        select_claims(["9"])


def test_renderings_carry_every_field(rows):
    some = list(rows.values())[:3]
    text = as_text(some)
    data = json.loads(as_json(some))
    for row, item in zip(some, data, strict=True):
        assert item["id"] == row.claim.id and item["verdict"] == row.finding.verdict
        assert item["quote"] == row.claim.quote and item["computed"] == row.finding.computed
        assert row.claim.id in text and f"[{row.finding.verdict}]" in text
    assert text.rstrip().endswith("not checkable here")


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``attnlab textbook ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(["textbook", *args])
    except SystemExit as e:  # parser errors exit like argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_only_and_errors(tmp_path, capsys):
    first = CLAIMS[0]
    code, out, err = _cli(capsys, "--json", "--only", first.id, "--quiet")
    assert code == 0, err
    assert [r["id"] for r in json.loads(out)] == [first.id]
    last = CLAIMS[-1]
    code, out, err = _cli(capsys, "--json", "--only", first.id, "--only", last.id, "--quiet")
    assert code == 0, err
    assert [r["id"] for r in json.loads(out)] == [first.id, last.id]  # --only repeats
    for args, flag in (
        (["--only", "no-such"], "--only"),
        (["--exercise", "99.9"], "--exercise"),
        (["--markdown", str(tmp_path / "x.txt")], "--markdown"),
    ):
        code, out, err = _cli(capsys, *args)
        assert code == 2 and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1 and f"argument {flag}" in err


def test_cli_list_names_every_claim_and_exercise(capsys):
    code, out, err = _cli(capsys, "--list")
    assert code == 0, err
    listed = [line.split("\t")[0] for line in out.splitlines()]
    assert [c.id for c in all_claims()] == [x for x in listed if not x.startswith("exercise ")]
    assert [f"exercise {e.id}" for e in all_exercises()] == [
        x for x in listed if x.startswith("exercise ")
    ]
