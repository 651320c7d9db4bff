"""`varlen_attn` (torch's packed variable-length API, paged KV) and `masks.window`.

The independent reference is flash-attn's test reference written from its documented behaviour
(``tests/test_flash_attn.py``: ``construct_local_mask`` and ``attention_ref``, with
``flash_api.cpp``'s normalisation of a one-sided window: −1 becomes ``seqlen_k``), run per
sequence; torch's math SDPA on a padded batch is the second one.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab import masks
from attnlab.functional import varlen
from attnlab.functional.varlen import AuxRequest, reference_varlen_attn, varlen_attn
from helpers import assert_close_rule, mean_factor_for


# ---------------------------------------------------------------- flash-attn's reference
def construct_local_mask(seqlen_q, seqlen_k, window_size):
    """flash-attn's local mask, True = masked: query i sits at key ``i + sk − sq``.

    A −1 side is unbounded (the brief's and torch's docstring's meaning). flash-attn's
    ``flash_api.cpp`` replaces it by ``max_seqlen_k`` when the other side is bounded: the same on
    every row within ``max_seqlen_k`` queries of its sequence's last one, so for ``L_q <= L_k + 1``
    (its own tests' shapes); the stand-in here, ``sq + sk``, is unbounded on every row.
    """
    left, right = window_size
    if left < 0 and right < 0:
        return torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    left = seqlen_q + seqlen_k if left < 0 else left
    right = seqlen_q + seqlen_k if right < 0 else right
    row = torch.arange(seqlen_q).view(-1, 1)
    col = torch.arange(seqlen_k)
    sk, sq = seqlen_k, seqlen_q
    return (col > torch.clamp(row + sk - sq + right, max=sk)) | (col < row + sk - sq - left)


def attention_ref(q, k, v, window_size, scale):
    """flash-attn's ``attention_ref`` for one sequence: q ``(sq, H, D)``, k/v ``(sk, H_kv, D)``;
    rows with every key masked give 0."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    local = construct_local_mask(q.shape[0], k.shape[0], window_size)
    scores = scores.masked_fill(local, float("-inf"))
    attn = torch.softmax(scores, dim=-1).masked_fill(local.all(-1, keepdim=True), 0.0)
    return torch.einsum("hts,shd->thd", attn, v)


def flash_ref(q, k, v, cu_q, cu_k, window_size, scale=None):
    """flash-attn's reference over the packed sequences (in the inputs' dtype)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if k1 == k0:
            outs.append(q.new_zeros(q1 - q0, q.shape[1], v.shape[-1]))
            continue
        outs.append(attention_ref(q[q0:q1], k[k0:k1], v[k0:k1], window_size, scale))
    return torch.cat(outs)


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _check(q, k, v, cu_q, cu_k, window, *, gqa=False, scale=None):
    """varlen_attn against flash-attn's reference under the tolerance rule, forward and grads."""
    max_q, max_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attn(
        *xs, cu_q, cu_k, max_q, max_k, window_size=window, enable_gqa=gqa, scale=scale
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    refs = {}
    for name, dtype in (("golden", torch.float64), ("naive", q.dtype)):
        rs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        ro = flash_ref(*rs, cu_q, cu_k, window, scale)
        ro.backward(dout.to(dtype))
        refs[name] = (ro, *(r.grad for r in rs))
    mf = mean_factor_for("flash", q.dtype)  # the tiled backend's float32 rule
    assert_close_rule(out, refs["golden"][0], refs["naive"][0], name="out", mean_factor=mf)
    for i, name in enumerate(("dq", "dk", "dv"), start=1):
        g, gold, naive = xs[i - 1].grad, refs["golden"][i], refs["naive"][i]
        assert_close_rule(g, gold, naive, kind="grad", name=name, mean_factor=mf)
    return out


# (0, 0) leaves one key per row: dq is exactly 0 there, a tolerance rule without a floor
WINDOWS = [(-1, -1), (-1, 0), (1, 0), (5, 3), (16, -1), (-1, 7)]
DEFAULT = {((-1, 0), 59), ((5, 3), 59), ((16, -1), 8)}
GRID = [
    pytest.param(w, D, marks=() if (w, D) in DEFAULT else pytest.mark.slow)
    for D in (8, 59, 128)
    for w in WINDOWS
]


@pytest.mark.parametrize(("window", "D"), GRID)
def test_matches_flash_attn_reference(window, D):
    # cross-attention lengths: L_q > L_k (leading rows see no key under a causal window),
    # L_q < L_k, an empty key sequence, an empty query sequence, odd sizes
    torch.manual_seed(D)
    lq, lk = [17, 1, 113, 4, 0, 40], [5, 97, 113, 0, 3, 41]
    cu_q, cu_k = _cu(lq), _cu(lk)
    q = torch.randn(sum(lq), 4, D)
    k, v = torch.randn(2, sum(lk), 4, D).unbind(0)
    _check(q, k, v, cu_q, cu_k, window)


SELF = [
    pytest.param(w, dt, marks=() if (w, dt) in {((-1, 0), bf), ((4, 9), f32)} else pytest.mark.slow)
    for bf, f32 in [(torch.bfloat16, torch.float32)]
    for w in [(-1, 0), (-1, -1), (31, 0), (4, 9)]
    for dt in (f32, bf)
]


@pytest.mark.parametrize(("window", "dtype"), SELF)
def test_self_packing_one_call(window, dtype):
    # cu_seq_q == cu_seq_k: one call with documents & window (segment calls when causal/full)
    torch.manual_seed(1)
    lengths = [97, 1, 17, 113, 17, 64]
    cu = _cu(lengths)
    q, k, v = torch.randn(3, sum(lengths), 4, 40, dtype=dtype).unbind(0)
    _check(q, k, v, cu, cu, window)


def test_gqa_and_scale():
    torch.manual_seed(2)
    lq, lk = [17, 33], [40, 33]
    q = torch.randn(sum(lq), 6, 16)
    k, v = torch.randn(2, sum(lk), 2, 16).unbind(0)
    _check(q, k, v, _cu(lq), _cu(lk), (8, 0), gqa=True, scale=0.3)


def test_lse_layout_and_values():
    torch.manual_seed(3)
    lq, lk = [5, 4, 9], [3, 0, 9]
    q = torch.randn(sum(lq), 2, 8)
    k, v = torch.randn(2, sum(lk), 2, 8).unbind(0)
    out, lse = varlen_attn(
        q, k, v, _cu(lq), _cu(lk), 9, 9, window_size=(-1, 0), return_aux=AuxRequest(lse=True)
    )
    assert lse.shape == (2, sum(lq)) and lse.dtype == torch.float32  # torch's (H, T_q)
    _, golden = reference_varlen_attn(
        q.double(), k.double(), v.double(), _cu(lq), _cu(lk), window_size=(-1, 0)
    )
    dead = torch.isneginf(golden)
    # L_q = 5 > L_k = 3 under causal: 2 rows see no key; the empty key sequence: 4 rows
    assert int(dead[0].sum()) == 2 + 4
    assert torch.equal(torch.isneginf(lse), dead)
    assert (out[dead[0]] == 0).all()
    torch.testing.assert_close(lse[~dead].double(), golden[~dead], atol=1e-5, rtol=1e-5)
    # torch's own AuxRequest works too
    import torch.nn.attention.varlen as tv

    torch_aux = tv.AuxRequest(lse=True)
    assert len(varlen_attn(q, k, v, _cu(lq), _cu(lk), 9, 9, return_aux=torch_aux)) == 2


def test_against_torch_math_sdpa_on_a_padded_batch():
    torch.manual_seed(4)
    lengths = [17, 97, 1, 64]
    N, M, H, D = len(lengths), max(lengths), 2, 24
    cu = _cu(lengths)
    q, k, v = (torch.randn(sum(lengths), H, D, dtype=torch.float64) for _ in range(3))
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attn(*xs, cu, cu, M, M, window_size=(-1, 0))
    dout = torch.randn_like(out)
    out.backward(dout)
    pads = []
    for x in (q, k, v):
        p = x.new_zeros(N, M, H, D)
        for b in range(N):
            p[b, : lengths[b]] = x[cu[b] : cu[b + 1]]
        pads.append(p.transpose(1, 2).requires_grad_())  # (N, H, M, D)
    real = torch.arange(M) < torch.tensor(lengths).view(-1, 1)  # (N, M)
    mask = torch.ones(M, M, dtype=torch.bool).tril() & real[:, None, None, :]
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*pads, attn_mask=mask)
    dpad = torch.zeros_like(ref)
    for b in range(N):
        dpad[b, :, : lengths[b]] = dout[cu[b] : cu[b + 1]].transpose(0, 1)
    ref.backward(dpad)
    for b in range(N):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n = lengths[b]
        torch.testing.assert_close(out[rows], ref[b, :, :n].transpose(0, 1))
        for x, p in zip(xs, pads, strict=True):
            torch.testing.assert_close(x.grad[rows], p.grad[b, :, :n].transpose(0, 1))


def _pages(rng_seed=5, dtype=torch.float32):
    torch.manual_seed(rng_seed)
    page, H, D = 4, 2, 16
    pool_k, pool_v = torch.randn(2, 10, page, H, D, dtype=dtype).unbind(0)
    # page 0 shared by sequences 0 and 2 (a common prefix); sequence 1 uses no key
    table = torch.tensor([[0, 7, 3], [9, 9, 9], [0, 1, 5]], dtype=torch.int32)
    used = torch.tensor([9, 0, 11], dtype=torch.int32)
    lq = [2, 3, 11]
    q = torch.randn(sum(lq), H, D, dtype=dtype)
    return q, pool_k, pool_v, table, used, _cu(lq)


def _gathered(pool, table, used):
    page = pool.shape[1]
    rows = [
        pool[table[b, : -(-int(n) // page)].long()].flatten(0, 1)[: int(n)]
        for b, n in enumerate(used)
    ]
    return torch.cat(rows)


@pytest.mark.parametrize("window", [(-1, 0), (2, 1)])
def test_block_table_equals_the_gathered_dense_form(window):
    q, pool_k, pool_v, table, used, cu_q = _pages()
    cu_k = _cu(used.tolist())
    ks = [x.clone().requires_grad_() for x in (q, pool_k, pool_v)]
    out, lse = varlen_attn(
        *ks,
        cu_q,
        None,
        11,
        11,
        window_size=window,
        seqused_k=used,
        block_table=table,
        return_aux=AuxRequest(lse=True),
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    # the dense form: gather by hand, then plain varlen (autograd carries the gather back)
    ds = [x.clone().requires_grad_() for x in (q, pool_k, pool_v)]
    dk, dv = _gathered(ds[1], table, used), _gathered(ds[2], table, used)
    ref, ref_lse = varlen_attn(
        ds[0], dk, dv, cu_q, cu_k, 11, 11, window_size=window, return_aux=AuxRequest(lse=True)
    )
    ref.backward(dout)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    for a, b in zip(ks, ds, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert ks[1].grad[0].abs().sum() > 0 and ks[1].grad[2].abs().sum() == 0  # page 2: unused


def test_seqused_k_equals_sliced_keys():
    torch.manual_seed(6)
    lq, lk, used = [3, 17], [20, 30], [7, 29]
    q = torch.randn(sum(lq), 2, 8)
    k, v = torch.randn(2, sum(lk), 2, 8).unbind(0)
    u = torch.tensor(used, dtype=torch.int32)
    out = varlen_attn(q, k, v, _cu(lq), _cu(lk), 17, 30, window_size=(-1, 0), seqused_k=u)
    keep = torch.cat([torch.arange(0, 7), torch.arange(20, 49)])
    ref = flash_ref(q.double(), k[keep].double(), v[keep].double(), _cu(lq), _cu(used), (-1, 0))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cross", [False, True])
def test_nan_stays_in_its_sequence(cross):
    # self packing (documents) and cross packing (intervals): the NaN rule per sequence
    torch.manual_seed(7)
    lengths = [17, 40, 9]
    cu = _cu(lengths)
    cu_k = _cu([17, 40, 12]) if cross else cu
    q = torch.randn(sum(lengths), 2, 8)
    k, v = torch.randn(2, int(cu_k[-1]), 2, 8).unbind(0)
    k[20, 1, 3] = float("nan")  # sequence 1, head 1
    out = varlen_attn(q, k, v, cu, cu_k, 40, 40, window_size=(-1, 0))
    assert torch.isfinite(out[:17]).all() and torch.isfinite(out[57:]).all()
    assert torch.isnan(out[20:57, 1]).all() and torch.isfinite(out[17:20]).all()


def test_compiles_fullgraph_with_inductor():
    torch.manual_seed(8)
    cu = torch.tensor([0, 33, 130, 131], dtype=torch.int32)
    q, k, v = torch.randn(3, 131, 4, 16).unbind(0)

    def f(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 97, 97, window_size=(7, 0))

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    a, b = q.clone().requires_grad_(), q.clone().requires_grad_()
    out = compiled(a, k, v, cu)
    out.sum().backward()
    ref = f(b, k, v, cu)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a.grad, b.grad)


def test_meta_tensors_give_shapes_without_values():
    q, k, v = torch.empty(3, 50, 4, 16, device="meta").unbind(0)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = varlen_attn(q, k, v, cu, cu, 20, 20, return_aux=AuxRequest(lse=True))
    assert out.shape == (50, 4, 16) and lse.shape == (4, 50) and out.device.type == "meta"


def test_enable_routes_torch_varlen_on_cpu_and_is_reversible():
    import torch.nn.attention.varlen as tv

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = torch.randn(3, 12, 2, 8).unbind(0)
    original = tv.varlen_attn
    with pytest.raises(Exception, match=r"CPU|flash|not"):  # torch's own kernel is CUDA-only
        original(q, k, v, cu, cu, 7, 7)
    with varlen.enable():
        assert varlen.enabled()
        out = tv.varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0))
        torch.testing.assert_close(out, varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0)))
        buf = torch.empty_like(q)
        tv.varlen_attn_out(buf, q, k, v, cu, cu, 7, 7)
        torch.testing.assert_close(buf, varlen_attn(q, k, v, cu, cu, 7, 7))
    assert tv.varlen_attn is original and not varlen.enabled()
    varlen.enable()
    varlen.enable()  # idempotent
    varlen.disable()
    assert tv.varlen_attn is original


# ---------------------------------------------------------------- bad input
def _args():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = torch.randn(3, 12, 2, 8).unbind(0)
    return [q, k, v, cu, cu, 7, 7], {}


def _bad(i=None, value=None, **kw):
    args, kwargs = _args()
    if i is not None:
        args[i] = value
    kwargs.update(kw)
    return args, kwargs


BAD = [
    (_bad(0, torch.randn(12, 16)), "query must be \\(T_q, H, D\\), got shape \\(12, 16\\)"),
    (_bad(1, torch.randn(12, 2, 9)), "key must match query's head dim"),
    (_bad(1, torch.randn(12, 2, 9)), "key must match query's head dim"),
    (_bad(3, torch.tensor([0, 5, 11], dtype=torch.int32)), "cu_seq_q must .* end at T_q=12"),
    (_bad(3, torch.tensor([0, 13, 12])), "cu_seq_q must start at 0, not decrease"),
    (_bad(3, torch.tensor([0.0, 5.0, 12.0])), "cu_seq_q must be int32 or int64"),
    (_bad(4, torch.tensor([0, 12], dtype=torch.int32)), "cu_seq_k must have shape \\(3,\\)"),
    (_bad(5, 6), "a sequence of 7 rows in cu_seq_q exceeds its max \\(6\\)"),
    (_bad(6, -1), "max_k must be an int >= 0, got -1"),
    (_bad(window_size=(-2, 0)), "window_size must be \\(left, right\\) ints >= -1"),
    (_bad(window_size=(3,)), "window_size must be \\(left, right\\)"),
    (_bad(scale=0.0), "scale must be a finite non-zero float"),
    (_bad(num_splits=0), "num_splits must be None or an int >= 1"),
    (_bad(block_table=torch.zeros(2, 2, dtype=torch.int32)), "block_table requires seqused_k"),
    (
        _bad(seqused_k=torch.tensor([6, 3], dtype=torch.int32)),
        "seqused_k\\[0\\] = 6 must be in \\[0, 5\\]",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_names_argument_and_values(bad, message):
    args, kwargs = bad
    with pytest.raises((ValueError, TypeError), match=message):
        varlen_attn(*args, **kwargs)


def test_gqa_needs_enable_gqa():
    args, _ = _args()
    args[1], args[2] = torch.randn(2, 12, 1, 8).unbind(0)
    with pytest.raises(ValueError, match="H=2 heads and key/value H_kv=1: pass enable_gqa=True"):
        varlen_attn(*args)
    varlen_attn(*args, enable_gqa=True)


def test_block_table_page_out_of_range():
    q, pool_k, pool_v, table, used, cu_q = _pages()
    table[2, 1] = 10
    with pytest.raises(ValueError, match=r"block_table\[2\] names pages .*the pool has 10"):
        varlen_attn(q, pool_k, pool_v, cu_q, None, 11, 11, seqused_k=used, block_table=table)


# ---------------------------------------------------------------- masks.window
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (3, 2), (5, -1), (-1, 4)])
@pytest.mark.parametrize(("L", "S"), [(17, 17), (5, 23), (23, 5)])
def test_window_mask_is_flash_attn_local_mask(window, L, S):
    m = masks.window(*window)
    dense = m.to_dense(L, S)[0, 0]
    assert torch.equal(dense, ~construct_local_mask(L, S, window))
    assert m.attended_pairs(L, S) == int(dense.sum())  # exact counts from the closed form
    assert m.band() is not None  # the band kernel runs it
    assert repr(masks.from_spec(*m.spec())) == repr(m)


def test_interval_mask():
    lo, hi = torch.tensor([0, 2, 5, 3]), torch.tensor([1, 4, 5, 7])
    m = masks.IntervalMask(lo, hi, 7)
    dense = m.to_dense(4, 7)[0, 0]
    j = torch.arange(7)
    assert torch.equal(dense, (j >= lo.view(-1, 1)) & (j < hi.view(-1, 1)))
    assert torch.equal(masks.from_spec(*m.spec()).to_dense(4, 7), m.to_dense(4, 7))
    with pytest.raises(ValueError, match="intervals cover L=4 rows and S=7 keys, got L=4, S=8"):
        m.to_dense(4, 8)


def test_window_mask_equals_causal_and_sliding_window():
    for L, S in ((9, 9), (4, 11)):
        assert torch.equal(masks.window(-1, 0).to_dense(L, S), masks.causal().to_dense(L, S))
        assert torch.equal(
            masks.window(3, 0).to_dense(L, S), masks.sliding_window(4).to_dense(L, S)
        )
    with pytest.raises(ValueError, match="left must be >= -1, got -3"):
        masks.window(-3, 0)


def test_window_mask_in_attention_on_the_band_kernel():
    torch.manual_seed(9)
    q, k, v = torch.randn(3, 1, 2, 1025, 40).unbind(0)
    m = masks.window(64, 31)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attnlab.attention(*xs, mask=m, backend="flash")
    out.sum().backward()
    rs = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attnlab.attention(*rs, mask=m.to_dense(1025, 1025), backend="reference")
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(xs, rs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)
    assert "band" in attnlab.explain(q, k, v, mask=m, backend="flash").plan


def test_reference_definition_agrees_with_flash_attn():
    torch.manual_seed(10)
    lq, lk = [7, 3], [4, 9]
    q = torch.randn(sum(lq), 2, 8, dtype=torch.float64)
    k, v = torch.randn(2, sum(lk), 2, 8, dtype=torch.float64).unbind(0)
    out, _ = reference_varlen_attn(q, k, v, _cu(lq), _cu(lk), window_size=(2, 1))
    torch.testing.assert_close(out, flash_ref(q, k, v, _cu(lq), _cu(lk), (2, 1)))


# ---------------------------------------------------------------- memory O(T)
def test_memory_is_o_of_t_not_of_the_longest_sequence_squared():
    """The profiler's memory timeline sees every allocation, inside the custom ops too: packing
    T = 4096 tokens as one sequence or as 16 of 256 grows live tensors by a few times q, far
    below the (H, 4096, 4096) score matrix a padded call would form."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from common import peak_tensor_growth

    T, H, D = 4096, 2, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    growth = {}
    for n in (1, 16):
        cu = torch.arange(0, T + 1, T // n, dtype=torch.int32)
        growth[n] = peak_tensor_growth(
            lambda cu=cu, n=n: varlen_attn(q, k, v, cu, cu, T // n, T // n, window_size=(-1, 0))
        )
    scores = H * T * T * 4
    assert max(growth.values()) <= 8 * q.nbytes, (growth, q.nbytes)
    assert max(growth.values()) < scores / 16, (growth, scores)
    assert growth[1] <= 2 * growth[16] + q.nbytes, growth
