"""The cases and contenders of ``attnlab bench`` (`attnlab.cli.bench` runs them and prints).

Every case runs in the dtype of ``args.run_dtype`` (float32, bfloat16 or float16): inputs,
FlexAttention compiled for that dtype, SDPA with the dense mask, local-attention, and the kernel
bound (one SDPA call on the tile shapes flash uses). Times come from ``args.clock`` (wall clock,
or this process's CPU time with ``--clock cpu``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..utils import Progress, best_times, matmul_rate  # noqa: F401  (matmul_rate: re-exported)
from ._bench_memory import memory_row
from ._bench_rows import (  # noqa: F401  (re-exported for `attnlab.cli.bench`)
    BIGBIRD,
    CLOCKS,
    DTYPES,
    SHORT,
    Report,
    Row,
    dtype_name,
    tolerance,
)


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


def matmul_size(
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    n: int = 4096,
    budget: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """The largest power-of-two size up to ``n`` whose ``torch.mm`` should take at most
    ``budget`` seconds, from the best of three timed 512² products (at least 512; one timing
    hit by a preempted thread picked 2048² for float32 in a run). A dtype without native
    matrix units (float16 on a CPU without AVX512-FP16; measured: benchmarks/RESULTS.md) would
    otherwise spend minutes on the 4096² rate."""
    m = min(n, 512)
    a = torch.randn(m, m, device=device).to(dtype)
    mm = _synced(lambda: torch.mm(a, a), device)
    mm()
    seconds = []
    for _ in range(3):
        t0 = clock()
        mm()
        seconds.append(clock() - t0)
    per_flop = max(min(seconds), 1e-9) / (2 * m**3)
    while n > 512 and per_flop * 2 * n**3 > budget:
        n //= 2
    return n


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


def _flash_and_dense_bwd(flash, sdpa, q, k, v, dout) -> dict[str, Callable[[], None]]:
    """Forward + backward of flash and of SDPA with the dense mask, named as in the rows."""
    return {
        "flash": _fwd_bwd(flash, q, k, v, dout),
        "sdpa dense mask": _fwd_bwd(sdpa, q, k, v, dout),
    }


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
        # a fresh compile per case: recompiling flex_attention for a second mask in the same
        # process fell back to an unfused path (a documents case after the window case grew to
        # 24 GB and was killed; a bigbird case failed to compile)
        torch.compiler.reset()
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


def band_block(q) -> int:
    """Query rows per block of flash's batched band forward on ``q`` (`plan.band_block_fwd`)."""
    from ..functional.flash import plan

    return plan.band_block_fwd(q)


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


def _matmul_floor_row(report: Report, case: str, flops: float, useful: float, name_dt: str) -> None:
    """A computed row: the time of the tiles' two products (``flops``) at the dtype's measured
    matmul rate — what no kernel on those tiles can beat, softmax aside."""
    rate = report.matmul_gflops.get(name_dt)
    if not rate:
        return
    seconds = flops / (rate * 1e9)
    name = f"matmul floor: q·kᵀ and p·v of those tiles at {rate:.0f} GF/s"
    note = "computed, not timed: 4·rows·keys·D flops per tile and head / the mm rate above"
    report.rows.append(Row(case, name, seconds, useful / seconds, note, None, name_dt, None))


def _fwd_rows(
    report: Report,
    case: str,
    times: dict[str, float],
    outs: dict[str, torch.Tensor],
    useful: float,
    tol: float,
    name_dt: str,
    notes: dict[str, str],
) -> None:
    """Rows of timed forward contenders (max|Δ| against flash's output where there is one,
    judged by ``tol``) and of contenders that did not run (``notes`` of names not timed)."""
    for name, t in times.items():
        err = _err(outs[name], outs["flash"]) if name in outs and name != "flash" else None
        tol_row = tol if err is not None else None
        report.rows.append(
            Row(case, name, t, useful / t, notes.get(name, ""), err, name_dt, tol_row)
        )
    for name, why in notes.items():
        if name not in times:
            report.rows.append(Row(case, name, None, note=why, dtype=name_dt))


def _bwd_rows(
    args,
    report: Report,
    progress: Progress,
    case: str,
    fns: dict[str, Callable[[], None]],
    useful: float,
    notes: dict[str, str] | None = None,
) -> None:
    """Times forward + backward contenders (``--repeats`` − 1 rounds) into rows of ``case``
    (useful GFLOP/s count the backward as 2.5 forwards), then rows for ``notes``."""
    name_dt = dtype_name(args.run_dtype)
    times = interleaved(
        fns, max(1, args.repeats - 1), progress, case, args.device, CLOCKS[args.clock]
    )
    for name, t in times.items():
        report.rows.append(Row(case, name, t, 3.5 * useful / t, dtype=name_dt))
    for name, why in (notes or {}).items():
        report.rows.append(Row(case, name, None, note=why, dtype=name_dt))


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
            L, L, lambda _b, _h, i, j: (i - j >= 0) & (i - j < w), B, H, D, dt, args.device
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
    block = band_block(q)
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
    notes[bound] = "same tile shapes as flash's band forward"
    _fwd_rows(report, label + " fwd", times, outs, useful, tol, name_dt, notes)
    _matmul_floor_row(
        report, label + " fwd", 4 * qt.shape[0] * H * block * kt.shape[2] * D, useful, name_dt
    )
    if args.no_backward:
        return
    bwd = _flash_and_dense_bwd(flash, sdpa, q, k, v, dout)
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
    _bwd_rows(args, report, progress, label + " fwd+bwd", bwd, useful, bwd_notes)


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
    _bwd_rows(args, report, progress, label + " fwd+bwd", bwd, useful)


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
    times = interleaved(fwd, args.repeats, progress, label + " fwd", args.device, clock)
    _fwd_rows(report, label + " fwd", times, outs, useful, tol, name_dt, notes)
    if args.no_backward:
        return
    bwd = _flash_and_dense_bwd(flash, sdpa, q, k, v, dout)
    _bwd_rows(args, report, progress, label + " fwd+bwd", bwd, useful)
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
        _bwd_rows(args, report, progress, label + " fwd+bwd", bwd, useful)
    holder.clear()
    if not args.no_backward:
        memory_row(args, report, progress, f"memory {label} fwd+bwd", "alibi", L)


def case_memory(args, report: Report, progress: Progress) -> None:
    """flash's peak memory for one causal forward + backward at ``--memory-length``."""
    L = args.memory_length
    memory_row(args, report, progress, f"memory causal fwd+bwd L={L}", "causal", L)
