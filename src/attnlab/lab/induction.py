"""``attnlab experiment induction-heads``: Olsson et al. (2022), "In-context Learning and
Induction Heads" — attention-only transformers of 1 and 2 layers on repeated random tokens.

Each training sequence is a random segment of ``n`` tokens (n drawn per sequence between
``min_period`` and ``max_period``) repeated until the sequence is full, so the tokens after the
first ``n`` are predictable from the context alone, and only by looking back a distance that
changes from sequence to sequence. The model (`AttentionOnly`, built from attnlab's
`MultiHeadAttention`: no MLP, no norm) is trained on next-token prediction. Measured over
training: the loss on the first occurrence of the segment (unpredictable: about ``ln V``) and
on the repeats (in-context predictable). At the end, per head, with `attnlab.analysis`:

- the prefix-matching score (`attnlab.analysis.induction.prefix_matching_score`): attention
  from a token to the token after its earlier occurrence;
- the previous-token score (the first half of the induction circuit);
- the copying score of the OV circuit ``W_U W_O W_V W_E``: ``Σλ / Σ|λ|`` of its eigenvalues
  (`attnlab.analysis.induction.copying_score`, Elhage et al., 2021).

Expected (the paper's claim): with 2 layers the loss on the repeats collapses at some step (the
phase change) and a head in layer 2 prefix-matches; with 1 layer neither happens — a single
layer can raise the logits of tokens seen before, but cannot tell which one comes next.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import masks
from .._shapes import check_int
from ..models.gpt import check_token_ids
from ..modules import MultiHeadAttention
from ..positional import LearnedPositionalEmbedding
from .base import Check, LabResult, LabSettings, SeedStats, Verdict
from .registry import experiment

__all__ = [
    "AttentionOnly",
    "InductionRecipe",
    "judge",
    "repeated_sequences",
    "run",
    "train_one",
]

VOCAB = 64  # token ids 0 … 63: the first occurrence costs about ln 64 = 4.16 nats per token
HIGH_PREFIX = 0.5  # an induction head puts over half of its attention on the matched token
COLLAPSED = 0.25  # the repeats' loss collapses: below a quarter of ln V


@dataclass(frozen=True)
class InductionRecipe:
    """The size of one run: data, model and training.

    Attributes:
        seq_len: L, tokens per sequence. min_period, max_period: the segment length n is drawn
            per sequence in ``[min_period, max_period]``.
        d_model: E. heads: H per layer. steps: optimiser steps. batch: sequences per step.
        lr: AdamW learning rate. eval_every: steps between evaluations. eval_batch: held-out
            sequences per evaluation.
    """

    seq_len: int = 48
    min_period: int = 6
    max_period: int = 24
    d_model: int = 64
    heads: int = 4
    steps: int = 1500
    batch: int = 32
    lr: float = 3e-3
    eval_every: int = 25
    eval_batch: int = 128


DEFAULT = InductionRecipe()
QUICK = InductionRecipe(steps=500, eval_every=50, eval_batch=64)


class AttentionOnly(nn.Module):
    """An attention-only transformer (Elhage et al., 2021): no MLP, no norm.

    ``x_0 = W_E[t] + W_P[p]``; ``x_{l+1} = x_l + MHA_l(x_l)`` with a causal mask;
    ``logits = x_N W_Uᵀ``. Every attention is an attnlab `MultiHeadAttention` (no biases), so
    `attnlab.analysis.capture_attentions` reads its weights, and each head's OV circuit is
    ``W_U W_O^h W_V^h W_E`` exactly on the direct path.

    Args:
        vocab_size: V. d_model: E. n_layers: N (0 = a bigram model). n_heads: H per layer.
        max_len: the longest sequence (learned position table). init_std: standard deviation
            of the token and position embeddings (1.0: large enough that attention patterns
            form within a few hundred steps).

    Example:
        >>> model = AttentionOnly(64, 64, n_layers=2, n_heads=4, max_len=48)
        >>> logits = model(torch.randint(0, 64, (8, 48)))            # (8, 48, 64)
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        max_len: int,
        init_std: float = 1.0,
    ) -> None:
        super().__init__()
        self.vocab_size = check_int("vocab_size", vocab_size, minimum=1)
        check_int("n_layers", n_layers, minimum=0)
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=init_std)
        self.pos = LearnedPositionalEmbedding(max_len, d_model, init_std=init_std)
        self.layers = nn.ModuleList(
            MultiHeadAttention(d_model, n_heads, bias=False) for _ in range(n_layers)
        )
        self.unembed = nn.Linear(d_model, vocab_size, bias=False)
        self.mask = masks.causal()

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(B, L, V)`` for token ids ``(B, L)`` in ``[0, V)``, L <= max_len (checked
        in eager mode, before any work; skipped while compiling)."""
        idx = check_token_ids("idx", idx, self.vocab_size)
        x = self.embed(idx) + self.pos(idx.shape[1])  # (B, L, E)
        for attn in self.layers:
            x = x + attn(x, mask=self.mask)  # (B, L, E)
        return self.unembed(x)  # (B, L, V)


def repeated_sequences(
    batch: int, recipe: InductionRecipe, generator: torch.Generator, device: str = "cpu"
) -> tuple[Tensor, Tensor]:
    """``(tokens (B, L), period (B,))``: per row a random segment of n tokens, repeated.

    ``tokens[b, i] = segment_b[i mod n_b]`` with n_b uniform in ``[min_period, max_period]``
    and the segment's tokens uniform in ``[0, VOCAB)``.
    """
    L = recipe.seq_len
    segment = torch.randint(0, VOCAB, (batch, L), generator=generator)
    period = torch.randint(recipe.min_period, recipe.max_period + 1, (batch,), generator=generator)
    pos = torch.arange(L)
    tokens = segment.gather(1, pos[None] % period[:, None])  # (B, L)
    return tokens.to(device), period.to(device)


def target_parts(period: Tensor, L: int) -> tuple[Tensor, Tensor]:
    """Which of the ``L − 1`` next-token targets lie in the first occurrence (positions
    ``1 … n − 1``) and which in the repeats (positions ``n + 1 …``, whose previous token
    occurred before); position n starts the first repeat and is predictable from neither."""
    target = torch.arange(1, L, device=period.device)[None]  # (1, L − 1)
    first = target < period[:, None]  # (B, L − 1)
    repeat = target > period[:, None]
    return first, repeat


def split_losses(model: nn.Module, tokens: Tensor, period: Tensor) -> tuple[float, float]:
    """Mean next-token loss (nats) on the first occurrence and on the repeats."""
    with torch.no_grad():
        logits = model(tokens)[:, :-1]  # (B, L − 1, V)
        loss = nn.functional.cross_entropy(
            logits.transpose(1, 2), tokens[:, 1:], reduction="none"
        )  # (B, L − 1)
    first, repeat = target_parts(period, tokens.shape[1])
    return float(loss[first].mean()), float(loss[repeat].mean())


def head_scores(model: AttentionOnly, tokens: Tensor) -> dict[str, list[list[float]]]:
    """Per layer and head: prefix-matching, previous-token and copying scores."""
    from ..analysis.capture import capture_attentions
    from ..analysis.induction import (
        copying_score,
        ov_circuits,
        prefix_matching_score,
        previous_token_score,
    )

    with torch.no_grad(), capture_attentions(model) as captured:
        model(tokens)
    prefix, previous, copying = [], [], []
    for attn, (_, w) in zip(model.layers, captured, strict=True):  # w: (B, H, L, L)
        prefix.append(prefix_matching_score(w, tokens).mean(0).tolist())
        previous.append(previous_token_score(w).mean(0).tolist())
        _, _, (w_v, _) = attn.projection_weights()
        ov = ov_circuits(
            model.embed.weight, w_v, attn.out_proj.weight, model.unembed.weight, attn.num_heads
        )
        copying.append(copying_score(ov).tolist())
    return {"prefix": prefix, "previous": previous, "copying": copying}


def train_one(
    n_layers: int, seed: int, recipe: InductionRecipe, progress: Any = None, device: str = "cpu"
) -> tuple[dict[str, Any], AttentionOnly]:
    """Trains one model; returns its record (curves, final losses, head scores) and the model.

    The record: ``step``, ``first``, ``repeat`` (the curves), ``first_loss``, ``repeat_loss``
    (the last evaluation), ``phase_step`` (the first evaluated step where the repeats' loss is
    below half of ln V, or None), and per layer and head ``prefix``, ``previous``, ``copying``,
    with ``best_head`` = ``[layer, head]`` of the highest prefix-matching score.
    """
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed)
    held_out = repeated_sequences(
        recipe.eval_batch, recipe, torch.Generator().manual_seed(10_000 + seed), device
    )
    model = AttentionOnly(VOCAB, recipe.d_model, n_layers, recipe.heads, recipe.seq_len)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    curve: dict[str, list] = {"step": [], "first": [], "repeat": []}
    for step in range(recipe.steps + 1):
        if step % recipe.eval_every == 0 or step == recipe.steps:
            model.eval()
            first, repeat = split_losses(model, *held_out)
            model.train()
            for key, value in zip(curve, (step, first, repeat), strict=True):
                curve[key].append(value)
            if progress is not None:
                progress.step(f"{n_layers} layer(s), seed {seed}: step {step}")
        if step == recipe.steps:
            break
        tokens, _ = repeated_sequences(recipe.batch, recipe, data, device)
        logits = model(tokens)[:, :-1]  # (B, L − 1, V)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return _record(model, curve, held_out[0]), model.eval()


def _record(model: AttentionOnly, curve: dict[str, list], tokens: Tensor) -> dict[str, Any]:
    half = math.log(VOCAB) / 2
    phase = next((s for s, r in zip(curve["step"], curve["repeat"], strict=True) if r < half), None)
    record: dict[str, Any] = {
        **curve,
        "first_loss": curve["first"][-1],
        "repeat_loss": curve["repeat"][-1],
        "phase_step": phase,
    }
    if model.layers:
        record.update(head_scores(model, tokens))
        flat = [(v, li, h) for li, row in enumerate(record["prefix"]) for h, v in enumerate(row)]
        best, layer, head = max(flat)
        record.update(best_head=[layer, head], best_prefix=best)
        record["best_copying"] = record["copying"][layer][head]
        record["best_previous"] = max(max(row) for row in record["previous"])
    return record


def probe(model: AttentionOnly, recipe: InductionRecipe, seed: int) -> tuple[Tensor, Tensor]:
    """One held-out segment of ``L // 2`` tokens repeated twice, and the weights of every
    layer on it, ``(tokens (L,), weights (layers, H, L, L))`` — an induction head draws a
    stripe ``L // 2 − 1`` below the diagonal."""
    from ..analysis.capture import module_attentions

    half = recipe.seq_len // 2
    g = torch.Generator().manual_seed(20_000 + seed)
    segment = torch.randint(0, VOCAB, (half,), generator=g)
    tokens = torch.cat([segment, segment]).to(next(model.parameters()).device)  # (L,)
    with torch.no_grad():
        weights = module_attentions(model, lambda: model(tokens[None]))
    return tokens.cpu(), weights.cpu()


DEPTHS = (1, 2)


def run(settings: LabSettings, progress: Any) -> LabResult:
    """Trains attention-only models of 1 and 2 layers over seeds and judges the claim."""
    recipe = QUICK if settings.quick else DEFAULT
    seeds = list(range(settings.seed_count(default=3)))
    evals = len(range(0, recipe.steps, recipe.eval_every)) + 1
    progress.total = len(DEPTHS) * len(seeds) * evals
    models: dict[str, dict[str, list]] = {}
    probes: dict[int, tuple[Tensor, Tensor]] = {}
    for depth in DEPTHS:
        records = []
        for seed in seeds:
            record, model = train_one(depth, seed, recipe, progress, settings.device)
            records.append(record)
            if seed == seeds[0]:
                probes[depth] = probe(model, recipe, seed)
        models[str(depth)] = {key: [r[key] for r in records] for key in records[0]}
    metrics = {
        "recipe": asdict(recipe),
        "vocab": VOCAB,
        "uniform_loss": math.log(VOCAB),
        "seeds": seeds,
        "models": models,
    }
    from ..viz import lab_induction as draw

    figures = {
        "loss_curves.png": lambda path: draw.plot_loss_curves(path, metrics),
        "head_scores.png": lambda path: draw.plot_head_scores(path, metrics),
        "induction_stripe.png": lambda path: draw.plot_stripes(path, probes, metrics),
        "induction_view.html": lambda path: draw.save_probe_view(path, probes[2], metrics),
    }
    return LabResult.judged("induction-heads", settings, metrics, judge, table(metrics), figures)


def table(metrics: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per depth: the losses, the phase change and the best head's scores."""
    columns = [
        "model",
        "first-occurrence loss",
        "repeat loss",
        "phase change at step",
        "best prefix matching",
        "its copying score",
        "best previous-token",
    ]
    rows = []
    for depth, m in metrics["models"].items():
        steps = [s for s in m["phase_step"] if s is not None]
        phase = f"{len(steps)}/{len(m['phase_step'])} seeds" + (
            f", {SeedStats.of(steps)}" if steps else ""
        )
        rows.append(
            [
                f"{depth} layer{'s' if depth != '1' else ''}",
                str(SeedStats.of(m["first_loss"])),
                str(SeedStats.of(m["repeat_loss"])),
                phase,
                str(SeedStats.of(m["best_prefix"])),
                str(SeedStats.of(m["best_copying"])),
                str(SeedStats.of(m["best_previous"])),
            ]
        )
    return columns, rows


def judge(metrics: dict[str, Any], quick: bool) -> Verdict:
    """The verdict from the metrics alone: 2 layers form a prefix-matching, copying head and
    the loss on the repeats collapses; 1 layer does neither (margins against seed spread)."""
    one, two = metrics["models"]["1"], metrics["models"]["2"]
    collapsed = COLLAPSED * metrics["uniform_loss"]
    pm1, pm2 = SeedStats.of(one["best_prefix"]), SeedStats.of(two["best_prefix"])
    rep1, rep2 = SeedStats.of(one["repeat_loss"]), SeedStats.of(two["repeat_loss"])
    copy2 = SeedStats.of(two["best_copying"])
    checks = (
        Check.greater(
            "2 layers form a head with a higher prefix-matching score than any of 1 layer",
            two["best_prefix"],
            one["best_prefix"],
        ),
        Check(
            f"the 2-layer head's prefix-matching score is high (> {HIGH_PREFIX})",
            pm2.mean - HIGH_PREFIX,
            pm2.std,
            f"{pm2}",
        ),
        Check(
            f"1 layer forms no induction head (best prefix matching < {HIGH_PREFIX})",
            HIGH_PREFIX - pm1.mean,
            pm1.std,
            f"{pm1}",
        ),
        Check(
            "the 2-layer induction head copies (copying score > 0)",
            copy2.mean,
            copy2.std,
            f"{copy2}",
        ),
        Check(
            f"2 layers: the loss on the repeats collapses (< {COLLAPSED} ln V = "
            f"{collapsed:.2f} nats)",
            collapsed - rep2.mean,
            rep2.std,
            f"{rep2} nats",
        ),
        Check(
            f"1 layer: the loss on the repeats does not collapse (> {collapsed:.2f} nats)",
            rep1.mean - collapsed,
            rep1.std,
            f"{rep1} nats",
        ),
    )
    return Verdict(experiment("induction-heads").claim, checks, quick=quick)
