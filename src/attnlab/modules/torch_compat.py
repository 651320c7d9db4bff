"""`MultiheadAttention`: a drop-in for `torch.nn.MultiheadAttention` running on attnlab's attention.

Its public name is ``attnlab.nn.MultiheadAttention`` (the ``attnlab.nn`` namespace mirrors
``torch.nn``); attnlab's own module is ``attnlab.MultiHeadAttention`` (`attnlab.modules.mha`).
The old spellings ``attnlab.MultiheadAttention`` and ``attnlab.modules.MultiheadAttention`` are
kept for one release (`deprecated_alias`).

Same constructor, parameter names (so state dicts load both ways), forward signature, mask dialect
(``key_padding_mask`` True = ignore; bool ``attn_mask`` True = not allowed; float masks additive)
and outputs. The one deliberate difference: a query that may attend to nothing returns zeros and
zero weights where torch returns NaN (pytorch #41508, #160064).

Bad inputs raise torch's exception types with the wording of torch's Python checks, in torch's
order and before any projection: `ShapeAssertionError` where torch raises AssertionError,
`ShapeRuntimeError` where it raises RuntimeError (both also ValueError), `MaskDtypeError`
(AssertionError and TypeError) for a mask neither bool nor float. Where torch would take its fused
inference path (which the drop-in never calls) torch leaves shape checks to its C++ kernel, which
raises RuntimeError: the drop-in raises `ShapeRuntimeError` there.

torch's `nn.TransformerEncoderLayer` (and `nn.TransformerEncoder`) have their own fused inference
path: in eval mode without grad they call the attention module's `merge_masks` and then torch's
fused kernel on its weights, never its ``forward``. The drop-in provides `merge_masks`, so such
layers run (with torch's results, NaN rows included), and says so once with a `UserWarning`;
``torch.backends.mha.set_fastpath_enabled(False)`` makes them call the drop-in's ``forward``.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._shapes import check_int, check_probability
from ..functional import attention
from ..functional.registry import check_backend_name


class ShapeAssertionError(ValueError, AssertionError):
    """A bad input shape where `torch.nn.MultiheadAttention` raises AssertionError (ranks of
    query/key/value and the masks, the embedding dim, key vs value, key_padding_mask ``(N, S)``):
    code that catches torch's AssertionError, or attnlab's ValueError, catches it."""


class ShapeRuntimeError(ValueError, RuntimeError):
    """A bad input shape where `torch.nn.MultiheadAttention` raises RuntimeError (an attn_mask
    that is not ``(L, S)`` or ``(N·num_heads, L, S)``, a key batch that is not query's)."""


class MaskDtypeError(TypeError, AssertionError):
    """A mask that is neither bool nor float: AssertionError in torch, TypeError in attnlab."""


def _check_mask_dtypes(key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> None:
    """torch's `F._canonical_mask` check (before the shape checks, as in torch)."""
    for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if m is not None and m.dtype != torch.bool and not m.is_floating_point():
            raise MaskDtypeError(
                f"only bool and floating types of {name} are supported: {name} must be bool "
                f"(True = not allowed) or an additive float mask, got {m.dtype}"
            )


def _check_shapes(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    num_heads: int,
    error: type[ValueError],
) -> None:
    """torch's `F._mha_shape_check`: the ranks of every input (before any work).

    Raises:
        error: `ShapeAssertionError` (torch's Python path) or `ShapeRuntimeError` (where torch
            would take its fused path, whose C++ checks raise RuntimeError), with the message of
            torch's Python path naming the shapes received.
    """
    r = query.dim()
    if r not in (2, 3):
        raise ShapeAssertionError(
            f"query should be unbatched 2D or batched 3D tensor but received {r}-D query "
            f"tensor: query must be (L, E) unbatched or 3-D batched, got shape "
            f"{tuple(query.shape)}"
        )
    kind = "For batched (3-D) `query`" if r == 3 else "For unbatched (2-D) `query`"
    if key.dim() != r or value.dim() != r:
        raise error(
            f"{kind}, expected `key` and `value` to be {r}-D but found {key.dim()}-D and "
            f"{value.dim()}-D tensors respectively: key and value must have the rank of query "
            f"({r}-D), got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != r - 1:
        raise error(
            f"{kind}, expected `key_padding_mask` to be `None` or {r - 1}-D but found "
            f"{key_padding_mask.dim()}-D tensor instead (shape {tuple(key_padding_mask.shape)})"
        )
    if attn_mask is not None:
        if attn_mask.dim() not in (2, 3):
            raise error(
                f"{kind}, expected `attn_mask` to be `None`, 2-D or 3-D but found "
                f"{attn_mask.dim()}-D tensor instead (shape {tuple(attn_mask.shape)})"
            )
        want = (num_heads, query.shape[0], key.shape[0])
        if r == 2 and attn_mask.dim() == 3 and tuple(attn_mask.shape) != want:
            raise error(
                f"Expected `attn_mask` shape to be {want} but got {attn_mask.shape}: attn_mask "
                f"must have shape (L, S) = {want[1:]} or (num_heads, L, S) = {want} for "
                f"unbatched inputs"
            )


def _additive(mask: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    """torch's dialect → additive float: bool True (= not allowed) becomes −inf."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
    if not mask.is_floating_point():
        raise TypeError(f"{name} must be bool or float, got {mask.dtype}")
    return mask.to(dtype)


def _is_float(mask: Tensor | None) -> bool:
    return mask is not None and torch.is_floating_point(mask)


FUSED_LAYER_WARNING = (
    "attnlab.nn.MultiheadAttention: torch's TransformerEncoderLayer fast path runs torch's fused "
    "kernel on this module's weights, not attnlab's attention (rows with nothing to attend are "
    "NaN there); call torch.backends.mha.set_fastpath_enabled(False) to run attnlab"
)
_warned_fused = False
# torch's own method, taken before anyone patches nn.MultiheadAttention with the drop-in
_torch_merge_masks = nn.MultiheadAttention.merge_masks


class MultiheadAttention(nn.Module):
    """Drop-in replacement for `torch.nn.MultiheadAttention` (same arguments and state dict).

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn: exactly as in torch.
        kdim, vdim, batch_first, device, dtype: exactly as in torch.
        backend: the `attnlab.attention` backend (keyword only; not in torch).

    Example:
        >>> theirs = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        >>> ours = MultiheadAttention(64, 4, batch_first=True)
        >>> ours.load_state_dict(theirs.state_dict())
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            check_int(name, value, minimum=1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout = check_probability("dropout", dropout)
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.backend = check_backend_name(backend)
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **kw))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **kw))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(E)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b = self.in_proj_bias.split(E) if self.in_proj_bias is not None else (None, None, None)
        return F.linear(query, w_q, b[0]), F.linear(key, w_k, b[1]), F.linear(value, w_v, b[2])

    def _torch_fast_path(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
    ) -> bool:
        """Whether torch 2.x's MultiheadAttention would run its fused inference path here.

        Mirrors the checks of `torch.nn.MultiheadAttention.forward` (torch 2.13). It matters for
        one thing only: that path ignores ``is_causal`` (it always uses ``attn_mask``), while the
        other path replaces ``attn_mask`` by the causal mask when it may (see `forward`).
        """
        params = (self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias)
        tensors = (query, key, value, *params)
        allowed_devices = ("cpu", "cuda", torch._C._get_privateuse1_backend_name())  # noqa: SLF001 (torch's own check uses this name)
        return not (
            _is_float(attn_mask)
            or _is_float(key_padding_mask)
            or not torch.backends.mha.get_fastpath_enabled()
            or query.dim() != 3
            or query is not key
            or key is not value
            or self.in_proj_weight is None
            or self.in_proj_bias is None  # torch then falls back to the other path
            or query.dtype != self.in_proj_weight.dtype
            or query.dtype != self.in_proj_bias.dtype
            or self.training
            or self.num_heads % 2
            or not self.batch_first
            or self.bias_k is not None
            or self.add_zero_attn
            or not self._qkv_same_embed_dim
            or torch.is_autocast_enabled()
            or torch.overrides.has_torch_function(tensors)
            or any(t is not None and t.device.type not in allowed_devices for t in tensors)
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
        )

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """torch's `nn.MultiheadAttention.merge_masks`: one mask for torch's fused kernel.

        Only torch's `nn.TransformerEncoderLayer` fast path calls it, right before it runs torch's
        fused kernel on this module's weights instead of `forward`: the first call warns once
        (`FUSED_LAYER_WARNING`).

        Args:
            attn_mask: ``(L, L)`` or ``(N·num_heads, L, L)``, or None.
            key_padding_mask: ``(N, L)``, or None.
            query: ``(N, L, E)``.

        Returns:
            ``(mask, kind)``: kind 0 = attn_mask, 1 = key_padding_mask, 2 = both as one
            ``(N, num_heads, L, L)`` mask; ``(None, None)`` without masks.
        """
        global _warned_fused
        if not _warned_fused:
            _warned_fused = True
            warnings.warn(FUSED_LAYER_WARNING, UserWarning, stacklevel=2)
        return _torch_merge_masks(self, attn_mask, key_padding_mask, query)  # type: ignore[arg-type]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Same as `torch.nn.MultiheadAttention.forward`.

        Args:
            query: ``(L, N, E)``, ``(N, L, E)`` with batch_first, or unbatched ``(L, E)``.
            key: ``(S, N, kdim)`` (likewise). value: ``(S, N, vdim)``.
            key_padding_mask: ``(N, S)`` (``(S,)`` unbatched); bool True = ignore, or additive.
            need_weights: return the weights too.
            attn_mask: ``(L, S)`` or ``(N·num_heads, L, S)``; bool True = not allowed, or additive.
            average_attn_weights: average the returned weights over heads.
            is_causal: torch's hint that ``attn_mask`` is the causal mask, followed exactly as
                torch 2.13 does: torch's fused inference path (eval mode, no grad, self-attention
                with ``query is key is value``, batch_first, even num_heads, bool or no masks, ...)
                ignores the hint and uses ``attn_mask``; otherwise, when no key_padding_mask is
                given and weights are not needed, the top-left causal mask over the final keys
                replaces ``attn_mask``, and in every other case ``attn_mask`` is used. A wrong
                hint therefore gives different results on the two paths, in torch as here.

        Returns:
            ``(attn_output, attn_weights or None)`` shaped as torch's.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        # torch's checks, in torch's order and with its exception types, before any work
        _check_mask_dtypes(key_padding_mask, attn_mask)
        fast = self._torch_fast_path(query, key, value, attn_mask, key_padding_mask)
        # torch's fused path leaves shape checks to its C++ kernel: RuntimeError, not Assertion
        asserted = ShapeRuntimeError if fast else ShapeAssertionError
        _check_shapes(query, key, value, key_padding_mask, attn_mask, self.num_heads, asserted)
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # (L|S, N, ·)
        if is_causal and attn_mask is None and not fast:  # torch's fused path ignores is_causal
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        # torch's contract: with this hint, the top-left causal mask over the final keys replaces
        # attn_mask when no padding mask is given and no weights are needed, except on torch's
        # fused inference path, which always uses attn_mask. The replaced mask is not read, so
        # (as in torch) its shape is not checked.
        causal_hint = is_causal and not fast and key_padding_mask is None and not need_weights
        self._check_sizes(
            query, key, value, key_padding_mask, None if causal_hint else attn_mask, asserted
        )
        q, k, v = self._project(query, key, value)  # (L, N, E), (S, N, E), (S, N, E)
        q, k, v, mask = self._heads_and_mask(
            q, k, v, None if causal_hint else attn_mask, key_padding_mask, causal_hint, query.dtype
        )
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:  # auto picks a backend that returns weights
            out, weights = attention(q, k, v, mask=mask, dropout_p=dropout_p, return_weights=True)
        else:
            out = attention(q, k, v, mask=mask, dropout_p=dropout_p, backend=self.backend)
            weights = None
        return self._output(out, weights, batched, average_attn_weights)

    def _check_sizes(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        asserted: type[Exception],
    ) -> None:
        """torch's size checks on ``(L|S, N, ·)`` inputs, in torch's order and exception types
        (``attn_mask`` None when the causal hint replaces it: then its shape is not read)."""
        L, N, E = query.shape
        S = key.shape[0]
        H = self.num_heads
        if self.embed_dim != E:
            raise asserted(
                f"was expecting embedding dimension of {self.embed_dim}, but got {E}: query "
                f"embed dim must be {self.embed_dim}, got {E} (query {tuple(query.shape)} as "
                f"(L, N, E))"
            )
        same = key.shape == value.shape if self._qkv_same_embed_dim else None
        if same is False or key.shape[:2] != value.shape[:2]:
            torch_says = (
                f"key shape {key.shape} does not match value shape {value.shape}"
                if same is False
                else f"key's sequence and batch dims {key.shape[:2]} do not match value's "
                f"{value.shape[:2]}"
            )
            raise asserted(
                f"{torch_says}: key {tuple(key.shape)} and value {tuple(value.shape)} must share "
                f"(S, N) with N={N} from query"
            )
        if key.shape[1] != N:
            raise ShapeRuntimeError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must share (S, N) with "
                f"N={N} from query {tuple(query.shape)} (as (L|S, N, E))"
            )
        if attn_mask is not None:
            want = ((L, S), (N * H, L, S))
            got = tuple(attn_mask.shape)
            if got != want[attn_mask.dim() - 2]:
                raise ShapeRuntimeError(
                    f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but "
                    f"should be {want[attn_mask.dim() - 2]}. attn_mask must have shape (L, S) = "
                    f"{want[0]} or (N·num_heads, L, S) = {want[1]}, got {got}"
                )
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (N, S):
            i = 0 if key_padding_mask.shape[0] != N else 1
            raise asserted(
                f"Expected key_padded_mask.shape[{i}] to be {(N, S)[i]}, but got "
                f"{key_padding_mask.shape[i]}: key_padding_mask must have shape (N, S) = "
                f"{(N, S)}, got {tuple(key_padding_mask.shape)}"
            )

    def _heads_and_mask(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        causal_hint: bool,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The projected ``(L|S, N, E)`` inputs as heads ``(N, H, L|S', D)`` and torch's masks
        as one additive ``(N|1, H|1, L, S')`` mask (bias_k/v and the zero key appended)."""
        L, N, E = q.shape
        S = k.shape[0]
        H, D = self.num_heads, self.head_dim
        add = None if attn_mask is None else _additive(attn_mask, "attn_mask", dtype)
        add = None if add is None else add.view(-1, add.shape[-2], S)  # (1|N·H, L, S)
        kpm = (
            None
            if key_padding_mask is None
            else _additive(key_padding_mask, "key_padding_mask", dtype)
        )
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(1, N, E)])  # (S+1, N, E)
            v = torch.cat([v, self.bias_v.expand(1, N, E)])
            add = None if add is None else F.pad(add, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        q = q.view(L, N, H, D).permute(1, 2, 0, 3)  # (N, H, L, D)
        k = k.view(k.shape[0], N, H, D).permute(1, 2, 0, 3)  # (N, H, S', D)
        v = v.view(v.shape[0], N, H, D).permute(1, 2, 0, 3)  # (N, H, S', D)
        if self.add_zero_attn:
            k = F.pad(k, (0, 0, 0, 1))  # (N, H, S'+1, D)
            v = F.pad(v, (0, 0, 0, 1))
            add = None if add is None else F.pad(add, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        if causal_hint:
            S_final = k.shape[2]
            add = _additive(
                torch.ones(L, S_final, dtype=torch.bool, device=q.device).triu(1), "", dtype
            )
            add = add.unsqueeze(0)  # (1, L, S')
        mask = None
        if add is not None:
            mask = add.view(N, H, L, -1) if add.shape[0] > 1 else add.view(1, 1, L, -1)
        if kpm is not None:
            kpm = kpm.view(N, 1, 1, -1)  # (N, 1, 1, S')
            mask = kpm if mask is None else mask + kpm
        return q, k, v, mask

    def _output(
        self, out: Tensor, weights: Tensor | None, batched: bool, average_attn_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``out (N, H, L, D)`` projected to torch's layout; the weights averaged if asked."""
        N, _, L, _ = out.shape
        out = out.permute(2, 0, 1, 3).reshape(L, N, -1)  # (L, N, E)
        out = self.out_proj(out)
        if self.batch_first and batched:
            out = out.transpose(0, 1)  # (N, L, E)
        if not batched:
            out = out.squeeze(1)  # (L, E)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (N, L, S')
            if not batched:
                weights = weights.squeeze(0)
        return out, weights


#: The spellings `deprecated_alias` has warned about in this process (each warns once).
_warned_aliases: set[str] = set()


def deprecated_alias(old: str) -> type[MultiheadAttention]:
    """`MultiheadAttention` reached by its old spelling ``old``, kept for one release.

    The first use of each spelling in a process warns with a `FutureWarning` (what PyTorch
    raises for its renamed APIs, shown by default) naming ``attnlab.nn.MultiheadAttention``;
    the class returned is the same one, so ``isinstance`` and state dicts are unaffected.

    Args:
        old: the spelling used, e.g. ``"attnlab.MultiheadAttention"``.
    """
    if old not in _warned_aliases:
        _warned_aliases.add(old)
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release: use "
            "attnlab.nn.MultiheadAttention, the drop-in for torch.nn.MultiheadAttention "
            "(attnlab's own module is attnlab.MultiHeadAttention)",
            FutureWarning,
            stacklevel=3,  # the caller of the module's __getattr__
        )
    return MultiheadAttention
