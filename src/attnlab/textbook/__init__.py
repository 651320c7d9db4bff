"""The source texts, runnable: every checkable claim with a live check and a verdict.

``attnlab textbook`` walks the claims of the five source texts (Chinese textbook chapters on
self-attention) and prints, per claim, what the text says, what attnlab computes (and the call
that computed it) and a verdict: ``agrees``, ``text error``, ``disagrees`` (a library bug) or
``not checkable here``. See `core` for the data model and the verdict rule, `derivations` for the
independent derivations a ``text error`` needs, `render` for the outputs (text, JSON,
``docs/textbook.md``) and `exercises` for the worked exercise solutions.

Example:
    >>> from attnlab.textbook import select_claims, run_claim
    >>> row = run_claim(select_claims(["000"])[0])
    >>> row.finding.verdict in ("agrees", "text error", "disagrees", "not checkable here")
    True
"""

from .core import (
    AGREES,
    DISAGREES,
    NOT_CHECKABLE,
    SEEDS,
    TEXT_ERROR,
    VERDICTS,
    Claim,
    Derivation,
    Finding,
    Row,
    all_claims,
    check,
    run_claim,
    select_claims,
)
from .exercises import Exercise, all_exercises, exercise, get_exercise

__all__ = [
    "AGREES",
    "DISAGREES",
    "NOT_CHECKABLE",
    "SEEDS",
    "TEXT_ERROR",
    "VERDICTS",
    "Claim",
    "Derivation",
    "Exercise",
    "Finding",
    "Row",
    "all_claims",
    "all_exercises",
    "check",
    "exercise",
    "get_exercise",
    "run_claim",
    "select_claims",
]
