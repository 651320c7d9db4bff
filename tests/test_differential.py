"""Differential attention (issue #42): ``softmax(q1·k1ᵀ) v − λ·softmax(q2·k2ᵀ) v``, head RMSNorm.

`reference.differential_attention` is the definition (checked against the paper's formula written
out here); `DifferentialAttention.attend` (two `attnlab.attention` calls) against it under the
tolerance rule; the module against transformers' own DiffLlama eager layer, forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks
from attnlab.functional import reference
from attnlab.modules import DifferentialAttention
from attnlab.modules.differential import lambda_init_of
from helpers import check_against_reference, seeded

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny layers gain nothing from threads

transformers = pytest.importorskip("transformers")
from transformers.models.diffllama import modeling_diffllama as hf_diff  # noqa: E402


def hf_layer(dtype=torch.float32, *, layer_idx=2, heads=4, kv_heads=2):
    config = transformers.DiffLlamaConfig(
        hidden_size=48,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=12,
        num_hidden_layers=4,
        intermediate_size=16,
        vocab_size=10,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(layer_idx)
    hf = hf_diff.DiffLlamaAttention(config, layer_idx=layer_idx).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    return config, hf


def hf_forward(config, hf, x, keep):
    """transformers' eager layer with its rotary tables and an additive mask from ``keep``."""
    L = x.shape[1]
    cos, sin = hf_diff.DiffLlamaRotaryEmbedding(config)(x, torch.arange(L)[None])
    additive = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))
    return hf(x, (cos, sin), additive)[0]


def test_lambda_init_is_the_papers_and_transformers():
    for layer in range(1, 6):
        want = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
        assert lambda_init_of(layer) == want == reference.differential_lambda_init(layer)
        assert hf_diff.lambda_init_fn(layer - 1) == pytest.approx(want, abs=1e-15)


def test_reference_is_the_papers_formula():
    """Two softmax maps, one subtracted with λ, written out here; then the scaled RMSNorm."""
    q1, q2 = seeded(2, 2, 9, 8, seed=1), seeded(2, 2, 9, 8, seed=2)
    k1, k2 = seeded(2, 1, 11, 8, seed=3), seeded(2, 1, 11, 8, seed=4)
    v = seeded(2, 1, 11, 6, seed=5)
    keep = torch.ones(9, 11, dtype=torch.bool).tril(2)

    def smax(q, k):
        s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1)

    lam, li = 0.37, 0.5
    o = smax(q1, k1) @ v - lam * smax(q2, k2) @ v
    got = reference.differential_attention(q1, k1, q2, k2, v, lam, mask=keep)
    torch.testing.assert_close(got, o, rtol=0, atol=1e-14)
    normed = (1 - li) * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = reference.differential_attention(q1, k1, q2, k2, v, lam, mask=keep, lambda_init=li)
    torch.testing.assert_close(got, normed, rtol=0, atol=1e-13)
    lq = [seeded(8, seed=s) * 0.1 for s in range(4)]
    want = math.exp(float(lq[0] @ lq[1])) - math.exp(float(lq[2] @ lq[3])) + li
    assert float(reference.differential_lambda(*lq, li)) == pytest.approx(want, abs=1e-14)


@pytest.mark.parametrize("L,S", [(1, 17), (17, 23), (97, 113)])
@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(7)])
def test_attend_matches_reference(L, S, mask):
    """The two fast-path calls, forward and backward, under the tolerance rule (float32)."""
    mod = DifferentialAttention(40, 4, num_kv_heads=2, head_dim=10, layer=3)
    lam, li = mod.lam().detach(), mod.lambda_init

    def ref(q, k, v, *, compute_dtype, reorder):  # reorder: one rounding order only
        vp = torch.cat([v[:, :1], v[:, 1:]], dim=-1)
        parts = (q[:, :2], k[:, :1], q[:, 2:], k[:, 1:], vp)
        return reference.differential_attention(
            *parts, lam, mask=mask, lambda_init=li, eps=mod.norm_eps, compute_dtype=compute_dtype
        )

    inputs = [seeded(2, h, n, 10, seed=h).float() for h, n in ((4, L), (2, S), (2, S))]
    check_against_reference(lambda q, k, v: mod.attend(q, k, v, mask=mask), ref, inputs)


@pytest.mark.parametrize("layer_idx,heads,kv_heads", [(0, 4, 2), (2, 4, 4), (3, 8, 2)])
def test_module_equals_transformers_eager_layer(layer_idx, heads, kv_heads):
    """Forward and every gradient (input and weights) equal DiffLlama's eager layer.

    Run in float64; transformers' eager softmax runs in float32 whatever the dtype (its
    ``softmax(..., dtype=torch.float32)``), hence the float32-sized tolerance."""
    config, hf = hf_layer(torch.float64, layer_idx=layer_idx, heads=heads, kv_heads=kv_heads)
    mine = DifferentialAttention.from_hf(hf)
    assert mine.layer == layer_idx + 1 and mine.lambda_init == hf.lambda_init
    L = 19
    x = seeded(2, L, 48, seed=11).requires_grad_(True)
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    keep[1, ..., 14:] = False  # padding of batch item 1
    want = hf_forward(config, hf, x, keep)
    got = mine(x, mask=masks.padding(torch.tensor([L, 14])))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max()))
    dout = seeded(*want.shape, seed=3)
    gw = torch.autograd.grad(want, [x, *hf.parameters()], dout)
    gg = torch.autograd.grad(got, [x, *mine.parameters()], dout)
    names = ["x", *(n for n, _ in hf.named_parameters())]
    assert names[1:] == [n for n, _ in mine.named_parameters()]
    for name, a, b in zip(names, gg, gw, strict=True):
        atol = 1e-5 * float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_fully_masked_rows_are_zero():
    mod = DifferentialAttention(24, 2, num_kv_heads=2, causal=False)
    x = seeded(1, 5, 24, seed=2).float().requires_grad_(True)
    keep = torch.ones(5, 5, dtype=torch.bool)
    keep[2] = False
    out = mod(x, mask=keep)
    assert torch.equal(out[0, 2], torch.zeros(24)) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_heads": 3}, "must be even"),
        ({"num_kv_heads": 3}, "must be even"),
        ({"layer": 0}, "layer must be >= 1"),
        ({"norm_eps": -1.0}, "norm_eps must be > 0"),
        ({"embed_dim": 30, "num_heads": 4}, "divisible by num_heads"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"embed_dim": 32, "num_heads": 4, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        DifferentialAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"x must be \(B, L, embed_dim=32\), got \(2, 5, 16\)"):
        DifferentialAttention(32, 4)(torch.randn(2, 5, 16))


@pytest.mark.slow  # ~10 s of Inductor builds; the default run compiles tests/test_sigmoid_attention
@pytest.mark.usefixtures("fresh_dynamo")
def test_inductor_fullgraph_forward_backward():
    mod = DifferentialAttention(48, 4, num_kv_heads=2, layer=2)
    x = seeded(2, 37, 48, seed=1).float()
    compiled = torch.compile(mod, fullgraph=True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    want, got = mod(xs[0]), compiled(xs[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-5)


def test_from_hf_names_a_wrong_layer():
    with pytest.raises(ValueError, match="must be a DiffLlamaAttention, got Linear"):
        DifferentialAttention.from_hf(torch.nn.Linear(2, 2))
