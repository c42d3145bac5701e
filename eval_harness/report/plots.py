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
