"""Weights and per-query statistics recomputed from the log-sum-exp (no L×S matrix)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional.api import attention_stats, attention_weights
from attnlab.positional import ALiBi
from helpers import seeded


def qkv(B, H, H_kv, L, S, D, dtype=torch.float64):
    return (
        seeded(B, H, L, D, dtype=dtype, seed=1),
        seeded(B, H_kv, S, D, dtype=dtype, seed=2),
        seeded(B, H_kv, S, D, dtype=dtype, seed=3),
    )


def reference_stats(w: torch.Tensor, L: int, S: int) -> dict[str, torch.Tensor]:
    """The statistics from dense weights (B, H, L, S): the definition."""
    w = w.double()
    logw = torch.where(w > 0, w.log(), 0.0)
    pos = (torch.arange(L) + (S - L)).view(-1, 1)
    dist = (pos - torch.arange(S).view(1, -1)).abs().double()
    return {
        "entropy": -(w * logw).sum(-1),
        "max_weight": w.amax(-1) if S else w.sum(-1),
        "sink_mass": w[..., 0],
        "mean_distance": (w * dist).sum(-1),
    }


CASES = {
    "causal": (masks.causal(), None),
    "window_alibi": (masks.sliding_window(7), ALiBi(4)),
    "padding_dead": (masks.padding([0, 30]), None),
    "document_causal": (masks.causal() & masks.document.from_lengths([10, 25, 15]), None),
    "bidir_alibi": (None, ALiBi(4, causal=False)),
    "strided": (masks.strided(5), None),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_attention_weights_equal_reference_rows_and_heads(name, dtype):
    mask, bias = CASES[name]
    L, S = 41, 50
    q, k, v = qkv(2, 4, 2, L, S, 16, dtype)
    _, w, lse = attnlab.attention(
        q, k, v, mask=mask, bias=bias, backend="reference", return_weights=True, return_lse=True
    )
    _, lse_flash = attnlab.attention(
        q, k, v, mask=mask, bias=bias, backend="flash", return_lse=True
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    rows, heads = [0, 7, 40, 13], [3, 0]
    got = attention_weights(q, k, lse_flash, rows=rows, heads=heads, mask=mask, bias=bias)
    assert got.shape == (2, 2, 4, S) and got.dtype == dtype
    torch.testing.assert_close(got, w[:, heads][:, :, rows], atol=tol, rtol=0)
    everything = attention_weights(q, k, lse, mask=mask, bias=bias)
    torch.testing.assert_close(everything, w, atol=tol, rtol=0)
    dense = (
        mask.to_dense(L, S, batch=2)
        if mask is not None
        else torch.ones(1, 1, L, S, dtype=torch.bool)
    )
    assert torch.equal(
        everything.masked_select(~dense.expand_as(everything)),
        torch.zeros(int((~dense.expand_as(everything)).sum()), dtype=dtype),
    )


def test_attention_weights_3d_slices_cosine_temperature():
    q, k, v = seeded(2, 30, 8, seed=4), seeded(2, 35, 8, seed=5), seeded(2, 35, 8, seed=6)
    kw = {"score": "cosine", "temperature": 0.25, "mask": masks.sliding_window(9, causal=False)}
    _, w, lse = attnlab.attention(q, k, v, return_weights=True, return_lse=True, **kw)
    assert lse.shape == (2, 30)
    got = attention_weights(q, k, lse, rows=slice(5, 12), **kw)
    assert got.shape == (2, 7, 35)
    torch.testing.assert_close(got, w[:, 5:12], atol=1e-12, rtol=0)


def test_attention_weights_errors_name_the_argument():
    q, k, v = qkv(1, 2, 2, 6, 7, 4)
    _, lse = attnlab.attention(q, k, v, return_lse=True)
    with pytest.raises(
        ValueError, match=r"lse must have shape \(B, H, L\) = \(1, 2, 6\).*got \(1, 6\)"
    ):
        attention_weights(q, k, lse[:, 0])
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 6\), got \[6\]"):
        attention_weights(q, k, lse, rows=[6])
    with pytest.raises(TypeError, match=r"heads must hold integers, got dtype torch.float32"):
        attention_weights(q, k, lse, heads=torch.tensor([0.0]))
    with pytest.raises(TypeError, match=r"lse must be a torch.Tensor"):
        attention_weights(q, k, [1.0])


def assert_stats_match_dense(q, k, v, mask, bias, distance_atol: float):
    """`attention_stats` in float32 against `reference_stats` of the float64 dense weights."""
    B, H, L = q.shape[:3]
    S = k.shape[2]
    x64 = [t.double() for t in (q, k, v)]
    _, w = attnlab.attention(*x64, mask=mask, bias=bias, backend="reference", return_weights=True)
    st = attention_stats(q, k, v, mask=mask, bias=bias)
    for key, ref in reference_stats(w, L, S).items():
        got = getattr(st, key)
        assert got.shape == (B, H, L) and got.dtype == torch.float32
        atol = distance_atol if key == "mean_distance" else 2e-5
        torch.testing.assert_close(
            got.double(), ref, atol=atol, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
    return st


@pytest.mark.parametrize("name", list(CASES))
def test_attention_stats_equal_dense_reference(name):
    mask, bias = CASES[name]
    q, k, v = qkv(2, 4, 2, 41, 50, 16, torch.float32)
    st = assert_stats_match_dense(q, k, v, mask, bias, distance_atol=2e-4)
    dead = torch.isneginf(st.lse)
    if name == "padding_dead":
        assert dead[0].all() and not dead[1].any()
        for t in st.as_dict().values():
            if t is not st.lse:
                assert torch.equal(t[dead], torch.zeros_like(t[dead]))


def test_attention_stats_on_the_relative_plan_equal_dense_reference():
    """ALiBi causal at L = S = 1030: the plan shares bias tiles across merged band calls (rows
    reached by several calls); the streamed statistics still equal the dense definition."""
    mask, bias = masks.causal(), ALiBi(2)
    q, k, v = qkv(1, 2, 1, 1030, 1030, 16, torch.float32)
    assert attnlab.explain(q, k, v, mask=mask, bias=bias).backend == "flash"
    assert "relative plan" in attnlab.explain(q, k, v, mask=mask, bias=bias).plan
    assert_stats_match_dense(q, k, v, mask, bias, distance_atol=2e-3)


def test_attention_stats_reuses_given_lse_and_handles_3d_and_bf16():
    q, k, v = (seeded(2, 64, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    m = masks.sliding_window(10)
    _, lse = attnlab.attention(q, k, v, mask=m, return_lse=True)
    a = attention_stats(q, k, v, mask=m)
    b = attention_stats(q, k, v, mask=m, lse=lse)
    assert a.entropy.shape == (2, 64) and a.entropy.dtype == torch.float32
    for x, y in zip(a.as_dict().values(), b.as_dict().values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    # a one-key window has entropy 0 and max weight 1 (up to the bf16 kernel's lse rounding)
    one = attention_stats(q, k, v, mask=masks.sliding_window(1))
    torch.testing.assert_close(one.entropy, torch.zeros(2, 64), atol=2e-4, rtol=0)
    torch.testing.assert_close(one.max_weight, torch.ones(2, 64), atol=2e-4, rtol=0)
    assert torch.equal(one.mean_distance, torch.zeros(2, 64))


def test_attention_stats_uniform_attention_entropy_is_log_n():
    q = torch.zeros(1, 1, 20, 4)
    k, v = torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4)
    st = attention_stats(q, k, v, mask=masks.causal())
    n = torch.arange(1, 21, dtype=torch.float32)
    torch.testing.assert_close(st.entropy[0, 0], n.log(), atol=1e-6, rtol=0)
    torch.testing.assert_close(st.sink_mass[0, 0], 1 / n, atol=1e-6, rtol=0)
    torch.testing.assert_close(st.mean_distance[0, 0], (n - 1) / 2, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------ the NaN rule (issue 13)


def _nan_rule_case():
    """Packed documents [10, 12, 8] (causal), key padding in item 1, two rows with no key, and
    NaN/inf planted in attended and non-attended keys and queries; the rows the rule poisons."""
    B, H, H_kv, L, D = 2, 4, 2, 30, 8
    q, k, v = qkv(B, H, H_kv, L, L, D)
    doc = torch.tensor([0] * 10 + [1] * 12 + [2] * 8)
    keep = (doc[:, None] == doc[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    keep = keep.expand(B, L, L).clone()
    keep[1, :, 27:] = False  # item 1: padded keys
    keep[0, 3] = False  # rows with no key at all
    keep[1, 0] = False
    qb, kb = q.clone(), k.clone()
    kb[0, 0, 14] = float("nan")  # doc 2 of item 0, kv head 0 (query heads 0, 1)
    kb[1, 1, 28] = float("nan")  # padding: reaches nothing
    kb[1, 1, 12] = float("inf")  # doc 2 of item 1, kv head 1 (query heads 2, 3)
    qb[0, 3, 3] = float("nan")  # a row with no key: stays zeros
    qb[0, 2, 25] = float("-inf")  # doc 3: its own row only
    G = H // H_kv
    q_bad = ~torch.isfinite(qb).all(-1)  # (B, H, L)
    k_bad = ~torch.isfinite(kb).all(-1)[:, torch.arange(H) // G]  # (B, H, S)
    poisoned = (q_bad & keep.any(-1)[:, None]) | (keep[:, None] & k_bad[:, :, None]).any(-1)
    assert poisoned.any() and (~poisoned & keep.any(-1)[:, None]).any()
    return q, k, v, qb, kb, keep[:, None], poisoned


@pytest.mark.parametrize("lse_kind", ["clean", "poisoned"])
def test_nan_rule_attention_weights(lse_kind):
    """NaN in a key row i may not attend never reaches row i's weights; a non-finite attended
    key or query makes the row's weights non-finite (from the logits even when the given lse is
    finite, or from a NaN lse); rows with no key are 0."""
    q, k, _, qb, kb, mask, poisoned = _nan_rule_case()
    _, lse = attnlab.attention(q, k, k, mask=mask, backend="reference", return_lse=True)
    want = attention_weights(q, k, lse, mask=mask)
    if lse_kind == "poisoned":
        lse = torch.where(poisoned, float("nan"), lse)
    w = attention_weights(qb, kb, lse, mask=mask)
    assert torch.equal(torch.isfinite(w), ~poisoned[..., None].expand_as(w))
    ok = ~poisoned
    assert torch.equal(w[ok], want[ok])
    dead = ~mask.any(-1).expand_as(poisoned)
    assert (w[dead] == 0).all() and dead.any()


@pytest.mark.parametrize("lse_kind", ["clean", "poisoned"])
def test_nan_rule_attention_stats(lse_kind):
    q, k, v, qb, kb, mask, poisoned = _nan_rule_case()
    _, lse = attnlab.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    want = attention_stats(q, k, v, mask=mask, lse=lse)
    if lse_kind == "poisoned":
        lse = torch.where(poisoned, float("nan"), lse)
    st = attention_stats(qb, kb, v, mask=mask, lse=lse)
    dead = ~mask.any(-1).expand_as(poisoned)
    for name in ("entropy", "max_weight", "sink_mass", "mean_distance"):
        got, exp = getattr(st, name), getattr(want, name)
        assert torch.equal(torch.isfinite(got), ~poisoned), name
        torch.testing.assert_close(got[~poisoned], exp[~poisoned], atol=1e-12, rtol=0)
        assert (got[dead] == 0).all(), name


def test_nan_rule_bias_nan_on_a_masked_pair_never_reaches_the_row():
    """A NaN bias entry where the mask forbids the pair is masked (−inf wins); on an attended
    pair it poisons the row (weights and stats)."""
    q, k, v = qkv(1, 2, 2, 12, 12, 8)
    bias = torch.zeros(1, 2, 12, 12, dtype=torch.float64)
    bias[0, 0, 4, 9] = float("nan")  # above the diagonal: masked by causal
    bias[0, 1, 6, 2] = float("nan")  # attended
    mask = masks.causal()
    _, lse = attnlab.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    w = attention_weights(q, k, lse, mask=mask, bias=bias)
    st = attention_stats(q, k, v, mask=mask, bias=bias, lse=lse)
    bad = torch.zeros(1, 2, 12, dtype=torch.bool)
    bad[0, 1, 6] = True
    assert torch.equal(torch.isfinite(w).all(-1), ~bad) and torch.isnan(w[0, 1, 6]).all()
    assert torch.equal(torch.isfinite(st.entropy), ~bad)


def test_weights_and_stats_make_no_host_sync_on_a_causal_plan():
    """With int rows/heads and a given lse, neither reads a tensor value back to the host (the
    sink mass used nonzero() + int(), the index checks min()/max())."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = qkv(2, 4, 2, 40, 40, 8)
    _, lse = attnlab.attention(q, k, v, mask=masks.causal(), return_lse=True)
    with Syncs() as mode:
        attention_weights(q, k, lse, rows=[0, 5, -1], heads=2, mask=masks.causal())
        attention_stats(q, k, v, mask=masks.causal(), lse=lse)
    assert mode.seen == []
