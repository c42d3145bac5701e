"""``decodeleak finalize``: the reviewed items as benchmark rows, the dataset-attributes table, the length figure.

Rows follow the published MedPriv/CommPriv schema, keys in its order: ``answer`` (the correct option's text),
``options``, ``answer_idx``, ``_split``, ``_id``, ``private_context``, ``public_query`` and ``filtered_context``
(the spans, joined by ``", "``). Each row is read back through :func:`eval_harness.datasets.item_from_row`, the
loader the audits use, and each of its spans is checked once more against its private context.

The attributes are the paper's (its dataset-attributes table): items, options per item, and the average word
counts, words split on whitespace, of the public query ``|x_pub|``, the private context ``|x_priv|`` and the
private evidence ``|E_priv|`` (the words of all an item's spans), and spans per item.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eval_harness.construction.judge import check_spans
from eval_harness.construction.pipeline import MANIFEST
from eval_harness.construction.review import ReviewLog
from eval_harness.construction.sources import SplitItem
from eval_harness.datasets import item_from_row
from edge_sdk.private_files import make_private, private_dir, write_private_text

SCHEMA_KEYS = ("answer", "options", "answer_idx", "_split", "_id", "private_context", "public_query",
               "filtered_context")


def benchmark_row(item: SplitItem, spans: Sequence[str]) -> dict[str, Any]:
    """One row of the final JSONL."""
    return {"answer": item.answer, "options": item.options, "answer_idx": item.answer_idx, "_split": item.split,
            "_id": item.item_id, "private_context": item.private_context, "public_query": item.public_query,
            "filtered_context": ", ".join(spans)}


def words(text: str) -> int:
    return len(text.split())


def evidence_spans(row: Mapping[str, Any]) -> list[str]:
    """A row's spans, read as the audits read them (comma-separated, stripped)."""
    return [span.strip() for span in row["filtered_context"].split(",") if span.strip()]


@dataclass(frozen=True)
class DatasetAttributes:
    """One line of the dataset-attributes table."""

    benchmark: str
    source: str
    domain: str
    samples: int
    options: str  # "4", or "4-5" when items differ
    public_words: float
    private_words: float
    evidence_words: float
    spans_per_item: float


def dataset_attributes(rows: Sequence[Mapping[str, Any]], *, benchmark: str, source: str,
                       domain: str) -> DatasetAttributes:
    """The averages over ``rows`` (``ValueError`` for none)."""
    if not rows:
        raise ValueError("no rows: nothing to describe")
    n = len(rows)
    option_counts = sorted({len(row["options"]) for row in rows})
    options = str(option_counts[0]) if len(option_counts) == 1 else f"{option_counts[0]}-{option_counts[-1]}"
    return DatasetAttributes(
        benchmark=benchmark, source=source, domain=domain, samples=n, options=options,
        public_words=sum(words(row["public_query"]) for row in rows) / n,
        private_words=sum(words(row["private_context"]) for row in rows) / n,
        evidence_words=sum(sum(map(words, evidence_spans(row))) for row in rows) / n,
        spans_per_item=sum(len(evidence_spans(row)) for row in rows) / n,
    )


TABLE_HEADER = ("Benchmark", "Source", "Domain", "Samples", "Options", "Avg. |x_pub|", "Avg. |x_priv|",
                "Avg. |E_priv|", "Avg. spans")


def _cells(attributes: DatasetAttributes) -> list[str]:
    a = attributes
    return [a.benchmark, a.source, a.domain, f"{a.samples:,}", a.options, f"{a.public_words:.1f}",
            f"{a.private_words:.1f}", f"{a.evidence_words:.1f}", f"{a.spans_per_item:.1f}"]


def attributes_markdown(attributes: DatasetAttributes) -> str:
    """The table in Markdown, as the paper prints it (averages to one decimal; lengths in words)."""
    header = [cell.replace("|", "\\|") for cell in TABLE_HEADER]  # a bare | would end the cell
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * 6,
                      "| " + " | ".join(_cells(attributes)) + " |"]) + "\n"


def attributes_csv(attributes: DatasetAttributes) -> str:
    """The table as CSV, unrounded."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(asdict(attributes)), lineterminator="\n")
    writer.writeheader()
    writer.writerow(asdict(attributes))
    return out.getvalue()


def length_distributions(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Word counts per item of the public query, the private context and the private evidence."""
    return {"public query x_pub": [words(row["public_query"]) for row in rows],
            "private context x_priv": [words(row["private_context"]) for row in rows],
            "private evidence E_priv": [sum(map(words, evidence_spans(row))) for row in rows]}


@dataclass(frozen=True)
class Finalized:
    """What ``finalize`` wrote and what it left out."""

    rows: int
    counts: Mapping[str, int]  # proposed items by review status
    include_pending: bool
    paths: list[Path]


def finalize(directory: str | Path, out_dir: str | Path, *, name: str, include_pending: bool = False) -> Finalized:
    """Write ``<name>.jsonl``, ``attributes.md``/``.csv`` and ``length_distribution.png``/``.pdf`` to ``out_dir``.

    The rows are the items a person accepted (with ``include_pending``, also those nobody has decided on yet, with
    the judge's spans); rejected items never.
    """
    from eval_harness.report.plots import length_distributions as plot_lengths

    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    log = ReviewLog(directory)
    wanted = ("accepted", "pending") if include_pending else ("accepted",)
    rows = []
    for entry in log.items():
        if entry.status not in wanted:
            continue
        kept, dropped = check_spans(entry.spans, entry.item)
        if dropped or not kept:
            raise ValueError(f"item {entry.item.item_id}: span {dropped[0]['span']!r} {dropped[0]['reason']}"
                             if dropped else f"item {entry.item.item_id} has no span")
        row = benchmark_row(entry.item, kept)
        item_from_row(row)  # the audits' own loader must accept it
        rows.append(row)
    if not rows:
        counts = log.counts()
        raise ValueError(f"no item to write: {counts['accepted']} accepted, {counts['pending']} not reviewed "
                         f"(decodeleak review {directory}; or --unreviewed to take the judge's proposals), "
                         f"{counts['rejected']} rejected")
    out = private_dir(out_dir)
    jsonl = out / f"{name}.jsonl"
    write_private_text(jsonl, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    source = ", ".join(Path(s["path"]).name for s in manifest["sources"]) + f" ({manifest['format']})"
    attributes = dataset_attributes(rows, benchmark=name, source=source, domain=manifest["domain"])
    write_private_text(out / "attributes.md", attributes_markdown(attributes))
    write_private_text(out / "attributes.csv", attributes_csv(attributes))
    figures = plot_lengths(length_distributions(rows), out, title=f"{name}: lengths of {len(rows)} items")
    for figure in figures:
        make_private(figure)
    return Finalized(len(rows), log.counts(), include_pending, [jsonl, out / "attributes.md", out / "attributes.csv",
                                                                  *figures])
