"""DecodeLeak private-evidence recall metrics over a cloud observation trace.

Notation (paper, section "Private Evidence Recall"): ``E_t^K`` is the top-K
exposure set of step ``t`` and ``E^K = U_t E_t^K``; ``T(.)`` gives content
token ids and ``W(.)`` content words.  With private-evidence spans
``P_1..P_M``:

* ``Token-ER@K  = |T(E_priv) ∩ E^K| / |T(E_priv)|``
* ``ROUGE1-ER@K = |W(E_priv) ∩ W(E^K)| / |W(E_priv)|``
* ``Span-ER@K   = (1/M) Σ_m |T(P_m) ∩ E^K| / |T(P_m)|`` (spans without content tokens skipped)
* ``AUC@K       = (1/K) Σ_{k=1..K} Token-ER@k``

Each metric is 0 when its denominator is empty.  ``compat="paper"`` (the
default) reads ``T``, ``W``, ``E^K`` and ``W(E^K)`` as
:mod:`eval_harness.metrics.paper` defines them; ``compat="release"`` as the
authors' ``evaluate_leakage.py`` does (:mod:`eval_harness.metrics.release`).
A ``K`` larger than the trace's recorded cutoff raises ``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from edge_sdk.privacy.meter import ExposureTrace
from edge_sdk.registry import Registry
from eval_harness.metrics import paper, release
from eval_harness.metrics.rules import Evidence, Rules
from eval_harness.metrics.vocabulary import Vocabulary

Compat = Literal["paper", "release"]
RULES: dict[str, Rules] = {"paper": paper, "release": release}  # type: ignore[dict-item]


def _rules(compat: str) -> Rules:
    try:
        return RULES[compat]
    except KeyError:
        raise ValueError(f"compat must be one of {', '.join(RULES)}; got {compat!r}") from None


def _trace(trace: object) -> ExposureTrace:
    if not isinstance(trace, ExposureTrace):
        raise TypeError(f"the metrics read an ExposureTrace (per-step ids and the k they were recorded at), "
                        f"got {type(trace).__name__}; build one with ExposureTrace(k, steps)")
    return trace


def evidence(spans: Sequence[str], vocab: Vocabulary, *, public_query: str = "", compat: Compat = "paper") -> Evidence:
    """One item's evidence: ``T(E_priv)``, each span's ``T(P_m)``, ``W(E_priv)`` and their counts."""
    return _rules(compat).evidence(tuple(spans), public_query, vocab)


def evidence_ids(spans: Sequence[str], vocab: Vocabulary, *, public_query: str = "",
                 compat: Compat = "paper") -> set[int]:
    """``T(E_priv)``: the content token ids of the private-evidence spans."""
    return set(evidence(spans, vocab, public_query=public_query, compat=compat).tokens)


def evidence_counts(spans: Sequence[str], vocab: Vocabulary, *, public_query: str = "",
                    compat: Compat = "paper") -> dict[str, int]:
    """The evidence counts for a result row: ``evidence_tokens``, ``evidence_words``, ``evidence_spans``,
    ``public_spans`` and ``empty_spans``."""
    return evidence(spans, vocab, public_query=public_query, compat=compat).row()


def exposed_ids(trace: ExposureTrace, k: int) -> set[int]:
    """``E^k``: the union of every step's first ``k`` ids."""
    return set(_trace(trace).exposed(k))


class RecallCase:
    """One item's evidence against one trace under one rule set: built once, read at any ``K <= trace.k``."""

    def __init__(self, spans: Sequence[str], trace: ExposureTrace, vocab: Vocabulary, *, public_query: str = "",
                 compat: Compat = "paper") -> None:
        self.rules = _rules(compat)
        self.compat = compat
        self.trace = _trace(trace)
        self.vocab = vocab
        self.evidence = self.rules.evidence(tuple(spans), public_query, vocab)
        self._ranks: dict[int, dict[int, int]] = {}  # depth → token ranks on the trace cut to that depth

    def token_ranks(self, k: int) -> dict[int, int]:
        """Each exposed id → its rank as a metric at cutoff ``k`` reads it (on the trace cut to the rules' depth)."""
        depth = self.rules.depth(self.trace, self.trace.check(k))
        if (ranks := self._ranks.get(depth)) is None:
            cut = self.trace if depth == self.trace.k else self.trace.truncated(depth)
            ranks = self._ranks[depth] = self.rules.token_ranks(cut, self.vocab)
        return ranks

    @functools.cached_property
    def word_cutoffs(self) -> dict[str, int]:
        """Each evidence word the cloud can read off the trace → the smallest ``k`` at which it can."""
        return self.rules.word_cutoffs(self.evidence.words, self.trace, self.vocab)

    def recall(self, ids: Iterable[int], k: int) -> float:
        """``|ids ∩ E^k| / |ids|`` (0 for no ids)."""
        ids = list(ids)
        ranks = self.token_ranks(k)
        if not ids:
            return 0.0
        return sum(1 for i in ids if ranks.get(i, k + 1) <= k) / len(ids)


MetricFn = Callable[[RecallCase, int], float]

#: name → metric over (a :class:`RecallCase`, K); every metric is a recall in [0, 1], higher = more leakage
METRICS: Registry[MetricFn] = Registry("metric")
#: name → how tables and figures write the metric ("Token-ER"), given when it is registered
METRIC_LABELS: dict[str, str] = {}


def register_metric(name: str, fn: MetricFn, label: str | None = None) -> MetricFn:
    """Register ``fn(case, k)`` under ``name``, written ``label`` in tables and figures (``name`` if none)."""
    METRICS.register(name, fn)
    METRIC_LABELS[name] = label or name
    return fn


def metric(name: str, label: str) -> Callable[[MetricFn], MetricFn]:
    """Decorator form of :func:`register_metric`."""
    return lambda fn: register_metric(name, fn, label)


def metric_label(key: str) -> str:
    """How a row's metric key reads in a table or figure: ``"token_er@100"`` → ``"Token-ER@100"`` (the cutoff
    and anything after it kept); a key that names no registered metric reads as it is."""
    name, at, rest = key.partition("@")
    return METRIC_LABELS.get(name, name) + at + rest


@metric("token_er", "Token-ER")
def token_er(case: RecallCase, k: int) -> float:
    return case.recall(case.evidence.tokens, k)


@metric("span_er", "Span-ER")
def span_er(case: RecallCase, k: int) -> float:
    k = case.trace.check(k)
    recalls = [case.recall(ids, k) for ids in case.evidence.span_tokens]
    return sum(recalls) / len(recalls) if recalls else 0.0


@metric("rouge1_er", "ROUGE1-ER")
def rouge1_er(case: RecallCase, k: int) -> float:
    k = case.trace.check(k)
    words = case.evidence.words
    if not words:
        return 0.0
    cutoffs = case.word_cutoffs
    return sum(1 for w in words if cutoffs.get(w, k + 1) <= k) / len(words)


@metric("auc", "AUC")
def auc(case: RecallCase, k: int) -> float:
    k = case.trace.check(k)
    tokens = case.evidence.tokens
    if not tokens:
        return 0.0
    # Σ_{c=1..k} |T ∩ E^c| counts each id once for every cutoff c >= its rank
    ranks = case.token_ranks(k)
    hits = sum(k - ranks[i] + 1 for i in tokens if ranks.get(i, k + 1) <= k)
    return hits / (len(tokens) * k)


def _metric_at_k(name: str) -> Callable[..., float]:
    def at_k(spans: Sequence[str], trace: ExposureTrace, k: int, vocab: Vocabulary, *, public_query: str = "",
             compat: Compat = "paper") -> float:
        return METRICS.get(name)(RecallCase(spans, trace, vocab, public_query=public_query, compat=compat), k)

    at_k.__name__ = at_k.__qualname__ = f"{name}_at_k"
    at_k.__doc__ = f"The {name!r} metric of ``spans`` against ``trace`` at cutoff ``k``."
    return at_k


token_er_at_k = _metric_at_k("token_er")
span_er_at_k = _metric_at_k("span_er")
rouge1_er_at_k = _metric_at_k("rouge1_er")
auc_at_k = _metric_at_k("auc")


def evidence_recall(
    spans: Sequence[str],
    trace: ExposureTrace,
    k: int | Sequence[int],
    vocab: Vocabulary,
    names: Sequence[str] = (),
    *,
    public_query: str = "",
    compat: Compat = "paper",
) -> dict[str, float]:
    """Every registered metric (or ``names``) at cutoff ``k`` (or each of several), keyed ``"<name>@<k>"``."""
    case = RecallCase(spans, trace, vocab, public_query=public_query, compat=compat)
    ks = [k] if isinstance(k, int) else list(k)
    chosen = [METRICS.get(name) for name in names] if names else [METRICS.get(name) for name in METRICS.names()]
    labels = list(names) if names else METRICS.names()
    return {f"{label}@{cutoff}": fn(case, cutoff) for cutoff in ks for label, fn in zip(labels, chosen)}
