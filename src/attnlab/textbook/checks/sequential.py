"""Checks of sequential against parallel computation: the KV cache, decoding cost, and the
recurrent network's path length and cost (subjects ``kv-cache``, ``kv-history``,
``naive-as-linear``, ``complexity-path``)."""

from __future__ import annotations

import torch

from ..core import Finding, check, judged, tiny
from ._shared import _err, _found, _mha, _mha_eval, _randn, _seq


@check("000-o2-c")
def _decode_latency() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ... import KVCache, MultiHeadAttention, masks

    E = 64
    torch.manual_seed(16)
    mha = MultiHeadAttention(E, 4, backend="reference").eval()
    g = torch.Generator().manual_seed(16)
    flops = {}
    for t in (64, 256, 1024):
        cache = KVCache()
        with torch.no_grad():
            mha(torch.randn(1, t, E, generator=g), mask=masks.causal(), cache=cache)
            with FlopCounterMode(display=False) as fc:
                mha(torch.randn(1, 1, E, generator=g), mask=masks.causal(), cache=cache)
        flops[t] = fc.get_total_flops()
    ok = all(f == 8 * E * E + 4 * (t + 1) * E for t, f in flops.items())
    return Finding(
        computed="FLOPs of one decoding step: "
        + ", ".join(f"{f:,} after {t} tokens" for t, f in flops.items())
        + " = 8E² (projections) + 4(t + 1)E (attention over the cache): linear in the context, "
        "so a whole generation of n tokens is O(n²d)",
        call="FlopCounterMode(); mha(x_new, mask=masks.causal(), cache=cache) with t cached tokens",
        **judged(ok, "the per-step cost does not grow with the context"),
    )


@check("000-rnn-a")
def _rnn_table() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...analysis import estimate

    d = 512
    rnn = torch.nn.RNN(d, d, batch_first=True, device="meta")
    per_step = []
    for n in (16, 32):  # the recurrence costs the same every step: count two lengths
        with FlopCounterMode(display=False) as fc:
            rnn(torch.empty(1, n, d, device="meta"))
        per_step.append(fc.get_total_flops() / n)
    out = []
    for n in (128, 2048):
        e = estimate(n, d, 1)
        sa = e.value("scores QKᵀ", "naive") + e.value("weighted sum PV", "naive")
        out.append((n, sa, per_step[0] * n))
    linear = per_step[0] == per_step[1] == 4 * d * d
    ok = linear and out[0][1] < out[0][2] and out[1][1] > out[1][2]
    return Finding(
        computed="; ".join(
            f"n={n}: self-attention {sa:,.0f}, RNN {r:,.0f} FLOPs" for n, sa, r in out
        ),
        call="estimate(n, 512, 1) QKᵀ + PV rows vs FlopCounterMode over torch.nn.RNN(512, 512) "
        "(per step, 4d² FLOPs, times n)",
        **judged(ok, "the crossover is not at n ≈ d"),
    )


@check("000-rnn-b")
def _rnn_memory_path() -> Finding:
    from ...analysis import estimate
    from ...analysis.costs import complexity_table

    d, parts, ok = 512, [], True
    for n in (128, 2048):
        rows = {r["layer"]: r for r in complexity_table(n, d)}
        sa, rnn = rows["self-attention"], rows["recurrent"]
        scores = estimate(n, d, 1, dtype="float32").value("score matrix", "naive")
        states = n * d * 4
        ok &= (scores > states) == (n > d) and sa["path"] == 1 and rnn["path"] == n
        parts.append(
            f"n={n}: n×n weights {int(scores):,} B vs RNN states {states:,} B; path "
            f"{sa['path']} vs {rnn['path']}"
        )
    return Finding(
        computed="; ".join(parts),
        call="complexity_table(n, 512) rows 'self-attention' / 'recurrent' (path); "
        "estimate(n, 512, 1).value('score matrix', 'naive')",
        **judged(ok, "the memory crossover is not at n = d or the paths are not 1 and n"),
    )


@check("001-2.3-a")
def _parallel() -> Finding:
    from ... import KVCache, masks

    mha = _mha_eval(32, 4, seed=1)
    x = _seq(12, 32, seed=1)
    with torch.no_grad():
        full = mha(x, mask=masks.causal())
        cache = KVCache(12)
        steps = torch.cat([mha(x[:, t : t + 1], cache=cache) for t in range(12)], dim=1)
    err = float((full - steps).abs().max())
    ok = err < 1e-12
    return Finding(
        computed=f"1 call over 12 positions vs 12 sequential steps: max difference {tiny(err)}",
        call="mha(x, mask=masks.causal()) vs [mha(x[:, t:t+1], cache=KVCache(12)) for t]",
        **judged(ok, "the parallel and sequential computations differ"),
    )


@check("001-5.1-a")
def _long_range() -> Finding:
    from ...analysis.costs import complexity_table

    n, d = 256, 32
    x = _seq(n, d, 32).requires_grad_()
    _mha_eval(d, 4, 32)(x)[0, -1].sum().backward()
    attn = float(x.grad[0, 0].norm())
    torch.manual_seed(32)
    rnn = torch.nn.RNN(d, d, batch_first=True).double()
    x2 = x.detach().clone().requires_grad_()
    rnn(x2)[0][0, -1].sum().backward()
    rec = float(x2.grad[0, 0].norm())
    rows = {r["layer"]: r["path"] for r in complexity_table(n, d)}
    ok = attn > 1e-6 and rec < 1e-6 * attn and rows["self-attention"] == 1
    return Finding(
        computed=f"|∂y_{n}/∂x_1| = {attn:.2e} through one attention layer vs {rec:.2e} through "
        f"the RNN; path lengths {rows['self-attention']} vs {rows['recurrent']}",
        call="MultiHeadAttention(32, 4)(x)[0, -1].sum().backward(); the same through "
        "torch.nn.RNN(32, 32); complexity_table(256, 32)",
        **judged(ok, "the far token does not reach the last output directly"),
    )


@check("002-8.4.3-a")
def _parallel_vs_sequential() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 10, 16, seed=1)
    full = mha(x, mask=masks.causal())
    cache = KVCache()
    steps = torch.cat(
        [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(10)], 1
    )
    err = float((full - steps).abs().max())
    return _found(
        f"1 parallel call vs 10 sequential cached steps: max |Δ| = {_err(err)}",
        "mha(x, mask=masks.causal()) vs mha(x[:, t:t+1], mask=masks.causal(), cache=KVCache())",
        err < 1e-12,
        "the parallel and sequential results differ",
    )


@check("002-8.6-h")
def _streaming() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 10, 16, seed=2)
    cache = KVCache()
    outs = [mha(x[:, :6], mask=masks.causal(), cache=cache)]
    outs += [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(6, 10)]
    err = float((torch.cat(outs, 1) - mha(x, mask=masks.causal())).abs().max())
    return _found(
        f"prefill + 4 cached steps vs one full call: max |Δ| = {_err(err)}; cache holds "
        f"{len(cache)} tokens",
        "mha(x_t, mask=masks.causal(), cache=KVCache())",
        err < 1e-12 and len(cache) == 10,
        "cached incremental decoding differs from the full computation",
    )


@check("002-8.9-k")
def _kv_recompute() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 8, 16, seed=4)
    cache = KVCache()
    inc = [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(8)]
    rec = [mha(x[:, : t + 1], mask=masks.causal())[:, -1:] for t in range(8)]  # recompute all
    err = float((torch.cat(inc, 1) - torch.cat(rec, 1)).abs().max())
    return _found(
        f"cached vs recomputed, 8 steps: max |Δ| = {_err(err)}",
        "mha(x_t, mask=masks.causal(), cache=KVCache()) vs mha(x[:, :t+1], "
        "mask=masks.causal())[:, -1:]",
        err < 1e-12,
        "the cache changes the outputs",
    )
