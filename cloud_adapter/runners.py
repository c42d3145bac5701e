"""Where the cloud model's forward passes run: in the caller's thread, or batched on one worker thread."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from cloud_adapter.llm import CloudSequence, TransformersLLM


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

    Sessions call :meth:`forward` from their own threads.  The worker gathers
    the sessions known to be mid-step: every live sequence whose last forward
    has been delivered comes back with its next token after its edge's turn
    (its *return gap*), so a batch waits for each live sequence whose recent
    return gap (an exponential average) is within ``batch_window_ms``, for at
    most ``batch_window_ms`` after its first request, then runs one
    ``llm.step(batch)``.  A session whose edge is slow (or gone quiet) is not
    waited for and catches the next batch; a single session never waits.
    Gathering by membership instead of a window restarted at each arrival
    keeps sessions that fell into two groups from staying split.  Sessions
    join (:meth:`prefill`) and leave (:meth:`release`) between steps:
    continuous batching.  Prefills run on the same thread, between step
    batches, so no two forwards ever overlap; the prefills that queued up
    meanwhile run as one padded ``llm.open_many``.

    Attributes:
        batch_sizes: how many step batches of each size ran.
        prefill_sizes: how many prefill batches of each size ran.
        step_seconds: wall time spent inside ``llm.step``.
    """

    #: weight of the newest return gap in its exponential average
    GAP_SMOOTHING = 0.3

    def __init__(self, llm: TransformersLLM, *, batch_window_ms: float = 10.0) -> None:
        if batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be non-negative, got {batch_window_ms}")
        self._llm = llm
        self._window_s = batch_window_ms / 1000.0
        self._cond = threading.Condition()
        self._steps: list[_StepRequest] = []
        self._prefills: deque[_PrefillRequest] = deque()
        self._live: set[CloudSequence] = set()
        self._delivered_at: dict[int, float] = {}  # id(seq) -> when its last forward was delivered
        self._return_gap: dict[int, float] = {}  # id(seq) -> average seconds from delivery to its next request
        self._closed = False
        self._dead = False  # the worker thread has ended
        #: called (on the dying worker thread) if the worker ends without :meth:`close`; the server reports
        #: NOT_SERVING to health checks from here
        self.on_death: list[Callable[[], None]] = []
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
            delivered = self._delivered_at.get(id(seq))
            if delivered is not None:
                gap = time.monotonic() - delivered
                previous = self._return_gap.get(id(seq), gap)
                self._return_gap[id(seq)] = previous + self.GAP_SMOOTHING * (gap - previous)
            self._steps.append(request)
            self._cond.notify_all()
        return request.result.result()

    def release(self, seq: CloudSequence) -> None:
        with self._cond:
            self._live.discard(seq)
            self._delivered_at.pop(id(seq), None)
            self._return_gap.pop(id(seq), None)
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
        if self._dead:
            raise RuntimeError("the model worker has died; the server must be restarted")


    # -- the worker thread ---------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._serve_requests()
        finally:  # whatever ended the worker, nobody waits forever on it
            with self._cond:
                self._dead = True  # from here on every request fails at once
                waiting = [*self._steps, *self._prefills]
                self._steps, self._prefills = [], deque()
                died = not self._closed
            for request in waiting:
                if not request.result.done():
                    request.result.set_exception(RuntimeError("the model worker has died"))
            if died:
                for callback in self.on_death:
                    callback()

    def _serve_requests(self) -> None:
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
            # drop this batch's requests before waiting for the next: they hold their sequences, and with
            # them the KV caches of sessions that may have ended meanwhile
            del steps, prefills

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
        """With the lock held: wait for the live sequences expected back, at most a window after the first request.

        Expected back: every live sequence without a request yet whose
        average return gap is within the window (a new one counts as expected).
        """
        deadline = time.monotonic() + self._window_s
        while not self._closed:
            waiting = {id(request.seq) for request in self._steps}
            expected = [
                seq for seq in self._live
                if id(seq) not in waiting and self._return_gap.get(id(seq), 0.0) <= self._window_s
            ]
            remaining = deadline - time.monotonic()
            if not expected or remaining <= 0:
                return
            self._cond.wait(remaining)

    def _run_steps(self, steps: list[_StepRequest]) -> None:
        start = time.perf_counter_ns()
        try:
            self._llm.step([(request.seq, request.token_id) for request in steps])
        except BaseException as exc:  # delivered to every session of the batch
            for request in steps:
                request.result.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise  # the worker cannot go on (interpreter exit and the like)
            return
        elapsed = time.perf_counter_ns() - start
        self.step_seconds += elapsed / 1e9
        self.batch_sizes[len(steps)] += 1
        now = time.monotonic()
        with self._cond:
            for request in steps:
                self._delivered_at[id(request.seq)] = now
        for request in steps:
            request.result.set_result(elapsed)

    def _run_prefills(self, requests: list[_PrefillRequest]) -> None:
        """One padded prefill for ``requests``; if it fails, each alone, so one bad prompt fails only its session."""
        start = time.perf_counter_ns()
        try:
            seqs = self._llm.open_many([request.prompt_ids for request in requests])
        except BaseException as exc:
            if not isinstance(exc, Exception):
                for request in requests:
                    request.result.set_exception(RuntimeError(repr(exc)))
                raise  # the worker cannot go on
            if len(requests) > 1:
                for request in requests:
                    self._run_prefills([request])
            else:
                requests[0].result.set_exception(exc)
            return
        elapsed = time.perf_counter_ns() - start
        self.prefill_sizes[len(requests)] += 1
        now = time.monotonic()
        with self._cond:
            self._live.update(seqs)
            for seq in seqs:
                self._delivered_at[id(seq)] = now
        for request, seq in zip(requests, seqs, strict=True):
            request.result.set_result((seq, elapsed))
