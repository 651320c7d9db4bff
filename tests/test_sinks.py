"""Attention sinks (issue 42, GPT-OSS): ``out_i = Σ_j e^{l_ij} v_j / (e^{s_h} + Σ_j e^{l_ij})``.

The definition is `reference.attention(..., sinks=)` (a sink column in the softmax); every
backend computes it from its plain output and log-sum-exp (`attnlab.functional.sinks`). Checked
against a formula written here from transformers' gpt_oss ``eager_attention_forward`` and against
that function itself, under the tolerance rule on odd sizes (forward and backward, the sinks'
gradient included), with the NaN rule, rows with no key, compile, the module, its KV cache and
a whole GPT-OSS model through the transformers bridge.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab._shapes import check_qkv
from attnlab.functional import reference
from attnlab.functional.request import dense_mask_and_bias
from attnlab.modules import KVCache, MultiHeadAttention
from attnlab.testing import check_against_reference, seeded

SLOW = pytest.mark.slow
B, H, H_KV, L, S, D = 2, 4, 2, 17, 23, 8


def qkvs(dtype=torch.float64, *, b=B, h=H, h_kv=H_KV, l=L, s=S, d=D, seed=0):
    """q, k, v and sinks ``(H,)`` spread so that the sinks take a real share of each row."""
    q = seeded(b, h, l, d, seed=seed, scale=1.5).to(dtype)
    k = seeded(b, h_kv, s, d, seed=seed + 1, scale=1.5).to(dtype)
    v = seeded(b, h_kv, s, d, seed=seed + 2).to(dtype)
    sinks = seeded(h, seed=seed + 3, scale=2.0).to(dtype)
    return q, k, v, sinks


def written_out(q, k, v, sinks, keep=None, scale=None):
    """The formula of transformers' gpt_oss eager attention, float64, k/v repeated per group:
    the sink column concatenated to the masked logits, softmax, the column dropped."""
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    logits = q @ kr.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    col = sinks.view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    p = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
    return p @ vr


def mask_cases():
    return {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(5),
        "padding": masks.padding([23, 9]),
        "documents": masks.causal() & masks.document.from_lengths([10, 13]),
    }


def ref_fn(mask, **kw):
    """`check_against_reference`'s ``ref_fn`` for inputs ``(q, k, v, sinks)``."""

    def ref(q, k, v, sinks, *, compute_dtype, reorder):
        dims = check_qkv(q, k, v)
        keep, _ = dense_mask_and_bias(mask, None, dims, q.dtype, q.device)
        out, _ = reference.attention(
            q, k, v, mask=keep, sinks=sinks, compute_dtype=compute_dtype, reorder=reorder, **kw
        )
        return out

    return ref


def grads(out, *xs, seed=5):
    dout = seeded(*out.shape, seed=seed).to(out.dtype)
    return torch.autograd.grad(out, xs, dout)


def leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


# --------------------------------------------------------------------------- the definition
@pytest.mark.parametrize("name", ["causal", "padding", "documents"])
def test_reference_is_the_written_out_formula_with_its_gradients(name):
    q, k, v, s = leaves(*qkvs())
    mask = mask_cases()[name]
    keep, _ = dense_mask_and_bias(mask, None, check_qkv(q, k, v), q.dtype, q.device)
    want = written_out(q, k, v, s, keep)
    got, _ = reference.attention(q, k, v, mask=keep, sinks=s)
    torch.testing.assert_close(got, want, atol=1e-13, rtol=0)
    for g, w in zip(grads(got, q, k, v, s), grads(want, q, k, v, s), strict=True):
        torch.testing.assert_close(g, w, atol=1e-13, rtol=0)
    plain, _ = reference.attention(q, k, v, mask=keep)
    assert (plain - got).abs().max() > 0.05  # the sinks matter on these inputs


def test_equals_transformers_gpt_oss_eager_attention():
    """The function attnlab did not write: gpt_oss's eager attention, float64, causal + GQA."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, s = qkvs()
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = H // H_KV, s, False
    additive = torch.zeros(L, S, dtype=q.dtype).masked_fill(
        ~torch.ones(L, S, dtype=torch.bool).tril(S - L), float("-inf")
    )
    want, _ = gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=D**-0.5)
    for backend in ("reference", "flash", "auto"):
        got = attnlab.attention(q, k, v, mask=masks.causal(), sinks=s, backend=backend)
        torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------- the tolerance rule
@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("name", ["causal", "window", "documents", "padding"])
def test_float64_forward_and_backward_match_the_definition(backend, name):
    """The rule on q, k, v; the sinks' gradient (a sum over every row, whose float64 naive run
    shares the golden's summation) within a few ulp of its size."""
    mask = mask_cases()[name]
    q, k, v, s = qkvs()

    def impl(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, sinks=s, backend=backend)

    def ref(q, k, v, **kw):
        return ref_fn(mask)(q, k, v, s.to(q.dtype), **kw)

    check_against_reference(impl, ref, [q, k, v])
    xs, ys = leaves(q, k, v, s), leaves(q, k, v, s)
    got = grads(attnlab.attention(*xs[:3], mask=mask, sinks=xs[3], backend=backend), xs[3])[0]
    want = grads(ref_fn(mask)(*ys, compute_dtype=torch.float64, reorder=False), ys[3])[0]
    torch.testing.assert_close(got, want, atol=64 * 2**-52 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize(
    "dtype,name,dims",
    [
        (torch.float32, "causal", {}),
        (torch.bfloat16, "window", {}),
        (torch.float32, "none", {"l": 1, "s": 97, "d": 40}),
        pytest.param(torch.float32, "documents", {"l": 113, "s": 113, "d": 64}, marks=SLOW),
        pytest.param(torch.bfloat16, "causal", {"l": 97, "s": 1025, "d": 80}, marks=SLOW),
        pytest.param(torch.float16, "padding", {"l": 17, "s": 23, "d": 128}, marks=SLOW),
    ],
)
def test_low_precision_tolerance_rule(dtype, name, dims):
    mask = mask_cases()[name]
    n = dims.get("s", S)
    if name == "padding":
        mask = masks.padding([n, 9])
    if name == "documents":
        mask = masks.causal() & masks.document.from_lengths([n // 2, n - n // 2])

    def impl(q, k, v, s):
        return attnlab.attention(q, k, v, mask=mask, sinks=s)

    mean = 10.0 if dtype == torch.float32 else None
    check_against_reference(impl, ref_fn(mask), list(qkvs(dtype, **dims)), mean_factor=mean)


def test_lse_and_weights_include_the_sink():
    q, k, v, s = qkvs()
    keep = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    out, w, lse = attnlab.attention(
        q, k, v, mask=masks.causal(), sinks=s, return_weights=True, return_lse=True
    )
    want_out, want_w = reference.attention(q, k, v, mask=keep, sinks=s)
    torch.testing.assert_close(out, want_out, atol=1e-13, rtol=0)
    torch.testing.assert_close(w, want_w, atol=1e-13, rtol=0)
    torch.testing.assert_close(lse, reference.logsumexp(q, k, mask=keep, sinks=s))
    # the sink's share of each row is e^{s_h − lse_i} = 1 − Σ_j p_ij
    share = torch.exp(s.view(1, H, 1) - lse)
    torch.testing.assert_close(share, 1 - w.sum(-1), atol=1e-13, rtol=0)
    again = attnlab.attention_weights(q, k, lse, mask=masks.causal())
    torch.testing.assert_close(again, w, atol=1e-13, rtol=0)


def test_three_d_input():
    q, k, v, s = qkvs(b=2, h=1, h_kv=1, l=5, s=7, d=3)
    got = attnlab.attention(q[:, 0], k[:, 0], v[:, 0], mask=masks.causal(), sinks=s)
    torch.testing.assert_close(
        got, attnlab.attention(q, k, v, mask=masks.causal(), sinks=s)[:, 0], atol=0, rtol=0
    )


@SLOW
def test_gradcheck_tiny():
    q, k, v, s = qkvs(b=2, h=1, h_kv=1, l=5, s=7, d=3)

    def f(q, k, v, s):
        return attnlab.attention(q, k, v, mask=masks.sliding_window(3), sinks=s, backend="flash")

    assert torch.autograd.gradcheck(f, tuple(leaves(q, k, v, s)), atol=1e-8, rtol=1e-5)


# --------------------------------------------------------------------------- edges and NaN rule
def test_rows_with_no_key_stay_zero_with_zero_gradients():
    q, k, v, s = leaves(*qkvs())
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    keep[0, :, 3] = False  # row 3 of item 0 attends nothing
    for backend in ("reference", "flash"):
        out, lse = attnlab.attention(q, k, v, mask=keep, sinks=s, backend=backend, return_lse=True)
        assert bool((out[0, :, 3] == 0).all()) and torch.equal(lse[0, :, 3], s.detach())
        gq, gs = grads(out, q, s)
        assert bool((gq[0, :, 3] == 0).all()) and bool(torch.isfinite(gs).all())


def test_a_minus_inf_sink_is_no_sink():
    q, k, v, s = qkvs()
    s = s.clone()
    s[1] = float("-inf")
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    keep[1, :, 0] = False
    for backend in ("reference", "flash"):
        xs = leaves(q, k, v, s)
        out = attnlab.attention(*xs[:3], mask=keep, sinks=xs[3], backend=backend)
        plain = attnlab.attention(q, k, v, mask=keep, backend=backend)
        torch.testing.assert_close(out[:, 1], plain[:, 1], atol=1e-14, rtol=0)
        g = grads(out, *xs)
        assert all(bool(torch.isfinite(t).all()) for t in g) and g[3][1] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_nan_rule_a_non_finite_sink_poisons_its_head(bad, backend):
    """A NaN/+inf sink makes every row of its head that has a key NaN (and its lse); the other
    heads are exact, a row with no key stays 0, and gradients are those of the sink read as 0."""
    q, k, v, s = qkvs()
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    keep[0, :, 2] = False
    poisoned = s.clone()
    poisoned[2] = bad
    xs = leaves(q, k, v, poisoned)
    out, lse = attnlab.attention(*xs[:3], mask=keep, sinks=xs[3], backend=backend, return_lse=True)
    has_key = keep.expand(B, H, L, S).any(-1)  # (B, H, L)
    assert bool(torch.isnan(out[:, 2][has_key[:, 2]]).all())
    assert bool(torch.isnan(lse[:, 2][has_key[:, 2]]).all())
    assert bool((out[0, 2, 2] == 0).all())
    zeroed = s.clone()
    zeroed[2] = 0.0
    ys = leaves(q, k, v, zeroed)
    want = attnlab.attention(*ys[:3], mask=keep, sinks=ys[3], backend=backend)
    others = [0, 1, 3]
    torch.testing.assert_close(out[:, others], want[:, others], atol=0, rtol=0)
    got_g, want_g = grads(out, *xs), grads(want, *ys)
    for g, w in zip(got_g[:3], want_g[:3], strict=True):
        torch.testing.assert_close(g, w, atol=1e-14, rtol=0)
    assert got_g[3][2] == 0 and torch.equal(got_g[3][others], want_g[3][others])


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "bad,err,match",
    [
        ([0.0] * H, TypeError, r"sinks must be a float tensor of shape \(H,\), got list"),
        (torch.zeros(H, dtype=torch.long), TypeError, "got dtype torch.int64"),
        (torch.zeros(H + 1), ValueError, r"\(H,\) = \(4,\), one logit per query head, got \(5,\)"),
        (torch.zeros(1, H), ValueError, r"got \(1, 4\)"),
        (torch.zeros(H, device="meta"), ValueError, "on q's device cpu, got meta"),
    ],
)  # fmt: skip
def test_bad_sinks_are_refused_before_any_work(bad, err, match):
    q, k, v, _ = qkvs(torch.float32)
    calls = []

    def bias(b, h, i, j):
        calls.append(1)
        return torch.zeros(())

    with pytest.raises(err, match=match):
        attnlab.attention(q, k, v, bias=bias, sinks=bad)
    assert not calls


def test_sdpa_cannot_run_sinks_and_auto_skips_it():
    q, k, v, s = qkvs(torch.float32)
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run this call.*sinks="):
        attnlab.attention(q, k, v, sinks=s, backend="sdpa")
    assert attnlab.explain(q, k, v).backend == "sdpa"
    assert attnlab.explain(q, k, v, sinks=s).backend != "sdpa"


# --------------------------------------------------------------------------- compile, decode
def test_compile_fullgraph_inductor_forward_backward():
    q, k, v, s = qkvs(torch.float32, l=33, s=33)
    mask = masks.causal() & masks.document.from_lengths([10, 23])

    def f(q, k, v, s):
        return attnlab.attention(q, k, v, mask=mask, sinks=s)

    torch._dynamo.reset()
    xs = leaves(q, k, v, s)
    out = torch.compile(f, fullgraph=True)(*xs)  # Inductor; raises on a graph break
    got = grads(out, *xs)
    ys = leaves(q, k, v, s)
    want_out = f(*ys)
    want = grads(want_out, *ys)
    torch._dynamo.reset()
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_decode_backend_and_meta():
    q, k, v, s = qkvs(torch.float32, l=1, s=37)
    got = attnlab.attention(q, k, v, sinks=s, backend="decode")
    want = reference.attention(q.double(), k.double(), v.double(), sinks=s.double())[0]
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-5)
    qm, km, vm = (torch.empty(x.shape, device="meta") for x in (q, k, v))
    out = attnlab.attention(qm, km, vm, sinks=torch.empty(H, device="meta"))
    assert out.is_meta and out.shape == q.shape


# --------------------------------------------------------------------------- the module
def test_module_learns_sinks_and_cached_decoding_equals_uncached():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, H, num_kv_heads=H_KV, sinks=True).double()
    assert mha.sinks.shape == (H,) and bool((mha.sinks == 0).all())
    with torch.no_grad():
        mha.sinks.copy_(seeded(H, seed=3, scale=2.0))
    x = seeded(2, 9, 32, seed=4)
    full = mha(x, mask=masks.causal())
    cache = KVCache()
    steps = [mha(x[:, :4], mask=masks.causal(), cache=cache)]
    steps += [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)
    plain = MultiHeadAttention(32, H, num_kv_heads=H_KV).double()
    plain.load_state_dict({n: p for n, p in mha.state_dict().items() if n != "sinks"})
    assert (plain(x, mask=masks.causal()) - full).abs().max() > 1e-3
    (g,) = torch.autograd.grad(full.square().sum(), mha.sinks)
    assert bool((g != 0).all())
    mha.prune_heads([1, 3])
    assert torch.equal(mha.sinks.detach(), seeded(H, seed=3, scale=2.0)[[0, 2]])
    assert mha(x).shape == x.shape
    with pytest.raises(TypeError, match="sinks must be a bool"):
        MultiHeadAttention(32, H, sinks=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- GPT-OSS (transformers)
@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory):
    """A tiny random GPT-OSS: sliding (window 4) and full layers, sinks, YaRN RoPE, GQA."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=4, max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0, "truncate": False,
        },
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks large enough to take a real share
            layer.self_attn.sinks.copy_(seeded(4, seed=11, scale=2.0))
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(folder)
    return folder


def test_gpt_oss_loads_through_from_pretrained(gpt_oss_folder, one_thread):
    """`attnlab.hf.from_pretrained` accepts GPT-OSS (refused before issue 42) and its sinks take
    part; logits, gradients and greedy generate against eager are the family grid's
    (tests/test_hf_families.py, "gpt_oss")."""
    transformers = pytest.importorskip("transformers")
    import attnlab.hf

    auto = transformers.AutoModelForCausalLM
    model = attnlab.hf.from_pretrained(auto, gpt_oss_folder)  # refused before issue 42
    eager = auto.from_pretrained(gpt_oss_folder, attn_implementation="eager").eval()
    ids = seeded(2, 11, seed=12).abs().mul(20).long() % 64
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, :4] = 0  # left padding
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=am).logits
        want = eager(input_ids=ids, attention_mask=am).logits
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        no_sinks = eager(input_ids=ids, attention_mask=am).logits
    assert (no_sinks[real] - want[real]).abs().max() > 1e-3  # the sinks matter in this model


def test_hf_attention_stats_refuses_sinks_by_name(gpt_oss_folder):
    transformers = pytest.importorskip("transformers")
    import attnlab.hf

    model = attnlab.hf.from_pretrained(transformers.AutoModelForCausalLM, gpt_oss_folder)
    with pytest.raises(attnlab.hf.UnsupportedAttentionError, match="attention sinks"):
        attnlab.hf.attention_stats(model, {"input_ids": torch.tensor([[1, 2, 3]])})


# --------------------------------------------------------------------------- the fused backward
def _poisoned_inputs():
    q, k, v, s = qkvs(torch.float32, l=33, s=33)
    q[1, 0, 5] = float("nan")  # the NaN rule touches the call: row 5 of (1, 0) only
    s[3] = float("nan")  # and head 3's rows
    keep = torch.ones(B, 1, 33, 33, dtype=torch.bool).tril()
    keep[0, :, 7] = False  # a row with no key
    return q, k, v, s, keep


@pytest.mark.parametrize("poisoned", [False, True])
def test_flash_backward_runs_on_out_and_lse_with_sinks_without_an_lse_gradient(
    poisoned, monkeypatch
):
    """Eager float32 flash runs its backward on (out', lse') (`flash.sinks`): the fused kernels
    see no lse gradient, and the gradients equal the generic path's (reference backend)."""
    from attnlab.functional.flash.job import FlashJob

    q, k, v, s, keep = _poisoned_inputs()
    if not poisoned:
        q, s = qkvs(torch.float32, l=33, s=33)[0], qkvs(torch.float32)[3]
    seen = []
    real = FlashJob.backward

    def spy(self, res, dlse=None):
        seen.append(dlse)
        return real(self, res, dlse)

    monkeypatch.setattr(FlashJob, "backward", spy)
    xs, ys = leaves(q, k, v, s), leaves(q, k, v, s)
    out = attnlab.attention(*xs[:3], mask=keep, sinks=xs[3], backend="flash")
    got = grads(out, *xs)
    assert seen and all(d is None for d in seen)
    want_out = attnlab.attention(*ys[:3], mask=keep, sinks=ys[3], backend="reference")
    torch.testing.assert_close(out, want_out, atol=2e-6, rtol=2e-6, equal_nan=True)
    if poisoned:  # gradients of the clean computation: q's NaN row read as 0, its grad 0
        assert bool((got[0][1, 0, 5] == 0).all())
        ys[0].data[1, 0, 5] = 0.0
    want = grads(attnlab.attention(*ys[:3], mask=keep, sinks=ys[3], backend="reference"), *ys)
    if poisoned:
        want[0][1, 0, 5] = 0.0
    for g, w in zip(got, want, strict=True):
        assert bool(torch.isfinite(g).all())
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_flash_lse_gradient_with_sinks():
    """A loss on the returned lse' too: the fused path passes it on, equal to the reference."""
    q, k, v, s = qkvs(torch.float32)
    xs, ys = leaves(q, k, v, s), leaves(q, k, v, s)
    runs = []
    for backend, x in (("flash", xs), ("reference", ys)):
        out, lse = attnlab.attention(
            *x[:3], mask=masks.causal(), sinks=x[3], backend=backend, return_lse=True
        )
        loss = (out * seeded(*out.shape, seed=3).float()).sum() + (lse * lse).sum()
        runs.append(torch.autograd.grad(loss, x))
    for g, w in zip(*runs, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_nan_rule_a_nan_query_row_leaks_no_nan_gradient(backend):
    """The generic path (float64): a row the NaN rule poisons stays NaN and passes no gradient."""
    q, k, v, s = qkvs()
    q[1, 2, 4] = float("nan")
    xs = leaves(q, k, v, s)
    out = attnlab.attention(*xs[:3], mask=masks.causal(), sinks=xs[3], backend=backend)
    assert bool(torch.isnan(out[1, 2, 4]).all())
    assert int(torch.isnan(out).sum()) == out.shape[-1]
    assert all(bool(torch.isfinite(g).all()) for g in grads(out, *xs))
