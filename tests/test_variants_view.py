"""The viewer's pictures of attention sinks and differential attention (issue 42 item 5).

Weights come from real modules — `MultiHeadAttention(sinks=True)` and `DifferentialAttention`
(its ``need_weights`` and `attnlab.analysis.module_attentions`; a tiny GPT-OSS through the
transformers bridge is tests/test_visualize_hf.py's) — and are checked against the float64
reference:

- the sink's share of each row, ``1 − Σ_j p_ij``, is ``e^{s_h} / (e^{s_h} + Σ_j e^{l_ij})``
  (``exp(s_h − lse'_i)`` of `reference.logsumexp`), NaN on rows with no key;
- the differential maps are the module's two softmaxes, and ``first − λ·second`` applied to
  ``v = I`` is `reference.differential_attention` without the head norm;
- the pictures render (panels, titles, PNG files) and bad input is refused by name.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.analysis import (
    differential_maps,
    head_sink_share,
    module_attentions,
    sink_share,
)
from attnlab.functional import reference
from attnlab.modules import DifferentialAttention, MultiHeadAttention
from attnlab.testing import seeded

F64 = torch.float64
E, H, L = 32, 4, 13


def _mha_with_sinks() -> MultiHeadAttention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, sinks=True).to(F64).eval()
    with torch.no_grad():
        mha.sinks.copy_(torch.tensor([-2.0, 0.0, 1.5, 3.0], dtype=F64))
    return mha


# ------------------------------------------------------------------------------------ sinks
def test_sink_share_of_a_module_equals_the_reference():
    mha = _mha_with_sinks()
    x = seeded(2, L, E, seed=1)
    w = module_attentions(mha, lambda: mha(x, mask=masks.causal()))[0]  # (H, L, L), batch 0
    q, k, _ = mha.project(x[:1], None, None)  # (1, H, L, D)
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    lse = reference.logsumexp(q, k, mask=keep, sinks=mha.sinks.detach())  # (1, H, L)
    want = torch.exp(mha.sinks.detach().view(H, 1) - lse[0])  # e^{s_h} / (e^{s_h} + Σ e^l)
    got = sink_share(w)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, 1 - w.sum(-1), atol=0, rtol=0)
    torch.testing.assert_close(head_sink_share(w), want.mean(-1), atol=1e-12, rtol=0)
    # a larger sink takes a larger share of every row
    assert bool((got[3] > got[0]).all())


def test_rows_with_no_key_have_no_share_and_the_head_mean_skips_them():
    mha = _mha_with_sinks()
    x = seeded(1, L, E, seed=2)
    keep = torch.ones(1, 1, L, L, dtype=torch.bool)
    keep[..., :3, :] = False  # the first three rows attend nothing
    _, w = mha(x, mask=keep, need_weights=True)
    assert torch.equal(w[0, :, :3], torch.zeros(H, 3, L))  # zeros, not the sink's 1
    share = sink_share(w)[0]  # (H, L)
    assert bool(share[:, :3].isnan().all()) and not bool(share[:, 3:].isnan().any())
    torch.testing.assert_close(head_sink_share(w)[0], share[:, 3:].mean(-1))
    without = MultiHeadAttention(E, H).to(F64).eval()
    _, w0 = without(x, need_weights=True)
    torch.testing.assert_close(sink_share(w0), torch.zeros(1, H, L, dtype=F64), atol=1e-15, rtol=0)


# GPT-OSS through the bridge (its output_attentions give eager's sink share) and
# `attnlab visualize --png` of it: tests/test_visualize_hf.py.


# ----------------------------------------------------------------------------- differential
def _differential() -> DifferentialAttention:
    torch.manual_seed(0)
    return DifferentialAttention(E, H, num_kv_heads=2, layer=3, lambda_std=0.3).to(F64).eval()


def test_differential_weights_are_the_modules_two_softmaxes():
    layer = _differential()
    x = seeded(2, L, E, seed=3)
    out, w = layer(x, need_weights=True)
    # the same output (return_weights may pick another exact backend: float64 rounding apart)
    torch.testing.assert_close(out, layer(x), atol=1e-14, rtol=0)
    assert torch.equal(module_attentions(layer, lambda: layer(x))[0], w[0])
    B, D = 2, layer.head_dim
    q = layer.rope(layer.q_proj(x).view(B, L, H, D).transpose(1, 2))  # (B, H, L, D)
    k = layer.rope(layer.k_proj(x).view(B, L, 2, D).transpose(1, 2))  # (B, H_kv, L, D)
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    eye = torch.eye(L, dtype=F64).expand(B, 1, L, L)
    # the first maps: query heads 0, 1 on key head 0; the second: query heads 2, 3 on key head 1
    first = reference.attention(q[:, :2], k[:, :1], eye, mask=keep)[1]
    second = reference.attention(q[:, 2:], k[:, 1:], eye, mask=keep)[1]
    f, s, d = differential_maps(w, layer.lam())
    torch.testing.assert_close(f, first, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, second, atol=1e-12, rtol=0)
    lam = layer.lam()
    want = reference.differential_attention(
        q[:, :2], k[:, :1], q[:, 2:], k[:, 1:], torch.eye(L, dtype=F64).expand(B, 1, L, L),
        lam, mask=masks.causal(),
    )  # fmt: skip
    torch.testing.assert_close(d, want, atol=1e-12, rtol=0)  # with v = I the map is the output


def test_differential_maps_refuses_odd_heads_and_non_scalar_lambda():
    with pytest.raises(ValueError, match=r"even number of heads \(two maps\), got H=3"):
        differential_maps(torch.rand(3, 4, 4), 0.5)
    with pytest.raises(ValueError, match=r"lam must be a number or a 0-d tensor, got shape \(2,\)"):
        differential_maps(torch.rand(4, 4, 4), torch.ones(2))
    with pytest.raises(TypeError, match="weights must be a float tensor"):
        sink_share(torch.ones(2, 3, 3, dtype=torch.long))


# --------------------------------------------------------------------------------- pictures
def test_the_pictures_render(tmp_path):
    pytest.importorskip("matplotlib")
    from attnlab.viz import differential_figure, plot_differential, plot_sinks, sinks_figure

    mha = _mha_with_sinks()
    x = seeded(1, L, E, seed=4)
    w = module_attentions(mha, lambda: mha(x, mask=masks.causal()))[0]  # (H, L, L)
    fig = sinks_figure(w, title="sinks")
    bars, rows, one = fig.axes[0], fig.axes[1], fig.axes[2]
    heights = [p.get_height() for p in bars.patches]
    torch.testing.assert_close(torch.tensor(heights, dtype=F64), head_sink_share(w).double())
    assert "head 3" in one.get_title()  # default: the head with the largest share
    assert rows.images[0].get_array().shape == (H, L)
    path = plot_sinks(tmp_path / "sinks.png", w, head=1, tokens=[f"t{i}" for i in range(L)])
    assert path.read_bytes().startswith(b"\x89PNG")

    layer = _differential()
    _, wd = layer(seeded(1, L, E, seed=5), need_weights=True)
    fig = differential_figure(wd[0], layer.lam())
    assert len(fig.axes) == 2 * 3 + 2 * 3  # 2 pairs × 3 panels, each with its colour bar
    diff = fig.axes[2].images[0]
    lo, hi = diff.get_clim()
    assert lo == -hi and hi > 0  # the difference on a scale centred on 0
    assert "λ = " in fig.axes[2].get_title()
    path = plot_differential(tmp_path / "diff.png", wd[0], layer.lam(), pairs=[1])
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda v: v.sinks_figure(torch.rand(1, 2, 3, 3)), r"weights must be \(H, L, S\)"),
        (lambda v: v.sinks_figure(torch.rand(2, 3, 3), head=2), r"head must be an int in \[0, 2\)"),
        (lambda v: v.sinks_figure(torch.rand(2, 3, 3), tokens=["a"]), "one label per query row"),
        (lambda v: v.differential_figure(torch.rand(4, 3, 3), 0.5, pairs=[2]), r"pairs must be"),
        (lambda v: v.plot_sinks("x.jpg", torch.rand(2, 3, 3)), "path must end in .png"),
    ],
)
def test_bad_input_is_refused_by_name(call, match):
    pytest.importorskip("matplotlib")
    import attnlab.viz as v

    with pytest.raises(ValueError, match=match):
        call(v)


def test_public_names():
    import attnlab.viz as v

    assert {"sinks_figure", "plot_sinks", "differential_figure", "plot_differential"} <= set(
        v.__all__
    )
    assert {"sink_share", "head_sink_share", "differential_maps"} <= set(attnlab.analysis.__all__)
