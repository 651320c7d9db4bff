"""attnlab textbook, the verdict rule: a ``text error`` needs attnlab to differ from the text AND
to agree with an independent derivation that imports nothing from attnlab; anything else that
fails is ``disagrees`` (a library bug), which the command prints and exits 1 on."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.functional import request
from attnlab.textbook import (
    AGREES,
    DISAGREES,
    TEXT_ERROR,
    Derivation,
    Finding,
    run_claim,
    select_claims,
)
from attnlab.textbook import derivations as ind
from attnlab.textbook.core import judged

DERIVATIONS = Path(ind.__file__)


def test_judged_needs_two_computed_facts_for_a_text_error():
    backed, unbacked = Derivation(True, "closed form"), Derivation(False, "closed form")
    assert judged(True, "why")["verdict"] == AGREES
    assert judged(True, "why", backed)["verdict"] == AGREES
    text_error = judged(False, "the text is wrong", backed)
    assert text_error == {
        "verdict": TEXT_ERROR,
        "explanation": "the text is wrong",
        "derivation": "closed form",
    }
    # differs from the text, nothing independent behind attnlab: the library is the suspect
    alone = judged(False, "the text is wrong")
    assert alone["verdict"] == DISAGREES and alone["explanation"].startswith("library bug")
    # attnlab contradicts its own witness: a library bug even where it matches the text
    for agrees in (True, False):
        bug = judged(agrees, "the text is wrong", unbacked)
        assert bug["verdict"] == DISAGREES and "the text is wrong" not in bug["explanation"]
    Finding("c", "f()", **text_error)  # a valid finding
    with pytest.raises(ValueError, match="one line"):
        Derivation(True, "a\nb")


def test_the_derivations_import_nothing_from_attnlab():
    """Parsed, not imported: every import statement of the module, deferred ones included."""
    tree = ast.parse(DERIVATIONS.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import reaches into attnlab"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
    assert imported <= {"__future__", "math", "numpy", "torch", "transformers"}, imported
    assert "attnlab" not in imported


def test_the_derivations_compute_what_they_say():
    """Spot values a hand can check: a wrong witness would let the library off."""
    assert ind.softmax([0.0, np.log(3.0)]).tolist() == pytest.approx([0.25, 0.75])
    assert ind.sinusoid(2, 4)[1].tolist() == pytest.approx(
        [np.sin(1), np.cos(1), np.sin(0.01), np.cos(0.01)]
    )
    assert ind.sinusoid_distance(1, 4) == pytest.approx(
        np.linalg.norm(ind.sinusoid(2, 4)[1] - ind.sinusoid(2, 4)[0])
    )
    assert ind.causal_keep(2, 3).tolist() == [[True, True, False], [True, True, True]]
    assert ind.causal_keep(2, 3, bottom_right=False).tolist() == [
        [True, False, False],
        [True, True, False],
    ]
    assert ind.band_keep(3, 2).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    assert ind.entropy([0.5, 0.5, 0.0]) == pytest.approx(np.log(2))
    assert ind.transformer_layer_flops(1, 1, 4) == 8 + 16 + 4
    q = np.eye(2)
    assert ind.sdpa(q, q, q, scale=0.0).tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert ind.span_ramp([0, 2, 3, 4], 2.0, 2.0).tolist() == [1.0, 1.0, 0.5, 0.0]
    assert ind.tiled_io(4, 1, 2) == 8 + 2 * (12 + 16)


def test_every_text_error_carries_its_derivation():
    rows = [run_claim(c) for c in select_claims(["002-8.2.2", "003-4.3", "000-scale"])]
    errors = [r for r in rows if r.finding.verdict == TEXT_ERROR]
    assert len(errors) >= 5
    assert all(r.finding.derivation.strip() for r in errors)
    assert all(r.claim.expected == r.finding.verdict for r in rows)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["textbook", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_library_bug_is_printed_as_such_and_exits_1(monkeypatch, capsys):
    """The default scale 1/√d → 1/d: the claims it breaks say 'disagrees', the text error whose
    witness it breaks too, and the command exits 1 naming them as library bugs."""
    code, out, _ = _cli(capsys, "--json", "--quiet", "--only", "000-def-a", "000-scale-b")
    assert code == 0 and [r["verdict"] for r in json.loads(out)] == [AGREES, TEXT_ERROR]
    monkeypatch.setitem(request.SCORES, "dot", request.Score("dot", lambda x: x, lambda d: 1.0 / d))
    code, out, err = _cli(capsys, "--json", "--quiet", "--only", "000-def-a", "000-scale-b")
    rows = json.loads(out)
    assert code == 1
    assert [r["verdict"] for r in rows] == [DISAGREES, DISAGREES]
    assert all(r["explanation"].startswith("library bug") for r in rows)
    assert "library bugs" in err and "000-scale-b" in err
    code, out, _ = _cli(capsys, "--quiet", "--only", "000-def-a")
    assert code == 1 and "[disagrees] 000-def-a" in out and "library bugs: ['000-def-a']" in out


def test_the_transformers_witness_of_head_pruning_removes_heads():
    """002-8.3.2-c's witness: nothing pruned gives cosine 1; the heads it zeroes change the
    embeddings, more heads more."""
    from attnlab.models.minilm import model_path

    path, texts = str(model_path()), ["The cat sat on the mat.", "Attention is all you need."]
    assert ind.bert_pruned_cosine(path, texts, []) == pytest.approx(1.0, abs=1e-12)
    one = ind.bert_pruned_cosine(path, texts, [(0, 0)])
    layer = ind.bert_pruned_cosine(path, texts, [(0, h) for h in range(12)])
    assert layer < one < 1.0
