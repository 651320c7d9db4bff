"""Checks of multi-head attention: the head formula, widths and parameter shapes, what heads of
MiniLM attend to, diversity and pruning (subjects ``heads``, ``full-width``, ``diversity``,
``output-norm``, ``minilm``, ``minilm-transposed``)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny
from ..derivations import np  # NumPy on first use (the textbook extra)
from ._shared import (
    _SINGLE_HEAD_WITNESS,
    F64,
    _err,
    _est,
    _found,
    _heads_seq,
    _mha,
    _mha_by_hand,
    _mha_parts,
    _qkv,
    _randn,
    _single_head_copy,
    _softmax_ref,
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


SENTENCE = "The animal didn't cross the street because it was too tired"


@functools.cache
def _minilm_attention(text: str) -> tuple[list[str], torch.Tensor]:
    from ...models import minilm

    return minilm().attentions(text)  # tokens, (layers, heads, T, T)


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


#: head_dim = d_model / heads as each text's claim is checked: the (d_model, heads) pairs, how
#: the finding words them (prefix, separator, one pair), the call, and the claim's wording of a
#: failure.
_HEAD_DIMS = {
    "001-6.2-a": (
        ((512, 8), (1024, 16)),
        ("", "; ", "d_model={E}, {H} heads: head_dim {D}"),
        "MultiHeadAttention(512, 8).head_dim",
        "head_dim differs from d_model / num_heads",
    ),
    "002-8.3.3-d": (
        tuple((768, h) for h in (4, 12, 32, 96)),
        ("d_k = ", ", ", "{D} at h={H}"),
        "MultiHeadAttention(768, h).head_dim",
        "head_dim is not d_model/h",
    ),
}


@check("001-6.2-a", "002-8.3.3-d")
def _head_dim(cid: str) -> Finding:
    """Each head works in d_model / heads dimensions: `MultiHeadAttention`'s ``head_dim`` at the
    sizes of claim ``cid`` (`_HEAD_DIMS`), built on the meta device.

    Args:
        cid: the claim id.

    Returns:
        The finding: the head widths.
    """
    from ...modules import MultiHeadAttention

    sizes, (prefix, sep, part), call, why = _HEAD_DIMS[cid]
    with torch.device("meta"):
        dims = [(E, H, MultiHeadAttention(E, H).head_dim) for E, H in sizes]
    return _found(
        prefix + sep.join(part.format(E=E, H=H, D=D) for E, H, D in dims),
        call,
        all(D == E // H for E, H, D in dims),
        why,
    )


def _heads_by_hand(mha, x: Tensor) -> list[Tensor]:
    """head_i = softmax(x W_i^Q (x W_i^K)ᵀ/√d_k) x W_i^V, one head at a time (no biases)."""
    wq, wk, wv, _ = _mha_parts(mha)
    D, out = mha.head_dim, []
    for i in range(mha.num_heads):
        sl = slice(i * D, (i + 1) * D)
        out.append(_softmax_ref(x @ wq[sl].T, x @ wk[sl].T, x @ wv[sl].T))
    return out


@check("002-8.3.1-a")
def _multihead_formula() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(1, 6, 16, seed=1)
    y = torch.cat(_heads_by_hand(mha, x), -1) @ _mha_parts(mha)[3].T
    err = float((mha(x) - y).abs().max())
    return _found(
        f"max |MultiHeadAttention(x) − Concat(head_1..head_4)W^O| = {_err(err)}",
        "MultiHeadAttention(16, 4, bias=False)(x) vs torch.cat(heads, -1) @ W_o.T",
        err < 1e-12,
        "the module is not Concat(heads)·W^O",
    )


@check("002-8.3.2-a")
def _bilinear() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(1, 5, 16, seed=1)
    q, k, _ = mha.project(x)
    wq, wk, _, _ = _mha_parts(mha)
    err = 0.0
    for i in range(4):
        sl = slice(4 * i, 4 * i + 4)
        m = wq[sl].T @ wk[sl]  # (E, E) = W_i^Q (W_i^K)ᵀ in the text's (d_model × d_k) layout
        err = max(err, float((q[0, i] @ k[0, i].T - x[0] @ m @ x[0].T).abs().max()))
    return _found(
        f"max |q_i·k_j (from MultiHeadAttention.project) − x_iᵀ M y_j| over 4 heads = {_err(err)}",
        "q, k, _ = mha.project(x); M_h = W_q[h].T @ W_k[h]",
        err < 1e-12,
        "the per-head score is not a bilinear form of the inputs",
    )


@check("002-8.3.2-b")
def _metric_shape() -> Finding:
    mha = _mha(16, 4, bias=False)
    wq, wk, _, _ = _mha_parts(mha)
    WQ, WK = wq[:4].T, wk[:4].T  # the text's layout: (d_model, d_k)
    text_m, right_m = WQ.T @ WK, WQ @ WK.T
    rank = int(torch.linalg.matrix_rank(right_m))
    x = _randn(1, 5, 16, seed=3)
    q, k, _ = mha.project(x)  # (1, H, 5, 4): attnlab's head-0 queries and keys
    xn = x[0].numpy()
    bilinear = xn @ (WQ.numpy() @ WK.numpy().T) @ xn.T  # xᵀ W^Q (W^K)ᵀ y for every pair
    return _found(
        f"(W^Q)ᵀW^K has shape {tuple(text_m.shape)}; W^Q(W^K)ᵀ has shape "
        f"{tuple(right_m.shape)} and rank {rank}",
        "W_q[:4].T and W_k[:4].T of MultiHeadAttention(16, 4); shapes of both products",
        tuple(text_m.shape) == (16, 16),
        "the two sides mix conventions: with W_i^Q ∈ R^{d_model×d_k} (8.3.1), (xW^Q)ᵀ(yW^K) = "
        "xᵀW^Q(W^K)ᵀy, so M_i = W_i^Q(W_i^K)ᵀ (d_model×d_model, rank ≤ d_k); (W^Q)ᵀW^K is "
        "d_k×d_k (right only in 8.1.2's W ∈ R^{d_k×d} layout)",
        Derivation(
            ind.close((q[0, 0] @ k[0, 0].mT).numpy(), bilinear, 1e-10),
            "xᵀ(W^Q(W^K)ᵀ)y in numpy equals attnlab's head-0 q·k for every pair of 5 tokens",
        ),
    )


@check("002-8.3.2-c")
def _heads_redundant() -> Finding:
    from ...analysis.heads import alice_sentences, pruning_sweep
    from ...models.minilm import model_path

    sweep = pruning_sweep(tuple(i / 20 for i in range(21)), threshold=0.95)
    kept = sweep.kept_fraction("importance")  # largest fraction pruned with cosine ≥ 0.95
    rand = sweep.kept_fraction("random")
    matter = 1.0 - kept
    ok = 0.3 <= matter <= 0.5
    # the same pruned sets through transformers: the cosine at the kept fraction and one step on
    texts = alice_sentences(sweep.eval_sentences)
    points = [i for i, f in enumerate(sweep.fractions) if f >= kept][:2]
    theirs = [
        ind.bert_pruned_cosine(
            str(model_path()), texts, sweep.order[: round(sweep.fractions[i] * sweep.heads)]
        )
        for i in points
    ]
    ours = [sweep.metric["importance"][i] for i in points]
    witness = all(abs(a - b) < 1e-3 for a, b in zip(theirs, ours, strict=True))
    return Finding(
        f"cosine ≥ 0.95 holds up to {kept:.0%} of the heads pruned in importance order "
        f"({rand:.0%} in random order): {matter:.0%} of the heads matter at that bar",
        "pruning_sweep(fractions=0, 0.05, …, 1, threshold=0.95).kept_fraction('importance')",
        **judged(
            ok,
            f"in the distilled 6-layer MiniLM about {matter:.0%} of the heads matter at "
            "cosine 0.95 — the 30–50 % rule comes from larger models (Michel et al.) and depends "
            "on the model and the metric's bar",
            Derivation(
                witness,
                "Hugging Face transformers with the same heads' outputs zeroed gives mean "
                "cosines " + ", ".join(f"{x:.4f}" for x in theirs) + " at the kept fraction and "
                "one step past it (attnlab: " + ", ".join(f"{x:.4f}" for x in ours) + ")",
            ),
        ),
    )


_SENTENCES = (
    "The quick brown fox jumps over the lazy dog because it was hungry.",
    "Attention lets every position look at every other position in one step.",
    "She put the book she had borrowed from the library back on the shelf.",
)


@functools.lru_cache(maxsize=1)
def _minilm_head_profile() -> dict[str, Tensor]:
    """Per (layer, head) of all-MiniLM-L6-v2, averaged over `_SENTENCES`: the mean weight on the
    previous token, on the next token, on [CLS], and the entropy relative to ln T."""
    from ...analysis import entropy
    from ...models.minilm import minilm

    model = minilm()
    parts: dict[str, list[Tensor]] = {"prev": [], "next": [], "cls": [], "entropy": []}
    for text in _SENTENCES:
        _, w = model.attentions(text)  # (layers, heads, T, T)
        w = w.to(F64)
        i = torch.arange(w.shape[-1])
        parts["prev"].append(w[..., i[1:], i[:-1]].mean(-1))
        parts["next"].append(w[..., i[:-1], i[1:]].mean(-1))
        parts["cls"].append(w[..., 0].mean(-1))
        parts["entropy"].append(entropy(w).mean(-1) / math.log(w.shape[-1]))
    return {k: torch.stack(v).mean(0) for k, v in parts.items()}


@check("002-8.3.4-b")
def _specialisation() -> Finding:
    prof = _minilm_head_profile()
    named = {
        "previous-token": prof["prev"] > 0.5,
        "next-token": prof["next"] > 0.5,
        "[CLS]-sink": prof["cls"] > 0.5,
        "broad (global)": prof["entropy"] > 0.8,
    }
    found = {k: [f"L{int(a)}H{int(b)}" for a, b in v.nonzero()] for k, v in named.items()}
    best_prev = float(prof["prev"].max())
    ok = bool(found["previous-token"] or found["next-token"]) and bool(found["broad (global)"])
    return _found(
        "; ".join(
            f"{k} heads: {len(v)} ({', '.join(v[:4])}{', …' if len(v) > 4 else ''})"
            for k, v in found.items()
        )
        + f"; largest previous-token weight {fmt(best_prev)}",
        "minilm().attentions(text) → per-head mean weight on i−1, i+1, [CLS]; entropy / ln T",
        ok,
        "MiniLM shows no positional or no broad heads",
    )


@check("002-8.3.3-c")
def _fused_vs_loop() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(2, 6, 16, seed=1)
    serial = torch.cat(_heads_by_hand(mha, x), -1) @ _mha_parts(mha)[3].T  # for i in range(h)
    fused = mha(x)  # one (E × 3E) matmul, view (B, L, H, D), transpose, one attention call
    err = float((fused - serial).abs().max())
    return _found(
        f"max |fused − serial loop| = {_err(err)}",
        "MultiHeadAttention(16, 4, bias=False)(x) vs a per-head loop over weight slices",
        err < 1e-12,
        "the fused and serial forms differ",
    )


@check("002-8.3.4-a")
def _diversity() -> Finding:
    from ... import attention
    from ...analysis import head_diversity

    q, k, v = _qkv(H=4)
    _, w = attention(q, k, v, return_weights=True)
    a = w[0].flatten(1)
    cos = torch.nn.functional.cosine_similarity(a[:, None], a[None, :], dim=-1)
    h = 4
    ref = 1 - (cos.sum() - cos.diagonal().sum()) / (h * (h - 1))
    got = float(head_diversity(w)[0])
    err = abs(got - float(ref))
    return _found(
        f"head_diversity = {fmt(got, 8)}; formula = {fmt(float(ref), 8)}",
        "head_diversity(attention(q, k, v, return_weights=True)[1])",
        err < 1e-12,
        "head_diversity differs from the formula",
    )


@check("002-8.3.4-c")
def _importance() -> Finding:
    from ...analysis import output_norm

    mha = _mha(16, 4)
    wo = _mha_parts(mha)[3]
    ref = torch.stack([wo[:, 4 * i : 4 * i + 4].norm() for i in range(4)])
    got = output_norm(mha)[0].to(F64)
    err = float((got - ref).abs().max())
    return _found(
        "output_norm = [" + ", ".join(fmt(float(x)) for x in got) + f"]; max |Δ| vs formula "
        f"{_err(err)}",
        "output_norm(mha)",
        err < 1e-12,
        "output_norm is not the slice norm",
    )


@check("002-8.3.4-d")
def _no_interactions() -> Finding:
    mha = _mha(16, 4)
    x = _randn(1, 6, 16, seed=1)
    q, k, v = mha.project(x)
    heads = _softmax_ref(q, k, v)  # (1, H, L, D)
    wo, bo = mha.out_proj.weight.detach(), mha.out_proj.bias.detach()
    parts = sum(heads[0, i] @ wo[:, 4 * i : 4 * i + 4].T for i in range(4)) + bo
    resid = float((mha(x)[0] - parts).abs().max())
    return _found(
        f"max |MultiHeadAttention(x) − (Σ_i head_i W_i^O + b)| = {_err(resid)}",
        "mha(x) vs sum(head_i @ W_o[:, i·d_v:(i+1)·d_v].T) + b_o",
        resid > 1e-9,
        "W^O is linear: y = Σ_i head_i W_i^O + b exactly (residual 0), so there is no "
        "interaction term and no confidence-dependent weighting of heads",
        _mha_by_hand(mha, x),
    )


@check("002-8.7-c")
def _typical_heads() -> Finding:
    from ...modules import MultiHeadAttention

    dims = {h: MultiHeadAttention(1024, h).head_dim for h in (4, 8, 16, 32)}
    cfg = {h: _est(128, 1024, h).config["D"] for h in (4, 8, 16, 32)}
    return _found(
        "d_k = " + ", ".join(f"{d} (h={h})" for h, d in dims.items()),
        "MultiHeadAttention(1024, h).head_dim; estimate(128, 1024, h).config['D']",
        all(d == 1024 // h == cfg[h] for h, d in dims.items()),
        "d_k is not d_model/h",
    )


@check("002-8.3.1-c")
def _param_shapes() -> Finding:
    mha = _mha(512, 8)
    wq, wk, wv, wo = _mha_parts(mha)
    per_head = [tuple(w[:64].T.shape) for w in (wq, wk, wv)]
    ok = per_head == [(512, 64)] * 3 and tuple(wo.T.shape) == (512, 512) and mha.head_dim == 64
    return _found(
        f"W_i^Q, W_i^K, W_i^V (transposed head slices): {per_head}; W^O (transposed): "
        f"{tuple(wo.T.shape)} = (h·d_v, d_model)",
        "MultiHeadAttention(512, 8): qkv_proj.weight split per head, out_proj.weight",
        ok,
        "the projection shapes differ",
    )


@check("002-8.3.4-e")
def _pruning() -> Finding:
    from ...analysis import head_importance

    mha = _mha(16, 4)
    x, target = _randn(2, 6, 16, seed=1), _randn(2, 6, 16, seed=2)

    def loss_fn(m, batch):
        return ((m(batch[0]) - batch[1]) ** 2).sum()

    imp = head_importance(mha, (x, target), loss_fn, ablation=True)["ablation"][0]
    base = float(loss_fn(mha, (x, target)))
    pruned = []
    for h in range(4):
        m = _mha(16, 4)
        m.prune_heads([h])
        with torch.no_grad():
            pruned.append(float(loss_fn(m, (x, target))) - base)
    err = max(abs(float(a) - b) for a, b in zip(imp, pruned, strict=True))
    order = [int(i) for i in imp.argsort(descending=True)]
    return _found(
        "loss increase per pruned head: "
        + ", ".join(fmt(b) for b in pruned)
        + f"; head_importance ablation matches to {_err(err, 1e-9)}; ranking {order}",
        "head_importance(mha, (x, t), loss_fn, ablation=True); mha.prune_heads([h])",
        err < 1e-9,
        "the gated ablation does not equal pruning the head",
    )


@check("002-8.9-g")
def _divisible() -> Finding:
    from ...modules import MultiHeadAttention

    try:
        MultiHeadAttention(512, 7)
        got = "accepted"
    except ValueError as e:
        got = f"ValueError: {e}"
    d8 = MultiHeadAttention(512, 8).head_dim
    return _found(
        f"h=7: {got}; h=8: d_k = {d8}",
        "MultiHeadAttention(512, 7); MultiHeadAttention(512, 8).head_dim",
        got.startswith("ValueError") and d8 == 64,
        "the module accepts 7 heads or gives another d_k",
    )


@check("002-8.9-h")
def _reshape() -> Finding:
    mha = _mha(16, 4, bias=False)
    x = _randn(2, 5, 16, seed=1)
    q, _, _ = mha.project(x)
    flat = x @ _mha_parts(mha)[0].T  # (B, L, E)
    right = flat.reshape(2, 5, 4, 4).transpose(1, 2)
    wrong = flat.reshape(2, 5, 4, 4).permute(0, 3, 1, 2)  # reshape(B, L, d_k, h)-style split
    e_right, e_wrong = float((q - right).abs().max()), float((q - wrong).abs().max())
    return _found(
        f"project() vs reshape+transpose: {_err(e_right)}; vs the scrambled split: {fmt(e_wrong)}",
        "mha.project(x)[0] vs (x @ W_q.T).reshape(B, L, h, d_k).transpose(1, 2)",
        e_right < 1e-12 and e_wrong > 1e-3,
        "the head split differs",
    )


@check("002-ex8.8-a")
def _ex88_single() -> Finding:
    y, target, a = _single_head_copy()
    err = float((y - target).abs().max())
    a1, an, rest = float(a[:, 0].min()), float(a[:, -1].min()), float(a[:, 1:-1].max())
    return _found(
        f"α_i1 = {fmt(a1, 6)}, α_in = {fmt(an, 6)} in every row, other weights {_err(rest)}; "
        f"max |y_i − (x_1 + x_n)| = {_err(err)}",
        "MultiHeadAttention(8, 1, bias=False) with hand-set weights; attention(…, "
        "return_weights=True)",
        not (abs(a1 - 0.5) < 1e-12 and abs(an - 0.5) < 1e-12 and err < 1e-12),
        "one head does it: equal logits on x_1 and x_n and much lower elsewhere give 0.5/0.5, "
        "and W^O = 2I outputs x_1 + x_n exactly",
        _SINGLE_HEAD_WITNESS[0],
    )


@check("002-ex8.8-b")
def _ex88_rank() -> Finding:
    from ... import attention

    _, _, a = _single_head_copy()
    r_copy = int(torch.linalg.matrix_rank(a))
    q, k, v = _qkv(H=1, L=16, D=16)
    _, w = attention(q, k, v, return_weights=True)
    r_rand = int(torch.linalg.matrix_rank(w[0, 0]))
    w_ind = ind.attention_weights(q.numpy(), k.numpy())[0, 0]
    witness = ind.close(w[0, 0].numpy(), w_ind) and _SINGLE_HEAD_WITNESS[0].agrees
    return _found(
        f"rank of the 0.5/0.5 matrix = {r_copy}; rank of one random head's 16×16 weights = "
        f"{r_rand}",
        "torch.linalg.matrix_rank(attention(q, k, v, return_weights=True)[1][0, 0])",
        r_copy >= 2 and r_rand == 1,
        "the 0.5/0.5 pattern has rank 1, and a single head's n×n weights are generically of "
        "full rank n, not rank 1",
        Derivation(
            witness,
            f"softmax(QKᵀ/√d) in numpy equals attnlab's weights (numpy rank "
            f"{int(np.linalg.matrix_rank(w_ind))}), and the copy head matches numpy",
        ),
    )


@check("003-3.1-a")
def _multihead() -> Finding:
    from ... import MultiHeadAttention

    torch.manual_seed(1)
    mha = MultiHeadAttention(24, 4).double()
    x = _heads_seq(7, 24, seed=1)[0]  # (1, 7, 24)
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
