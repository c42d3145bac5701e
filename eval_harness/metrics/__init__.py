"""DecodeLeak metrics: private-evidence recall (Token-ER, ROUGE1-ER, Span-ER, AUC) over an exposure trace.

:mod:`~eval_harness.metrics.leakage` holds the metrics and their registry (a :class:`MetricSpec` per metric,
which the tables, the figures and ``coveil demo`` read);
:mod:`~eval_harness.metrics.paper` and :mod:`~eval_harness.metrics.release`
the two rule sets (``compat="paper"``, the default, and ``compat="release"``).
"""

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.metrics.rules import Evidence
from eval_harness.metrics.leakage import (
    METRIC_SPECS,
    METRICS,
    Compat,
    MetricFn,
    MetricSpec,
    RecallCase,
    attack_columns,
    auc,
    auc_at_k,
    evidence,
    evidence_counts,
    evidence_ids,
    evidence_recall,
    exposed_ids,
    demo_metrics,
    k_metrics,
    metric,
    metric_label,
    metric_spec,
    register_metric,
    register_spec,
    rouge1_er,
    rouge1_er_at_k,
    span_er,
    span_er_at_k,
    table_columns,
    token_er,
    token_er_at_k,
)
from eval_harness.metrics.vocabulary import Vocabulary

__all__ = [
    "METRICS",
    "METRIC_SPECS",
    "Compat",
    "Evidence",
    "ExposureTrace",
    "MetricFn",
    "MetricSpec",
    "RecallCase",
    "Vocabulary",
    "attack_columns",
    "auc",
    "auc_at_k",
    "demo_metrics",
    "evidence",
    "evidence_counts",
    "evidence_ids",
    "evidence_recall",
    "exposed_ids",
    "k_metrics",
    "metric",
    "metric_label",
    "metric_spec",
    "register_metric",
    "register_spec",
    "rouge1_er",
    "rouge1_er_at_k",
    "span_er",
    "span_er_at_k",
    "table_columns",
    "token_er",
    "token_er_at_k",
]
