"""Gated attention (issue #42): ``softmax(q·kᵀ/√D) v ⊙ sigmoid(gate)``, Qwen3-Next's layout.

`reference.gated_attention` is the definition (checked against the formula written out here);
`GatedAttention.attend` against it under the tolerance rule; the module against transformers' own
Qwen3-Next full-attention eager layer (q/k RMSNorm, partial RoPE, gate), forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks
from attnlab.functional import reference
from attnlab.modules import GatedAttention, OffsetRMSNorm
from helpers import check_against_reference, seeded

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny layers gain nothing from threads

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qn  # noqa: E402


def hf_layer(dtype=torch.float64, *, heads=4, kv_heads=2, partial=0.25):
    config = transformers.Qwen3NextConfig(
        hidden_size=48,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        num_hidden_layers=4,
        intermediate_size=16,
        vocab_size=10,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    config.rope_parameters["partial_rotary_factor"] = partial
    config._attn_implementation = "eager"
    torch.manual_seed(heads)
    hf = hf_qn.Qwen3NextAttention(config, layer_idx=3).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    return config, hf


def test_reference_is_the_formula():
    q, k, v = seeded(2, 4, 9, 8, seed=1), seeded(2, 2, 11, 8, seed=2), seeded(2, 2, 11, 6, seed=3)
    gate = seeded(2, 4, 9, 6, seed=4)
    keep = torch.ones(9, 11, dtype=torch.bool).tril(2)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = (q @ kk.transpose(-1, -2) / math.sqrt(8)).masked_fill(~keep, float("-inf"))
    want = torch.softmax(s, dim=-1) @ vv * torch.sigmoid(gate)
    got = reference.gated_attention(q, k, v, gate, mask=keep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("L,S", [(1, 17), (17, 23), (97, 113)])
@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(7)])
def test_attend_matches_reference(L, S, mask):
    def ref(q, k, v, g, *, compute_dtype, reorder):  # reorder: one rounding order only
        return reference.gated_attention(q, k, v, g, mask=mask, compute_dtype=compute_dtype)

    shapes = [(2, 4, L, 40), (2, 2, S, 40), (2, 2, S, 24), (2, 4, L, 24)]
    inputs = [seeded(*shape, seed=i).float() for i, shape in enumerate(shapes)]
    check_against_reference(
        lambda q, k, v, g: GatedAttention.attend(q, k, v, g, mask=mask), ref, inputs
    )


def test_offset_rmsnorm_equals_qwen3_next():
    x = seeded(3, 5, 16, seed=2).float()
    theirs, ours = hf_qn.Qwen3NextRMSNorm(16, eps=1e-6), OffsetRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    torch.testing.assert_close(ours(x.bfloat16()), theirs(x.bfloat16()), rtol=0, atol=0)


@pytest.mark.parametrize("heads,kv_heads,partial", [(4, 2, 0.25), (4, 1, 1.0), (2, 2, 0.5)])
def test_module_equals_transformers_eager_layer(heads, kv_heads, partial):
    """Forward and every gradient (input and weights) equal Qwen3-Next's eager layer.

    Run in float64; transformers' eager softmax runs in float32 whatever the dtype, hence the
    float32-sized tolerance."""
    config, hf = hf_layer(heads=heads, kv_heads=kv_heads, partial=partial)
    mine = GatedAttention.from_hf(hf)
    assert mine.rope.rotary_dim == int(16 * partial)
    L = 19
    x = seeded(2, L, 48, seed=11).requires_grad_(True)
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    keep[1, ..., 14:] = False  # padding of batch item 1
    cos, sin = hf_qn.Qwen3NextRotaryEmbedding(config)(x, torch.arange(L)[None])
    additive = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))
    want = hf(x, (cos, sin), additive)[0]
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
    mod = GatedAttention(24, 2, causal=False)
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
        ({"num_kv_heads": 3}, "must divide num_heads"),
        ({"rotary_dim": 3}, "rotary_dim must be even"),
        ({"norm_eps": 0.0}, "eps must be > 0"),
        ({"embed_dim": 30}, "divisible by num_heads"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"embed_dim": 32, "num_heads": 4, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        GatedAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"x must be \(B, L, embed_dim=32\), got \(2, 5\)"):
        GatedAttention(32, 4)(torch.randn(2, 5))


@pytest.mark.slow  # ~10 s of Inductor builds; the default run compiles tests/test_sigmoid_attention
@pytest.mark.usefixtures("fresh_dynamo")
def test_inductor_fullgraph_forward_backward():
    mod = GatedAttention(48, 4, num_kv_heads=2, rotary_dim=4)
    x = seeded(2, 37, 48, seed=1).float()
    compiled = torch.compile(mod, fullgraph=True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    want, got = mod(xs[0]), compiled(xs[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-5)


def test_from_hf_names_a_wrong_layer():
    with pytest.raises(ValueError, match=r"must be a Qwen3NextAttention.*got Linear"):
        GatedAttention.from_hf(torch.nn.Linear(2, 2))
