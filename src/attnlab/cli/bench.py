"""`attnlab bench`: the flash backend against its anchors, measured side by side in one run.

Each case times every contender in the same process, interleaved round by round (so machine noise
hits them alike), keeps the best of ``--repeats`` rounds, checks every contender's output against
flash's, and prints ratios. "Useful GFLOP/s" counts only attended pairs,
``4·B·H·pairs·D / seconds`` (`Mask.attended_pairs`), and the machine's fp32 matmul rate
(``torch.mm`` on 4096² matrices) is measured in the same run as the physical limit.

Cases (B=1, H=8, D=64, float32 by default):

- ``window``: causal sliding window (256) at L=16384 — flash vs sdpa with the dense bool mask,
  compiled FlexAttention with a BlockMask, local-attention, and the naive formula (when its L×S
  matrices fit in memory);
- ``causal``: dense causal at L=8192 — flash vs sdpa ``is_causal=True``;
- ``alibi``: ALiBi + causal at L=16384 — flash (one relative-bias tile per window offset) vs sdpa
  with the materialised bias;
- ``memory``: forward + backward of causal attention at L=65536, peak RSS growth (subprocess).

Optional dependencies are imported where used: tqdm (progress, ``cli`` extra), matplotlib
(``--plot``), local-attention (a benchmark anchor, ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..utils import Progress, best_times, text_table
from ._args import add_device_argument, check_output_file, nonnegative_float, positive_int

CASES = ("window", "causal", "alibi", "memory")
#: File types ``--plot`` can write (matplotlib's raster and vector formats).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
#: Sequence length of each case (``--window-length`` etc.); ``--quick`` divides the ones not given.
LENGTHS = {
    "window_length": 16384,
    "causal_length": 8192,
    "alibi_length": 16384,
    "memory_length": 65536,
}


# --------------------------------------------------------------------------- measuring
@dataclass
class Row:
    """One contender's result in one case."""

    case: str
    name: str
    seconds: float | None
    useful_gflops: float | None = None
    note: str = ""
    max_err: float | None = None


@dataclass
class Report:
    """Everything one `attnlab bench` run measured."""

    rows: list[Row] = field(default_factory=list)
    matmul_gflops: float = 0.0
    info: dict[str, str] = field(default_factory=dict)


def _rate(gflops: float) -> str:
    """A rate as printed: whole GFLOP/s, two significant digits below 10 (never a bare 0)."""
    return f"{gflops:.0f}" if gflops >= 10 else f"{gflops:.2g}"


def matmul_rate(n: int = 4096, repeats: int = 3, device: torch.device | str = "cpu") -> float:
    """fp32 ``torch.mm`` GFLOP/s on n×n matrices on ``device`` (best of ``repeats``)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = best_times({"mm": _synced(lambda: torch.mm(a, b), device)}, repeats)["mm"]
    return 2 * n**3 / best / 1e9


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


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    progress: Progress,
    label: str,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Best time of each function on ``device`` over ``repeats`` rounds; one call of each per
    round."""
    fns = {name: _synced(fn, device) for name, fn in fns.items()}
    return best_times(fns, repeats, on_step=lambda what: progress.step(f"{label}: {what}"))


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


# --------------------------------------------------------------------------- contenders
def _flex(L: int, S: int, mask_mod, B: int, H: int, device: torch.device | str = "cpu"):
    """Compiled FlexAttention with a BlockMask, or (None, reason)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block = create_block_mask(mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=S, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def run(q, k, v):
            return compiled(q, k, v, block_mask=block)

        with torch.no_grad():  # compile now: failures are reported, not raised mid-benchmark
            tiny = torch.zeros(B, H, L, 64, device=device)
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


# --------------------------------------------------------------------------- cases
def case_window(args, report: Report, progress: Progress) -> None:
    from .. import masks
    from ..functional import attention

    B, H, D, L, w = args.batch, args.heads, args.dim, args.window_length, args.window
    q, k, v, dout = (torch.randn(B, H, L, D, device=args.device) for _ in range(4))
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
        flex, why = _flex(L, L, lambda b, h, i, j: (i - j >= 0) & (i - j < w), B, H, args.device)
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
    if _naive_fits(B, H, L, L):
        fwd["naive formula"] = _no_grad(_naive, q, k, v, dense)
    else:
        notes["naive formula"] = (
            f"skipped: its L×S scores need {3 * 4 * B * H * L * L / 1e9:.0f} GB"
        )
    label = f"window {w} L={L}"
    times = interleaved(fwd, args.repeats, progress, label + " fwd", args.device)
    for name, t in times.items():
        err = _err(outs[name], outs["flash"]) if name in outs and name != "flash" else None
        report.rows.append(Row(label + " fwd", name, t, useful / t, max_err=err))
    for name, why in notes.items():
        report.rows.append(Row(label + " fwd", name, None, note=why))
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
    times = interleaved(bwd, max(1, args.repeats - 1), progress, label + " fwd+bwd", args.device)
    for name, t in times.items():
        report.rows.append(Row(label + " fwd+bwd", name, t, 3.5 * useful / t))
    for name, why in bwd_notes.items():
        report.rows.append(Row(label + " fwd+bwd", name, None, note=why))


def case_causal(args, report: Report, progress: Progress) -> None:
    from .. import masks
    from ..functional import attention

    B, H, D, L = args.batch, args.heads, args.dim, args.causal_length
    q, k, v, dout = (torch.randn(B, H, L, D, device=args.device) for _ in range(4))
    useful = 4 * masks.causal().attended_pairs(L, L) * B * H * D / 1e9

    def flash(q, k, v):
        return attention(q, k, v, mask=masks.causal(), backend="flash")

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    label = f"causal L={L}"
    fwd = {"flash": _no_grad(flash, q, k, v), "sdpa is_causal": _no_grad(sdpa, q, k, v)}
    err = _err(fwd["flash"](), fwd["sdpa is_causal"]())
    for name, t in interleaved(fwd, args.repeats, progress, label + " fwd", args.device).items():
        report.rows.append(
            Row(label + " fwd", name, t, useful / t, max_err=err if name != "flash" else None)
        )
    if args.no_backward:
        return
    bwd = {"flash": _fwd_bwd(flash, q, k, v, dout), "sdpa is_causal": _fwd_bwd(sdpa, q, k, v, dout)}
    for name, t in interleaved(
        bwd, max(1, args.repeats - 1), progress, label + " fwd+bwd", args.device
    ).items():
        report.rows.append(Row(label + " fwd+bwd", name, t, 3.5 * useful / t))


def case_alibi(args, report: Report, progress: Progress) -> None:
    from .. import masks
    from ..functional import attention
    from ..positional import ALiBi

    B, H, D, L = args.batch, args.heads, args.dim, args.alibi_length
    q, k, v = (torch.randn(B, H, L, D, device=args.device) for _ in range(3))
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
        return bias.masked_fill(j > i, float("-inf"))  # (1, H, L, L) float: causal folded in

    gb = 4 * H * L * L / 1e9
    if gb > args.max_bias_gb:
        t = interleaved({"flash": flash}, args.repeats, progress, label, args.device)["flash"]
        report.rows.append(Row(label, "flash", t, useful / t))
        report.rows.append(
            Row(
                label,
                "sdpa materialised bias",
                None,
                note=f"skipped: the bias needs {gb:.1f} GB > --max-bias-gb",
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
    out_sdpa = sdpa_with_build()
    err = _err(out_flash, out_sdpa)
    fns = {
        "flash": flash,
        "sdpa (bias prebuilt)": sdpa_prebuilt,
        "sdpa (+ building the bias)": sdpa_with_build,
    }
    times = interleaved(fns, args.repeats, progress, label, args.device)
    for name, t in times.items():
        report.rows.append(
            Row(
                label,
                name,
                t,
                useful / t,
                max_err=None if name == "flash" else err,
                note=f"bias {gb:.1f} GB" if name != "flash" else "one bias tile per offset",
            )
        )
    holder.clear()


MEMORY_SCRIPT = r"""
import json, resource, sys, time, torch, attnlab
from attnlab import masks
B, H, L, D = (int(x) for x in sys.argv[1:5])
q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, L, D)
def status_mb(field):  # VmRSS / VmHWM of this process (ru_maxrss would include the parent's)
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
peak = lambda: status_mb("VmHWM")
base = status_mb("VmRSS")  # with the inputs allocated: growth = what attention itself adds
t = time.perf_counter()
out = attnlab.attention(q, k, v, mask=masks.causal(), backend="flash")
t_fwd = time.perf_counter() - t
out.backward(dout)
total = time.perf_counter() - t
print(json.dumps({"growth_mb": peak() - base, "fwd_s": t_fwd, "fwd_bwd_s": total,
                  "finite": bool(torch.isfinite(q.grad).all())}))
"""


def case_memory(args, report: Report, progress: Progress) -> None:
    B, H, D, L = args.batch, args.heads, args.dim, args.memory_length
    label = f"memory causal fwd+bwd L={L}"
    if torch.device(args.device).type != "cpu":
        note = f"skipped: measures the host's peak RSS (cpu only), not {args.device}"
        report.rows.append(Row(label, "flash", None, note=note))
        return
    progress.step(f"memory: causal fwd+bwd L={L} (subprocess)")
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(B), str(H), str(L), str(D)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        report.rows.append(Row(label, "flash", None, note=f"failed: {proc.stderr[-200:]}"))
        return
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    useful = 4 * (L * (L + 1) // 2) * B * H * D / 1e9
    lxs = 4 * B * H * L * L / 1e9
    report.rows.append(
        Row(
            label,
            "flash",
            res["fwd_bwd_s"],
            3.5 * useful / res["fwd_bwd_s"],
            note=f"peak RSS growth {res['growth_mb'] / 1024:.2f} GB "
            f"(one fp32 L×S score tensor: {lxs:.0f} GB)",
        )
    )


# --------------------------------------------------------------------------- output
def format_table(report: Report) -> str:
    """The results as a plain-text table, with speed-ups against flash within each case."""
    lines = [
        f"machine: {report.info.get('machine', '')}",
        f"fp32 matmul (torch.mm 4096²): {_rate(report.matmul_gflops)} GFLOP/s  "
        "<- the physical limit",
        "",
    ]
    header = ("case", "contender", "seconds", "useful GF/s", "% mm", "flash is ×", "note")
    rows: list[tuple[str, ...] | None] = []
    by_case: dict[str, list[Row]] = {}
    for r in report.rows:
        by_case.setdefault(r.case, []).append(r)
    for case, case_rows in by_case.items():
        flash = next((r.seconds for r in case_rows if r.name == "flash"), None)
        for r in case_rows:
            gf = r.useful_gflops
            ratio = ""
            if flash and r.seconds and r.name != "flash":
                ratio = f"{r.seconds / flash:.2f}×"
            note = r.note
            if r.max_err is not None:
                note = (note + "; " if note else "") + f"max|Δ| vs flash {r.max_err:.1e}"
            rows.append(
                (
                    case,
                    r.name,
                    f"{r.seconds:.3f}" if r.seconds is not None else "n/a",
                    f"{gf:.1f}" if gf else "",
                    f"{100 * gf / report.matmul_gflops:.0f}%" if gf else "",
                    ratio,
                    note,
                )
            )
        rows.append(None)
    lines.append(text_table(header, rows, align="<<>>>><"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers ``attnlab bench`` on an argparse ``subparsers`` object and returns its parser."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the flash backend against sdpa, FlexAttention, local-attention, naive",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--case",
        choices=[*CASES, "all"],
        nargs="+",
        default=["all"],
        help="which cases to run (default: all)",
    )
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument(
        "--window", type=positive_int, default=256, help="sliding-window size (keys per query)"
    )
    for name, default in LENGTHS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=positive_int,
            default=None,
            help=f"default {default} ({default // 8} with --quick)",
        )
    p.add_argument(
        "--max-bias-gb",
        type=nonnegative_float,
        default=10.0,
        help="skip sdpa with a materialised bias above this size",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed rounds per contender (best kept)"
    )
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--no-flex", action="store_true", help="skip compiling FlexAttention")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (default L/8, at least 256) for a smoke run; lengths given explicitly "
        "are kept; the targets are for the defaults",
    )
    p.add_argument("--plot", metavar="PNG", help="also write a bar chart")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    add_device_argument(p)
    p.set_defaults(func=run_bench)
    return p


def run_bench(args: argparse.Namespace) -> int:
    """Runs the selected cases, prints the table; returns the process exit code."""
    cases = list(CASES) if "all" in args.case else list(dict.fromkeys(args.case))
    if args.json:
        check_output_file(args.json, "--json")
    if args.plot:
        check_output_file(args.plot, "--plot", PLOT_SUFFIXES)
    for name, default in LENGTHS.items():  # explicit lengths are kept, --quick or not
        if getattr(args, name, None) is None:
            setattr(args, name, max(256, default // 8) if args.quick else default)
    steps = 1 + len(cases) * (2 * 5 * (args.repeats + 1))
    progress = Progress(total=steps, unit="step", enabled=not args.quiet, echo=True)
    report = Report()
    report.info["machine"] = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, device {args.device}"
    )
    report.info["command"] = "attnlab bench " + " ".join(sys.argv[2:])
    progress.step("fp32 matmul rate")
    report.matmul_gflops = matmul_rate(device=args.device)
    runners = {
        "window": case_window,
        "causal": case_causal,
        "alibi": case_alibi,
        "memory": case_memory,
    }
    for name in cases:
        runners[name](args, report, progress)
    progress.close()
    text = format_table(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "matmul_gflops": report.matmul_gflops,
                    "info": report.info,
                    "rows": [r.__dict__ for r in report.rows],
                },
                f,
                indent=1,
            )
    if args.plot:
        from ..viz.bench import plot_bench

        plot_bench(report.rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``benchmarks/bench_flash.py``): ``main(["bench", ...])``, the
    ``attnlab`` command's entry point (same errors and exit codes)."""
    from . import main as attnlab_main

    return attnlab_main(argv)
