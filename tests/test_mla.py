"""Multi-head latent attention (DeepSeek-V2/V3): the absorbed form against the naive definition,
the module against transformers' ``DeepseekV3Attention`` (prefill with causal + padding, and
step-by-step decode), the latent cache, Inductor, bad input (``deepseek_v3`` through the bridge is
tests/test_hf_families.py's)."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnlab
from attnlab import masks
from attnlab.analysis.estimate import cache_bytes_per_token
from attnlab.functional import nan_rule
from attnlab.functional.reference import latent_attention
from attnlab.modules import (
    CacheOverflowError,
    LatentCache,
    MultiHeadLatentAttention,
    absorbed_latent_attention,
)
from attnlab.modules.mla import key_head_views
from helpers import LargestTensor, assert_close_rule, check_against_reference, seeded

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def _inputs(B, H, L, S, Dn=8, R=4, C=16, Dv=6, dtype=F64, seed=0):
    """``q_nope, q_rope, latent, k_rope, w_uk, w_uv`` (weights scaled so logits are O(1))."""
    return [
        seeded(B, H, L, Dn, dtype=dtype, seed=seed),
        seeded(B, H, L, R, dtype=dtype, seed=seed + 1),
        seeded(B, S, C, dtype=dtype, seed=seed + 2),
        seeded(B, S, R, dtype=dtype, seed=seed + 3),
        seeded(H, Dn, C, dtype=dtype, seed=seed + 4, scale=C**-0.5),
        seeded(H, Dv, C, dtype=dtype, seed=seed + 5, scale=C**-0.5),
    ]


def _dense(mask, B, H, L, S):
    return None if mask is None else mask.to_dense(L, S, batch=B, heads=H)


def _left_padding(B, S):
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[-1, : S // 3 + 1] = False  # the last item left-padded
    return keep


# ------------------------------------------------------------- absorbed form vs the definition


@pytest.mark.parametrize("L,S", [(1, 1), (1, 97), (17, 17), (5, 113)])
@pytest.mark.parametrize("which", ["none", "causal", "causal+padding"])
def test_absorbed_equals_definition_float64(L, S, which):
    B, H = 2, 3
    xs = _inputs(B, H, L, S)
    mask = {
        "none": None,
        "causal": masks.causal(),
        "causal+padding": masks.causal() & masks.from_tensor(_left_padding(B, S)[:, None, None]),
    }[which]
    out = absorbed_latent_attention(*xs, mask=mask)
    ref = latent_attention(*xs, mask=_dense(mask, B, H, L, S))
    assert out.shape == (B, H, L, 6)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("L,S,Dn,R,C,Dv", [(1, 97, 40, 8, 64, 24), (17, 113, 8, 4, 59, 40)])
def test_absorbed_float32_tolerance_rule_forward_and_backward(L, S, Dn, R, C, Dv):
    B, H = 2, 3
    mask = masks.causal()
    dense = mask.to_dense(L, S)
    xs = _inputs(B, H, L, S, Dn, R, C, Dv, dtype=torch.float32, seed=3)

    def ref(*x, compute_dtype, reorder):
        return latent_attention(*x, mask=dense, compute_dtype=compute_dtype, reorder=reorder).to(
            x[0].dtype
        )

    errors = check_against_reference(
        lambda *x: absorbed_latent_attention(*x, mask=mask), ref, xs, grads=True
    )
    assert set(errors) == {"out", *(f"grad[{i}]" for i in range(6))}


def test_scale_is_the_expanded_head_dims_not_the_latents():
    xs = _inputs(1, 2, 3, 5)
    out = absorbed_latent_attention(*xs)
    torch.testing.assert_close(out, latent_attention(*xs, scale=12**-0.5), atol=1e-12, rtol=0)
    wrong = latent_attention(*xs, scale=(16 + 4) ** -0.5)
    assert (out - wrong).abs().max() > 1e-3


def test_fully_masked_rows_are_zero_and_the_nan_rule_holds():
    B, H, L, S = 2, 2, 4, 6
    xs = [x.requires_grad_() for x in _inputs(B, H, L, S)]
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    keep[0, :, 1] = False  # row 1 of item 0 attends nothing
    keep[1, :, :, 2] = False  # key 2 of item 1 is masked for every row
    with torch.no_grad():
        xs[2][1, 2] = float("nan")  # a NaN latent in the masked key: must not reach any row
        xs[3][1, 2] = float("inf")
        xs[0][0, :, 1] = float("nan")  # a NaN query in the row with nothing to attend
    out = absorbed_latent_attention(*xs, mask=keep)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.isfinite(out).all()
    out.sum().backward()
    # the attention inputs' gradients are finite (the up-projections' gradients sum over every
    # row and key, so a non-finite input reaches them in the definition too, as in any Linear)
    assert all(torch.isfinite(x.grad).all() for x in xs[:4])
    assert torch.equal(xs[0].grad[0, :, 1], torch.zeros_like(xs[0].grad[0, :, 1]))
    assert torch.equal(xs[2].grad[1, 2], torch.zeros_like(xs[2].grad[1, 2]))
    clean = [x.detach().clone() for x in xs]
    clean[2][1, 2] = 0.0
    clean[3][1, 2] = 0.0
    clean[0][0, :, 1] = 0.0
    torch.testing.assert_close(
        out.detach(), latent_attention(*clean, mask=keep), atol=1e-12, rtol=0
    )


# ------------------------------------------------- the decode step spread over the threads


@contextlib.contextmanager
def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _needs_ext():
    if not nan_rule.ext_ready(torch.zeros(1)):
        pytest.skip("attnlab's C++ operators are not built (`attnlab build`)")


def _absorbed_no_grad(mask):
    def impl(*x):
        with torch.no_grad():
            return absorbed_latent_attention(*x, mask=mask)

    return impl


def _latent_ref(mask, B, H, L, S):
    dense = _dense(mask, B, H, L, S) if isinstance(mask, masks.Mask) else mask

    def ref(*x, compute_dtype, reorder):
        out = latent_attention(*x, mask=dense, compute_dtype=compute_dtype, reorder=reorder)
        return out.to(x[0].dtype)

    return ref


DECODE_CASES = {
    # (B, H, L, S, threads, mask, dtype): P = 2 key-head views in every case
    "one-item-S97": (1, 16, 1, 97, 2, None, torch.float32),
    "causal-S1025": (1, 16, 1, 1025, 2, "causal", torch.float32),
    "padding-B2": (2, 32, 1, 113, 4, "padding", torch.float32),
    "draft-L3": (1, 16, 3, 97, 2, None, torch.float32),
    "causal-draft-L3": (1, 16, 3, 113, 2, "causal", torch.float32),
    "bfloat16": (1, 16, 1, 97, 2, "causal", torch.bfloat16),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_step_on_threads_equals_the_definition(case):
    """With the C++ decode step, the H query heads go to ``B · P`` tasks over P views of the one
    key head: the tolerance rule against the naive form, odd sizes (C = 59, Dn = 40, Dv = 24)."""
    _needs_ext()
    B, H, L, S, threads, which, dtype = DECODE_CASES[case]
    mask = {"causal": masks.causal(), "padding": _left_padding(B, S)[:, None, None], None: None}[
        which
    ]
    xs = _inputs(B, H, L, S, 40, 8, 59, 24, dtype=dtype, seed=7)
    q = torch.cat(xs[:2], dim=-1)
    with _threads(threads):
        with torch.no_grad():
            assert key_head_views(q, torch.cat(xs[2:4], dim=-1)) == 2
        check_against_reference(
            _absorbed_no_grad(mask), _latent_ref(mask, B, H, L, S), xs, grads=False
        )


def test_key_head_views_only_where_the_decode_kernel_runs():
    _needs_ext()
    q, joint = torch.zeros(1, 128, 1, 576), torch.zeros(1, 4096, 576)
    with _threads(2), torch.no_grad():
        assert key_head_views(q, joint) == 2
        assert key_head_views(q.expand(2, -1, -1, -1), joint.expand(2, -1, -1)) == 1  # B tasks
        assert key_head_views(q[:, :12], joint) == 1  # fewer than 8 heads per task
        assert key_head_views(q.double(), joint.double()) == 1  # float64: sdpa for few keys
        assert key_head_views(q.expand(1, -1, 9, -1), joint) == 1  # more than DECODE_MAX_L rows
    with _threads(8), torch.no_grad():
        assert key_head_views(q, joint) == 8
        assert key_head_views(q[:, :48], joint) == 6  # the largest divisor of H that fits
    with _threads(2):
        assert key_head_views(q.requires_grad_(), joint) == 1  # autograd: not the C++ step


def test_decode_step_on_threads_keeps_the_nan_rule_and_zero_rows():
    """P = 2 views per item (B = 2, 4 threads): item 0 attends nothing (zeros whatever its
    queries), item 1 has a NaN latent and an inf rotary key in a masked key (reach no row)."""
    _needs_ext()
    B, H, L, S = 2, 16, 1, 37
    xs = _inputs(B, H, L, S, dtype=torch.float32, seed=3)
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    keep[0] = False
    keep[1, ..., 5] = False
    xs[2][1, 5] = float("nan")
    xs[3][1, 5] = float("inf")
    xs[0][0, 3] = float("nan")
    with _threads(4), torch.no_grad():
        assert key_head_views(torch.cat(xs[:2], -1), torch.cat(xs[2:4], -1)) == 2
        out = absorbed_latent_attention(*xs, mask=keep)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    clean = [x.double() for x in xs]
    clean[2][1, 5], clean[3][1, 5] = 0.0, 0.0
    ref = latent_attention(*clean, mask=keep)
    torch.testing.assert_close(out[1].double(), ref[1], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the latent cache


def test_latent_cache_stores_only_the_latent_and_the_rotary_key():
    cache = LatentCache(capacity=4096)
    assert repr(cache) == "LatentCache(S=0, seen=0, capacity=4096)"
    view = cache.update(torch.randn(1, 7, 512), torch.randn(1, 7, 64))
    assert view.latent.shape == (1, 7, 512) and view.k_rope.shape == (1, 7, 64)
    assert view.joint.shape == (1, 7, 576) and view.start == 0 and view.t == 7
    assert cache.nbytes / 4096 == (512 + 64) * 4  # the measured bytes per cached token
    assert repr(cache) == (
        "LatentCache(B=1, S=7, C=512, R=64, dtype=torch.float32, seen=7, capacity=4096)"
    )
    view = cache.update(torch.randn(1, 1, 512), torch.randn(1, 1, 64))
    assert view.joint.shape == (1, 8, 576) and len(cache) == 8 == cache.seen


def test_latent_cache_grows_keeps_values_and_overflows_clearly():
    cache = LatentCache()
    a, r = torch.randn(2, 20, 8), torch.randn(2, 20, 2)
    for t in range(20):
        view = cache.update(a[:, t : t + 1], r[:, t : t + 1])
    assert torch.equal(view.latent, a) and torch.equal(view.k_rope, r)
    cache.reorder(torch.tensor([1, 0]))
    assert torch.equal(cache.update(a[:, :0], r[:, :0]).latent, a.flip(0))
    small = LatentCache(capacity=3)
    small.update(a[:, :2], r[:, :2])
    with pytest.raises(CacheOverflowError, match="capacity is 3 positions, 2 are cached"):
        small.update(a[:, :2], r[:, :2])
    with pytest.raises(ValueError, match=r"\(B, C, R\) = \(2, 4, 2\) does not match .*\(2, 8, 2\)"):
        small.update(a[:, :1, :4], r[:, :1])
    with pytest.raises(ValueError, match="latent must be \\(B, T, ·\\), got \\(20, 8\\)"):
        small.update(a[0], r[0])


def test_cache_bytes_per_token_deepseek_v3():
    got = cache_bytes_per_token(
        128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        dtype="bfloat16",
    )
    assert got == {"latent": 1152, "per-head K/V": 81920}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        cache_bytes_per_token(
            1, kv_lora_rank=0, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2
        )


# --------------------------------------------------- the module against transformers' eager layer

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

TINY = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    n_routed_experts=4,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
CONFIGS = {
    "default": TINY,
    "yarn": dict(TINY, rope_parameters=YARN),
    "full_rank_q_rotate_half": dict(TINY, q_lora_rank=None, rope_interleave=False),
}


def _rms_norm_in_input_precision(self, x):
    """HF's RMSNorm, but in float64 for float64 input (HF rounds through float32 always)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def _eager_in_input_precision(module, query, key, value, attention_mask, scaling, **_):
    """HF's eager attention, its softmax in float64 for float64 input (HF's is float32)."""
    s = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        s = s + attention_mask
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
    return (p.to(query.dtype) @ value).transpose(1, 2).contiguous(), p


@pytest.fixture(autouse=True)
def _float64_golden(monkeypatch):
    """The float64 golden is HF's arithmetic in float64 throughout (norms and softmax)."""
    monkeypatch.setattr(hf_ds.DeepseekV3RMSNorm, "forward", _rms_norm_in_input_precision)
    monkeypatch.setattr(hf_ds, "eager_attention_forward", _eager_in_input_precision)


def _pair(name, dtype):
    """``(hf eager layer, attnlab module with its weights, hf rotary)`` in ``dtype``."""
    cfg = transformers.DeepseekV3Config(**CONFIGS[name])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = hf_ds.DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = MultiHeadLatentAttention.from_config(cfg)
    ours.load_state_dict(hf.state_dict())
    return hf.to(dtype), ours.to(dtype), hf_ds.DeepseekV3RotaryEmbedding(cfg)


def _tables(ours, positions, dtype, exact):
    """HF's ``(cos, sin)``: its own rotary module (float32 angles), or ``exact`` float64 tables
    from attnlab's RoPE in HF's ``cat(freqs, freqs)`` layout (for a float64 comparison)."""
    cos, sin = ours.rope.cos_sin(positions, dtype=F64)
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


B, L = 3, 9
KEEP = torch.ones(B, L, dtype=torch.bool)
KEEP[1, :3] = False  # left padding
KEEP[2, :7] = False
ALLOWED = torch.ones(L, L, dtype=torch.bool).tril()[None, None] & KEEP[:, None, None, :]
POS = (KEEP.long().cumsum(-1) - 1).clamp(min=0)  # positions of the real tokens


def _hf_prefill(hf, rot, x, cos_sin=None):
    cos_sin = rot(x, POS) if cos_sin is None else cos_sin
    add = torch.zeros(ALLOWED.shape, dtype=x.dtype).masked_fill(~ALLOWED, torch.finfo(x.dtype).min)
    return hf(x, cos_sin, add)[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_equals_hf_eager_with_causal_and_padding(name):
    hf64, ours64, _ = _pair(name, F64)
    x = seeded(B, L, 32, seed=11)
    mask = masks.causal() & masks.from_tensor(KEEP[:, None, None, :])
    with torch.no_grad():
        golden = _hf_prefill(hf64, None, x, _tables(ours64, POS, F64, True))
        out64 = ours64(x, mask=mask, positions=POS)
        torch.testing.assert_close(out64[KEEP], golden[KEEP], atol=1e-12, rtol=1e-12)
        hf32, ours32, rot = _pair(name, torch.float32)
        naive = _hf_prefill(hf32, rot, x.float())
        out32 = ours32(x.float(), mask=ALLOWED, positions=POS)
    assert_close_rule(out32[KEEP], golden[KEEP], naive[KEEP], name=f"{name} prefill")


@pytest.mark.parametrize("name", ["default", "yarn"])
def test_decode_step_by_step_equals_hf_eager_and_the_prefill(name):
    hf, ours, _ = _pair(name, F64)
    x = seeded(2, 8, 32, seed=5)
    hf_cache, cache = DynamicCache(config=hf.config), LatentCache()
    outs = []
    with torch.no_grad():
        for t in range(8):
            pos = torch.full((2, 1), t)
            ref = hf(x[:, t : t + 1], _tables(ours, pos, F64, True), None, cache=hf_cache)[0]
            outs.append(ours(x[:, t : t + 1], cache=cache))
            torch.testing.assert_close(outs[-1], ref, atol=1e-12, rtol=1e-12)
        full = ours(x, mask=masks.causal())
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=1e-12)
    assert len(cache) == 8 and cache.nbytes == 2 * 16 * (16 + 8) * 8  # grown to 16 slots


def test_padded_prompt_then_decode_equals_hf_eager():
    """A left-padded batch: prompt into the cache with causal + padding, then decode steps with
    the padding mask over the cached keys and per-item positions, against HF's eager layer."""
    hf, ours, _ = _pair("yarn", F64)
    x = seeded(B, L, 32, seed=4)
    add = torch.zeros(ALLOWED.shape, dtype=F64).masked_fill(~ALLOWED, torch.finfo(F64).min)
    hf_cache, cache = DynamicCache(config=hf.config), LatentCache()
    P = 5  # prompt length; tokens P … L − 1 are decoded one at a time
    with torch.no_grad():
        tables = _tables(ours, POS[:, :P], F64, True)
        ref = hf(x[:, :P], tables, add[..., :P, :P], cache=hf_cache)[0]
        out = ours(x[:, :P], mask=ALLOWED[..., :P, :P], positions=POS[:, :P], cache=cache)
        real = KEEP[:, :P]
        torch.testing.assert_close(out[real], ref[real], atol=1e-12, rtol=1e-12)
        for t in range(P, L):
            pos = POS[:, t : t + 1]
            ref = hf(x[:, t : t + 1], _tables(ours, pos, F64, True), add[..., t : t + 1, : t + 1],
                     cache=hf_cache)[0]  # fmt: skip
            out = ours(x[:, t : t + 1], mask=ALLOWED[..., t : t + 1, : t + 1], positions=pos,
                       cache=cache)  # fmt: skip
            real = KEEP[:, t]
            torch.testing.assert_close(out[real], ref[real], atol=1e-12, rtol=1e-12)


def test_absorbed_decode_step_forms_no_per_head_keys_or_values():
    """With 300 cached tokens, no tensor of a decode step is as large as one per-head K or V
    (H · S · Dv = 12,000 elements); the cache holds S · (C + R) = 7,200."""
    _, ours, _ = _pair("default", torch.float32)
    cache = LatentCache(capacity=301)
    with torch.no_grad():
        ours(seeded(1, 300, 32, dtype=torch.float32), mask=masks.causal(), cache=cache)
        with LargestTensor() as spy:
            ours(seeded(1, 1, 32, dtype=torch.float32, seed=1), cache=cache)
    assert cache.nbytes == 301 * (16 + 8) * 4
    assert 0 < spy.largest < 4 * 300 * 10, spy.largest


class _NewTensors(TorchDispatchMode):
    """Records the numel of every op output that is not a view of an input (new memory)."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.numels.append(t.numel())
        return out


def test_decode_step_on_threads_reads_the_cache_in_place():
    """On 2 threads (2 views of the key head), a decode step over 301 cached tokens makes no
    new tensor as large as a tenth of the cache (S · (C + R) = 7,248 elements): no copy of it,
    nor of the up-projections (W_UKᵀ is kept from the previous step)."""
    _needs_ext()
    cfg = transformers.DeepseekV3Config(**dict(TINY, num_attention_heads=16))
    ours = MultiHeadLatentAttention.from_config(cfg).eval()
    cache = LatentCache(capacity=302)
    with torch.no_grad(), _threads(2):
        ours(seeded(1, 300, 32, dtype=torch.float32), mask=masks.causal(), cache=cache)
        ours(seeded(1, 1, 32, dtype=torch.float32, seed=1), cache=cache)  # RoPE tables grown
        with _NewTensors() as spy:
            ours(seeded(1, 1, 32, dtype=torch.float32, seed=2), cache=cache)
        assert key_head_views(torch.zeros(1, 16, 1, 24), torch.zeros(1, 302, 24)) == 2
    assert 0 < max(spy.numels) < 720, max(spy.numels)


def test_decode_position_off_by_one_is_detected():
    """The check above is sensitive to the RoPE offset: positions shifted by one differ."""
    _, ours, _ = _pair("default", F64)
    x = seeded(1, 4, 32, seed=2)
    with torch.no_grad():
        full = ours(x, mask=masks.causal())
        cache = LatentCache()
        ours(x[:, :3], mask=masks.causal(), cache=cache)
        shifted = ours(x[:, 3:], cache=cache, positions=4)
    assert (shifted[:, 0] - full[:, 3]).abs().max() > 1e-6


def test_prefill_into_the_cache_then_decode_in_float32():
    _, ours, _ = _pair("default", torch.float32)
    x = seeded(2, 7, 32, dtype=torch.float32, seed=9)
    cache = LatentCache(capacity=7)
    with torch.no_grad():
        a = ours(x[:, :5], mask=masks.causal(), cache=cache)
        b = torch.cat([ours(x[:, t : t + 1], cache=cache) for t in (5, 6)], 1)
        full = ours(x, mask=masks.causal())
    torch.testing.assert_close(torch.cat((a, b), 1), full, atol=2e-6, rtol=1e-5)


def test_absorbed_query_weight_is_made_once_per_weight_version():
    """W_UKᵀ is kept between decode steps and made again when kv_b_proj.weight changes (an
    in-place step, load_state_dict, a dtype change); under training it is not used, and the
    decode step's gradients reach the weight as the expanded form's do."""
    _, ours, _ = _pair("default", F64)
    w = ours.kv_b_proj.weight
    with torch.no_grad():
        a = ours.absorbed_query_weight()
        assert a is ours.absorbed_query_weight() and a.is_contiguous()
        assert torch.equal(a, ours.up_projections()[0].transpose(1, 2))
        w.mul_(2.0)  # an optimiser-like in-place step
        b = ours.absorbed_query_weight()
        assert b is not a and torch.equal(b, 2 * a)
        ours.load_state_dict({k: v / 2 if k == "kv_b_proj.weight" else v
                              for k, v in ours.state_dict().items()})  # fmt: skip
        assert torch.equal(ours.absorbed_query_weight(), a)
    x = seeded(2, 5, 32, seed=6)

    def decode_last(m):
        cache = LatentCache()
        m(x[:, :4], mask=masks.causal(), cache=cache)
        return m(x[:, 4:], cache=cache)

    with torch.no_grad():
        before = decode_last(ours)
        w.add_(0.1 * seeded(*w.shape, seed=8))  # the next steps must see the new weight
        full = ours(x, mask=masks.causal())[:, 4:]
        torch.testing.assert_close(decode_last(ours), full, atol=1e-12, rtol=1e-12)
        assert (before - full).abs().max() > 1e-3
    # training: no kept copy, and the step's gradient reaches kv_b_proj.weight
    assert ours.absorbed_query_weight() is None
    decode_last(ours).square().sum().backward()
    g_decode, w.grad = w.grad, None
    ours(x, mask=masks.causal())[:, 4:].square().sum().backward()
    torch.testing.assert_close(g_decode, w.grad, atol=1e-10, rtol=1e-10)
    f32 = ours.float()
    with torch.no_grad():
        assert f32.absorbed_query_weight().dtype == torch.float32


def test_decode_on_threads_equals_hf_eager():
    """16 heads, 2 threads: the decode steps run as 2 tasks over views of the latent (the C++
    step), against transformers' eager layer (float64 golden, its float32 run the naive)."""
    _needs_ext()
    cfg = dict(CONFIGS["yarn"], num_attention_heads=16, num_key_value_heads=16)
    CONFIGS["yarn16"] = cfg
    try:
        hf64, ours64, _ = _pair("yarn16", F64)
        hf32, ours32, rot = _pair("yarn16", torch.float32)
    finally:
        del CONFIGS["yarn16"]
    x = seeded(1, 6, 32, seed=12)
    caches = {k: DynamicCache(config=hf64.config) for k in ("64", "32")}
    ours_cache = LatentCache()
    views = []
    spy = key_head_views

    def counting(q, joint):
        views.append(spy(q, joint))
        return views[-1]

    with _threads(2), torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr("attnlab.modules.mla.key_head_views", counting)
        for t in range(6):
            pos = torch.full((1, 1), t)
            golden = hf64(x[:, t : t + 1], _tables(ours64, pos, F64, True), None,
                          cache=caches["64"])[0]  # fmt: skip
            naive = hf32(x[:, t : t + 1].float(), rot(x[:, t : t + 1].float(), pos), None,
                         cache=caches["32"])[0]  # fmt: skip
            out = ours32(x[:, t : t + 1].float(), cache=ours_cache)
            assert_close_rule(out, golden, naive, name=f"step {t}")
    assert views == [2] * 6


# deepseek_v3 through the bridge against eager (float32 logits by the tolerance rule, gradients,
# greedy generate with both caches) is a family of tests/test_hf_families.py's grid.


# --------------------------------------------------------------------------- compile, errors


def test_absorbed_decode_compiles_fullgraph_with_inductor():
    torch._dynamo.reset()
    xs = _inputs(1, 4, 1, 33, 8, 4, 16, 8, dtype=torch.float32)
    fn = torch.compile(
        lambda *x: absorbed_latent_attention(*x, mask=masks.causal()), fullgraph=True
    )
    torch.testing.assert_close(
        fn(*xs), absorbed_latent_attention(*xs, mask=masks.causal()), atol=1e-5, rtol=1e-5
    )


@pytest.mark.slow
def test_cached_decode_step_compiles_fullgraph_with_inductor():
    """The module's decode step (RoPE, LatentCache append, absorbed attention) in one graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    kw = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8)
    mla = MultiHeadLatentAttention(64, 4, **kw, v_head_dim=12).eval()
    x = torch.randn(2, 9, 64)
    cache = LatentCache(capacity=16)  # never full: a full buffer is one more specialisation
    step = torch.compile(lambda x, cache: mla(x, cache=cache), fullgraph=True)
    with torch.no_grad():
        outs = [mla(x[:, :6], mask=masks.causal(), cache=cache)]
        outs += [step(x[:, t : t + 1], cache) for t in range(6, 9)]
        full = mla(x, mask=masks.causal())
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-6, rtol=1e-5)
    assert len(cache) == 9


def test_bad_input_names_the_argument():
    xs = _inputs(1, 2, 3, 5)
    with pytest.raises(ValueError, match=r"w_uk must be \(2, 8, 16\) .* got \(2, 8, 15\)"):
        absorbed_latent_attention(*xs[:4], xs[4][..., :15], xs[5])
    with pytest.raises(ValueError, match=r"latent must be a 3-D tensor, got \(1, 1, 5, 16\)"):
        absorbed_latent_attention(xs[0], xs[1], xs[2][:, None], *xs[3:])
    kw = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match=r"rotary_dim must be even .* got 5"):
        MultiHeadLatentAttention(32, 4, **dict(kw, qk_rope_head_dim=5))
    with pytest.raises(ValueError, match="kv_lora_rank must be"):
        MultiHeadLatentAttention(32, 4, **dict(kw, kv_lora_rank=0))
    dyn = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    with pytest.raises(ValueError, match=r"rope_scaling: .* got rope_type 'dynamic'"):
        MultiHeadLatentAttention(32, 4, **kw, rope_scaling=dyn)
    m = MultiHeadLatentAttention(32, 4, **kw)
    with pytest.raises(ValueError, match=r"x must be \(B, L, embed_dim=32\), got \(2, 3, 31\)"):
        m(torch.randn(2, 3, 31))
    with pytest.raises(TypeError, match="cache must be a LatentCache or None, got KVCache"):
        m(torch.randn(2, 3, 32), cache=attnlab.modules.KVCache())
