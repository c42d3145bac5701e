"""``decodeleak report``: the paper's tables (Markdown and CSV) from result files; reads rows only."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge_sdk.protocol.signals import FUSION_MODES
from eval_harness.cli.shared import add_source_options


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``report`` on the ``decodeleak`` subcommand table."""
    report = commands.add_parser("report", help="the paper's tables from result files",
                                 description="The undefended DecodeLeak table (the paper's Table 1) and tables "
                                             "per fusion mode and setting (item counts, accuracy, the epsilon "
                                             "each generation spent (mean; 'non-private' for the heuristics), "
                                             "Token/ROUGE1/Span-ER@100 and AUC@100, and the inversion's ROUGE-1 "
                                             "recall/F1 where rows have it, with 95% bootstrap intervals), by the "
                                             "paper's rules and by the release's, as Markdown and CSV (numbers in %: "
                                             "each metric's mean, its interval as METRIC_lo and METRIC_hi, and "
                                             "METRIC_n, the items that recorded it).")
    report.add_argument("results", nargs="+", type=Path,
                        help="JSONL result files of one run, read once in constant memory (shards are merged; files "
                             "of different runs, e.g. fp32 and bf16 or two inversion attackers, are refused, and so "
                             "is a key two files hold with different rows)")
    report.add_argument("--out", type=Path, default=Path("runs/decodeleak/report"),
                        help="where tables.md, tables.csv, undefended.csv and sources.json (the sha256 of every "
                             "file read, and the rows' code digests) are written")
    add_source_options(report)
    report.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return report


def run(args: argparse.Namespace) -> int:
    """``decodeleak report``: reads rows only (no model library is imported)."""
    from eval_harness.report.runs import label, read_run
    from eval_harness.report.tables import (csv_text, markdown, metrics_recorded, table, table_numbers,
                                            undefended_numbers, undefended_table)

    run_rows = read_run(args.results, allow_code_change=args.allow_code_change)
    rows = run_rows.rows
    metrics = metrics_recorded(rows)
    sections, csv_parts, undefended_csv = [], [], []
    for rules, suffix in (("paper", ""), ("release", ":release")):
        cells = undefended_table(rows, suffix=suffix)
        if cells:
            sections.append(markdown(cells, f"## Undefended DecodeLeak (the paper's Table 1) by the {rules}'s rules "
                                            "(mean [95% bootstrap interval], %; inversion: ROUGE-1 of the "
                                            "reconstructed private context)"))
            undefended_csv.append(csv_text([{"rules": rules, **c} for c in undefended_numbers(rows, suffix=suffix)]))
        for mode in FUSION_MODES:
            mode_rows = [r for r in rows if r["mode"] == mode]
            cells = table(mode_rows, metrics=metrics, suffix=suffix)
            if cells:
                sections.append(markdown(cells, f"## {mode}-side fusion, DecodeLeak by the {rules}'s rules "
                                                "(mean [95% bootstrap interval], %)"))
                csv_parts.append(csv_text([{"rules": rules, **c}
                                           for c in table_numbers(mode_rows, metrics=metrics, suffix=suffix)]))
    args.out.mkdir(parents=True, exist_ok=True)
    text = (f"# DecodeLeak report: {len(rows)} rows from {len(args.results)} file(s) of one run; {label(rows)}\n\n"
            f"{run_rows.caption()}\n\n" + "\n".join(sections))
    (args.out / "tables.md").write_text(text)
    (args.out / "tables.csv").write_text(_join_csv(csv_parts))
    (args.out / "undefended.csv").write_text(_join_csv(undefended_csv))
    (args.out / "sources.json").write_text(json.dumps(
        {"derived": ["tables.md", "tables.csv", "undefended.csv"], **run_rows.provenance()}, indent=1) + "\n")
    print(text)
    return 0


def _join_csv(parts: list[str]) -> str:
    """CSV texts of one header joined under that header once."""
    header, *body = "".join(parts).splitlines(keepends=True) or [""]
    return header + "".join(line for line in body if line != header)
