"""Language identification of single words, from the word lists that ``wordfreq`` ships.

The labelled set is real data that a package installs (nothing is downloaded): for each language
``wordfreq.top_n_list(lang, n_words)`` gives its ``n_words`` most frequent words (lower-case,
from the package's "best" wordlist). Words that are not purely alphabetic (``str.isalpha``:
digits, apostrophes, hyphens) are dropped, and so is **every word listed by more than one of the
chosen languages** ("de", "in", "is", "hotel", …), so no word appears under two labels and the
label of a word is a property of the word. The split is **by word** and stratified: each
language's words are sorted, shuffled by ``random.Random(seed)`` (one generator, languages in the
given order) and the first ``round(test_fraction · n)`` (at least 1) go to the test set, so the
train and test sets never share a word and every language keeps its share in both.

Example:
    >>> split = language_split(("de", "en", "fr"), n_words=500)
    >>> split.labels, len(split.train_words), split.train_words[0], split.train_labels[0]
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .._shapes import check_int, check_number
from ..utils.extras import require

#: The default languages: ten Latin-script languages that wordfreq ships large lists for.
LANGUAGES = ("de", "en", "es", "fr", "it", "nl", "pl", "pt", "sv", "tr")

#: English names of the languages above (for plots and tables).
LANGUAGE_NAMES = {
    "ca": "Catalan",
    "cs": "Czech",
    "da": "Danish",
    "de": "German",
    "en": "English",
    "es": "Spanish",
    "fi": "Finnish",
    "fr": "French",
    "hu": "Hungarian",
    "id": "Indonesian",
    "it": "Italian",
    "lv": "Latvian",
    "ms": "Malay",
    "nb": "Norwegian",
    "nl": "Dutch",
    "pl": "Polish",
    "pt": "Portuguese",
    "ro": "Romanian",
    "sk": "Slovak",
    "sl": "Slovenian",
    "sv": "Swedish",
    "tr": "Turkish",
    "vi": "Vietnamese",
}


@dataclass(frozen=True)
class LanguageSplit:
    """Words with language labels, split by word into a train and a test set.

    Attributes:
        labels: the language codes; label ``i`` is ``labels[i]``.
        train_words, train_labels: the training words and their label indices.
        test_words, test_labels: the held-out words (none of them is a training word).
        n_words: how many words of each list were read (before filtering).
        test_fraction: the share of each language's words held out.
        seed: the seed of the split.
        dropped_shared: how many distinct words were dropped for being listed by more than one
            language.
    """

    labels: tuple[str, ...]
    train_words: tuple[str, ...]
    train_labels: tuple[int, ...]
    test_words: tuple[str, ...]
    test_labels: tuple[int, ...]
    n_words: int
    test_fraction: float
    seed: int
    dropped_shared: int

    def counts(self) -> dict[str, tuple[int, int]]:
        """``{language: (train words, test words)}``."""
        train, test = Counter(self.train_labels), Counter(self.test_labels)
        return {lang: (train[i], test[i]) for i, lang in enumerate(self.labels)}


def _check_languages(languages: object) -> tuple[str, ...]:
    if isinstance(languages, str) or not isinstance(languages, Sequence):
        raise TypeError(
            f"languages must be a sequence of language codes, got {type(languages).__name__}"
        )
    langs = tuple(languages)
    if not all(isinstance(x, str) for x in langs):
        raise TypeError(f"languages must be strings, got {langs!r}")
    if len(langs) < 2:
        raise ValueError(f"languages must name at least 2 languages, got {list(langs)}")
    repeated = sorted({x for x in langs if langs.count(x) > 1})
    if repeated:
        raise ValueError(f"languages must be distinct, got {repeated} more than once")
    unknown = [x for x in langs if x not in LANGUAGE_NAMES]
    if unknown:
        raise ValueError(
            f"languages must be Latin-script wordfreq languages {sorted(LANGUAGE_NAMES)}, got "
            f"{unknown}"
        )
    return langs


def language_words(
    languages: Sequence[str] = LANGUAGES, n_words: int = 3000
) -> tuple[dict[str, list[str]], int]:
    """Each language's alphabetic words among its ``n_words`` most frequent, unique to it.

    Args:
        languages: wordfreq language codes (Latin script, see `LANGUAGE_NAMES`), at least 2.
        n_words: how many words of each frequency list to read (``wordfreq.top_n_list``).

    Returns:
        ``({language: words in frequency order}, number of distinct words dropped because
        more than one language lists them)``.

    Raises:
        TypeError, ValueError: a bad ``languages`` or ``n_words`` (checked before any reading).
    """
    langs = _check_languages(languages)
    check_int("n_words", n_words, minimum=1)
    wordfreq = require("wordfreq", "apps", "attnlab.data.languages")
    lists = {}
    for lang in langs:
        words = [w for w in wordfreq.top_n_list(lang, n_words) if w.isalpha()]
        lists[lang] = list(dict.fromkeys(words))  # a word once per language, in order
    listed = Counter(w for words in lists.values() for w in words)
    shared = {w for w, c in listed.items() if c > 1}
    return {lang: [w for w in words if w not in shared] for lang, words in lists.items()}, len(
        shared
    )


def language_split(
    languages: Sequence[str] = LANGUAGES,
    *,
    n_words: int = 3000,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> LanguageSplit:
    """Words labelled by language, split by word (stratified, seeded): see the module docstring.

    Args:
        languages: wordfreq language codes (Latin script), at least 2, distinct.
        n_words: how many words of each language's frequency list to read.
        test_fraction: the share of each language's words held out, in (0, 1).
        seed: the split's seed (the same arguments give the same split).

    Returns:
        A `LanguageSplit`; within each set the words are grouped by language.

    Raises:
        TypeError, ValueError: bad arguments, or a language left with fewer than 2 words.
    """
    langs = _check_languages(languages)
    check_int("n_words", n_words, minimum=1)
    check_int("seed", seed, minimum=-(2**63))
    if not 0.0 < check_number("test_fraction", test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    words, dropped = language_words(langs, n_words)
    rng = random.Random(seed)
    train_w: list[str] = []
    train_y: list[int] = []
    test_w: list[str] = []
    test_y: list[int] = []
    for label, lang in enumerate(langs):
        ws = sorted(words[lang])
        if len(ws) < 2:
            raise ValueError(
                f"language {lang!r} keeps {len(ws)} word(s) of its top {n_words} after "
                "dropping shared and non-alphabetic words; it needs at least 2: raise n_words"
            )
        rng.shuffle(ws)
        n_test = min(len(ws) - 1, max(1, round(test_fraction * len(ws))))
        test_w += ws[:n_test]
        test_y += [label] * n_test
        train_w += ws[n_test:]
        train_y += [label] * (len(ws) - n_test)
    return LanguageSplit(
        labels=langs,
        train_words=tuple(train_w),
        train_labels=tuple(train_y),
        test_words=tuple(test_w),
        test_labels=tuple(test_y),
        n_words=n_words,
        test_fraction=float(test_fraction),
        seed=seed,
        dropped_shared=dropped,
    )


__all__ = ["LANGUAGES", "LANGUAGE_NAMES", "LanguageSplit", "language_split", "language_words"]
