"""Seed 000 from cosine attention on: cosine scores, temperature, the code sample, complexity
and the efficient variants.

The checks of claims whose metadata is in ``claims/seed000.toml``.
"""

from __future__ import annotations

import itertools
import math

import torch

from .. import derivations as ind
from ..core import Derivation, Finding, check, judged, tiny
from .seed000 import _qkv


@check("000-cos-a")
def _cosine_invariance() -> Finding:
    from ... import attention

    q, k, v = _qkv(4, 6, 32, 3, seed=6)
    q, k = q * 1000, k * 1000
    out, w = attention(q, k, v, score="cosine", return_weights=True)
    scaled = attention(q * 7.5, k * 0.01, v, score="cosine")
    logits = torch.log(w) - torch.log(w).amin(-1, keepdim=True)  # spread of the scores
    err = float((out - scaled).abs().max())
    ok = err < 1e-12 and float(logits.max()) <= 2.0 + 1e-12
    return Finding(
        computed=f"rescaling q by 7.5 and k by 0.01 changes the output by {tiny(err)}; the largest "
        f"score spread in a row is {float(logits.max()):.3f} ≤ 2 (scores in [-1, 1])",
        call="attention(q, k, v, score='cosine') vs attention(7.5 q, 0.01 k, v, score='cosine')",
        **judged(ok, "cosine attention depends on the lengths"),
    )


@check("000-cos-b")
def _cosine_dimension() -> Finding:
    from ... import attention
    from ...analysis.weights import entropy

    spreads, ents, by_hand = [], [], True
    for d in (16, 1024):
        q, k, v = _qkv(64, 128, d, 2, seed=7)
        _, w = attention(q, k, v, score="cosine", return_weights=True)
        qn, kn = (t[0, 0].numpy() / t[0, 0].norm(dim=-1, keepdim=True).numpy() for t in (q, k))
        c = qn @ kn.T  # cos θ between every query and key, numpy
        spreads.append(float(c.std(ddof=1)))
        ents.append(float(entropy(w).mean()))
        by_hand &= abs(ents[-1] - float(ind.entropy(ind.softmax(c)).mean())) < 1e-9
    uniform = torch.log(torch.tensor(128.0, dtype=torch.float64)).item()
    shrinks = spreads[1] < spreads[0] / 4 and ents[1] > ents[0]
    return Finding(
        computed=f"std of cos θ: {spreads[0]:.3f} at d=16, {spreads[1]:.4f} at d=1024 (≈ 1/√d); "
        f"mean weight entropy {ents[0]:.4f} → {ents[1]:.4f} nats (uniform: {uniform:.4f})",
        call="attention(q, k, v, score='cosine', return_weights=True); entropy(w)",
        **judged(
            not shrinks,
            "the range [-1, 1] does not depend on d, but the spread of cos θ between "
            "random vectors is 1/√d, so without a learned scale (temperature) the weights flatten "
            "towards uniform as d grows",
            Derivation(
                by_hand,
                "the entropy of softmax(cos θ) computed in numpy from the normalised q and k "
                "equals attnlab's at both d to 1e-9",
            ),
        ),
    )


@check("000-temp-a")
def _temperature() -> Finding:
    from ... import attention
    from ...analysis.weights import entropy

    q, k, v = _qkv(8, 32, 16, 4, seed=8)
    temps = (0.1, 0.5, 1.0, 2.0, 10.0)
    ents = [
        float(entropy(attention(q, k, v, temperature=t, return_weights=True)[1]).mean())
        for t in temps
    ]
    ok = all(a < b for a, b in itertools.pairwise(ents))
    return Finding(
        computed="mean entropy "
        + ", ".join(f"T={t:g}: {e:.3f}" for t, e in zip(temps, ents, strict=True))
        + " nats (uniform 3.466)",
        call="entropy(attention(q, k, v, temperature=T, return_weights=True)[1])",
        **judged(ok, "entropy does not grow with T"),
    )


@check("000-code-a")
def _java_sample() -> Finding:
    from ... import MultiHeadAttention

    torch.manual_seed(18)
    mha = MultiHeadAttention(16, 1).double().eval().requires_grad_(False)
    (wq, bq), (wk, bk), (wv, bv) = mha.projection_weights()
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(18), dtype=torch.float64)
    lin = torch.nn.functional.linear
    Q, K, V = lin(x, wq, bq), lin(x, wk, bk), lin(x, wv, bv)  # wQ/wK/wV.forward(input)
    scores = Q @ K.transpose(-2, -1)  # Q.dot(K.transpose(-2, -1))
    scores = scores / math.sqrt(16)  # scores.div(Math.sqrt(dKey))
    weights = scores.softmax(-1)  # scores.softmax(-1)
    output = weights @ V  # weights.dot(V)
    sample = mha.out_proj(output)  # wO.forward(output)
    err = float((sample - mha(x)).abs().max())
    return Finding(
        computed=f"max |sample − MultiHeadAttention(16, 1)(x)| = {tiny(err)}",
        call="the sample's six steps with mha.projection_weights() and mha.out_proj vs mha(x)",
        **judged(err < 1e-12, "the code sample differs from attention with an output projection"),
    )


@check("000-time-a")
def _time_complexity() -> Finding:
    from ...analysis import estimate

    rows = ("scores QKᵀ", "softmax", "weighted sum PV")

    def flops(n: int, d: int) -> list[float]:
        e = estimate(n, d, 1)
        return [e.value(r, "naive") for r in rows]

    base = flops(512, 64)
    by_n = [b2 / b1 for b1, b2 in zip(base, flops(1024, 64), strict=True)]
    by_d = [b2 / b1 for b1, b2 in zip(base, flops(512, 128), strict=True)]
    ok = by_n == [4.0, 4.0, 4.0] and by_d == [2.0, 1.0, 2.0]
    return Finding(
        computed=f"n=512, d=64: QKᵀ {base[0]:,.0f}, softmax {base[1]:,.0f}, PV {base[2]:,.0f} "
        f"FLOPs; ×{by_n} when n doubles, ×{by_d} when d doubles",
        call="estimate(n, d, 1).value('scores QKᵀ' | 'softmax' | 'weighted sum PV', 'naive')",
        **judged(ok, "the FLOP counts do not scale as n²d, n², n²d"),
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


@check("000-o2-a")
def _doubling() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...models import TransformerBlock, TransformerConfig

    # the reference backend: plain matmuls that FlopCounterMode sees (a fused kernel is opaque)
    cfg = TransformerConfig(
        d_model=768, n_heads=12, d_ff=3072, positional=None, attn_backend="reference"
    )
    with torch.device("meta"):
        block = TransformerBlock(cfg)
    counts = {}
    for n in (1024, 2048, 4096, 8192):
        with FlopCounterMode(display=False) as fc:
            block(torch.empty(1, n, 768, device="meta"))
        counts[n] = fc.get_total_flops()
    ratios = {n: counts[2 * n] / counts[n] for n in (1024, 2048, 4096)}
    formula = all(counts[n] == ind.transformer_layer_flops(n, 768, 3072) for n in counts)
    wrong = all(r < 3.5 for r in ratios.values())
    return Finding(
        computed="FLOPs per layer = 24nd² + 4n²d exactly; doubling n multiplies them by "
        + ", ".join(f"{r:.2f} at n={n}" for n, r in ratios.items()),
        call="FlopCounterMode(); TransformerBlock(cfg)(torch.empty(1, n, 768, device='meta'))",
        **judged(
            not wrong,
            "only the n² part (attention scores) quadruples; a whole layer at d=768 "
            f"grows {ratios[1024]:.2f}× (n=1024), {ratios[2048]:.2f}× (2048), {ratios[4096]:.2f}× "
            "(4096) and approaches 4× only when n ≫ 6d",
            Derivation(
                formula,
                "closed form 8nd² + 4n·d·d_ff + 4n²d (projections, FFN, scores and mixing) "
                "equals the counted FLOPs at every n",
            ),
        ),
    )


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


@check("000-sparse-a")
def _sparse_cost() -> Finding:
    from ... import masks

    parts, ok = [], True
    for n in (1024, 4096):
        w, s = 64, int(n**0.5)
        local = masks.sliding_window(w).attended_pairs(n, n)
        strided = masks.strided(s).attended_pairs(n, n)
        ok &= 0.9 * n * w <= local <= n * w and 0.5 * n * s <= strided <= 2 * n * s
        parts.append(
            f"n={n}: window {local:,} pairs (nw = {n * w:,}), stride {s}: {strided:,} "
            f"(n√n = {n * s:,})"
        )
    return Finding(
        computed="; ".join(parts) + f"; dense causal {masks.causal().attended_pairs(4096, 4096):,}",
        call="masks.sliding_window(64).attended_pairs(n, n); "
        "masks.strided(√n).attended_pairs(n, n)",
        **judged(ok, "the pair counts do not scale as nw and n√n"),
    )


@check("000-linear-a")
def _linear_formula() -> Finding:
    from ...linear import linear_attention

    q, k, v = _qkv(64, 64, 16, 16, seed=9)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    ours = linear_attention(q, k, v, feature_map="elu", eps=0.0)
    right = ind.linear_attention(q.numpy(), k.numpy(), v.numpy())
    text = q @ (phi(k).mT @ phi(v))
    gap = float(abs(ours.numpy() - right).max())
    rel = float((text - ours).norm() / ours.norm())
    wrong = rel > 0.5
    return Finding(
        computed="linear_attention = φ(Q)(φ(K)ᵀV) / (φ(Q)φ(K)ᵀ1) to "
        f"{tiny(gap, 1e-10)}; the text's Q·φ(K)ᵀ·φ(V) differs from it by {rel:.3g} (relative)",
        call="linear_attention(q, k, v, feature_map='elu', eps=0.0) vs q @ (φ(k).mT @ φ(v))",
        **judged(
            not wrong,
            "φ belongs on Q and K, not V, and the row normaliser φ(Q)φ(K)ᵀ1 is missing: "
            "linear attention is φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1))",
            Derivation(
                gap < 1e-10,
                "φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1)) with φ = elu + 1 in numpy (Katharopoulos et "
                "al., eq. 6) equals linear_attention to 1e-10",
            ),
        ),
    )


@check("000-linear-b")
def _linear_works() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...functional.fnet import fnet_mixing
    from ...functional.performer import favor_attention
    from ...linear import linear_attention

    def count(fn) -> int:
        with FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()

    growth = {}
    for name, fn in (
        (
            "Performer",
            lambda q: favor_attention(
                q, q, q, num_features=64, generator=torch.Generator().manual_seed(17)
            ),
        ),
        ("Linear Transformer", lambda q: linear_attention(q, q, q, feature_map="elu")),
    ):
        f1, f2 = (count(lambda n=n, fn=fn: fn(torch.zeros(1, 1, n, 32))) for n in (512, 1024))
        growth[name] = f2 / f1
    x = torch.zeros(1, 8, 4, dtype=torch.float64)
    x[0, 3, 1] = 1.0
    mixed = fnet_mixing(x)[0]
    negative, reached = int((mixed < -1e-12).sum()), int((mixed.abs() > 1e-12).sum())
    wrong = all(abs(g - 2) < 0.01 for g in growth.values()) and negative > 0
    fft_ok = ind.close(mixed.numpy(), ind.fourier_mixing(x.numpy())[0], 1e-12)
    return Finding(
        computed="FLOPs ×"
        + ", ×".join(f"{g:.3f} ({k})" for k, g in growth.items())
        + " when n doubles (linear); FNet's fnet_mixing(x) takes no queries or keys: a one-hot "
        f"token reaches {reached} of {mixed.numel()} outputs, {negative} with negative weights (no "
        "softmax, not a distribution), by an FFT",
        call="FlopCounterMode over favor_attention(q, q, q, num_features=64) and "
        "linear_attention(q, q, q, feature_map='elu') at n = 512, 1024; fnet_mixing(one-hot)",
        **judged(
            not wrong,
            "Performer and the Linear Transformer are linear-time attention, but FNet is not "
            "attention at all (a fixed Fourier token mixing without queries, keys or softmax) "
            "and its FFT costs O(n log n), not O(n)",
            Derivation(
                fft_ok,
                "FNet's mixing Re(FFT_seq(FFT_hidden(x))) by numpy's FFT equals fnet_mixing on the "
                "one-hot token",
            ),
        ),
    )


@check("000-mem-a")
def _checkpointing() -> Finding:
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
