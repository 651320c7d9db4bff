"""``attnlab bench``'s memory rows: flash's peak RSS growth for one forward + backward, measured
in a fresh subprocess (so earlier cases' allocations do not count) for a named mask recipe."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ..utils import Progress
from ._bench_rows import BIGBIRD, SHORT, Report, Row, dtype_name

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
    score_mib = args.run_dtype.itemsize * B * H * L * L / 2**20
    report.rows.append(
        Row(
            label,
            "flash",
            res["fwd_bwd_s"],
            3.5 * useful / res["fwd_bwd_s"],
            note=f"peak RSS growth {res['growth_mb']:,.1f} MiB "
            f"(one {SHORT.get(name_dt, name_dt)} L×S score tensor: {score_mib:,.1f} MiB)",
            dtype=name_dt,
            peak_bytes=round(res["growth_mb"] * 2**20),
        )
    )
