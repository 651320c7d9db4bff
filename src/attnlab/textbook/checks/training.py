"""Checks of training practice: pre- and post-LayerNorm, gradient norms, the Noam schedule and
the learning-rate experiments (``--with-training``) (subjects ``mha``, ``noam``)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..core import Derivation, Finding, check, fmt
from ._shared import _found


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


@check("002-8.9-j")
def _pre_post_ln() -> Finding:
    from ...models import GPT, TransformerConfig

    spread = {}
    for pre in (True, False):
        torch.manual_seed(0)
        cfg = TransformerConfig(
            vocab_size=64,
            d_model=32,
            n_layers=8,
            n_heads=4,
            max_seq_len=16,
            prenorm=pre,
            attn_backend="reference",
        )
        model = GPT(cfg).double()
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = model(idx)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1)
        )
        loss.backward()
        norms = []
        for blk in model.blocks:
            g = torch.cat([p.grad.flatten() for p in blk.parameters() if p.grad is not None])
            norms.append(float(g.norm()))
        spread[pre] = max(norms) / min(norms)
    return _found(
        f"per-layer gradient-norm spread (max/min over 8 layers): Pre-LN {fmt(spread[True])}, "
        f"Post-LN {fmt(spread[False])}",
        "GPT(TransformerConfig(n_layers=8, prenorm=True/False)); per-block gradient norms",
        spread[True] < spread[False],
        "Post-LN's layer gradients are not more uneven than Pre-LN's at initialisation",
    )
