"""The textbook's comparison measured: self-attention (the character GPT) against recurrence (the
GRU character LM) at matched parameter counts.

Vaswani et al. (2017, Table 1) and the seed texts compare a layer's cost: self-attention does
O(n²·d) work with O(1) sequential operations and a maximum path length of O(1); a recurrent layer
does O(n·d²) work but needs O(n) sequential operations and its path between distant positions is
O(n). This script prints that table (`attnlab.analysis.costs.complexity_table`) beside measured
times on this machine:

1. ms per training step (forward + backward + AdamW; batch ``--batch``) against the sequence
   length n (default 64..2048), for the default GPT of ``attnlab train`` and the default GRU LM of
   ``attnlab train rnn`` (800,041 vs 802,688 parameters on the Alice text).
2. ms per generated token after a context of n tokens (batch 1): the GPT with its KV cache (each
   token attends n cached keys: O(n·d)), the RNN carrying its state (O(d²) whatever n).
3. The validation loss each reaches in the same wall-clock budget (``--budget`` seconds each,
   their trainers' defaults: seq_len 128, batch 16, the same text, split and evaluation).

It writes a PNG of the three (``--plot``) and a JSON of every number (``--json``).

Run: python benchmarks/bench_rnn_vs_attention.py [--lengths 64,128,...,2048] [--batch 4]
     [--new 32] [--repeats 3] [--budget 120] [--threads N] [--plot P.png] [--json P.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from attnlab.analysis.costs import complexity_table
from attnlab.apps.gpt import TrainSettings, evaluate
from attnlab.apps.loop import FitSettings, fit, param_groups
from attnlab.apps.rnn import RNNTrainSettings, char_data, lm_loss_at
from attnlab.models import GPT, RNNLM
from attnlab.utils import text_table
from attnlab.viz.rnn import plot_rnn_vs_attention
from common import print_machine

#: The clock of every measurement: wall-clock (default) or this process's CPU time (--clock cpu,
#: with one thread: the time an otherwise idle core would take, whatever else loads the machine).
CLOCK: Callable[[], float] = time.perf_counter


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call on `CLOCK`."""
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def build(vocab: int, max_len: int) -> dict[str, nn.Module]:
    """The two default models (same seed), the GPT sized for ``max_len`` positions (RoPE: the
    parameter count does not depend on it)."""
    torch.manual_seed(0)
    gpt_cfg = TrainSettings().model_config(vocab)
    gpt_cfg.max_seq_len = max_len
    gpt = GPT(type(gpt_cfg)(**gpt_cfg.to_dict()))
    torch.manual_seed(0)
    rnn = RNNLM(RNNTrainSettings().model_config(vocab))
    return {"GPT": gpt, "GRU": rnn}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    return 1e3 * statistics.median(timed(fn) for _ in range(repeats))


def train_step_ms(model: nn.Module, n: int, batch: int, vocab: int, repeats: int) -> float:
    """One AdamW step on a random (batch, n) window: forward, cross-entropy, backward, update."""
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    x = torch.randint(0, vocab, (batch, n))
    y = torch.randint(0, vocab, (batch, n))
    model.train()

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return median_ms(step, repeats)


@torch.no_grad()
def token_ms(name: str, model: nn.Module, n: int, new: int, vocab: int, repeats: int) -> float:
    """ms per generated token (greedy, batch 1) after a context of n tokens: the context is read
    once (not timed), then ``new`` tokens are decoded one at a time."""
    model.eval()
    prompt = torch.randint(0, vocab, (1, n))

    def prefill() -> tuple[object, torch.Tensor]:
        if name == "GPT":
            caches = model.new_caches(n + new)
            return caches, model(prompt, caches=caches)[:, -1]
        logits, state = model.run(prompt)
        return state, logits[:, -1]

    def decode(carry: object, last: torch.Tensor) -> None:
        for _ in range(new):
            nxt = last.argmax(-1, keepdim=True)  # (1, 1)
            if name == "GPT":
                last = model(nxt, caches=carry)[:, -1]
            else:
                logits, carry = model.run(nxt, carry)
                last = logits[:, -1]

    samples = []
    for _ in range(repeats + 1):
        carry, last = prefill()
        samples.append(timed(lambda carry=carry, last=last: decode(carry, last)))
    return 1e3 * statistics.median(samples[1:]) / new


class _BudgetSpentError(Exception):
    """Raised by the loss function once the budget is spent (so `CLOCK` can be CPU time)."""


def budget_run(name: str, vocab: int, budget: float, eval_every: int) -> dict:
    """Trains the model with its trainer's defaults (init seed, lr schedule over 600 steps, batch
    order) until ``budget`` seconds of training on `CLOCK` are spent (the evaluations are not
    counted) and returns the validation curve against training seconds."""
    s = TrainSettings() if name == "GPT" else RNNTrainSettings()
    data = char_data(s.text, s.seq_len)
    torch.manual_seed(s.seed)  # as the trainers build their models
    model = GPT(s.model_config(vocab)) if name == "GPT" else RNNLM(s.model_config(vocab))
    settings = FitSettings(
        steps=s.steps, lr=s.lr, min_lr=s.min_lr, warmup=s.warmup, weight_decay=s.weight_decay,
        grad_clip=s.grad_clip, eval_every=eval_every, seed=s.seed, betas=(0.9, 0.99),
    )  # fmt: skip
    clock = {"t0": 0.0, "spent": 0.0, "steps": 0}
    inner = lm_loss_at(model, data.train, s.batch_size, s.seq_len, s.seed)

    def training_seconds() -> float:
        return CLOCK() - clock["t0"] - clock["spent"]

    def loss_at(step: int) -> torch.Tensor:
        if step == 0:
            clock["t0"] = CLOCK()
        elif training_seconds() >= budget:
            raise _BudgetSpentError
        clock["steps"] = step + 1
        return inner(step)

    curve: list[tuple[float, int, float]] = []

    def held_out() -> dict[str, float]:
        t = CLOCK()
        seconds = training_seconds()
        v = evaluate(model, data.val, s, seed=s.seed + 1)  # the trainers' protocol
        curve.append((seconds, clock["steps"], v))
        clock["spent"] += CLOCK() - t
        return {"val_loss": v}

    try:
        fit(model, loss_at, settings, evaluate=held_out, desc=name, log=lambda _l: None)
        stopped_by = "steps"
    except _BudgetSpentError:
        stopped_by = "budget"
        seconds = training_seconds()
        model.eval()
        with torch.no_grad():
            curve.append((seconds, clock["steps"], evaluate(model, data.val, s, seed=s.seed + 1)))
    return {
        "steps": clock["steps"],
        "seconds": curve[-1][0],
        "stopped_by": stopped_by,
        "final_val_loss": curve[-1][2],
        "curve": curve,
        "entropy": data.entropy,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="64,128,256,512,1024,2048")
    p.add_argument("--batch", type=int, default=4, help="sequences per timed training step")
    p.add_argument("--new", type=int, default=32, help="tokens decoded per timing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=120.0, help="training seconds per model")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall-clock time, or this process's CPU time (needs --threads 1: then it is the "
        "time on one idle core even when other jobs load the machine)",
    )
    p.add_argument("--plot", default=str(Path(__file__).with_suffix(".png")))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            p.error("--clock cpu needs --threads 1 (CPU time adds up the threads)")
        global CLOCK
        CLOCK = time.process_time
    lengths = [int(x) for x in args.lengths.split(",")]
    print_machine()
    print(f"clock: {'CPU time of this process' if args.clock == 'cpu' else 'wall-clock'}")
    vocab = len(char_data(None, 128).vocab)
    models = build(vocab, max(lengths) + args.new)
    gpt_cfg, rnn_cfg = models["GPT"].config, models["GRU"].config
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    print(
        f"GPT: d_model={gpt_cfg.d_model}, {gpt_cfg.n_layers} blocks, {gpt_cfg.n_heads} heads, "
        f"RoPE, {params['GPT']:,} parameters | GRU LM: {rnn_cfg.n_layers} layers of "
        f"{rnn_cfg.d_hidden} (embedding {rnn_cfg.d_embed}), {params['GRU']:,} parameters | "
        f"{vocab} characters (the Alice text); batch {args.batch} per training step, batch 1 "
        f"when generating; median of {args.repeats}"
    )

    print("\nThe textbook's table (Vaswani et al. 2017, Table 1; attnlab.analysis.costs):")
    rows = {r["layer"]: r for r in complexity_table(1024, gpt_cfg.d_model)}
    attn, rec = rows["self-attention"], rows["recurrent"]
    print(
        text_table(
            ["layer", "ops per layer", "sequential ops", "max path length"],
            [
                ["self-attention", f"O({attn['complexity']})", "O(1)", "O(1)"],
                ["recurrent", f"O({rec['complexity']})", "O(n)", "O(n)"],
            ],
        )
    )

    step_ms: dict[str, list[float]] = {k: [] for k in models}
    tok_ms: dict[str, list[float]] = {k: [] for k in models}
    table = []
    for n in lengths:
        for name, model in models.items():
            step_ms[name].append(train_step_ms(model, n, args.batch, vocab, args.repeats))
            tok_ms[name].append(token_ms(name, model, n, args.new, vocab, args.repeats))
        r = {x["layer"]: x for x in complexity_table(n, gpt_cfg.d_model)}
        r_rnn = {x["layer"]: x for x in complexity_table(n, rnn_cfg.d_hidden)}
        table.append(
            [
                f"{n}",
                f"{step_ms['GPT'][-1]:.1f}",
                f"{step_ms['GRU'][-1]:.1f}",
                f"{step_ms['GRU'][-1] / step_ms['GPT'][-1]:.2f}",
                f"{tok_ms['GPT'][-1]:.2f}",
                f"{tok_ms['GRU'][-1]:.2f}",
                f"{r['self-attention']['ops'] / 1e6:.1f}M / {r_rnn['recurrent']['ops'] / 1e6:.1f}M",
                f"1 / {r_rnn['recurrent']['sequential']}",
                f"1 / {r_rnn['recurrent']['path']}",
            ]
        )
        print(f"  n={n}: done", flush=True)
    print(
        "\nMeasured (ms) beside the table's quantities at each n (attention d = "
        f"{gpt_cfg.d_model}, recurrent d = {rnn_cfg.d_hidden}):"
    )
    print(
        text_table(
            [
                "n",
                "GPT step",
                "GRU step",
                "GRU/GPT",
                "GPT token",
                "GRU token",
                "ops/layer n²d / nd²",
                "sequential",
                "path",
            ],
            table,
        )
    )

    what = "CPU" if args.clock == "cpu" else "wall-clock"
    print(f"\nValidation loss in the same budget ({args.budget:g} {what} s of training each):")
    results = {}
    for name in models:
        results[name] = budget_run(name, vocab, args.budget, args.eval_every)
        r = results[name]
        print(
            f"  {name}: {r['steps']} steps in {r['seconds']:.0f} s ({r['stopped_by']}), val loss "
            f"{r['final_val_loss']:.3f} nats/char (unigram entropy {r['entropy']:.3f})",
            flush=True,
        )
    curves = {
        k: ([c[0] for c in r["curve"]], [c[2] for c in r["curve"]]) for k, r in results.items()
    }
    entropy = results["GPT"]["entropy"]
    if args.plot and plot_rnn_vs_attention(
        args.plot, lengths, step_ms, tok_ms, curves, entropy, args.budget, clock=what
    ):
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "lengths": lengths,
                    "params": params,
                    "step_ms": step_ms,
                    "token_ms": tok_ms,
                    "budget": args.budget,
                    "clock": args.clock,
                    "budget_runs": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
