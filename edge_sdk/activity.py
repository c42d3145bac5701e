"""The activity log: one record per generation of what left the device, for the person it protects to export.

Each record says when the generation ended, its mode and policy, what was sent (bytes, values, full-row
requests), how many steps revealed something decided from the private context, the epsilon spent with its
relation and delta (or, for a heuristic, that there is none), and the cloud's session ids.  Nothing of the
private context or of the generated text is kept: only the counts and figures the ledger already reports.

The log is bounded (the newest ``limit`` records) and, when given a path, kept on disk as JSON lines in a
private file (0600 in a 0700 folder, :mod:`edge_sdk.private_files`) that is compacted to the newest ``limit``
records once it holds twice as many.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from edge_sdk.privacy.ledger import PrivacyLedger
from edge_sdk.private_files import open_private

#: records kept by default (the newest)
DEFAULT_ACTIVITY_LIMIT = 1000


def activity_record(ledger: PrivacyLedger, *, finish_reason: str | None, when: datetime | None = None) -> dict[str, Any]:
    """The activity record of one generation (JSON-ready), read off its ledger."""
    privacy = ledger.privacy() or {}
    steps_revealed, values_revealed = ledger.revealed()
    return {
        "when": (when or datetime.now(timezone.utc)).isoformat(timespec="milliseconds"),
        "mode": ledger.mode,
        "policy": ledger.policy,
        "finish_reason": finish_reason,
        "steps": len(ledger.entries),
        "steps_revealed": steps_revealed,
        "values_revealed": values_revealed,
        "values_uploaded": ledger.values_uploaded,
        "tokens_synced": sum(entry.signal == "token" for entry in ledger.entries),
        "full_requests": ledger.full_requests,
        "bytes_up": ledger.bytes_up,
        "bytes_down": ledger.bytes_down,
        "guarantee": privacy.get("guarantee"),
        "epsilon": privacy.get("epsilon_spent"),
        "relation": privacy.get("relation"),
        "delta": privacy.get("delta"),
        "source_relation": privacy.get("source_relation"),
        "withheld_from": privacy.get("withheld_from"),
        "in_words": privacy.get("in_words"),
        "session_ids": list(ledger.session_ids),
        "cloud_model": ledger.cloud_model,
    }


class ActivityLog:
    """The newest ``limit`` activity records, in memory and (with ``path``) in a private JSON-lines file.

    Args:
        limit: how many records are kept (the oldest go first).
        path: the file the log is kept in across runs (``None``: memory only); read back when the log is made.
    """

    def __init__(self, limit: int = DEFAULT_ACTIVITY_LIMIT, path: str | Path | None = None) -> None:
        if int(limit) != limit or limit < 1:
            raise ValueError(f"activity log limit must be a positive integer, got {limit}")
        self.limit = int(limit)
        self.path = None if path is None else Path(path)
        self._records: deque[dict[str, Any]] = deque(maxlen=self.limit)
        self._lines_on_disk = 0
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            with open_private(self.path, "r+", encoding="utf-8") as file:  # narrowed to 0600 if it was not
                lines = [line for line in file.read().splitlines() if line.strip()]
            self._records.extend(json.loads(line) for line in lines[-self.limit:])
            self._lines_on_disk = len(lines)

    def record(self, ledger: PrivacyLedger, *, finish_reason: str | None) -> dict[str, Any]:
        """Add the record of one finished generation (:func:`activity_record`) and return it."""
        entry = activity_record(ledger, finish_reason=finish_reason)
        with self._lock:
            self._records.append(entry)
            if self.path is not None:
                self._write(entry)
        return entry

    def _write(self, entry: dict[str, Any]) -> None:
        assert self.path is not None
        if self._lines_on_disk + 1 >= 2 * self.limit:  # compact: the newest ``limit`` records, replaced at once
            partial = self.path.with_name(self.path.name + ".partial")
            with open_private(partial, "w", encoding="utf-8") as file:
                file.writelines(json.dumps(record) + "\n" for record in self._records)
            os.replace(partial, self.path)
            self._lines_on_disk = len(self._records)
            return
        with open_private(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps(entry) + "\n")
        self._lines_on_disk += 1

    def entries(self) -> list[dict[str, Any]]:
        """The records, oldest first (copies)."""
        with self._lock:
            return [dict(record) for record in self._records]

    def export(self) -> str:
        """The records as one JSON document (``{"activity": [...]}``), what a person downloads."""
        return json.dumps({"activity": self.entries()}, indent=1)
