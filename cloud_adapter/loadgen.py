"""A load generator for the cloud adapter: many concurrent edge-side sessions over gRPC, timed step by step.

Each session answers every distribution at once with its best id that does
not end the generation, so every session runs its full length and the
adapter's own latency is what is measured.  Used by ``tests/test_load.py``
(a tiny model, in CI) and ``benchmarks/load.py`` (the embedded model).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk import wire

_END = object()


@dataclass
class LoadReport:
    """What one load run measured."""

    sessions: int
    tokens: int
    errors: list[str] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # every step of every session
    wall_seconds: float = 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.step_seconds, q) * 1e3) if self.step_seconds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.step_seconds) / self.wall_seconds if self.wall_seconds else 0.0


def _session(channel: Any, request: wire.SessionRequest, start: threading.Barrier, report: LoadReport,
             lock: threading.Lock) -> None:
    from edge_sdk._wire import coveil_pb2_grpc

    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    steps: list[float] = []
    try:
        replies = coveil_pb2_grpc.CollaborativeDecodingStub(channel).Decode(iter(outbox.get, _END), timeout=600)
        outbox.put(wire.encode_open(request))
        info = wire.decode_opened(next(replies).opened)
        dist = wire.decode_distribution(next(replies).distribution, info.vocab_size)
        start.wait()
        while True:
            token = next(int(i) for i in dist.ids if int(i) not in info.eos_token_ids)
            sent = time.perf_counter()
            outbox.put(wire.encode_token(dist.step, token))
            reply = next(replies)
            steps.append(time.perf_counter() - sent)
            if reply.WhichOneof("kind") == "finished":
                break
            dist = wire.decode_distribution(reply.distribution, info.vocab_size)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: one failure must not hide the others
        with lock:
            report.errors.append(f"{type(exc).__name__}: {exc}")
        start.abort()
    finally:
        outbox.put(_END)
        with lock:
            report.step_seconds.extend(steps)


def run_load(channel: Any, prompts: Sequence[Sequence[int]], *, fingerprint: bytes, vocab_size: int,
             tokens: int, top_m: int = 16) -> LoadReport:
    """One edge-side session per prompt, all at once after every one has opened; returns the timings."""
    report = LoadReport(sessions=len(prompts), tokens=tokens)
    lock = threading.Lock()
    start = threading.Barrier(len(prompts) + 1)
    requests = [
        wire.SessionRequest(prompt_ids=tuple(prompt), mode="edge", max_new_tokens=tokens, vocab_fingerprint=fingerprint,
                            vocab_size=vocab_size, top_m=top_m, edge_model="loadgen")
        for prompt in prompts
    ]
    threads = [threading.Thread(target=_session, args=(channel, request, start, report, lock)) for request in requests]
    for thread in threads:
        thread.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass  # a session failed to open: its error is in the report
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    report.wall_seconds = time.perf_counter() - began
    return report
