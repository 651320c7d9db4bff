"""Seed 002, §8.9: common pitfalls (the checks of the claims in claims/seed002.toml)."""

from __future__ import annotations

import math

import torch

from .. import derivations as ind
from ..core import (
    Derivation,
    Finding,
    check,
    fmt,
)
from .seed002 import F64, _err, _found, _mha, _mha_parts, _qkv, _randn
from .seed002_costs import _est


# ------------------------------------------------------------------------- 8.9 pitfalls
@check("002-8.9-a")
def _same_word() -> Finding:
    from ...positional import sinusoidal

    mha = _mha(16, 4)
    x = _randn(1, 6, 16, seed=3)
    x[0, 4] = x[0, 1]
    plain = mha(x)
    pe = mha(x + sinusoidal(6, 16, dtype=F64))
    d0 = float((plain[0, 1] - plain[0, 4]).abs().max())
    d1 = float((pe[0, 1] - pe[0, 4]).abs().max())
    return _found(
        f"outputs at the two copies differ by {_err(d0)} without PE, {fmt(d1)} with PE",
        "mha(x)[0, 1] vs mha(x)[0, 4]; mha(x + sinusoidal(6, 16))",
        d0 < 1e-12 and d1 > 1e-3,
        "the copies are (in)distinguishable contrary to the text",
    )


@check("002-8.9-b")
def _dim_mismatch() -> Finding:
    from ...positional import SinusoidalEmbedding

    x = torch.zeros(10, 512)
    try:
        _ = x + SinusoidalEmbedding(256)(10)
        got = "no error"
    except RuntimeError as e:
        got = f"RuntimeError: {str(e).splitlines()[0]}"
    ok_same = (x + SinusoidalEmbedding(512)(10)).shape == (10, 512)
    return _found(
        f"512 + 256: {got}; 512 + 512: shape (10, 512)",
        "torch.zeros(10, 512) + SinusoidalEmbedding(256)(10)",
        got.startswith("RuntimeError") and ok_same,
        "the mismatched widths add without error",
    )


@check("002-8.9-c")
def _scale_snippet() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    _, w = attention(q, k, v, return_weights=True)
    snippet = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(8), -1)
    _, w1 = attention(q, k, v, scale=1.0, return_weights=True)
    err = float((w - snippet).abs().max())
    unscaled = float((w1 - snippet).abs().max())
    return _found(
        f"max |attnlab weights − snippet| = {_err(err)}; without the division they differ by "
        f"{fmt(unscaled)}",
        "attention(q, k, v, return_weights=True)[1] vs softmax(Q Kᵀ / sqrt(d_k))",
        err < 1e-12,
        "attnlab's default does not divide by √d_k",
    )


@check("002-8.9-d")
def _softmax_dim() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    wrong = torch.softmax(s, -2)
    _, w = attention(q, k, v, return_weights=True)
    rows_wrong = float((wrong.sum(-1) - 1).abs().max())
    err = float((w - torch.softmax(s, -1)).abs().max())
    return _found(
        f"dim=-2: row sums miss 1 by up to {fmt(rows_wrong)} (the columns sum to 1); "
        "attnlab equals dim=-1 to "
        f"{_err(err)}",
        "torch.softmax(scores, -2) vs attention(q, k, v, return_weights=True)[1]",
        rows_wrong > 0.1 and err < 1e-12,
        "the two softmax dimensions agree",
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


@check("002-8.9-j")
def _pre_post_ln() -> Finding:
    from ...models import GPT, TransformerConfig

    spread = {}
    for pre in (True, False):
        torch.manual_seed(0)
        cfg = TransformerConfig(
            vocab_size=64,
            d_model=32,
            n_layers=8,
            n_heads=4,
            max_seq_len=16,
            prenorm=pre,
            attn_backend="reference",
        )
        model = GPT(cfg).double()
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = model(idx)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1)
        )
        loss.backward()
        norms = []
        for blk in model.blocks:
            g = torch.cat([p.grad.flatten() for p in blk.parameters() if p.grad is not None])
            norms.append(float(g.norm()))
        spread[pre] = max(norms) / min(norms)
    return _found(
        f"per-layer gradient-norm spread (max/min over 8 layers): Pre-LN {fmt(spread[True])}, "
        f"Post-LN {fmt(spread[False])}",
        "GPT(TransformerConfig(n_layers=8, prenorm=True/False)); per-block gradient norms",
        spread[True] < spread[False],
        "Post-LN's layer gradients are not more uneven than Pre-LN's at initialisation",
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


@check("002-8.9-m")
def _position_cosine() -> Finding:
    from ...positional import sinusoidal

    e = _randn(64, seed=8)
    pe = sinusoidal(11, 64, dtype=F64)
    cos = float(torch.nn.functional.cosine_similarity(e + pe[0], e + pe[10], dim=0))
    return _found(
        f"cos(e + PE_0, e + PE_10) = {fmt(cos)}",
        "cosine_similarity(e + sinusoidal(11, 64)[0], e + sinusoidal(11, 64)[10])",
        cos < 1 - 1e-3,
        "the representations coincide",
    )
