"""Functions run on spawned gloo ranks by tests/test_ring.py (module level, so they pickle)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import attnlab
from attnlab import masks
from attnlab.distributed import ring as ring_mod
from attnlab.distributed import ring_attention, shard, unshard


def _global_inputs(case: dict) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(case["seed"])
    B, H, H_kv, N, D = case["B"], case["H"], case["H_kv"], case["N"], case["D"]
    dtype = case["dtype"]
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H_kv, N, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H_kv, N, D, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _mask(case: dict):
    if case.get("mask") == "window":
        return masks.sliding_window(5, causal=False)
    if case.get("mask") == "document":
        N = case["N"]
        return masks.document(torch.arange(N) * 3 // N)
    return None


def _with_causal(case: dict, m):
    """The case's mask with its causal flag folded in by ``&`` (the one mask of the call)."""
    if case["causal"]:
        m = masks.causal() if m is None else masks.causal() & m
    return m


def _full(q, k, v, dout, case, backend):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    m = _with_causal(case, _mask(case))
    out = attnlab.attention(*xs, mask=m, backend=backend)
    grads = torch.autograd.grad(out, xs, dout)
    return out.detach(), grads


def exactness(rank: int, world: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        q, k, v, dout = _global_inputs(case)
        layout = case["layout"]
        gold_out, gold_grads = _full(*(t.double() for t in (q, k, v, dout)), case, "reference")
        single_out, single_grads = _full(
            q, k, v, dout, case, "reference" if q.dtype == torch.float64 else "sdpa"
        )
        xs = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*xs, mask=_with_causal(case, _mask(case)), layout=layout)
        grads = torch.autograd.grad(out, xs, shard(dout, layout=layout))
        full_out = unshard(out.detach(), layout=layout)
        full_grads = [unshard(g, layout=layout) for g in grads]
        err = lambda a, b: float((a.double() - b.double()).abs().max())  # noqa: E731
        results.append(
            {
                "case": case,
                "fwd_vs_single": err(full_out, single_out),
                "grad_vs_single": max(
                    err(a, b) for a, b in zip(full_grads, single_grads, strict=True)
                ),
                "fwd_vs_gold": err(full_out, gold_out),
                "grad_vs_gold": max(err(a, b) for a, b in zip(full_grads, gold_grads, strict=True)),
                "finite": bool(torch.isfinite(full_out).all())
                and all(bool(torch.isfinite(g).all()) for g in full_grads),
            }
        )
    return results


def determinism_and_hops_all(rank: int, world: int) -> dict:
    layouts = ("contiguous", "zigzag")
    return {layout: determinism_and_hops(rank, world, layout) for layout in layouts}


def determinism_and_hops(rank: int, world: int, layout: str) -> dict:
    case = {"seed": 3, "B": 1, "H": 2, "H_kv": 1, "N": 8 * world, "D": 16, "dtype": torch.float32}
    q, k, v, dout = _global_inputs(case)
    calls = []
    original = ring_mod.Ring.start

    def counting(self, tensors):
        calls.append(sum(t.numel() for t in tensors))
        return original(self, tensors)

    ring_mod.Ring.start = counting
    xs = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*xs, mask=masks.causal(), layout=layout)
    fwd_calls = list(calls)
    first = None
    bit_equal = True
    for _ in range(20):
        grads = torch.autograd.grad(
            ring_attention(*xs, mask=masks.causal(), layout=layout), xs, shard(dout, layout=layout)
        )
        if first is None:
            first = grads
        else:
            bit_equal &= all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))
    out2 = ring_attention(*xs, mask=masks.causal(), layout=layout)
    ring_mod.Ring.start = original
    block = xs[1].numel() + xs[2].numel()  # one rank's keys and values
    return {
        "fwd_rotations": sum(fwd_calls) / block,  # blocks moved, whatever the number of pieces
        "bit_equal": bit_equal and torch.equal(out, out2),
    }


def mismatches(rank: int, world: int, fields: list[str]) -> list[str]:
    """Every field in turn: the group stays usable because every rank raises after the gather."""
    return [mismatch(rank, world, f) for f in fields]


def mismatch(rank: int, world: int, field: str) -> str:
    B, H, H_kv, L, D, dtype, causal, pieces = 1, 2, 2, 8, 16, torch.float32, False, 2
    if rank == 1:
        if field == "local_len":
            L = 16
        elif field == "heads":
            H, H_kv = 4, 4
        elif field == "head_dim":
            D = 8
        elif field == "causal":
            causal = True
        elif field == "dtype":
            dtype = torch.float64
        elif field == "pieces":
            pieces = 1
    q = torch.randn(B, H, L, D, dtype=dtype)
    k = torch.randn(B, H_kv, L, D, dtype=dtype)
    try:
        ring_attention(q, k, k.clone(), mask=masks.causal() if causal else None, pieces=pieces)
    except ValueError as e:
        return str(e)
    return "no error"


def pieces_invariance(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case with pieces = 1, 2, 3: largest difference from pieces = 1, messages sent."""
    results = []
    original = ring_mod.Ring.start
    for case in cases:
        q, k, v, dout = _global_inputs(case)
        layout = case["layout"]
        xs = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
        runs = {}
        for pieces in (1, 2, 3):
            sent = []

            def counting(self, tensors, sent=sent):
                sent.append(len(tensors))
                return original(self, tensors)

            ring_mod.Ring.start = counting
            out = ring_attention(
                *xs, mask=_with_causal(case, _mask(case)), layout=layout, pieces=pieces
            )
            forward_messages = len(sent)
            grads = torch.autograd.grad(out, xs, shard(dout, layout=layout))
            ring_mod.Ring.start = original
            runs[pieces] = (out.detach(), *grads, forward_messages)
        err = lambda a, b: float((a.double() - b.double()).abs().max())  # noqa: E731
        results.append(
            {
                "case": case,
                "fwd_diff": max(err(runs[p][0], runs[1][0]) for p in runs),
                "grad_diff": max(err(runs[p][i], runs[1][i]) for p in runs for i in (1, 2, 3)),
                "forward_messages": {p: r[4] for p, r in runs.items()},
            }
        )
    return results


def bad_pieces(rank: int, world: int) -> list[str]:
    """The error type and message for invalid ``pieces`` values."""
    q = torch.randn(1, 2, 8, 16)
    messages = []
    for pieces in (0, -1, 1.5, True):
        try:
            ring_attention(q, q, q, pieces=pieces)
        except (TypeError, ValueError) as e:
            messages.append(f"{type(e).__name__}: {e}")
        else:
            messages.append("no error")
    return messages


def dies_or_stalls(rank: int, world: int, mode: str, victim: int, timeout: float) -> dict:
    case = {"seed": 1, "B": 1, "H": 2, "H_kv": 2, "N": 8 * world, "D": 16, "dtype": torch.float32}
    q, k, v, _ = _global_inputs(case)
    xs = [shard(t) for t in (q, k, v)]
    original = ring_mod.Ring.start

    def faulty(self, tensors):
        if rank == victim and self.hops == 1:
            if mode == "die":
                os._exit(3)
            time.sleep(timeout + 6)
        return original(self, tensors)

    ring_mod.Ring.start = faulty
    t0 = time.monotonic()
    try:
        ring_attention(*xs, timeout=timeout)
    except ring_mod.RingAttentionError as e:
        return {"error": str(e), "peer": e.peer, "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


def big_exchange(rank: int, world: int, mb: int) -> float:
    n = mb * 1024 * 1024 // 4
    ring = ring_mod.Ring(None, rank, world, None)
    t0 = time.monotonic()
    blocks = [torch.full((n,), float(rank)), torch.full((n,), float(rank))]
    for _ in range(world - 1):
        blocks = ring.start(blocks)()
    ok = float(blocks[0][0]) == float((rank + 1) % world)  # after W-1 hops we hold rank+1's block
    elapsed = time.monotonic() - t0
    return elapsed if ok else -1.0


def module_parity_all(rank: int, world: int) -> dict:
    return {layout: module_parity(rank, world, layout) for layout in ("contiguous", "zigzag")}


def module_parity(rank: int, world: int, layout: str) -> float:
    from attnlab.distributed import RingMultiHeadAttention
    from attnlab.modules import MultiHeadAttention
    from attnlab.positional import RoPE

    torch.manual_seed(0)
    local = MultiHeadAttention(32, 4, num_kv_heads=2, rope=RoPE(8)).double()
    ring = RingMultiHeadAttention(
        32,
        4,
        num_kv_heads=2,
        rope=RoPE(8),
        layout=layout,
        pieces=1 if layout == "zigzag" else 4,
    ).double()
    ring.load_state_dict(local.state_dict())
    x = torch.randn(
        2, 8 * world, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    want = local(x, mask=masks.causal())
    got = unshard(ring(shard(x, layout=layout, dim=1), mask=masks.causal()), layout=layout, dim=1)
    return float((got - want).abs().max())


def init_check(rank: int, world: int) -> str:
    dist.barrier()
    return "ok"


# --------------------------------------------------------------------------- issue 13
def _strict_causal(b, h, i, j):
    """Keys strictly before the query: row 0 attends nothing (a dead row)."""
    return j < i


def _head_dependent(b, h, i, j):
    """Head h sees keys at most ``i - h``: the tiles differ per head."""
    return j <= i - h


def _band(b, h, i, j, width):
    return (i - j).abs() <= width


def rule_mask(case: dict):
    """The mask a NaN-rule case names (module level, so spawned ranks and the test agree)."""
    if case.get("mask") == "strict":
        return masks.from_fn(_strict_causal)
    if case.get("mask") == "heads":
        return masks.from_fn(_head_dependent, num_heads=case["H"])
    return _mask(case)


def nan_rule(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Ring attention on inputs with planted non-finite entries: unsharded out, lse and grads."""
    results = []
    for case in cases:
        layout = case["layout"]
        xs = [shard(case[n], layout=layout).detach().requires_grad_() for n in ("q", "k", "v")]
        out, lse = ring_attention(
            *xs, mask=_with_causal(case, rule_mask(case)), layout=layout, return_lse=True
        )
        grads = torch.autograd.grad(out, xs, shard(case["dout"], layout=layout))
        # numpy arrays: they pickle by value (a tensor would be shared with a process that exits)
        results.append(
            {
                "out": unshard(out.detach(), layout=layout).numpy(),
                "lse": unshard(lse.unsqueeze(-1), layout=layout).squeeze(-1).numpy(),
                "grads": [unshard(g, layout=layout).numpy() for g in grads],
            }
        )
    return results


def mask_contents(rank: int, world: int, odd: int) -> dict[str, str]:
    """Masks that differ only in their contents on rank ``odd``, then equal masks built apart."""
    import functools

    N, L = 8 * world, 8
    q = torch.randn(1, 2, L, 8, generator=torch.Generator().manual_seed(rank))
    ids = torch.arange(N) * 2 // N
    dense = torch.ones(N, N, dtype=torch.bool).tril()
    width = 2
    if rank == odd:
        ids = ids.flip(0)  # the same shape and the same repr, other documents
        dense[N - 1, 0] = False
        width = 3
    differing = {
        "document": masks.document(ids),
        "tensor": masks.from_tensor(dense),
        "fn_partial": masks.from_fn(functools.partial(_band, width=width)),
    }
    bigbird = masks.BigBirdMask(2, 1, 1, 1, seed=5)
    if rank == 0:
        bigbird.random_table(3)  # a cache only rank 0 has filled: not part of the mask's contents
    equal = {
        "equal_document": masks.document(torch.arange(N) * 2 // N),
        "equal_fn": masks.from_fn(_strict_causal) & masks.sliding_window(3),
        "equal_bigbird": bigbird,
    }
    messages = {}
    for name, mask in {**differing, **equal}.items():
        try:
            out = ring_attention(q, q, q, mask=mask, timeout=20)
        except ValueError as e:
            messages[name] = str(e)
        else:
            messages[name] = "no error" if bool(torch.isfinite(out).all()) else "non-finite"
    return messages


def stalls_before_first(rank: int, world: int, victim: int, timeout: float) -> dict:
    """``victim`` sleeps past ``timeout`` before it calls ring attention; the others time out."""
    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(rank))
    if rank == victim:
        time.sleep(timeout + 2.5)  # the others have given up by now
        try:
            ring_attention(q, q, q, timeout=1.0)
        except Exception as e:  # the peers are gone: any failure, as long as it returns
            return {"victim": True, "error": type(e).__name__}
        return {"victim": True, "error": None}
    t0 = time.monotonic()
    try:
        ring_attention(q, q, q, timeout=timeout)
    except ring_mod.RingAttentionError as e:
        return {
            "victim": False,
            "error": str(e),
            "peer": e.peer,
            "hop": e.hop,
            "elapsed": time.monotonic() - t0,
        }
    return {"victim": False, "error": None, "elapsed": time.monotonic() - t0}
