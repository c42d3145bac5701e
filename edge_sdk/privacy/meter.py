"""Content tokens of private text, and what the cloud observed.

DecodeLeak counts leakage over *content* token ids: the ids of a text's
content words (stop words and punctuation excluded; negations and numbers
kept), each word tokenised with a leading space the way it appears inside a
sentence, so that it matches the ids a model generates mid-text.  The same
function serves the edge's :class:`LeakageMeter` and the harness's metrics.
Token texts come from the vocabulary's pieces through
:func:`edge_sdk.backends.pieces.piece_reader`.

Exposure
--------
:class:`ExposureTrace` is DecodeLeak's per-step exposure sequence
``E_1^k .. E_T^k`` together with the cutoff ``k`` it was recorded at; the
metrics refuse a ``K`` larger than that instead of silently reading fewer ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

#: words every answer template contains, whatever the private context (the release drops them too)
TEMPLATE_WORDS = frozenset(
    "answer answers reason reasoning option options explanation step steps context solution brief".split()
)
#: never stop words: a negation changes what the evidence says (annotators mark "not" on its own)
NEGATIONS = frozenset(
    """no not nor never none nothing nobody nowhere neither without cannot n't
    aren't can't couldn't didn't doesn't don't hadn't hasn't haven't isn't mustn't shan't shouldn't wasn't weren't
    won't wouldn't""".split()
)
#: never stop words either: counts are evidence ("two weeks")
NUMBER_WORDS = frozenset(
    """zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
    seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million
    first second third fourth fifth once twice""".split()
)


# -- content words and content tokens --------------------------------------------------------------


@functools.cache
def stop_words() -> frozenset[str]:
    """The English stop-word list of the ``stop-words`` package, plus the answer-template words,
    minus negations and number words (lower case; ``’`` written ``'``)."""
    try:
        from stop_words import get_stop_words
    except ImportError as exc:  # pragma: no cover - the edge extra installs it
        raise ImportError("content-token filtering needs the 'stop-words' package: pip install 'coveil[edge]'") from exc
    listed = {fold(word) for word in get_stop_words("en")}
    return frozenset((listed | TEMPLATE_WORDS) - NEGATIONS - NUMBER_WORDS)


def fold(word: str) -> str:
    """A word as the metrics compare words: lower case, with ``’`` written ``'``."""
    return word.lower().replace("\u2019", "'")


def _strip_edges(chunk: str) -> str:
    """``chunk`` without leading and trailing characters that are not letters or digits."""
    start, end = 0, len(chunk)
    while start < end and not chunk[start].isalnum():
        start += 1
    while end > start and not chunk[end - 1].isalnum():
        end -= 1
    return chunk[start:end]


def words(text: str) -> list[str]:
    """The words of ``text`` as they appear: whitespace-separated, edge punctuation stripped.

    Inner punctuation stays, so ``"70-year-old"``, ``"mg/dL"`` and ``"don't"`` are one word each.
    """
    return [word for chunk in text.split() if (word := _strip_edges(chunk))]


def is_number(word: str) -> bool:
    """Digits, possibly with decimal or range punctuation (``"7"``, ``"37.5"``, ``"120/80"``)."""
    return any(ch.isdigit() for ch in word) and all(ch.isdigit() or ch in ".,:/-" for ch in word)


def is_content_word(word: str) -> bool:
    """A word that counts as evidence: anything with a letter or digit that is not a stop word."""
    folded = fold(_strip_edges(word))
    return bool(folded) and (is_number(folded) or folded not in stop_words())


def piece_is_content(piece: str) -> bool:
    """Whether a token's *text* (decoded, not its raw vocabulary piece) can carry content on its own.

    No content: whitespace, punctuation, a stop word (``" the"``, ``"\\n"``, ``","``).
    """
    core = fold(_strip_edges(piece.strip()))
    return bool(core) and (is_number(core) or core not in stop_words())


def word_token_ids(word: str, tokenize: Callable[[str], list[int]], piece: Callable[[int], str]) -> set[int]:
    """The ids that stand for one content word, tokenised as ``" " + word``.

    Its number pieces always count.  Of its other pieces, the most specific
    kind it has counts: pieces of more than two letters that are not stop
    words (``"bilirubin"`` without ``"ir"``, ``"patient's"`` without ``"'s"``:
    short fragments say little and turn up in almost every exposure set);
    for a word without one (``"ERCP"`` = ``▁ER CP``, ``"no"``), its pieces
    that are not stop words; for a word of stop-word pieces alone
    (``"thereof"`` = ``▁there of``), those.  Whitespace and punctuation
    pieces never count, so every content word keeps at least one id.
    """
    cores = [(i, fold(_strip_edges(piece(i).strip()))) for i in tokenize(" " + word)]
    cores = [(i, core) for i, core in cores if core]
    ids = {i for i, core in cores if is_number(core)}
    letters = [(i, core) for i, core in cores if not is_number(core)]
    stop = stop_words()
    for keep in (lambda c: len(c) > 2 and c not in stop, lambda c: c not in stop, lambda c: True):
        chosen = {i for i, core in letters if keep(core)}
        if chosen:
            return ids | chosen
    return ids


def content_token_ids(text: str, tokenize: Callable[[str], list[int]], piece: Callable[[int], str]) -> set[int]:
    """``T(text)``: the content token ids of ``text``, the union of :func:`word_token_ids` over its
    content words (:func:`is_content_word`).

    Each word is tokenised as ``" " + word``, as it would appear mid-sentence.
    ``piece`` must give a token's text, e.g. a :class:`~edge_sdk.backends.pieces.PieceDecoder`, never its
    raw vocabulary string.
    """
    ids: set[int] = set()
    for word in words(text):
        if is_content_word(word):
            ids |= word_token_ids(word, tokenize, piece)
    return ids


# -- what the cloud observed ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExposureTrace:
    """DecodeLeak's exposure sequence: each step's ``E_t^k`` ids, best first, recorded at cutoff ``k``.

    A step holds fewer than ``k`` ids only when fewer were observed (an upload
    smaller than ``k``).  Asking for a larger ``K`` than ``k`` is an error:
    the ids beyond ``k`` were never recorded.
    """

    k: int
    steps: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or self.k < 1:
            raise ValueError(f"an exposure trace needs a cutoff k >= 1, got {self.k!r}")
        steps = tuple(tuple(int(i) for i in step) for step in self.steps)
        for t, step in enumerate(steps):
            if len(step) > self.k:
                raise ValueError(f"step {t} holds {len(step)} ids, more than the trace's k={self.k}")
            if len(set(step)) != len(step) or any(i < 0 for i in step):
                raise ValueError(f"step {t} must hold distinct non-negative token ids, got {step}")
        object.__setattr__(self, "k", int(self.k))
        object.__setattr__(self, "steps", steps)

    @classmethod
    def from_transcript(cls, transcript: Mapping) -> ExposureTrace:
        """The trace of a cloud observation transcript (``exposure_k`` and each step's ``exposure``)."""
        return cls(int(transcript["exposure_k"]), tuple(tuple(s["exposure"]) for s in transcript["steps"]))

    def __len__(self) -> int:
        return len(self.steps)

    def check(self, k: int) -> int:
        """``k`` itself if this trace can answer for it; ``ValueError`` otherwise."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"K must be a positive integer, got {k!r}")
        if k > self.k:
            raise ValueError(f"K={k} is larger than the cutoff this trace was recorded at (k={self.k}); "
                             f"record the exposure with k >= {k}")
        return int(k)

    def top(self, k: int) -> tuple[tuple[int, ...], ...]:
        """Every step's first ``k`` ids."""
        k = self.check(k)
        return tuple(step[:k] for step in self.steps)

    def exposed(self, k: int) -> frozenset[int]:
        """``E^k``: the union of every step's first ``k`` ids."""
        return frozenset(i for step in self.top(k) for i in step)

    def truncated(self, k: int) -> ExposureTrace:
        """The same trace as if it had been recorded at cutoff ``k``."""
        return ExposureTrace(k, self.top(k))


@dataclass
class LeakageMeter:
    """What share of the private context's content tokens the cloud has observed so far.

    ``exposed`` accumulates every id that left the device or that the cloud
    could read off its own view of the step (DecodeLeak's exposure sets).
    """

    private_content_ids: frozenset[int]
    exposed: set[int] = field(default_factory=set)

    def observe(self, ids: Iterable[int] | np.ndarray) -> None:
        self.exposed.update(int(i) for i in ids)

    @property
    def leaked_ids(self) -> set[int]:
        return self.exposed & self.private_content_ids

    @property
    def share(self) -> float:
        """``|T(private) ∩ exposed| / |T(private)|`` (0 when the private context has no content tokens)."""
        if not self.private_content_ids:
            return 0.0
        return len(self.leaked_ids) / len(self.private_content_ids)
