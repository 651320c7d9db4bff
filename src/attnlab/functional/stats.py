"""Attention weights and per-query statistics without an L×S matrix, from the log-sum-exp.

With the log-sum-exp of each query row (``attention(..., return_lse=True)``) every weight is one
exponential away: ``p_ij = exp(s_ij − lse_i)``, where ``s_ij`` is the scaled (soft-capped, when
the request has ``softcap``), biased logit. So:

- `attention_weights` recomputes the exact weights of chosen rows and heads only;
- `attention_stats` streams over the same tiles as the tiled backend (skipping empty tiles) and
  accumulates per-query statistics, so it works at sequence lengths whose L×S matrix would not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._shapes import stat_dtype
from ..utils.table import text_table
from .flash import TileSource, flash_job
from .flash.calls import CALL_CAUSAL, CALL_MASKED, Call
from .nan_rule import nan_flags
from .reference import softcap_logits
from .request import Request, logit_qk

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttentionStats:
    """Per-head, per-query statistics of the attention weights; each ``(B, H, L)`` (3-D in: (B, L)).

    Rows with no key to attend have every statistic 0 and lse −inf. ``print(stats)`` shows the
    shape and the mean, min and max of each statistic; ``repr(stats)`` the shape and the means.

    Attributes:
        entropy: ``−Σ_j p_ij log p_ij`` in nats (0 for one-hot, log n for uniform over n keys).
        max_weight: ``max_j p_ij``.
        sink_mass: ``p_i0``, the weight on the first key (the "attention sink").
        mean_distance: ``Σ_j p_ij |i' − j|`` with ``i' = i + S − L`` the aligned query position.
        lse: log-sum-exp of the row's logits (float32 or float64).
    """

    entropy: Tensor
    max_weight: Tensor
    sink_mass: Tensor
    mean_distance: Tensor
    lse: Tensor

    def as_dict(self) -> dict[str, Tensor]:
        """The statistics by name."""
        return {
            "entropy": self.entropy,
            "max_weight": self.max_weight,
            "sink_mass": self.sink_mass,
            "mean_distance": self.mean_distance,
            "lse": self.lse,
        }

    def _layout(self) -> str:
        """``"(B, H, L) = (2, 4, 128), float32"`` (the letters of 3, 2 or 1 dims)."""
        shape = tuple(self.entropy.shape)
        letters = {3: "(B, H, L) = ", 2: "(B, L) = ", 1: "(L,) = "}.get(len(shape), "")
        device = self.entropy.device
        where = "" if device.type == "cpu" else f" on {device}"
        return f"{letters}{shape}, {str(self.entropy.dtype).removeprefix('torch.')}{where}"

    def __repr__(self) -> str:
        means = []
        for name, t in self.as_dict().items():
            summary = _summary(t)
            if name != "lse" and summary is not None:
                means.append(f"{name}={summary[0]}")
        values = f"; means over rows: {', '.join(means)}" if means else ""
        return f"AttentionStats({self._layout()}{values})"

    def __str__(self) -> str:
        rows = []
        for name, t in self.as_dict().items():
            summary = _summary(t)
            rows.append([name, *summary] if summary else [name, "—", "—", "—", "—"])
        header = ["statistic", "mean", "min", "max", "non-finite rows"]
        table = text_table(header, rows, align="<>>>>")
        return f"AttentionStats {self._layout()}\n{table}"


def _summary(t: Tensor) -> list[str] | None:
    """Mean, min and max of the finite values of ``t`` and how many are not finite, as text;
    None for values that cannot be read (meta tensors) or no values."""
    if t.is_meta or t.numel() == 0:
        return None
    x = t.detach().to("cpu", torch.float64)  # a summary for people: one host copy
    finite = x[torch.isfinite(x)]
    bad = x.numel() - finite.numel()
    if finite.numel() == 0:
        return ["—", "—", "—", str(bad)]
    nums = (finite.mean().item(), finite.min().item(), finite.max().item())
    return [*(f"{n:.4g}" for n in nums), str(bad)]


def _prepared(req: Request) -> tuple[Tensor, Tensor]:
    """q and k as the job's logits read them (`request.logit_qk`: the job's scale is > 0)."""
    q, k, _ = logit_qk(req)
    return q, k


def _logits(qs: Tensor, ks: Tensor, scale: float) -> Tensor:
    """``q·kᵀ·scale``: q ``(nb, H, r, D)``, grouped k ``(nb, H_kv, c, D)`` → ``(nb, H, r, c)``."""
    H, H_kv = qs.shape[1], ks.shape[1]
    qg = qs.unflatten(1, (H_kv, H // H_kv))  # (nb, H_kv, G, r, D)
    s = qg @ ks.unsqueeze(2).transpose(-1, -2)  # (nb, H_kv, G, r, c)
    return s.flatten(1, 2) * scale  # (nb, H, r, c)


def compute_stats(
    req: Request, lse: Tensor, *, chunk_q: int = 128, chunk_k: int = 1024
) -> AttentionStats:
    """Streams the plan's tiles once, given the rows' lse ``(B, H, L)``; see `attention_stats`."""
    d = req.dims
    acc = stat_dtype(req.q.dtype)
    job = flash_job(req)
    src: TileSource = job.source
    q, k = _prepared(req)
    ent = torch.zeros(d.B, d.H, d.L, dtype=acc, device=q.device)
    smax = torch.full_like(ent, _NEG_INF)
    sink = torch.zeros_like(ent)
    dist = torch.zeros_like(ent)
    lse_b = torch.where(torch.isneginf(lse), float("inf"), lse).to(acc)
    # The NaN rule: 0, or NaN once a row meets a non-finite logit among the keys it may attend
    flag = torch.zeros_like(ent)
    for c in job.plan.simple_calls:
        keys_all = c.index.to(q.device)
        b = torch.arange(c.b0, c.b1, device=q.device).view(-1, 1, 1, 1)
        for r0 in range(c.r0, c.r1, chunk_q):
            r1 = min(c.r1, r0 + chunk_q)
            rows = torch.arange(r0, r1, device=q.device)
            qs = q[c.b0 : c.b1, :, r0:r1].to(acc)
            lrow = lse_b[c.b0 : c.b1, :, r0:r1].unsqueeze(-1)  # (nb, H, r, 1)
            pos = (rows + (d.S - d.L)).view(1, 1, -1, 1)
            n_keys = keys_all.numel()
            if c.kind == CALL_CAUSAL:  # keys past the last row's diagonal are all masked
                n_keys = min(n_keys, r1 - c.r0)
            for c0 in range(0, n_keys, chunk_k):
                keys = keys_all[c0 : min(n_keys, c0 + chunk_k)]
                s = _logits(qs, k[c.b0 : c.b1].index_select(2, keys).to(acc), job.scale)
                add = _tile_add(src, c, b, rows, keys)
                s, bad = _masked_logits(s, add, acc, req.softcap)
                logp = s - lrow  # log p_ij; −inf where masked, −inf on dead rows (lse = +inf)
                p = torch.exp(logp)
                live = p > 0
                sl = (slice(c.b0, c.b1), slice(None), slice(r0, r1))
                flag[sl] += bad
                ent[sl] -= torch.where(live, p * logp, 0.0).sum(dim=-1)
                smax[sl] = torch.maximum(smax[sl], s.amax(dim=-1))
                gap = (pos - keys.view(1, 1, 1, -1)).abs().to(acc)
                dist[sl] += torch.where(live, p * gap, 0.0).sum(dim=-1)
                sink[sl] += torch.where(keys == 0, p, 0.0).sum(dim=-1)  # p_i0, no host sync
    dead = torch.isneginf(lse)
    # NaN rows: a non-finite attended logit, or a NaN/+inf lse (a row poisoned upstream)
    poison = _poison(torch.isnan(flag) | torch.isnan(lse) | torch.isposinf(lse), acc)
    maxw = torch.where(dead, 0.0, torch.exp(smax - lse_b))
    return AttentionStats(
        entropy=torch.where(dead, 0.0, ent) + poison,
        max_weight=maxw + poison,
        sink_mass=torch.where(dead, 0.0, sink) + poison,
        mean_distance=torch.where(dead, 0.0, dist) + poison,
        lse=lse,
    )


def _poison(bad: Tensor, dtype: torch.dtype) -> Tensor:
    """NaN where ``bad``, −0.0 elsewhere (adding −0.0 keeps every value bit-exact)."""
    return torch.where(bad, float("nan"), -0.0).to(dtype)


def _masked_logits(
    s: Tensor, add: Tensor | None, acc: torch.dtype, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """``(cap(s) + add with masked entries at −inf, row flag)``: the flag ``(..., r)`` is NaN
    where an attended logit (add ≠ −inf) is NaN or ±inf, else 0 — masked entries never reach it.

    ``cap`` is `reference.softcap_logits`; the flag reads the logits before capping (tanh would
    turn ±inf into ±softcap)."""
    raw = s
    s = softcap_logits(s, softcap)
    if add is not None:
        add = add.to(acc)
        raw, s = raw + add, s + add
        masked = torch.isneginf(add)
        bad = torch.where(masked, 0.0, nan_flags(raw)).sum(dim=-1)
        return torch.where(masked, _NEG_INF, s), bad
    return s, nan_flags(raw).sum(dim=-1)


def _tile_add(src: TileSource, c: Call, b: Tensor, rows: Tensor, keys: Tensor) -> Tensor | None:
    """The additive tile of call ``c`` on a (rows × keys) sub-tile, causal calls included."""
    with_mask = c.kind == CALL_MASKED
    add = None
    if with_mask or src.has_bias:
        add = src.additive(b, rows.view(1, 1, -1, 1), keys.view(1, 1, 1, -1), with_mask=with_mask)
    if c.kind == CALL_CAUSAL:
        assert isinstance(c.keys, tuple)
        local_r = (rows - c.r0).view(-1, 1)
        local_k = (keys - c.keys[0]).view(1, -1)
        causal = torch.where(local_k > local_r, _NEG_INF, 0.0).to(src.dtype)  # (r, c)
        causal = causal.view(1, 1, rows.numel(), keys.numel())
        add = causal if add is None else add + causal
    return add


def compute_weights(
    req: Request,
    lse: Tensor,
    rows: Tensor,
    heads: Tensor,
) -> Tensor:
    """Exact weights ``(B, len(heads), len(rows), S)`` of the chosen rows and heads; see
    `attention_weights`."""
    d = req.dims
    acc = stat_dtype(req.q.dtype)
    q, k = _prepared(req)
    G = d.H // d.H_kv
    qs = q[:, heads][:, :, rows].to(acc)  # (B, nh, nr, D)
    ks = k[:, heads // G].to(acc)  # (B, nh, S, D): kv head of each chosen query head
    s = (qs @ ks.transpose(-1, -2)) * abs(req.logit_scale)  # (B, nh, nr, S); sign in q
    job_src = flash_job(req).source
    b = torch.arange(d.B, device=q.device).view(-1, 1, 1, 1)
    add = job_src.additive(
        b,
        rows.view(1, 1, -1, 1),
        torch.arange(d.S, device=q.device).view(1, 1, 1, -1),
        with_mask=True,
        h=heads.view(1, -1, 1, 1),
    )
    s, bad = _masked_logits(s, add, acc, req.softcap)
    lrow = lse[:, heads][:, :, rows].to(acc)  # (B, nh, nr)
    poison = _poison(torch.isnan(bad) | torch.isnan(lrow) | torch.isposinf(lrow), acc)
    lrow = torch.where(torch.isneginf(lrow), float("inf"), lrow).unsqueeze(-1)
    return (torch.exp(s - lrow) + poison.unsqueeze(-1)).to(req.q.dtype)


def as_index(
    name: str, value: int | Sequence[int] | Tensor | slice | None, size: int, device
) -> Tensor:
    """Row/head selection → a 1-D int64 tensor of indices in [0, size), or ValueError naming it.

    Ints, sequences of ints and slices are checked in Python; only an index *tensor* is read
    back (``min``/``max``) to check its range.
    """
    if value is None:
        return torch.arange(size, device=device)
    if isinstance(value, slice):
        return torch.arange(size, device=device)[value]
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, a sequence of ints, a slice or a tensor, got bool")
    if isinstance(value, int) or (
        isinstance(value, Sequence) and all(isinstance(x, int) for x in value)
    ):
        items = [value] if isinstance(value, int) else list(value)
        if any(isinstance(x, bool) for x in items):
            raise TypeError(f"{name} must hold integers, got a bool in {items}")
        if any(x < -size or x >= size for x in items):
            raise ValueError(f"{name} must lie in [0, {size}), got {items}")
        return torch.tensor(
            [x % size for x in items] if size else items, dtype=torch.long, device=device
        )
    t = torch.as_tensor(value, device=device)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    t = t.long().reshape(-1)
    if t.numel() and (int(t.min()) < -size or int(t.max()) >= size):
        raise ValueError(f"{name} must lie in [0, {size}), got {t.tolist()}")
    return t % size if size else t


__all__ = ["AttentionStats", "as_index", "compute_stats", "compute_weights"]
