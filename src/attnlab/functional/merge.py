"""Merging partial attention results by their log-sum-exp (the online-softmax combine step).

Attention over a key set that is split into disjoint parts ``K = K_1 ∪ … ∪ K_n`` can be computed
part by part: each part gives its normalised output ``o_i`` and log-sum-exp ``lse_i`` of its
logits, and the full result is

    lse = log Σ_i exp(lse_i)            o = Σ_i exp(lse_i − lse) · o_i

This is how the tiled ("flash") backend combines its tiles and how ring attention combines the
key/value shards it receives from other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._shapes import stat_dtype

_NEG_INF = float("-inf")


def merge_partials(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Combines attention results over disjoint key sets into the result over their union.

    ``lse = log Σ_i exp(lse_i)`` and ``out = Σ_i exp(lse_i − lse) · out_i``. A part with lse −inf
    (no attended key in that part) contributes nothing; a row whose lse is −inf in every part gets
    an all-zero output and lse = −inf, never NaN. The sum is formed in float32 (float64 for
    float64 inputs) and the output is cast back to the dtype of ``outs[0]``.

    The NaN rule (merging equals attention over the union of the key sets): a NaN or +inf
    ``lse_i`` makes the row's output and lse NaN, a NaN/inf entry ``out_i[..., l, d]`` of a part
    with finite ``lse_i`` makes ``out[..., l, d]`` NaN (other columns exact), and a part with
    ``lse_i = −inf`` never leaks its stored output. For finite output gradients, the gradients
    are finite: those of the merge with non-finite output entries read as 0 and NaN/+inf lse
    read as −inf.

    Args:
        outs: n tensors of shape ``(..., L, Dv)``, each normalised over its own key set (the output
            of attention restricted to that set; zeros where the set has no attended key).
        lses: n tensors of shape ``(..., L)``: the log-sum-exp of the scaled, masked logits over the
            same key sets, −inf where the set has no attended key.

    Returns:
        ``(out (..., L, Dv) in the dtype of outs[0], lse (..., L) in float32 or float64)``.

    Raises:
        ValueError: empty input, different counts of outs and lses, or shapes that do not match.

    Example:
        >>> o, l = merge_partials([o1, o2], [l1, l2])  # keys split in two halves
    """
    if len(outs) != len(lses):
        raise ValueError(f"merge_partials: got {len(outs)} outs but {len(lses)} lses")
    if len(outs) == 0:
        raise ValueError("merge_partials: need at least one partial result, got 0")
    shape, lshape = tuple(outs[0].shape), tuple(lses[0].shape)
    if len(shape) < 1 or shape[:-1] != lshape:
        raise ValueError(
            f"merge_partials: outs[0] of shape {shape} needs lses[0] of shape {shape[:-1]}, "
            f"got {lshape}"
        )
    for idx, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if tuple(o.shape) != shape or tuple(lse.shape) != lshape:
            raise ValueError(
                f"merge_partials: part {idx} has out {tuple(o.shape)} and lse {tuple(lse.shape)}, "
                f"expected out {shape} and lse {lshape}"
            )
    acc = stat_dtype(outs[0].dtype)
    if any(lse.dtype == torch.float64 for lse in lses):
        acc = torch.float64
    lse_all = torch.stack([lse.to(acc) for lse in lses])  # (n, ..., L)
    # The NaN rule: a NaN/+inf lse poisons its row; it enters the arithmetic as −inf (no key).
    bad_lse = torch.isnan(lse_all) | torch.isposinf(lse_all)  # (n, ..., L)
    lse_all = torch.where(bad_lse, _NEG_INF, lse_all)
    m = lse_all.amax(dim=0)  # (..., L)
    dead = torch.isneginf(m)
    m_safe = torch.where(dead, 0.0, m)
    w = torch.exp(lse_all - m_safe)  # (n, ..., L); exactly 0 for parts with lse = −inf
    total = w.sum(dim=0)  # (..., L)
    lse = torch.where(dead, _NEG_INF, m_safe + torch.log(torch.where(dead, 1.0, total)))
    frac = w / torch.where(dead, 1.0, total)  # (n, ..., L)
    out = torch.zeros(shape, dtype=acc, device=outs[0].device)
    bad = bad_lse.any(dim=0).unsqueeze(-1)  # (..., L, 1): rows poisoned by an lse
    for f, o, lse_i in zip(frac, outs, lse_all, strict=True):
        # nan_to_num: a part with weight 0 must not leak NaN/inf stored in its (unused) output;
        # a live part's non-finite entries are flagged instead (column-wise, as the rule says).
        oc = o.to(acc)
        cleaned = torch.nan_to_num(oc, 0.0, 0.0, 0.0)
        # oc != cleaned exactly at NaN/±inf (one compare; isfinite is a composite of several)
        bad = bad | ((oc != cleaned) & ~torch.isneginf(lse_i).unsqueeze(-1))
        out = out.addcmul(f.unsqueeze(-1), cleaned)  # out + f · cleaned
    # + (−0.0) keeps every value bit-exact; NaN where the rule says. Gradients see none of it.
    out = out + torch.where(bad, float("nan"), -0.0)
    lse = lse + torch.where(bad_lse.any(dim=0), float("nan"), -0.0)
    return out.to(outs[0].dtype), lse


def merge_into(out: Tensor, lse: Tensor, o: Tensor, lse_o: Tensor) -> None:
    """In place: ``(out, lse)`` becomes the merge of itself with the part ``(o, lse_o)``.

    The two-part case of `merge_partials` without temporaries of the whole output: ``out``
    (…, L, Dv) and ``lse`` (…, L) are updated (they may be views), ``o`` must be zero where
    ``lse_o`` is −inf. Start from ``out = 0, lse = −inf`` to accumulate parts one by one.
    """
    new = torch.logaddexp(lse, lse_o.to(lse.dtype))  # (…, L)
    new_safe = torch.where(torch.isneginf(new), 0.0, new)
    keep = torch.exp(lse - new_safe).unsqueeze(-1)  # (…, L, 1); 0 where lse = −inf
    take = torch.exp(lse_o.to(lse.dtype) - new_safe).unsqueeze(-1)
    out.mul_(keep.to(out.dtype)).add_(o * take.to(o.dtype))
    lse.copy_(new)


def merge_compensated(
    parts: list[tuple[Tensor, Tensor, Tensor | None]],
) -> tuple[Tensor, Tensor, Tensor]:
    """`merge_partials` of parts whose lse carries its rounding error: ``(o, hi, lo)`` triples.

    Each part's log-sum-exp is ``hi + lo`` (``lo`` from `TorchEngine.forward`'s two-sum, or a
    previous merge; None = 0). The merge weights ``exp(hi_i + lo_i − lse)`` and the merged
    ``lse = hi + lo`` are formed in float64, so neither the output nor backward's probabilities
    ``exp(s − hi − lo)`` see the rounding of a large lse (ulp(32) ≈ 4e-6 in float32). Inputs are
    finite (the NaN rule cleans them first); rows with no key in any part stay ``o = 0``,
    ``lse = −inf``, ``lo = 0``.

    Returns:
        ``(out (..., L, Dv) in the first part's dtype, hi (..., L), lo (..., L))``, hi and lo in
        the first part's lse dtype.
    """
    exact = torch.stack(
        [l.double() if lo is None else l.double() + lo.double() for _, l, lo in parts]
    )  # (n, ..., L)
    top = torch.logsumexp(exact, dim=0)  # (..., L); −inf where every part is empty
    weights = torch.exp(exact - torch.where(torch.isneginf(top), 0.0, top))  # (n, ..., L)
    o0, l0 = parts[0][0], parts[0][1]
    acc = stat_dtype(o0.dtype)
    out = sum(
        (w.to(acc).unsqueeze(-1) * o.to(acc) for w, (o, _, _) in zip(weights, parts, strict=True)),
        torch.zeros((), dtype=acc, device=o0.device),
    )
    hi = top.to(l0.dtype)
    lo = torch.where(torch.isneginf(top), 0.0, top - hi.double()).to(l0.dtype)
    return out.to(o0.dtype), hi, lo


__all__ = ["merge_compensated", "merge_into", "merge_partials"]
