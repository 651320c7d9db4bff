"""`MultiHeadAttention`'s unchecked route to the backend (issue 13's decode-step target).

Without a mask, bias function or weights, the module builds the attention request itself
(`validate.trusted_request`) instead of re-validating its own projections in `attention`. It must
be the same computation: the same backend and bit-equal outputs as calling `attention`.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import attention, masks
from attnlab.functional.registry import select
from attnlab.functional.validate import build_request, trusted_request
from attnlab.modules import KVCache, MultiHeadAttention
from attnlab.positional import RoPE


def _by_attention(mha: MultiHeadAttention, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """The module's forward written with the public `attention` call (no cache eviction)."""
    B, L, _ = x.shape
    q, k, v = mha.project(x)
    start = 0
    if cache is not None:
        view = cache.update(k, v)
        k, v, start = view.k, view.v, view.start
    S = k.shape[2]
    if mha.rope is not None:
        q, k = mha.rope(q, start + S - L), mha.rope(k, start)
    mask = masks.causal() if L > 1 else None
    out = attention(q, k, v, mask=mask, backend=mha.backend)
    return mha.out_proj(out.transpose(1, 2).reshape(B, L, -1))


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_bit_equal_to_attention(rope, dtype) -> None:
    """Prefill then decode steps (S crosses the decode backend's 512-key threshold): the module
    equals the same layer written with `attention`, bit for bit, at every step."""
    torch.manual_seed(0)
    E, H, H_kv = 64, 4, 2
    mha = MultiHeadAttention(E, H, num_kv_heads=H_kv, rope=RoPE(E // H) if rope else None)
    mha = mha.eval().to(dtype)
    x = torch.randn(2, 520, E, dtype=dtype)
    with torch.no_grad():
        c1, c2 = KVCache(530), KVCache(530)
        a = mha(x[:, :505], mask=masks.causal(), cache=c1)
        b = _by_attention(mha, x[:, :505], c2)
        assert torch.equal(a, b)
        for t in range(505, 515):
            a = mha(x[:, t : t + 1], cache=c1)
            b = _by_attention(mha, x[:, t : t + 1], c2)
            assert torch.equal(a, b), t


def test_trusted_request_equals_build_request() -> None:
    """The unchecked request has the fields `build_request` gives the same call, and auto picks
    the same backend for it."""
    q = torch.randn(1, 8, 1, 32)
    k, v = torch.randn(1, 2, 600, 32), torch.randn(1, 2, 600, 32)
    kw = dict(mask=None, bias=None, scale=None, temperature=1.0, score="dot", return_weights=False)
    for p in (0.0, 0.25):
        want = build_request(q, k, v, dropout_p=p, backend="auto", **kw)
        got = trusted_request(q, k, v, dropout_p=p)
        for field in ("dims", "mask", "bias", "scale", "temperature", "score", "dropout_p"):
            assert getattr(got, field) == getattr(want, field), field
        assert got.softcap is None and got.return_weights is False
        with torch.no_grad():
            assert select("auto", got)[0].name == select("auto", want)[0].name


def test_project_views_match_split_then_view() -> None:
    """The fused projection split gives the same views (values, strides, offsets) as splitting
    the features first and viewing each part."""
    torch.manual_seed(1)
    mha = MultiHeadAttention(48, 6, num_kv_heads=3)
    x = torch.randn(2, 5, 48)
    q, k, v = mha.project(x)
    qkv = mha.qkv_proj(x)
    parts = qkv.split([6 * 8, 3 * 8, 3 * 8], dim=-1)
    for got, part, n in zip((q, k, v), parts, (6, 3, 3), strict=True):
        want = part.view(2, 5, n, 8).transpose(1, 2)
        assert torch.equal(got, want)
        assert got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
