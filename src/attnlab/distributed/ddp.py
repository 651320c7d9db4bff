"""Data-parallel and context-parallel training of the GPT over torch.distributed (torchrun).

`attnlab.apps.gpt.train` runs on every rank that ``torchrun`` starts; a `Parallel` tells it how the
ranks share the work. Both modes keep the run of one process:

- ``"data"`` (DistributedDataParallel): every rank draws the same global batch ``(B, L)`` from the
  same seeded generator and takes rows ``[r·B/W, (r+1)·B/W)``; DDP averages the gradients, so
  each step's gradient is that of the mean loss over the global batch (equal-sized slices), i.e.
  the one-process gradient up to rounding.
- ``"context"`` (``--context-parallel``): every rank takes the contiguous shard
  ``[r·L/W, (r+1)·L/W)`` of *every* sequence of the global batch. Each attention layer is swapped
  for `RingMultiHeadAttention` (same state dict), causal over global positions; RoPE rotates by
  global positions inside the ring, learned/sinusoidal embeddings are looked up at the shard's
  global positions (a forward pre-hook adds ``r·L/W``). The loss is the mean over the rank's
  tokens; the ranks hold equally many, so the mean of the ranks' losses is the mean over all
  tokens, and DDP's gradient average is its gradient (the ring's backward sends each key/value
  gradient to the rank that owns it). The ring runs on its own process group, so its
  point-to-point messages never interleave with DDP's all-reduces.

Only rank 0 (``is_main``) writes files, logs and shows a progress bar. Evaluation is collective:
every rank evaluates its part of the same evaluation batches and the means are averaged.

Example (one machine, two processes; docs/guide/distributed.md for several machines):
    $ torchrun --nproc-per-node=2 -m attnlab train --steps 600 --out runs/ddp
    $ torchrun --nproc-per-node=2 -m attnlab train --context-parallel --dropout 0 --out runs/cp
"""

from __future__ import annotations

import datetime
import inspect
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._shapes import check_bool
from ..masks import CausalMask, Mask
from .ring_mha import RingMultiHeadAttention

T = TypeVar("T")
MODES = ("single", "data", "context")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True when torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) is set."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for ``device``: "nccl" for CUDA, "gloo" otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: torch.device | str) -> torch.device:
    """``device`` with this process's local accelerator index (``LOCAL_RANK``) when it has none.

    ``cuda`` under torchrun becomes ``cuda:LOCAL_RANK``; CPU and indexed devices are unchanged.
    """
    device = torch.device(device)
    if device.type != "cpu" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device(device.type, int(os.environ["LOCAL_RANK"]))
    return device


@contextmanager
def process_group_from_env(
    device: torch.device | str = "cpu", *, timeout: float = 1800.0
) -> Iterator[bool]:
    """Initialises the default process group from torchrun's environment (``env://``).

    Without torchrun's variables, or when a group already exists, nothing happens (one process,
    or the caller's group). A group created here is destroyed on exit.

    Args:
        device: the training device; it picks the backend ("gloo" on CPU, "nccl" on CUDA).
        timeout: seconds any collective may wait for a peer.

    Yields:
        True if this call created the group.
    """
    if not launched_by_torchrun() or not dist.is_available() or dist.is_initialized():
        yield False
        return
    device = rank_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method="env://", timeout=datetime.timedelta(seconds=timeout)
    )
    try:
        yield True
    finally:
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    """Where the default group's collectives need their tensors: this process's GPU for nccl,
    the CPU otherwise."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _CausalRing(RingMultiHeadAttention):
    """`RingMultiHeadAttention` with `MultiHeadAttention`'s call signature, as a GPT block calls it.

    The GPT passes the causal mask (or None for a one-token sequence, which in a shard means the
    same causal attention); both run causal ring attention over global positions. Caches and
    attention weights need the whole sequence on one rank and raise ValueError.
    """

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        cache: Any = None,
        need_weights: bool = False,
        positions: Any = None,
    ) -> Tensor:
        """Causal self-attention of this rank's shard ``query (B, L_local, E)``."""
        given = {"key": key, "value": value, "cache": cache, "positions": positions}
        extra = [name for name, v in given.items() if v is not None]
        if need_weights:
            extra.append("need_weights")
        if extra:
            raise ValueError(
                f"context-parallel attention takes only the shard and the causal mask, got {extra}"
            )
        if mask is not None and not isinstance(mask, CausalMask):
            raise ValueError(
                f"context-parallel attention is causal; mask must be masks.causal() or None, "
                f"got {type(mask).__name__}"
            )
        return super().forward(query, mask=_CAUSAL)


_CAUSAL = CausalMask()


def _ring_of(attn: nn.Module, group: dist.ProcessGroup | None) -> _CausalRing:
    """A `_CausalRing` with ``attn``'s sizes, RoPE and (shared) projection modules."""
    has_bias = attn.out_proj.bias is not None
    ring = _CausalRing(
        attn.embed_dim,
        attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        bias=has_bias,
        rope=attn.rope,
        group=group,
        layout="contiguous",
    )
    ring.load_state_dict(attn.state_dict())
    return ring.to(attn.out_proj.weight.device, attn.out_proj.weight.dtype)


@dataclass
class Parallel:
    """How this process takes part in a training run.

    Attributes:
        rank, world: this rank and the number of ranks (0 and 1 for one process).
        mode: "single", "data" (DDP over batch rows) or "context" (sequence shards, ring
            attention, DDP's gradient all-reduce).
        ring_group: the process group of the ring attention (context mode), else None.
    """

    rank: int = 0
    world: int = 1
    mode: str = "single"
    ring_group: dist.ProcessGroup | None = None

    @classmethod
    def current(cls, context_parallel: bool = False) -> Parallel:
        """The mode of the initialised default process group (one process without one).

        ``context_parallel`` shards sequences instead of batches; it needs >= 2 ranks, since one
        process holds the whole sequence anyway it is then the same as "single". Creating the
        ring's process group is collective: every rank must call this in the same order.
        """
        check_bool("context_parallel", context_parallel)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        rank, world = dist.get_rank(), dist.get_world_size()
        if not context_parallel:
            return cls(rank, world, "data")
        ring_group = dist.new_group(list(range(world)), backend=dist.get_backend())
        return cls(rank, world, "context", ring_group)

    @property
    def is_main(self) -> bool:
        """True on the rank that writes files, logs and shows the progress bar (rank 0)."""
        return self.rank == 0

    def describe(self) -> str:
        """One line for the log, e.g. ``data parallel on 2 ranks``."""
        if self.mode == "single":
            return "one process"
        kind = "data parallel" if self.mode == "data" else "context parallel (ring attention)"
        return f"{kind} on {self.world} ranks"

    def check(
        self, *, batch_size: int, seq_len: int, dropout: float, positional: str | None
    ) -> None:
        """Raises ValueError if the run cannot be split this way (before any work)."""
        if self.mode == "data" and batch_size % self.world:
            raise ValueError(
                f"batch_size must be divisible by the {self.world} data-parallel ranks (each "
                f"takes an equal slice of the global batch), got {batch_size}"
            )
        if self.mode != "context":
            return
        if seq_len % self.world:
            raise ValueError(
                f"seq_len must be divisible by the {self.world} context-parallel ranks (each "
                f"holds an equal contiguous shard of every sequence), got {seq_len}"
            )
        if dropout:
            raise ValueError(
                "context parallel needs dropout=0 (ring attention has no attention-weight "
                f"dropout), got {dropout}"
            )
        if positional == "alibi":
            raise ValueError(
                "context parallel supports positional 'rope', 'learned', 'sinusoidal' or None "
                "(ring attention takes no ALiBi bias), got 'alibi'"
            )

    def prepare(self, model: nn.Module) -> nn.Module:
        """Context mode: swaps each block's attention for ring attention and shifts the added
        position embeddings to the shard's global positions, in place (call it before building
        the optimizer; the state dict keys stay the same). Other modes: unchanged."""
        if self.mode != "context":
            return model
        for block in model.blocks:
            block.attn = _ring_of(block.attn, self.ring_group)
        if model.pos_emb is not None:
            rank = self.rank

            def to_global(_module: nn.Module, args: tuple) -> tuple:
                pos = args[0]  # (L_local,): the shard's local positions
                return (pos + rank * pos.shape[-1], *args[1:])  # + r·L/W: global positions

            model.pos_emb.register_forward_pre_hook(to_global)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train: ``DistributedDataParallel(model)`` on >= 2 ranks, else ``model``.

        Call it after loading any checkpoint. The ranks start equal (DDP broadcasts rank 0's
        parameters); buffers are not broadcast at every step (every rank computes the same).
        """
        if self.mode == "single":
            return model
        device = next(model.parameters()).device
        ids = [device] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel
        # no buffer broadcast before every forward (newer torch renames the switch)
        if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
            return ddp(model, device_ids=ids, forward_sync_buffers=False)
        return ddp(model, device_ids=ids, broadcast_buffers=False)

    def local(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's part of a global batch ``x, y (B, L)``: rows ``[r·B/W, (r+1)·B/W)``
        (data), columns ``[r·L/W, (r+1)·L/W)`` (context), or all of it (single)."""
        if self.mode == "single":
            return x, y
        dim = 0 if self.mode == "data" else 1
        n = x.shape[dim] // self.world
        return x.narrow(dim, self.rank * n, n), y.narrow(dim, self.rank * n, n)

    def mean(self, value: Tensor) -> Tensor:
        """The average over the ranks of a tensor (an all-reduce; the tensor itself on one)."""
        if self.mode == "single":
            return value
        total = value.detach().clone()
        dist.all_reduce(total)
        return total / self.world

    def seed(self, seed: int) -> None:
        """Gives each of several ranks its own torch RNG stream (dropout), derived from ``seed``;
        one process keeps its stream (and so its results) unchanged."""
        if self.mode != "single":
            torch.manual_seed(seed + 1_000_003 * (self.rank + 1))

    def rng_states(self) -> Tensor | None:
        """Every rank's torch RNG state ``(W, n)`` uint8 (collective), for the checkpoint."""
        if self.mode == "single":
            return None
        state = torch.get_rng_state().to(_comm_device())
        parts = [torch.empty_like(state) for _ in range(self.world)]
        dist.all_gather(parts, state)
        return torch.stack(parts).cpu()

    def restore_rng(self, states: Tensor | None, seed: int, step: int) -> bool:
        """Sets this rank's torch RNG from a checkpoint's ``(W, n)`` states; if they are missing
        or from another world size, reseeds from ``(seed, step)`` instead. Returns True if the
        stored state was used (only several ranks call this; one process restores
        ``rng.torch``)."""
        if states is not None and states.dim() == 2 and states.shape[0] == self.world:
            torch.set_rng_state(states[self.rank].clone())
            return True
        self.seed(seed + 7919 * step)
        return False

    def load_shared(self, path: str | os.PathLike, load: Callable[[Path], T]) -> T:
        """``load(path)`` where only rank 0 needs the file (e.g. ``--resume`` on one machine).

        Rank 0 reads the file's bytes and broadcasts them as a uint8 tensor (no pickle); every
        other rank writes them to a temporary file and loads that, so each rank verifies the
        same bytes with the same loader. If rank 0 cannot read the file it raises its OSError
        and the other ranks raise RuntimeError naming the path.
        """
        if self.mode == "single":
            return load(Path(path))
        data, error = b"", None
        if self.is_main:
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                error = e
        device = _comm_device()
        size = torch.tensor([-1 if error is not None else len(data)], device=device)  # int64
        dist.broadcast(size, src=0)
        if error is not None:
            raise error
        if int(size[0]) < 0:
            raise RuntimeError(f"rank 0 could not read {os.fspath(path)!r}")
        payload = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
        if self.is_main:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        dist.broadcast(payload, src=0)
        payload = payload.cpu()
        if self.is_main:
            return load(Path(path))
        with tempfile.TemporaryDirectory(prefix="attnlab-rank-") as tmp:
            local = Path(tmp) / Path(path).name
            local.write_bytes(payload.numpy().tobytes())
            return load(local)


__all__ = [
    "MODES",
    "TORCHRUN_VARIABLES",
    "Parallel",
    "backend_for",
    "launched_by_torchrun",
    "process_group_from_env",
    "rank_device",
]
