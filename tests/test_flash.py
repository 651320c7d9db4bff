"""The tiled backend ("flash") against the float64 reference: masks × biases × dtypes × odd sizes,
every gradient, and the reliability catalogue's section G (G1–G9) and H7."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import flash_attention, reference
from attnlab.functional.request import dense_mask_and_bias
from attnlab.positional import ALiBi, T5RelativeBias
from helpers import (
    ODD_SIZES,
    call_backend,
    check_against_reference,
    mean_factor_for,
    reference_for,
    seeded,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def softcap_free_bias(b, h, i, j):
    """A function bias of (h, i, j) with −inf entries: head 1 never sees key 0."""
    val = 0.05 * (h + 1) * torch.cos((i - j).float() / 7.0)
    return torch.where((h == 1) & (j == 0), float("-inf"), val)


def cases(B: int, L: int, S: int, H: int = 4) -> dict[str, tuple[object, object]]:
    """name -> (mask, bias), covering every mask family, tensor masks, and function biases.

    ``H`` is the call's head count (ALiBi must be built for it; the tensor bias has 4 heads).
    """
    g = torch.Generator().manual_seed(L * 1000 + S)
    rand = torch.rand(B, 1, L, S, generator=g) > 0.3
    add = torch.where(torch.rand(1, 1, L, S, generator=g) > 0.2, 0.0, float("-inf"))
    tbias = torch.randn(1, 4, L, S, generator=g)
    n = max(1, S // 3)
    return {
        "none": (None, None),
        "causal": (masks.causal(), None),
        "window5": (masks.sliding_window(5), None),
        "window200": (masks.sliding_window(200), None),
        "window7_bidir": (masks.sliding_window(7, causal=False), None),
        "padding": (masks.padding([max(0, S - 3), S][:B]), None),
        "padding_empty": (masks.padding([0, S // 2][:B]), None),
        "causal&padding": (masks.causal() & masks.padding([S, max(1, S // 2)][:B]), None),
        "document": (masks.document.from_lengths([n, S - n]), None),
        "causal&document": (masks.causal() & masks.document.from_lengths([n, S - n]), None),
        "strided": (masks.strided(4), None),
        "bigbird": (masks.bigbird(16, 3, 1, 1, seed=2), None),
        "global_local": (masks.global_local(8, 2), None),
        "not_causal": (~masks.causal(), None),
        "from_fn": (masks.from_fn(lambda b, h, i, j: (i - j) % 3 != 1), None),
        "bool_tensor": (rand, None),
        "additive": (add, None),
        "alibi": (None, ALiBi(H, causal=False)),
        "alibi_causal": (masks.causal(), ALiBi(H)),
        "alibi_window": (masks.sliding_window(200), ALiBi(H)),
        "fn_bias_inf": (masks.sliding_window(9), softcap_free_bias),
        "tensor_bias": (masks.causal(), tbias),
    }


def run_flash(mask, bias, **kw):
    return call_backend("flash", mask, bias, **kw)


def qkv(B, H, H_kv, L, S, D, Dv, dtype, seed=1, scale=1.0):
    return (
        seeded(B, H, L, D, dtype=dtype, seed=seed, scale=scale),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 1, scale=scale),
        seeded(B, H_kv, S, Dv, dtype=dtype, seed=seed + 2),
    )


def check_all_cases(dtype, L, S, only=None, B=2, H=4, H_kv=2, D=40, Dv=24):
    q, k, v = qkv(B, H, H_kv, L, S, D, Dv, dtype)
    for name, (mask, bias) in cases(B, L, S, H).items():
        if only is not None and name not in only:
            continue
        try:
            check_against_reference(
                run_flash(mask, bias),
                reference_for(mask, bias),
                [q, k, v],
                mean_factor=mean_factor_for("flash", dtype),
            )
        except AssertionError as e:
            raise AssertionError(f"case={name} dtype={dtype} L={L} S={S}: {e}") from e


# --------------------------------------------------------------------------- correctness sweep
SMALL = [(1, 1), (17, 17), (97, 113), (113, 97), (1, 97)]


@pytest.mark.parametrize(
    "dtype,L,S",
    [(torch.float32, L, S) for L, S in SMALL]
    + [
        (dt, L, S) for dt in (torch.float64, torch.bfloat16, torch.float16) for L, S in SMALL[1:4:2]
    ],
    ids=str,
)
def test_every_case_matches_reference_small(dtype, L, S):
    check_all_cases(dtype, L, S)


LONG_CASES = ["causal", "window200", "causal&document", "alibi_causal"]


@pytest.mark.parametrize(
    "dtype,L,S,only",
    [
        (torch.float32, 1025, 1025, LONG_CASES),
        (torch.float32, 97, 1025, LONG_CASES),
        (torch.bfloat16, 1025, 1025, ["causal", "window200"]),
        (torch.float16, 1025, 1025, ["causal&document"]),
        (torch.float64, 1025, 1025, ["causal"]),
    ],
    ids=str,
)
def test_long_odd_sizes(dtype, L, S, only):
    check_all_cases(dtype, L, S, only=only, B=1, H=2, H_kv=1, D=64, Dv=64)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", list(itertools.product(ODD_SIZES, ODD_SIZES)))
def test_full_sweep_every_case_odd_sizes(dtype, L, S):
    check_all_cases(dtype, L, S, B=2 if max(L, S) < 1025 else 1)


@pytest.mark.parametrize("D,Dv", [(8, 8), (64, 32), (24, 80), (1, 3), (257, 7)])
def test_head_dims_and_dv_different_from_d(D, Dv):
    q, k, v = qkv(1, 2, 1, 33, 47, D, Dv, torch.float32)
    for mask in (None, masks.causal(), masks.sliding_window(6)):
        check_against_reference(
            run_flash(mask, None), reference_for(mask), [q, k, v], mean_factor=10.0
        )


def test_cosine_score_temperature_and_negative_scale():
    q, k, v = qkv(2, 4, 2, 40, 55, 16, 16, torch.float32)
    m = masks.sliding_window(11)
    for kw in ({"score": "cosine", "temperature": 0.3}, {"scale": -0.4}, {"temperature": 7.0}):
        # (a negative scale once broke the kernel's own causal masking: L < S has a causal call)
        check_against_reference(
            run_flash(masks.causal(), None, **kw),
            reference_for(masks.causal(), **kw),
            [q, k, v],
            mean_factor=10.0,
        )
        check_against_reference(
            run_flash(m, ALiBi(4), **kw),
            reference_for(m, ALiBi(4), **kw),
            [q, k, v],
            mean_factor=10.0,
        )


def test_large_logits_low_precision_stay_finite():
    # B11: scores ~1e4 accumulate in float32 inside the kernel
    for dtype, scale in ((torch.bfloat16, 30.0), (torch.float16, 12.0)):
        q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 2, 70, 70, 32, 32, dtype, scale=scale))
        out = attnlab.attention(q, k, v, mask=masks.sliding_window(9), backend="flash")
        out.backward(torch.ones_like(out))
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
        # the forward still meets the rule against float64 (gradients of near one-hot rows are
        # outside the fixed unit-input table for every backend)
        check_against_reference(
            run_flash(masks.causal(), None),
            reference_for(masks.causal()),
            [q.detach(), k.detach(), v.detach()],
            grads=False,
        )


def test_gqa_equals_mha_on_repeat_interleaved_kv():
    q, k, v = qkv(2, 6, 2, 90, 90, 16, 16, torch.float64)
    for mask in (masks.causal(), masks.sliding_window(12), masks.padding([50, 90])):
        a = attnlab.attention(q, k, v, mask=mask, backend="flash")
        b = attnlab.attention(
            q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask=mask, backend="flash"
        )
        torch.testing.assert_close(a, b, atol=1e-13, rtol=0)


# --------------------------------------------------------------------------- masked rows (B9)
def test_fully_masked_rows_zero_output_zero_grads_lse_minus_inf():
    B, H, L, S = 2, 2, 40, 30
    q, k, v = qkv(B, H, H, L, S, 16, 16, torch.float32)
    # batch 0: no key at all; causal L > S: the first L − S rows of batch 1 see nothing
    mask = masks.padding([0, S]) & masks.causal()
    for m in (mask, masks.padding([0, S])):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out, lse = flash_attention(qq, kk, vv, mask=m, block_q=16, block_k=16)
        dense = m.to_dense(L, S, batch=B)
        dead = ~dense.any(-1).expand(B, H, L)
        assert dead.any()
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
        out.backward(torch.randn_like(out))
        assert torch.equal(qq.grad[dead], torch.zeros_like(qq.grad[dead]))
        for g in (qq.grad, kk.grad, vv.grad):
            assert torch.isfinite(g).all()
        assert torch.equal(kk.grad[0], torch.zeros_like(kk.grad[0]))  # batch 0 attends no key


def test_bias_minus_inf_rows_are_dead():
    q, k, v = qkv(1, 2, 2, 20, 20, 8, 8, torch.float32)

    def bias(b, h, i, j):
        return torch.where(
            (i % 5 == 0) & (h == 0), float("-inf"), torch.zeros((), dtype=torch.float32)
        ).expand(1, 2, i.shape[-2], j.shape[-1])

    out, lse = flash_attention(q, k, v, mask=masks.sliding_window(4), bias=bias)
    assert torch.equal(out[0, 0, ::5], torch.zeros(4, 8))
    assert torch.isneginf(lse[0, 0, ::5]).all() and torch.isfinite(lse[0, 1]).all()


def test_nan_in_masked_out_keys_is_bit_equal_to_zeros():
    # A11: padding positions hold NaN/inf; where()-masking keeps them out of every result
    B, H, L, S = 2, 2, 50, 70
    q, k, v = qkv(B, H, H, L, S, 16, 16, torch.float32)
    lengths = [40, 61]
    k0, v0 = k.clone(), v.clone()
    for b, n in enumerate(lengths):
        k0[b, :, n:], v0[b, :, n:] = 0.0, 0.0
        k[b, :, n:], v[b, :, n:] = float("nan"), float("inf")
    for m in (masks.padding(lengths), masks.padding(lengths) & masks.sliding_window(30)):
        results = []
        for kk, vv in ((k, v), (k0, v0)):
            qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, kk, vv))
            out, lse = flash_attention(qq, kk, vv, mask=m, block_q=32, block_k=32)
            out.backward(seeded(*out.shape, dtype=torch.float32, seed=9))
            results.append((out, lse, qq.grad, kk.grad, vv.grad))
        for a, b in zip(*results, strict=True):
            assert torch.isfinite(a).sum() == torch.isfinite(b).sum()
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        assert torch.isfinite(results[0][0]).all()


# --------------------------------------------------------------------------- G1, G2, H7: tiles
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_g1_lengths_at_block_size_edges(block):
    for L in (block - 1, block, block + 1):
        q, k, v = qkv(1, 2, 1, L, L + 3, 32, 32, torch.float32)
        for mask in (
            masks.causal(),
            masks.sliding_window(max(2, block // 2)),
            masks.causal() & masks.padding([L]),
        ):

            def impl(q, k, v, mask=mask):
                return flash_attention(
                    q, k, v, mask=mask, block_q=block, block_k=block, band_block=block
                )[0]

            check_against_reference(impl, reference_for(mask), [q, k, v], mean_factor=10.0)


def test_g2_tile_size_independence_fp32():
    L = S = 200
    q, k, v = qkv(2, 2, 1, L, S, 32, 32, torch.float32)
    for mask in (masks.causal() & masks.padding([S, 170]), masks.sliding_window(50)):
        outs, lses = [], []
        for t in (16, 32, 64, 128):

            def impl(q, k, v, t=t, mask=mask):
                return flash_attention(q, k, v, mask=mask, block_q=t, block_k=t, band_block=t)[0]

            check_against_reference(impl, reference_for(mask), [q, k, v], mean_factor=10.0)
            o, l = flash_attention(q, k, v, mask=mask, block_q=t, block_k=t, band_block=t)
            outs.append(o)
            lses.append(l)
        for o, l in zip(outs[1:], lses[1:], strict=True):
            torch.testing.assert_close(o, outs[0], atol=2e-5, rtol=1.3e-6)
            fin = torch.isfinite(lses[0])
            assert torch.equal(fin, torch.isfinite(l))
            assert float((l[fin] - lses[0][fin]).abs().max()) <= 2e-4


@pytest.mark.parametrize("seed", range(8))
def test_h7_random_tile_sizes_equal_reference_fp64(seed):
    g = torch.Generator().manual_seed(seed)
    L, S = (int(x) for x in torch.randint(1, 140, (2,), generator=g))
    bq, bk, bb = (int(x) for x in torch.randint(1, 70, (3,), generator=g))
    engine = ["torch", "kernel"][seed % 2]
    q, k, v = qkv(2, 4, 2, L, S, 12, 10, torch.float64, seed=seed)
    for mask, bias in list(cases(2, L, S).values())[::2]:
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            mask = mask.double()
        if isinstance(bias, torch.Tensor):
            bias = bias.double()
        out, lse = flash_attention(
            q, k, v, mask=mask, bias=bias, block_q=bq, block_k=bk, band_block=bb, engine=engine
        )
        m, b = dense_mask_and_bias(
            mask, bias, attnlab._shapes.check_qkv(q, k, v), q.dtype, q.device
        )
        ref, _ = reference.attention(q, k, v, mask=m, bias=b)
        ref_lse = reference.logsumexp(q, k, mask=m, bias=b)
        tol = 1e-12 if engine == "torch" else 1e-6  # the kernel's exp is approximate
        torch.testing.assert_close(out, ref, atol=tol, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=0)


# --------------------------------------------------------------------------- G3, G9: autograd
GRADCHECK_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.sliding_window(3),
    "window_bidir": masks.sliding_window(2, causal=False),
    "causal&padding": masks.causal() & masks.padding([7, 4]),
    "document": masks.document.from_lengths([3, 6]),
}


@pytest.mark.parametrize(
    "name,engine",
    [(n, "torch") for n in GRADCHECK_MASKS] + [("window_bidir", "kernel")],
)
def test_g3_gradcheck_float64(name, engine):
    mask = GRADCHECK_MASKS[name]
    shape = (2, 2, 1, 7, 9, 3, 2) if engine == "torch" else (1, 2, 1, 5, 7, 2, 2)
    q, k, v = qkv(*shape, torch.float64)
    bias = ALiBi(2) if name == "causal" else None

    def f(q, k, v):
        out, lse = flash_attention(
            q, k, v, mask=mask, bias=bias, block_q=3, block_k=2, band_block=2, engine=engine
        )
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    inputs = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    # the kernel's exp is a fast approximation: its float64 finite differences need a looser atol
    atol = 1e-8 if engine == "torch" else 1e-5
    assert torch.autograd.gradcheck(f, inputs, atol=atol, rtol=1e-5, eps=1e-6)


def test_g9_double_backward_raises_clear_error():
    q, k, v = (x.requires_grad_(True) for x in qkv(1, 2, 2, 10, 10, 4, 4, torch.float64))
    out = attnlab.attention(q, k, v, mask=masks.causal(), backend="flash")
    # first-order gradients with create_graph=True are still correct...
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    ref = attnlab.attention(q, k, v, mask=masks.causal(), backend="reference")
    (rq,) = torch.autograd.grad(ref.pow(2).sum(), q, create_graph=True)
    torch.testing.assert_close(gq, rq, atol=1e-12, rtol=0)
    # ...but differentiating them raises instead of silently treating them as constants
    assert gq.requires_grad
    with pytest.raises(RuntimeError, match=r"double backward.*backend='reference'"):
        torch.autograd.grad(gq.pow(2).sum(), q)
    # (the failed call above freed part of gq's graph: build it again)
    out = attnlab.attention(q, k, v, mask=masks.causal(), backend="flash")
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    penalty = gq.pow(2).sum()
    with pytest.raises(RuntimeError, match=r"not differentiable"):
        (out.sum() + penalty).backward()


def test_lse_gradient_flows_and_matches_reference():
    q, k, v = qkv(1, 2, 2, 30, 40, 8, 8, torch.float64)
    m = masks.causal() & masks.padding([33])
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_attention(*x, mask=m, block_q=8, block_k=8)
    loss = (out * 1.5).sum() + torch.where(torch.isfinite(lse), lse, 0.0).pow(2).sum()
    grads = torch.autograd.grad(loss, x)
    y = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dm, _ = dense_mask_and_bias(m, None, attnlab._shapes.check_qkv(q, k, v), q.dtype, q.device)
    ro, _ = reference.attention(*y, mask=dm)
    rl = reference.logsumexp(y[0], y[1], mask=dm)
    loss = (ro * 1.5).sum() + torch.where(torch.isfinite(rl), rl, 0.0).pow(2).sum()
    rgrads = torch.autograd.grad(loss, y)
    for a, b in zip(grads, rgrads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# --------------------------------------------------------------------------- G4, G7: determinism
def test_g4_backward_bit_deterministic_50_runs():
    q, k, v = qkv(2, 4, 2, 129, 129, 16, 16, torch.float32)
    dout = seeded(2, 4, 129, 16, dtype=torch.float32, seed=7)
    runs = (
        (masks.sliding_window(20), None),
        (masks.causal() & masks.document.from_lengths([50, 79]), None),
        (masks.causal(), ALiBi(4)),  # the relative plan: merged band calls, overlapping rows
    )
    for mask, bias in runs:
        first = None
        for _ in range(50):
            x = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out, lse = flash_attention(
                *x, mask=mask, bias=bias, band_block=16, block_q=32, block_k=32
            )
            out.backward(dout)
            got = (out.detach(), lse, *(t.grad for t in x))
            if first is None:
                first = got
            else:
                assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True))


def test_g7_noncontiguous_dout_same_grads():
    q, k, v = qkv(1, 2, 2, 100, 100, 16, 16, torch.float32)
    base = seeded(1, 2, 16, 100, dtype=torch.float32, seed=3)
    dout_nc = base.transpose(-1, -2)  # (1, 2, 100, 16), non-contiguous
    grads = []
    for dout in (dout_nc, dout_nc.contiguous()):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = flash_attention(*x, mask=masks.sliding_window(20), band_block=16)
        out.backward(dout)
        grads.append([t.grad for t in x])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("L", [1, 2, 5, 17, 128])
def test_g8_backward_odd_lengths_no_nan(L):
    q, k, v = qkv(1, 2, 2, L, L, 16, 16, torch.float32, scale=5.0)
    for mask in (masks.causal(), masks.sliding_window(3), None):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = flash_attention(*x, mask=mask, block_q=16, block_k=16, band_block=16)
        out.backward(torch.ones_like(out))
        for g in x:
            assert torch.isfinite(g.grad).all()


# --------------------------------------------------------------------------- G5, G6, B5
def test_g5_storage_beyond_logical_length_is_never_read():
    B, H, L, S, D = 2, 2, 77, 91, 16
    q, k, v = qkv(B, H, H, L, S, D, D, torch.float32)

    def nan_padded(t, extra):
        big = torch.full((t.shape[0] + 1, t.shape[1], t.shape[2] + extra, t.shape[3]), float("nan"))
        big[: t.shape[0], :, : t.shape[2]] = t
        return big[: t.shape[0], :, : t.shape[2]]  # a view: NaN right after the logical end

    qp, kp, vp = nan_padded(q, 13), nan_padded(k, 200), nan_padded(v, 200)
    for mask in (masks.causal(), masks.sliding_window(16), masks.padding([50, 91]), None):
        ref = flash_attention(q, k, v, mask=mask, band_block=16)
        got = flash_attention(qp, kp, vp, mask=mask, band_block=16)
        for a, b in zip(ref, got, strict=True):
            assert not torch.isnan(b).any()
            assert torch.equal(a, b)


def test_b5_noncontiguous_inputs_bit_equal():
    q, k, v = qkv(1, 3, 3, 60, 60, 16, 16, torch.float32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, L, H, D) storage
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not unit-stride
    for mask in (masks.causal(), masks.sliding_window(9)):
        a = flash_attention(q, k, v, mask=mask, band_block=16)
        b = flash_attention(qt, kt, v, mask=mask, band_block=16)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("L,S", [(97, 113), (300, 300), (1, 50)])
def test_g6_lse_equals_logsumexp_of_scaled_masked_scores(L, S):
    q, k, v = qkv(2, 4, 2, L, S, 32, 32, torch.float32)
    for name, (mask, bias) in cases(2, L, S).items():
        _, lse = attnlab.attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias.to(q.dtype) if isinstance(bias, torch.Tensor) else bias,
            backend="flash",
            return_lse=True,
        )
        assert lse.dtype == torch.float32
        m, b = dense_mask_and_bias(
            mask, bias, attnlab._shapes.check_qkv(q, k, v), torch.float64, q.device
        )
        ref = reference.logsumexp(q.double(), k.double(), mask=m, bias=b)
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(lse)), name
        err = (lse.double() - ref)[fin].abs()
        assert err.numel() == 0 or float(err.max()) <= 2e-4, name


def test_low_precision_lse_is_float32():
    q, k, v = qkv(1, 2, 2, 20, 20, 8, 8, torch.bfloat16)
    out, lse = attnlab.attention(q, k, v, mask=masks.causal(), backend="flash", return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


# --------------------------------------------------------------------------- engines, errors
@pytest.mark.parametrize(
    "name", ["causal", "window200", "causal&document", "alibi_window", "tensor_bias"]
)
def test_torch_engine_matches_reference(name):
    L = S = 260
    q, k, v = qkv(1, 4, 2, L, S, 16, 16, torch.float32)
    mask, bias = cases(1, L, S)[name]

    def impl(q, k, v):
        b = bias.to(q.dtype) if isinstance(bias, torch.Tensor) else bias
        return flash_attention(q, k, v, mask=mask, bias=b, engine="torch", block_q=64, block_k=64)[
            0
        ]

    check_against_reference(impl, reference_for(mask, bias), [q, k, v], mean_factor=10.0)


def test_unsupported_requests_name_the_reason():
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"backend='flash' cannot run.*dropout"):
        attnlab.attention(q, k, v, dropout_p=0.2, backend="flash")
    with pytest.raises(ValueError, match=r"backend='flash' cannot run.*return_weights=True"):
        attnlab.attention(q, k, v, return_weights=True, backend="flash")
    t5 = T5RelativeBias(2, num_buckets=8, max_distance=16)
    with pytest.raises(ValueError, match=r"bias function whose values require grad"):
        attnlab.attention(q, k, v, bias=t5, backend="flash")
    with torch.no_grad():  # without autograd the learned bias is just a function of (h, i, j)
        check = attnlab.attention(q, k, v, bias=t5, backend="flash")
        ref = attnlab.attention(q, k, v, bias=t5, backend="reference")
    torch.testing.assert_close(check, ref, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match=r"block_q must be >= 1, got 0"):
        flash_attention(q, k, v, block_q=0)
    with pytest.raises(ValueError, match=r"engine must be 'kernel' or 'torch', got 'gpu'"):
        flash_attention(q, k, v, engine="gpu")
    with pytest.raises(ValueError, match=r"4-D q \(B, H, L, D\), got shape \(1, 8, 4\)"):
        flash_attention(q[:, 0], k[:, 0], v[:, 0])


def test_bias_function_errors_are_clear():
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 4, torch.float32)
    with pytest.raises(
        TypeError, match=r"bias function must return a float tensor, got dtype torch.int64"
    ):
        attnlab.attention(q, k, v, bias=lambda b, h, i, j: i - j, backend="flash")


def test_empty_dimensions():
    for shape_q, shape_kv in (
        ((1, 2, 0, 4), (1, 2, 5, 4)),
        ((1, 2, 5, 4), (1, 2, 0, 4)),
        ((0, 2, 5, 4), (0, 2, 5, 4)),
    ):
        q = torch.randn(*shape_q, requires_grad=True)
        k = torch.randn(*shape_kv, requires_grad=True)
        v = torch.randn(*shape_kv, requires_grad=True)
        out, lse = flash_attention(q, k, v, mask=masks.causal())
        assert out.shape == shape_q and lse.shape == shape_q[:3]
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert torch.equal(q.grad, torch.zeros_like(q))


def test_s1_output_equals_v():
    q, k, v = qkv(2, 2, 2, 7, 1, 8, 8, torch.float32)
    out = attnlab.attention(q, k, v, backend="flash")
    assert torch.equal(out, v.expand(2, 2, 7, 8))


def test_three_d_inputs_and_return_lse_shapes():
    q, k, v = (
        seeded(2, 30, 8, dtype=torch.float32),
        seeded(2, 40, 8, seed=2, dtype=torch.float32),
        seeded(2, 40, 8, seed=3, dtype=torch.float32),
    )
    out, lse = attnlab.attention(q, k, v, mask=masks.causal(), backend="flash", return_lse=True)
    assert out.shape == (2, 30, 8) and lse.shape == (2, 30)
    ref = attnlab.attention(q, k, v, mask=masks.causal(), backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    _, w, l = attnlab.attention(q, k, v, mask=masks.causal(), return_weights=True, return_lse=True)
    assert w.shape == (2, 30, 40)
    torch.testing.assert_close(l, lse, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- auto and explain
def test_auto_and_explain():
    small = qkv(1, 2, 2, 64, 64, 16, 16, torch.float32)
    big = qkv(1, 2, 2, 512, 512, 16, 16, torch.float32)
    assert attnlab.explain(*small).backend == "sdpa"
    assert attnlab.explain(*small, mask=masks.sliding_window(8)).backend == "sdpa"
    why = attnlab.explain(*big, mask=masks.sliding_window(8))
    assert why.backend == "flash" and "band plan" in why.plan
    assert attnlab.explain(*big, bias=ALiBi(2)).backend == "flash"
    # dense and short: one fused call (L = S unmasked calls may go to flash's segment kernel:
    # tests/test_flash_fast.py::test_auto_sends_one_segment_to_flash_when_the_kernel_runs_it)
    rect = qkv(1, 2, 2, 512, 520, 16, 16, torch.float32)
    assert attnlab.explain(*rect).backend == "sdpa"
    assert attnlab.explain(*big, mask=masks.sliding_window(8), dropout_p=0.1).backend == "sdpa"
    # sdpa cannot return lse: a short dense call with return_lse goes to flash, not the reference
    why = attnlab.explain(*small, return_lse=True)
    assert why.backend == "flash" and "cannot return the log-sum-exp" in why.reason
    assert attnlab.explain(*small, return_lse=True, return_weights=True).backend == "reference"
    with torch.enable_grad():
        t5 = T5RelativeBias(2, num_buckets=8, max_distance=16)
        assert attnlab.explain(*big, bias=t5).backend == "sdpa"  # flash: no bias gradients
    out = attnlab.attention(*big, mask=masks.sliding_window(8))
    ref = attnlab.attention(*big, mask=masks.sliding_window(8), backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_long_sequence_auto_picks_flash():
    q = torch.randn(1, 1, 4096, 8)
    assert attnlab.explain(q, q, q).backend == "flash"


@pytest.mark.parametrize("shape", [(1, 4, 30, 41), (2, 1, 30, 41), (1, 1, 1, 41), (41,)])
def test_bias_tensor_gradients_match_reference(shape):
    """A learned dense bias (e.g. a relative-position table already expanded) gets dS, summed
    over its broadcast dimensions."""
    q, k, v = qkv(2, 4, 2, 30, 41, 8, 8, torch.float64)
    bias = seeded(*shape, seed=11)
    for mask in (masks.causal() & masks.padding([41, 20]), masks.sliding_window(7)):
        grads = []
        for backend in ("flash", "reference"):
            x = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
            out = attnlab.attention(*x[:3], mask=mask, bias=x[3], backend=backend)
            out.backward(seeded(*out.shape, seed=12))
            grads.append([t.grad for t in x])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        assert grads[0][3].abs().sum() > 0


def test_rows_with_one_key_have_exactly_zero_dq_fp64():
    """Every weight is exactly 1 with a single key, so dQ is exactly 0: backward takes δ from the
    tile (Σ P·dP, as softmax's own backward does) for rows whose keys all lie in one call."""
    q, k, v = qkv(2, 3, 1, 113, 1, 8, 8, torch.float64)
    q.requires_grad_(True)
    out, _ = flash_attention(q, k, v, mask=masks.causal())
    out.backward(seeded(*out.shape, seed=4))
    assert torch.equal(q.grad, torch.zeros_like(q))
    check_all_cases(torch.float64, 113, 1, only=["causal", "none", "alibi", "alibi_causal"])


def test_backward_supports_is_grads_batched_and_func_grad():
    """The flash backward under vmap (autograd's is_grads_batched) and under torch.func.grad."""
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 1, 40, 37, 8, 8, torch.float64))
    mask = masks.sliding_window(5)
    out = attnlab.attention(q, k, v, mask=mask, backend="flash")
    douts = torch.randn(3, *out.shape, dtype=torch.float64)
    batched = torch.autograd.grad(out, (q, k, v), douts, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        single = torch.autograd.grad(out, (q, k, v), douts[i], retain_graph=True)
        for b, s in zip(batched, single, strict=True):
            assert torch.equal(b[i], s)

    def loss(q, backend):
        return attnlab.attention(q, k.detach(), v.detach(), mask=mask, backend=backend).sum()

    got = torch.func.grad(loss)(q.detach(), "flash")
    want = torch.func.grad(loss)(q.detach(), "reference")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_gradcheck_with_batched_grad():
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 1, 1, 7, 6, 3, 3, torch.float64))

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=masks.causal(), backend="flash")

    assert torch.autograd.gradcheck(f, (q, k, v), check_batched_grad=True, atol=1e-8)
