"""The cloud engine: the model and everything its sessions share.

A :class:`CloudEngine` owns the cloud LLM, the server's limits and their
admission (:mod:`cloud_adapter.limits`), the record of what the cloud observed
(:mod:`cloud_adapter.transcript`) and where forwards run
(:mod:`cloud_adapter.runners`).  Every stream gets a
:class:`~cloud_adapter.session.SessionHandler`, the protocol's state machine.
Nothing here imports gRPC: the server (:mod:`cloud_adapter.server`) and the
in-process transport drive the same handlers.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from cloud_adapter.backends.rows import RowSpec
from cloud_adapter.limits import Admission, Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.runners import DirectRunner, ModelRunner
from cloud_adapter.session import SessionHandler
from cloud_adapter.transcript import SessionTranscript, TranscriptStore
from edge_sdk.decode_settings import DecodeSettings

#: finished transcripts kept in memory for :meth:`CloudEngine.transcript` (within ``Limits.transcript_bytes``)
TRANSCRIPTS_KEPT = 1000
#: rows of steps whose full row was sent when their stream broke, kept for the session that resumes them
RESUMABLE_ROWS_KEPT = 32
RESUMABLE_ROW_TTL_S = 300.0

#: what a resumed session's step must match to be served a kept row: client, space, prompt and prefix
RowKey = tuple[str, str, tuple[int, ...], tuple[int, ...]]


class ResumableRows:
    """The logits of each step whose full row was sent when its stream broke, until a session resumes it.

    The edge asks again for that row on its next connection; a recomputed row (a one-pass prefill of
    prompt and prefix instead of step-by-step decoding) may differ in its last bits, so the resumed step
    is served the row already sent, byte for byte.  At most ``capacity`` rows (the oldest go first), each
    for ``ttl_s`` seconds, each taken once.
    """

    def __init__(self, capacity: int = RESUMABLE_ROWS_KEPT, ttl_s: float = RESUMABLE_ROW_TTL_S) -> None:
        self._capacity, self._ttl_s = capacity, ttl_s
        self._rows: OrderedDict[RowKey, tuple[float, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, key: RowKey, logits: np.ndarray) -> None:
        with self._lock:
            self._rows.pop(key, None)
            self._rows[key] = (time.monotonic(), logits)
            while len(self._rows) > self._capacity:
                self._rows.popitem(last=False)

    def take(self, key: RowKey) -> np.ndarray | None:
        with self._lock:
            kept = self._rows.pop(key, None)
        if kept is None or time.monotonic() - kept[0] > self._ttl_s:
            return None
        return kept[1]


class CloudEngine:
    """The cloud LLM plus everything sessions share: limits, admission and transcripts.

    Args:
        llm: the cloud model.
        limits: the server's limits.
        transcript_dir: when set, each finished session's transcript is written
            there as ``<session_id>.json``.
        exposure_k: ``K`` of DecodeLeak's per-step exposure set ``E_t^K``.
        runner: where forwards run; default: :class:`~cloud_adapter.runners.DirectRunner` (the caller's thread).
        transcript_upload_limit: an upload is kept in the transcript as its largest
            this-many values (its full size is recorded too).  1000 covers every
            cutoff DecodeLeak uses; an undefended upload of all 262k values per
            step would otherwise hold ~2 MB per step in memory.
    """

    def __init__(
        self,
        llm: TransformersLLM,
        limits: Limits | None = None,
        transcript_dir: Path | None = None,
        exposure_k: int = DecodeSettings.exposure_k,
        *,
        runner: ModelRunner | None = None,
        transcript_upload_limit: int = 1000,
    ) -> None:
        if exposure_k < 1 or transcript_upload_limit < exposure_k:
            raise ValueError(
                f"need 1 <= exposure_k <= transcript_upload_limit, got {exposure_k} and {transcript_upload_limit}"
            )
        self.llm = llm
        self.limits = limits or Limits()
        self.admission = Admission(self.limits)
        self.transcripts = TranscriptStore(TRANSCRIPTS_KEPT, self.limits.transcript_bytes, transcript_dir,
                                           max_dir_bytes=self.limits.transcript_dir_bytes)
        self.exposure_k = exposure_k
        self.transcript_upload_limit = transcript_upload_limit
        self.runner: ModelRunner = runner if runner is not None else DirectRunner(llm)
        self.max_upload = self.limits.max_upload if self.limits.max_upload is not None else llm.vocab_size
        self.fingerprint = llm.vocab_fingerprint()
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers refuse concurrent use
        self._lock = threading.Lock()
        self._live: dict[str, SessionHandler] = {}
        self.resumable_rows = ResumableRows()

    def session(self, client_id: str) -> SessionHandler:
        """A handler for one new stream of ``client_id`` (admitted when it opens)."""
        return SessionHandler(self, client_id)

    def warm_up(self) -> None:
        """Run one prefill and one decode step so the first real session pays no start-up cost."""
        seq, _ = self.runner.prefill(self.tokenize("Hello"), spec=RowSpec())
        try:
            top = seq.next_row.ids[0] if seq.next_row is not None else np.argmax(seq.next_logits)
            self.runner.forward(seq, int(top))
        finally:
            self.runner.release(seq)

    def tokenize(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self.llm.tokenize(text)

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._live)

    def transcript(self, session_id: str) -> dict[str, Any]:
        """The observation transcript of a finished session (one of the newest kept)."""
        return self.transcripts.get(session_id)

    # -- called by handlers ------------------------------------------------------------------------
    def admit(self, handler: SessionHandler, session_id: str) -> None:
        """Count ``handler``'s new session against the limits (``RESOURCE_EXHAUSTED`` beyond them)."""
        self.admission.admit_session(handler.client_id)
        with self._lock:
            self._live[session_id] = handler

    def retire(self, handler: SessionHandler, transcript: SessionTranscript) -> None:
        """``handler``'s session ended: free its place and keep its transcript."""
        with self._lock:
            admitted = self._live.pop(transcript.session_id, None) is not None
        if admitted:
            self.admission.session_done(handler.client_id)
        self.transcripts.add(transcript)
