"""The edge SLM in llama.cpp against an in-process cloud engine: the deployed edge, the reference cloud.

Each item runs the SDK's own loop (:class:`edge_sdk.client.EdgeClient` over the in-process transport) with a
:class:`~edge_sdk.backends.llama_cpp.LlamaCppSLM` as its edge model.  ``concurrency`` llama.cpp contexts each
decode one item at a time; the cloud is a :class:`~cloud_adapter.engine.CloudEngine` shared with a
:class:`~eval_harness.runners.reference.ReferenceRunner`, so every edge model meets the same cloud and the
cloud's forwards of the items in flight still run as one batch.  It shares the
reference runner's :class:`~eval_harness.runners.reference.ItemRunner` loop, so
:func:`eval_harness.sweep.execute.run_sweep` drives either.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cloud_adapter.engine import CloudEngine
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from eval_harness.runners.reference import ItemRunner


class LlamaCppEdgeRunner(ItemRunner):
    """A GGUF edge model in llama.cpp, ``concurrency`` items at once, against ``engine``.

    Args:
        gguf_path: the edge model's file.
        engine: the cloud (its limits must admit ``concurrency`` sessions, as a reference runner's do).
        concurrency: llama.cpp contexts, hence items in flight.
        n_threads: decode threads per context (default: the cores shared out over the contexts).
        n_ctx: each context's window (private context + public query + generation).
    """

    def __init__(self, gguf_path: str | Path, engine: CloudEngine, *, concurrency: int = 8,
                 n_threads: int | None = None, n_ctx: int = 2048) -> None:
        threads = n_threads or max(1, (os.cpu_count() or 1) // concurrency)
        self.engine, self.concurrency = engine, concurrency
        self._slms = [LlamaCppSLM(gguf_path, n_ctx=n_ctx, n_threads=threads) for _ in range(concurrency)]
        self._idle: queue.Queue[LlamaCppSLM] = queue.Queue()
        for slm in self._slms:
            self._idle.put(slm)

    @property
    def policy_backend(self) -> LlamaCppSLM:
        """The edge model, for policies that build themselves from it (used before any item runs)."""
        return self._slms[0]

    @contextmanager
    def edge(self) -> Iterator[LlamaCppSLM]:
        """An idle llama.cpp context for one item (its previous item's cache is replaced by the next prefill)."""
        slm = self._idle.get()
        try:
            yield slm
        finally:
            self._idle.put(slm)

    def close(self) -> None:
        for slm in self._slms:
            slm.close()

    def __enter__(self) -> LlamaCppEdgeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
