"""The blockwise causal scan of linear attention and FAVOR+ (issue #19 item 4).

The causal forms carry one running state ``Σ φ(k) [v, 1]ᵀ`` (and the NaN rule's running flags)
through blocks of `BLOCK_BYTES`; the default sizes of the other tests fit one or a few blocks.
Here `BLOCK_BYTES` is shrunk so that odd sizes cross many blocks, and every result is compared
with the explicit reference (float64, forward and backward) or the NaN rule written out row by row.
"""

from __future__ import annotations

import pytest
import torch

import attnlab.functional.kernel_scan as ks
import attnlab.functional.linear as lin
from attnlab import masks
from attnlab.functional import nan_rule, reference
from attnlab.functional.linear_features import clean_features
from attnlab.linear import favor_attention, favor_projection, linear_attention
from helpers import FIXED_TABLE, LargestTensor, fwd_bwd, seeded
from nan_rule_linear import as_mask, check_nan_rule, keep_matrix, planted

F64 = torch.float64
FWD_ATOL, FWD_RTOL, GRAD_ATOL, GRAD_RTOL = FIXED_TABLE[F64]


@pytest.fixture
def blocks(monkeypatch):
    """Sets `BLOCK_BYTES` and counts the query blocks (`normalise`, once per block of output)."""
    calls = []
    normalise = ks.normalise

    def counting(*args, **kwargs):
        calls.append(args[0].shape[3])  # rows in the block
        return normalise(*args, **kwargs)

    monkeypatch.setattr(ks, "normalise", counting)

    def use(nbytes: int) -> list[int]:
        monkeypatch.setattr(ks, "BLOCK_BYTES", nbytes)
        calls.clear()
        return calls

    return use


def qkv(B=2, H=4, H_kv=2, L=17, S=17, D=8, Dv=5, seed=0, scale=1.0):
    return (
        seeded(B, H, L, D, dtype=F64, seed=seed, scale=scale),
        seeded(B, H_kv, S, D, dtype=F64, seed=seed + 1, scale=scale),
        seeded(B, H_kv, S, Dv, dtype=F64, seed=seed + 2),
    )


def padding(B: int, S: int, seed: int) -> torch.Tensor:
    """Random key padding (a real prefix per item) with an all-padding last item."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, S + 1, (B,), generator=g)
    lengths[0] = S // 3  # item 0: most keys are padding
    lengths[-1] = 0
    return torch.arange(S) < lengths[:, None]


def assert_equal_to_reference(fast, ref, inputs):
    out_f, grads_f = fwd_bwd(fast, inputs)
    out_r, grads_r = fwd_bwd(ref, inputs)
    torch.testing.assert_close(out_f, out_r, atol=FWD_ATOL, rtol=FWD_RTOL)
    for gf, gr in zip(grads_f, grads_r, strict=True):
        torch.testing.assert_close(gf, gr, atol=GRAD_ATOL, rtol=GRAD_RTOL)


# (L, S, chunk, block bytes): S > L puts keys before the first query (the initial state, itself
# summed in blocks), L > S queries before the first key; 1 byte = one chunk per block.
SCAN_CASES = [
    (37, 37, 4, 1, "elu"),
    (37, 37, 5, 3000, "relu"),
    (23, 61, 3, 1, "relu"),
    (61, 23, 4, 1, "elu"),
    (29, 40, 7, 4000, "elu"),
    (1, 50, 4, 1, "elu"),
    (50, 1, 4, 1, "elu"),
]


def as_callable(name: str):
    """The built-in map ``name`` as a user's callable: the scan through autograd, not fused."""
    phi = reference.LINEAR_FEATURE_MAPS[name]
    return lambda x: phi(x)


@pytest.mark.parametrize("form", ["fused", "callable"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("L,S,chunk,nbytes,feature_map", SCAN_CASES)
def test_linear_scan_in_blocks_equals_reference(
    blocks, L, S, chunk, nbytes, feature_map, padded, form
):
    """Both forms of the causal scan: `_CausalScan` (built-in maps, hand-written backward) and
    autograd through the block ops (a user's callable), forward and backward."""
    inputs = qkv(L=L, S=S, seed=L * S)
    key_mask = padding(2, S, seed=L + S) if padded else None
    calls = blocks(nbytes)
    phi = feature_map if form == "fused" else as_callable(feature_map)

    def fast(q, k, v):
        return linear_attention(
            q,
            k,
            v,
            feature_map=phi,
            chunk_size=chunk,
            mask=as_mask(True, key_mask),
        )

    def ref(q, k, v):
        return reference.linear_attention(
            q,
            k,
            v,
            feature_map=feature_map,
            mask=as_mask(True, key_mask),
        )

    assert_equal_to_reference(fast, ref, inputs)
    T = min(L, S)
    block = ks.block_tokens(2 * 4, max(8, 5 + 1, min(chunk, T)), 8, min(chunk, T))
    assert sum(calls) == T and max(calls) == min(block, T)
    assert len(calls) >= (2 if T > 1 else 1)  # several blocks (each a multiple of the chunk)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,S,chunk,nbytes", [(37, 37, 4, 1), (23, 41, 3, 1), (41, 23, 5, 5000)])
def test_favor_in_blocks_equals_reference(blocks, L, S, chunk, nbytes, causal):
    """FAVOR+ with its features made block by block (`_FavorSource`), causal (the scan) and not
    (one state over all key blocks), equals the explicit reference in float64, forward and
    backward, the projection's gradient included."""
    inputs = qkv(L=L, S=S, seed=L + 2 * S, scale=0.7)
    key_mask = padding(2, S, seed=S)
    W = favor_projection(16, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    calls = blocks(nbytes)

    def fast(q, k, v, W):  # W too: a learned projection gets its gradient
        return _favor(W, key_mask, chunk, causal)(q, k, v)

    def ref(q, k, v, W):
        return reference.favor_attention(q, k, v, W, mask=as_mask(causal, key_mask))

    assert_equal_to_reference(fast, ref, [*inputs, W])
    assert len(calls) >= 3 and sum(calls) == (min(L, S) if causal else L)


# ------------------------------------------------------------------------ the NaN rule, carried


@pytest.fixture(params=["detected", "flags"])
def finite_blocks(request, monkeypatch):
    """ "detected": blocks known finite (`nan_rule.known_finite`, the C++ operator) skip the
    flags; "flags": nothing is known finite, every block computes them (no compiler, compile)."""
    if request.param == "flags":
        monkeypatch.setattr(lin, "known_finite", lambda x: False)
    return request.param


@pytest.mark.parametrize("form", ["fused", "callable"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "L,S,padded", [(9, 11, False), (9, 11, True), (11, 7, True), (13, 13, True)]
)
def test_nan_rule_carried_across_blocks(blocks, finite_blocks, seed, L, S, padded, form):
    """Planted NaN/±inf with blocks of one 2-token chunk: bad keys/values of earlier blocks
    poison later blocks' rows/columns only, padding never leaks, no-key rows stay zeros; the
    gradients are those of the cleaned inputs (0 at the non-finite entries)."""
    key_mask = None
    if padded:
        key_mask = torch.ones(2, S, dtype=torch.bool)
        key_mask[0, S - 3 :] = False
        key_mask[1, 1:] = False  # item 1: one real key; causal rows before it see none
    inputs = planted(seed + 7 * L, L=L, S=S, key_mask=key_mask)
    keep = keep_matrix(2, L, S, True, key_mask)
    calls = blocks(1)

    phi = "elu" if form == "fused" else as_callable("elu")

    def fast(q, k, v):
        return linear_attention(
            q,
            k,
            v,
            feature_map=phi,
            chunk_size=2,
            mask=as_mask(True, key_mask),
        )

    def ref(q, k, v):
        return reference.linear_attention(q, k, v, mask=as_mask(True, key_mask))

    check_nan_rule(fast, ref, inputs, keep, key_mask)
    assert len(calls) >= 4


@pytest.mark.parametrize("where", ["prefix", "first block"])
def test_nan_rule_bad_key_and_value_reach_every_later_block(blocks, finite_blocks, where):
    """A bad key (value column) in the prefix keys or in the first block poisons the rows
    (column 1) of every later block, and no row before it; padded bad keys poison nothing."""
    L, S = 12, 16 if where == "prefix" else 12
    q, k, v = qkv(B=1, H=2, H_kv=1, L=L, S=S)
    j = 1 if where == "prefix" else S - L + 2  # key index; its first row is j − (S − L)
    blocks(1)
    for name in ("k", "v"):
        k2, v2 = k.clone(), v.clone()
        (k2 if name == "k" else v2)[0, 0, j, 1] = float("nan")
        clean = linear_attention(q, k, v, chunk_size=2, mask=masks.causal())
        out = linear_attention(q, k2, v2, chunk_size=2, mask=masks.causal())
        first = max(j - (S - L), 0)
        assert torch.equal(out[:, :, :first], clean[:, :, :first])
        cols = slice(None) if name == "k" else 1
        assert torch.isnan(out[:, :, first:, cols]).all()
        if name == "v":
            torch.testing.assert_close(out[:, :, :, [0, 2, 3, 4]], clean[:, :, :, [0, 2, 3, 4]])
        key_mask = torch.ones(1, S, dtype=torch.bool)
        key_mask[0, j:] = False  # the bad key is padding: nothing changes
        hidden = linear_attention(q, k2, v2, chunk_size=2, mask=as_mask(True, key_mask))
        assert torch.equal(
            hidden, linear_attention(q, k, v, chunk_size=2, mask=as_mask(True, key_mask))
        )


def test_nan_query_of_rows_whose_keys_are_all_padding_gives_zeros(blocks, finite_blocks):
    """The running count of keys: rows before the first key (bottom-right, blocks later) are
    zeros even with a NaN query; the first row that has one is NaN."""
    q, k, v = qkv(B=1, H=1, H_kv=1, L=10, S=3)  # bottom-right: rows 0..6 have no key
    key_mask = torch.ones(1, 3, dtype=torch.bool)
    q = q.clone()
    q[0, 0, [2, 5, 8]] = float("nan")
    blocks(1)
    out = linear_attention(q, k, v, chunk_size=2, mask=as_mask(True, key_mask))
    assert torch.equal(out[0, 0, :7], torch.zeros(7, 5, dtype=F64))
    assert torch.isnan(out[0, 0, 8]).all() and torch.isfinite(out[0, 0, [7, 9]]).all()


# ------------------------------------------------------------------------ sizes of intermediates


@pytest.mark.parametrize("S", [1024, 1500])
def test_no_intermediate_larger_than_the_inputs(blocks, S):
    """Per block, not per sequence: the largest tensor of forward + backward is q, k, v, the
    output or their gradients (L · D elements), never ``(L, C)`` scores, the ``(L, Dv + 1)``
    values with ones, or the NaN rule's flags of all tokens."""
    L, D, C = 1024, 8, 32
    xs = [
        x.requires_grad_(True)
        for x in (torch.randn(1, 1, L, D), torch.randn(1, 1, S, D), torch.randn(1, 1, S, D))
    ]
    calls = blocks(128 * 32 * 4)  # 128 tokens of 32 floats: 4 chunks per block
    with LargestTensor() as mode:
        out = linear_attention(*xs, chunk_size=C, mask=masks.causal())
        out.sum().backward()
    assert mode.largest == S * D  # k's own size (its gradient)
    assert calls == [128] * 8


def test_block_tokens_is_a_multiple_of_the_chunk_within_the_budget():
    for rows, width, itemsize, chunk in [(8, 65, 4, 64), (1, 17, 8, 5), (64, 129, 4, 32)]:
        n = ks.block_tokens(rows, width, itemsize, chunk)
        assert n % chunk == 0 and n >= chunk
        assert n == chunk or rows * n * width * itemsize <= ks.BLOCK_BYTES
        assert rows * (n + chunk) * width * itemsize > ks.BLOCK_BYTES  # the largest such


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("L,S", [(37, 37), (45, 30), (30, 45)])
def test_inference_writes_the_same_output_as_autograd(blocks, dtype, L, S):
    """Without autograd the blocks are written into one output tensor (rows before the first
    key zeroed; so is `_CausalScan`'s forward); with autograd through the block ops (a user's
    feature map) they are concatenated: the two are bit-equal."""
    q, k, v = (x.to(dtype) for x in qkv(L=L, S=S, seed=L - S + 50))
    q[0, 1, L - 2, 2] = float("nan")  # a row with real keys: NaN
    key_mask = padding(2, S, seed=3)
    calls = blocks(1)
    phi = as_callable("elu")
    with torch.no_grad():
        out = linear_attention(
            q,
            k,
            v,
            feature_map=phi,
            chunk_size=4,
            mask=as_mask(True, key_mask),
        )
        fused = linear_attention(q, k, v, chunk_size=4, mask=as_mask(True, key_mask))
    assert len(calls) >= 3
    q_g = q.clone().requires_grad_(True)
    out_g = linear_attention(
        q_g,
        k,
        v,
        feature_map=phi,
        chunk_size=4,
        mask=as_mask(True, key_mask),
    )
    fused_g = linear_attention(q_g, k, v, chunk_size=4, mask=as_mask(True, key_mask))
    assert torch.equal(fused.nan_to_num(0.0), fused_g.detach().nan_to_num(0.0))
    assert out_g.grad_fn is not None and out.dtype == dtype
    assert torch.equal(out.isnan(), out_g.isnan()) and out.isnan().any()
    assert torch.equal(out.nan_to_num(0.0), out_g.detach().nan_to_num(0.0))
    if L > S:
        assert torch.equal(out[:, :, : L - S], torch.zeros_like(out[:, :, : L - S]))


def _graph_fns(out: torch.Tensor) -> list:
    """The autograd nodes behind ``out``, each once."""
    seen, todo = [], [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.append(fn)
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return seen


def _graph_nodes(out: torch.Tensor) -> list[str]:
    return [type(fn).__name__ for fn in _graph_fns(out)]


@pytest.mark.parametrize(("L", "S", "splits"), [(40, 40, 3), (40, 52, 7), (52, 40, 4)])
def test_causal_scan_splits_each_input_once_when_aligned(blocks, L, S, splits) -> None:
    """With L = S each of q, k, v is split into blocks once: every split's backward concatenates
    its pieces' gradients into a fresh L-sized tensor (the cost issue #19 item 4 measures), so a
    split into ``[0, L]`` would add one per input. Keys before the first query (S > L) split k
    and v twice more (off, then into blocks); queries without keys (L > S) split q once more."""
    blocks(4096)
    q = seeded(1, 2, L, 8, seed=1).requires_grad_(True)
    k, v = (seeded(1, 2, S, 8, seed=s).requires_grad_(True) for s in (2, 3))
    out = linear_attention(q, k, v, feature_map=as_callable("elu"), mask=masks.causal())
    assert _graph_nodes(out).count("SplitWithSizesBackward0") == splits
    # the built-in maps: one node, whose backward writes dq, dk, dv in place block by block
    fused = linear_attention(q, k, v, mask=masks.causal())
    assert _graph_nodes(fused) == ["_CausalScanBackward"] + ["AccumulateGrad"] * 3


# ------------------------------------------------------------- the fused form and its memory


@pytest.mark.parametrize("name", ["elu", "relu"])
def test_fused_features_equal_the_composition(name):
    """φ(clean(x)) fused: the values and gradients of the reference map on the cleaned input,
    0 gradient at the non-finite entries, float32 features from bfloat16 in, gradient in x's
    dtype."""
    phi = reference.LINEAR_FEATURE_MAPS[name]
    x = seeded(3, 41, 6, dtype=F64, seed=4, scale=3.0)
    x[0, 1, 2], x[1, 5, 0], x[2, 40, 5], x[0, 7, 3] = float("nan"), float("inf"), -float("inf"), 0.0
    want, want_grad = fwd_bwd(lambda t: phi(nan_rule.clean(t)), [x])
    got, got_grad = fwd_bwd(lambda t: clean_features(phi, t, F64), [x])
    torch.testing.assert_close(got, want, atol=1e-15, rtol=1e-13)
    torch.testing.assert_close(got_grad[0], want_grad[0], atol=1e-15, rtol=1e-13)
    assert (got_grad[0][~torch.isfinite(x)] == 0).all()
    xb = x.to(torch.bfloat16).requires_grad_(True)
    fb = clean_features(phi, xb, torch.float32)
    assert fb.dtype == torch.float32
    torch.testing.assert_close(fb, phi(nan_rule.clean(xb.float())))  # float32 defaults
    fb.sum().backward()
    assert xb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["linear", "favor", "favor non-causal"])
def test_fused_scan_keeps_only_its_inputs_and_a_row_per_token(kind):
    """Autograd holds q, k, v themselves (no copy, no feature, score or chunk-state tensor; for
    FAVOR+ also W and one key shift per head) and the tape: one state per block and one
    denominator per (row, head): far from the ~600 numbers per token and head that autograd
    through the block ops keeps (a callable feature map), or FAVOR+'s ``(L, M)`` features."""
    B, H, L, D = 1, 4, 1000, 16
    q, k, v = (seeded(B, H, L, D, seed=s).requires_grad_(True) for s in (1, 2, 3))
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    W = favor_projection(64, D, generator=torch.Generator().manual_seed(0))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if kind == "linear":
            out = linear_attention(q, k, v, mask=masks.causal())
        else:
            out = _favor(W, causal=kind == "favor")(q, k, v)
        ref_saved = len(saved)
        linear_attention(q, k, v, feature_map=as_callable("elu"), mask=masks.causal())
    assert _graph_nodes(out)[0] == (
        "_CausalScanBackward" if kind == "linear" else "_FavorBlocksBackward"
    )
    own = [t for t in saved[:ref_saved] if t.untyped_storage().data_ptr() not in inputs]
    assert all(t.numel() <= W.numel() for t in own)  # W, the key shift (B·H numbers)
    assert any(t.untyped_storage().data_ptr() not in inputs for t in saved[ref_saved:])
    tape = out.grad_fn.tape
    F = D if kind == "linear" else W.shape[0]
    kept = sum(t.numel() for t in tape.states + tape.dens)
    assert len(tape.states) == (1 if kind == "favor non-causal" else -(-L // tape.n))
    assert kept <= len(tape.states) * H * F * (D + 1) + B * H * L
    assert sum(t.numel() for t in tape.dens) == B * H * L


@pytest.mark.parametrize("kind", ["linear", "favor", "favor non-causal"])
def test_fused_scan_compiles_and_runs_on_meta(kind):
    """`torch.compile(fullgraph=True)` traces `_CausalScan` / `_FavorBlocks` (FAVOR+) forward
    and backward (no graph break, no host sync) and equals eager; meta tensors give the shapes
    without data."""
    q, k, v = (seeded(1, 2, 300, 16, seed=s).requires_grad_(True) for s in (1, 2, 3))
    if kind == "linear":
        run = lambda q, k, v: linear_attention(q, k, v, mask=masks.causal())  # noqa: E731
    else:
        W = favor_projection(32, 16, generator=torch.Generator().manual_seed(0))
        run = _favor(W.to(q.device), causal=kind == "favor")
    f = torch.compile(run, fullgraph=True)
    want, want_grads = fwd_bwd(run, [q, k, v])
    got, got_grads = fwd_bwd(f, [q, k, v])
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    m = [torch.empty(1, 2, 300, 16, device="meta", requires_grad=True) for _ in range(3)]
    if kind != "linear":
        run = _favor(W.to("meta"), causal=kind == "favor")
    out = run(*m)
    out.sum().backward()
    assert out.shape == (1, 2, 300, 16) and m[0].grad.shape == m[0].shape


def _favor(W, key_mask=None, chunk=4, causal=True):
    def run(q, k, v):
        return favor_attention(
            q,
            k,
            v,
            num_features=W.shape[0],
            projection=W,
            chunk_size=chunk,
            mask=as_mask(causal, key_mask),
        )

    return run


def _hvp(fn, inputs, seed=11):
    """Hessian-vector products of ``⟨fn(q, k, v), dout⟩`` along seeded directions, for q, k, v."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    dout = seeded(*out.shape, dtype=out.dtype, seed=seed)
    grads = torch.autograd.grad(out, xs, dout, create_graph=True)
    dirs = [seeded(*x.shape, dtype=x.dtype, seed=seed + 1 + i) for i, x in enumerate(xs)]
    dot = sum((g * d).sum() for g, d in zip(grads, dirs, strict=True))
    return torch.autograd.grad(dot, xs)


@pytest.mark.parametrize("kind", ["linear", "favor", "favor non-causal"])
@pytest.mark.parametrize("L,S", [(23, 31), (31, 23)])
def test_second_derivatives_equal_the_reference(blocks, kind, L, S):
    """Under ``create_graph=True`` the scans' backward (`_CausalScan`, `_FavorBlocks`) runs
    the forward again through the block ops and differentiates that: Hessian-vector products
    equal the explicit reference's (float64, a block per chunk, keys before the first query or
    queries before the first key, key padding)."""
    inputs = qkv(L=L, S=S, seed=L + S, scale=0.7)
    key_mask = padding(2, S, seed=L)
    calls = blocks(1)
    if kind == "linear":

        def fast(q, k, v):
            return linear_attention(q, k, v, chunk_size=3, mask=as_mask(True, key_mask))

        def ref(q, k, v):
            return reference.linear_attention(q, k, v, mask=as_mask(True, key_mask))

    else:
        W = favor_projection(16, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
        causal = kind == "favor"
        fast = _favor(W, key_mask, chunk=3, causal=causal)

        def ref(q, k, v):
            return reference.favor_attention(q, k, v, W, mask=as_mask(causal, key_mask))

    got, want = _hvp(fast, inputs), _hvp(ref, inputs)
    assert len(calls) >= 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert all(g.abs().max() > 0 for g in got)


@pytest.mark.parametrize("L,S", [(37, 37), (23, 41), (41, 23)])
def test_causal_kernel_attention_of_given_features_equals_reference(blocks, L, S):
    """`causal_kernel_attention` (given non-negative features, one node `_CausalKernel`): the
    reference with the identity as feature map, forward, backward and Hessian-vector products,
    across blocks; keys before the first query and queries before the first key."""
    q, k, v = qkv(B=2, H=2, H_kv=2, L=L, S=S, seed=L * 3 + S)
    inputs = [q.abs(), k.abs(), v]
    calls = blocks(1)

    def fast(fq, fk, v):
        out = lin.causal_kernel_attention(fq.unsqueeze(2), fk, v, eps=1e-3, chunk_size=4)
        return out.squeeze(2)

    def ref(fq, fk, v):
        return reference.linear_attention(
            fq, fk, v, feature_map=lambda x: x, eps=1e-3, mask=masks.causal()
        )

    assert_equal_to_reference(fast, ref, inputs)
    assert len(calls) >= 3
    xs = [x.clone().requires_grad_(True) for x in inputs]
    assert _graph_nodes(fast(*xs))[:2] == ["SqueezeBackward1", "_CausalKernelBackward"]
    for g, w in zip(_hvp(fast, inputs), _hvp(ref, inputs), strict=True):
        torch.testing.assert_close(g, w, atol=GRAD_ATOL, rtol=GRAD_RTOL)
