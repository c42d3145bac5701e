"""A person's decisions on the judge's proposals: accept, edit or reject items and spans, saved as made.

The judge proposes (the paper's "GPT-5.4 proposes ... not final decisions"); a person decides. Every decision
is one line appended to ``review.jsonl`` in the build directory and flushed at once: the item, its status
(``accepted``, ``rejected`` or ``pending``) and its full span list as the person left it. An item's state is its
last decision, or, with none, ``pending`` with the judge's spans. A decision is checked before it is written,
by the rule the judge's spans were held to (:func:`~eval_harness.construction.judge.check_spans`): every span
verbatim in the private context, cutting no word, not in the public query, no comma, no repeat; an accepted
item needs at least one span.

Two ways to decide: the local page (:mod:`~eval_harness.construction.review_server`) and a CSV round-trip
(:func:`export_csv`, :func:`import_csv`) for a spreadsheet.
"""

from __future__ import annotations

import csv
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eval_harness.construction.judge import check_spans, occurrences
from eval_harness.construction.pipeline import proposals
from eval_harness.construction.sources import SplitItem
from edge_sdk.private_files import open_private

REVIEW = "review.jsonl"
STATUSES = ("pending", "accepted", "rejected")
#: the CSV's columns: the decision columns a person fills in, then what they read
CSV_COLUMNS = ("_id", "status", "spans", "marked_private_context", "public_query", "answer", "judge_rationale")
#: how ``marked_private_context`` marks a span
MARK_OPEN, MARK_CLOSE = "[[", "]]"
#: a cell starting with one of these is a formula to a spreadsheet (OWASP's list); ``'`` is the escape itself
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
#: the longest CSV field :func:`import_csv` reads (the csv module's default, 128 KiB, is less than a long context)
CSV_FIELD_LIMIT = 16 * 1024 * 1024


@dataclass(frozen=True)
class ReviewItem:
    """A proposed item with its current state: status and spans (the judge's until a person decides)."""

    item: SplitItem
    judge_spans: tuple[str, ...]
    judge_rationale: str
    dropped: tuple[Mapping[str, str], ...]
    status: str
    spans: tuple[str, ...]
    decided_at: str | None

    def to_json(self) -> dict[str, Any]:
        """What the review page shows of it."""
        return {"id": self.item.item_id, "public_query": self.item.public_query, "options": self.item.options,
                "answer_idx": self.item.answer_idx, "private_context": self.item.private_context,
                "judge_spans": list(self.judge_spans), "judge_rationale": self.judge_rationale,
                "dropped": [dict(d) for d in self.dropped], "status": self.status, "spans": list(self.spans),
                "segments": [{"text": text, "span": index}
                             for text, index in segments(self.item.private_context, self.spans)],
                "decided_at": self.decided_at}


def check_decision(item: SplitItem, status: str, spans: Sequence[str]) -> list[str]:
    """The spans of a decision, stripped (``ValueError`` naming the first problem)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    if not isinstance(spans, (list, tuple)) or not all(isinstance(span, str) for span in spans):
        raise ValueError("spans must be a list of strings")
    for span in spans:
        if "," in span:
            raise ValueError(f"span {span!r} holds a comma: the benchmark's filtered_context separates spans by "
                             "commas, so make it two spans")
    kept, dropped = check_spans(spans, item)
    if dropped:
        raise ValueError(f"span {dropped[0]['span']!r}: {dropped[0]['reason']}")
    if status == "accepted" and not kept:
        raise ValueError("an accepted item needs at least one span")
    return kept


class ReviewLog:
    """``review.jsonl``: decisions appended as they are made; the state is each item's last one (thread-safe).

    Args:
        directory: the build directory (its proposals are what can be decided on).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / REVIEW
        self._lock = threading.Lock()
        self._proposals = {item.item_id: (item, row) for item, row in proposals(self.directory)}
        self._last: dict[str, dict[str, Any]] = {}
        data = self.path.read_bytes() if self.path.exists() else b""
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn last line: the decision was never confirmed to the person
            with self.path.open("r+b") as out:
                out.truncate(end)
        for number, line in enumerate(data[:end].decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                decision = json.loads(line)
                self._last[decision["item"]] = decision
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.path}:{number}: not a review decision ({exc})") from None

    def items(self) -> list[ReviewItem]:
        """Every proposed item with its current state, in source order."""
        return [self.item(item_id) for item_id in self._proposals]

    def item(self, item_id: str) -> ReviewItem:
        if item_id not in self._proposals:
            raise KeyError(f"no proposed item {item_id!r} in {self.directory}")
        item, row = self._proposals[item_id]
        last = self._last.get(item_id)
        return ReviewItem(item=item, judge_spans=tuple(row["spans"]), judge_rationale=row["detail"],
                          dropped=tuple(row["dropped"]),
                          status=last["status"] if last else "pending",
                          spans=tuple(last["spans"]) if last else tuple(row["spans"]),
                          decided_at=last["at"] if last else None)

    def decide(self, item_id: str, status: str, spans: Sequence[str]) -> ReviewItem:
        """Check a decision, append it and flush it to disk; the item's new state."""
        current = self.item(item_id)
        kept = check_decision(current.item, status, spans)
        decision = {"item": item_id, "status": status, "spans": kept,
                    "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with self._lock:
            with open_private(self.path, "a", encoding="utf-8") as out:
                out.write(json.dumps(decision, ensure_ascii=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
            self._last[item_id] = decision
        return self.item(item_id)

    def counts(self) -> dict[str, int]:
        """Items by status."""
        counts = dict.fromkeys(STATUSES, 0)
        for item in self.items():
            counts[item.status] += 1
        return counts


def segments(context: str, spans: Sequence[str]) -> list[tuple[str, int | None]]:
    """``context`` cut into ``(text, span index or None)`` pieces, every whole-word occurrence of every span marked.

    Longer spans claim their text first; an occurrence overlapping one already marked stays unmarked.
    """
    taken: list[tuple[int, int, int]] = []
    for index in sorted(range(len(spans)), key=lambda i: -len(spans[i])):
        for start in occurrences(spans[index], context):
            end = start + len(spans[index])
            if all(end <= a or start >= b for a, b, _ in taken):
                taken.append((start, end, index))
    pieces: list[tuple[str, int | None]] = []
    last = 0
    for start, end, index in sorted(taken):
        if start > last:
            pieces.append((context[last:start], None))
        pieces.append((context[start:end], index))
        last = end
    if last < len(context):
        pieces.append((context[last:], None))
    return pieces


def marked(context: str, spans: Sequence[str]) -> str:
    """``context`` with every whole-word occurrence of a span wrapped in ``[[`` ``]]``."""
    return "".join(f"{MARK_OPEN}{text}{MARK_CLOSE}" if index is not None else text
                   for text, index in segments(context, spans))


def escape_formula(cell: str) -> str:
    """``cell`` made inert for a spreadsheet: ``'`` before a cell that starts with a formula character or with
    ``'`` (so the escape can be undone exactly, :func:`unescape_formula`); any other cell unchanged."""
    return "'" + cell if cell.startswith((*FORMULA_STARTS, "'")) else cell


def unescape_formula(cell: str) -> str:
    """The inverse of :func:`escape_formula`: one ``'`` dropped before a formula character or ``'``. A cell a
    spreadsheet saved without the escape (the text the person saw) comes back unchanged."""
    return cell[1:] if cell.startswith("'") and cell[1:].startswith((*FORMULA_STARTS, "'")) else cell


def export_csv(log: ReviewLog, path: str | Path) -> int:
    """Write every proposed item to a CSV for a spreadsheet: fill in ``status`` and edit ``spans`` (comma-separated,
    as in the benchmark); ``marked_private_context`` shows the spans in ``[[ ]]``. Returns the rows written."""
    items = log.items()
    with open_private(path, "w", encoding="utf-8", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for entry in items:
            row = {"_id": entry.item.item_id, "status": entry.status, "spans": ", ".join(entry.spans),
                   "marked_private_context": marked(entry.item.private_context, entry.spans),
                   "public_query": entry.item.public_query, "answer": f"({entry.item.answer_idx}) {entry.item.answer}",
                   "judge_rationale": entry.judge_rationale}
            writer.writerow({column: escape_formula(text) for column, text in row.items()})
    return len(items)


def import_csv(log: ReviewLog, path: str | Path) -> dict[str, int]:
    """Apply a reviewed CSV: each row whose status or spans differ from the item's state becomes a decision.

    Every row is checked first; if any is wrong nothing is written (``ValueError`` naming each bad row by its
    line). Cells are read through :func:`unescape_formula`. Returns the decisions made, by status.
    """
    limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        planned, problems = _plan_import(log, path)
    except csv.Error as exc:
        raise ValueError(f"{path}: not a readable CSV ({exc}; a field may be at most {CSV_FIELD_LIMIT} "
                         "characters)") from None
    finally:
        csv.field_size_limit(limit)
    if problems:
        raise ValueError(f"{path}: nothing imported; " + "; ".join(problems))
    made = dict.fromkeys(STATUSES, 0)
    for item_id, status, spans in planned:
        log.decide(item_id, status, spans)
        made[status] += 1
    return made


def _plan_import(log: ReviewLog, path: str | Path) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """The decisions a reviewed CSV asks for, and the problems of its bad rows (each named by its line)."""
    with Path(path).open(encoding="utf-8-sig", newline="") as data:
        reader = csv.DictReader(data)
        missing = [c for c in ("_id", "status", "spans") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} column")
        planned, problems = [], []
        for row in reader:
            line = reader.line_num
            try:
                item_id, status, spans = (unescape_formula(row[column] or "") for column in ("_id", "status", "spans"))
                current = log.item(item_id)
                status = (status or "pending").strip().lower()
                spans = [span.strip() for span in spans.split(",") if span.strip()]
                check_decision(current.item, status, spans)
            except (KeyError, ValueError) as exc:
                problems.append(f"line {line}: {exc}")
                continue
            if status != current.status or tuple(spans) != current.spans:
                planned.append((item_id, status, spans))
    return planned, problems
