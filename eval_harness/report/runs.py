"""Which run result files belong to: a report or a figure reads the rows of one run, never two silently merged.

Shards, Ray tasks and resumes of one run write rows that merge (their keys never clash, and where a key is in
two files the rows are the same run's).  Rows of two runs must not: a bf16 run's setting means averaged with
an fp32 run's, or an item's inversion score taken from whichever attacker's file came first.  A run is what
:data:`~eval_harness.sweep.store.RUN_FIELDS` record (models, dtype, backend, protocol, seed) and, for rows
that carry the inversion attack, the attacker (:data:`ATTACKER_FIELDS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eval_harness.sweep.store import RUN_FIELDS, read_rows

#: the fields of a row's ``inversion`` that say who attacked and how (its scores aside)
ATTACKER_FIELDS = ("attacker", "k", "max_new_tokens", "prompt")


def run_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that say which run ``row`` belongs to: :data:`RUN_FIELDS` and the inversion's attacker."""
    run = {name: row.get(name) for name in RUN_FIELDS}
    inversion = row.get("inversion")
    run["inversion"] = ({name: inversion.get(name) for name in ATTACKER_FIELDS}
                        if isinstance(inversion, Mapping) else None)
    return run


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The dotted path of the first field recorded in both ``a`` and ``b`` with different values (``None``: they
    agree).  A field one of them leaves unrecorded (null or absent: rows from before it was recorded, a row
    without the attack) differs from nothing."""
    if a is None or b is None:
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for name in sorted(a.keys() & b.keys()):
            found = first_difference(a[name], b[name], f"{path}.{name}" if path else name)
            if found is not None:
                return found
        return None
    return None if a == b else path


def _at(run: Mapping[str, Any], path: str) -> Any:
    value: Any = run
    for name in path.split("."):
        value = value[name]
    return value


def check_one_run(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The rows of ``paths`` (each key once, the first file's), after checking that they are of one run.

    Raises ``ValueError`` in one line naming the first field that differs and a file and line on each side.
    Every row is compared, those a later file repeats too (their key is dropped from the result, not from the
    check), so two attackers' scores of the same items are refused instead of the first file's winning.
    """
    seen: list[tuple[dict[str, Any], str]] = []  # each distinct run, with where it was first seen
    for path in paths:
        for number, row in _numbered(path):
            run = run_of(row)
            for other, where in seen:
                field = first_difference(other, run)
                if field is not None:
                    raise ValueError(
                        f"rows of different runs: {field} {json.dumps(_at(run, field))} in {path}:{number}, "
                        f"{json.dumps(_at(other, field))} in {where}; give each run its own report")
            if all(other != run for other, _ in seen):
                seen.append((run, f"{path}:{number}"))
    return list(read_rows(paths))


def _numbered(path: str | Path) -> Iterable[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every row of one file, repeated keys too (``ValueError`` at a line that is not
    a row, as :func:`~eval_harness.sweep.store.read_rows` says it)."""
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a result row ({exc})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{number}: not a result row (a JSON {type(row).__name__})")
                yield number, row


def label(rows: Iterable[Mapping[str, Any]]) -> str:
    """What the report's title says of the run: its dtype and batching, e.g. ``dtype=float32, batching: one
    forward per item (rows independent of their batch)``."""
    rows = list(rows)
    dtypes = sorted({str(row.get("dtype")) for row in rows if row.get("dtype") is not None})
    batchings = [row.get("batching") for row in rows if isinstance(row.get("batching"), Mapping)]
    text = f"dtype={'/'.join(dtypes) if dtypes else 'unrecorded'}"
    if not batchings:
        return text + ", batching unrecorded"
    if all(b.get("batch_invariant") for b in batchings) and len(batchings) == len(rows):
        return text + ", batching: one forward per item (rows independent of their batch)"
    padded = sum(1 for b in batchings if not b.get("batch_invariant"))
    return text + (f", batching: {padded} of {len(rows)} rows from padded batched forwards (such a row depends on "
                   "which items shared its batches)" if padded else ", batching unrecorded for some rows")
