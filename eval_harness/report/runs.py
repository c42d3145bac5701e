"""Reading result files for a report or a figure: once, in constant memory, one run, never two rows merged blind.

Shards, Ray tasks and resumes of one run write rows that merge (their keys never clash, and where a key is in
two files the rows are the same bytes).  What must not merge:

* rows of two runs: a bf16 run's setting means averaged with an fp32 run's, or an item's inversion score taken
  from whichever attacker's file came first.  A run is what :data:`~eval_harness.sweep.store.RUN_FIELDS` record
  (models, dtype, backend, protocol, seed) and, for rows that carry the inversion attack, the attacker
  (:data:`ATTACKER_FIELDS`);
* one key holding different rows in two files: whichever file came first would win, so the table would depend on
  the order of the arguments;
* rows scored by different code (``code.sha256``, e.g. before and after a metric fix), unless the caller says
  mixing them is intended (``allow_code_change``), and then the table names every digest.

:func:`read_run` streams each file once: every line is parsed, checked and cut down to what a table or a figure
reads (:func:`summary_row`: the metric values kept in a flat array, the exposure trace, text and ledger
dropped), so memory grows with the items' metric values, not with the file.  It records the sha256 of every
file it read (:class:`Source`), which each table and figure then carries.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval_harness.metrics.leakage import METRIC_SPECS, attack_columns
from eval_harness.sweep.store import RUN_FIELDS

#: the fields of a row's ``inversion`` that say who attacked and how (its scores aside)
ATTACKER_FIELDS = ("attacker", "k", "max_new_tokens", "prompt")
#: the observer attacks' scores a summary row keeps (the row's ``observer`` field less its recordings)
OBSERVER_SCORES = tuple(METRIC_SPECS[column].entry for column in attack_columns("observer"))
#: the fields every result row has and every table reads
ROW_FIELDS = ("task", "mode", "policy", "correct", "metrics")
#: what of a row's privacy ledger the tables and figures read
PRIVACY_FIELDS = ("guarantee", "epsilon_spent", "delta")
#: how a report's title says each batch-invariant kind of forward (a row's ``batching.forwards``)
FORWARD_WORDS = {"per-sequence": "one forward per item", "batch-invariant": "batched forwards through batch-invariant "
                                                                             "kernels"}
#: at most this many differing fields are named in a refusal (then how many more)
NAMED_DIFFERENCES = 6


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


def differing_fields(a: Any, b: Any, path: str = "") -> list[str]:
    """Every dotted path at which ``a`` and ``b`` differ, down to the leaves of nested objects (a field only one
    of them has differs too; lists are compared whole)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        found: list[str] = []
        for name in sorted(a.keys() | b.keys()):
            inner = f"{path}.{name}" if path else name
            if name not in a or name not in b:
                found.append(inner)
            else:
                found += differing_fields(a[name], b[name], inner)
        return found
    return [] if a == b else [path or "(the row)"]


def _at(run: Mapping[str, Any], path: str) -> Any:
    value: Any = run
    for name in path.split("."):
        value = value[name]
    return value


class MetricValues(Mapping[str, float]):
    """A row's ``metrics`` held compactly: the names shared by every row that recorded the same ones, the values
    in one ``array('d')`` (8 bytes each instead of a dict entry, a key string and a float object)."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: Mapping[str, int], values: array) -> None:
        self._index, self._values = index, values

    def __getitem__(self, name: str) -> float:
        return self._values[self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _Compactor:
    """Cuts rows down to :func:`summary_row`, sharing what repeats across rows (metric names, parameters,
    privacy summaries, batching) instead of holding a copy per row."""

    def __init__(self) -> None:
        self._indexes: dict[tuple[str, ...], dict[str, int]] = {}
        self._shared: dict[str, Any] = {}

    def metrics(self, metrics: Mapping[str, Any]) -> Mapping[str, Any]:
        try:
            values = array("d", metrics.values())
        except TypeError:  # a null metric stays null
            return {sys.intern(str(k)): v for k, v in metrics.items()}
        names = tuple(metrics)
        index = self._indexes.get(names)
        if index is None:
            index = self._indexes[names] = {sys.intern(name): n for n, name in enumerate(names)}
        return MetricValues(index, values)

    def shared(self, value: Any) -> Any:
        """One object for every equal JSON ``value`` (treated as read-only by the tables and figures)."""
        if value is None or isinstance(value, (bool, int, float)):
            return value
        text = json.dumps(value, sort_keys=True)
        return self._shared.setdefault(text, value)

    def interned(self, value: Any) -> Any:
        """``value`` with its mappings' keys and its short strings interned (for what varies per row)."""
        if isinstance(value, Mapping):
            return {sys.intern(str(k)): self.interned(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.interned(v) for v in value]
        return sys.intern(value) if isinstance(value, str) and len(value) < 64 else value


def summary_row(row: Mapping[str, Any], compactor: _Compactor) -> dict[str, Any]:
    """What the tables and figures read of ``row``: its key, item, setting, correctness, metrics (compact),
    the privacy ledger's ``PRIVACY_FIELDS``, the inversion's attacker and scores (not its reconstruction), the
    observer attacks' scores (not their recordings), the mechanism statistics, dtype and batching.  The exposure
    trace, text, token ids and ledger are dropped."""
    privacy = row.get("privacy")
    inversion = row.get("inversion")
    observer = row.get("observer")
    return {
        "key": str(row["key"]),
        "item": row.get("item"),
        "task": sys.intern(str(row["task"])),
        "mode": sys.intern(str(row["mode"])),
        "policy": sys.intern(str(row["policy"])),
        "params": compactor.shared(row.get("params", {})),
        "alpha": row.get("alpha"),
        "correct": bool(row["correct"]),
        "metrics": compactor.metrics(row["metrics"]),
        "privacy": (compactor.shared({name: privacy.get(name) for name in PRIVACY_FIELDS})
                    if isinstance(privacy, Mapping) else privacy),
        "inversion": (compactor.interned({name: inversion.get(name) for name in (*ATTACKER_FIELDS, "recall", "f1")})
                      if isinstance(inversion, Mapping) else inversion),
        "observer": ({name: observer.get(name) for name in OBSERVER_SCORES}
                     if isinstance(observer, Mapping) else observer),
        "mechanism": compactor.interned(row.get("mechanism")),
        "dtype": compactor.shared(row.get("dtype")),
        "batching": compactor.shared(row.get("batching")),
    }


@dataclass(frozen=True)
class Source:
    """A file a report or figure read: its path, the sha256 of its bytes, and the rows it gave."""

    path: str
    sha256: str
    rows: int

    def line(self) -> str:
        return f"{self.path} (sha256 {self.sha256}, {self.rows} rows)"


@dataclass
class RunRows:
    """The rows of one run (each key once) cut to :func:`summary_row`, the files read, and the code digests of
    the rows (more than one only where mixing was allowed)."""

    rows: list[dict[str, Any]]
    sources: list[Source]
    code_digests: list[str] = field(default_factory=list)

    def provenance(self) -> dict[str, Any]:
        """What a derived table or figure records of its inputs (``sources.json``, a figure's metadata)."""
        return {"sources": [vars(source) for source in self.sources], "code_sha256": self.code_digests}

    def caption(self) -> str:
        """The lines under a report's title: each file read with its digest, and the code digests when several."""
        text = "Read: " + "; ".join(source.line() for source in self.sources) + "."
        if len(self.code_digests) > 1:
            text += (f"\n\nRows scored by {len(self.code_digests)} versions of the code (mixed on purpose, "
                     f"--allow-code-change): code.sha256 {', '.join(self.code_digests)}.")
        return text


@dataclass(slots=True)
class _FirstSeen:
    """Where a key's row was first read: the file (index into the paths), the line, its byte offset, a digest
    of its bytes."""

    file: int
    line: int
    offset: int
    digest: bytes


def _lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset, line)`` of every line of ``path``, read once."""
    with path.open("rb") as data:
        offset = 0
        for number, line in enumerate(data, 1):
            yield number, offset, line
            offset += len(line)


def _parse(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}:{number}: not a result row ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: not a result row (a JSON {type(row).__name__})")
    if "key" not in row:
        raise ValueError(f"{path}:{number}: not a result row (it has no key)")
    if missing := [name for name in ROW_FIELDS if name not in row]:
        raise ValueError(f"{path}:{number}: row {row['key']!r} is not a decodeleak result row: it has no "
                         f"{', '.join(missing)}")
    return row


def _row_at(path: Path, offset: int) -> dict[str, Any]:
    with path.open("rb") as data:
        data.seek(offset)
        return json.loads(data.readline())


def _named(fields: Sequence[str]) -> str:
    shown = ", ".join(fields[:NAMED_DIFFERENCES])
    return shown + (f" and {len(fields) - NAMED_DIFFERENCES} more" if len(fields) > NAMED_DIFFERENCES else "")


def read_run(paths: Sequence[str | Path], *, allow_code_change: bool = False) -> RunRows:
    """The rows of ``paths``, read once, checked to be of one run and cut to :func:`summary_row`.

    Raises ``ValueError`` in one line naming both files (and lines) and what differs when: two rows are of
    different runs (the first field that differs); one key holds rows that differ (the key and the differing
    fields); two rows were scored by different code (``code.sha256``, the two keys), unless
    ``allow_code_change``.  A key a later file repeats with the same content is read once.
    """
    files = [Path(p) for p in paths]
    compactor = _Compactor()
    rows: list[dict[str, Any]] = []
    sources: list[Source] = []
    runs: list[tuple[dict[str, Any], str]] = []  # each distinct run, with where it was first seen
    codes: dict[str, str] = {}  # code digest -> "path:line (key K)" where first seen
    first: dict[str, _FirstSeen] = {}
    for index, path in enumerate(files):
        file_digest, kept = hashlib.sha256(), 0
        for number, offset, line in _lines(path):
            file_digest.update(line)
            if not line.strip():
                continue
            row = _parse(path, number, line)
            key, where = str(row["key"]), f"{path}:{number}"
            run = run_of(row)
            for other, other_where in runs:
                found = None if other == run else first_difference(other, run)
                if found is not None:
                    raise ValueError(
                        f"rows of different runs: {found} {json.dumps(_at(run, found))} in {where}, "
                        f"{json.dumps(_at(other, found))} in {other_where}; give each run its own report")
            if all(other != run for other, _ in runs):
                runs.append((run, where))
            code = (row.get("code") or {}).get("sha256") if isinstance(row.get("code"), Mapping) else None
            if code is not None and code not in codes:
                if codes and not allow_code_change:
                    other_code, other_where = next(iter(codes.items()))
                    raise ValueError(
                        f"rows scored by different code: code.sha256 {code} in {where} (key {key}), {other_code} "
                        f"in {other_where}; pass --allow-code-change if mixing them is intended")
                codes[code] = f"{where} (key {key})"
            digest = hashlib.blake2b(line.strip(), digest_size=16).digest()
            seen = first.get(key)
            if seen is not None:
                if seen.digest != digest:
                    earlier = _row_at(files[seen.file], seen.offset)
                    fields = differing_fields(earlier, row)
                    if fields:
                        raise ValueError(
                            f"key {key} holds different rows in {files[seen.file]}:{seen.line} and {where} "
                            f"(differing: {_named(fields)}); the report would depend on the files' order")
                continue
            first[key] = _FirstSeen(index, number, offset, digest)
            rows.append(summary_row(row, compactor))
            kept += 1
        sources.append(Source(str(path), file_digest.hexdigest(), kept))
    return RunRows(rows, sources, list(codes))


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
        kinds = sorted({str(b.get("forwards", "per-sequence")) for b in batchings})
        return text + f", batching: {' and '.join(FORWARD_WORDS.get(k, k) for k in kinds)} (rows independent of " \
                      "their batch)"
    padded = sum(1 for b in batchings if not b.get("batch_invariant"))
    return text + (f", batching: {padded} of {len(rows)} rows from padded batched forwards (such a row depends on "
                   "which items shared its batches)" if padded else ", batching unrecorded for some rows")
