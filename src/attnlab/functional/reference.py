"""THE definitions. Every fast path in attnlab is defined to equal a function in this file.

The code here is explicit, unfused plain PyTorch that runs in float64 (and, with ``compute_dtype``,
in any precision). It favours clarity over speed and never changes meaning for performance.

Conventions: q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)``, ``H % H_kv == 0``;
``mask`` is bool, True = may attend, broadcastable to ``(B, H, L, S)``; ``bias`` is additive float,
broadcastable to ``(B, H, L, S)`` (−inf entries count as masked). A query row with no attendable key
outputs zeros and gets zero weights and zero gradients.

The NaN rule: row i's output, and every gradient through it, depends only on ``q_i`` and the
keys/values row i may attend. A non-finite ``q_i`` or attended ``k_j`` (or a NaN/+inf attended bias
entry; −inf means masked) makes the whole row NaN; a non-finite attended ``v_j[d]`` makes
``o_i[d]`` NaN and leaves the other columns exact; a non-finite value anywhere else never reaches
row i (packed documents stay isolated; causal rows before j never see ``v_j``). A row that may
attend nothing is zeros even when ``q_i`` is NaN. Gradients are those of the same computation on
inputs whose non-finite entries are 0 (see `functional.nan_rule`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._shapes import stat_dtype
from ..masks import Mask
from ..masks.patterns import causal_and_padding
from . import nan_rule
from .request import get_score

_NEG_INF = float("-inf")


def _as4(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)


def group_heads(t: Tensor, H_kv: int) -> Tensor:
    """Views ``(B|1, H|1, L|1, S|1)`` as ``(B|1, H_kv|1, G|1, L|1, S|1)`` without copying."""
    t = _as4(t)
    if t.shape[1] == 1:
        return t.unsqueeze(2)  # (B|1, 1, 1, L|1, S|1)
    return t.unflatten(1, (H_kv, t.shape[1] // H_kv if H_kv else 0))  # (B|1, H_kv, G, L|1, S|1)


def keep_mask(mask: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """Where attention is allowed: the bool mask, minus positions whose additive bias is −inf."""
    keep = None if mask is None else _as4(mask)
    if bias is not None:
        finite = ~torch.isneginf(_as4(bias))
        keep = finite if keep is None else keep & finite
    return keep


def softcap_logits(s: Tensor, softcap: float | None) -> Tensor:
    """The logit-transform stage: ``softcap · tanh(s / softcap)`` (identity for None).

    Logit soft-capping (Gemma 2, Grok; flash-attn's and transformers' ``softcap``): smooth, odd,
    monotone, slope 1 at 0 and ``|result| ≤ softcap``. It acts on the scaled scores
    ``score(q, k) · scale / T``, BEFORE the bias and the mask are added — the order of
    transformers' gemma2 ``eager_attention_forward`` (``attn_weights = tanh(attn_weights /
    softcap) · softcap``, then ``attn_weights + attention_mask``) and of flash-attn. Its
    derivative is ``1 − tanh²(s / softcap)``.

    Args:
        s: logits of any shape, float.
        softcap: the cap (> 0), or None.

    Returns:
        ``s`` capped, same shape and dtype.
    """
    if softcap is None:
        return s
    return torch.tanh(s / softcap) * softcap


def _logits(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    temperature: float,
    score: str,
    dtype: torch.dtype,
    reorder: bool = False,
    softcap: float | None = None,
) -> Tensor:
    """``softcap_logits(score(q, k) · scale / T)`` grouped: ``(B, H_kv, G, L, S)`` in ``dtype``."""
    s = get_score(score)
    H_kv = k.shape[1]
    qg = s.prepare(q.to(dtype)).unflatten(1, (H_kv, q.shape[1] // H_kv if H_kv else 0))
    kg = s.prepare(k.to(dtype)).unsqueeze(2)  # (B, H_kv, 1, S, D)
    # qg: (B, H_kv, G, L, D)
    if reorder:  # the same value with the scale folded into k first (a different rounding)
        logits = qg @ (kg * (scale / temperature)).transpose(-1, -2)  # (B, H_kv, G, L, S)
    else:
        logits = (qg @ kg.transpose(-1, -2)) * (scale / temperature)  # (B, H_kv, G, L, S)
    return softcap_logits(logits, softcap)


def _unnormalized_softmax(logits: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(e, z)`` with ``softmax = e / z``; masked e are exactly 0, all-masked rows have z = 1."""
    if logits.shape[-1] == 0:
        return logits, logits.new_ones(*logits.shape[:-1], 1)
    if keep is not None:
        logits = logits.masked_fill(~keep, _NEG_INF)
    m = logits.amax(dim=-1, keepdim=True).detach()  # NaN propagates through amax
    dead = m == _NEG_INF
    e = torch.exp(logits - torch.where(dead, 0.0, m))
    return e, torch.where(dead, 1.0, e.sum(dim=-1, keepdim=True))


def _masked_softmax(logits: Tensor, keep: Tensor | None) -> Tensor:
    """softmax over the last dim with masked entries at exactly 0 and all-masked rows at 0."""
    e, z = _unnormalized_softmax(logits, keep)
    return e / z


def _dropout(p: Tensor, dropout_p: float, generator: torch.Generator | None) -> Tensor:
    if dropout_p == 0.0:
        return p
    kept = torch.empty_like(p).bernoulli_(1.0 - dropout_p, generator=generator)
    return p * kept / (1.0 - dropout_p)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference attention: ``softmax(cap(score(q, k) · scale / temperature) + bias, masked) @ v``.

    With attention sinks (GPT-OSS) the softmax of row i in head h runs over the row's logits
    and one more, the sink ``s_h``, whose value is 0: ``out_i = Σ_j e^{l_ij} v_j / (e^{s_h} +
    Σ_j e^{l_ij})`` (transformers' gpt_oss eager: the sink column concatenated to the logits,
    softmax, the column dropped). A row with no key stays 0; a NaN/+inf sink makes the rows of
    its head that have a key NaN (gradients as for the sink read as 0); a −inf sink is none.

    ``cap(s) = softcap · tanh(s / softcap)`` (`softcap_logits`; the identity when ``softcap`` is
    None): soft-capping acts on the scaled scores, before the bias and the mask.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        mask: bool, True = may attend, broadcastable to ``(B, H, L, S)``.
        bias: additive float, broadcastable to ``(B, H, L, S)``; −inf entries are masked.
        scale: logit scale; None means the score's default (1/√D for "dot", 1 for "cosine").
        temperature: logits are divided by it.
        score: a name from ``functional.request.SCORES``.
        dropout_p: probability of zeroing a weight (kept weights are scaled by 1/(1−p)).
        generator: RNG for dropout.
        compute_dtype: precision of logits and softmax; default float32 or wider.
        reorder: fold the scale into k before the product and normalise after the weighted sum.
            Same definition, different rounding: the tolerance rule runs it in the input dtype to
            measure the naive formula's error.
        softcap: logit soft-capping (> 0), or None for none.
        sinks: ``(H,)`` sink logits (after the scale), or None for none.

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype. ``weights`` are those that
        multiplied v, i.e. after dropout (without the sink's share).
    """
    B, H, L, _ = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = compute_dtype or stat_dtype(q.dtype)
    if scale is None:
        scale = get_score(score).default_scale(q.shape[-1])
    keep = keep_mask(mask, bias)
    q_in, k_in, v_in = q, k, v
    q, k, v = nan_rule.clean(q), nan_rule.clean(k), nan_rule.clean(v)
    logits = _logits(
        q,
        k,
        scale=scale,
        temperature=temperature,
        score=score,
        dtype=dtype,
        reorder=reorder,
        softcap=softcap,
    )
    if bias is not None:
        logits = logits + group_heads(nan_rule.clean_bias(bias), H_kv).to(dtype)
    gkeep = None if keep is None else group_heads(keep, H_kv)
    if sinks is None:
        e, z = _unnormalized_softmax(logits, gkeep)
    else:
        e, z = _sink_softmax(logits, gkeep, sinks)
    vg = v.to(dtype).unsqueeze(2)  # (B, H_kv, 1, S, Dv)
    if reorder:  # normalise after the weighted sum: same value, different rounding
        p = _dropout(e, dropout_p, generator)
        out = (p @ vg) / z  # (B, H_kv, G, L, Dv)
        p = p / z
    else:
        p = _dropout(e / z, dropout_p, generator)
        out = p @ vg  # (B, H_kv, G, L, Dv)
    out = out.flatten(1, 2).to(q.dtype).reshape(B, H, L, Dv)  # (B, H, L, Dv)
    weights = p.flatten(1, 2).to(q.dtype).reshape(B, H, L, S)  # (B, H, L, S)
    out, weights = nan_rule.poison(out, q_in, k_in, v_in, keep=keep, bias=bias, weights=weights)
    if sinks is not None:  # a NaN/+inf sink poisons its head's rows that have a key
        has_key = rows_with_keys(keep, (B, H, L, S)).to(q.device)  # (B, H, L, 1)
        bad = (torch.isnan(sinks) | torch.isposinf(sinks)).view(1, H, 1, 1) & has_key
        out, weights = nan_rule.add_nan(out, bad), nan_rule.add_nan(weights, bad)
    return out, weights


def _sink_softmax(logits: Tensor, keep: Tensor | None, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """`_unnormalized_softmax` over the keys plus one sink column per head: ``(e, z)`` of the
    keys, ``z`` including ``e^{s_h}``. The sink column is kept only on rows with a key, so a
    row with no key stays 0; a NaN/+inf sink is read as 0 (the caller poisons its rows)."""
    B, H_kv, G, L, S = logits.shape
    s = sinks.to(logits.dtype)
    s = torch.where(torch.isnan(s) | torch.isposinf(s), 0.0, s)
    col = s.view(1, H_kv, G, 1, 1).expand(B, H_kv, G, L, 1)  # (B, H_kv, G, L, 1)
    full = torch.cat([logits, col], dim=-1)  # (B, H_kv, G, L, S + 1)
    if keep is None:
        keep = torch.ones(1, 1, 1, 1, 1, dtype=torch.bool, device=logits.device)
    keep = keep.expand(B, H_kv, G, L, S)
    has_key = keep.any(dim=-1, keepdim=True)  # (B, H_kv, G, L, 1)
    e, z = _unnormalized_softmax(full, torch.cat([keep, has_key], dim=-1))
    return e[..., :S], z


def rows_with_keys(keep: Tensor | None, shape: tuple[int, int, int, int]) -> Tensor:
    """``(B, H, L, 1)`` bool: which query rows may attend at least one key (``shape`` is
    ``(B, H, L, S)``, ``keep`` from `keep_mask`)."""
    B, H, L, S = shape
    if keep is None:
        return torch.full((1, 1, 1, 1), S > 0).expand(B, H, L, 1)
    return _as4(keep).expand(B, H, L, S).any(dim=-1, keepdim=True)


def logsumexp(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Reference log-sum-exp of the masked logits ``(B, H, L)``, float32+, −inf if empty.

    The logits are those of `attention` (soft-capped when ``softcap`` is given, then biased).
    With ``sinks (H,)``: ``log(e^{s_h} + Σ_j e^{l_ij})`` on rows with a key, ``s_h`` on rows
    without (NaN on a head whose sink is NaN/+inf, on rows with a key).
    """
    B, H, L, _ = q.shape
    H_kv = k.shape[1]
    dtype = stat_dtype(q.dtype)
    if scale is None:
        scale = get_score(score).default_scale(q.shape[-1])
    keep = keep_mask(mask, bias)
    row_bad, _ = nan_rule.bad_entries(q, k, k[..., :0], keep=keep, bias=bias)
    q, k = nan_rule.clean(q), nan_rule.clean(k)
    logits = _logits(
        q, k, scale=scale, temperature=temperature, score=score, dtype=dtype, softcap=softcap
    )
    if bias is not None:
        logits = logits + group_heads(nan_rule.clean_bias(bias), H_kv).to(dtype)
    if keep is not None:
        logits = logits.masked_fill(~group_heads(keep, H_kv), _NEG_INF)
    if logits.shape[-1] == 0:
        lse = logits.new_full((B, H, L), _NEG_INF)
    else:
        lse = torch.logsumexp(logits, dim=-1).flatten(1, 2).reshape(B, H, L)
        lse = torch.where(row_bad, float("nan"), lse)
    if sinks is None:
        return lse
    s = sinks.to(dtype).view(1, H, 1).expand(B, H, L)  # (B, H, L)
    has_key = rows_with_keys(keep, (B, H, L, k.shape[2]))[..., 0].to(q.device)  # (B, H, L)
    both = torch.logsumexp(torch.stack([lse, s]), dim=0)
    both = torch.where(torch.isposinf(s), float("nan"), both)  # NaN/+inf sink: NaN rows
    return torch.where(has_key, both, s)


def additive_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    w_q: Tensor,
    w_k: Tensor,
    b_k: Tensor | None,
    w_v: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference additive (Bahdanau) attention: ``e_ij = w_vᵀ tanh(W_q q_i + W_k k_j + b_k)``.

    Args:
        query: ``(B, L, Dq)``. key: ``(B, S, Dk)``. value: ``(B, S, Dv)``.
        w_q: ``(Hd, Dq)``. w_k: ``(Hd, Dk)``. b_k: ``(Hd,)`` or None. w_v: ``(Hd,)``.
        mask: bool (True = may attend), broadcastable to ``(B, L, S)``.
        bias: additive float, broadcastable to ``(B, L, S)``.

    Returns:
        ``(out (B, L, Dv), weights (B, L, S))``, masked and fully-masked rows as in `attention`.
    """
    dtype = stat_dtype(query.dtype)
    mask4 = None if mask is None else _as4(mask.unsqueeze(-3) if mask.dim() == 3 else mask)
    bias4 = None if bias is None else _as4(bias.unsqueeze(-3) if bias.dim() == 3 else bias)
    keep = keep_mask(mask4, bias4)  # (B|1, 1, L|1, S|1)
    # the NaN rule as in `attention`: compute on clean inputs, poison what the rule names
    key4, value4 = nan_rule.clean(key).unsqueeze(1), nan_rule.clean(value).unsqueeze(1)
    wq, wk, wv = w_q.to(dtype), w_k.to(dtype), w_v.to(dtype)
    pq = nan_rule.clean(query).to(dtype) @ wq.T  # (B, L, Hd)
    pk = key4.squeeze(1).to(dtype) @ wk.T  # (B, S, Hd)
    if b_k is not None:
        pk = pk + b_k.to(dtype)
    logits = torch.tanh(pq.unsqueeze(2) + pk.unsqueeze(1)) @ wv  # (B, L, S)
    if bias4 is not None:
        logits = logits + nan_rule.clean_bias(bias4.squeeze(1)).to(dtype)
    p = _masked_softmax(logits, None if keep is None else keep.squeeze(1))
    p = _dropout(p, dropout_p, generator)
    out = p @ value4.squeeze(1).to(dtype)  # (B, L, Dv)
    out4, p4 = nan_rule.poison(
        out.to(query.dtype).unsqueeze(1),
        query.unsqueeze(1),
        key.unsqueeze(1),
        value.unsqueeze(1),
        keep=keep,
        bias=bias4,
        weights=p.to(query.dtype).unsqueeze(1),
    )
    assert p4 is not None
    return out4.squeeze(1), p4.squeeze(1)


# ------------------------------------------------------------------------------------------------
# Efficient approximations (issue #6): linear attention, FAVOR+, FNet, hierarchical attention.
# Each is written here in its explicit quadratic form (an L × S matrix, a DFT matrix, explicit
# masks); the fast forms in functional/linear.py, performer.py, fnet.py, hierarchical.py equal them.
# ------------------------------------------------------------------------------------------------


def elu_feature_map(x: Tensor) -> Tensor:
    """``φ(x) = elu(x) + 1`` ("Transformers are RNNs"), positive everywhere."""
    return torch.nn.functional.elu(x) + 1.0


def relu_feature_map(x: Tensor) -> Tensor:
    """``φ(x) = relu(x)``, non-negative."""
    return torch.relu(x)


# name -> φ, applied to the last dim of q and k: (..., D) -> (..., F); here F = D.
LINEAR_FEATURE_MAPS = {"elu": elu_feature_map, "relu": relu_feature_map}


def causal_keep(L: int, S: int, device: torch.device | None = None) -> Tensor:
    """Bottom-right causal mask ``(L, S)``: query i sees keys ``j <= i + S − L``."""
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L)


def _kernel_keep(
    L: int, S: int, causal: bool, key_mask: Tensor | None, device: torch.device
) -> Tensor:
    """Which keys each query may attend: ``(L, S)`` or ``(B|1, 1, 1, L, S)``, True = attend."""
    keep = (
        causal_keep(L, S, device) if causal else torch.ones(L, S, dtype=torch.bool, device=device)
    )
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, None, :]  # (B|1, 1, 1, L, S)
    return keep


def nan_rule_poison(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """The NaN rule of kernel attention: NaN where it makes the output non-finite, −0.0 elsewhere.

    `nan_rule.bad_entries` on the kernel-attention mask: row i is poisoned if it may attend some
    key and q_i is non-finite, or if an attended k_j is non-finite; column d of row i if an
    attended ``v_j[d]`` is. Adding the result keeps every other value bit-exact.

    Args:
        q: ``(B, H, L, D|F)``. k: ``(B, H_kv, S, D|F)``. v: ``(B, H_kv, S, Dv)``.
        keep: bool ``(L, S)`` or ``(B|1, 1, 1, L, S)``, True = row i may attend key j.

    Returns:
        ``(B, H_kv, G, L, Dv)`` in v's dtype.
    """
    H_kv = k.shape[1]
    keep4 = keep if keep.dim() == 2 else keep.squeeze(2)  # (L, S) or (B|1, 1, L, S)
    _, bad = nan_rule.bad_entries(
        q, k, v, keep=keep4.reshape((1,) * (4 - keep4.dim()) + tuple(keep4.shape))
    )
    bad = bad.unflatten(1, (H_kv, q.shape[1] // H_kv if H_kv else 0))  # (B, H_kv, G, L, Dv)
    return torch.where(bad, float("nan"), -0.0).to(v.dtype)


def _kernel_product(fq: Tensor, fk: Tensor, v: Tensor, keep: Tensor, eps: float, reorder: bool):
    """``(A ⊙ keep) V / (rowsum(A ⊙ keep) + eps)`` grouped: ``(B, H_kv, G, L, Dv)``."""
    H, H_kv = fq.shape[1], fk.shape[1]
    fqg = fq.unflatten(1, (H_kv, H // H_kv if H_kv else 0))  # (B, H_kv, G, L, F)
    A = fqg @ fk.unsqueeze(2).transpose(-1, -2)  # (B, H_kv, G, L, S)
    A = torch.where(keep, A, 0.0)
    den = A.sum(dim=-1, keepdim=True) + eps  # (B, H_kv, G, L, 1)
    den = torch.where(den == 0, 1.0, den)
    vg = v.unsqueeze(2)  # (B, H_kv, 1, S, Dv)
    return (A @ vg) / den if reorder else (A / den) @ vg  # (B, H_kv, G, L, Dv)


def kernel_attention(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    eps: float = 0.0,
    reorder: bool = False,
) -> Tensor:
    """Explicit kernelised attention: ``out = (A ⊙ keep) V / (rowsum(A ⊙ keep) + eps)``, A = φQ φKᵀ.

    A zero denominator is replaced by 1, so a row with no key (S = 0, all keys padded, or all
    kernel values 0) outputs zeros. Runs in the dtype of its inputs. The NaN rule: a non-finite
    attended fk_j (or fq_i of a row with a key) makes row i NaN, a non-finite attended
    ``v_j[d]`` makes ``out_i[d]`` NaN, and nothing else reaches row i (`nan_rule_poison`).

    Args:
        fq: query features ``(B, H, L, F)``. fk: key features ``(B, H_kv, S, F)``.
        v: ``(B, H_kv, S, Dv)``.
        causal: keep only ``j <= i + S − L`` (bottom-right).
        key_mask: bool ``(B|1, S)``, True = a real key; padded keys get zero kernel weight.
        eps: added to every denominator.
        reorder: normalise after the product with V (same value, different rounding).

    Returns:
        ``(B, H, L, Dv)``.
    """
    B, H, L, _ = fq.shape
    S, Dv = fk.shape[2], v.shape[-1]
    keep = _kernel_keep(L, S, causal, key_mask, fq.device)
    out = _kernel_product(
        nan_rule.clean(fq), nan_rule.clean(fk), nan_rule.clean(v), keep, eps, reorder
    )
    out = out + nan_rule_poison(fq, fk, v, keep)  # (B, H_kv, G, L, Dv)
    return out.flatten(1, 2).reshape(B, H, L, Dv)  # (B, H, L, Dv)


def _zero_padded_keys(k: Tensor, v: Tensor, key_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Stores 0 at padded key positions (``where``), so NaN/inf there cannot reach anything."""
    if key_mask is None:
        return k, v
    live = key_mask[:, None, :, None]  # (B|1, 1, S, 1)
    return torch.where(live, k, 0.0), torch.where(live, v, 0.0)


def _kernel_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi,
    *,
    causal: bool,
    key_mask: Tensor | None,
    eps: float,
    reorder: bool,
) -> Tensor:
    """The kernel form on the cleaned inputs plus the NaN rule's poison of the raw inputs."""
    B, H, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    keep = _kernel_keep(L, S, causal, key_mask, q.device)
    kc, vc = _zero_padded_keys(nan_rule.clean(k), nan_rule.clean(v), key_mask)
    out = _kernel_product(phi(nan_rule.clean(q)), phi(kc), vc, keep, eps, reorder)
    out = out + nan_rule_poison(q, k, v, keep)  # (B, H_kv, G, L, Dv)
    return out.flatten(1, 2).reshape(B, H, L, Dv)  # (B, H, L, Dv)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map="elu",
    mask: Mask | None = None,
    eps: float = 1e-6,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> Tensor:
    """Reference linear attention: ``out_i = Σ_j φ(q_i)·φ(k_j) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)``.

    Explicit form with the ``(L, S)`` kernel matrix ``φ(Q) φ(K)ᵀ`` (Katharopoulos et al., 2020).
    The NaN rule: computed on the inputs with non-finite entries read as 0, plus NaN where
    `nan_rule_poison` says (a non-finite q_i of a row with a key or attended k_j: the row; an
    attended ``v_j[d]``: column d); padded and causally hidden keys never reach row i.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        feature_map: a name in `LINEAR_FEATURE_MAPS` or a callable ``(..., D) -> (..., F)``.
        mask: ``masks.causal()`` (query i sees keys ``j <= i + S − L``), ``masks.padding``,
            their ``&`` or None (`masks.patterns.causal_and_padding`): the sums run over the
            keys it keeps.
        eps: added to the denominator; a zero denominator is replaced by 1.
        compute_dtype: precision of the computation; default float32 or wider.
        reorder: normalise after the product with V.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.
    """
    dtype = compute_dtype or stat_dtype(q.dtype)
    phi = LINEAR_FEATURE_MAPS[feature_map] if isinstance(feature_map, str) else feature_map
    causal, key_mask = causal_and_padding(
        mask, where="reference.linear_attention", batch=q.shape[0], S=k.shape[-2], device=q.device
    )
    out = _kernel_reference(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        phi,
        causal=causal,
        key_mask=key_mask,
        eps=eps,
        reorder=reorder,
    )
    return out.to(q.dtype)


def favor_feature_map(x: Tensor, projection: Tensor) -> Tensor:
    """FAVOR+ positive random features ``φ(x) = exp(W x' − ‖x'‖²/2) / √M``, ``x' = x / D^¼``.

    With the rows of ``W (M, D)`` marginally N(0, I), ``E[φ(q)·φ(k)] = exp(q·k / √D)``: the
    softmax kernel (Choromanski et al., 2021, Lemma 1). No stabilisation: the definition.

    Args:
        x: ``(..., D)``. projection: W ``(M, D)``.

    Returns:
        ``(..., M)`` in x's dtype.
    """
    D, M = x.shape[-1], projection.shape[0]
    xs = x * (D**-0.25 if D else 1.0)  # (..., D)
    log_phi = xs @ projection.to(x.dtype).T - (xs * xs).sum(-1, keepdim=True) / 2  # (..., M)
    return torch.exp(log_phi) / M**0.5


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    mask: Mask | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> Tensor:
    """Reference FAVOR+: the explicit kernel matrix ``A = φ(Q) φ(K)ᵀ``, ``out = A V / rowsum(A)``.

    ``φ = favor_feature_map`` with the given projection; ``A`` estimates ``exp(Q Kᵀ / √D)``, so
    the output approximates softmax attention. A zero row sum gives a zero row. The NaN rule as
    in `linear_attention`: non-finite inputs read as 0, plus `nan_rule_poison`.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        projection: the random features W ``(M, D)``.
        mask: ``masks.causal()``, ``masks.padding``, their ``&`` or None, as in
            `linear_attention`.
        compute_dtype: precision; default float32 or wider. reorder: normalise after ``A V``.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.
    """
    dtype = compute_dtype or stat_dtype(q.dtype)
    w = projection.to(dtype)
    causal, key_mask = causal_and_padding(
        mask, where="reference.favor_attention", batch=q.shape[0], S=k.shape[-2], device=q.device
    )
    out = _kernel_reference(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        lambda x: favor_feature_map(x, w),
        causal=causal,
        key_mask=key_mask,
        eps=0.0,
        reorder=reorder,
    )
    return out.to(q.dtype)


def dft_matrices(
    n: int, dtype: torch.dtype, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of the n-point DFT angles ``2π·(j·k mod n)/n``, each ``(n, n)``."""
    j = torch.arange(n, device=device)
    angle = (j[:, None] * j[None, :] % max(n, 1)).to(torch.float64) * (2 * torch.pi / max(n, 1))
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def fnet_mixing(
    x: Tensor, *, compute_dtype: torch.dtype | None = None, reorder: bool = False
) -> Tensor:
    """Reference FNet token mixing: ``Re(F_L X F_E)`` with explicit DFT matrices.

    ``F_n = C_n − i S_n`` (``C, S`` = cos, sin of ``2π jk / n``), so for real X
    ``Re(F_L X F_E) = C_L X C_E − S_L X S_E`` (Lee-Thorp et al., 2022).

    Args:
        x: ``(..., L, E)`` real.
        compute_dtype: precision; default float32 or wider.
        reorder: multiply right-to-left (same value, different rounding).

    Returns:
        ``(..., L, E)`` in x's dtype.
    """
    dtype = compute_dtype or stat_dtype(x.dtype)
    L, E = x.shape[-2], x.shape[-1]
    cl, sl = dft_matrices(L, dtype, x.device)
    ce, se = dft_matrices(E, dtype, x.device)
    xd = x.to(dtype)
    # reorder multiplies right-to-left: the same value with a different rounding
    out = cl @ (xd @ ce) - sl @ (xd @ se) if reorder else (cl @ xd) @ ce - (sl @ xd) @ se
    return out.to(x.dtype)  # (..., L, E)


def hierarchical_parts(
    k: Tensor, v: Tensor, block_size: int, *, causal: bool, key_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The explicit key set of hierarchical attention for self-attention of length L.

    Keys are the L tokens followed by the N = ⌈L/b⌉ block summaries (block means of the real keys
    and values). Query i (block I = i // b) may attend to token j iff ``j // b == I``, j is real
    (``key_mask``) and ``j <= i`` if causal, and to summary J iff ``J != I`` (``J < I`` if causal)
    and block J holds a real key. A summary's logit gets ``+ log n_J`` (n_J real tokens in block
    J): it stands for the n_J tokens it averages.

    Args:
        k: ``(B, H_kv, L, D)``. v: ``(B, H_kv, L, Dv)``. block_size: b.
        causal: causal at both levels. key_mask: bool ``(B|1, L)``, True = a real key, or None.

    Returns:
        ``(k_all (B, H_kv, L + N, D), v_all (B, H_kv, L + N, Dv), keep (B|1, 1, L, L + N) bool,
        bias (B|1, 1, 1, L + N))``.
    """
    L, b = k.shape[2], block_size
    N = -(-L // b)
    pos = torch.arange(L, device=k.device)
    blk = pos // b  # (L,)
    live = (
        torch.ones(1, L, dtype=torch.bool, device=k.device) if key_mask is None else key_mask
    )  # (B|1, L)
    if key_mask is not None:  # padded keys hold 0 (`where`): nothing there reaches a summary
        k = torch.where(live[:, None, :, None], k, 0.0)
        v = torch.where(live[:, None, :, None], v, 0.0)
    member = (blk[None, :] == torch.arange(N, device=k.device)[:, None]) & live[:, None, :]
    member = member.to(k.dtype)  # (B|1, N, L)
    counts = member.sum(-1)  # (B|1, N)
    pool = (member / counts.clamp(min=1)[..., None])[:, None]  # (B|1, 1, N, L): J's mean
    k_all = torch.cat([k, pool @ k], dim=2)  # (B, H_kv, L + N, D)
    v_all = torch.cat([v, pool @ v], dim=2)  # (B, H_kv, L + N, Dv)
    fine = (blk[:, None] == blk[None, :]) & live[:, None, :]  # (B|1, L, L)
    coarse = blk[:, None] != torch.arange(N, device=k.device)[None, :]  # (L, N)
    if causal:
        fine = fine & (pos[None, :] <= pos[:, None])
        coarse = torch.arange(N, device=k.device)[None, :] < blk[:, None]
    coarse = coarse & (counts > 0)[:, None, :]  # (B|1, L, N)
    keep = torch.cat([fine, coarse], dim=-1)[:, None]  # (B|1, 1, L, L + N)
    zeros = torch.zeros(counts.shape[0], L, dtype=k.dtype, device=k.device)
    bias = torch.cat([zeros, counts.log()], dim=-1)[:, None, None]  # (B|1, 1, 1, L + N)
    return k_all, v_all, keep, bias


def hierarchical_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    mask: Mask | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> Tensor:
    """Reference two-level hierarchical attention, by explicit masks over tokens and summaries.

    ``out_i = softmax_j∈fine(i) ∪ coarse(i)(s·q_i·k_j + [j is a summary]·log n_J) v_j`` with the
    key set of `hierarchical_parts`: exact attention inside the query's block of b tokens, block
    means of keys and values for every other block (earlier blocks only if causal). Equivalently:
    full softmax attention over the real keys in which every key and value outside the query's
    block is replaced by its block mean.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, L, D)``. v: ``(B, H_kv, L, Dv)`` (self-attention).
        block_size: b ≥ 1.
        mask: ``masks.causal()`` (tokens ``j <= i`` in the own block, earlier blocks only),
            ``masks.padding(lengths)`` (keys ``j >= lengths[b]`` dropped at both levels), their
            ``&`` or None.
        scale: logit scale, default 1/√D.
        compute_dtype: precision; default float32 or wider. reorder: normalise after ``P V``.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.
    """
    dtype = compute_dtype or stat_dtype(q.dtype)
    causal, key_mask = causal_and_padding(
        mask,
        where="reference.hierarchical_attention",
        batch=q.shape[0],
        S=k.shape[-2],
        device=q.device,
    )
    k_all, v_all, keep, bias = hierarchical_parts(
        k.to(dtype), v.to(dtype), block_size, causal=causal, key_mask=key_mask
    )
    out, _ = attention(
        q.to(dtype),
        k_all,
        v_all,
        mask=keep,
        bias=bias,
        scale=scale,
        compute_dtype=dtype,
        reorder=reorder,
    )
    return out.to(q.dtype)


def shaw_relative_index(L: int, S: int, max_distance: int, device=None) -> Tensor:
    """Shaw et al.'s table row of each pair: ``clip(j − i, −k, k) + k``, ``(L, S)`` int64.

    Query row r sits at key position ``i = r + S − L`` (bottom-right alignment), key j at j.
    """
    i = torch.arange(L, device=device).view(L, 1) + (S - L)  # (L, 1) aligned query positions
    j = torch.arange(S, device=device).view(1, S)  # (1, S)
    return (j - i).clamp(-max_distance, max_distance) + max_distance  # (L, S)


def shaw_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor,
    rel_v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> tuple[Tensor, Tensor]:
    """Reference Shaw et al. (2018) relative attention, written out with ``(L, S, D)`` tables.

    With ``r_ij = clip(j − i, −K, K)`` (query i aligned bottom-right) and learned tables
    ``a^K``, ``a^V`` of 2K + 1 rows::

        e_ij = q_i · (k_j + a^K[r_ij]) · scale + bias_ij,   α = softmax_j(e, masked)
        o_i  = Σ_j α_ij (v_j + a^V[r_ij])

    This function materialises ``a^K[r]`` ``(H|1, L, S, D)`` and ``a^V[r]`` ``(H|1, L, S, Dv)``:
    the definition, not a fast path (`attnlab.positional.shaw_attention` is). Masks, fully
    masked rows and the NaN rule are as in `attention`, where a table row counts as part of the
    key (``a^K``) or value (``a^V``) of every pair that reads it.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        rel_k: ``(2K+1, D)`` shared by the heads, or ``(H, 2K+1, D)`` per head.
        rel_v: ``(2K+1, Dv)`` or ``(H, 2K+1, Dv)``.
        mask: bool, True = may attend, broadcastable to ``(B, H, L, S)``.
        bias: additive float, broadcastable to ``(B, H, L, S)``; −inf entries are masked.
        scale: logit scale, default ``1/√D``.
        compute_dtype: precision of logits and softmax; default float32 or wider.
        reorder: fold the scale into k and a^K and normalise after the weighted sum (same
            value, different rounding: the tolerance rule's naive run).

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype.
    """
    H, L, D = q.shape[1:]
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv if H_kv else 0
    K = (rel_k.shape[-2] - 1) // 2
    dtype = compute_dtype or stat_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    keep = keep_mask(mask, bias)
    keep4 = torch.ones(1, 1, L, S, dtype=torch.bool, device=q.device) if keep is None else keep
    idx = shaw_relative_index(L, S, K, q.device)  # (L, S)
    rk = nan_rule.clean(rel_k).to(dtype)
    rv = nan_rule.clean(rel_v).to(dtype)
    ak = (rk if rk.dim() == 3 else rk.unsqueeze(0))[:, idx]  # (H|1, L, S, D)
    av = (rv if rv.dim() == 3 else rv.unsqueeze(0))[:, idx]  # (H|1, L, S, Dv)
    qc = nan_rule.clean(q).to(dtype)
    kc = nan_rule.clean(k).to(dtype).repeat_interleave(G, dim=1)  # (B, H, S, D)
    vc = nan_rule.clean(v).to(dtype).repeat_interleave(G, dim=1)  # (B, H, S, Dv)
    if reorder:
        logits = qc @ (kc * scale).transpose(-1, -2) + torch.einsum(
            "bhld,hlsd->bhls", qc, ak * scale
        )
    else:
        logits = (qc @ kc.transpose(-1, -2) + torch.einsum("bhld,hlsd->bhls", qc, ak)) * scale
    if bias is not None:
        logits = logits + _as4(nan_rule.clean_bias(bias)).to(dtype)
    e, z = _unnormalized_softmax(logits, keep)  # (B, H, L, S), (B, H, L, 1)
    if reorder:
        out = (e @ vc + torch.einsum("bhls,hlsd->bhld", e, av)) / z  # (B, H, L, Dv)
        p = e / z
    else:
        p = e / z  # (B, H, L, S)
        out = p @ vc + torch.einsum("bhls,hlsd->bhld", p, av)  # (B, H, L, Dv)
    out, weights = out.to(q.dtype), p.to(q.dtype)
    out, weights = nan_rule.poison(out, q, k, v, keep=keep, bias=bias, weights=weights)
    # the tables: a non-finite a^K row read by an attended pair poisons the row, a^V[d] column d
    flags_k = nan_rule.row_flags(rel_k if rel_k.dim() == 3 else rel_k.unsqueeze(0))[:, idx] > 0
    flags_v = nan_rule.flags(rel_v if rel_v.dim() == 3 else rel_v.unsqueeze(0))[:, idx] > 0
    row_bad = (flags_k & keep4).any(dim=-1)  # (B|1, H|1, L)
    col_bad = (flags_v & keep4.unsqueeze(-1)).any(dim=-2)  # (B|1, H|1, L, Dv)
    out = nan_rule.add_nan(out, row_bad.unsqueeze(-1) | col_bad)
    weights = torch.where(row_bad.unsqueeze(-1) & keep4, float("nan"), weights)
    return out, weights


# ------------------------------------------------------------------------------------------------
# Adaptive attention span (Sukhbaatar et al., 2019, "Adaptive Attention Span in Transformers").
# The fast form (modules/adaptive_span.py) writes the ramp as an additive log-mask bias and lets
# the tiled backend skip every tile beyond the largest span; it equals this multiplicative form.
# ------------------------------------------------------------------------------------------------


def span_ramp(x: Tensor, z: Tensor, ramp: float) -> Tensor:
    """The soft span mask ``m_z(x) = clamp((R + z − x) / R, 0, 1)`` of a distance x ≥ 0.

    1 for ``x <= z``, a linear ramp down to 0 over ``z < x < z + R``, 0 from ``x = z + R`` on. The
    derivative in z is ``1/R`` on the ramp (``0 < m < 1``, and at ``x = z`` where m reaches 1) and
    0 where m = 0 (the one-sided derivative at ``x = z + R``: the pair is not attended, so its
    gradient is the one of the masked form).

    Args:
        x: distances ``i − j`` (any float or int tensor, broadcastable with z).
        z: spans (float tensor).
        ramp: R > 0, the ramp width.

    Returns:
        ``m`` of the broadcast shape, in z's dtype.
    """
    raw = (ramp + z - x) / ramp
    return torch.where(raw > 0, raw.clamp(max=1.0), 0.0)


def adaptive_span_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    *,
    ramp: float,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> tuple[Tensor, Tensor]:
    """Reference adaptive-span attention: ``a_ij = m(x_ij) e^{s_ij} / Σ_k m(x_ik) e^{s_ik}``.

    Sukhbaatar et al. (2019): head h attends key j from query i with the weight of softmax
    attention multiplied by the soft mask ``m = span_ramp(x, z_h, R)`` of the distance
    ``x_ij = i' − j`` (``i' = i + S − L``, bottom-right causal: only ``x >= 0``) and renormalised.
    Written here multiplicatively, as in the paper; equals `attention` with the additive bias
    ``log m`` (−inf where m = 0). Pairs with m = 0 are not attended (the NaN rule treats them as
    masked); a row with no such pair (``i' < 0``) outputs zeros.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``; ``H % H_kv == 0``.
        z: ``(H,)`` the per-head spans (≥ 0 in the model; any real value is accepted here).
        ramp: R > 0, the ramp width.
        scale: logit scale, default ``1/√D``.
        compute_dtype: precision; default float32 or wider.
        reorder: normalise after the weighted sum (same value, different rounding).

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype.
    """
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = compute_dtype or stat_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    pos_q = torch.arange(L, device=q.device) + (S - L)
    x = (pos_q[:, None] - torch.arange(S, device=q.device)[None, :]).to(dtype)  # (L, S)
    m = span_ramp(x, z.to(dtype)[:, None, None], ramp)  # (H, L, S)
    m = torch.where(x >= 0, m, 0.0)
    keep = (m > 0).unsqueeze(0)  # (1, H, L, S)
    qc, kc, vc = nan_rule.clean(q), nan_rule.clean(k), nan_rule.clean(v)
    logits = _logits(qc, kc, scale=scale, temperature=1.0, score="dot", dtype=dtype)
    mg = group_heads(m.unsqueeze(0), H_kv)  # (1, H_kv, G, L, S)
    keepg = group_heads(keep, H_kv)
    logits = logits.masked_fill(~keepg, _NEG_INF)
    top = logits.amax(dim=-1, keepdim=True).detach()
    dead = top == _NEG_INF
    w = mg * torch.exp(logits - torch.where(dead, 0.0, top))  # m · e^{s − max}
    den = torch.where(dead, 1.0, w.sum(dim=-1, keepdim=True))
    vg = vc.to(dtype).unsqueeze(2)  # (B, H_kv, 1, S, Dv)
    if reorder:
        out = (w @ vg) / den  # (B, H_kv, G, L, Dv)
        p = w / den
    else:
        p = w / den
        out = p @ vg  # (B, H_kv, G, L, Dv)
    out = out.flatten(1, 2).to(q.dtype).reshape(B, H, L, Dv)  # (B, H, L, Dv)
    weights = p.flatten(1, 2).to(q.dtype).reshape(B, H, L, S)  # (B, H, L, S)
    out, weights = nan_rule.poison(out, q, k, v, keep=keep, weights=weights)
    assert weights is not None
    return out, weights


# ------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2", §2.1). Keys and values are
# up-projected from one latent per token; the decoupled rotary key is shared by every head. The
# fast form (modules/mla.py, `absorbed_latent_attention`) folds the up-projections into the query
# and the output and attends over the latent itself; it equals this naive form.
# ------------------------------------------------------------------------------------------------


def latent_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    k_rope: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    mask: Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> Tensor:
    """Reference multi-head latent attention (MLA), the naive form: keys and values expanded.

    For head h, with the latent ``c_j`` and the (already rotated) shared rotary key ``r_j`` of
    token j::

        k_hj = [W_UK[h] · c_j ; r_j]          (Dn + R)
        v_hj = W_UV[h] · c_j                  (Dv)
        o_hi = Σ_j softmax_j(scale · ⟨[q_nope_hi ; q_rope_hi], k_hj⟩) · v_hj

    i.e. `attention` on the expanded per-head keys and values.

    Args:
        q_nope: ``(B, H, L, Dn)`` the query part without position.
        q_rope: ``(B, H, L, R)`` the rotated query part.
        latent: ``(B, S, C)`` the compressed key/value latent (C = kv_lora_rank).
        k_rope: ``(B, S, R)`` the rotated key part shared by all heads.
        w_uk: ``(H, Dn, C)`` the key up-projection. w_uv: ``(H, Dv, C)`` the value up-projection.
        mask: bool, True = may attend, broadcastable to ``(B, H, L, S)``.
        scale: logit scale, default ``1/√(Dn + R)``.
        compute_dtype: precision of logits and softmax (see `attention`).
        reorder: normalise after the weighted sum (same value, different rounding).

    Returns:
        ``(B, H, L, Dv)`` in q_nope's dtype.
    """
    B, H = q_nope.shape[:2]
    k_nope = torch.einsum("bsc,hdc->bhsd", latent, w_uk)  # (B, H, S, Dn)
    v = torch.einsum("bsc,hdc->bhsd", latent, w_uv)  # (B, H, S, Dv)
    r = k_rope.unsqueeze(1).expand(B, H, -1, -1)  # (B, H, S, R)
    q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, L, Dn + R)
    k = torch.cat((k_nope, r), dim=-1)  # (B, H, S, Dn + R)
    out, _ = attention(
        q, k, v, mask=mask, scale=scale, compute_dtype=compute_dtype, reorder=reorder
    )
    return out


# ----------------------------------------------------------------------------- issue #42 variants


def _as_keep(mask: Tensor | Mask | None, q: Tensor, k: Tensor) -> Tensor | None:
    """A `Mask` rendered as a bool tensor ``(B|1, H|1, L, S)``; a tensor or None unchanged."""
    if isinstance(mask, Mask):
        B, H, L = q.shape[0], q.shape[1], q.shape[2]
        return mask.to_dense(L, k.shape[2], batch=B, heads=H, device=q.device)
    return mask


def sigmoid_bias(S: int) -> float:
    """The default sigmoid-attention logit bias ``b = −log S`` (0 for ``S <= 1``).

    With it, ``sigmoid(s − log S) ≈ e^s / S`` for small scores: a row of S equal weights starts
    near the softmax's ``1/S`` (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for
    Sigmoid Self-Attention").
    """
    return -math.log(S) if S > 1 else 0.0


def sigmoid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    scale: float | None = None,
    bias: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference sigmoid attention: ``out = (sigmoid(q·kᵀ·scale + b) ⊙ keep) @ v``.

    Every weight ``p_ij = sigmoid(q_i·k_j·scale + b)`` stands alone (no row max, no normaliser);
    masked pairs weigh exactly 0, so a row that may attend nothing outputs zeros. The NaN rule is
    `attention`'s: non-finite ``q_i`` or attended ``k_j`` makes row i NaN, a non-finite attended
    ``v_j[d]`` makes ``o_i[d]`` NaN, nothing else reaches row i.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``; ``H % H_kv == 0``.
        mask: bool (True = may attend) broadcastable to ``(B, H, L, S)``, a `Mask`, or None.
        scale: logit scale; None means ``1/√D``.
        bias: the scalar logit bias b; None means ``sigmoid_bias(S) = −log S``.
        compute_dtype: precision of the logits and weights; default float32 or wider.

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype.
    """
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = compute_dtype or stat_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    b = sigmoid_bias(S) if bias is None else bias
    keep = keep_mask(_as_keep(mask, q, k), None)
    q_in, k_in, v_in = q, k, v
    q, k, v = nan_rule.clean(q), nan_rule.clean(k), nan_rule.clean(v)
    logits = _logits(q, k, scale=scale, temperature=1.0, score="dot", dtype=dtype)
    p = torch.sigmoid(logits + b)  # (B, H_kv, G, L, S)
    if keep is not None:
        p = p.masked_fill(~group_heads(keep, H_kv), 0.0)
    out = p @ v.to(dtype).unsqueeze(2)  # (B, H_kv, G, L, Dv)
    out = out.flatten(1, 2).to(q.dtype).reshape(B, H, L, Dv)  # (B, H, L, Dv)
    weights = p.flatten(1, 2).to(q.dtype).reshape(B, H, L, S)  # (B, H, L, S)
    return nan_rule.poison(out, q_in, k_in, v_in, keep=keep, weights=weights)  # type: ignore[return-value]


def differential_lambda_init(layer: int) -> float:
    """``λ_init = 0.8 − 0.6·exp(−0.3·(l − 1))`` for the 1-based layer number ``l``.

    (transformers' ``lambda_init_fn(layer_idx)`` with ``layer_idx = l − 1``.)
    """
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


def differential_lambda(
    lambda_q1: Tensor, lambda_k1: Tensor, lambda_q2: Tensor, lambda_k2: Tensor, lambda_init: float
) -> Tensor:
    """The re-parameterised λ of differential attention, a 0-d tensor:
    ``λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init`` (vectors of size D, dot products in float32
    or wider)."""
    dtype = stat_dtype(lambda_q1.dtype)
    dot1 = (lambda_q1.to(dtype) * lambda_k1.to(dtype)).sum(-1)
    dot2 = (lambda_q2.to(dtype) * lambda_k2.to(dtype)).sum(-1)
    return torch.exp(dot1) - torch.exp(dot2) + lambda_init


def differential_attention(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor | float,
    *,
    mask: Tensor | Mask | None = None,
    scale: float | None = None,
    lambda_init: float | None = None,
    eps: float = 1e-6,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Reference differential attention (Ye et al. 2024, "Differential Transformer").

    ``o = softmax(q1·k1ᵀ·scale) v − λ · softmax(q2·k2ᵀ·scale) v``, both maps masked alike; with
    ``lambda_init`` the per-head normalisation follows:
    ``o ← (1 − λ_init) · o / √(mean_d(o²) + eps)`` (an RMSNorm over each head's Dv, no weight).

    Args:
        q1, q2: ``(B, H, L, D)``. k1, k2: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        lam: λ, a number or a tensor broadcastable to ``(B, H, L, Dv)`` (e.g. 0-d).
        mask: bool (True = may attend) broadcastable to ``(B, H, L, S)``, a `Mask`, or None.
        scale: logit scale; None means ``1/√D``.
        lambda_init: apply the head norm scaled by ``1 − λ_init``; None: no norm.
        eps: the RMSNorm epsilon.
        compute_dtype: precision of the computation; default float32 or wider.

    Returns:
        ``(B, H, L, Dv)`` in q1's dtype.
    """
    dtype = compute_dtype or stat_dtype(q1.dtype)
    m = _as_keep(mask, q1, k1)
    o1, _ = attention(q1, k1, v, mask=m, scale=scale, compute_dtype=dtype)
    o2, _ = attention(q2, k2, v, mask=m, scale=scale, compute_dtype=dtype)
    lam_t = lam.to(dtype) if isinstance(lam, Tensor) else lam
    o = o1.to(dtype) - lam_t * o2.to(dtype)  # (B, H, L, Dv)
    if lambda_init is not None:
        o = (1.0 - lambda_init) * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps))
    return o.to(q1.dtype)


def gated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Reference gated attention (Qwen3-Next's full-attention layers, Qiu et al. 2025).

    ``o = softmax(q·kᵀ·scale, masked) v ⊙ sigmoid(gate)``: an output gate computed from the layer
    input, one value per head and output channel.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        gate: gate logits broadcastable to ``(B, H, L, Dv)`` (``(B, H, L, 1)``: one per head).
        mask: bool (True = may attend) broadcastable to ``(B, H, L, S)``, a `Mask`, or None.
        scale: logit scale; None means ``1/√D``.
        compute_dtype: precision of the computation; default float32 or wider.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.
    """
    dtype = compute_dtype or stat_dtype(q.dtype)
    o, _ = attention(q, k, v, mask=_as_keep(mask, q, k), scale=scale, compute_dtype=dtype)
    return (o.to(dtype) * torch.sigmoid(gate.to(dtype))).to(q.dtype)


def local_window_keep(L: int, S: int, window: int, *, causal: bool, device=None) -> Tensor:
    """The local heads' band ``(L, S)``: ``0 <= p − j < W`` (causal) or ``|p − j| < W``, with the
    query's position ``p = i + S − L`` (bottom-right aligned)."""
    p = torch.arange(L, device=device)[:, None] + (S - L)  # (L, 1)
    d = p - torch.arange(S, device=device)[None, :]  # (L, S): p − j
    return (d >= 0) & (d < window) if causal else d.abs() < window


def local_global_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    local_heads: int,
    window: int,
    mask: Tensor | Mask | None = None,
    causal_window: bool = True,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> Tensor:
    """Reference Concat(local, global) attention: one softmax per head over a per-head key set.

    ``HierarchicalAttention(Q, K, V) = Concat(LocalAttention(Q, K, V), GlobalAttention(Q, K, V))``
    (seed 003 §4.3) over heads: query head h < H_l keeps the keys of `local_window_keep` (W
    keys) and of the caller's mask M, head h >= H_l keeps M alone::

        o_h = softmax(s · q_h k_g(h)ᵀ, masked by [h < H_l] · band ∧ M) v_g(h),  out = concat_h o_h

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        local_heads: H_l (a multiple of ``H / H_kv``). window: W.
        mask: M, bool (True = may attend) broadcastable to ``(B, H, L, S)``, a `Mask`, or None.
        causal_window: the band is ``0 <= p − j < W`` (True) or ``|p − j| < W`` (False).
        scale: logit scale; None means ``1/√D``.
        compute_dtype: precision; default float32 or wider. reorder: normalise after ``P V``.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.
    """
    H, L, S = q.shape[1], q.shape[2], k.shape[2]
    band = local_window_keep(L, S, window, causal=causal_window, device=q.device)  # (L, S)
    local = (torch.arange(H, device=q.device) < local_heads)[:, None, None]  # (H, 1, 1)
    keep = (band | ~local)[None]  # (1, H, L, S): the band on local heads only
    user = _as_keep(mask, q, k)
    if user is not None:
        keep = keep & _as4(user)
    dtype = compute_dtype or stat_dtype(q.dtype)
    out, _ = attention(q, k, v, mask=keep, scale=scale, compute_dtype=dtype, reorder=reorder)
    return out


def topk_keep(logits: Tensor, keep: Tensor | None, k_top: int) -> Tensor:
    """Which allowed logits are among the ``k_top`` largest of their row: bool, ``logits``' shape.

    Ranks each row's allowed logits from the largest down; equal logits rank by key index, the
    lowest first (a stable sort). Kept: allowed and rank ``< k_top`` — so a row with at most
    ``k_top`` allowed keys keeps them all, and a row with none keeps none.

    Args:
        logits: ``(..., L, S)`` float (finite where allowed).
        keep: bool broadcastable to ``logits`` (True = allowed), or None (all allowed).
        k_top: how many keys a row keeps (>= 1).
    """
    allowed = torch.ones_like(logits, dtype=torch.bool) if keep is None else keep.expand_as(logits)
    ranked = logits.masked_fill(~allowed, _NEG_INF)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # (..., L, S)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)  # the rank of each key in its row
    return allowed & (rank < k_top)


def topk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    k_top: int,
    mask: Tensor | Mask | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> tuple[Tensor, Tensor]:
    """Reference exact top-k attention: each row attends its ``k_top`` largest allowed logits.

    With ``l_ij = q_i·k_j·scale`` and ``A_i`` the keys row i may attend (the mask),
    ``T_i = topk(l_i, A_i, k_top)`` (`topk_keep`: ties broken by the lowest key index) and
    ``out_i = Σ_{j ∈ T_i} e^{l_ij} v_j / Σ_{j ∈ T_i} e^{l_ij}`` — softmax restricted to the kept
    logits. ``k_top >= |A_i|`` is ordinary attention; a row with no key outputs zeros. The
    selection is ranked on logits in float32 or wider whatever ``compute_dtype``; the gradient
    flows through the kept logits only (the selection is piecewise constant). The NaN rule is
    `attention`'s with "may attend" = the mask (a non-finite ``k_j`` in ``A_i`` makes row i NaN
    whether or not j is kept: its logit cannot be ranked).

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``; ``H % H_kv == 0``.
        k_top: keys kept per row (>= 1).
        mask: bool (True = may attend) broadcastable to ``(B, H, L, S)``, a `Mask`, or None.
        scale: logit scale; None means ``1/√D``.
        compute_dtype: precision of the logits and softmax; default float32 or wider.
        reorder: fold the scale into k first and normalise after the weighted sum (the same
            definition, another rounding).

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype; weights are 0 off ``T_i``.
    """
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = compute_dtype or stat_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    keep = keep_mask(_as_keep(mask, q, k), None)
    q_in, k_in, v_in = q, k, v
    q, k, v = nan_rule.clean(q), nan_rule.clean(k), nan_rule.clean(v)
    gkeep = None if keep is None else group_heads(keep, H_kv)
    rank_dtype = torch.promote_types(dtype, torch.float32)
    rank_logits = _logits(q, k, scale=scale, temperature=1.0, score="dot", dtype=rank_dtype)
    kept = topk_keep(rank_logits, gkeep, k_top)  # (B, H_kv, G, L, S)
    logits = _logits(q, k, scale=scale, temperature=1.0, score="dot", dtype=dtype, reorder=reorder)
    e, z = _unnormalized_softmax(logits, kept)
    vg = v.to(dtype).unsqueeze(2)  # (B, H_kv, 1, S, Dv)
    out = (e @ vg) / z if reorder else (e / z) @ vg  # (B, H_kv, G, L, Dv)
    out = out.flatten(1, 2).to(q.dtype).reshape(B, H, L, Dv)  # (B, H, L, Dv)
    weights = (e / z).flatten(1, 2).to(q.dtype).reshape(B, H, L, S)  # (B, H, L, S)
    return nan_rule.poison(out, q_in, k_in, v_in, keep=keep, weights=weights)  # type: ignore[return-value]


def routing_cells(L: int, S: int, query_block: int) -> tuple[Tensor, int]:
    """``(cell (L,), n_cells)``: the query cell of each row, ``⌊p / query_block⌋ − first``.

    ``p = i + S − L`` is the aligned position (bottom-right), ``first = ⌊(S − L) / query_block⌋``.
    """
    p = torch.arange(L) + (S - L)
    first = (S - L) // query_block
    cell = torch.div(p, query_block, rounding_mode="floor") - first
    return cell, (S - 1) // query_block - first + 1


def _block_means(x: Tensor, offset: int, size: int, n: int) -> Tensor:
    """Means of ``x (B, H, T, D)`` over runs of ``size`` rows along dim 2, the first run starting
    ``offset`` rows before row 0 (runs cut by the ends are averaged over the rows they hold):
    ``(B, H, n, D)``."""
    T = x.shape[2]
    pad = (0, 0, offset, n * size - offset - T)
    sums = torch.nn.functional.pad(x, pad).unflatten(2, (n, size)).sum(3)  # (B, H, n, D)
    ones = torch.nn.functional.pad(x.new_ones(T), pad[2:]).view(n, size).sum(1)  # (n,)
    return sums / ones.view(-1, 1)


def routing_select(
    q: Tensor,
    k: Tensor,
    *,
    block: int,
    k_blocks: int,
    causal: bool = True,
    query_block: int | None = None,
) -> Tensor:
    """Which key blocks each query cell attends (MoBA / NSA block selection): bool table.

    The keys are cut into blocks of ``block`` (the last may be shorter), the query rows into
    cells of ``query_block`` aligned positions (`routing_cells`; ``query_block`` divides
    ``block``, so a cell lies in one block: its *own* block ``⌊p / block⌋``). Cell c scores key
    block J by ``s_cJ = q̄_c · k̄_J``, the mean query of the cell against the block's mean key
    (clean inputs: NaN/inf read as 0). The own block is always kept (when it holds keys); the
    other ``k_blocks − 1`` are the highest-scoring candidates — with ``causal`` the blocks wholly
    before the own block, else every other block — ties broken by the lowest block index.
    Nothing is differentiated: the selection is a constant of the attention that follows.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``; ``H % H_kv == 0``, ``L, S >= 1``.
        block: keys per block (>= 1). k_blocks: blocks kept per cell (>= 1).
        causal: rank only past blocks.
        query_block: rows per cell (divides ``block``); None means ``block``.

    Returns:
        bool ``(B, H, n_cells, ceil(S / block))``.
    """
    qb = block if query_block is None else query_block
    H, L = q.shape[1], q.shape[2]
    H_kv, S = k.shape[1], k.shape[2]
    dtype = stat_dtype(q.dtype)
    q, k = nan_rule.clean(q.detach()).to(dtype), nan_rule.clean(k.detach()).to(dtype)
    first = (S - L) // qb
    n_cells = (S - 1) // qb - first + 1
    q_bar = _block_means(q, (S - L) - first * qb, qb, n_cells)  # (B, H, n_cells, D)
    n_k = -(-S // block)
    k_bar = _block_means(k, 0, block, n_k)  # (B, H_kv, n_k, D)
    qg = q_bar.unflatten(1, (H_kv, H // H_kv))  # (B, H_kv, G, n_cells, D)
    score = (qg @ k_bar.unsqueeze(2).transpose(-1, -2)).flatten(1, 2)  # (B, H, n_cells, n_k)
    own = ((torch.arange(n_cells, device=q.device) + first) * qb).div(block, rounding_mode="floor")
    j = torch.arange(n_k, device=q.device)
    forced = j.view(1, -1) == own.view(-1, 1)  # (n_cells, n_k)
    cand = j.view(1, -1) < own.view(-1, 1) if causal else ~forced
    ranked = torch.where(forced, float("inf"), torch.where(cand, score, _NEG_INF))
    return topk_keep(ranked, forced | cand, k_blocks)


def routing_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block: int,
    k_blocks: int,
    causal: bool = True,
    query_block: int | None = None,
    mask: Tensor | Mask | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> tuple[Tensor, Tensor]:
    """Reference block-routed attention (MoBA, Lu et al. 2025; NSA's selection branch).

    ``out_i = softmax(q_i·K_{T_i}ᵀ·scale) V_{T_i}`` over the keys of the selected blocks
    ``T_i = ∪_{J ∈ sel(c_i)} block J`` (`routing_select`), intersected with the causal mask
    (bottom-right) when ``causal`` and with ``mask``. No gradient flows through the selection.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        block, k_blocks, causal, query_block: as in `routing_select`.
        mask: bool (True = may attend) broadcastable to ``(B, H, L, S)``, a `Mask`, or None.
        scale: logit scale; None means ``1/√D``.
        compute_dtype, reorder: as in `attention`.

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype.
    """
    qb = block if query_block is None else query_block
    L, S = q.shape[2], k.shape[2]
    table = routing_select(q, k, block=block, k_blocks=k_blocks, causal=causal, query_block=qb)
    cell = routing_cells(L, S, qb)[0].to(q.device)
    key_block = torch.arange(S, device=q.device) // block
    keep = table[:, :, cell][..., key_block]  # (B, H, L, S)
    if causal:
        keep = keep & causal_keep(L, S, q.device)
    user = _as_keep(mask, q, k)
    keep = keep if user is None else keep & user
    return attention(q, k, v, mask=keep, scale=scale, compute_dtype=compute_dtype, reorder=reorder)


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    compute_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference selective scan (Gu & Dao, 2023, "Mamba"): the recurrence, one position at a time.

    For every batch item and channel e, with ``Δ_t = softplus(delta_t + delta_bias)`` (softplus
    only with ``delta_softplus``) and ``h_0 = 0``::

        h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t     (A discretised by ZOH, B by Euler)
        y_t = C_t · h_t + D u_t
        out_t = y_t · silu(z_t)

    Arguments as ``mamba_ssm``'s ``selective_scan_ref`` documents them (its channel letter D is
    E here). Non-finite inputs at position j reach the outputs at t >= j only.

    Args:
        u: ``(B, E, L)``. delta: ``(B, E, L)``. A: ``(E, N)``, real.
        B: ``(E, N)``, ``(B, N, L)`` or ``(B, G, N, L)`` (channel e uses group ``e // (E/G)``).
        C: as B. D: ``(E,)`` or None. z: ``(B, E, L)`` or None. delta_bias: ``(E,)`` or None.
        delta_softplus: apply softplus to Δ. return_last_state: also return ``h_L (B, E, N)``.
        compute_dtype: precision of the recurrence; default float32 or wider.

    Returns:
        ``(B, E, L)`` in u's dtype (and ``h_L`` in ``compute_dtype``).
    """
    from .selective_scan import check_selective_scan, scan_matrix

    batch, E, L, N = check_selective_scan(u, delta, A, B, C, D, z, delta_bias)
    dtype = compute_dtype or stat_dtype(u.dtype)
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)  # (B, E, L)
    a, uu = A.to(dtype), u.to(dtype)
    Bm, Cm = scan_matrix(B, E, dtype), scan_matrix(C, E, dtype)  # (B|1, E|1, N, L|1)
    h = torch.zeros(batch, E, N, dtype=dtype, device=u.device)
    ys = []
    for t in range(L):
        b_t, c_t = Bm[..., min(t, Bm.shape[-1] - 1)], Cm[..., min(t, Cm.shape[-1] - 1)]
        h = torch.exp(dt[:, :, t, None] * a) * h + (dt[:, :, t] * uu[:, :, t])[..., None] * b_t
        ys.append((h * c_t).sum(-1))  # (B, E)
    y = torch.stack(ys, dim=-1)  # (B, E, L)
    if D is not None:
        y = y + uu * D.to(dtype)[:, None]
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(dtype))
    return (y.to(u.dtype), h) if return_last_state else y.to(u.dtype)
