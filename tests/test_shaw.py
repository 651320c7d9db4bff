"""Shaw et al. relative position representations and concatenated position encoding (issue 18)."""

import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import reference
from attnlab.modules.shaw import ShawRelativeAttention
from attnlab.positional import (
    ConcatPositionalEncoding,
    LearnedPositionalEmbedding,
    ShawRelativePositions,
    SinusoidalEmbedding,
    shaw_attention,
)
from helpers import check_against_reference, seeded

F64 = torch.float64


def _inputs(B=2, H=4, H_kv=2, L=5, S=7, D=3, Dv=5, K=2, per_head=False, dtype=F64, seed=0):
    lead = (H,) if per_head else ()
    return [
        seeded(B, H, L, D, dtype=dtype, seed=seed),
        seeded(B, H_kv, S, D, dtype=dtype, seed=seed + 1),
        seeded(B, H_kv, S, Dv, dtype=dtype, seed=seed + 2),
        seeded(*lead, 2 * K + 1, D, dtype=dtype, seed=seed + 3),
        seeded(*lead, 2 * K + 1, Dv, dtype=dtype, seed=seed + 4),
    ]


def _loop(q, k, v, rel_k, rel_v, keep):
    """Shaw et al.'s formula, one pair at a time (float64)."""
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    K = (rel_k.shape[-2] - 1) // 2
    out = torch.zeros(B, H, L, Dv, dtype=F64)
    for b in range(B):
        for h in range(H):
            g = h // (H // H_kv)
            ak = rel_k[h] if rel_k.dim() == 3 else rel_k
            av = rel_v[h] if rel_v.dim() == 3 else rel_v
            for r in range(L):
                i = r + S - L  # bottom-right alignment
                e = {}
                for j in range(S):
                    if keep[b, h, r, j]:
                        a = max(-K, min(K, j - i)) + K
                        e[j] = float(q[b, h, r] @ (k[b, g, j] + ak[a])) / math.sqrt(D)
                if not e:
                    continue
                m = max(e.values())
                z = sum(math.exp(x - m) for x in e.values())
                for j, x in e.items():
                    a = max(-K, min(K, j - i)) + K
                    out[b, h, r] += math.exp(x - m) / z * (v[b, g, j] + av[a])
    return out


@pytest.mark.parametrize("per_head", [False, True])
def test_reference_equals_the_loop_formula(per_head):
    q, k, v, rk, rv = _inputs(per_head=per_head)
    keep = seeded(2, 4, 5, 7, seed=9) > -0.3  # (B, H, L, S) random
    keep[0, 1, 2] = False  # a fully masked row: zeros
    out, w = reference.shaw_attention(q, k, v, rk, rv, mask=keep)
    want = _loop(q, k, v, rk, rv, keep)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[0, 1, 2], torch.zeros(5, dtype=F64))
    assert torch.equal(w[~keep], torch.zeros_like(w[~keep]))


def test_relative_index_clips_and_aligns_bottom_right():
    idx = reference.shaw_relative_index(2, 4, 1) - 1  # r = clip(j − i, −1, 1)
    assert idx.tolist() == [[-1, -1, 0, 1], [-1, -1, -1, 0]]
    idx = reference.shaw_relative_index(3, 3, 5) - 5
    assert idx.tolist() == [[0, 1, 2], [-1, 0, 1], [-2, -1, 0]]


CASES = {
    "none": dict(L=5, S=7),
    "causal L<S": dict(L=5, S=7, mask=masks.causal()),
    "window L=S": dict(L=9, S=9, mask=masks.sliding_window(3)),
    "padding": dict(L=6, S=6, mask=masks.padding([6, 3])),
    "bias": dict(L=5, S=7, bias="float"),
    "L=1": dict(L=1, S=7, mask=masks.causal()),
    "ALiBi fn bias": dict(L=5, S=7, mask=masks.causal(), bias="alibi"),
    "float mask": dict(L=5, S=7, mask="float"),
}


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_dense_path_equals_reference_forward_and_backward(case, per_head):
    c = dict(CASES[case])
    mask, bias = c.pop("mask", None), c.pop("bias", None)
    q, k, v, rk, rv = _inputs(per_head=per_head, **c)
    L, S = q.shape[2], k.shape[2]
    ref_bias = bias
    if bias == "float":
        bias = ref_bias = seeded(1, 4, L, S, seed=11)
        bias[..., 0] = float("-inf")  # −inf = masked
    elif bias == "alibi":
        bias = attnlab.pos.ALiBi(4)
        ref_bias = bias.matrix(L, S).to(F64)  # (H, L, S)
    if mask == "float":  # an additive float mask: −inf entries are masked
        mask = torch.where(seeded(L, S, seed=12) > -0.5, 0.0, float("-inf")).to(F64)
        ref_bias, dense_mask = mask, None
    else:
        dense_mask = None if mask is None else mask.to_dense(L, S, batch=2, heads=4)

    def fast(*x):
        return shaw_attention(*x, mask=mask, bias=bias)

    def ref(*x):
        return reference.shaw_attention(*x, mask=dense_mask, bias=ref_bias)[0]

    xs = [t.clone().requires_grad_(True) for t in (q, k, v, rk, rv)]
    out = fast(*xs)
    want = ref(*xs)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    dout = seeded(*out.shape, seed=5)
    g_fast = torch.autograd.grad(out, xs, dout)
    g_ref = torch.autograd.grad(want, xs, dout)
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_dense_path_float32_meets_the_tolerance_rule():
    xs = [t.float() for t in _inputs(B=2, H=4, H_kv=2, L=17, S=33, D=40, Dv=40, K=4)]

    def ref(q, k, v, rk, rv, compute_dtype, reorder):
        keep = reference.causal_keep(17, 33)
        return reference.shaw_attention(
            q, k, v, rk, rv, mask=keep, compute_dtype=compute_dtype, reorder=reorder
        )[0]

    check_against_reference(lambda *x: shaw_attention(*x, mask=masks.causal()), ref, xs)


def test_gradcheck_tiny():
    xs = [t.requires_grad_(True) for t in _inputs(B=1, H=2, H_kv=1, L=3, S=4, D=2, Dv=3, K=1)]
    mask = masks.causal()
    assert torch.autograd.gradcheck(lambda *x: shaw_attention(*x, mask=mask), xs)


def test_distances_beyond_k_share_the_end_rows():
    """Clipping: a table of K = 2 equals a table of K = 6 whose rows beyond ±2 copy the ends."""
    q, k, v, rk, rv = _inputs(L=7, S=7, K=2)
    r = torch.arange(-6, 7).clamp(-2, 2) + 2  # (13,)
    out = shaw_attention(q, k, v, rk, rv)
    wide = shaw_attention(q, k, v, rk[r], rv[r])
    torch.testing.assert_close(out, wide, rtol=1e-13, atol=1e-14)
    # and the end rows matter: changing the row of distance +2 changes rows that see j − i ≥ 2
    rk2 = rk.clone()
    rk2[-1] += 1.0
    changed = (shaw_attention(q, k, v, rk2, rv) - out).abs().amax(dim=-1) > 1e-9  # (B, H, L)
    assert changed[..., :5].all() and not changed[..., 5:].any()  # rows 5, 6 have no j − i ≥ 2


def test_shift_equivariance_relative_positions_only():
    """Moving the whole sequence t positions later (keys before it masked) changes nothing."""
    q, k, v, rk, rv = _inputs(H_kv=4, L=6, S=6, K=3)
    t = 4
    pad = seeded(2, 4, t, 3, seed=20)
    qs, ks = torch.cat([pad, q], 2), torch.cat([pad, k], 2)
    vs = torch.cat([seeded(2, 4, t, 5, seed=21), v], 2)
    keep = torch.ones(10, 10, dtype=torch.bool)
    keep[:, :t] = False
    out = shaw_attention(q, k, v, rk, rv, mask=masks.causal())
    shifted = shaw_attention(qs, ks, vs, rk, rv, mask=keep.tril())
    torch.testing.assert_close(shifted[:, :, t:], out, rtol=1e-13, atol=1e-14)
    # the same shift with an absolute encoding added to q and k is not equivariant
    pe = SinusoidalEmbedding(4)(10).to(F64)[:, :3]  # (10, 3)
    absolute = shaw_attention(q + pe[:6], k + pe[:6], v, rk, rv, mask=masks.causal())
    absolute_s = shaw_attention(qs + pe, ks + pe, vs, rk, rv, mask=keep.tril())
    assert (absolute_s[:, :, t:] - absolute).abs().max() > 1e-3


def test_decode_row_equals_last_row_of_full_attention():
    """Bottom-right alignment: one query against S keys is the last row of the S×S causal run."""
    q, k, v, rk, rv = _inputs(L=8, S=8, K=2)
    full = shaw_attention(q, k, v, rk, rv, mask=masks.causal())
    step = shaw_attention(q[:, :, -1:], k, v, rk, rv)
    torch.testing.assert_close(step, full[:, :, -1:], rtol=1e-13, atol=1e-14)


def test_nan_rule_matches_reference_and_isolates_rows():
    q, k, v, rk, rv = _inputs(H_kv=4, L=8, S=8, K=2)
    q[0, 0, 1] = float("nan")
    k[0, 1, 5, 0] = float("inf")
    v[1, 2, 3, 4] = float("nan")
    rv[0, 1] = float("nan")  # distance −2 (clipped: every j − i ≤ −2), column 1
    rk_future = rk.clone()
    rk_future[-1, 0] = float("nan")  # distance +2: causal rows never read it
    keep = reference.causal_keep(8, 8)
    out = shaw_attention(q, k, v, rk_future, rv, mask=masks.causal())
    want, _ = reference.shaw_attention(q, k, v, rk_future, rv, mask=keep)
    assert torch.equal(torch.isfinite(out), torch.isfinite(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(out[fin], want[fin], rtol=1e-12, atol=1e-13)
    bad = ~torch.isfinite(out)
    assert bad[0, 0, 1].all() and not bad[0, 0, 0].any()  # q NaN: that row only
    assert bad[0, 1, 5:].all() and not bad[0, 1, :5, [0, 2, 3, 4]].any()  # k_5: rows ≥ 5
    assert bad[1, 2, 3:, 4].all() and not bad[1, 2, :3, 4].any()  # v_3[4]: rows ≥ 3, col 4
    assert bad[..., 2:, 1].all() and not bad[1, :, :2, 1].any()  # a^V[−2][1]: rows i ≥ 2
    assert torch.isnan(out[bad]).all()  # non-finite outputs are NaN
    # a NaN in the row of distance 0 poisons every row that may attend something
    rk0 = rk.clone()
    rk0[2, 1] = float("nan")
    keep_pad = masks.padding([8, 0])  # batch 1 attends nothing
    out0 = shaw_attention(q, k, v, rk0, rv.nan_to_num(0.0), mask=keep_pad)
    assert torch.isnan(out0[0]).all()
    assert torch.equal(out0[1], torch.zeros_like(out0[1]))  # empty rows stay zeros


def test_nan_gradients_are_those_of_cleaned_inputs():
    q, k, v, rk, rv = _inputs(H_kv=4, L=6, S=6, K=2)
    q[0, 0, 1] = float("nan")
    v[0, 0, 3, 2] = float("inf")
    rk[0, 0] = float("nan")
    xs = [t.clone().requires_grad_(True) for t in (q, k, v, rk, rv)]
    clean = [t.nan_to_num(0.0, 0.0, 0.0).requires_grad_(True) for t in (q, k, v, rk, rv)]
    out = shaw_attention(*xs, mask=masks.causal())
    ref = shaw_attention(*clean, mask=masks.causal())
    dout = seeded(*out.shape, seed=3)
    g = torch.autograd.grad(out, xs, dout)
    g_clean = torch.autograd.grad(ref, clean, dout)
    for x, a, b in zip(xs, g, g_clean, strict=True):
        # nan_to_num's gradient is 0 at the replaced entries
        torch.testing.assert_close(a, torch.where(torch.isfinite(x), b, 0.0), rtol=1e-12, atol=0)


def test_zero_tables_give_plain_attention_and_module_wiring():
    torch.manual_seed(0)
    shaw = ShawRelativeAttention(32, 4, max_distance=3, num_kv_heads=2)
    plain = attnlab.MultiHeadAttention(32, 4, num_kv_heads=2)
    missing, unexpected = plain.load_state_dict(shaw.state_dict(), strict=False)
    assert not missing and set(unexpected) == {"relative.rel_k", "relative.rel_v"}
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        shaw.relative.rel_k.zero_()
        shaw.relative.rel_v.zero_()
    torch.testing.assert_close(
        shaw(x, mask=masks.causal()), plain(x, mask=masks.causal()), rtol=1e-5, atol=1e-6
    )
    with torch.no_grad():
        shaw.relative.rel_v.normal_()
        shaw.relative.rel_k.normal_()
    q, kk, vv = shaw.project(x)
    want = shaw.out_proj(
        reference.shaw_attention(
            q.double(),
            kk.double(),
            vv.double(),
            shaw.relative.rel_k.double(),
            shaw.relative.rel_v.double(),
            mask=reference.causal_keep(9, 9),
        )[0]
        .float()
        .transpose(1, 2)
        .reshape(2, 9, 32)
    )
    got, w = shaw(x, mask=masks.causal(), need_weights=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert w.shape == (2, 4, 9, 9) and torch.equal(w.triu(1), torch.zeros_like(w))
    got.sum().backward()
    assert shaw.relative.rel_k.grad.abs().sum() > 0 and shaw.relative.rel_v.grad.abs().sum() > 0


def test_per_head_tables_module():
    shaw = ShawRelativePositions(2, 8, 6, num_heads=3)
    assert shaw.rel_k.shape == (3, 5, 8) and shaw.rel_v.shape == (3, 5, 6)
    q, k, v = seeded(1, 3, 4, 8, dtype=torch.float32), seeded(1, 3, 4, 8), seeded(1, 3, 4, 6)
    out = shaw(q, k.float(), v.float())
    want = reference.shaw_attention(q.double(), k, v, shaw.rel_k.double(), shaw.rel_v.double())[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_meta_tensors_sync_free():
    q, k, v, rk, rv = (t.to("meta") for t in _inputs())
    out = shaw_attention(q, k, v, rk, rv, mask=masks.causal())
    assert out.shape == (2, 4, 5, 5) and out.is_meta


@pytest.mark.parametrize(
    ("which", "shape", "message"),
    [
        ("rel_k", (4, 3), "odd number"),
        ("rel_k", (5, 4), r"\(2K\+1, 3\)"),
        ("rel_v", (7, 5), "same number of rows"),
        ("rel_v", (3, 5, 5), r"\(4, 2K\+1, 5\)"),
    ],
)
def test_bad_tables_raise_naming_the_argument(which, shape, message):
    q, k, v, rk, rv = _inputs()
    t = torch.zeros(shape, dtype=F64)
    args = (t, rv) if which == "rel_k" else (rk, t)
    with pytest.raises(ValueError, match=f"{which}.*{message}|{message}"):
        shaw_attention(q, k, v, *args)
    with pytest.raises(TypeError, match="rel_k must be a float tensor"):
        shaw_attention(q, k, v, rk.long(), rv)
    with pytest.raises(ValueError, match="max_distance must be >= 0"):
        ShawRelativePositions(-1, 4)


# ---------------------------------------------------------------- concatenated encoding


@pytest.mark.parametrize("encoding", ["sinusoidal", "learned"])
def test_concat_logits_split_into_content_and_position(encoding):
    """With identity projections ``[x_i; p_i]·[x_j; p_j] = x_i·x_j + p_i·p_j`` (no cross terms)."""
    enc = SinusoidalEmbedding(8) if encoding == "sinusoidal" else LearnedPositionalEmbedding(16, 8)
    cat = ConcatPositionalEncoding(enc)
    x = torch.randn(2, 11, 12)
    xp = cat(x)
    assert xp.shape == (2, 11, 20)
    p = enc(11).detach()
    assert torch.equal(xp[..., :12], x) and torch.equal(xp[..., 12:], p.expand(2, 11, 8))
    logits = xp @ xp.transpose(-1, -2)  # (B, L, L)
    content, position = x @ x.transpose(-1, -2), p @ p.T
    torch.testing.assert_close(logits, content + position, rtol=1e-5, atol=1e-5)
    # the same through attnlab.attention: weights = softmax((content + position)/√(E+E_p))
    _, w = attnlab.attention(xp[:, None], xp[:, None], xp[:, None], return_weights=True)
    want = torch.softmax((content + position) / math.sqrt(20), dim=-1)
    torch.testing.assert_close(w[:, 0], want, rtol=1e-5, atol=1e-6)


def test_concat_explicit_positions_and_errors():
    cat = ConcatPositionalEncoding(LearnedPositionalEmbedding(32, 4))
    x = torch.randn(2, 3, 6)
    pos = torch.tensor([[5, 6, 7], [0, 10, 20]])
    out = cat(x, pos)
    torch.testing.assert_close(out[1, 2, 6:], cat.encoding.weight[20])
    torch.testing.assert_close(out[0, 0, 6:], cat.encoding.weight[5])
    with pytest.raises(ValueError, match="positions must be"):
        cat(x, torch.arange(4))
    with pytest.raises(ValueError, match="x must be"):
        cat(torch.randn(3, 6))
    with pytest.raises(TypeError, match=r"encoding must be an nn\.Module"):
        ConcatPositionalEncoding(lambda p: p)


def test_nan_rule_per_head_tables_dense_mask_and_weights():
    q, k, v, rk, rv = _inputs(L=6, S=6, K=1, per_head=True)
    rv[1, 2, 0] = float("nan")  # head 1, distance +1, column 0
    k[0, 0, 4, 1] = float("nan")  # kv head 0 = query heads 0, 1
    keep = seeded(1, 1, 6, 6, seed=4) > 0  # a dense bool mask
    keep[..., 3, :] = False  # row 3 attends nothing
    out, w = shaw_attention(q, k, v, rk, rv, mask=keep, return_weights=True)
    want, w_ref = reference.shaw_attention(q, k, v, rk, rv, mask=keep)
    for a, b in ((out, want), (w, w_ref)):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.isfinite(b).any()
        torch.testing.assert_close(a[~a.isnan()], b[~b.isnan()], rtol=1e-12, atol=1e-13)
    reads_plus1 = (keep[0, 0] & (reference.shaw_relative_index(6, 6, 1) == 2)).any(-1)  # (L,)
    assert torch.equal(torch.isnan(out[1, 1, :, 0]), reads_plus1)  # head 1, col 0 (batch 1)
    assert not torch.isnan(out[1, [0, 2, 3]]).any()  # other heads: their own tables are finite
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))


@pytest.mark.parametrize(("L", "S"), [(0, 3), (3, 0), (0, 0)])
def test_empty_sizes_give_zeros_even_for_nan_queries(L, S):
    q, k, v = seeded(1, 2, L, 4), seeded(1, 2, S, 4), seeded(1, 2, S, 4)
    q[..., 0] = float("nan")
    rk, rv = seeded(5, 4, seed=1), seeded(5, 4, seed=2)
    out = shaw_attention(q, k, v, rk, rv, mask=masks.causal())
    assert out.shape == (1, 2, L, 4) and torch.equal(out, torch.zeros_like(out))


@pytest.mark.slow
def test_compiles_in_one_graph_forward_and_backward():
    """No host syncs: ``torch.compile(fullgraph=True)`` traces the module, backward included."""
    torch.manual_seed(0)
    mha = ShawRelativeAttention(16, 2, max_distance=2, num_kv_heads=1)
    x = torch.randn(2, 7, 16)
    compiled = torch.compile(lambda t: mha(t, mask=masks.causal()), fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, mha(x, mask=masks.causal()), rtol=1e-6, atol=1e-6)
    got.sum().backward()
    assert torch.isfinite(mha.relative.rel_v.grad).all() and mha.relative.rel_v.grad.abs().sum() > 0


def test_cached_decoding_equals_the_full_causal_run():
    torch.manual_seed(1)
    mha = ShawRelativeAttention(16, 4, max_distance=3, num_kv_heads=2)
    x = torch.randn(2, 9, 16)
    full = mha(x, mask=masks.causal())
    cache = attnlab.KVCache()
    steps = [mha(x[:, :5], mask=masks.causal(), cache=cache)]  # prefill
    steps += [mha(x[:, t : t + 1], cache=cache) for t in range(5, 9)]  # one token at a time
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="plain KVCache"):
        mha(x, cache=attnlab.SlidingWindowCache(4))


def test_prune_heads_is_refused_and_leaves_the_module_unchanged():
    from attnlab.modules import ShawRelativeAttention

    m = ShawRelativeAttention(16, 4, 3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"prune_heads: .*relative tables"):
        m.prune_heads([1])
    assert m.num_heads == 4
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
