"""Induction-head scores: prefix matching, previous-token attention and the OV circuit's copying.

Olsson et al. (2022, "In-context Learning and Induction Heads") call a head an *induction head*
when, on a sequence that repeats, it attends from a token to the token that came *after* the
earlier occurrence of the same token (prefix matching) and raises the logit of the token it
attends to (copying). Elhage et al. (2021, "A Mathematical Framework for Transformer Circuits")
read copying off the head's OV circuit ``W_U W_O W_V W_E``: a matrix whose eigenvalues are
mostly positive maps a token to a higher logit of the same token.

Every function takes the weights or parameter matrices explicitly (tensors in, numbers out) and
computes in float64.

Example:
    >>> w = module_attentions(model, lambda: model(tokens[None]))   # (layers, H, L, L)
    >>> prefix_matching_score(w, tokens)                             # (layers, H)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_int


def _check_float(name: str, t: object, min_dims: int, what: str) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a float tensor {what}, got {got}")
    if t.dim() < min_dims:
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    return t


def _check_square(weights: object) -> Tensor:
    w = _check_float("weights", weights, 3, "(..., H, L, L)")
    if w.shape[-1] != w.shape[-2]:
        raise ValueError(
            f"weights must be self-attention weights (..., H, L, L) with S = L, got shape "
            f"{tuple(w.shape)}"
        )
    return w


def prefix_match_targets(tokens: Tensor) -> Tensor:
    """Where a prefix-matching head should look: ``T[..., i, k]`` is True when the token at
    ``k − 1`` equals the token at ``i`` and ``k − 1 < i`` (k is the position *after* an earlier
    occurrence of token i).

    Args:
        tokens: integer ids ``(..., L)``.

    Returns:
        Bool ``(..., L, L)``; row i is empty where token i has not occurred before.
    """
    if not isinstance(tokens, Tensor) or tokens.is_floating_point() or tokens.dim() < 1:
        got = (
            f"dtype {tokens.dtype}, shape {tuple(tokens.shape)}"
            if isinstance(tokens, Tensor)
            else type(tokens).__name__
        )
        raise TypeError(f"tokens must be an integer tensor (..., L), got {got}")
    L = tokens.shape[-1]
    earlier = torch.ones(L, L, dtype=torch.bool, device=tokens.device).tril(-1)  # j < i
    same = (tokens[..., :, None] == tokens[..., None, :]) & earlier  # (..., L, L): [i, j]
    return torch.nn.functional.pad(same[..., :-1], (1, 0))  # [i, k] = same[i, k − 1]


def prefix_matching_score(weights: Tensor, tokens: Tensor) -> Tensor:
    """Each head's mean attention from a repeated token to the tokens after its earlier
    occurrences (Olsson et al., 2022).

    For query row i whose token occurred before, at positions ``j < i`` with ``t_j = t_i``::

        s_i = Σ_{j < i, t_j = t_i} w[i, j + 1]          score = mean_i s_i

    over the rows that have an earlier occurrence (other rows are left out). A perfect
    induction head scores 1; a head attending uniformly over i + 1 keys scores about
    (number of earlier occurrences) / (i + 1).

    Args:
        weights: self-attention probabilities ``(B, H, L, L)`` with tokens ``(B, L)``, or
            ``(..., H, L, L)`` for one sequence (e.g. ``(layers, H, L, L)`` from
            `attnlab.analysis.module_attentions`) with tokens ``(L,)``.
        tokens: the ids of the sequence(s) the weights were computed on.

    Returns:
        ``(..., H)``: one score per head (batch items, if any, are kept: average them over
        dim 0). NaN where no row has an earlier occurrence.

    Raises:
        TypeError: weights not float, tokens not integer.
        ValueError: weights not ``(..., H, L, L)``, or tokens of another length or batch.
    """
    w = _check_square(weights)
    T = prefix_match_targets(tokens).to(torch.float64)  # (L, L) or (B, L, L)
    L = w.shape[-1]
    batched = tokens.dim() == 2
    if (
        tokens.dim() > 2
        or tokens.shape[-1] != L
        or (batched and (w.dim() != 4 or w.shape[0] != tokens.shape[0]))
    ):
        raise ValueError(
            f"tokens must be (L,) or (B, L) matching weights (B, H, L, L) with L = {L}, got "
            f"tokens {tuple(tokens.shape)} for weights {tuple(w.shape)}"
        )
    if batched:
        T = T[:, None]  # (B, 1, L, L)
    rows = (w.to(torch.float64) * T).sum(-1)  # (..., H, L)
    has = T.amax(-1)  # (..., 1 or H, L): 1 where the row has a target
    return (rows * has).sum(-1) / has.sum(-1)  # (..., H)


def previous_token_score(weights: Tensor) -> Tensor:
    """Each head's mean attention to the previous position: ``mean_{i >= 1} w[i, i − 1]``.

    The first half of an induction circuit (Elhage et al., 2021): a head in an earlier layer
    that copies the previous token into each position, so that a later head's keys can match
    on it.

    Args:
        weights: self-attention probabilities ``(..., H, L, L)``, L >= 2.

    Returns:
        ``(..., H)``.
    """
    w = _check_square(weights)
    if w.shape[-1] < 2:
        raise ValueError(f"weights must have L >= 2 positions, got shape {tuple(w.shape)}")
    return torch.diagonal(w.to(torch.float64), offset=-1, dim1=-2, dim2=-1).mean(-1)


def ov_circuits(embed: Tensor, w_v: Tensor, w_o: Tensor, unembed: Tensor, num_heads: int) -> Tensor:
    """Each head's full OV circuit ``W_U W_O^h W_V^h W_E`` as a ``(V, V)`` matrix.

    Entry ``[s, t]`` is how much the logit of token t rises when the head attends (with
    weight 1) to a position holding token s, through the direct path (embedding → value →
    output → unembedding; Elhage et al., 2021). In the row-vector layout of ``nn.Linear``::

        M^h = E · W_v^hᵀ · W_o^hᵀ · Uᵀ

    where ``W_v^h`` are rows ``h·D … (h+1)·D − 1`` of ``w_v`` and ``W_o^h`` the same columns
    of ``w_o``.

    Args:
        embed: token embeddings ``(V, E)``.
        w_v: the value projection's weight ``(H·D, E)`` (``nn.Linear`` layout).
        w_o: the output projection's weight ``(E, H·D)``.
        unembed: the unembedding ``(V, E)`` (logits = x @ unembedᵀ).
        num_heads: H.

    Returns:
        ``(H, V, V)`` in float64.
    """
    H = check_int("num_heads", num_heads, minimum=1)
    emb = _check_float("embed", embed, 2, "(V, E)").detach().to(torch.float64)
    E = emb.shape[1]
    wv = _check_float("w_v", w_v, 2, "(H*D, E)").detach().to(torch.float64)
    wo = _check_float("w_o", w_o, 2, "(E, H*D)").detach().to(torch.float64)
    un = _check_float("unembed", unembed, 2, "(V, E)").detach().to(torch.float64)
    if wv.shape[0] % H or wv.shape[1] != E or wo.shape != (E, wv.shape[0]) or un.shape[1] != E:
        raise ValueError(
            f"expected w_v (H*D, E={E}) with H={H} dividing H*D, w_o (E, H*D) and unembed "
            f"(V, E); got w_v {tuple(wv.shape)}, w_o {tuple(wo.shape)}, unembed {tuple(un.shape)}"
        )
    D = wv.shape[0] // H
    wv_h = wv.view(H, D, E)  # (H, D, E)
    wo_h = wo.view(E, H, D).permute(1, 2, 0)  # (H, D, E): W_o^hᵀ
    values = emb @ wv_h.transpose(1, 2)  # (H, V, D)
    return values @ wo_h @ un.T  # (H, V, V)


def copying_score(circuit: Tensor) -> Tensor:
    """How much a circuit copies: ``Σ_k λ_k / Σ_k |λ_k|`` over the eigenvalues of ``M``.

    Elhage et al.'s (2021) summary of an OV circuit (see `ov_circuits`): +1 when every
    eigenvalue is positive (the head raises the logit of the very token it attends to — a
    copying head), −1 when every one is negative (it lowers it), near 0 without a preference.
    ``Σ λ_k`` is the trace, so the score is ``tr(M) / Σ |λ_k|``; the eigenvalues are complex
    in general, and their real parts add up to the trace.

    Args:
        circuit: ``(..., V, V)``, e.g. `ov_circuits` ``(H, V, V)``.

    Returns:
        ``(...)`` in ``[−1, 1]``; NaN for an all-zero matrix.
    """
    m = _check_float("circuit", circuit, 2, "(..., V, V)")
    if m.shape[-1] != m.shape[-2]:
        raise ValueError(f"circuit must be square (..., V, V), got shape {tuple(m.shape)}")
    lam = torch.linalg.eigvals(m.to(torch.float64))  # (..., V) complex
    return lam.real.sum(-1) / lam.abs().sum(-1)


__all__ = [
    "copying_score",
    "ov_circuits",
    "prefix_match_targets",
    "prefix_matching_score",
    "previous_token_score",
]
