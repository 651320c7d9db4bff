"""Seed 002, the practice rules: memory, lengths and learning rates.

The checks of claims whose metadata is in ``claims/seed002.toml``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import (
    Derivation,
    Finding,
    check,
    fmt,
    judged,
)
from .seed002 import _found

# ----------------------------------------------------- the practice rules: memory and lengths
#: The 12-layer model of §8.4.2's memory rule: GPT-2 small (d=768, 12 heads, tied head).
_GPT2_SMALL = dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50257, batch=1)


def _eager_saved_per_layer(seq_len: int, d_model: int, n_heads: int, dropout: float) -> tuple:
    """(bytes, number of B·H·L·L tensors) one attnlab `TransformerBlock` with the reference
    (eager, L×L-materialising) backend saves for backward at batch 1 × ``seq_len`` in float32,
    counted per saved tensor with autograd's saved-tensor hooks on the meta device (no data)."""
    from ...models import TransformerBlock, TransformerConfig

    cfg = TransformerConfig(
        d_model=d_model,
        n_heads=n_heads,
        d_ff=4 * d_model,
        positional=None,
        attn_backend="reference",
        dropout=dropout,
    )
    with torch.device("meta"):
        block = TransformerBlock(cfg).train()
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        saved[id(t)] = t  # one entry per tensor object, however many ops save it
        return t

    x = torch.empty(1, seq_len, d_model, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    nbytes = sum(t.numel() * t.element_size() for t in saved.values())
    square = sum(1 for t in saved.values() if t.numel() == n_heads * seq_len * seq_len)
    return nbytes, square


def _plain_squares(seq_len: int, n_heads: int, head_dim: int) -> int:
    """How many (1, H, L, L) tensors plain PyTorch attention as the texts write it (§8.9's
    ``softmax(Q Kᵀ / √d_k)``, seed 003's dropout 0.1, ``· V``) saves for backward, counted on the
    meta device."""
    q, k, v = (
        torch.empty(1, n_heads, seq_len, head_dim, device="meta", requires_grad=True)
        for _ in range(3)
    )
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> Tensor:
        saved[id(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        p = torch.nn.functional.dropout(torch.softmax(s, dim=-1), 0.1, training=True)
        torch.matmul(p, v)
    return sum(1 for t in saved.values() if t.numel() == n_heads * seq_len * seq_len)


@check("002-8.4.2-f")
def _sixteen_gb() -> Finding:
    from ...analysis.costs import model_cost

    L, gb = 2048, 1e9
    low = model_cost(L, train=True, dtype="float32", attention="naive", **_GPT2_SMALL)
    mixed = model_cost(L, train=True, dtype="float16", attention="naive", **_GPT2_SMALL)
    tiled = model_cost(L, train=True, dtype="float32", attention="flash", **_GPT2_SMALL)
    layers = _GPT2_SMALL["n_layers"]
    model_layer = low.memory["activations"] / layers  # one L×L per head: the probabilities
    eager_layer, squares = _eager_saved_per_layer(L, 768, 12, 0.1)
    eager = low.memory["total"] + layers * (eager_layer - model_layer)
    square = 12 * L * L * 4  # one float32 (1, H, L, L) tensor
    plain_sq = _plain_squares(L, 12, 64)
    plain = low.memory["total"] + layers * (plain_sq - 1) * square
    ok = abs(eager / (16 * gb) - 1) <= 0.15  # the one implementation named in advance
    return _found(
        f"cost model (one L×L per head kept): {fmt(low.memory['total'] / gb, 3)} GB float32, "
        f"{fmt(mixed.memory['total'] / gb, 3)} GB mixed float16, "
        f"{fmt(tiled.memory['total'] / gb, 3)} GB float32 with tiled attention; plain "
        f"PyTorch attention keeps {plain_sq} tensors of 12×2048×2048 floats per layer: "
        f"{fmt(plain / gb, 3)} GB; attnlab's reference layer keeps {squares} "
        f"({fmt(eager_layer / 2**20, 4)} MiB instead of {fmt(model_layer / 2**20, 4)} MiB): "
        f"{fmt(eager / gb, 3)} GB",
        "model_cost(2048, d_model=768, n_layers=12, n_heads=12, vocab_size=50257, train=True, "
        "dtype=…, attention='naive'|'flash').memory['total']; saved_tensors_hooks around "
        "TransformerBlock(attn_backend='reference', dropout=0.1) and the plain code on the meta "
        "device",
        ok,
        f"attnlab's reference implementation needs {fmt(eager / gb, 3)} GB, not about 16",
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
    from ...utils.timing import best_times

    m = machine_info()
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    rate = 2 * n**3 / best_times({"mm": lambda: torch.mm(a, b)}, 3)["mm"] / 1e9
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


# ------------------------------------------------------------ the practice rules: learning rate
@check("002-8.9-n")
def _noam_peak() -> Finding:
    from ...apps.gpt import TrainSettings, lr_at

    s = TrainSettings(schedule="noam", warmup=4000, d_model=512, steps=100_000)
    at = {t: lr_at(t, s) for t in (0, 999, 3999, 15999, 99999)}
    peak = max(at.values())
    ok = at[3999] == peak and 0.5 <= peak / 5e-4 <= 2
    return _found(
        "noam schedule, d_model=512, warmup 4000: "
        + ", ".join(f"step {t + 1}: {lr:.3g}" for t, lr in at.items())
        + f"; the peak {peak:.3g} is {peak / 5e-4:.2f}× the text's 5e-4 and {1e-2 / peak:.0f}× "
        "below its 'too large' 1e-2",
        "lr_at(t, TrainSettings(schedule='noam', warmup=4000, d_model=512))",
        ok,
        "the 2017 warmup schedule does not peak near 5e-4",
    )


#: The small char-LM of the learning-rate / warmup ablation (the shipped Alice text).
_SWEEP = dict(
    steps=300,
    batch_size=16,
    seq_len=64,
    d_model=64,
    n_layers=2,
    n_heads=4,
    dropout=0.0,
    min_lr=5e-5,
    eval_interval=100,
    eval_batches=8,
    save_interval=0,
    seed=0,
)


def _lr_sweep() -> dict[tuple[float, int], float]:
    """Final validation loss (nats/char) per (lr, warmup) of `attnlab.apps.gpt.sweep` over
    lr ∈ {1e-2, 5e-4} × warmup ∈ {0, 30} (`_SWEEP`), on one thread."""
    return _lr_sweep_runs()[0]


@functools.cache
def _lr_sweep_runs() -> tuple[dict[tuple[float, int], float], dict[tuple[float, int], float]]:
    """`_lr_sweep`'s final validation losses, and the mean batch training loss of each run's
    last 30 steps (the same runs measured a second way, on the training batches)."""
    import tempfile

    from ...apps.gpt import TrainSettings, sweep

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # oversubscribed threads slow a tiny model down by 10× or more
    try:
        with tempfile.TemporaryDirectory() as out:
            base = TrainSettings(out_dir=out, lr=5e-4, warmup=0, **_SWEEP)
            result = sweep(base, {"lr": [1e-2, 5e-4], "warmup": [0, 30]}, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    key = {id(r): (r.point["lr"], r.point["warmup"]) for r in result.runs}
    val = {key[id(r)]: r.final_val for r in result.runs}
    tail = {key[id(r)]: sum(r.train_losses[-30:]) / 30 for r in result.runs}
    return val, tail


@functools.cache
def _no_clip_val() -> float:
    """Final validation loss of the lr 1e-2, warmup 0 run of `_lr_sweep` without gradient
    clipping (`attnlab.apps.gpt.train` with ``grad_clip=0``), on one thread."""
    import tempfile

    from ...apps.gpt import TrainSettings, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            s = TrainSettings(out_dir=out, lr=1e-2, warmup=0, grad_clip=0.0, **_SWEEP)
            return train(s, log=lambda _: None, plots=False).val_history[-1][2]
    finally:
        torch.set_num_threads(threads)


def _sweep_text(val: dict[tuple[float, int], float]) -> str:
    return "final validation loss (nats/char): " + ", ".join(
        f"lr {lr:g} warmup {w}: {v:.3f}" for (lr, w), v in val.items()
    )


_SWEEP_CALL = (
    "sweep(TrainSettings(steps=300, batch_size=16, seq_len=64, d_model=64, n_layers=2, n_heads=4, "
    "…), {'lr': [1e-2, 5e-4], 'warmup': [0, 30]}).runs[i].final_val"
)


@check("002-8.9-o")
def _lr_too_large() -> Finding:
    val, tail = _lr_sweep_runs()
    too_large = all(
        not math.isfinite(val[(1e-2, w)]) or val[(1e-2, w)] > val[(5e-4, w)] for w in (0, 30)
    )

    # the second measurement: the training batches of the same runs rank them the same way
    def worse(loss: dict[tuple[float, int], float], w: int) -> bool:
        return not math.isfinite(loss[(1e-2, w)]) or loss[(1e-2, w)] > loss[(5e-4, w)]

    same_rank = all(worse(val, w) == worse(tail, w) for w in (0, 30))
    return _found(
        _sweep_text(val),
        _SWEEP_CALL,
        too_large,
        "for this small pre-LN model 1e-2 trains stably and ends below 5e-4 with or without "
        "warmup: how large is too large depends on the model (depth, post-LN or pre-LN) and the "
        "run, so 1e-2 is not too large for Transformers in general",
        Derivation(
            same_rank,
            "the mean batch loss of the last 30 training steps (a second measurement of the same "
            "runs, on the training batches, by the per-step log) ranks 1e-2 and 5e-4 as the "
            "validation loss does: "
            + ", ".join(f"lr {k[0]:g} warmup {k[1]}: {fmt(v, 3)}" for k, v in tail.items()),
        ),
    )


@check("002-8.7-i")
def _warmup_helps() -> Finding:
    val = _lr_sweep()
    gain = {lr: val[(lr, 0)] - val[(lr, 30)] for lr in (1e-2, 5e-4)}
    no_clip = _no_clip_val()
    clip_gain = no_clip - val[(1e-2, 0)] if math.isfinite(no_clip) else math.inf
    ok = gain[1e-2] > 0 and gain[5e-4] > -0.02 and clip_gain > 0
    return _found(
        _sweep_text(val)
        + "; warmup lowers it by "
        + ", ".join(f"{g:.3f} at lr {lr:g}" for lr, g in gain.items())
        + f"; without clipping (lr 1e-2, warmup 0) it ends at {no_clip:.3f}",
        _SWEEP_CALL + "; train(TrainSettings(lr=1e-2, warmup=0, grad_clip=0, …))",
        ok,
        "warmup or clipping does not help the large learning rate here",
    )


@check("002-8.9-p")
def _grad_thresholds() -> Finding:
    from ...apps.gpt import TrainSettings, get_batch, layer_grad_norms, layer_parameters, load_text
    from ...models import GPT

    text = load_text(None)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text[:20_000]])
    x, y = get_batch(data, 8, 64, torch.Generator().manual_seed(15))
    torch.manual_seed(15)
    model = GPT(TrainSettings(d_model=64, n_layers=2, n_heads=4).model_config(len(vocab))).double()
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    per_param = {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
    layers = layer_grad_norms(layer_parameters(model))
    lo, hi = min(per_param, key=per_param.get), max(per_param, key=per_param.get)
    ok = per_param[lo] > 1e-6 and per_param[hi] < 1000
    return _found(
        f"{len(per_param)} parameters: gradient norms from {fmt(per_param[lo], 3)} ({lo}) to "
        f"{fmt(per_param[hi], 3)} ({hi}); per layer " + ", ".join(fmt(float(v), 3) for v in layers),
        "loss.backward(); {n: p.grad.norm() for n, p in model.named_parameters()}; "
        "layer_grad_norms(layer_parameters(model))",
        ok,
        "a freshly initialised model already reads as vanishing or exploding",
    )


@functools.cache
def _ln_runs() -> dict[str, float]:
    """The training text's unigram entropy and the final validation loss (nats/char, NaN if
    diverged) of a 6-layer char-LM trained by
    `attnlab.apps.loop.fit` at lr 1e-2: Pre-LN and Post-LN without warmup, Post-LN with 30
    warmup steps; same seed, batches and settings otherwise, one thread."""
    from ...apps.gpt import get_batch, load_text, unigram_entropy
    from ...apps.loop import FitSettings, fit
    from ...models import GPT, TransformerConfig

    text = load_text(None)
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([index[c] for c in text])
    cut = int(0.9 * len(data))
    train_data, val_data = data[:cut], data[cut:]

    def run(prenorm: bool, warmup: int) -> float:
        torch.manual_seed(0)
        cfg = TransformerConfig(
            vocab_size=len(index),
            d_model=64,
            n_layers=6,
            n_heads=4,
            max_seq_len=64,
            prenorm=prenorm,
            dropout=0.0,
            positional="rope",
        )
        model = GPT(cfg)
        g = torch.Generator().manual_seed(0)

        def loss(x: Tensor, y: Tensor) -> Tensor:
            return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

        def evaluate() -> dict[str, float]:
            gv = torch.Generator().manual_seed(1)
            return {"val": sum(float(loss(*get_batch(val_data, 16, 64, gv))) for _ in range(8)) / 8}

        s = FitSettings(steps=300, lr=1e-2, min_lr=5e-5, warmup=warmup, grad_clip=1.0, seed=0)
        try:
            h = fit(
                model,
                lambda _: loss(*get_batch(train_data, 16, 64, g)),
                s,
                evaluate=evaluate,
                log=lambda _: None,
            )
        except ValueError:  # fit refuses a non-finite loss: the run diverged
            return math.nan
        return h.evals[-1]["val"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            "unigram entropy": unigram_entropy(train_data, len(index)),
            "Pre-LN, warmup 0": run(True, 0),
            "Post-LN, warmup 0": run(False, 0),
            "Post-LN, warmup 30": run(False, 30),
        }
    finally:
        torch.set_num_threads(threads)


@check("002-8.9-q")
def _pre_ln_training() -> Finding:
    val = dict(_ln_runs())
    entropy = val.pop("unigram entropy")
    pre, post = val["Pre-LN, warmup 0"], val["Post-LN, warmup 0"]
    ok = math.isfinite(pre) and (not math.isfinite(post) or pre < post)
    return _found(
        "final validation loss (nats/char): "
        + ", ".join(f"{k}: {v:.3f}" for k, v in val.items())
        + f" (the text's unigram entropy: {entropy:.3f})",
        "fit(GPT(TransformerConfig(n_layers=6, prenorm=True|False, …)), loss_at, "
        "FitSettings(steps=300, lr=1e-2, warmup=0|30)).evals[-1]['val']",
        ok,
        "Post-LN trains as well as Pre-LN at this learning rate",
    )
