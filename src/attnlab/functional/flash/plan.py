"""The job for a validated request: tile sizes, engine, tiling plan and tile source.

Nothing here touches the values of q, k, v: `flash_job` reads shapes, dtypes and the mask's
structure only (plans may depend on shapes and mask structure, never on tensor values).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks import Mask, TensorMask
from ..request import BiasFn, Request, is_relative_bias
from ..scores import get_score
from ..tiling import Plan, build_plan
from .engines import TorchEngine, acc_dtype
from .job import FlashJob
from .tiles import TileSource

# Default tile sizes (rows × keys) of the block map, and the query block of batched band calls.
BLOCK_Q = 128
BLOCK_K = 128
BAND_BLOCK = 64
# Forward query block of batched band calls when none is given: the forward kernel wastes fewer
# pairs on 32-row blocks (288 keys per block for a 256-window instead of 320), while the backward
# kernel is faster on 64-row blocks (measured at window 256, L=16384, benchmarks/RESULTS.md).
BAND_BLOCK_FWD = 32
# Tile size with a bias (measured: 256 beats 128 for ALiBi), and for float64 (see `flash_job`).
BLOCK_BIAS = 256
BLOCK_64 = 2048
# Key window of a relative bias over a wide band (causal, none): one shared tile per offset.
RELATIVE_WINDOW = 1024


def split_mask_bias(
    mask: Mask | Tensor | None, bias: Tensor | BiasFn | None
) -> tuple[Mask | None, BiasFn | None, list[Tensor]]:
    """``(structured mask, bias function, additive tensors)`` of a request's mask and bias.

    A bool mask tensor becomes a `TensorMask`; a float mask and a bias tensor are additive.
    """
    tensors: list[Tensor] = []
    m: Mask | None = None
    if isinstance(mask, Mask):
        m = mask
    elif isinstance(mask, Tensor):
        if mask.dtype == torch.bool:
            m = TensorMask(mask)
        else:
            tensors.append(mask)
    fn: BiasFn | None = None
    if isinstance(bias, Tensor):
        tensors.append(bias)
    elif bias is not None:
        fn = bias
    return m, fn, tensors


def _check_block(name: str, val: object) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return val


def flash_job(
    req: Request,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    band_block: int | None = None,
    engine: str | None = None,
) -> FlashJob:
    """The plan and tile source for a validated request (no computation on q, k, v).

    Args:
        req: the validated request.
        block_q, block_k: tile size of the block map (default 128 × 128, 256 × 256 with a bias,
            1024 keys for a relative bias alone, 2048 × 2048 in float64).
        band_block: query block of batched band calls (default 32 forward, 64 backward; 64
            both ways on the torch engine).
        engine: ``"kernel"`` or ``"torch"`` (default: kernel on CPU below float64, and torch
            whenever the request soft-caps its logits: the kernel cannot apply tanh).

    Raises:
        ValueError: a block size that is not a positive int, an unknown engine, or
            ``engine="kernel"`` with ``req.softcap``.
    """
    d = req.dims
    mask, fn, tensors = split_mask_bias(req.mask, req.bias)
    wide = req.q.dtype == torch.float64  # see below: float64 uses wide tiles
    # with a bias every tile carries an additive tile: larger tiles mean fewer, fuller calls
    biased = fn is not None or bool(tensors)
    bq = (BLOCK_64 if wide else BLOCK_BIAS if biased else BLOCK_Q) if block_q is None else block_q
    if block_k is not None:
        bk = block_k
    elif wide:
        bk = BLOCK_64
    elif fn is not None and is_relative_bias(fn) and not tensors:
        bk = RELATIVE_WINDOW
    else:
        bk = BLOCK_BIAS if biased else BLOCK_K
    bb = (BLOCK_64 if wide else BAND_BLOCK) if band_block is None else band_block
    bb_fwd = BAND_BLOCK_FWD if band_block is None and not wide else bb
    bq, bk, bb = (
        _check_block("block_q", bq),
        _check_block("block_k", bk),
        _check_block("band_block", bb),
    )
    if engine is None:
        # float64 is the verification dtype: its tolerance rule compares against the reference's
        # own summation order (float64 rounding), which a tiled sum over 128-row blocks misses by
        # a few ulp. So float64 runs the pure-PyTorch engine on wide tiles (BLOCK_64), i.e. one
        # tile up to 2048 × 2048 — still bounded memory for any length.
        # Soft-capping applies tanh to every tile's logits, which torch's fused kernel cannot:
        # such requests run the pure-PyTorch engine (the same tiles, plan and merging).
        on_cpu = req.q.device.type == "cpu"
        kernel = on_cpu and req.q.dtype != torch.float64 and req.softcap is None
        engine = "kernel" if kernel else "torch"
    if engine not in ("kernel", "torch"):
        raise ValueError(f"engine must be 'kernel' or 'torch', got {engine!r}")
    if engine == "kernel" and req.softcap is not None:
        raise ValueError(
            f"engine='kernel' cannot soft-cap logits (softcap={req.softcap}): torch's CPU flash "
            f"kernel has no tanh stage; use engine='torch' (the default with softcap)"
        )
    if engine == "torch" and band_block is None:
        # the 32-row forward block suits the kernel; the torch engine (soft-capped calls) pays
        # per call: its forward is faster on 64-row blocks (window 512, L = 4096, H = 8, fp32,
        # one thread, best CPU time of 7: 305 ms at 32 rows, 255 at 64, 251 at 128)
        bb_fwd = bb
    bias_kind = "tensor" if tensors else ("fn" if fn is not None else None)
    relative = bias_kind == "fn" and is_relative_bias(fn)

    def plan_for(band_block: int) -> Plan:
        return build_plan(
            mask,
            B=d.B,
            H=d.H,
            L=d.L,
            S=d.S,
            block_q=bq,
            block_k=bk,
            band_block=band_block,
            bias=bias_kind,
            device=req.q.device,
            relative=relative,
        )

    plan = plan_for(bb_fwd)
    bwd_plan = plan_for(bb) if bb != bb_fwd and plan.kind == "band" else None
    source = TileSource(
        mask,
        fn,
        tensors,
        B=d.B,
        H=d.H,
        L=d.L,
        S=d.S,
        dtype=acc_dtype(req.q.dtype),
        device=req.q.device,
        relative=relative,
    )
    chunks = TorchEngine(max(bq, 128), max(bk, 512))
    return FlashJob(
        plan,
        source,
        req.scale / req.temperature,
        engine,
        chunks,
        bwd_plan=bwd_plan,
        softcap=req.softcap,
    )


def prepare_inputs(req: Request, engine: str) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(q, k, v, Dv)`` as the engine reads them: scored (cosine), unit-stride, padded.

    The kernel needs D = Dv: zero columns change no dot product and add zero output columns, so
    padding both to ``max(D, Dv)`` is exact (the caller slices the output back to ``Dv``).
    """
    q, k, v = req.q, req.k, req.v
    if req.score != "dot":
        s = get_score(req.score)
        q, k = s.prepare(q), s.prepare(k)
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    Dv = v.shape[-1]
    D = q.shape[-1]
    if engine == "kernel" and Dv != D:
        width = max(D, Dv)
        if width > D:
            q = torch.nn.functional.pad(q, (0, width - D))
            k = torch.nn.functional.pad(k, (0, width - D))
        if Dv < width:
            v = torch.nn.functional.pad(v, (0, width - Dv))
    return q, k, v, Dv


__all__ = [
    "BAND_BLOCK",
    "BAND_BLOCK_FWD",
    "BLOCK_64",
    "BLOCK_BIAS",
    "BLOCK_K",
    "BLOCK_Q",
    "RELATIVE_WINDOW",
    "flash_job",
    "prepare_inputs",
    "split_mask_bias",
]
