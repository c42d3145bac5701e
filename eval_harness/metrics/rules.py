"""What a rule set extracts from one item's private evidence, and what every rule set provides."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.metrics.vocabulary import Vocabulary


@dataclass(frozen=True)
class Evidence:
    """One item's private evidence as token ids and words.

    Attributes:
        tokens: ``T(E_priv)``, what Token-ER and AUC count.
        span_tokens: ``T(P_m)`` of each span Span-ER averages over (spans without content tokens left out).
        words: ``W(E_priv)``, what ROUGE1-ER counts.
        spans: how many spans the item annotates.
        public_spans: spans left out because the public query already contains them.
        empty_spans: spans (of those not left out) without a single content token.
    """

    tokens: frozenset[int]
    span_tokens: tuple[frozenset[int], ...]
    words: frozenset[str]
    spans: int
    public_spans: int
    empty_spans: int

    def row(self) -> dict[str, int]:
        """The counts a result row carries next to the metrics."""
        return {
            "evidence_tokens": len(self.tokens),
            "evidence_words": len(self.words),
            "evidence_spans": self.spans,
            "public_spans": self.public_spans,
            "empty_spans": self.empty_spans,
        }


def first_ranks(steps: Iterable[Iterable[int]]) -> dict[int, int]:
    """Each id → the best (smallest) 1-based rank it holds in any step: the least ``k`` with it in ``E^k``."""
    ranks: dict[int, int] = {}
    for step in steps:
        for rank, token_id in enumerate(step, 1):
            if rank < ranks.get(token_id, rank + 1):
                ranks[token_id] = rank
    return ranks


class Rules(Protocol):
    """A rule set: how evidence and exposure are read (the paper's, or the authors' release)."""

    def evidence(self, spans: Sequence[str], public_query: str, vocab: Vocabulary) -> Evidence: ...

    def depth(self, trace: ExposureTrace, k: int) -> int:
        """How many of each step's recorded ids a metric at cutoff ``k`` reads (``k <= depth <= trace.k``)."""
        ...

    def token_ranks(self, trace: ExposureTrace, vocab: Vocabulary) -> dict[int, int]:
        """Each exposed id → the smallest cutoff ``k`` at which it belongs to ``E^k``."""
        ...

    def word_cutoffs(self, words: frozenset[str], trace: ExposureTrace, vocab: Vocabulary) -> dict[str, int]:
        """Each of ``words`` the cloud can read off the trace → the smallest cutoff ``k`` at which it can."""
        ...
