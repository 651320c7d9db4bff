"""Checks of word order: self-attention is permutation equivariant without positions and a
positional encoding breaks the symmetry (subject ``default-causal`` and the permutation claims)."""

from __future__ import annotations

import torch

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny
from ._shared import (
    F64,
    _close,
    _err,
    _found,
    _gen,
    _mha,
    _mha_eval,
    _permutation_outputs,
    _qkv,
    _randn,
    _randn_from,
    _seq,
    _verdict,
)


@check("001-3.1-a")
def _equivariance() -> Finding:
    mha = _mha_eval(16, 2, seed=2)
    x = _seq(5, 16, seed=2)
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

    mha = _mha_eval(16, 2, seed=3)
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


@check("002-8.2.1-b", "002-8.5-b", "002-8.7-a", "002-ex8.3-b")
def _invariance_claim() -> Finding:
    """The text's word 'invariance' (置换不变性): the output would be unchanged by a permutation."""
    out, out_p, perm = _permutation_outputs()
    q, k, v = (t.numpy() for t in _qkv(H=1, L=6))
    p = perm.numpy()
    by_hand = ind.close(out.numpy(), ind.sdpa(q, k, v)) and ind.close(
        out_p.numpy(), ind.sdpa(q[:, :, p], k[:, :, p], v[:, :, p])
    )
    changed = float((out_p - out).abs().max())
    equi = float((out_p - out[:, :, perm]).abs().max())
    return _found(
        f"max |Attention(PQ, PK, PV) − Attention(Q, K, V)| = {fmt(changed)} (not invariant); "
        f"max |Attention(PQ, PK, PV) − P·Attention(Q, K, V)| = {_err(equi)} (equivariant)",
        "attention(q[:, :, perm], k[:, :, perm], v[:, :, perm]) vs attention(q, k, v)",
        changed < 1e-12,
        "the property is permutation equivariance (the output is permuted the same way), not "
        "invariance (an unchanged output)",
        Derivation(
            by_hand,
            "softmax(QKᵀ/√d)V in numpy equals attention on the inputs and on the permuted inputs",
        ),
    )


@check("002-8.2.1-c")
def _dog_bites_man() -> Finding:
    from ...positional import sinusoidal

    mha = _mha(16, 4)
    dog, bite, man = _randn(3, 16, seed=5)
    s1 = torch.stack([dog, bite, man])[None]  # 狗咬人
    s2 = torch.stack([man, bite, dog])[None]  # 人咬狗
    no_pe = float((mha(s1)[0, 0] - mha(s2)[0, 2]).abs().max())
    pe = sinusoidal(3, 16, dtype=F64)
    with_pe = float((mha(s1 + pe)[0, 0] - mha(s2 + pe)[0, 2]).abs().max())
    return _found(
        f"output at '狗': max difference between the sentences {_err(no_pe)} without positions, "
        f"{fmt(with_pe)} with sinusoidal positions added",
        "mha(s1)[0, 0] vs mha(s2)[0, 2]; mha(s + sinusoidal(3, 16))",
        no_pe < 1e-12 and with_pe > 1e-3,
        "the two orders are (in)distinguishable contrary to the text",
    )


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


@check("004-4-a")
def _permutation() -> Finding:
    from ... import MultiHeadAttention

    g = _gen(18)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(18)
        mha = MultiHeadAttention(16, 2).to(F64)
    x = _randn_from(g, 1, 7, 16)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    with torch.no_grad():
        y, w = mha(x, need_weights=True)
        yp, wp = mha(x[:, perm], need_weights=True)
    equivariant = _close(yp, y[:, perm])
    pair_scores = _close(wp, w[:, :, perm][:, :, :, perm])
    invariant = _close(yp, y)
    ok = equivariant and pair_scores and not invariant
    return Finding(
        computed=f"MHA(x[perm]) == MHA(x)[perm]: {equivariant}; every (query, key) pair keeps its "
        f"weight wherever it sits: {pair_scores}; MHA(x[perm]) == MHA(x) (invariance of the "
        f"sequence output): {invariant}",
        call="mha(x[:, perm], need_weights=True) vs mha(x, need_weights=True)[..][perm]",
        **_verdict(ok, "scores depend on the positions without a position encoding"),
    )


@check("004-4-i")
def _pe_breaks_symmetry() -> Finding:
    from ... import MultiHeadAttention, SinusoidalEmbedding

    g = _gen(18)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(18)
        mha = MultiHeadAttention(16, 2).to(F64)
    x = _randn_from(g, 1, 7, 16)
    pe = SinusoidalEmbedding(16, dtype=F64)(7)  # (7, 16)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    with torch.no_grad():
        plain = float((mha(x[:, perm]) - mha(x)[:, perm]).abs().max())
        with_pe = float((mha(x[:, perm] + pe) - mha(x + pe)[:, perm]).abs().max())
    ok = plain < 1e-12 and with_pe > 1e-6
    return Finding(
        computed=f"max change of a token's output when the sequence is reordered: without PE "
        f"< 1e-12: {plain < 1e-12}; with sinusoidal PE added {fmt(with_pe, 2)}",
        call="mha(x[:, perm] + pe) vs mha(x + pe)[:, perm]; pe = SinusoidalEmbedding(16)(7)",
        **_verdict(ok, "adding the position encoding does not make attention order-aware"),
    )
