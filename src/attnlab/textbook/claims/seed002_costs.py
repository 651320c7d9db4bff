"""Seed 002, §8.4: time, memory and parallelism.

The checks of claims whose metadata is in ``claims/seed002.toml``.
"""

from __future__ import annotations

import math

import torch

from .. import derivations as ind
from ..core import (
    NOT_CHECKABLE,
    Derivation,
    Finding,
    check,
    fmt,
)
from .seed002 import _err, _found, _mha, _qkv, _randn, _softmax_ref


# ------------------------------------------------------------------------------------ 8.4
def _est(n: int, E: int = 768, H: int = 12, **kw):
    from ...analysis import estimate

    return estimate(n, E, H, **kw)


@check("002-8.4.1-a")
def _proj_cost() -> Finding:
    p = {
        (n, E): _est(n, E).value("QKV + output projections", "naive")
        for n, E in ((512, 768), (1024, 768), (512, 1536))
    }
    rn, rd = p[1024, 768] / p[512, 768], p[512, 1536] / p[512, 768]
    ok = rn == 2 and rd == 4 and p[512, 768] == 8 * 512 * 768**2
    return _found(
        f"{fmt(p[512, 768])} FLOPs at n=512, d=768 (= 8·n·d²); ×{fmt(rn)} for 2n, ×{fmt(rd)} "
        "for 2d",
        "estimate(n, d, 12).value('QKV + output projections', 'naive')",
        ok,
        "the projection cost is not linear in n and quadratic in d",
    )


@check("002-8.4.1-b")
def _score_pv_cost() -> Finding:
    s = {
        n: (
            _est(n, 64, 1).value("scores QKᵀ", "naive"),
            _est(n, 64, 1).value("weighted sum PV", "naive"),
        )
        for n in (512, 1024)
    }
    ok = all(a == b == 2 * n * n * 64 for n, (a, b) in s.items())
    return _found(
        "; ".join(f"n={n}: QKᵀ {fmt(a)}, PV {fmt(b)} FLOPs (2·n²·d)" for n, (a, b) in s.items()),
        "estimate(n, 64, 1).value('scores QKᵀ' / 'weighted sum PV', 'naive')",
        ok,
        "the score or weighted-sum cost is not 2·n²·d",
    )


@check("002-8.4.1-c")
def _total_cost() -> Finding:
    vals = {n: _est(n).value("total", "naive") for n in (256, 1024, 4096)}
    ok = all(v == 8 * n * 768**2 + 4 * n * n * 768 + 5 * 12 * n * n for n, v in vals.items())
    return _found(
        "; ".join(f"n={n}: {fmt(v)} FLOPs" for n, v in vals.items()) + " = 8nd² + 4n²d + 5hn²",
        "estimate(n, 768, 12).value('total', 'naive')",
        ok,
        "the total is not 8nd² + 4n²d + 5hn²",
    )


def _rnn_flops(n: int, d: int) -> int:
    """FLOPs of an Elman RNN (torch.nn.RNN, d → d): two d×d mat-vecs per step."""
    rnn = torch.nn.RNN(d, d, bias=False)
    return 2 * n * sum(p.numel() for p in rnn.parameters())


@check("002-8.4.1-d")
def _rnn_crossover() -> Finding:
    def core(n: int) -> float:
        e = _est(n)
        return sum(e.value(r, "naive") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))

    ratio = {n: core(n) / _rnn_flops(n, 768) for n in (256, 512, 768, 1024, 2048)}
    ok = ratio[256] < 1 < ratio[1024] and 0.5 < ratio[512] < 2
    return _found(
        "attention core / RNN FLOPs: " + ", ".join(f"n={n}: {fmt(r, 3)}" for n, r in ratio.items()),
        "estimate(n, 768, 12) scores+softmax+PV vs 2·n·numel(torch.nn.RNN(768, 768))",
        ok,
        "the crossover is not near n = d_model",
    )


@check("002-8.4.2-a")
def _forward_memory() -> Finding:
    sm = {
        (n, h): _est(n, 768, h).value("score matrix", "naive") for n in (512, 1024) for h in (6, 12)
    }
    ok = all(v == 4 * h * n * n for (n, h), v in sm.items())
    return _found(
        "score matrix bytes: "
        + ", ".join(f"n={n} h={h}: {int(v):,}" for (n, h), v in sm.items())
        + " (= 4·h·n²)",
        "estimate(n, 768, h).value('score matrix', 'naive')",
        ok,
        "the score matrix memory is not h·n² elements",
    )


@check("002-8.4.2-b")
def _backward_memory() -> Finding:
    one = _est(2048).value("activations kept for backward", "naive")
    twelve = _est(2048, layers=12).value("activations kept for backward", "naive")
    p = 12 * 2048**2 * 4
    ok = twelve == 12 * one and p / one > 0.85
    return _found(
        f"kept activations {fmt(one / 2**20)} MiB for 1 layer, {fmt(twelve / 2**20)} MiB for 12 "
        f"(×{fmt(twelve / one)}); the n²·h probabilities are {fmt(100 * p / one, 3)} % of it",
        "estimate(2048, 768, 12, layers=L).value('activations kept for backward', 'naive')",
        ok,
        "the kept activations do not scale as L·n²·h",
    )


@check("002-8.4.2-c")
def _memory_techniques() -> Finding:
    f32 = _est(4096).value("score matrix", "naive")
    f16 = _est(4096, dtype="float16").value("score matrix", "naive")
    tiled = {n: _est(n).value("score matrix", "flash") for n in (1024, 4096, 16384)}
    ok = f16 * 2 == f32 and len(set(tiled.values())) == 1 and tiled[4096] < f32 / 100
    return _found(
        f"n=4096 scores: float32 {fmt(f32 / 2**20)} MiB, float16 {fmt(f16 / 2**20)} MiB; "
        f"tiled {fmt(tiled[4096] / 2**20)} MiB at n = 1024, 4096 and 16384 alike",
        "estimate(n, 768, 12, dtype=…).value('score matrix', 'naive' / 'flash')",
        ok,
        "fp16 or tiling do not reduce the memory as stated",
    )


@check("002-8.4.2-d")
@check("002-8.7-e")
def _memory_doubling() -> Finding:
    kept = {
        i: _est(2048, 768, 12).value("activations kept for backward", i)
        / _est(1024, 768, 12).value("activations kept for backward", i)
        for i in ("naive", "flash")
    }
    scores = _est(2048).value("score matrix", "naive") / _est(1024).value("score matrix", "naive")
    ok = abs(kept["naive"] - 4) < 0.2 and abs(kept["flash"] - 4) < 0.2
    closed = all(
        _est(n, 768, 12).value("activations kept for backward", i)
        == ind.attention_kept_bytes(n, 768, 12, 4, tiled=i == "flash")
        for n in (1024, 2048)
        for i in ("naive", "flash")
    )
    return _found(
        f"n 1024 → 2048 (d_model=768, h=12): score matrix ×{fmt(scores)}; activations kept "
        f"for backward ×{fmt(kept['naive'], 3)} (naive), ×{fmt(kept['flash'], 3)} (tiled)",
        "estimate(n, 768, 12).value('activations kept for backward', impl), n = 1024, 2048",
        ok,
        f"only the n×n score matrix grows 4×; a naive layer's kept activations grow "
        f"{kept['naive']:.2f}× (the O(n·d) Q/K/V/output part doubles) and a tiled one's "
        f"{kept['flash']:.2f}×",
        Derivation(
            closed,
            "closed form 4·n·d_model·bytes (Q, K, V, output) + h·n²·bytes (P) or h·n·4 (the "
            "log-sum-exp) equals estimate's bytes at n = 1024 and 2048",
        ),
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


@check("002-8.4.3-b")
def _utilisation() -> Finding:
    return Finding(
        "nothing computed",
        "measure_estimate(estimate(...)) on the target accelerator",
        NOT_CHECKABLE,
        "a GPU/TPU with a known peak FLOPS (this CPU run is shared and unrepresentative)",
    )


@check("002-8.4.4-a")
def _long_table() -> Finding:
    table = {
        512: (262_144, 0.5),
        2048: (4 * 2**20, 8),
        8192: (64 * 2**20, 128),
        32768: (1024 * 2**20, 2048),
        131072: (16384 * 2**20, 32768),
    }
    got, ok = [], True
    for n, (entries, mib) in table.items():
        e = _est(n, 64, 1, dtype="float16")
        b = e.value("score matrix", "naive")
        pairs = e.value("attended pairs per head", "naive")
        ok &= pairs == entries and b == mib * 2**20
        got.append(f"n={n}: {int(pairs):,} entries, {fmt(b / 2**20)} MiB")
    return _found(
        "; ".join(got),
        "estimate(n, 64, 1, dtype='float16').value('score matrix', 'naive')",
        ok,
        "the sizes differ from the table",
    )


@check("002-8.4.4-b")
def _sparse_cost() -> Finding:
    from ... import masks

    r = {}
    for n in (256, 1024, 2304):
        m = masks.strided(math.isqrt(n))
        r[n] = _est(n, 64, 1, mask=m).value("attended pairs per head", "flash") / n**1.5
    ok = max(r.values()) / min(r.values()) < 1.1
    return _found(
        "attended pairs / n^1.5: " + ", ".join(f"n={n}: {fmt(v)}" for n, v in r.items()),
        "estimate(n, 64, 1, mask=masks.strided(isqrt(n))).value('attended pairs per head', "
        "'flash')",
        ok,
        "the strided pattern's cost does not grow as n√n",
    )


@check("002-8.4.4-c")
def _sparse_patterns() -> Finding:
    from ... import masks

    w = masks.sliding_window(8).to_dense(64, 64)[0, 0]
    s = masks.strided(8).to_dense(64, 64)[0, 0]
    row = w.sum(-1)
    far = s[63, : 63 - 7].nonzero().flatten().tolist()  # keys beyond the local block
    b0 = masks.bigbird(8, 1, 1, 1, seed=0).to_dense(64, 64)[0, 0]
    b1 = masks.bigbird(8, 1, 1, 1, seed=1).to_dense(64, 64)[0, 0]
    ok = int(row[8:].min()) == int(row[8:].max()) == 8 and all((63 - j) % 8 == 0 for j in far)
    ok = ok and bool((b0 != b1).any())
    return _found(
        f"window: every row past 8 attends {int(row[8:].max())} keys; strided: query 63's "
        f"far keys {far} (63 − j ≡ 0 mod 8); bigbird's random blocks change with the seed: "
        f"{bool((b0 != b1).any())}",
        "masks.sliding_window(8), masks.strided(8), masks.bigbird(8, 1, 1, 1, seed)",
        ok,
        "a pattern does not select the keys described",
    )


@check("002-8.4.4-d")
def _linear_formula() -> Finding:
    from ...linear import linear_attention

    q, k, v = _qkv(H=1, L=256, D=16)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    text = phi(q) @ (phi(k).transpose(-1, -2) @ v)
    lin = linear_attention(q, k, v)
    norm = phi(q) @ phi(k).sum(-2, keepdim=True).transpose(-1, -2)  # φ(q_i)ᵀ Σ_j φ(k_j)
    err_norm = float((text / norm - lin).abs().max())
    rel = float((text - lin).norm() / lin.norm())
    witness = ind.close(lin.numpy(), ind.linear_attention(q.numpy(), k.numpy(), v.numpy()), 1e-9)
    return _found(
        f"‖φ(Q)(φ(K)ᵀV) − linear_attention‖/‖linear_attention‖ = {fmt(rel)}; divided by "
        f"φ(Q)(φ(K)ᵀ1) it matches to {_err(err_norm, 1e-9)}",
        "linear_attention(q, k, v) vs phi(q) @ (phi(k).mT @ v)",
        rel < 1e-6,
        "the normaliser is missing: φ(Q)(φ(K)ᵀV) must be divided row-wise by φ(Q)(φ(K)ᵀ1), "
        "else rows are sums, not weighted averages (here ~n·mean times too large)",
        Derivation(
            witness,
            "φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1)) with φ = elu + 1 in numpy equals linear_attention "
            "to 1e-9",
        ),
    )


@check("002-8.4.4-e")
def _linear_cost() -> Finding:
    def core(n: int, d: int) -> float:
        e = _est(n, d, 1)
        return sum(e.value(r, "linear") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))

    rn, rd = core(2048, 64) / core(1024, 64), core(1024, 128) / core(1024, 64)
    return _found(
        f"×{fmt(rn)} for 2n, ×{fmt(rd)} for 2d (4 for a pure d² term; the O(n·d) normaliser "
        "and feature map make it a little less)",
        "estimate(n, d, 1) rows 'scores QKᵀ' + 'softmax' + 'weighted sum PV', 'linear'",
        rn == 2 and 3.8 < rd <= 4,
        "the linear form's cost is not linear in n and quadratic in d",
    )


@check("002-8.4.4-f")
def _hierarchical() -> Finding:
    from ...functional import reference
    from ...linear import hierarchical_attention

    q, k, v = _qkv(H=1, L=64)
    out = hierarchical_attention(q, k, v, block_size=8)
    ref = reference.hierarchical_attention(q, k, v, block_size=8)
    err = float((out - ref).abs().max())
    dense = float((out - _softmax_ref(q, k, v)).abs().max())
    return _found(
        f"output {tuple(out.shape)}; max |fast − reference| = {_err(err)}; differs from dense "
        f"attention by up to {fmt(dense)} (an approximation)",
        "hierarchical_attention(q, k, v, block_size=8)",
        err < 1e-12 and out.shape == q.shape,
        "the hierarchical scheme does not produce n outputs from n/k summaries",
    )


@check("002-8.4.4-g")
def _flash_memory() -> Finding:
    from ... import attention

    q, k, v = _qkv(L=300, D=16)
    err = float((attention(q, k, v, backend="flash") - _softmax_ref(q, k, v)).abs().max())
    kept = {n: _est(n).value("activations kept for backward", "flash") for n in (2048, 4096)}
    tile = {n: _est(n).value("score matrix", "flash") for n in (2048, 4096)}
    ok = err < 1e-12 and kept[4096] == 2 * kept[2048] and tile[2048] == tile[4096]
    return _found(
        f"max |flash − softmax(QKᵀ/√d)V| = {_err(err)}; kept activations ×"
        f"{fmt(kept[4096] / kept[2048])} for 2n; score tile {fmt(tile[2048] / 2**20)} MiB at "
        "any n",
        "attention(q, k, v, backend='flash'); estimate(n, 768, 12) 'flash' rows",
        ok,
        "the tiled form is not exact or not O(n) in memory",
    )


@check("002-8.4.4-h")
def _flash_speed() -> Finding:
    naive = _est(65536, 64, 1, dtype="float16").value("score matrix", "naive")
    tiled = _est(65536, 64, 1, dtype="float16").value("activations kept for backward", "flash")
    return Finding(
        f"memory side at n=65536, one head, fp16: naive scores {fmt(naive / 2**30)} GiB; tiled "
        f"keeps {fmt(tiled / 2**20)} MiB",
        "estimate(65536, 64, 1, dtype='float16')",
        NOT_CHECKABLE,
        "a GPU with HBM/SRAM (the 2–4× is a GPU kernel measurement)",
    )
