"""Auditing a generation from what the cloud observed: its adapter's transcripts, checked against the edge's ledger.

When a session opens, the cloud adapter hands the edge the session's id
(``SessionInfo.session_id``); the edge keeps it in its ledger
(:attr:`edge_sdk.privacy.ledger.PrivacyLedger.session_ids`, one id per session, so a
resumed generation has several).  An adapter run with ``--transcript-dir DIR``
writes each finished session's observation transcript to
``DIR/<session_id>.json``.  The audit reads those files, stitches the
sessions of one generation together by step number (a step re-sent after a
broken stream was observed twice, the same bytes both times; the later
record stands), and takes DecodeLeak's exposure sequence ``{E_t^K}`` from
them: what the cloud itself recorded.  The edge's own trace (the same rule,
computed on the device) is compared step by step at the cutoff both
recorded, ``K = min(K_transcript, K_ledger)``, together with the tokens
decided; for an honest adapter the two agree exactly.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sdk.client import GenerationResult
from edge_sdk.privacy.meter import ExposureTrace

#: what the exposure sequence of a row was read from (the row's ``audit.exposure_source``)
FROM_TRANSCRIPT = "cloud transcript"
FROM_LEDGER = "edge ledger"

#: a session id the auditor will turn into a file name: no path separators, no dots, nothing odd
_SAFE_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_POLL_S = 0.05


@dataclass
class AuditedResult(GenerationResult):
    """A generation of the deployed stack with its audit.

    Attributes:
        observed: the exposure sequence the cloud's transcripts record (``None``: none could be read,
            see ``audit["reason"]``; the audit then rests on the edge's ledger).
        audit: where the trace came from, the session ids, the transcript's ``K``, and whether the
            ledger agrees (:func:`audit_generation`).
    """

    observed: ExposureTrace | None = None
    audit: dict[str, Any] = field(default_factory=dict)

    def exposure_trace(self) -> ExposureTrace:
        """The trace the metrics are computed on: the cloud's when it was read, else the edge's ledger's."""
        return self.observed if self.observed is not None else self.ledger.exposure_trace()


class TranscriptError(ValueError):
    """A transcript is missing, unreadable, or not of this generation."""


def transcript_path(directory: Path, session_id: str) -> Path:
    """``directory/<session_id>.json``; a session id that is no plain name (``../x``) is refused, not joined."""
    if not _SAFE_SESSION_ID.fullmatch(session_id):
        raise TranscriptError(f"session id {session_id!r} is not a plain name; no transcript file is read for it")
    return directory / f"{session_id}.json"


def read_transcript(directory: Path, session_id: str, *, deadline: float) -> dict[str, Any]:
    """The transcript of ``session_id``, waiting until ``deadline`` (``time.monotonic()``) for it to appear.

    An adapter writes a transcript when the session ends on its side, which
    for a session the edge closed (the stopping rule) is a moment after the
    edge has its result; a transcript directory synced from a remote adapter
    lags further.
    """
    path = transcript_path(directory, session_id)
    while not path.is_file():
        if time.monotonic() >= deadline:
            raise TranscriptError(f"no transcript {path.name} in {directory}")
        time.sleep(_POLL_S)
    try:
        transcript = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TranscriptError(f"cannot read transcript {path}: {exc}") from None
    if not isinstance(transcript, dict) or transcript.get("session_id") != session_id:
        raise TranscriptError(f"{path} is not the transcript of session {session_id}")
    return transcript


def stitch(transcripts: Sequence[Mapping[str, Any]]) -> tuple[ExposureTrace, list[int | None]]:
    """One generation's sessions, in order, as one trace and the token of each step.

    Step ``t`` is the last record of step ``t`` across the sessions; the
    steps must run ``0 .. n-1`` without a gap.  ``K`` is the smallest of the
    sessions' ``exposure_k``.
    """
    by_step: dict[int, Mapping[str, Any]] = {}
    for transcript in transcripts:
        for record in transcript["steps"]:
            by_step[int(record["step"])] = record
    if sorted(by_step) != list(range(len(by_step))):
        missing = sorted(set(range(max(by_step, default=-1) + 1)) - set(by_step))
        raise TranscriptError(f"the transcripts skip steps {missing[:5]}")
    k = min(int(t["exposure_k"]) for t in transcripts)
    records = [by_step[t] for t in range(len(by_step))]
    trace = ExposureTrace(k, tuple(tuple(r["exposure"])[:k] for r in records))
    return trace, [r.get("token_id") for r in records]


def first_disagreement(observed: ExposureTrace, observed_tokens: Sequence[int | None], result: GenerationResult
                       ) -> int | None:
    """The first step where the cloud's record and the edge's differ (exposure at the common ``K``, or token).

    ``None`` when they agree at every step and have as many steps.  A length
    mismatch disagrees at the first step one side lacks.
    """
    ledger = result.ledger.exposure_trace()
    k = min(observed.k, ledger.k)
    cloud_steps, edge_steps = observed.top(k), ledger.top(k)
    for t in range(min(len(cloud_steps), len(edge_steps))):
        if cloud_steps[t] != edge_steps[t] or observed_tokens[t] != result.ledger.entries[t].token_id:
            return t
    if len(cloud_steps) != len(edge_steps):
        return min(len(cloud_steps), len(edge_steps))
    return None


def audit_generation(result: GenerationResult, transcripts: Path | None, *, wait_s: float = 30.0) -> AuditedResult:
    """``result`` audited against the cloud's transcripts in ``transcripts`` (``None``: from the ledger only).

    The audit record (``AuditedResult.audit``):

    * ``exposure_source``: ``"cloud transcript"`` or ``"edge ledger"``;
    * ``sessions``: the session ids of the generation, in order; ``cloud_model``: the model the adapter
      said it serves;
    * with transcripts: ``transcript_k``, ``ledger_agrees`` and
      ``first_disagreement`` (the first step where the ledger differs, or ``None``);
    * without: ``reason``, why the trace is the ledger's.
    """
    sessions = list(result.ledger.session_ids)
    audit: dict[str, Any] = {"sessions": sessions, "cloud_model": result.ledger.cloud_model}
    observed: ExposureTrace | None = None
    if transcripts is None:
        audit.update(exposure_source=FROM_LEDGER, reason="no transcript directory was given")
    elif not sessions:
        audit.update(exposure_source=FROM_LEDGER, reason="the generation opened no session")
    else:
        deadline = time.monotonic() + wait_s
        try:
            read = [read_transcript(transcripts, session_id, deadline=deadline) for session_id in sessions]
            observed, tokens = stitch(read)
        except (KeyError, TypeError, ValueError) as exc:  # a missing or malformed transcript (TranscriptError too)
            audit.update(exposure_source=FROM_LEDGER, reason=f"{type(exc).__name__}: {exc}")
        else:
            disagreement = first_disagreement(observed, tokens, result)
            audit.update(exposure_source=FROM_TRANSCRIPT, transcript_k=observed.k,
                         ledger_agrees=disagreement is None, first_disagreement=disagreement)
    return AuditedResult(result.text, result.token_ids, result.ledger, result.finish_reason,
                         observed=observed, audit=audit)
