"""attnlab textbook, the mutation test: a bug put into the library makes the claims that depend on
it "disagrees" — a library bug — and never "text error". Each claim declares its ``subjects`` (the
facts of the library its check depends on) in its seed's data file; `textbook_mutations.MUTATIONS`
breaks each subject the way a plausible bug would, and only the claims of that subject run under
it (the whole suite of checks takes minutes on a loaded machine)."""

from __future__ import annotations

import sys

import pytest

from attnlab.textbook import DISAGREES, NOT_CHECKABLE, TEXT_ERROR, all_claims, run_claim
from textbook_mutations import MUTATIONS

CLAIMS = all_claims(include_slow=False)

#: Claims that compute something but that no mutation of the registry reaches yet: the gap still
#: to close (a claim leaves the list when it gains a subject; the list may only shrink).
UNCOVERED: set[str] = set()


def _clear_check_caches() -> None:
    """Forgets what the checks' cached helpers computed (an earlier run in this process would
    otherwise hand the unmutated library's results to the mutated one)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("attnlab.textbook.checks."):
            for value in vars(module).values():
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@pytest.fixture
def fresh_checks():
    _clear_check_caches()
    yield
    _clear_check_caches()


@pytest.mark.parametrize("subject", sorted(MUTATIONS))
def test_a_mutation_makes_its_claims_disagree_never_text_error(subject, monkeypatch, fresh_checks):
    affected = [c for c in CLAIMS if subject in c.subjects]
    assert affected, f"no claim declares the subject {subject!r}"
    before = {c.id: run_claim(c).finding.verdict for c in affected[:3]}
    assert DISAGREES not in before.values()
    MUTATIONS[subject](monkeypatch)
    _clear_check_caches()
    verdicts = {c.id: run_claim(c).finding.verdict for c in affected}
    wrong = {k: v for k, v in verdicts.items() if v != DISAGREES}
    assert not wrong, f"under the {subject!r} mutation these claims did not disagree: {wrong}"
    assert TEXT_ERROR not in verdicts.values()


def test_every_subject_has_a_mutation_and_every_computing_claim_a_subject():
    declared = {s for c in CLAIMS for s in c.subjects}
    assert declared == set(MUTATIONS), declared ^ set(MUTATIONS)
    computing = [c for c in CLAIMS if c.expected != NOT_CHECKABLE]
    uncovered = {c.id for c in computing if not c.subjects}
    assert uncovered <= UNCOVERED, f"claims lost their subject: {sorted(uncovered - UNCOVERED)}"
    assert {c.id for c in computing} >= UNCOVERED, "UNCOVERED names a claim that is not computing"
    assert uncovered == UNCOVERED, (
        f"covered now, drop from UNCOVERED: {sorted(UNCOVERED - uncovered)}"
    )
    assert sum(c.expected == NOT_CHECKABLE for c in all_claims()) <= 10
    # every text error sits on at least one subject, so a library bug cannot hide behind it
    text_errors = [c.id for c in CLAIMS if c.expected == TEXT_ERROR and not c.subjects]
    assert not text_errors, f"text errors without a subject: {text_errors}"
