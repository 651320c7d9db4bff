"""Translation of number words (English -> German / French) with a seq2seq model.

`train_translate` trains any architecture of `ARCHITECTURES` (name -> ``build(config_dict)``)
through the seq2seq interface only (``forward``, ``greedy``, ``alignment``, ``config.to_dict()``)
with the shared `attnlab.apps.loop.fit`; `evaluate` measures held-out exact match per language
with batched greedy decoding, on the German reordering cases and on the longest numbers; `load`
reads a ``"translate"`` checkpoint (the architecture, vocabulary and task are in its metadata) and
`translate` turns English number words into the target language.

Example:
    >>> result = train_translate("runs/translate", TranslateSettings())
    >>> model, ck = load("runs/translate/ckpt.safetensors")
    >>> translate(model, vocab_of(ck), ["twenty-three"], lang="de")    # ['dreiundzwanzig']
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._fit import ConfigRule
from ..checkpoint import Checkpoint, CheckpointError, read_header
from ..data.numbers import (
    BOS,
    EOS,
    PAD,
    Example,
    NumberTask,
    Vocab,
    collate,
    length_batches,
    reorders,
)
from ..models.rnn import build_rnn_seq2seq
from ..models.seq2seq import Seq2SeqConfig, build_seq2seq_transformer
from .loop import FitHistory, FitSettings, fit, load_model, save_model, write_metrics

KIND = "translate"

#: The longest text `translate` accepts, in characters. Decoding a text of n characters takes up
#: to 2n + 20 steps that each attend to the whole source, so the time grows with n²: the longest
#: number word below 10**15 has 197 characters (below 10**9, the default task: 114); measured:
#: docs/results. Longer input: one number per text.
MAX_SOURCE_CHARS = 256

#: Architectures: name -> ``build(config_dict) -> model`` implementing the seq2seq interface.
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "transformer": build_seq2seq_transformer,
    "rnn": build_rnn_seq2seq,  # the textbook's baseline: GRUs + additive (Bahdanau) attention
}

#: How the tensors of a checkpoint justify its stored config, per architecture
#: (`attnlab._fit.justify_config`: layer counts, vocabularies and widths; names below
#: the ``model.`` prefix).
RULES: dict[str, tuple[ConfigRule, ...]] = {
    "transformer": (
        ConfigRule("enc_layers", low=1, layers="encoder"),
        ConfigRule("dec_layers", low=1, layers="decoder"),
        ConfigRule("src_vocab_size", low=1, tensor="src_embed.weight", dim=0),
        ConfigRule("tgt_vocab_size", low=1, tensor="tgt_embed.weight", dim=0),
        ConfigRule("d_model", low=1, tensor="src_embed.weight", dim=1),
        ConfigRule("n_heads", low=1),
        ConfigRule("d_ff", low=1, tensor="encoder.0.mlp.fc1.weight", dim=0, optional=True),
        ConfigRule("pad_id"),
    ),
    "rnn": (
        ConfigRule("src_vocab_size", low=1, tensor="src_emb.weight", dim=0),
        ConfigRule("tgt_vocab_size", low=1, tensor="tgt_emb.weight", dim=0),
        ConfigRule("d_embed", low=1, tensor="src_emb.weight", dim=1),
        ConfigRule("d_encoder", low=1, tensor="enc_fwd.weight_hh_l0", dim=1),
        ConfigRule("d_decoder", low=1, tensor="decoder.weight_hh", dim=1),
        ConfigRule("d_attention", low=1, tensor="attention.v", dim=0),
        ConfigRule("d_output", low=1, tensor="out.weight", dim=1),
    ),
}


def default_config(arch: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The model config of ``arch`` for a shared vocabulary of ``vocab_size`` tokens."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if arch == "transformer":
        return Seq2SeqConfig(
            src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, pad_id=PAD, **overrides
        ).to_dict()
    return {"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, **overrides}


@dataclass
class TranslateSettings:
    """What `train_translate` runs.

    Attributes:
        arch: a name in `ARCHITECTURES`. model: config overrides (e.g. ``{"d_model": 128}``).
        max_digits: numbers 0 … 10**max_digits − 1. held_out: held-out numbers per language.
        langs: target languages. pool: distinct training examples generated (num2words is
            slow, so the run draws a pool once and shuffles it every epoch; measured:
            docs/results).
        batch_tokens: padded source + target tokens per batch (length-bucketed).
        label_smoothing: of the cross-entropy. fit: the optimisation settings.
        threads: torch threads (None = torch's default).
        pieces: multi-character number pieces in the vocabulary (`attnlab.data.numbers`).
        eval_batch: sentences per greedy-decoding batch.
        pad_multiple: training batches pad source and target lengths to a multiple of this
            (few distinct shapes: faster CPU kernels; 1 = pad to the longest only).
        lang_weights: how often each target language is drawn, relative (missing: 1.0). The
            default draws French twice as often as German: French is the harder direction
            (it must look ahead in the source: "eighteen" -> "dix-huit", "seventy" ->
            "soixante-dix"), and 2:1 evened the held-out errors of the two languages.
    """

    arch: str = "transformer"
    model: dict[str, Any] = field(default_factory=dict)
    max_digits: int = 9
    held_out: int = 2000
    langs: tuple[str, ...] = ("de", "fr")
    pool: int = 60000
    batch_tokens: int = 800
    label_smoothing: float = 0.0
    fit: FitSettings = field(
        default_factory=lambda: FitSettings(
            steps=100000,
            lr=1e-3,
            min_lr=5e-5,
            warmup=100,
            weight_decay=0.01,
            grad_clip=1.0,
            time_budget=540.0,
            schedule="time",
            precision="bf16",
        )
    )
    threads: int | None = None
    eval_batch: int = 250
    data_seed: int = 0
    pieces: bool = False
    pad_multiple: int = 32
    lang_weights: dict[str, float] | None = field(default_factory=lambda: {"fr": 2.0})


def seq2seq_loss(model: nn.Module, batch: Sequence[Tensor], label_smoothing: float) -> Tensor:
    """Token-level cross-entropy (label smoothed) over the real target tokens."""
    src, src_mask, tgt_in, tgt_out = batch
    logits = model(src, src_mask, tgt_in)  # (B, T, V)
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        tgt_out.flatten(),
        ignore_index=PAD,
        label_smoothing=label_smoothing,
    )


def decode_batch(
    model: nn.Module, vocab: Vocab, src: Tensor, src_mask: Tensor, max_len: int, beam: int = 1
) -> list[str]:
    """Greedy (``beam=1``) or beam-search translations of a padded source batch."""
    if beam == 1:
        out = model.greedy(src, src_mask, max_len=max_len, bos=BOS, eos=EOS)
    else:
        if not hasattr(model, "beam_search"):
            raise ValueError(f"beam={beam}: this architecture has no beam search")
        out, _ = model.beam_search(src, src_mask, beam=beam, max_len=max_len, bos=BOS, eos=EOS)
    return [vocab.decode(row) for row in out.tolist()]


@torch.no_grad()
def predict(
    model: nn.Module, vocab: Vocab, examples: Sequence[Example], batch: int = 250
) -> list[str]:
    """Greedy translations of ``examples`` (batched by source length; returned in order)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].src))
    out: list[str] = [""] * len(examples)
    model.eval()
    for i in range(0, len(order), batch):
        idx = order[i : i + batch]
        chunk = [examples[j] for j in idx]
        src, src_mask, _, _ = collate(chunk)
        max_len = max(len(e.tgt) for e in chunk) + 10
        for j, text in zip(idx, decode_batch(model, vocab, src, src_mask, max_len), strict=True):
            out[j] = text
    return out


def evaluate(
    model: nn.Module, task: NumberTask, batch: int = 250, longest: float = 0.1
) -> dict[str, Any]:
    """Held-out exact match per language; German reordering cases; the longest numbers.

    Returns:
        ``{"exact_match": {lang: x}, "reordering_de": x, "longest": {lang: x}, "counts": …,
        "errors": {lang: [up to 5 (number, expected, got)]}}``; "longest" is the top
        ``longest`` fraction of the held-out numbers by target length.
    """
    v = task.vocab
    res: dict[str, Any] = {"exact_match": {}, "longest": {}, "counts": {}, "errors": {}}
    for lang in task.langs:
        examples = task.held_out_examples(lang)
        got = predict(model, v, examples, batch)
        want = [task.pair(e.number, lang)[1] for e in examples]
        ok = [g == w for g, w in zip(got, want, strict=True)]
        res["exact_match"][lang] = sum(ok) / len(ok)
        k = max(1, round(longest * len(ok)))
        top = sorted(range(len(ok)), key=lambda i: (-len(want[i]), i))[:k]
        res["longest"][lang] = sum(ok[i] for i in top) / k
        res["counts"][lang] = len(ok)
        res["errors"][lang] = [
            (examples[i].number, want[i], got[i]) for i in range(len(ok)) if not ok[i]
        ][:5]
        if lang == "de":
            sel = [i for i, e in enumerate(examples) if reorders(e.number)]
            res["reordering_de"] = sum(ok[i] for i in sel) / max(1, len(sel))
            res["counts"]["reordering_de"] = len(sel)
    return res


class _Batches:
    """Length-bucketed batches of a pool, reshuffled every epoch from a seeded generator."""

    def __init__(self, pool: Sequence[Example], tokens: int, seed: int, multiple: int = 1) -> None:
        self.pool, self.tokens, self.rng = pool, tokens, random.Random(f"batches-{seed}")
        self.multiple = multiple
        self.queue: list[list[Example]] = []
        self.epochs = 0

    def next(self) -> tuple[Tensor, ...]:
        if not self.queue:
            self.queue = length_batches(self.pool, self.tokens, self.rng, self.multiple)
            self.epochs += 1
        return collate(self.queue.pop(), self.multiple)


def _arch_meta(arch: str, task: NumberTask) -> dict[str, str]:
    return {
        "arch": arch,
        "vocab": json.dumps(list(task.vocab.tokens), ensure_ascii=False),
        "task": json.dumps(
            {"max_digits": task.max_digits, "langs": list(task.langs), "seed": task.seed}
        ),
    }


@dataclass
class TranslateResult:
    """What `train_translate` returns: the model, the task, the history and the metrics."""

    model: nn.Module
    task: NumberTask
    history: FitHistory
    metrics: dict[str, Any]
    config: dict[str, Any]


def train_translate(
    out_dir: str | os.PathLike | None,
    s: TranslateSettings,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> TranslateResult:
    """Trains, evaluates and (with ``out_dir``) writes ckpt.safetensors, metrics.json,
    loss.png and alignment.png.

    Returns:
        A `TranslateResult`.
    """
    t_start, cpu_start = time.perf_counter(), time.process_time()
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    task = NumberTask(
        max_digits=s.max_digits,
        held_out=s.held_out,
        langs=s.langs,
        seed=s.data_seed,
        pieces=s.pieces,
    )
    weights = {k: v for k, v in (s.lang_weights or {}).items() if k in task.langs}
    task.language_weights(weights)  # a bad weight fails before the model is built
    config = default_config(s.arch, len(task.vocab), **s.model)
    torch.manual_seed(s.fit.seed)
    model = ARCHITECTURES[s.arch](config)
    t0 = time.process_time() if s.fit.clock == "cpu" else time.perf_counter()
    pool = task.training_examples(s.pool, s.fit.seed, weights)
    data_seconds = (time.process_time() if s.fit.clock == "cpu" else time.perf_counter()) - t0
    log(f"translate: {len(pool)} training pairs generated in {data_seconds:.1f} s")
    batches = _Batches(pool, s.batch_tokens, s.fit.seed, s.pad_multiple)
    ls = s.label_smoothing

    def loss_at(_step: int) -> Tensor:
        return seq2seq_loss(model, batches.next(), ls)

    history = fit(model, loss_at, s.fit, desc=f"translate/{s.arch}", progress=progress, log=log)
    t0, c0 = time.perf_counter(), time.process_time()
    model.eval()
    with torch.no_grad():
        ev = evaluate(model, task, s.eval_batch)
    eval_seconds, eval_cpu = time.perf_counter() - t0, time.process_time() - c0
    n_params = sum(p.numel() for p in model.parameters())
    metrics: dict[str, Any] = {
        "task": "translate",
        "arch": s.arch,
        "exact_match": ev["exact_match"],
        "reordering_de": ev.get("reordering_de"),
        "longest_10pct": ev["longest"],
        "held_out_counts": ev["counts"],
        "errors": ev["errors"],
        "steps": history.steps,
        "epochs": batches.epochs,
        "stopped_by": history.stopped_by,
        "train_seconds": round(history.seconds, 2),
        "clock": s.fit.clock,
        "data_seconds": round(data_seconds, 2),
        "eval_seconds": round(eval_seconds, 2),
        "eval_cpu_seconds": round(eval_cpu, 2),
        "final_train_loss": history.train_loss[-1] if history.train_loss else None,
        "train_loss_every_50": [
            round(sum(chunk) / len(chunk), 4)
            for chunk in (history.train_loss[i : i + 50] for i in range(0, history.steps, 50))
        ],
        "parameters": n_params,
        "config": config,
        "settings": {**asdict(s), "fit": asdict(s.fit)},
    }
    if out_dir is not None:
        out = Path(out_dir)
        save_model(
            out / "ckpt.safetensors",
            model,
            kind=KIND,
            config=config,
            extra=_arch_meta(s.arch, task),
        )
        from ..viz.alignment import plot_alignments, plot_loss

        plot_loss(out / "loss.png", history.train_loss, title=f"translate ({s.arch})")
        pngs = alignment_examples(model, task)
        plot_alignments(out / "alignment.png", pngs)
        metrics["seconds"] = round(time.perf_counter() - t_start, 2)
        metrics["cpu_seconds"] = round(time.process_time() - cpu_start, 2)
        write_metrics(out, metrics)
    else:
        metrics["seconds"] = round(time.perf_counter() - t_start, 2)
        metrics["cpu_seconds"] = round(time.process_time() - cpu_start, 2)
    return TranslateResult(model, task, history, metrics, config)


def alignment_examples(
    model: nn.Module, task: NumberTask, numbers: Sequence[int] | None = None
) -> list[tuple[str, list[str], list[str], Tensor]]:
    """``(title, source tokens, target tokens, weights (T, S))`` for held-out numbers (the
    model's own greedy output is fed back as the target), one per language."""
    v = task.vocab
    if numbers is None:
        held = task.held_out_numbers
        numbers = [next((n for n in held if 10**4 <= n < 10**5 and reorders(n)), held[0])]
    items = []
    for lang in task.langs:
        for n in numbers:
            en, _ = task.pair(n, lang)
            items.append(alignment_of(model, v, en, lang, title=f"{n:,} -> {lang}"))
    return items


@torch.no_grad()
def cross_attentions(
    model: nn.Module, vocab: Vocab, text: str, lang: str
) -> tuple[list[str], list[str], Tensor]:
    """``(source tokens, output tokens, weights (layers, heads, T, S))`` of the model's own
    greedy translation of ``text``; an architecture without per-head weights (no
    ``cross_attention_weights``) gives its `alignment` as one layer and one head."""
    src_ids = vocab.encode_source(text, lang)
    src = torch.tensor([src_ids])
    mask = torch.ones_like(src, dtype=torch.bool)
    out = model.greedy(src, mask, max_len=4 * len(src_ids) + 20, bos=BOS, eos=EOS)[0].tolist()
    if EOS in out:
        out = out[: out.index(EOS) + 1]
    tgt_in = torch.tensor([[BOS, *out[:-1]]])
    if hasattr(model, "cross_attention_weights"):
        w = model.cross_attention_weights(src, mask, tgt_in)[:, 0]  # (layers, H, T, S)
    else:
        w = model.alignment(src, mask, tgt_in)[0][None, None]  # (1, 1, T, S)
    return [vocab.tokens[i] for i in src_ids], [vocab.tokens[i] for i in out], w.float().cpu()


@torch.no_grad()
def alignment_of(
    model: nn.Module, vocab: Vocab, text: str, lang: str, *, title: str = ""
) -> tuple[str, list[str], list[str], Tensor]:
    """The cross-attention of the model's own translation of ``text``: ``(title, source
    tokens, output tokens, weights (T, S))`` (row t: the step that wrote output token t)."""
    src_ids = vocab.encode_source(text, lang)
    src = torch.tensor([src_ids])
    mask = torch.ones_like(src, dtype=torch.bool)
    out = model.greedy(src, mask, max_len=4 * len(src_ids) + 20, bos=BOS, eos=EOS)[0].tolist()
    if EOS in out:
        out = out[: out.index(EOS) + 1]
    tgt_in = torch.tensor([[BOS, *out[:-1]]])
    w = model.alignment(src, mask, tgt_in)[0]  # (T, S)
    src_tok = [vocab.tokens[i] for i in src_ids]
    tgt_tok = [vocab.tokens[i] for i in out]
    return title or f"{text} -> {lang}", src_tok, tgt_tok, w


# --------------------------------------------------------------------------- checkpoints
def load(
    path: str | os.PathLike, device: torch.device | str = "cpu"
) -> tuple[nn.Module, Checkpoint]:
    """The model of a ``"translate"`` checkpoint, verified (any architecture of
    `ARCHITECTURES`): ``(model in eval mode, checkpoint)``; `vocab_of` gives its vocabulary."""
    header = read_header(path)
    arch = header.metadata.get("arch")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            Path(os.fspath(path)),
            f"names an unknown architecture {arch!r} (known: {sorted(ARCHITECTURES)})",
        )
    model, _, ck = load_model(path, KIND, ARCHITECTURES[arch], rules=RULES[arch], device=device)
    vocab_of(ck)  # a damaged vocabulary fails now, not at the first translation
    return model, ck


def vocab_of(ck: Checkpoint) -> Vocab:
    """The `Vocab` stored in a translate checkpoint."""
    try:
        tokens = json.loads(ck.metadata["vocab"])
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError("not a list of strings")
        return Vocab(tuple(tokens))
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            Path(str(getattr(ck, "path", "checkpoint"))), f"bad vocabulary: {e}"
        ) from None


def langs_of(ck: Checkpoint) -> list[str]:
    """The target languages of a translate checkpoint (from its vocabulary's ``<lang>`` tokens)."""
    return [t[1:-1] for t in vocab_of(ck).tokens[3:] if len(t) > 2 and t[0] == "<" and t[-1] == ">"]


@torch.no_grad()
def translate(
    model: nn.Module,
    vocab: Vocab,
    texts: Sequence[str],
    *,
    lang: str,
    beam: int = 1,
    max_len: int | None = None,
) -> list[str]:
    """Translations of English number words ``texts`` into ``lang`` (ValueError for a
    character outside the vocabulary, an unknown language or a text longer than
    `MAX_SOURCE_CHARS`, naming it)."""
    if not texts:
        return []
    for i, t in enumerate(texts):
        if len(t) > MAX_SOURCE_CHARS:
            raise ValueError(
                f"texts[{i}] has {len(t)} characters, more than the {MAX_SOURCE_CHARS} a "
                "translation accepts (one number's words per text; split longer input)"
            )
    ids = [vocab.encode_source(t, lang) for t in texts]
    examples = [Example(-1, lang, s, [EOS]) for s in ids]
    src, src_mask, _, _ = collate(examples)
    limit = max_len if max_len is not None else 2 * src.shape[1] + 20
    model.eval()
    return decode_batch(model, vocab, src, src_mask, limit, beam)


__all__ = [
    "ARCHITECTURES",
    "KIND",
    "MAX_SOURCE_CHARS",
    "TranslateResult",
    "TranslateSettings",
    "alignment_examples",
    "alignment_of",
    "cross_attentions",
    "default_config",
    "evaluate",
    "langs_of",
    "load",
    "predict",
    "seq2seq_loss",
    "train_translate",
    "translate",
    "vocab_of",
]
