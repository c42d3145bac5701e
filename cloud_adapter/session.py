"""The cloud side of one stream: the protocol's state machine, independent of the transport.

A :class:`SessionHandler` consumes decoded ``EdgeMessage`` protos and yields
the ``CloudMessage`` protos to send back; input is checked by
:mod:`cloud_adapter.validation` before anything of it is applied.

Message sequence of one session (steps start at ``len(resume_prefix)``)::

    edge  open ─────────────►  cloud: prefill, opened, distribution(t)
    edge  request_full(t) ──►  cloud: distribution(t, dense)          (optional, once)
    edge  signal(t) ────────►  cloud: [token(t)] then finished | forward + distribution(t+1)
    edge  close ────────────►  cloud: finished("closed")

Run-ahead (``lookahead`` > 0 on both sides): between the edge's messages the
cloud drafts (:meth:`SessionHandler.draft`): it assumes its own draft token
``d`` at the last row it sent (edge-side fusion: that row's top token;
cloud-side: its greedy pick from the row alone, as if the upload were empty),
forwards it and sends the next row naming ``d`` (``assumes_token``), up to
its depth past the awaited step.  A signal whose token is the draft confirms
it (the next row already went out); any other token drops every draft (the
KV cache rolls back) and the row after that token follows, as in lockstep.
Every drafted row depends on the public prompt and the confirmed tokens only.
Where the runner drafts itself (:meth:`~cloud_adapter.runners.StepBatcher.run_ahead`,
the slot engine's default) the engine forwards the same draft tokens as soon as
each row is computed, as deep as the session allows, and :meth:`SessionHandler.draft`
takes the row it drafted: the same rows, sent at the same points.
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from cloud_adapter.backends.rows import GreedyPick, RowSpec, StepRow, summarize_row
from cloud_adapter.llm import CloudSequence
from cloud_adapter.transcript import SessionTranscript, StepRecord
from cloud_adapter.validation import check_open_message, parse_upload, validate_request
from edge_sdk.protocol import wire
from edge_sdk.protocol.drafting import DraftSchedule
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import cloud_scores, pick_token
from edge_sdk.grammar import GrammarError, JsonConstraint, mask_row
from edge_sdk.logprobs import TokenLogprobs, token_logprobs
from edge_sdk.protocol.signals import CloudUpload, SyncedToken
from edge_sdk.protocol.status import CloudError

if TYPE_CHECKING:
    from cloud_adapter.engine import CloudEngine, RowKey


class _State(enum.Enum):
    AWAITING_OPEN = "awaiting open"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False)
class _Row:
    """One step's row as the cloud sent it, kept until the step is confirmed (drafted rows included)."""

    record: StepRecord  # what the cloud observes at this step
    row: StepRow  # the model's row as the backend read it: top ids and values (p_llm, or raw z_llm in logit space)
    ranking: wire.CloudDistribution  # the row E_t^K is read off (its top ids when enough, else dense)
    sent_at: float  # monotonic clock when the row's message was built
    drafted: bool  # computed on a draft token (not on the confirmed prefix alone)


class SessionHandler:
    """The cloud side of one stream: consumes ``EdgeMessage`` protos, yields ``CloudMessage`` protos.

    :meth:`handle` is a generator: the messages it yields must be sent in order
    as they come, because in cloud-side fusion the chosen token is yielded
    *before* the next forward pass runs, so the edge can start its own model
    while the cloud computes.  Any problem with the input raises
    :class:`CloudError` before anything of that message is applied.  The
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
        self._spec = RowSpec()  # what the session reads of each row (set when it opens)
        self._eos: frozenset[int] = frozenset()
        self._max_new_tokens = 0
        self._rng: np.random.Generator | None = None
        self._constraint: JsonConstraint | None = None  # the session's public JSON schema, where the cloud picks
        self._step = 0
        # the rows sent and not yet confirmed: [0] is the awaited step's, the rest drafted ones (one per draft)
        self._rows: list[_Row] = []
        self._drafts: list[int] = []  # tokens the cloud appended past the confirmed ones (run-ahead)
        self._lookahead = 0  # the deepest run-ahead agreed for this session (0 = lockstep)
        self._schedule = DraftSchedule(0)  # how deep it drafts now (set when the session opens)
        self._engine_drafts = False  # the runner advances this session's drafts itself (StepBatcher.run_ahead)
        self.forwards = 0  # decode forwards run for this session (drafts included; the prefill not)
        self.drafts_dropped = 0  # drafted forwards rolled back
        self.draft_agreements = 0  # confirmed tokens that were the cloud's draft token (run-ahead sessions)
        self.depth_sum = 0  # rows drafted past the awaited step when each signal arrived (run-ahead sessions)
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
    def confirmed(self) -> int:
        """Tokens confirmed in this session (the resume prefix not counted)."""
        return self._step - (len(self._request.resume_prefix) if self._request is not None else 0)

    @property
    def bytes_up(self) -> int:
        return self._bytes_up

    @property
    def bytes_down(self) -> int:
        return self._bytes_down

    def handle(self, message: Any) -> Iterator[Any]:
        """Apply one ``EdgeMessage``; yields the ``CloudMessage`` replies in sending order."""
        if self._state is _State.FINISHED:
            raise CloudError("FAILED_PRECONDITION", "this session has finished; open a new stream for another")
        size = message.ByteSize()
        self._bytes_up += size
        kind = message.WhichOneof("kind")
        if kind == "open":
            yield from self._open(message.open)
        elif kind == "close":
            yield self._finish("closed", steps=self._step)
        elif kind is None:
            raise CloudError("INVALID_ARGUMENT", "empty EdgeMessage: set open, signal, request_full or close")
        elif self._state is _State.AWAITING_OPEN:
            raise CloudError("NOT_FOUND", f"no session is open on this stream: send open before {kind}")
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
            raise CloudError("FAILED_PRECONDITION", f"this stream already carries session {self.session_id}")
        engine, llm = self.engine, self.engine.llm
        check_open_message(msg, cloud_model=llm.name, fingerprint=engine.fingerprint, limits=engine.limits)
        try:
            request = wire.decode_open(msg, tokenize=engine.tokenize)
        except ValueError as exc:
            raise CloudError("INVALID_ARGUMENT", str(exc)) from None
        if msg.top_m == 0:  # the server default, within this vocabulary
            request = replace(request, top_m=min(DecodeSettings.top_m, llm.vocab_size))
        max_new_tokens = validate_request(request, vocab_size=llm.vocab_size, eos_ids=llm.eos_token_ids,
                                          limits=engine.limits)
        held = len(request.prompt_ids) + max_new_tokens  # a resume prefix is part of max_new_tokens' count
        capacity = engine.runner.tokens_per_session
        if capacity is not None and held > capacity:
            raise CloudError(
                "INVALID_ARGUMENT", f"the prompt's {len(request.prompt_ids)} tokens and max_new_tokens {max_new_tokens} "
                f"exceed the {capacity} tokens a session holds here: shorten the prompt or lower max_new_tokens"
            )
        end_ids = llm.eos_token_ids | frozenset(request.stop_token_ids)  # the session's public end set (both sides)
        constraint = self._compile_schema(request, end_ids) if request.json_schema else None

        session_id = uuid.uuid4().hex
        transcript = SessionTranscript(session_id, request, llm.name, max_new_tokens, engine.exposure_k)
        engine.admit(self, session_id)
        self.session_id = session_id
        self._transcript = transcript
        self._state = _State.DECODING
        self._request = request
        self._max_new_tokens = max_new_tokens
        self._eos = end_ids
        self._rng = np.random.default_rng(request.seed)
        self._constraint = constraint
        self._lookahead = self._agreed_lookahead(request)
        self._schedule = DraftSchedule(self._lookahead)
        self._step = len(request.resume_prefix)
        dense = request.top_m >= llm.vocab_size
        self._spec = RowSpec(space=request.space, top_n=max(request.top_m, engine.exposure_k), dense=dense)
        self._seq, forward_ns = engine.runner.prefill(list(request.prompt_ids) + list(request.resume_prefix),
                                                      spec=self._spec)
        if request.resume_prefix:  # a step whose full row was sent before the stream broke: that row again
            kept = engine.resumable_rows.take(self._row_key())
            if kept is not None:
                self._seq.next_row = summarize_row(kept, self._spec)
        run_ahead = getattr(engine.runner, "run_ahead", None)
        self._engine_drafts = bool(self._lookahead and run_ahead is not None and run_ahead(
            self._seq, rule=self._draft_rule(), spec=self._spec, end_ids=self._eos))

        prompt_rows, token_values = self._prompt_rows(request) if request.score_prompt else ((), ())
        info = wire.SessionInfo(
            session_id=session_id,
            cloud_model=llm.name,
            vocab_size=llm.vocab_size,
            prompt_tokens=len(request.prompt_ids),
            eos_token_ids=self._eos,
            max_new_tokens=max_new_tokens,
            lookahead=self._lookahead,
            padded=request.padded,  # the edge asked: every distribution, pick and end goes out padded
            prompt_rows=prompt_rows,
            prompt_token_values=token_values,
        )
        transcript.lookahead = self._lookahead
        yield self._count_down(wire.encode_opened(info))
        yield self._next_distribution(forward_ns)

    def _prompt_rows(self, request: wire.SessionRequest) -> tuple[tuple[wire.CloudDistribution, ...], tuple[float, ...]]:
        """Echo with logprobs: the row after each public prompt token but the last (sparse, the session's
        ``top_m``, in its space) and each row's value at the token that follows, from one forward over the public
        prompt.  Edge-side only: cloud-side the fused row is the cloud's, and it would need an upload per prompt
        position."""
        if request.mode != "edge":
            raise CloudError("INVALID_ARGUMENT", "score_prompt is served in edge-side fusion only")
        ids = list(request.prompt_ids)
        spec = RowSpec(space=request.space, top_n=min(request.top_m, self.engine.llm.vocab_size))
        vocab_size = self.engine.llm.vocab_size
        rows, token_values = [], []
        for position, logits in enumerate(self.engine.llm.prompt_logits(ids)):
            row = summarize_row(logits, spec)
            if not row.finite:
                raise CloudError("INTERNAL", f"the cloud model's logits at prompt position {position} hold "
                                             "non-finite values")
            rows.append(wire.CloudDistribution.from_top(position, row.ids, row.values, row.probs, vocab_size))
            token_values.append(float(row.full_values()[ids[position + 1]]))
        return tuple(rows), tuple(token_values)

    def _compile_schema(self, request: wire.SessionRequest, end_ids: frozenset[int]) -> JsonConstraint:
        """The session's JSON schema compiled over the cloud model's token bytes and the session's end set (the one
        the edge compiles over too), advanced past a resumed prefix (``INVALID_ARGUMENT`` when it is not JSON,
        cannot compile, or the prefix leaves its grammar)."""
        try:
            schema = json.loads(request.json_schema)
        except ValueError as exc:
            raise CloudError("INVALID_ARGUMENT", f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise CloudError("INVALID_ARGUMENT", "json_schema must be a JSON object (a schema)")
        try:
            constraint = JsonConstraint(self.engine.llm, schema, end_ids=end_ids)
            for token in request.resume_prefix:
                constraint.consume(token)
        except TypeError as exc:  # a model without token_pieces()
            raise CloudError("FAILED_PRECONDITION", str(exc)) from None
        except (GrammarError, ValueError) as exc:
            raise CloudError("INVALID_ARGUMENT", str(exc)) from None
        return constraint

    def _agreed_lookahead(self, request: wire.SessionRequest) -> int:
        """The run-ahead depth for this session: the edge's largest, within the server's cap; 0 (lockstep) where
        a draft could change what the cloud would do in lockstep (cloud-side sampling draws from the session's
        seeded generator, which a draft must not advance) or would need the grammar's state past the awaited
        step (a cloud-side JSON schema), and where every row is dense (``top_m`` = the vocabulary, as an edge-side
        schema asks): a draft then serialises and sends a whole row (1 MB on Gemma-3), which on loopback cost
        more than it hid (``benchmarks/openai_endpoint.py``: 7% a step under a schema against 2% in lockstep) and
        over a slow link costs a row's bandwidth for each draft dropped."""
        if request.mode == "cloud" and (request.temperature > 0 or request.json_schema):
            return 0
        if request.top_m >= self.engine.llm.vocab_size:
            return 0
        return min(request.lookahead, self.engine.limits.max_lookahead)

    # -- steps ---------------------------------------------------------------------------------------
    def _check_step(self, step: int) -> _Row:
        if step != self._step:
            raise CloudError("INVALID_ARGUMENT", f"expected step {self._step}, got {step}")
        assert self._rows, "a decoding session always holds the awaited step's row"
        return self._rows[0]

    def _send_full(self, step: int, size: int) -> Iterator[Any]:
        row = self._check_step(step)
        record = row.record
        if record.full_requested:
            raise CloudError("INVALID_ARGUMENT", f"the full distribution of step {step} was already sent")
        record.full_requested = True
        record.bytes_up += size
        full = wire.CloudDistribution(step=step, dense=row.row.full_values())
        yield self._count_down(wire.encode_distribution(full), record)

    def _apply_signal(self, signal: Any, size: int) -> Iterator[Any]:
        row = self._check_step(signal.step)
        record = row.record
        request = self._request
        assert request is not None and self._seq is not None and self._transcript is not None
        kind = signal.WhichOneof("signal")
        if request.mode == "cloud":
            if kind != "upload":
                raise CloudError(
                    "INVALID_ARGUMENT", f"this session fuses on the cloud: step {signal.step} needs an upload, got "
                    f"{kind or 'no signal'}"
                )
            observation = upload = parse_upload(signal.upload, vocab_size=self.engine.llm.vocab_size,
                                                max_upload=self.engine.max_upload, space=request.space)
            token, logprobs = self._choose(upload, row.row, no_stop=signal.no_stop)
            record.upload_size = len(upload)
            record.upload = upload.largest(self.engine.transcript_upload_limit)
        else:
            if kind != "token_id":
                raise CloudError(
                    "INVALID_ARGUMENT", f"this session fuses on the edge: step {signal.step} needs a token_id, got "
                    f"{kind or 'no signal'}"
                )
            token = int(signal.token_id)
            if token >= self.engine.llm.vocab_size:
                raise CloudError(
                    "INVALID_ARGUMENT", f"token id {token} is outside the vocabulary of {self.engine.llm.vocab_size}"
                )
            observation, logprobs = SyncedToken(token), None
        if self._lookahead:
            # the awaited row's draft token is the first draft past it, where one was sent (no pick to recompute)
            self.draft_agreements += token == (self._drafts[0] if self._drafts else self._draft_token(row))
            self.depth_sum += len(self._drafts)
        record.exposure = wire.step_exposure(observation, row.ranking, self.engine.exposure_k)
        record.token_id = token
        record.bytes_up += size
        self._transcript.steps.append(record)
        self._rows.pop(0)
        now = time.monotonic()
        if not row.drafted:  # the edge waited for this row: the link's whole turnaround
            self._schedule.observe_turnaround(now - row.sent_at)

        step = self._step
        self._step = step + 1
        reason = "eos" if token in self._eos else "max_new_tokens" if self._step == self._max_new_tokens else None
        if request.mode == "cloud":
            yield self._count_down(wire.encode_token_chosen(step, token, reason is not None, logprobs), record)
        if reason is not None:
            yield self._finish(reason, steps=self._step)
            return
        if self._drafts and self._drafts[0] == token:  # the draft holds: its row already went out
            self._drafts.pop(0)
            return
        runner = self.engine.runner
        if self._engine_drafts and not self._drafts:  # the engine may have drafted this token before a row went out
            drafted = runner.take_draft(self._seq, token)
            if drafted is not None:
                self._count_forward(drafted.forward_ns)
                yield self._next_distribution(drafted.forward_ns, assumes=token, row=drafted.row)
                return
        truncate_to = None
        if self._drafts or self._engine_drafts:  # a miss: drop every draft (and its KV), go on from the confirmed token
            truncate_to = len(request.prompt_ids) + step
            self.drafts_dropped += len(self._drafts)
            self._drafts.clear()
            self._rows.clear()
        forward_ns = (runner.forward(self._seq, token) if truncate_to is None else
                      runner.forward(self._seq, token, truncate_to=truncate_to))
        self._count_forward(forward_ns)
        row = runner.forwarded_row(self._seq) if self._engine_drafts else None
        yield self._next_distribution(forward_ns, assumes=token if self._lookahead else None, row=row)

    # -- run-ahead -----------------------------------------------------------------------------------
    def _count_forward(self, forward_ns: int) -> None:
        self.forwards += 1
        self._schedule.observe_forward(forward_ns / 1e9)

    @property
    def depth(self) -> int:
        """How far past the awaited step the cloud drafts now (:class:`~edge_sdk.protocol.drafting.DraftSchedule`;
        the turnaround is read only on rows the edge waited for, sent on its confirmation)."""
        return self._schedule.depth

    def _draft_rule(self) -> GreedyPick | None:
        """How the draft token is read off a row: cloud-side the greedy pick of an empty upload, edge-side (``None``)
        the row's top id."""
        request = self._request
        assert request is not None
        return GreedyPick.draft(request.alpha, request.space) if request.mode == "cloud" else None

    def _draft_token(self, row: _Row) -> int:
        """The token the cloud assumes the edge confirms at ``row``: edge-side its top token, cloud-side its
        greedy pick from the row alone (the pick of an empty upload)."""
        rule = self._draft_rule()
        return int(row.row.ids[0]) if rule is None else row.row.greedy_cloud_pick(rule)

    def can_draft(self) -> bool:
        """Whether :meth:`draft` has work: decoding, below the depth, before the token limit, and the last
        row's draft token does not end the generation (nothing is drafted past an end)."""
        if self._state is not _State.DECODING or not self._rows or len(self._drafts) >= self.depth:
            return False
        if self._step + len(self._drafts) + 1 >= self._max_new_tokens:
            return False
        if self._engine_drafts:  # the engine drafts by the same rule, as deep as this allows: is a row coming?
            assert self._request is not None and self._seq is not None
            ahead = min(self.depth, self._max_new_tokens - self._step - 1)
            return self.engine.runner.plan_drafts(self._seq, len(self._request.prompt_ids) + self._step + ahead)
        return self._draft_token(self._rows[-1]) not in self._eos

    def draft(self) -> Iterator[Any]:
        """One run-ahead step: forward the last row's draft token and yield the next row, naming that token (where
        the engine drafts, the row it drafted)."""
        assert self._seq is not None and self.can_draft()
        if self._engine_drafts:
            drafted = self.engine.runner.take_draft(self._seq)
            self._drafts.append(drafted.token)
            self._count_forward(drafted.forward_ns)
            yield self._next_distribution(drafted.forward_ns, assumes=drafted.token, drafted=True, row=drafted.row)
            return
        token = self._draft_token(self._rows[-1])
        self._drafts.append(token)
        forward_ns = self.engine.runner.forward(self._seq, token)
        self._count_forward(forward_ns)
        yield self._next_distribution(forward_ns, assumes=token, drafted=True)

    def _choose(self, upload: CloudUpload, row: StepRow, *, no_stop: bool) -> tuple[int, TokenLogprobs | None]:
        """The awaited step's cloud-side token: ``argmax`` (or a draw) of the cloud's pick rule
        :func:`edge_sdk.fusion.cloud_scores` with this session's settings (``no_stop``: its end set lowered) and
        every id the session's JSON schema does not allow next masked (:func:`edge_sdk.grammar.mask_row`:
        probabilities renormalised), and its log-probabilities under that row when the session asked
        (:mod:`edge_sdk.logprobs`).  Greedy without a schema or log-probabilities, the pick is read off the kept
        row where it lies (:meth:`~cloud_adapter.backends.rows.StepRow.greedy_cloud_pick`: on the device, one id
        copied back); otherwise the whole row comes to the host.
        """
        request = self._request
        assert request is not None
        stop_ids = np.fromiter(self._eos, dtype=np.int64) if no_stop else np.empty(0, np.int64)
        if request.temperature == 0 and self._constraint is None and not request.logprobs:
            return row.greedy_cloud_pick(GreedyPick(upload.ids, upload.values, request.alpha, request.space,
                                                    stop_ids)), None
        scores, raw_logits = cloud_scores(row.full_values(), upload.ids, upload.values, request.alpha,
                                          space=request.space, temperature=request.temperature, stop_ids=stop_ids)
        lowest = np.finfo(np.float32).min if raw_logits else 0.0
        if self._constraint is not None:
            scores = mask_row(scores, self._constraint.allowed(), lowest=lowest)
        token = pick_token(scores, temperature=request.temperature, rng=self._rng)
        if self._constraint is not None:
            self._constraint.consume(token)
        if not request.logprobs:
            return token, None
        return token, token_logprobs(scores, "logit" if raw_logits else "prob", token, request.top_logprobs)

    def _next_distribution(self, forward_ns: int, *, assumes: int | None = None, drafted: bool = False,
                           row: StepRow | None = None) -> Any:
        """Read the next row off the sequence (the awaited step's, or a drafted one past it; ``row``: that row,
        where the engine drafts past it) and build its distribution message; ``assumes``: the token before it the
        message names (run-ahead sessions).

        The row is ``p_llm`` in probability space and the raw logits ``z_llm``
        in logit space (both rank tokens alike), as the backend read it
        (:class:`~cloud_adapter.backends.rows.StepRow`).  Sparse (the top
        ``top_m`` entries and the tail certificate) unless the edge asked for
        ``top_m`` = vocabulary size: then dense.
        """
        request, seq = self._request, self._seq
        assert request is not None and seq is not None
        step = self._step + len(self._drafts)
        if row is None:
            row = seq.next_row if seq.next_row is not None else summarize_row(seq.next_logits, self._spec)
        if not row.finite:
            raise CloudError("INTERNAL", f"the cloud model's logits at step {step} hold non-finite values; "
                                         "refusing to rank or send them")
        record = StepRecord(step)
        vocab_size = self.engine.llm.vocab_size
        if self._spec.dense:  # every entry: dense, half the bytes of listing each id
            ranking = sent = wire.CloudDistribution(step=step, dense=row.full_values(), forward_ns=forward_ns)
        else:
            m = request.top_m
            sent = wire.CloudDistribution.from_top(step, row.ids[:m], row.values[:m], row.probs[:m], vocab_size,
                                                   forward_ns)
            # E_t^K is read off the row's top ids when they are enough, else off the whole row
            enough = len(row.ids) >= self.engine.exposure_k
            ranking = (wire.CloudDistribution(step=step, ids=row.ids, values=row.values) if enough else
                       wire.CloudDistribution(step=step, dense=row.full_values()))
        self._rows.append(_Row(record, row, ranking, time.monotonic(), drafted))
        if assumes is not None:
            sent = replace(sent, assumes_token=assumes)
        return self._count_down(wire.encode_distribution(sent), record)

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
        confirmed = prompt + self._step  # the engine may hold drafts the session never sent
        return self.client_id, request.space, tuple(seq.ids[:prompt]), tuple(seq.ids[prompt:confirmed])

    def _end(self, reason: str) -> None:
        self._state = _State.FINISHED
        if self._transcript is None:  # never admitted: nothing to free or record
            return
        pending = self._rows[0] if self._rows else None  # the awaited step's row
        if pending is not None and pending.record.full_requested and self._seq is not None and reason != "closed":
            self.engine.resumable_rows.keep(self._row_key(), pending.row.logits())
        if self._seq is not None:
            self.engine.runner.release(self._seq)
            self._seq = None  # the KV cache goes with its last reference
        if pending is not None and pending.record.full_requested:
            self._transcript.steps.append(pending.record)  # the edge asked for the full row, then stopped
        self.drafts_dropped += len(self._drafts)
        self._rows, self._drafts = [], []
        self._transcript.finish_reason = reason
        self._transcript.forwards = self.forwards
        self._transcript.drafts_dropped = self.drafts_dropped
        self._transcript.draft_agreements = self.draft_agreements
        self._transcript.depth_sum = self.depth_sum
        self._transcript.bytes_up = self._bytes_up
        self._transcript.bytes_down = self._bytes_down
        self.engine.retire(self, self._transcript)

    def _count_down(self, message: Any, record: StepRecord | None = None) -> Any:
        if self._request is not None:  # to its public size, when the session asked (wire.pad_cloud_message)
            message = wire.pad_cloud_message(message, self._request)
        size = message.ByteSize()
        self._bytes_down += size
        if record is not None:
            record.bytes_down += size
        return message
