"""The rules of the authors' release (``evaluate_leakage.py`` in KejiaZhang-Robust/CoVeil), for comparison.

``compat="release"`` puts this toolkit's numbers next to the paper's tables.
What the release does differently from :mod:`eval_harness.metrics.paper`:

* A token or word is filtered out ("bad") when, stripped, it has at most two
  characters and is not all digits, has no letter or digit, or is one of ten
  template words (``answer``, ``the``, ``reason``, ...).  No other stop words.
* ``T(E_priv)``: the evidence words that survive that filter, joined by one
  space and tokenised as one text (no leading space), then filtered by each
  token's text.  Spans are tokenised alone, as written, for Span-ER.
* A span whose punctuation-free, lower-case form is a substring of the public
  query's is left out of Span-ER only (Token-ER, ROUGE1-ER and AUC keep it).
* ``E^k`` takes each step's first ``k`` *content* ids among its first
  ``max_k`` recorded ids: the release cuts every step to ``max_k =
  max(ks, auc_k)`` before filtering.  Its defaults (``ks`` = 10, 50, 100,
  ``auc_k`` = 100) make ``max_k`` = 100, so a metric at ``K`` reads the trace
  cut to :func:`depth` = ``max(K, 100)`` ids a step (the recorded ``k`` if
  smaller), however deep the trace was recorded: a step's 100th content id can
  sit at raw rank 150, which a 1,000-id trace would count at ``K`` = 100.
* Words are compared case-sensitively, as ``str.split`` cuts them
  (punctuation attached); ``W(E^k)`` holds the words of the rank-``r`` paths
  for ``r <= k``: the ``r``-th id of every step holding one, decoded in order
  with special tokens skipped.

One difference is left: transformers' ``decode`` may tidy spaces before
punctuation (``clean_up_tokenization_spaces``) where :meth:`Vocabulary.decode`
keeps the text exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.metrics.rules import Evidence, first_ranks
from eval_harness.metrics.vocabulary import Vocabulary

#: the release's whole stop-word list
#: the release's default ``auc_k``: every run of its ``evaluate_leakage.py`` cuts the trace to at least this many ids
RELEASE_AUC_K = 100
RELEASE_STOP_WORDS = frozenset(
    {"answer", "the", "reason", "reasoning", "option", "options", "explanation", "step", "context", "solution"}
)
_NOT_WORD = re.compile(r"[^\w\s]")
_SPACES = re.compile(r"\s+")


def is_filtered(text: str) -> bool:
    """The release's filter for a token's text or a word (True: not counted)."""
    token = text.strip()
    if token.isdigit():
        return False
    return len(token) <= 2 or not any(ch.isalnum() for ch in token) or token.lower() in RELEASE_STOP_WORDS


def normalised_phrase(text: str) -> str:
    """Lower case, punctuation as spaces, runs of whitespace as one space."""
    return _SPACES.sub(" ", _NOT_WORD.sub(" ", text.lower())).strip()


def _content_ids(text: str, vocab: Vocabulary) -> frozenset[int]:
    return frozenset(i for i in vocab.tokenize(text) if not is_filtered(vocab.piece(i))) if text else frozenset()


def evidence(spans: Sequence[str], public_query: str, vocab: Vocabulary) -> Evidence:
    kept = [word.strip() for span in spans for word in span.split() if word.strip() and not is_filtered(word)]
    query = normalised_phrase(public_query)
    private = []
    for span in (s.strip() for s in spans):
        phrase = normalised_phrase(span)
        if span and not (phrase and phrase in query):
            private.append(span)
    span_sets = [_content_ids(span, vocab) for span in private]
    return Evidence(
        tokens=_content_ids(" ".join(kept), vocab),
        span_tokens=tuple(ids for ids in span_sets if ids),
        words=frozenset(kept),
        spans=len(spans),
        public_spans=len(spans) - len(private),
        empty_spans=sum(1 for ids in span_sets if not ids),
    )


def depth(trace: ExposureTrace, k: int) -> int:
    """How many of each step's ids the release reads for a metric at ``k``: ``min(trace.k, max(k, 100))``.

    The release's ``max_k = max(max(ks), auc_k)`` with its default ``auc_k`` = 100
    and ``k`` among the ``ks``.
    """
    return min(trace.k, max(k, RELEASE_AUC_K))


def token_ranks(trace: ExposureTrace, vocab: Vocabulary) -> dict[int, int]:
    """Ranks among each step's *content* ids, as the release counts its first k (on a trace cut to :func:`depth`)."""
    filtered: dict[int, bool] = {}  # id → whether its text is filtered, read once per id

    def content(token_id: int) -> bool:
        if (out := filtered.get(token_id)) is None:
            out = filtered[token_id] = is_filtered(vocab.piece(token_id))
        return not out

    return first_ranks([i for i in step if content(i)] for step in trace.steps)


def word_cutoffs(words: frozenset[str], trace: ExposureTrace, vocab: Vocabulary) -> dict[str, int]:
    cutoffs: dict[str, int] = {}
    for rank in range(1, trace.k + 1):
        path = [step[rank - 1] for step in trace.steps if len(step) >= rank]
        if not path:
            break  # no step holds this many ids, nor more
        for word in vocab.decode(path, skip_special=True).split():
            if word in words and word not in cutoffs and not is_filtered(word):
                cutoffs[word] = rank
    return cutoffs
