"""Tiled exact attention ("flash"): block-sparse tiling, online softmax, recomputing backward.

Defined to equal `functional.reference.attention` (and `reference.logsumexp` for the returned
log-sum-exp): ``out = softmax(q·kᵀ·scale + bias, masked) · v``, computed without ever holding an
L×S tensor, in either pass.

How it runs:

1. A *plan* (`flash.tiling`) splits the (query, key) grid using the mask's block map: EMPTY
   tiles are skipped, FULL tiles run without evaluating the mask, PARTIAL tiles evaluate it (and a
   bias function) on the tile's indices only. Narrow bands (sliding windows) run all interior
   query blocks as one batched call over strided key windows with one shared mask; plain causal
   runs as one causal call. A *relative* bias function (``fn.relative = True``: ALiBi, T5) over
   a wide band (causal, none) cuts each query block's keys into windows at fixed offsets from
   the block: one batched call per offset, sharing ONE additive tile, merged by log-sum-exp.
   Packed documents (``document(ids)``, optionally ``& causal()``, block-diagonal) run as
   batched *segment* calls: consecutive documents of equal length form ONE kernel call over
   strided views. Plans are cached per shape, mask structure and the digest of the mask's tensors'
   values (`plan.cached_plan`: a bounded LRU; a buffer rewritten behind torch's back misses).
2. Each call runs on a tile *engine* that returns the call's output and log-sum-exp:

   - ``"kernel"``: torch's fused CPU flash kernel
     (``aten._scaled_dot_product_flash_attention_for_cpu``) for float32, float16 and bfloat16
     (float16/bfloat16 plans whose rows each come from one call — bands, causal, packed
     documents — run it in their own dtype, ``ATTNLAB_FLASH_LOWP=widen`` forces float32, and
     under the default ``auto`` a call whose 16-bit pass torch's kernel runs slowly on a CPU
     without native products of the dtype goes to it widened, `engines.kernel_widens`; other
     plans, and band backward, run it in float32 and round once at the end; bfloat16 plans made
     only of band calls on attnlab's band kernel — ALiBi on a causal mask — keep their inputs
     and merge the kernel's float32 partial outputs, rounding once at the end);
   - ``"torch"``: a pure-PyTorch online-softmax loop over (row, key) chunks: float64 (the
     verification dtype, on wide 2048-tiles) and devices other than the CPU.

   On the kernel engine, batched band calls (sliding windows) run their forward on attnlab's own
   C++ band kernel when it is built (`band_kernel`: float32/bfloat16, one operator call per
   band, a one-pass softmax per block, oneDNN's brgemm products, keys and values packed per
   thread as its blocks advance); their backward stays on torch's kernel.

3. Calls over disjoint key sets are combined with `merge_partials` (log-sum-exp weights).
4. Backward recomputes every call from q, k, v and the GLOBAL out and lse: the kernel's backward
   over a subset of keys, given the global normaliser, returns exactly that subset's dK, dV and its
   share of dQ (ring attention's observation), so the per-call gradients sum to the exact gradient.
   Calls run in a fixed order, so gradients are bit-deterministic.

Modules (one job each): `tiling` (plans), `plan` (the options record, tile sizes, engine, the
cached plan for a request), `engines` (kernel and pure-PyTorch engines, and the additive tiles
they read), `band` (batched band calls), `band_kernel` (when the C++ band kernel runs them),
`job` (walks a plan forward and backward, and where the NaN rule puts NaN), `run` (the
registry's hooks, and the one forward and backward with the NaN rule that eager autograd and
the custom operators of ``torch.compile`` both run). `functional.api.flash_attention` is the
direct entry with the tiling knobs. Auto's size thresholds (``AUTO_*_MIN``) and
`flash_declines` are the dispatch policy: they live in `functional.backends`.

Inputs are cleaned for the NaN rule only when they hold NaN/±inf (`nan_rule.clean_flagged`: a
C++ scan, ``_ext/flash_rule.cpp``; without a compiler every input is cleaned by a copy).

Not supported (the backend's ``supports`` says so and ``backend="auto"`` picks another): dropout,
returning the (B, H, L, S) weights, and gradients through bias *functions* whose values require
grad (a learned T5 table). Bias *tensors* that require grad get their gradient (dS summed over
broadcast dims); that backward runs on the pure-PyTorch engine, which exposes dS.
"""

from __future__ import annotations

from .engines import (
    BandTiles,
    Logits,
    Residuals,
    TileSource,
    TorchEngine,
    kernel_backward,
    kernel_forward,
)
from .job import FlashJob, poison_entries
from .plan import (
    BAND_BLOCK,
    BAND_BLOCK_FWD,
    BLOCK_64,
    BLOCK_BIAS,
    BLOCK_K,
    BLOCK_Q,
    RELATIVE_WINDOW,
    FlashOptions,
    flash_job,
    flash_options,
    prepare_inputs,
)
from .run import flash_run, flash_run_lse, flash_supports

__all__ = [
    "BAND_BLOCK",
    "BAND_BLOCK_FWD",
    "BLOCK_64",
    "BLOCK_BIAS",
    "BLOCK_K",
    "BLOCK_Q",
    "RELATIVE_WINDOW",
    "BandTiles",
    "FlashJob",
    "FlashOptions",
    "Logits",
    "Residuals",
    "TileSource",
    "TorchEngine",
    "flash_job",
    "flash_options",
    "flash_run",
    "flash_run_lse",
    "flash_supports",
    "kernel_backward",
    "kernel_forward",
    "poison_entries",
    "prepare_inputs",
]
