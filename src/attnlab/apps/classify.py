"""Text classification: which language is a word? Three classifiers measured in one run.

Data: `attnlab.data.languages` (wordfreq's per-language word lists, words listed by more than one
language dropped, split by word, stratified, seeded). Classifiers, all scored on the same
held-out words:

- **ngram**: the baseline, scikit-learn ``TfidfVectorizer(analyzer="char_wb",
  ngram_range=(1, 4), sublinear_tf=True)`` + ``LogisticRegression(C=10)`` on the training words;
- **char**: a small character-level `attnlab.models.Encoder` trained from scratch with a
  classification head (`attnlab.models.classifier`), every parameter trained;
- **minilm**: the pretrained all-MiniLM-L6-v2 encoder (its uncased WordPiece tokenizer) with a
  classification head; the head and the top ``minilm_layers`` layers are trained, the layers
  below stay as pretrained. Their output never changes, so it is computed once per word and
  reused by every step (`TextClassifier.features` / `forward_from`).

Which heads a classifier uses (`head_ablation`): every encoder head (layer l, head h) is removed
in turn by gating its output to zero (`attnlab.analysis.importance.head_gates`, the same as
`MultiHeadAttention.prune_heads` up to float rounding) and the held-out accuracy drop
``acc − acc_{−(l,h)}`` and cross-entropy increase are recorded (layers below l are unaffected,
so each ablation runs from the cached input of layer l).

Batches are drawn by length (`length_batches`): each epoch the training words are shuffled with
the run's seeded generator, stably sorted by token count and cut into batches, whose order is
shuffled again, so a batch pads little.

Example:
    >>> result = run(ClassifySettings(n_words=1000, char_steps=300, minilm_steps=100), "out")
    >>> result.metrics["accuracy"]          # held-out accuracy of each classifier
    {'ngram': ..., 'char': ..., 'minilm': ...}
    >>> model, _ = load("out/char.safetensors")
    >>> model.predict(["haus", "maison"])
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._fit import ConfigRule
from .._shapes import check_bool, check_int, check_number
from ..analysis.importance import attention_modules, head_gates
from ..checkpoint import Checkpoint
from ..data.languages import LANGUAGES, LanguageSplit, language_split
from ..models.classifier import POOLINGS, TextClassifier, build_classifier, char_classifier
from ..models.config import checkpoint_rules
from .loop import FitHistory, FitSettings, fit, load_model, save_model, write_metrics

#: The checkpoint kind of `save_model` / `load`.
KIND = "classify"


@dataclass
class ClassifySettings:
    """One ``attnlab train classify`` run.

    Attributes:
        languages, n_words, test_fraction, seed: the data (`language_split`); ``seed`` also
            seeds the models' initialisation and batch order.
        pooling: the heads' pooling, "attention" or "cls".
        char_d_model, char_layers, char_heads, char_max_len: the character encoder.
        char_steps, char_batch, char_lr, char_dropout: its training.
        minilm: also train the MiniLM classifier.
        minilm_layers: how many top MiniLM layers are trained with the head (0 = the head only).
        minilm_steps, minilm_batch, minilm_lr: its training.
        ablation_words: held-out words (the first of each language, in equal numbers) the head
            ablation runs on (0 = no ablation).
        time_budget: seconds of training per model (None = no limit).
    """

    languages: tuple[str, ...] = LANGUAGES
    n_words: int = 3000
    test_fraction: float = 0.2
    seed: int = 0
    pooling: str = "attention"
    char_d_model: int = 128
    char_layers: int = 3
    char_heads: int = 4
    char_max_len: int = 24
    char_steps: int = 1500
    char_batch: int = 128
    char_lr: float = 2e-3
    char_dropout: float = 0.1
    minilm: bool = True
    minilm_layers: int = 2
    minilm_steps: int = 600
    minilm_batch: int = 128
    minilm_lr: float = 3e-4
    ablation_words: int = 1000
    time_budget: float | None = None

    def __post_init__(self) -> None:
        self.languages = tuple(self.languages)
        for name in ("char_d_model", "char_layers", "char_heads", "char_steps", "char_batch"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("minilm_steps", "minilm_batch"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("char_max_len", self.char_max_len, minimum=2)
        check_int("minilm_layers", self.minilm_layers, minimum=0)
        check_int("ablation_words", self.ablation_words, minimum=0)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")
        if self.char_d_model % self.char_heads:
            raise ValueError(
                f"char_heads={self.char_heads} must divide char_d_model={self.char_d_model}"
            )
        for name in ("char_lr", "minilm_lr"):
            check_number(name, getattr(self, name), positive=True)
        check_bool("minilm", self.minilm)


# ------------------------------------------------------------------------------ batches
def length_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches of indices, each of similar lengths, in a random order.

    The indices are shuffled by ``rng``, stably sorted by length, cut into batches of
    ``batch_size`` (the last may be smaller), and the batches are shuffled by ``rng``.
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def _pad_states(states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``(T_i, E)`` tensors → ``(B, T, E)`` right-padded with zeros and the bool mask."""
    T = max(s.shape[0] for s in states)
    x = torch.nn.utils.rnn.pad_sequence(list(states), batch_first=True)  # (B, T, E)
    lengths = torch.tensor([s.shape[0] for s in states], device=x.device)
    return x, torch.arange(T, device=x.device) < lengths[:, None]


@dataclass
class Encoded:
    """Words run through a classifier's frozen layers once, in batches of similar lengths.

    Attributes:
        batches: ``(indices, ids (B, T), mask (B, T), states)`` per batch; ``states[l]`` is the
            input of encoder layer ``layer + l`` (computed for ``layer`` … ``upto``).
        layer: the first layer whose input is held.
        labels: the label of every word (by index).
    """

    batches: list[tuple[list[int], Tensor, Tensor, list[Tensor]]]
    layer: int
    labels: Tensor


@torch.no_grad()
def encode_words(
    model: TextClassifier,
    words: Sequence[str],
    labels: Sequence[int],
    *,
    layer: int,
    upto: int | None = None,
    batch_size: int = 256,
) -> Encoded:
    """Runs ``words`` through layers ``0 … layer − 1`` of the model (in eval mode) and keeps the
    inputs of layers ``layer … upto`` (default ``layer`` only), batched by length."""
    upto = layer if upto is None else upto
    was = model.training
    model.eval()
    seqs = model.tokenize(words)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = model.pad([seqs[i] for i in idx])
        x = model.features(ids, mask, layer)
        states = [x]
        for block in model.encoder.blocks[layer:upto]:
            x = block(x, mask=mask[:, None, None, :])
            states.append(x)
        batches.append((idx, ids, mask, states))
    model.train(was)
    device = model.head.classifier.weight.device
    return Encoded(batches, layer, torch.tensor(list(labels), device=device))


@torch.no_grad()
def evaluate(model: TextClassifier, data: Encoded, *, at: int | None = None) -> dict[str, Any]:
    """Accuracy, mean cross-entropy and predictions (by word index) from cached states.

    Args:
        model: the classifier (used as it is: put it in eval mode first).
        data: `encode_words` output.
        at: the layer whose cached input to start from (default ``data.layer``).
    """
    at = data.layer if at is None else at
    k = at - data.layer
    n = data.labels.numel()
    preds = torch.empty(n, dtype=torch.long, device=data.labels.device)
    loss = torch.zeros((), dtype=torch.float64, device=data.labels.device)
    for idx, ids, mask, states in data.batches:
        x = model.features(ids, mask, 0) if at == 0 else states[k]  # layer 0: embed anew
        logits = model.forward_from(x, mask, at)
        i = torch.tensor(idx, device=logits.device)
        preds[i] = logits.argmax(-1)
        loss += F.cross_entropy(logits.float(), data.labels[i], reduction="sum").double()
    correct = int((preds == data.labels).sum())
    return {"accuracy": correct / n, "loss": float(loss) / n, "predictions": preds.tolist()}


# ------------------------------------------------------------------------------ training
def train_classifier(
    model: TextClassifier,
    split: LanguageSplit,
    *,
    layer: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    time_budget: float | None = None,
    desc: str = "classify",
    progress: bool = False,
    log: Callable[[str], None] = print,
    test: Encoded | None = None,
) -> FitHistory:
    """Trains the layers ``layer …`` and the head of ``model`` on the training words.

    Layers below ``layer`` are frozen (``requires_grad=False``) and run once per word
    (`encode_words`); each step draws the next `length_batches` batch (``random.Random(seed)``)
    and minimises the cross-entropy of `TextClassifier.forward_from`. `attnlab.apps.loop.fit`
    runs the optimisation (AdamW, 5 % warmup + cosine to lr/10, clipping at 1).

    Returns:
        The `FitHistory` (with the held-out accuracy at the end when ``test`` is given).
    """
    model.encoder.requires_grad_(layer == 0)
    for block in model.encoder.blocks[layer:]:
        block.requires_grad_(True)
    model.encoder.norm_f.requires_grad_(True)
    seqs = model.tokenize(split.train_words)
    lengths = [len(q) for q in seqs]
    labels = torch.tensor(split.train_labels, device=model.head.classifier.weight.device)
    states: list[Tensor] = []
    if layer > 0:  # the frozen layers run once per word
        train = encode_words(model, split.train_words, split.train_labels, layer=layer)
        states = [labels.new_empty(0)] * len(seqs)
        for idx, _ids, _mask, st in train.batches:
            for j, i in enumerate(idx):
                states[i] = st[0][j, : lengths[i]]  # (T_i, E)
    rng = random.Random(seed)
    queue: list[list[int]] = []

    def loss_at(_step: int) -> Tensor:
        if not queue:
            queue.extend(length_batches(lengths, batch_size, rng))
        idx = queue.pop()
        if layer == 0:
            ids, mask = model.pad([seqs[i] for i in idx])
            logits = model(ids, mask)
        else:
            x, mask = _pad_states([states[i] for i in idx])
            logits = model.forward_from(x, mask, layer)
        return F.cross_entropy(logits, labels[torch.tensor(idx, device=labels.device)])

    def held_out() -> dict[str, float]:
        assert test is not None
        return {"accuracy": evaluate(model, test)["accuracy"]}

    s = FitSettings(
        steps=steps,
        lr=lr,
        min_lr=lr / 10,
        warmup=max(1, steps // 20),
        weight_decay=0.01,
        grad_clip=1.0,
        seed=seed,
        time_budget=time_budget,
    )
    return fit(
        model,
        loss_at,
        s,
        evaluate=held_out if test is not None else None,
        desc=desc,
        progress=progress,
        log=log,
    )


# ------------------------------------------------------------------------------ heads
@dataclass
class HeadAblation:
    """Held-out accuracy and loss with each encoder head removed in turn.

    Attributes:
        accuracy, loss: ``(layers, heads)`` with head (l, h) gated to zero.
        base_accuracy, base_loss: with every head.
        words: how many held-out words were scored.
    """

    accuracy: Tensor
    loss: Tensor
    base_accuracy: float
    base_loss: float
    words: int

    @property
    def drop(self) -> Tensor:
        """``(layers, heads)`` accuracy drop ``base − accuracy`` (positive: the head helps)."""
        return self.base_accuracy - self.accuracy

    def top(self, k: int = 5) -> list[dict[str, float]]:
        """The ``k`` heads whose removal costs the most accuracy (ties: the larger loss)."""
        L, H = self.accuracy.shape
        flat = [
            (float(self.drop[l, h]), float(self.loss[l, h]) - self.base_loss, l, h)
            for l in range(L)
            for h in range(H)
        ]
        flat.sort(key=lambda t: (-t[0], -t[1], t[2], t[3]))
        return [
            {"layer": l, "head": h, "accuracy_drop": d, "loss_increase": dl}
            for d, dl, l, h in flat[:k]
        ]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        return {
            "words": self.words,
            "base_accuracy": self.base_accuracy,
            "base_loss": self.base_loss,
            "accuracy_drop": self.drop.tolist(),
            "loss_increase": (self.loss - self.base_loss).tolist(),
            "top": self.top(),
        }


@torch.no_grad()
def head_ablation(
    model: TextClassifier,
    words: Sequence[str],
    labels: Sequence[int],
    *,
    batch_size: int = 256,
    progress: bool = False,
) -> HeadAblation:
    """Accuracy and loss of ``model`` on ``words`` with each encoder head removed in turn.

    Head (l, h) is removed by a zero gate on its output (`head_gates`); the inputs of every
    layer are computed once with all heads, and the ablation of a head of layer l runs layers
    l … N − 1 from its cached input. The model is put in eval mode and restored.
    """
    from ..utils.progress import Progress

    was = model.training
    model.eval()
    try:
        L = model.n_layers
        data = encode_words(model, words, labels, layer=0, upto=L, batch_size=batch_size)
        base = evaluate(model, data, at=L)
        shapes = [m.num_heads for _, m in attention_modules(model.encoder)]
        H = max(shapes)
        acc = torch.full((L, H), math.nan, dtype=torch.float64)
        loss = torch.full((L, H), math.nan, dtype=torch.float64)
        device = model.head.classifier.weight.device
        bar = Progress(desc="head ablation", total=sum(shapes), unit="head", enabled=progress)
        for layer, n in enumerate(shapes):
            for head in range(n):
                gates = [torch.ones(h, device=device) for h in shapes]
                gates[layer][head] = 0.0
                with head_gates(model.encoder, gates):
                    r = evaluate(model, data, at=layer)
                acc[layer, head], loss[layer, head] = r["accuracy"], r["loss"]
                bar.step()
        bar.close()
    finally:
        model.train(was)
    return HeadAblation(acc, loss, base["accuracy"], base["loss"], len(words))


def ablation_subset(split: LanguageSplit, n: int) -> tuple[list[str], list[int]]:
    """The first ``n // languages`` held-out words of each language (all of them if fewer)."""
    per = max(1, n // len(split.labels))
    words, labels = [], []
    for label in range(len(split.labels)):
        ws = [w for w, y in zip(split.test_words, split.test_labels, strict=True) if y == label]
        words += ws[:per]
        labels += [label] * len(ws[:per])
    return words, labels


# ------------------------------------------------------------------------------ baseline
def ngram_baseline(split: LanguageSplit, seed: int = 0) -> dict[str, Any]:
    """Character n-grams + logistic regression (scikit-learn), fitted on the training words.

    ``TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), sublinear_tf=True)`` then
    ``LogisticRegression(C=10, solver="saga", tol=1e-4)`` (saga: the default lbfgs took 10×
    longer on these 40,000 sparse features for the same accuracy).

    Returns:
        ``{"accuracy", "predictions" (test order), "seconds", "features"}``.
    """
    from ..utils.extras import require

    fe = require("sklearn.feature_extraction.text", "apps", "the n-gram baseline")
    lm = require("sklearn.linear_model", "apps", "the n-gram baseline")
    t0 = time.perf_counter()
    vec = fe.TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), sublinear_tf=True)
    x_train = vec.fit_transform(split.train_words)
    clf = lm.LogisticRegression(C=10.0, solver="saga", max_iter=1000, tol=1e-4, random_state=seed)
    clf.fit(x_train, list(split.train_labels))
    preds = [int(p) for p in clf.predict(vec.transform(split.test_words))]
    correct = sum(p == y for p, y in zip(preds, split.test_labels, strict=True))
    return {
        "accuracy": correct / len(preds),
        "predictions": preds,
        "seconds": time.perf_counter() - t0,
        "features": int(x_train.shape[1]),
    }


def confusion(labels: Sequence[int], preds: Sequence[int], n: int) -> Tensor:
    """``(n, n)`` int64 counts: row = true label, column = predicted label."""
    m = torch.zeros(n, n, dtype=torch.long)
    for y, p in zip(labels, preds, strict=True):
        m[y, p] += 1
    return m


# ------------------------------------------------------------------------------ models
def train_char(
    split: LanguageSplit,
    s: ClassifySettings,
    *,
    test: bool = True,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
) -> tuple[TextClassifier, FitHistory]:
    """The character-level classifier, trained from scratch on the training words.

    Its characters are those of the training words (sorted; others map to UNK).
    """
    chars = "".join(sorted({c for w in split.train_words for c in w}))
    torch.manual_seed(s.seed)
    model = char_classifier(
        chars,
        split.labels,
        d_model=s.char_d_model,
        n_layers=s.char_layers,
        n_heads=s.char_heads,
        max_len=s.char_max_len,
        dropout=s.char_dropout,
        pooling=s.pooling,
        pool_heads=s.char_heads,
    ).to(device)
    held = None
    if test:
        held = encode_words(model, split.test_words, split.test_labels, layer=0)
    hist = train_classifier(
        model,
        split,
        layer=0,
        steps=s.char_steps,
        batch_size=s.char_batch,
        lr=s.char_lr,
        seed=s.seed,
        time_budget=s.time_budget,
        desc="char",
        progress=progress,
        log=log,
        test=held,
    )
    return model.eval(), hist


def train_minilm(
    split: LanguageSplit,
    s: ClassifySettings,
    *,
    minilm: Any = None,
    test: bool = True,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
) -> tuple[TextClassifier, FitHistory]:
    """A head (and the top ``s.minilm_layers`` layers) on the pretrained all-MiniLM-L6-v2.

    Args:
        minilm: a loaded `attnlab.models.MiniLM` (default ``attnlab.models.minilm()``).
    """
    from ..models.classifier import from_minilm
    from ..models.minilm import minilm as load_minilm

    base = load_minilm() if minilm is None else minilm
    torch.manual_seed(s.seed)
    model = from_minilm(base.to(device), split.labels, pooling=s.pooling, pool_heads=4)
    L = model.n_layers
    if s.minilm_layers > L:
        raise ValueError(
            f"minilm_layers must be <= {L} (the encoder's layers), got {s.minilm_layers}"
        )
    layer = L - s.minilm_layers
    model.config.trained = (
        "the head only" if layer == L else f"the head + the top {s.minilm_layers} of {L} layers"
    )
    model.encoder.drop.p = 0.0
    held = None
    if test:
        held = encode_words(model, split.test_words, split.test_labels, layer=layer)
    hist = train_classifier(
        model,
        split,
        layer=layer,
        steps=s.minilm_steps,
        batch_size=s.minilm_batch,
        lr=s.minilm_lr,
        seed=s.seed,
        time_budget=s.time_budget,
        desc="minilm",
        progress=progress,
        log=log,
        test=held,
    )
    return model.eval(), hist


# ------------------------------------------------------------------------------ files
def save(path: str | os.PathLike, model: TextClassifier) -> Path:
    """Writes ``model`` as a verified checkpoint of kind "classify" (config in the metadata)."""
    return save_model(path, model, kind=KIND, config=model.config.to_dict())


def load(
    path: str | os.PathLike, device: torch.device | str = "cpu"
) -> tuple[TextClassifier, Checkpoint]:
    """A classifier written by `save`, verified (its config must fit its tensors).

    Returns:
        ``(model in eval mode, checkpoint)``.
    """
    model, _, ck = load_model(
        path,
        KIND,
        build_classifier,
        rules=RULES,
        device=device,
    )
    return model, ck  # type: ignore[return-value]


#: How the tensors of a "classify" checkpoint justify its stored `ClassifierConfig`
#: (`attnlab._fit.justify_config`): the encoder's `TransformerConfig` like a GPT's, and
#: the head's integer fields (its class count is the classifier's rows, which the build on
#: ``meta`` compares).
RULES = (
    *checkpoint_rules("encoder.", "encoder."),
    ConfigRule("max_len", low=2),
    ConfigRule("pool_heads", low=1),
)


# ------------------------------------------------------------------------------ the run
@dataclass
class ClassifyResult:
    """What `run` measured (``metrics`` is what OUT/metrics.json holds, without the machine)."""

    metrics: dict[str, Any]
    files: list[Path] = field(default_factory=list)


def run(
    s: ClassifySettings,
    out_dir: str | os.PathLike,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
    minilm: Any = None,
) -> ClassifyResult:
    """The whole experiment: data, baseline, char model, MiniLM model, head ablation, files.

    Writes ``OUT/metrics.json``, ``OUT/char.safetensors`` (and ``OUT/minilm.safetensors``),
    ``OUT/confusion.png`` and ``OUT/heads.png`` (when a head ablation ran).
    """
    from ..viz.classify import plot_confusions, plot_head_ablation

    out = Path(os.fspath(out_dir))
    t_start = time.perf_counter()
    split = language_split(
        s.languages, n_words=s.n_words, test_fraction=s.test_fraction, seed=s.seed
    )
    seconds: dict[str, float] = {"data": time.perf_counter() - t_start}
    log(
        f"data: {len(split.labels)} languages, {len(split.train_words)} training and "
        f"{len(split.test_words)} held-out words ({split.dropped_shared} shared words dropped)"
    )
    C = len(split.labels)
    results: dict[str, dict[str, Any]] = {}
    preds: dict[str, list[int]] = {}

    base = ngram_baseline(split, s.seed)
    seconds["ngram"] = base["seconds"]
    preds["ngram"] = base["predictions"]
    results["ngram"] = {
        "accuracy": base["accuracy"],
        "model": "TfidfVectorizer(char_wb, 1-4) + LogisticRegression(C=10, saga)",
        "features": base["features"],
    }
    log(f"ngram baseline: held-out accuracy {base['accuracy']:.4f} ({base['seconds']:.1f} s)")

    models: dict[str, TextClassifier] = {}
    hists: dict[str, FitHistory] = {}
    t0 = time.perf_counter()
    models["char"], hists["char"] = train_char(split, s, progress=progress, log=log, device=device)
    seconds["char"] = time.perf_counter() - t0
    if s.minilm:
        t0 = time.perf_counter()
        models["minilm"], hists["minilm"] = train_minilm(
            split, s, minilm=minilm, progress=progress, log=log, device=device
        )
        seconds["minilm"] = time.perf_counter() - t0
    for name, model in models.items():
        r = evaluate(model, encode_words(model, split.test_words, split.test_labels, layer=0))
        preds[name] = r["predictions"]
        h = hists[name]
        results[name] = {
            "accuracy": r["accuracy"],
            "loss": r["loss"],
            "trained": model.config.trained,
            "pooling": model.config.pooling,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained_parameters": _trained_parameters(model, name, s),
            "steps": h.steps,
            "train_seconds": h.seconds,
            "stopped_by": h.stopped_by,
            "final_train_loss": sum(h.train_loss[-20:]) / len(h.train_loss[-20:]),
        }
        log(f"{name}: held-out accuracy {r['accuracy']:.4f} ({h.steps} steps, {h.seconds:.0f} s)")

    ablations: dict[str, HeadAblation] = {}
    if s.ablation_words:
        words, labels = ablation_subset(split, s.ablation_words)
        for name, model in models.items():
            t0 = time.perf_counter()
            ablations[name] = head_ablation(model, words, labels, progress=progress)
            seconds[f"ablation_{name}"] = time.perf_counter() - t0
            top = ablations[name].top(3)
            log(
                f"{name} heads: removing "
                + ", ".join(
                    f"L{t['layer']}H{t['head']} costs {100 * t['accuracy_drop']:.1f} pts"
                    for t in top
                )
            )

    files = []
    for name, model in models.items():
        files.append(save(out / f"{name}.safetensors", model))
    confusions = {name: confusion(split.test_labels, p, C) for name, p in preds.items()}
    files.append(
        plot_confusions(
            out / "confusion.png",
            confusions,
            split.labels,
            {k: v["accuracy"] for k, v in results.items()},
        )
    )
    if ablations:
        files.append(plot_head_ablation(out / "heads.png", ablations))
    seconds["total"] = time.perf_counter() - t_start
    metrics = {
        "task": "classify",
        "metric": "held-out accuracy (language of a single word)",
        "accuracy": {k: v["accuracy"] for k, v in results.items()},
        "chance": max(n for _, n in split.counts().values()) / len(split.test_words),
        "languages": list(split.labels),
        "data": {
            "source": "wordfreq.top_n_list",
            "n_words": split.n_words,
            "train_words": len(split.train_words),
            "test_words": len(split.test_words),
            "dropped_shared": split.dropped_shared,
            "per_language": split.counts(),
            "seed": split.seed,
        },
        "models": results,
        "confusion": {k: v.tolist() for k, v in confusions.items()},
        "head_ablation": {k: v.as_dict() for k, v in ablations.items()},
        "settings": asdict(s),
        "seconds": seconds,
    }
    files.insert(0, write_metrics(out, metrics))
    return ClassifyResult(metrics, files)


def _trained_parameters(model: TextClassifier, name: str, s: ClassifySettings) -> int:
    if name == "char":
        return sum(p.numel() for p in model.parameters())
    L = model.n_layers
    layers = model.encoder.blocks[L - s.minilm_layers :]
    return sum(p.numel() for p in layers.parameters()) + sum(
        p.numel() for p in model.head.parameters()
    )


__all__ = [
    "KIND",
    "ClassifyResult",
    "ClassifySettings",
    "Encoded",
    "HeadAblation",
    "ablation_subset",
    "confusion",
    "encode_words",
    "evaluate",
    "head_ablation",
    "length_batches",
    "load",
    "ngram_baseline",
    "run",
    "save",
    "train_char",
    "train_classifier",
    "train_minilm",
]
