"""A Vision Transformer (Dosovitskiy et al., 2021) built from attnlab's Transformer blocks.

An image is cut into non-overlapping ``p × p`` patches (`patchify`), each patch is projected
to a token, a learned [CLS] token is put in front, 2-D positions are added to the patch tokens,
and a bidirectional stack of `TransformerBlock`s runs over the ``1 + N`` tokens; the class
logits are a linear head on the final [CLS] state::

    x_0 = [cls;  W_p · patch_1 + pos(1);  …;  W_p · patch_N + pos(N)]     (B, 1 + N, E)
    logits = W_h · norm(blocks(x_0))[:, 0]                                (B, K)

Example:
    >>> model = VisionTransformer(ViTConfig(image_size=8, patch_size=2, d_model=64))
    >>> logits = model(torch.rand(5, 1, 8, 8))                      # (5, 10)
    >>> logits, weights = model(torch.rand(5, 1, 8, 8), need_weights=True)  # 4 × (5, 4, 17, 17)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from .._shapes import check_int
from ..positional import sinusoidal
from .blocks import StackOutput, TransformerBlock, make_norm, run_blocks
from .config import TransformerConfig

#: Position schemes of `ViTConfig.positional`.
VIT_POSITIONALS = ("learned", "sinusoidal")


@dataclass
class ViTConfig:
    """Sizes and choices of `VisionTransformer` (validated on creation).

    Attributes:
        image_size: side of the square input images in pixels (H = W).
        channels: C, colour channels of the input (1 for grey digits).
        patch_size: p, side of a square patch; must divide ``image_size``. The grid has
            ``(image_size / p)²`` patches, each a token of ``C·p²`` pixel values.
        num_classes: K, the number of classes of the head.
        d_model: E, the residual width. n_layers: number of blocks. n_heads: H (divides E).
        d_ff: the MLP's hidden width (None = 4·E).
        dropout: dropout on embeddings, attention weights and residual branches (training).
        positional: "learned": a trainable row vector plus a trainable column vector per
            patch, ``pos(r, c) = R[r] + C[c]`` (2-D, factorised); "sinusoidal": the fixed
            2-D table ``pos(r, c) = [PE_{E/2}(r); PE_{E/2}(c)]`` (the original sin/cos
            table of width E/2 for the row, then the column; needs ``E % 4 == 0``). The
            [CLS] token gets no position (it is a learned vector itself).
        norm: "layernorm" or "rmsnorm". attn_backend: the `attnlab.attention` backend.
    """

    image_size: int = 8
    channels: int = 1
    patch_size: int = 2
    num_classes: int = 10
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    positional: str = "learned"
    norm: str = "layernorm"
    attn_backend: str = "auto"

    def __post_init__(self) -> None:
        for name, low in (
            ("image_size", 1),
            ("channels", 1),
            ("patch_size", 1),
            ("num_classes", 1),
            ("d_model", 1),
            ("n_layers", 0),
            ("n_heads", 1),
        ):
            check_int(name, getattr(self, name), minimum=low)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size must divide image_size={self.image_size}, got {self.patch_size}"
            )
        if self.positional not in VIT_POSITIONALS:
            raise ValueError(
                f"positional must be one of {list(VIT_POSITIONALS)}, got {self.positional!r}"
            )
        if self.positional == "sinusoidal" and self.d_model % 4:
            raise ValueError(
                f"positional='sinusoidal' needs d_model divisible by 4 (E/2 even for the row "
                f"and the column tables), got {self.d_model}"
            )
        self.transformer_config()  # n_heads, d_ff, dropout, norm and backend checks

    @property
    def grid(self) -> int:
        """Patches per side, ``image_size / patch_size``."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """N = grid², the patch tokens (the sequence is 1 + N with [CLS])."""
        return self.grid**2

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch, ``C·p²``."""
        return self.channels * self.patch_size**2

    def transformer_config(self) -> TransformerConfig:
        """The `TransformerConfig` of the blocks (pre-LN, no positions inside attention)."""
        return TransformerConfig(
            vocab_size=1,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            max_seq_len=1 + self.num_patches,
            dropout=self.dropout,
            norm=self.norm,
            positional=None,
            attn_backend=self.attn_backend,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``ViTConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        """The inverse of `to_dict`; unknown keys raise ValueError naming them."""
        if not isinstance(data, dict):
            raise TypeError(f"config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ViTConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def _check_images(images: object, channels: int, size: int) -> Tensor:
    """``images`` as ``(B, C, H, W)`` float, or TypeError/ValueError naming the expected shape."""
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a (B, C, H, W) float tensor, got {type(images).__name__}")
    if not images.is_floating_point():
        raise TypeError(f"images must be a floating-point tensor, got dtype {images.dtype}")
    if images.dim() != 4 or tuple(images.shape[1:]) != (channels, size, size):
        raise ValueError(
            f"images must have shape (B, C, H, W) = (B, {channels}, {size}, {size}), got "
            f"{tuple(images.shape)}"
        )
    return images


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Cuts images into non-overlapping square patches, row-major over the grid.

    ``patches[b, r·G + c] = images[b, :, r·p:(r+1)·p, c·p:(c+1)·p].flatten()`` (channel,
    then pixel row, then pixel column), G = H / p patches per side.

    Args:
        images: ``(B, C, H, W)`` with H and W divisible by ``patch_size``.
        patch_size: p.

    Returns:
        ``(B, N, C·p²)`` with ``N = (H/p)·(W/p)``.

    Raises:
        TypeError, ValueError: not a 4-D tensor, or p does not divide H and W.
    """
    p = check_int("patch_size", patch_size, minimum=1)
    if not isinstance(images, Tensor) or images.dim() != 4:
        got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"images must be (B, C, H, W), got {got}")
    B, C, H, W = images.shape
    if H % p or W % p:
        raise ValueError(f"patch_size must divide H={H} and W={W}, got {p}")
    x = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, Gh, p, Gw, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, Gh, Gw, C, p, p)
    return x.reshape(B, (H // p) * (W // p), C * p * p)  # (B, N, C·p²)


def unpatchify(patches: Tensor, patch_size: int, height: int, width: int | None = None) -> Tensor:
    """The inverse of `patchify`: ``unpatchify(patchify(x, p), p, H, W) == x`` exactly.

    Args:
        patches: ``(B, N, C·p²)``, N = (H/p)·(W/p) patches in row-major order.
        patch_size: p. height: H. width: W (default H).

    Returns:
        ``(B, C, H, W)``.

    Raises:
        ValueError: the patch count or patch width do not fit H, W and p.
    """
    p = check_int("patch_size", patch_size, minimum=1)
    H = check_int("height", height, minimum=1)
    W = H if width is None else check_int("width", width, minimum=1)
    if H % p or W % p:
        raise ValueError(f"patch_size must divide H={H} and W={W}, got {p}")
    if not isinstance(patches, Tensor) or patches.dim() != 3:
        got = tuple(patches.shape) if isinstance(patches, Tensor) else type(patches).__name__
        raise ValueError(f"patches must be (B, N, C·p²), got {got}")
    B, N, P = patches.shape
    Gh, Gw = H // p, W // p
    if Gh * Gw != N or P % (p * p):
        raise ValueError(
            f"patches must have shape (B, {Gh * Gw}, C·{p * p}) for {H}×{W} images and "
            f"patch_size {p}, got {tuple(patches.shape)}"
        )
    C = P // (p * p)
    x = patches.reshape(B, Gh, Gw, C, p, p)  # (B, Gh, Gw, C, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)  # (B, C, H, W)


def sinusoidal_2d(grid: int, dim: int, device: torch.device | str | None = None) -> Tensor:
    """The fixed 2-D position table ``pos[r·G + c] = [PE_{dim/2}(r); PE_{dim/2}(c)]``.

    Args:
        grid: G, patches per side. dim: E, divisible by 4. device: where to build it.

    Returns:
        ``(G², E)`` float32.
    """
    half = dim // 2
    rows = sinusoidal(grid, half, device=device)  # (G, E/2)
    r = rows[:, None, :].expand(grid, grid, half)  # (G, G, E/2): the patch's row
    c = rows[None, :, :].expand(grid, grid, half)  # (G, G, E/2): the patch's column
    return torch.cat((r, c), dim=-1).reshape(grid * grid, dim)  # (N, E)


class VisionTransformer(nn.Module):
    """Image classifier: ``logits = W_h · norm(blocks([cls; W_p·patches + pos]))[:, 0]``.

    Every token attends to every token (no mask). Weights: N(0, 0.02) for the patch
    projection, the [CLS] token, the learned positions and the head; the blocks' own init.

    Args:
        config: a `ViTConfig`.

    Attributes:
        config: the config. patch_embed: ``C·p² -> E``. cls_token: ``(1, 1, E)``.
        pos_row, pos_col: ``(G, E)`` learned tables ("learned"), or the buffer ``pos_table``
        ``(N, E)`` ("sinusoidal"). blocks: the blocks (`TransformerBlock`). norm: the final norm.
        head: ``E -> K``.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        self.config = config
        tcfg = config.transformer_config()
        E, G = config.d_model, config.grid
        self.patch_embed = nn.Linear(config.patch_dim, E)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, E))
        if config.positional == "learned":
            self.pos_row = nn.Parameter(torch.zeros(G, E))
            self.pos_col = nn.Parameter(torch.zeros(G, E))
        else:
            # Saved with the weights, so a checkpoint's tensors justify its image and patch
            # size. Allocated where the module is built (on "meta" a loader checks shapes
            # only) and filled from the float64 table elsewhere.
            table = self.patch_embed.weight.new_empty(G * G, E)  # (N, E), beside the weights
            if not table.is_meta:
                table.copy_(sinusoidal_2d(G, E, device=table.device))
            self.register_buffer("pos_table", table)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(tcfg) for _ in range(config.n_layers))
        self.norm = make_norm(tcfg)
        self.head = nn.Linear(E, config.num_classes)
        for p in (self.patch_embed.weight, self.cls_token, self.head.weight):
            nn.init.normal_(p, std=0.02)
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.zeros_(self.head.bias)
        if config.positional == "learned":
            nn.init.normal_(self.pos_row, std=0.02)
            nn.init.normal_(self.pos_col, std=0.02)

    def positions(self) -> Tensor:
        """The position vector of every patch, ``(N, E)`` (row-major over the grid)."""
        if self.config.positional == "learned":
            G, E = self.config.grid, self.config.d_model
            pos = self.pos_row[:, None, :] + self.pos_col[None, :, :]  # (G, G, E)
            return pos.reshape(G * G, E)  # (N, E)
        return self.pos_table  # (N, E)

    def embed(self, images: Tensor) -> Tensor:
        """``[cls; W_p·patches + pos]``: ``(B, C, H, W) -> (B, 1 + N, E)`` (no input checks)."""
        x = self.patch_embed(patchify(images, self.config.patch_size))  # (B, N, E)
        x = x + self.positions().to(x.dtype)  # (B, N, E)
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], -1, -1)  # (B, 1, E)
        return self.drop(torch.cat((cls, x), dim=1))  # (B, 1 + N, E)

    def encode(self, images: Tensor, *, need_weights: bool = False) -> StackOutput:
        """The final states of all ``1 + N`` tokens (normed), and optionally every block's
        attention weights ``(B, H, 1 + N, 1 + N)`` (token 0 is [CLS]).

        Args:
            images: ``(B, C, H, W)`` as in the config.
            need_weights: collect the weights of this forward pass.

        Returns:
            A `StackOutput` with ``last_hidden_state`` ``(B, 1 + N, E)``.
        """
        cfg = self.config
        images = _check_images(images, cfg.channels, cfg.image_size)
        out = run_blocks(self.blocks, self.embed(images), need_weights=need_weights)
        return out._replace(last_hidden_state=self.norm(out.last_hidden_state))

    def forward(
        self, images: Tensor, *, need_weights: bool = False
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Class logits.

        Args:
            images: ``(B, C, H, W)`` floats, ``C = config.channels``,
                ``H = W = config.image_size``.
            need_weights: also return every block's attention weights
                ``(B, H, 1 + N, 1 + N)`` from this forward pass.

        Returns:
            ``(B, K)`` logits, or ``(logits, weights)`` (``n_layers`` tensors).

        Raises:
            TypeError, ValueError: images that are not floating point or not shaped
                ``(B, C, H, W)`` as in the config (the message gives both shapes).
        """
        out = self.encode(images, need_weights=need_weights)
        logits = self.head(out.last_hidden_state[:, 0])  # (B, K)
        if need_weights:
            assert out.attentions is not None
            return logits, out.attentions
        return logits

    def num_parameters(self) -> int:
        """The trainable parameter count."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def build_vit(config: dict[str, Any]) -> VisionTransformer:
    """A `VisionTransformer` from ``ViTConfig.to_dict()`` output (checkpoint loading)."""
    return VisionTransformer(ViTConfig.from_dict(config))


__all__ = [
    "VIT_POSITIONALS",
    "ViTConfig",
    "VisionTransformer",
    "build_vit",
    "patchify",
    "sinusoidal_2d",
    "unpatchify",
]
