"""The cases and contenders of ``attnlab bench`` (`attnlab.cli.bench` runs them and prints).

Every case runs in the dtype of ``args.run_dtype`` (float32, bfloat16 or float16): inputs,
FlexAttention compiled for that dtype, SDPA with the dense mask, local-attention, and the kernel
bound (one SDPA call on the tile shapes flash uses). Times come from ``args.clock`` (wall clock,
or this process's CPU time with ``--clock cpu``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..testing import FIXED_TABLE
from ..utils import Progress, best_times

#: ``masks.bigbird`` arguments of the bigbird case: block size, window, global, random blocks.
BIGBIRD = (64, 3, 2, 3)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- measuring
@dataclass
class Row:
    """One contender's result in one case, in one dtype."""

    case: str
    name: str
    seconds: float | None
    useful_gflops: float | None = None
    note: str = ""
    max_err: float | None = None
    dtype: str = "float32"
    tolerance: float | None = None

    @property
    def within_tolerance(self) -> bool | None:
        """max|Δ| against flash within the dtype's tolerance (None: nothing compared)."""
        if self.max_err is None or self.tolerance is None:
            return None
        return self.max_err <= self.tolerance

    def to_dict(self) -> dict[str, object]:
        """The row as written by ``--json`` (with ``within_tolerance``)."""
        return {**self.__dict__, "within_tolerance": self.within_tolerance}


@dataclass
class Report:
    """Everything one `attnlab bench` run measured."""

    rows: list[Row] = field(default_factory=list)
    matmul_gflops: dict[str, float] = field(default_factory=dict)  # dtype name -> rate
    info: dict[str, str] = field(default_factory=dict)


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    """Largest max|Δ| accepted between two exact contenders in ``dtype``: twice the fixed
    forward table's ``atol + rtol·max|out|`` (each may be that far from the truth)."""
    atol, rtol = FIXED_TABLE[dtype][:2]
    return 2 * (atol + rtol * float(reference.detach().abs().max().double()))


def _synced(fn: Callable[[], object], device: torch.device | str) -> Callable[[], object]:
    """``fn`` followed by waiting for ``device`` (CUDA kernels are asynchronous: a timer must
    wait for them); ``fn`` itself on the cpu."""
    if torch.device(device).type != "cuda":
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return run


def matmul_rate(
    n: int = 4096,
    repeats: int = 3,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """``torch.mm`` GFLOP/s of ``dtype`` on n×n matrices on ``device`` (best of ``repeats``)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = best_times({"mm": _synced(lambda: torch.mm(a, b), device)}, repeats, clock=clock)
    return 2 * n**3 / best["mm"] / 1e9


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    progress: Progress,
    label: str,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Best time of each function on ``device`` over ``repeats`` rounds; one call of each per
    round."""
    fns = {name: _synced(fn, device) for name, fn in fns.items()}
    return best_times(
        fns, repeats, on_step=lambda what: progress.step(f"{label}: {what}"), clock=clock
    )


def _fwd_bwd(fn: Callable[..., torch.Tensor], q, k, v, dout) -> Callable[[], None]:
    def run() -> None:
        x = [t.detach().requires_grad_(True) for t in (q, k, v)]
        fn(*x).backward(dout)

    return run


def _no_grad(fn: Callable[..., torch.Tensor], *args) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            return fn(*args)

    return run


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _inputs(args, L: int, n: int = 4) -> list[torch.Tensor]:
    B, H, D = args.batch, args.heads, args.dim
    return [torch.randn(B, H, L, D, device=args.device).to(args.run_dtype) for _ in range(n)]


# --------------------------------------------------------------------------- contenders
def _flex(L: int, S: int, mask_mod, B: int, H: int, D: int, dtype, device="cpu"):
    """FlexAttention compiled for ``dtype`` with a BlockMask, or (None, reason)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block = create_block_mask(mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=S, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def run(q, k, v):
            return compiled(q, k, v, block_mask=block)

        with torch.no_grad():  # compile now: failures are reported, not raised mid-benchmark
            tiny = torch.zeros(B, H, L, D, device=device, dtype=dtype)
            run(tiny, tiny, tiny)
        return run, ""
    except Exception as e:
        return (
            None,
            f"FlexAttention did not compile on this machine: {type(e).__name__}: {str(e)[:120]}",
        )


def _local_attention(window: int):
    """local-attention's LocalAttention (exact window of window+1 keys, see RESULTS.md)."""
    try:
        from local_attention import LocalAttention
    except ImportError as e:
        return None, f"local-attention not installed ({e.name})"
    la = LocalAttention(
        window_size=window,
        causal=True,
        look_backward=1,
        exact_windowsize=True,
        autopad=True,
        use_rotary_pos_emb=False,
    )

    def run(q, k, v):
        return la(q, k, v)

    return run, ""


def _naive_fits(B: int, H: int, L: int, S: int, limit_gb: float = 6.0) -> bool:
    return limit_gb > 3 * 4 * B * H * L * S / 1e9


def _naive(q, k, v, allowed, bias=None):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def band_block() -> int:
    """Query rows per block of flash's batched band forward (its plan's ``BAND_BLOCK_FWD``)."""
    from ..functional.flash import plan

    return int(getattr(plan, "BAND_BLOCK_FWD", 32))


def band_tiles(q, k, v, window: int, block: int):
    """The band's tiles as one batched SDPA call's operands: each ``block`` query rows with the
    ``block + window − 1`` keys they may see (zero-padded before the start) and the in-tile
    band mask, shared by all tiles.

    Returns:
        ``(qt, kt, vt, mask)``: ``(B·nb, H, block, D)``, ``(B·nb, H, keys, D)`` twice and
        ``(block, keys)`` bool, nb = ceil(L / block).
    """
    B, H, L, D = q.shape
    nb = -(-L // block)
    pad_l = nb * block - L
    keys = block + window - 1

    def tiles_of(x, size):  # (B, H, nb·block + window − 1, D) -> (B·nb, H, size, D)
        x = torch.nn.functional.pad(x, (0, 0, window - 1, pad_l))
        t = x.unfold(2, size, block)  # (B, H, nb, D, size)
        return t.permute(0, 2, 1, 4, 3).reshape(B * nb, H, size, D).contiguous()

    qt = torch.nn.functional.pad(q, (0, 0, 0, pad_l)).view(B, H, nb, block, D)
    qt = qt.transpose(1, 2).reshape(B * nb, H, block, D).contiguous()
    r = torch.arange(block).view(block, 1)
    c = torch.arange(keys).view(1, keys)
    mask = (c >= r) & (c <= r + window - 1)  # key c is query r's position − (window−1−(c−r))
    return qt, tiles_of(k, keys), tiles_of(v, keys), mask.to(q.device)


# --------------------------------------------------------------------------- cases
def case_window(args, report: Report, progress: Progress) -> None:
    from .. import masks
    from ..functional import attention

    B, H, D, L, w = args.batch, args.heads, args.dim, args.window_length, args.window
    dt, name_dt, clock = args.run_dtype, dtype_name(args.run_dtype), CLOCKS[args.clock]
    q, k, v, dout = _inputs(args, L)
    mask = masks.sliding_window(w)
    pairs = mask.attended_pairs(L, L) * B * H
    useful = 4 * pairs * D / 1e9

    def flash(q, k, v):
        return attention(q, k, v, mask=mask, backend="flash")

    dense = mask.to_dense(L, L, device=args.device)  # (1, 1, L, L) bool: what sdpa needs

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    fwd = {"flash": _no_grad(flash, q, k, v), "sdpa dense mask": _no_grad(sdpa, q, k, v)}
    notes: dict[str, str] = {}
    outs = {"flash": fwd["flash"]()}
    outs["sdpa dense mask"] = fwd["sdpa dense mask"]()
    if not args.no_flex:
        flex, why = _flex(
            L, L, lambda b, h, i, j: (i - j >= 0) & (i - j < w), B, H, D, dt, args.device
        )
        if flex is not None:
            fwd["flex (compiled, BlockMask)"] = _no_grad(flex, q, k, v)
            outs["flex (compiled, BlockMask)"] = fwd["flex (compiled, BlockMask)"]()
        else:
            notes["flex (compiled, BlockMask)"] = why
    local, why = _local_attention(w - 1)  # window−1 lookback = exactly w keys
    if local is not None:
        fwd["local-attention"] = _no_grad(local, q, k, v)
        outs["local-attention"] = fwd["local-attention"]()
    else:
        notes["local-attention"] = why
    block = band_block()
    qt, kt, vt, tile_mask = band_tiles(q, k, v, w, block)
    bound = f"kernel bound: 1 sdpa call, {qt.shape[0]}×({H}, {block}, {kt.shape[2]}) tiles"
    fwd[bound] = _no_grad(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, tile_mask)
    if _naive_fits(B, H, L, L):
        fwd["naive formula"] = _no_grad(_naive, q, k, v, dense)
    else:
        notes["naive formula"] = (
            f"skipped: its L×S scores need {3 * 4 * B * H * L * L / 1e9:.0f} GB"
        )
    label = f"window {w} L={L}"
    tol = tolerance(dt, outs["flash"])
    times = interleaved(fwd, args.repeats, progress, label + " fwd", args.device, clock)
    for name, t in times.items():
        err = _err(outs[name], outs["flash"]) if name in outs and name != "flash" else None
        note = "same tile shapes as flash's band forward" if name == bound else ""
        report.rows.append(
            Row(label + " fwd", name, t, useful / t, note, err, name_dt, tol if err else None)
        )
    for name, why in notes.items():
        report.rows.append(Row(label + " fwd", name, None, note=why, dtype=name_dt))
    if args.no_backward:
        return
    bwd = {
        "flash": _fwd_bwd(flash, q, k, v, dout),
        "sdpa dense mask": _fwd_bwd(sdpa, q, k, v, dout),
    }
    bwd_notes: dict[str, str] = {}
    if "flex (compiled, BlockMask)" in fwd:
        flex_bwd = _fwd_bwd(flex, q, k, v, dout)
        try:  # torch 2.13 raises NotImplementedError: no FlexAttention backward on CPU
            flex_bwd()
            bwd["flex (compiled, BlockMask)"] = flex_bwd
        except Exception as e:
            bwd_notes["flex (compiled, BlockMask)"] = f"{type(e).__name__}: {str(e)[:70]}"
    if local is not None:
        bwd["local-attention"] = _fwd_bwd(local, q, k, v, dout)
    times = interleaved(
        bwd, max(1, args.repeats - 1), progress, label + " fwd+bwd", args.device, clock
    )
    for name, t in times.items():
        report.rows.append(Row(label + " fwd+bwd", name, t, 3.5 * useful / t, dtype=name_dt))
    for name, why in bwd_notes.items():
        report.rows.append(Row(label + " fwd+bwd", name, None, note=why, dtype=name_dt))


def case_causal(args, report: Report, progress: Progress) -> None:
    from .. import masks
    from ..functional import attention

    B, H, D, L = args.batch, args.heads, args.dim, args.causal_length
    name_dt, clock = dtype_name(args.run_dtype), CLOCKS[args.clock]
    q, k, v, dout = _inputs(args, L)
    useful = 4 * masks.causal().attended_pairs(L, L) * B * H * D / 1e9

    def flash(q, k, v):
        return attention(q, k, v, mask=masks.causal(), backend="flash")

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    label = f"causal L={L}"
    fwd = {"flash": _no_grad(flash, q, k, v), "sdpa is_causal": _no_grad(sdpa, q, k, v)}
    out = fwd["flash"]()
    err, tol = _err(out, fwd["sdpa is_causal"]()), tolerance(args.run_dtype, out)
    times = interleaved(fwd, args.repeats, progress, label + " fwd", args.device, clock)
    for name, t in times.items():
        other = name != "flash"
        report.rows.append(
            Row(
                label + " fwd",
                name,
                t,
                useful / t,
                max_err=err if other else None,
                dtype=name_dt,
                tolerance=tol if other else None,
            )
        )
    if args.no_backward:
        return
    bwd = {"flash": _fwd_bwd(flash, q, k, v, dout), "sdpa is_causal": _fwd_bwd(sdpa, q, k, v, dout)}
    for name, t in interleaved(
        bwd, max(1, args.repeats - 1), progress, label + " fwd+bwd", args.device, clock
    ).items():
        report.rows.append(Row(label + " fwd+bwd", name, t, 3.5 * useful / t, dtype=name_dt))


def _masked_case(
    args, report: Report, progress: Progress, label: str, mask, L: int, recipe: str
) -> None:
    """flash against SDPA with the dense mask and compiled Flex (the mask's own `mask_mod`),
    forward (with max|Δ|) and forward + backward (Flex has no CPU backward), then flash's peak
    memory for one forward + backward in a subprocess (`memory_row`)."""
    from ..functional import attention

    B, H, D = args.batch, args.heads, args.dim
    dt, name_dt, clock = args.run_dtype, dtype_name(args.run_dtype), CLOCKS[args.clock]
    q, k, v, dout = _inputs(args, L)
    useful = 4 * mask.attended_pairs(L, L) * B * H * D / 1e9

    def flash(q, k, v):
        return attention(q, k, v, mask=mask, backend="flash")

    dense = mask.to_dense(L, L, device=args.device)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    fwd = {"flash": _no_grad(flash, q, k, v), "sdpa dense mask": _no_grad(sdpa, q, k, v)}
    notes: dict[str, str] = {}
    if not args.no_flex:
        flex, why = _flex(L, L, mask.mask_mod(L, L), B, H, D, dt, args.device)
        if flex is not None:
            fwd["flex (compiled, BlockMask)"] = _no_grad(flex, q, k, v)
        else:
            notes["flex (compiled, BlockMask)"] = why
    outs = {name: fn() for name, fn in fwd.items()}
    tol = tolerance(dt, outs["flash"])
    for name, t in interleaved(
        fwd, args.repeats, progress, label + " fwd", args.device, clock
    ).items():
        err = _err(outs[name], outs["flash"]) if name != "flash" else None
        report.rows.append(
            Row(label + " fwd", name, t, useful / t, "", err, name_dt, tol if err else None)
        )
    for name, why in notes.items():
        report.rows.append(Row(label + " fwd", name, None, note=why, dtype=name_dt))
    if args.no_backward:
        return
    bwd = {
        "flash": _fwd_bwd(flash, q, k, v, dout),
        "sdpa dense mask": _fwd_bwd(sdpa, q, k, v, dout),
    }
    for name, t in interleaved(
        bwd, max(1, args.repeats - 1), progress, label + " fwd+bwd", args.device, clock
    ).items():
        report.rows.append(Row(label + " fwd+bwd", name, t, 3.5 * useful / t, dtype=name_dt))
    memory_row(args, report, progress, f"memory {label} fwd+bwd", recipe, L)


def case_documents(args, report: Report, progress: Progress) -> None:
    """Packed documents: ``causal() & document.from_lengths([doc] * (L // doc))``."""
    from .. import masks

    L, doc = args.documents_length, args.doc_length
    if L % doc:
        raise ValueError(f"--documents-length must be a multiple of --doc-length={doc}, got {L}")
    mask = masks.causal() & masks.document.from_lengths([doc] * (L // doc))
    label = f"documents {L // doc}×{doc} causal L={L}"
    _masked_case(args, report, progress, label, mask, L, f"documents:{doc}")


def case_bigbird(args, report: Report, progress: Progress) -> None:
    """BigBird (`BIGBIRD`): blocks of 64, a window of 3 blocks, 2 global, 3 random per row."""
    from .. import masks

    L = args.bigbird_length
    mask = masks.bigbird(*BIGBIRD)
    _masked_case(args, report, progress, f"bigbird 64/3/2/3 L={L}", mask, L, "bigbird")


def case_alibi(args, report: Report, progress: Progress) -> None:
    from .. import masks
    from ..functional import attention
    from ..positional import ALiBi

    B, H, D, L = args.batch, args.heads, args.dim, args.alibi_length
    dt, name_dt, clock = args.run_dtype, dtype_name(args.run_dtype), CLOCKS[args.clock]
    q, k, v = _inputs(args, L, 3)
    alibi = ALiBi(H)
    mask = masks.causal()
    useful = 4 * mask.attended_pairs(L, L) * B * H * D / 1e9
    label = f"alibi causal L={L}"

    def flash():
        with torch.no_grad():
            return attention(q, k, v, mask=mask, bias=alibi, backend="flash")

    def build_bias() -> torch.Tensor:
        dev = args.device
        i = torch.arange(L, device=dev).view(1, 1, L, 1)
        j = torch.arange(L, device=dev).view(1, 1, 1, L)
        bias = alibi(
            torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev),
            torch.arange(H, device=dev).view(1, H, 1, 1),
            i,
            j,
        )
        # (1, H, L, L) in the inputs' dtype (sdpa's rule), causal folded in
        return bias.masked_fill(j > i, float("-inf")).to(dt)

    gb = dt.itemsize * H * L * L / 1e9
    if gb > args.max_bias_gb:
        t = interleaved({"flash": flash}, args.repeats, progress, label, args.device, clock)
        report.rows.append(Row(label, "flash", t["flash"], useful / t["flash"], dtype=name_dt))
        report.rows.append(
            Row(
                label,
                "sdpa materialised bias",
                None,
                note=f"skipped: the bias needs {gb:.1f} GB > --max-bias-gb",
                dtype=name_dt,
            )
        )
        return
    holder: dict[str, torch.Tensor] = {}

    def sdpa_prebuilt():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=holder["bias"]
            )

    def sdpa_with_build():
        holder["bias"] = None  # type: ignore[assignment]
        holder["bias"] = build_bias()
        return sdpa_prebuilt()

    out_flash = flash()
    err, tol = _err(out_flash, sdpa_with_build()), tolerance(dt, out_flash)
    fns = {
        "flash": flash,
        "sdpa (bias prebuilt)": sdpa_prebuilt,
        "sdpa (+ building the bias)": sdpa_with_build,
    }
    times = interleaved(fns, args.repeats, progress, label, args.device, clock)
    for name, t in times.items():
        other = name != "flash"
        note = f"bias {gb:.1f} GB" if other else "one bias tile per offset"
        report.rows.append(
            Row(
                label,
                name,
                t,
                useful / t,
                note,
                err if other else None,
                name_dt,
                tol if other else None,
            )
        )
    if not args.no_backward:
        q, k, v, dout = (*(t.detach() for t in (q, k, v)), torch.randn_like(q))

        def flash_bwd():
            x = [t.detach().requires_grad_(True) for t in (q, k, v)]
            attention(*x, mask=mask, bias=alibi, backend="flash").backward(dout)

        def sdpa_bwd():
            x = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=holder["bias"])
            out.backward(dout)

        bwd = {"flash": flash_bwd, "sdpa (bias prebuilt)": sdpa_bwd}
        for name, t in interleaved(
            bwd, max(1, args.repeats - 1), progress, label + " fwd+bwd", args.device, clock
        ).items():
            report.rows.append(Row(label + " fwd+bwd", name, t, 3.5 * useful / t, dtype=name_dt))
    holder.clear()
    if not args.no_backward:
        memory_row(args, report, progress, f"memory {label} fwd+bwd", "alibi", L)


MEMORY_SCRIPT = r"""
import json, sys, time, torch, attnlab
from attnlab import masks
from attnlab.positional import ALiBi
B, H, L, D, threads = (int(x) for x in sys.argv[1:6])
dtype = getattr(torch, sys.argv[6])
clock = time.process_time if sys.argv[7] == "cpu" else time.perf_counter
kind, _, arg = sys.argv[8].partition(":")
bias = None
if kind == "causal":
    mask = masks.causal()
elif kind == "documents":
    mask = masks.causal() & masks.document.from_lengths([int(arg)] * (L // int(arg)))
elif kind == "bigbird":
    mask = masks.bigbird(*(int(x) for x in sys.argv[9].split(",")))
elif kind == "alibi":
    mask, bias = masks.causal(), ALiBi(H)
else:
    raise SystemExit(f"unknown mask recipe {sys.argv[8]!r}")
if threads:
    torch.set_num_threads(threads)
q, k, v = (torch.randn(B, H, L, D).to(dtype).requires_grad_(True) for _ in range(3))
dout = torch.randn(B, H, L, D).to(dtype)
def status_mb(field):  # VmRSS / VmHWM of this process (ru_maxrss would include the parent's)
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
peak = lambda: status_mb("VmHWM")
base = status_mb("VmRSS")  # with the inputs allocated: growth = what attention itself adds
t = clock()
out = attnlab.attention(q, k, v, mask=mask, bias=bias, backend="flash")
t_fwd = clock() - t
out.backward(dout)
total = clock() - t
print(json.dumps({"growth_mb": peak() - base, "fwd_s": t_fwd, "fwd_bwd_s": total,
                  "finite": bool(torch.isfinite(q.grad).all()),
                  "pairs": mask.attended_pairs(L, L)}))
"""


def memory_row(args, report: Report, progress: Progress, label: str, recipe: str, L: int) -> None:
    """flash's peak RSS growth (and time) for one forward + backward at length ``L`` in a fresh
    subprocess, the mask given by ``recipe`` (``causal``, ``documents:DOC``, ``bigbird``,
    ``alibi``: causal with ALiBi's bias); the row is ``memory LABEL fwd+bwd``."""
    B, H, D = args.batch, args.heads, args.dim
    name_dt = dtype_name(args.run_dtype)
    if torch.device(args.device).type != "cpu":
        note = f"skipped: measures the host's peak RSS (cpu only), not {args.device}"
        report.rows.append(Row(label, "flash", None, note=note, dtype=name_dt))
        return
    progress.step(f"{label} {name_dt} (subprocess)")
    argv = (B, H, L, D, args.threads or 0, name_dt, args.clock, recipe, ",".join(map(str, BIGBIRD)))
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, *(str(x) for x in argv)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        note = f"failed: {proc.stderr[-200:]}"
        report.rows.append(Row(label, "flash", None, note=note, dtype=name_dt))
        return
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    useful = 4 * res["pairs"] * B * H * D / 1e9
    lxs = args.run_dtype.itemsize * B * H * L * L / 1e9
    report.rows.append(
        Row(
            label,
            "flash",
            res["fwd_bwd_s"],
            3.5 * useful / res["fwd_bwd_s"],
            note=f"peak RSS growth {res['growth_mb'] / 1024:.2f} GB "
            f"(one {SHORT.get(name_dt, name_dt)} L×S score tensor: {lxs:.1f} GB)",
            dtype=name_dt,
        )
    )


def case_memory(args, report: Report, progress: Progress) -> None:
    """flash's peak memory for one causal forward + backward at ``--memory-length``."""
    L = args.memory_length
    memory_row(args, report, progress, f"memory causal fwd+bwd L={L}", "causal", L)
