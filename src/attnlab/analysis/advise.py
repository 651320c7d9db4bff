"""Length-based advice: which attention (dense, tiled, sparse, linear, ring) for a length, a memory
budget and a machine — with the reason and the numbers from `attnlab.analysis.costs`.

The rule (first that holds wins; memory = `model_cost(...).memory["total"]`, time =
``step FLOPs / rate``)::

    dense   the naive form fits the budget and its time is within max_seconds
    tiled   the tiled (flash) form fits and its time is within max_seconds (exact, memory ∝ L)
    ring    devices > 1 and the tiled form fits when its activations are split over the devices
            (exact; each device holds L / devices tokens) with time / devices within max_seconds
    sparse  a causal sliding window of `window` keys fits and is within max_seconds (approximate)
    linear  linear attention fits and is within max_seconds (approximate; memory and time ∝ L)
    (none within max_seconds: the first exact option that fits, else the fastest that fits)
    none    nothing fits the budget

Deterministic given its inputs: the machine only enters through ``gflops`` (pass it; the CLI
uses this machine's rate, measured once and cached by `attnlab.analysis.rates`, when not given)
and the informational `machine_info`.

Example:
    >>> advise(2048, "16GB", gflops=100.0).choice  # BERT-base-sized encoder, inference
    'dense'
    >>> advise(65536, "8GB", gflops=100.0, max_seconds=3600.0).choice  # 194 GiB of scores
    'tiled'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .._shapes import check_int, check_number
from .costs import model_cost, parse_bytes
from .table_parts import TableParts

CHOICES = ("dense", "tiled", "ring", "sparse", "linear", "none")


def machine_info(cpuinfo: str | None = None) -> dict[str, object]:
    """CPU model and matrix-extension flags from ``/proc/cpuinfo`` (or the text given).

    Returns:
        ``{"cpu": model name or "unknown", "amx": bool, "avx512": bool, "cores": int}``.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags_m = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(flags_m.group(1).split()) if flags_m else set()
    return {
        "cpu": name.group(1).strip() if name else "unknown",
        "amx": bool(flags & {"amx_tile", "amx_bf16", "amx_int8"}),
        "avx512": "avx512f" in flags,
        "cores": len(re.findall(r"^processor\s*:", cpuinfo, re.M)),
    }


@dataclass
class Advice:
    """A recommendation with its reason and the numbers behind it.

    Attributes:
        choice: one of `CHOICES`.
        reason: one sentence.
        options: per option, ``{"memory": bytes, "flops": step FLOPs, "seconds": estimate,
            "fits": bool, "fast enough": bool}``.
        inputs: the inputs the advice depends on.
    """

    choice: str
    reason: str
    options: dict[str, dict[str, float]] = field(default_factory=dict)
    inputs: dict[str, object] = field(default_factory=dict)

    def table(self) -> str:
        """The options as an aligned text table, then the choice and the reason."""
        return self.table_parts().text()

    def table_parts(self) -> TableParts:
        """The table of `table` as data: a row per option; below it, the choice and the reason."""
        from .estimate import _fmt

        rows = [
            [
                name,
                _fmt(o["memory"], "bytes"),
                _fmt(o["flops"], "FLOPs"),
                f"{o['seconds']:,.3f} s",
                "yes" if o["fits"] else "no",
                "yes" if o["fast enough"] else "no",
            ]
            for name, o in self.options.items()
        ]
        head = ["option", "memory", "FLOPs per step", "time", "fits", "within time"]
        verdict = f"advice: {self.choice} — {self.reason}"
        return TableParts(head, rows, "<" * len(head), after=("", verdict))


def advise(
    seq_len: int,
    budget: str | int | float,
    gflops: float,
    *,
    d_model: int = 768,
    n_layers: int = 12,
    n_heads: int = 12,
    vocab_size: int = 0,
    batch: int = 1,
    train: bool = False,
    dtype: str = "float32",
    max_seconds: float = 10.0,
    window: int = 512,
    devices: int = 1,
    machine: dict[str, object] | None = None,
) -> Advice:
    """Recommends dense / tiled / ring / sparse / linear attention for one length (module rule).

    ``time = step FLOPs / (gflops · 10⁹)`` with the step FLOPs of `model_cost` (forward, or
    forward + backward when ``train``); memory from the same model.

    Args:
        seq_len: L. budget: memory per device (bytes or "12GB"). gflops: the machine's matmul rate.
        d_model, n_layers, n_heads, vocab_size, batch, train, dtype: the model (see `model_cost`).
        max_seconds: the time one step may take. window: keys per query of the sparse option.
        devices: devices a ring could use. machine: `machine_info()` (reported, not used).

    Raises:
        ValueError: for a non-positive ``gflops``, ``max_seconds`` or ``devices``.
    """
    cap = parse_bytes(budget)
    check_number("gflops", gflops, positive=True)
    check_number("max_seconds", max_seconds, positive=True)
    check_int("devices", devices, minimum=1)
    check_int("window", window, minimum=1)
    kw = dict(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        vocab_size=vocab_size,
        batch=batch,
        train=train,
        dtype=dtype,
    )
    rate = float(gflops) * 1e9
    options: dict[str, dict[str, float]] = {}

    def add(name: str, memory: float, flops: float, div: int = 1) -> None:
        seconds = flops / rate / div
        options[name] = {
            "memory": memory,
            "flops": flops,
            "seconds": seconds,
            "fits": memory <= cap,
            "fast enough": seconds <= max_seconds,
        }

    dense = model_cost(seq_len, attention="naive", **kw)
    tiled = model_cost(seq_len, attention="flash", **kw)
    add("dense", dense.memory["total"], dense.flops["step"])
    add("tiled", tiled.memory["total"], tiled.flops["step"])
    if devices > 1:
        # Each device keeps the weights (and optimizer state) and 1/devices of the activations.
        per_dev = tiled.memory["total"] - sum(
            v for k, v in tiled.memory.items() if k in ("activations", "logits")
        )
        per_dev += (tiled.memory.get("activations", 0) + tiled.memory.get("logits", 0)) / devices
        if not train:
            per_dev = model_cost(-(-seq_len // devices), attention="flash", **kw).memory["total"]
        add("ring", per_dev, tiled.flops["step"], devices)
    # Sparse: the tiled form's memory, attention FLOPs over L·w pairs instead of L².
    w = min(window, seq_len)
    core = tiled.per_layer["attention core"] * tiled.config["layers"]
    factor = 3.0 if train else 1.0
    sparse_flops = tiled.flops["step"] - factor * core * (1 - w / seq_len)
    add("sparse", tiled.memory["total"], sparse_flops)
    lin = model_cost(seq_len, attention="linear", **kw)
    add("linear", lin.memory["total"], lin.flops["step"])

    choice, reason = _decide(options, cap, max_seconds, w, devices)
    inputs = dict(kw, seq_len=seq_len, budget=cap, gflops=float(gflops), max_seconds=max_seconds)
    inputs.update(window=window, devices=devices, machine=machine)
    return Advice(choice, reason, options, inputs)


_WHY = {
    "dense": "exact and the simplest: the L×L scores fit",
    "tiled": "exact, memory linear in L (the L×L scores are never stored)",
    "ring": "exact, the sequence split over {devices} devices",
    "sparse": "approximate: each query sees only its last {w} keys",
    "linear": "approximate: a kernel feature map instead of softmax, memory and time linear in L",
}
_EXACT = ("dense", "tiled", "ring")


def _decide(
    options: dict[str, dict[str, float]], cap: int, max_seconds: float, w: int, devices: int
) -> tuple[str, str]:
    """The module rule: the first option (in `CHOICES` order) that fits and is fast enough; if
    none is fast enough, the first exact option that fits, else the fastest that fits."""
    gib = 2**30

    def numbers(name: str) -> str:
        o = options[name]
        return f"{o['memory'] / gib:,.2f} GiB of {cap / gib:,.2f} GiB, {o['seconds']:,.3f} s"

    def why(name: str) -> str:
        return _WHY[name].format(w=w, devices=devices)

    rejected = []
    for name, o in options.items():
        if o["fits"] and o["fast enough"]:
            tail = f" ({'; '.join(rejected)})" if rejected else ""
            return name, f"{why(name)}: {numbers(name)} <= {max_seconds:g} s{tail}"
        rejected.append(
            f"{name}: "
            + (
                f"needs {o['memory'] / gib:,.2f} GiB"
                if not o["fits"]
                else f"takes {o['seconds']:,.3f} s > {max_seconds:g} s"
            )
        )
    fitting = [n for n, o in options.items() if o["fits"]]
    if not fitting:
        smallest = min(o["memory"] for o in options.values())
        return "none", (
            f"no option fits {cap / gib:,.2f} GiB (the smallest needs {smallest / gib:,.2f} GiB):"
            " shrink the batch, the model or the length"
        )
    exact = [n for n in fitting if n in _EXACT]
    name = exact[0] if exact else min(fitting, key=lambda n: options[n]["seconds"])
    return name, (
        f"no option takes <= {max_seconds:g} s; {why(name)}: {numbers(name)} "
        f"({'the first exact option that fits' if exact else 'the fastest that fits'})"
    )
