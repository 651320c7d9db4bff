"""Adaptive attention span (Sukhbaatar et al., 2019): a learned soft span per head.

Head h attends keys at distance ``x = i − j`` (causal) with the softmax weight multiplied by the
ramp ``m_{z_h}(x) = clamp((R + z_h − x) / R, 0, 1)`` and renormalised:

    a_ij = m(i − j) exp(s_ij) / Σ_k m(i − k) exp(s_ik)

(`functional.reference.adaptive_span_attention`). A penalty ``λ Σ_h z_h`` added to the loss
shrinks every span the task does not need.

Fast path: ``m · e^s = e^{s + log m}``, so the ramp is an additive bias ``log m`` (−inf where
m = 0) for the ordinary attention call, and every key farther than the largest span is outside
the causal ``sliding_window(span)`` with ``span = max_h ⌈z_h + R⌉`` — a Python int, so the tiled
backend skips those tiles from the mask's block map. ``span`` is refreshed by `refresh_span`
(after ``optimizer.step()``), never inside ``forward``: the plan never depends on tensor values
and ``forward`` makes no host synchronisation (``torch.compile(fullgraph=True)`` traces it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number
from ..functional import attention
from ..functional.reference import span_ramp
from ..functional.registry import check_backend_name
from ..masks import Mask, sliding_window


def span_log_mask(z: Tensor, L: int, S: int, ramp: float) -> Tensor:
    """The additive bias ``log m_{z_h}(i' − j)`` of adaptive span, ``(1, H, L, S)``.

    ``i' = i + S − L`` (bottom-right); −inf where ``m = 0`` or ``j > i'``. Adding it to the logits
    gives exactly the weights ``m e^s / Σ m e^s`` of `reference.adaptive_span_attention`. The
    gradient in z is ``1/(R + z − x)`` on the ramp, 0 elsewhere (never NaN: ``log`` only sees
    m > 0).

    Args:
        z: ``(H,)`` spans. L, S: query and key lengths. ramp: R > 0.

    Returns:
        ``(1, H, L, S)`` in z's dtype.
    """
    # every distance i' − j = i + S − L − j occurs on a diagonal: log m of the L + S − 1
    # distances t + 1 − L (t = 0 … L + S − 2), then the Toeplitz matrix by a strided view
    # (unfold) and one flip, so the (H, L, S) tensor costs one copy and its gradient one sum
    # per diagonal
    if L == 0 or S == 0:
        return (z[:, None, None] * 0).expand(z.shape[0], L, S).unsqueeze(0)  # empty
    x = (torch.arange(L + S - 1, device=z.device) + (1 - L)).to(z.dtype)  # (L + S − 1,)
    m = span_ramp(x, z[:, None], ramp)  # (H, L + S − 1)
    live = (m > 0) & (x >= 0)
    logm = torch.log(torch.where(live, m, 1.0))  # no log(0): its gradient would be NaN
    u = torch.where(live, logm, float("-inf"))  # (H, L + S − 1): u[t] = log m(t + 1 − L)
    toeplitz = u.unfold(-1, S, 1)  # (H, L, S): toeplitz[h, i, S − 1 − j] = log m(i' − j)
    return toeplitz.flip(-1).unsqueeze(0)  # (1, H, L, S)


class SpanLogMask:
    """`span_log_mask` as a relative bias function ``fn(b, h, i, j)`` (no gradient in z).

    Depends only on the head and ``i − j`` (``relative = True``), so the tiled backend evaluates
    it per tile inside the window and never holds the ``(H, L, S)`` bias. Used by
    `AdaptiveSpan.forward` when z needs no gradient (inference, ``torch.no_grad()``).

    Args:
        z: ``(H,)`` spans (detached). ramp: R > 0.
    """

    relative = True

    def __init__(self, z: Tensor, ramp: float) -> None:
        self.z, self.ramp, self.num_heads = z, ramp, int(z.shape[0])

    def __call__(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:  # noqa: ARG002 (a bias function is fn(b, h, i, j))
        x = (i - j).to(self.z.dtype)
        m = span_ramp(x, self.z[h], self.ramp)  # broadcast of (h, i, j)
        live = (m > 0) & (x >= 0)
        return torch.where(live, torch.log(torch.where(live, m, 1.0)), float("-inf"))


class AdaptiveSpan(nn.Module):
    """The learned spans ``z (H,)`` and the causal attention over them, on given q, k, v.

    Args:
        num_heads: H (one span per query head).
        max_span: S_max, the largest span; z is kept in ``[0, S_max]`` by `refresh_span`.
        ramp: R > 0, the ramp width (the paper uses 32).
        init_span: the initial z of every head (default ``max_span``).
        backend: the `attnlab.attention` backend (``"flash"`` skips the tiles beyond ``span``).

    Attributes:
        z: ``nn.Parameter (H,)``, the spans.
        span: Python int ``max_h ⌈z_h + R⌉`` (at least 1) at the last `refresh_span`: the
            sliding window that bounds every head's keys.

    ``forward`` uses ``z`` clamped to ``[0, span − R]``, so the window never cuts a key the ramp
    weights: if z grew since the last refresh, the call equals the reference at the clamped z.

    Example:
        >>> span = AdaptiveSpan(4, max_span=64, ramp=8, init_span=16)
        >>> q = k = v = torch.randn(2, 4, 50, 8)
        >>> span(q, k, v).shape, span.span
        (torch.Size([2, 4, 50, 8]), 24)
    """

    def __init__(
        self,
        num_heads: int,
        max_span: int,
        *,
        ramp: float = 32.0,
        init_span: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.max_span = check_int("max_span", max_span, minimum=1)
        self.ramp = check_number("ramp", ramp, positive=True)
        init = float(max_span) if init_span is None else init_span
        ok = isinstance(init, (int, float)) and not isinstance(init, bool)
        if not ok or not 0 <= init <= max_span:
            raise ValueError(
                f"init_span must be a number in [0, max_span={max_span}], got {init!r}"
            )
        self.backend = check_backend_name(backend)
        self.z = nn.Parameter(torch.full((num_heads,), float(init)))
        self.span = 1
        self.refresh_span()

    @torch.no_grad()
    def refresh_span(self) -> int:
        """Clamps z to ``[0, S_max]`` and sets ``span = max_h ⌈z_h + R⌉`` (a host sync: call it
        outside forward, e.g. after ``optimizer.step()``). Returns the new span.

        Raises:
            ValueError: z holds NaN (a diverged step), naming the values.
        """
        top = float(self.z.max())
        if math.isnan(top):
            raise ValueError(f"z must be finite to refresh the span, got {self.z.tolist()}")
        self.z.clamp_(0.0, float(self.max_span))
        top = float(self.z.max())
        self.span = max(1, math.ceil(top + self.ramp))
        return self.span

    def mask(self) -> Mask:
        """The causal ``sliding_window(span)``: keys ``i' − span < j <= i'``."""
        return sliding_window(self.span)

    def effective_z(self) -> Tensor:
        """z clamped to ``[0, span − R]`` (what forward uses), ``(H,)``."""
        return self.z.clamp(0.0, max(0.0, self.span - self.ramp))

    def log_mask(self, L: int, S: int) -> Tensor:
        """`span_log_mask` of the effective z: ``(1, H, L, S)``."""
        return span_log_mask(self.effective_z(), L, S, self.ramp)

    def penalty(self, weight: float) -> Tensor:
        """The L1 span penalty ``λ Σ_h z_h`` (a 0-d tensor to add to the loss)."""
        return weight * self.z.sum()

    def spans(self) -> Tensor:
        """The current spans ``z (H,)``, detached."""
        return self.z.detach().clone()

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal adaptive-span attention ``(B, H, L, Dv)``.

        ``attention(q, k, v, mask=sliding_window(span), bias=log m)`` — equal to
        `reference.adaptive_span_attention(q, k, v, effective_z(), ramp=R)`. With a gradient
        for z the bias is the ``(1, H, L, S)`` tensor `log_mask` (flash returns its gradient);
        otherwise the relative bias function `SpanLogMask`, evaluated per tile inside the
        window (O(tile) memory; under ``torch.compile`` flash takes no bias function, and
        ``backend="auto"`` renders it for sdpa).

        Args:
            q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        """
        if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[1] != self.num_heads:
            got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
            raise ValueError(
                f"q must be (B, H, L, D) with H = num_heads = {self.num_heads}, got {got}"
            )
        if not isinstance(k, Tensor) or k.dim() != 4:
            got = tuple(k.shape) if isinstance(k, Tensor) else type(k).__name__
            raise ValueError(f"k must be (B, H_kv, S, D), got {got}")
        L, S = q.shape[2], k.shape[2]
        bias: Tensor | SpanLogMask
        if torch.is_grad_enabled() and self.z.requires_grad:
            bias = self.log_mask(L, S).to(q.dtype)  # (1, H, L, S): its gradient reaches z
        else:
            bias = SpanLogMask(self.effective_z().detach(), self.ramp)  # per tile, no L×S
        out = attention(q, k, v, mask=self.mask(), bias=bias, backend=self.backend)
        assert isinstance(out, Tensor)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, max_span={self.max_span}, ramp={self.ramp}, "
            f"span={self.span}, backend={self.backend!r}"
        )


class AdaptiveSpanAttention(nn.Module):
    """Causal multi-head self-attention with adaptive spans: projections around `AdaptiveSpan`.

    ``out = W_o · concat_h AdaptiveSpan(x W_q^h, x W_k^h, x W_v^h)``.

    Args:
        embed_dim: E (``E % num_heads == 0``). num_heads: H.
        max_span, ramp, init_span, backend: as in `AdaptiveSpan`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_span: int,
        *,
        ramp: float = 32.0,
        init_span: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_int("embed_dim", embed_dim, minimum=1)
        check_int("num_heads", num_heads, minimum=1)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim}, "
                f"num_heads={num_heads}"
            )
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)
        self.span = AdaptiveSpan(
            num_heads, max_span, ramp=ramp, init_span=init_span, backend=backend
        )

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E) -> (B, L, E)``."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be (B, L, E) with E = {self.embed_dim}, got {got}")
        B, L, E = x.shape
        qkv = self.qkv(x).view(B, L, 3, self.num_heads, E // self.num_heads)  # (B, L, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, L, D)
        o = self.span(q, k, v)  # (B, H, L, D)
        return self.out(o.transpose(1, 2).reshape(B, L, E))  # (B, L, E)


__all__ = ["AdaptiveSpan", "AdaptiveSpanAttention", "SpanLogMask", "span_log_mask"]
