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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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
#: which way a metric is more private: ``"lower"``, ``"higher"``, or the value that is (a score whose best is
#: chance, as an attack's AUC is at 0.5, in the metric's own units)
Better = Literal["lower", "higher"] | float


@dataclass(frozen=True)
class MetricSpec:
    """One metric, declared once, as everything that shows it reads it: ``decodeleak report``'s tables,
    ``decodeleak plot``'s figures and ``coveil demo``.

    Attributes:
        name: the key stem: rows carry a trace metric as ``"<name>@<K>"`` (``":release"`` appended for the
            release's rules), an attack's score under ``row[field][entry]``.
        label: how tables and figures write it (``"Token-ER"``).
        fn: ``fn(case, K)`` over an exposure trace (computed for every row by the sweep), or ``None`` for a score
            an attack writes into the row's ``field``.
        better: which way is more private (:data:`Better`); the tables bold, and the demo's table marks, the
            setting that is best by it, and the figures' axes say it.
        percent: values are fractions written as percentages (else as they are).
        field, entry: where a row holds a score that is not a trace metric (``fn`` is ``None``).
        table_k: the K whose value is a column of the tables (a trace metric; ``None``: not a column).
        against_k: drawn against K in the leakage-vs-K figures (a trace metric).
        demo: a column of ``coveil demo``'s table, by both rule sets.
    """

    name: str
    label: str
    fn: MetricFn | None = None
    better: Better = "lower"
    percent: bool = True
    field: str = "metrics"
    entry: str = ""
    table_k: int | None = 100
    against_k: bool = True
    demo: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.better, float) and self.better not in ("lower", "higher"):
            raise ValueError(f"better is 'lower', 'higher' or the best value (a float), got {self.better!r}")
        if (self.fn is None) == (self.field == "metrics"):
            raise ValueError(f"metric {self.name!r}: a trace metric has a fn and no field; an attack's score a "
                             f"field and no fn")

    @property
    def column(self) -> str | None:
        """Its column in the tables: ``"<name>@<table_k>"`` for a trace metric, ``name`` for an attack's score;
        ``None`` when it has none."""
        if self.fn is None:
            return self.name
        return None if self.table_k is None else f"{self.name}@{self.table_k}"

    def value(self, row: Mapping[str, Any], key: str, suffix: str = "") -> float | None:
        """The value of column ``key`` (``"<name>@<K>"`` or ``name``) in a result row, ``None`` if it has none;
        ``suffix`` picks a trace metric's rule set (``""`` or ``":release"``)."""
        if self.fn is not None:
            value = row["metrics"].get(key + suffix)
        else:
            value = (row.get(self.field) or {}).get(self.entry)
        return None if value is None else float(value)

    @property
    def scale(self) -> float:
        """What a value is multiplied by to be written (100 for a percentage)."""
        return 100.0 if self.percent else 1.0

    def direction(self) -> str:
        """How an axis or a caption says which way is more private: ``"lower is more private"``."""
        if isinstance(self.better, float):
            return f"nearer {self.scale * self.better:g} is more private"
        return f"{self.better} is more private"

    def best(self, values: Sequence[float | None]) -> set[int]:
        """The indices of the most private of ``values`` by :attr:`better` (every one tied with it); ``None``
        and NaN are never best."""
        present = {i: float(v) for i, v in enumerate(values) if v is not None and v == v}
        if not present:
            return set()
        if self.better == "lower":
            cost = present
        elif self.better == "higher":
            cost = {i: -v for i, v in present.items()}
        else:
            cost = {i: abs(v - float(self.better)) for i, v in present.items()}
        least = min(cost.values())
        return {i for i, c in cost.items() if c == least}


#: name → ``fn(case, K)`` of every trace metric (what the sweep computes for every row)
METRICS: Registry[MetricFn] = Registry("metric")
#: name → :class:`MetricSpec` of every metric, trace metrics and attacks' scores, in the order reports show them
METRIC_SPECS: dict[str, MetricSpec] = {}


def register_spec(spec: MetricSpec) -> MetricSpec:
    """Declare ``spec``: its ``fn`` (if any) joins :data:`METRICS`, and the tables, figures and demo show it as
    it says.  A name taken by a different spec raises ``ValueError``."""
    existing = METRIC_SPECS.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"a metric named {spec.name!r} is already registered ({existing!r})")
    if spec.fn is not None:
        METRICS.register(spec.name, spec.fn)
    METRIC_SPECS[spec.name] = spec
    return spec


def register_metric(name: str, fn: MetricFn, label: str | None = None, **shown: Any) -> MetricFn:
    """Register the trace metric ``fn(case, k)`` under ``name``, written ``label`` (``name`` if none); ``shown``:
    the other :class:`MetricSpec` fields (``better``, ``table_k``, ``against_k``, ``demo``, ``percent``)."""
    register_spec(MetricSpec(name, label or name, fn=fn, **shown))
    return fn


def metric(name: str, label: str, **shown: Any) -> Callable[[MetricFn], MetricFn]:
    """Decorator form of :func:`register_metric`."""
    return lambda fn: register_metric(name, fn, label, **shown)


def metric_spec(key: str) -> MetricSpec | None:
    """The spec a column key names (``"token_er@100"``, ``"span_er@5:release"``, ``"inversion_recall"``), or
    ``None``."""
    return METRIC_SPECS.get(key.partition("@")[0])


def metric_scale(key: str) -> float:
    """What a column's values are multiplied by to be written: its spec's :attr:`MetricSpec.scale`, 100 (a
    percentage) for a key without a spec."""
    spec = metric_spec(key)
    return 100.0 if spec is None else spec.scale


def metric_label(key: str) -> str:
    """How a row's metric key reads in a table or figure: ``"token_er@100"`` → ``"Token-ER@100"`` (the cutoff
    and anything after it kept); a key that names no registered metric reads as it is."""
    name, at, rest = key.partition("@")
    spec = METRIC_SPECS.get(name)
    return (spec.label if spec is not None else name) + at + rest


def table_columns() -> tuple[str, ...]:
    """The trace metrics' table columns (``"<name>@<table_k>"``), in registration order."""
    return tuple(spec.column for spec in METRIC_SPECS.values() if spec.fn is not None and spec.column)


def attack_columns(field: str) -> tuple[str, ...]:
    """The columns of the scores an attack writes into a row's ``field`` (``"inversion"``, ``"observer"``)."""
    return tuple(spec.name for spec in METRIC_SPECS.values() if spec.fn is None and spec.field == field)


def k_metrics() -> tuple[str, ...]:
    """The trace metrics the leakage-vs-K figures draw, in registration order."""
    return tuple(spec.name for spec in METRIC_SPECS.values() if spec.fn is not None and spec.against_k)


def demo_metrics() -> tuple[str, ...]:
    """The trace metrics ``coveil demo`` reports (by both rule sets), in registration order."""
    return tuple(spec.name for spec in METRIC_SPECS.values() if spec.fn is not None and spec.demo)


@metric("token_er", "Token-ER", demo=True)
def token_er(case: RecallCase, k: int) -> float:
    return case.recall(case.evidence.tokens, k)


@metric("rouge1_er", "ROUGE1-ER")
def rouge1_er(case: RecallCase, k: int) -> float:
    k = case.trace.check(k)
    words = case.evidence.words
    if not words:
        return 0.0
    cutoffs = case.word_cutoffs
    return sum(1 for w in words if cutoffs.get(w, k + 1) <= k) / len(words)


@metric("span_er", "Span-ER", demo=True)
def span_er(case: RecallCase, k: int) -> float:
    k = case.trace.check(k)
    recalls = [case.recall(ids, k) for ids in case.evidence.span_tokens]
    return sum(recalls) / len(recalls) if recalls else 0.0


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


# the attacks' scores: each row's attack writes them (``row["inversion"]``, ``row["observer"]``), the reports read
# them as these specs say (eval_harness.attacks.inversion, eval_harness.attacks.observer)
register_spec(MetricSpec("inversion_recall", "inversion ROUGE-1 recall", field="inversion", entry="recall"))
register_spec(MetricSpec("inversion_f1", "inversion ROUGE-1 F1", field="inversion", entry="f1"))
register_spec(MetricSpec("observer_sizes_apart", "observer: sizes told apart", field="observer", entry="sizes_apart"))
register_spec(MetricSpec("observer_timing_auc", "observer: timing AUC", better=0.5, field="observer",
                         entry="timing_auc"))
register_spec(MetricSpec("observer_cloud_timing_auc", "cloud's clock: timing AUC", better=0.5, field="observer",
                         entry="cloud_timing_auc"))


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
