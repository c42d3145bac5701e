"""Where the cloud model's forward passes run: in the caller's thread, or batched on one worker thread.

* :class:`DirectRunner`: each forward in the caller's thread (tests, a single session).
* :class:`StepBatcher`: the server's runner.  One worker thread owns the model and folds the steps of
  concurrent sessions into one forward, waiting only for the sessions whose edges are quick to come back.
* :class:`LockstepBatcher`: the reference runner's.  One worker thread owns several models (edge and cloud)
  for a known set of item threads, and runs a batch once every item is waiting: each forward holds every
  item waiting on that model, or (``per_sequence``) the batch's items step one forward each, back to back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, Self

from cloud_adapter.backends.rows import GreedyPick, RowSpec, StepRow, greedy_picks, summarize_row
from cloud_adapter.llm import CloudSequence, TransformersLLM

log = logging.getLogger("coveil.cloud")


class ModelRunner(Protocol):
    """Where the engine's forward passes run.  Every method blocks until its work is done.

    ``tokens_per_session``: the most tokens (prompt and generated) one sequence may hold, ``None`` for no bound
    (the slot engine's slots have one: sessions that could outgrow it are refused when they open).
    """

    tokens_per_session: int | None

    def prefill(self, prompt_ids: Sequence[int], *, spec: RowSpec | None = None) -> tuple[CloudSequence, int]:
        """Open a sequence on ``prompt_ids``; returns it and the forward time in ns.

        ``spec``: what its session reads of each row.  A runner that summarises rows where the model runs (the
        slot engine) sets ``seq.next_row`` by it after every forward; the others leave ``next_row`` ``None`` and
        the session reads ``seq.next_logits`` itself.
        """
        ...

    def forward(self, seq: CloudSequence, token_id: int, *, truncate_to: int | None = None) -> int:
        """Append ``token_id`` to ``seq`` (refreshing ``seq.next_logits``); returns the forward time in ns.

        ``truncate_to``: first drop ``seq``'s tokens past that many (drafted tokens the edge did not confirm),
        in the same turn on the model's thread, so no other forward sees the sequence half rolled back.
        """
        ...

    def release(self, seq: CloudSequence) -> None:
        """``seq`` will not be stepped again (its session ended)."""
        ...


class DirectRunner:
    """Runs each forward in the caller's thread, one at a time (a lock serialises callers)."""

    tokens_per_session: int | None = None

    def __init__(self, llm: TransformersLLM) -> None:
        self._llm = llm
        self._lock = threading.Lock()

    def prefill(self, prompt_ids: Sequence[int], *, spec: RowSpec | None = None) -> tuple[CloudSequence, int]:
        with self._lock:
            start = time.perf_counter_ns()
            seq = self._llm.open(prompt_ids)
            return seq, time.perf_counter_ns() - start

    def forward(self, seq: CloudSequence, token_id: int, *, truncate_to: int | None = None) -> int:
        with self._lock:
            if truncate_to is not None:
                self._llm.truncate(seq, truncate_to)
            start = time.perf_counter_ns()
            self._llm.step([(seq, token_id)])
            return time.perf_counter_ns() - start

    def release(self, seq: CloudSequence) -> None:
        """Nothing to do: the sequence's cache is freed with its last reference."""


class ModelFailure(BaseException):
    """The model can serve nothing more (a lost CUDA context, say): raised by a model's forward, it is delivered
    to the batch's sessions and stops the worker, whose ``on_death`` callbacks run (the server then reports
    NOT_SERVING).  A ``BaseException``, so no handler meant for one session's errors swallows it."""


@dataclass(eq=False)
class _StepRequest:
    seq: CloudSequence
    token_id: int
    truncate_to: int | None = None  # drop the sequence's tokens past this many first (a rolled-back draft)
    result: Future[int] = field(default_factory=Future)
    epoch: int | None = None  # an engine draft's: the epoch of its sequence's draft lane when it was queued


@dataclass(frozen=True)
class Drafted:
    """A step the engine drafted on its own: the token it appended, the row after it, the forward's time."""

    token: int
    row: StepRow
    forward_ns: int


#: drafted rows the worker keeps ready beyond those its session took: the next forward runs while the session
#: sends the last row, and the lane moves at its session's pace (as far ahead as the depth would let it, a free
#: forward would leave every session waiting for its edge, one step per confirmation, in batches of a few)
DRAFT_LEAD = 2


@dataclass(eq=False)
class _DraftLane:
    """One run-ahead sequence's drafts as the engine advances them (:meth:`StepBatcher.run_ahead`).

    After every forward of the sequence the worker reads the draft token off its new row (``rule``: ``None`` for
    the row's top id, else a :class:`GreedyPick`) and, while the sequence is shorter than ``until``, fewer than
    :data:`DRAFT_LEAD` drafted rows wait for the session, and that token does not end the generation, queues the
    step that appends it.  ``epoch`` grows at each cancel (a forward of
    the session's own, a release), so a draft still running then is not delivered.
    """

    rule: GreedyPick | None
    spec: RowSpec
    end_ids: frozenset[int]
    until: int = 0  # the engine drafts while the sequence holds fewer tokens
    epoch: int = 0
    request: _StepRequest | None = None  # its draft step queued or running
    ready: deque[Drafted] = field(default_factory=deque)  # drafted steps the session has not taken, oldest first
    next_token: int | None = None  # the draft token of the sequence's last row
    row: StepRow | None = None  # the row after the session's own latest forward
    error: BaseException | None = None  # a draft step's failure, raised to the session that takes it


@dataclass(eq=False)
class _PrefillRequest:
    prompt_ids: list[int]
    spec: RowSpec | None = None  # what the session reads of each row (for a model that summarises its rows)
    result: Future[tuple[CloudSequence, int]] = field(default_factory=Future)
    forward_ns: int = 0  # time inside the forwards of its chunks so far (a chunked prefill)


#: called with the sequences a batch just stepped or opened, before their callers are woken
Delivered = Callable[[Sequence[CloudSequence]], None]


@dataclass
class BatchStats:
    """What ran on one model: batches by size and the wall time inside its forwards."""

    batch_sizes: Counter[int] = field(default_factory=Counter)  # step batches of each size
    prefill_sizes: Counter[int] = field(default_factory=Counter)  # successful prefill batches of each size
    step_seconds: float = 0.0  # inside ``llm.step``
    engine_drafts: int = 0  # steps the worker queued itself, advancing run-ahead sequences by their draft tokens
    prefill_seconds: float = 0.0  # inside successful ``llm.open_many``


class _ModelQueue:
    """One model's waiting forwards, how to run them as batches, and what ran (``stats``).

    Only the owning batcher's worker thread runs them; the batcher's lock guards ``steps`` and ``prefills``.
    With ``per_sequence`` a batch runs as one forward per sequence (an unpadded batch of one each), so every
    sequence's logits are bit for bit those of a run alone.  A batched forward changes each row's floating-point
    reductions (measured with torch's CPU kernels: a linear layer's row differs between a batch of one and of
    several, and rows differ between batches of 2 and 4 without any padding): about 1e-7 in float32, far more in
    bf16, enough to reorder near-ties in a top-1000 or flip a greedy token.
    """

    def __init__(self, llm: TransformersLLM, *, per_sequence: bool = False, chunked_prefills: bool = False) -> None:
        self.llm = llm
        self.per_sequence = per_sequence
        #: a model that prefills chunk by chunk (``opening``): each prefill turn runs one chunk of one prompt
        self.chunked_prefills = chunked_prefills and hasattr(llm, "opening")
        self.steps: list[_StepRequest] = []
        self.prefills: deque[_PrefillRequest] = deque()
        #: the prefill whose chunks are running (with ``chunked_prefills``), and the generator that runs them
        self.opening: tuple[_PrefillRequest, Generator[None, None, CloudSequence]] | None = None
        self.stats = BatchStats()

    def __len__(self) -> int:
        """Requests waiting (steps and prefills, one part-prefilled included)."""
        return len(self.steps) + len(self.prefills) + (self.opening is not None)

    @property
    def prefill_waits(self) -> bool:
        """A prefill is waiting or part-run."""
        return bool(self.prefills) or self.opening is not None

    def take_steps(self) -> list[_StepRequest]:
        """With the lock held: every waiting step (one batch)."""
        steps, self.steps = self.steps, []
        return steps

    def take_prefills(self) -> list[_PrefillRequest]:
        """With the lock held: the waiting prefills that one padded forward should run together.

        Takes them in arrival order while the padded batch (``B * max L`` tokens)
        stays within twice the real tokens, so a long prompt is not padded into
        many short ones.  With ``chunked_prefills``: the oldest waiting prefill alone, or none while one is
        part-run (:meth:`run_prefills` then runs that one's next chunk).
        """
        if self.chunked_prefills:
            return [] if self.opening is not None else [self.prefills.popleft()]
        taken = [self.prefills.popleft()]
        real, longest = len(taken[0].prompt_ids), len(taken[0].prompt_ids)
        while self.prefills:
            n = len(self.prefills[0].prompt_ids)
            if (len(taken) + 1) * max(longest, n) > 2 * (real + n):
                break
            taken.append(self.prefills.popleft())
            real, longest = real + n, max(longest, n)
        return taken

    def take_all(self) -> list[_StepRequest | _PrefillRequest]:
        """With the lock held: every waiting request, which nobody will run (the worker is ending); a part-run
        prefill is abandoned (its generator closed, so its slot is given back)."""
        waiting: list[_StepRequest | _PrefillRequest] = [*self.steps, *self.prefills]
        if self.opening is not None:
            request, chunks = self.opening
            chunks.close()
            waiting.append(request)
        self.steps, self.prefills, self.opening = [], deque(), None
        return waiting

    def run_steps(self, steps: list[_StepRequest], delivered: Delivered | None = None,
                  stepped: Callable[[list[_StepRequest], int], None] | None = None) -> None:
        """One ``llm.step`` for ``steps`` (one per step with ``per_sequence``); a failure is delivered to every one
        of them.  ``stepped(steps, ns)`` runs after ``delivered``, before any caller is woken."""
        start = time.perf_counter_ns()
        try:
            for request in steps:
                if request.truncate_to is not None and request.truncate_to < len(request.seq.ids):
                    self.llm.truncate(request.seq, request.truncate_to)
                    request.truncate_to = None
            if self.per_sequence:
                for request in steps:
                    self.llm.step([(request.seq, request.token_id)])
            else:
                self.llm.step([(request.seq, request.token_id) for request in steps])
        except BaseException as exc:  # delivered to every session of the batch
            for request in steps:
                request.result.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise  # the worker cannot go on (interpreter exit and the like)
            return
        elapsed = time.perf_counter_ns() - start
        self.stats.step_seconds += elapsed / 1e9
        self.stats.batch_sizes[len(steps)] += 1
        if delivered is not None:
            delivered([request.seq for request in steps])
        if stepped is not None:
            stepped(steps, elapsed)
        for request in steps:
            request.result.set_result(elapsed)

    def run_prefills(self, requests: list[_PrefillRequest], delivered: Delivered | None = None) -> None:
        """One padded prefill for ``requests`` (one prefill each with ``per_sequence``); if it fails, each alone, so
        one bad prompt fails only its session.  With ``chunked_prefills``: one chunk (:meth:`_run_chunk`)."""
        if self.chunked_prefills:
            self._run_chunk(requests, delivered)
            return
        start = time.perf_counter_ns()
        try:
            prompts = [request.prompt_ids for request in requests]
            if getattr(self.llm, "summarizes_rows", False):  # a model that reads its rows itself (the slot engine)
                seqs = self.llm.open_many(prompts, [request.spec for request in requests])
            elif self.per_sequence:
                seqs = [self.llm.open(prompt) for prompt in prompts]
            else:
                seqs = self.llm.open_many(prompts)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                for request in requests:
                    request.result.set_exception(RuntimeError(repr(exc)))
                raise  # the worker cannot go on
            if len(requests) > 1:
                for request in requests:
                    self.run_prefills([request], delivered)
            else:
                requests[0].result.set_exception(exc)
            return
        elapsed = time.perf_counter_ns() - start
        self.stats.prefill_seconds += elapsed / 1e9
        self.stats.prefill_sizes[len(requests)] += 1
        if delivered is not None:
            delivered(seqs)
        for request, seq in zip(requests, seqs, strict=True):
            request.result.set_result((seq, elapsed))

    def _run_chunk(self, requests: list[_PrefillRequest], delivered: Delivered | None) -> None:
        """The next chunk of the part-run prefill, or the first of ``requests``' one prefill; a prefill that ends
        (its last chunk, or a failure) is answered."""
        if requests:
            (request,) = requests
            self.opening = request, self.llm.opening(request.prompt_ids, request.spec)  # type: ignore[attr-defined]
        assert self.opening is not None
        request, chunks = self.opening
        start = time.perf_counter_ns()
        try:
            next(chunks)
        except StopIteration as done:
            self.opening = None
            self._count_chunk(request, start)
            self.stats.prefill_sizes[1] += 1
            if delivered is not None:
                delivered([done.value])
            request.result.set_result((done.value, request.forward_ns))
            return
        except BaseException as exc:
            self.opening = None
            request.result.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise  # the worker cannot go on
            return
        self._count_chunk(request, start)

    def _count_chunk(self, request: _PrefillRequest, start_ns: int) -> None:
        elapsed = time.perf_counter_ns() - start_ns
        request.forward_ns += elapsed
        self.stats.prefill_seconds += elapsed / 1e9


class _ModelWorker:
    """One worker thread that owns some models' queues and runs every forward on them, never two at once.

    Subclasses decide which requests run together (:meth:`_serve_requests`) and call :meth:`_start` at the
    end of their ``__init__``.
    """

    def __init__(self, queues: Sequence[_ModelQueue]) -> None:
        self._queues = list(queues)
        self._cond = threading.Condition()
        self._closed = False
        self._dead = False  # the worker thread has ended
        #: called (on the dying worker thread) if the worker ends without :meth:`close`; the server reports
        #: NOT_SERVING to health checks from here
        self.on_death: list[Callable[[], None]] = []
        self._worker = threading.Thread(target=self._work, name="coveil-model", daemon=True)

    def _start(self) -> None:
        self._worker.start()

    def _submit(self, queue: _ModelQueue, request: _StepRequest | _PrefillRequest) -> None:
        """Queue ``request`` (the caller then waits on ``request.result``)."""
        with self._cond:
            self._enqueue(queue, request)

    def _enqueue(self, queue: _ModelQueue, request: _StepRequest | _PrefillRequest) -> None:
        """With the lock held: queue ``request``."""
        self._require_open()
        if isinstance(request, _StepRequest):
            queue.steps.append(request)
        else:
            queue.prefills.append(request)
        self._cond.notify_all()

    def _waiting(self) -> int:
        """With the lock held: requests waiting in every queue."""
        return sum(len(queue) for queue in self._queues)

    def close(self) -> None:
        """Finish the requests already queued, then stop the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def died(self) -> bool:
        """Whether the worker ended without :meth:`close` (the ``on_death`` callbacks have run or are running)."""
        return self._dead and not self._closed

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the model worker has shut down")
        if self._dead:
            raise RuntimeError("the model worker has died; the server must be restarted")

    def _work(self) -> None:
        try:
            self._serve_requests()
        except ModelFailure as exc:
            log.error("the model worker stopped: %s", exc)
        finally:  # whatever ended the worker, nobody waits forever on it
            with self._cond:
                self._dead = True  # from here on every request fails at once
                waiting = [request for queue in self._queues for request in queue.take_all()]
                died = not self._closed
                self._cond.notify_all()  # sessions waiting on an engine's draft
            for request in waiting:
                if not request.result.done():
                    request.result.set_exception(RuntimeError("the model worker has died"))
            if died:
                for callback in self.on_death:
                    callback()

    def _serve_requests(self) -> None:
        raise NotImplementedError


class StepBatcher(_ModelWorker):
    """One worker thread owns the model and batches the decode steps of all sessions.

    Sessions call :meth:`forward` from their own threads.  The worker gathers
    the sessions known to be mid-step: every live sequence whose last forward
    has been delivered comes back with its next token after its edge's turn
    (its *return gap*), so a batch waits for each live sequence whose recent
    return gap (an exponential average) is within the window, for at most the
    window after its first request, then runs one ``llm.step(batch)``.  The
    window is the larger of ``batch_window_ms`` and the recent time of one
    batched step (an exponential average): a session left out costs a step of
    its own, so waiting up to that long pays, and a host whose steps are slow
    (whose sessions' threads also answer more slowly) waits longer.  A
    session whose edge is slow (or gone quiet) is not waited for and catches
    the next batch; a single session never waits.
    Gathering by membership instead of a window restarted at each arrival
    keeps sessions that fell into two groups from staying split.  Sessions
    join (:meth:`prefill`) and leave (:meth:`release`) between steps:
    continuous batching.  Prefills run on the same thread, between step
    batches, so no two forwards ever overlap; the prefills that queued up
    meanwhile run as one padded ``llm.open_many``, right after the next step
    batch: under continuous decoding a new session waits at most one step
    (not until no step waits, which under run-ahead may be never).  On a
    model that prefills chunk by chunk (the slot engine's ``opening``), a
    prefill turn runs one chunk of the oldest prompt: a long prompt then
    holds the decoding sessions up by one chunk's forward per step, never
    by its whole prefill (chunked prefill, interleaved with the steps).

    Run-ahead sessions' drafts are advanced by the worker itself
    (``engine_drafts``; :meth:`run_ahead`): after each forward of such a
    sequence the worker reads its draft token off the new row (the top id,
    or the greedy cloud-side pick of an empty upload, on the device for a
    device row) and queues the step that appends it, up to the depth its
    session allows (:meth:`plan_drafts`), so a drafting sequence's next
    forward joins the next batch without a round through its session's
    thread.  The session takes the drafted rows (:meth:`take_draft`) when
    its stream may send them; a forward of its own (the edge's token where
    it is not the draft) first drops every draft past the confirmed tokens.

    Attributes:
        batch_sizes: how many step batches of each size ran.
        prefill_sizes: how many prefill batches of each size ran.
        step_seconds: wall time spent inside ``llm.step``.
    """

    #: weight of the newest return gap, and of the newest step's time, in their exponential averages
    GAP_SMOOTHING = 0.3

    def __init__(self, llm: TransformersLLM, *, batch_window_ms: float = 10.0,
                 engine_drafts: bool | None = None) -> None:
        if batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be non-negative, got {batch_window_ms}")
        self._queue = _ModelQueue(llm, chunked_prefills=True)
        super().__init__([self._queue])
        #: the worker advances run-ahead sessions' drafts itself (default: for a model that summarises its rows,
        #: the slot engine; over whole rows each draft token would cost the worker a V-sized pass)
        self.engine_drafts = getattr(llm, "summarizes_rows", False) if engine_drafts is None else engine_drafts
        self._lanes: dict[int, _DraftLane] = {}  # id(seq) -> its draft lane
        self._stepping: set[int] = set()  # id(seq) of the sequences in the step batch running now
        self._least_window_s = batch_window_ms / 1000.0
        self._step_s = 0.0  # average seconds of one batched step
        self._live: set[CloudSequence] = set()
        self._delivered_at: dict[int, float] = {}  # id(seq) -> when its last forward was delivered
        self._return_gap: dict[int, float] = {}  # id(seq) -> average seconds from delivery to its next request
        self._start()

    @property
    def batch_sizes(self) -> Counter[int]:
        return self._queue.stats.batch_sizes

    @property
    def prefill_sizes(self) -> Counter[int]:
        return self._queue.stats.prefill_sizes

    @property
    def step_seconds(self) -> float:
        return self._queue.stats.step_seconds

    @property
    def drafted_steps(self) -> int:
        """Steps the worker queued itself to advance run-ahead sessions' drafts (``engine_drafts``)."""
        return self._queue.stats.engine_drafts

    @property
    def tokens_per_session(self) -> int | None:
        """The model's bound on one sequence's tokens (the slot engine's ``max_len``), or ``None``."""
        return getattr(self._queue.llm, "max_len", None)

    @property
    def window_s(self) -> float:
        """How long a batch waits for the sessions expected back: ``max(batch_window_ms, recent step time)``."""
        return max(self._least_window_s, self._step_s)

    # -- called by sessions --------------------------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int], *, spec: RowSpec | None = None) -> tuple[CloudSequence, int]:
        request = _PrefillRequest([int(i) for i in prompt_ids], spec)
        self._submit(self._queue, request)
        return request.result.result()

    def forward(self, seq: CloudSequence, token_id: int, *, truncate_to: int | None = None) -> int:
        """Step ``seq`` by ``token_id``; on a run-ahead sequence every engine draft is dropped first (so give
        ``truncate_to``: its confirmed tokens), and :meth:`forwarded_row` reads the row after it."""
        request = _StepRequest(seq, int(token_id), truncate_to)
        with self._cond:
            self._require_open()
            lane = self._lanes.get(id(seq))
            if lane is not None:
                self._cancel(lane)
            self._note_return(seq)
            self._enqueue(self._queue, request)
        return request.result.result()

    def _note_return(self, seq: CloudSequence) -> None:
        """With the lock held: ``seq``'s session asks for its next step now (its return gap, averaged)."""
        delivered = self._delivered_at.get(id(seq))
        if delivered is not None:
            gap = time.monotonic() - delivered
            previous = self._return_gap.get(id(seq), gap)
            self._return_gap[id(seq)] = previous + self.GAP_SMOOTHING * (gap - previous)

    def release(self, seq: CloudSequence) -> None:
        with self._cond:
            self._live.discard(seq)
            self._delivered_at.pop(id(seq), None)
            self._return_gap.pop(id(seq), None)
            lane = self._lanes.pop(id(seq), None)
            if lane is not None:
                self._cancel(lane)
                while id(seq) in self._stepping:  # a draft of it is running: its slot is given back after
                    self._cond.wait()
            self._cond.notify_all()  # a batch waiting for this sequence can go now
        release = getattr(self._queue.llm, "release", None)
        if release is not None:  # a slot to give back (the slot engine); no forward of it is queued or running
            release(seq)

    # -- run-ahead driven by the engine ------------------------------------------------------------
    def run_ahead(self, seq: CloudSequence, *, rule: GreedyPick | None, spec: RowSpec,
                  end_ids: frozenset[int]) -> bool:
        """Let the worker draft past ``seq``'s tokens by ``rule`` (:class:`_DraftLane`), ``end_ids`` never
        drafted; ``False`` (nothing done) where ``engine_drafts`` is off.  Call it between forwards of ``seq``,
        once, with ``seq``'s current row in ``seq.next_row`` (or ``next_logits``); nothing is drafted until
        :meth:`plan_drafts`."""
        if not self.engine_drafts:
            return False
        row = seq.next_row if seq.next_row is not None else summarize_row(seq.next_logits, spec)
        lane = _DraftLane(rule, spec, end_ids, row=row)
        lane.next_token = greedy_picks([row], [rule])[0] if rule is not None else int(row.ids[0])
        with self._cond:
            self._require_open()
            self._lanes[id(seq)] = lane
        return True

    def plan_drafts(self, seq: CloudSequence, until: int) -> bool:
        """The worker may draft ``seq`` up to ``until`` tokens; whether a drafted step is ready or on its way."""
        with self._cond:
            lane = self._lanes[id(seq)]
            lane.until = until
            self._extend(seq, lane)
            return bool(lane.ready) or lane.request is not None or lane.error is not None

    def take_draft(self, seq: CloudSequence, token: int | None = None) -> Drafted | None:
        """The oldest drafted step of ``seq`` not yet taken, waiting for it if it is on its way; with ``token``:
        only if it drafted that token (else ``None``, and nothing is taken)."""
        with self._cond:
            lane = self._lanes[id(seq)]
            while not lane.ready and lane.request is not None and lane.error is None and not self._dead:
                if token is not None and lane.request.token_id != token:
                    return None
                self._cond.wait()
            if lane.error is not None:
                error, lane.error = lane.error, None
                raise error
            if lane.ready and (token is None or lane.ready[0].token == token):
                drafted = lane.ready.popleft()
                self._extend(seq, lane)  # a row taken: the lane may go on
                return drafted
            if token is None:
                self._require_open()
                raise RuntimeError("no draft of this sequence is ready or on its way")
            return None

    def forwarded_row(self, seq: CloudSequence) -> StepRow | None:
        """The row after the latest :meth:`forward` of a run-ahead ``seq`` (the worker may already be drafting
        past it, replacing ``seq.next_row``)."""
        with self._cond:
            lane = self._lanes.get(id(seq))
            if lane is not None and lane.error is not None:  # reading the row after it failed
                error, lane.error = lane.error, None
                raise error
            return lane.row if lane is not None else None

    def _cancel(self, lane: _DraftLane) -> None:
        """With the lock held: drop ``lane``'s drafts, queued and ready (one running is not delivered)."""
        lane.epoch += 1
        if lane.request is not None and lane.request in self._queue.steps:
            self._queue.steps.remove(lane.request)
        lane.request, lane.next_token, lane.row, lane.error = None, None, None, None
        lane.ready.clear()

    def _extend(self, seq: CloudSequence, lane: _DraftLane) -> None:
        """With the lock held: queue ``seq``'s next draft step when the lane allows one.

        Counted as ``seq``'s return (:meth:`_note_return`), as a session's own draft request was: at once when the
        worker queues it on delivery, after the edge's confirmation when the session lets a stopped lane go on; so
        batches wait for run-ahead sequences as they waited for their sessions' draft requests."""
        if (lane.request is None and lane.error is None and lane.next_token is not None and len(lane.ready) < DRAFT_LEAD
                and lane.next_token not in lane.end_ids and len(seq.ids) < lane.until):
            lane.request = _StepRequest(seq, lane.next_token, epoch=lane.epoch)
            self._queue.stats.engine_drafts += 1
            self._note_return(seq)
            self._enqueue(self._queue, lane.request)

    def _stepped(self, steps: list[_StepRequest], elapsed_ns: int) -> None:
        """On the worker, after a step batch and before its callers wake: each run-ahead sequence's new row and
        draft token; drafted steps handed to their lanes, the next ones queued."""
        with self._cond:
            lanes = [(request, self._lanes.get(id(request.seq))) for request in steps]
        current = [(request, lane) for request, lane in lanes
                   if lane is not None and (request.epoch is None or request.epoch == lane.epoch)]
        if not current:
            return
        try:
            rows = [request.seq.next_row if request.seq.next_row is not None else
                    summarize_row(request.seq.next_logits, lane.spec) for request, lane in current]
            picking = [(b, lane.rule) for b, (_, lane) in enumerate(current) if lane.rule is not None]
            tokens: list[int | None] = [int(row.ids[0]) if len(row.ids) else None for row in rows]
            if picking:
                picked = greedy_picks([rows[b] for b, _ in picking], [rule for _, rule in picking])
                for (b, _), token in zip(picking, picked):
                    tokens[b] = token
        except Exception as exc:  # noqa: BLE001 - each lane's session raises it (the worker goes on)
            with self._cond:
                for _, lane in current:
                    lane.error, lane.request = exc, None
                self._cond.notify_all()
            return
        with self._cond:
            for (request, lane), row, token in zip(current, rows, tokens):
                if request.epoch is not None:
                    if request.epoch != lane.epoch:  # cancelled while it ran
                        continue
                    lane.ready.append(Drafted(request.token_id, row, elapsed_ns))
                    lane.request = None
                else:
                    request.seq.next_row, lane.row = row, row
                lane.next_token = token if row.finite else None
                self._extend(request.seq, lane)
            self._cond.notify_all()

    def _failed_drafts(self, steps: list[_StepRequest]) -> None:
        """On the worker, after a step batch that failed: its engine drafts' lanes hold the error."""
        with self._cond:
            for request in steps:
                lane = self._lanes.get(id(request.seq))
                if (request.epoch is not None and lane is not None and lane.epoch == request.epoch
                        and request.result.done() and request.result.exception() is not None):
                    lane.error, lane.request = request.result.exception(), None
            self._cond.notify_all()

    # -- the worker thread ---------------------------------------------------------------------
    def _serve_requests(self) -> None:
        queue = self._queue
        prefill_turn = False  # after a step batch, prefills waiting go first: a session opens within one step
        while True:
            with self._cond:
                while not (queue or self._closed):
                    self._cond.wait()
                if queue.prefill_waits and (prefill_turn or not queue.steps):
                    steps, prefills, prefilling = [], queue.take_prefills(), True
                elif queue.steps:
                    self._wait_for_batch()
                    steps, prefills, prefilling = queue.take_steps(), [], False
                    self._stepping = {id(request.seq) for request in steps}
                else:
                    return  # closed and drained
            prefill_turn = bool(steps)
            if steps:
                started = time.monotonic()
                try:
                    queue.run_steps(steps, self._delivered, self._stepped if self.engine_drafts else None)
                finally:
                    self._failed_drafts(steps)
                    with self._cond:
                        self._stepping = set()
                        self._cond.notify_all()
                with self._cond:
                    elapsed = time.monotonic() - started
                    self._step_s += self.GAP_SMOOTHING * (elapsed - self._step_s) if self._step_s else elapsed
            elif prefilling:
                queue.run_prefills(prefills, self._opened)
            # drop this batch's requests before waiting for the next: they hold their sequences, and with
            # them the KV caches of sessions that may have ended meanwhile
            del steps, prefills

    def _delivered(self, seqs: Sequence[CloudSequence]) -> None:
        now = time.monotonic()
        with self._cond:
            for seq in seqs:
                self._delivered_at[id(seq)] = now

    def _opened(self, seqs: Sequence[CloudSequence]) -> None:
        with self._cond:
            self._live.update(seqs)
        self._delivered(seqs)

    def _wait_for_batch(self) -> None:
        """With the lock held: wait for the live sequences expected back, at most a window after the first request.

        Expected back: every live sequence without a request yet whose
        average return gap is within the window (a new one counts as expected).
        """
        window_s = self.window_s
        deadline = time.monotonic() + window_s
        while not self._closed:
            waiting = {id(request.seq) for request in self._queue.steps}
            expected = [
                seq for seq in self._live
                if id(seq) not in waiting and self._return_gap.get(id(seq), 0.0) <= window_s
            ]
            remaining = deadline - time.monotonic()
            if not expected or remaining <= 0:
                return
            self._cond.wait(remaining)


class ModelLane:
    """One model of a :class:`LockstepBatcher`, as a :class:`ModelRunner` (what the engine or an SLM calls).

    ``stats`` says what ran on this model.
    """

    tokens_per_session: int | None = None

    def __init__(self, batcher: LockstepBatcher, queue: _ModelQueue) -> None:
        self._batcher, self._queue = batcher, queue
        self.stats = queue.stats

    def prefill(self, prompt_ids: Sequence[int], *, spec: RowSpec | None = None) -> tuple[CloudSequence, int]:
        request = _PrefillRequest([int(i) for i in prompt_ids])
        self._batcher._submit(self._queue, request)  # noqa: SLF001 - the batcher's own queue entry point
        return request.result.result()

    def forward(self, seq: CloudSequence, token_id: int, *, truncate_to: int | None = None) -> int:
        request = _StepRequest(seq, int(token_id), truncate_to)
        self._batcher._submit(self._queue, request)  # noqa: SLF001 - the batcher's own queue entry point
        return request.result.result()

    def release(self, seq: CloudSequence) -> None:
        """Nothing to do: the sequence's cache is freed with its last reference."""


class LockstepBatcher(_ModelWorker):
    """Several models behind one worker thread, for a known set of client threads that each call them in turn.

    Each client (an item being decoded, in a thread of its own) is registered
    while it takes part (:meth:`participant`).  A client is always either
    computing or blocked on exactly one forward, so the worker knows when
    nobody else can come: it runs a batch once every registered client is
    waiting (or ``max_wait_ms`` after the batch's first request: a client
    stuck elsewhere is not waited for longer).  Every batch then holds every
    client waiting on its model, however long a client's own work between
    forwards takes; forwards never overlap, so each gets the whole machine.

    Which batch runs: waiting prefills first (a new client joins the others
    quickly), else the model with the most waiting steps.  The clients that
    step then go on to their next model and join the ones waiting there, so
    two groups out of step merge after one batch instead of taking turns.

    A request from a thread that is not a registered client is served as
    soon as everyone registered is waiting too (with none registered: at once).

    With ``per_sequence`` a batch's clients still step together, but each in a forward of its own
    (:class:`_ModelQueue`): a client's logits are then the same whichever clients shared its batch.  The
    ``stats`` count batches (the clients that stepped together) either way.
    """

    def __init__(self, llms: Sequence[TransformersLLM], *, max_wait_ms: float = 500.0,
                 per_sequence: bool = False) -> None:
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be non-negative, got {max_wait_ms}")
        queues = [_ModelQueue(llm, per_sequence=per_sequence) for llm in llms]
        super().__init__(queues)
        self.lanes = [ModelLane(self, queue) for queue in queues]
        self._max_wait_s = max_wait_ms / 1000.0
        self._clients = 0
        self._start()

    @contextmanager
    def participant(self) -> Iterator[None]:
        """Count the calling thread as a client for the duration of the ``with`` block."""
        with self._cond:
            self._clients += 1
        try:
            yield
        finally:
            with self._cond:
                self._clients -= 1
                self._cond.notify_all()  # a batch waiting for this client can go now

    def _serve_requests(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting() or self._closed):
                    self._cond.wait()
                if not self._waiting():
                    return  # closed and drained
                deadline = time.monotonic() + self._max_wait_s
                while not self._closed and self._waiting() < self._clients:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                queue, steps, prefills = self._choose()
            if prefills:
                queue.run_prefills(prefills)
            else:
                queue.run_steps(steps)
            del steps, prefills  # the requests hold sequences (and their KV caches) that may be done with

    def _choose(self) -> tuple[_ModelQueue, list[_StepRequest], list[_PrefillRequest]]:
        """With the lock held and something waiting: the model and the batch to run next."""
        with_prefills = [queue for queue in self._queues if queue.prefills]
        if with_prefills:
            queue = max(with_prefills, key=lambda q: len(q.prefills))  # first of the largest on a tie
            return queue, [], queue.take_prefills()
        queue = max(self._queues, key=lambda q: len(q.steps))
        return queue, queue.take_steps(), []
