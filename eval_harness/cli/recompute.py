"""``decodeleak recompute``: re-score every row of result files from what the rows hold, and say where they agree.

A row holds its exposure trace at the recorded K (``exposure``), the digests of its item and dataset, and
the fingerprint of the tokenizer it was scored with (``vocabulary``).  This command runs no model: it reads
the tokenizer alone (``vocabulary.model``, or ``--tokenizer``) and the row's task, checks both against the
row's digests, and re-scores the row with the sweep's own scoring (:func:`eval_harness.sweep.execute._metrics`,
hence the metric functions of :mod:`eval_harness.metrics` as they are now): every DecodeLeak metric in both
rule sets at every recorded K, the evidence counts, the predicted letter and its correctness, and the
inversion's ROUGE-1 where the row kept the reconstruction.  The per-step mechanism statistics need both models
and are not re-scored.  A trace edited after it was written is refused by its ``sha256``
(:func:`~eval_harness.sweep.exposure_codec.decode_trace`), even where the edit changes no metric.

The files are streamed once: each row is parsed, its trace decoded, re-scored and dropped before the next.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``recompute`` on the ``decodeleak`` subcommand table."""
    parser = commands.add_parser(
        "recompute", help="re-score result rows from the file alone (no model) and report agreement",
        description="Re-score every row of the result files from its stored exposure trace, its item (checked "
                    "against the row's digest) and its tokenizer (checked against the row's fingerprint), "
                    "without loading a model; per metric, the rows compared, the largest absolute difference and "
                    "the rows that disagree. Exits 1 when any row disagrees or cannot be re-scored.")
    parser.add_argument("results", nargs="+", type=Path, help="JSONL result files")
    parser.add_argument("--tokenizer", metavar="MODEL",
                        help="the edge model whose tokenizer scored the rows ('embedded', a GGUF or a transformers "
                             "dir), for rows that do not name one or whose model moved (default: each row's "
                             "vocabulary.model); its fingerprint must still match the row's")
    parser.add_argument("--tolerance", type=float, default=0.0, metavar="X",
                        help="largest absolute difference still counted as agreement (default: 0, exact)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return parser


@dataclass
class Agreement:
    """One re-scored quantity over the rows: how many were compared, the largest difference, who disagreed."""

    rows: int = 0
    max_abs_diff: float = 0.0
    disagreeing: list[str] = field(default_factory=list)

    def add(self, key: str, stored: Any, recomputed: Any, tolerance: float) -> None:
        self.rows += 1
        if isinstance(stored, (int, float)) and isinstance(recomputed, (int, float)) and not isinstance(
                stored, bool) and not isinstance(recomputed, bool):
            diff = abs(float(stored) - float(recomputed))
            self.max_abs_diff = max(self.max_abs_diff, diff)
            if not diff <= tolerance:  # a NaN on either side disagrees
                self.disagreeing.append(key)
        elif stored != recomputed:
            self.max_abs_diff = float("inf")
            self.disagreeing.append(key)


class Rescorer:
    """Re-scores rows, loading each tokenizer and task once."""

    def __init__(self, tokenizer: str | None = None) -> None:
        self._tokenizer_override = tokenizer
        self._vocabularies: dict[str, tuple[Any, str]] = {}
        self._tasks: dict[str, dict[str, Any]] = {}

    def _vocabulary(self, row: Mapping[str, Any]) -> Any:
        from cloud_adapter.hf_loading import load_tokenizer
        from edge_sdk.models import resolve_model
        from eval_harness.provenance import tokenizer_fingerprint
        from eval_harness.sweep.execute import reference_vocabulary

        recorded = row.get("vocabulary") or {}
        model = self._tokenizer_override or recorded.get("model")
        if model is None:
            raise ValueError("the row names no tokenizer (written before rows recorded one): give --tokenizer")
        if model not in self._vocabularies:
            tokenizer = load_tokenizer(resolve_model(model))
            self._vocabularies[model] = (reference_vocabulary(tokenizer), tokenizer_fingerprint(tokenizer))
        vocab, fingerprint = self._vocabularies[model]
        if recorded.get("sha256") not in (None, fingerprint):
            raise ValueError(f"the tokenizer of {model} is not the one the row was scored with (fingerprint "
                             f"{fingerprint[:12]}, the row's {str(recorded['sha256'])[:12]})")
        return vocab

    def _item(self, row: Mapping[str, Any]) -> Any:
        from eval_harness.datasets import load_task
        from eval_harness.provenance import item_digest

        task = row["task"]
        if task not in self._tasks:
            self._tasks[task] = {item.item_id: item for item in load_task(task)}
        item = self._tasks[task].get(row["item"])
        if item is None:
            raise ValueError(f"task {task!r} has no item {row['item']!r}")
        recorded = (row.get("dataset") or {}).get("item_sha256")
        if recorded is None:
            raise ValueError("the row has no item digest (written before rows recorded one)")
        if item_digest(item) != recorded:
            raise ValueError(f"item {row['item']!r} of task {task!r} is not the one the row was scored on (its "
                             "digest differs: the dataset changed)")
        return item

    def rescore(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """What the row's stored fields should be, recomputed: ``{"metrics": {...}, "evidence": {...}, ...}``."""
        from eval_harness.metrics import evidence_counts
        from eval_harness.decoding_protocol import DecodingProtocol
        from eval_harness.sweep.execute import _metrics
        from eval_harness.sweep.exposure_codec import decode_trace

        if row.get("exposure") is None:
            raise ValueError("the row holds no exposure trace (written before rows recorded it)")
        trace = decode_trace(row["exposure"])
        item, vocab = self._item(row), self._vocabulary(row)
        predicted = DecodingProtocol().predicted(item, row["text"])
        scored: dict[str, Any] = {
            "metrics": _metrics(item, trace, vocab),
            "evidence": evidence_counts(item.evidence_spans, vocab, public_query=item.public_query),
            "predicted": predicted,
            "correct": predicted == item.answer,
        }
        inversion = row.get("inversion")
        if isinstance(inversion, Mapping) and isinstance(inversion.get("reconstruction"), str):
            from eval_harness.attacks.inversion import rouge1

            score = rouge1(inversion["reconstruction"], item.private_context)
            scored["inversion"] = {"recall": score["rouge1_recall"], "f1": score["rouge1_f1"]}
        return scored


def _compared(stored: Mapping[str, Any], recomputed: Mapping[str, Any]) -> Iterable[tuple[str, Any, Any]]:
    """``(name, stored value, recomputed value)`` for every recomputed quantity: ``metrics.token_er@100`` etc."""
    for name, value in recomputed.items():
        if isinstance(value, Mapping):
            held = stored.get(name) if isinstance(stored.get(name), Mapping) else {}
            for sub, sub_value in value.items():
                yield f"{name}.{sub}", held.get(sub), sub_value
            for sub in held.keys() - value.keys():  # a stored metric nothing recomputes: it cannot be vouched for
                yield f"{name}.{sub}", held[sub], None
        else:
            yield name, stored.get(name), value


def run(args: argparse.Namespace) -> int:
    """``decodeleak recompute``: one line per quantity, a summary; 1 if any row disagrees or cannot be re-scored."""
    from eval_harness.cli.shared import progress_bar
    from eval_harness.sweep.store import read_rows_sized

    if args.tolerance < 0:
        raise ValueError(f"--tolerance must be non-negative, got {args.tolerance}")
    rescorer = Rescorer(args.tokenizer)
    agreement: dict[str, Agreement] = {}
    failed: list[tuple[str, str]] = []
    rows = 0
    with progress_bar() as progress:  # in bytes of the files: the rows are not counted before they are read
        bar = progress.add_task("decodeleak recompute (bytes)", total=sum(path.stat().st_size for path in args.results))
        for row, size in read_rows_sized(args.results):
            rows += 1
            key = str(row["key"])
            try:
                recomputed = rescorer.rescore(row)
            except (ValueError, KeyError) as exc:
                failed.append((key, str(exc).strip("'\"")))
                progress.advance(bar, size)
                continue
            for name, stored, value in _compared(row, recomputed):
                agreement.setdefault(name, Agreement()).add(key, stored, value, args.tolerance)
            progress.advance(bar, size)
    width = max((len(name) for name in agreement), default=8)
    print(f"{'quantity':<{width}}  rows  max_abs_diff  disagreeing")
    for name in sorted(agreement):
        a = agreement[name]
        print(f"{name:<{width}}  {a.rows:>4}  {a.max_abs_diff:>12.3g}  {len(a.disagreeing)}"
              + (f"  (e.g. {a.disagreeing[0]})" if a.disagreeing else ""))
    disagreeing = sorted({key for a in agreement.values() for key in a.disagreeing})
    for key, reason in failed[:5]:
        print(f"row {key}: not re-scored: {reason}", file=sys.stderr)
    summary = (f"{rows - len(failed)} of {rows} rows re-scored; "
               f"{len(disagreeing)} disagree with what they store" + (f"; {len(failed)} could not be re-scored"
                                                                       if failed else ""))
    print(summary)
    if disagreeing:
        print("disagreeing rows: " + ", ".join(disagreeing[:10]) + (" ..." if len(disagreeing) > 10 else ""))
    return 1 if disagreeing or failed else 0
