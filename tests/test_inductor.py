"""Inductor — what ``torch.compile(model)`` gives users — on `attnlab.attention` and the modules.

Every compile here uses the default backend (Inductor: C++ code generated and built for this
CPU) with ``fullgraph=True``, forward and backward, and checks the compiled result against the
float64 reference under the tolerance rule (`attnlab.testing`), as eager is checked.

The default run compiles a representative slice: the two failures users met (issue #37:
`MultiHeadAttention` with a causal mask, the flash backward of fused-QKV views), the README's
MHA + RoPE + GQA example, one row per backend and dtype, dynamic lengths, and `opcheck` of the
custom operators on strided inputs. ``-m slow`` runs the grid: every mask × every backend, with
dtype, layout (contiguous, fused-QKV views, transposed ``(B, L, H, D)``) and ``dynamic`` varied
so that every pair of values of any two factors is compiled at least once (`pairwise_rows`).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

import attnlab
from attnlab import masks
from attnlab.functional import reference
from attnlab.functional.flash import engines, ops
from attnlab.positional import ALiBi, T5RelativeBias
from attnlab.testing import (
    assert_close_rule,
    check_against_reference,
    mean_factor_for,
    reference_for,
)

B, L, H, D = 2, 193, 4, 32  # L: two flash tiles and a tail; odd, as the tolerance rule asks


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# ----------------------------------------------------------------------------- the cases


torch.manual_seed(0)
ALIBI, T5 = ALiBi(H), T5RelativeBias(H)  # one instance each: a new module would recompile


def _case(name: str, n: int = L) -> dict:
    """``attention`` keyword arguments of one mask/bias case at length ``n``."""
    lengths = torch.tensor([n - 43, n])
    ids = torch.arange(n) * 3 // n  # three packed documents
    dense = torch.rand(1, 1, n, n, generator=torch.Generator().manual_seed(3)) > 0.3
    return {
        "none": {},
        "causal": {"mask": masks.causal()},
        "sliding_window": {"mask": masks.sliding_window(48)},
        "document": {"mask": masks.causal() & masks.document(ids)},
        "bigbird": {"mask": masks.bigbird(16, 3, 1, 1)},
        "strided": {"mask": masks.strided(16)},
        "global_local": {"mask": masks.global_local(16, 4)},
        "padding": {"mask": masks.padding(lengths)},
        "and": {"mask": masks.causal() & masks.sliding_window(64) & masks.padding(lengths)},
        "or": {"mask": masks.sliding_window(16) | masks.global_local(4, 2)},
        "bool_tensor": {"mask": dense},
        "alibi": {"mask": masks.causal(), "bias": ALIBI},
        "t5": {"bias": T5},
        "softcap": {"mask": masks.causal(), "softcap": 20.0},
        "gqa": {"mask": masks.causal()},
        "lse": {"mask": masks.sliding_window(48), "return_lse": True},
    }[name]


MASKS = (
    "none",
    "causal",
    "sliding_window",
    "document",
    "bigbird",
    "strided",
    "global_local",
    "padding",
    "and",
    "or",
    "bool_tensor",
    "alibi",
    "t5",
    "softcap",
    "gqa",
    "lse",
)
BACKENDS = ("auto", "flash", "sdpa")
DTYPES = ("float32", "bfloat16")
LAYOUTS = ("contiguous", "fused_qkv", "blhd")
DYNAMIC = (False, True)

#: Masks whose pattern is drawn per number of blocks (BigBird's random blocks): rendered in the
#: graph (sdpa), a length with another block count is another mask, compiled once more; lengths
#: with the same count are not. Flash's operators build their plan when the graph runs.
PER_BLOCK_COUNT = {"bigbird"}

#: (case, backend) pairs refused with a ValueError naming why (tested below), as
#: ``(eager's words, the compiled call's words)``: sdpa has no soft-capping and no log-sum-exp;
#: flash computes no gradient for a bias function with learned values (T5's weight), so the grid
#: runs T5 on flash without gradient (`test_relative_bias_functions_on_flash`).
NO_BIAS_GRAD = "no gradient for a bias function"
REFUSED = {
    ("softcap", "sdpa"): ("no logit soft-capping",) * 2,
    ("lse", "sdpa"): ("log-sum-exp",) * 2,
    ("t5", "flash"): (NO_BIAS_GRAD, NO_BIAS_GRAD),
}


def _kv_heads(name: str) -> int:
    return 2 if name == "gqa" else H


def _split(layout: str, xs: tuple, h_kv: int) -> tuple:
    """``(q, k, v)`` in ``(B, ·, n, D)`` from a layout's inputs (views, as a model makes them)."""
    if layout == "contiguous":
        return xs
    if layout == "fused_qkv":  # one projection (B, n, (H + 2 H_kv) D), split and transposed
        q, k, v = xs[0].split([H * D, h_kv * D, h_kv * D], dim=-1)
        return tuple(t.unflatten(-1, (-1, D)).transpose(1, 2) for t in (q, k, v))
    return tuple(t.transpose(1, 2) for t in xs)  # transformers' (B, n, H, D)


def _inputs(layout: str, dtype: torch.dtype, h_kv: int, n: int = L) -> list[torch.Tensor]:
    """A layout's inputs at length ``n``, with one NaN in key 120 of item 1, head 0: the NaN rule
    holds in the compiled graph too (rows that attend that key are NaN, no other)."""
    g = torch.Generator().manual_seed(0)
    if layout == "fused_qkv":
        x = torch.randn(B, n, (H + 2 * h_kv) * D, generator=g).to(dtype)
        x[1, 120, H * D + 3] = float("nan")  # k's head 0, entry 3
        return [x]
    shape = (lambda h: (B, h, n, D)) if layout == "contiguous" else (lambda h: (B, n, h, D))
    xs = [torch.randn(shape(h), generator=g).to(dtype) for h in (H, h_kv, h_kv)]
    xs[1][(1, 0, 120, 3) if layout == "contiguous" else (1, 120, 0, 3)] = float("nan")
    return xs


def _rule(compiled, name: str, backend: str, dt: torch.dtype, layout: str, n: int, grads: bool):
    """Checks ``compiled(xs, kw)`` at length ``n`` against the float64 reference."""
    kw, h_kv = _case(name, n), _kv_heads(name)
    kw.pop("return_lse", None)
    ref = reference_for(kw.get("mask"), kw.get("bias"), softcap=kw.get("softcap"))

    def ref_fn(*xs, compute_dtype, reorder):
        return ref(*_split(layout, xs, h_kv), compute_dtype=compute_dtype, reorder=reorder)

    check_against_reference(
        lambda *xs: compiled(xs, kw),
        ref_fn,
        _inputs(layout, dt, h_kv, n),
        grads=grads,
        mean_factor=mean_factor_for(backend, dt),
    )


def check_row(name: str, backend: str, dtype: str, layout: str, dynamic: bool) -> None:
    """Compiles one grid row with Inductor and checks it against the float64 reference.

    Forward and the gradient of every input; with ``return_lse`` the compiled lse too; with
    ``dynamic=True`` a second length (new mask tensors of that length) runs on the same graph,
    as torch's own SDPA does (`test_dynamic_lengths_compile_once_like_sdpa`).
    """
    h_kv, lse = _kv_heads(name), "return_lse" in _case(name)
    dt = getattr(torch, dtype)

    def fn(xs, kw):
        q, k, v = _split(layout, xs, h_kv)
        out = attnlab.attention(q, k, v, backend=backend, return_lse=lse, **kw)
        return out[0] if lse else out

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    _rule(compiled, name, backend, dt, layout, L, grads=True)
    if lse:
        kw = _case(name)
        xs = _inputs(layout, dt, h_kv)
        got = torch.compile(
            lambda xs, kw: attnlab.attention(*_split(layout, xs, h_kv), backend=backend, **kw)[1],
            fullgraph=True,
            dynamic=dynamic,
        )(xs, kw)
        q, k, _ = _split(layout, [x.double() for x in xs], h_kv)
        want = reference.logsumexp(q, k, mask=kw["mask"].to_dense(L, L), scale=D**-0.5)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5, equal_nan=True)
    if dynamic:  # two more lengths, both with 9 blocks of 16 (L has 13)
        rendered = name in PER_BLOCK_COUNT and backend != "flash"  # flash plans at run time
        for n, new_graphs in ((L - 50, int(rendered)), (L - 53, 0)):
            graphs = counters["stats"]["unique_graphs"]
            _rule(compiled, name, backend, dt, layout, n, grads=False)
            got = counters["stats"]["unique_graphs"] - graphs
            assert got == new_graphs, f"{name}: length {n} compiled {got} new graphs"


def pairwise_rows() -> list[tuple[str, str, str, str, bool]]:
    """Grid rows covering every (mask, backend) pair that eager runs, and every pair of values of
    any two factors at least once (greedy pairwise covering, deterministic)."""
    factors = (MASKS, BACKENDS, DTYPES, LAYOUTS, DYNAMIC)

    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(range(len(row)), 2)}

    def allowed(row):
        return (row[0], row[1]) not in REFUSED

    todo = set().union(*(pairs(r) for r in itertools.product(*factors) if allowed(r)))
    rows = []
    for m, b in itertools.product(MASKS, BACKENDS):
        if (m, b) in REFUSED:
            continue
        best = max(
            itertools.product(DTYPES, LAYOUTS, DYNAMIC),
            key=lambda rest, m=m, b=b: len(pairs((m, b, *rest)) & todo),
        )
        rows.append((m, b, *best))
        todo -= pairs(rows[-1])
    while todo:  # pairs of the last three factors left over
        row = max(
            (r for r in itertools.product(*factors) if allowed(r)),
            key=lambda r: len(pairs(r) & todo),
        )
        rows.append(row)
        todo -= pairs(row)
    return rows


GRID = pairwise_rows()


def test_grid_covers_every_pair():
    covered = set()
    for row in GRID:
        covered |= {(a, row[a], b, row[b]) for a, b in itertools.combinations(range(5), 2)}
    for a, b in itertools.combinations(range(5), 2):
        f = (MASKS, BACKENDS, DTYPES, LAYOUTS, DYNAMIC)
        for x, y in itertools.product(f[a], f[b]):
            if (a, b) == (0, 1) and (x, y) in REFUSED:
                continue
            assert (a, x, b, y) in covered, (a, x, b, y)
    assert len(GRID) < 70  # pairwise, not the 1,728-row product


@pytest.mark.slow
@pytest.mark.parametrize("row", GRID, ids=lambda r: "-".join(map(str, r)))
def test_grid(row):
    check_row(*row)


# -------------------------------------------------------------- the default (fast) slice

FAST = [
    ("causal", "auto", "float32", "contiguous", False),
    ("and", "flash", "float32", "fused_qkv", False),  # issue #37's flash_bwd fake-stride row
    ("document", "sdpa", "bfloat16", "blhd", False),
    ("bigbird", "auto", "bfloat16", "fused_qkv", True),
    ("lse", "flash", "float32", "blhd", True),
    ("alibi", "auto", "float32", "contiguous", False),
    ("alibi", "flash", "bfloat16", "blhd", True),
]


@pytest.mark.parametrize("row", FAST, ids=lambda r: "-".join(map(str, r)))
def test_fast_slice(row):
    check_row(*row)


@pytest.mark.parametrize(("name", "backend"), sorted(REFUSED))
def test_refusals_name_why(name, backend):
    """The grid leaves these pairs out because they are refused with a reason, not silently."""
    kw = _case(name)
    q, k, v = _inputs("contiguous", torch.float32, H)
    eager, compiled = REFUSED[(name, backend)]
    with pytest.raises(ValueError, match=eager):
        attnlab.attention(q, k, v, backend=backend, **kw)
    with pytest.raises(Exception, match=compiled):
        torch.compile(
            lambda q, k, v: attnlab.attention(q, k, v, backend=backend, **kw), fullgraph=True
        )(q, k, v)


def test_dynamic_lengths_compile_once_like_sdpa():
    """Three lengths on ``dynamic=True``: attnlab (padding lengths and document ids of each
    length as graph inputs) compiles as many graphs as torch's SDPA with its dense mask."""

    def graphs(fn, make) -> int:
        dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, fullgraph=True, dynamic=True)
        for n in (L, L - 50, L - 53):
            compiled(*make(n))
        return counters["stats"]["unique_graphs"]

    def qkv(n):
        return _inputs("contiguous", torch.float32, H, n)

    def sdpa(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def ours(q, k, v, m):
        return attnlab.attention(q, k, v, mask=m, backend="flash")

    def dense(n):
        return (*qkv(n), _case("and", n)["mask"].to_dense(n, n))

    anchor = graphs(sdpa, dense)
    assert anchor == 1
    assert graphs(ours, lambda n: (*qkv(n), _case("and", n)["mask"])) == anchor
    assert graphs(ours, lambda n: (*qkv(n), _case("document", n)["mask"])) == anchor


# ------------------------------------------------------------ the rows users reported (#37)


def _mha_check(mha, x, mask, *, grad: bool) -> None:
    """Compiled `MultiHeadAttention` equals eager: output, and the input's and weights' grads."""
    compiled = torch.compile(mha, fullgraph=True)
    if not grad:
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, mask=mask), mha(x, mask=mask))
        return
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [compiled(xs[0], mask=mask), mha(xs[1], mask=mask)]
    grads = []
    for out, xi in zip(outs, xs, strict=True):
        mha.zero_grad()
        out.square().sum().backward()
        grads.append([xi.grad, *(p.grad.clone() for p in mha.parameters())])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_mha_causal_compiles_under_no_grad():
    """Row 1: Inductor's C++ for ``torch.max`` of a bool tensor did not compile (NaN rule)."""
    torch.manual_seed(0)
    mha = attnlab.MultiHeadAttention(256, 4).eval()
    _mha_check(mha, torch.randn(2, 128, 256), masks.causal(), grad=False)


def test_mha_rope_gqa_forward_backward():
    """The README's MultiHeadAttention with RoPE and grouped-query heads, trained compiled."""
    torch.manual_seed(0)
    mha = attnlab.MultiHeadAttention(128, 8, num_kv_heads=2, rope=attnlab.RoPE(16))
    _mha_check(mha, torch.randn(2, 97, 128), masks.causal(), grad=True)


@pytest.mark.parametrize("kind", ["window", "padding"])
def test_mha_long_masks_run_flash_compiled(kind):
    """Row 2: at L = 1024 auto picks flash; its backward under Inductor (fake-kernel strides)."""
    torch.manual_seed(0)
    mha = attnlab.MultiHeadAttention(64, 4)
    x = torch.randn(2, 1024, 64)
    mask = (
        masks.sliding_window(64) if kind == "window" else masks.padding(torch.tensor([700, 1024]))
    )
    assert attnlab.explain(*(torch.randn(2, 4, 1024, 16),) * 3, mask=mask).backend == "flash"
    _mha_check(mha, x, mask, grad=True)


# ------------------------------------------------------------ custom operators and torch bugs


def test_relative_bias_functions_on_flash():
    """Under compile flash reads a relative bias function (T5 here, without gradient) from its
    table per offset: equal to the float64 reference, forward, with a causal & window mask."""
    q, k, v = _inputs("contiguous", torch.float32, H)
    mask = masks.sliding_window(64)
    with torch.no_grad():
        got = torch.compile(
            lambda q, k, v: attnlab.attention(q, k, v, mask=mask, bias=T5, backend="flash"),
            fullgraph=True,
        )(q, k, v)
        ref = reference_for(mask, T5)
        golden = ref(*(x.double() for x in (q, k, v)), compute_dtype=torch.float64, reorder=False)
        naive = ref(q, k, v, compute_dtype=torch.float32, reorder=True)
    assert_close_rule(got, golden, naive, mean_factor=10.0)


def test_offset_table_reads_back_the_function():
    """`OffsetTable` of `offset_table` equals the function on every (i, j) of an L × S grid,
    L != S (bottom-right aligned positions), for ALiBi and T5."""
    n_q, n_k = 7, 12
    i = (torch.arange(n_q) + n_k - n_q).view(1, 1, -1, 1)
    j = torch.arange(n_k).view(1, 1, 1, -1)
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(H).view(1, -1, 1, 1)
    for fn in (ALIBI, T5):
        table = engines.offset_table(fn, H, n_q, n_k, torch.device("cpu"))
        assert table.shape == (H, n_q + n_k - 1)
        want = fn(b, h, i, j).expand(1, H, n_q, n_k)
        assert torch.equal(engines.OffsetTable(table, n_k)(b, h, i, j), want)


def _strided_qkv(dtype=torch.float32, n=150, h_kv=2):
    """q, k, v as views of one fused projection (non-contiguous, gaps between heads)."""
    x = torch.randn(B, n, (H + 2 * h_kv) * D, dtype=dtype)
    return _split("fused_qkv", (x,), h_kv)


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize(
    "mask", [masks.sliding_window(48) & masks.padding([120, 150]), None], ids=["window", "none"]
)
def test_custom_ops_opcheck_on_strided_inputs(mask, nan):
    """`torch.library.opcheck`: schema, fake kernels (their strides equal the real kernel's for
    any input layout), autograd registration and AOT dispatch, on fused-QKV views — with finite
    inputs (the backward reads them as they are) and with a NaN (it recomputes the clean call)."""
    q, k, v = (t.detach() for t in _strided_qkv())
    if nan:
        k[1, 0, 100, 3] = float("nan")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    spec, tensors = ("", []) if mask is None else mask.spec()
    table = engines.offset_table(ALIBI, H, q.shape[2], k.shape[2], q.device)  # (H, L + S − 1)
    # opcheck compares outputs without equal_nan: NaN outputs (the rule's) skip that one check;
    # the grid's rows (a NaN in every one) compare them with the reference instead
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    kw = {"test_utils": utils} if nan else {}
    fwd = (q, k, v, tensors, None, None, spec, D**-0.5, None, table)
    torch.library.opcheck(ops.flash_fwd, fwd, **kw)
    out, lse, touched = ops.flash_fwd(*fwd)
    assert bool(touched) == nan
    dout = torch.randn_like(out)
    bwd = (dout, None, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), touched)
    args = (*bwd, tensors, None, None, spec, D**-0.5, None, table)
    torch.library.opcheck(ops.flash_bwd, args, **kw)


def test_fake_kernels_return_the_real_strides():
    """The failing row itself, without opcheck: each op's fake output strides equal its real
    output's for transposed ``(B, L, H, D)`` inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (t.contiguous().transpose(1, 2) for t in _strided_qkv())
    spec, tensors = masks.causal().spec()
    args = (tensors, None, None, spec, D**-0.5, None, None)
    out, lse, t = ops.flash_fwd(q, k, v, *args)
    real = [(out, lse, t), ops.flash_bwd(out, None, q, k, v, out, lse, t, *args)]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, fo, fl, ft = (mode.from_tensor(x) for x in (q, k, v, out, lse, t))
        fake = [
            ops.flash_fwd(fq, fk, fv, *args),
            ops.flash_bwd(fo, None, fq, fk, fv, fo, fl, ft, *args),
        ]
    for r, f in zip(real, fake, strict=True):
        assert [x.stride() for x in r] == [x.stride() for x in f]


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.13 Inductor: C++ for torch.max(bool, dim) with a vector tail does not "
    "compile (max_masked_reduce overload); attnlab's NaN rule uses amin instead",
)
def test_torch_bug_inductor_bool_max_reduction():
    """Stand-alone reproducer of the Inductor bug attnlab routes around (`nan_rule._first_true`).
    When torch fixes it this test passes, strict xfail fails, and the note can go."""
    x = torch.randn(2, 128, 4)
    x[0, 5, 1] = float("nan")
    found, idx = torch.compile(lambda x: torch.max(~torch.isfinite(x), dim=1), fullgraph=True)(x)
    assert found[0, 1] and idx[0, 1] == 5 and not found[1].any()


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.13 Inductor folds a product with the integer 0 into the constant 0 (its "
    "constant-folding peephole for aten.mul), so NaN·0 and inf·0 give 0; attnlab's NaN rule "
    "uses isfinite (nan_rule.nan_flags) instead",
)
def test_torch_bug_inductor_folds_float_times_int_zero():
    """Stand-alone reproducer of the second Inductor bug attnlab routes around: IEEE says
    ``nan · 0`` and ``inf · 0`` are NaN, eager agrees, Inductor returns 0."""
    x = torch.tensor([float("nan"), float("inf"), 1.0])
    got = torch.compile(lambda x: x * 0, fullgraph=True)(x)
    assert got[:2].isnan().all() and got[2] == 0


@pytest.mark.slow  # one AOTInductor build
@pytest.mark.xfail(
    strict=True,
    reason="torch 2.13 AOTInductor: the proxy executor passes None for an empty Tensor[] "
    "argument of a custom op (it cannot tell [] from an absent optional list); attnlab's "
    "compiled_flash passes a placeholder tensor instead",
)
def test_torch_bug_aoti_empty_tensor_list(tmp_path):
    """Stand-alone reproducer of the AOTInductor bug `ops.compiled_flash` routes around."""

    @torch.library.custom_op("attnlab_test::scale_list", mutates_args=())
    def scale(x: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        out = x * 2
        for e in extra:
            out = out + e
        return out

    @scale.register_fake
    def _(x, extra):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x):
            return scale(x, [])

    x = torch.randn(4)
    ep = torch.export.export(M(), (x,))
    assert torch.equal(ep.module()(x), x * 2)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    assert torch.equal(torch._inductor.aoti_load_package(path)(x), x * 2)
