"""Shaw et al. (2018) relative position representations: clipped relative key and value tables.

"Self-Attention with Relative Position Representations" gives every pair ``(i, j)`` the clipped
distance ``r_ij = clip(j − i, −K, K)`` and two learned tables ``a^K``, ``a^V`` of ``2K + 1`` rows
(shared across heads in the paper)::

    e_ij = q_i · (k_j + a^K[r_ij]) / √D,   α = softmax_j(e),   z_i = Σ_j α_ij (v_j + a^V[r_ij])

The key term ``q_i · a^K[r_ij]`` could be written as an additive bias, but it depends on ``q_i``
(a bias function ``fn(b, h, i, j)`` only sees indices), and the value term is not a bias at all:
it adds ``Σ_j α_ij a^V[r_ij]`` to the output, which the online-softmax (flash) and fused (sdpa)
kernels do not compute. So Shaw attention is a definition (`attnlab.functional.reference.
shaw_attention`) plus one dense path here: it builds the ``(B, H, L, S)`` weights, like the
reference backend with ``return_weights=True``, but never a ``(L, S, D)`` table.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._shapes import check_bool, check_int, stat_dtype
from ..functional import nan_rule
from ..functional.reference import shaw_relative_index
from ..functional.request import BiasFn, plain_request, request_dense, request_interval
from ..masks import Mask

_NEG_INF = float("-inf")


def _check_tables(rel_k: object, rel_v: object, q: Tensor, v: Tensor) -> int:
    """Checks the tables against q ``(B, H, L, D)`` and v; returns K (tables have 2K + 1 rows)."""
    H, D, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    for name, t, width in (("rel_k", rel_k, D), ("rel_v", rel_v, Dv)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {t.dtype}")
        if t.dim() not in (2, 3) or t.shape[-1] != width or (t.dim() == 3 and t.shape[0] != H):
            raise ValueError(
                f"{name} must be (2K+1, {width}) shared by the heads or ({H}, 2K+1, {width}) per "
                f"head, got {tuple(t.shape)}"
            )
        if t.shape[-2] % 2 == 0:
            raise ValueError(
                f"{name} must have an odd number 2K+1 of rows (distances −K..K), got {t.shape[-2]}"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    assert isinstance(rel_k, Tensor) and isinstance(rel_v, Tensor)
    if rel_k.shape[-2] != rel_v.shape[-2]:
        raise ValueError(
            f"rel_k and rel_v must have the same number of rows 2K+1, got {rel_k.shape[-2]} and "
            f"{rel_v.shape[-2]}"
        )
    return (rel_k.shape[-2] - 1) // 2


def _as4(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)


def _per_head(t: Tensor) -> Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t  # (H|1, 2K+1, ·)


def shaw_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor,
    rel_v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Shaw relative attention, dense: equals `functional.reference.shaw_attention`.

    ``e_ij = (q_i·k_j + q_i·a^K[r_ij])·scale + bias_ij``, ``o_i = Σ_j α_ij (v_j + a^V[r_ij])``
    with ``r_ij = clip(j − i, −K, K)``, query i aligned bottom-right to the keys::

        L=2, S=4, K=1:   r = [[-1, -1,  0, 1],    (row 0 sits at key position 2)
                              [-1, -1, -1, 0]]    (row 1 at key position 3)

    Cost: the key term is ``q @ a^Kᵀ`` ``(B, H, L, 2K+1)`` gathered to ``(B, H, L, S)``; the value
    term scatters the weights into their 2K + 1 distance buckets ``(B, H, L, 2K+1)`` and
    multiplies by ``a^V``. No ``(L, S, D)`` tensor; the ``(B, H, L, S)`` weights are dense (the
    value term needs them: there is no tiled path, see the module docstring).

    Masks, bias, fully masked rows (zeros) and the NaN rule are as in `attnlab.attention`; a
    table row counts as part of the key (``a^K``) or value (``a^V``) of every pair that reads it.
    Sync-free (no host reads): works under ``torch.compile`` and on ``meta`` tensors.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``; ``H % H_kv == 0``.
        rel_k: ``a^K``, ``(2K+1, D)`` shared by the heads (the paper) or ``(H, 2K+1, D)``.
        rel_v: ``a^V``, ``(2K+1, Dv)`` or ``(H, 2K+1, Dv)``; row ``K + r`` is distance r.
        mask: an `attnlab.masks.Mask`, a bool tensor (True = may attend) or an additive float
            tensor, broadcastable to ``(B, H, L, S)``.
        bias: additive float tensor or function bias ``fn(b, h, i, j)``; −inf entries are masked.
        scale: logit scale, default ``1/√D``.
        return_weights: also return the attention weights ``(B, H, L, S)``.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype (softmax in float32 or wider), or ``(out, weights)``.

    Raises:
        ValueError/TypeError: bad shapes, dtypes or devices, naming the argument (before any work).
    """
    if not isinstance(q, Tensor) or q.dim() != 4:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must be 4-D (B, H, L, D), got {got}")
    req = plain_request(q, k, v, mask=mask, bias=bias, scale=scale, temperature=1.0, score="dot")
    check_bool("return_weights", return_weights)
    K = _check_tables(rel_k, rel_v, req.q, req.v)
    keep, additive = (None if t is None else _as4(t) for t in request_dense(req))
    if additive is not None:
        finite = ~torch.isneginf(additive)
        keep = finite if keep is None else keep & finite
    q, k, v = req.q, req.k, req.v
    B, H, L, _ = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv
    dtype = stat_dtype(q.dtype)
    idx = shaw_relative_index(L, S, K, q.device).expand(B, H, L, S)  # (B, H, L, S)

    qc = nan_rule.clean(q).to(dtype)
    kc, vc = nan_rule.clean(k).to(dtype), nan_rule.clean(v).to(dtype)
    rk, rv = _per_head(nan_rule.clean(rel_k).to(dtype)), _per_head(nan_rule.clean(rel_v).to(dtype))
    content = qc.unflatten(1, (H_kv, G)) @ kc.unsqueeze(2).transpose(-1, -2)  # (B, H_kv, G, L, S)
    qa = qc @ rk.transpose(-1, -2)  # (B, H, L, 2K+1)
    logits = (content.flatten(1, 2) + qa.gather(-1, idx)) * req.scale  # (B, H, L, S)
    if additive is not None:
        logits = logits + nan_rule.clean_bias(additive).to(dtype)
    if keep is not None:
        logits = logits.masked_fill(~keep, _NEG_INF)
    m = logits.amax(dim=-1, keepdim=True).detach() if S else logits.sum(-1, keepdim=True)
    dead = m == _NEG_INF  # rows that may attend nothing
    e = torch.exp(logits - torch.where(dead, 0.0, m))
    p = e / torch.where(dead, 1.0, e.sum(dim=-1, keepdim=True))  # (B, H, L, S)
    buckets = p.new_zeros(B, H, L, 2 * K + 1).scatter_add(-1, idx, p)  # (B, H, L, 2K+1)
    out = (p.unflatten(1, (H_kv, G)) @ vc.unsqueeze(2)).flatten(1, 2)  # (B, H, L, Dv)
    out = (out + buckets @ rv).to(q.dtype)
    weights = p.to(q.dtype)

    # The NaN rule: content part as in attention, then the tables through per-row bucket counts.
    # A structured mask gives each row one key interval: O((S + L)·Dv), no dense pass.
    interval = None if return_weights or req.is_empty else request_interval(req)
    if interval is not None:
        out, _ = nan_rule.poison(out, q, k, v, interval=interval)
    else:
        out, weights = nan_rule.poison(out, q, k, v, keep=keep, bias=additive, weights=weights)
    keep4 = q.new_ones((), dtype=torch.bool).expand(1, 1, L, S) if keep is None else keep
    kb, kh = keep4.shape[:2]  # (B|1, H|1): the counts stay as small as the mask
    counts = torch.zeros(kb, kh, L, 2 * K + 1, device=q.device).scatter_add(
        -1, idx[:kb, :kh], keep4.expand(kb, kh, L, S).float()
    )  # (B|1, H|1, L, 2K+1): how many attended pairs read each table row
    row_bad = (counts @ nan_rule.row_flags(_per_head(rel_k)).unsqueeze(-1)) > 0  # (·, H|1, L, 1)
    col_bad = (counts @ nan_rule.flags(_per_head(rel_v))) > 0  # (B|1, H|1, L, Dv)
    out = nan_rule.add_nan(out, row_bad | col_bad)
    if not return_weights:
        return out
    return out, torch.where(row_bad & keep4, float("nan"), weights)


class ShawRelativePositions(nn.Module):
    """The two learned tables of Shaw et al.: ``a^K (2K+1, D)`` and ``a^V (2K+1, Dv)``.

    ``forward(q, k, v, mask=...)`` is `shaw_attention` with these tables, i.e. a drop-in for
    ``attnlab.attention(q, k, v, mask=...)`` on head tensors. Neither table fits
    `MultiHeadAttention`'s ``bias_fn`` (the key term depends on q, the value term is added to
    the output), so `attnlab.modules.shaw.ShawRelativeAttention` is the multi-head module
    that uses it.

    Args:
        max_distance: K, the clipping distance: every ``|j − i| >= K`` shares the end rows.
        head_dim: D, width of ``a^K``.
        value_dim: Dv, width of ``a^V`` (default D).
        num_heads: None (default, the paper): tables shared by all heads; an int H: one pair of
            tables per head, ``(H, 2K+1, ·)``.
        init_std: standard deviation of the normal initialisation.

    Attributes:
        rel_k: ``(2K+1, D)`` or ``(H, 2K+1, D)``; row ``K + r`` is distance ``r = j − i``.
        rel_v: ``(2K+1, Dv)`` or ``(H, 2K+1, Dv)``.

    Example:
        >>> shaw = ShawRelativePositions(max_distance=4, head_dim=16)
        >>> q = k = v = torch.randn(2, 4, 10, 16)
        >>> shaw(q, k, v, mask=attnlab.masks.causal()).shape
        torch.Size([2, 4, 10, 16])
    """

    def __init__(
        self,
        max_distance: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        num_heads: int | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.max_distance = check_int("max_distance", max_distance, minimum=0)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.value_dim = (
            head_dim if value_dim is None else check_int("value_dim", value_dim, minimum=1)
        )
        self.num_heads = None if num_heads is None else check_int("num_heads", num_heads, minimum=1)
        lead = () if self.num_heads is None else (self.num_heads,)
        n = 2 * self.max_distance + 1
        self.rel_k = nn.Parameter(torch.empty(*lead, n, self.head_dim))
        self.rel_v = nn.Parameter(torch.empty(*lead, n, self.value_dim))
        nn.init.normal_(self.rel_k, std=init_std)
        nn.init.normal_(self.rel_v, std=init_std)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | BiasFn | None = None,
        scale: float | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`shaw_attention(q, k, v, self.rel_k, self.rel_v, ...)`; q ``(B, H, L, D)``."""
        return shaw_attention(
            q,
            k,
            v,
            self.rel_k,
            self.rel_v,
            mask=mask,
            bias=bias,
            scale=scale,
            return_weights=return_weights,
        )

    def extra_repr(self) -> str:
        heads = "shared" if self.num_heads is None else f"num_heads={self.num_heads}"
        return (
            f"max_distance={self.max_distance}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, {heads}"
        )
