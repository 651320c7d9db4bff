"""Adaptive attention span (Sukhbaatar et al., 2019; issue 18): reference, fast path, plan, compile.

The reference (`reference.adaptive_span_attention`) is checked against the formula written out
with Python loops; the module's fast path (log-mask bias + ``sliding_window(span)``) against the
reference forward and backward, the gradient in z included; the span (the plan) changes only
through `refresh_span`, never inside forward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo as dynamo

from attnlab.functional import reference
from attnlab.functional.flash import flash_job
from attnlab.functional.request import plain_request
from attnlab.modules import AdaptiveSpan, AdaptiveSpanAttention
from attnlab.modules import adaptive_span as adaptive_span_module
from attnlab.modules.adaptive_span import SpanLogMask, span_log_mask
from attnlab.testing import check_against_reference, seeded

F64 = torch.float64


def _qkv(B, H, L, S, D, dtype=F64, H_kv=None, seed=0):
    H_kv = H if H_kv is None else H_kv
    return (
        seeded(B, H, L, D, dtype=dtype, seed=seed),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 1),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 2),
    )


def _span(z, max_span=40, ramp=4.0, backend="flash", dtype=F64) -> AdaptiveSpan:
    sp = AdaptiveSpan(len(z), max_span, ramp=ramp, backend=backend).to(dtype)
    with torch.no_grad():
        sp.z.copy_(torch.tensor(z, dtype=dtype))
    sp.refresh_span()
    return sp


# ---------------------------------------------------------------------------- the definition


def test_reference_equals_the_formula_written_with_loops():
    """a_ij = m(i'−j) e^{s_ij} / Σ_k m(i'−k) e^{s_ik}, m(x) = clamp((R + z − x)/R, 0, 1), x ≥ 0;
    L < S checks the bottom-right alignment, and H_kv = 1 the grouped heads."""
    B, H, L, S, D, R = 2, 3, 5, 9, 4, 3.0
    q, k, v = _qkv(B, H, L, S, D, H_kv=1)
    z = torch.tensor([0.0, 1.5, 4.25], dtype=F64)
    out, w = reference.adaptive_span_attention(q, k, v, z, ramp=R)
    want_w = torch.zeros(B, H, L, S, dtype=F64)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                ip = i + S - L
                num = []
                for j in range(S):
                    x = ip - j
                    m = min(max((R + float(z[h]) - x) / R, 0.0), 1.0) if x >= 0 else 0.0
                    s = float(q[b, h, i] @ k[b, 0, j]) / math.sqrt(D)
                    num.append(m * math.exp(s))
                for j in range(S):
                    want_w[b, h, i, j] = num[j] / sum(num)
    torch.testing.assert_close(w, want_w, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(out, want_w @ v, atol=1e-14, rtol=1e-12)
    # z = 0 with R = 3: only x ∈ {0, 1, 2} can be attended, with ramp weights 1, 2/3, 1/3
    assert torch.all(w[:, 0, :, :].count_nonzero(-1) == 3)


def test_log_mask_bias_gives_exactly_the_multiplicative_weights():
    """m · e^s = e^{s + log m}: attention with the additive bias log m (−inf where m = 0) equals
    the multiplicative reference, weights and output; the bias is −inf exactly where m = 0."""
    B, H, L, S, D, R = 2, 3, 11, 14, 8, 4.0
    q, k, v = _qkv(B, H, L, S, D)
    z = torch.tensor([0.7, 3.0, 9.2], dtype=F64)
    bias = span_log_mask(z, L, S, R)
    out_b, w_b = reference.attention(q, k, v, bias=bias)
    out_m, w_m = reference.adaptive_span_attention(q, k, v, z, ramp=R)
    torch.testing.assert_close(w_b, w_m, atol=1e-15, rtol=1e-13)
    torch.testing.assert_close(out_b, out_m, atol=1e-15, rtol=1e-13)
    assert torch.equal(torch.isneginf(bias).expand_as(w_m), w_m == 0)


@pytest.mark.parametrize(
    ("L", "S"), [(5, 5), (3, 9), (9, 3), (1, 1), (4, 1), (1, 4), (0, 3), (3, 0)]
)
def test_log_mask_toeplitz_view_equals_the_entrywise_formula(L, S):
    """The strided (unfold + flip) rendering equals log m(i' − j) computed entry by entry,
    bit for bit, for L = S, L < S, L > S (rows with i' < 0 all −inf) and empty sizes."""
    z, R = torch.tensor([0.5, 2.0, 7.3], dtype=F64), 2.5
    i = torch.arange(L) + S - L
    x = (i[:, None] - torch.arange(S)[None, :]).to(F64)  # (L, S)
    m = reference.span_ramp(x, z[:, None, None], R)
    live = (m > 0) & (x >= 0)
    want = torch.where(live, torch.log(torch.where(live, m, 1.0)), float("-inf"))
    got = span_log_mask(z, L, S, R)
    assert got.shape == (1, 3, L, S) and torch.equal(got[0], want)


def test_log_mask_gradient_is_finite_and_equals_the_ramp_derivative():
    """d log m / dz = 1/(R + z − x) on the ramp, 0 where m = 1 and where m = 0 (never NaN)."""
    R, L = 4.0, 12
    z = torch.tensor([2.5], dtype=F64, requires_grad=True)
    bias = span_log_mask(z, L, L, R)
    live = torch.isfinite(bias)
    (g,) = torch.autograd.grad(torch.where(live, bias, 0.0).sum(), z)
    x = torch.arange(L, dtype=F64)
    ramp = (x > 2.5) & (x < 2.5 + R)
    # distance x occurs in the L − x rows i >= x (S = L)
    want = sum((L - float(xx)) / (R + 2.5 - float(xx)) for xx in x[ramp])
    assert math.isfinite(float(g)) and float(g) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------- the fast path


@pytest.mark.parametrize(
    ("dtype", "L", "S"),
    [
        (torch.float32, 97, 97),
        (F64, 97, 97),
        (torch.float32, 17, 113),
        (F64, 17, 113),
        pytest.param(torch.float32, 520, 520, marks=pytest.mark.slow),
    ],
)
def test_fast_path_matches_the_reference_forward_and_backward(dtype, L, S):
    """The module on flash (tiles beyond the span skipped at L = 520) against the float64
    reference under the tolerance rule, output and dq, dk, dv."""
    sp = _span([1.3, 6.5, 20.25, 0.0], ramp=5.0, backend="flash", dtype=dtype)
    q, k, v = _qkv(1, 4, L, S, 16, dtype=dtype, H_kv=2)
    z = sp.effective_z().detach()

    def ref(q, k, v, *, compute_dtype, reorder):
        zz = z.to(q.dtype)
        return reference.adaptive_span_attention(
            q, k, v, zz, ramp=5.0, compute_dtype=compute_dtype, reorder=reorder
        )[0]

    mean = 10.0 if dtype == torch.float32 else None
    check_against_reference(sp, ref, [q, k, v], mean_factor=mean)


def test_inference_uses_the_relative_bias_function_and_matches_the_reference(monkeypatch):
    """Without a gradient for z, forward passes `SpanLogMask` (a relative bias function, no
    (H, L, S) tensor); its output equals the gradient-mode output and the reference."""
    sp = _span([3.5, 20.5, 60.25], max_span=300, ramp=8.0, dtype=torch.float32)
    q, k, v = _qkv(2, 3, 300, 300, 16, dtype=torch.float32)
    seen = []
    real = adaptive_span_module.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["bias"])
        return real(*args, **kwargs)

    monkeypatch.setattr(adaptive_span_module, "attention", spy)
    with torch.no_grad():
        fast = sp(q, k, v)
    dense = sp(q, k, v)
    assert isinstance(seen[0], SpanLogMask) and seen[0].relative
    assert isinstance(seen[1], torch.Tensor) and seen[1].shape == (1, 3, 300, 300)
    idx = torch.arange(300)
    grid = seen[0](idx[:1, None, None, None], idx[None, :3, None, None], idx[:, None], idx)
    assert torch.equal(grid, seen[1])  # the same log m, entry by entry
    ref, _ = reference.adaptive_span_attention(q.double(), k.double(), v.double(), sp.z, ramp=8.0)
    torch.testing.assert_close(fast, dense, atol=2e-6, rtol=0)
    torch.testing.assert_close(fast.double(), ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", ["flash", "sdpa", "reference"])
def test_gradient_in_z_matches_the_reference(backend):
    B, H, L, D, R = 2, 3, 45, 8, 6.0
    q, k, v = _qkv(B, H, L, L, D)
    dout = seeded(B, H, L, D, seed=9)
    sp = _span([2.3, 7.7, 15.1], ramp=R, backend=backend)
    out = sp(q, k, v)
    (gz,) = torch.autograd.grad(out, sp.z, dout)
    z = sp.z.detach().clone().requires_grad_(True)
    ref, _ = reference.adaptive_span_attention(q, k, v, z, ramp=R)
    (gz_ref,) = torch.autograd.grad(ref, z, dout)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(gz, gz_ref, atol=1e-10, rtol=1e-8)
    assert torch.all(gz != 0)  # every head's span is on a ramp that some row attends


def test_gradcheck_in_z_and_inputs_on_flash():
    """Finite differences of the flash path in float64 (z away from the ramp's kinks)."""
    sp = _span([1.4, 3.6], ramp=2.5, backend="flash")
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 2, 9, 9, 3))

    def fn(z, q, k, v):  # the module's own forward with z as an input
        return torch.func.functional_call(sp, {"z": z}, (q, k, v))

    z = sp.z.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (z, q, k, v), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- span and plan


def _pairs(sp: AdaptiveSpan, L: int) -> int:
    """(query, key) pairs the flash plan computes for the module's call (64 × 64 tiles)."""
    q, k, v = _qkv(1, sp.num_heads, L, L, 8, dtype=torch.float32)
    req = plain_request(
        q,
        k,
        v,
        mask=sp.mask(),
        bias=sp.log_mask(L, L).detach().float(),
        scale=None,
        temperature=1.0,
        score="dot",
    )
    calls = flash_job(req, block_q=64, block_k=64).plan.simple_calls
    return sum((c.b1 - c.b0) * (c.r1 - c.r0) * c.num_keys for c in calls)


def test_span_and_plan_change_only_in_refresh_span():
    """An optimizer step moves z but neither span nor the plan; forward then equals the
    reference at z clamped to [0, span − R] (the window never cuts a ramp-weighted key);
    refresh_span moves both; the plan skips every tile beyond the span."""
    R, L = 8.0, 1024
    sp = _span([10.5, 30.0], max_span=300, ramp=R, backend="flash")
    assert sp.span == math.ceil(30.0 + R) == 38
    pairs_before = _pairs(sp, L)
    opt = torch.optim.SGD(sp.parameters(), lr=1.0)
    sp.z.grad = torch.tensor([-50.0, 20.0], dtype=F64)  # z ← z − grad: head 0 grows past the span
    opt.step()
    assert sp.span == 38 and _pairs(sp, L) == pairs_before
    torch.testing.assert_close(sp.effective_z(), torch.tensor([30.0, 10.0], dtype=F64))
    q, k, v = _qkv(1, 2, 70, 70, 8)
    ref, _ = reference.adaptive_span_attention(q, k, v, sp.effective_z(), ramp=R)
    torch.testing.assert_close(sp(q, k, v), ref, atol=1e-12, rtol=1e-10)
    assert sp.refresh_span() == math.ceil(60.5 + R) == sp.span == 69
    pairs_after = _pairs(sp, L)
    # each row computes at most its window widened by one 64-tile on each side; causal would
    # compute L(L+1)/2 pairs
    assert pairs_before < pairs_after <= L * (69 + 128) < L * (L + 1) // 2
    assert pairs_before <= L * (38 + 128)
    with torch.no_grad():
        sp.z.fill_(-3.0)
    assert sp.refresh_span() == math.ceil(R) and torch.all(sp.z == 0)
    with torch.no_grad():
        sp.z.fill_(1e6)
    assert sp.refresh_span() == 300 + R and torch.all(sp.z == 300)


def test_forward_makes_no_host_sync_and_compiles_without_graph_breaks():
    """forward on meta tensors gives the shape; torch.compile(fullgraph=True) traces it (a graph
    break would raise); the compiled forward + backward (Inductor) equals eager, the gradient
    of z included, and so does the compiled inference (no_grad) forward."""
    dynamo.reset()
    try:
        attn = AdaptiveSpanAttention(16, 2, 32, ramp=4.0, init_span=5.5).double()
        attn.span.z.data = torch.tensor([2.5, 9.25], dtype=F64)
        attn.span.refresh_span()
        x = seeded(2, 13, 16, seed=4)
        meta = AdaptiveSpan(2, 32, ramp=4.0).to("meta")
        meta.span = 36
        assert meta(*(torch.empty(1, 2, 7, 8, device="meta") for _ in range(3))).shape == (
            1,
            2,
            7,
            8,
        )
        compiled = torch.compile(attn, fullgraph=True)

        def run(fn):
            attn.zero_grad()
            out = fn(x)
            out.backward(torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out))
            return out.detach(), [p.grad.clone() for p in attn.parameters()]

        out_c, g_c = run(compiled)
        out_e, g_e = run(attn)
        torch.testing.assert_close(out_c, out_e, atol=1e-12, rtol=0)
        for a, b in zip(g_c, g_e, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        assert attn.span.z.grad is not None and torch.all(attn.span.z.grad != 0)
        with torch.no_grad():  # inference: the relative bias function, also in one graph
            torch.testing.assert_close(compiled(x), attn(x), atol=1e-12, rtol=0)
    finally:
        dynamo.reset()


# ---------------------------------------------------------------------------- the NaN rule


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_nan_beyond_the_span_never_reaches_a_row(backend):
    """A NaN key j reaches only rows that attend it (0 <= i − j < z_h + R per head); a NaN
    v_j[d] only column d of those rows; other rows equal the clean run exactly."""
    R, L, j = 3.0, 30, 10
    sp = _span([1.5, 6.0], ramp=R, backend=backend)
    q, k, v = _qkv(1, 2, L, L, 4)
    clean = sp(q, k, v)
    k_bad = k.clone()
    k_bad[0, :, j, 1] = float("nan")
    v_bad = v.clone()
    v_bad[0, :, j, 2] = float("inf")
    i = torch.arange(L)
    reach = torch.stack([(i - j >= 0) & (i - j < z + R) for z in (1.5, 6.0)])  # (H, L)
    out_k = sp(q, k_bad, v)[0]  # (H, L, D)
    assert torch.equal(~torch.isfinite(out_k).all(-1), reach)
    nonfinite = ~torch.isfinite(out_k)
    assert torch.equal(nonfinite.all(-1), nonfinite.any(-1))  # whole rows
    assert torch.equal(out_k[~reach], clean[0][~reach])
    out_v = sp(q, k, v_bad)[0]
    bad_cols = ~torch.isfinite(out_v)
    assert torch.equal(bad_cols[..., 2], reach) and not bad_cols[..., [0, 1, 3]].any()
    assert torch.isnan(out_v[..., 2][reach]).all()
    torch.testing.assert_close(out_v[..., [0, 1, 3]], clean[0][..., [0, 1, 3]], atol=0, rtol=0)
    ref, _ = reference.adaptive_span_attention(q, k_bad, v, sp.z, ramp=R)
    assert torch.equal(torch.isfinite(ref[0]), torch.isfinite(out_k))


# ---------------------------------------------------------------------------- penalty, errors


def test_l1_penalty_gradient_is_lambda_per_head_and_shrinks_spans():
    sp = _span([5.0, 9.0], ramp=2.0)
    (g,) = torch.autograd.grad(sp.penalty(0.25), sp.z)
    torch.testing.assert_close(g, torch.full((2,), 0.25, dtype=F64))
    opt = torch.optim.SGD(sp.parameters(), lr=4.0)
    for _ in range(3):
        opt.zero_grad()
        sp.penalty(0.5).backward()
        opt.step()
        sp.refresh_span()
    torch.testing.assert_close(sp.spans(), torch.tensor([0.0, 3.0], dtype=F64))
    assert sp.span == 5


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_heads": 0, "max_span": 8}, r"num_heads must be >= 1, got 0"),
        ({"num_heads": 2, "max_span": 2.5}, r"max_span must be an int, got float 2\.5"),
        ({"num_heads": 2, "max_span": 8, "ramp": 0}, r"ramp must be > 0, got 0"),
        (
            {"num_heads": 2, "max_span": 8, "init_span": 9},
            r"init_span must be a number in \[0, max_span=8\], got 9",
        ),
        ({"num_heads": 2, "max_span": 8, "backend": "nope"}, r"nope"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        AdaptiveSpan(**kwargs)


def test_refresh_span_refuses_a_nan_span():
    sp = _span([1.0, 2.0])
    with torch.no_grad():
        sp.z[1] = float("nan")
    with pytest.raises(
        ValueError, match=r"z must be finite to refresh the span, got \[1\.0, nan\]"
    ):
        sp.refresh_span()
    assert sp.span == math.ceil(2.0 + 4.0)  # unchanged


def test_wrong_head_count_raises_before_any_work():
    sp = AdaptiveSpan(2, 8)
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r"H = num_heads = 2, got \(1, 3, 4, 8\)"):
        sp(q, q, q)
    with pytest.raises(ValueError, match=r"embed_dim must be divisible by num_heads.*10.*3"):
        AdaptiveSpanAttention(10, 3, 8)


# ---------------------------------------------------------------------------- training (slow)


def _span_demo():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "adaptive_span_charlm.py"
    spec = importlib.util.spec_from_file_location("adaptive_span_charlm", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_char_lm_training_shrinks_spans_per_head_under_the_l1_penalty(tmp_path):
    """200 steps on alice.txt (2 layers × 4 heads, L = 64, every z starting at S_max = 64): with
    λ = 5e-5 every span shrinks (some to 0, others stay longer: per head), the Python-int
    windows follow ⌈max z + R⌉ and the loss falls; with λ = 0 the spans stay at 64 (no key
    lies on their ramp, so the loss gives z no gradient)."""
    demo = _span_demo()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is ~10× faster on a loaded machine
    try:
        run = demo.train_spans(200, penalty=5e-5)
        control = demo.train_spans(20, penalty=0.0)
    finally:
        torch.set_num_threads(threads)
    last = torch.tensor(run.spans[-1])  # (layers, H)
    assert torch.all(last <= 40.0) and torch.any(last == 0.0)
    assert float(last.max() - last.min()) > 5.0
    for spans, windows in zip(run.spans, run.windows, strict=True):
        assert windows == [max(1, math.ceil(max(z) + 8.0)) for z in spans]
    assert run.windows[-1][0] < run.windows[0][0] == 72
    assert sum(run.losses[-20:]) / 20 < sum(run.losses[:20]) / 20 - 0.5
    demo.plot(run, tmp_path / "spans.png", 64)
    assert (tmp_path / "spans.png").stat().st_size > 10_000
    assert all(z == 64.0 for layer in control.spans[-1] for z in layer)
