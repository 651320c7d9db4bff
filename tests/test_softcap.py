"""Logit soft-capping (issue 16): ``softmax(c·tanh(s/c) + bias, masked) v``, ``s = q·kᵀ·scale/T``.

The definition is `reference.softcap_logits` inside `reference.attention`; flash applies it per
tile (forward and backward), decode on its materialised logits, sdpa declines it. The order of
the stages (cap after scaling, before bias and mask) is checked against transformers' own gemma2
``eager_attention_forward`` on the same q, k, v.
"""

from __future__ import annotations

import types

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import flash_attention, reference
from attnlab.functional.request import dense_mask_and_bias
from attnlab.testing import assert_close_rule
from helpers import check_against_reference, reference_for, seeded

CAP = 2.5
B, H, H_KV, L, S, D = 2, 4, 2, 37, 53, 24


def qkv(dtype=torch.float64, *, b=B, h=H, h_kv=H_KV, l=L, s=S, d=D, dv=D, spread=3.0, seed=0):
    """Inputs whose logits reach well beyond the cap (|s| up to ~15), so capping matters."""
    q = seeded(b, h, l, d, seed=seed, scale=spread).to(dtype)
    k = seeded(b, h_kv, s, d, seed=seed + 1, scale=spread).to(dtype)
    v = seeded(b, h_kv, s, dv, seed=seed + 2).to(dtype)
    return q, k, v


def mask_cases() -> dict[str, tuple[object, object]]:
    """name -> (mask, bias) on the (B, H, L=37, S=53) grid; biases are float64 tensors."""
    bias = seeded(1, H, L, S, seed=9)
    return {
        "none": (None, None),
        "causal": (masks.causal(), None),
        "window": (masks.sliding_window(9), None),
        "documents": (masks.causal() & masks.document.from_lengths([20, 33]), None),
        "padding": (masks.padding([53, 29]), None),
        "causal_bias": (masks.causal(), bias),
        "window_bias": (masks.sliding_window(9), bias),
    }


def explicit(q, k, v, keep, add, *, scale, cap):
    """The formula written out (float64, k/v repeated per group), independent of attnlab."""
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ kr.transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap)
    if add is not None:
        s = s + add
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows: zeros
    return p @ vr


def dense(mask, bias, q, k, v):
    dims = attnlab._shapes.check_qkv(q, k, v)
    return dense_mask_and_bias(mask, bias, dims, q.dtype, q.device)


# --------------------------------------------------------------------------- the definition
@pytest.mark.parametrize("name", ["causal", "documents", "window_bias"])
def test_reference_is_the_written_out_formula_and_the_cap_matters(name):
    q, k, v = qkv()
    mask, bias = mask_cases()[name]
    keep, add = dense(mask, bias, q, k, v)
    scale = 0.3
    want = explicit(q, k, v, keep, add, scale=scale, cap=CAP)
    got = attnlab.attention(q, k, v, mask=mask, bias=bias, scale=scale, softcap=CAP)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    uncapped = attnlab.attention(q, k, v, mask=mask, bias=bias, scale=scale, backend="reference")
    assert (got - uncapped).abs().max() > 0.1  # these inputs exercise the cap
    # a huge cap is the identity up to rounding: tanh(x)·c → x
    big = attnlab.attention(q, k, v, mask=mask, bias=bias, scale=scale, softcap=1e9)
    torch.testing.assert_close(big, uncapped, atol=1e-9, rtol=0)


def test_softcap_logits_values_and_derivative():
    s = torch.tensor(
        [-1e6, -3.0, -0.0, 0.0, 0.5, 3.0, 1e6], dtype=torch.float64, requires_grad=True
    )
    y = reference.softcap_logits(s, 2.0)
    torch.testing.assert_close(y, 2.0 * torch.tanh(s / 2.0))
    assert float(y.detach().abs().max()) <= 2.0 and float(y.detach()[2]) == 0.0
    (g,) = torch.autograd.grad(y.sum(), s)
    torch.testing.assert_close(g, 1 - torch.tanh(s / 2.0) ** 2)
    assert reference.softcap_logits(s, None) is s


# --------------------------------------------------------------------------- backends vs reference
SLOW = pytest.mark.slow
FLASH64_CASES = [
    "causal",
    "window",
    "documents",
    "padding",
    "causal_bias",
    pytest.param("none", marks=SLOW),
    pytest.param("window_bias", marks=SLOW),
]


@pytest.mark.parametrize("name", FLASH64_CASES)
def test_flash_float64_forward_and_backward_match_reference(name):
    """Small tiles so every case runs several tiles, merges and band calls."""
    mask, bias = mask_cases()[name]
    q, k, v = qkv()

    def tiled(q, k, v):
        return flash_attention(
            q, k, v, mask=mask, bias=bias, softcap=CAP, block_q=16, block_k=16, band_block=8
        )[0]

    check_against_reference(tiled, reference_for(mask, bias, softcap=CAP), [q, k, v])


def test_flash_default_tiles_through_attention_float64():
    mask, bias = mask_cases()["window_bias"]
    q, k, v = qkv()

    def default(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, bias=bias, softcap=CAP, backend="flash")

    check_against_reference(default, reference_for(mask, bias, softcap=CAP), [q, k, v])


def test_flash_cosine_temperature_negative_scale_match_reference():
    """The cap acts on ``score · scale / T`` whatever the score, sign or temperature."""
    mask = masks.sliding_window(12, causal=False)
    q, k, v = qkv(b=1, l=29, s=29, spread=1.0)
    kw = {"score": "cosine", "temperature": 0.5, "scale": -3.0, "softcap": CAP}

    def impl(q, k, v):
        return flash_attention(q, k, v, mask=mask, block_q=8, block_k=8, band_block=4, **kw)[0]

    check_against_reference(impl, reference_for(mask, None, **kw), [q, k, v])
    plain = attnlab.attention(q, k, v, mask=mask, **{**kw, "softcap": None})
    assert (impl(q, k, v) - plain).abs().max() > 0.05  # |logits| reach 6 > CAP


def test_flash_bias_gradient_and_lse_match_reference():
    """The bias is added after the cap: its gradient is dS, not dS·(1 − tanh²)."""
    mask, bias = mask_cases()["causal_bias"]
    q, k, v = qkv()
    bias = bias.clone()

    def run(backend):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
        out, lse = attnlab.attention(
            xs[0],
            xs[1],
            xs[2],
            mask=mask,
            bias=xs[3],
            softcap=CAP,
            backend=backend,
            return_lse=True,
        )
        dout = seeded(*out.shape, seed=5)
        grads = torch.autograd.grad((out * dout).sum() + lse.sum(), xs)
        return out, lse, grads

    out_f, lse_f, g_f = run("flash")
    out_r, lse_r, g_r = run("reference")
    torch.testing.assert_close(out_f, out_r, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse_f, lse_r, atol=1e-12, rtol=1e-10)
    for a, b in zip(g_f, g_r, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize(
    "dtype,name",
    [
        (torch.float32, "causal_bias"),
        (torch.bfloat16, "documents"),
        pytest.param(torch.float32, "window", marks=SLOW),
        pytest.param(torch.bfloat16, "causal_bias", marks=SLOW),
        pytest.param(torch.float32, "documents", marks=SLOW),
        pytest.param(torch.bfloat16, "window", marks=SLOW),
    ],
)
def test_flash_low_precision_tolerance_rule(dtype, name):
    mask, bias = mask_cases()[name]
    q, k, v = qkv(dtype)

    def impl(q, k, v):
        b = None if bias is None else bias.to(q.dtype)
        return attnlab.attention(q, k, v, mask=mask, bias=b, softcap=CAP, backend="flash")

    mean = 10.0 if dtype == torch.float32 else None
    check_against_reference(
        impl, reference_for(mask, bias, softcap=CAP), [q, k, v], mean_factor=mean
    )


def test_flash_gradcheck_float64_tiny():
    q, k, v = qkv(b=1, h=2, h_kv=1, l=7, s=9, d=3, dv=2, spread=2.0)
    mask = masks.sliding_window(4)

    def f(q, k, v):
        out, lse = flash_attention(
            q, k, v, mask=mask, softcap=0.7, block_q=3, block_k=2, band_block=2
        )
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    inputs = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    assert torch.autograd.gradcheck(f, inputs, atol=1e-8, rtol=1e-5, eps=1e-6)


@pytest.mark.parametrize(
    "dtype,mask",
    [
        (torch.float64, masks.padding([600, 311])),
        (torch.float32, None),
        (torch.bfloat16, masks.causal()),
    ],
    ids=repr,
)
def test_decode_supports_softcap(dtype, mask):
    q, k, v = qkv(dtype, l=1, s=600)
    assert attnlab.explain(q, k, v, mask=mask, softcap=CAP).backend == "decode"
    with torch.no_grad():
        out, lse = attnlab.attention(
            q, k, v, mask=mask, softcap=CAP, backend="decode", return_lse=True
        )
    keep, _ = dense(mask, None, q, k, v)
    golden, _ = reference.attention(
        *(x.double() for x in (q, k, v)), mask=keep, softcap=CAP, compute_dtype=torch.float64
    )
    naive, _ = reference.attention(
        q, k, v, mask=keep, softcap=CAP, compute_dtype=dtype, reorder=True
    )
    assert_close_rule(out, golden, naive)
    golden_lse = reference.logsumexp(q.double(), k.double(), mask=keep, softcap=CAP)
    naive_lse = reference.logsumexp(q, k, mask=keep, softcap=CAP)  # float32+ like decode
    assert_close_rule(lse, golden_lse, naive_lse, name="lse")


HOLES = torch.arange(600) % 7 != 3  # a key mask with holes: the C++ step gathers its keys


@pytest.mark.parametrize(
    "dtype,mask",
    [
        (torch.float32, None),
        (torch.bfloat16, masks.causal() & masks.padding([600, 311])),
        (torch.float32, masks.from_tensor(HOLES.view(1, 1, 1, 600))),
        (torch.float64, masks.padding([600, 311])),
    ],
    ids=repr,
)
def test_decode_cpp_step_soft_caps(dtype, mask):
    """Without lse the decode step runs on attnlab's C++ kernel with soft-capping (the
    vectorised `tanh_f`; `explain` says so) and follows the rule against the float64 reference;
    an infinite logit still makes its row NaN (tanh would turn it into ±softcap), another row
    keeps its value."""
    from attnlab.functional import nan_rule

    q, k, v = qkv(dtype, l=1, s=600)
    if not nan_rule.ext_ready(q, k, v):
        pytest.skip("attnlab's C++ kernels are not built here")
    assert "C++ decode kernel" in attnlab.explain(q, k, v, mask=mask, softcap=CAP).engines[0]
    with torch.no_grad():
        out = attnlab.attention(q, k, v, mask=mask, softcap=CAP, backend="decode")
    keep, _ = dense(mask, None, q, k, v)
    golden, _ = reference.attention(
        *(x.double() for x in (q, k, v)), mask=keep, softcap=CAP, compute_dtype=torch.float64
    )
    naive, _ = reference.attention(
        q, k, v, mask=keep, softcap=CAP, compute_dtype=dtype, reorder=True
    )
    assert_close_rule(out, golden, naive)
    k = k.clone()
    k[0, 0, 5, 0] = float("inf")  # attended by every row of item 0's first two heads
    with torch.no_grad():
        poisoned = attnlab.attention(q, k, v, mask=mask, softcap=CAP, backend="decode")
    assert poisoned[0, : H // H_KV].isnan().all() and not poisoned[1].isnan().any()


# --------------------------------------------------------------------------- transformers' gemma2
@pytest.mark.parametrize("window", [None, 11])
def test_equals_transformers_gemma2_eager_attention(window):
    """transformers' gemma2 ``eager_attention_forward`` on the same q, k, v: scaling, then
    ``tanh(s / softcap)·softcap``, then its additive causal/padding (or sliding-window) mask."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    Lq = 41
    q, k, v = qkv(torch.float32, l=Lq, s=Lq)
    lengths = [Lq, 35]  # every row keeps a key (HF spreads an all-masked row uniformly)
    mask = masks.causal() if window is None else masks.sliding_window(window)
    mask = mask & masks.padding(lengths)
    keep, _ = dense(mask, None, q, k, v)
    keep = keep.expand(B, 1, Lq, Lq)  # HF's (B, 1, L, S) additive mask: min where masked
    hf_mask = torch.zeros(B, 1, Lq, Lq).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(head_dim=D, num_key_value_groups=H // H_KV, training=False)
    scaling, cap = 0.2, 4.0
    hf_out, hf_w = gemma2.eager_attention_forward(
        module, q, k, v, hf_mask, dropout=0.0, scaling=scaling, softcap=cap
    )
    hf_out = hf_out.transpose(1, 2)  # HF returns (B, L, H, D)
    golden = attnlab.attention(
        q.double(),
        k.double(),
        v.double(),
        mask=mask,
        scale=scaling,
        softcap=cap,
        backend="reference",
    )
    uncapped = attnlab.attention(q.double(), k.double(), v.double(), mask=mask, scale=scaling)
    assert (golden - uncapped).abs().max() > 0.05  # the comparison sees the cap
    naive, _ = reference.attention(
        q, k, v, mask=keep, scale=scaling, softcap=cap, compute_dtype=torch.float32, reorder=True
    )
    assert_close_rule(hf_out, golden, naive, name="transformers gemma2 eager")
    for backend in ("flash", "reference"):
        ours = attnlab.attention(q, k, v, mask=mask, scale=scaling, softcap=cap, backend=backend)
        assert_close_rule(ours, golden, naive, name=backend, mean_factor=10.0)
    _, w = attnlab.attention(q, k, v, mask=mask, scale=scaling, softcap=cap, return_weights=True)
    _, golden_w = reference.attention(
        q.double(), k.double(), v.double(), mask=keep, scale=scaling, softcap=cap
    )
    _, naive_w = reference.attention(
        q, k, v, mask=keep, scale=scaling, softcap=cap, compute_dtype=torch.float32, reorder=True
    )
    assert_close_rule(hf_w, golden_w, naive_w, name="transformers gemma2 eager weights")
    assert_close_rule(w, golden_w, naive_w, name="weights")


# --------------------------------------------------------------------------- dispatch, errors
def test_sdpa_declines_and_explain_says_why():
    q, k, v = qkv(torch.float32)
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run.*soft-capping.*softcap=2.5"):
        attnlab.attention(q, k, v, softcap=CAP, backend="sdpa")
    why = attnlab.explain(q, k, v, mask=masks.causal(), softcap=CAP)
    assert why.backend == "flash", why
    assert "not 'sdpa': torch's scaled_dot_product_attention has no logit soft-capping" in (
        why.reason
    )
    # no gradient: attnlab's C++ kernels soft-cap in their forward; with one, the torch engine
    assert "soft-capped logits on attnlab's C++ kernels" in why.plan or not _cpp_ready()
    grad = attnlab.explain(q.requires_grad_(), k, v, mask=masks.causal(), softcap=CAP)
    assert "soft-capped logits on the pure-PyTorch tile engine" in grad.plan
    q.requires_grad_(False)
    # without softcap the same call goes to sdpa: the cap alone changed the choice
    assert attnlab.explain(q, k, v, mask=masks.causal()).backend == "sdpa"
    with pytest.raises(ValueError, match=r"engine='kernel' cannot soft-cap"):
        flash_attention(q, k, v, softcap=CAP, engine="kernel")


def test_a_backend_that_does_not_declare_softcap_never_sees_it(monkeypatch):
    """A backend registered without ``softcap=True`` would silently drop the cap: it is refused."""
    from attnlab.functional import registry

    seen = []

    def plain(req):
        seen.append(req)
        return registry.get_backend("reference").run(req)

    monkeypatch.setitem(
        registry._BACKENDS, "plain", registry.Backend("plain", plain, lambda r: None, "no cap")
    )
    monkeypatch.setattr(registry, "_AUTO_ORDER", ["plain", *registry._AUTO_ORDER])
    q, k, v = qkv(torch.float32, l=5, s=6)
    with pytest.raises(ValueError, match=r"'plain' cannot run.*does not implement logit soft-cap"):
        attnlab.attention(q, k, v, softcap=CAP, backend="plain")
    why = attnlab.explain(q, k, v, softcap=CAP)
    assert "not 'plain': it does not implement logit soft-capping (softcap=2.5)" in why.reason
    assert why.backend != "plain"
    assert attnlab.explain(q, k, v).backend == "plain"  # without a cap it runs
    assert not seen


@pytest.mark.parametrize(
    "bad,err,match",
    [
        (0.0, ValueError, r"softcap must be > 0, got 0.0"),
        (-1.0, ValueError, r"softcap must be > 0, got -1.0"),
        (float("nan"), ValueError, r"softcap must be finite, got nan"),
        (float("inf"), ValueError, r"softcap must be finite, got inf"),
        (1e-300, ValueError, r"softcap must lie in \[.*\] for torch.float32 inputs.*got 1e-300"),
        (1e300, ValueError, r"softcap must lie in \[.*\] for torch.float32 inputs.*got 1e\+300"),
        (True, TypeError, r"softcap must be a real number, got bool True"),
        ("2", TypeError, r"softcap must be a real number, got str '2'"),
        (torch.tensor(2.0), TypeError, r"softcap must be a real number, got Tensor"),
    ],
)
def test_bad_softcap_refused_before_any_work(bad, err, match):
    q, k, v = qkv(torch.float32, l=5, s=6)
    calls = []

    def bias(b, h, i, j):  # would record any evaluation
        calls.append(1)
        return (i - j).float()

    with pytest.raises(err, match=match):
        attnlab.attention(q, k, v, bias=bias, softcap=bad)
    with pytest.raises(err, match=match):
        attnlab.attention_weights(q, k, torch.zeros(B, H, 5), softcap=bad)
    with pytest.raises(err, match=match):
        attnlab.attention_stats(q, k, v, bias=bias, softcap=bad)
    with pytest.raises(err, match=match):
        flash_attention(q, k, v, softcap=bad)
    assert not calls
    # float64 inputs accept what float32 cannot hold
    attnlab.attention(q.double(), k.double(), v.double(), softcap=1e-300)


# ------------------------------------------------------ attnlab's C++ kernels (no gradient)
KERNEL_CASES = {  # name -> (mask, L = S): plans whose every call is attnlab's C++ kernel
    "causal, one segment": (masks.causal(), 301),
    "full, one segment": (None, 257),
    "window, band calls": (masks.sliding_window(96), 700),  # + an edge call (torch engine)
}


def _on_cpp_kernel(q, k, v, mask) -> bool:
    why = attnlab.explain(q, k, v, mask=mask, softcap=CAP)
    capped = why.plan is not None and "soft-capped logits on attnlab's C++ kernels" in why.plan
    return capped and "C++ band kernel" in "; ".join(why.engines)


def _cpp_ready() -> bool:
    from attnlab.functional.flash import band_kernel

    return band_kernel.ready(torch.zeros(1, 1, 64, 64))


@pytest.fixture
def cpp_kernels():
    if not _cpp_ready():
        pytest.skip("attnlab's C++ band kernel does not run here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_cpp_kernels_soft_cap_without_gradient(cpp_kernels, dtype, name):
    """Without gradient, soft-capped calls whose every call is attnlab's C++ kernel (Gemma 2's
    causal and sliding-window layers) run there — the tanh applied to each score row before the
    mask — and follow the tolerance rule against the float64 reference (GQA, odd lengths)."""
    mask, n = KERNEL_CASES[name]
    n += n % 2 if dtype == torch.bfloat16 else 0  # bfloat16 pairs: segments of even length
    q, k, v = qkv(dtype, l=n, s=n, d=64, dv=64, b=2)

    def impl(q, k, v):
        with torch.no_grad():
            return attnlab.attention(q, k, v, mask=mask, softcap=CAP)

    with torch.no_grad():
        assert _on_cpp_kernel(q, k, v, mask), attnlab.explain(q, k, v, mask=mask, softcap=CAP)
    check_against_reference(impl, reference_for(mask, None, softcap=CAP), [q, k, v], grads=False)


def test_with_gradient_soft_capping_stays_on_the_torch_engine(cpp_kernels):
    """The C++ backward has no tanh stage: a call that needs gradients runs the pure-PyTorch
    engine (its gradients are checked above), the same call without them attnlab's kernel."""
    q, k, v = qkv(torch.float32, l=301, s=301, d=64, dv=64)
    assert "pure-PyTorch" in str(
        attnlab.explain(q.requires_grad_(), k, v, mask=masks.causal(), softcap=CAP)
    )
    with torch.no_grad():
        assert _on_cpp_kernel(q, k, v, masks.causal())


def test_nan_rule_with_softcap_on_the_cpp_kernel(cpp_kernels):
    """The NaN rule on the kernel path: a non-finite k_j poisons exactly the rows that attend j
    (causal: rows >= j), a non-finite v_j[d] only column d of them, whatever tanh(±inf) is."""
    q, k, v = qkv(torch.float32, l=300, s=300, d=64, dv=64)
    k[:, 0, 200, 3] = float("inf")
    v[:, 1, 100, 2] = float("nan")
    with torch.no_grad():
        assert _on_cpp_kernel(q, k, v, masks.causal())
        out = attnlab.attention(q, k, v, mask=masks.causal(), softcap=CAP)
    want = torch.zeros_like(out, dtype=torch.bool)
    want[:, :2, 200:] = True  # query heads 0, 1 share k/v head 0
    want[:, 2:, 100:, 2] = True
    assert torch.equal(out.isnan() | out.isinf(), want)


# --------------------------------------------------------------------------- NaN rule, stats
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["flash", "reference", "decode"])
def test_nan_rule_with_softcap(backend, value):
    """A non-finite k_j poisons exactly the rows that attend j, even though tanh(±inf) = ±1;
    a non-finite v_j[d] only column d of those rows; other documents stay exact."""
    if backend == "decode":
        q, k, v = qkv(torch.float32, l=1, s=600)
        mask, j, grad = masks.padding([600, 300]), 400, False  # item 1 never attends key 400
    else:
        q, k, v = qkv(torch.float32)
        mask, j, grad = masks.causal() & masks.document.from_lengths([20, 33]), 30, True
    k[:, 0, j, 3] = value
    v[:, 1, j, 2] = value
    keep, _ = dense(mask, None, q, k, v)
    want, _ = reference.attention(q.double(), k.double(), v.double(), mask=keep, softcap=CAP)
    clean, _ = reference.attention(
        q.double(),
        k.nan_to_num(0, 0, 0).double(),
        v.nan_to_num(0, 0, 0).double(),
        mask=keep,
        softcap=CAP,
    )
    xs = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    with torch.set_grad_enabled(grad):
        out = attnlab.attention(*xs, mask=mask, softcap=CAP, backend=backend)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), finite)
    # the rows poisoned: exactly those that attend j (heads 0, 1 of k/v group 0; group 1: col 2)
    attends = keep.expand(B, H, out.shape[2], k.shape[2])[..., j]  # (B, H, L)
    assert torch.equal(~finite[:, :2].all(-1), attends[:, :2])
    assert torch.equal(~finite[:, 2:, :, 2], attends[:, 2:])
    assert bool(finite[:, 2:, :, [0, 1, 3]].all())
    torch.testing.assert_close(out[finite].double(), clean[finite], atol=2e-6, rtol=1e-5)
    if grad:
        dout = torch.ones_like(out)
        grads = torch.autograd.grad(out, xs, dout)
        assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_weights_and_stats_use_the_capped_logits():
    mask, bias = mask_cases()["window_bias"]
    q, k, v = qkv()
    _, lse = attnlab.attention(
        q, k, v, mask=mask, bias=bias, softcap=CAP, backend="flash", return_lse=True
    )
    keep, add = dense(mask, bias, q, k, v)
    torch.testing.assert_close(
        lse, reference.logsumexp(q, k, mask=keep, bias=add, softcap=CAP), atol=1e-12, rtol=0
    )
    _, w_ref = attnlab.attention(q, k, v, mask=mask, bias=bias, softcap=CAP, return_weights=True)
    w = attnlab.attention_weights(q, k, lse, rows=[0, 17, 36], mask=mask, bias=bias, softcap=CAP)
    torch.testing.assert_close(w, w_ref[:, :, [0, 17, 36]], atol=1e-13, rtol=0)
    st = attnlab.attention_stats(q, k, v, mask=mask, bias=bias, softcap=CAP)
    p = w_ref
    ent = -(torch.where(p > 0, p * p.log(), 0.0)).sum(-1)
    torch.testing.assert_close(st.entropy, ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(st.max_weight, p.amax(-1), atol=1e-13, rtol=0)
    uncapped = attnlab.attention_stats(q, k, v, mask=mask, bias=bias)
    assert (uncapped.entropy - st.entropy).abs().max() > 0.05


# --------------------------------------------------------------------------- compile, meta
def test_compile_fullgraph_forward_backward():
    """Auto picks flash (sdpa cannot cap); compiled, flash runs as custom operators."""
    q, k, v = (x.float().requires_grad_(True) for x in qkv(torch.float32, l=33, s=33))
    k.data[1, 0, 30, 3] = float("nan")  # the NaN rule holds in the compiled graph too
    mask = masks.causal() & masks.document.from_lengths([10, 23])

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=mask, softcap=CAP)

    assert attnlab.explain(q, k, v, mask=mask, softcap=CAP).backend == "flash"
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True)(q, k, v)  # raises on a break
    got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    want_out = f(q, k, v)
    want = torch.autograd.grad(want_out, (q, k, v), torch.ones_like(out))
    torch._dynamo.reset()
    # k/v head 0 of item 1: key 30 reaches rows 30… of its document only (causal)
    assert bool(torch.isnan(out[1, :2, 30:]).all()) and bool(torch.isfinite(out[1, :, :30]).all())
    torch.testing.assert_close(out, want_out, equal_nan=True, atol=1e-6, rtol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    plain = attnlab.attention(q.detach(), k.detach(), v.detach(), mask=mask, backend="reference")
    assert (plain - want_out.detach()).nan_to_num().abs().max() > 0.05  # the graph ran the cap


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_meta_tensors(backend):
    q = torch.empty(2, 4, 9, 16, device="meta")
    k = torch.empty(2, 2, 9, 16, device="meta")
    v = torch.empty(2, 2, 9, 8, device="meta")
    out, lse = attnlab.attention(
        q, k, v, mask=masks.causal(), softcap=CAP, backend=backend, return_lse=True
    )
    assert out.shape == (2, 4, 9, 8) and out.is_meta and lse.shape == (2, 4, 9)
