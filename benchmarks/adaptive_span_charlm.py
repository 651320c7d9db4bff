"""Adaptive attention span on the shipped Alice text: spans shrink per head under the L1 penalty.

A tiny character-level LM (embedding + learned positions, ``layers`` pre-norm blocks of
`attnlab.modules.AdaptiveSpanAttention` and an MLP) is trained with the loss
``cross-entropy + λ Σ_layers Σ_h z_h`` (Sukhbaatar et al., 2019). After every optimizer step the
training loop calls ``refresh_span()`` (the only host sync: forward never reads z's values), so
the flash plan's window follows the largest span. Writes the spans per step as JSON and a PNG of
``z_h`` over steps (one line per head, one panel per layer).

    PYTHONPATH=src python benchmarks/adaptive_span_charlm.py --steps 300 --out /tmp/span

Measured (300 steps at the defaults, λ = 5e-5, one thread: 9 s, up to 70 s on a loaded machine):
every z starts at 64; layer 0 ends at z = [0, 0, 0, 2.7], layer 1 at [18.7, 0, 0, 16.3] (the
windows go from 72 to 11 and 27 keys); the training cross-entropy falls from 4.37 to ~1.8
nats/char. The spans first fall together (the penalty alone: with max_span ≥ L no key lies on
the ramp, so the loss gives z no gradient — with λ = 0 every z stays at 64), then part ways per
head once the ramp reaches keys the loss needs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.apps.gpt import get_batch, load_text
from attnlab.modules import AdaptiveSpanAttention


@dataclass
class SpanRun:
    """Spans ``z[step][layer][head]`` (after each step's refresh), losses and the windows."""

    spans: list[list[list[float]]]
    windows: list[list[int]]
    losses: list[float]
    seconds: float


class SpanCharLM(nn.Module):
    """Character LM: ``logits = W_out · LN(blocks(emb(x) + pos))``, causal adaptive-span blocks."""

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, seq_len: int, max_span: int, ramp
    ):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.attn = nn.ModuleList(
            AdaptiveSpanAttention(dim, heads, max_span, ramp=ramp, backend="auto")
            for _ in range(layers)
        )
        self.ln1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]  # (B, L, E)
        for attn, ln1, ln2, mlp in zip(self.attn, self.ln1, self.ln2, self.mlp, strict=True):
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        return self.head(self.ln_f(x))  # (B, L, V)

    def spans(self) -> list:
        return [a.span for a in self.attn]


def train_spans(
    steps: int = 300,
    *,
    dim: int = 64,
    heads: int = 4,
    layers: int = 2,
    seq_len: int = 64,
    batch: int = 16,
    max_span: int = 64,
    ramp: float = 8.0,
    penalty: float = 5e-5,
    lr: float = 3e-3,
    span_lr: float = 100.0,
    seed: int = 0,
) -> SpanRun:
    """Trains the char-LM; every head starts at ``z = max_span``. Returns the recorded run.

    ``span_lr`` multiplies the learning rate of the spans (z lives on a scale of tokens, the
    weights on a scale of 1).
    """
    torch.manual_seed(seed)
    text = load_text(None)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    model = SpanCharLM(len(chars), dim, heads, layers, seq_len, max_span, ramp)
    zs = [a.span.z for a in model.attn]
    z_ids = {id(z) for z in zs}
    rest = [p for p in model.parameters() if id(p) not in z_ids]
    opt = torch.optim.Adam([{"params": rest}, {"params": zs, "lr": lr * span_lr}], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    run = SpanRun([], [], [], 0.0)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = get_batch(data, batch, seq_len, gen)
        logits = model(x)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss = ce + sum(a.span.penalty(penalty) for a in model.attn)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # outside forward: clamp z to [0, max_span] and move each layer's window (a host sync)
        run.windows.append([a.span.refresh_span() for a in model.attn])
        run.spans.append([a.span.spans().tolist() for a in model.attn])
        run.losses.append(ce.item())
    run.seconds = time.perf_counter() - t0
    return run


def plot(run: SpanRun, path: Path, max_span: int) -> None:
    """PNG of z_h over steps: one panel per layer, one line per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = len(run.spans[0])
    fig, axes = plt.subplots(1, layers + 1, figsize=(4.2 * (layers + 1), 3.4))
    steps = range(1, len(run.spans) + 1)
    for li in range(layers):
        ax = axes[li]
        for h in range(len(run.spans[0][li])):
            ax.plot(steps, [s[li][h] for s in run.spans], label=f"head {h}")
        ax.set_title(f"layer {li}: span z_h")
        ax.set_xlabel("step")
        ax.set_ylim(0, max_span * 1.05)
        ax.legend(fontsize=7)
    axes[-1].plot(steps, run.losses)
    axes[-1].set_title("cross-entropy (nats/char)")
    axes[-1].set_xlabel("step")
    fig.suptitle("Adaptive attention span on alice.txt (L1 penalty on z)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--penalty", type=float, default=5e-5)
    ap.add_argument("--max-span", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("adaptive_span"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny ops)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    run = train_spans(a.steps, penalty=a.penalty, max_span=a.max_span)
    (a.out / "spans.json").write_text(json.dumps(run.__dict__))
    plot(run, a.out / "spans.png", a.max_span)
    first, last = run.spans[0], run.spans[-1]
    print(f"{a.steps} steps in {run.seconds:.1f} s; ce {run.losses[0]:.3f} -> {run.losses[-1]:.3f}")
    for li, (f, g) in enumerate(zip(first, last, strict=True)):
        print(
            f"layer {li}: z after step 1 {[round(v, 1) for v in f]} -> {[round(v, 1) for v in g]}"
        )
    print(f"windows (Python-int spans) {run.windows[0]} -> {run.windows[-1]}; PNG {a.out}")


if __name__ == "__main__":
    main()
