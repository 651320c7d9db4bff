"""Claims of the source texts and the live checks that judge them.

A `Claim` is one quantitative or checkable statement of a source text (``00N``, the first part of
its id): where it is (seed and section), the original sentence, an English paraphrase, the attnlab
API that checks it, the assumptions it is checked under, and a ``check`` function that calls the
library live and returns a `Finding` — what attnlab computes, the call that computed it, and a
verdict:

- ``"agrees"``: the library reproduces the claim under the stated assumptions;
- ``"text error"``: the text is wrong; ``explanation`` says why in one line;
- ``"disagrees"``: attnlab's value differs from the text's and nothing independent backs
  attnlab's value — a library bug until shown otherwise (the command exits 1);
- ``"not checkable here"``: ``explanation`` names the missing resource (a GPU, data that cannot
  ship, a historical fact).

The verdict rule (`judged`): a check computes whether attnlab's value matches the text's. If it
does, the claim ``agrees``. If it does not, the library is blamed by default: the verdict is
``disagrees``. Only two computed facts together make a ``text error``: attnlab's value differs
from the text's AND agrees with an independent derivation of the same quantity — a closed form,
another library (torch, numpy) or a second method — written in `attnlab.textbook.derivations`,
which imports nothing from attnlab (a test holds that). The derivation is a `Derivation`: whether
attnlab matched it and, in one line, what it computed; a ``text error`` finding carries that line.
A check with a derivation that attnlab does not match is ``disagrees`` whatever the text says,
so a change in the library can never turn into blame on the text: the pre-written reason of a
text error is only printed when the derivation still stands behind the library.

Each claim also declares the verdict it is ``expected`` to get. The test suite runs every check
and asserts that the computed verdict equals the declared one, so a change in the library that
breaks a reproduced claim fails a test. ``computed`` strings are deterministic (seeded, float64,
counts and ratios — never wall-clock timings), so the rendered ``docs/textbook.md`` can be checked
for drift. What depends on the machine (a wall-clock time, this CPU's name, its measured matmul
rate) goes into a finding's ``measured`` text: the command prints it and ``--json`` carries it,
but it never decides a verdict and never enters ``docs/textbook.md``.

Claims are data: every seed has a data file ``attnlab/textbook/claims/seed00N.toml`` with one
``[[claim]]`` table per claim (id, section, verbatim quote, paraphrase, api, declared verdict,
assumptions, ``slow``, ``subjects``), in the order of the text. ``subjects`` names the facts of the
library a check depends on; the test suite breaks each subject in turn (a mutation of the
library, ``tests/textbook_mutations.py``) and requires every claim of that subject to come out
``disagrees``, never ``text error``. The checks are Python functions registered by
id with the `check` decorator in the modules of ``attnlab.textbook.checks``, one module per
subject (a function registered with several ids serves every claim of the same fact);
`all_claims` imports them and joins both, and refuses a claim without a check or a check without a
claim.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources

import tomllib

AGREES = "agrees"
TEXT_ERROR = "text error"
DISAGREES = "disagrees"
NOT_CHECKABLE = "not checkable here"
VERDICTS = (AGREES, TEXT_ERROR, DISAGREES, NOT_CHECKABLE)

#: Seed files of the source texts, by their three-digit number.
SEEDS = {
    "000": "13.2 自注意力机制的数学推导 (the mathematics of self-attention)",
    "001": "Day 2 理论学习：自注意力机制深度解析 (self-attention in depth)",
    "002": "第8章：Transformer与注意力机制 (chapter 8: Transformer and attention)",
    "003": "自注意力机制如何提升Transformer的性能 (how self-attention improves the Transformer)",
    "004": "缩放点积注意力：原理与机制 (scaled dot-product attention: principles)",
}

_ID = re.compile(r"^(000|001|002|003|004)-[0-9A-Za-z.]+-[a-z0-9]+$")


@dataclass(frozen=True)
class Finding:
    """What a check found.

    Attributes:
        computed: what attnlab computes, with the numbers (deterministic text).
        call: the call(s) that computed it, as code.
        verdict: one of `VERDICTS`.
        explanation: one line; required for ``text error`` (why), ``disagrees`` (what the
            library got wrong) and ``not checkable here`` (the missing resource).
        measured: machine-dependent observations (wall-clock times, this machine), "" if none;
            reported, never used for the verdict, left out of ``docs/textbook.md``.
        derivation: the independent derivation attnlab's value agreed with, one line; required
            for ``text error`` (the second computed fact behind it), "" otherwise if none.
    """

    computed: str
    call: str
    verdict: str
    explanation: str = ""
    measured: str = ""
    derivation: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict != AGREES and not self.explanation.strip():
            raise ValueError(f"a {self.verdict!r} finding needs an explanation")
        if "\n" in self.explanation or "\n" in self.derivation:
            raise ValueError("explanation and derivation must be one line")
        if self.verdict == TEXT_ERROR and not self.derivation.strip():
            raise ValueError("a 'text error' finding needs the independent derivation behind it")


@dataclass(frozen=True)
class Claim:
    """One checkable statement of a source text (see the module docstring).

    Attributes:
        id: ``SEED-SECTION-LETTER``, e.g. ``"002-8.1.3-a"``.
        section: the section heading (as in the text, shortened).
        quote: the original sentence(s), verbatim from the seed file.
        paraphrase: an English paraphrase.
        api: the attnlab API that checks it (comma-separated names).
        expected: the verdict the check is expected to return.
        check: computes the `Finding` by calling the library.
        assumptions: the conditions of the check (model, batch, precision, n), "" if none.
        slow: a training experiment (runs only with ``--with-training``).
        subjects: the facts of the library the check depends on (``"scale"``, ``"sinusoid"``,
            ``"causal"``, …): a mutation of one of them must turn the claim into ``disagrees``
            (``tests/test_textbook_mutations.py`` holds that).
    """

    id: str
    section: str
    quote: str
    paraphrase: str
    api: str
    expected: str
    check: Callable[[], Finding] = field(repr=False, compare=False)
    assumptions: str = ""
    slow: bool = False
    subjects: tuple[str, ...] = ()

    @property
    def seed(self) -> str:
        """The seed file number, ``"000"`` … ``"004"``."""
        return self.id[:3]


@dataclass(frozen=True)
class Row:
    """A claim with its finding, as the command prints it."""

    claim: Claim
    finding: Finding
    seconds: float

    @property
    def ok(self) -> bool:
        """The computed verdict is the declared one."""
        return self.finding.verdict == self.claim.expected

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields (``--json``)."""
        c, f = self.claim, self.finding
        return {
            "id": c.id,
            "seed": c.seed,
            "section": c.section,
            "quote": c.quote,
            "paraphrase": c.paraphrase,
            "api": c.api,
            "assumptions": c.assumptions,
            "computed": f.computed,
            "call": f.call,
            "verdict": f.verdict,
            "explanation": f.explanation,
            "measured": f.measured,
            "derivation": f.derivation,
            "expected": c.expected,
            "ok": self.ok,
        }


#: A check: computes the `Finding` of a claim, with no argument or with the claim's id.
CheckFn = Callable[[], Finding] | Callable[[str], Finding]

_CHECKS: dict[str, Callable[[], Finding]] = {}
_CLAIMS: dict[str, Claim] = {}
_FIELDS = {
    "id",
    "section",
    "quote",
    "paraphrase",
    "api",
    "expected",
    "assumptions",
    "slow",
    "subjects",
}
_REQUIRED = ("section", "quote", "paraphrase", "api", "expected")


def check(*ids: str) -> Callable[[CheckFn], CheckFn]:
    """Registers the decorated function as the check of the claims ``ids``, each with its
    metadata (section, quote, paraphrase, api, declared verdict, assumptions) in a ``[[claim]]``
    table of its seed's data file ``claims/seed00N.toml``.

    Several ids make one function the check of every claim of the same fact
    (``@check("001-3.3-a", "002-8.2.2-a")``): the texts state it in several places, the library
    computes it once. A function without parameters returns the same `Finding` for each of them;
    a function with one parameter is called with the claim's id, for what differs between the
    texts (the sizes a text uses, its wording, the value it states).

    Args:
        *ids: the claim ids, ``SEED-SECTION-LETTER`` (at least one).

    Returns:
        The decorator; it registers the function under every id and returns it unchanged.

    Raises:
        ValueError: no id, a malformed id, an id given twice, or an id that already has a check
            (then none of ``ids`` is registered).
    """
    if not ids:
        raise ValueError("check needs at least one claim id")
    for id in ids:
        if not _ID.match(id):
            raise ValueError(f"claim id must look like '002-8.1.3-a', got {id!r}")
        if id in _CHECKS:
            raise ValueError(f"claim id {id!r} has two checks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"a claim id is given twice: {ids}")

    def register(fn: CheckFn) -> CheckFn:
        takes_id = bool(inspect.signature(fn).parameters)
        for id in ids:
            _CHECKS[id] = _bound(fn, id) if takes_id else fn
        return fn

    return register


def _bound(fn: Callable[[str], Finding], id: str) -> Callable[[], Finding]:
    """``fn`` called with the claim id ``id``, under ``fn``'s name and module (`inspect.unwrap`
    gives ``fn`` back)."""

    def run() -> Finding:
        return fn(id)

    return functools.update_wrapper(run, fn)


def claim_from_data(entry: dict[str, object], check_fn: Callable[[], Finding]) -> Claim:
    """A `Claim` from one ``[[claim]]`` table of a seed's data file and its check.

    Raises:
        ValueError: a malformed id, an unknown or missing field, an unknown declared verdict, or
            an empty quote, paraphrase or api.
    """
    cid = str(entry.get("id", ""))
    if not _ID.match(cid):
        raise ValueError(f"claim id must look like '002-8.1.3-a', got {cid!r}")
    unknown = set(entry) - _FIELDS
    missing = [f for f in _REQUIRED if f not in entry]
    if unknown or missing:
        raise ValueError(f"claim {cid}: unknown fields {sorted(unknown)}, missing {missing}")
    if entry["expected"] not in VERDICTS:
        raise ValueError(f"claim {cid}: expected must be one of {VERDICTS}")
    for name in ("quote", "paraphrase", "api"):
        if not str(entry[name]).strip():
            raise ValueError(f"claim {cid}: {name} must not be empty")
    fields = {k: v for k, v in entry.items() if k != "id"}
    fields["subjects"] = tuple(fields.get("subjects", ()))
    return Claim(id=cid, check=check_fn, **fields)


def _load() -> None:
    """Imports the check modules, then joins every seed's data file with the checks."""
    if _CLAIMS:
        return
    from . import checks, claims

    for info in pkgutil.iter_modules(checks.__path__):
        importlib.import_module(f"{checks.__name__}.{info.name}")
    loaded: dict[str, Claim] = {}
    for seed in SEEDS:
        data = resources.files(claims).joinpath(f"seed{seed}.toml").read_text(encoding="utf-8")
        for entry in tomllib.loads(data)["claim"]:
            cid = str(entry.get("id"))
            if cid in loaded:
                raise ValueError(f"claim id {cid!r} is in the data twice")
            if cid not in _CHECKS:
                raise ValueError(f"claim {cid} has no check (@check({cid!r}))")
            loaded[cid] = claim_from_data(entry, _CHECKS[cid])
    orphans = sorted(set(_CHECKS) - set(loaded))
    if orphans:
        raise ValueError(f"checks without a claim in the data files: {orphans}")
    _CLAIMS.update(loaded)


def all_claims(*, include_slow: bool = True) -> list[Claim]:
    """Every claim: by seed, then in the order of its data file (the order of the text)."""
    _load()
    return [c for c in _CLAIMS.values() if include_slow or not c.slow]  # data order


def select_claims(only: Iterable[str] = (), *, include_slow: bool = False) -> list[Claim]:
    """The claims whose id equals or starts with one of ``only`` (all when empty).

    Raises:
        ValueError: an entry of ``only`` matches no claim (the message lists the seeds).
    """
    claims = all_claims(include_slow=True)
    wanted = list(only)
    if not wanted:
        return [c for c in claims if include_slow or not c.slow]
    chosen = []
    for prefix in wanted:
        hits = [c for c in claims if c.id == prefix or c.id.startswith(prefix + "-")]
        hits = hits or [c for c in claims if c.id.startswith(prefix)]
        if not hits:
            raise ValueError(
                f"only: {prefix!r} matches no claim (ids look like '002-8.1.3-a'; seeds "
                f"{sorted(SEEDS)})"
            )
        chosen += [c for c in hits if c not in chosen]
    return chosen


def run_claim(c: Claim) -> Row:
    """Runs one check; a check that raises is a bug, not a verdict, and propagates."""
    start = time.perf_counter()
    finding = c.check()
    if not isinstance(finding, Finding):
        raise TypeError(f"claim {c.id}: check returned {type(finding).__name__}, not a Finding")
    return Row(c, finding, time.perf_counter() - start)


@dataclass(frozen=True)
class Derivation:
    """An independent derivation of the quantity a check computes with attnlab.

    Attributes:
        agrees: attnlab's value equals the derivation's (computed, within the check's tolerance).
        says: one line — what the derivation computed and how (closed form, torch, numpy).
    """

    agrees: bool
    says: str

    def __post_init__(self) -> None:
        if not self.says.strip() or "\n" in self.says:
            raise ValueError("a derivation says what it computed, in one line")


def judged(agrees: bool, why: str, derivation: Derivation | None = None) -> dict[str, str]:
    """`Finding`'s ``verdict``/``explanation``/``derivation`` keywords by the verdict rule of the
    module docstring (``Finding(computed, call, **judged(ok, "…", Derivation(…)))``).

    Args:
        agrees: attnlab's value matches the text's.
        why: one line — why the text is wrong (printed for a ``text error``), or what attnlab's
            value fails to match (printed for a ``disagrees`` without a derivation).
        derivation: the independent derivation of attnlab's value, if the check has one.

    Returns:
        ``agrees`` when attnlab matches the text and (if given) the derivation; ``text error``
        with ``why`` when attnlab differs from the text and matches the derivation; else
        ``disagrees``, which names the library as the suspect.
    """
    if derivation is not None and not derivation.agrees:
        return {
            "verdict": DISAGREES,
            "explanation": "library bug: attnlab's value differs from the independent "
            f"derivation ({derivation.says})",
            "derivation": "",
        }
    if agrees:
        return {"verdict": AGREES, "explanation": "", "derivation": ""}
    if derivation is None:
        return {
            "verdict": DISAGREES,
            "explanation": f"library bug: attnlab differs from the text ({why}) and no "
            "independent derivation backs attnlab's value",
            "derivation": "",
        }
    return {"verdict": TEXT_ERROR, "explanation": why, "derivation": derivation.says}


def tiny(x: float, tol: float = 1e-12) -> str:
    """A difference that should be round-off: ``≈0 (< tol)`` below ``tol`` (its last bits vary
    with the CPU's BLAS and thread count, which would make ``computed`` text machine-dependent),
    else `fmt` of it."""
    return f"≈0 (< {tol:g})" if x < tol else fmt(x)


def fmt(x: float, digits: int = 4) -> str:
    """A float with ``digits`` significant digits, the same on every machine (for ``computed``)."""
    return f"{x:.{digits}g}"


__all__ = [
    "AGREES",
    "DISAGREES",
    "NOT_CHECKABLE",
    "SEEDS",
    "TEXT_ERROR",
    "VERDICTS",
    "Claim",
    "Derivation",
    "Finding",
    "Row",
    "all_claims",
    "check",
    "claim_from_data",
    "fmt",
    "judged",
    "run_claim",
    "select_claims",
    "tiny",
]
