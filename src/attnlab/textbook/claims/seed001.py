"""Seed 001 — Day 2 理论学习：自注意力机制深度解析 (self-attention in depth)."""

from __future__ import annotations

import functools

import torch

from .. import derivations as ind
from ..core import NOT_CHECKABLE, Derivation, Finding, check, judged, tiny

SENTENCE = "The animal didn't cross the street because it was too tired"


@functools.cache
def _minilm_attention(text: str) -> tuple[list[str], torch.Tensor]:
    from ...models import minilm

    return minilm().attentions(text)  # tokens, (layers, heads, T, T)


def _mha(E: int, heads: int, seed: int) -> torch.nn.Module:
    from ... import MultiHeadAttention

    torch.manual_seed(seed)
    return MultiHeadAttention(E, heads).double().eval()


def _x(n: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, E, generator=g, dtype=torch.float64)


@check("001-1.1-a")
def _it_animal() -> Finding:
    tokens, w = _minilm_attention(SENTENCE)
    it, animal, street = (tokens.index(t) for t in ("it", "animal", "street"))
    wa, ws = w[:, :, it, animal], w[:, :, it, street]  # (layers, heads)
    best = int(wa.argmax())
    layer, head = divmod(best, w.shape[1])
    a, s = float(wa.flatten()[best]), float(ws.flatten()[best])
    prefer = int((wa > ws).sum())
    ok = a > 10 * s
    return Finding(
        computed=f"layer {layer}, head {head}: it→animal {a:.3f}, it→street {s:.3f}; "
        f"{prefer} of {wa.numel()} heads weight 'animal' above 'street'",
        call=f"tokens, w = minilm().attentions({SENTENCE!r}); w[:, :, it, animal]",
        **judged(ok, "no head of the pretrained model prefers 'animal' clearly"),
    )


@check("001-1.2-a")
def _self_attention() -> Finding:
    mha = _mha(6, 1, seed=0)
    x = _x(4, 6, seed=0)
    (wq, bq), (wk, bk), (wv, bv) = mha.projection_weights()
    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv  # (1, 4, 6) each
    a = torch.softmax(q @ k.mT / 6**0.5, dim=-1)  # (1, 4, 4)
    want = mha.out_proj(a @ v)
    with torch.no_grad():
        got = mha(x)
        err = float((got - want).abs().max())
    ok = err < 1e-12 and tuple(a.shape[-2:]) == (4, 4) and tuple(got.shape[-2:]) == (4, 6)
    return Finding(
        computed=f"S and A are {tuple(a.shape[-2:])}, the output {tuple(got.shape[-2:])}; "
        f"max |module − formula| = {tiny(err)}",
        call="MultiHeadAttention(6, 1)(x) vs W_O(softmax(XW_Q (XW_K)ᵀ/√6) XW_V)",
        **judged(ok, "the module differs from the formula"),
    )


@check("001-2.2-a")
def _traditional_cost() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ... import AdditiveAttention

    d = 64
    with torch.device("meta"):
        m = AdditiveAttention(d, d, d, bias=False)
    counts = {}
    for n in (256, 512, 1024):
        x = torch.empty(1, n, d, device="meta")
        with FlopCounterMode(display=False) as fc:
            m(x, x, x)
        counts[n] = fc.get_total_flops()
    growth = [counts[512] / counts[256], counts[1024] / counts[512]]
    quadratic = growth[1] > 3.5 and growth[1] > growth[0]  # → 4 once n ≫ d
    closed = all(c == ind.additive_attention_flops(n, n, d, d, d, d) for n, c in counts.items())
    return Finding(
        computed=f"FLOPs {counts[256]:,} (n=256), {counts[512]:,} (512), {counts[1024]:,} (1024): "
        f"×{growth[0]:.2f}, ×{growth[1]:.2f} per doubling of n",
        call="FlopCounterMode(); AdditiveAttention(64, 64, 64, bias=False)(x, x, x) on meta",
        **judged(
            not quadratic,
            "each decoder step scores all n encoder states, so the attention itself is O(n²d) "
            "in total (O(nd) per step); O(nd²) is the recurrence's (and the projections') cost",
            Derivation(
                closed,
                "closed form 4nd·h + 2n²d_v (the projections and the weighted sum) equals the "
                "counted FLOPs at every n",
            ),
        ),
    )


@check("001-2.3-a")
def _parallel() -> Finding:
    from ... import KVCache, masks

    mha = _mha(32, 4, seed=1)
    x = _x(12, 32, seed=1)
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


@check("001-3.1-a")
def _equivariance() -> Finding:
    mha = _mha(16, 2, seed=2)
    x = _x(5, 16, seed=2)
    perm = torch.tensor([0, 3, 2, 1, 4])
    with torch.no_grad():
        y, yp = mha(x), mha(x[:, perm])
    weights = (mha.qkv_proj.weight, mha.qkv_proj.bias, mha.out_proj.weight, mha.out_proj.bias)
    weights = [w.detach().numpy() for w in weights]
    by_hand = all(
        ind.close(out[0].numpy(), ind.mha(inp[0].numpy(), *weights, heads=2))
        for inp, out in ((x, y), (x[:, perm], yp))
    )
    equivariant = float((yp - y[:, perm]).abs().max())
    identical = float((yp - y).abs().max())
    pooled = float((yp.mean(1) - y.mean(1)).abs().max())
    wrong = equivariant < 1e-12 and identical > 1e-3
    return Finding(
        computed=f"max |f(Px) − P f(x)| = {tiny(equivariant)} but max |f(Px) − f(x)| = "
        f"{identical:.3f}; mean-pooled outputs differ by {tiny(pooled)}",
        call="mha(x[:, perm]) vs mha(x)[:, perm] and vs mha(x)",
        **judged(
            not wrong,
            "self-attention is permutation-equivariant, not invariant: the outputs are "
            "swapped the same way (each word's output is unchanged, but it moves); only an "
            "order-free summary such as the mean is identical",
            Derivation(
                by_hand,
                "multi-head attention in numpy from the module's weights equals its outputs on "
                "x and on the permuted x",
            ),
        ),
    )


@check("001-3.1-b")
def _word_order() -> Finding:
    from ... import SinusoidalEmbedding

    mha = _mha(16, 2, seed=3)
    vocab = {c: i for i, c in enumerate("狗咬了人")}
    emb = torch.randn(
        len(vocab), 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    pe = SinusoidalEmbedding(16, dtype=torch.float64)

    def sentence(text: str, positions: bool) -> torch.Tensor:
        x = emb[[vocab[c] for c in text]].unsqueeze(0)  # (1, 4, 16)
        if positions:
            x = x + pe(torch.arange(len(text)))
        with torch.no_grad():
            return mha(x).mean(1)

    without = float((sentence("狗咬了人", False) - sentence("人咬了狗", False)).abs().max())
    with_pe = float((sentence("狗咬了人", True) - sentence("人咬了狗", True)).abs().max())
    ok = without < 1e-12 and with_pe > 1e-3
    return Finding(
        computed=f"sentence vectors differ by {tiny(without)} without positions, by {with_pe:.3f} "
        "with sinusoidal positions added",
        call="mha(emb[tokens] (+ SinusoidalEmbedding(16)(positions))).mean(1)",
        **judged(ok, "the two sentences are distinguishable without positions"),
    )


@check("001-3.2-a")
def _same_word_differs() -> Finding:
    from ...positional import sinusoidal

    e = _x(1, 64, 31)[0, 0]
    x = e + sinusoidal(512, 64, dtype=torch.float64)  # (512, 64): the word at every position
    dist = torch.cdist(x, x)
    closest = float(dist[~torch.eye(512, dtype=torch.bool)].min())
    return Finding(
        computed=f"512 copies of one word: the closest two differ by {closest:.3f} (L2)",
        call="e + sinusoidal(512, 64); torch.cdist",
        **judged(closest > 0.1, "two positions give the word the same representation"),
    )


@check("001-3.3-a")
def _pe_formula() -> Finding:
    from ... import SinusoidalEmbedding

    d = 512
    pe = SinusoidalEmbedding(d, dtype=torch.float64)(torch.arange(2048))  # (2048, d)
    pos = torch.arange(2048, dtype=torch.float64)[:, None]
    angle = pos / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    err = max(
        float((pe[:, 0::2] - angle.sin()).abs().max()),
        float((pe[:, 1::2] - angle.cos()).abs().max()),
    )
    ok = err < 1e-12
    return Finding(
        computed=f"max |SinusoidalEmbedding − formula| = {tiny(err)} over 2048 positions",
        call="SinusoidalEmbedding(512, dtype=torch.float64)(torch.arange(2048))",
        **judged(ok, "attnlab's encoding differs from the formula"),
    )


@check("001-3.3-b")
def _pe_unique_relative() -> Finding:
    from ... import SinusoidalEmbedding

    d, n, k = 64, 4096, 7
    pe = SinusoidalEmbedding(d, dtype=torch.float64)(torch.arange(n + k))
    dist = torch.cdist(pe[:n], pe[:n])
    dist.fill_diagonal_(float("inf"))
    nearest = float(dist.min())
    theta = k / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = theta.cos(), theta.sin()
    a, b = pe[:n, 0::2], pe[:n, 1::2]  # sin, cos of pos·ω
    shifted = torch.stack((a * c + b * s, b * c - a * s), dim=-1).flatten(-2)  # rotation by kω
    err = float((shifted - pe[k:]).abs().max())
    ok = nearest > 1e-3 and err < 1e-9
    return Finding(
        computed=f"smallest distance between two of 4096 codes {nearest:.4f}; PE(pos+7) = "
        f"R_7 PE(pos) for every pos to {tiny(err, 1e-9)}",
        call="SinusoidalEmbedding(64)(torch.arange(4103)); torch.cdist; rotation by 7ω_i",
        **judged(ok, "codes repeat or the shift is not a fixed rotation"),
    )


@check("001-3.3-c")
def _pe_frequencies() -> Finding:
    from ... import SinusoidalEmbedding

    pe = SinusoidalEmbedding(128, dtype=torch.float64)(torch.arange(1000))[:, 0::2]  # sines
    flips = (pe[1:].sign() != pe[:-1].sign()).sum(0)  # (64,) zero crossings
    ok = bool((flips[1:] <= flips[:-1]).all()) and int(flips[0]) > 100 * max(int(flips[-1]), 1)
    return Finding(
        computed=f"zero crossings over 1000 positions: dimension 0: {int(flips[0])}, 32: "
        f"{int(flips[16])}, 126: {int(flips[-1])} (non-increasing with the dimension)",
        call="SinusoidalEmbedding(128)(torch.arange(1000))[:, 0::2].sign() changes",
        **judged(ok, "the frequencies do not fall with the dimension"),
    )


@check("001-3.3-e")
def _binary_like() -> Finding:
    from ...positional import sinusoidal

    d, n = 128, 1024
    pe = sinusoidal(n, d, dtype=torch.float64)
    p = torch.arange(n, dtype=torch.float64)[:, None]
    omega = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    fit = float((pe[:, 0::2] - torch.sin(p * omega)).abs().max())  # digit i: sin(p·ω_i)
    ratio = omega[:-1] / omega[1:]  # the same factor between neighbouring digits
    closest = float(torch.pdist(pe).min())
    signs = len({tuple(r) for r in (pe > 0).to(torch.int64).tolist()})
    ok = fit < 1e-12 and float(ratio.max() - ratio.min()) < 1e-9 and closest > 0.1
    return Finding(
        computed=f"period ratio between neighbouring pairs {float(ratio[0]):.4f} for every pair "
        f"(binary digits: 2); closest two of {n} positions {closest:.3f} apart; unlike binary "
        f"digits the signs alone are not a unique code ({signs} distinct sign patterns)",
        call="sinusoidal(1024, 128) vs sin(p·10000^(−2i/d)); torch.pdist; (pe > 0) rows",
        **judged(ok, "the dimensions do not form a geometric ladder of periodic digits"),
    )


@check("001-3.3-d")
def _extrapolation() -> Finding:
    from .seed002_positions import _sinusoidal_extrapolates

    return _sinusoidal_extrapolates()


@check("001-3.4-a")
def _pe_geometry() -> Finding:
    from ... import SinusoidalEmbedding

    pe = SinusoidalEmbedding(512, dtype=torch.float64)(torch.arange(200))
    dist = (pe - pe[0]).norm(dim=-1)  # ‖PE(0) − PE(k)‖, the same for every start position
    drops = [k for k in range(1, 199) if dist[k + 1] < dist[k]]
    closed = all(abs(float(dist[k]) - ind.sinusoid_distance(k, 512)) < 1e-9 for k in range(200))
    wrong = bool(drops) and float(dist[1]) < float(dist[10])
    first = drops[0] if drops else None
    return Finding(
        computed=f"‖PE(p) − PE(p+k)‖: {float(dist[1]):.2f} (k=1), {float(dist[10]):.2f} (10), "
        f"{float(dist[100]):.2f} (100); first decrease at k={first}"
        + (f" ({float(dist[first]):.3f} → {float(dist[first + 1]):.3f})" if first else ""),
        call="SinusoidalEmbedding(512)(torch.arange(200)); (pe - pe[0]).norm(dim=-1)",
        **judged(
            not wrong,
            f"near positions are close, but the distance is not monotone in the offset: "
            f"it first falls at k={first}, so a farther position can be nearer in encoding space",
            Derivation(
                closed,
                "closed form ‖PE(p) − PE(p+k)‖ = √Σ(2 − 2cos(k/10000^(2i/d))) equals attnlab's "
                "distances for k = 0…199",
            ),
        ),
    )


@check("001-4.1-a")
def _shapes() -> Finding:
    from ... import attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    out, w = attention(q[None], k[None], v[None], return_weights=True)  # 3-D: (1, 4, ·)
    shapes = (tuple(w.shape[1:]), tuple(out.shape[1:]))
    ok = shapes == ((4, 4), (4, 6))
    return Finding(
        computed=f"weights {shapes[0]}, output {shapes[1]}",
        call="attention(q[None], k[None], v[None], return_weights=True) with q, k, v (4, 6)",
        **judged(ok, "the shapes differ"),
    )


@check("001-4.2-a")
def _diagonal() -> Finding:
    tokens, w = _minilm_attention(SENTENCE)
    n = len(tokens)
    diag = w.diagonal(dim1=-2, dim2=-1)  # (layers, heads, n)
    off = (w.sum(-1) - diag) / (n - 1)
    rows = float((w.sum(-1) - 1).abs().max())
    top = float((w.argmax(-1) == torch.arange(n)).float().mean())
    ok = rows < 1e-5 and float(diag.mean()) > float(off.mean())
    return Finding(
        computed=f"max |row sum − 1| = {tiny(rows, 1e-5)}; mean diagonal weight "
        f"{float(diag.mean()):.3f} vs off-diagonal {float(off.mean()):.3f}; the diagonal is the "
        f"row maximum in {100 * top:.0f} % of rows",
        call="tokens, w = minilm().attentions(sentence); w.diagonal(dim1=-2, dim2=-1)",
        **judged(ok, "the diagonal is not larger than the rest on average"),
    )


@check("001-5.1-a")
def _long_range() -> Finding:
    from ...analysis.costs import complexity_table

    n, d = 256, 32
    x = _x(n, d, 32).requires_grad_()
    _mha(d, 4, 32)(x)[0, -1].sum().backward()
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


@check("001-5.2-a")
def _no_locality() -> Finding:
    from ... import attention

    n = 256
    x = _x(n, 16, 19)[:, None]  # (1, 1, n, 16)
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


#: The reference CPU assumed for §6.1's length rule (not this machine: the command prints that).
_CPU = dict(budget="16GB", gflops=100.0, max_seconds=1.0, window=256)
#: The 2017 Transformer-base encoder (d_model = 512, the text's own §6.2 size).
_BASE = dict(d_model=512, n_layers=6, n_heads=8)


def _length_rule(gflops: float) -> dict[int, tuple[float, str]]:
    """Per length: the attention core's share of a layer's forward FLOPs and `advise`'s choice."""
    from ...analysis.advise import advise
    from ...analysis.costs import model_cost

    out = {}
    for n in (50, 500, 2000):
        layer = model_cost(n, train=False, **_BASE).per_layer
        share = layer["attention core"] / sum(layer.values())
        out[n] = (share, advise(n, **dict(_CPU, gflops=gflops), **_BASE).choice)
    return out


@check("001-6.1-a")
def _length_rule_claim() -> Finding:
    from .seed002_practice import _this_machine

    rule = _length_rule(_CPU["gflops"])
    note, rate = _this_machine()
    live = _length_rule(rate)
    (s50, c50), (s500, c500), (_, c2000) = rule.values()
    ok = s50 < 0.05 and c50 == c500 == "dense" and 0.05 < s500 < 0.5 and c2000 != "dense"
    return Finding(
        computed="the n² part's share of a layer's FLOPs and the advice: "
        + "; ".join(f"n={n}: {100 * s:.1f} %, {c}" for n, (s, c) in rule.items())
        + f" (the n² part passes half of the FLOPs at n = 6·d_model = {6 * _BASE['d_model']}, "
        "so the bands scale with d_model)",
        call="model_cost(n, d_model=512, n_layers=6, n_heads=8, train=False).per_layer; "
        "advise(n, '16GB', gflops=100, d_model=512, n_layers=6, n_heads=8, max_seconds=1, "
        "window=256).choice",
        **judged(ok, "the advice does not change across the text's bands"),
        measured=f"{note}; at this rate advise picks "
        + ", ".join(f"n={n}: {c}" for n, (_, c) in live.items()),
    )


@check("001-6.2-a")
def _head_dim() -> Finding:
    from ... import MultiHeadAttention

    with torch.device("meta"):
        dims = [(E, H, MultiHeadAttention(E, H).head_dim) for E, H in ((512, 8), (1024, 16))]
    ok = all(D == E // H for E, H, D in dims)
    return Finding(
        computed="; ".join(f"d_model={E}, {H} heads: head_dim {D}" for E, H, D in dims),
        call="MultiHeadAttention(512, 8).head_dim",
        **judged(ok, "head_dim differs from d_model / num_heads"),
    )


@check("001-6.2-b")
def _usual_width() -> Finding:
    from ... import MultiHeadAttention

    with torch.device("meta"):
        built = [
            (E, H, MultiHeadAttention(E, H).head_dim) for E, H in ((512, 8), (768, 12), (1024, 16))
        ]
    return Finding(
        computed="attnlab builds any width divisible by the head count: "
        + ", ".join(f"d_model={E} with {H} heads (head_dim {D})" for E, H, D in built),
        call="MultiHeadAttention(E, H).head_dim on the meta device",
        verdict=NOT_CHECKABLE,
        explanation="which widths are usual is a historical fact about published models (the "
        "2017 Transformer used 512 and 1024, BERT-base and GPT-2 768), not something to compute",
    )


@check("001-6.3-a")
def _fixed_vs_learned() -> Finding:
    from ... import LearnedPositionalEmbedding, SinusoidalEmbedding

    fixed = SinusoidalEmbedding(64)
    learned = LearnedPositionalEmbedding(512, 64)
    n_fixed = sum(p.numel() for p in fixed.parameters())
    n_learned = sum(p.numel() for p in learned.parameters())
    far = fixed(torch.tensor([600]))
    try:
        learned(torch.tensor([600]))
        refused = ""
    except ValueError as e:
        refused = str(e)
    ok = (
        n_fixed == 0 and n_learned == 512 * 64 and bool(torch.isfinite(far).all()) and bool(refused)
    )
    return Finding(
        computed=f"parameters: sinusoidal {n_fixed}, learned {n_learned:,}; position 600: "
        f"sinusoidal gives a code, learned raises ValueError ({refused[:60]}…)",
        call="SinusoidalEmbedding(64)(600); LearnedPositionalEmbedding(512, 64)(600)",
        **judged(ok, "the parameter counts or the extrapolation behaviour differ"),
    )


@check("001-7.2-a")
def _softmax_gradient() -> Finding:
    from ... import attention

    grads = {}
    for gap in (0.0, 5.0, 20.0, 50.0):
        q = torch.tensor([[[[1.0]]]], dtype=torch.float64, requires_grad=True)
        k = torch.tensor([[[[gap], [0.0]]]], dtype=torch.float64)
        v = torch.tensor([[[[1.0], [0.0]]]], dtype=torch.float64)  # out = weight of key 0
        attention(q, k, v, scale=1.0).sum().backward()
        grads[gap] = float(q.grad.abs().sum())  # ∂p₀/∂(gap) · gap-direction: p₀(1 − p₀)·gap
    ok = grads[0.0] == 0.0 and grads[5.0] > grads[20.0] > grads[50.0] and grads[50.0] < 1e-15
    return Finding(
        computed="|∂p₀/∂q| for logit gaps "
        + ", ".join(f"{g:g}: {v:.2e}" for g, v in grads.items()),
        call="attention(q, k, v, scale=1.0).sum().backward() with k = [[gap], [0]]",
        **judged(ok, "the gradient does not vanish at the extremes"),
    )
