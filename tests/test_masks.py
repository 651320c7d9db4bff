"""Tests for `attnlab.masks` (RELIABILITY.md section E, H6).

Every pattern is checked against grids drawn by hand from its definition, and every derived quantity
(block map, row counts, attended pairs, density) against a brute-force computation on the dense
mask. Alignment is bottom-right: query row ``r`` sits at key position ``p = r + S - L``.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import attention as M_attention
from attnlab import masks as M
from attnlab.masks import EMPTY, FULL, PARTIAL, Mask
from attnlab.masks import base as masks_base

# ----------------------------------------------------------------------------- helpers


def grid(text: str) -> torch.Tensor:
    """Parses a hand-drawn ■ (attend) / ⬚ (masked) picture into an (L, S) bool tensor."""
    rows = [line.split() for line in text.strip().splitlines()]
    assert all(c in ("■", "⬚") for r in rows for c in r)
    assert len({len(r) for r in rows}) <= 1
    return torch.tensor([[c == "■" for c in r] for r in rows], dtype=torch.bool).view(
        len(rows), len(rows[0]) if rows else 0
    )


def dense(mask: Mask, L: int, S: int, **kw) -> torch.Tensor:
    """The mask materialised to its full (B, H, L, S) shape."""
    d = mask.to_dense(L, S, **kw)
    assert d.dtype == torch.bool
    assert d.dim() == 4 and d.shape[-2:] == (L, S)
    return d


def expand_bh(d: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    return d.expand(batch, heads, d.shape[2], d.shape[3])


def declared(mask: Mask, d: torch.Tensor) -> torch.Tensor:
    """The dense mask over the (B, H) grid the mask declares (its batch_size / num_heads)."""
    return expand_bh(d, mask.batch_size or d.shape[0], mask.num_heads or d.shape[1])


def brute_block_map(d: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Classifies tiles one by one, looking only at the positions that exist."""
    B, H, L, S = d.shape
    nq, nk = -(-L // bq), -(-S // bk)
    out = torch.empty(B, H, nq, nk, dtype=torch.int8)
    for qi in range(nq):
        for ki in range(nk):
            tile = d[:, :, qi * bq : (qi + 1) * bq, ki * bk : (ki + 1) * bk].reshape(B, H, -1)
            anyv, allv = tile.any(-1), tile.all(-1)
            out[:, :, qi, ki] = torch.where(
                allv,
                torch.tensor(FULL, dtype=torch.int8),
                torch.where(anyv, torch.tensor(PARTIAL, dtype=torch.int8), EMPTY),
            )
    return out


def aligned_causal(L: int, S: int) -> torch.Tensor:
    """Bottom-right causal written out element by element: j <= r + S - L."""
    out = torch.zeros(L, S, dtype=torch.bool)
    for r in range(L):
        for j in range(S):
            out[r, j] = j <= r + S - L
    return out


def doc_ids(S: int) -> torch.Tensor:
    """Packed documents of lengths 1, 2, 3, 4, 1, 2, ... truncated to S positions."""
    ids: list[int] = []
    d = 0
    while len(ids) < S:
        ids += [d] * (d % 4 + 1)
        d += 1
    return torch.tensor(ids[:S], dtype=torch.long)


def rand_bool(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) < 0.5


# Every pattern and a few combinations, each built for the (L, S) it will be rendered at (document
# ids and tensors have a fixed size; the others ignore L and S).
PATTERNS = {
    "causal": lambda L, S: M.causal(),
    "window1": lambda L, S: M.sliding_window(1),
    "window3": lambda L, S: M.sliding_window(3),
    "window5_bidir": lambda L, S: M.sliding_window(5, causal=False),
    "window_huge": lambda L, S: M.sliding_window(4096),
    "padding": lambda L, S: M.padding([S, S // 2, 0, max(S - 3, 0)]),
    "strided3": lambda L, S: M.strided(3),
    "strided4_bidir": lambda L, S: M.strided(4, causal=False),
    "global_local_count": lambda L, S: M.global_local(2, 2),
    "global_local_list": lambda L, S: M.global_local(3, [1, 7, 30]),
    "bigbird": lambda L, S: M.bigbird(4, 3, 1, 2, seed=0),
    "bigbird_noglobal": lambda L, S: M.bigbird(3, 1, 0, 1, seed=7),
    "document": lambda L, S: M.document(doc_ids(S)),
    "document_batched": lambda L, S: M.document(torch.stack([doc_ids(S), doc_ids(S).flip(0)])),
    "tensor": lambda L, S: M.from_tensor(rand_bool(L, S, seed=L * 1000 + S)),
    "tensor_keys_batched": lambda L, S: M.from_tensor(rand_bool(2, 1, 1, S, seed=S)),
    "fn_heads": lambda L, S: M.from_fn(
        lambda b, h, i, j: (i - j).remainder(h + 2) == 0, num_heads=3
    ),
    "causal&padding": lambda L, S: M.causal() & M.padding([S - S // 3, 1]),
    "document&causal": lambda L, S: M.document(doc_ids(S)) & M.causal(),
    "window|global": lambda L, S: M.sliding_window(2) | M.global_local(1, [0]),
    "~strided": lambda L, S: ~M.strided(3),
    "bigbird&~padding": lambda L, S: M.bigbird(2, 1, 1, 1, seed=1) & ~M.padding([S // 3, S]),
    "tensor|(causal&fn)": lambda L, S: (
        M.from_tensor(rand_bool(L, S, seed=7))
        | (M.causal() & M.from_fn(lambda b, h, i, j: (i + j) % 3 == b, batch_size=2))
    ),
}
# Patterns whose index function is defined on positions (not a fixed L × S tensor).
POSITIONAL = [k for k in PATTERNS if not k.startswith("tensor")]


# ----------------------------------------------------------------------------- hand-drawn grids


@pytest.mark.parametrize(
    ("mask", "L", "S", "picture"),
    [
        pytest.param(
            M.causal(), 4, 4,
            """
            ■ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚
            ■ ■ ■ ⬚
            ■ ■ ■ ■
            """,
            id="causal",
        ),
        pytest.param(
            M.causal(), 2, 4,
            """
            ■ ■ ■ ⬚
            ■ ■ ■ ■
            """,
            id="causal_L<S",
        ),
        pytest.param(
            M.causal(), 4, 2,
            """
            ⬚ ⬚
            ⬚ ⬚
            ■ ⬚
            ■ ■
            """,
            id="causal_L>S",
        ),
        pytest.param(
            M.sliding_window(2), 4, 4,
            """
            ■ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚
            ⬚ ■ ■ ⬚
            ⬚ ⬚ ■ ■
            """,
            id="window2",
        ),
        pytest.param(
            M.sliding_window(2, causal=False), 5, 5,
            """
            ■ ■ ⬚ ⬚ ⬚
            ■ ■ ■ ⬚ ⬚
            ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ■ ■ ■
            ⬚ ⬚ ⬚ ■ ■
            """,
            id="window2_bidir",
        ),
        pytest.param(
            M.sliding_window(3), 3, 6,
            """
            ⬚ ■ ■ ■ ⬚ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ⬚ ■ ■ ■
            """,
            id="window3_L<S",
        ),
        # Child et al. 2019, strided: A1 = {max(0, i-l), ..., i}, A2 = {j : (i - j) mod l = 0}.
        pytest.param(
            M.strided(3), 9, 9,
            """
            ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚
            ⬚ ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚
            ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚ ⬚
            ■ ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚
            ⬚ ■ ⬚ ⬚ ■ ■ ■ ■ ⬚
            ⬚ ⬚ ■ ⬚ ⬚ ■ ■ ■ ■
            """,
            id="strided3",
        ),
        pytest.param(
            M.strided(2, causal=False), 6, 6,
            """
            ■ ■ ■ ⬚ ■ ⬚
            ■ ■ ■ ■ ⬚ ■
            ■ ■ ■ ■ ■ ⬚
            ⬚ ■ ■ ■ ■ ■
            ■ ⬚ ■ ■ ■ ■
            ⬚ ■ ⬚ ■ ■ ■
            """,
            id="strided2_bidir",
        ),
        # Longformer: band |i - j| < w, global rows and columns.
        pytest.param(
            M.global_local(2, [0, 5]), 7, 7,
            """
            ■ ■ ■ ■ ■ ■ ■
            ■ ■ ■ ⬚ ⬚ ■ ⬚
            ■ ■ ■ ■ ⬚ ■ ⬚
            ■ ⬚ ■ ■ ■ ■ ⬚
            ■ ⬚ ⬚ ■ ■ ■ ⬚
            ■ ■ ■ ■ ■ ■ ■
            ■ ⬚ ⬚ ⬚ ⬚ ■ ■
            """,
            id="global_local_list",
        ),
        pytest.param(
            M.global_local(1, 2), 5, 5,
            """
            ■ ■ ■ ■ ■
            ■ ■ ■ ■ ■
            ■ ■ ■ ⬚ ⬚
            ■ ■ ⬚ ■ ⬚
            ■ ■ ⬚ ⬚ ■
            """,
            id="global_local_count",
        ),
        # BigBird, blocks of 2, window of one block, block 0 global.
        pytest.param(
            M.bigbird(2, 1, 1, 0), 8, 8,
            """
            ■ ■ ■ ■ ■ ■ ■ ■
            ■ ■ ■ ■ ■ ■ ■ ■
            ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚
            ■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚ ■ ■ ⬚ ⬚
            ■ ■ ⬚ ⬚ ■ ■ ⬚ ⬚
            ■ ■ ⬚ ⬚ ⬚ ⬚ ■ ■
            ■ ■ ⬚ ⬚ ⬚ ⬚ ■ ■
            """,
            id="bigbird_w1",
        ),
        # Window of three blocks; S = 9 leaves a ragged last block of one position.
        pytest.param(
            M.bigbird(2, 3, 1, 0), 9, 9,
            """
            ■ ■ ■ ■ ■ ■ ■ ■ ■
            ■ ■ ■ ■ ■ ■ ■ ■ ■
            ■ ■ ■ ■ ■ ■ ⬚ ⬚ ⬚
            ■ ■ ■ ■ ■ ■ ⬚ ⬚ ⬚
            ■ ■ ■ ■ ■ ■ ■ ■ ⬚
            ■ ■ ■ ■ ■ ■ ■ ■ ⬚
            ■ ■ ⬚ ⬚ ■ ■ ■ ■ ■
            ■ ■ ⬚ ⬚ ■ ■ ■ ■ ■
            ■ ■ ⬚ ⬚ ⬚ ⬚ ■ ■ ■
            """,
            id="bigbird_w3_ragged",
        ),
        pytest.param(
            M.document([0, 0, 1, 1, 1, 2]), 6, 6,
            """
            ■ ■ ⬚ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚ ⬚ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ⬚ ⬚ ⬚ ■
            """,
            id="document",
        ),
        pytest.param(
            M.document([0, 0, 1, 1, 1, 2]), 3, 6,
            """
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ⬚ ⬚ ⬚ ■
            """,
            id="document_L<S",
        ),
        pytest.param(
            M.document([0, 0, 1]), 4, 3,
            """
            ⬚ ⬚ ⬚
            ■ ■ ⬚
            ■ ■ ⬚
            ⬚ ⬚ ■
            """,
            id="document_L>S",
        ),
        pytest.param(
            M.document([0, 0, 1, 1, 1, 2]) & M.causal(), 6, 6,
            """
            ■ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚ ⬚ ⬚
            ⬚ ⬚ ■ ⬚ ⬚ ⬚
            ⬚ ⬚ ■ ■ ⬚ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ⬚ ⬚ ⬚ ■
            """,
            id="document&causal",
        ),
    ],
)  # fmt: skip
def test_hand_drawn_grid(mask, L, S, picture):
    expected = grid(picture)
    assert expected.shape == (L, S)
    d = dense(mask, L, S)
    assert d.shape == (1, 1, L, S)
    assert torch.equal(d[0, 0], expected)
    assert mask.render(L, S) == "\n".join(
        " ".join(c for c in line.split()) for line in picture.strip().splitlines()
    )


def test_padding_grid_per_batch_item():
    d = dense(M.padding([2, 4, 0]), 2, 4)
    assert d.shape == (3, 1, 2, 4)
    assert torch.equal(d[0, 0], grid("■ ■ ⬚ ⬚\n■ ■ ⬚ ⬚"))
    assert torch.equal(d[1, 0], grid("■ ■ ■ ■\n■ ■ ■ ■"))
    assert torch.equal(d[2, 0], grid("⬚ ⬚ ⬚ ⬚\n⬚ ⬚ ⬚ ⬚"))
    # Lengths beyond S keep every key.
    assert dense(M.padding([9]), 3, 4).all()


def test_bigbird_block_structure_with_random_blocks():
    # Blocks of 3 over 10 query blocks; BigBird's windows at block level are uniform tiles.
    bs, nblk = 3, 10
    m = M.bigbird(bs, 3, 1, 2, seed=11)
    d = dense(m, bs * nblk, bs * nblk)[0, 0]
    blk = d[::bs, ::bs]
    assert torch.equal(d, blk.repeat_interleave(bs, 0).repeat_interleave(bs, 1))
    qb = torch.arange(nblk).view(-1, 1)
    kb = torch.arange(nblk).view(1, -1)
    structural = ((qb - kb).abs() <= 1) | (qb < 1) | (kb < 1)
    assert (blk | ~structural).all()  # window and global always attended
    extra = blk & ~structural
    assert extra[0].sum() == 0  # the global block row has nothing "extra"
    assert extra[1:].sum(1).tolist() == [2] * (nblk - 1)  # exactly random_blocks per query block
    assert torch.equal(m.random_table(nblk), extra)  # the table never overlaps window/global


def test_bigbird_random_blocks_when_not_enough_free():
    # 4 blocks, window 3: query block 1 has no free block, block 2 and 3 have one or two free.
    m = M.bigbird(2, 3, 1, 5, seed=0)
    blk = dense(m, 8, 8)[0, 0, ::2, ::2]
    assert blk.all(), "with 5 random blocks wanted, every free block must be taken"
    m = M.bigbird(2, 1, 0, 1, seed=3)
    blk = dense(m, 8, 8)[0, 0, ::2, ::2]
    assert torch.equal(blk.sum(1), torch.tensor([2, 2, 2, 2]))  # diagonal + one random each
    assert blk.diagonal().all()


def test_bigbird_random_is_deterministic_and_seeded():
    a = dense(M.bigbird(2, 3, 1, 2, seed=5), 40, 40)
    b = dense(M.bigbird(2, 3, 1, 2, seed=5), 40, 40)
    m = M.bigbird(2, 3, 1, 2, seed=5)
    assert torch.equal(a, b)
    assert torch.equal(dense(m, 40, 40), dense(m, 40, 40))
    others = [dense(M.bigbird(2, 3, 1, 2, seed=s), 40, 40) for s in (6, 7)]
    assert not torch.equal(a, others[0])
    assert not torch.equal(others[0], others[1])
    # random_blocks=0 has nothing random: every seed gives the same mask.
    assert torch.equal(dense(M.bigbird(2, 3, 1, 0, seed=1), 20, 20),
                       dense(M.bigbird(2, 3, 1, 0, seed=2), 20, 20))  # fmt: skip


# ----------------------------------------------------------------------------- E1 sliding window


@pytest.mark.parametrize("w", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("L", "S"), [(1, 1), (7, 7), (16, 16), (5, 16), (16, 5)])
def test_e1_causal_window_keys_exactly(w, L, S):
    d = dense(M.sliding_window(w), L, S)[0, 0]
    for r in range(L):
        p = r + S - L
        keys = torch.nonzero(d[r]).flatten().tolist()
        assert keys == [j for j in range(S) if p - w < j <= p]
        if p >= w - 1:
            assert len(keys) == w and keys[-1] == p  # w keys, including itself once
    counts = M.sliding_window(w).row_counts(L, S)
    assert torch.equal(counts[0, 0], d.sum(-1))


def test_e1_window_one_is_the_diagonal_and_big_window_is_causal():
    assert torch.equal(dense(M.sliding_window(1), 9, 9)[0, 0], torch.eye(9, dtype=torch.bool))
    for L, S in [(9, 9), (4, 9), (9, 4), (1, 9)]:
        for w in (S, S + 1, 1000):
            assert torch.equal(dense(M.sliding_window(w), L, S), dense(M.causal(), L, S))
            assert torch.equal(M.sliding_window(w).row_counts(L, S), M.causal().row_counts(L, S))
        # w = S - 1 is not causal any more when the last row sees all S keys.
        if L >= 1 and S >= 2:
            assert not torch.equal(dense(M.sliding_window(S - 1), L, S), dense(M.causal(), L, S))


@pytest.mark.parametrize("w", [0, -1, -5])
def test_e1_non_positive_window_raises(w):
    with pytest.raises(ValueError, match=rf"window must be >= 1, got {w}"):
        M.sliding_window(w)
    with pytest.raises(ValueError, match=rf"window must be >= 1, got {w}"):
        M.sliding_window(w, causal=False)


@pytest.mark.parametrize("w", [1, 2, 4])
def test_e1_non_causal_window(w):
    L, S = 6, 9
    d = dense(M.sliding_window(w, causal=False), L, S)[0, 0]
    for r in range(L):
        p = r + S - L
        assert torch.nonzero(d[r]).flatten().tolist() == [j for j in range(S) if abs(p - j) < w]


# ----------------------------------------------------------------------------- E2 block maps


def test_block_map_hand_computed():
    bm = M.causal().block_map(5, 5, 2, 2)
    assert bm.dtype == torch.int8
    assert bm[0, 0].tolist() == [
        [PARTIAL, EMPTY, EMPTY],
        [FULL, PARTIAL, EMPTY],
        [FULL, FULL, FULL],  # the ragged corner tile (4, 4) exists only as one attended cell
    ]
    assert (EMPTY, PARTIAL, FULL) == (0, 1, 2)


BLOCK_CASES = [
    (1023, 1023, 64, 64),
    (1023, 1025, 128, 100),
    (64, 63, 16, 16),
    (65, 64, 16, 16),
    (17, 33, 4, 8),
    (33, 17, 8, 4),
    (7, 7, 3, 3),
    (1, 1, 1, 1),
    (5, 9, 16, 16),
    (0, 5, 2, 2),
    (5, 0, 2, 2),
]


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize(("L", "S", "bq", "bk"), BLOCK_CASES, ids=lambda v: str(v))
def test_e2_block_map_equals_brute_force(name, L, S, bq, bk):
    mask = PATTERNS[name](L, S)
    d = dense(mask, L, S)
    bm = mask.block_map(L, S, bq, bk)
    assert bm.dtype == torch.int8
    assert bm.shape[-2:] == (-(-L // bq), -(-S // bk))
    assert torch.equal(bm.expand(d.shape[0], d.shape[1], -1, -1), brute_block_map(d, bq, bk))


@pytest.mark.parametrize(
    "mask",
    [
        M.causal() & ~M.causal(),
        M.from_fn(lambda b, h, i, j: j < 0),
        M.padding([0, 0]),
        M.from_tensor(torch.zeros(37, 29, dtype=torch.bool)),
    ],
    ids=["causal&~causal", "fn_false", "padding0", "tensor_zeros"],
)
def test_e2_all_false_mask_is_all_empty(mask):
    bm = mask.block_map(37, 29, 8, 5)
    assert bm.shape[-2:] == (5, 6)
    assert (bm == EMPTY).all()
    assert mask.attended_pairs(37, 29) == 0
    assert mask.density(37, 29) == 0.0


def test_e2_all_true_mask_is_all_full_including_ragged_tiles():
    for mask in (~(M.causal() & ~M.causal()), M.sliding_window(100, causal=False)):
        bm = mask.block_map(37, 29, 8, 5)
        assert (bm == FULL).all()


def test_block_map_batch_dependent_shape():
    bm = M.padding([3, 8]).block_map(6, 8, 4, 4)
    assert bm.shape == (2, 1, 2, 2)
    assert bm[0, 0].tolist() == [[PARTIAL, EMPTY], [PARTIAL, EMPTY]]
    assert bm[1, 0].tolist() == [[FULL, FULL], [FULL, FULL]]


@pytest.mark.parametrize("name", list(PATTERNS))
def test_chunked_evaluation_matches_unchunked(name, monkeypatch):
    # Force many small row chunks (with chunk sizes not dividing L) and compare against the
    # single-chunk result.
    L, S = 37, 29
    mask = PATTERNS[name](L, S)
    ref_bm = mask.block_map(L, S, 8, 4)
    ref_counts = Mask.row_counts(mask, L, S)
    monkeypatch.setattr(masks_base, "_CHUNK_ELEMENTS", 50)
    assert torch.equal(mask.block_map(L, S, 8, 4), ref_bm)
    assert torch.equal(mask.block_map(L, S, 3, 7), brute_block_map(dense(mask, L, S), 3, 7))
    assert torch.equal(Mask.row_counts(mask, L, S), ref_counts)
    assert torch.equal(ref_counts.expand(*dense(mask, L, S).shape[:3]), dense(mask, L, S).sum(-1))


# ----------------------------------------------------------------------------- E3 padding + causal


def test_e3_causal_with_arbitrary_padding():
    key_valid = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1],  # left padding
            [1, 0, 1, 0, 1, 1],  # holes
            [1, 1, 1, 1, 0, 0],  # right padding
        ],
        dtype=torch.bool,
    )
    for L in (6, 4, 8):
        S = 6
        m = M.causal() & M.from_tensor(key_valid[:, None, None, :])
        expected = aligned_causal(L, S)[None, None] & key_valid[:, None, None, :]
        assert torch.equal(dense(m, L, S), expected)
        # The other order, and a bool tensor on the left, give the same mask.
        m2 = key_valid[:, None, None, :] & M.causal()
        assert torch.equal(dense(m2, L, S), expected)
        assert torch.equal(m.row_counts(L, S), expected.sum(-1))
    # Drawn by hand for the item with holes.
    d = dense(M.causal() & M.from_tensor(key_valid[:, None, None, :]), 6, 6)
    assert torch.equal(
        d[1, 0],
        grid(
            """
            ■ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ⬚ ■ ⬚ ⬚ ⬚
            ■ ⬚ ■ ⬚ ⬚ ⬚
            ■ ⬚ ■ ⬚ ■ ⬚
            ■ ⬚ ■ ⬚ ■ ■
            """
        ),
    )
    # Left padding + causal leaves the first rows with no key at all.
    assert d[0, 0].sum(-1).tolist() == [0, 0, 1, 2, 3, 4]


def test_e3_causal_with_padding_lengths():
    lengths = [5, 2, 0, 7]
    for L, S in [(6, 6), (3, 6), (8, 6)]:
        m = M.padding(lengths) & M.causal()
        key_valid = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
        expected = aligned_causal(L, S)[None, None] & key_valid[:, None, None, :]
        assert torch.equal(dense(m, L, S), expected)
        assert m.attended_pairs(L, S) == int(expected.sum())


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize(("L", "S"), [(1, 9), (3, 9), (9, 9), (12, 9), (9, 1), (0, 4), (4, 0)])
def test_causal_bottom_right_alignment(L, S):
    d = dense(M.causal(), L, S)[0, 0]
    assert torch.equal(d, aligned_causal(L, S))
    if L > 0 and S > 0:
        assert d[-1].all()  # the last query sees every key
    if L > S:
        assert not d[: L - S].any()  # rows before the first key position see nothing
        assert M.causal().row_counts(L, S)[0, 0, : L - S].eq(0).all()
    if L == S:
        assert torch.equal(d, torch.ones(L, S, dtype=torch.bool).tril())
    # from_fn receives the aligned query position: i >= j is bottom-right causal.
    assert torch.equal(dense(M.from_fn(lambda b, h, i, j: j <= i), L, S)[0, 0], d)


@pytest.mark.parametrize("name", POSITIONAL)
def test_bottom_right_rows_are_the_last_rows_of_the_square(name):
    # A query row's pattern depends only on its aligned position r + S - L.
    S = 23
    mask = PATTERNS[name](S, S)
    full = dense(mask, S, S)
    for L in (1, 5, 22):
        assert torch.equal(dense(mask, L, S), full[:, :, S - L :])
    tall = dense(mask, S + 4, S)
    assert torch.equal(tall[:, :, 4:], full)


def test_causal_rows_without_keys_when_l_greater_than_s():
    for mask in (M.causal(), M.sliding_window(3), M.strided(2), M.document([0, 1, 1])):
        d = dense(mask, 5, 3)
        assert not d[..., :2, :].any()
        assert mask.row_counts(5, 3)[..., :2].eq(0).all()


# ----------------------------------------------------------------------------- combinators


COMBO_PAIRS = [
    ("causal", "padding"),
    ("window5_bidir", "strided3"),
    ("document_batched", "fn_heads"),
    ("bigbird", "global_local_list"),
    ("tensor_keys_batched", "window3"),
    ("padding", "document"),
]


@pytest.mark.parametrize(("x", "y"), COMBO_PAIRS)
@pytest.mark.parametrize(("L", "S"), [(11, 13), (13, 11), (8, 8)])
def test_combinators_equal_elementwise_ops(x, y, L, S):
    a, b = PATTERNS[x](L, S), PATTERNS[y](L, S)
    da, db = dense(a, L, S), dense(b, L, S)
    assert torch.equal(dense(a & b, L, S), da & db)
    assert torch.equal(dense(a | b, L, S), da | db)
    assert torch.equal(dense(~a, L, S), ~da)
    assert torch.equal(dense(~(a & b) | a, L, S), ~(da & db) | da)
    for combo, ref in ((a & b, da & db), (a | ~b, da | ~db)):
        ref = declared(combo, ref)
        B, H = ref.shape[:2]
        assert combo.attended_pairs(L, S) == int(ref.sum())
        assert combo.density(L, S) == pytest.approx(int(ref.sum()) / (B * H * L * S))


def test_combine_batch_one_broadcasts_over_any_batch():
    # padding of one length is batch-independent enough to combine with a batch of 3.
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]])
    m = M.padding([3]) & M.document(ids)
    d = dense(m, 4, 4)
    assert d.shape == (3, 1, 4, 4)
    assert torch.equal(d, dense(M.padding([3]), 4, 4) & dense(M.document(ids), 4, 4))
    m = M.padding([2]) | M.padding([1, 3])
    assert dense(m, 2, 4)[:, 0, 0].tolist() == [
        [True, True, False, False],
        [True, True, True, False],
    ]


def test_combine_incompatible_batch_or_heads_raises():
    with pytest.raises(ValueError, match=r"batch_size=2.*batch_size=3"):
        M.padding([1, 2]) & M.padding([1, 2, 3])
    with pytest.raises(ValueError, match=r"batch_size=3.*batch_size=2"):
        M.padding([1, 2, 3]) | M.document(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"num_heads=2.*num_heads=3"):
        M.from_fn(lambda b, h, i, j: j <= i, num_heads=2) & M.from_tensor(
            torch.ones(1, 3, 4, 4, dtype=torch.bool)
        )


def test_combine_with_bool_tensor_both_sides():
    t = rand_bool(5, 7, seed=3)
    c = aligned_causal(5, 7)
    assert torch.equal(dense(M.causal() & t, 5, 7)[0, 0], c & t)
    assert torch.equal(dense(t & M.causal(), 5, 7)[0, 0], c & t)
    assert torch.equal(dense(M.causal() | t, 5, 7)[0, 0], c | t)
    assert torch.equal(dense(t | M.causal(), 5, 7)[0, 0], c | t)
    assert isinstance(t & M.causal(), Mask)


@pytest.mark.parametrize("other", [torch.ones(3, 3), torch.ones(3, 3, dtype=torch.uint8), 1, None])
def test_combine_with_non_mask_raises_type_error(other):
    with pytest.raises(TypeError, match="cannot combine a Mask"):
        M.causal() & other
    with pytest.raises(TypeError, match="cannot combine a Mask"):
        M.causal() | other


# ----------------------------------------------------------------------------- counting


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize(("L", "S"), [(1, 1), (17, 17), (9, 31), (31, 9), (0, 5), (5, 0)])
def test_attended_pairs_and_density_equal_dense_counts(name, L, S):
    mask = PATTERNS[name](L, S)
    d = declared(mask, dense(mask, L, S))
    B, H = d.shape[:2]
    assert mask.attended_pairs(L, S) == int(d.sum())
    assert mask.density(L, S) == (pytest.approx(int(d.sum()) / (B * H * L * S)) if L * S else 0.0)
    counts = mask.row_counts(L, S)
    assert counts.dtype == torch.long
    assert torch.equal(counts.expand(B, H, L), d.sum(-1))
    # Over an explicit (batch, heads) grid: a dimension the mask does not depend on multiplies.
    batch = B if mask.batch_size not in (None, 1) else 3
    heads = H if mask.num_heads not in (None, 1) else 2
    total = int(expand_bh(d, batch, heads).sum())
    assert mask.attended_pairs(L, S, batch=batch, heads=heads) == total
    if L * S:
        assert mask.density(L, S, batch=batch, heads=heads) == pytest.approx(
            total / (batch * heads * L * S)
        )


def test_attended_pairs_with_batch_and_heads_by_hand():
    assert M.causal().attended_pairs(4, 4) == 10
    assert M.causal().attended_pairs(4, 4, batch=3, heads=2) == 60
    assert M.causal().density(4, 4, batch=3, heads=2) == pytest.approx(10 / 16)
    assert M.padding([1, 4]).attended_pairs(3, 4) == 3 * 1 + 3 * 4
    assert M.padding([1, 4]).attended_pairs(3, 4, heads=5) == 5 * 15
    assert M.padding([1, 4]).density(3, 4) == pytest.approx(15 / 24)
    fn = M.from_fn(lambda b, h, i, j: j <= h, num_heads=3)
    assert fn.attended_pairs(2, 4) == 2 * (1 + 2 + 3)
    # Counts cover the declared grid even where fn ignores b (its dense form may broadcast).
    assert M.from_fn(lambda b, h, i, j: j <= i, batch_size=2).attended_pairs(3, 3) == 2 * 6
    assert M.padding([1, 4]).row_counts(0, 4).shape == (2, 1, 0)
    assert M.padding([1, 4]).block_map(0, 4, 2, 2).shape == (2, 1, 0, 2)
    with pytest.raises(ValueError, match=r"batch of 2.*batch=3"):
        M.padding([1, 4]).attended_pairs(3, 4, batch=3)
    with pytest.raises(ValueError, match=r"expected 3 heads.*heads=2"):
        fn.attended_pairs(2, 4, heads=2)


CLOSED_FORMS = [
    M.causal(),
    M.sliding_window(1),
    M.sliding_window(3),
    M.sliding_window(7),
    M.sliding_window(2, causal=False),
    M.sliding_window(5, causal=False),
    M.padding([0, 3, 7, 50]),
    M.padding([4]),
]


@pytest.mark.parametrize("mask", CLOSED_FORMS, ids=repr)
def test_closed_form_row_counts_equal_generic(mask):
    # the counts come from the key interval the pattern derives from its closed form
    assert mask.key_interval(5, 7) is not None
    for L in range(0, 19):
        for S in range(0, 19):
            fast = mask.row_counts(L, S)
            slow = mask.to_dense(L, S).sum(-1)
            assert fast.dtype == slow.dtype == torch.long
            assert fast.shape == slow.shape and fast.shape[-1] == L, (L, S)
            assert torch.equal(fast, slow), (L, S)
    for L, S in [(1000, 37), (37, 1000), (513, 513)]:
        assert torch.equal(mask.row_counts(L, S), Mask.row_counts(mask, L, S))


def _no_dense(self, *args, **kwargs):
    raise AssertionError("a closed form must not evaluate the index function")


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (M.causal(), 65536 * 65537 // 2),
        (M.sliding_window(256), 256 * 257 // 2 + (65536 - 256) * 256),
        (M.sliding_window(256, causal=False), 65536 * 511 - 255 * 256),
        (M.padding([65536, 1000]), 65536 * (65536 + 1000)),
    ],
    ids=repr,
)
def test_attended_pairs_closed_form_at_64k(mask, expected, monkeypatch):
    monkeypatch.setattr(Mask, "eval_rows", _no_dense)
    start = time.perf_counter()
    assert mask.attended_pairs(65536, 65536) == expected
    assert mask.density(65536, 65536, heads=4) == pytest.approx(
        expected / (65536 * 65536 * (mask.batch_size or 1))
    )
    assert time.perf_counter() - start < 5.0


# ----------------------------------------------------------------------------- dense shapes


def test_to_dense_shapes():
    assert dense(M.causal(), 3, 5).shape == (1, 1, 3, 5)
    assert dense(M.causal(), 3, 5, batch=4, heads=2).shape == (1, 1, 3, 5)  # broadcastable
    assert dense(M.padding([1, 2, 3]), 3, 5).shape == (3, 1, 3, 5)
    assert dense(M.padding([1, 2, 3]), 3, 5, batch=3).shape == (3, 1, 3, 5)
    assert dense(M.from_fn(lambda b, h, i, j: j <= i + h, num_heads=2), 3, 5).shape == (1, 2, 3, 5)
    # An fn that ignores h may stay broadcastable over the heads it declares.
    assert dense(M.from_fn(lambda b, h, i, j: j <= i, num_heads=2), 3, 5).shape[1] in (1, 2)
    assert dense(M.causal() & M.padding([1, 2]), 0, 5).shape == (2, 1, 0, 5)
    assert dense(M.from_tensor(torch.ones(2, 3, dtype=torch.bool)), 2, 3).shape == (1, 1, 2, 3)
    t = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    assert dense(M.from_tensor(t), 4, 3).shape == (2, 1, 4, 3)  # L broadcast


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: M.padding([1, 2]).to_dense(3, 3, batch=5), r"batch of 2.*batch=5"),
        (lambda: M.padding([1, 2]).row_counts(3, 3, batch=5), r"batch of 2.*batch=5"),
        (lambda: M.padding([1, 2]).block_map(3, 3, 2, 2, batch=5), r"batch of 2.*batch=5"),
        (
            lambda: M.from_fn(lambda b, h, i, j: j <= i, num_heads=4).to_dense(3, 3, heads=8),
            r"expected 4 heads.*heads=8",
        ),
        (
            lambda: M.from_tensor(torch.ones(2, 1, 3, 3, dtype=torch.bool)).to_dense(3, 3, batch=4),
            r"batch of 2.*batch=4",
        ),
    ],
)
def test_batch_and_head_mismatch_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_from_tensor_errors_and_broadcasting():
    with pytest.raises(TypeError, match=r"expected dtype torch\.bool, got torch\.float32"):
        M.from_tensor(torch.ones(3, 3))
    with pytest.raises(TypeError, match="from_tensor: expected a bool Tensor, got list"):
        M.from_tensor([[True]])
    with pytest.raises(ValueError, match=r"expected 2 to 4 dims.*got shape \(3,\)"):
        M.from_tensor(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got shape \(1, 1, 1, 3, 3\)"):
        M.from_tensor(torch.ones(1, 1, 1, 3, 3, dtype=torch.bool))
    m = M.from_tensor(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(1, 1, 3, 4\) is not broadcastable.*L=3, S=5"):
        m.to_dense(3, 5)
    with pytest.raises(ValueError, match=r"not broadcastable.*L=2, S=4"):
        (m & M.causal()).to_dense(2, 4)
    t = rand_bool(2, 3, 4, 5, seed=1)
    assert torch.equal(dense(M.from_tensor(t), 4, 5), t)
    assert torch.equal(dense(M.from_tensor(t) & M.causal(), 4, 5), t & aligned_causal(4, 5))


def test_from_fn_batch_and_head_dependent():
    m = M.from_fn(lambda b, h, i, j: j < (b + 2 * h + 1), batch_size=3, num_heads=2)
    d = dense(m, 2, 8)
    assert d.shape == (3, 2, 2, 8)
    for b in range(3):
        for h in range(2):
            assert d[b, h].sum(-1).tolist() == [b + 2 * h + 1] * 2
    assert m.attended_pairs(2, 8) == int(d.sum())


@pytest.mark.parametrize(
    "fn",
    [
        lambda b, h, i, j: (j <= i).int(),
        lambda b, h, i, j: (j <= i).float(),
        lambda b, h, i, j: (j <= i).to(torch.uint8),
        lambda b, h, i, j: True,
        lambda b, h, i, j: None,
    ],
    ids=["int", "float", "uint8", "python_bool", "none"],
)
def test_from_fn_non_bool_raises_type_error(fn):
    m = M.from_fn(fn)
    with pytest.raises(TypeError, match="mask function must return a bool tensor"):
        m.to_dense(3, 3)
    # Inside a combination too (a Python bool or int tensor must not be absorbed by & / |).
    for combo in (m & M.causal(), M.causal() | m, ~m):
        with pytest.raises(TypeError, match="mask function must return a bool tensor"):
            combo.to_dense(3, 3)
        with pytest.raises(TypeError, match="mask function must return a bool tensor"):
            combo.attended_pairs(3, 3)
    with pytest.raises(TypeError, match="from_fn: expected a callable"):
        M.from_fn(3)


# ----------------------------------------------------------------------------- documents


def test_document_batched_ids():
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 2]])
    d = dense(M.document(ids), 4, 4)
    assert d.shape == (2, 1, 4, 4)
    assert torch.equal(d[0, 0], grid("■ ■ ⬚ ⬚\n■ ■ ⬚ ⬚\n⬚ ⬚ ■ ■\n⬚ ⬚ ■ ■"))
    assert torch.equal(d[1, 0], grid("■ ⬚ ⬚ ⬚\n⬚ ■ ⬚ ⬚\n⬚ ⬚ ■ ■\n⬚ ⬚ ■ ■"))
    assert dense(M.document(ids[0]), 4, 4).shape == (1, 1, 4, 4)


def test_document_from_lengths_and_cu_seqlens():
    expected = dense(M.document([0, 0, 1, 1, 1, 2]), 6, 6)
    assert isinstance(M.document.from_lengths([2, 3, 1]), M.DocumentMask)
    assert torch.equal(dense(M.document.from_lengths([2, 3, 1]), 6, 6), expected)
    assert torch.equal(dense(M.document.from_lengths(torch.tensor([2, 3, 1])), 6, 6), expected)
    assert torch.equal(dense(M.document.from_cu_seqlens([0, 2, 5, 6]), 6, 6), expected)
    cu = torch.tensor([0, 2, 5, 6])
    assert torch.equal(dense(M.document.from_cu_seqlens(cu), 6, 6), expected)
    # Empty documents are allowed and change nothing.
    assert torch.equal(dense(M.document.from_lengths([2, 0, 3, 1]), 6, 6), expected)
    assert torch.equal(dense(M.document.from_cu_seqlens([0, 2, 2, 5, 6]), 6, 6), expected)
    assert torch.equal(
        dense(M.document.from_lengths([2, 3, 1]) & M.causal(), 6, 6),
        expected & aligned_causal(6, 6),
    )


DOC = M.document
VE, TE = ValueError, TypeError


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: DOC.from_cu_seqlens([1, 3, 5]), VE, r"cu_seqlens must start at 0.*\[1, 3, 5\]"),
        (lambda: DOC.from_cu_seqlens([0, 3, 2]), VE, r"non-decreasing, got \[0, 3, 2\]"),
        (lambda: DOC.from_cu_seqlens([]), VE, r"cu_seqlens must start at 0"),
        (lambda: DOC.from_cu_seqlens([0.0, 2.0]), TE, r"cu_seqlens must hold integers"),
        (lambda: DOC.from_cu_seqlens([[0, 2]]), VE, r"cu_seqlens must have 1 dims"),
        (lambda: DOC.from_lengths([2, -1]), VE, r"lengths must be >= 0, got \[2, -1\]"),
        (lambda: DOC.from_lengths([1.5]), TE, r"lengths must hold integers"),
        (lambda: DOC([0.0, 1.0]), TE, r"ids must hold integers, got dtype torch.float"),
        (lambda: DOC(torch.zeros(1, 2, 3, dtype=torch.long)), VE, r"ids must have 1 or 2 dims"),
        (lambda: DOC([0, 0, 1, 1]).to_dense(5, 5), VE, r"ids cover 4 positions, but S=5"),
        (lambda: DOC([0, 0, 1, 1]).attended_pairs(3, 3), VE, r"4 positions, but S=3"),
        (lambda: (M.causal() & DOC([0, 1])).block_map(3, 3, 2, 2), VE, r"S=3"),
    ],
)  # fmt: skip
def test_document_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ----------------------------------------------------------------------------- rendering


def test_str_exact():
    assert str(M.causal()) == (
        "causal()  (L=8, S=8)\n"
        "■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚\n"
        "■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚\n"
        "■ ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚\n"
        "■ ■ ■ ■ ⬚ ⬚ ⬚ ⬚\n"
        "■ ■ ■ ■ ■ ⬚ ⬚ ⬚\n"
        "■ ■ ■ ■ ■ ■ ⬚ ⬚\n"
        "■ ■ ■ ■ ■ ■ ■ ⬚\n"
        "■ ■ ■ ■ ■ ■ ■ ■"
    )
    assert str(M.padding([2, 3])) == "padding([2, 3])  (L=3, S=3)\n■ ■ ⬚\n■ ■ ⬚\n■ ■ ⬚"
    # A fixed-size operand (document ids, a tensor) decides the picture size of a combination.
    assert str(M.causal() & M.document([0, 0, 1])) == (
        "(causal() & document(ids of shape (3,)))  (L=3, S=3)\n■ ⬚ ⬚\n■ ■ ⬚\n⬚ ⬚ ■"
    )
    t = torch.tensor([[True, False], [True, True], [False, True]])
    assert str(M.from_tensor(t) | ~M.causal()) == (
        "(from_tensor(shape=(1, 1, 3, 2)) | ~causal())  (L=3, S=2)\n■ ■\n■ ■\n⬚ ■"
    )


def test_render_selects_batch_and_head():
    m = M.padding([2, 3])
    assert m.render(2, 3, b=0) == "■ ■ ⬚\n■ ■ ⬚"
    assert m.render(2, 3, b=1) == "■ ■ ■\n■ ■ ■"
    fn = M.from_fn(lambda b, h, i, j: j == h, num_heads=2)
    assert fn.render(1, 3, h=1) == "⬚ ■ ⬚"
    assert M.sliding_window(2).render(4, 4) == "■ ⬚ ⬚ ⬚\n■ ■ ⬚ ⬚\n⬚ ■ ■ ⬚\n⬚ ⬚ ■ ■"


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: M.sliding_window(2.5), TE, r"window must be an int, got float"),
        (lambda: M.sliding_window(True), TE, r"window must be an int, got bool"),
        (lambda: M.sliding_window("3"), TE, r"window must be an int, got str"),
        (lambda: M.strided(0), VE, r"stride must be >= 1, got 0"),
        (lambda: M.strided(-2, causal=False), VE, r"stride must be >= 1, got -2"),
        (lambda: M.strided(2.0), TE, r"stride must be an int, got float"),
        (lambda: M.global_local(0, 1), VE, r"window must be >= 1, got 0"),
        (lambda: M.global_local(1.0, 1), TE, r"window must be an int, got float"),
        (lambda: M.global_local(2, -1), VE, r"global_tokens must be >= 0, got -1"),
        (lambda: M.global_local(2, [0, -3]), VE, r"global_tokens positions must be >= 0"),
        (lambda: M.global_local(2, [1.5]), TE, r"global_tokens must hold integers"),
        (lambda: M.global_local(2, 1.5), TE, r"global_tokens must hold integers"),
        (lambda: M.global_local(2, [[0]]), VE, r"global_tokens must have 1 dims"),
        (lambda: M.bigbird(0, 1, 0, 0), VE, r"block_size must be >= 1, got 0"),
        (lambda: M.bigbird(2.0, 1, 0, 0), TE, r"block_size must be an int, got float"),
        (lambda: M.bigbird(2, 2, 0, 0), VE, r"window_blocks must be odd.*got 2"),
        (lambda: M.bigbird(2, 0, 0, 0), VE, r"window_blocks must be >= 1, got 0"),
        (lambda: M.bigbird(2, 1, -1, 0), VE, r"global_blocks must be >= 0, got -1"),
        (lambda: M.bigbird(2, 1, 1.0, 0), TE, r"global_blocks must be an int, got float"),
        (lambda: M.bigbird(2, 1, 0, -2), VE, r"random_blocks must be >= 0, got -2"),
        (lambda: M.bigbird(2, 1, 0, "1"), TE, r"random_blocks must be an int, got str"),
        (lambda: M.padding([3, -1]), VE, r"lengths must be >= 0, got \[3, -1\]"),
        (lambda: M.padding([2.0, 3.0]), TE, r"lengths must hold integers, got dtype torch.float"),
        (lambda: M.padding(torch.tensor([2.5])), TE, r"lengths must hold integers"),
        (lambda: M.padding([True, False]), TE, r"lengths must hold integers, got dtype torch.bool"),
        (lambda: M.padding([[1, 2]]), VE, r"lengths must have 1 dims, got shape \(1, 2\)"),
        (lambda: M.causal().to_dense(-1, 3), VE, r"L=-1, S=3"),
        (lambda: M.causal().to_dense(2.0, 3), VE, r"non-negative ints, got L=2.0"),
        (lambda: M.causal().row_counts(2, -4), VE, r"S=-4"),
        (lambda: M.causal().block_map(4, 4, 0, 2), VE, r"block_q must be >= 1, got 0"),
        (lambda: M.causal().block_map(4, 4, 2, -1), VE, r"block_k must be >= 1, got -1"),
        (lambda: M.causal().block_map(4, 4, 2.0, 2), TE, r"block_q must be an int, got float"),
        (lambda: M.causal().block_map(4, 4, 2, None), TE, r"block_k must be an int"),
    ],
)  # fmt: skip
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_empty_lists_are_accepted():
    # An empty list has no integer dtype of its own; it must still mean "no positions".
    assert torch.equal(dense(M.global_local(2, []), 5, 5), dense(M.sliding_window(2, False), 5, 5))
    assert dense(M.padding([]), 3, 3).shape == (0, 1, 3, 3)
    assert M.document.from_lengths([]).to_dense(0, 0).shape == (1, 1, 0, 0)


# ----------------------------------------------------------------------------- H6 equivalences


def test_h6_equivalences():
    for L, S in [(7, 7), (3, 7), (7, 3)]:
        assert torch.equal(dense(M.causal(), L, S)[0, 0], aligned_causal(L, S))
        assert torch.equal(dense(M.sliding_window(S), L, S), dense(M.causal(), L, S))
        lengths = torch.tensor([S, 1, 0])
        kpm = torch.arange(S)[None, :] < lengths[:, None]  # (B, S) key_padding (True = keep)
        expected = kpm[:, None, None, :].expand(3, 1, L, S)
        assert torch.equal(dense(M.padding(lengths), L, S), expected)
        # a block map is its dense expansion: FULL tiles all True, EMPTY all False
        d = dense(M.strided(3) | M.padding([2]), L, S)
        bm = (M.strided(3) | M.padding([2])).block_map(L, S, 2, 3)
        up = bm.repeat_interleave(2, -2)[..., :L, :].repeat_interleave(3, -1)[..., :S]
        assert (d[up == FULL]).all()
        assert not (d[up == EMPTY]).any()


# ----------------------------------------------------------------------------- properties


def _patterns(L: int, S: int):
    """Strategy for random base patterns valid at (L, S)."""
    windows = st.integers(1, 40)
    cuts = st.lists(st.integers(0, S), max_size=4).map(lambda c: [0, *sorted(c), S])
    fns = st.sampled_from(
        [
            lambda b, h, i, j: (i - j).abs() <= 1,
            lambda b, h, i, j: (j % 3 == 0) | (i == j),
            lambda b, h, i, j: (i + j + b) % 2 == 0,
        ]
    )
    return st.one_of(
        st.just(M.causal()),
        st.builds(M.sliding_window, windows, st.booleans()),
        st.builds(M.padding, st.lists(st.integers(0, 40), min_size=1, max_size=2)),
        st.builds(M.strided, st.integers(1, 10), st.booleans()),
        st.builds(
            M.global_local,
            st.integers(1, 10),
            st.one_of(st.integers(0, 5), st.lists(st.integers(0, 40), max_size=4)),
        ),
        st.builds(
            M.bigbird,
            st.integers(1, 6),
            st.sampled_from([1, 3, 5]),
            st.integers(0, 2),
            st.integers(0, 3),
            st.integers(0, 3),
        ),
        cuts.map(M.document.from_cu_seqlens),
        st.integers(0, 10_000).map(lambda s: M.from_tensor(rand_bool(L, S, seed=s))),
        st.integers(0, 10_000).map(lambda s: M.from_tensor(rand_bool(2, 1, 1, S, seed=s))),
        fns.map(lambda f: M.from_fn(f, batch_size=2)),
    )


@st.composite
def mask_cases(draw):
    L, S = draw(st.integers(0, 33)), draw(st.integers(0, 33))
    base = _patterns(L, S)
    mask = draw(base)
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["&", "|", "~"]))
        if op == "~":
            mask = ~mask
        else:
            other = draw(base)
            mask = (mask & other) if op == "&" else (other | mask)
    return L, S, mask


@settings(max_examples=100, deadline=None, derandomize=True)
@given(case=mask_cases(), bq=st.integers(1, 9), bk=st.integers(1, 9))
def test_property_block_map_equals_brute_force(case, bq, bk):
    L, S, mask = case
    d = dense(mask, L, S)
    bm = mask.block_map(L, S, bq, bk)
    assert torch.equal(bm.expand(d.shape[0], d.shape[1], -1, -1), brute_block_map(d, bq, bk))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(case=mask_cases(), heads=st.integers(1, 3))
def test_property_counts_equal_dense(case, heads):
    L, S, mask = case
    d = declared(mask, dense(mask, L, S))
    B, H = d.shape[:2]
    assert mask.attended_pairs(L, S) == int(d.sum())
    assert torch.equal(mask.row_counts(L, S).expand(B, H, L), d.sum(-1))
    if mask.num_heads in (None, 1):
        assert mask.attended_pairs(L, S, heads=heads) == int(expand_bh(d, B, heads).sum())
    assert torch.equal(declared(mask, dense(~mask, L, S)), ~d)


@pytest.mark.parametrize(
    "mask",
    [
        M.causal(),  # bottom-right when L != S
        M.bigbird(16, 3, 1, 2, seed=3),  # its random blocks drawn before Flex's vmap
        M.causal() & M.document.from_lengths([50, 40, 70]),
        M.sliding_window(24) | M.strided(8),
    ],
)
def test_mask_mod_runs_the_same_mask_on_flex_attention(mask) -> None:
    """`Mask.mask_mod` -> FlexAttention's create_block_mask gives the reference's output."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    L, S = 144, 160
    if "document" in repr(mask):  # documents need L == S
        L = S
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, L, 16, generator=g)
    k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(2))
    block = flex.create_block_mask(mask.mask_mod(L, S), None, None, L, S, device="cpu")
    want = M_attention(q, k, v, mask=mask, backend="reference")
    dense = mask.to_dense(L, S)
    got = flex.flex_attention(q, k, v, block_mask=block)
    rows = dense.any(-1, keepdim=True)  # Flex leaves rows that attend nothing at 0 too
    torch.testing.assert_close(torch.where(rows, got, 0.0), want, atol=2e-6, rtol=2e-6)
    mod = mask.mask_mod(L, S)
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    assert torch.equal(mod(torch.tensor(0), torch.tensor(0), i, j).expand(L, S), dense[0, 0])


def test_mask_mod_refuses_a_mask_that_needs_4d_grids() -> None:
    with pytest.raises(ValueError, match=r"mask_mod: .*padding.* 0-d"):
        (M.causal() & M.padding([20])).mask_mod(32, 32)
