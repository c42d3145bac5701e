"""Privacy-utility figures from result rows (the paper's trade-off plots): reads rows only.

One figure per fusion mode, one panel per leakage metric the rows recorded: accuracy against the metric, every method of the
mode as one curve over its swept parameter, the undefended point marked, one figure per task.  Labels name
the swept value at each end of a curve only, placed where they cover no other label, marker or curve
(:func:`place_labels`).

Leakage against K (:func:`leakage_vs_k`, :func:`leakage_vs_k_methods`) and CoVeil's per-step mechanism
(:func:`mechanism_cloud`, :func:`mechanism_edge`, :func:`rank_bins`; the rows' ``mechanism`` field, pooled
over steps) follow the paper's "Sensitivity Analysis".  Legends sit outside the axes or in a free corner.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eval_harness.metrics.leakage import (attack_columns, k_metrics, metric_label, metric_scale, metric_spec,
                                          table_columns)
from eval_harness.report.tables import lines


def _panel_grid(panels: int, size: tuple[float, float]) -> tuple[Any, Any]:
    """A figure of ``panels`` axes, two per row, each ``size`` inches; the grid's spare axes hidden."""
    plt = _pyplot()
    columns = min(2, panels)
    rows_n = -(-panels // columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(size[0] * columns, size[1] * rows_n), squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, axes


def _swept(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


#: each method's marker and line style in the trade-off figures, in order of first appearance: two methods whose
#: points coincide still show both (hollow markers of different shapes, different dashes)
METHOD_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "<", ">")
METHOD_LINESTYLES = ("-", "--", "-.", ":")
#: the narrowest accuracy range (percentage points) an accuracy axis spans: a constant accuracy is a line
#: in the middle of a 0-100 ruler, not a range of a hundredth of a point around it
ACCURACY_SPAN = 20.0


def _method_style(index: int) -> dict[str, Any]:
    """The ``index``-th method's marker, line style and marker size (earlier methods' markers a little larger,
    so a later one drawn on the same point sits inside it)."""
    return {"marker": METHOD_MARKERS[index % len(METHOD_MARKERS)], "markersize": 7 - (index % 3),
            "linestyle": METHOD_LINESTYLES[index % len(METHOD_LINESTYLES)], "markerfacecolor": "none",
            "markeredgewidth": 1.4}


def accuracy_limits(values: Sequence[float]) -> tuple[float, float]:
    """The y-limits (%) of an accuracy axis over ``values``: at least :data:`ACCURACY_SPAN` points wide around
    them, 12% of that as margin (room for end labels), never more than 3 points past 0 or 100 (what a marker
    drawn at 0% or 100% needs); :func:`_accuracy_axis` draws no tick below 0% or above 100%."""
    low, high = (min(values), max(values)) if values else (0.0, 100.0)
    span = max(high - low, ACCURACY_SPAN)
    centre = (low + high) / 2
    low, high = min(low, centre - span / 2), max(high, centre + span / 2)
    if low < 0:
        low, high = 0.0, high - low
    if high > 100:
        low, high = max(0.0, low - (high - 100)), 100.0
    margin = 0.12 * (high - low)
    return max(low - margin, -3.0), min(high + margin, 103.0)


def _accuracy_axis(ax: Any, values: Sequence[float]) -> None:
    """Set ``ax``'s y-axis to :func:`accuracy_limits` of ``values``, ticks only within 0-100%."""
    from matplotlib.ticker import MaxNLocator

    low, high = accuracy_limits(values)
    ax.set_ylim(low, high)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= 100 and low <= t <= high])


def coinciding(curves: Mapping[str, Sequence[tuple[float, float]]]) -> dict[str, str]:
    """For each curve whose points are exactly an earlier curve's (same points, rounded to 1e-6), that earlier
    curve's name: ``{later: earlier}``.  Drawn on top of each other, the later would hide the earlier."""
    seen: dict[tuple[tuple[float, float], ...], str] = {}
    same: dict[str, str] = {}
    for name, points in curves.items():
        key = tuple(sorted((round(x, 6), round(y, 6)) for x, y in points))
        if key and key in seen:
            same[name] = seen[key]
        else:
            seen.setdefault(key, name)
    return same


def _coincide_note(name: str, same: Mapping[str, str]) -> str:
    """``name``, and the earlier curve it hides (its label up to any parenthesis) when there is one."""
    return f"{name} (coincides with {same[name].split(' (')[0]})" if name in same else name


def axis_label(metric: str) -> str:
    """How an axis names a metric column: its label, its unit and which way is more private
    (``"Token-ER@100 (%), lower is more private"``)."""
    spec = metric_spec(metric)
    if spec is None:
        return f"{metric} (%)"
    return f"{metric_label(metric)}{' (%)' if spec.percent else ''}, {spec.direction()}"


def privacy_utility_figure(rows: Iterable[Mapping[str, Any]], task: str, mode: str, *,
                           metrics: Sequence[str] | None = None, suffix: str = "") -> Any:
    """The paper's privacy-utility panels for one task and fusion mode: accuracy (%) against each leakage metric
    the rows recorded (%, at K = 100), every method a curve through its settings in order of leakage, the
    undefended point a black star; each curve's two ends are labelled by :func:`place_labels` (no label over
    another, over a marker or a curve), the legend sits outside the axes.  ``metrics``: the registered trace
    metrics' table columns by default."""
    metrics = table_columns() if metrics is None else metrics
    grouped = [line for line in lines(rows, metrics, suffix=suffix) if line.task == task and line.mode == mode]
    # only the metrics the rows recorded: an empty panel would show axes of nothing
    shown = [m for m in metrics if any(line.values.get(m) for line in grouped)]
    fig, axes = _panel_grid(len(shown), (5.6, 4.4))
    ends: dict[int, list[tuple[float, float, str, Any]]] = {}
    methods = [policy for policy in dict.fromkeys(line.policy for line in grouped) if policy != "undefended"]
    drawn: dict[str, list[tuple[float, float]]] = {policy: [] for policy in methods}  # every panel's points
    accuracies = [100 * sum(line.correct) / len(line.correct) for line in grouped]
    for n, (ax, metric) in enumerate(zip(axes.flat, shown)):
        for policy in dict.fromkeys(line.policy for line in grouped):
            points = [line for line in grouped if line.policy == policy and line.values.get(metric)]
            xs = [metric_scale(metric) * p.mean(metric) for p in points]
            ys = [100 * sum(p.correct) / len(p.correct) for p in points]
            if policy == "undefended":
                ax.scatter(xs, ys, marker="*", s=160, color="black", zorder=3, label="undefended")
                continue
            order = sorted(range(len(points)), key=lambda i: xs[i])
            drawn[policy] += [(n * 1e3 + xs[i], ys[i]) for i in order]  # offset by panel: panels never meet
            (line_art,) = ax.plot([xs[i] for i in order], [ys[i] for i in order], label=policy,
                                  **_method_style(methods.index(policy)))
            for end in dict.fromkeys((order[0], order[-1])):
                ends.setdefault(n, []).append((xs[end], ys[end], _swept(json.loads(points[end].params)),
                                               line_art.get_color()))
        ax.set_xlabel(axis_label(metric))
        ax.set_ylabel("accuracy (%)")
        ax.margins(x=0.15)  # room for the end labels inside the frame
        _accuracy_axis(ax, accuracies)
        ax.grid(alpha=0.3)
    same = coinciding(drawn)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    labels = [_coincide_note(label, same) for label in labels]
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    items = max((line.items for line in grouped), default=0)
    fig.suptitle(f"{task}, {mode}-side fusion: privacy-utility trade-off ({items} items per point)")
    fig.tight_layout()
    fig.canvas.draw()  # final limits and layout before the labels are placed
    for n, ax in enumerate(axes.flat[:len(shown)]):
        place_labels(ax, ends.get(n, []))
    return fig


def privacy_utility(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, metrics: Sequence[str] | None = None,
                    suffix: str = "") -> list[Path]:
    """Write ``privacy_utility_<mode>`` (``_<task>`` added when the rows hold several tasks) as PNG and PDF for
    each (task, fusion mode) in ``rows`` (:func:`privacy_utility_figure`); return the paths."""
    return _save_each_figure(rows, out_dir, "privacy_utility", lambda group, task, mode: privacy_utility_figure(
        group, task, mode, metrics=metrics, suffix=suffix))


def _save_each_figure(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, name: str,
                      make: Callable[[list[Mapping[str, Any]], str, str], Any | None]) -> list[Path]:
    """``make(rows of one (task, mode), task, mode)`` for each (task, fusion mode) in ``rows``, saved as
    ``<name>_<mode>`` (``_<task>`` added when the rows hold several tasks) unless it returned ``None``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_figure(list(rows))
    tasks = len({task for task, _ in groups})
    written: list[Path] = []
    for task, mode in groups:
        fig = make(groups[task, mode], task, mode)
        if fig is not None:
            written += save_figure(fig, out, _stem(name, task, mode, tasks))
    return written


def epsilon_spent(line: Any) -> float | None:
    """The mean epsilon a line's generations spent (its rows' ``privacy``), ``None`` unless every row recorded
    one with a DP guarantee."""
    if len(line.privacy) != line.items or any(p["guarantee"] != "dp" for p in line.privacy):
        return None
    return float(np.mean([p["epsilon_spent"] for p in line.privacy]))


def privacy_utility_epsilon_figure(rows: Iterable[Mapping[str, Any]], task: str, mode: str, *,
                                   metrics: Sequence[str] | None = None, suffix: str = "") -> Any | None:
    """Leakage and accuracy against the epsilon each DP baseline's generations spent (mean per setting, log
    scale), one curve per DP method of the mode: a panel per leakage metric the rows recorded (%, at K = 100),
    then accuracy (%) in its own panel on a readable axis (:func:`accuracy_limits`).  The heuristics have no
    epsilon and are left out (``None`` when no line has one).  Epsilon 0 (nothing private used) is drawn at the
    axis' left end."""
    metrics = table_columns() if metrics is None else metrics
    grouped = [line for line in lines(rows, metrics, suffix=suffix) if line.task == task and line.mode == mode]
    points = [(line, epsilon_spent(line)) for line in grouped]
    points = [(line, eps) for line, eps in points if eps is not None]
    if not points:
        return None
    shown = [m for m in metrics if any(line.values.get(m) for line, _ in points)]
    fig, axes = _panel_grid(len(shown) + 1, (5.2, 4.0))
    positive = [eps for _, eps in points if eps > 0]
    floor = min(positive) / 2 if positive else 1e-3
    policies = list(dict.fromkeys(line.policy for line, _ in points))
    panels = [(metric, axis_label(metric)) for metric in shown]
    panels.append(("accuracy", "accuracy (%)"))
    for ax, (quantity, label) in zip(axes.flat, panels):
        for n, policy in enumerate(policies):
            mine = sorted((max(eps, floor), 100 * float(np.mean(line.correct)) if quantity == "accuracy"
                           else metric_scale(quantity) * line.mean(quantity))
                          for line, eps in points if line.policy == policy)
            ax.plot([x for x, _ in mine], [y for _, y in mine], label=policy, **_method_style(n))
        ax.set_xscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if quantity == "accuracy":
            _accuracy_axis(ax, [100 * float(np.mean(line.correct)) for line, _ in points])
    deltas = sorted({float(p["delta"]) for line, _ in points for p in line.privacy})
    for ax in axes.flat[:len(panels)]:
        ax.set_xlabel(f"epsilon spent per generation (mean; delta {', '.join(f'{d:g}' for d in deltas)})")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(f"{task}, {mode}-side fusion: leakage and accuracy against epsilon spent (DP baselines only)")
    fig.tight_layout()
    return fig


def privacy_utility_epsilon(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *,
                            metrics: Sequence[str] | None = None, suffix: str = "") -> list[Path]:
    """Write ``privacy_utility_epsilon_<mode>`` (:func:`privacy_utility_epsilon_figure`) for each (task, mode)
    with a DP baseline whose rows recorded their epsilon; return the paths."""
    return _save_each_figure(rows, out_dir, "privacy_utility_epsilon", lambda group, task, mode: (
        privacy_utility_epsilon_figure(group, task, mode, metrics=metrics, suffix=suffix)))


# -- leakage against K, and CoVeil's per-step mechanism ------------------------------------------------------

#: how a swept parameter is written in a legend or on an axis
PARAM_SYMBOLS = {"lam": "λ", "epsilon": "ε", "b": "B"}
UNDEFENDED_STYLE = {"color": "black", "linestyle": "--", "marker": "*", "markersize": 9, "linewidth": 1.6}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _setting(policy: str, params: Mapping[str, Any]) -> str:
    """``"coveil λ=1.5"``: the policy and its parameters as a legend writes them."""
    values = ", ".join(f"{PARAM_SYMBOLS.get(k, k)}={v}" for k, v in params.items())
    return f"{policy} {values}".strip()


def _swept_value(params: Mapping[str, Any]) -> float:
    """The setting's (first) swept number, for ordering settings along a curve."""
    numbers = [float(v) for v in params.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return numbers[0] if numbers else float("-inf")


def _by_figure(rows: Iterable[Mapping[str, Any]],
               mode: str | None = None) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    """Rows grouped by (task, mode), in first-seen order (only ``mode`` when given)."""
    grouped: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for row in rows:
        if mode is None or row["mode"] == mode:
            grouped.setdefault((row["task"], row["mode"]), []).append(row)
    return grouped


def _stem(name: str, task: str, mode: str, tasks: int) -> str:
    """``name_mode``, or ``name_mode_task`` when the rows hold several tasks."""
    return f"{name}_{mode}" + (f"_{task}" if tasks > 1 else "")


#: what the figures saved now were derived from (:func:`figures_record`): JSON, written into each file's metadata
_RECORDED_SOURCES: ContextVar[str | None] = ContextVar("recorded_sources", default=None)
#: the metadata entry each format carries it in (PNG: a tEXt chunk; PDF: the document information's Subject)
SOURCES_METADATA_KEY = {"png": "Description", "pdf": "Subject"}


@contextlib.contextmanager
def figures_record(provenance: Mapping[str, Any]) -> Iterator[None]:
    """Within the block every figure :func:`save_figure` writes carries ``provenance`` (the files read and their
    sha256, :meth:`~eval_harness.report.runs.RunRows.provenance`) as JSON in its metadata
    (:data:`SOURCES_METADATA_KEY`)."""
    token = _RECORDED_SOURCES.set(json.dumps(provenance, sort_keys=True))
    try:
        yield
    finally:
        _RECORDED_SOURCES.reset(token)


def save_figure(fig: Any, out: Path, stem: str, *, tight: bool = True) -> list[Path]:
    """Write ``fig`` as ``<stem>.png`` and ``<stem>.pdf`` under ``out`` (cropped to its contents when ``tight``;
    the sources :func:`figures_record` names in the metadata), close it, and return the two paths."""
    written = []
    sources = _RECORDED_SOURCES.get()
    for ext in ("png", "pdf"):
        path = out / f"{stem}.{ext}"
        metadata = {} if sources is None else {"metadata": {SOURCES_METADATA_KEY[ext]: sources}}
        fig.savefig(path, dpi=130, **({"bbox_inches": "tight"} if tight else {}), **metadata)
        written.append(path)
    _pyplot().close(fig)
    return written


def _recorded_ks(rows: Sequence[Mapping[str, Any]], suffix: str) -> list[int]:
    """Every K some row gives Token-ER at (``token_er@<K><suffix>``), ascending."""
    ks = set()
    for row in rows:
        for key in row["metrics"]:
            name, _, rest = key.partition("@")
            k, _, rules = rest.partition(":")
            if name == "token_er" and k.isdigit() and (":" + rules if rules else "") == suffix:
                ks.add(int(k))
    return sorted(ks)


def _k_curves(fig_title: str, curves: Sequence[tuple[str, Any, dict[str, Any]]], ks: Sequence[int]) -> Any:
    """One panel per recall metric: each curve's mean (%) against K on a log axis; a shared legend at the right.

    ``curves``: (legend label, :class:`~eval_harness.report.tables.Line` with ``"<metric>@<K>"`` values, style).
    """
    shown = [m for m in k_metrics() if any(line.values.get(f"{m}@{k}") for _, line, _ in curves for k in ks)]
    fig, axes = _panel_grid(len(shown), (5.2, 3.9))
    values = {label: [(n * 1e4 + k, metric_scale(metric) * line.mean(f"{metric}@{k}")) for n, metric in enumerate(shown)
                      for k in ks
                      if line.values.get(f"{metric}@{k}")] for label, line, _ in curves}
    same = coinciding(values)  # a curve under another would vanish: the later is dashed, hollow, and says so
    for ax, metric in zip(axes.flat, shown):
        for label, line, style in curves:
            points = [(k, metric_scale(metric) * line.mean(f"{metric}@{k}")) for k in ks
                      if line.values.get(f"{metric}@{k}")]
            if label in same:
                style = {**style, "linestyle": (0, (4, 3)), "markerfacecolor": "none", "markersize": 8,
                         "markeredgewidth": 1.2}
            if points:
                ax.plot([k for k, _ in points], [v for _, v in points], label=_coincide_note(label, same), **style)
        ax.set_xscale("log")
        ax.set_xticks(list(ks), [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("K: ids read per step (log scale)")
        ax.set_ylabel(axis_label(f"{metric}@K"))
        top = ax.get_ylim()[1]
        ax.set_ylim(-0.02 * top, top)  # a curve at 0% stays visible above the frame
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(fig_title)
    fig.tight_layout()
    return fig


def _undefended_curves(grouped: Sequence[Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    """The undefended line(s) as :func:`_k_curves` draws them (black, dashed, stars)."""
    return [("undefended", line, UNDEFENDED_STYLE) for line in grouped if line.policy == "undefended"]


def _k_lines(rows: Sequence[Mapping[str, Any]], ks: Sequence[int], suffix: str) -> list[Any]:
    return lines(rows, [f"{m}@{k}" for m in k_metrics() for k in ks], suffix=suffix)


def leakage_vs_k(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, policy: str = "coveil",
                 suffix: str = "") -> list[Path]:
    """``leakage_vs_k_<mode>``: every recall metric against K, one curve per setting of ``policy``, undefended marked.

    Each point is the mean over the setting's items of ``<metric>@K``; curves are coloured along the
    swept parameter (dark = smallest).
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_figure(rows)
    tasks = len({task for task, _ in groups})
    written: list[Path] = []
    for (task, mode), group in groups.items():
        ks = _recorded_ks(group, suffix)
        grouped = _k_lines(group, ks, suffix)
        swept = sorted((line for line in grouped if line.policy == policy),
                       key=lambda line: _swept_value(json.loads(line.params)))
        if not ks or not swept:
            continue
        colours = plt.get_cmap("viridis")([0.8 * i / max(1, len(swept) - 1) for i in range(len(swept))])
        curves = _undefended_curves(grouped)
        curves += [(_setting(policy, json.loads(line.params)), line,
                    {"color": colour, "marker": "o", "markersize": 3, "linewidth": 1.2})
                   for line, colour in zip(swept, colours)]
        items = max(line.items for _, line, _ in curves)
        fig = _k_curves(f"{mode}-side fusion ({task}): leakage against K, {policy} per setting "
                        f"(up to {items} items per point)", curves, ks)
        written += save_figure(fig, out, _stem("leakage_vs_k", task, mode, tasks))
    return written


def representatives(grouped: Sequence[Any], *, match: str = "token_er@100", target: float | None = None,
                    reference: str = "coveil") -> tuple[float, dict[str, Any]] | None:
    """Each defended method's :class:`~eval_harness.report.tables.Line` whose mean ``match`` lies nearest the goal.

    The goal is ``target`` (a fraction), else the low median of ``reference``'s lines (of every defended line
    when ``reference`` has none): a leakage one of its settings has, so that the reference is at the goal exactly
    (the mean of the two middle settings of an even grid is a leakage none of them has, and put the reference
    itself off its own target).  Returns ``(goal, {policy: line})``, or ``None`` without defended lines.
    """
    defended = [line for line in grouped if line.policy != "undefended" and line.values.get(match)]
    if not defended:
        return None
    pool = [line for line in defended if line.policy == reference] or defended
    goal = target if target is not None else statistics.median_low([line.mean(match) for line in pool])
    chosen: dict[str, Any] = {}
    for line in defended:
        best = chosen.get(line.policy)
        if best is None or abs(line.mean(match) - goal) < abs(best.mean(match) - goal):
            chosen[line.policy] = line
    return goal, chosen


#: how far (a fraction, 0.05 = 5 percentage points) a method's nearest setting may lie from the matched leakage
#: before :func:`leakage_vs_k_methods` marks it unmatched
MATCH_TOLERANCE = 0.05


def leakage_vs_k_methods(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, match: str = "token_er@100",
                         target: float | None = None, reference: str = "coveil", suffix: str = "") -> list[Path]:
    """``leakage_vs_k_methods_<mode>``: every method at its setting nearest a matched leakage, against K.

    Each method is drawn at the setting whose mean ``match`` metric lies nearest ``target`` (a fraction;
    default: the low median of ``reference``'s settings, or of every defended setting without it), so the
    curves meet near ``match``'s K and show how each method's leakage grows past it.  Undefended is marked.
    A method whose grid has no setting within :data:`MATCH_TOLERANCE` of the goal is drawn dotted at its nearest
    setting, its distance from the goal in the legend and under the figure: it is not at matched leakage.
    Cloud-side DP-Fusion is one: it uploads its ``upload_k`` largest values at every step, at ε = 0 those of the
    public distribution, whose top 100 already hold evidence tokens (measured, 6 MedPriv items, 48 tokens, fp32:
    Token-ER@100 28.2% at ε = 0, 29.9% at ε = 64, undefended 29.9%, CoVeil λ = 1-8 0.0%).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_figure(rows)
    tasks = len({task for task, _ in groups})
    written: list[Path] = []
    metric_name, _, match_k = match.partition("@")
    for (task, mode), group in groups.items():
        ks = _recorded_ks(group, suffix)
        grouped = [line for line in _k_lines(group, ks, suffix) if line.values.get(match)]
        picked = representatives(grouped, match=match, target=target, reference=reference)
        if not ks or picked is None:
            continue
        goal, chosen = picked
        title = metric_label(metric_name) + "@" + match_k
        curves = _undefended_curves(grouped)
        unmatched = []
        for (policy, line), marker in zip(chosen.items(), "osD^vP<>" * len(chosen)):
            gap = 100 * (line.mean(match) - goal)
            label = f"{_setting(policy, json.loads(line.params))} ({title} {100 * line.mean(match):.1f}%"
            style = {"marker": marker, "markersize": 4, "linewidth": 1.4}  # markers tell overlapping curves apart
            if abs(gap) > 100 * MATCH_TOLERANCE:  # its grid reaches no nearer: drawn dotted, and said so
                label += f", {gap:+.1f} from the target: unmatched"
                style["linestyle"] = ":"
                unmatched.append(f"{policy} {gap:+.1f}")
            curves.append((label + ")", line, style))
        items = max(line.items for _, line, _ in curves)
        fig = _k_curves(f"{mode}-side fusion ({task}): each method at the setting nearest {title} = {100 * goal:.1f}% "
                        f"(up to {items} items per point)", curves, ks)
        if unmatched:
            fig.text(0.5, -0.01, f"Dotted: not at matched leakage. No setting of its grid lies within "
                                 f"{100 * MATCH_TOLERANCE:g} points of the target {title} = {100 * goal:.1f}%; drawn "
                                 f"at its nearest ({'; '.join(unmatched)} points).",
                     ha="center", va="top", fontsize=9, color="0.25", wrap=True)
        written += save_figure(fig, out, _stem("leakage_vs_k_methods", task, mode, tasks))
    return written


@dataclass
class MechanismPoint:
    """One setting's per-step mechanism, pooled over its items' steps (each step counts once)."""

    params: Mapping[str, Any]
    items: int
    steps: int
    zero_upload_steps: int | None
    top1_agreement_steps: int
    rank_sum: int
    rank_bins: dict[str, int]
    accuracy: float

    @property
    def zero_upload_ratio(self) -> float | None:
        return None if self.zero_upload_steps is None else self.zero_upload_steps / self.steps

    @property
    def top1_agreement(self) -> float:
        return self.top1_agreement_steps / self.steps

    @property
    def rank_mean(self) -> float:
        return self.rank_sum / self.steps


def mechanism_points(rows: Iterable[Mapping[str, Any]], policy: str) -> list[MechanismPoint]:
    """``policy``'s settings among ``rows`` (one task and mode) with their pooled mechanism, by swept value.

    Rows without a ``mechanism`` (or with no steps) are left out.
    """
    pooled: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row["policy"] == policy and row.get("mechanism") and row["mechanism"]["steps"]:
            pooled.setdefault(json.dumps(row.get("params", {}), sort_keys=True), []).append(row)
    points = []
    for params, group in pooled.items():
        mechs = [row["mechanism"] for row in group]
        zero = [m["zero_upload_steps"] for m in mechs]
        bins: dict[str, int] = {}
        for m in mechs:
            for label, count in m["rank_bins"].items():
                bins[label] = bins.get(label, 0) + count
        points.append(MechanismPoint(
            params=json.loads(params), items=len(group), steps=sum(m["steps"] for m in mechs),
            zero_upload_steps=None if any(z is None for z in zero) else sum(zero),
            top1_agreement_steps=sum(m["top1_agreement_steps"] for m in mechs),
            rank_sum=sum(m["rank_sum"] for m in mechs), rank_bins=bins,
            accuracy=sum(bool(row["correct"]) for row in group) / len(group)))
    return sorted(points, key=lambda p: _swept_value(p.params))


def _twin_axes_figure(points: Sequence[MechanismPoint], undefended: MechanismPoint | None,
                      left: tuple[str, Any, str], right: tuple[str, Any, str], title: str, *,
                      log_left: bool = False) -> Any:
    """Two quantities against the swept parameter (evenly spaced), left and right axes, undefended as lines.

    ``left``/``right``: (axis label, ``point → value`` in the plotted unit, legend label).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    twin = ax.twinx()
    xs = list(range(len(points)))
    handles = []
    for axis, (label, value, legend), colour, marker in ((ax, left, "tab:blue", "o"), (twin, right, "tab:orange", "s")):
        (art,) = axis.plot(xs, [value(p) for p in points], color=colour, marker=marker, linewidth=1.6, label=legend)
        handles.append(art)
        axis.set_ylabel(label, color=colour)
        axis.tick_params(axis="y", colors=colour)
        if undefended is not None:
            handles.append(axis.axhline(value(undefended), color=colour, linestyle=":", linewidth=1.3,
                                        label=f"{legend}, undefended"))
    if log_left:
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, ... written out
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    names = {k for p in points for k in p.params}
    symbol = ", ".join(PARAM_SYMBOLS.get(k, k) for k in sorted(names)) or "setting"
    ax.set_xticks(xs, [", ".join(str(v) for v in p.params.values()) for p in points])
    ax.set_xlabel(f"{symbol} (privacy weight; settings evenly spaced)")
    ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _recomputation_note(fig: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Under a mechanism figure of rows decoded in reduced precision: why undefended agrees with full fusion on
    fewer than 100% of its steps.

    The row's mechanism is recomputed after decoding by one teacher-forced forward over the whole sequence
    (:mod:`eval_harness.runners.mechanism`); the decode ran token by token with a KV cache, in batches.  In
    bfloat16 the two round differently and a near tie of the fused top two can flip (measured: 94 of 95
    undefended steps agree in bfloat16, 95 of 95 in float32, the same 4 MedPriv items).
    """
    reduced = sorted({str(row["dtype"]) for row in rows if row.get("dtype") not in (None, "float32")})
    if reduced:
        fig.text(0.5, -0.11, f"Rows decoded in {', '.join(reduced)}: agreement and ranks are recomputed by a "
                             "teacher-forced pass that rounds differently from the token-by-token decode, so near "
                             "ties can flip (undefended below 100%); float32 rows agree.",
                 ha="center", va="top", fontsize=8, color="0.25", wrap=True)


def mechanism_cloud(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, policy: str = "coveil") -> list[Path]:
    """``mechanism_cloud``: zero-upload ratio (left) and top-1 agreement with full fusion (right) against λ.

    Pooled over steps: zero-upload ratio = steps uploading no SLM value / steps; top-1 agreement = steps
    whose token is ``argmax(α p_L + (1-α) p_S)`` / steps.  Undefended drawn as dotted lines.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_figure(rows, "cloud")
    tasks = len({task for task, _ in _by_figure(rows)})
    written: list[Path] = []
    for (task, mode), group in groups.items():
        points = [p for p in mechanism_points(group, policy) if p.zero_upload_steps is not None]
        if not points:
            continue
        undefended = next(iter(mechanism_points(group, "undefended")), None)
        items = max(p.items for p in points)
        fig = _twin_axes_figure(
            points, undefended,
            ("zero-upload steps (% of steps)", lambda p: 100 * p.zero_upload_ratio, "zero-upload ratio"),
            ("top-1 agreement with full fusion (% of steps)", lambda p: 100 * p.top1_agreement, "top-1 agreement"),
            f"Cloud-side {policy} ({task}): upload decisions against the privacy weight "
            f"(up to {items} items per point)")
        for axis in fig.axes[:2]:
            axis.set_ylim(-3, 103)
        _recomputation_note(fig, group)
        written += save_figure(fig, out, _stem("mechanism", task, mode, tasks))
    return written


def mechanism_edge(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, policy: str = "coveil") -> list[Path]:
    """``mechanism_edge``: mean selected-token rank under ``p_fuse`` (left; log from 10 up) and accuracy (right)
    against λ.

    Mean rank pooled over steps (Σ ranks / steps; rank 1 is the full-fusion top).  Undefended as dotted lines.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_figure(rows, "edge")
    tasks = len({task for task, _ in _by_figure(rows)})
    written: list[Path] = []
    for (task, mode), group in groups.items():
        points = mechanism_points(group, policy)
        if not points:
            continue
        undefended = next(iter(mechanism_points(group, "undefended")), None)
        items = max(p.items for p in points)
        # a log axis once the ranks span a decade (the paper's grid reaches ~50); below that it shows one tick
        log = max(p.rank_mean for p in points) >= 10
        fig = _twin_axes_figure(
            points, undefended,
            ("mean selected-token rank under p_fuse" + (" (log)" if log else ""), lambda p: p.rank_mean, "mean rank"),
            ("accuracy (%)", lambda p: 100 * p.accuracy, "accuracy"),
            f"Edge-side {policy} ({task}): token selection against the privacy weight "
            f"(up to {items} items per point)", log_left=log)
        fig.axes[0].set_ylim(bottom=0.9 if log else 0.95)
        fig.axes[1].set_ylim(-3, 103)
        _recomputation_note(fig, group)
        written += save_figure(fig, out, _stem("mechanism", task, mode, tasks))
    return written


def matched_pair(rows: Sequence[Mapping[str, Any]], policy: str, against: str, *, match: str = "token_er@100",
                 suffix: str = "") -> tuple[tuple[MechanismPoint, float], tuple[MechanismPoint, float]] | None:
    """The setting of ``policy`` and the setting of ``against`` whose mean ``match`` metrics lie nearest each
    other (rows of one task and mode), each with that mean; ``None`` unless both have rows with a mechanism."""
    leak = {(line.policy, line.params): line.mean(match) for line in lines(rows, [match], suffix=suffix)
            if line.values.get(match)}

    def scored(name: str) -> list[tuple[MechanismPoint, float]]:
        return [(p, leak[(name, json.dumps(p.params, sort_keys=True))]) for p in mechanism_points(rows, name)
                if (name, json.dumps(p.params, sort_keys=True)) in leak]

    ours, theirs = scored(policy), scored(against)
    if not ours or not theirs:
        return None
    return min(((x, y) for x in ours for y in theirs), key=lambda pair: abs(pair[0][1] - pair[1][1]))


def rank_bins(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, policy: str = "coveil",
              against: str = "invisible_ink", match: str = "token_er@100", suffix: str = "") -> list[Path]:
    """``rank_bins_edge``: selected-token ranks under ``p_fuse`` in bins, ``policy`` vs ``against`` at matched leakage.

    The pair of settings from :func:`matched_pair`; bars give the share of all their steps in each rank bin
    (1, 2-5, 6-50, >50); undefended alongside when present.  Nothing is drawn unless both methods have
    edge-side rows with a ``mechanism``.
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_figure(rows, "edge")
    tasks = len({task for task, _ in _by_figure(rows)})
    metric_name, _, match_k = match.partition("@")
    title_metric = metric_label(metric_name) + "@" + match_k
    written: list[Path] = []
    for (task, mode), group in groups.items():
        pair = matched_pair(group, policy, against, match=match, suffix=suffix)
        if pair is None:
            continue
        (a, leak_a), (b, leak_b) = pair
        bars = [(f"{_setting(policy, a.params)} ({title_metric} {100 * leak_a:.1f}%)", a, "tab:blue"),
                (f"{_setting(against, b.params)} ({title_metric} {100 * leak_b:.1f}%)", b, "tab:orange")]
        undefended = next(iter(mechanism_points(group, "undefended")), None)
        if undefended is not None:
            bars.append(("undefended", undefended, "0.55"))
        labels = list(a.rank_bins)
        fig, ax = plt.subplots(figsize=(7.2, 4.2))
        width = 0.8 / len(bars)
        for i, (label, point, colour) in enumerate(bars):
            xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(labels))]
            shares = [100 * point.rank_bins.get(bin_, 0) / point.steps for bin_ in labels]
            drawn = ax.bar(xs, shares, width, color=colour, label=label)
            ax.bar_label(drawn, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(labels)), [f"rank {bin_}" for bin_ in labels])
        ax.set_xlabel("selected token's rank under p_fuse (1 = the full-fusion top token)")
        ax.set_ylabel("share of decoding steps (%)")
        ax.set_ylim(0, 112)  # room for the value labels above a bar at 100%
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper right", frameon=False)
        ax.set_title(f"Edge-side ({task}): selected-token ranks at matched {title_metric} "
                     f"({a.items} and {b.items} items)", fontsize=10)
        fig.tight_layout()
        written += save_figure(fig, out, _stem("rank_bins", task, mode, tasks))
    return written


#: offsets (points) tried for a label around its point, nearest first: the first free one is taken
_LABEL_OFFSETS = tuple((round(r * dx), round(r * dy)) for r in (7, 14, 24, 36)
                       for dx, dy in ((1, 1), (-1, -1), (1, -1), (-1, 1), (1, 0), (-1, 0), (0, 1), (0, -1)))


def place_labels(ax: Any, labels: Sequence[tuple[float, float, str, Any]]) -> list[Any]:
    """Annotate each ``(x, y, text, color)`` at the first offset where it overlaps no label placed before it,
    no marker or curve of ``ax`` and nothing outside the axes; a label with no free place is left out (the legend
    still names its curve).  The axes' limits must be final.  Returns the annotations drawn."""
    import numpy as np

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    points = [ax.transData.transform(c.get_offsets()) for c in ax.collections if len(c.get_offsets())]
    for line in ax.get_lines():  # every curve as points 2 px apart along its segments, so no label crosses one
        xy = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
        for start, stop in zip(xy, xy[1:]):
            steps = max(1, int(np.hypot(*(stop - start)) // 2))
            points.append(start + np.linspace(0.0, 1.0, steps + 1)[:, None] * (stop - start))
        points.append(xy)
    marks = np.concatenate(points) if points else np.empty((0, 2))
    taken: list[Any] = []
    drawn = []
    for x, y, text, color in labels:
        for dx, dy in _LABEL_OFFSETS:
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, color=color,
                               ha="left" if dx > 0 else "right" if dx < 0 else "center",
                               va="bottom" if dy > 0 else "top" if dy < 0 else "center")
            box = note.get_window_extent(renderer).expanded(1.08, 1.15)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            on_mark = bool(len(marks)) and bool(np.any(
                (marks[:, 0] >= box.x0 - 3) & (marks[:, 0] <= box.x1 + 3)
                & (marks[:, 1] >= box.y0 - 3) & (marks[:, 1] <= box.y1 + 3)))
            if inside and not on_mark and not any(box.overlaps(other) for other in taken):
                taken.append(box)
                drawn.append(note)
                break
            note.remove()
    return drawn


def _parameter_order(line: Any) -> tuple[tuple[int, Any], ...]:
    """A line's swept values as a sort key (numbers by value, anything else after them by text)."""
    import json

    return tuple((0, v) if isinstance(v, (int, float)) else (1, str(v)) for v in json.loads(line.params).values())


def inversion_tradeoff_figure(rows: Iterable[Mapping[str, Any]], task: str, mode: str) -> Any:
    """The paper's "Privacy-utility trade-off: private context inversion" panel for one task and fusion mode.

    Accuracy (%) against the inversion's mean ROUGE-1 recall (%), every method as a curve through its swept
    parameter's values in order, the undefended point a black star; each curve's ends (its smallest and
    largest parameter) are labelled by :func:`place_labels`.  Only settings whose rows carry an inversion result are drawn.
    """
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = attack_columns("inversion")[0]
    grouped = [line for line in lines(rows, (metric,))
               if line.task == task and line.mode == mode and line.count(metric)]
    fig, ax = plt.subplots(figsize=(7.4, 4.8))
    ends = []
    methods = [policy for policy in dict.fromkeys(line.policy for line in grouped) if policy != "undefended"]
    drawn: dict[str, list[tuple[float, float]]] = {}
    for policy in dict.fromkeys(line.policy for line in grouped):
        points = sorted((line for line in grouped if line.policy == policy), key=_parameter_order)
        xs = [metric_scale(metric) * p.mean(metric) for p in points]
        ys = [100 * sum(p.correct) / len(p.correct) for p in points]
        if policy == "undefended":
            ax.scatter(xs, ys, marker="*", s=220, color="black", zorder=3, label="undefended")
            continue
        drawn[policy] = list(zip(xs, ys))
        (art,) = ax.plot(xs, ys, label=policy, **_method_style(methods.index(policy)))
        for end in dict.fromkeys((0, len(points) - 1)):
            ends.append((xs[end], ys[end], _swept(json.loads(points[end].params)), art.get_color()))
    ax.set_xlabel(axis_label(metric))
    ax.set_ylabel("accuracy (%)")
    ax.margins(x=0.18)  # room for the end labels inside the frame
    _accuracy_axis(ax, [100 * sum(line.correct) / len(line.correct) for line in grouped])
    ax.grid(alpha=0.3)
    same = coinciding(drawn)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, [_coincide_note(label, same) for label in labels], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # outside: covers nothing
    items = max((line.items for line in grouped), default=0)
    attacked = max((line.count(metric) for line in grouped), default=0)
    ax.set_title(f"{task}, {mode}-side fusion: private context inversion\n"
                 f"(accuracy over {items} items, inversion over {attacked} per point)", fontsize=10)
    fig.tight_layout()
    fig.canvas.draw()  # final limits and layout before the labels are placed
    place_labels(ax, ends)
    return fig


def inversion_tradeoff(rows: Iterable[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write ``inversion_tradeoff_<task>_<mode>.png`` and ``.pdf`` for each (task, mode) whose rows carry an
    inversion result; return the paths."""
    rows = list(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for task, mode in dict.fromkeys((row["task"], row["mode"]) for row in rows if row.get("inversion")):
        fig = inversion_tradeoff_figure(rows, task, mode)
        written += save_figure(fig, out, f"inversion_tradeoff_{task}_{mode}")
    return written


def length_distributions(lengths: Mapping[str, Sequence[int]], out_dir: str | Path, *, title: str,
                         stem: str = "length_distribution") -> list[Path]:
    """Write ``<stem>.png`` and ``.pdf``: one histogram of word counts per entry of ``lengths`` (the paper's length
    distributions of x_pub, x_priv and E_priv), side by side, each with its mean marked and given above it;
    return the paths."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False)
    for ax, (label, counts) in zip(axes.flat, lengths.items()):
        values = np.asarray(counts, dtype=int)
        # at most ~20 bars, each a whole number of words wide and centred on whole numbers
        width = max(1, -(-(int(values.max()) - int(values.min()) + 1) // 20))
        edges = np.arange(values.min(), values.max() + width + 1, width) - 0.5
        ax.hist(values, bins=edges, color="tab:blue", alpha=0.8, edgecolor="white")
        mean = values.mean()
        ax.axvline(mean, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"mean {mean:.1f} (dashed)", fontsize=9)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"{label} (words)")
        ax.set_ylabel("items")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, out, stem)
