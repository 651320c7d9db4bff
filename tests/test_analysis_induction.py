"""attnlab.analysis.induction: prefix matching, previous-token and copying scores on hand-built
attention patterns and circuits whose answer is known, against TransformerLens's induction score
(the mean of the diagonal ``n − 1`` below the main one on a segment repeated twice) and against a
direct measurement of the logits a head writes."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.analysis.induction import (
    copying_score,
    ov_circuits,
    prefix_match_targets,
    prefix_matching_score,
    previous_token_score,
)
from attnlab.modules import MultiHeadAttention


def _repeated(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    segment = torch.randperm(50, generator=g)[:n]  # n distinct tokens
    return torch.cat([segment, segment])  # (2n,)


def _rows_to(positions: list[int]) -> torch.Tensor:
    """One head whose row i puts all its weight on key positions[i]."""
    L = len(positions)
    w = torch.zeros(L, L)
    w[torch.arange(L), torch.tensor(positions)] = 1.0
    return w


def test_a_perfect_induction_head_scores_one_and_a_previous_token_head_zero():
    n = 7
    tokens = _repeated(n)
    L = 2 * n
    induction = _rows_to([0] * n + [i - n + 1 for i in range(n, L)])
    previous = _rows_to([0] + [i - 1 for i in range(1, L)])
    w = torch.stack([induction, previous])[None]  # (1 layer, 2 heads, L, L)
    score = prefix_matching_score(w, tokens)
    assert score.shape == (1, 2)
    torch.testing.assert_close(score, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    prev = previous_token_score(w)  # the induction head's row 1 looks at key 0: one hit
    torch.testing.assert_close(prev, torch.tensor([[1 / (L - 1), 1.0]], dtype=torch.float64))


def test_uniform_causal_attention_scores_the_share_of_matching_keys():
    tokens = torch.tensor([3, 5, 3, 3, 9])
    L = len(tokens)
    w = torch.ones(L, L).tril()
    w = (w / w.sum(-1, keepdim=True))[None]  # (H=1, L, L)
    # rows with an earlier occurrence: i=2 (3 at 0 → key 1), i=3 (3 at 0, 2 → keys 1, 3)
    expected = (1 / 3 + 2 / 4) / 2
    assert prefix_matching_score(w, tokens).item() == pytest.approx(expected)
    targets = prefix_match_targets(tokens)
    assert targets.nonzero().tolist() == [[2, 1], [3, 1], [3, 3]]


def test_no_repeated_token_gives_nan_and_the_batch_is_kept():
    unique = torch.arange(6)
    w = torch.full((2, 6, 6), 1 / 6)
    assert torch.isnan(prefix_matching_score(w, unique)).all()
    tokens = torch.stack([_repeated(3, 0), _repeated(3, 1)])  # (B=2, 6)
    per_item = prefix_matching_score(w.expand(2, 2, 6, 6), tokens)
    assert per_item.shape == (2, 2)
    for b in range(2):
        torch.testing.assert_close(per_item[b], prefix_matching_score(w, tokens[b]))


def test_agrees_with_transformerlens_induction_score_on_random_patterns():
    """TransformerLens (`ActivationCache` demos, Neel Nanda's induction-head notebook): on a
    segment of n distinct tokens repeated twice, the induction score of a head is the mean of
    its pattern's diagonal at offset −(n − 1), taken over the second half's queries."""
    n = 9
    tokens = _repeated(n, seed=3)
    L = 2 * n
    logits = torch.randn(3, 4, L, L, generator=torch.Generator().manual_seed(1))
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    w = logits.masked_fill(~causal, -math.inf).softmax(-1)  # (layers, H, L, L)
    stripe = torch.diagonal(w, offset=-(n - 1), dim1=-2, dim2=-1)  # (layers, H, L − n + 1)
    reference = stripe[..., 1:].double().mean(-1)  # queries n … 2n − 1
    torch.testing.assert_close(prefix_matching_score(w, tokens), reference)


def test_copying_score_of_known_circuits():
    V = 6
    eye = torch.eye(V)
    rotation = torch.zeros(V, V)
    for k in range(0, V, 2):  # 90° rotations in each plane: eigenvalues ± i
        rotation[k, k + 1], rotation[k + 1, k] = -1.0, 1.0
    a = torch.randn(V, 2, generator=torch.Generator().manual_seed(0))
    scores = copying_score(torch.stack([2 * eye, -eye, rotation, a @ a.T]))
    torch.testing.assert_close(scores, torch.tensor([1.0, -1.0, 0.0, 1.0], dtype=torch.float64))
    assert torch.isnan(copying_score(torch.zeros(V, V)))


def test_ov_circuit_is_the_logit_a_head_writes_measured_directly():
    """Row s of head h's circuit = the logits that head writes when it attends with weight 1
    to a position holding token s: the value of its embedding through the module's own
    projections, the other heads' values zeroed."""
    torch.manual_seed(0)
    V, E, H = 11, 12, 3
    mha = MultiHeadAttention(E, H, bias=False)
    embed, unembed = torch.randn(V, E), torch.randn(V, E)
    _, _, (w_v, _) = mha.projection_weights()
    circuits = ov_circuits(embed, w_v, mha.out_proj.weight, unembed, H)
    assert circuits.shape == (H, V, V) and circuits.dtype == torch.float64
    with torch.no_grad():
        _, _, v = mha.project(embed[None])  # (1, H, V, D): each token's value per head
        for h in range(H):
            only_h = torch.zeros_like(v)
            only_h[:, h] = v[:, h]
            written = mha.out_proj(only_h.transpose(1, 2).reshape(1, V, E))  # (1, V, E)
            torch.testing.assert_close(
                circuits[h], (written[0] @ unembed.T).double(), rtol=1e-4, atol=1e-4
            )


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: prefix_matching_score(torch.ones(2, 4, 5), torch.arange(4)), ValueError, "S = L"),
        (lambda: prefix_matching_score(torch.ones(2, 4, 4), torch.arange(5)), ValueError, "L = 4"),
        (lambda: prefix_matching_score(torch.ones(2, 4, 4), torch.ones(4)), TypeError, "tokens"),
        (lambda: prefix_matching_score(torch.ones(4, 4), torch.arange(4)), ValueError, "weights"),
        (lambda: previous_token_score(torch.ones(2, 1, 1)), ValueError, "L >= 2"),
        (lambda: copying_score(torch.ones(3, 4)), ValueError, "square"),
        (
            lambda: ov_circuits(
                torch.ones(5, 8), torch.ones(8, 8), torch.ones(8, 6), torch.ones(5, 8), 2
            ),
            ValueError,
            "w_o",
        ),
        (
            lambda: ov_circuits(
                torch.ones(5, 8), torch.ones(8, 8), torch.ones(8, 8), torch.ones(5, 8), 3
            ),
            ValueError,
            "H=3",
        ),
    ],
)
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error, match=words):
        call()
