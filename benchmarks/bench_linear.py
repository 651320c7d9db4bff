"""Linear attention and Performer (FAVOR+) against exact softmax attention: time, memory, error.

Forward passes (inference, ``torch.no_grad``) on ``(B, H, L, D)`` fp32 inputs, L from 1K to 64K:

1. time vs L for linear attention (elu + 1, non-causal and causal), FAVOR+ (256 features) and
   exact softmax attention through the "sdpa" backend (and "flash" when registered), timed
   side by side, interleaved (best of ``--repeats``, or ``--stat median``); exact calls
   predicted over 2 s are timed once, those over ``--exact-budget`` seconds are skipped;
2. peak memory vs L: growth of the process's peak resident set during one call (VmHWM reset
   through /proc/self/clear_refs; glibc's mmap threshold is pinned so freed blocks leave RSS);
3. the crossover length where linear attention beats exact attention (finer sweep below 1K);
4. FAVOR+ approximation error vs number of random features (mean relative output error
   against exact softmax attention, over ``--draws`` independent draws);
5. the project's targets for linear attention, then a PNG plot (matplotlib, the viz extra).

The machine's fp32 matmul rate is printed first as the physical limit.

``--scaling`` runs only the causal-linear scaling check instead (target: time(64K)/time(8K)
<= 10, ideal 8): causal `linear_attention` at B=1 H=8 D=64, L = 8K…64K, forward (no_grad) and
forward + backward, per dtype (``--dtypes float32,bfloat16``), ``--clock cpu`` (this process's
CPU time; with ``--threads 1`` the uncontended time on a shared machine) or wall, min over
interleaved rounds, with the CPU header (model, AMX, the matmul rate of each dtype) and
time(64K)/time(8K);
``--scaling-method favor_attention`` times causal FAVOR+ (``--features`` random features) instead,
``favor_attention_noncausal`` non-causal FAVOR+.

Run: python benchmarks/bench_linear.py [--lengths 1024,2048,...,65536] [--heads 4] [--repeats 3]
     [--exact-budget 20] [--plot benchmarks/bench_linear.png]
     python benchmarks/bench_linear.py --scaling [--threads 1] [--clock cpu] [--dtypes float32]
         [--scaling-method linear_attention|favor_attention|favor_attention_noncausal]
         [--features 256]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import attnlab
from attnlab import masks
from attnlab.analysis.measure import measure
from attnlab.cli._bench_cases import matmul_size
from attnlab.linear import favor_attention, linear_attention
from common import cpu_flags, cpu_model, matmul_gflops, timed

_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _pin_malloc() -> None:
    """Re-executes once with a fixed glibc mmap threshold, so freed tensors leave RSS at once."""
    if os.environ.get(_MMAP_ENV) is None and sys.platform.startswith("linux"):
        os.environ[_MMAP_ENV] = str(128 * 1024)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def progress(msg: str) -> None:
    print(f"  … {msg}", file=sys.stderr, flush=True)


def compare(
    fns: dict[str, Callable[[], object]], repeats: int, once: set[str], stat: str
) -> dict[str, float]:
    """Seconds per call of each function, measured interleaved so drift hits all alike.

    Every function runs once as warm-up, then ``repeats`` interleaved rounds; those in ``once``
    (exact calls of several seconds) are timed in the first round only, without warm-up.
    ``stat`` is "min" (timeit's convention: the least disturbed run, robust on a shared
    machine) or "median".
    """
    for name, fn in fns.items():
        if name not in once:
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            if r == 0 or name not in once:
                samples[name].append(timed(fn))
    pick = min if stat == "min" else statistics.median
    return {name: pick(s) for name, s in samples.items()}


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Growth of the peak RSS during one call of ``fn`` in MiB (`attnlab.analysis.measure`)."""
    gc.collect()
    _, _, peak = measure(fn)
    return peak / 2**20


def methods(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool, features: int
) -> dict[str, Callable[[], object]]:
    causal = masks.causal()
    g = torch.Generator().manual_seed(0)
    W = attnlab.linear.favor_projection(features, q.shape[-1], generator=g)
    fns: dict[str, Callable[[], object]] = {
        "linear": lambda: linear_attention(q, k, v),
        "linear causal": lambda: linear_attention(q, k, v, mask=causal),
        f"favor{features}": lambda: favor_attention(q, k, v, num_features=features, projection=W),
        f"favor{features} causal": lambda: favor_attention(
            q, k, v, num_features=features, projection=W, mask=causal
        ),
        "sdpa": lambda: attnlab.attention(q, k, v, backend="sdpa"),
        "sdpa causal": lambda: attnlab.attention(q, k, v, mask=causal, backend="sdpa"),
    }
    if flash:
        fns["flash"] = lambda: attnlab.attention(q, k, v, backend="flash")
        fns["flash causal"] = lambda: attnlab.attention(q, k, v, mask=causal, backend="flash")
    return fns


def is_exact(name: str) -> bool:
    return name.split()[0] in ("sdpa", "flash")


def sweep(
    lengths: list[int], args: argparse.Namespace, flash: bool, memory: bool
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Times (s) and peak memory growth (MB) per method and length; skipped runs are absent."""
    times: dict[str, dict[int, float]] = {}
    mems: dict[str, dict[int, float]] = {}
    last_exact: dict[str, tuple[int, float]] = {}
    for i, L in enumerate(lengths):
        torch.manual_seed(L)
        q, k, v = (torch.randn(args.batch, args.heads, L, args.head_dim) for _ in range(3))
        fns = methods(q, k, v, flash, args.features)
        run: dict[str, Callable[[], object]] = {}
        once: set[str] = set()  # exact calls predicted to take seconds: timed once
        for name, fn in fns.items():
            if is_exact(name) and name in last_exact:
                L0, t0 = last_exact[name]
                predicted = t0 * (L / L0) ** 2
                if predicted > args.exact_budget:
                    progress(f"L={L}: skip {name} (predicted {predicted:.0f} s > budget)")
                    continue
                if predicted > 2.0:
                    once.add(name)
            run[name] = fn
        progress(
            f"[{i + 1}/{len(lengths)}] time L={L}: {', '.join(run)} ×{args.repeats}"
            + (f" ({', '.join(sorted(once))} ×1)" if once else "")
        )
        with torch.no_grad():
            t = compare(run, args.repeats, once, args.stat)
            for name, sec in t.items():
                times.setdefault(name, {})[L] = sec
                if is_exact(name):
                    last_exact[name] = (L, sec)
            if memory:
                progress(f"[{i + 1}/{len(lengths)}] peak memory L={L}")
                for name, fn in run.items():
                    mb = peak_memory_mb(fn)
                    if mb is not None:
                        mems.setdefault(name, {})[L] = mb
        del q, k, v, fns, run
    return times, mems


def crossover(times: dict[str, dict[int, float]], fast: str, exact: str) -> str:
    """The first swept L where ``fast`` is faster, with the log-log interpolated crossing."""
    a, b = times.get(fast, {}), times.get(exact, {})
    common = sorted(set(a) & set(b))
    prev = None
    for L in common:
        ratio = a[L] / b[L]
        if ratio < 1:
            if prev is None:
                return f"already faster at the smallest L={L} ({b[L] / a[L]:.1f}×)"
            L0, r0 = prev
            x = math.log(L0) + (math.log(L) - math.log(L0)) * math.log(r0) / (
                math.log(r0) - math.log(ratio)
            )
            return f"L ≈ {math.exp(x):.0f} (slower at {L0}, faster at {L})"
        prev = (L, ratio)
    return "not within the swept lengths"


def favor_errors(args: argparse.Namespace, scale: float) -> dict[int, tuple[float, float]]:
    """Mean relative output error of FAVOR+ vs exact softmax, mean ± SE over draws, per M."""
    g = torch.Generator().manual_seed(1)
    L, D = args.error_length, args.head_dim
    q, k = (torch.randn(1, args.heads, L, D, generator=g) * scale for _ in range(2))
    v = torch.randn(1, args.heads, L, D, generator=g)
    with torch.no_grad():
        exact = attnlab.attention(q.double(), k.double(), v.double(), backend="reference")
        out: dict[int, tuple[float, float]] = {}
        for M in args.feature_counts:
            errs = []
            for s in range(args.draws):
                gen = torch.Generator().manual_seed(10_000 * M + s)
                o = favor_attention(q, k, v, num_features=M, generator=gen).double()
                errs.append(float(((o - exact).norm(dim=-1) / exact.norm(dim=-1)).mean()))
            se = statistics.stdev(errs) / math.sqrt(len(errs)) if len(errs) > 1 else 0.0
            out[M] = (statistics.mean(errs), se)
            progress(f"FAVOR+ error scale={scale} M={M}: {out[M][0]:.4f}")
    return out


def plot(path: str, times, mems, errors, args) -> None:
    import matplotlib  # the viz extra; imported only here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for name, series in times.items():
        Ls = sorted(series)
        axes[0].plot(Ls, [series[L] * 1e3 for L in Ls], "o-", label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="L", ylabel="forward time (ms)")
    axes[0].set_title(f"time, B={args.batch} H={args.heads} D={args.head_dim} fp32")
    for name, series in mems.items():
        Ls = sorted(series)
        axes[1].plot(Ls, [max(series[L], 1e-1) for L in Ls], "o-", label=name)
    axes[1].set(xscale="log", yscale="log", xlabel="L", ylabel="peak RSS growth (MB)")
    axes[1].set_title("peak memory of one forward")
    for scale, series in errors.items():
        Ms = sorted(series)
        axes[2].errorbar(
            Ms,
            [series[M][0] for M in Ms],
            yerr=[series[M][1] for M in Ms],
            fmt="o-",
            label=f"q, k ~ N(0, {scale}²)",
        )
    Ms = sorted(next(iter(errors.values())))
    ref = next(iter(errors.values()))[Ms[0]][0]
    axes[2].plot(Ms, [ref * math.sqrt(Ms[0] / M) for M in Ms], "k--", label="∝ 1/√M")
    axes[2].set(xscale="log", yscale="log", xlabel="num_features M", ylabel="mean rel. error")
    axes[2].set_title(f"FAVOR+ vs exact softmax, L={args.error_length}")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clocked(clock: Callable[[], float], fn: Callable[[], object]) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def scaling(args: argparse.Namespace) -> None:
    """Causal linear attention (or FAVOR+) time vs L: fwd and fwd+bwd, per dtype, and
    time(64K)/time(8K) (target <= 10, ideal 8)."""
    amx = sorted(f for f in cpu_flags() if f.startswith("amx"))
    print(f"CPU: {cpu_model()}; AMX: {', '.join(amx) if amx else 'no'}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; attnlab {attnlab.__file__}"
    )
    # torch's CPU allocator on transparent huge pages: the L-sized outputs and gradients of a
    # long call are fresh allocations, faulted in 4 KiB at a time without it
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "") == "1"
    print(f"THP_MEM_ALLOC_ENABLE: {'1 (huge pages)' if thp else 'unset (4 KiB pages)'}")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for dt in dtypes:
        n = matmul_size(dt, clock=clock)  # smaller where the dtype has no native products
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        torch.mm(a, b)
        sec = min(_clocked(clock, lambda a=a, b=b: torch.mm(a, b)) for _ in range(3))
        print(
            f"{dt} matmul rate (torch.mm {n}², {args.clock} clock): "
            f"{2 * n**3 / sec / 1e9:.1f} GFLOP/s"
        )
    B, H, D = args.batch, args.heads, args.head_dim
    attend = _scaling_method(args)
    print(
        f"{args.scaling_method} (causal unless _noncausal), B={B} H={H} D=Dv={D}; "
        f"{args.clock} clock, min of "
        f"{args.repeats} interleaved rounds after a warm-up; load average (1 min) at start "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n"
    )

    def call(q, k, v, backward: bool) -> float:
        if not backward:
            with torch.no_grad():
                t0 = clock()
                attend(q, k, v)
                return clock() - t0
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        t0 = clock()
        out = attend(q, k, v)
        out.backward(torch.ones_like(out))
        return clock() - t0

    for dt in dtypes:
        data = {}
        for L in args.lengths:
            g = torch.Generator().manual_seed(L)
            data[L] = [torch.randn(B, H, L, D, generator=g).to(dt) for _ in range(3)]
        for backward in (False, True):
            kind = "fwd+bwd" if backward else "fwd"
            for L in args.lengths:  # warm-up
                call(*data[L], backward)
            best = dict.fromkeys(args.lengths, math.inf)
            for _ in range(args.repeats):
                for L in args.lengths:
                    best[L] = min(best[L], call(*data[L], backward))
            cells = "  ".join(f"L={L}: {best[L] * 1e3:8.1f} ms" for L in args.lengths)
            print(f"{dt!s:15s} {kind:8s} {cells}")
            lo, hi = min(args.lengths), max(args.lengths)
            print(
                f"{'':24s} time({hi})/time({lo}) = {best[hi] / best[lo]:.2f}  "
                f"(ideal {hi / lo:.0f}; target <= 10 for 65536/8192)"
            )
        kept = _kept_mb(attend, *data[max(args.lengths)])
        print(f"{'':24s} autograd keeps beyond q, k, v: {kept}")
        del data
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


def _scaling_method(args: argparse.Namespace) -> Callable[..., torch.Tensor]:
    """The call `scaling` times (`SCALING_METHODS`); FAVOR+ with a fixed projection."""
    if args.scaling_method == "linear_attention":
        return lambda q, k, v: linear_attention(q, k, v, mask=masks.causal())
    W = attnlab.linear.favor_projection(
        args.features, args.head_dim, generator=torch.Generator().manual_seed(0)
    )
    causal = masks.causal() if args.scaling_method == "favor_attention" else None
    return lambda q, k, v: favor_attention(
        q, k, v, num_features=args.features, projection=W, mask=causal
    )


#: ``--scaling-method`` choices: causal linear attention (elu), causal FAVOR+, non-causal FAVOR+
SCALING_METHODS = ("linear_attention", "favor_attention", "favor_attention_noncausal")


def _kept_mb(attend: Callable[..., torch.Tensor], q, k, v) -> str:
    """MB autograd holds for the backward of one causal call, beyond the inputs themselves: the
    saved tensors (hooks) and the scan's tape (one state per block, a denominator per row)."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attend(q, k, v)
    taped, todo, seen = 0, [out.grad_fn], set()
    while todo:  # the node with a tape: `_CausalScan` or FAVOR+'s `_FavorBlocks`
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tape = getattr(node, "tape", None)
        if tape is not None:
            taped += sum(t.nbytes for t in tape.states + tape.dens)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return (
        f"{sum(kept.values()) / 1e6:.1f} MB saved tensors + {taped / 1e6:.1f} MB tape "
        f"at L={q.shape[2]} (the output alone is {out.nbytes / 1e6:.1f} MB)"
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=_ints, default=_ints("1024,2048,4096,8192,16384,32768,65536")
    )
    parser.add_argument("--crossover-lengths", type=_ints, default=_ints("64,128,256,512,1024"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=256, help="FAVOR+ features in the sweep")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stat", choices=("min", "median"), default="min")
    parser.add_argument("--exact-budget", type=float, default=20.0, help="max predicted s/call")
    parser.add_argument("--feature-counts", type=_ints, default=_ints("16,32,64,128,256,512,1024"))
    parser.add_argument("--error-length", type=int, default=1024)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--plot", default="benchmarks/bench_linear.png")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--scaling", action="store_true", help="only causal linear time(64K)/time(8K), target <= 10"
    )
    parser.add_argument("--dtypes", default="float32", help="--scaling: e.g. float32,bfloat16")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="--scaling")
    parser.add_argument(
        "--scaling-method",
        choices=SCALING_METHODS,
        default="linear_attention",
        help="--scaling: the call timed (causal unless _noncausal; FAVOR+: --features features)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    return parser


def _run_scaling(args: argparse.Namespace) -> None:
    """--scaling: its own defaults for the lengths, heads and repeats not given."""
    if "--lengths" not in sys.argv:
        args.lengths = _ints("8192,16384,32768,65536")
    if "--heads" not in sys.argv:
        args.heads = 8
    if "--repeats" not in sys.argv:
        args.repeats = 3
    scaling(args)


def _print_header(args: argparse.Namespace) -> None:
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, backends {attnlab.backends()}")
    print(f"fp32 matmul rate (torch.mm 4096²): {matmul_gflops():.1f} GFLOP/s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) at start: {load:.2f} on {os.cpu_count()} CPUs")
    print(
        f"shape B={args.batch} H={args.heads} D=Dv={args.head_dim}, fp32, forward, no_grad; "
        f"time = {args.stat} of {args.repeats} interleaved runs\n"
    )


def _print_sweep(args: argparse.Namespace, times: dict, mems: dict) -> None:
    names = list(times)
    print(f"time (ms, {args.stat}) vs L; '-' = skipped (predicted over the exact budget)")
    print(f"{'L':>7} " + " ".join(f"{n:>17}" for n in names))
    for L in args.lengths:
        cells = [f"{times[n][L] * 1e3:17.1f}" if L in times[n] else f"{'-':>17}" for n in names]
        print(f"{L:>7} " + " ".join(cells))
    if mems:
        print("\npeak RSS growth (MB) of one forward vs L")
        print(f"{'L':>7} " + " ".join(f"{n:>17}" for n in names))
        for L in args.lengths:
            cells = [f"{mems[n][L]:17.1f}" if L in mems.get(n, {}) else f"{'-':>17}" for n in names]
            print(f"{L:>7} " + " ".join(cells))


def _print_crossovers(args: argparse.Namespace, times: dict, flash: bool) -> None:
    small, _ = sweep(args.crossover_lengths, args, flash, memory=False)
    merged = {n: {**small.get(n, {}), **times.get(n, {})} for n in times}
    print(
        "\ncrossover (linear attention faster than exact), lengths "
        f"{sorted(set(args.crossover_lengths) | set(args.lengths))}:"
    )
    for fast, exact in (
        ("linear", "sdpa"),
        ("linear causal", "sdpa causal"),
        (f"favor{args.features}", "sdpa"),
        (f"favor{args.features} causal", "sdpa causal"),
        *((("linear", "flash"), ("linear causal", "flash causal")) if flash else ()),
    ):
        print(f"  {fast:>18} vs {exact:<12}: {crossover(merged, fast, exact)}")


def _print_errors(args: argparse.Namespace) -> dict:
    errors = {scale: favor_errors(args, scale) for scale in (0.5, 1.0)}
    print(
        f"\nFAVOR+ mean relative error vs exact softmax (L={args.error_length}, "
        f"D={args.head_dim}, {args.draws} draws, mean ± SE)"
    )
    print(f"{'M':>6} " + " ".join(f"{'q,k ~ N(0,' + str(s) + '²)':>22}" for s in errors))
    for M in args.feature_counts:
        print(f"{M:>6} " + " ".join(f"{e[M][0]:>13.4f} ± {e[M][1]:.4f}" for e in errors.values()))
    return errors


def _print_targets(times: dict, mems: dict, errors: dict) -> None:
    print("\ntargets")
    lc = times.get("linear causal", {})
    if 65536 in lc and 8192 in lc:
        r = lc[65536] / lc[8192]
        print(f"  causal linear time(65536)/time(8192) = {r:.2f}  (target <= 10, ideal 8)")
    mc = mems.get("linear causal", {})
    if 65536 in mc and 8192 in mc and mc[8192] > 0:
        print(f"  causal linear memory(65536)/memory(8192) = {mc[65536] / mc[8192]:.2f}  (O(L): 8)")
    lin, sd = times.get("linear", {}), times.get("sdpa", {})
    if 16384 in lin and 16384 in sd:
        print(
            f"  L=16384 non-causal: sdpa / linear = {sd[16384] / lin[16384]:.1f}×  (target >= 10×)"
        )
    for scale, e in errors.items():
        if 32 in e and 256 in e:
            verdict = "lower" if e[256][0] < e[32][0] else "NOT lower"
            print(
                f"  FAVOR+ q,k ~ N(0,{scale}²): error 256 features {e[256][0]:.4f} vs 32 "
                f"features {e[32][0]:.4f} ({verdict})"
            )


def main() -> None:
    args = _parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.scaling:
        _run_scaling(args)
        return
    _pin_malloc()
    flash = "flash" in attnlab.backends()
    _print_header(args)
    times, mems = sweep(args.lengths, args, flash, memory=not args.no_memory)
    _print_sweep(args, times, mems)
    _print_crossovers(args, times, flash)
    errors = _print_errors(args)
    _print_targets(times, mems, errors)
    if args.plot:
        try:
            plot(args.plot, times, mems, errors, args)
            print(f"\nplot written to {args.plot}")
        except ImportError:
            print("\nmatplotlib is not installed (pip install 'attnlab[viz]'): no plot")


if __name__ == "__main__":
    main()
