"""DecodeLeak metrics: private-evidence recall (Token-ER, ROUGE1-ER, Span-ER, AUC) over an exposure trace.

:mod:`~eval_harness.metrics.leakage` holds the metrics and their registry;
:mod:`~eval_harness.metrics.paper` and :mod:`~eval_harness.metrics.release`
the two rule sets (``compat="paper"``, the default, and ``compat="release"``).
"""

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.metrics.rules import Evidence
from eval_harness.metrics.leakage import (
    METRIC_LABELS,
    METRICS,
    Compat,
    MetricFn,
    RecallCase,
    auc,
    auc_at_k,
    evidence,
    evidence_counts,
    evidence_ids,
    evidence_recall,
    exposed_ids,
    metric,
    metric_label,
    register_metric,
    rouge1_er,
    rouge1_er_at_k,
    span_er,
    span_er_at_k,
    token_er,
    token_er_at_k,
)
from eval_harness.metrics.vocabulary import Vocabulary

__all__ = [
    "METRIC_LABELS",
    "METRICS",
    "Compat",
    "Evidence",
    "ExposureTrace",
    "MetricFn",
    "RecallCase",
    "Vocabulary",
    "auc",
    "auc_at_k",
    "evidence",
    "evidence_counts",
    "evidence_ids",
    "evidence_recall",
    "exposed_ids",
    "metric",
    "metric_label",
    "register_metric",
    "rouge1_er",
    "rouge1_er_at_k",
    "span_er",
    "span_er_at_k",
    "token_er",
    "token_er_at_k",
]
