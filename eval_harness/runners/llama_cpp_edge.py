"""The edge SLM in llama.cpp against an in-process cloud engine: the deployed edge, the reference cloud.

Each item runs the SDK's own loop (:class:`edge_sdk.client.EdgeClient` over the in-process transport) with a
:class:`~edge_sdk.backends.llama_cpp.LlamaCppSLM` as its edge model.  ``concurrency`` llama.cpp contexts each
decode one item at a time; the cloud is the engine of a
:class:`~eval_harness.runners.reference.ReferenceRunner`, so every edge model meets the same cloud, and each
item takes part in that runner's lockstep, so the cloud's forwards of the items in flight still run as one
batch.  It shares the
reference runner's :class:`~eval_harness.runners.reference.ItemRunner` loop, so
:func:`eval_harness.sweep.execute.run_sweep` drives either.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import EdgeClient
from eval_harness.attacks.observer import RecordingClient
from eval_harness.runners.reference import ItemRunner, ReferenceRunner


class LlamaCppEdgeRunner(ItemRunner):
    """A GGUF edge model in llama.cpp, ``concurrency`` items at once, against ``reference``'s cloud.

    Args:
        gguf_path: the edge model's file.
        reference: the runner whose cloud engine and lockstep the items join (its limits admit its own
            concurrency in sessions: this runner's ``concurrency`` must not exceed it).
        concurrency: llama.cpp contexts, hence items in flight.
        n_threads: decode threads per context (default: the cores shared out over the contexts).
        n_ctx: each context's window (private context + public query + generation).
    """

    def __init__(self, gguf_path: str | Path, reference: ReferenceRunner, *, concurrency: int = 8,
                 n_threads: int | None = None, n_ctx: int = 2048) -> None:
        if concurrency > reference.concurrency:
            raise ValueError(f"concurrency {concurrency} exceeds the reference runner's {reference.concurrency}")
        threads = n_threads or max(1, (os.cpu_count() or 1) // concurrency)
        self.engine, self.concurrency, self._reference = reference.engine, concurrency, reference
        self._slms = [LlamaCppSLM(gguf_path, n_ctx=n_ctx, n_threads=threads) for _ in range(concurrency)]
        self._idle: queue.Queue[tuple[EdgeClient, LlamaCppSLM]] = queue.Queue()
        for slm in self._slms:
            self._idle.put((RecordingClient(lambda: self.engine.session("llama-cpp-edge"), slm=slm), slm))

    @property
    def policy_backend(self) -> LlamaCppSLM:
        """The edge model, for policies that build themselves from it (used before any item runs)."""
        return self._slms[0]

    @contextmanager
    def client(self) -> Iterator[EdgeClient]:
        """A client over an idle llama.cpp context for one item (its previous item's cache is replaced by the
        next prefill), in the reference runner's lockstep while the item decodes."""
        pair = self._idle.get()
        try:
            with self._reference.participant():
                yield pair[0]
        finally:
            self._idle.put(pair)

    def close(self) -> None:
        for slm in self._slms:
            slm.close()

    def __enter__(self) -> LlamaCppEdgeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
