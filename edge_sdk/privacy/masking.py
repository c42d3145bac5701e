"""``never_upload``: spans of the private context whose tokens the SLM says nothing about to the cloud.

The session removes the SLM's values for these ids before any policy runs
(``edge_sdk.decoding``): no masked id's value is ever sent.  Every other value
is the SLM's own, computed over the whole context (the span included); in
probability space it is divided by ``1 - m``, ``m`` the SLM's mass on the
masked ids, so the row is still a distribution (left as it was, the sum of a
large upload would give ``m`` away).  A masked token can still be chosen on
the cloud's own probability, exactly as a word the context never mentions
(refusing it would tell a probing cloud which words are hidden).

The mask is deliberately wider than DecodeLeak's content tokens: a span the
user marks is masked whatever its words are (stop words, short words such as
"Dr. Li", non-ASCII names such as "王小明"), in every spelling a model can
produce mid-text: as given, lower case, upper case, capitalised and title
case, each with and without a leading space, and each of its words alone in
the same forms (the parts punctuation joins are words too: ``Okonkwo-Fitzgerald``
gives ``Fitzgerald``); each also in Unicode's composed (NFC, NFKC) and
accent-free forms.  Accented variants cannot be listed from the span ("Maria" may come
out as "María"), so every token of the vocabulary that spells one of the
span's words up to case and accents (:func:`fold`) is masked too, and so is
every word of the context that folds to one of them.  A model may also begin a
word with a token its tokenisation never uses (`` Maria`` + ``ngela`` where
``Mariangela`` is `` Mari`` + ``ang`` + ``ela``): every vocabulary token that
spells the word's first :data:`MIN_PREFIX_LETTERS` or more letters, up to case
and accents, is masked as well (for ``Mariangela``: `` Mar``, `` Mari``,
`` Maria``, `` Marian``, ...; common tokens such as `` Mar`` among them, which
is what the mask costs).  A span in Chinese or Japanese characters is also
masked in the romanised forms the vocabulary holds (:func:`romanised_words`:
`` Yamada``, `` Taro`` for ``山田太郎``; `` Wang``, `` Xiaoming`` for ``王小明``):
each reading, whole or from its first :data:`MIN_PREFIX_LETTERS` letters.  Only tokens that spell
nothing but punctuation or whitespace are left out (masking "." would say
nothing about the span and break every sentence).  A span none of whose
tokens can be masked is an error, never a silent no-op.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable, Iterable
from itertools import groupby
from typing import Any

#: a full-vocabulary upload keeps only its this-many largest values: with every id listed, the masked ids would
#: stand out.  In probability space always (cutting only while a mask is active would say that one is); in logit
#: space only under a mask, where the cut therefore says one is active (the cloud fuses a left-out id as a logit of
#: 0: cutting every full logit upload would change the release's fusion)
FULL_UPLOAD_LIMIT = 1000

#: a vocabulary token that spells the first this-many or more letters of a span's word (up to case and accents) is
#: masked with it: the model may start the word with a token the span's own tokenisation never uses (`` Maria`` for
#: ``Mariangela``), and that token alone gives the word's start away
MIN_PREFIX_LETTERS = 3


#: a romanised reading of Chinese or Japanese characters shorter than this is not masked (:func:`romanised_words`)
MIN_READING_LETTERS = 2


def fold(text: str) -> str:
    """``text`` up to case, accents and compatibility forms: NFKD, combining marks dropped, casefolded, stripped."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).casefold().strip()


def folded_vocabulary(piece: Callable[[int], str], vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every id of the vocabulary by its piece's :func:`fold` (pieces that fold to nothing left out)."""
    index: dict[str, list[int]] = {}
    for token_id in range(vocab_size):
        key = fold(piece(token_id))
        if key:
            index.setdefault(key, []).append(token_id)
    return {key: tuple(ids) for key, ids in index.items()}


def unspaced(ch: str) -> bool:
    """Whether ``ch`` belongs to a script written without spaces between words (Chinese, Japanese kana, Thai, Lao,
    Khmer, Myanmar), where any one character may be a word of its own."""
    return unicodedata.name(ch, "").startswith(_UNSPACED_SCRIPTS)


_UNSPACED_SCRIPTS = ("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA", "THAI", "LAO",
                     "KHMER", "MYANMAR")


#: marks that belong inside a Japanese word: the iteration mark (佐々木) and the long-vowel mark (ユーコ)
_JAPANESE_MARKS = frozenset("\u3005\u30fc")
#: the most consecutive readings joined into one word: a name's family and given parts (欧阳娜娜, 山田太郎); more
#: would only join a sentence, and the runs of n readings grow as n^2 (an 800-character span took 36 s and 1.6 GB)
MAX_JOINED_READINGS = 4


def _romanisable(ch: str) -> str | None:
    """``"han"`` for a Chinese character (read in Chinese and in Japanese), ``"kana"`` for hiragana or katakana
    (and the marks inside a Japanese word), else ``None``; ``ch`` as NFKC gives it (half-width katakana are read
    as full-width)."""
    name = unicodedata.name(ch, "")
    if name.startswith(("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH")):
        return "han"
    if ch in _JAPANESE_MARKS:
        return "kana"
    return "kana" if name.startswith(("HIRAGANA", "KATAKANA")) and unicodedata.category(ch) == "Lo" else None


@functools.cache
def _kakasi() -> Any:
    """pykakasi's converter, imported on first use (a span in Chinese or Japanese characters)."""
    try:
        import pykakasi
    except ImportError as exc:  # never a silent no-op: the romanised forms would stay unmasked
        raise ImportError("never_upload on Japanese text masks its romanised forms through pykakasi: install "
                          "coveil[edge] (or pip install pykakasi)") from exc
    return pykakasi.kakasi()


def _pinyin(run: str, *, heteronym: bool, joined: bool) -> list[list[str]]:
    """pypinyin's readings of ``run`` (imported on first use): per character in pinyin and Wade-Giles without
    tones, every reading of each with ``heteronym``; ``joined``: the phrase's likeliest reading as one list."""
    try:
        from pypinyin import Style, lazy_pinyin, pinyin
    except ImportError as exc:
        raise ImportError("never_upload on Chinese text masks its romanised forms through pypinyin: install "
                          "coveil[edge] (or pip install pypinyin)") from exc
    styles = (Style.NORMAL, Style.WADEGILES)
    if joined:
        return [lazy_pinyin(run, style=style) for style in styles]
    return [reading for style in styles for reading in pinyin(run, style=style, heteronym=heteronym)]


def _long_vowel_forms(reading: str) -> set[str]:
    """A Japanese reading as names are written in Latin letters: as given (``tarou``), without the long vowel
    (``taro``, as Hepburn with its macron dropped: ``Tarō``), and with ``oh`` (``satoh``)."""
    return {reading, re.sub(r"([aiueo])\1|ou", lambda m: m.group(0)[0], reading), reading.replace("ou", "oh")}


def _joined_runs(units: list[str]) -> set[str]:
    """Every run of at most :data:`MAX_JOINED_READINGS` consecutive ``units`` written as one word (``yamada``,
    ``tarou``, ``yamadatarou``)."""
    return {"".join(units[start:end]) for start in range(len(units))
            for end in range(start + 1, min(len(units), start + MAX_JOINED_READINGS) + 1)}


def romanised_words(text: str) -> set[str]:
    """The romanised readings of ``text``'s Chinese and Japanese characters, folded (:func:`fold`), that a model
    may write for them: Japanese through pykakasi (Hepburn, Kunrei and passport readings of each word it finds,
    with and without long vowels, and every run of consecutive words joined: ``山田太郎`` gives ``yamada``,
    ``tarou``, ``taro``, ``yamadatarou``, ...), Chinese characters also through pypinyin (every reading of each
    character in pinyin and Wade-Giles, and every run of consecutive characters' likeliest readings joined:
    ``王小明`` gives ``wang``, ``xiao``, ``ming``, ``xiaoming``, ``hsiao``, ...); readings of one letter left
    out (:data:`MIN_READING_LETTERS`).  Empty, importing neither library, for text without such characters.
    Han characters are read both ways (the text's language is not known), which masks more than either alone.
    Runs of more than :data:`MAX_JOINED_READINGS` readings are not joined.  What stays: readings neither
    dictionary gives (a name's unusual reading), other systems (Yale, Korean)."""
    text = unicodedata.normalize("NFKC", text)  # half-width katakana (ﾀﾛｳ) as full-width
    runs = ["".join(chars) for kind, chars in groupby(text, key=lambda ch: _romanisable(ch) is not None) if kind]
    words: set[str] = set()
    for run in runs:
        segments = _kakasi().convert(run)
        readings = [{f for key in ("hepburn", "kunrei", "passport") for f in _long_vowel_forms(segment[key])}
                    for segment in segments]
        words |= {form for forms in readings for form in forms}
        for key in ("hepburn", "kunrei", "passport"):
            words |= {form for joined in _joined_runs([segment[key] for segment in segments])
                      for form in _long_vowel_forms(joined)}
        if any(_romanisable(ch) == "han" for ch in run):
            words |= {reading for readings_of_char in _pinyin(run, heteronym=True, joined=False)
                      for reading in readings_of_char}
            for likeliest in _pinyin(run, heteronym=False, joined=True):
                words |= _joined_runs(likeliest)
    # a one-letter reading (``o`` of 王 read in Japanese) would mask a letter and say next to nothing
    return {key for word in words if len(key := fold(re.sub(r"[^A-Za-z]", "", word))) >= MIN_READING_LETTERS}


def spoken_words(text: str) -> list[str]:
    """The words of ``text`` a model may write alone: each whitespace-separated word, as written and without the
    punctuation around it, each part that punctuation joins inside it (``Okonkwo-Fitzgerald`` also gives
    ``Okonkwo`` and ``Fitzgerald``, ``O'Brien`` also ``O`` and ``Brien``), and each character of a script written
    without spaces (``山田太郎`` also gives ``山``, ``田``, ``太``, ``郎``: where words are not spaced, any of them
    may be a name's part, as ``田`` of ``山田``)."""
    words: list[str] = []
    for word in text.split():
        bare = _bare(word)
        parts = ["".join(run) for is_punctuation, run in groupby(bare, key=lambda ch: unicodedata.category(ch)[0] == "P")
                 if not is_punctuation]
        words += [word, bare, *(parts if len(parts) > 1 else ()), *(ch for ch in bare if unspaced(ch))]
    return list(dict.fromkeys(w for w in words if w))


def spellings(span: str) -> list[str]:
    """The forms of ``span`` a model may generate: case variants of the span and of each word (:func:`_words`),
    with and without a leading space."""
    span = " ".join(span.split())
    accent_free = "".join(ch for ch in unicodedata.normalize("NFKD", span) if not unicodedata.combining(ch))
    forms: list[str] = []
    for written in dict.fromkeys((span, unicodedata.normalize("NFC", span), unicodedata.normalize("NFKC", span),
                                  accent_free)):
        for text in (written, *spoken_words(written)):
            for variant in (text, text.lower(), text.upper(), text.capitalize(), text.title()):
                for spaced in (variant, " " + variant):
                    if variant and spaced not in forms:
                        forms.append(spaced)
    return forms


def _is_punctuation_or_space(text: str) -> bool:
    """Whether a token spells only punctuation or whitespace (a byte fragment of a character, shown as
    U+FFFD, is part of a word and counts as content)."""
    return "\ufffd" not in text and all(ch.isspace() or unicodedata.category(ch).startswith("P") for ch in text)


def _bare(word: str) -> str:
    """``word`` without the punctuation around it."""
    start, end = 0, len(word)
    while start < end and unicodedata.category(word[start]).startswith("P"):
        start += 1
    while end > start and unicodedata.category(word[end - 1]).startswith("P"):
        end -= 1
    return word[start:end]


def never_upload_ids(
    spans: Iterable[str],
    private_context: str,
    tokenize: Callable[[str], list[int]],
    piece: Callable[[int], str],
    vocabulary: dict[str, tuple[int, ...]] | None = None,
) -> frozenset[int]:
    """Every token id that spells part of one of ``spans`` (see the module docstring).

    ``vocabulary``: :func:`folded_vocabulary` of the model, whose tokens that
    spell a word of a span up to case and accents are masked too.  Raises
    ``ValueError`` for a span that does not occur in ``private_context`` (up
    to case and accents) or that has no maskable token (only punctuation or
    whitespace).
    """
    masked: set[int] = set()
    context_words = spoken_words(private_context)
    for span in spans:
        if not span.strip():
            raise ValueError("a never_upload span must not be empty")
        if span not in private_context and fold(span) not in fold(" ".join(private_context.split())):
            raise ValueError(f"never_upload span {span!r} does not occur in the private context")
        words = ({fold(word) for word in spoken_words(span)} | romanised_words(span)) - {""}
        variants = [bare for word in context_words if fold(bare := _bare(word)) in words]  # "María" for "Maria"
        forms = spellings(span) + [form for variant in variants for form in spellings(variant)]
        ids = {i for form in forms for i in tokenize(form) if not _is_punctuation_or_space(piece(i))}
        if vocabulary is not None:
            keys = {word[:end] for word in words for end in range(min(MIN_PREFIX_LETTERS, len(word)), len(word) + 1)}
            # unspaced scripts: a token may hold any run of the word's characters (山田 of 山田太郎)
            keys |= {word[start:end] for word in words if any(map(unspaced, word))
                     for start in range(len(word)) for end in range(start + 1, len(word) + 1)}
            ids |= {i for key in keys for i in vocabulary.get(key, ()) if not _is_punctuation_or_space(piece(i))}
        if not ids:
            raise ValueError(f"never_upload span {span!r} has no token that could be masked (only punctuation)")
        masked |= ids
    return frozenset(masked)
