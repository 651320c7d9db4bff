"""What MiniLM's heads do, and how many of them matter: a head classifier and a pruning sweep.

Both run on the real all-MiniLM-L6-v2 (`attnlab.models.minilm`) over sentences taken from the
shipped *Alice's Adventures in Wonderland* (`attnlab.data`), so every number is reproducible
offline.

**Sentence set** (`alice_sentences`): the text after the heading "CHAPTER I", whitespace
collapsed, split after ``.``, ``!`` or ``?`` followed by a space; sentences of 8–16 words (and
without "CHAPTER") are kept in book order. ``alice_sentences(n, skip)`` is sentences
``skip … skip + n − 1`` of that list.

**Head classifier** (`classify_heads`): per (layer, head), statistics of the attention weights
``p`` (rows = query tokens, averaged over the query rows of every sentence):

- ``prev``, ``next``, ``self``: mean ``p_{i,i−1}`` (over rows i ≥ 1), ``p_{i,i+1}`` (rows
  i ≤ T − 2), ``p_{i,i}``;
- ``special``: mean weight on [CLS] (the first token) plus [SEP];
- ``rare``: the share of a row's weight on ordinary (not [CLS]/[SEP]) tokens that goes to rare
  tokens — tokens seen at most ``rare_count`` (default 3) times in the whole book (WordPiece
  counts over alice.txt) — and ``rare_share``, the share of rare tokens among the ordinary keys
  (what a head blind to rarity would give them); sink weight on [CLS]/[SEP] is left out of both
  so that a sink head's rare-token preference still shows;
- ``entropy``: mean row entropy ``−Σ_j p_ij log p_ij`` in nats (0 = one-hot, ``ln T`` =
  uniform), the unit of every entropy in attnlab;
- ``normalised_entropy``: the mean of ``entropy / ln T`` per sentence, in ``[0, 1]`` (1 =
  uniform), comparable across sentence lengths;
- ``distance``: mean ``Σ_j p_ij |i − j|`` in tokens.

Classes, the first rule that fires (thresholds in `HEAD_THRESHOLDS`):

1. ``positional`` (``previous``/``next``/``self``): one of prev, next, self ≥ 0.5;
2. ``sink``: special ≥ 0.5 (the head parks its weight on [CLS]/[SEP]);
3. ``rare-token``: rare ≥ 3 × rare_share and rare ≥ 0.1;
4. ``broad``: normalised_entropy ≥ 0.8 (entropy ≥ 0.8 × ln T);
5. ``other``: none of these (content-dependent heads, e.g. syntactic ones; telling those apart
   needs annotated data).

**Pruning sweep** (`pruning_sweep`): heads are removed by gating their output to zero
(`head_gates`, equal to `MultiHeadAttention.prune_heads` up to float rounding) in two orders —
*importance* order (least important first; importance = the exact increase of the metric's
loss ``1 − cosine`` when that head alone is removed — `head_importance`'s ``ablation`` —
measured on a separate importance set of sentences, batched by `ablation_importance`) and
*random* order (seeded permutations, the metric averaged over seeds). The **metric** is the
mean over the evaluation sentences of the cosine between the pruned and the unpruned model's
sentence embeddings,
``cos(e, e₀) = e·e₀ / √(‖e‖² ‖e₀‖²)`` in float64 (exactly 1 at fraction 0).

Example:
    >>> sweep = pruning_sweep()
    >>> print(sweep.table())
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number
from .importance import attention_modules, head_gates
from .table_parts import TableParts
from .weights import entropy

#: The classifier's thresholds (see the module docstring for the rules they enter).
HEAD_THRESHOLDS: dict[str, float] = {
    "positional": 0.5,  # mean weight on the previous / next / same token
    "sink": 0.5,  # mean weight on [CLS] + [SEP]
    "rare_lift": 3.0,  # ordinary weight on rare tokens / their share of the ordinary keys
    "rare_min": 0.1,  # and at least this share of the ordinary weight on rare tokens
    "broad": 0.8,  # normalised entropy: mean entropy / ln T
}

#: Statistics per head, in the order of `HeadReport.stats`' last axis.
HEAD_STATS = (
    "prev",
    "next",
    "self",
    "special",
    "rare",
    "rare_share",
    "entropy",
    "normalised_entropy",
    "distance",
)

_MIN_WORDS, _MAX_WORDS = 8, 16


# ------------------------------------------------------------------------------ sentences
def _book() -> str:
    from ..data import default_text_path

    return default_text_path().read_text(encoding="ascii")


def _all_sentences() -> list[str]:
    text = _book()
    flat = " ".join(text[text.index("CHAPTER I") :].split())
    parts = re.split(r"(?<=[.!?]) ", flat)
    return [s for s in parts if _MIN_WORDS <= len(s.split()) <= _MAX_WORDS and "CHAPTER" not in s]


def alice_sentences(n: int = 16, skip: int = 0) -> list[str]:
    """Sentences ``skip … skip + n − 1`` of the fixed Alice sentence list (module docstring).

    Args:
        n: how many sentences (≥ 1).
        skip: how many sentences of the list to pass over first (≥ 0).

    Returns:
        ``n`` sentences of 8–16 words, in book order.

    Raises:
        TypeError, ValueError: ``n`` or ``skip`` not an int in range (the list has about 400).
    """
    check_int("n", n, minimum=1)
    check_int("skip", skip, minimum=0)
    sentences = _all_sentences()
    if skip + n > len(sentences):
        raise ValueError(
            f"skip + n must be <= {len(sentences)} (the Alice sentence list), got {skip + n}"
        )
    return sentences[skip : skip + n]


def token_counts(model: Any) -> Tensor:
    """How often each WordPiece id occurs in the whole of alice.txt, ``(vocab,)`` int64.

    Args:
        model: a `attnlab.models.MiniLM` (its tokenizer is used, line by line, no special tokens).
    """
    lines = [line for line in _book().splitlines() if line.strip()]
    encs = model.tokenizer.encode_batch(lines, add_special_tokens=False)
    ids = torch.tensor([i for e in encs for i in e.ids], dtype=torch.long)
    size = model.tokenizer.get_vocab_size()
    return torch.bincount(ids, minlength=size)


# ------------------------------------------------------------------------------ classifier
@dataclass
class HeadReport:
    """Per-head statistics and classes of a model over a sentence set.

    Attributes:
        stats: ``(layers, heads, len(HEAD_STATS))`` float64, columns named by `HEAD_STATS`.
        classes: ``classes[l][h]`` the class of layer l, head h.
        sentences: how many sentences the statistics average over.
    """

    stats: Tensor
    classes: list[list[str]]
    sentences: int

    def stat(self, name: str) -> Tensor:
        """One statistic for every head, ``(layers, heads)``."""
        if name not in HEAD_STATS:
            raise ValueError(f"name must be one of {list(HEAD_STATS)}, got {name!r}")
        return self.stats[..., HEAD_STATS.index(name)]

    def counts(self) -> dict[str, int]:
        """How many heads fall in each class."""
        out: dict[str, int] = {}
        for row in self.classes:
            for c in row:
                out[c] = out.get(c, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (layer, head): layer, head, class and every statistic."""
        out = []
        for layer, row in enumerate(self.classes):
            for head, c in enumerate(row):
                values = self.stats[layer, head].tolist()
                out.append(
                    {
                        "layer": layer,
                        "head": head,
                        "class": c,
                        **dict(zip(HEAD_STATS, values, strict=True)),
                    }
                )
        return out

    def table(self) -> str:
        """An aligned text table, one row per head, and the class counts."""
        return self.table_parts().text()

    def table_parts(self) -> TableParts:
        """The table of `table` as data: a row per head (statistics to 3 decimals); below it,
        the class counts and the unit of the entropies."""
        rows = [
            [str(r["layer"]), str(r["head"]), r["class"], *(f"{r[s]:.3f}" for s in HEAD_STATS)]
            for r in self.rows()
        ]
        header = ["layer", "head", "class", *HEAD_STATS]
        counts = ", ".join(f"{k} {v}" for k, v in self.counts().items())
        after = (
            f"{len(rows)} heads over {self.sentences} sentences: {counts}",
            "entropy in nats; normalised_entropy = entropy / ln T (1 = uniform)",
        )
        return TableParts(header, rows, "<" * len(header), after=after)


def classify(stats: Tensor) -> list[list[str]]:
    """Classes of heads from their statistics ``(layers, heads, len(HEAD_STATS))`` (rules and
    thresholds: module docstring, `HEAD_THRESHOLDS`)."""
    if not isinstance(stats, Tensor) or stats.dim() != 3 or stats.shape[-1] != len(HEAD_STATS):
        got = tuple(stats.shape) if isinstance(stats, Tensor) else type(stats).__name__
        raise ValueError(f"stats must be (layers, heads, {len(HEAD_STATS)}), got {got}")
    t = HEAD_THRESHOLDS
    col = {name: stats[..., i] for i, name in enumerate(HEAD_STATS)}
    out = []
    for layer in range(stats.shape[0]):
        row = []
        for head in range(stats.shape[1]):
            s = {k: float(v[layer, head]) for k, v in col.items()}
            positional = max(
                ("previous", s["prev"]),
                ("next", s["next"]),
                ("self", s["self"]),
                key=lambda kv: kv[1],
            )
            if positional[1] >= t["positional"]:
                row.append(f"positional ({positional[0]})")
            elif s["special"] >= t["sink"]:
                row.append("sink")
            elif s["rare"] >= t["rare_min"] and s["rare"] >= t["rare_lift"] * s["rare_share"]:
                row.append("rare-token")
            elif s["normalised_entropy"] >= t["broad"]:
                row.append("broad")
            else:
                row.append("other")
        out.append(row)
    return out


def head_statistics(
    weights: Tensor, ids: Sequence[int], special: Sequence[int], rare: Tensor
) -> Tensor:
    """`HEAD_STATS` of one sentence's attention, ``(layers, heads, len(HEAD_STATS))`` float64.

    Args:
        weights: ``(layers, heads, T, T)`` attention probabilities of the sentence.
        ids: its T token ids.
        special: the ids that count as special tokens ([CLS], [SEP]).
        rare: ``(vocab,)`` bool, True for rare token ids.
    """
    if (
        not isinstance(weights, Tensor)
        or weights.dim() != 4
        or weights.shape[-1] != weights.shape[-2]
    ):
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be (layers, heads, T, T), got {got}")
    w = weights.to(torch.float64)  # (layers, H, T, T)
    T = w.shape[-1]
    if T < 2:
        raise ValueError(f"a sentence needs at least 2 tokens, got T={T}")
    if len(ids) != T:
        raise ValueError(f"ids must hold T={T} token ids (one per weight row), got {len(ids)}")
    if not isinstance(rare, Tensor) or rare.dtype != torch.bool or rare.dim() != 1:
        raise TypeError(f"rare must be a 1-D bool tensor over the vocabulary, got {rare!r:.80}")
    idx = torch.tensor(list(ids), dtype=torch.long)
    i = torch.arange(T)
    prev = w[..., i[1:], i[:-1]].mean(-1)  # over the rows that have a previous token
    nxt = w[..., i[:-1], i[1:]].mean(-1)  # over the rows that have a next token
    diag = w.diagonal(dim1=-2, dim2=-1).mean(-1)
    is_special = torch.isin(idx, torch.tensor(list(special), dtype=torch.long))
    is_rare = rare[idx] & ~is_special
    spec_rows = w[..., is_special].sum(-1)  # (layers, H, T)
    ordinary = (1.0 - spec_rows).clamp_min(1e-12)  # weight on ordinary tokens per row
    rare_w = (w[..., is_rare].sum(-1) / ordinary).mean(-1)
    spec = spec_rows.mean(-1)
    share = torch.full_like(diag, float(is_rare.sum()) / max(int((~is_special).sum()), 1))
    ent = entropy(w).to(torch.float64).mean(-1)  # nats
    dist = (w * (i[:, None] - i[None, :]).abs().to(w.dtype)).sum(-1).mean(-1)
    return torch.stack([prev, nxt, diag, spec, rare_w, share, ent, ent / math.log(T), dist], -1)


def classify_heads(
    sentences: Sequence[str] | None = None,
    *,
    model: Any = None,
    rare_count: int = 3,
    device: torch.device | str | None = None,
) -> HeadReport:
    """Classifies every head of all-MiniLM-L6-v2 from its attention over ``sentences``.

    Args:
        sentences: default ``alice_sentences(16)``.
        model: a loaded `attnlab.models.MiniLM` (default ``minilm()``).
        rare_count: a token is rare when alice.txt holds it at most this many times.
        device: where the default model runs (the statistics are computed on the host).

    Returns:
        A `HeadReport`: per-head statistics averaged over the sentences (each sentence weighs
        the same) and the classes.
    """
    if sentences is None:
        sentences = alice_sentences(16)
    if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences):
        raise TypeError("sentences must be a sequence of strings")
    if not sentences:
        raise ValueError("sentences must not be empty")
    check_int("rare_count", rare_count, minimum=1)
    model = _minilm(model, device)
    rare = token_counts(model) <= rare_count  # (vocab,)
    special = [
        model.tokenizer.token_to_id(t)
        for t in ("[CLS]", "[SEP]")
        if model.tokenizer.token_to_id(t) is not None
    ]
    per = []
    for text in sentences:
        ids = model.tokenize([text])[0]
        _, w = model.attentions(text)  # (layers, H, T, T)
        per.append(head_statistics(w.cpu(), ids, special, rare))
    stats = torch.stack(per).mean(0)  # (layers, H, stats)
    return HeadReport(stats, classify(stats), len(sentences))


# ------------------------------------------------------------------------------ pruning
@dataclass
class PruningSweep:
    """Embedding cosine to the unpruned model against the fraction of heads pruned.

    Attributes:
        fractions: the fractions f of heads pruned (``round(f · heads)`` heads).
        metric: ``{order: [cosine per fraction]}`` for orders "importance" and "random".
        random_runs: ``[cosine per fraction]`` of each random seed.
        importance: ``(layers, heads)`` loss increase of removing each head alone.
        order: the importance order (``(layer, head)``, pruned first to last).
        heads: the number of heads in the model.
        eval_sentences, importance_sentences: how many sentences each set holds.
        threshold: the cosine level that `kept_fraction` reads.
    """

    fractions: list[float]
    metric: dict[str, list[float]]
    random_runs: list[list[float]]
    importance: Tensor
    order: list[tuple[int, int]]
    heads: int
    eval_sentences: int
    importance_sentences: int
    threshold: float = 0.95
    notes: list[str] = field(default_factory=list)

    def kept_fraction(self, order: str) -> float:
        """The largest measured fraction f with metric ≥ threshold at every fraction ≤ f."""
        best = 0.0
        for f, m in sorted(zip(self.fractions, self.metric[order], strict=True)):
            if m < self.threshold:
                break
            best = f
        return best

    def table(self) -> str:
        """The sweep as an aligned table plus the fractions at the threshold."""
        return self.table_parts().text()

    def table_parts(self) -> TableParts:
        """The table of `table` as data: above it what was measured; a row per fraction;
        below it, per order, the fraction pruned at the threshold, then the notes."""
        rows = [
            [
                f"{f:.2f}",
                str(round(f * self.heads)),
                *(f"{self.metric[o][i]:.4f}" for o in self.metric),
            ]
            for i, f in enumerate(self.fractions)
        ]
        head = ["fraction", "heads pruned", *(f"cosine ({o})" for o in self.metric)]
        title = (
            f"Head pruning on all-MiniLM-L6-v2: mean cosine to the unpruned embeddings over "
            f"{self.eval_sentences} Alice sentences; importance from {self.importance_sentences} "
            f"other sentences; random = mean of {len(self.random_runs)} seeds"
        )
        kept = []
        for o in self.metric:
            f = self.kept_fraction(o)
            kept.append(
                f"{o} order: cosine >= {self.threshold} up to {f:.0%} of heads pruned "
                f"({round(f * self.heads)} of {self.heads}); {1 - f:.0%} kept"
            )
        align = "<>" + ">" * len(self.metric)
        return TableParts(head, rows, align, before=(title,), after=(*kept, *self.notes))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return {
            "fractions": self.fractions,
            "metric": self.metric,
            "random_runs": self.random_runs,
            "importance": self.importance.tolist(),
            "order": self.order,
            "heads": self.heads,
            "threshold": self.threshold,
            "kept_fraction": {o: self.kept_fraction(o) for o in self.metric},
        }


def _minilm(model: Any, device: torch.device | str | None = None) -> Any:
    """``model``, or the shipped all-MiniLM-L6-v2 moved to ``device`` (default cpu)."""
    if model is None:
        from ..models.minilm import minilm

        return minilm().to(device if device is not None else "cpu")
    from ..models.minilm import MiniLM

    if not isinstance(model, MiniLM):
        raise TypeError(f"model must be an attnlab.models.MiniLM, got {type(model).__name__}")
    return model


def _cosine(e: Tensor, ref: Tensor) -> Tensor:
    """``e·e₀ / √(‖e‖² ‖e₀‖²)`` per row in float64: exactly 1 for identical rows (binary
    floating point with correctly rounded ``*`` and ``sqrt`` gives ``√(s·s) = s``)."""
    a, b = e.to(torch.float64), ref.to(torch.float64)
    return (a * b).sum(-1) / ((a * a).sum(-1) * (b * b).sum(-1)).sqrt()


def _check_fractions(fractions: object) -> list[float]:
    if not isinstance(fractions, Sequence) or not fractions:
        raise TypeError(f"fractions must be a non-empty sequence of floats, got {fractions!r}")
    out = []
    for f in fractions:
        x = check_number("fractions", f, at_least=0.0)
        if x > 1.0:
            raise ValueError(f"fractions must be <= 1, got {f!r}")
        out.append(x)
    return out


def _sample_gates(model: nn.Module, gates: list[Tensor]) -> Any:
    """`head_gates` with one gate vector per batch item: ``gates[l]`` is ``(B, H_l)``."""
    from contextlib import ExitStack

    stack = ExitStack()
    for (_, m), g in zip(attention_modules(model), gates, strict=True):
        H, D = m.num_heads, m.head_dim

        def hook(_mod: nn.Module, args: tuple, g: Tensor = g, H: int = H, D: int = D) -> tuple:
            x = args[0]  # (B, T, H·D)
            gx = g.to(x.dtype)[:, None, :, None]  # (B, 1, H, 1)
            return ((x.unflatten(-1, (H, D)) * gx).flatten(-2), *args[1:])

        stack.callback(m.out_proj.register_forward_pre_hook(hook).remove)
    return stack


def ablation_importance(
    model: Any, batch: tuple[Tensor, Tensor | None], ref: Tensor, *, heads_per_pass: int = 24
) -> Tensor:
    """``1 − mean_n cos(e_n, ref_n)`` with each head alone gated to zero, ``(layers, heads)``.

    The same numbers as ``head_importance(model, batch, loss_fn, ablation=True)["ablation"]``
    for ``loss_fn = 1 − mean cos(model(*batch), ref)`` (whose loss at every gate 1 is exactly 0
    when ``ref`` is the unpruned output), computed with the sentences repeated once per ablated
    head and per-item gates: one forward per ``heads_per_pass`` heads instead of one per head.

    Args:
        model: a `attnlab.models.MiniLM`.
        batch: padded ``(N, T)`` ids and mask (or None), as ``MiniLM.pad_batch`` returns them.
        ref: ``(N, E)`` the unpruned embeddings of the batch.
        heads_per_pass: ablated heads per forward pass.
    """
    ids, mask = batch
    N = ids.shape[0]
    shape = [m.num_heads for _, m in attention_modules(model)]
    flat = [(layer, head) for layer, h in enumerate(shape) for head in range(h)]
    out = torch.zeros(len(shape), max(shape), dtype=torch.float64)
    for start in range(0, len(flat), heads_per_pass):
        part = flat[start : start + heads_per_pass]
        R = len(part)
        gates = [torch.ones(R, h, device=ids.device) for h in shape]
        for r, (layer, head) in enumerate(part):
            gates[layer][r, head] = 0.0
        gates = [g.repeat_interleave(N, dim=0) for g in gates]  # (R·N, H)
        big_mask = None if mask is None else mask.repeat(R, 1)
        with torch.no_grad(), _sample_gates(model, gates):
            e = model(ids.repeat(R, 1), big_mask)  # (R·N, E)
        loss = 1.0 - _cosine(e, ref.repeat(R, 1)).unflatten(0, (R, N)).mean(-1)  # (R,)
        for r, (layer, head) in enumerate(part):
            out[layer, head] = loss[r]
    return out


def pruning_sweep(
    fractions: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    *,
    eval_sentences: int = 16,
    importance_sentences: int = 6,
    seeds: int = 3,
    model: Any = None,
    threshold: float = 0.95,
    device: torch.device | str | None = None,
) -> PruningSweep:
    """Prunes fractions of MiniLM's heads in importance order and in random order.

    Evaluation set: ``alice_sentences(eval_sentences)``; importance set: the next
    ``importance_sentences`` sentences of the list (disjoint from the evaluation set). Heads are
    pruned by zero gates (`head_gates`) on one padded batch; the unpruned embeddings come from
    the same batch with every gate 1, so fraction 0 gives cosine 1 exactly.

    Args:
        fractions: fractions of the heads to prune, each in [0, 1].
        eval_sentences: sentences the metric averages over.
        importance_sentences: sentences the importance is measured on.
        seeds: random orders (seeds 0 … seeds − 1) whose metric is averaged.
        model: a loaded `attnlab.models.MiniLM` (default ``minilm()``); gates are removed
            afterwards, the model is not changed.
        device: where the default model runs (default cpu).
        threshold: the cosine level `PruningSweep.kept_fraction` reports.

    Returns:
        A `PruningSweep`.
    """
    fracs = _check_fractions(fractions)
    check_int("eval_sentences", eval_sentences, minimum=1)
    check_int("importance_sentences", importance_sentences, minimum=1)
    check_int("seeds", seeds, minimum=1)
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
    model = _minilm(model, device)
    mods = attention_modules(model)
    shape = [m.num_heads for _, m in mods]
    total = sum(shape)
    texts = alice_sentences(eval_sentences + importance_sentences)
    device = model.encoder.word_embeddings.weight.device

    def batch_of(part: list[str]) -> tuple[Tensor, Tensor | None]:
        return model.pad_batch(model.tokenize(part), device)  # (N, T), (N, T) or None

    eval_batch = batch_of(texts[:eval_sentences])
    imp_batch = batch_of(texts[eval_sentences:])

    def embed(batch: tuple[Tensor, Tensor | None], gates: list[Tensor] | None) -> Tensor:
        gs = gates if gates is not None else [torch.ones(h, device=device) for h in shape]
        with head_gates(model, gs):
            return model(*batch)  # (N, E)

    with torch.no_grad():
        imp_ref = embed(imp_batch, None)
        eval_ref = embed(eval_batch, None)

    was_training = model.training
    model.eval()
    try:
        scores = ablation_importance(model, imp_batch, imp_ref)
        flat = [(layer, head) for layer, h in enumerate(shape) for head in range(h)]
        order = sorted(flat, key=lambda lh: (float(scores[lh]), lh))

        seen: dict[frozenset[tuple[int, int]], float] = {}

        def metric(pruned: list[tuple[int, int]]) -> float:
            key = frozenset(pruned)  # f = 0 and f = 1 prune the same set in every order
            if key not in seen:
                gates = [torch.ones(h, device=device) for h in shape]
                for layer, head in pruned:
                    gates[layer][head] = 0.0
                with torch.no_grad():
                    seen[key] = float(_cosine(embed(eval_batch, gates), eval_ref).mean())
            return seen[key]

        counts = [round(f * total) for f in fracs]
        by_importance = [metric(order[:c]) for c in counts]
        runs = []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            perm = [flat[i] for i in torch.randperm(total, generator=g).tolist()]
            runs.append([metric(perm[:c]) for c in counts])
    finally:
        model.train(was_training)
    random_mean = [sum(r[i] for r in runs) / len(runs) for i in range(len(fracs))]
    return PruningSweep(
        fractions=fracs,
        metric={"importance": by_importance, "random": random_mean},
        random_runs=runs,
        importance=scores,
        order=order,
        heads=total,
        eval_sentences=eval_sentences,
        importance_sentences=importance_sentences,
        threshold=threshold,
    )


__all__ = [
    "HEAD_STATS",
    "HEAD_THRESHOLDS",
    "HeadReport",
    "PruningSweep",
    "ablation_importance",
    "alice_sentences",
    "classify",
    "classify_heads",
    "head_statistics",
    "pruning_sweep",
    "token_counts",
]
