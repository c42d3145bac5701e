"""The paper's rules for DecodeLeak's recall metrics (section "Private Evidence Recall").

Evidence.  ``E_priv`` holds the spans that are absent from the public query
(the paper's definition of a private-evidence span); a span whose words occur,
in order, in the public query is left out of every metric.  ``T(.)`` is
:func:`edge_sdk.privacy.meter.content_token_ids`, the function the edge's leakage
meter uses; ``W(.)`` the content words, compared in lower case.

Exposure.  ``E^k`` is the union of every step's first ``k`` ids, so an id's
cutoff is its best rank over the steps.

Words read off the exposure.  A word split into several tokens is never one
exposed id, so ``W(E^k)`` decodes across steps: it holds every word written,
between real word boundaries, by some run of consecutive steps that takes one
id from each step's first ``k``.  A word boundary is whitespace inside the
run's text (edge punctuation stripped, as :func:`edge_sdk.privacy.meter.words`
reads text), or the start or end of the whole trace; a step boundary is not
one, so " A 70-year-old man" (``▁A ▁ 7 0 - year - old ▁man``) reads
"70-year-old" and "man", never "year" or "old".  At ``k = 1`` this reads the
words of the decoded text (a control token read as a space).  The authors'
release reads one run per rank ``r`` (the ``r``-th id of every step, decoded
and split on whitespace); this reads every run, so a word counts as soon as
its pieces are exposed one after another, at whatever ranks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from edge_sdk.privacy.meter import ExposureTrace, content_token_ids, fold, is_content_word, words
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
# A word is read as :func:`edge_sdk.privacy.meter.words` reads text: a whitespace-separated chunk with its edge
# punctuation stripped.  Reading one chunk of the text a run of steps spells is a small automaton:
#
#   BOUNDARY   after whitespace (or at the trace's start), edge punctuation only so far: a word may begin
#   j          the word's first j bytes read, nothing else in this chunk (0 < j < len(word))
#   CLOSING    the whole word read, then edge punctuation only: whitespace or the trace's end completes it
#   (dead)     inside some other chunk: only whitespace leads out
#
# A run may start at any step, in the dead state (what came before it is unknown), or at the trace's start in
# BOUNDARY.  So a step boundary is never a word boundary: " A 70-year-old man" never reads "year" or "old",
# and "130/85" never reads "13".  Each step offers its pieces at their ranks; a run's cutoff is the largest
# rank it takes, and a word's cutoff the smallest over the runs that complete it (a min-max path, computed
# step by step).  Text is compared as lower-cased bytes so that a character split over two byte-level tokens
# comes back whole; undecodable bytes are carried as surrogates ("surrogateescape") and count as letters.

_Key = dict[bytes, int]  # text → the best (smallest) rank of a piece with that text in the step
_BOUNDARY, _CLOSING, _DONE = "boundary", "closing", "done"
_State = int | str  # _BOUNDARY, _CLOSING, _DONE or the number of the word's bytes read


def _lower_bytes(data: bytes) -> bytes:
    text = fold(data.decode("utf-8", "surrogateescape"))
    return text.encode("utf-8", "surrogateescape")


def _wordish(ch: str) -> bool:
    return ch.isalnum() or "\udc80" <= ch <= "\udcff"


def _lstrip(text: str) -> str:
    """``text`` without leading edge punctuation (``text`` holds no whitespace)."""
    i = 0
    while i < len(text) and not _wordish(text[i]):
        i += 1
    return text[i:]


def _rstrip(text: str) -> str:
    """``text`` without trailing edge punctuation (``text`` holds no whitespace)."""
    end = len(text)
    while end and not _wordish(text[end - 1]):
        end -= 1
    return text[:end]


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


@dataclass
class _Step:
    """One step's pieces, keyed every way the automaton looks them up, each text → its best rank.

    A piece holding whitespace splits into a head (before its first whitespace), whole chunks, and a tail
    (after its last whitespace); one without is read whole.
    """

    head_stripped: _Key = field(default_factory=dict)  # BOUNDARY + head completes the word: strip(head) == word
    head_rstripped: _Key = field(default_factory=dict)  # j + head completes it: rstrip(head) == word[j:]
    chunk: _Key = field(default_factory=dict)  # a whole chunk: strip(chunk) == word
    tail_lstripped: _Key = field(default_factory=dict)  # any state + piece → the state of lstrip(tail) from BOUNDARY
    tail_stripped: _Key = field(default_factory=dict)  # ... CLOSING when strip(tail) == word
    lstripped: _Key = field(default_factory=dict)  # no whitespace: BOUNDARY → the state of lstrip(piece)
    stripped: _Key = field(default_factory=dict)  # BOUNDARY → CLOSING when strip(piece) == word
    exact: _Key = field(default_factory=dict)  # j → j + len(piece) when piece == word[j:...]
    rstripped: _Key = field(default_factory=dict)  # j → CLOSING when rstrip(piece) == word[j:]

    def add(self, text: str, rank: int) -> None:
        segments = re.split(r"\s", text)
        if len(segments) == 1:  # no whitespace
            core = _lstrip(text)
            self.lstripped.setdefault(_encode(core), rank)
            if core:
                self.stripped.setdefault(_encode(_rstrip(core)), rank)
            self.exact.setdefault(_encode(text), rank)
            self.rstripped.setdefault(_encode(_rstrip(text)), rank)
            return
        head, *middle, tail = segments
        self.head_stripped.setdefault(_encode(_rstrip(_lstrip(head))), rank)
        self.head_rstripped.setdefault(_encode(_rstrip(head)), rank)
        for chunk in middle:
            self.chunk.setdefault(_encode(_rstrip(_lstrip(chunk))), rank)
        core = _lstrip(tail)
        self.tail_lstripped.setdefault(_encode(core), rank)
        if core:
            self.tail_stripped.setdefault(_encode(_rstrip(core)), rank)


def _index(trace: ExposureTrace, vocab: Vocabulary) -> list[_Step]:
    """Each step's pieces; a control token (``<eos>``, ``<start_of_turn>``) stands for no text but ends any word,
    so it reads as a space (read as nothing, a run could skip a step through the control ids every step holds)."""
    specials = vocab.specials
    text: dict[int, str] = {}  # id → its lower-cased text, read once per id
    index = []
    for ids in trace.steps:
        step = _Step()
        for rank, token_id in enumerate(ids, 1):
            if (piece := text.get(token_id)) is None:
                data = b" " if token_id in specials else _lower_bytes(vocab.piece_bytes(token_id))
                piece = text[token_id] = data.decode("utf-8", "surrogateescape")
            step.add(piece, rank)
        index.append(step)
    return index


def _cutoff(word: bytes, index: list[_Step]) -> int | None:
    """The smallest ``k`` at which a run of consecutive steps writes ``word`` between real word boundaries."""
    n = len(word)
    best: int | None = None
    costs: dict[_State, int] = {_BOUNDARY: 0}  # the trace's start is a word boundary

    def better(cost: int) -> bool:
        return best is None or cost < best

    for step in index:
        reached: dict[_State, int] = {}

        def reach(state: _State, cost: int) -> None:
            nonlocal best
            if not better(cost):
                return
            if state == _DONE:
                best = cost
            elif cost < reached.get(state, cost + 1):  # noqa: B023 - called only in this pass of the loop
                reached[state] = cost  # noqa: B023

        # pieces holding whitespace: a chunk inside them, a head that ends the run's word, a tail that starts one
        if (rank := step.chunk.get(word)) is not None:
            reach(_DONE, rank)
        for state, cost in costs.items():
            if state == _BOUNDARY:
                rank = step.head_stripped.get(word)
            elif state == _CLOSING:
                rank = step.head_rstripped.get(b"")
            else:
                rank = step.head_rstripped.get(word[state:])
            if rank is not None:
                reach(_DONE, max(cost, rank))
        if (rank := step.tail_lstripped.get(b"")) is not None:
            reach(_BOUNDARY, rank)
        for j in range(1, n):
            if (rank := step.tail_lstripped.get(word[:j])) is not None:
                reach(j, rank)
        if (rank := step.tail_stripped.get(word)) is not None:
            reach(_CLOSING, rank)
        # pieces without whitespace continue the run's chunk
        for state, cost in costs.items():
            if state == _BOUNDARY:
                if (rank := step.lstripped.get(b"")) is not None:
                    reach(_BOUNDARY, max(cost, rank))
                for j in range(1, n):
                    if (rank := step.lstripped.get(word[:j])) is not None:
                        reach(j, max(cost, rank))
                if (rank := step.stripped.get(word)) is not None:
                    reach(_CLOSING, max(cost, rank))
            elif state == _CLOSING:
                if (rank := step.rstripped.get(b"")) is not None:
                    reach(_CLOSING, max(cost, rank))
            else:
                for end in range(state, n):
                    if (rank := step.exact.get(word[state:end])) is not None:
                        reach(end, max(cost, rank))
                if (rank := step.rstripped.get(word[state:])) is not None:
                    reach(_CLOSING, max(cost, rank))
        costs = reached
    if _CLOSING in costs and better(costs[_CLOSING]):  # the trace's end is a word boundary
        best = costs[_CLOSING]
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
