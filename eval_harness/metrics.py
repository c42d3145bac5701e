"""DecodeLeak private-evidence recall metrics over a cloud observation transcript.

Notation (paper, section "Private Evidence Recall"): ``E_t^K`` is the top-K
exposure set of step ``t`` and ``E^K = U_t E_t^K``; ``T(.)`` gives content
token ids and ``W(.)`` content words.  With private-evidence spans
``P_1..P_M``:

* ``Token-ER@K  = |T(E_priv) ∩ E^K| / |T(E_priv)|``
* ``ROUGE1-ER@K = |W(E_priv) ∩ W(E^K)| / |W(E_priv)|``
* ``Span-ER@K   = (1/M) Σ_m |T(P_m) ∩ E^K| / |T(P_m)|`` (spans without content tokens skipped)
* ``AUC@K       = (1/K) Σ_{k=1..K} Token-ER@k``
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_sdk.leakage import content_token_ids, piece_is_content, words


@dataclass(frozen=True)
class Vocabulary:
    """The two tokenizer views the metrics need."""

    tokenize: Callable[[str], list[int]]  # text -> ids, no BOS
    piece: Callable[[int], str]  # id -> token text


def evidence_ids(spans: Sequence[str], vocab: Vocabulary) -> set[int]:
    """``T(E_priv)``: the content token ids of all private-evidence spans."""
    return set().union(*(content_token_ids(span, vocab.tokenize, vocab.piece) for span in spans))


def exposed_ids(exposures: Sequence[Sequence[int]], k: int) -> set[int]:
    """``E^K``: the union of the first ``k`` ids of every step's exposure set."""
    union: set[int] = set()
    for step_ids in exposures:
        union.update(int(i) for i in list(step_ids)[:k])
    return union


def token_er(evidence_ids: set[int], exposed: set[int]) -> float:
    return len(evidence_ids & exposed) / len(evidence_ids) if evidence_ids else 0.0


def token_er_at_k(spans: Sequence[str], exposures: Sequence[Sequence[int]], k: int, vocab: Vocabulary) -> float:
    evidence = evidence_ids(spans, vocab)
    return token_er(evidence, exposed_ids(exposures, k))


def span_er_at_k(spans: Sequence[str], exposures: Sequence[Sequence[int]], k: int, vocab: Vocabulary) -> float:
    exposed = exposed_ids(exposures, k)
    recalls = [token_er(ids, exposed) for s in spans if (ids := content_token_ids(s, vocab.tokenize, vocab.piece))]
    return float(np.mean(recalls)) if recalls else 0.0


def rouge1_er_at_k(spans: Sequence[str], exposures: Sequence[Sequence[int]], k: int, vocab: Vocabulary) -> float:
    evidence_words = {w.lower() for s in spans for w in words(s) if piece_is_content(w)}
    if not evidence_words:
        return 0.0
    exposed_words = {
        w.lower() for i in exposed_ids(exposures, k) for w in words(vocab.piece(i)) if piece_is_content(w)
    }
    return len(evidence_words & exposed_words) / len(evidence_words)


def auc_at_k(spans: Sequence[str], exposures: Sequence[Sequence[int]], k: int, vocab: Vocabulary) -> float:
    evidence = evidence_ids(spans, vocab)
    if not evidence:
        return 0.0
    exposed: set[int] = set()
    total = 0.0
    for cutoff in range(1, k + 1):  # grow E^k one rank at a time
        for step_ids in exposures:
            if len(step_ids) >= cutoff:
                exposed.add(int(step_ids[cutoff - 1]))
        total += len(evidence & exposed) / len(evidence)
    return total / k


MetricFn = Callable[[Sequence[str], Sequence[Sequence[int]], int, Vocabulary], float]

#: name -> metric over (evidence spans, per-step exposure ids, K, vocabulary); all higher = more leakage
METRICS: dict[str, MetricFn] = {}


def register_metric(name: str, fn: MetricFn) -> None:
    if name in METRICS:
        raise ValueError(f"metric {name!r} is already registered")
    METRICS[name] = fn


register_metric("token_er", token_er_at_k)
register_metric("rouge1_er", rouge1_er_at_k)
register_metric("span_er", span_er_at_k)
register_metric("auc", auc_at_k)


def evidence_recall(
    spans: Sequence[str], exposures: Sequence[Sequence[int]], k: int, vocab: Vocabulary, names: Sequence[str] = ()
) -> dict[str, float]:
    """Every registered metric (or ``names``) at cutoff ``k``, keyed ``"<name>@<k>"``."""
    chosen = names or tuple(METRICS)
    return {f"{name}@{k}": METRICS[name](spans, exposures, k, vocab) for name in chosen}
