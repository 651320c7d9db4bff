"""Checks of the length rules of thumb: which sequence lengths fit a memory budget and a time
budget on a named machine (subject ``mlp``)."""

from __future__ import annotations

import functools

from .. import derivations as ind
from ..core import Derivation, Finding, check, judged
from ._shared import _found

#: The reference CPU assumed for §6.1's length rule (not this machine: the command prints that).
_CPU = dict(budget="16GB", gflops=100.0, max_seconds=1.0, window=256)


#: The 2017 Transformer-base encoder (d_model = 512, the text's own §6.2 size).
_BASE = dict(d_model=512, n_layers=6, n_heads=8)


def _length_rule(gflops: float) -> dict[int, tuple[float, str]]:
    """Per length: the attention core's share of a layer's forward FLOPs and `advise`'s choice."""
    from ...analysis.advise import advise
    from ...analysis.costs import model_cost

    out = {}
    for n in (50, 500, 2000):
        layer = model_cost(n, train=False, **_BASE).per_layer
        share = layer["attention core"] / sum(layer.values())
        out[n] = (share, advise(n, **dict(_CPU, gflops=gflops), **_BASE).choice)
    return out


@check("001-6.1-a")
def _length_rule_claim() -> Finding:
    rule = _length_rule(_CPU["gflops"])
    note, rate = _this_machine()
    live = _length_rule(rate)
    (s50, c50), (s500, c500), (_, c2000) = rule.values()
    ok = s50 < 0.05 and c50 == c500 == "dense" and 0.05 < s500 < 0.5 and c2000 != "dense"
    return Finding(
        computed="the n² part's share of a layer's FLOPs and the advice: "
        + "; ".join(f"n={n}: {100 * s:.1f} %, {c}" for n, (s, c) in rule.items())
        + f" (the n² part passes half of the FLOPs at n = 6·d_model = {6 * _BASE['d_model']}, "
        "so the bands scale with d_model)",
        call="model_cost(n, d_model=512, n_layers=6, n_heads=8, train=False).per_layer; "
        "advise(n, '16GB', gflops=100, d_model=512, n_layers=6, n_heads=8, max_seconds=1, "
        "window=256).choice",
        **judged(ok, "the advice does not change across the text's bands"),
        measured=f"{note}; at this rate advise picks "
        + ", ".join(f"n={n}: {c}" for n, (_, c) in live.items()),
    )


#: The hardware and model assumed for §8.6's length rule: a 7B-class decoder served from
#: 80 GB GPUs (an A100-80GB's bf16 peak is 312 TFLOP/s; half of it is assumed sustained).
_LLM = dict(d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, dtype="bfloat16")


_GPU = dict(budget="80GB", gflops=156e3, max_seconds=10.0, window=4096, devices=8)


_GPU_SMALL = dict(_GPU, budget="24GB", gflops=82e3)  # an RTX 4090-class card (165 TFLOP/s peak)


_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)


def _k(n: int) -> str:
    return f"{n // 1024}K"


def _length_scan(gpu: dict) -> dict[int, object]:
    """`advise` for every length of `_LENGTHS` on ``gpu`` (one forward of one sequence)."""
    from ...analysis.advise import advise

    return {n: advise(n, **gpu, **_LLM) for n in _LENGTHS}


def _flops_witness(*scans: dict) -> Derivation:
    """advise's exact-attention FLOPs against the closed form of a decoder forward."""
    ok = all(
        a.options[o]["flops"] == ind.decoder_forward_flops(n, 4096, 32, 32000)
        for scan in scans
        for n, a in scan.items()
        for o in ("dense", "tiled")
    )
    return Derivation(
        ok,
        "closed form 24nLd² + 4Ln²d + 2ndV equals advise's dense and tiled FLOPs at every "
        "length (the time side of the advice)",
    )


def _in_time(a) -> bool:
    """Some option meets the time limit (else the advice is a fallback)."""
    return any(o["fits"] and o["fast enough"] for o in a.options.values())


def _scan_text(scan: dict) -> str:
    return ", ".join(
        f"{_k(n)} {a.choice}" + ("" if _in_time(a) else " (none in time)") for n, a in scan.items()
    )


@functools.cache
def _this_machine() -> tuple[str, float]:
    """This machine, live: (`machine_info` and its float32 matmul rate as text, the rate in
    GFLOP/s), measured once per process — for a finding's ``measured``, never a verdict."""
    from ...analysis.advise import machine_info
    from ...utils.timing import matmul_rate

    m = machine_info()
    n = 1024
    rate = matmul_rate(n, 3)
    return (
        f"this machine: {m['cpu']}, {m['cores']} cores, AVX-512 {m['avx512']}, AMX {m['amx']}; "
        f"float32 {n}² matmul {rate:,.1f} GFLOP/s (measured now; a lower bound under load)",
        rate,
    )


def _machine_note() -> str:
    """`_this_machine`'s text."""
    return _this_machine()[0]


@check("002-8.6-i")
def _length_bands() -> Finding:
    scan, small = _length_scan(_GPU), _length_scan(_GPU_SMALL)
    want = {4096: ("dense", "tiled"), 16384: ("sparse",), 65536: ("ring",)}
    bands = {n: scan[n].choice in c for n, c in want.items()}
    bands[262144] = not _in_time(scan[262144])  # no standard option meets the limit
    wrong = [_k(n) for n, ok in bands.items() if not ok]
    exact = [_k(n) for n in _LENGTHS if 8192 < n <= 32768 and scan[n].choice != "sparse"]

    def first(choice: str) -> str:
        return next((_k(n) for n, a in small.items() if a.choice == choice), "never")

    return Finding(
        computed=f"advise on the 80 GB GPU: {_scan_text(scan)}; on the 24 GB card: "
        f"{_scan_text(small)}",
        call="advise(n, '80GB', gflops=156e3, d_model=4096, n_layers=32, n_heads=32, "
        "vocab_size=32000, dtype='bfloat16', max_seconds=10, window=4096, devices=8).choice",
        **judged(
            not wrong,
            f"the bands at {', '.join(wrong)} disagree: at {', '.join(exact)} exact attention "
            "(dense, or tiled = FlashAttention) still fits and meets the limit, so a window is "
            f"optional there; the band edges move with the memory (24 GB: tiled from "
            f"{first('tiled')}, ring from {first('ring')})",
            _flops_witness(scan, small),
        ),
        measured=_machine_note(),
    )


@check("002-8.7-h")
def _eight_k() -> Finding:
    scans = {"80 GB": _length_scan(_GPU), "24 GB": _length_scan(_GPU_SMALL)}
    first = {
        gpu: min((n for n, a in scan.items() if a.choice != "dense"), default=None)
        for gpu, scan in scans.items()
    }
    sparse = [
        f"{_k(n)} on {gpu}"
        for gpu, s in scans.items()
        for n, a in s.items()
        if a.choice == "sparse"
    ]
    dense_below = all(s[4096].choice == "dense" for s in scans.values())
    ok = dense_below and bool(sparse)
    return _found(
        "standard (dense) attention is the advice up to "
        + ", ".join(f"{_k(n // 2)} on the {gpu} GPU" for gpu, n in first.items() if n)
        + "; beyond it: "
        + "; ".join(
            f"{gpu}: " + ", ".join(f"{_k(n)} {a.choice}" for n, a in s.items() if n >= first[gpu])
            for gpu, s in scans.items()
        )
        + f"; sparse is chosen at: {', '.join(sparse) or 'no length'}",
        "advise(n, budget, gflops=…, d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, "
        "dtype='bfloat16', window=4096, devices=8).choice for n = 4K … 256K",
        ok,
        "past 8K the advice is exact attention that scales — tiled (FlashAttention) while one "
        "device's memory holds the sequence, then ring — and never the sparse variant",
        _flops_witness(*scans.values()),
    )
