"""attnlab textbook, claims as data: one TOML file of claim metadata per source text, joined with
the checks by id; a claim without a check, a check without a claim and malformed metadata are
refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from attnlab.textbook import AGREES, SEEDS, Finding, all_claims, core
from attnlab.textbook.core import claim_from_data

DATA = Path(core.__file__).parent / "claims"


def _entries(seed: str) -> list[dict]:
    return tomllib.loads((DATA / f"seed{seed}.toml").read_text(encoding="utf-8"))["claim"]


def test_one_data_file_per_source_text_holds_every_claim_in_order():
    ids = [e["id"] for seed in SEEDS for e in _entries(seed)]
    assert ids == [c.id for c in all_claims()]
    assert all(e["id"].startswith(seed) for seed in SEEDS for e in _entries(seed))
    first = all_claims()[0]
    entry = _entries(first.seed)[0]
    assert (entry["quote"], entry["expected"]) == (first.quote, first.expected)


def _check() -> Finding:
    return Finding("c", "f()", AGREES)


def test_malformed_metadata_is_refused():
    good = {
        "id": "000-x-a",
        "section": "s",
        "quote": "q",
        "paraphrase": "p",
        "api": "attnlab.attention",
        "expected": AGREES,
    }
    assert claim_from_data(good, _check).quote == "q"
    for bad, match in (
        ({**good, "id": "9-x"}, "claim id must look like"),
        ({**good, "expectd": AGREES}, "unknown fields"),
        ({k: v for k, v in good.items() if k != "api"}, "missing"),
        ({**good, "expected": "maybe"}, "expected must be one of"),
        ({**good, "quote": " "}, "quote must not be empty"),
    ):
        with pytest.raises(ValueError, match=match):
            claim_from_data(bad, _check)


def test_checks_and_claims_are_joined_one_to_one(monkeypatch):
    all_claims()
    monkeypatch.setattr(core, "_CLAIMS", {})
    monkeypatch.setitem(core._CHECKS, "004-zz-a", _check)
    with pytest.raises(ValueError, match=r"checks without a claim.*004-zz-a"):
        core.all_claims()
    monkeypatch.delitem(core._CHECKS, "004-zz-a")
    monkeypatch.delitem(core._CHECKS, "000-scale-a")
    with pytest.raises(ValueError, match="claim 000-scale-a has no check"):
        core.all_claims()
    with pytest.raises(ValueError, match="has two checks"):
        core.check("000-scale-b")(_check)


def test_no_textbook_module_is_over_700_lines():
    sizes = {
        p.name: len(p.read_text(encoding="utf-8").splitlines())
        for p in Path(core.__file__).parent.rglob("*.py")
    }
    assert len(sizes) >= 20 and "seed002_practice.py" in sizes
    assert {k: v for k, v in sizes.items() if v > 700} == {}
