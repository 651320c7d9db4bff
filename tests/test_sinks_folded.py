"""Attention sinks folded into attnlab's C++ kernel (issue 42: sinks cost ≤ 1.05× the plain call).

Where the band kernel writes every row of a flash call once (one causal or full segment, sliding
windows, packed documents, key masks) the sink joins each row's denominator where the kernel
finalises it (`attnlab.functional.flash.sinks`, ``_ext/band_attn.cpp``'s ``finish_row``): no pass
after the call. Checked against the float64 definition (`reference.attention(..., sinks=)`)
under the tolerance rule on odd head dims and lengths, forward and backward (the sinks' gradient
``ds_h = −Σ_i p_sink_i · (dO_i · O_i)`` included), with the NaN rule and rows without a key, and
the operators' own argument check; each test also asserts that the folded path ran.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import _ext, masks
from attnlab._shapes import check_qkv
from attnlab.functional import reference
from attnlab.functional.flash import run as flash_run
from attnlab.functional.request import dense_mask_and_bias
from attnlab.testing import check_against_reference, mean_factor_for, seeded

pytestmark = pytest.mark.skipif(not _ext.load("band_attn"), reason="attnlab's C++ band kernel")


def _left_padded(B: int, S: int) -> masks.Mask:
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    keep[0, ..., :11] = False  # item 0: its first 11 rows attend no key (causal)
    return masks.causal() & masks.from_tensor(keep)


CASES = {  # name: (mask, L = S, D)
    "causal": (masks.causal(), 97, 40),
    "full": (None, 113, 8),
    "window": (masks.sliding_window(17), 96, 80),
    "window, odd L": (masks.sliding_window(29), 113, 40),  # last rows: torch's kernel, then σ
    "documents": (masks.causal() & masks.document.from_lengths([37, 59]), 96, 64),
    "left padded": (_left_padded(2, 65), 65, 8),
}


@pytest.fixture
def folded(monkeypatch):
    """Records whether each flash call folded its sinks into the kernel (`run.fold_sinks`)."""
    seen: list[bool] = []
    real = flash_run.fold_sinks

    def spy(call, req, allowed):
        real(call, req, allowed)
        seen.append(call.folded)

    monkeypatch.setattr(flash_run, "fold_sinks", spy)
    return seen


def _inputs(L: int, D: int, *, H: int = 4, H_kv: int = 2, seed: int = 0):
    q = seeded(2, H, L, D, seed=seed, scale=1.5).float()
    k = seeded(2, H_kv, L, D, seed=seed + 1, scale=1.5).float()
    v = seeded(2, H_kv, L, D, seed=seed + 2).float()
    sinks = seeded(H, seed=seed + 3, scale=2.0).float()
    sinks[1] = 6.0  # a sink above every logit of its rows: the kernel rescales to it
    return q, k, v, sinks


def _reference(mask):
    def ref(q, k, v, sinks, *, compute_dtype, reorder):
        keep, _ = dense_mask_and_bias(mask, None, check_qkv(q, k, v), q.dtype, q.device)
        kw = {"compute_dtype": compute_dtype, "reorder": reorder}
        return reference.attention(q, k, v, mask=keep, sinks=sinks, **kw)[0]

    return ref


@pytest.mark.parametrize("name", list(CASES))
def test_folded_forward_and_backward_follow_the_tolerance_rule(name, folded):
    mask, L, D = CASES[name]

    def impl(q, k, v, sinks):
        return attnlab.attention(q, k, v, mask=mask, sinks=sinks, backend="flash")

    mean = mean_factor_for("flash", torch.float32)  # the rule of tiled float32 kernels
    check_against_reference(impl, _reference(mask), list(_inputs(L, D)), mean_factor=mean)
    assert folded and all(folded)


@pytest.mark.parametrize("name", ["causal", "window", "window, odd L", "left padded"])
def test_folded_lse_and_no_grad_forward_equal_the_definition(name, folded):
    mask, L, D = CASES[name]
    q, k, v, s = _inputs(L, D)
    with torch.no_grad():
        out, lse = attnlab.attention(q, k, v, mask=mask, sinks=s, backend="flash", return_lse=True)
    keep, _ = dense_mask_and_bias(mask, None, check_qkv(q, k, v), q.dtype, q.device)
    xs = [x.double() for x in (q, k, v, s)]
    want = reference.attention(*xs[:3], mask=keep, sinks=xs[3])[0]
    want_lse = reference.logsumexp(xs[0], xs[1], mask=keep, sinks=xs[3])
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=2e-6)
    assert folded == [True]


@pytest.mark.parametrize(
    "dtype,name", [(torch.bfloat16, "causal"), (torch.float16, "window, odd L")], ids=str
)
def test_folded_low_precision_follows_the_tolerance_rule(dtype, name, folded):
    """16-bit flash folds too (the kernel rounds each row once, the sink inside)."""
    mask, L, D = CASES[name]
    L += L % 2 if dtype == torch.bfloat16 else 0  # (bfloat16 pairs: an even segment)

    def impl(q, k, v, sinks):
        return attnlab.attention(q, k, v, mask=mask, sinks=sinks, backend="flash")

    check_against_reference(impl, _reference(mask), [x.to(dtype) for x in _inputs(L, D)])
    assert folded and all(folded)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["left padded", "window, odd L"])
def test_folded_nan_rule_and_rows_without_keys(name, bad, folded):
    """A NaN/+inf sink makes its head's rows with a key NaN (output and lse); rows without a key
    stay 0 with lse = s; the other heads are exact; gradients are those of the sink read as 0."""
    mask, L, D = CASES[name]
    q, k, v, s = _inputs(L, D)
    poisoned, zeroed = s.clone(), s.clone()
    poisoned[2], zeroed[2] = bad, 0.0
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, poisoned)]
    out, lse = attnlab.attention(*xs[:3], mask=mask, sinks=xs[3], backend="flash", return_lse=True)
    assert folded == [True]
    first = 11 if name == "left padded" else 0  # item 0's rows without a key
    assert bool((out[0, :, :first] == 0).all())
    assert torch.equal(lse[0, 1, :first], s[1].expand(first))
    assert bool(torch.isnan(out[0, 2, first:]).all() and torch.isnan(out[1, 2]).all())
    assert bool(torch.isnan(lse[0, 2, first:]).all() and torch.isnan(lse[1, 2]).all())
    ys = [x.clone().requires_grad_(True) for x in (q, k, v, zeroed)]
    want = attnlab.attention(*ys[:3], mask=mask, sinks=ys[3], backend="flash")
    others = [0, 1, 3]
    torch.testing.assert_close(out[:, others], want[:, others], atol=0, rtol=0)
    dout = seeded(*out.shape, seed=7).float()
    got_g = torch.autograd.grad(out, xs, dout)
    want_g = torch.autograd.grad(want, ys, dout)
    for g, w in zip(got_g[:3], want_g[:3], strict=True):
        assert bool(torch.isfinite(g).all())
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert got_g[3][2] == 0 and torch.equal(got_g[3][others], want_g[3][others])


@pytest.mark.parametrize("name", ["causal", "window", "documents", "left padded"])
def test_the_sinks_gradient_reads_delta_from_the_kernels_backward(name, monkeypatch):
    """``ds_h = −Σ_i p_sink_i · (dO_i · O_i)``: the C++ backward writes every row's
    ``δ_i = dO_i · O_i`` (0 on rows without a key), so the sinks' gradient needs no pass over
    dO and O."""
    from attnlab.functional.flash import sinks as flash_sinks

    seen = []
    real = flash_sinks._sinks_grad

    def spy(sinks, out, lse, dout, dlse, delta=None):
        seen.append((delta is not None and bool(torch.isfinite(delta).all()), delta, dout, out))
        return real(sinks, out, lse, dout, dlse, delta)

    monkeypatch.setattr(flash_sinks, "_sinks_grad", spy)
    mask, L, D = CASES[name]
    xs = [x.requires_grad_(True) for x in _inputs(L, D)]
    out = attnlab.attention(*xs[:3], mask=mask, sinks=xs[3], backend="flash")
    out.backward(seeded(*out.shape, seed=4).float())
    ((written, delta, dout, o),) = seen
    assert written
    torch.testing.assert_close(delta, torch.linalg.vecdot(dout, o), atol=2e-5, rtol=1e-5)


def test_band_operator_refuses_sinks_of_the_wrong_shape():
    q = k = v = torch.randn(4, 32, 8)
    out, lse = torch.empty(1, 4, 16, 8), torch.empty(1, 4, 16)
    add = torch.zeros(1, 1, 16, 32)
    args = (out, lse, q, k, v, add, 0, 1, 16, 0, 32, 32, 0.35, False, False, 0.0, None)
    with pytest.raises(
        RuntimeError,
        match=r"sinks must be a unit-stride float32 CPU tensor of "
        r"shape \(4,\), got Double of shape \[4\]",
    ):
        torch.ops.attnlab_band.forward_into(*args, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"of shape \(4,\), got Float of shape \[3\]"):
        torch.ops.attnlab_band.forward_into(*args, torch.zeros(3))


# --------------------------------------------------------------------------- the decode step
@pytest.fixture
def stepped(monkeypatch):
    """Records whether each decode call with sinks ran the C++ step (`decode_run_sinks`)."""
    from attnlab.functional import api

    seen: list[bool] = []
    real = api.decode_run_sinks

    def spy(req, sinks):
        out = real(req, sinks)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(api, "decode_run_sinks", spy)
    return seen


def _step(L: int, S: int, D: int, seed: int = 0):
    q, k, v, s = _inputs(S, D, seed=seed)
    return q[:, :, :L].contiguous(), k, v, s


@pytest.mark.parametrize("L,S,D", [(1, 1, 8), (1, 97, 40), (3, 1025, 64), (1, 113, 80)])
@pytest.mark.parametrize("keyed", [False, True])
def test_decode_step_with_sinks_follows_the_tolerance_rule(L, S, D, keyed, stepped):
    keep = None
    if keyed and S > 1:  # padding on the left of item 0, a hole in item 1
        keep = torch.ones(2, 1, 1, S, dtype=torch.bool)
        keep[0, ..., : S // 3] = False
        keep[1, ..., S // 2 : S // 2 + 3] = False

    def impl(q, k, v, sinks):
        with torch.no_grad():
            return attnlab.attention(q, k, v, mask=keep, sinks=sinks, backend="decode")

    check_against_reference(impl, _reference(keep), list(_step(L, S, D)), grads=False)
    assert stepped == [True]


def test_decode_step_nan_rule_with_sinks(stepped):
    """A NaN/+inf sink poisons its head's rows; a NaN key only its item's rows of its key head;
    an item with no key is zeros — the tensor-op path's answers."""
    q, k, v, s = _step(1, 50, 16)
    keep = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    keep[1] = False  # item 1 attends nothing
    for bad in (float("nan"), float("inf")):
        sinks, kk = s.clone(), k.clone()
        sinks[2] = bad
        kk[0, 1, 7, 3] = float("nan")  # key head 1 of item 0: query heads 2 and 3
        with torch.no_grad():
            out = attnlab.attention(q, kk, v, mask=keep, sinks=sinks, backend="decode")
        assert bool(torch.isnan(out[0, 2:]).all()) and bool(torch.isfinite(out[0, :2]).all())
        assert bool((out[1] == 0).all())
        want = attnlab.attention(q, kk, v, mask=keep, sinks=sinks, backend="reference")
        torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6, equal_nan=True)
    assert stepped == [True, True]


def test_decode_operator_refuses_sinks_of_the_wrong_shape():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 9, 8)
    with pytest.raises(RuntimeError, match=r"sinks must be a unit-stride float32 CPU tensor of "):
        torch.ops.attnlab_nan.decode_attend(q, k, k, 0.35, None, 0.0, torch.zeros(2))
