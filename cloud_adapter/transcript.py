"""What the cloud observed in each session, in DecodeLeak's exposure format, and where finished ones are kept."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.protocol.signals import CloudUpload


@dataclass(eq=False)
class StepRecord:
    """What the cloud observed at one step (arrays stay numpy until serialised)."""

    step: int
    token_id: int | None = None
    full_requested: bool = False
    upload: CloudUpload | None = None  # at most the engine's transcript_upload_limit largest values
    upload_size: int = 0  # how many values the edge uploaded
    exposure: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    bytes_up: int = 0
    bytes_down: int = 0

    def as_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"step": self.step, "token_id": self.token_id, "full_requested": self.full_requested}
        if self.upload is not None:
            entry["upload_ids"] = self.upload.ids.tolist()
            entry["upload_values"] = self.upload.values.tolist()
            entry["upload_size"] = self.upload_size
        entry["exposure"] = self.exposure.tolist()
        entry["bytes_up"] = self.bytes_up
        entry["bytes_down"] = self.bytes_down
        return entry


@dataclass(eq=False)
class SessionTranscript:
    """Everything the cloud saw in one session, in DecodeLeak's exposure format (see :meth:`as_dict`)."""

    session_id: str
    request: wire.SessionRequest
    cloud_model: str
    max_new_tokens: int
    exposure_k: int  # K of every step's exposure set E_t^K
    steps: list[StepRecord] = field(default_factory=list)
    finish_reason: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    lookahead: int = 0  # the run-ahead depth agreed when the session opened (0 = lockstep)
    forwards: int = 0  # decode forwards the cloud ran (drafts included, the prefill not)
    drafts_dropped: int = 0  # drafted forwards rolled back (the edge confirmed another token)
    draft_agreements: int = 0  # confirmed tokens that were the cloud's draft token
    depth_sum: int = 0  # over the confirmed tokens, the rows drafted past the awaited step when each arrived

    def as_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "session_id": self.session_id,
            "mode": req.mode,
            "space": req.space,
            "alpha": req.alpha,
            "temperature": req.temperature,
            "seed": req.seed,
            "logprobs": req.logprobs,
            "top_logprobs": req.top_logprobs,
            "json_schema": req.json_schema,
            "score_prompt": req.score_prompt,
            "prompt_ids": list(req.prompt_ids),
            "resume_prefix": list(req.resume_prefix),
            "max_new_tokens": self.max_new_tokens,
            "exposure_k": self.exposure_k,
            "cloud_model": self.cloud_model,
            "edge_model": req.edge_model,
            "steps": [step.as_dict() for step in self.steps],
            "finish_reason": self.finish_reason,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "lookahead": self.lookahead,
            "forwards": self.forwards,
            "drafts_dropped": self.drafts_dropped,
            "forwards_per_token": round(self.forwards / len(self.steps), 4) if self.steps else 0.0,
            "draft_agreements": self.draft_agreements,
            "mean_depth": round(self.depth_sum / len(self.steps), 4) if self.steps else 0.0,
        }


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    fd, staging = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _step_bytes(step: StepRecord) -> int:
    """Memory a step's record holds: its arrays plus a fixed overhead for the Python objects."""
    held = step.exposure.nbytes + 256
    if step.upload is not None:
        held += step.upload.ids.nbytes + step.upload.values.nbytes
    return held


class TranscriptStore:
    """The finished sessions' transcripts: the newest ``max_kept`` within ``max_bytes``, optionally on disk too.

    Args:
        max_kept: how many transcripts stay in memory for :meth:`get`.
        max_bytes: the memory they may hold together; the oldest are dropped first (the newest always stays).
        directory: when set, each transcript is also written there as ``<session_id>.json``.
        max_dir_bytes: the disk the ``*.json`` files in ``directory`` may take together, those found there at start
            included: after each write the oldest (by modification time) are deleted until they fit (the newest
            always stays), so a long-running server cannot fill its disk.
    """

    def __init__(self, max_kept: int = 1000, max_bytes: int = 256 * 1024 * 1024, directory: Path | None = None,
                 *, max_dir_bytes: int = 4096 * 1024 * 1024) -> None:
        self.max_kept, self.max_bytes, self.max_dir_bytes = max_kept, max_bytes, max_dir_bytes
        self.directory = Path(directory) if directory is not None else None
        self._on_disk: OrderedDict[Path, int] = OrderedDict()  # oldest first
        self.dir_bytes = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = [(path.stat().st_mtime_ns, path) for path in self.directory.glob("*.json") if path.is_file()]
            for _, path in sorted(found):
                self._on_disk[path] = path.stat().st_size
                self.dir_bytes += self._on_disk[path]
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[SessionTranscript, int]] = OrderedDict()
        self.bytes_held = 0

    def add(self, transcript: SessionTranscript) -> None:
        request = transcript.request
        size = sum(_step_bytes(step) for step in transcript.steps) + 1024 + len(request.edge_model) + 8 * (
            len(request.prompt_ids) + len(request.resume_prefix) + len(request.stop_token_ids)
        )
        with self._lock:
            self._kept[transcript.session_id] = (transcript, size)
            self.bytes_held += size
            while len(self._kept) > 1 and (len(self._kept) > self.max_kept or self.bytes_held > self.max_bytes):
                _, (_, dropped) = self._kept.popitem(last=False)
                self.bytes_held -= dropped
        if self.directory is not None:
            path = self.directory / f"{transcript.session_id}.json"
            _write_json_atomically(path, transcript.as_dict())
            self._account_on_disk(path)

    def _account_on_disk(self, path: Path) -> None:
        """Count the file just written and delete the oldest until the directory fits ``max_dir_bytes``."""
        with self._lock:
            self.dir_bytes -= self._on_disk.pop(path, 0)
            self._on_disk[path] = path.stat().st_size
            self.dir_bytes += self._on_disk[path]
            while len(self._on_disk) > 1 and self.dir_bytes > self.max_dir_bytes:
                oldest, written = self._on_disk.popitem(last=False)
                oldest.unlink(missing_ok=True)
                self.dir_bytes -= written

    def get(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            kept = self._kept.get(session_id)
        if kept is None:
            raise KeyError(f"no finished session {session_id!r} is kept (the newest {self.max_kept} within "
                           f"{self.max_bytes} bytes are)")
        return kept[0].as_dict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
