"""Checks of masking: causal masks, additive −∞ (or −1e9) masks, sliding windows and strided
patterns (subjects ``masking``, ``causal``, ``attention-causal``, ``window``, ``strided``,
``window-tiles``, ``default-window``, ``span``)."""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged
from ._shared import (
    _PERIODIC_CALL,
    F64,
    _close,
    _err,
    _est,
    _found,
    _gen,
    _heads_seq,
    _periodic,
    _permutation_outputs,
    _qkv,
    _randn,
    _randn_from,
    _seq,
    _softmax_ref,
    _unit_pair,
    _verdict,
)


@check("000-sparse-a")
def _window_cost() -> Finding:
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


@check("001-5.2-a")
def _no_locality() -> Finding:
    from ... import attention

    n = 256
    x = _seq(n, 16, 19)[:, None]  # (1, 1, n, 16)
    _, w = attention(x, x, x, return_weights=True)
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs()
    att = [float(w[0, 0][dist == k].mean()) for k in (1, 16, 128)]
    ok = min(att) > 0.5 * max(att)  # no decay with distance (a kernel-3 conv: 0 beyond 1)
    return Finding(
        computed="mean weight at distance 1, 16, 128: attention "
        + ", ".join(f"{v:.3g}" for v in att)
        + f" (uniform 1/n = {1 / n:.3g}); a kernel-3 convolution reaches distance 1 only",
        call="_, w = attention(x, x, x, return_weights=True); w averaged by |i − j|",
        **judged(ok, "attention's weights decay with distance like a convolution's"),
    )


@check("002-8.2.1-a")
def _equivariance() -> Finding:
    out, out_p, perm = _permutation_outputs()
    err = float((out_p - out[:, :, perm]).abs().max())
    return _found(
        f"max |Attention(PQ, PK, PV) − P·Attention(Q, K, V)| = {_err(err)}",
        "attention(q[:, :, perm], k[:, :, perm], v[:, :, perm]) vs attention(q, k, v)[:, :, perm]",
        err < 1e-12,
        "the output is not permuted with the input",
    )


@check("002-8.2.4-b")
def _t5() -> Finding:
    from ... import attention
    from ...positional import T5RelativeBias

    torch.manual_seed(0)
    t5 = T5RelativeBias(2).double()
    m = t5.matrix(12).detach()
    toeplitz = float((m[:, 1:, 1:] - m[:, :-1, :-1]).abs().max())
    q, k, v = _qkv(L=12)
    out = attention(q, k, v, bias=t5).detach()
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + m, -1) @ v
    err = float((out - ref).abs().max())
    return _found(
        f"b[i+1, j+1] − b[i, j] max {_err(toeplitz)} (depends on i − j only); max |attention(…, "
        f"bias=t5) − softmax(QKᵀ/√d + b)V| = {_err(err)}",
        "t5 = T5RelativeBias(2); t5.matrix(12); attention(q, k, v, bias=t5)",
        toeplitz < 1e-15 and err < 1e-12,
        "the T5 bias is not a function of i − j",
    )


@check("002-8.4.4-b")
def _strided_cost() -> Finding:
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


@check("002-8.6-c")
def _flash_variants() -> Finding:
    from ... import attention, masks

    q = _randn(1, 8, 150, 16, seed=1)
    k, v = _randn(1, 2, 150, 16, seed=2), _randn(1, 2, 150, 16, seed=3)
    out = attention(q, k, v, mask=masks.causal(), backend="flash")
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    s = q @ kk.transpose(-1, -2) / 4
    s = s.masked_fill(~torch.ones(150, 150, dtype=torch.bool).tril(), float("-inf"))
    err = float((out - torch.softmax(s, -1) @ vv).abs().max())
    return _found(
        f"causal GQA (8 query / 2 KV heads) on the flash backend: max |Δ| vs dense = {_err(err)}",
        "attention(q, k, v, mask=masks.causal(), backend='flash') with k, v of 2 heads",
        err < 1e-12,
        "the tiled backend does not support causal GQA exactly",
    )


@check("002-8.6-f")
def _sliding_window() -> Finding:
    from ... import masks

    a = masks.sliding_window(4).to_dense(64, 64)[0, 0].to(F64)
    reach, r = [], torch.eye(64, dtype=F64)
    for _ in range(4):
        r = ((r @ a) > 0).to(F64)
        reach.append(int(r[-1].sum()))
    pairs = {
        n: _est(n, 4096, 32, mask=masks.sliding_window(4096)).value(
            "attended pairs per head", "flash"
        )
        for n in (16384, 32768)
    }
    ratio = pairs[32768] / pairs[16384]
    ok = reach == [4, 7, 10, 13] and 2 <= ratio < 2.2
    return _found(
        f"last token's reach after 1–4 layers: {reach} tokens (= L·(W−1)+1); attended pairs "
        f"×{fmt(ratio, 4)} from n=16K to 32K",
        "masks.sliding_window(4).to_dense(64, 64); "
        "estimate(n, 4096, 32, mask=masks.sliding_window(4096))",
        ok,
        "the window's reach or cost do not behave as described",
    )


@check("002-8.9-e")
def _mask_snippets() -> Finding:
    from ... import attention, masks

    q, k, v = _qkv()
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    mask01 = masks.causal().to_dense(8, 8)[0, 0].to(F64)  # 1 = may attend
    times = torch.softmax(s * mask01, -1)
    plus = torch.softmax(s + mask01.masked_fill(mask01 == 0, -1e9), -1)
    _, w = attention(q, k, v, mask=masks.causal(), return_weights=True)
    leak = float((times * (1 - mask01)).sum(-1).max())
    err = float((plus - w).abs().max())
    return _found(
        f"scores·mask leaves up to {fmt(leak)} of a row's weight on masked keys; scores + "
        f"(−1e9 where 0, +1 elsewhere) equals attnlab's causal weights to {_err(err)}",
        "attention(q, k, v, mask=masks.causal(), return_weights=True)",
        leak > 0.1 and err < 1e-12,
        "the snippets behave otherwise",
    )


@check("002-8.9-f")
def _tril() -> Finding:
    from ... import masks

    m = masks.causal().to_dense(7, 7)[0, 0]
    tril = bool((m == torch.tril(torch.ones(7, 7, dtype=torch.bool))).all())
    triu = bool((m == torch.triu(torch.ones(7, 7, dtype=torch.bool))).all())
    return _found(
        f"masks.causal().to_dense(7, 7) == tril: {tril}; == triu: {triu}",
        "masks.causal().to_dense(7, 7)",
        tril and not triu,
        "the causal mask is not the lower triangle",
    )


@check("002-8.9-l")
def _entropy_snippet() -> Finding:
    from ... import attention, masks
    from ...analysis import entropy

    q, k, v = _qkv()
    _, weights = attention(q, k, v, mask=masks.causal(), return_weights=True)
    snippet = float(-(weights * weights.log()).sum(-1).mean())
    lib = float(entropy(weights).mean())
    w_ind = ind.attention_weights(q.numpy(), k.numpy(), keep=ind.causal_keep(q.shape[-2]))
    witness = (
        ind.close(weights.numpy(), w_ind) and abs(lib - float(ind.entropy(w_ind).mean())) < 1e-12
    )
    return _found(
        f"snippet: {snippet}; attnlab.analysis.entropy: {fmt(lib)} nats",
        "-(weights * weights.log()).sum(-1).mean() vs entropy(weights).mean()",
        math.isfinite(snippet) and abs(snippet - lib) < 1e-9,
        "a weight of exactly 0 (any masked key) gives 0·log 0 = 0·(−inf) = NaN, so the snippet "
        "prints nan for masked attention; treat 0·log 0 as 0 (as analysis.entropy does)",
        Derivation(
            witness,
            "causal softmax(QKᵀ/√d) in numpy and its entropy with 0·log 0 = 0 equal attnlab's",
        ),
    )


def _local(n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Exercise 8.4: the text's loop, attnlab with a band mask, attnlab with an additive −∞ M."""
    from ... import attention, masks

    q, k_, v = _qkv(H=1, L=n)
    loop = torch.zeros_like(q)
    for i in range(n):
        s, e = max(0, i - k), min(n, i + k + 1)
        loop[:, :, i] = _softmax_ref(q[:, :, i : i + 1], k_[:, :, s:e], v[:, :, s:e])[:, :, 0]
    band = attention(q, k_, v, mask=masks.sliding_window(k + 1, causal=False))
    idx = torch.arange(n)
    m = torch.zeros(n, n, dtype=F64).masked_fill((idx[:, None] - idx).abs() > k, float("-inf"))
    additive = attention(q, k_, v, mask=m)
    return loop, band, additive


@check("002-ex8.4-a")
def _ex84() -> Finding:
    from ... import masks

    loop, band, additive = _local(32, 3)
    err = max(float((band - loop).abs().max()), float((additive - loop).abs().max()))
    e = _est(4096, 64, 1, mask=masks.sliding_window(65, causal=False))
    pairs = e.value("attended pairs per head", "flash")
    ratio = e.value("scores QKᵀ", "flash") / e.value("scores QKᵀ", "naive")
    want = 4096 * 129 - 64 * 65
    return _found(
        f"loop vs band mask vs −∞ matrix: max |Δ| = {_err(err)}; n=4096, k=64: {int(pairs):,} "
        f"pairs (= n(2k+1) − k(k+1)), score FLOPs {fmt(100 * ratio, 3)} % of dense",
        "attention(q, k, v, mask=masks.sliding_window(k + 1, causal=False)); "
        "estimate(4096, 64, 1, mask=…)",
        err < 1e-12 and pairs == want,
        "the local-attention forms or their cost differ",
    )


@check("002-ex8.8-c")
def _ex88_two_heads() -> Finding:
    from ... import attention

    n = 6
    x = _randn(1, 1, n, 8, seed=7)
    m1 = torch.zeros(n, n, dtype=torch.bool)
    m1[:, 0] = True
    m2 = torch.zeros(n, n, dtype=torch.bool)
    m2[:, -1] = True
    h1, h2 = attention(x, x, x, mask=m1), attention(x, x, x, mask=m2)
    xn = x.numpy()
    witness = ind.close(h1.numpy(), ind.sdpa(xn, xn, xn, keep=m1.numpy())) and ind.close(
        h2.numpy(), ind.sdpa(xn, xn, xn, keep=m2.numpy())
    )
    y = 0.5 * h1 + 0.5 * h2  # Σ_i head_i W_i^O with W_i^O = 0.5·I
    target = x[:, :, :1] + x[:, :, -1:]
    gap = float((y - target).abs().max())
    half = float((y - 0.5 * target).abs().max())
    return _found(
        f"max |y − (x_1 + x_n)| = {fmt(gap)}; max |y − 0.5(x_1 + x_n)| = {_err(half)}",
        "attention(x, x, x, mask=first/last column) per head; 0.5·head_1 + 0.5·head_2",
        gap < 1e-12,
        "W^O = 0.5·I gives 0.5(x_1 + x_n), half the stated target; W_i^O = I gives x_1 + x_n",
        Derivation(witness, "masked softmax(QKᵀ/√d)V in numpy equals both heads"),
    )


@check("003-1-a")
def _quadratic() -> Finding:
    from ... import masks
    from ...analysis import estimate

    ns = (256, 1024, 4096)
    flops = [estimate(n, 64, 1).value("scores QKᵀ", "naive") for n in ns]
    pairs = [masks.causal().attended_pairs(n, n) for n in ns]
    ratios = [b / a for a, b in itertools.pairwise(flops)]
    ok = ratios == [16.0, 16.0] and all(
        p == n * (n + 1) // 2 for p, n in zip(pairs, ns, strict=True)
    )
    return Finding(
        computed="QKᵀ FLOPs at n = 256, 1024, 4096: "
        + ", ".join(f"{int(f):,}" for f in flops)
        + f" (×{ratios[0]:g} per ×4 in n); causal pairs {', '.join(f'{p:,}' for p in pairs)}",
        call="estimate(n, 64, 1).value('scores QKᵀ', 'naive'); masks.causal().attended_pairs(n, n)",
        **judged(ok, "the cost does not grow as n²"),
    )


@check("003-3.2-b")
def _window_tiles() -> Finding:
    from ... import masks

    n, b = 4096, 128
    counts = {}
    for name, m in (("causal", masks.causal()), ("window 128", masks.sliding_window(128))):
        codes = m.block_map(n, n, b, b)
        counts[name] = int((codes != masks.EMPTY).sum())
    ok = counts["window 128"] * 4 < counts["causal"]
    return Finding(
        computed=f"tiles computed at n={n}: causal {counts['causal']}, window 128 "
        f"{counts['window 128']} of {(n // b) ** 2}",
        call="(mask.block_map(4096, 4096, 128, 128) != masks.EMPTY).sum()",
        **judged(ok, "the window does not reduce the work"),
    )


@check("003-4.3-a")
def _odot_mask() -> Finding:
    from ... import attention, masks

    q, k, v = (_heads_seq(8, 16, seed=2 + i) for i in range(3))
    m = masks.sliding_window(3)
    keep = m.to_dense(8, 8).reshape(8, 8)
    _, w = attention(q, k, v, mask=m, return_weights=True)
    text = torch.softmax((q @ k.mT / 4.0) * keep, dim=-1)
    band = ind.band_keep(8, 3)
    witness = bool((keep.numpy() == band).all()) and ind.close(
        w[0, 0].numpy(), ind.attention_weights(q[0, 0].numpy(), k[0, 0].numpy(), keep=band)
    )
    leak_rows = text.masked_fill(keep, 0).sum(-1)  # weight on masked keys per row
    ours = float(w[..., ~keep].abs().max())
    wrong = ours == 0.0 and float(leak_rows.max()) > 0.1
    return Finding(
        computed=f"with ⊙M a row puts up to {float(leak_rows.max()):.3f} of its weight on keys "
        f"the mask excludes (they get logit 0, not −∞); attnlab's masked weights there: {ours:g}",
        call="attention(q, k, v, mask=masks.sliding_window(3), return_weights=True) vs "
        "softmax((q @ k.mT / √d) * M)",
        **judged(
            not wrong,
            "multiplying by 0 sets a logit to 0, which still receives weight e^0/Σ; a "
            "mask must set excluded logits to −∞ (add log M), e.g. softmax(QKᵀ/√d_k + log M)",
            Derivation(
                witness,
                "softmax(QKᵀ/√d + log M) in numpy with the band 0 ≤ i − j < 3 equals attnlab's "
                "masked weights",
            ),
        ),
    )


@check("003-3.2-d")
def _dynamic_range() -> Finding:
    from ... import masks
    from ...modules.adaptive_span import AdaptiveSpan

    n = 2048
    span = AdaptiveSpan(4, max_span=512, ramp=32.0, init_span=16.0)
    with torch.no_grad():
        span.z.copy_(torch.tensor([16.0, 32.0, 64.0, 200.0]))
    span.refresh_span()
    windowed = span.mask().attended_pairs(n, n)
    dense = masks.causal().attended_pairs(n, n)
    ok = span.span == 232 and windowed < dense / 4
    return Finding(
        computed=f"span = ⌈max z + R⌉ = {span.span}; key pairs per head {windowed:,} vs "
        f"{dense:,} dense causal (×{dense / windowed:.1f} less work at n = {n})",
        call="AdaptiveSpan(4, max_span=512, ramp=32); span.refresh_span(); "
        "span.mask().attended_pairs(2048, 2048)",
        **judged(ok, "the learned span does not reduce the pairs computed"),
    )


@check("003-4.3-c")
def _hierarchical() -> Finding:
    from ... import attention, local_global_attention, masks

    n, window = 1024, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    local = attention(q, k, v, mask=masks.sliding_window(window))
    glob = attention(q, k, v, mask=masks.causal())
    # the formula: both on the same Q, K, V — attnlab's Concat(local, global) over two heads
    heads = local_global_attention(
        *(t.expand(1, 2, n, 16) for t in (q, k, v)),
        local_heads=1,
        window=window,
        mask=masks.causal(),
    )  # (1, 2, n, 16): head 0 local, head 1 global
    both = heads.transpose(1, 2).reshape(1, 1, n, 32)
    seq = attention(local, local, local, mask=masks.causal())  # the prose: global after local
    pairs = masks.sliding_window(window).attended_pairs(n, n)
    full = masks.causal().attended_pairs(n, n)
    differs = float((seq - glob).abs().max())
    # the text is consistent iff its formula computes what its prose says
    consistent = differs < 1e-9
    qn, kn, vn = (t[0, 0].numpy() for t in (q, k, v))
    causal, band = ind.causal_keep(n), ind.band_keep(n, window)
    loc_ind = ind.sdpa(qn, kn, vn, keep=band)
    witness = (
        ind.close(both[0, 0, :, :16].numpy(), loc_ind)
        and ind.close(both[0, 0, :, 16:].numpy(), ind.sdpa(qn, kn, vn, keep=causal))
        and ind.close(local[0, 0].numpy(), loc_ind)
        and ind.close(glob[0, 0].numpy(), ind.sdpa(qn, kn, vn, keep=causal))
        and ind.close(seq[0, 0].numpy(), ind.sdpa(loc_ind, loc_ind, loc_ind, keep=causal))
        and (pairs, full) == (int(band.sum()), n * (n + 1) // 2)
    )
    return Finding(
        computed=f"Concat(Local, Global) has width {both.shape[-1]} (2·d_v) and attends "
        f"{pairs + full:,} pairs vs {full:,} for global attention alone; global-after-local "
        f"differs from the formula's Global(Q, K, V) by up to {differs:.3g}",
        call="local_global_attention(q, k, v, local_heads=1, window=64, mask=masks.causal()) "
        "on two heads = torch.cat([attention(q, k, v, mask=masks.sliding_window(64)), "
        "attention(q, k, v, mask=masks.causal())], -1), vs attention(local, local, local, "
        "mask=masks.causal())",
        **judged(
            consistent,
            "the formula runs both side by side on the same Q, K, V — nothing is computed 'first "
            f"local, then global' (that differs by up to {differs:.3g}) — and its global term "
            f"alone attends all {full:,} causal pairs, so the pair adds {pairs:,} to plain "
            "attention instead of saving any",
            Derivation(
                witness,
                "local, global and global-after-local softmax(QKᵀ/√d)V in numpy with the band "
                "0 ≤ i − j < 64 and the causal mask j ≤ i, and the pair counts Σ min(i+1, 64) "
                "and n(n+1)/2, equal attnlab's",
            ),
        ),
    )


@check("004-4-b")
def _four_terms() -> Finding:
    from ... import attention
    from ...positional import sinusoidal

    g = _gen(19)
    x, v = _randn_from(g, 1, 9, 8), _randn_from(g, 1, 9, 3)
    p = sinusoidal(9, 8, dtype=F64).unsqueeze(0)
    xx, xp, px, pp = (a @ b.transpose(-1, -2) for a, b in ((x, x), (x, p), (p, x), (p, p)))
    s = (x + p) @ (x + p).transpose(-1, -2)
    split = _close(s, xx + xp + px + pp)
    scale = 1 / math.sqrt(8)
    full = attention(x + p, x + p, v)
    parts = attention(x, x, v, bias=(xp + px + pp) * scale)
    ok = split and _close(full, parts)
    return Finding(
        computed=f"(x+p)(x+p)ᵀ == xxᵀ + xpᵀ + pxᵀ + ppᵀ: {split}; attention(x+p, x+p, v) == "
        f"attention(x, x, v, bias=(xpᵀ + pxᵀ + ppᵀ)/√d): {_close(full, parts)}",
        call="attention(x + p, x + p, v) vs attention(x, x, v, bias=(x@p.mT + p@x.mT + "
        "p@p.mT) / math.sqrt(8)); p = sinusoidal(9, 8)",
        **_verdict(ok, "the four terms do not add up to the score"),
    )


@check("004-4-f")
def _dominance() -> Finding:
    from ... import attention

    g = _gen(21)
    d, n = 64, 128
    x, v = _randn_from(g, 1, n, d), _randn_from(g, 1, n, 2)
    u, w_ = _unit_pair(g, d)
    sc = _periodic(n, 16.0)
    off = ~torch.eye(n, dtype=torch.bool)  # pairs i != j (the self term x_i·x_i = dσ² aside)
    shares, tv_pos, tv_con = [], [], []
    _, w_content = attention(x, x, v, mask=off, return_weights=True)
    for c in (0.1, 1.0, 10.0):
        amp = math.sqrt(c * math.sqrt(d))
        p = amp * (sc[:, :1] * u + sc[:, 1:] * w_).unsqueeze(0)
        s = ((x + p) @ (x + p).transpose(-1, -2))[0][off]
        pos = (p @ p.transpose(-1, -2))[0][off]
        shares.append(1 - float((s - pos).var() / s.var()))
        _, w_full = attention(x + p, x + p, v, mask=off, return_weights=True)
        _, w_pos = attention(p, p, v, mask=off, return_weights=True)
        tv_pos.append(float((w_full - w_pos).abs().sum(-1).mean() / 2))
        tv_con.append(float((w_full - w_content).abs().sum(-1).mean() / 2))
    ok = shares[0] < 0.1 and shares[2] > 0.8 and 0.1 < shares[1] < 0.9
    ok &= tv_pos[0] > tv_con[0] and tv_pos[2] < tv_con[2]
    return Finding(
        computed="; ".join(
            f"A² = {c:g}·σ²√d: position share of score variance {fmt(sh, 2)}, TV to "
            f"position-only weights {fmt(tp, 2)}, to content-only {fmt(tc, 2)}"
            for c, sh, tp, tc in zip((0.1, 1, 10), shares, tv_pos, tv_con, strict=True)
        ),
        call="attention(x + p, x + p, v, mask=~eye, return_weights=True) vs attention(p, p, …) "
        "and attention(x, x, …); p = A·(sin·u + cos·v) from " + _PERIODIC_CALL,
        **_verdict(ok, "the position term does not take over around A² ≈ σ²√d"),
    )


@check("004-5.1-a")
def _causal_weights() -> Finding:
    from ... import attention, masks

    g = _gen(22)
    q, k, v = _randn_from(g, 2, 2, 9, 4), _randn_from(g, 2, 2, 9, 4), _randn_from(g, 2, 2, 9, 3)
    out, w = attention(q, k, v, mask=masks.causal(), return_weights=True)
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    zero = bool((w[..., future] == 0).all())
    sums = _close(w.sum(-1), torch.ones(2, 2, 9, dtype=F64))
    l_ij = (q @ k.transpose(-1, -2) / 2).masked_fill(future, float("-inf"))
    ref = torch.softmax(l_ij, -1) @ v
    # the strongest form: NaN keys and values at positions 5… leave rows 0–4 bit-identical
    # (values of width d = 4 here, on every backend)
    vd = _randn_from(g, 2, 2, 9, 4)
    k_nan, v_nan = k.clone(), vd.clone()
    k_nan[..., 5:, :], v_nan[..., 5:, :] = float("nan"), float("nan")
    isolated = True
    for be in ("auto", "reference", "flash"):
        plain = attention(q, k, vd, mask=masks.causal(), backend=be)
        out_nan = attention(q, k_nan, v_nan, mask=masks.causal(), backend=be)
        isolated &= bool((out_nan[..., :5, :] == plain[..., :5, :]).all())
    ok = zero and sums and _close(out, ref) and isolated
    return Finding(
        computed=f"weights at j > i exactly 0: {zero}; rows sum to 1: {sums}; output == "
        f"softmax(l) V with l_ij = −∞ for j > i: {_close(out, ref)}; NaN keys/values at "
        f"positions ≥ 5 leave rows 0–4 bit-identical (auto, reference, flash): {isolated}",
        call="attention(q, k, v, mask=masks.causal(), return_weights=True)",
        **_verdict(ok, "the causal weights leak to the future"),
    )


@check("004-5.1-c")
def _minus_1e9() -> Finding:
    from ... import attention, masks

    g = _gen(24)
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)
    parts, ok = [], True
    q, k, v = (_randn_from(g, 1, 2, 8, 4) for _ in range(3))
    for dt in (torch.float32, torch.float64):
        qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
        add = torch.zeros(8, 8, dtype=dt).masked_fill(future, -1e9)
        o1, w1 = attention(qq, kk, vv, mask=add, backend="reference", return_weights=True)
        o2 = attention(qq, kk, vv, mask=masks.causal(), backend="reference")
        zero = bool((w1[..., future] == 0).all())
        same = bool((o1 == o2).all())
        ok &= zero and same
        parts.append(
            f"{str(dt).removeprefix('torch.')}: masked weights exactly 0: {zero}, "
            f"output bit-equal to −∞ masking: {same}"
        )
    try:
        torch.zeros(2, dtype=torch.float16).masked_fill(torch.tensor([True, False]), -1e9)
        half = "float16 masked_fill(-1e9) works"
    except RuntimeError:
        half = "float16 cannot hold −1e9 (masked_fill(-1e9) raises; use torch.finfo(dtype).min)"
    return Finding(
        computed="; ".join(parts) + f"; {half}",
        call="attention(q, k, v, mask=zeros(8, 8).masked_fill(future, -1e9), "
        "backend='reference') vs attention(q, k, v, mask=masks.causal(), backend='reference')",
        **_verdict(ok, "−1e9 does not reproduce −∞ masking"),
    )


@check("004-5.1-d")
def _parallel_prefix() -> Finding:
    from ... import attention, masks

    g = _gen(34)
    q, k, v = (_randn_from(g, 2, 2, 10, 4) for _ in range(3))
    full = attention(q, k, v, mask=masks.causal())
    rows = torch.cat(
        [attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in range(10)],
        dim=2,
    )
    ok = _close(full, rows)
    return Finding(
        computed=f"one causal pass == 10 prefix-only calls, row by row: {ok}",
        call="attention(q, k, v, mask=masks.causal()) vs attention(q[:, :, i:i+1], "
        "k[:, :, :i+1], v[:, :, :i+1]) for each i",
        **_verdict(ok, "the causal pass differs from attending to the prefix"),
    )
