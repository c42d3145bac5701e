"""Quantised vs reference (``decodeleak compare-quant``): the summary, its tables and its figure, from rows only.

Inputs are the command's records: one description per variant (its file's type, size and bits per weight),
the per-step drift rows (one per variant, mode and item, each holding per-step lists) and the end-to-end
result rows of the reference and of each variant (``decodeleak sweep``'s row format).  Per variant:

* KL mean and 95th percentile, top-1 agreement, top-10/100 overlap: pooled over every compared step;
* CoVeil agreement per fusion mode: the share of that mode's steps with the same decision;
* end to end, per (mode, policy): ``Δ = mean over items of (variant - reference)`` on the items both ran, in
  percentage points, for accuracy and each DecodeLeak metric at K = 100, with the 95% percentile-bootstrap
  interval of that mean (paired: items resampled); and the share of items whose generation is token for token
  the reference's.  Greedy generations part at the first step whose choice flips, so a variant whose steps
  barely drift can still move an item's leakage: the interval says how much of a Δ that noise covers.

Imports numpy and matplotlib only.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eval_harness.metrics.leakage import metric_label, table_columns
from eval_harness.report.plots import save_figure
from eval_harness.report.tables import bootstrap_interval

MARKERS = ("o", "s", "^", "D", "v", "P")
#: the per-step lists a drift row carries, and their table headings
STEP_FIELDS = {"top1": "top-1 agree", "overlap@10": "top-10 overlap", "overlap@100": "top-100 overlap"}


def _setting_label(row: Mapping[str, Any]) -> str:
    params = " ".join(f"{k}={v}" for k, v in sorted(row.get("params", {}).items()))
    return f"{row['mode']}-side {row['policy']}" + (f" {params}" if params else "")


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def summarise(
    variants: Sequence[Mapping[str, Any]],
    step_rows: Iterable[Mapping[str, Any]],
    reference_rows: Iterable[Mapping[str, Any]],
    variant_rows: Mapping[str, Iterable[Mapping[str, Any]]],
) -> dict[str, Any]:
    """One summary per variant (distribution drift, decision agreement, end-to-end deltas) and the reference's
    end-to-end figures, per setting."""
    steps_by_variant: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in step_rows:
        steps_by_variant[row["variant"]].append(row)
    reference = {row["key"]: row for row in reference_rows}
    reference_by_setting: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in reference.values():
        reference_by_setting[_setting_label(row)].append(row)
    summary: dict[str, Any] = {
        "reference": {
            label: {"items": len(rows), "accuracy": _mean([float(r["correct"]) for r in rows]),
                    **{m: _mean([r["metrics"][m] for r in rows if m in r["metrics"]]) for m in table_columns()}}
            for label, rows in reference_by_setting.items()
        },
        "variants": [],
    }
    for variant in variants:
        name = variant["name"]
        rows = steps_by_variant.get(name, [])
        kl = [x for row in rows for x in row["kl"]]
        entry: dict[str, Any] = {
            **variant,
            "steps": len(kl),
            "kl_mean": _mean(kl),
            "kl_p95": float(np.percentile(kl, 95)) if kl else float("nan"),
            **{field: _mean([float(x) for row in rows for x in row[field]]) for field in STEP_FIELDS},
            "coveil_agreement": {
                mode: _mean([float(x) for row in rows if row["mode"] == mode for x in row["decision_agrees"]])
                for mode in sorted({row["mode"] for row in rows})
            },
        }
        deltas: dict[str, dict[str, float]] = {}
        paired: dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = defaultdict(list)
        for row in variant_rows.get(name, []):
            if row["key"] in reference:
                paired[_setting_label(row)].append((reference[row["key"]], row))
        for label, pairs in paired.items():
            differences = {"accuracy": [float(v["correct"]) - float(r["correct"]) for r, v in pairs],
                           **{m: [v["metrics"][m] - r["metrics"][m] for r, v in pairs
                                  if m in v["metrics"] and m in r["metrics"]] for m in table_columns()}}
            deltas[label] = {
                "items": len(pairs),
                "same_tokens": _mean([float(r["token_ids"] == v["token_ids"]) for r, v in pairs
                                      if "token_ids" in r and "token_ids" in v]),
                **{m: _mean(d) for m, d in differences.items()},
                **{f"{m}:ci95": bootstrap_interval(d) for m, d in differences.items()},
            }
        entry["end_to_end"] = deltas
        summary["variants"].append(entry)
    return summary


def _pct(value: float, *, signed: bool = False) -> str:
    if value != value:  # NaN: nothing to compare
        return "-"
    return f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}%"


def _delta(d: Mapping[str, Any], metric: str) -> str:
    """``+6.2 [+1.0, +11.3]``: the mean change and its 95% bootstrap interval, in percentage points."""
    low, high = d[f"{metric}:ci95"]
    return f"{_pct(d[metric], signed=True)} [{_pct(low, signed=True)}, {_pct(high, signed=True)}]"


def markdown(summary: Mapping[str, Any], *, title: str, preamble: str) -> str:
    """Two tables: drift and decisions per variant; end-to-end deltas per setting, one line per variant."""
    modes = sorted({mode for v in summary["variants"] for mode in v["coveil_agreement"]})
    head = ["variant", "file type", "bits/weight (matrices / file)", "size (MB)", "steps", "KL mean (nats)",
            "KL p95", *STEP_FIELDS.values(), *(f"CoVeil agree, {m}-side" for m in modes)]
    lines = [f"# {title}", "", preamble, "", "## Next-token distributions and CoVeil's decisions, step by step", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in summary["variants"]:
        origin = v["file_type"] if v["derived_from"] is None else f"{v['file_type']} (from {v['derived_from']})"
        cells = [v["name"], origin, f"{v['matrix_bits_per_weight']:.2f} / {v['bits_per_weight']:.2f}",
                 f"{v['size_bytes'] / 1e6:.1f}", str(v["steps"]), f"{v['kl_mean']:.4f}", f"{v['kl_p95']:.4f}",
                 *(_pct(v[f]) for f in STEP_FIELDS), *(_pct(v["coveil_agreement"].get(m, float("nan"))) for m in modes)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## End to end: each SLM in the collaborative loop against the same cloud LLM", "",
              "The reference's line gives its values; each variant's line the change from it: percentage points, "
              "mean over the items both ran [95% paired bootstrap interval]; 'same tokens' is the share of items "
              "whose generation equals the reference's token for token.", ""]
    metric_heads = [metric_label(m) for m in table_columns()]
    for label, ref in summary["reference"].items():
        lines += [f"### {label} ({ref['items']} items)", "",
                  "| SLM | items | same tokens | accuracy | " + " | ".join(metric_heads) + " |",
                  "|" + "---|" * (4 + len(metric_heads)),
                  "| reference | " + " | ".join([str(ref["items"]), "", _pct(ref["accuracy"]),
                                                 *(_pct(ref[m]) for m in table_columns())]) + " |"]
        for v in summary["variants"]:
            d = v["end_to_end"].get(label)
            if d is None:
                continue
            cells = [str(d["items"]), _pct(d["same_tokens"]), _delta(d, "accuracy"),
                     *(_delta(d, m) for m in table_columns())]
            lines.append(f"| Δ {v['name']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def drift_figure(summary: Mapping[str, Any], out_dir: str | Path, *, title: str,
                 name: str = "drift_vs_bits") -> list[Path]:
    """``<name>.png`` and ``.pdf``: six panels of drift as the weight matrices' bits per weight drop.

    Top: KL (mean and 95th percentile, log scale), top-1/10/100 agreement, CoVeil's decision agreement per
    mode.  Bottom: the change in Token-ER@100, Span-ER@100 and accuracy per (mode, policy) with its 95%
    bootstrap interval, the reference at 0 (its own value in the legend).  Variants sit at evenly spaced
    positions in order of bits per weight (two types can be a few hundredths of a bit apart); each tick names
    the variant and its bits, so no point needs a label of its own.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted(summary["variants"], key=lambda v: v["matrix_bits_per_weight"])
    if not variants:
        raise ValueError("no variant to plot")
    xs = np.arange(len(variants), dtype=float)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.8))

    def points(ax: Any, ys: Sequence[float], label: str, *, errors: Sequence[tuple[float, float]] | None = None,
               shift: float = 0.0, **style: Any) -> None:
        # a marker of its own per series, slightly transparent, so series that coincide stay visible
        marker = MARKERS[len(ax.get_lines()) % len(MARKERS)]
        if errors is None:
            ax.plot(xs + shift, ys, marker=marker, markersize=6, alpha=0.85, label=label, **style)
            return
        spans = np.array([[y - low, high - y] for y, (low, high) in zip(ys, errors)]).T
        ax.errorbar(xs + shift, ys, yerr=spans, marker=marker, markersize=6, alpha=0.85, capsize=3, label=label,
                    **style)

    ax = axes[0, 0]
    points(ax, [v["kl_mean"] for v in variants], "mean")
    points(ax, [v["kl_p95"] for v in variants], "95th percentile", linestyle="--")
    ax.set_yscale("log")
    ax.set_ylabel("KL(p_ref || p_quant) per step (nats, log scale)")
    ax.set_title("Distribution drift")
    ax = axes[0, 1]
    for field, label in STEP_FIELDS.items():
        points(ax, [100 * v[field] for v in variants], label)
    ax.set_ylabel("agreement with the reference (% of steps)")
    ax.set_title("Top tokens kept")
    ax = axes[0, 2]
    for mode in sorted({m for v in variants for m in v["coveil_agreement"]}):
        points(ax, [100 * v["coveil_agreement"].get(mode, float("nan")) for v in variants], f"{mode}-side")
    ax.set_ylabel("same decision as the reference (% of steps)")
    ax.set_title("CoVeil's decisions (same cloud LLM row)")
    settings = list(summary["reference"])
    shifts = np.linspace(-0.12, 0.12, len(settings)) if len(settings) > 1 else [0.0]
    bottom = [(m, metric_label(m)) for m in ("token_er@100", "span_er@100", "accuracy")]
    for ax, (metric, heading) in zip(axes[1], bottom):
        ax.axhline(0.0, color="black", linewidth=0.8, label="reference")
        for label, shift in zip(settings, shifts):
            deltas = [v["end_to_end"].get(label, {}) for v in variants]
            ys = [100 * d.get(metric, float("nan")) for d in deltas]
            errors = [tuple(100 * x for x in d.get(f"{metric}:ci95", (float("nan"),) * 2)) for d in deltas]
            ref = summary["reference"][label]
            points(ax, ys, f"{label} (reference: {metric_label('token_er@100')} {100 * ref['token_er@100']:.1f}%, "
                           f"accuracy {100 * ref['accuracy']:.0f}%)", errors=errors, shift=shift)
        ax.set_ylabel(f"Δ {heading} vs reference (percentage points)")
        ax.set_title(f"End to end: {heading}")
    for ax in axes.flat:
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{v['name']}{' (source)' if v['derived_from'] is None else ''}\n"
                            f"{v['matrix_bits_per_weight']:.2f} bits" for v in variants], fontsize=8)
        ax.set_xlabel("variant, by bits per weight of the weight matrices")
        ax.set_xlim(-0.5, len(variants) - 0.5)
        ax.margins(y=0.12)
        ax.grid(alpha=0.3)
    for ax in axes[0]:
        ax.legend(fontsize=7, loc="best")
    # the bottom row shares its series: one legend under the figure, clear of every panel's points and bars
    handles, labels = axes[1, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8,
               title="end to end, per setting (bars: 95% paired bootstrap interval of the mean change)",
               title_fontsize=8)
    items = max((ref["items"] for ref in summary["reference"].values()), default=0)
    fig.suptitle(f"{title} ({items} items per setting)")
    fig.tight_layout(rect=(0, 0.02 + 0.025 * -(-len(labels) // 3), 1, 1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out, name, tight=False)


def write_summary(summary: Mapping[str, Any], path: str | Path) -> Path:
    """The summary as JSON (NaN written as null)."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and value != value:
            return None
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    target = Path(path)
    target.write_text(json.dumps(clean(summary), indent=2) + "\n", encoding="utf-8")
    return target
