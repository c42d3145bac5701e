"""Append-only JSONL results: one row per (setting, item), written as it finishes, resumed by key.

Each row is one JSON object on one line carrying a ``key``
(:func:`eval_harness.sweep.grid.row_key`).  A row is appended and flushed
as soon as it is finished, so a crash or Ctrl-C loses at most the row being
written; a torn last line (the process died mid-write) is set aside when
the file is next opened, never parsed as a result.  A re-run reads the keys
already present and skips them.

A row's key names its setting and item only, so a file holds one *run*: the
row fields in :data:`RUN_FIELDS` (models and their digests, dtype, backend,
protocol, seed) must agree across it, except where older rows left a field
unrecorded (null or absent: it matches any value).  A store refuses a row, or a re-run's
metadata (:meth:`ResultStore.check_run`), from another run: otherwise a
re-run with another ``--max-new-tokens`` or model would skip every pair as
done and leave rows of two runs in one file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from edge_sdk.private_files import open_private, private_dir


#: the row fields that identify the run a row belongs to (a file holds one run)
RUN_FIELDS = ("models", "dtype", "backend", "protocol", "seed")


def run_identity(row: Mapping[str, Any]) -> str:
    """The :data:`RUN_FIELDS` of a row (or of a run's metadata) as canonical JSON."""
    return json.dumps({name: row.get(name) for name in RUN_FIELDS}, sort_keys=True, separators=(",", ":"))


def _compatible(found: Any, wanted: Any) -> bool:
    """Whether a run recorded as ``found`` in the file is the run ``wanted``: equal, except that what the file
    left unrecorded (``null`` or absent: rows written before the field was recorded, e.g. a checkpoint's
    ``sha256`` before it had a digest, or a protocol field added since) matches anything."""
    if found is None:
        return True
    if isinstance(found, dict) and isinstance(wanted, dict):
        return all(_compatible(value, wanted.get(name)) for name, value in found.items())
    return found == wanted


def _run_difference(found: str, wanted: str) -> str:
    """``protocol.max_new_tokens 256 here, 8 in the file``: the first incompatible entry of :data:`RUN_FIELDS`
    (:func:`_compatible`), followed into nested objects down to the first incompatible leaf."""
    old, new = json.loads(found), json.loads(wanted)
    path = []
    while isinstance(old, dict) and isinstance(new, dict):
        name = next(n for n in (RUN_FIELDS if not path else sorted(old.keys() | new.keys()))
                    if not _compatible(old.get(n), new.get(n)))
        path.append(name)
        old, new = old.get(name), new.get(name)
    return f"{'.'.join(path)} {json.dumps(new)} here, {json.dumps(old)} in the file"


class RowStore(Protocol):
    """Where a sweep puts finished rows: asked which keys are done, given each new row once."""

    def __contains__(self, key: object) -> bool: ...

    def append(self, row: Mapping[str, Any]) -> None: ...


class ResultStore:
    """One JSONL results file, opened for appending (0600; folders it makes 0700: :mod:`edge_sdk.private_files`).

    Args:
        path: the file (created with its parent directory if missing).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        private_dir(self.path.parent)
        self._keys: set[str] = set()
        self._runs: set[str] = set()  # run_identity of the rows in the file
        self.recovered_bytes = 0  # bytes of a torn last line moved aside on opening
        self._load()
        self._file = open_private(self.path, "a", encoding="utf-8")  # rows hold decoded private answers

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a line without its newline: the writer died while writing it
            torn = self.path.with_name(self.path.name + ".torn")
            with open_private(torn, "ab") as aside:
                aside.write(data[end:] + b"\n")
            with self.path.open("r+b") as out:
                out.truncate(end)
            self.recovered_bytes = len(data) - end
        for number, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self._keys.add(str(row["key"]))
                self._runs.add(run_identity(row))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{self.path}:{number}: not a result row ({exc})") from None

    def check_run(self, metadata: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) to add rows of the run ``metadata`` describes to a file of another run."""
        wanted = run_identity(metadata)
        for found in sorted(self._runs):
            if not _compatible(json.loads(found), json.loads(wanted)):
                raise ValueError(f"{self.path} holds rows of another run ({_run_difference(found, wanted)}); "
                                 "give this run its own --out")

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def append(self, row: Mapping[str, Any]) -> None:
        """Write one finished row (it must carry a ``key`` not written before) and flush it to the OS."""
        key = str(row["key"])
        if key in self._keys:
            raise ValueError(f"row {key} is already in {self.path}")
        self.check_run(row)
        self._file.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._keys.add(key)
        self._runs.add(run_identity(row))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_rows(paths: Iterable[str | Path]) -> Iterator[dict[str, Any]]:
    """The rows of several result files (e.g. one per shard), each key once (the first seen wins)."""
    for row, _ in read_rows_sized(paths):
        yield row


def read_rows_sized(paths: Iterable[str | Path]) -> Iterator[tuple[dict[str, Any], int]]:
    """:func:`read_rows` with the bytes of each row's line (a line of a repeated key counts with the next row
    given), streamed: one line in memory at a time."""
    seen: set[str] = set()
    skipped = 0
    for path in paths:
        with Path(path).open("rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    skipped += len(line)
                    continue
                try:
                    row = json.loads(line)
                    key = str(row["key"])
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a result row ({exc})") from None
                if key in seen:
                    skipped += len(line)
                    continue
                seen.add(key)
                yield row, skipped + len(line)
                skipped = 0
