"""Seed 002, §8.3: multi-head attention (the checks of the claims in claims/seed002.toml)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import (
    NOT_CHECKABLE,
    Derivation,
    Finding,
    check,
    fmt,
    judged,
)
from .seed002 import F64, _err, _found, _mha, _mha_by_hand, _mha_parts, _qkv, _randn, _softmax_ref


# ------------------------------------------------------------------------------------ 8.3
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


@check("002-8.3.1-b")
def _heads_same_compute() -> Finding:
    from ...analysis import estimate

    mm = {}
    for h in (1, 2, 4, 8, 12):
        e = estimate(512, 768, h)
        mm[h] = (
            e.value("QKV + output projections", "naive")
            + e.value("scores QKᵀ", "naive")
            + e.value("weighted sum PV", "naive"),
            e.value("softmax", "naive"),
            e.value("total", "naive"),
        )
    same = len({v[0] for v in mm.values()}) == 1
    sm = mm[12][1] / mm[12][2]
    return _found(
        f"matmul FLOPs {fmt(mm[1][0])} for every h; softmax adds 5·h·n² "
        f"({fmt(100 * sm, 3)} % of the total at h=12)",
        "estimate(512, 768, h).value('scores QKᵀ' / 'weighted sum PV' / …, 'naive')",
        same and sm < 0.02,
        "the matmul FLOPs depend on the number of heads",
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


@check("002-8.3.3-a")
def _param_count() -> Finding:
    from ...analysis import estimate

    E = 768
    est = {h: estimate(128, E, h, bias=False).value("projection weights", "naive") for h in (1, 12)}
    counted = {h: sum(p.numel() for p in _mha(E, h, bias=False).parameters()) for h in (1, 12)}
    qkv = _mha(E, 12, bias=False).qkv_proj.weight.numel()
    # the text: one head takes 3d² (Q, K, V only), several heads 4d² (the extra W^O)
    split = est[1] == 3 * E * E and est[12] == 4 * E * E
    return _found(
        f"QKV weights {qkv:,} = 3·768²; the layer's projection weights: {int(est[1]):,} with one "
        f"head, {int(est[12]):,} with 12 (= 4·768² both)",
        "estimate(128, 768, h, bias=False).value('projection weights', 'naive'), h = 1, 12; "
        "MultiHeadAttention(768, h, bias=False).parameters()",
        split,
        "the output projection W^O belongs to the attention layer whatever the number of heads: "
        "one head with W^O has 4d² as well, and multi-head attention without it 3d²; the "
        "heads split d_model and add no weights",
        Derivation(
            counted == est and qkv == 3 * E * E,
            "the weight count of MultiHeadAttention(768, h) summed over its parameters equals "
            f"estimate's at h = 1 and 12 ({counted[1]:,} and {counted[12]:,})",
        ),
    )


@check("002-8.3.3-b")
def _score_cost() -> Finding:
    from ...analysis import estimate

    vals = {
        (n, h): estimate(n, 768, h).value("scores QKᵀ", "naive")
        for n in (512, 1024)
        for h in (1, 12)
    }
    ok = all(v == 2 * n * n * 768 for (n, _), v in vals.items())
    return _found(
        "QKᵀ FLOPs: "
        + ", ".join(f"n={n} h={h}: {fmt(v)}" for (n, h), v in vals.items())
        + " (= 2·n²·d_model)",
        "estimate(n, 768, h).value('scores QKᵀ', 'naive')",
        ok,
        "the score cost is not 2·n²·d_model independent of h",
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


@check("002-8.3.3-d")
def _head_dim() -> Finding:
    from ...modules import MultiHeadAttention

    dims = {h: MultiHeadAttention(768, h).head_dim for h in (4, 12, 32, 96)}
    return _found(
        "d_k = " + ", ".join(f"{d} at h={h}" for h, d in dims.items()),
        "MultiHeadAttention(768, h).head_dim",
        all(d == 768 // h for h, d in dims.items()),
        "head_dim is not d_model/h",
    )


@check("002-8.3.3-e")
def _heads_survey() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a historical fact: the configurations of published models (e.g. GPT-3 175B uses 96 "
        "heads, outside 16–32)",
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
