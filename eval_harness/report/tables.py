"""The paper's tables from result rows: one line per (task, mode, policy, parameters), with item counts and
bootstrap confidence intervals for the leakage metrics.

The columns are the registered metrics' (:class:`~eval_harness.metrics.leakage.MetricSpec`): each trace metric at
its ``table_k``, and each attack's scores where the rows carry them; in the Markdown tables the most private
setting of each (task, mode) is bold in every metric column, by the metric's ``better``.
Reads rows only (``decodeleak sweep``'s JSONL); imports numpy and nothing of the models.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eval_harness.metrics.leakage import attack_columns, metric_label, metric_scale, metric_spec, table_columns

#: the attacks whose scores a row may carry, by the row field each writes (eval_harness.attacks)
ATTACK_FIELDS = ("inversion", "observer")
BOOTSTRAP_RESAMPLES = 1000


def bootstrap_interval(values: Sequence[float], *, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values`` (``BOOTSTRAP_RESAMPLES`` resamples)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(BOOTSTRAP_RESAMPLES, data.size))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass
class Line:
    """One table line: a setting over its items (``alpha``: the LLM's fusion weight, ``None`` if unrecorded)."""

    task: str
    mode: str
    policy: str
    params: str
    alpha: float | None = None
    items: int = 0
    correct: list[bool] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    #: each item's epsilon ledger (``row["privacy"]``; rows written before it have none)
    privacy: list[Mapping[str, Any]] = field(default_factory=list)

    def count(self, metric: str) -> int:
        """How many of the line's items recorded ``metric`` (inversion may run on a subset)."""
        return len(self.values.get(metric, []))

    def mean(self, metric: str) -> float:
        values = self.values.get(metric, [])
        return float(np.mean(values)) if values else float("nan")


def lines(rows: Iterable[Mapping[str, Any]], metrics: Sequence[str] | None = None, *,
          suffix: str = "") -> list[Line]:
    """Rows grouped by (task, mode, policy, parameters, alpha), in first-seen order, with the values of
    ``metrics`` (column keys; default :func:`~eval_harness.metrics.leakage.table_columns`).

    ``suffix`` picks the rule set of the trace metrics: ``""`` for the paper's, ``":release"`` for the release's.
    An attack's scores come from the row field its spec names (rows without one add nothing).
    """
    metrics = table_columns() if metrics is None else metrics
    specs = [metric_spec(metric) for metric in metrics]
    grouped: dict[tuple[str, str, str, str, float | None], Line] = {}
    for row in rows:
        params = json.dumps(row.get("params", {}), sort_keys=True)
        key = (row["task"], row["mode"], row["policy"], params, row.get("alpha"))
        line = grouped.setdefault(key, Line(*key))
        line.items += 1
        line.correct.append(bool(row["correct"]))
        if row.get("privacy"):
            line.privacy.append(row["privacy"])
        for metric, spec in zip(metrics, specs):
            value = spec.value(row, metric, suffix) if spec is not None else row["metrics"].get(metric + suffix)
            if value is not None:
                line.values.setdefault(metric, []).append(float(value))
    return list(grouped.values())


def metrics_recorded(rows: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The metric columns for ``rows``: every trace metric's (:func:`~eval_harness.metrics.leakage.table_columns`),
    then each attack's scores (:data:`ATTACK_FIELDS`) if any row has them."""
    rows = list(rows)
    return table_columns() + tuple(column for field in ATTACK_FIELDS if any(row.get(field) for row in rows)
                                   for column in attack_columns(field))


def best_cells(grouped: Sequence[Line], metrics: Sequence[str]) -> set[tuple[int, str]]:
    """``(line index, metric)`` of the most private line of each (task, mode) in each metric column, by the
    metric's :attr:`~eval_harness.metrics.leakage.MetricSpec.better` (every tied one; none for a metric without a
    spec, or a group of one line)."""
    best: set[tuple[int, str]] = set()
    groups: dict[tuple[str, str], list[int]] = {}
    for index, line in enumerate(grouped):
        groups.setdefault((line.task, line.mode), []).append(index)
    for members in groups.values():
        for metric in metrics:
            spec = metric_spec(metric)
            means = [grouped[i].mean(metric) if grouped[i].values.get(metric) else None for i in members]
            if spec is None or sum(mean is not None for mean in means) < 2:
                continue
            best |= {(members[j], metric) for j in spec.best(means)}
    return best


def _estimate(line: Line, metric: str, seed: int) -> tuple[float, float, float, int] | None:
    """``(mean, low, high, n)`` of ``metric`` over the line's items that recorded it, in percent for a percentage
    (95% bootstrap interval); ``None`` when none did."""
    values = line.values.get(metric, [])
    if not values:
        return None
    low, high = bootstrap_interval(values, seed=seed)
    scale = metric_scale(metric)
    return scale * line.mean(metric), scale * low, scale * high, len(values)


def _cell(line: Line, metric: str, seed: int, *, best: bool = False) -> str:
    """``mean [low, high]`` in percent (95% bootstrap interval), ``n=`` when fewer items than the line's; the mean
    bold (``**mean**``) when ``best``."""
    estimate = _estimate(line, metric, seed)
    if estimate is None:
        return "-"
    mean, low, high, n = estimate
    count = "" if n == line.items else f" n={n}"
    shown = f"**{mean:.1f}**" if best else f"{mean:.1f}"
    return f"{shown} [{low:.1f}, {high:.1f}]{count}"


#: decimals of a percentage in the CSV tables (what a bootstrap over ~100 items can resolve, and more)
CSV_DECIMALS = 4


def _numbers(line: Line, metric: str, seed: int) -> dict[str, float | int | None]:
    """``metric``'s CSV columns: ``metric`` (the mean), ``metric_lo``/``metric_hi`` (its 95% bootstrap interval),
    all in percent, and ``metric_n`` (items that recorded it); empty (``None``, 0 items) when none did."""
    estimate = _estimate(line, metric, seed)
    mean, low, high, n = (None, None, None, 0) if estimate is None else estimate
    rounded = [None if v is None else round(v, CSV_DECIMALS) for v in (mean, low, high)]
    return dict(zip((metric, f"{metric}_lo", f"{metric}_hi", f"{metric}_n"), (*rounded, n)))


def _epsilon_numbers(line: Line) -> dict[str, Any]:
    """The epsilon the line's generations spent, for CSV: ``epsilon_spent`` (the mean over the items that
    recorded it), ``epsilon_delta`` (the ledgers' delta; several joined by ``;``), ``epsilon_n`` (those items)
    and ``guarantee`` (``dp``, ``non-private`` for a policy with no DP guarantee, empty when no row recorded a
    ledger; the numbers are empty unless ``dp``)."""
    if not line.privacy or any(p["guarantee"] != "dp" for p in line.privacy):
        guarantee = "non-private" if line.privacy else None
        return {"epsilon_spent": None, "epsilon_delta": None, "epsilon_n": 0, "guarantee": guarantee}
    spent = [float(p["epsilon_spent"]) for p in line.privacy]
    deltas = sorted({float(p["delta"]) for p in line.privacy})
    return {"epsilon_spent": float(np.mean(spent)), "epsilon_delta": ";".join(f"{d:g}" for d in deltas),
            "epsilon_n": len(spent), "guarantee": "dp"}


def _epsilon(line: Line) -> str:
    """The epsilon the line's generations spent (:func:`_epsilon_numbers`) as a cell: the mean at the ledger's
    delta; "non-private" for a policy with no DP guarantee; ``-`` when no row recorded it."""
    numbers = _epsilon_numbers(line)
    if numbers["guarantee"] != "dp":
        return numbers["guarantee"] or "-"
    count = "" if numbers["epsilon_n"] == line.items else f" n={numbers['epsilon_n']}"
    return f"{numbers['epsilon_spent']:.4g} (delta {numbers['epsilon_delta'].replace(';', ', ')}){count}"


def _alpha(line: Line) -> str:
    return "" if line.alpha is None else f"{line.alpha:g}"


def table(rows: Iterable[Mapping[str, Any]], *, metrics: Sequence[str] | None = None, suffix: str = "",
          seed: int = 0) -> list[dict[str, str]]:
    """The table as cells: each metric cell (``metrics``, default the trace metrics' table columns) is
    ``mean [low, high]`` in percent (95% bootstrap interval), followed by ``n=`` its item count when that is
    fewer than the line's ``items``; the most private mean of each (task, mode) bold (:func:`best_cells`)."""
    metrics = table_columns() if metrics is None else metrics
    grouped = lines(rows, metrics, suffix=suffix)
    best = best_cells(grouped, metrics)
    out = []
    for index, line in enumerate(grouped):
        cells = {"task": line.task, "mode": line.mode, "policy": line.policy,
                 "params": ", ".join(f"{k}={v}" for k, v in json.loads(line.params).items()),
                 "alpha": _alpha(line), "items": str(line.items), "accuracy": f"{100 * np.mean(line.correct):.1f}",
                 "epsilon_spent": _epsilon(line)}
        cells.update({metric: _cell(line, metric, seed, best=(index, metric) in best) for metric in metrics})
        out.append(cells)
    return out


def table_numbers(rows: Iterable[Mapping[str, Any]], *, metrics: Sequence[str] | None = None, suffix: str = "",
                  seed: int = 0) -> list[dict[str, Any]]:
    """:func:`table` as numbers, for CSV, every column the Markdown table has: the line's fields, ``items``,
    ``accuracy`` (%), the epsilon spent (:func:`_epsilon_numbers`) and for each metric its mean, ``_lo``, ``_hi``
    (%, 95% bootstrap interval) and ``_n`` (items that recorded it) columns (:func:`_numbers`)."""
    metrics = table_columns() if metrics is None else metrics
    out = []
    for line in lines(rows, metrics, suffix=suffix):
        numbers: dict[str, Any] = {"task": line.task, "mode": line.mode, "policy": line.policy,
                                   "params": ", ".join(f"{k}={v}" for k, v in json.loads(line.params).items()),
                                   "alpha": line.alpha, "items": line.items,
                                   "accuracy": round(100 * float(np.mean(line.correct)), CSV_DECIMALS),
                                   **_epsilon_numbers(line)}
        for metric in metrics:
            numbers.update(_numbers(line, metric, seed))
        out.append(numbers)
    return out


def _undefended_columns() -> tuple[str, ...]:
    """The undefended table's metric columns: the trace metrics', then the inversion's (the paper's Table 1)."""
    return table_columns() + attack_columns("inversion")


def undefended_numbers(rows: Iterable[Mapping[str, Any]], *, suffix: str = "", seed: int = 0) -> list[dict[str, Any]]:
    """:func:`undefended_table` as numbers, for CSV (columns as in :func:`table_numbers`)."""
    out = []
    metrics = _undefended_columns()
    for line in lines([row for row in rows if row["policy"] == "undefended"], metrics, suffix=suffix):
        numbers: dict[str, Any] = {"task": line.task, "fusion": f"{line.mode}-side", "alpha": line.alpha,
                                   "items": line.items,
                                   "accuracy": round(100 * float(np.mean(line.correct)), CSV_DECIMALS)}
        for metric in metrics:
            numbers.update(_numbers(line, metric, seed))
        out.append(numbers)
    return out


def undefended_table(rows: Iterable[Mapping[str, Any]], *, suffix: str = "", seed: int = 0) -> list[dict[str, str]]:
    """The paper's undefended DecodeLeak table (its Table 1): one line per (task, fusion mode).

    Accuracy, Token/ROUGE1/Span-ER@100 and AUC@100, and the inversion's ROUGE-1 recall and F1, over the
    ``undefended`` rows; cells as in :func:`table` (``-`` where a metric was not recorded).
    """
    undefended = [row for row in rows if row["policy"] == "undefended"]
    out = []
    metrics = _undefended_columns()
    for line in lines(undefended, metrics, suffix=suffix):
        cells = {"task": line.task, "fusion": f"{line.mode}-side", "alpha": _alpha(line), "items": str(line.items),
                 "accuracy": f"{100 * np.mean(line.correct):.1f}"}
        cells.update({metric: _cell(line, metric, seed) for metric in metrics})
        out.append(cells)
    return out


def markdown(cells: Sequence[Mapping[str, str]], title: str = "") -> str:
    """A Markdown table of :func:`table`'s cells."""
    if not cells:
        return f"{title}\n\n(no rows)\n" if title else "(no rows)\n"
    columns = list(cells[0])
    head = "| " + " | ".join(metric_label(c) for c in columns) + " |\n|" + "|".join("---" for _ in columns) + "|\n"
    body = "".join("| " + " | ".join(row[c] for c in columns) + " |\n" for row in cells)
    return (f"{title}\n\n" if title else "") + head + body


def csv_text(cells: Sequence[Mapping[str, Any]]) -> str:
    """CSV of :func:`table_numbers`-like rows under one header (``None`` is an empty cell)."""
    if not cells:
        return ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(cells[0]))
    writer.writeheader()
    writer.writerows(cells)
    return buffer.getvalue()
