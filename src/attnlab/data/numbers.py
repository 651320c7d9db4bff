"""Number words as a translation task: English -> German / French, in number pieces on both sides.

Every sentence is produced by `num2words` (nothing hand-written): the source is the English words
of a number preceded by a target-language token, the target the same number in German or French::

    <de> twenty-three          ->  dreiundzwanzig        (units before tens: a reordering)
    <fr> seventy-one           ->  soixante et onze
    <de> one million, two ...  ->  eine Million zwei...

Numbers are drawn with a uniform number of digits (1 … ``max_digits``) and then uniformly among the
numbers with that many digits, so every magnitude is equally represented. A fixed, seeded set of
held-out numbers (>= 1,000, i.e. 4 … ``max_digits`` digits) is excluded from training in both
languages; the 1,000 numbers below 1,000 are the building blocks and all stay in training.

The vocabulary is one table shared by both sides: the special tokens, one token per target
language, then every character num2words writes for the numbers 0 … 999 and the powers of a
thousand up to ``10**(max_digits - 1)`` in the three languages, and the `number_pieces` (the
words of 0 … 99 and of the powers, ``dreiundzwanzig``, ``hundert``, ``Millionen``), sorted; text
is encoded by the longest matching token at each position. Everything is derived from the
library's output, not from a hand-made list. Pieces make the sequences 3-4× shorter than
characters (German 43 characters -> 6 tokens on average); ``vocabulary(pieces=True)`` /
``NumberTask(pieces=True)`` use them, the default is the character table (it trained better in
the measured 9-minute budget, see docs/results).

Example:
    >>> task = NumberTask(seed=0)
    >>> vocab = task.vocab
    >>> src, tgt = task.pair(23, "de")           # ("twenty-three", "dreiundzwanzig")
    >>> ids = vocab.encode_source(src, "de")     # [<de>, t, w, …, <eos>]
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from .._shapes import check_int, check_number

#: The source language.
SOURCE_LANG = "en"
#: Target languages, each selected by its token ``<de>`` / ``<fr>`` at the start of the source.
TARGET_LANGS = ("de", "fr")
#: Special tokens (ids 0, 1, 2).
PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")


@lru_cache(maxsize=1 << 18)
def _words(n: int, lang: str) -> str:
    from num2words import num2words

    return num2words(n, lang=lang)


def words(n: int, lang: str) -> str:
    """The words of ``n`` in ``lang`` ("en", "de", "fr") as num2words writes them."""
    check_int("n", n, minimum=0)
    if lang not in (SOURCE_LANG, *TARGET_LANGS):
        raise ValueError(f"lang must be one of {[SOURCE_LANG, *TARGET_LANGS]}, got {lang!r}")
    return _words(n, lang)


@dataclass(frozen=True)
class Vocab:
    """A vocabulary of characters and multi-character pieces shared by source and target.

    Attributes:
        tokens: id -> token: the specials, the language tokens ``<de>``, ``<fr>``, then
            characters and pieces (`encode` takes the longest match at each position).
        longest: the length of the longest token (1 = a character vocabulary).
    """

    tokens: tuple[str, ...]
    index: dict[str, int] = field(init=False, repr=False, compare=False)
    longest: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if tuple(self.tokens[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"tokens must start with {SPECIALS}, got {self.tokens[:3]!r}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("tokens must be distinct")
        object.__setattr__(self, "index", {t: i for i, t in enumerate(self.tokens)})
        longest = max((len(t) for t in self.tokens[len(SPECIALS) :] if not _is_tag(t)), default=1)
        object.__setattr__(self, "longest", longest)

    @classmethod
    def from_characters(cls, chars: Iterable[str], langs: Sequence[str] = TARGET_LANGS) -> Vocab:
        """Specials, ``<lang>`` tokens, then the sorted distinct characters."""
        return cls((*SPECIALS, *(f"<{lang}>" for lang in langs), *sorted(set(chars))))

    def __len__(self) -> int:
        return len(self.tokens)

    def lang_id(self, lang: str) -> int:
        """The id of the target-language token ``<lang>``."""
        token = f"<{lang}>"
        if token not in self.index:
            langs = [t[1:-1] for t in self.tokens if t.startswith("<") and t not in SPECIALS]
            raise ValueError(f"lang must be one of {langs}, got {lang!r}")
        return self.index[token]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: at each position the longest token that matches (a character
        vocabulary gives one id per character; ValueError naming the first unknown character)."""
        index = self.index
        if self.longest == 1:
            try:
                return [index[c] for c in text]
            except KeyError as e:
                raise ValueError(
                    f"text {text!r} has the character {e.args[0]!r}, which is not in the vocabulary"
                ) from None
        out: list[int] = []
        i, n = 0, len(text)
        while i < n:
            for j in range(min(n, i + self.longest), i, -1):
                t = index.get(text[i:j])
                if t is not None and (j > i + 1 or not _is_tag(text[i:j])):
                    out.append(t)
                    i = j
                    break
            else:
                raise ValueError(
                    f"text {text!r} has the character {text[i]!r}, which is not in the vocabulary"
                )
        return out

    def encode_source(self, text: str, lang: str) -> list[int]:
        """``[<lang>, chars…, <eos>]``."""
        return [self.lang_id(lang), *self.encode(text), EOS]

    def encode_target(self, text: str) -> list[int]:
        """``[chars…, <eos>]`` (the decoder input is ``[<bos>, chars…]``)."""
        return [*self.encode(text), EOS]

    def decode(self, ids: Iterable[int]) -> str:
        """Characters up to the first ``<eos>``; padding and other specials are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= len(SPECIALS) and 0 <= i < len(self.tokens):
                tok = self.tokens[i]
                if not (tok.startswith("<") and len(tok) > 1):
                    out.append(tok)
        return "".join(out)


def _is_tag(token: str) -> bool:
    return token.startswith("<") and len(token) > 1


def number_pieces(max_digits: int = 9, langs: Sequence[str] = TARGET_LANGS) -> set[str]:
    """Multi-character tokens derived from num2words: the words of 0 … 99 as whole strings
    (``twenty-three``, ``dreiundzwanzig``, ``quatre-vingt-dix-neuf``) and the words of the
    powers 10**2, 10**3, 10**6, 10**9 below ``10**max_digits`` (times 1 … 9, split at spaces
    and commas; a part that starts with the multiplier's own word keeps its remainder:
    ``zweihundert`` -> ``hundert``) and the new words of 10**p + 1 (English ``and``), in
    English and the ``langs``."""
    pieces: set[str] = set()
    powers = [p for p in (2, 3, 6, 9, 12) if p < max_digits]
    for lang in (SOURCE_LANG, *langs):
        pieces.update(words(n, lang) for n in range(min(100, 10**max_digits)))
        for p in powers:
            for k in range(1, 10):
                head = words(k, lang)
                for part in words(k * 10**p, lang).replace(",", " ").split():
                    if part.startswith(head) and len(part) > len(head):
                        part = part[len(head) :]
                    pieces.add(part)
            for part in words(10**p + 1, lang).replace(",", " ").split():
                if not any(part.startswith(t) for t in pieces if len(t) > 1):
                    pieces.add(part)  # a joining word: English "and"
    return {t for t in pieces if len(t) > 1}


def vocabulary(
    max_digits: int = 9, langs: Sequence[str] = TARGET_LANGS, *, pieces: bool = False
) -> Vocab:
    """The characters num2words writes for 0 … 999 and for multiples of the powers of 1,000
    below ``10**max_digits`` (a few multipliers and remainders), in English and the ``langs``;
    with ``pieces`` also the `number_pieces` (3-4× shorter sequences than characters)."""
    numbers = list(range(1000))
    for p in range(3, max_digits, 3):
        numbers += [m * 10**p + r for m in (1, 2, 21, 101, 180) for r in (0, 1, 100, 121, 180)]
    chars: set[str] = set()
    for lang in (SOURCE_LANG, *langs):
        for n in numbers:
            chars.update(words(n, lang))
    if pieces:
        chars |= number_pieces(max_digits, langs)
    return Vocab.from_characters(chars, langs)


def sample_number(rng: random.Random, max_digits: int, min_digits: int = 1) -> int:
    """A number with a uniform digit count in [min_digits, max_digits], then uniform."""
    d = rng.randint(min_digits, max_digits)
    low = 0 if d == 1 else 10 ** (d - 1)
    return rng.randint(low, 10**d - 1)


class NumberTask:
    """The number-translation task: a vocabulary, held-out numbers and seeded training batches.

    Args:
        max_digits: numbers go from 0 to ``10**max_digits − 1`` (default 9: up to 999,999,999).
        held_out: how many distinct held-out numbers (>= 1,000; every one is evaluated in every
            target language and never appears in training).
        langs: the target languages.
        seed: fixes the held-out numbers (the training draws take their own seed).
        pieces: a vocabulary with the `number_pieces` (default: characters only).

    Attributes:
        vocab: the shared `Vocab`. held_out_numbers: the sorted held-out numbers.
    """

    def __init__(
        self,
        *,
        max_digits: int = 9,
        held_out: int = 2000,
        langs: Sequence[str] = TARGET_LANGS,
        seed: int = 0,
        pieces: bool = False,
    ) -> None:
        self.max_digits = check_int("max_digits", max_digits, minimum=1, maximum=12)
        langs = tuple(langs)
        if (
            not langs
            or any(lang not in TARGET_LANGS for lang in langs)
            or len(set(langs)) != len(langs)
        ):
            raise ValueError(f"langs must be distinct names from {TARGET_LANGS}, got {langs!r}")
        self.langs = langs
        self.seed = check_int("seed", seed, minimum=0)
        low = 1000 if max_digits >= 4 else 0
        room = 10**max_digits - low
        self.held_out_size = check_int("held_out", held_out, minimum=1, maximum=room // 2)
        self.vocab = vocabulary(max_digits, langs, pieces=pieces)
        rng = random.Random(f"numbers-held-out-{seed}")
        held: set[int] = set()
        min_digits = 4 if max_digits >= 4 else 1
        while len(held) < held_out:
            held.add(sample_number(rng, max_digits, min_digits))
        self.held_out_numbers = sorted(held)
        self._held = held

    def pair(self, n: int, lang: str) -> tuple[str, str]:
        """``(English words, words in lang)`` of ``n``."""
        if lang not in self.langs:
            raise ValueError(f"lang must be one of {list(self.langs)}, got {lang!r}")
        return words(n, SOURCE_LANG), words(n, lang)

    def is_held_out(self, n: int) -> bool:
        return n in self._held

    def training_numbers(self, count: int, seed: int) -> list[int]:
        """``count`` training numbers (repeats allowed, held-out numbers never), seeded."""
        rng = random.Random(f"numbers-train-{self.seed}-{seed}")
        out: list[int] = []
        while len(out) < count:
            n = sample_number(rng, self.max_digits)
            if n not in self._held:
                out.append(n)
        return out

    def examples(self, numbers: Iterable[int], langs: Iterable[str]) -> list[Example]:
        """Encoded examples of ``numbers`` paired with ``langs`` (zip)."""
        v = self.vocab
        out = []
        for n, lang in zip(numbers, langs, strict=True):
            en, tgt = self.pair(n, lang)
            out.append(Example(n, lang, v.encode_source(en, lang), v.encode_target(tgt)))
        return out

    def training_examples(
        self, count: int, seed: int, weights: Mapping[str, float] | None = None
    ) -> list[Example]:
        """``count`` seeded training examples; each one's target language is a seeded draw.

        Args:
            count: examples. seed: the training seed.
            weights: relative frequency per target language (missing ones: 1.0; None: uniform),
                e.g. ``{"fr": 2.0}`` draws French twice as often as German.
        """
        w = self.language_weights(weights)
        rng = random.Random(f"numbers-langs-{self.seed}-{seed}")
        numbers = self.training_numbers(count, seed)
        return self.examples(numbers, rng.choices(self.langs, weights=w, k=len(numbers)))

    def language_weights(self, weights: Mapping[str, float] | None) -> list[float]:
        """``weights`` checked and listed in the order of `langs` (missing languages: 1.0)."""
        if weights is None:
            return [1.0] * len(self.langs)
        unknown = sorted(set(weights) - set(self.langs))
        if unknown:
            raise ValueError(f"weights names languages {unknown} outside langs {list(self.langs)}")
        out = []
        for lang in self.langs:
            x = weights.get(lang, 1.0)
            out.append(check_number(f"weights[{lang!r}]", x, positive=True))
        return out

    def held_out_examples(self, lang: str) -> list[Example]:
        """Every held-out number in ``lang``."""
        return self.examples(self.held_out_numbers, [lang] * len(self.held_out_numbers))


@dataclass(frozen=True)
class Example:
    """One pair: the number, the target language, source ids and target ids (both end in EOS)."""

    number: int
    lang: str
    src: list[int]
    tgt: list[int]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate(
    examples: Sequence[Example], multiple: int = 1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pads a batch: ``src (B, S)``, ``src_mask (B, S)`` (True = real), ``tgt_in (B, T)`` =
    ``[BOS, chars…]`` and ``tgt_out (B, T)`` = ``[chars…, EOS]`` (PAD after the end).

    ``multiple``: S and T are rounded up to a multiple of it. Training pads to few distinct
    shapes because the CPU kernels (oneDNN's primitive cache) are much slower when almost every
    batch has a new shape (`docs/results`, translation)."""
    B = len(examples)
    S = _round_up(max(len(e.src) for e in examples), multiple)
    T = _round_up(max(len(e.tgt) for e in examples), multiple)
    src = torch.full((B, S), PAD, dtype=torch.long)
    tgt_in = torch.full((B, T), PAD, dtype=torch.long)
    tgt_out = torch.full((B, T), PAD, dtype=torch.long)
    for i, e in enumerate(examples):
        src[i, : len(e.src)] = torch.tensor(e.src)
        tgt_out[i, : len(e.tgt)] = torch.tensor(e.tgt)
        tgt_in[i, 0] = BOS
        tgt_in[i, 1 : len(e.tgt)] = torch.tensor(e.tgt[:-1])
    return src, src != PAD, tgt_in, tgt_out


def length_batches(
    examples: Sequence[Example], tokens: int, rng: random.Random, multiple: int = 1
) -> list[list[Example]]:
    """Buckets by length: sorted by source + target length, cut into batches of about
    ``tokens`` padded tokens each (lengths rounded up to ``multiple`` as `collate` pads them),
    returned in a seeded random order."""
    order = sorted(examples, key=lambda e: (len(e.src) + len(e.tgt), rng.random()))
    batches: list[list[Example]] = []
    cur: list[Example] = []
    S = T = 0  # the batch's longest source and target, as `collate` pads them
    for e in order:
        s, t = _round_up(len(e.src), multiple), _round_up(len(e.tgt), multiple)
        if cur and (len(cur) + 1) * (max(S, s) + max(T, t)) > tokens:
            batches.append(cur)
            cur, S, T = [], 0, 0
        cur.append(e)
        S, T = max(S, s), max(T, t)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def reorders(n: int) -> bool:
    """True when German writes ``n``'s last two digits units before tens (units != 0, tens >= 2)."""
    return n % 10 != 0 and (n // 10) % 10 >= 2


__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SOURCE_LANG",
    "SPECIALS",
    "TARGET_LANGS",
    "Example",
    "NumberTask",
    "Vocab",
    "collate",
    "length_batches",
    "number_pieces",
    "reorders",
    "sample_number",
    "vocabulary",
    "words",
]
