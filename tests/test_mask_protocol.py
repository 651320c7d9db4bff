"""The `Mask` extension protocol: a user's structured mask gets tiling, counts and Flex export.

The masks below are defined here, outside attnlab, through the documented protocol only:
`Dilated` states its diagonals (nothing else), `ChunkedCausal` its index function, key interval
and geometry. Each must run on the tiled backend equal to the float64 reference (forward and
backward, odd sizes), count its pairs equal to its dense rendering, and export a FlexAttention
``mask_mod`` equal to the dense mask.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks as M
from attnlab.functional.flash.tiling import build_plan
from attnlab.masks import Geometry, Mask
from attnlab.testing import check_against_reference, mean_factor_for, reference_for, seeded


class Dilated(Mask):
    """A dilated causal window: every ``rate``-th key among the last ``window`` (diagonals only)."""

    def __init__(self, window: int, rate: int) -> None:
        self.window, self.rate = window, rate

    def diagonals(self):
        return [(-(self.window - 1), 0, self.rate, 0)]  # 1 − w <= j − p <= 0, j − p ≡ 0 mod r

    def __repr__(self) -> str:
        return f"Dilated({self.window}, {self.rate})"


class ChunkedCausal(Mask):
    """Causal inside chunks of ``chunk`` keys (Llama-4-style chunked attention), by `mod`."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def mod(self, b, h, p, j, S):
        return (j <= p) & (
            torch.div(j, self.chunk, rounding_mode="floor")
            == p.div(self.chunk, rounding_mode="floor")
        )

    def key_interval(self, L, S, *, device=None):
        p = self.positions(L, S, device=device)
        lo = (p.div(self.chunk, rounding_mode="floor") * self.chunk).clamp(0, S)
        return lo.view(1, 1, L), (p + 1).clamp(0, S).view(1, 1, L)

    def geometry(self, L, S):
        runs = [(a, min(self.chunk, S - a)) for a in range(0, S, self.chunk)]
        return Geometry(diagonals=[(None, 0, 1, 0)], runs=[runs])

    def __repr__(self) -> str:
        return f"ChunkedCausal({self.chunk})"


def dilated_dense(window: int, rate: int, L: int, S: int) -> torch.Tensor:
    """The definition written out on the (L, S) grid."""
    p = torch.arange(L).view(L, 1) + (S - L)
    d = torch.arange(S).view(1, S) - p
    return (d <= 0) & (d > -window) & (d % rate == 0)


def chunked_dense(chunk: int, L: int, S: int) -> torch.Tensor:
    p = torch.arange(L).view(L, 1) + (S - L)
    j = torch.arange(S).view(1, S)
    return (j <= p) & (j // chunk == p.clamp(min=0) // chunk) & (p >= 0)


USER_MASKS = [
    (Dilated(9, 2), lambda L, S: dilated_dense(9, 2, L, S)),
    (Dilated(40, 3), lambda L, S: dilated_dense(40, 3, L, S)),
    (ChunkedCausal(16), lambda L, S: chunked_dense(16, L, S)),
]
SIZES = [(1, 17), (17, 17), (97, 113), (113, 97)]


@pytest.mark.parametrize(
    "mask,dense", USER_MASKS, ids=lambda x: repr(x) if isinstance(x, Mask) else ""
)
@pytest.mark.parametrize("L,S", SIZES)
def test_user_mask_renders_and_counts_as_defined(mask, dense, L, S):
    want = dense(L, S)
    assert torch.equal(mask.to_dense(L, S)[0, 0], want)
    assert mask.attended_pairs(L, S) == int(want.sum())
    assert mask.geometry(L, S) is not None  # counted in closed form, no L×S evaluation
    assert torch.equal(mask.row_counts(L, S)[0, 0], want.sum(-1))
    assert mask.attended_pairs(L, S, batch=3, heads=2) == 6 * int(want.sum())
    # combined with a library mask, still closed form where the geometries combine
    both = mask & M.padding([S // 2, S])
    keys = torch.arange(S)
    per_item = [int((want & (keys < n)).sum()) for n in (S // 2, S)]
    assert both.attended_pairs(L, S) == sum(per_item)


def test_user_mask_counts_in_closed_form_at_any_size():
    n = 10**12  # no tensor of n positions could exist
    w, r = 9, 2  # row p sees d = 0, −2, −4, −6, −8 once p >= 8; rows 0..7 miss 4, 4, 3, 3, …
    assert Dilated(w, r).attended_pairs(n, n) == 5 * n - (4 + 4 + 3 + 3 + 2 + 2 + 1 + 1)
    assert ChunkedCausal(4).attended_pairs(8, 8) == 2 * (1 + 2 + 3 + 4)


@pytest.mark.parametrize(
    "mask,dense", USER_MASKS, ids=lambda x: repr(x) if isinstance(x, Mask) else ""
)
@pytest.mark.parametrize("bq,bk", [(16, 16), (7, 5)])
def test_user_mask_block_map_is_closed_form_and_exact(mask, dense, bq, bk):
    L, S = 113, 97
    want = dense(L, S)
    codes = mask.block_map(L, S, bq, bk)[0, 0]
    nq, nk = -(-L // bq), -(-S // bk)
    for qb in range(nq):
        for kb in range(nk):
            tile = want[qb * bq : (qb + 1) * bq, kb * bk : (kb + 1) * bk]
            expect = 2 if tile.all() else 1 if tile.any() else 0
            assert int(codes[qb, kb]) == expect, (qb, kb)
    plan = build_plan(mask, B=1, H=2, L=L, S=S, block_q=bq, block_k=bk, band_block=16, bias=None)
    assert plan.kind == "block-sparse"
    assert mask.band() is None  # a dilated window is no band: the tiles decide


@pytest.mark.parametrize(
    "mask,dense", USER_MASKS, ids=lambda x: repr(x) if isinstance(x, Mask) else ""
)
@pytest.mark.parametrize("L,S", [(97, 113), (113, 97), (17, 17)])
def test_user_mask_on_the_tiled_backend_equals_the_reference(mask, dense, L, S):
    q = seeded(2, 3, L, 40, dtype=torch.float32, seed=1)
    k = seeded(2, 3, S, 40, dtype=torch.float32, seed=2)
    v = seeded(2, 3, S, 24, dtype=torch.float32, seed=3)
    check_against_reference(
        lambda q, k, v: attnlab.attention(q, k, v, mask=mask, backend="flash"),
        reference_for(mask=dense(L, S)),
        [q, k, v],
        mean_factor=mean_factor_for("flash", torch.float32),  # the online-softmax rule
    )


@pytest.mark.parametrize(
    "mask,dense", USER_MASKS, ids=lambda x: repr(x) if isinstance(x, Mask) else ""
)
def test_user_mask_exports_a_flex_mask_mod_equal_to_the_dense_mask(mask, dense):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    L, S = 113, 129
    mod = mask.mask_mod(L, S)
    rendered = flex.create_mask(mod, 1, 1, L, S, device="cpu")[0, 0]
    assert torch.equal(rendered, dense(L, S))
    block = flex.create_block_mask(mod, None, None, L, S, device="cpu")
    q = seeded(1, 2, L, 16, dtype=torch.float32, seed=4)
    k, v = (seeded(1, 2, S, 16, dtype=torch.float32, seed=s) for s in (5, 6))
    got = flex.flex_attention(q, k, v, block_mask=block)
    want = attnlab.attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_library_patterns_state_their_closed_form_once():
    # a band is its one diagonal piece; everything else derives from it
    w = M.sliding_window(5)
    assert w.diagonals() == [(-4, 0, 1, 0)]
    assert w.band() == (-4.0, 0.0)
    assert M.causal().band() == (float("-inf"), 0.0)
    assert M.sliding_window(3, causal=False).band() == (-2.0, 2.0)
    assert M.strided(3).band() is None and len(M.strided(3).diagonals()) == 2
    for name in ("mod", "key_interval", "row_counts", "geometry", "band"):
        for cls in (M.CausalMask, M.SlidingWindowMask, M.StridedMask):
            assert name not in vars(cls), (cls, name)


def test_conjuncts_split_an_and():
    m = M.causal() & M.padding([3, 4]) & M.from_tensor(torch.ones(5, 5, dtype=torch.bool))
    assert m.conjuncts()[0].band() == (float("-inf"), 0.0) and len(m.conjuncts()) == 3
    assert m.batch_heads(2, 3) == (2, 1) and len(m.data_tensors()) == 1


def test_a_mask_without_an_index_function_says_so():
    class Nothing(Mask):
        pass

    with pytest.raises(NotImplementedError, match="Nothing implements neither mod nor diagonals"):
        Nothing().to_dense(2, 2)
