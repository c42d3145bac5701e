"""The cloud side of one stream: the protocol's state machine, independent of the transport.

A :class:`SessionHandler` consumes decoded ``EdgeMessage`` protos and yields
the ``CloudMessage`` protos to send back; input is checked by
:mod:`cloud_adapter.validation` before anything of it is applied.

Message sequence of one session (steps start at ``len(resume_prefix)``)::

    edge  open ─────────────►  cloud: prefill, opened, distribution(t)
    edge  request_full(t) ──►  cloud: distribution(t, dense)          (optional, once)
    edge  signal(t) ────────►  cloud: [token(t)] then finished | forward + distribution(t+1)
    edge  close ────────────►  cloud: finished("closed")
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from cloud_adapter.llm import CloudSequence
from cloud_adapter.transcript import SessionTranscript, StepRecord
from cloud_adapter.validation import ProtocolError, check_open_message, parse_upload, validate_request
from edge_sdk import wire
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import NonFiniteError, check_finite, pick_token, softmax
from edge_sdk.policies.base import CloudUpload, SyncedToken

if TYPE_CHECKING:
    from cloud_adapter.engine import CloudEngine, RowKey


class _State(enum.Enum):
    AWAITING_OPEN = "awaiting open"
    DECODING = "decoding"
    FINISHED = "finished"


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
        check_open_message(msg, cloud_model=llm.name, fingerprint=engine.fingerprint, limits=engine.limits)
        try:
            request = wire.decode_open(msg, tokenize=engine.tokenize)
        except ValueError as exc:
            raise ProtocolError("INVALID_ARGUMENT", str(exc)) from None
        if msg.top_m == 0:  # the server default, within this vocabulary
            request = replace(request, top_m=min(DecodeSettings.top_m, llm.vocab_size))
        max_new_tokens = validate_request(request, vocab_size=llm.vocab_size, eos_ids=llm.eos_token_ids,
                                          limits=engine.limits)

        session_id = uuid.uuid4().hex
        transcript = SessionTranscript(session_id, request, llm.name, max_new_tokens, engine.exposure_k)
        engine.admit(self, session_id)
        self.session_id = session_id
        self._transcript = transcript
        self._state = _State.DECODING
        self._request = request
        self._max_new_tokens = max_new_tokens
        self._eos = llm.eos_token_ids | frozenset(request.stop_token_ids)
        self._rng = np.random.default_rng(request.seed)
        self._step = len(request.resume_prefix)
        self._seq, forward_ns = engine.runner.prefill(list(request.prompt_ids) + list(request.resume_prefix))
        if request.resume_prefix:  # a step whose full row was sent before the stream broke: that row again
            kept = engine.resumable_rows.take(self._row_key())
            if kept is not None:
                self._seq.next_logits = kept

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
            observation = upload = parse_upload(signal.upload, vocab_size=self.engine.llm.vocab_size,
                                                max_upload=self.engine.max_upload, space=request.space)
            token = self._pick(upload, no_stop=signal.no_stop)
            record.upload_size = len(upload)
            record.upload = upload.largest(self.engine.transcript_upload_limit)
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

    def _pick(self, upload: CloudUpload, *, no_stop: bool = False) -> int:
        """The cloud-side token: ``argmax`` (or a draw) of ``alpha * row_llm + (1 - alpha) * m * upload``.

        With ``alpha = 0`` and nothing uploaded the fusion holds no information
        at all; the cloud then picks from its own row rather than from zeros.
        ``no_stop`` takes the end-of-generation ids out of the choice.
        """
        request = self._request
        assert request is not None
        if request.alpha == 0.0 and not len(upload):
            scores = self._llm_values.copy()
        else:
            scores = upload.fuse_with(self._llm_values, request.alpha)
        if request.space == "logit" and request.temperature > 0:
            scores = softmax(scores)  # pick_token samples from p**(1/T): softmax(z)**(1/T) ∝ exp(z/T)
        if no_stop:  # scores are probabilities here, or raw fused logits when greedy in logit space
            raw_logits = request.space == "logit" and request.temperature == 0
            stops = np.fromiter(self._eos, dtype=np.int64)
            scores[stops[stops < scores.shape[0]]] = np.finfo(np.float32).min if raw_logits else 0.0
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
        sparse = wire.CloudDistribution.sparse_from(  # the certificate's tail mass stays a probability
            self._step, self._llm_values, request.top_m, forward_ns,
            probabilities=p_llm if request.space == "logit" else None,
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

    def _row_key(self) -> RowKey:
        """This session's current step as :class:`~cloud_adapter.engine.ResumableRows` knows it."""
        request, seq = self._request, self._seq
        assert request is not None and seq is not None
        prompt = len(request.prompt_ids)
        return self.client_id, request.space, tuple(seq.ids[:prompt]), tuple(seq.ids[prompt:])

    def _end(self, reason: str) -> None:
        self._state = _State.FINISHED
        if self._transcript is None:  # never admitted: nothing to free or record
            return
        if self._pending is not None and self._pending.full_requested and self._seq is not None and reason != "closed":
            self.engine.resumable_rows.keep(self._row_key(), self._seq.next_logits)
        if self._seq is not None:
            self.engine.runner.release(self._seq)
            self._seq = None  # the KV cache goes with its last reference
        if self._pending is not None and self._pending.full_requested:
            self._transcript.steps.append(self._pending)  # the edge asked for the full row, then stopped
        self._pending = None
        self._transcript.finish_reason = reason
        self._transcript.bytes_up = self._bytes_up
        self._transcript.bytes_down = self._bytes_down
        self.engine.retire(self, self._transcript)

    def _count_down(self, message: Any, record: StepRecord | None = None) -> Any:
        size = message.ByteSize()
        self._bytes_down += size
        if record is not None:
            record.bytes_down += size
        return message
