"""The reference runner: both models in HF transformers, many items decoded at once, one decoding loop.

Each item runs the SDK's own loop (:class:`edge_sdk.client.EdgeClient` over
the in-process transport, so the same bytes and checks as the wire) in a
thread of its own.  Both models sit behind one
:class:`~cloud_adapter.runners.LockstepBatcher`: the cloud LLM through the
cloud engine, the SLM through :class:`BatchedSLM`.  Once every item in flight
waits on a forward, the items waiting on one model run as one padded forward
with their KV caches, then go on to the other model together: the items step
in lockstep, not one at a time without a cache as the authors' release does.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM, TransformersSLM
from cloud_adapter.runners import BatchStats, LockstepBatcher, ModelLane
from edge_sdk.client import EdgeClient, GenerationResult
from edge_sdk.policies import Policy


class BatchedSLM(TransformersSLM):
    """A :class:`~cloud_adapter.llm.TransformersSLM` whose forwards go through a batcher's lane.

    One instance per item in flight (reused for the next item); instances sharing a lane have their
    steps folded into one batched forward, and share one lock for the
    tokenizer (fast tokenizers refuse concurrent use).
    """

    def __init__(self, llm: TransformersLLM, lane: ModelLane, tokenizer_lock: threading.Lock) -> None:
        super().__init__(llm)
        self.lane, self._lock = lane, tokenizer_lock
        self.source = llm.source  # a policy that needs the model's files (CusText) finds them here

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        with self._lock:
            return super().tokenize(text, add_bos=add_bos)

    def detokenize(self, ids: list[int]) -> str:
        with self._lock:
            return super().detokenize(ids)

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.close()
        self._seq, _ = self.lane.prefill(ids)
        return self._seq.next_logits.copy()

    def append(self, token_id: int) -> np.ndarray:
        if self._seq is None:
            raise RuntimeError("append before prefill: the sequence is empty")
        self.lane.forward(self._seq, int(token_id))
        return self._seq.next_logits.copy()

    def close(self) -> None:
        """Let the lane forget this item's sequence (its KV cache goes with it)."""
        if self._seq is not None:
            self.lane.release(self._seq)
            self._seq = None


@dataclass(frozen=True)
class ItemRun:
    """What one item needs: the prompts, and a policy built for this item (randomised ones get their own rng)."""

    item_id: str
    public_prompt: str
    private_context: str
    policy: Policy
    rng: np.random.Generator | None = None
    stopping: Any = None


class ReferenceRunner:
    """Both models in transformers, ``concurrency`` items in flight; results as the in-process SDK gives them.

    Args:
        slm: the edge model in transformers (e.g. the full-precision twin of a GGUF).
        llm: the cloud model.
        concurrency: items decoded at once (the batch each model's forwards gather).
        max_wait_ms: how long a batch waits for an item still busy with its own work before it runs without it.
    """

    def __init__(self, slm: TransformersLLM, llm: TransformersLLM, *, concurrency: int = 8,
                 max_wait_ms: float = 500.0) -> None:
        self.slm_model, self.llm = slm, llm
        self.concurrency = concurrency
        self._batcher = LockstepBatcher([slm, llm], max_wait_ms=max_wait_ms)
        self._slm_lane, self._llm_lane = self._batcher.lanes
        limits = Limits(max_sessions=concurrency, max_sessions_per_client=concurrency)
        self.engine = CloudEngine(llm, limits, runner=self._llm_lane, exposure_k=1000)
        self._tokenizer_lock = threading.Lock()
        # one client (and edge model) per item in flight, reused for the items after it: a client builds its
        # token-text reader over the whole vocabulary once, as a device would, not once per item
        self._idle_clients: queue.SimpleQueue[tuple[EdgeClient, BatchedSLM]] = queue.SimpleQueue()

    def _take_client(self) -> tuple[EdgeClient, BatchedSLM]:
        """An idle client with its edge model, or a new pair (there are never more than items in flight)."""
        try:
            return self._idle_clients.get_nowait()
        except queue.Empty:
            slm = BatchedSLM(self.slm_model, self._slm_lane, self._tokenizer_lock)
            return EdgeClient(lambda: self.engine.session("reference"), slm=slm), slm

    @property
    def policy_backend(self) -> BatchedSLM:
        """The edge model as a backend, for policies that build themselves from it (CusText's clusters)."""
        return BatchedSLM(self.slm_model, self._slm_lane, self._tokenizer_lock)

    @property
    def batch_sizes(self) -> tuple[dict[int, int], dict[int, int]]:
        """How many batched forwards of each size ran: (SLM, cloud LLM)."""
        return dict(self._slm_lane.stats.batch_sizes), dict(self._llm_lane.stats.batch_sizes)

    @property
    def stats(self) -> tuple[BatchStats, BatchStats]:
        """What ran on each model so far, and the time inside its forwards: (SLM, cloud LLM)."""
        return self._slm_lane.stats, self._llm_lane.stats

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
            client, slm = self._take_client()
            with self._batcher.participant():
                try:
                    result = client.generate(item.public_prompt, item.private_context, mode=mode, policy=item.policy,
                                             alpha=alpha, max_new_tokens=max_new_tokens, rng=item.rng,
                                             stopping=item.stopping, exposure_k=exposure_k)
                finally:
                    slm.close()
                    self._idle_clients.put((client, slm))
            if on_result is not None:
                on_result(item, result)
            return result

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="reference-item") as pool:
            return list(pool.map(one, runs))

    def close(self) -> None:
        self._batcher.close()

    def __enter__(self) -> ReferenceRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
