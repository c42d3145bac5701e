"""A load generator for the cloud adapter: many concurrent sessions over gRPC, timed step by step.

Each edge-side session answers every distribution at once with its best id that does
not end the generation, so every session runs its full length and the
adapter's own latency is what is measured.  A cloud-side session (``mode="cloud"``)
uploads a flat value over the row's top ids (:data:`CLOUD_UPLOAD_IDS` of them) with
``no_stop``, so the cloud picks every token and never an end.  Used by ``tests/cloud_adapter/test_load.py``
(a tiny model, in CI) and ``benchmarks/load.py`` (the embedded model).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import GrpcChannel
from edge_sdk.protocol.signals import CloudUpload

#: a cloud-side session's upload: this many of the row's top ids, each valued 1 / this
CLOUD_UPLOAD_IDS = 4


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
             lock: threading.Lock, lookahead: int, veto_share: float, seed: int) -> None:
    connection = CloudConnection(GrpcChannel(channel, timeout_s=600), lookahead=lookahead)
    steps: list[float] = []
    rng = np.random.default_rng(seed)
    try:
        info = connection.open(request)
        dist = connection.distribution()
        start.wait()
        while True:
            sent = time.perf_counter()
            if request.mode == "cloud":
                ids = np.sort(np.asarray(dist.ids[:CLOUD_UPLOAD_IDS], np.int64))
                upload = CloudUpload(ids, np.full(len(ids), 1 / CLOUD_UPLOAD_IDS, np.float32))
                _, finished = connection.upload(dist.step, upload, no_stop=True)
            else:
                candidates = (int(i) for i in dist.ids if int(i) not in info.eos_token_ids)
                token = next(candidates)
                if veto_share and rng.random() < veto_share:  # the edge's second choice: the cloud's draft drops
                    token = next(candidates, token)
                connection.sync_token(dist.step, token)
                finished = dist.step + 1 >= info.max_new_tokens
            if finished:
                connection.finished()
                steps.append(time.perf_counter() - sent)
                break
            dist = connection.distribution()
            steps.append(time.perf_counter() - sent)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: one failure must not hide the others
        with lock:
            report.errors.append(f"{type(exc).__name__}: {exc}")
        start.abort()
    finally:
        connection.close()
        with lock:
            report.step_seconds.extend(steps)


def run_load(channel: Any, prompts: Sequence[Sequence[int]], *, fingerprint: bytes, vocab_size: int,
             tokens: int, top_m: int = 16, lookahead: int = 0, veto_share: float = 0.0,
             mode: str = "edge") -> LoadReport:
    """One session per prompt (``mode``: edge- or cloud-side fusion), all at once after every one has opened;
    returns the timings.

    ``lookahead``: the run-ahead depth each session accepts (0 = lockstep); a session confirms the cloud's draft
    whenever its top id does not end the generation, so run-ahead then hides every round trip.  ``veto_share``:
    the share of steps (drawn per session from a seeded generator) on which a session takes its second-best id
    instead, so the cloud's draft past that step is dropped (edge-side sessions)."""
    report = LoadReport(sessions=len(prompts), tokens=tokens)
    lock = threading.Lock()
    start = threading.Barrier(len(prompts) + 1)
    requests = [
        wire.SessionRequest(prompt_ids=tuple(prompt), mode=mode, max_new_tokens=tokens, vocab_fingerprint=fingerprint,
                            vocab_size=vocab_size, top_m=top_m, edge_model="loadgen")
        for prompt in prompts
    ]
    threads = [threading.Thread(target=_session, args=(channel, request, start, report, lock, lookahead, veto_share,
                                                       seed))
               for seed, request in enumerate(requests)]
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


def _load_process(address: str, prompts: list[list[int]], options: dict[str, Any], out: Any) -> None:
    import grpc

    with grpc.insecure_channel(address) as channel:
        out.send(run_load(channel, prompts, **options))


def run_load_in_process(address: str, prompts: Sequence[Sequence[int]], *, started: Any = None,
                        **options: Any) -> LoadReport:
    """:func:`run_load` against the adapter at ``address`` (plaintext, loopback) from a process of its own, as
    remote edges are: none of the load's Python shares the server's interpreter lock.  ``started``, when given,
    is called once the process runs (to start a measurement); ``options`` are :func:`run_load`'s."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_load_process, args=(address, [list(p) for p in prompts], options, send))
    process.start()
    try:
        if started is not None:
            started()
        report: LoadReport = receive.recv()
    finally:
        process.join()
    return report
