"""Multi-head latent attention (MLA; DeepSeek-AI, 2024, "DeepSeek-V2", §2.1; DeepSeek-V3).

Queries and keys/values are compressed to low-rank latents; every head's key and value is an
up-projection of one latent ``c_j`` per token, plus a decoupled rotary key ``r_j`` shared by all
heads (q/k head dim ``Dn + R`` ≠ v head dim ``Dv``)::

    c_j = RMSNorm(W_DKV · x_j)                       (C = kv_lora_rank)
    r_j = RoPE(W_KR · x_j, j)                        (R = qk_rope_head_dim)
    k_hj = [W_UK[h] · c_j ; r_j],  v_hj = W_UV[h] · c_j
    o_i = W_O · concat_h Σ_j softmax_j(scale · ⟨q_hi, k_hj⟩) · v_hj

Prefill (no cache) expands the keys and values and calls `attnlab.attention`. With a
`LatentCache` the module stores only ``c_j`` and ``r_j`` and decodes in the absorbed form,
``W_UK`` folded into the query and ``W_UV`` applied after the weighted sum::

    q̃_hi = W_UK[h]ᵀ · q_nope_hi                      (C)
    õ_hi = softmax_j(scale · (q̃_hi · c_j + q_rope_hi · r_j)) · c_j
    o_hi = W_UV[h] · õ_hi

which is multi-query attention over the cached ``[c_j ; r_j]`` with value ``c_j``
(`absorbed_latent_attention`; definition: `attnlab.functional.reference.latent_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number
from ..functional import attention, nan_rule
from ..functional.decode import DECODE_MAX_L
from ..masks import Mask
from ..positional.rope import RoPE
from .kv_cache import LatentCache, LatentView, check_cache_positions


class LatentRMSNorm(nn.Module):
    """RMSNorm as DeepSeek's checkpoints compute it: ``w · (x / √(mean(x²) + ε))``, the
    normalisation in float32 and rounded to x's dtype before the weight multiplies."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(check_int("dim", dim, minimum=1)))
        self.eps = check_number("eps", eps, greater=0.0)

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        h = x.to(dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}"


def _absorbed(
    q_nope: Tensor,
    q_rope: Tensor,
    joint: Tensor,
    rank: int,
    w_uk: Tensor,
    w_uv: Tensor,
    mask: Mask | Tensor | None,
    scale: float,
    w_uk_t: Tensor | None = None,
) -> Tensor:
    """The absorbed form over ``joint = [c ; r]`` ``(B, S, C + R)`` (C = ``rank``).

    ``w_uk_t``: ``W_UKᵀ`` ``(H, C, Dn)`` contiguous (the module's copy,
    `MultiHeadLatentAttention.absorbed_query_weight`), or None to read ``w_uk`` in place. The
    one key head is handed to `attnlab.attention` as P views (`key_head_views`), so the decode
    kernel spreads the H query heads over its threads.
    """
    B, S, W = joint.shape
    # q̃ = W_UKᵀ q_nope per head: (B, H, L, C)
    q_abs = _per_head(q_nope, w_uk) if w_uk_t is None else _per_head_t(w_uk_t, q_nope)
    q = torch.cat((q_abs, q_rope), dim=-1)  # (B, H, L, C + R)
    P = key_head_views(q, joint)
    k = joint.unsqueeze(1).expand(B, P, S, W)  # (B, P, S, C + R): views of one key head (MQA)
    v = k[..., :rank]  # (B, P, S, C): the latent is the value
    o = attention(q, k, v, mask=mask, scale=scale)  # (B, H, L, C)
    return _per_head_t(w_uv, o)  # (B, H, L, Dv)


def key_head_views(q: Tensor, joint: Tensor) -> int:
    """How many views P of the latent's one key head the absorbed step passes to `attention`.

    The decode backend's C++ step (`attnlab.functional.decode`) runs one task per (item, key
    head), each reading its keys once for the G = H / P query heads that share them: with one
    key head and B = 1 it would run the 128 heads of DeepSeek-V3 on one thread. P identical
    views ``(B, P, S, C + R)`` of the same cache (stride 0, no copy) give it ``B · P`` tasks,
    one per thread, with the same result (grouped-query attention over equal key heads). P is
    the largest divisor of H with ``B · P <= torch.get_num_threads()`` and ``H / P >= 8`` rows
    per task; 1 wherever that kernel cannot run (``torch.compile``, autograd, more than
    `DECODE_MAX_L` query rows, float64, no C++ operators), so those calls see one key head. (A
    decode-sized call whose mask sends it to another backend sees P equal key heads, which it
    runs as grouped-query attention: the same result.)
    """
    B, H, L, _ = q.shape
    if L > DECODE_MAX_L or q.dtype == torch.float64 or not nan_rule.ext_ready(q, joint):
        return 1
    most = min(torch.get_num_threads() // max(B, 1), H // _MIN_ROWS_PER_TASK)
    return max((p for p in range(1, most + 1) if H % p == 0), default=1)


_MIN_ROWS_PER_TASK = 8
"""`key_head_views` keeps at least this many query heads on each task (each key row read from
memory serves them all)."""


def _per_head(x: Tensor, w: Tensor) -> Tensor:
    """``x[b, h] @ w[h]`` for x ``(B, H, L, I)`` and w ``(H, I, O)``: one batched matmul over
    the heads (torch.einsum takes milliseconds on this pattern on CPU)."""
    B, H, L, _ = x.shape
    y = x.transpose(0, 1).reshape(H, B * L, -1) @ w  # (H, B·L, O)
    return y.view(H, B, L, -1).transpose(0, 1)  # (B, H, L, O)


def _per_head_t(w: Tensor, x: Tensor) -> Tensor:
    """``w[h] @ x[b, h, l]`` for w ``(H, O, I)`` (rows contiguous) and x ``(B, H, L, I)``:
    ``(B, H, L, O)``. One batched product ``(H, O, I) @ (H, I, B·L)``, each weight row read
    once in order: for the B·L of a decode step a matrix–vector product per head, about 1.5×
    faster than ``x @ wᵀ`` on CPU (measured at DeepSeek-V3's shapes)."""
    B, H, L, _ = x.shape
    y = w @ x.permute(1, 3, 0, 2).reshape(H, -1, B * L)  # (H, O, B·L)
    return y.view(H, -1, B, L).permute(2, 0, 3, 1)  # (B, H, L, O)


def absorbed_latent_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    k_rope: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Multi-head latent attention with the up-projections absorbed (no per-head K/V formed).

    ``o_h = W_UV[h] · softmax(scale · (q_nope_h W_UK[h] · cᵀ + q_rope_h · rᵀ)) · c``: multi-query
    attention through `attnlab.attention` with the query ``[q_nope_h W_UK[h] ; q_rope_h]``
    ``(B, H, L, C + R)``, one key head ``[c ; r]`` and the latent as value. Equals
    `attnlab.functional.reference.latent_attention` (same signature), which expands
    ``k_h = [c W_UK[h]ᵀ ; r]`` and ``v_h = c W_UV[h]ᵀ``. Differentiable; masks, the NaN rule and
    zeros for rows with no key are `attnlab.attention`'s.

    Args:
        q_nope: ``(B, H, L, Dn)``. q_rope: ``(B, H, L, R)`` (rotated).
        latent: ``(B, S, C)``. k_rope: ``(B, S, R)`` (rotated, shared by the heads).
        w_uk: ``(H, Dn, C)``. w_uv: ``(H, Dv, C)``.
        mask: `Mask` or bool (True = may attend) broadcastable to ``(B, H, L, S)``,
            bottom-right aligned.
        scale: logit scale, default ``1/√(Dn + R)`` (the expanded head dim, not C + R).

    Returns:
        ``(B, H, L, Dv)``.
    """
    _check_latent_inputs(q_nope, q_rope, latent, k_rope, w_uk, w_uv)
    if scale is None:
        scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
    joint = torch.cat((latent, k_rope), dim=-1)  # (B, S, C + R)
    return _absorbed(q_nope, q_rope, joint, latent.shape[-1], w_uk, w_uv, mask, float(scale))


def _check_latent_inputs(
    q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, w_uk: Tensor, w_uv: Tensor
) -> None:
    named = {"q_nope": q_nope, "q_rope": q_rope, "latent": latent, "k_rope": k_rope}
    named.update(w_uk=w_uk, w_uv=w_uv)
    ranks = {"q_nope": 4, "q_rope": 4, "latent": 3, "k_rope": 3, "w_uk": 3, "w_uv": 3}
    for name, t in named.items():
        if not isinstance(t, Tensor) or t.dim() != ranks[name]:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {ranks[name]}-D tensor, got {got}")
    B, H, L, Dn = q_nope.shape
    C = latent.shape[-1]
    want = {
        "q_rope": (B, H, L, k_rope.shape[-1]),
        "k_rope": (B, latent.shape[1], q_rope.shape[-1]),
        "w_uk": (H, Dn, C),
        "w_uv": (H, w_uv.shape[1], C),
    }
    for name, shape in want.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(
                f"{name} must be {shape} to match q_nope {tuple(q_nope.shape)} and latent "
                f"{tuple(latent.shape)}, got {tuple(named[name].shape)}"
            )
    if latent.shape[0] != B:
        raise ValueError(f"latent must have batch {B} (q_nope's), got {tuple(latent.shape)}")


def softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, object] | None) -> float:
    """DeepSeek's logit scale: ``(Dn + R)^(−1/2)``, times ``mscale²`` for a scaled RoPE with
    ``mscale_all_dim`` (YaRN: ``mscale = 0.1 · mscale_all_dim · ln(factor) + 1`` if factor > 1)."""
    scale = qk_head_dim**-0.5
    if rope_scaling is None:
        return scale
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    m_all = rope_scaling.get("mscale_all_dim", 0)
    if rope_type != "default" and m_all:
        factor = float(rope_scaling["factor"])  # type: ignore[arg-type]
        m = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0  # type: ignore[arg-type]
        scale *= m * m
    return scale


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (see the module docstring for the formula).

    Parameter names follow transformers' ``DeepseekV3Attention``, so its ``state_dict`` loads
    as is (`from_config` builds the matching module).

    Args:
        embed_dim: E. num_heads: H.
        kv_lora_rank: C, the key/value latent's rank.
        qk_nope_head_dim: Dn, the query/key dims without position.
        qk_rope_head_dim: R, the decoupled rotary dims (even).
        v_head_dim: Dv.
        q_lora_rank: the query latent's rank, or None for a full-rank query projection.
        bias: biases on the down-projections and the output projection (``attention_bias``).
        rope_base: RoPE's θ. rope_scaling: an HF-style scaling dict (e.g. YaRN) or None.
        rope_interleaved: pair dims ``(2i, 2i + 1)`` (DeepSeek's ``rope_interleave``) or rotate
            half.
        norm_eps: the latents' RMSNorm ε.

    Raises:
        ValueError: a non-positive size, an odd ``qk_rope_head_dim``, a RoPE scaling whose
            frequencies depend on the sequence length (cached rotary keys are stored rotated).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        rope_base: float = 10000.0,
        rope_scaling: Mapping[str, object] | None = None,
        rope_interleaved: bool = True,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        E = self.embed_dim = check_int("embed_dim", embed_dim, minimum=1)
        H = self.num_heads = check_int("num_heads", num_heads, minimum=1)
        C = self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, minimum=1)
        Dn = self.qk_nope_head_dim = check_int("qk_nope_head_dim", qk_nope_head_dim, minimum=1)
        R = self.qk_rope_head_dim = check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=2)
        Dv = self.v_head_dim = check_int("v_head_dim", v_head_dim, minimum=1)
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(E, H * (Dn + R), bias=False)
        else:
            check_int("q_lora_rank", q_lora_rank, minimum=1)
            self.q_a_proj = nn.Linear(E, q_lora_rank, bias=bias)
            self.q_a_layernorm = LatentRMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * (Dn + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(E, C + R, bias=bias)
        self.kv_a_layernorm = LatentRMSNorm(C, norm_eps)
        self.kv_b_proj = nn.Linear(C, H * (Dn + Dv), bias=False)
        self.o_proj = nn.Linear(H * Dv, E, bias=bias)
        self.rope = RoPE(R, rope_base, rope_scaling, interleaved=rope_interleaved)
        if self.rope.depends_on_seq_len:
            raise ValueError(
                "rope_scaling: a LatentCache stores rotary keys rotated, so the RoPE frequencies "
                f"must not depend on the sequence length, got rope_type {self.rope.rope_type!r}"
            )
        self.scale = softmax_scale(Dn + R, rope_scaling)
        self._absorbed: tuple[tuple, Tensor, Tensor] | None = None  # absorbed_query_weight's

    @classmethod
    def from_config(cls, config: object) -> MultiHeadLatentAttention:
        """The module matching a transformers ``DeepseekV3Config`` (read by attribute name)."""
        params = dict(getattr(config, "rope_parameters", None) or {})
        base = float(params.pop("rope_theta", 10000.0))
        scaling = None if params.get("rope_type", "default") == "default" else params
        return cls(
            config.hidden_size,  # type: ignore[attr-defined]
            config.num_attention_heads,  # type: ignore[attr-defined]
            kv_lora_rank=config.kv_lora_rank,  # type: ignore[attr-defined]
            qk_nope_head_dim=config.qk_nope_head_dim,  # type: ignore[attr-defined]
            qk_rope_head_dim=config.qk_rope_head_dim,  # type: ignore[attr-defined]
            v_head_dim=config.v_head_dim,  # type: ignore[attr-defined]
            q_lora_rank=config.q_lora_rank,  # type: ignore[attr-defined]
            bias=bool(getattr(config, "attention_bias", False)),
            rope_base=base,
            rope_scaling=scaling,
            rope_interleaved=bool(getattr(config, "rope_interleave", True)),
        )

    def up_projections(self) -> tuple[Tensor, Tensor]:
        """``(W_UK (H, Dn, C), W_UV (H, Dv, C))``: views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)  # (H, Dn + Dv, C)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def absorbed_query_weight(self) -> Tensor | None:
        """``W_UKᵀ`` ``(H, C, Dn)``, contiguous: the absorbed decode's query up-projection
        ``q̃_h = W_UK[h]ᵀ · q_nope_h`` as one matrix–vector product per head.

        Made from ``kv_b_proj.weight`` on first use and kept until that weight changes: a new
        tensor or storage (``load_state_dict``, ``.to()``), or an in-place change (an optimiser
        step, ``copy_``: the version counter). In-place writes through ``weight.data`` bypass
        the counter; call `forget_absorbed_weights` after them. None, and nothing kept, when the
        weight would take a gradient (training: the step then reads the weight in place, so
        gradients reach it) and under ``torch.compile`` (no Python-side state in a graph).
        """
        w = self.kv_b_proj.weight
        if torch.compiler.is_compiling():
            return None
        if torch.is_grad_enabled() and w.requires_grad:
            self.forget_absorbed_weights()
            return None
        key = (w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape))  # noqa: SLF001
        held = self._absorbed
        if held is None or held[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                w_uk_t = self.up_projections()[0].transpose(1, 2).contiguous()  # (H, C, Dn)
            # the source is kept with its key: its storage cannot be freed and reused at the
            # same address while the key names it
            held = self._absorbed = (key, w.detach(), w_uk_t)
        return held[2]

    def forget_absorbed_weights(self) -> None:
        """Drops the kept `absorbed_query_weight` (made again on the next decode step)."""
        self._absorbed = None

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """What a `LatentCache` keeps per token: ``(C + R) · itemsize`` bytes."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype.itemsize

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, L, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, L, self.num_heads, -1).transpose(1, 2)  # (B, H, L, Dn + R)
        return q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]

    def _check(self, x: object, positions: object, cache: object) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be (B, L, embed_dim={self.embed_dim}), got {got}")
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache or None, got {type(cache).__name__}")
        if cache is not None:
            check_cache_positions(positions if isinstance(positions, Tensor) else None)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        positions: Tensor | int | None = None,
        cache: LatentCache | None = None,
    ) -> Tensor:
        """Self-attention of ``x`` ``(B, L, E)`` → ``(B, L, E)``.

        Args:
            x: the hidden states.
            mask: `Mask` or bool (True = may attend) broadcastable to ``(B, H, L, S)``, S
                counting cached tokens too; bottom-right aligned (``masks.causal()`` for a
                decoder).
            positions: RoPE positions ``(L,)``, ``(B, L)`` or an int offset; default ``0…L−1``,
                or the cache's next positions.
            cache: a `LatentCache`: the new latents and rotary keys are appended and the queries
                attend to every cached token in the absorbed form. Without a cache, keys and
                values are expanded per head (the prefill form).
        """
        self._check(x, positions, cache)
        B, L, _ = x.shape
        q_nope, q_rope = self._queries(x)  # (B, H, L, Dn), (B, H, L, R)
        kv = self.kv_a_proj_with_mqa(x)  # (B, L, C + R)
        latent = self.kv_a_layernorm(kv[..., : self.kv_lora_rank])  # (B, L, C)
        k_rope = kv[..., self.kv_lora_rank :].unsqueeze(1)  # (B, 1, L, R)
        if positions is None and cache is not None:
            positions = cache.seen
        q_rope = self.rope(q_rope, positions)
        k_rope = self.rope(k_rope, positions).squeeze(1)  # (B, L, R)
        w_uk, w_uv = self.up_projections()
        if cache is None:
            o = self._expanded(q_nope, q_rope, latent, k_rope, mask)  # (B, H, L, Dv)
        else:
            view: LatentView = cache.update(latent, k_rope)
            C = self.kv_lora_rank
            w_uk_t = self.absorbed_query_weight()
            o = _absorbed(q_nope, q_rope, view.joint, C, w_uk, w_uv, mask, self.scale, w_uk_t)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))  # (B, L, E)

    def _expanded(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, mask: object
    ) -> Tensor:
        """The prefill form: per-head keys and values through `attnlab.attention`."""
        B, H, L, _ = q_nope.shape
        kv = self.kv_b_proj(latent).view(B, L, H, -1).transpose(1, 2)  # (B, H, S, Dn + Dv)
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
        r = k_rope.unsqueeze(1).expand(B, H, L, -1)  # (B, H, S, R)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, L, Dn + R)
        k = torch.cat((k_nope, r), dim=-1)  # (B, H, S, Dn + R)
        return attention(q, k, v, mask=mask, scale=self.scale)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        parts += [f"q_lora_rank={self.q_lora_rank}", f"kv_lora_rank={self.kv_lora_rank}"]
        parts += [f"qk_nope_head_dim={self.qk_nope_head_dim}"]
        parts += [f"qk_rope_head_dim={self.qk_rope_head_dim}", f"v_head_dim={self.v_head_dim}"]
        return ", ".join(parts)


__all__ = [
    "LatentRMSNorm",
    "MultiHeadLatentAttention",
    "absorbed_latent_attention",
    "key_head_views",
    "softmax_scale",
]
