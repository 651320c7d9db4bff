"""Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer").

RoPE rotates each pair of dimensions of q and k by an angle proportional to the position,
``R(m)·x`` with angle ``m·θ_i`` for pair i, so that ``⟨R(m)q, R(n)k⟩`` depends only on ``m − n``.
Two layouts name which dimensions form a pair (D = rotary dim)::

    interleaved=False ("rotate half", GPT-NeoX / Llama checkpoints):  pair i = (x[i], x[i + D/2])
    interleaved=True  (pairwise, the RoFormer paper, GPT-J):           pair i = (x[2i], x[2i + 1])

and each pair (a, b) becomes ``(a·cos − b·sin, b·cos + a·sin)`` times the attention scaling.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .._shapes import check_bool, check_int, check_number, stat_dtype
from ._checks import check_positions
from .rope_scaling import compute_rope_parameters, depends_on_seq_len, rope_type_of

_TABLE_DTYPES = (torch.float32, torch.float64)


@torch.library.custom_op("attnlab::rope_tables", mutates_args=())
def rope_tables(
    positions: Tensor, inv_freq: Tensor, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(scale · cos(p·θ), scale · sin(p·θ))``, each ``(*positions.shape, R/2)`` in ``dtype``:
    computed in float64 and rounded once.

    An operator so that a compiled graph computes the table once per call: written as tensor
    ops, Inductor fuses the float64 ``cos``/``sin`` into the rotation's loop and evaluates them
    for every batch item and head (measured: docs/results,
    `benchmarks/bench_compile.py`).
    """
    angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(positions.device)  # (..., R/2)
    return (angle.cos() * scale).to(dtype), (angle.sin() * scale).to(dtype)


@rope_tables.register_fake
def _(positions, inv_freq, scale, dtype):  # noqa: ARG001 (a custom op's fake kernel takes the op's arguments)
    shape = (*positions.shape, inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


class RoPE(nn.Module):
    """Rotary position embedding ``rope(x, positions)`` for x ``(B, H, L, D)``.

    The cos/sin tables are computed from integer positions in float64 and rounded once to float32
    (float64 for float64 inputs); the module holds no floating buffers, so ``.to(bfloat16)``
    cannot degrade them (the bf16 RoPE phase bug, HF #29496). The rotation runs in that table
    precision and the result is cast back to ``x.dtype``. In eager mode, None/int positions read
    rows of a table computed the same way once per (device, precision) and kept as a plain
    attribute (not a buffer); under `torch.compile` the graph computes them once per call, as the
    operator ``attnlab::rope_tables`` (`rope_tables`).

    Args:
        head_dim: D, the last dimension of q and k.
        base: θ, the wavelength base (HF's ``rope_theta``; Llama 3 uses 500000).
        scaling: None, or an HF-style dict selecting a function of
            `attnlab.positional.rope_scaling.ROPE_SCALING`, e.g.
            ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}``.
            A ``partial_rotary_factor`` field sets ``rotary_dim = int(head_dim · factor)``.
        interleaved: False for the rotate-half layout of Llama-family checkpoints, True for the
            pairwise layout of the paper (see the module docstring).
        rotary_dim: rotate only the first ``rotary_dim`` dims (even); the rest pass through
            bit-exactly. Default: all of ``head_dim``.

    Raises:
        ValueError: an odd rotary dim, ``rotary_dim > head_dim``, ``base <= 1``, bad scaling fields.

    Example:
        >>> rope = RoPE(64, scaling={"rope_type": "yarn", "factor": 4.0,
        ...                          "original_max_position_embeddings": 4096})
        >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
        >>> pos = torch.arange(128)
        >>> out = attnlab.attention(rope(q, pos), rope(k, pos), v, mask=attnlab.masks.causal())
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        scaling: Mapping[str, object] | None = None,
        interleaved: bool = False,
        *,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.base = check_number("base", base, greater=1.0)
        check_bool("interleaved", interleaved)
        self.interleaved = interleaved
        self.rope_type = rope_type_of(scaling)
        fields = dict(scaling) if scaling is not None else None
        if fields is not None and "partial_rotary_factor" in fields:
            prf = fields.pop("partial_rotary_factor")
            prf = check_number("partial_rotary_factor", prf, greater=0.0)
            from_factor = int(self.head_dim * prf)
            if rotary_dim is not None and rotary_dim != from_factor:
                raise ValueError(
                    f"rotary_dim={rotary_dim} disagrees with partial_rotary_factor={prf:g} "
                    f"(head_dim {self.head_dim} · {prf:g} = {from_factor})"
                )
            rotary_dim = from_factor
        if rotary_dim is None:
            rotary_dim = self.head_dim
        rotary_dim = check_int("rotary_dim", rotary_dim, minimum=2)
        if rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even (dimensions are rotated in pairs), got {rotary_dim}"
                + (f" (from head_dim={self.head_dim})" if rotary_dim == self.head_dim else "")
            )
        if rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim={self.head_dim}, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.scaling = fields
        self._dynamic = depends_on_seq_len(self.rope_type)
        # Validates the scaling fields now, and caches the seq-len independent frequencies.
        self._static = compute_rope_parameters(fields, self.rotary_dim, self.base)
        # Memo of (cos, sin) for positions 0..n-1 per (device, table dtype), eager mode only:
        # plain attributes, not buffers, so `.to(bfloat16)` never touches them.
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ frequencies
    def frequencies(self, seq_len: int | None = None) -> tuple[Tensor, float]:
        """``(inv_freq (rotary_dim/2,) float64, attention_scaling)`` for a sequence of ``seq_len``.

        Only the ``dynamic`` and ``longrope`` types depend on ``seq_len``; None means a sequence
        within the original length.
        """
        if not self._dynamic or seq_len is None:
            inv_freq, scale = self._static
            return inv_freq.clone(), scale
        return compute_rope_parameters(self.scaling, self.rotary_dim, self.base, seq_len=seq_len)

    @property
    def depends_on_seq_len(self) -> bool:
        """Whether the frequencies depend on the sequence length (``dynamic``, ``longrope``)."""
        return self._dynamic

    @property
    def inv_freq(self) -> Tensor:
        """``θ_i`` after scaling, ``(rotary_dim/2,)`` float64; seq-len dependent types: short."""
        return self.frequencies()[0]

    @property
    def attention_scaling(self) -> float:
        """The factor multiplying cos and sin (YaRN, LongRoPE); scores scale by its square."""
        return self.frequencies()[1]

    def cos_sin(
        self,
        positions: Tensor,
        *,
        seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[Tensor, Tensor]:
        """The rotation tables ``a · cos(p·θ_i)`` and ``a · sin(p·θ_i)``, a = attention scaling.

        Args:
            positions: integer tensor of any shape.
            seq_len: sequence length for seq-len dependent scaling; default ``max(positions) + 1``
                (read from the tensor: a host synchronisation, only for those scaling types —
                pass ``seq_len`` to avoid it under `torch.compile`).
            dtype: float32 or float64 (computed in float64, rounded once).

        Returns:
            ``(cos, sin)``, each ``(*positions.shape, rotary_dim/2)`` in ``dtype``.
        """
        positions = check_positions("positions", positions)
        if dtype not in _TABLE_DTYPES:
            raise ValueError(
                f"dtype must be float32 or float64 (tables are never rounded lower), got {dtype}"
            )
        if seq_len is None and self._dynamic and positions.numel():
            seq_len = int(positions.max()) + 1
        inv_freq, scale = self._static if not self._dynamic else self.frequencies(seq_len)
        return rope_tables(positions, inv_freq, float(scale), dtype)

    # ------------------------------------------------------------------ rotation
    def forward(
        self, x: Tensor, positions: Tensor | int | None = None, *, seq_len: int | None = None
    ) -> Tensor:
        """Rotates x by its positions: ``out[..., l, :] = R(positions[l]) · x[..., l, :]``.

        Args:
            x: ``(B, H, L, D)`` (any rank >= 2 with ``(…, L, D)`` works) with D = head_dim.
            positions: integer positions ``(L,)``, ``(B, L)`` (per batch item, shared by heads),
                or broadcastable to ``x.shape[:-1]``; an int p means ``p, p+1, …, p+L−1`` (p = the
                KV-cache length when decoding); None means ``0..L−1``.
            seq_len: sequence length for dynamic/longrope scaling; default ``max(positions) + 1``,
                known on the host for None/int positions. Only for a position *tensor* with a
                seq-len dependent scaling type is it read from the tensor (a host sync: pass
                ``seq_len`` under `torch.compile`). Other types ignore it.

        Returns:
            Tensor shaped and typed like x.

        No host synchronisation for the default, linear, YaRN and Llama-3 types (or whenever
        ``seq_len`` is given), so ``torch.compile(fullgraph=True)`` traces it in one graph.
        """
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = f"dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"x must be a floating tensor, got {got}")
        if x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must be (..., L, head_dim={self.head_dim}), got shape {tuple(x.shape)}"
            )
        L = x.shape[-2]
        table_dtype = stat_dtype(x.dtype)
        host = positions is None or (
            isinstance(positions, (int, torch.SymInt)) and not isinstance(positions, bool)
        )
        if host:
            offset: int = 0 if positions is None else positions  # type: ignore[assignment]
            if seq_len is None and self._dynamic and L:
                seq_len = offset + L  # max position + 1, known on the host
        if (
            host
            and not self._dynamic
            and not torch.compiler.is_compiling()
            and x.device.type != "meta"
            and offset >= 0
        ):
            # Eager: rows of the memoised table (the same float64 computation, done once).
            cos, sin = self.table(offset + L, x.device, table_dtype)
            cos, sin = cos[offset : offset + L], sin[offset : offset + L]  # (L, R/2)
        else:
            positions = self._positions(x, positions, L)
            cos, sin = self.cos_sin(positions, seq_len=seq_len, dtype=table_dtype)  # (..., L, R/2)
        R = self.rotary_dim
        xr = x if self.head_dim == R else x[..., :R]  # (..., L, R)
        if xr.dtype != table_dtype:
            xr = xr.to(table_dtype)
        if self.interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]  # (..., L, R/2) each
            pairs = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., L, R/2, 2)
            rotated = pairs.flatten(-2)  # (..., L, R)
        else:
            a, b = xr[..., : R // 2], xr[..., R // 2 :]  # (..., L, R/2) each
            rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., L, R)
        if rotated.dtype != x.dtype:
            rotated = rotated.to(x.dtype)
        if self.head_dim == R:
            return rotated
        return torch.cat((rotated, x[..., R:]), dim=-1)  # (..., L, D), the tail copied bit-exactly

    def table(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos_sin(arange(N))`` for some ``N >= n``, computed once per (device, dtype) and grown
        by doubling; only for types whose frequencies do not depend on the sequence length."""
        tables = self.__dict__.setdefault("_tables", {})
        hit = tables.get((device, dtype))
        if hit is None or hit[0].shape[0] < n:
            size = max(n, 2 * (0 if hit is None else hit[0].shape[0]), 64)
            with torch.inference_mode(False), torch.no_grad():
                hit = self.cos_sin(torch.arange(size, device=device), dtype=dtype)
            tables[(device, dtype)] = hit
        return hit

    def _positions(self, x: Tensor, positions: Tensor | int | None, L: int) -> Tensor:
        if positions is None or (
            isinstance(positions, (int, torch.SymInt)) and not isinstance(positions, bool)
        ):
            offset = 0 if positions is None else positions
            return torch.arange(offset, offset + L, device=x.device)  # (L,)
        positions = check_positions("positions", positions).to(x.device)
        if positions.dim() == 2 and x.dim() == 4:
            positions = positions.unsqueeze(1)  # (B, 1, L)
        ps, xs = tuple(positions.shape), tuple(x.shape[:-1])
        # broadcast_shapes(ps, xs) == xs, without its cost on every call
        ok = 1 <= len(ps) <= len(xs) and ps[-1] == L
        pairs = zip(reversed(ps), reversed(xs), strict=False)  # aligned from the right
        if not ok or any(p not in (1, s) for p, s in pairs):
            raise ValueError(
                f"positions must have shape (L,), (B, L) or broadcast to x.shape[:-1] = "
                f"{tuple(x.shape[:-1])}, got {tuple(positions.shape)}"
            )
        return positions

    def extra_repr(self) -> str:
        parts = [f"head_dim={self.head_dim}", f"base={self.base:g}"]
        parts.append(f"interleaved={self.interleaved}")
        if self.rotary_dim != self.head_dim:
            parts.append(f"rotary_dim={self.rotary_dim}")
        if self.scaling is not None:
            parts.append(f"scaling={self.scaling}")
        return ", ".join(parts)
