"""The paper's rules for DecodeLeak's recall metrics (section "Private Evidence Recall").

Evidence.  ``E_priv`` holds the spans that are absent from the public query
(the paper's definition of a private-evidence span); a span whose words occur,
in order, in the public query is left out of every metric.  ``T(.)`` is
:func:`edge_sdk.leakage.content_token_ids`, the function the edge's leakage
meter uses; ``W(.)`` the content words, compared in lower case.

Exposure.  ``E^k`` is the union of every step's first ``k`` ids, so an id's
cutoff is its best rank over the steps.

Words read off the exposure.  A word split into several tokens is never one
exposed id, so ``W(E^k)`` decodes across steps: it holds every word of the
text of any run of consecutive steps that takes one id from each step's first
``k`` (a step boundary counts as a word boundary at the run's two ends).  The
authors' release reads one such run per rank ``r`` (the ``r``-th id of every
step); this reads every run, so a word counts as soon as its pieces are
exposed one after another, at whatever ranks.  At ``k = 1`` both read the
decoded text itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge_sdk.leakage import ExposureTrace, content_token_ids, fold, is_content_word, words
from eval_harness.metrics.rules import Evidence, first_ranks
from eval_harness.metrics.vocabulary import Vocabulary


def occurs_in(span_words: Sequence[str], text_words: Sequence[str]) -> bool:
    """Whether ``span_words`` appear in ``text_words`` as a contiguous run (an empty span never does)."""
    n = len(span_words)
    if n == 0:
        return False
    span = list(span_words)
    return any(list(text_words[i:i + n]) == span for i in range(len(text_words) - n + 1))


def evidence(spans: Sequence[str], public_query: str, vocab: Vocabulary) -> Evidence:
    query = [fold(w) for w in words(public_query)]
    private = [span for span in spans if not occurs_in([fold(w) for w in words(span)], query)]
    span_sets = [frozenset(content_token_ids(span, vocab.tokenize, vocab.piece)) for span in private]
    return Evidence(
        tokens=frozenset().union(*span_sets),
        span_tokens=tuple(ids for ids in span_sets if ids),
        words=frozenset(fold(w) for span in private for w in words(span) if is_content_word(w)),
        spans=len(spans),
        public_spans=len(spans) - len(private),
        empty_spans=sum(1 for ids in span_sets if not ids),
    )


def depth(trace: ExposureTrace, k: int) -> int:
    """Every recorded id: an id's rank is its raw rank, whatever the cutoff asked for."""
    return trace.k


def token_ranks(trace: ExposureTrace, vocab: Vocabulary) -> dict[int, int]:
    return first_ranks(trace.steps)


# -- reading words across steps ------------------------------------------------------------------
#
# Everything below works on bytes so that a character split over two byte-level
# tokens comes back whole; text is lower-cased piece by piece, with undecodable
# bytes carried through as surrogates ("surrogateescape") and counted as letters.


def _lower_bytes(data: bytes) -> bytes:
    text = fold(data.decode("utf-8", "surrogateescape"))
    return text.encode("utf-8", "surrogateescape")


def _wordish(ch: str) -> bool:
    return ch.isalnum() or "\udc80" <= ch <= "\udcff"


def _word_starts(data: bytes) -> set[bytes]:
    """The tails of ``data`` where a word can begin: at its start or after whitespace, edge punctuation skipped."""
    text = data.decode("utf-8", "surrogateescape")
    starts = set()
    for boundary in [0, *(i + 1 for i, ch in enumerate(text) if ch.isspace())]:
        i = boundary
        while i < len(text) and not text[i].isspace() and not _wordish(text[i]):
            i += 1
        if i < len(text) and _wordish(text[i]):
            starts.add(text[i:].encode("utf-8", "surrogateescape"))
    return starts


def _closes_word(rest: bytes) -> bool:
    """Whether a word that ends just before ``rest`` stays a whole word (only punctuation up to whitespace)."""
    for ch in rest.decode("utf-8", "surrogateescape"):
        if ch.isspace():
            return True
        if _wordish(ch):
            return False
    return True


_DONE = -1


def _advance(word: bytes, at: int, piece: bytes) -> int | None:
    """Read ``piece`` at byte ``at`` of ``word``: the next position, ``_DONE`` when the word ends whole, or None."""
    rest = word[at:]
    if len(piece) < len(rest):
        return at + len(piece) if rest.startswith(piece) else None
    if piece.startswith(rest) and _closes_word(piece[len(rest):]):
        return _DONE
    return None


_Bucket = dict[int, dict[bytes, int]]  # first byte → {text: best rank}


def _index(trace: ExposureTrace, vocab: Vocabulary) -> list[tuple[_Bucket, _Bucket]]:
    """Per step: (word starts by first byte, whole pieces by first byte), each text → its best rank."""
    index = []
    specials = vocab.specials  # control tokens stand for no text
    read: dict[int, tuple[bytes, set[bytes]]] = {}  # id → (its lower-cased bytes, their word starts), once per id
    for step in trace.steps:
        starts: _Bucket = {}
        pieces: _Bucket = {}
        for rank, token_id in enumerate(step, 1):
            if token_id in specials:
                continue
            if (known := read.get(token_id)) is None:
                data = _lower_bytes(vocab.piece_bytes(token_id))
                known = read[token_id] = (data, _word_starts(data))
            data, word_starts = known
            if data:
                bucket = pieces.setdefault(data[0], {})
                bucket.setdefault(data, rank)
            for start in word_starts:
                bucket = starts.setdefault(start[0], {})
                bucket.setdefault(start, rank)
        index.append((starts, pieces))
    return index


def _cutoff(word: bytes, index: list[tuple[_Bucket, _Bucket]]) -> int | None:
    """The smallest ``k`` at which some run of consecutive steps spells ``word`` (min over runs of the max rank)."""
    best: int | None = None
    active: dict[int, int] = {}  # position in the word → smallest max-rank of a run that reached it
    for starts, pieces in index:
        reached: dict[int, int] = {}

        def offer(at: int, piece: bytes, cost: int) -> None:
            nonlocal best
            if best is not None and cost >= best:
                return
            step_to = _advance(word, at, piece)
            if step_to == _DONE:
                best = cost
            elif step_to is not None and cost < reached.get(step_to, cost + 1):
                reached[step_to] = cost

        for at, cost in active.items():
            for piece, rank in pieces.get(word[at], {}).items():
                offer(at, piece, max(cost, rank))
        for start, rank in starts.get(word[0], {}).items():
            offer(0, start, rank)
        active = reached
    return best


def word_cutoffs(words_: frozenset[str], trace: ExposureTrace, vocab: Vocabulary) -> dict[str, int]:
    if not words_ or not trace.steps:
        return {}
    index = _index(trace, vocab)
    cutoffs = {}
    for word in words_:
        data = fold(word).encode("utf-8")
        if data and (cutoff := _cutoff(data, index)) is not None:
            cutoffs[word] = cutoff
    return cutoffs
