"""`MultiHeadAttention`'s unchecked route to the backend (issue 13's decode-step target).

Without a mask, bias function or weights, the module builds the attention request itself
(`validate.trusted_request`) instead of re-validating its own projections in `attention`. It must
be the same computation: the same backend and bit-equal outputs as calling `attention`.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from attnlab import _ext, attention, masks
from attnlab.functional import gemv
from attnlab.functional.decode import decode_step_ready
from attnlab.functional.registry import select
from attnlab.functional.request import build_request, trusted_request
from attnlab.modules import KVCache, MultiHeadAttention
from attnlab.modules import mha as mha_module
from attnlab.positional import RoPE
from attnlab.testing import FIXED_TABLE, assert_close_rule


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
        want = build_request(q, k, v, dropout_p=p, **kw)
        got = trusted_request(q, k, v, dropout_p=p)
        for field in ("dims", "mask", "bias", "scale", "temperature", "score", "dropout_p"):
            assert getattr(got, field) == getattr(want, field), field
        assert got.softcap is None and got.return_weights is False
        with torch.no_grad():
            assert select("auto", got)[0].name == select("auto", want)[0].name


@pytest.mark.parametrize("backend", ["auto", "decode", "sdpa"])
def test_decode_step_ready_agrees_with_select(backend) -> None:
    """`decode.decode_step_ready` (the module's request-free check) says "decode" exactly when
    `select` gives the decode backend to the same request and its C++ step can run: over
    sizes around auto's 512-key threshold and the logits bound, L up to 9, empty calls, dtypes,
    dropout, and inputs that require grad (with and without grad mode)."""
    ext_on = _ext.mode() != "off" and _ext.load("nan_rule")
    cases = 0
    for S, L, B, dtype, p, grad, mode in itertools.product(
        (0, 1, 511, 512, 4096, 1 << 20),
        (1, 8, 9),
        (0, 1, 3),
        (torch.float32, torch.bfloat16, torch.float64),
        (0.0, 0.1),
        (False, True),
        (False, True),
    ):
        q = torch.zeros(1, 1, 1, 16, dtype=dtype, requires_grad=grad).expand(B, 4, L, 16)
        k = v = torch.zeros(1, 1, 1, 16, dtype=dtype).expand(B, 2, S, 16)  # no memory
        with torch.set_grad_enabled(mode):
            req = trusted_request(q, k, v, dropout_p=p)
            try:
                picked = select(backend, req)[0].name == "decode"
            except ValueError:  # an explicit backend refused it: so must the check
                picked = False
            want = picked and ext_on and not (grad and mode)
            assert decode_step_ready(backend, q, k, v, p) == want, (S, L, B, dtype, p, grad)
            cases += want
    assert (cases > 0) == (ext_on and backend != "sdpa")


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


@pytest.fixture(scope="module")
def ext() -> None:
    """The C++ operators, built or loaded (first run on a machine: about a minute), else skip."""
    if _ext.mode() == "off" or not _ext.load("nan_rule"):
        pytest.skip(f"C++ extension unavailable: {_ext.status('nan_rule')}")


@pytest.mark.parametrize(
    "dtype,rope_kw",
    [
        (torch.float32, {}),
        (torch.float32, {"interleaved": True}),
        (torch.float32, {"rotary_dim": 8}),
        (torch.bfloat16, {"interleaved": True}),
        (torch.float64, {}),
    ],
)
def test_fused_rope_decode_step_matches_the_python_path(ext, monkeypatch, rope_kw, dtype):
    """A cached decode step that auto gives the decode backend rotates q and every cached key
    and attends in one C++ call (`decode.rope_decode_run`); against the pure-PyTorch path
    (``ATTNLAB_EXT=0``: `RoPE` then the backend's tensor ops) as the naive and the same layer in
    float64 as the golden it follows the tolerance rule with the same NaN positions, for both
    RoPE layouts and a partial rotary dim, with NaN/inf planted in one batch item's cache (the
    NaN rule: that item's rows are non-finite, the other item's are finite). The projections
    stay on torch's kernel (``ATTNLAB_GEMV=off``: the streaming linear sums in another order;
    tests/test_gemv.py)."""
    monkeypatch.setenv(gemv.ENV, "off")
    calls = []
    real = mha_module.rope_decode_run
    monkeypatch.setattr(
        mha_module, "rope_decode_run", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    torch.manual_seed(4)
    E, H, H_kv = 64, 4, 2
    mha = MultiHeadAttention(E, H, num_kv_heads=H_kv, rope=RoPE(E // H, **rope_kw))
    mha = mha.eval().to(dtype)
    x = torch.randn(2, 4, E, dtype=dtype)
    k0 = torch.randn(2, H_kv, 512, E // H, dtype=dtype)
    v0 = torch.randn(2, H_kv, 512, E // H).to(dtype)

    def run(mode: str, plant: bool, module: MultiHeadAttention, dt) -> list[torch.Tensor]:
        monkeypatch.setenv(_ext.ENV, mode)
        cache = KVCache(520)
        cache.update(k0.to(dt), v0.to(dt))  # a 512-token prompt's pre-RoPE keys
        if plant:  # a NaN key entry and an inf value entry of item 0
            cache._k[0, 1, 100, 3] = float("nan")
            cache._v[0, 0, 7, 2] = float("inf")
        with torch.no_grad():
            return [module(x[:, t : t + 1].to(dt), cache=cache) for t in range(4)]

    gold_mha = copy.deepcopy(mha).double()
    for plant in (False, True):
        before = len(calls)
        naive = run("0", plant, mha, dtype)
        golden = run("0", plant, gold_mha, torch.float64)
        assert len(calls) == before  # no operators: RoPE in Python, then the backend
        on = run("require", plant, mha, dtype)
        assert len(calls) == before + 4  # each decode step took the fused call
        for a, n, g in zip(on, naive, golden, strict=True):
            assert torch.equal(a.isnan(), g.isnan()) and torch.equal(a.isnan(), n.isnan())
            if dtype == torch.float64:
                atol, rtol = FIXED_TABLE[torch.float64][:2]
                torch.testing.assert_close(a, g, atol=atol, rtol=rtol, equal_nan=True)
            else:
                assert_close_rule(a, g, n)
        if plant:
            steps = torch.cat(on, dim=1)
            assert steps[0].isnan().all() and steps[1].isfinite().all()


def test_fused_step_is_not_used_under_autograd(ext, monkeypatch) -> None:
    """With gradients the decode backend does not run (inference-only), so neither does the
    fused call; the module's output then matches the fused no-grad output to rounding."""
    calls = []
    real = mha_module.rope_decode_run
    monkeypatch.setattr(
        mha_module, "rope_decode_run", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    torch.manual_seed(5)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, rope=RoPE(8)).eval()
    x = torch.randn(1, 513, 32)
    c1, c2 = KVCache(), KVCache()
    with torch.no_grad():
        mha(x[:, :512], mask=masks.causal(), cache=c1)
        fused = mha(x[:, 512:], cache=c1)
    assert calls == [1]
    mha(x[:, :512], mask=masks.causal(), cache=c2)
    graded = mha(x[:, 512:], cache=c2)
    assert graded.requires_grad and calls == [1]
    torch.testing.assert_close(graded.detach(), fused, atol=1e-6, rtol=0)
