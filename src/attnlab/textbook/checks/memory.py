"""Checks of memory: the bytes of the score matrix, what training keeps, checkpointing, mixed
precision, and the tiled (flash) kernels' IO and exactness (subjects ``bytes``, ``kept-layers``,
``checkpointing``, ``flash-kept``, ``merge``, ``io``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged
from ._shared import (
    _close,
    _err,
    _est,
    _found,
    _gen,
    _io_flash,
    _qkv,
    _randn_from,
    _softmax_ref,
    _verdict,
)


@check("000-space-a")
def _matrix_memory() -> Finding:
    from ...analysis import estimate

    table = {128: 64 * 2**10, 512: 2**20, 1024: 4 * 2**20, 4096: 64 * 2**20, 16384: 2**30}
    got, ok = [], True
    for n, want in table.items():
        nbytes = estimate(n, 64, 1, dtype="float32").value("score matrix", "naive")
        ok &= nbytes == want
        got.append(f"n={n}: {int(nbytes):,} B")
    return Finding(
        computed="; ".join(got),
        call="estimate(n, 64, 1, dtype='float32').value('score matrix', 'naive')",
        **judged(ok, "the byte counts differ from the table"),
    )


@check("000-o2-b")
def _twelve_gb() -> Finding:
    from ...analysis.costs import max_seq_len

    bert = dict(
        d_model=768, n_layers=12, n_heads=12, vocab_size=30522, learned_positions=512, batch=1
    )
    naive32 = max_seq_len("12GB", dtype="float32", attention="naive", **bert)
    naive16 = max_seq_len("12GB", dtype="float16", attention="naive", **bert)
    tiled32 = max_seq_len("12GB", dtype="float32", attention="flash", **bert)
    ok = naive32 <= 4096 <= naive16 and tiled32 > 2 * 4096
    return Finding(
        computed=f"largest n in 12 GB: {naive32:,} (float32), {naive16:,} (mixed float16); "
        f"with tiled attention (the 'special optimisation') {tiled32:,} in float32",
        call="max_seq_len('12GB', dtype=…, attention='naive'|'flash', d_model=768, n_layers=12, "
        "n_heads=12, vocab_size=30522, learned_positions=512, batch=1)",
        **judged(ok, "the memory model does not put the limit near 4096"),
    )


@check("000-mem-a")
def _checkpointing_trade() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...models import GPT, TransformerConfig

    torch.manual_seed(10)
    model = GPT(TransformerConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4)).double()
    idx = torch.randint(0, 50, (1, 128), generator=torch.Generator().manual_seed(10))
    saved, flops, losses = {}, {}, {}
    for on in (False, True):
        model.gradient_checkpointing = on
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with FlopCounterMode(display=False) as fc:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(idx).logsumexp(-1).mean()
            loss.backward()
        saved[on], flops[on], losses[on] = total, fc.get_total_flops(), float(loss.detach())
        model.zero_grad()
    ok = saved[True] < saved[False] / 2 and flops[True] > flops[False]
    return Finding(
        computed=f"saved for backward {saved[False] / 2**20:.2f} MiB → "
        f"{saved[True] / 2**20:.2f} MiB; forward + backward FLOPs "
        f"×{flops[True] / flops[False]:.3f}; same loss: {losses[True] == losses[False]}",
        call="model.gradient_checkpointing = True; saved_tensors_hooks; FlopCounterMode",
        **judged(ok, "checkpointing did not trade compute for memory"),
    )


@check("000-mem-b")
def _mixed_precision() -> Finding:
    from ...analysis.costs import model_cost

    kw = dict(d_model=768, n_layers=12, n_heads=12, vocab_size=30522, batch=8, train=True)
    mem = {dt: model_cost(512, dtype=dt, **kw).memory for dt in ("float32", "bfloat16")}
    scale = torch.amp.GradScaler("cpu").get_scale()
    g = torch.tensor(1e-8)
    fp16, bf16 = float(g.half()), float(g.bfloat16())
    scaled = float((g * scale).half()) / scale
    ok = (
        mem["bfloat16"]["total"] < mem["float32"]["total"]
        and mem["bfloat16"]["activations"] < 0.51 * mem["float32"]["activations"]
        and fp16 == 0.0
        and abs(scaled / 1e-8 - 1) < 1e-2
        and bf16 > 0
    )
    return Finding(
        computed=f"training memory {mem['float32']['total'] / 2**30:.2f} GiB float32 → "
        f"{mem['bfloat16']['total'] / 2**30:.2f} GiB mixed bfloat16 (activations "
        f"×{mem['bfloat16']['activations'] / mem['float32']['activations']:.3f}, float32 master "
        f"weights added); a 1e-8 gradient is {fp16:g} in float16, {scaled:.3g} after "
        f"scaling by {scale:g}, {bf16:.3g} in bfloat16 (which needs no scaling)",
        call="model_cost(512, dtype='float32'|'bfloat16', train=True, …).memory; "
        "torch.tensor(1e-8).half(), (g * GradScaler('cpu').get_scale()).half()",
        **judged(ok, "16-bit training does not save memory or fp16 does not need scaling"),
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


@check("002-8.4.2-d", "002-8.7-e")
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


#: The 12-layer model of §8.4.2's memory rule: GPT-2 small (d=768, 12 heads, tied head).
_GPT2_SMALL = dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50257, batch=1)


def _eager_saved_per_layer(seq_len: int, d_model: int, n_heads: int, dropout: float) -> tuple:
    """(bytes, number of B·H·L·L tensors) one attnlab `TransformerBlock` with the reference
    (eager, L×L-materialising) backend saves for backward at batch 1 × ``seq_len`` in float32,
    counted per saved tensor with autograd's saved-tensor hooks on the meta device (no data)."""
    from ...models import TransformerBlock, TransformerConfig

    cfg = TransformerConfig(
        d_model=d_model,
        n_heads=n_heads,
        d_ff=4 * d_model,
        positional=None,
        attn_backend="reference",
        dropout=dropout,
    )
    with torch.device("meta"):
        block = TransformerBlock(cfg).train()
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        saved[id(t)] = t  # one entry per tensor object, however many ops save it
        return t

    x = torch.empty(1, seq_len, d_model, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    nbytes = sum(t.numel() * t.element_size() for t in saved.values())
    square = sum(1 for t in saved.values() if t.numel() == n_heads * seq_len * seq_len)
    return nbytes, square


def _plain_squares(seq_len: int, n_heads: int, head_dim: int) -> int:
    """How many (1, H, L, L) tensors plain PyTorch attention as the texts write it (§8.9's
    ``softmax(Q Kᵀ / √d_k)``, seed 003's dropout 0.1, ``· V``) saves for backward, counted on the
    meta device."""
    q, k, v = (
        torch.empty(1, n_heads, seq_len, head_dim, device="meta", requires_grad=True)
        for _ in range(3)
    )
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        saved[id(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        p = torch.nn.functional.dropout(torch.softmax(s, dim=-1), 0.1, training=True)
        torch.matmul(p, v)
    return sum(1 for t in saved.values() if t.numel() == n_heads * seq_len * seq_len)


@check("002-8.4.2-f")
def _sixteen_gb() -> Finding:
    from ...analysis.costs import model_cost

    L, gb = 2048, 1e9
    low = model_cost(L, train=True, dtype="float32", attention="naive", **_GPT2_SMALL)
    mixed = model_cost(L, train=True, dtype="float16", attention="naive", **_GPT2_SMALL)
    tiled = model_cost(L, train=True, dtype="float32", attention="flash", **_GPT2_SMALL)
    layers = _GPT2_SMALL["n_layers"]
    model_layer = low.memory["activations"] / layers  # one L×L per head: the probabilities
    eager_layer, squares = _eager_saved_per_layer(L, 768, 12, 0.1)
    eager = low.memory["total"] + layers * (eager_layer - model_layer)
    square = 12 * L * L * 4  # one float32 (1, H, L, L) tensor
    plain_sq = _plain_squares(L, 12, 64)
    plain = low.memory["total"] + layers * (plain_sq - 1) * square
    ok = abs(eager / (16 * gb) - 1) <= 0.15  # the one implementation named in advance
    return _found(
        f"cost model (one L×L per head kept): {fmt(low.memory['total'] / gb, 3)} GB float32, "
        f"{fmt(mixed.memory['total'] / gb, 3)} GB mixed float16, "
        f"{fmt(tiled.memory['total'] / gb, 3)} GB float32 with tiled attention; plain "
        f"PyTorch attention keeps {plain_sq} tensors of 12×2048×2048 floats per layer: "
        f"{fmt(plain / gb, 3)} GB; attnlab's reference layer keeps {squares} "
        f"({fmt(eager_layer / 2**20, 4)} MiB instead of {fmt(model_layer / 2**20, 4)} MiB): "
        f"{fmt(eager / gb, 3)} GB",
        "model_cost(2048, d_model=768, n_layers=12, n_heads=12, vocab_size=50257, train=True, "
        "dtype=…, attention='naive'|'flash').memory['total']; saved_tensors_hooks around "
        "TransformerBlock(attn_backend='reference', dropout=0.1) and the plain code on the meta "
        "device",
        ok,
        f"attnlab's reference implementation needs {fmt(eager / gb, 3)} GB, not about 16",
    )


@check("002-8.6-a")
def _flash_blocks() -> Finding:
    from ... import attention, attention_weights

    q, k, v = _qkv(L=200, D=16)
    _, lse = attention(q, k, v, backend="flash", return_lse=True)
    w = attention_weights(q, k, lse, rows=[0, 199])
    p = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)[:, :, [0, 199]]
    err = float((w - p).abs().max())
    naive = _est(8192).value("score matrix", "naive")
    tile = _est(8192).value("score matrix", "flash")
    return _found(
        f"weights of rows 0 and 199 from the lse match P to {_err(err)}; scores held at n=8192: "
        f"{fmt(naive / 2**20)} MiB naive vs {fmt(tile / 2**20)} MiB in 128×128 tiles",
        "attention(q, k, v, backend='flash', return_lse=True); attention_weights(q, k, lse, "
        "rows=[0, 199]); estimate(8192, 768, 12)",
        err < 1e-12 and tile * 100 < naive,
        "the tiled form needs the full matrices",
    )


@check("002-8.6-g")
def _ring() -> Finding:
    from ... import attention, merge_partials

    q, k, v = _qkv(L=64)
    parts = [
        attention(q, k[:, :, s : s + 16], v[:, :, s : s + 16], return_lse=True)
        for s in range(0, 64, 16)
    ]
    out, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    err = float((out - _softmax_ref(q, k, v)).abs().max())
    return _found(
        f"merge of 4 KV-block partials vs full attention: max |Δ| = {_err(err)}",
        "merge_partials([attention(q, k_b, v_b, return_lse=True)…])",
        err < 1e-12,
        "merging the ring's partial results is not exact",
    )


@check("002-8.4.2-e")
def _checkpointing_recomputes() -> Finding:
    from ...models import GPT, TransformerConfig

    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    grads, calls = {}, {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
        model = GPT(cfg).double().train()
        model.gradient_checkpointing = ckpt
        count = [0]
        for blk in model.blocks:
            blk.register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model(idx).sum().backward()
        grads[ckpt] = torch.cat([p.grad.flatten() for p in model.parameters()])
        calls[ckpt] = count[0]
    err = float((grads[True] - grads[False]).abs().max())
    return _found(
        f"block forwards: {calls[False]} without, {calls[True]} with checkpointing "
        f"(recomputed in backward); max |Δ grad| = {_err(err)}",
        "GPT(cfg).gradient_checkpointing = True; forward pre-hooks on model.blocks",
        err < 1e-12 and calls[True] == 2 * calls[False],
        "checkpointing does not recompute or changes the gradients",
    )


@check("002-8.9-i")
def _ten_thousand() -> Finding:
    b = _est(10000, 512, 8).value("score matrix", "naive")
    one = _est(10000, 64, 1).value("score matrix", "naive")
    return _found(
        f"{fmt(b / 2**30)} GiB ({fmt(b / 1e9)} GB) for 8 heads; {fmt(one / 2**30)} GiB per head",
        "estimate(10000, 512, 8).value('score matrix', 'naive')",
        2.5e9 < b < 3.5e9,
        "the matrix is far from 3 GB",
    )


def _io_fit(block, io=None) -> float:
    """Slope of log IO against log M at N=2^20, d=64 for a block-size rule ``block(M, d)``
    (attnlab's IO model, or ``io(N, d, B)``)."""
    io = _io_flash if io is None else io
    Ms = (2**14, 2**16, 2**18)
    ios = [io(2**20, 64, block(M, 64)) for M in Ms]
    return (math.log(ios[-1]) - math.log(ios[0])) / (math.log(Ms[-1]) - math.log(Ms[0]))


def _io_closed(N: int, d: int, B: float) -> float:
    return float(ind.tiled_io(N, d, max(1, round(B))))


@check("002-ex8.6-a")
def _ex86() -> Finding:
    text = _io_fit(lambda M, d: math.sqrt(M / d))
    right = _io_fit(lambda M, d: M / (4 * d))  # K_j, V_j, Q_i, O_i blocks of B×d in SRAM
    closed = (
        _io_fit(lambda M, d: math.sqrt(M / d), _io_closed),
        _io_fit(lambda M, d: M / (4 * d), _io_closed),
    )
    return _found(
        f"IO ∝ M^{fmt(text, 3)} with B = √(M/d); IO ∝ M^{fmt(right, 3)} with B = M/(4d)",
        "io_tiled(N, d, sram, block=B) at B = sqrt(M/d) and B = M/(4d)",
        abs(text + 1) < 0.05,
        "B = √(M/d) gives O(N²d^1.5/√M); O(N²d²/M) needs B = Θ(M/d) (B×d blocks of Q, K, V, "
        "O filling the SRAM)",
        Derivation(
            abs(closed[0] - text) < 1e-9 and abs(closed[1] - right) < 1e-9,
            "FlashAttention's Algorithm 1 IO 2Nd + ⌈N/B⌉(3Nd + 4N) in closed form gives slopes "
            f"{fmt(closed[0], 3)} and {fmt(closed[1], 3)}",
        ),
    )


@check("004-5.3-b")
def _score_memory() -> Finding:
    from ... import attention
    from ...analysis import estimate

    mem = {n: estimate(n, 64, 1).value("score matrix", "naive") for n in (1024, 2048, 4096)}
    g = _gen(30)
    x = _randn_from(g, 1, 33, 8)
    _, w = attention(x, x, x, return_weights=True)
    ok = all(m == 4 * n * n for n, m in mem.items()) and tuple(w.shape) == (1, 33, 33)
    return Finding(
        computed="; ".join(f"n={n}: {int(m) // 2**20} MiB" for n, m in mem.items())
        + f" (= 4n² bytes); attention(..., return_weights=True) at n=33: {tuple(w.shape)}",
        call="estimate(n, 64, 1).value('score matrix', 'naive')",
        **_verdict(ok, "the score matrix is not n × n"),
    )


@check("004-5.3-e")
def _online_merge() -> Finding:
    from ... import attention, merge_partials

    g = _gen(32)
    q, k, v = _randn_from(g, 1, 2, 10, 5), _randn_from(g, 1, 2, 23, 5), _randn_from(g, 1, 2, 23, 3)
    parts = [
        attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
        for a, b in ((0, 8), (8, 16), (16, 23))
    ]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    full, full_lse = attention(q, k, v, return_lse=True)
    ok = _close(out, full) and _close(lse, full_lse)
    return Finding(
        computed=f"merge of 3 key blocks == full attention: out {_close(out, full)}, lse "
        f"{_close(lse, full_lse)}",
        call="merge_partials([o1, o2, o3], [l1, l2, l3]) vs attention(q, k, v, return_lse=True)",
        **_verdict(ok, "block results do not merge into the full result"),
    )


@check("004-5.3-f")
def _linear_memory() -> Finding:
    from ...analysis import estimate

    a, b = estimate(2048, 768, 12), estimate(4096, 768, 12)
    kept = {
        i: b.value("activations kept for backward", i) / a.value("activations kept for backward", i)
        for i in ("naive", "flash")
    }
    tile = (a.value("score matrix", "flash"), b.value("score matrix", "flash"))
    ok = abs(kept["flash"] - 2) < 1e-9 and kept["naive"] > 3.5 and tile[0] == tile[1]
    return Finding(
        computed=f"doubling n multiplies the memory kept for backward by {fmt(kept['naive'], 3)} "
        f"(naive) and {fmt(kept['flash'], 3)} (flash); flash's transient scores stay "
        f"{int(tile[0]) // 2**10} KiB at both lengths (one 128×128 float32 tile per head)",
        call="estimate(n, 768, 12).value('activations kept for backward', impl)",
        **_verdict(ok, "the tiled form's memory is not linear in n"),
    )
