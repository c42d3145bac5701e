"""The edge SLM in llama.cpp against an in-process cloud engine: the deployed edge, the reference cloud.

Each item runs the SDK's own loop (:class:`edge_sdk.client.EdgeClient` over the in-process transport) with a
:class:`~edge_sdk.backends.llama_cpp.LlamaCppSLM` as its edge model.  ``concurrency`` llama.cpp contexts each
decode one item at a time; the cloud is a :class:`~cloud_adapter.engine.CloudEngine` shared with a
:class:`~eval_harness.runners.reference.ReferenceRunner`, so every edge model meets the same cloud and the
cloud's forwards of the items in flight still run as one batch.  :meth:`LlamaCppEdgeRunner.run` has the
reference runner's signature: :func:`eval_harness.sweep.execute.run_sweep` drives either.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cloud_adapter.engine import CloudEngine
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import EdgeClient, GenerationResult
from eval_harness.runners.reference import ItemRun


class LlamaCppEdgeRunner:
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

    def run(
        self,
        runs: Sequence[ItemRun],
        *,
        mode: str,
        alpha: float,
        max_new_tokens: int,
        on_result: Callable[[ItemRun, GenerationResult], None] | None = None,
        exposure_k: int = 100,
    ) -> list[GenerationResult]:
        """Decode every item; ``on_result`` is called (from a worker thread) as each one finishes."""

        def one(item: ItemRun) -> GenerationResult:
            slm = self._idle.get()
            try:
                client = EdgeClient(lambda: self.engine.session("llama-cpp-edge"), slm=slm)
                result = client.generate(item.public_prompt, item.private_context, mode=mode, policy=item.policy,
                                         alpha=alpha, max_new_tokens=max_new_tokens, rng=item.rng,
                                         stopping=item.stopping, exposure_k=exposure_k)
            finally:
                self._idle.put(slm)
            if on_result is not None:
                on_result(item, result)
            return result

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="llama-cpp-item") as pool:
            return list(pool.map(one, runs))

    def close(self) -> None:
        for slm in self._slms:
            slm.close()

    def __enter__(self) -> LlamaCppEdgeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
