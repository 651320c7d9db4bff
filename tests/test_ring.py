"""Ring attention on 1–4 real gloo ranks (loopback), RELIABILITY R1–R10 and H8."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

import attnlab
import ring_workers as W
from attnlab import masks
from attnlab.distributed import ring_attention, ring_comm
from attnlab.distributed.launch import run_local


def _ok(results):
    for status, payload in results:
        assert status == "ok", payload
    return [p for _, p in results]


def _cases(world: int):
    cases = []
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            for H, H_kv in ((2, 2), (3, 1), (4, 2)):
                cases.append(
                    {
                        "seed": len(cases),
                        "B": 2,
                        "H": H,
                        "H_kv": H_kv,
                        "N": 6 * world,
                        "D": 16,
                        "dtype": torch.float32,
                        "layout": layout,
                        "causal": causal,
                    }
                )
    cases.append(
        {
            "seed": 90,
            "B": 1,
            "H": 2,
            "H_kv": 1,
            "N": 4 * world,
            "D": 8,
            "dtype": torch.float64,
            "layout": "zigzag",
            "causal": True,
        }
    )
    cases.append(
        {
            "seed": 91,
            "B": 1,
            "H": 2,
            "H_kv": 2,
            "N": 6 * world,
            "D": 8,
            "dtype": torch.float32,
            "layout": "contiguous",
            "causal": False,
            "mask": "window",
        }
    )
    cases.append(
        {
            "seed": 92,
            "B": 1,
            "H": 2,
            "H_kv": 2,
            "N": 6 * world,
            "D": 8,
            "dtype": torch.float32,
            "layout": "zigzag",
            "causal": True,
            "mask": "document",
        }
    )
    cases.append(
        {
            "seed": 93,
            "B": 1,
            "H": 2,
            "H_kv": 2,
            "N": 4 * world,
            "D": 8,
            "dtype": torch.bfloat16,
            "layout": "contiguous",
            "causal": True,
        }
    )
    return cases


# worlds 2 and 3 (even and odd) by default; 1 and 4 with the slow sweeps (spawned interpreters:
# 4 and 10 s on an AVX2-only EPYC, where every bfloat16 product of the references is slow)
@pytest.mark.parametrize(
    "world",
    [pytest.param(1, marks=pytest.mark.slow), 2, 3, pytest.param(4, marks=pytest.mark.slow)],
)
def test_r7_h8_ring_equals_single_process(world):
    results = _ok(run_local(W.exactness, world, _cases(world), timeout=120, threads=1))
    for rank_results in results:
        for r in rank_results:
            case = r["case"]
            assert r["finite"], case
            if case["dtype"] == torch.float64:
                assert r["fwd_vs_gold"] < 1e-12 and r["grad_vs_gold"] < 1e-11, r
            elif case["dtype"] == torch.float32:
                assert r["fwd_vs_single"] <= 2e-5 * world, r
                assert r["grad_vs_single"] <= 1e-4 * world, r
            else:  # bf16: the fixed table (fp32 statistics) times the world size
                assert r["fwd_vs_gold"] <= 3e-2 * world and r["grad_vs_gold"] <= 6e-2 * world, r


def test_r8_r9_rotation_count_and_bitwise_deterministic_backward():
    for per_layout in _ok(run_local(W.determinism_and_hops_all, 3, timeout=120, threads=1)):
        for result in per_layout.values():
            assert result["fwd_rotations"] == 2  # exactly W - 1 key/value rotations forward
            assert result["bit_equal"]


def test_r3_r4_metadata_handshake_raises_on_every_rank():
    fields = ["local_len", "heads", "head_dim", "causal", "dtype", "pieces"]
    for messages in _ok(run_local(W.mismatches, 2, fields, timeout=60)):
        for field, msg in zip(fields, messages, strict=True):
            assert f"ranks disagree on {field}" in msg and "rank 1" in msg, msg


def _pieces_cases(world: int) -> list[dict]:
    """Chunks of 6 positions (zigzag: N = 12·W; contiguous: N = 6·W), so 1, 2 and 3 pieces apply."""
    base = {"B": 2, "D": 16, "dtype": torch.float32}
    return [
        {**base, "seed": 1, "H": 4, "H_kv": 2, "N": 12 * world, "layout": "zigzag", "causal": True},
        {**base, "seed": 2, "H": 3, "H_kv": 1, "N": 6 * world, "layout": "contiguous",
         "causal": False, "mask": "window"},
        {**base, "seed": 3, "H": 2, "H_kv": 2, "N": 12 * world, "layout": "zigzag",
         "causal": True, "dtype": torch.float64},
    ]  # fmt: skip


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_result_does_not_depend_on_pieces(world):
    cases = _pieces_cases(world)
    for rank_results in _ok(run_local(W.pieces_invariance, world, cases, timeout=120, threads=1)):
        for r in rank_results:
            case = r["case"]
            if case["dtype"] == torch.float64:
                assert r["fwd_diff"] < 1e-12 and r["grad_diff"] < 1e-11, r
            else:  # the float32 tolerance rule of the exactness test
                assert r["fwd_diff"] <= 2e-5 * world and r["grad_diff"] <= 1e-4 * world, r
            chunks = 2 if case["layout"] == "zigzag" else 1
            assert r["forward_messages"] == {p: (world - 1) * chunks * p for p in (1, 2, 3)}, r


def test_invalid_pieces_is_a_clear_error():
    for messages in _ok(run_local(W.bad_pieces, 2, timeout=60)):
        assert messages[0] == "ValueError: pieces must be >= 1, got 0", messages
        assert messages[1] == "ValueError: pieces must be >= 1, got -1", messages
        assert messages[2] == "ArgumentTypeError: pieces must be an int, got float 1.5", messages
        assert messages[3] == "ArgumentTypeError: pieces must be an int, got bool True", messages


def test_ring_module_rejects_bad_pieces_at_construction():
    from attnlab.distributed import RingMultiHeadAttention

    with pytest.raises(ValueError, match="pieces must be >= 1, got 0"):
        RingMultiHeadAttention(16, 2, pieces=0)
    with pytest.raises(TypeError, match="pieces must be an int, got float"):
        RingMultiHeadAttention(16, 2, pieces=2.0)


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_r1_r2_dead_or_stalled_peer_raises_naming_it(mode):
    timeout = 3.0
    results = run_local(W.dies_or_stalls, 3, mode, 1, timeout, timeout=60, pg_timeout=timeout)
    survivors = [p for r, (s, p) in enumerate(results) if r != 1]
    for status, payload in [results[0], results[2]]:
        assert status == "ok", payload
    for p in survivors:
        assert p["error"] is not None, p
        assert p["elapsed"] <= timeout + 2 + 3, p  # timeout + 2 s (+ slack for a loaded machine)
        assert "peer rank" in p["error"]
    assert any(p["peer"] == 1 for p in survivors)  # someone was waiting on the victim itself
    if mode == "die":
        assert results[1][0] == "missing"
    assert not multiprocessing.active_children()


def test_r5_no_deadlock_with_large_blocks():
    elapsed = _ok(run_local(W.big_exchange, 3, 64, timeout=60))
    assert all(0 <= e < 10 for e in elapsed), elapsed


def test_ring_multihead_attention_equals_local_module():
    for errors in _ok(run_local(W.module_parity_all, 2, timeout=60, threads=1)):
        assert all(err < 1e-12 for err in errors.values()), errors


def test_r10_uninitialised_group_is_a_clear_error():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match=r"needs an initialised torch.distributed process group"):
        ring_attention(q, q, q)
    assert not multiprocessing.active_children()


# --------------------------------------------------------------------------- issue 13: NaN rule
def _allowed(case: dict, B: int, H: int, N: int) -> torch.Tensor:
    """Bool ``(B, H, N, N)``: which (query, key) pairs may attend under the case's masks."""
    allowed = torch.ones(B, H, N, N, dtype=torch.bool)
    mask = W.rule_mask(case)
    if mask is not None:
        allowed = allowed & mask.to_dense(N, N, batch=B, heads=H)
    if case["causal"]:
        allowed = allowed & torch.ones(N, N, dtype=torch.bool).tril()
    return allowed


def _rule_pattern(q, k, v, allowed):
    """The NaN rule, written out: ``(out non-finite (B, H, N, Dv), row non-finite, live rows)``."""
    group = q.shape[1] // k.shape[1]
    q_bad = ~torch.isfinite(q).all(-1)  # (B, H, N)
    k_bad = (~torch.isfinite(k).all(-1)).repeat_interleave(group, 1)  # (B, H, N)
    v_bad = (~torch.isfinite(v)).repeat_interleave(group, 1)  # (B, H, N, Dv)
    live = allowed.any(-1)
    rows = live & (q_bad | (allowed & k_bad.unsqueeze(-2)).any(-1))
    cols = (allowed.unsqueeze(-1) & v_bad.unsqueeze(2)).any(-2)  # (B, H, N, Dv)
    return rows.unsqueeze(-1) | cols, rows, live


def _planted_case(seed: int, world: int, **case) -> dict:
    """Random inputs with NaN/±inf planted in q, k and v at random positions (and q at row 0)."""
    g = torch.Generator().manual_seed(seed)
    B, H, H_kv, N, D = 2, case.pop("H", 2), case.pop("H_kv", 1), 12 * world, 8
    dtype = case.pop("dtype", torch.float64)
    q, k, v, dout = (
        torch.randn(B, h, N, D, generator=g, dtype=torch.float64).to(dtype)
        for h in (H, H_kv, H_kv, H)
    )
    pos = lambda: int(torch.randint(N, (1,), generator=g))  # noqa: E731
    col = lambda: int(torch.randint(D, (1,), generator=g))  # noqa: E731
    q[0, H - 1, pos(), col()] = float("nan")
    q[1, 0, 0, col()] = float("nan")  # row 0: dead under the strict mask, live otherwise
    k[1, 0, pos(), col()] = float("inf") if seed % 2 else float("-inf")
    v[0, 0, pos(), col()] = float("nan")
    v[1, H_kv - 1, pos(), col()] = float("-inf")
    v[1, H_kv - 1, pos(), col()] = float("inf")
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    return {"seed": seed, "N": N, "H": H, "dtype": dtype, **tensors, **case}


def _nan_cases(world: int) -> list[dict]:
    cases = []
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            cases.append(_planted_case(len(cases), world, layout=layout, causal=causal))
    extra = [
        {"layout": "zigzag", "causal": True, "mask": "document", "H": 4, "H_kv": 2},
        {"layout": "contiguous", "causal": False, "mask": "window"},
        {"layout": "zigzag", "causal": False, "mask": "strict"},
        {"layout": "contiguous", "causal": False, "mask": "heads", "H": 4, "H_kv": 2},
        {"layout": "zigzag", "causal": True, "H": 4, "H_kv": 2, "dtype": torch.float32},
    ]
    return cases + [_planted_case(10 + i, world, **c) for i, c in enumerate(extra)]


def test_ring_follows_the_nan_rule_like_one_process():
    world = 3
    cases = _nan_cases(world)
    per_rank = _ok(run_local(W.nan_rule, world, cases, timeout=120, threads=1))
    for case_index, case in enumerate(cases):
        q, k, v, dout = case["q"], case["k"], case["v"], case["dout"]
        B, H, N, _ = q.shape
        allowed = _allowed(case, B, H, N)
        bad_out, bad_rows, live = _rule_pattern(q, k, v, allowed)
        assert bad_out.any() and (~bad_out).any(), case["seed"]  # the case tests something
        # Finite values: reference attention on the cleaned inputs, in float64.
        clean = [torch.nan_to_num(t, 0.0, 0.0, 0.0).double().requires_grad_() for t in (q, k, v)]
        want = attnlab.attention(*clean, mask=allowed, backend="reference")
        want_grads = torch.autograd.grad(want, clean, dout.double())
        want = want.detach()
        tol = 1e-12 if q.dtype == torch.float64 else 2e-5 * world
        gtol = 1e-11 if q.dtype == torch.float64 else 1e-4 * world
        for rank, results in enumerate(per_rank):
            r = results[case_index]
            out, lse = torch.from_numpy(r["out"]), torch.from_numpy(r["lse"])
            grads = [torch.from_numpy(g) for g in r["grads"]]
            where = (case["seed"], rank)
            assert torch.equal(~torch.isfinite(out), bad_out), where
            assert bool(torch.isnan(out[bad_out]).all()), where  # non-finite means NaN
            assert float((out[~bad_out].double() - want[~bad_out]).abs().max()) <= tol, where
            assert bool((out[~live] == 0).all()), where  # dead rows are zeros, NaN query or not
            assert torch.equal(torch.isnan(lse), bad_rows), where
            assert torch.equal(torch.isneginf(lse), ~live), where
            for got, ref in zip(grads, want_grads, strict=True):
                assert bool(torch.isfinite(got).all()), where
                assert float((got.double() - ref).abs().max()) <= gtol, where


# --------------------------------------------------------------------------- issue 13: handshake
def test_handshake_compares_mask_contents():
    world, odd = 3, 2
    for rank_messages in _ok(run_local(W.mask_contents, world, odd, timeout=60)):
        for name in ("document", "tensor", "fn_partial"):
            msg = rank_messages[name]
            assert "ranks disagree on mask" in msg and f"rank {odd} has" in msg, (name, msg)
        for name in ("equal_document", "equal_fn", "equal_bigbird"):
            assert rank_messages[name] == "no error", (name, rank_messages[name])


def test_timeout_covers_the_handshake_before_the_first_hop():
    timeout, victim = 5.0, 1
    results = run_local(W.stalls_before_first, 3, victim, timeout, timeout=60, pg_timeout=60)
    for rank in (0, 2):
        status, p = results[rank]
        assert status == "ok", p
        assert p["error"] is not None and p["peer"] == victim and p["hop"] == -1, p
        assert "metadata handshake" in p["error"] and f"peer rank {victim}" in p["error"], p
        assert timeout - 0.5 <= p["elapsed"] <= timeout + 2, p  # not the group's 60 s default
    assert results[victim][0] == "ok", results[victim]
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("kind", ["full", "causal", "masked"])
def test_block_math_off_cpu_engine_equals_the_kernel(kind, monkeypatch):
    """Off the CPU ring blocks run on flash's pure-PyTorch engine (`TorchEngine`): forced here
    on CPU tensors, it gives the kernel path's out, lse and gradients (grouped heads, a masked
    tile with a dead row)."""
    from attnlab.distributed import ring_blocks as rb
    from attnlab.functional.flash import Residuals

    g = torch.Generator().manual_seed(0)
    B, H, H_kv, C, D = 2, 4, 2, 16, 8
    q, dout = (torch.randn(B, H, C, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H_kv, C, D, generator=g) for _ in range(2))
    tile = None
    if kind == "masked":
        tile = torch.rand(1, 1, C, C, generator=g) > 0.3
        tile[..., 3, :] = False  # a row with nothing to attend in this block
    args = {"kind": kind, "tile": tile, "scale": 0.3}
    out, lse = rb.block_forward(q, k, v, **args)
    res = Residuals(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    grads = rb.block_backward(res, **args)
    monkeypatch.setattr(rb, "kernel_forward", lambda *a: rb._TORCH_ENGINE.forward(*a)[:2])
    monkeypatch.setattr(rb, "kernel_backward", rb._TORCH_ENGINE.backward)
    out_t, lse_t = rb.block_forward(q, k, v, **args)
    grads_t = rb.block_backward(res, **args)
    torch.testing.assert_close(out_t, out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse_t, lse, atol=2e-6, rtol=1e-5)  # −inf on the dead row in both
    for a, b in zip(grads_t, grads, strict=True):
        torch.testing.assert_close(a.to(b.dtype), b, atol=2e-6, rtol=1e-5)
    if tile is not None:
        assert torch.isneginf(lse[:, :, 3]).all() and (out[:, :, 3] == 0).all()


def test_mask_fingerprint_reads_values_written_behind_torch():
    """Issue 38 item 1: the handshake's fingerprint follows the ids' values, not the tensor's
    identity and version counter (a NumPy view writes without bumping them)."""
    buf = np.zeros(64, dtype=np.int64)
    mask = masks.causal() & masks.document(torch.from_numpy(buf))
    buf[:] = [0] * 32 + [1] * 32
    first = ring_comm._mask_fingerprint(mask)
    buf[:] = [0] * 16 + [1] * 32 + [0] * 16  # a permutation: same counts
    assert ring_comm._mask_fingerprint(mask) != first
    buf[:] = [0] * 32 + [1] * 32
    assert ring_comm._mask_fingerprint(mask) == first


def test_ring_reads_the_block_map_and_evaluates_only_partial_piece_pairs():
    """Ring attention asks the mask for its block map over pieces: empty pairs are skipped and
    full ones run unmasked without evaluating the mask; the causal factor of ``causal() & m``
    runs as the kernels' causal diagonal."""
    from attnlab.distributed.ring import split_causal
    from attnlab.distributed.ring_blocks import tile_relation
    from attnlab.distributed.ring_comm import RingConfig

    calls = []

    class Counted(masks.Mask):
        def diagonals(self):
            return [(-7, 0, 1, 0)]  # a causal window of 8 keys, through the protocol

        def evaluate(self, b, h, i, j, L, S):
            calls.append((int(i.min()), int(j.min())))
            return super().evaluate(b, h, i, j, L, S)

    causal, rest = split_causal(masks.causal() & Counted())
    assert causal and isinstance(rest, Counted)
    assert split_causal(masks.causal()) == (True, None)
    cfg = RingConfig(None, 0, 2, causal, rest, 1.0, "contiguous", None, 1)
    kinds = [
        [tile_relation(a, b, cfg=cfg, C=8, N=32, B=1, H=1, device="cpu")[0] for b in range(4)]
        for a in range(4)
    ]
    assert kinds == [
        ["masked", "skip", "skip", "skip"],
        ["masked", "masked", "skip", "skip"],
        ["skip", "masked", "masked", "skip"],
        ["skip", "skip", "masked", "masked"],
    ]
    assert len(calls) == 7  # the partial pairs only, each once
    wide = masks.sliding_window(64, causal=False)
    wide = RingConfig(None, 0, 2, True, wide, 1.0, "contiguous", None, 1)
    assert tile_relation(2, 1, cfg=wide, C=8, N=32, B=1, H=1, device="cpu") == ("full", None)
    assert tile_relation(2, 2, cfg=wide, C=8, N=32, B=1, H=1, device="cpu") == ("causal", None)
