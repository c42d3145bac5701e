"""The reference runner: both models in HF transformers, many items decoded at once, one decoding loop.

Each item runs the SDK's own loop (:class:`edge_sdk.client.EdgeClient` over
the in-process transport, so the same bytes and checks as the wire) in a
thread of its own.  Both models sit behind one
:class:`~cloud_adapter.runners.LockstepBatcher`: the cloud LLM through the
cloud engine, the SLM through :class:`BatchedSLM`.  Once every item in flight
waits on a forward, the items waiting on one model step together, each in a
forward of its own over its own KV cache, then go on to the other model
together: the items step in lockstep, not one at a time without a cache as
the authors' release does.  A forward of one sequence makes a row the same
whichever items shared its batch (a padded forward of several rows changes
every row's rounding: :class:`~cloud_adapter.runners.LockstepBatcher`);
``forwards="padded"`` runs each batch as one padded forward instead,
faster, and its rows say ``batch_invariant: false``; ``forwards="batch-invariant"``
runs each batch as one padded forward through batch-invariant kernels
(:mod:`eval_harness.runners.batch_invariant`): batched, and each row bit for bit
what the item gives alone through those kernels.

:meth:`ReferenceRunner.mechanism` measures a finished item's per-step
decisions against full fusion (:mod:`eval_harness.runners.mechanism`).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM, TransformersSLM
from cloud_adapter.runners import BatchStats, LockstepBatcher, ModelLane
from edge_sdk.backends.base import SLMBackend
from edge_sdk.client import EdgeClient, GenerationResult
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.prompts import Prompts, plain_prompts
from edge_sdk.policies import Policy
from eval_harness.attacks.observer import RecordingChannel, RecordingClient
from eval_harness.datasets import DecodeLeakItem
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners import mechanism


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
    """What one item needs: the prompts, and a policy built for this item (randomised ones get their own rng).

    ``public_prompt`` is the item's public text (its question), which the SLM reads right after the private
    context; ``public_preamble`` is public text both models read before them (the protocol's worked example).
    ``wire``: where to record the generation's messages as the observer attacks see them (one
    :class:`~eval_harness.attacks.observer.RecordingChannel` per session; ``None``: not recorded), through a
    :class:`~eval_harness.attacks.observer.RecordingClient`.
    """

    item_id: str
    public_prompt: str
    private_context: str
    policy: Policy
    rng: np.random.Generator | None = None
    stopping: Any = None
    public_preamble: str = ""
    wire: list[RecordingChannel] | None = None

    @classmethod
    def of(cls, protocol: DecodingProtocol, item: DecodeLeakItem, policy: Policy, *,
           rng: np.random.Generator | None = None, private_context: str | None = None,
           wire: list[RecordingChannel] | None = None) -> ItemRun:
        """``item`` under ``protocol``: its question prompt, the protocol's preamble and stopping rule, and its
        own private context unless ``private_context`` is given (the observer attacks' second context)."""
        context = item.private_context if private_context is None else private_context
        return cls(item.item_id, protocol.question_prompt(item), context, policy, rng=rng,
                   stopping=protocol.stopping(item), public_preamble=protocol.preamble, wire=wire)

    def prompts(self, slm: SLMBackend) -> Prompts:
        """Both prompts (:func:`edge_sdk.prompts.plain_prompts`): the private context right before the question."""
        return plain_prompts(slm, self.public_prompt, self.private_context, public_preamble=self.public_preamble)

    def generate(self, client: EdgeClient, *, mode: str, alpha: float, max_new_tokens: int,
                 exposure_k: int) -> GenerationResult:
        """This item through ``client``'s decoding loop, with its own policy, generator and stopping rule (its
        sessions recorded into :attr:`wire` if set: ``client`` is then a :class:`RecordingClient`)."""
        def generate() -> GenerationResult:
            return client.generate(self.prompts(client.slm), mode=mode, policy=self.policy, alpha=alpha,
                                   max_new_tokens=max_new_tokens, rng=self.rng, stopping=self.stopping,
                                   exposure_k=exposure_k)

        if self.wire is None:
            return generate()
        if not isinstance(client, RecordingClient):
            raise TypeError(f"item {self.item_id} is to be recorded (wire), but its runner's client is a "
                            f"{type(client).__name__}, not a RecordingClient")
        with client.recording(self.wire):
            return generate()


class ItemRunner(ABC):
    """Items through the SDK's loop, ``self.concurrency`` at once.

    A subclass says which client (its edge model and its cloud) decodes each item (:meth:`client`), may say what
    a finished item reports (:meth:`finish`), and sets ``concurrency``; :meth:`run` is the same for all, so a
    sweep drives any of them.
    """

    concurrency: int

    @property
    @abstractmethod
    def policy_backend(self) -> SLMBackend:
        """The edge model, for policies that build themselves from it (CusText's clusters)."""

    @abstractmethod
    def client(self) -> AbstractContextManager[EdgeClient]:
        """A client with its own edge model, held for one item while it decodes."""

    def finish(self, result: GenerationResult) -> GenerationResult:
        """What :meth:`run` reports for a decoded item, once its client is free again: the result itself (the
        deployed runner audits it against the cloud's transcript)."""
        return result

    def run(
        self,
        runs: Sequence[ItemRun],
        *,
        mode: str,
        alpha: float,
        max_new_tokens: int,
        on_result: Callable[[ItemRun, GenerationResult], None] | None = None,
        exposure_k: int = DecodeSettings.exposure_k,
    ) -> list[GenerationResult]:
        """Decode every item; ``on_result`` is called (from a worker thread) as each one finishes."""

        def one(item: ItemRun) -> GenerationResult:
            with self.client() as client:
                result = item.generate(client, mode=mode, alpha=alpha, max_new_tokens=max_new_tokens,
                                       exposure_k=exposure_k)
            result = self.finish(result)
            if on_result is not None:
                on_result(item, result)
            return result

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="item") as pool:
            return list(pool.map(one, runs))

    def mechanism(self, item: ItemRun, result: GenerationResult, *, mode: str, alpha: float) -> dict[str, Any] | None:
        """The item's per-step mechanism statistics; ``None`` where the runner cannot recompute full fusion
        (the :class:`ReferenceRunner` can: it holds both models in full precision)."""
        return None


#: how the reference runner runs a batch of forwards (:class:`ReferenceRunner`'s ``forwards``)
FORWARDS = ("per-sequence", "padded", "batch-invariant")


class ReferenceRunner(ItemRunner):
    """Both models in transformers, ``concurrency`` items in flight; results as the in-process SDK gives them.

    Args:
        slm: the edge model in transformers (e.g. the full-precision twin of a GGUF).
        llm: the cloud model.
        concurrency: items decoded at once (the batch each model's forwards gather).
        max_wait_ms: how long a batch waits for an item still busy with its own work before it runs without it.
        forwards: how a batch runs (:data:`FORWARDS`): ``"per-sequence"``, one forward per item (the default: a
            row is what the item gives alone); ``"padded"``, one padded forward (faster; a row then depends on
            which items shared its batches); ``"batch-invariant"``, one padded forward through batch-invariant
            kernels (:func:`~eval_harness.runners.batch_invariant.make_batch_invariant`, applied to both models
            here: float32 on the CPU), as fast as batching and a row still what the item gives alone.
    """

    def __init__(self, slm: TransformersLLM, llm: TransformersLLM, *, concurrency: int = 8,
                 max_wait_ms: float = 500.0, forwards: str = "per-sequence") -> None:
        if forwards not in FORWARDS:
            raise ValueError(f"forwards is one of {', '.join(FORWARDS)}, got {forwards!r}")
        if forwards == "batch-invariant":
            from eval_harness.runners.batch_invariant import make_batch_invariant

            for model in (slm, llm):
                make_batch_invariant(model.model)
        self.slm_model, self.llm = slm, llm
        self.concurrency = concurrency
        self.forwards = forwards
        self._batcher = LockstepBatcher([slm, llm], max_wait_ms=max_wait_ms, per_sequence=forwards == "per-sequence")
        self._slm_lane, self._llm_lane = self._batcher.lanes
        limits = Limits(max_sessions=concurrency, max_sessions_per_client=concurrency)
        self.engine = CloudEngine(llm, limits, runner=self._llm_lane, exposure_k=1000)
        self._tokenizer_lock = threading.Lock()
        self._mechanism_lock = threading.Lock()  # one teacher-forced pass at a time (each holds [T, V] rows)
        # one client (and edge model) per item in flight, reused for the items after it: a client builds its
        # token-text reader over the whole vocabulary once, as a device would, not once per item
        self._idle_clients: queue.SimpleQueue[tuple[EdgeClient, BatchedSLM]] = queue.SimpleQueue()

    @property
    def policy_backend(self) -> BatchedSLM:
        """The edge model as a backend, for policies that build themselves from it (CusText's clusters)."""
        return BatchedSLM(self.slm_model, self._slm_lane, self._tokenizer_lock)

    @property
    def batching(self) -> dict[str, Any]:
        """How items were batched, for each result row: ``concurrency``, ``lockstep``, ``forwards``
        (:data:`FORWARDS`) and ``batch_invariant`` (whether a row is independent of which items shared its
        batches)."""
        return {"concurrency": self.concurrency, "lockstep": True, "forwards": self.forwards,
                "batch_invariant": self.forwards != "padded"}

    @property
    def batch_sizes(self) -> tuple[dict[int, int], dict[int, int]]:
        """How many batched forwards of each size ran: (SLM, cloud LLM)."""
        return dict(self._slm_lane.stats.batch_sizes), dict(self._llm_lane.stats.batch_sizes)

    @property
    def stats(self) -> tuple[BatchStats, BatchStats]:
        """What ran on each model so far, and the time inside its forwards: (SLM, cloud LLM)."""
        return self._slm_lane.stats, self._llm_lane.stats

    @contextmanager
    def participant(self) -> Iterator[None]:
        """Count the calling thread as an item in flight (:meth:`LockstepBatcher.participant`): batches wait
        for it.  :meth:`client` does this; an item decoded against :attr:`engine` by another edge model (the
        llama.cpp edge of ``compare-quant``) does it to have its cloud forwards batched with the others."""
        with self._batcher.participant():
            yield

    @contextmanager
    def client(self) -> Iterator[EdgeClient]:
        """An idle client with its edge model (a new pair while fewer than the items in flight exist), taking
        part in the lockstep while the item decodes; its sequence is released when the item is done."""
        try:
            client, slm = self._idle_clients.get_nowait()
        except queue.Empty:
            slm = BatchedSLM(self.slm_model, self._slm_lane, self._tokenizer_lock)
            client = RecordingClient(lambda: self.engine.session("reference"), slm=slm)
        with self.participant():
            try:
                yield client
            finally:
                slm.close()
                self._idle_clients.put((client, slm))

    def mechanism(self, item: ItemRun, result: GenerationResult, *, mode: str, alpha: float) -> dict[str, Any]:
        """The item's per-step mechanism statistics (:func:`eval_harness.runners.mechanism.summarise`).

        One teacher-forced forward of each model over its prompt and ``result``'s tokens gives both full
        rows at every step (see :mod:`eval_harness.runners.mechanism` for what that recomputation can
        differ in); zero uploads are read off the ledger.  Safe to call from ``on_result`` while other
        items decode: the pass reads the models' weights only, never a decoding sequence's cache.
        """
        tokens = list(result.token_ids)
        slm, llm = self.slm_model, self.llm
        with self._tokenizer_lock:
            prompts = item.prompts(slm)
            slm_prompt, cloud_prompt = list(prompts.slm_ids), list(prompts.cloud_ids)
            # the loop asks its stopping rule before each step, about the text decoded so far
            end_allowed = [item.stopping is None or item.stopping.allows_end(slm.detokenize(tokens[:t]))
                           for t in range(len(tokens))]
        with self._mechanism_lock:
            slm_rows = mechanism.teacher_forced_logits(slm.model, slm_prompt, tokens, slm.vocab_size)
            llm_rows = mechanism.teacher_forced_logits(llm.model, cloud_prompt, tokens, llm.vocab_size)
            full_top, ranks = mechanism.step_decisions(
                slm_rows, llm_rows.to(slm_rows.device), tokens, alpha=alpha, space=item.policy.space,
                end_allowed=end_allowed, stop_ids=slm.eos_token_ids | llm.eos_token_ids)
            del slm_rows, llm_rows
        uploads = [entry.values_uploaded for entry in result.ledger.entries] if mode == "cloud" else None
        return mechanism.summarise(tokens, full_top, ranks, uploads)

    def close(self) -> None:
        self._batcher.close()

    def __enter__(self) -> ReferenceRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
