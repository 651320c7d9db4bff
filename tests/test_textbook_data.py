"""attnlab textbook, claims as data: one TOML file of claim metadata per source text, joined with
the checks by id; a claim without a check, a check without a claim and malformed metadata are
refused."""

from __future__ import annotations

import inspect
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
    root = Path(core.__file__).parent
    sizes = {
        p.relative_to(root).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in root.rglob("*.py")
    }
    assert len(sizes) >= 20 and "checks/scale.py" in sizes
    assert {k: v for k, v in sizes.items() if v > 700} == {}


def test_checks_are_grouped_by_subject_not_by_source_text():
    """Every check lives in a subject module of attnlab.textbook.checks (none in the data
    package, none among the shared helpers), and the modules mix the source texts."""
    homes: dict[str, set[str]] = {}
    for c in all_claims():
        module = c.check.__module__
        assert module.startswith("attnlab.textbook.checks."), (c.id, module)
        assert not module.endswith("._shared"), c.id
        homes.setdefault(module, set()).add(c.seed)
    assert max(len(seeds) for seeds in homes.values()) == len(SEEDS)
    assert [p.name for p in DATA.glob("*.py")] == ["__init__.py"]


def test_one_check_serves_several_claims(monkeypatch):
    """``check`` takes several ids: one function is the check of every claim of the same fact
    (across the texts, too), called with the claim's id when it takes one; it is refused as a
    whole when one of its ids is malformed or taken."""
    monkeypatch.setattr(core, "_CHECKS", dict(core._CHECKS))
    assert core.check("004-zz-a", "003-zz-b")(_check) is _check
    assert core._CHECKS["004-zz-a"] is core._CHECKS["003-zz-b"] is _check
    with pytest.raises(ValueError, match="has two checks"):
        core.check("004-zz-c", "004-zz-a")(_check)
    assert "004-zz-c" not in core._CHECKS
    with pytest.raises(ValueError, match="twice"):
        core.check("004-zz-d", "004-zz-d")
    with pytest.raises(ValueError, match="at least one claim id"):
        core.check()
    seen: list[str] = []

    def by_id(cid: str) -> Finding:
        seen.append(cid)
        return _check()

    core.check("004-zz-e", "001-zz-f")(by_id)
    core._CHECKS["001-zz-f"]()
    assert seen == ["001-zz-f"]
    shared: dict[object, list[str]] = {}
    for c in all_claims():
        shared.setdefault(inspect.unwrap(c.check), []).append(c.id)
    merged = {tuple(ids) for ids in shared.values() if len(ids) > 1}
    merged_ids = {i for ids in merged for i in ids}
    assert merged_ids >= {"001-3.3-a", "001-3.3-d", "002-8.2.2-a", "002-8.2.3-b", "004-2-d"}
    assert {ids[0][:3] != ids[-1][:3] for ids in merged} == {True, False}
