"""`merge_partials`: combining attention over disjoint key sets by log-sum-exp (H7)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.functional import reference
from attnlab.functional.merge import merge_into, merge_partials
from helpers import seeded


def _part(q, k, v, keep):
    """Reference attention restricted to the keys where ``keep`` (S,) is True: (out, lse)."""
    mask = keep.view(1, 1, 1, -1).expand(q.shape[0], q.shape[1], q.shape[2], -1)
    out, _ = reference.attention(q, k, v, mask=mask)
    lse = reference.logsumexp(q, k, mask=mask)
    return out, lse


@pytest.mark.parametrize("seed", range(6))
def test_random_key_chunks_merge_to_full_attention(seed):
    g = torch.Generator().manual_seed(seed)
    S = int(torch.randint(2, 60, (1,), generator=g))
    q, k, v = (
        seeded(2, 3, 7, 5, seed=seed),
        seeded(2, 3, S, 5, seed=seed + 10),
        seeded(2, 3, S, 4, seed=seed + 20),
    )
    n_parts = int(torch.randint(1, 5, (1,), generator=g))
    owner = torch.randint(0, n_parts, (S,), generator=g)  # random, non-contiguous chunks
    parts = [_part(q, k, v, owner == p) for p in range(n_parts)]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    full_out, full_lse = _part(q, k, v, torch.ones(S, dtype=torch.bool))
    torch.testing.assert_close(out, full_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=0)


def test_merge_of_a_result_with_itself_adds_ln2():
    out = seeded(2, 3, 9, 4, dtype=torch.float32, seed=1)
    lse = seeded(2, 3, 9, dtype=torch.float32, seed=2) * 5
    m_out, m_lse = merge_partials([out, out], [lse, lse])
    assert torch.equal(m_out, out)  # 0.5·a + 0.5·a is exact
    torch.testing.assert_close(m_lse, lse + math.log(2.0), atol=1e-6, rtol=0)


def test_all_minus_inf_rows_give_zeros_never_nan():
    outs = [seeded(1, 2, 4, 3, seed=s) for s in range(3)]
    outs[1][0, 0, 2] = float("nan")  # junk in a part that has no key for that row
    lses = [torch.full((1, 2, 4), float("-inf"), dtype=torch.float64) for _ in range(3)]
    lses[0][0, 1, 3] = 0.7  # row (0, 1, 3) is alive only in part 0
    out, lse = merge_partials(outs, lses)
    assert not torch.isnan(out).any()
    assert torch.isneginf(lse).sum() == 2 * 4 - 1
    assert torch.equal(out[0, 0], torch.zeros(4, 3, dtype=torch.float64))
    assert torch.equal(out[0, 1, 3], outs[0][0, 1, 3])
    assert lse[0, 1, 3] == 0.7


def test_dead_part_contributes_nothing_even_with_nan_output():
    a, b = seeded(1, 1, 3, 2, seed=1), torch.full((1, 1, 3, 2), float("nan"), dtype=torch.float64)
    la = seeded(1, 1, 3, seed=2)
    lb = torch.full((1, 1, 3), float("-inf"), dtype=torch.float64)
    out, lse = merge_partials([a, b], [la, lb])
    assert torch.equal(out, a) and torch.equal(lse, la)


def test_low_precision_outputs_merge_in_float32():
    out32 = seeded(1, 2, 5, 8, dtype=torch.float32, seed=3)
    lse = seeded(1, 2, 5, dtype=torch.float32, seed=4)
    o, l = merge_partials([out32.to(torch.bfloat16)] * 2, [lse, lse])
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32
    assert torch.equal(o, out32.to(torch.bfloat16))


def test_extreme_lse_gap_is_stable():
    a, b = seeded(1, 1, 2, 3, seed=1), seeded(1, 1, 2, 3, seed=2)
    la = torch.tensor([[[1e4, -1e4]]], dtype=torch.float64)
    lb = torch.tensor([[[-1e4, 1e4]]], dtype=torch.float64)
    out, lse = merge_partials([a, b], [la, lb])
    torch.testing.assert_close(out[0, 0, 0], a[0, 0, 0], atol=1e-12, rtol=0)
    torch.testing.assert_close(out[0, 0, 1], b[0, 0, 1], atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, torch.tensor([[[1e4, 1e4]]], dtype=torch.float64))


@pytest.mark.parametrize(
    "outs,lses,msg",
    [
        ([], [], r"at least one"),
        ([torch.zeros(1, 2, 3)], [], r"1 outs but 0 lses"),
        (
            [torch.zeros(1, 2, 3)],
            [torch.zeros(1, 3)],
            r"needs lses\[0\] of shape \(1, 2\), got \(1, 3\)",
        ),
        (
            [torch.zeros(1, 2, 3), torch.zeros(1, 2, 4)],
            [torch.zeros(1, 2), torch.zeros(1, 2)],
            r"part 1 has out \(1, 2, 4\)",
        ),
    ],
)
def test_merge_errors_name_shapes(outs, lses, msg):
    with pytest.raises(ValueError, match=msg):
        merge_partials(outs, lses)


def test_merge_into_accumulates_like_merge_partials():
    """Parts merged one by one in place (from out = 0, lse = −inf) equal merge_partials, with
    rows dead in some parts and in all parts."""
    g = torch.Generator().manual_seed(5)
    outs = [torch.randn(2, 3, 6, 4, generator=g) for _ in range(3)]
    lses = [torch.randn(2, 3, 6, generator=g) for _ in range(3)]
    lses[0][..., 0] = float("-inf")
    lses[1][..., 1] = float("-inf")
    for lse in lses:
        lse[..., 2] = float("-inf")  # dead everywhere
    for o, lse in zip(outs, lses, strict=True):
        o.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
    want_o, want_l = merge_partials(outs, lses)
    acc_o, acc_l = torch.zeros(2, 3, 6, 4), torch.full((2, 3, 6), float("-inf"))
    for o, lse in zip(outs, lses, strict=True):
        merge_into(acc_o, acc_l, o, lse)
    torch.testing.assert_close(acc_o, want_o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(acc_l, want_l)
    assert (acc_o[..., 2, :] == 0).all() and torch.isneginf(acc_l[..., 2]).all()


# ------------------------------------------------------------------------ the NaN rule (issue 13)


def _planted_parts(seed):
    """Parts of a masked attention (reference, clean inputs) with NaN/inf planted by the rule.

    Returns ``(outs, lses, full_out, full_lse, finite_out, finite_lse)``: the planted parts, the
    full-key reference result, and where the merged result must be finite under the NaN rule.
    """
    g = torch.Generator().manual_seed(seed)
    B, H, L, S, D, Dv, n = 2, 2, 9, 23, 5, 4, 3
    q, k, v = (
        seeded(B, H, L, D, seed=seed),
        seeded(B, H, S, D, seed=seed + 1),
        seeded(B, H, S, Dv, seed=seed + 2),
    )
    mask = torch.rand(B, H, L, S, generator=g) < 0.3  # many (row, part) pairs with no key
    mask[0, 0, 0] = False  # a row with no key at all
    owner = torch.randint(0, n, (S,), generator=g)
    outs, lses = [], []
    for p in range(n):
        m = mask & (owner == p)
        outs.append(reference.attention(q, k, v, mask=m)[0])
        lses.append(reference.logsumexp(q, k, mask=m))
    full_out, _ = reference.attention(q, k, v, mask=mask)
    full_lse = reference.logsumexp(q, k, mask=mask)
    finite_row = torch.ones(B, H, L, dtype=torch.bool)
    finite_out = torch.ones(B, H, L, Dv, dtype=torch.bool)
    bad_values = [float("nan"), float("inf"), float("-inf")]
    for p in range(n):
        alive = torch.isfinite(lses[p])
        assert alive.any() and (~alive).any()
        # garbage in the stored output of rows where the part has no key: must not leak
        junk = ~alive & (torch.rand(B, H, L, generator=g) < 0.5)
        outs[p][junk] = float("nan")
        outs[p][~alive & ~junk] = float("inf")
        # a non-finite entry of a live part's output poisons that column of that row
        hit = alive.unsqueeze(-1) & (torch.rand(B, H, L, Dv, generator=g) < 0.05)
        outs[p][hit] = bad_values[p % 3]
        finite_out &= ~hit
        # a NaN or +inf lse (NaN/inf logit in that part) poisons the whole row
        row_hit = alive & (torch.rand(B, H, L, generator=g) < 0.1)
        lses[p][row_hit] = float("nan") if p % 2 else float("inf")
        finite_row &= ~row_hit
    finite_out &= finite_row.unsqueeze(-1)
    assert (~finite_row).any() and (finite_out != finite_row.unsqueeze(-1)).any()
    return outs, lses, full_out, full_lse, finite_out, finite_row


@pytest.mark.parametrize("seed", range(4))
def test_nan_rule_merge_equals_full_attention_under_the_rule(seed):
    outs, lses, full_out, full_lse, finite_out, finite_row = _planted_parts(seed)
    out, lse = merge_partials(outs, lses)
    assert torch.equal(torch.isfinite(out), finite_out)
    assert torch.equal(torch.isfinite(lse) | torch.isneginf(lse), finite_row)
    assert not torch.isposinf(out).any() and not torch.isneginf(out).any()  # poison is NaN
    torch.testing.assert_close(out[finite_out], full_out[finite_out], atol=1e-12, rtol=0)
    torch.testing.assert_close(lse[finite_row], full_lse[finite_row], atol=1e-12, rtol=0)
    assert torch.equal(out[0, 0, 0], torch.zeros_like(out[0, 0, 0]))  # no key: zeros
    assert torch.isneginf(lse[0, 0, 0])


def test_nan_rule_merge_gradients_are_those_of_the_cleaned_merge():
    outs, lses, *_ = _planted_parts(11)
    xs = [t.clone().requires_grad_(True) for t in outs + lses]
    n = len(outs)
    out, lse = merge_partials(xs[:n], xs[n:])
    dout, dlse = seeded(*out.shape, seed=3), seeded(*lse.shape, seed=4)
    grads = torch.autograd.grad((out, lse), xs, (dout, dlse))
    clean_outs = [torch.nan_to_num(o, 0.0, 0.0, 0.0) for o in outs]
    clean_lses = [torch.where(torch.isnan(t) | torch.isposinf(t), float("-inf"), t) for t in lses]
    ys = [t.clone().requires_grad_(True) for t in clean_outs + clean_lses]
    c_out, c_lse = merge_partials(ys[:n], ys[n:])
    want = torch.autograd.grad((c_out, c_lse), ys, (dout, dlse))
    for got, exp, x in zip(grads, want, outs + lses, strict=True):
        assert torch.isfinite(got).all()
        # entries that were non-finite get no gradient (they are read as constants)
        torch.testing.assert_close(got, torch.where(torch.isfinite(x), exp, 0.0), atol=0, rtol=0)
