"""Seed 003 — 自注意力机制如何提升Transformer的性能 (how self-attention improves the Transformer).

The file stops mid-sentence in §6 ("文本分类: 利用自"); claims end there.
"""

from __future__ import annotations

import itertools

import torch

from .. import derivations as ind
from ..core import (
    NOT_CHECKABLE,
    Derivation,
    Finding,
    check,
    judged,
    tiny,
)
from ..derivations import np  # NumPy on first use (the textbook extra)
from .seed001 import SENTENCE, _minilm_attention

#: §5's code sample, verbatim (whitespace-only lines emptied).
SNIPPET = "\n".join(
    [
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        "class SelfAttention(nn.Module):",
        "    def __init__(self, d_model, n_heads, dropout=0.1):",
        "        super(SelfAttention, self).__init__()",
        "        self.d_model = d_model",
        "        self.n_heads = n_heads",
        "        self.d_k = d_model // n_heads",
        "",
        "        self.q_linear = nn.Linear(d_model, d_model)",
        "        self.k_linear = nn.Linear(d_model, d_model)",
        "        self.v_linear = nn.Linear(d_model, d_model)",
        "        self.dropout = nn.Dropout(dropout)",
        "        self.out = nn.Linear(d_model, d_model)",
        "",
        "    def forward(self, x):",
        "        batch_size = x.size(0)",
        "",
        "        # 将输入x映射到查询、键、值向量",
        "        q = self.q_linear(x).view(batch_size, -1, self.n_heads, self"
        ".d_k).permute(0, 2, 1, 3)",
        "        k = self.k_linear(x).view(batch_size, -1, self.n_heads, self"
        ".d_k).permute(0, 2, 1, 3)",
        "        v = self.v_linear(x).view(batch_size, -1, self.n_heads, self"
        ".d_k).permute(0, 2, 1, 3)",
        "",
        "        # 计算注意力权重",
        "        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)",
        "        attn = F.softmax(scores, dim=-1)",
        "        attn = self.dropout(attn)",
        "",
        "        # 计算加权求和得到输出",
        "        output = torch.matmul(attn, v).transpose(1, 2).contiguous()"
        ".view(batch_size, -1, self.d_model)",
        "        output = self.out(output)",
        "",
        "        return output",
    ]
)


def _x(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)


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


@check("003-2.2-a")
def _q_equals_k() -> Finding:
    from ... import MultiHeadAttention, attention

    x = _x(16, 64, seed=0)
    _, w_same = attention(x, x, x, return_weights=True)
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 1).double()
    with torch.no_grad():
        _, w_proj = mha(x[0], need_weights=True)
    d_same = float(w_same.diagonal(dim1=-2, dim2=-1).mean())
    d_proj = float(w_proj.diagonal(dim1=-2, dim2=-1).mean())
    xn = x[0, 0].numpy()
    qkv = xn @ mha.qkv_proj.weight.detach().numpy().T + mha.qkv_proj.bias.detach().numpy()
    witness = ind.close(w_same[0, 0].numpy(), ind.attention_weights(xn, xn)) and ind.close(
        w_proj.reshape(16, 16).numpy(), ind.attention_weights(qkv[:, :64], qkv[:, 64:128])
    )
    wrong = d_same > 0.9 and d_proj < 0.5
    return Finding(
        computed=f"mean diagonal weight with Q = K = V = X: {d_same:.3f}; with three projections: "
        f"{d_proj:.3f} (uniform 1/16 = 0.0625)",
        call="attention(x, x, x, return_weights=True) vs MultiHeadAttention(64, 1)(x, "
        "need_weights=True)",
        **judged(
            not wrong,
            "Q, K and V come from the same X through three different projections "
            "(§3.1's Q = XW^Q, K = XW^K, V = XW^V); with Q = K literally, q_i·q_i dominates and "
            "each token attends almost only to itself",
            Derivation(
                witness,
                "softmax(QKᵀ/√d) in numpy, with Q = K = X and with the module's projections, "
                "equals both weight matrices",
            ),
        ),
    )


@check("003-3.1-a")
def _multihead() -> Finding:
    from ... import MultiHeadAttention

    torch.manual_seed(1)
    mha = MultiHeadAttention(24, 4).double()
    x = _x(7, 24, seed=1)[0]  # (1, 7, 24)
    (wq, bq), (wk, bk), (wv, bv) = mha.projection_weights()
    heads = []
    for i in range(4):
        rows = slice(6 * i, 6 * (i + 1))
        q, k, v = (x @ w[rows].T + b[rows] for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        heads.append(torch.softmax(q @ k.mT / 6**0.5, dim=-1) @ v)  # (1, 7, 6)
    want = mha.out_proj(torch.cat(heads, dim=-1))
    with torch.no_grad():
        err = float((mha(x) - want).abs().max())
    shapes = (tuple(wq[:6].T.shape), tuple(mha.out_proj.weight.T.shape))
    ok = err < 1e-12 and shapes == ((24, 6), (24, 24))
    return Finding(
        computed=f"W_i^Q is {shapes[0]}, W^O is {shapes[1]} (h·d_k × d_model); max |module − "
        f"Concat(head_i) W^O| = {tiny(err)}",
        call="MultiHeadAttention(24, 4)(x) vs out_proj(cat(softmax(q_i k_iᵀ/√6) v_i))",
        **judged(ok, "the module differs from the per-head formula"),
    )


@check("003-3.2-a")
def _local_heads() -> Finding:
    tokens, w = _minilm_attention(SENTENCE)
    n = len(tokens)
    inner = range(2, n - 2)  # skip [CLS]/[SEP] neighbours
    prev = torch.stack([w[..., i, i - 1] for i in inner], -1).mean(-1)  # (layers, heads)
    nxt = torch.stack([w[..., i, i + 1] for i in inner], -1).mean(-1)
    p, q = int(prev.argmax()), int(nxt.argmax())
    H = w.shape[1]
    wrong = float(prev.max()) > 0.5
    from ...models.minilm import model_path

    theirs = ind.bert_attentions(str(model_path()), SENTENCE)
    witness = ind.close(w.double().numpy(), theirs, 1e-4)
    return Finding(
        computed=f"layer {p // H}, head {p % H} puts {float(prev.max()):.4f} of each token's "
        f"weight on the previous token; layer {q // H}, head {q % H} {float(nxt.max()):.3f} on "
        "the next",
        call="tokens, w = minilm().attentions(sentence); w[..., i, i - 1].mean()",
        **judged(
            not wrong,
            "a trained model learns local heads (previous/next-token attention) with positional "
            "information; what self-attention lacks is a built-in locality bias, not the ability "
            "to attend locally",
            Derivation(
                witness,
                "Hugging Face transformers' BertModel on the same checkpoint gives the same "
                "attention weights to 1e-4",
            ),
        ),
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


@check("003-3.2-c")
def _concat_positions() -> Finding:
    from ... import SinusoidalEmbedding, attention
    from ...positional import ConcatPositionalEncoding

    x = _x(32, 16, seed=4)[0]  # (1, 32, 16)
    cat = ConcatPositionalEncoding(SinusoidalEmbedding(64, dtype=torch.float64))
    xp = cat(x)  # (1, 32, 80)
    p = xp[0, :, 16:]
    logits = xp[0] @ xp[0].T
    split = float((logits - (x[0] @ x[0].T + p @ p.T)).abs().max())
    pp = p @ p.T  # (32, 32), a function of i − j
    row = pp[16]
    local = bool(row.argmax() == 16) and bool((row[16:20].diff() < 0).all())
    _, w = attention(xp, xp, xp, scale=1.0, return_weights=True)
    ok = split < 1e-12 and local and tuple(w.shape) == (1, 32, 32)
    return Finding(
        computed=f"[x; p]·[x; p] − (x·x + p·p) = {tiny(split)}; p_16·p_j = "
        + ", ".join(f"{float(v):.2f}" for v in row[16:20])
        + " for j = 16…19 (largest at j = i, falling with the offset)",
        call="ConcatPositionalEncoding(SinusoidalEmbedding(64))(x); p @ p.T",
        **judged(ok, "the concatenated positions do not add a local term"),
    )


@check("003-4.3-a")
def _odot_mask() -> Finding:
    from ... import attention, masks

    q, k, v = (_x(8, 16, seed=2 + i) for i in range(3))
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


@check("003-4.3-b")
def _dynamic_range() -> Finding:
    from ...functional.reference import adaptive_span_attention, span_ramp

    q, k, v = (_x(12, 8, seed=5 + i) for i in range(3))
    z = torch.tensor([2.0], dtype=torch.float64)
    _, w = adaptive_span_attention(q, k, v, z, ramp=2.0)
    i = torch.arange(12)
    dist = (i[:, None] - i[None, :]).to(torch.float64)  # x = i − j
    m = torch.where(dist >= 0, span_ramp(dist, z, 2.0), 0.0)  # causal ramp, (12, 12)
    text = torch.softmax((q @ k.mT / 8**0.5) * m, dim=-1)  # the text's ⊙ f on the logits
    outside = m == 0
    leak = float((text * outside).sum(-1).max())  # weight on keys outside the span, per row
    ramp = np.where(dist.numpy() >= 0, ind.span_ramp(dist.numpy(), 2.0, 2.0), 0.0)
    a = ramp * np.exp(q[0, 0].numpy() @ k[0, 0].numpy().T / 8**0.5)  # a_ij ∝ m_ij·exp(s_ij)
    witness = ind.close(w.reshape(12, 12).numpy(), a / a.sum(-1, keepdims=True))
    ours = float(w[..., outside].abs().max())
    wrong = ours == 0.0 and leak > 0.1
    return Finding(
        computed=f"⊙ on the logits leaves up to {leak:.3f} of a row's weight on keys outside the "
        f"span (f = 0 gives logit 0, not −∞); the adaptive span's weights there: {ours:g}",
        call="adaptive_span_attention(q, k, v, z, ramp=2.0) vs softmax((q @ k.mT / √d) * m)",
        **judged(
            not wrong,
            "a range must scale the weights, not the logits: a_ij ∝ f_ij·exp(s_ij), i.e. "
            "softmax(QKᵀ/√d_k + log f)V (Sukhbaatar et al.); scaling a logit by f only changes its "
            "temperature and keeps every key",
            Derivation(
                witness,
                "a_ij ∝ m_z(i − j)·exp(q_i·k_j/√d) with the ramp in closed form, in numpy, "
                "equals the adaptive span's weights",
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
    from ... import attention, masks

    n, window = 1024, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    local = attention(q, k, v, mask=masks.sliding_window(window))
    glob = attention(q, k, v, mask=masks.causal())
    both = torch.cat([local, glob], dim=-1)  # the formula: both on the same Q, K, V
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
        ind.close(local[0, 0].numpy(), loc_ind)
        and ind.close(glob[0, 0].numpy(), ind.sdpa(qn, kn, vn, keep=causal))
        and ind.close(seq[0, 0].numpy(), ind.sdpa(loc_ind, loc_ind, loc_ind, keep=causal))
        and (pairs, full) == (int(band.sum()), n * (n + 1) // 2)
    )
    return Finding(
        computed=f"Concat(Local, Global) has width {both.shape[-1]} (2·d_v) and attends "
        f"{pairs + full:,} pairs vs {full:,} for global attention alone; global-after-local "
        f"differs from the formula's Global(Q, K, V) by up to {differs:.3g}",
        call="torch.cat([attention(q, k, v, mask=masks.sliding_window(64)), attention(q, k, v, "
        "mask=masks.causal())], -1) vs attention(local, local, local, mask=masks.causal())",
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


@check("003-5-a")
def _code_sample() -> Finding:
    from ... import MultiHeadAttention

    x = _x(5, 32, seed=3)[0]  # (1, 5, 32)
    as_printed: dict = {}
    exec(compile(SNIPPET, "<seed 003 §5>", "exec"), as_printed)  # the text's own code
    try:
        as_printed["SelfAttention"](32, 4).eval()(x.float())
        error = ""
    except NameError as e:
        error = str(e)
    fixed: dict = {}
    exec(compile("import math\n" + SNIPPET, "<seed 003 §5, fixed>", "exec"), fixed)
    torch.manual_seed(3)
    theirs = fixed["SelfAttention"](32, 4).double().eval()
    ours = MultiHeadAttention(32, 4).double().eval()
    parts = (theirs.q_linear, theirs.k_linear, theirs.v_linear)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([lin.weight for lin in parts]))
        ours.qkv_proj.bias.copy_(torch.cat([lin.bias for lin in parts]))
        ours.out_proj.weight.copy_(theirs.out.weight)
        ours.out_proj.bias.copy_(theirs.out.bias)
        err = float((ours(x) - theirs(x)).abs().max())
        mine = ours(x)[0].numpy()
    weights = (ours.qkv_proj.weight, ours.qkv_proj.bias, ours.out_proj.weight, ours.out_proj.bias)
    by_hand = ind.mha(x[0].numpy(), *(t.detach().numpy() for t in weights), heads=4)
    wrong = bool(error) and err < 1e-12
    return Finding(
        computed=f"as printed: NameError ({error}); with `import math`: equals "
        f"attnlab.MultiHeadAttention to {tiny(err)}",
        call="exec(snippet); SelfAttention(32, 4)(x) vs MultiHeadAttention(32, 4) with the "
        "same weights",
        **judged(
            not wrong,
            "the code calls math.sqrt without `import math`; with it added, the module "
            "computes standard multi-head self-attention",
            Derivation(
                ind.close(mine, by_hand),
                "multi-head attention in numpy from the copied weights equals "
                "attnlab.MultiHeadAttention",
            ),
        ),
    )


@check("003-6-a")
def _translation() -> Finding:
    return Finding(
        computed="no computation: the published results are BLEU scores of large models trained "
        "on WMT corpora",
        call="—",
        verdict=NOT_CHECKABLE,
        explanation="needs the WMT training and test corpora (gigabytes, not shippable) and GPU "
        "training time; a historical result of the 2017 paper",
    )
