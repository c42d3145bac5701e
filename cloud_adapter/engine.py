"""The cloud half of a decoding session, independent of the transport.

A :class:`CloudEngine` owns the cloud LLM, the server's :class:`Limits` and the
record of what the cloud observed in each session.  Every stream gets a
:class:`SessionHandler`, a small state machine that consumes decoded
``EdgeMessage`` protos and yields the ``CloudMessage`` protos to send back; it
raises :class:`ProtocolError` (a gRPC status code name and a message) on bad
input, so this module needs no gRPC import.

Model calls go through a :class:`ModelRunner`: :class:`DirectRunner` runs them
in the caller's thread (in-process use), :class:`StepBatcher` runs them on one
worker thread that owns the model and folds the decode steps of all sessions
that arrive together into one batched forward pass.

Message sequence of one session (steps start at ``len(resume_prefix)``)::

    edge  open ─────────────►  cloud: prefill, opened, distribution(t)
    edge  request_full(t) ──►  cloud: distribution(t, dense)          (optional, once)
    edge  signal(t) ────────►  cloud: [token(t)] then finished | forward + distribution(t+1)
    edge  close ────────────►  cloud: finished("closed")
"""

from __future__ import annotations

import enum
import json
import math
import os
import tempfile
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cloud_adapter.llm import CloudSequence, TransformersLLM
from edge_sdk import wire
from edge_sdk.fusion import FusionSpace, NonFiniteError, check_alpha, check_finite, pick_token, softmax, top_k_ids
from edge_sdk.models import VocabularyMismatchError, check_same_vocabulary
from edge_sdk.policies.base import CloudUpload, SyncedToken

#: finished transcripts kept in memory for :meth:`CloudEngine.transcript`
TRANSCRIPTS_KEPT = 1000


class ProtocolError(Exception):
    """The edge broke the protocol or a limit; ``code`` names a ``grpc.StatusCode`` member."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """What one cloud server allows.

    Args:
        max_sessions_total: concurrent sessions over all clients (keep it below
            the server's worker threads so health checks always find one).
        max_sessions_per_client: concurrent sessions of one client identity.
        idle_timeout_s: a session whose edge sends nothing for this long is
            evicted and its KV cache freed.
        max_new_tokens: the most tokens one session may decode (also the
            default when the edge asks for 0).
        max_upload: the most ids one upload may carry; ``None`` = vocabulary size.
        max_message_bytes: the largest gRPC message accepted or sent.
    """

    max_sessions_total: int = 24
    max_sessions_per_client: int = 8
    idle_timeout_s: float = 300.0
    max_new_tokens: int = 1024
    max_upload: int | None = None
    max_message_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_sessions_total", "max_sessions_per_client", "max_new_tokens", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"Limits.idle_timeout_s must be positive, got {self.idle_timeout_s}")
        if self.max_upload is not None and self.max_upload < 0:
            raise ValueError(f"Limits.max_upload must be non-negative, got {self.max_upload}")


# -- model runners -------------------------------------------------------------------------------


class ModelRunner(Protocol):
    """Where the engine's forward passes run.  Every method blocks until its work is done."""

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[CloudSequence, int]:
        """Open a sequence on ``prompt_ids``; returns it and the forward time in ns."""
        ...

    def forward(self, seq: CloudSequence, token_id: int) -> int:
        """Append ``token_id`` to ``seq`` (refreshing ``seq.next_logits``); returns the forward time in ns."""
        ...

    def release(self, seq: CloudSequence) -> None:
        """``seq`` will not be stepped again (its session ended)."""
        ...


class DirectRunner:
    """Runs each forward in the caller's thread, one at a time (a lock serialises callers)."""

    def __init__(self, llm: TransformersLLM) -> None:
        self._llm = llm
        self._lock = threading.Lock()

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[CloudSequence, int]:
        with self._lock:
            start = time.perf_counter_ns()
            seq = self._llm.open(prompt_ids)
            return seq, time.perf_counter_ns() - start

    def forward(self, seq: CloudSequence, token_id: int) -> int:
        with self._lock:
            start = time.perf_counter_ns()
            self._llm.step([(seq, token_id)])
            return time.perf_counter_ns() - start

    def release(self, seq: CloudSequence) -> None:
        """Nothing to do: the sequence's cache is freed with its last reference."""


@dataclass(eq=False)
class _StepRequest:
    seq: CloudSequence
    token_id: int
    result: Future[int] = field(default_factory=Future)


@dataclass(eq=False)
class _PrefillRequest:
    prompt_ids: list[int]
    result: Future[tuple[CloudSequence, int]] = field(default_factory=Future)


class StepBatcher:
    """One worker thread owns the model and batches the decode steps of all sessions.

    Sessions call :meth:`forward` from their own threads; the worker takes the
    waiting step requests, keeps waiting for the other live sessions as long as
    one arrives within ``batch_window_ms`` of the last (it stops at once when
    every live sequence has a request waiting) and runs one
    ``llm.step(batch)``.  Sessions join (:meth:`prefill`) and leave
    (:meth:`release`) between steps: continuous batching.  Prefills run on the
    same thread, between step batches, so no two forwards ever overlap; the
    prefills that queued up meanwhile run as one padded ``llm.open_many``.

    Attributes:
        batch_sizes: how many step batches of each size ran.
        prefill_sizes: how many prefill batches of each size ran.
        step_seconds: wall time spent inside ``llm.step``.
    """

    def __init__(self, llm: TransformersLLM, *, batch_window_ms: float = 2.0) -> None:
        if batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be non-negative, got {batch_window_ms}")
        self._llm = llm
        self._window_s = batch_window_ms / 1000.0
        self._cond = threading.Condition()
        self._steps: list[_StepRequest] = []
        self._prefills: deque[_PrefillRequest] = deque()
        self._live: set[CloudSequence] = set()
        self._closed = False
        self.batch_sizes: Counter[int] = Counter()
        self.prefill_sizes: Counter[int] = Counter()
        self.step_seconds = 0.0
        self._worker = threading.Thread(target=self._work, name="coveil-model", daemon=True)
        self._worker.start()

    # -- called by sessions --------------------------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int]) -> tuple[CloudSequence, int]:
        request = _PrefillRequest([int(i) for i in prompt_ids])
        with self._cond:
            self._require_open()
            self._prefills.append(request)
            self._cond.notify_all()
        return request.result.result()

    def forward(self, seq: CloudSequence, token_id: int) -> int:
        request = _StepRequest(seq, int(token_id))
        with self._cond:
            self._require_open()
            self._steps.append(request)
            self._cond.notify_all()
        return request.result.result()

    def release(self, seq: CloudSequence) -> None:
        with self._cond:
            self._live.discard(seq)
            self._cond.notify_all()  # a batch waiting for this sequence can go now

    def close(self) -> None:
        """Finish the requests already queued, then stop the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    def __enter__(self) -> StepBatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the model worker has shut down")

    # -- the worker thread ---------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._steps or self._prefills or self._closed):
                    self._cond.wait()
                if self._steps:
                    self._wait_for_batch()
                    steps, self._steps = self._steps, []
                    prefills = []
                elif self._prefills:
                    steps, prefills = [], self._take_prefills()
                else:
                    return  # closed and drained
            if steps:
                self._run_steps(steps)
            elif prefills:
                self._run_prefills(prefills)

    def _take_prefills(self) -> list[_PrefillRequest]:
        """With the lock held: the waiting prefills that one padded forward should run together.

        Takes them in arrival order while the padded batch (``B * max L`` tokens)
        stays within twice the real tokens, so a long prompt is not padded into
        many short ones.
        """
        taken = [self._prefills.popleft()]
        real, longest = len(taken[0].prompt_ids), len(taken[0].prompt_ids)
        while self._prefills:
            n = len(self._prefills[0].prompt_ids)
            if (len(taken) + 1) * max(longest, n) > 2 * (real + n):
                break
            taken.append(self._prefills.popleft())
            real, longest = real + n, max(longest, n)
        return taken

    def _wait_for_batch(self) -> None:
        """With the lock held: wait until every live sequence asked for a step or none came for a window.

        The window restarts at each arrival: sessions answer one after another
        (each reply costs the server and its edge some Python work), so a batch
        of ``n`` may gather over more than one window but never waits more than
        ``n`` windows, and never for a session that stays away.
        """
        deadline = time.monotonic() + self._window_s
        arrived = len(self._steps)
        while arrived < len(self._live) and not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)
            if len(self._steps) > arrived:
                arrived = len(self._steps)
                deadline = time.monotonic() + self._window_s

    def _run_steps(self, steps: list[_StepRequest]) -> None:
        start = time.perf_counter_ns()
        try:
            self._llm.step([(request.seq, request.token_id) for request in steps])
        except Exception as exc:  # delivered to every session of the batch
            for request in steps:
                request.result.set_exception(exc)
            return
        elapsed = time.perf_counter_ns() - start
        self.step_seconds += elapsed / 1e9
        self.batch_sizes[len(steps)] += 1
        for request in steps:
            request.result.set_result(elapsed)

    def _run_prefills(self, requests: list[_PrefillRequest]) -> None:
        """One padded prefill for ``requests``; if it fails, each alone, so one bad prompt fails only its session."""
        start = time.perf_counter_ns()
        try:
            seqs = self._llm.open_many([request.prompt_ids for request in requests])
        except Exception as exc:
            if len(requests) > 1:
                for request in requests:
                    self._run_prefills([request])
            else:
                requests[0].result.set_exception(exc)
            return
        elapsed = time.perf_counter_ns() - start
        self.prefill_sizes[len(requests)] += 1
        with self._cond:
            self._live.update(seqs)
        for request, seq in zip(requests, seqs, strict=True):
            request.result.set_result((seq, elapsed))


# -- observation transcript ----------------------------------------------------------------------


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

    def as_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "session_id": self.session_id,
            "mode": req.mode,
            "space": req.space,
            "alpha": req.alpha,
            "temperature": req.temperature,
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
        }


# -- the engine ----------------------------------------------------------------------------------


class CloudEngine:
    """The cloud LLM plus everything sessions share: limits, admission and transcripts.

    Args:
        llm: the cloud model.
        limits: the server's limits.
        transcript_dir: when set, each finished session's transcript is written
            there as ``<session_id>.json``.
        exposure_k: ``K`` of DecodeLeak's per-step exposure set ``E_t^K``.
        runner: where forwards run; default: :class:`DirectRunner` (the caller's thread).
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
        exposure_k: int = 100,
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
        self.transcript_dir = Path(transcript_dir) if transcript_dir is not None else None
        if self.transcript_dir is not None:
            self.transcript_dir.mkdir(parents=True, exist_ok=True)
        self.exposure_k = exposure_k
        self.transcript_upload_limit = transcript_upload_limit
        self.runner: ModelRunner = runner if runner is not None else DirectRunner(llm)
        self.max_upload = self.limits.max_upload if self.limits.max_upload is not None else llm.vocab_size
        self.fingerprint = llm.vocab_fingerprint()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers refuse concurrent use
        self._live: dict[str, SessionHandler] = {}
        self._per_client: Counter[str] = Counter()
        self._finished: OrderedDict[str, SessionTranscript] = OrderedDict()

    def session(self, client_id: str) -> SessionHandler:
        """A handler for one new stream of ``client_id`` (admitted when it opens)."""
        return SessionHandler(self, client_id)

    def warm_up(self) -> None:
        """Run one prefill and one decode step so the first real session pays no start-up cost."""
        seq, _ = self.runner.prefill(self.tokenize("Hello"))
        try:
            self.runner.forward(seq, int(np.argmax(seq.next_logits)))
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
        """The observation transcript of a finished session (one of the last 1000)."""
        with self._lock:
            record = self._finished.get(session_id)
        if record is None:
            raise KeyError(f"no finished session {session_id!r} (only the last {TRANSCRIPTS_KEPT} are kept)")
        return record.as_dict()

    # -- called by handlers ------------------------------------------------------------------------
    def _admit(self, handler: SessionHandler, session_id: str) -> None:
        with self._lock:
            if len(self._live) >= self.limits.max_sessions_total:
                raise ProtocolError(
                    "RESOURCE_EXHAUSTED",
                    f"the server is at its limit of {self.limits.max_sessions_total} concurrent sessions; retry later",
                )
            if self._per_client[handler.client_id] >= self.limits.max_sessions_per_client:
                raise ProtocolError(
                    "RESOURCE_EXHAUSTED",
                    f"this client already has {self.limits.max_sessions_per_client} open sessions, its limit; "
                    "close one first",
                )
            self._live[session_id] = handler
            self._per_client[handler.client_id] += 1

    def _retire(self, handler: SessionHandler, transcript: SessionTranscript) -> None:
        with self._lock:
            if self._live.pop(transcript.session_id, None) is not None:
                self._per_client[handler.client_id] -= 1
                if not self._per_client[handler.client_id]:
                    del self._per_client[handler.client_id]
            self._finished[transcript.session_id] = transcript
            while len(self._finished) > TRANSCRIPTS_KEPT:
                self._finished.popitem(last=False)
        if self.transcript_dir is not None:
            _write_json_atomically(self.transcript_dir / f"{transcript.session_id}.json", transcript.as_dict())


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    fd, staging = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


# -- one session ---------------------------------------------------------------------------------


class _State(enum.Enum):
    AWAITING_OPEN = "awaiting open"
    DECODING = "decoding"
    FINISHED = "finished"


def _largest(upload: CloudUpload, limit: int) -> CloudUpload:
    """``upload`` itself, or its ``limit`` largest values when it holds more."""
    if len(upload) <= limit:
        return upload
    keep = top_k_ids(upload.values, limit)
    return CloudUpload(upload.ids[keep], upload.values[keep], upload.space)


def _all_unique(ids: np.ndarray, vocab_size: int) -> bool:
    """Whether in-range ``ids`` hold no duplicate: a strictly increasing check (what the SDK sends),
    else one mark per id; both linear, unlike ``np.unique``'s sort (170 ms on a full 262k upload)."""
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return True
    seen = np.zeros(vocab_size, dtype=bool)
    seen[ids] = True
    return int(np.count_nonzero(seen)) == ids.size


class SessionHandler:
    """The cloud side of one stream: consumes ``EdgeMessage`` protos, yields ``CloudMessage`` protos.

    :meth:`handle` is a generator: the messages it yields must be sent in order
    as they come, because in cloud-side fusion the chosen token is yielded
    *before* the next forward pass runs, so the edge can start its own model
    while the cloud computes.  Any problem with the input raises
    :class:`ProtocolError` before anything of that message is applied.  The
    owner must call :meth:`abandon` when the stream ends for any reason (it is
    a no-op after a normal finish).
    """

    def __init__(self, engine: CloudEngine, client_id: str) -> None:
        self.engine = engine
        self.client_id = client_id
        self.session_id: str | None = None
        self._state = _State.AWAITING_OPEN
        self._request: wire.SessionRequest | None = None
        self._transcript: SessionTranscript | None = None
        self._seq: CloudSequence | None = None
        self._eos: frozenset[int] = frozenset()
        self._max_new_tokens = 0
        self._rng: np.random.Generator | None = None
        self._step = 0
        self._pending: StepRecord | None = None  # the step whose distribution the edge holds
        self._llm_values = np.empty(0, np.float32)  # what the cloud sends and fuses: p_llm or raw z_llm
        self._ranking: wire.CloudDistribution | None = None  # this step's row, for E_t^K (sent ids or dense)
        self._bytes_up = 0
        self._bytes_down = 0
        self.started_at = time.monotonic()  # when the stream began

    @property
    def finished(self) -> bool:
        return self._state is _State.FINISHED

    @property
    def steps(self) -> int:
        """Tokens decided so far (the resume prefix included): while decoding, the step awaited."""
        return self._step

    @property
    def finish_reason(self) -> str | None:
        return self._transcript.finish_reason if self._transcript is not None else None

    @property
    def bytes_up(self) -> int:
        return self._bytes_up

    @property
    def bytes_down(self) -> int:
        return self._bytes_down

    def handle(self, message: Any) -> Iterator[Any]:
        """Apply one ``EdgeMessage``; yields the ``CloudMessage`` replies in sending order."""
        if self._state is _State.FINISHED:
            raise ProtocolError("FAILED_PRECONDITION", "this session has finished; open a new stream for another")
        size = message.ByteSize()
        self._bytes_up += size
        kind = message.WhichOneof("kind")
        if kind == "open":
            yield from self._open(message.open)
        elif kind == "close":
            yield self._finish("closed", steps=self._step)
        elif kind is None:
            raise ProtocolError("INVALID_ARGUMENT", "empty EdgeMessage: set open, signal, request_full or close")
        elif self._state is _State.AWAITING_OPEN:
            raise ProtocolError("NOT_FOUND", f"no session is open on this stream: send open before {kind}")
        elif kind == "request_full":
            yield from self._send_full(message.request_full.step, size)
        else:
            yield from self._apply_signal(message.signal, size)

    def abandon(self, reason: str) -> None:
        """End the session without a ``finished`` message (``"idle"``, ``"cancelled"``, ``"error"``)."""
        if self._state is not _State.FINISHED:
            self._end(reason)

    # -- open ----------------------------------------------------------------------------------------
    def _open(self, msg: Any) -> Iterator[Any]:
        if self._state is not _State.AWAITING_OPEN:
            raise ProtocolError("FAILED_PRECONDITION", f"this stream already carries session {self.session_id}")
        engine, llm = self.engine, self.engine.llm
        if msg.protocol_version != wire.PROTOCOL_VERSION:
            raise ProtocolError(
                "FAILED_PRECONDITION",
                f"the edge speaks protocol version {msg.protocol_version}, this server speaks {wire.PROTOCOL_VERSION}",
            )
        try:
            request = wire.decode_open(msg, tokenize=engine.tokenize)
            check_alpha(request.alpha)
        except ValueError as exc:
            raise ProtocolError("INVALID_ARGUMENT", str(exc)) from None
        if msg.top_m == 0:  # the server default, within this vocabulary
            request = replace(request, top_m=min(wire.DEFAULT_TOP_M, llm.vocab_size))
        try:
            check_same_vocabulary(request.edge_model or "(unnamed edge model)", request.vocab_fingerprint,
                                  llm.name, engine.fingerprint)
        except VocabularyMismatchError as exc:
            raise ProtocolError("FAILED_PRECONDITION", str(exc)) from None
        max_new_tokens = self._validate_open(request)

        session_id = uuid.uuid4().hex
        transcript = SessionTranscript(session_id, request, llm.name, max_new_tokens, engine.exposure_k)
        engine._admit(self, session_id)
        self.session_id = session_id
        self._transcript = transcript
        self._state = _State.DECODING
        self._request = request
        self._max_new_tokens = max_new_tokens
        self._eos = llm.eos_token_ids | frozenset(request.stop_token_ids)
        self._rng = np.random.default_rng(request.seed)
        self._step = len(request.resume_prefix)
        self._seq, forward_ns = engine.runner.prefill(list(request.prompt_ids) + list(request.resume_prefix))

        info = wire.SessionInfo(
            session_id=session_id,
            cloud_model=llm.name,
            vocab_size=llm.vocab_size,
            prompt_tokens=len(request.prompt_ids),
            eos_token_ids=self._eos,
            max_new_tokens=max_new_tokens,
        )
        yield self._count_down(wire.encode_opened(info))
        yield self._next_distribution(forward_ns)

    def _validate_open(self, request: wire.SessionRequest) -> int:
        """Check the open request's numbers against the model and limits; returns the effective max_new_tokens."""
        vocab, limits = self.engine.llm.vocab_size, self.engine.limits
        if not (math.isfinite(request.temperature) and request.temperature >= 0):
            raise ProtocolError("INVALID_ARGUMENT", f"temperature must be finite and >= 0, got {request.temperature}")
        if not request.prompt_ids:
            raise ProtocolError("INVALID_ARGUMENT", "the public prompt is empty")
        for name, ids in (("prompt", request.prompt_ids), ("resume_prefix", request.resume_prefix),
                          ("stop_token_ids", request.stop_token_ids)):
            if ids and max(ids) >= vocab:
                raise ProtocolError(
                    "INVALID_ARGUMENT", f"{name} holds id {max(ids)}, outside the vocabulary of {vocab}"
                )
        max_new_tokens = request.max_new_tokens or limits.max_new_tokens
        if max_new_tokens > limits.max_new_tokens:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"max_new_tokens {max_new_tokens} exceeds this server's limit of {limits.max_new_tokens}",
            )
        if not 1 <= request.top_m <= vocab:
            raise ProtocolError("INVALID_ARGUMENT", f"top_m must lie in 1..{vocab}, got {request.top_m}")
        if len(request.resume_prefix) >= max_new_tokens:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"resume_prefix holds {len(request.resume_prefix)} tokens: nothing is left of max_new_tokens "
                f"{max_new_tokens}",
            )
        eos = self.engine.llm.eos_token_ids | frozenset(request.stop_token_ids)
        for position, token in enumerate(request.resume_prefix):
            if token in eos:
                raise ProtocolError(
                    "INVALID_ARGUMENT",
                    f"resume_prefix ends the generation already (end-of-generation id at {position})",
                )
        return max_new_tokens

    # -- steps ---------------------------------------------------------------------------------------
    def _check_step(self, step: int) -> StepRecord:
        if step != self._step:
            raise ProtocolError("INVALID_ARGUMENT", f"expected step {self._step}, got {step}")
        assert self._pending is not None
        return self._pending

    def _send_full(self, step: int, size: int) -> Iterator[Any]:
        record = self._check_step(step)
        if record.full_requested:
            raise ProtocolError("INVALID_ARGUMENT", f"the full distribution of step {step} was already sent")
        record.full_requested = True
        record.bytes_up += size
        full = wire.CloudDistribution(step=step, dense=self._llm_values)
        yield self._count_down(wire.encode_distribution(full), record)

    def _apply_signal(self, signal: Any, size: int) -> Iterator[Any]:
        record = self._check_step(signal.step)
        request = self._request
        assert request is not None and self._seq is not None and self._transcript is not None
        kind = signal.WhichOneof("signal")
        if request.mode == "cloud":
            if kind != "upload":
                raise ProtocolError(
                    "INVALID_ARGUMENT", f"this session fuses on the cloud: step {signal.step} needs an upload, got "
                    f"{kind or 'no signal'}"
                )
            observation = upload = self._parse_upload(signal.upload, request.space)
            token = self._pick(upload)
            record.upload_size = len(upload)
            record.upload = _largest(upload, self.engine.transcript_upload_limit)
        else:
            if kind != "token_id":
                raise ProtocolError(
                    "INVALID_ARGUMENT", f"this session fuses on the edge: step {signal.step} needs a token_id, got "
                    f"{kind or 'no signal'}"
                )
            token = int(signal.token_id)
            if token >= self.engine.llm.vocab_size:
                raise ProtocolError(
                    "INVALID_ARGUMENT", f"token id {token} is outside the vocabulary of {self.engine.llm.vocab_size}"
                )
            observation = SyncedToken(token)
        record.exposure = wire.step_exposure(observation, self._ranking, self.engine.exposure_k)
        record.token_id = token
        record.bytes_up += size
        self._transcript.steps.append(record)
        self._pending = None

        step = self._step
        self._step = step + 1
        reason = "eos" if token in self._eos else "max_new_tokens" if self._step == self._max_new_tokens else None
        if request.mode == "cloud":
            yield self._count_down(wire.encode_token_chosen(step, token, reason is not None), record)
        if reason is not None:
            yield self._finish(reason, steps=self._step)
            return
        forward_ns = self.engine.runner.forward(self._seq, token)
        yield self._next_distribution(forward_ns)

    def _parse_upload(self, upload: Any, space: FusionSpace) -> CloudUpload:
        vocab = self.engine.llm.vocab_size
        try:
            values = wire.values_from_bytes(upload.values)
            ids = wire.ids_from_bytes(upload.ids)
        except ValueError as exc:
            raise ProtocolError("INVALID_ARGUMENT", f"malformed upload: {exc}") from None
        if upload.dense:
            if ids.size or values.size != vocab:
                raise ProtocolError(
                    "INVALID_ARGUMENT", f"a dense upload carries no ids and exactly {vocab} values, got "
                    f"{ids.size} ids and {values.size} values"
                )
            ids = np.arange(vocab, dtype=np.int64)
        if ids.shape != values.shape:
            raise ProtocolError("INVALID_ARGUMENT", f"upload has {ids.size} ids but {values.size} values")
        if ids.size > self.engine.max_upload:
            raise ProtocolError(
                "INVALID_ARGUMENT", f"upload holds {ids.size} ids, more than this server's limit of "
                f"{self.engine.max_upload}"
            )
        if ids.size:
            if int(ids.max()) >= vocab:
                raise ProtocolError(
                    "INVALID_ARGUMENT", f"upload id {int(ids.max())} is outside the vocabulary of {vocab}"
                )
            if not _all_unique(ids, vocab):
                raise ProtocolError("INVALID_ARGUMENT", "upload ids must be unique")
            if not np.isfinite(values).all():
                raise ProtocolError("INVALID_ARGUMENT", "upload values must be finite (found NaN or infinity)")
            if space == "prob" and (float(values.min()) < 0.0 or float(values.max()) > 1.0):
                raise ProtocolError("INVALID_ARGUMENT", "upload values are probabilities and must lie in [0, 1]")
        return CloudUpload(ids, values, space)

    def _pick(self, upload: CloudUpload) -> int:
        request = self._request
        assert request is not None
        scores = upload.fuse_with(self._llm_values, request.alpha)
        if request.space == "logit" and request.temperature > 0:
            scores = softmax(scores)  # pick_token samples from p**(1/T): softmax(z)**(1/T) ∝ exp(z/T)
        return pick_token(scores, temperature=request.temperature, rng=self._rng)

    def _next_distribution(self, forward_ns: int) -> Any:
        """Read the current step's row off the sequence and build its distribution message.

        The row is ``p_llm`` in probability space and the raw logits ``z_llm``
        in logit space (both rank tokens alike).  Sparse (the top ``top_m``
        entries and the tail certificate) unless the edge asked for ``top_m`` =
        vocabulary size: then dense.
        """
        request, seq = self._request, self._seq
        assert request is not None and seq is not None
        try:
            logits = check_finite(seq.next_logits, f"the cloud model's logits at step {self._step}")
        except NonFiniteError as exc:
            raise ProtocolError("INTERNAL", str(exc)) from None
        p_llm = softmax(logits)
        self._llm_values = np.asarray(logits, dtype=np.float32) if request.space == "logit" else p_llm
        self._pending = StepRecord(self._step)
        if request.top_m >= p_llm.size:  # every entry: dense, half the bytes of listing each id
            self._ranking = wire.CloudDistribution(step=self._step, dense=self._llm_values, forward_ns=forward_ns)
            return self._count_down(wire.encode_distribution(self._ranking), self._pending)
        tail_mass = None
        if request.space == "logit":  # the certificate's tail mass stays a probability
            tail_mass = max(0.0, 1.0 - float(p_llm[top_k_ids(self._llm_values, request.top_m)].sum(dtype=np.float64)))
        sparse = wire.CloudDistribution.sparse_from(
            self._step, self._llm_values, request.top_m, forward_ns, tail_mass=tail_mass
        )
        # E_t^K is read off the sent ids when they are enough, else off the whole row
        enough = len(sparse.ids) >= self.engine.exposure_k
        self._ranking = sparse if enough else wire.CloudDistribution(step=self._step, dense=self._llm_values)
        return self._count_down(wire.encode_distribution(sparse), self._pending)

    # -- ending --------------------------------------------------------------------------------------
    def _finish(self, reason: str, *, steps: int) -> Any:
        """Free the session, then return its ``finished`` message (so a quick re-open is admitted)."""
        message = self._count_down(wire.encode_finished(steps, reason))
        self._end(reason)
        return message

    def _end(self, reason: str) -> None:
        self._state = _State.FINISHED
        if self._transcript is None:  # never admitted: nothing to free or record
            return
        if self._seq is not None:
            self.engine.runner.release(self._seq)
            self._seq = None  # the KV cache goes with its last reference
        if self._pending is not None and self._pending.full_requested:
            self._transcript.steps.append(self._pending)  # the edge asked for the full row, then stopped
        self._pending = None
        self._transcript.finish_reason = reason
        self._transcript.bytes_up = self._bytes_up
        self._transcript.bytes_down = self._bytes_down
        self.engine._retire(self, self._transcript)

    def _count_down(self, message: Any, record: StepRecord | None = None) -> Any:
        size = message.ByteSize()
        self._bytes_down += size
        if record is not None:
            record.bytes_down += size
        return message
