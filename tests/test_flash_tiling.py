"""Tiling plans of the flash backend: analytic block maps equal brute force, empty tiles are
skipped, full tiles are not masked, narrow bands are batched, and no L×S tensor is allocated."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from attnlab import masks
from attnlab.functional.flash import tiling
from attnlab.functional.flash.calls import CALL_CAUSAL, CALL_FULL, CALL_MASKED, BandCall
from attnlab.functional.flash.tiling import band_of, build_plan
from attnlab.masks import EMPTY, FULL, PARTIAL, Mask


def brute(mask: Mask, L: int, S: int, bq: int, bk: int, B: int) -> torch.Tensor:
    """Tile codes from the dense mask: the definition block maps must equal."""
    d = mask.to_dense(L, S, batch=B)
    nq, nk = -(-L // bq), -(-S // bk)
    out = torch.empty(d.shape[0], d.shape[1], nq, nk, dtype=torch.int8)
    for a in range(nq):
        for c in range(nk):
            t = d[:, :, a * bq : (a + 1) * bq, c * bk : (c + 1) * bk]
            out[:, :, a, c] = torch.where(
                t.all(-1).all(-1), FULL, torch.where(t.any(-1).any(-1), PARTIAL, EMPTY)
            )
    return out


def mask_zoo(S: int) -> dict[str, Mask]:
    g = torch.Generator().manual_seed(S)
    ids = torch.sort(torch.randint(0, 4, (S,), generator=g)).values
    shuffled = torch.randint(0, 3, (2, S), generator=g)
    return {
        "causal": masks.causal(),
        "window4": masks.sliding_window(4),
        "window9_bidir": masks.sliding_window(9, causal=False),
        "causal&window": masks.causal() & masks.sliding_window(6),
        "padding": masks.padding([3, S]),
        "document_sorted": masks.document(ids),
        "document_unsorted_batched": masks.document(shuffled),
        "causal&document": masks.causal() & masks.document(ids),
        "causal&padding": masks.causal() & masks.padding([max(0, S - 5), 2]),
        "window|padding": masks.sliding_window(3) | masks.padding([2, 1]),
        "not_window": ~masks.sliding_window(5),
        "strided&causal": masks.strided(3) & masks.causal(),
        "document&~causal": masks.document(ids) & ~masks.causal(),
    }


@pytest.mark.parametrize("L,S", [(1, 1), (17, 17), (23, 40), (40, 23), (64, 64), (1, 30)])
@pytest.mark.parametrize("bq,bk", [(1, 1), (4, 4), (5, 3), (8, 16), (64, 64)])
def test_analytic_block_maps_equal_brute_force(L, S, bq, bk):
    for name, mask in mask_zoo(S).items():
        got = mask.block_map(L, S, bq, bk, batch=2)
        want = brute(mask, L, S, bq, bk, 2)
        assert got.dtype == torch.int8, name
        assert torch.equal(got.expand_as(want), want), name


def test_band_of_structured_masks():
    inf = float("inf")
    assert band_of(None) == (-inf, inf)
    assert band_of(masks.causal()) == (-inf, 0.0)
    assert band_of(masks.sliding_window(5)) == (-4.0, 0.0)
    assert band_of(masks.sliding_window(5, causal=False)) == (-4.0, 4.0)
    assert band_of(masks.sliding_window(5, causal=False) & masks.causal()) == (-4.0, 0.0)
    assert band_of(masks.padding([3])) is None
    assert band_of(masks.causal() | masks.sliding_window(2)) is None


def _keys(call) -> set[int]:
    return set(call.index.tolist())


def _pairs(plan, L: int, S: int, B: int, mask: Mask | None) -> torch.Tensor:
    """Which (b, row, key) pairs some call covers, and check the calls' treatments."""
    cover = torch.zeros(B, L, S, dtype=torch.int64)
    dense = None if mask is None else mask.to_dense(L, S, batch=B).any(1).expand(B, L, S)
    for c in plan.simple_calls:
        keys = c.index
        hit = torch.ones(c.r1 - c.r0, len(keys), dtype=torch.int64)
        if c.kind == CALL_CAUSAL:  # the engine computes the lower triangle only
            assert c.r1 - c.r0 == len(keys)
            hit = hit.tril()
        sub = cover[c.b0 : c.b1, c.r0 : c.r1]  # a view; index_put_ below writes through it
        sub[:, :, keys] += hit
        if c.kind == CALL_FULL and dense is not None:  # a FULL call never needs its mask
            assert dense[c.b0 : c.b1, c.r0 : c.r1][:, :, keys].all()
    return cover


@pytest.mark.parametrize(
    "name,mask",
    [
        ("none", None),
        ("causal", masks.causal()),
        ("window", masks.sliding_window(20)),
        ("window_bidir", masks.sliding_window(13, causal=False)),
        ("document&causal", "doc"),
        ("padding", masks.padding([0, 250])),
        ("bigbird", masks.bigbird(32, 3, 1, 2, seed=1)),
    ],
)
@pytest.mark.parametrize("L,S", [(300, 300), (200, 300), (300, 200)])
def test_plans_cover_every_attended_pair_once_and_skip_empty_tiles(name, mask, L, S):
    B = 2
    if mask == "doc":
        mask = masks.causal() & masks.document.from_lengths([S // 3, 37, S - S // 3 - 37])
    plan = build_plan(mask, B=B, H=2, L=L, S=S, block_q=32, block_k=32, band_block=16, bias=None)
    cover = _pairs(plan, L, S, B, mask)
    assert cover.max() <= 1  # key sets of a group are disjoint
    if mask is not None:
        dense = mask.to_dense(L, S, batch=B).any(1).expand(B, L, S)
        assert cover[dense].all()  # every attended pair is computed
        # nothing is computed in tiles that are EMPTY for the block map
        codes = mask.block_map(L, S, 32, 32, batch=B).amax(1)  # (B|1, nq, nk)
        empty = (codes == EMPTY).repeat_interleave(32, 1).repeat_interleave(32, 2)[:, :L, :S]
        if not isinstance(mask, masks.SlidingWindowMask):  # band windows round up to blocks
            assert not cover[empty.expand(B, L, S)].any()


def test_sliding_window_batches_interior_blocks_into_one_call():
    plan = build_plan(
        masks.sliding_window(256),
        B=1,
        H=8,
        L=16384,
        S=16384,
        block_q=128,
        block_k=128,
        band_block=64,
        bias=None,
    )
    bands = [c for g in plan.groups for c in g.calls if isinstance(c, BandCall)]
    assert len(bands) == 1
    assert bands[0].t1 - bands[0].t0 >= 16384 // 64 - 6  # all but a few edge blocks
    assert bands[0].width == 320 and bands[0].span == 255
    assert plan.num_calls <= 6


def test_causal_plans():
    for L, S, n in ((500, 500, 1), (300, 500, 2), (500, 300, 1)):
        plan = build_plan(
            masks.causal(), B=1, H=1, L=L, S=S, block_q=64, block_k=64, band_block=64, bias=None
        )
        assert plan.num_calls == n
        kinds = [c.kind for c in plan.simple_calls]
        assert CALL_CAUSAL in kinds and CALL_MASKED not in kinds
    # with a bias function every tile needs the bias: per-block calls, masks only on the diagonal
    plan = build_plan(
        masks.causal(), B=1, H=1, L=256, S=256, block_q=64, block_k=64, band_block=64, bias="fn"
    )
    masked = [c for c in plan.simple_calls if c.kind == CALL_MASKED]
    assert len(masked) == 4 and all(c.num_keys == 64 for c in masked)


def test_bias_tiles_stay_within_budget(monkeypatch):
    monkeypatch.setattr(tiling, "TILE_BUDGET", 4096)
    plan = build_plan(
        None, B=1, H=4, L=100, S=1000, block_q=16, block_k=16, band_block=16, bias="fn"
    )
    for c in plan.simple_calls:
        assert 4 * (c.r1 - c.r0) * c.num_keys <= 4096 or c.num_keys <= 16


MEMORY_SCRIPT = textwrap.dedent(
    r"""
    import json, sys, torch
    import attnlab
    from attnlab import masks
    from attnlab.functional.api import attention_stats
    from attnlab.positional import ALiBi
    torch.manual_seed(0)

    def status_mb(field):  # ru_maxrss would include the parent's RSS at fork time
        line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    def peak_mb():
        return status_mb("VmHWM")

    def rss_mb():
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
        return status_mb("VmRSS")

    def run(name, L, H, D, mask, bias=None, backward=True, stats=False):
        q, k, v = (torch.randn(1, H, L, D, requires_grad=backward) for _ in range(3))
        base = rss_mb()  # the peak below can only exceed this by what attention allocates
        if stats:
            st = attention_stats(q.detach(), k.detach(), v.detach(), mask=mask, bias=bias)
            assert torch.isfinite(st.entropy).all()
        else:
            out = attnlab.attention(q, k, v, mask=mask, bias=bias, backend="flash")
            if backward:
                out.backward(torch.ones_like(out))
                assert torch.isfinite(q.grad).all()
        results[name] = peak_mb() - base

    results = {}
    run("window_65536", 65536, 2, 16, masks.sliding_window(256))
    run("document_causal_32768", 32768, 1, 16,
        masks.causal() & masks.document.from_lengths([2048] * 16))
    run("alibi_causal_8192", 8192, 2, 16, masks.causal(), ALiBi(2))
    run("causal_16384", 16384, 2, 16, masks.causal())
    run("stats_window_32768", 32768, 1, 16, masks.sliding_window(128), stats=True)
    print(json.dumps(results))
    """
)


def test_no_lxs_tensor_is_allocated():
    """Peak RSS growth stays far below one L×S tensor.

    65536² bools are 4 GiB; a float (H, L, S) bias at L = 8192 is 512 MiB; 16384² floats 1 GiB.
    """
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, mb in growth.items():
        # inputs + grads are a few tens of MB; one L×S bool mask would be >= 1 GiB
        assert mb < 400, f"{name}: peak RSS grew by {mb:.0f} MB"


# ---------------------------------------------------------------- key-padding tensors (issue #40)
@pytest.mark.parametrize(
    ("L", "S", "bq", "bk"), [(37, 53, 8, 16), (64, 64, 16, 16), (5, 130, 4, 32)]
)
@pytest.mark.parametrize("shape", ["key", "full", "query", "plain"])
@pytest.mark.parametrize("p", [0.0, 0.5, 0.95, 1.0])
def test_tensor_block_codes_equal_the_rendering(L, S, bq, bk, shape, p):
    """`TensorMask.block_codes` reads the tensor once (O(B·S) for a key mask at any L) and gives
    exactly the codes of the rendered L×S grid."""
    from attnlab.masks.blocks import dense_codes

    dims = {"key": (2, 1, 1, S), "full": (1, 3, L, S), "query": (2, 1, L, 1), "plain": (L, S)}
    t = torch.rand(dims[shape], generator=torch.Generator().manual_seed(L + S)) < p
    m = masks.from_tensor(t)
    nb, nh = m.batch_heads(None, None)
    want = dense_codes(m, L, S, bq, bk, nb, nh, None, 1 << 20)
    assert torch.equal(m.block_codes(L, S, bq, bk, nb, nh, None), want)


def test_a_key_mask_block_map_never_renders_the_grid(monkeypatch):
    """A (B, 1, 1, S) key mask at L = S = 65536 maps its blocks without an L×S evaluation."""
    from attnlab.masks import base

    def boom(*_a, **_k):
        raise AssertionError("rendered the L×S grid")

    monkeypatch.setattr(base, "dense_codes", boom)
    keep = torch.ones(2, 1, 1, 65536, dtype=torch.bool)
    keep[1, ..., :1000] = False  # left padding
    codes = (masks.causal() & masks.from_tensor(keep)).block_map(65536, 65536, 128, 128)
    assert codes.shape == (2, 1, 512, 512)
    assert (codes[1, 0, :, :7] == EMPTY).all() and (codes[1, 0, 7:, 7] == PARTIAL).all()


def test_an_all_true_padding_mask_plans_as_the_rest():
    """transformers' all-ones ``attention_mask`` (``causal() & from_tensor(ones)``) plans as
    causal alone — one causal call — and a mask with holes keeps its tensor in the plan."""
    B, L = 2, 256
    ones = masks.from_tensor(torch.ones(B, 1, 1, L, dtype=torch.bool))
    kw = dict(B=B, H=2, L=L, S=L, block_q=64, block_k=64, band_block=16, bias=None)
    plan = build_plan(masks.causal() & ones, **kw)
    assert plan.kind == "causal" and plan.single_call
    assert build_plan(ones, **kw).kind == "dense"
    holes = torch.ones(B, 1, 1, L, dtype=torch.bool)
    holes[0, ..., :100] = False
    padded = build_plan(masks.causal() & masks.from_tensor(holes), **kw)
    assert padded.kind == "block-sparse" and not padded.single_call
