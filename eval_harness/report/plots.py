"""Privacy-utility figures from result rows (the paper's trade-off plots): reads rows only.

One figure per fusion mode, one panel per leakage metric the rows recorded: accuracy against the metric, every method of the
mode as one curve over its swept parameter, the undefended point marked.  Labels name the swept value at
each end of a curve only, offset away from the points, so none is written over another.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eval_harness.report.tables import LEAKAGE_METRICS, lines

TITLES = {"token_er@100": "Token-ER@100", "rouge1_er@100": "ROUGE1-ER@100", "span_er@100": "Span-ER@100",
          "auc@100": "AUC@100"}


def _swept(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def privacy_utility(rows: Iterable[Mapping[str, Any]], out_dir: str | Path, *, metrics: Sequence[str] = LEAKAGE_METRICS,
                    suffix: str = "") -> list[Path]:
    """Write ``privacy_utility_<mode>.png`` and ``.pdf`` for each fusion mode in ``rows``; return the paths."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grouped = lines(rows, metrics, suffix=suffix)
    written: list[Path] = []
    for mode in dict.fromkeys(line.mode for line in grouped):
        # only the metrics the rows recorded: an empty panel would show axes of nothing
        shown = [m for m in metrics if any(line.values.get(m) for line in grouped if line.mode == mode)]
        columns = min(2, len(shown))
        rows_n = -(-len(shown) // columns)
        fig, axes = plt.subplots(rows_n, columns, figsize=(5.6 * columns, 4.4 * rows_n), squeeze=False)
        for ax in axes.flat[len(shown):]:
            ax.set_visible(False)
        for ax, metric in zip(axes.flat, shown):
            policies = dict.fromkeys(line.policy for line in grouped if line.mode == mode)
            for policy in policies:
                points = [line for line in grouped if line.mode == mode and line.policy == policy]
                xs = [100 * p.mean(metric) for p in points]
                ys = [100 * sum(p.correct) / len(p.correct) for p in points]
                if policy == "undefended":
                    ax.scatter(xs, ys, marker="*", s=160, color="black", zorder=3, label="undefended")
                    continue
                order = sorted(range(len(points)), key=lambda i: xs[i])
                (line_art,) = ax.plot([xs[i] for i in order], [ys[i] for i in order], marker="o", markersize=4,
                                      label=policy)
                for end, offset in ((order[0], (-6, -12)), (order[-1], (6, 6))):
                    if len(order) > 1 or end == order[0]:
                        ax.annotate(_swept(json.loads(points[end].params)), (xs[end], ys[end]), fontsize=7,
                                    textcoords="offset points", xytext=offset, color=line_art.get_color(),
                                    ha="right" if offset[0] < 0 else "left")
            ax.set_xlabel(f"{TITLES.get(metric, metric)} (%), lower is more private")
            ax.set_ylabel("accuracy (%)")
            ax.margins(0.15)  # room for the end labels inside the frame
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8, loc="best")
        items = max((line.items for line in grouped if line.mode == mode), default=0)
        fig.suptitle(f"{mode}-side fusion: privacy-utility trade-off ({items} items per point)")
        fig.tight_layout()
        for ext in ("png", "pdf"):
            path = out / f"privacy_utility_{mode}.{ext}"
            fig.savefig(path, dpi=130)
            written.append(path)
        plt.close(fig)
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

    from eval_harness.report.tables import INVERSION_METRICS

    metric = INVERSION_METRICS[0]
    grouped = [line for line in lines(rows, (metric,))
               if line.task == task and line.mode == mode and line.count(metric)]
    fig, ax = plt.subplots(figsize=(7.4, 4.8))
    ends = []
    for policy in dict.fromkeys(line.policy for line in grouped):
        points = sorted((line for line in grouped if line.policy == policy), key=_parameter_order)
        xs = [100 * p.mean(metric) for p in points]
        ys = [100 * sum(p.correct) / len(p.correct) for p in points]
        if policy == "undefended":
            ax.scatter(xs, ys, marker="*", s=220, color="black", zorder=3, label="undefended")
            continue
        (art,) = ax.plot(xs, ys, marker="o", markersize=4, label=policy)
        for end in dict.fromkeys((0, len(points) - 1)):
            ends.append((xs[end], ys[end], _swept(json.loads(points[end].params)), art.get_color()))
    ax.set_xlabel("inversion ROUGE-1 recall (%), lower is more private")
    ax.set_ylabel("accuracy (%)")
    ax.margins(0.18)  # room for the end labels inside the frame
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # outside: covers nothing
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
    import matplotlib.pyplot as plt

    rows = list(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for task, mode in dict.fromkeys((row["task"], row["mode"]) for row in rows if row.get("inversion")):
        fig = inversion_tradeoff_figure(rows, task, mode)
        for ext in ("png", "pdf"):
            path = out / f"inversion_tradeoff_{task}_{mode}.{ext}"
            fig.savefig(path, dpi=130, bbox_inches="tight")
            written.append(path)
        plt.close(fig)
    return written
