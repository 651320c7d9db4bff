"""analysis.views: bilinear metric, four-term score decomposition, Nadaraya–Watson, Gibbs."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.analysis.views import (
    bilinear_metric,
    gibbs,
    nadaraya_watson,
    score_decomposition,
)


def _mha(E=24, H=4, H_kv=2, bias=True, seed=0):
    torch.manual_seed(seed)
    return attnlab.MultiHeadAttention(E, H, num_kv_heads=H_kv, bias=bias).double()


def _logits(mha, x):
    q, k, _ = mha.project(x)  # (B, H, L, D), (B, H_kv, L, D)
    k = k.repeat_interleave(mha.num_heads // mha.num_kv_heads, dim=1)
    return q @ k.mT / math.sqrt(mha.head_dim)


@pytest.mark.parametrize("bias", [True, False])
def test_four_terms_sum_to_the_logits_and_the_weights(bias):
    mha = _mha(bias=bias)
    g = torch.Generator().manual_seed(1)
    e = torch.randn(2, 7, 24, generator=g, dtype=torch.float64)
    p = attnlab.SinusoidalEmbedding(24, dtype=torch.float64)(7)  # (7, 24)
    terms = score_decomposition(mha, e, p)
    x = e + p
    torch.testing.assert_close(terms.total(), _logits(mha, x), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        _, w = mha(x, need_weights=True)
    torch.testing.assert_close(torch.softmax(terms.total(), -1), w, rtol=1e-12, atol=1e-12)
    assert (terms.bias.abs().max() > 0) == bias
    # each term is what its name says: position–position does not depend on the content
    other = score_decomposition(mha, torch.randn_like(e), p)
    torch.testing.assert_close(other.position_position, terms.position_position)
    assert not torch.allclose(other.content_content, terms.content_content)


def test_score_decomposition_refuses_rope_and_bad_shapes():
    rope = attnlab.MultiHeadAttention(16, 2, rope=attnlab.RoPE(8))
    with pytest.raises(ValueError, match="RoPE"):
        score_decomposition(rope, torch.randn(1, 3, 16), torch.randn(3, 16))
    with pytest.raises(ValueError, match="positions must be"):
        score_decomposition(_mha(), torch.randn(1, 3, 24).double(), torch.randn(4, 24).double())
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        bilinear_metric(torch.nn.Linear(2, 2))


def test_bilinear_metric_gives_the_bias_free_logits_with_rank_at_most_d():
    mha = _mha(bias=False)
    M = bilinear_metric(mha)  # (H, E, E)
    assert M.shape == (4, 24, 24)
    x = torch.randn(1, 5, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = _logits(mha, x)[0]  # (H, L, L)
    got = torch.einsum("le,hef,mf->hlm", x[0], M, x[0]) / math.sqrt(mha.head_dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert int(torch.linalg.matrix_rank(M[0])) <= mha.head_dim


def test_nadaraya_watson_is_gaussian_kernel_regression():
    g = torch.Generator().manual_seed(3)
    xt = torch.rand(40, 2, generator=g, dtype=torch.float64) * 4
    yt = torch.randn(40, 3, generator=g, dtype=torch.float64)
    x = torch.rand(9, 2, generator=g, dtype=torch.float64) * 4
    h = 0.7
    k = torch.exp(-(torch.cdist(x, xt) ** 2) / (2 * h * h))  # (9, 40)
    want = (k @ yt) / k.sum(-1, keepdim=True)
    torch.testing.assert_close(nadaraya_watson(x, xt, yt, h), want, rtol=1e-10, atol=1e-12)
    # h → 0: the nearest training point's target
    nearest = yt[torch.cdist(x, xt).argmin(-1)]
    torch.testing.assert_close(nadaraya_watson(x, xt, yt, 1e-3), nearest, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="bandwidth"):
        nadaraya_watson(x, xt, yt, 0.0)
    with pytest.raises(ValueError, match="shapes do not fit"):
        nadaraya_watson(x, xt, yt[:5], 1.0)


def test_gibbs_free_energy_identity_and_limits():
    s = torch.randn(6, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for t in (0.05, 1.0, 30.0):
        g = gibbs(s, t)
        torch.testing.assert_close(g.probs, torch.softmax(s / t, -1), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(g.free_energy, g.energy - t * g.entropy, rtol=1e-10, atol=1e-10)
    assert float(gibbs(s, 1e-3).entropy.max()) < 1e-6  # ground state
    assert float(gibbs(s, 1e4).entropy.min()) > math.log(11) - 1e-3  # uniform
    with pytest.raises(ValueError, match="temperature"):
        gibbs(s, 0.0)
