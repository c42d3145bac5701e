"""Content tokens of private text, and the edge's live leakage meter.

DecodeLeak counts leakage over *content* token ids: the ids of a text's
words, minus stop words, punctuation and fragments of at most two characters
(numbers are kept).  Each word is tokenised with a leading space, the way it
appears inside a sentence, so that it matches the ids a model generates
mid-text.  The same function serves the edge's meter and the harness's
metrics.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

#: common English function words, plus words every answer template contains
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below between
    both but by can could did do does doing down during each few for from further had has have having he her here
    hers herself him himself his how i if in into is it its itself just me more most my myself no nor not now of
    off on once only or other our ours ourselves out over own same she should so some such than that the their
    theirs them themselves then there these they this those through to too under until up very was we were what
    when where which while who whom why will with would you your yours yourself yourselves also may might must
    shall upon yet via per its let lets one ones
    answer answers reason reasoning option options explanation step steps context solution brief""".split()
)
_WORD = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)?")
_SPM_SPACE = "\u2581"


def piece_is_content(piece: str) -> bool:
    """Whether a token's text counts as content (not a stop word, punctuation or short fragment)."""
    word = piece.replace(_SPM_SPACE, " ").strip().lower()
    if not word or all(ch in string.punctuation or ch.isspace() for ch in word):
        return False
    if word.isdigit():
        return True
    return len(word) > 2 and word not in STOPWORDS


def piece_reader(slm: object) -> Callable[[int], str]:
    """Token id → its text: a lookup in the backend's vocabulary table (``token_strings``) when it
    has one, else a one-token detokenisation."""
    strings = getattr(slm, "token_strings", None)
    if strings is not None:
        return [s.decode("utf-8", errors="replace") for s in strings()].__getitem__
    return lambda i: slm.detokenize([i])  # type: ignore[attr-defined]


def words(text: str) -> list[str]:
    """The words of ``text`` (letters and digits, with an apostrophe suffix)."""
    return _WORD.findall(text)


def content_token_ids(text: str, tokenize: Callable[[str], list[int]], piece: Callable[[int], str]) -> set[int]:
    """``T(text)``: the content token ids of ``text`` (each word tokenised as ``" " + word``)."""
    ids: set[int] = set()
    for word in words(text):
        ids.update(i for i in tokenize(" " + word) if piece_is_content(piece(i)))
    return ids


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
