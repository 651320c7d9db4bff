"""Masks own their geometry: one alignment, public band / block_map methods, closed forms.

Every closed-form block map must equal the block map derived from the mask's dense rendering, on
odd sizes with L != S, for each kind and for combinations; structured kinds must not render.
"""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

import attnlab
from attnlab import masks as M
from attnlab._shapes import Dims, align, index_grid, query_positions
from attnlab.functional import reference
from attnlab.functional.flash.tiling import build_plan
from attnlab.functional.request import materialize_bias
from attnlab.masks import EMPTY, FULL, PARTIAL, Mask
from attnlab.positional import dense_bias

SIZES = [(13, 29), (29, 13), (17, 17), (1, 9), (9, 1)]
BLOCKS = [(1, 1), (3, 5), (4, 4), (7, 2), (32, 32)]


def dense_codes(d: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Tile codes of a dense mask, one tile at a time (the definition)."""
    B, H, L, S = d.shape
    nq, nk = -(-L // bq), -(-S // bk)
    out = torch.empty(B, H, nq, nk, dtype=torch.int8)
    for a in range(nq):
        for c in range(nk):
            t = d[:, :, a * bq : (a + 1) * bq, c * bk : (c + 1) * bk].reshape(B, H, -1)
            out[:, :, a, c] = torch.where(t.all(-1), FULL, torch.where(t.any(-1), PARTIAL, EMPTY))
    return out


def kinds(S: int) -> dict[str, Mask]:
    g = torch.Generator().manual_seed(S)
    n1 = max(1, S // 3)
    return {
        "causal": M.causal(),
        "window3": M.sliding_window(3),
        "window4_bidir": M.sliding_window(4, causal=False),
        "window_huge": M.sliding_window(2**70, causal=False),
        "padding_ints": M.padding([max(0, S - 4), S]),
        "padding_tensor": M.padding(torch.tensor([1, S // 2])),
        "strided3": M.strided(3),
        "strided4_bidir": M.strided(4, causal=False),
        "strided_huge": M.strided(2**70),
        "global_local_int": M.global_local(2, 3),
        "global_local_list": M.global_local(3, [0, S // 2, S + 3]),
        "bigbird": M.bigbird(3, 3, 1, 2, seed=5),
        "bigbird_no_random": M.bigbird(4, 1, 0, 0),
        "bigbird_huge_block": M.bigbird(2**70, 1, 1, 0),
        "document_lengths": M.document.from_lengths([n1, S - n1]),
        "document_ids_batched": M.document(torch.randint(0, 3, (2, S), generator=g)),
        "from_fn": M.from_fn(lambda b, h, i, j: (i + j) % 3 == 0),
    }


def combos(S: int) -> dict[str, Mask]:
    k = kinds(S)
    return {
        "strided|padding": k["strided3"] | k["padding_ints"],
        "bigbird&causal": k["bigbird"] & k["causal"],
        "~global_local": ~k["global_local_int"],
        "global_local&document": k["global_local_list"] & k["document_lengths"],
        "(causal|strided)&padding": (k["causal"] | k["strided4_bidir"]) & k["padding_tensor"],
        "window&~bigbird": k["window4_bidir"] & ~k["bigbird_no_random"],
        "from_fn|window": k["from_fn"] | k["window3"],
    }


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("bq,bk", BLOCKS)
@pytest.mark.parametrize("group", [kinds, combos], ids=["kinds", "combos"])
def test_block_map_equals_dense_rendering(group, L, S, bq, bk):
    for name, mask in group(S).items():
        want = dense_codes(mask.to_dense(L, S, batch=2), bq, bk)
        got = mask.block_map(L, S, bq, bk, batch=2)
        assert got.dtype == torch.int8, name
        assert got.shape == want.shape, name  # same (B|1, H|1) as the rendering
        assert torch.equal(got, want), name


def _no_render(self, *args, **kwargs):
    raise AssertionError("a closed-form block map must not render the mask")


@pytest.mark.parametrize(
    "mask",
    [
        M.causal(),
        M.sliding_window(300, causal=False),
        M.padding([5000, 65536]),
        M.strided(128),
        M.global_local(256, 16),
        M.bigbird(64, 3, 2, 3),
        M.document.from_lengths([20000, 45536]),
        M.strided(128) & M.causal(),
        M.bigbird(64, 3, 2, 3) | M.padding([100, 200]),
        ~M.global_local(256, 16),
    ],
    ids=repr,
)
def test_structured_block_maps_are_closed_form_at_64k(mask, monkeypatch):
    L = S = 65536
    monkeypatch.setattr(Mask, "_dense_block_map", _no_render)
    monkeypatch.setattr(Mask, "eval_rows", _no_render)
    start = time.perf_counter()
    codes = mask.block_map(L, S, 128, 128)
    assert codes.shape[-2:] == (512, 512)
    assert time.perf_counter() - start < 10.0
    # spot-check one row of tiles against the exact evaluation of that row block
    monkeypatch.undo()
    b, h, i, j = index_grid(2 if mask.batch_size else 1, 1, L, S, rows=torch.arange(896, 1024))
    rows = mask.evaluate(b, h, i, j, L, S).expand(b.shape[0], 1, 128, S)  # query block 7
    tiles = rows.reshape(rows.shape[0], 1, 128, S // 128, 128).transpose(2, 3).flatten(3)
    want = torch.where(tiles.all(-1), FULL, torch.where(tiles.any(-1), PARTIAL, EMPTY))
    assert torch.equal(codes[:, :, 7].expand_as(want), want)


def test_band_of_each_kind_and_combinator():
    inf = float("inf")
    assert M.causal().band() == (-inf, 0.0)
    assert M.sliding_window(4).band() == (-3.0, 0.0)
    assert M.sliding_window(4, causal=False).band() == (-3.0, 3.0)
    assert (M.sliding_window(4, causal=False) & M.causal()).band() == (-3.0, 0.0)
    assert (M.sliding_window(6) & M.sliding_window(3, causal=False)).band() == (-2.0, 0.0)
    for mask in [
        M.causal() | M.sliding_window(2),
        ~M.causal(),
        M.causal() & M.padding([3]),
        M.strided(2),
        M.global_local(2, 1),
        M.bigbird(2, 1, 1, 0),
        M.from_fn(lambda b, h, i, j: j <= i),
    ]:
        assert mask.band() is None, repr(mask)


def test_alignment_is_one_function():
    assert align(torch.tensor([0, 2]), 3, 5).tolist() == [2, 4]
    assert query_positions(3, 5).tolist() == [2, 3, 4]
    assert query_positions(5, 3).tolist() == [-2, -1, 0, 1, 2]
    assert torch.equal(Mask.positions(4, 7), query_positions(4, 7))
    b, h, i, j = index_grid(2, 3, 4, 6)
    assert (b.shape, h.shape, i.shape, j.shape) == (
        (2, 1, 1, 1),
        (1, 3, 1, 1),
        (1, 1, 4, 1),
        (1, 1, 1, 6),
    )
    assert i.flatten().tolist() == [2, 3, 4, 5]
    _, _, raw, keys = index_grid(1, 1, 4, 6, rows=torch.tensor([1, 3]), aligned=False)
    assert raw.flatten().tolist() == [1, 3] and keys.flatten().tolist() == list(range(6))


def test_bias_functions_and_masks_see_the_same_positions():
    def rel(b, h, i, j):
        return (j - i).double() + 100 * h.double()

    L, S, H = 3, 7, 2
    dims = Dims(B=1, H=H, H_kv=H, L=L, S=S, D=4, Dv=4, three_d=False)
    full = materialize_bias(rel, dims, torch.float64, torch.device("cpu"))
    assert torch.equal(full.expand(1, H, L, S)[0], dense_bias(rel, H, L, S))
    # the last query row sits on the last key: j − p = 0 there, for the bias and for from_fn
    assert full[0, 0, -1, -1].item() == 0.0
    diag = M.from_fn(lambda b, h, i, j: j == i).to_dense(L, S)[0, 0]
    assert torch.equal(diag, full[0, 0] == 0)


class Tridiagonal(Mask):
    """A user mask on aligned positions that declares its band."""

    def mod(self, b, h, p, j, S):
        return (j - p).abs() <= 1

    def band(self):
        return (-1.0, 1.0)


def test_user_mask_with_band_gets_the_band_plan_and_exact_output():
    mask = Tridiagonal()
    L, S = 70, 91
    assert torch.equal(
        mask.to_dense(L, S)[0, 0],
        torch.ones(L, S, dtype=torch.bool).triu(S - L - 1).tril(S - L + 1),
    )
    plan = build_plan(mask, B=1, H=2, L=L, S=S, block_q=64, block_k=64, band_block=16, bias=None)
    assert plan.kind == "band"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, S, 8, generator=g, dtype=torch.float64)
    out = attnlab.attention(q, k, v, mask=mask, backend="flash")
    want = reference.attention(q, k, v, mask=mask.to_dense(L, S))[0]
    torch.testing.assert_close(out, want)


def test_no_private_mask_classes_outside_masks():
    src = pathlib.Path(attnlab.__file__).parent
    for path in src.rglob("*.py"):
        if path.parent.name == "masks":
            continue
        text = path.read_text()
        for name in ("_Combined", "_Not"):
            assert name not in text, f"{path.relative_to(src)} uses {name}"
