"""Run a function on W local ranks over gloo (loopback only) — for tests, benchmarks and demos.

For real multi-machine jobs use ``torchrun`` (docs/guide/distributed.md); this helper is the
in-process equivalent for one machine, with a hard wall-clock limit and no process left behind.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    out: Any,
    pg_timeout: float,
    threads: int | None,
) -> None:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            out.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent, with its type
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    threads: int | None = None,
) -> list[tuple[str, Any]]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: number of processes.
        timeout: wall-clock limit for the whole run; past it every rank is killed.
        pg_timeout: the process group's operation timeout in seconds.
        threads: torch threads per rank (default: torch's default).

    Returns:
        ``[(status, payload)]`` per rank: ``("ok", result)``, ``("error", message)`` or
        ``("missing", reason)`` for a rank that died or reported nothing.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, fn, args, out, pg_timeout, threads),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: list[tuple[str, Any]] = [("missing", "no report")] * world_size
    deadline = time.monotonic() + timeout
    received = 0
    while received < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = out.get(timeout=0.2)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
            continue
        results[rank] = (status, payload)
        received += 1
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(5.0)
            if results[r][0] == "missing":
                results[r] = ("missing", f"killed after the {timeout:.0f} s wall-clock limit")
        elif results[r][0] == "missing":
            results[r] = ("missing", f"exited with code {p.exitcode} without a report")
    out.close()
    return results
