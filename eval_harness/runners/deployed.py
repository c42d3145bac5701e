"""The deployed runner: the real stack, audited from what the cloud observed.

The edge is a GGUF in llama.cpp (:class:`~edge_sdk.backends.llama_cpp.LlamaCppSLM`)
driven by the SDK's own :class:`~edge_sdk.client.EdgeClient` over gRPC; the
cloud is a ``coveil-cloud`` adapter, either one this runner starts on
loopback (:class:`LocalAdapter`: a real gRPC server over the transformers
LLM, transcripts into a directory) or a remote one given as ``HOST:PORT``
with its credentials, whose transcripts the operator makes readable in a
directory.  Each item's DecodeLeak trace is read from the cloud's transcript
of its sessions and checked against the edge's ledger
(:mod:`eval_harness.runners.audit`).

Concurrency: ``concurrency`` items at once, each through its own
:class:`EdgeClient` over its own llama.cpp instance.  A llama.cpp context
holds one sequence's KV cache, so items sharing one instance behind a lock
would re-prefill their private prompt at every switch, or wait for each
other's whole generation: separate instances are what several devices are.
The weights are memory-mapped from the same file, so the instances share
them; each adds only its context (KV cache and buffers), and the edge
threads are split between them.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import Credentials, EdgeClient, GenerationResult
from edge_sdk.models import ModelSource, resolve_model
from eval_harness.attacks.observer import RecordingClient
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.metrics import Vocabulary
from eval_harness.provenance import model_digest
from eval_harness.runners import RunMetadata
from eval_harness.runners.audit import AuditedResult, audit_generation
from eval_harness.runners.reference import ItemRunner

if TYPE_CHECKING:
    from cloud_adapter.llm import TransformersLLM

#: ``K`` a local adapter records every step's exposure set at (leakage-vs-K curves go up to 1000)
LOCAL_EXPOSURE_K = 1000


class LocalAdapter:
    """A real cloud adapter on loopback in this process: the gRPC server over ``llm``, transcripts in a directory.

    The same server ``coveil-cloud serve`` runs (:func:`cloud_adapter.inprocess.serving`,
    forwards batched by a :class:`~cloud_adapter.runners.StepBatcher`), bound to
    ``127.0.0.1`` on a free port, plaintext (loopback only) and guarded by a
    fresh random bearer token.

    Args:
        llm: the cloud model.
        transcript_dir: where each finished session's transcript is written (``<session_id>.json``).
        sessions: concurrent sessions admitted (the runner's concurrency).
        exposure_k: ``K`` of the exposure sets the transcripts record.
    """

    def __init__(self, llm: TransformersLLM, transcript_dir: Path, *, sessions: int = 2,
                 exposure_k: int = LOCAL_EXPOSURE_K) -> None:
        from cloud_adapter.engine import CloudEngine
        from cloud_adapter.limits import Limits
        from cloud_adapter.inprocess import serving
        from cloud_adapter.runners import StepBatcher

        self.llm, self.transcript_dir = llm, Path(transcript_dir)
        self._batcher = StepBatcher(llm)
        limits = Limits(max_sessions=sessions, max_sessions_per_client=sessions)
        self.engine = CloudEngine(llm, limits, self.transcript_dir, exposure_k, runner=self._batcher)
        token = secrets.token_urlsafe(24)
        self._serving = contextlib.ExitStack()
        self.address = self._serving.enter_context(serving(
            self.engine, token=token, max_workers=sessions + limits.max_unopened_streams + 8, grace_s=1.0)).address
        self.credentials = Credentials(token=token, plaintext=True)

    def close(self) -> None:
        """Stop the server (sessions still open get a second to finish) and the batcher."""
        self._serving.close()
        self._batcher.close()

    def __enter__(self) -> LocalAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeployedRunner(ItemRunner):
    """Items through the deployed stack, each result audited against the cloud's transcript.

    The :class:`~eval_harness.runners.reference.ItemRunner` loop, as the reference runner's, so
    :func:`~eval_harness.sweep.execute.run_sweep` drives either; results are
    :class:`~eval_harness.runners.audit.AuditedResult`.  Per-step mechanism statistics are not measured
    (:meth:`mechanism` is ``None``): full-fusion decisions need both models' full rows in one process.

    Args:
        cloud: a :class:`LocalAdapter`, or ``"host:port"`` of a running adapter.
        edge_model: the edge GGUF (``None``: the embedded Gemma-3 270M).
        credentials: token and TLS material for a remote ``cloud`` (a local adapter brings its own).
        transcripts: the directory holding the adapter's transcripts (``None`` with a remote adapter: the
            audit rests on the edge's ledger, and every row says so); a local adapter's own by default.
        concurrency: items in flight, each with its own llama.cpp instance and EdgeClient.
        edge_threads: llama.cpp threads over all instances (default: the cores, at most 8), split evenly.
        n_ctx: each instance's context window (private context + public prompt + answer).
        transcript_wait_s: how long to wait for an item's transcript to appear (a synced directory lags).
    """

    def __init__(
        self,
        cloud: LocalAdapter | str,
        *,
        edge_model: ModelSource | str | os.PathLike | None = None,
        credentials: Credentials | None = None,
        transcripts: Path | None = None,
        concurrency: int = 2,
        edge_threads: int | None = None,
        n_ctx: int = 4096,
        transcript_wait_s: float = 30.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self._owned_adapter: LocalAdapter | None = None
        self.local_adapter = cloud if isinstance(cloud, LocalAdapter) else None
        if isinstance(cloud, LocalAdapter):
            self.address, credentials = cloud.address, cloud.credentials
            transcripts = transcripts if transcripts is not None else cloud.transcript_dir
        else:
            self.address = cloud
            if transcripts is not None and not Path(transcripts).is_dir():
                raise ValueError(f"the transcript directory {transcripts} does not exist (--transcripts)")
        self.transcripts = Path(transcripts) if transcripts is not None else None
        self.transcript_wait_s = transcript_wait_s
        self.concurrency = concurrency
        threads = max(1, (edge_threads or min(8, os.cpu_count() or 1)) // concurrency)
        self._slms = [LlamaCppSLM(edge_model, n_ctx=n_ctx, n_threads=threads) for _ in range(concurrency)]
        self._all_clients = [RecordingClient(self.address, slm=slm, credentials=credentials or Credentials())
                             for slm in self._slms]
        self._clients: queue.SimpleQueue[EdgeClient] = queue.SimpleQueue()  # those not decoding an item now
        for client in self._all_clients:
            self._clients.put(client)

    @classmethod
    def with_local_adapter(cls, llm: TransformersLLM, transcript_dir: Path, *, concurrency: int = 2,
                           exposure_k: int = LOCAL_EXPOSURE_K, **kwargs: Any) -> DeployedRunner:
        """A runner over a :class:`LocalAdapter` of its own (stopped by :meth:`close`); ``kwargs`` as for the
        constructor."""
        adapter = LocalAdapter(llm, transcript_dir, sessions=concurrency, exposure_k=exposure_k)
        try:
            runner = cls(adapter, concurrency=concurrency, **kwargs)
        except BaseException:
            adapter.close()
            raise
        runner._owned_adapter = adapter
        return runner

    @property
    def edge_model(self) -> ModelSource:
        """The edge GGUF every instance runs."""
        return self._slms[0].source

    @property
    def policy_backend(self) -> LlamaCppSLM:
        """The edge model as a backend, for policies that build themselves from it (CusText's embeddings)."""
        return self._slms[0]

    @contextmanager
    def client(self) -> Iterator[EdgeClient]:
        """An idle client (its own llama.cpp instance, a gRPC channel to the adapter) for one item."""
        client = self._clients.get()
        try:
            yield client
        finally:
            self._clients.put(client)

    def finish(self, result: GenerationResult) -> AuditedResult:
        """The item's result with its audit against the adapter's transcript (:func:`audit_generation`)."""
        return audit_generation(result, self.transcripts, wait_s=self.transcript_wait_s)

    def close(self) -> None:
        """Close every client's gRPC channel, and stop the local adapter this runner started (if any)."""
        for client in self._all_clients:
            client.close()
        if self._owned_adapter is not None:
            self._owned_adapter.close()
            self._owned_adapter = None

    def __enter__(self) -> DeployedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



@dataclass(frozen=True)
class DeployedSpec:
    """What the deployed runner runs (registered as ``"deployed"``, :data:`eval_harness.runners.RUNNERS`).

    Attributes:
        slm: the edge model: ``"embedded"`` or a GGUF file (llama.cpp).
        llm: the cloud model of a local adapter (``cloud`` not given).
        dtype: the local adapter's dtype, by name (``"auto"``: the CPU's choice).
        concurrency: items at once, each through its own llama.cpp instance and :class:`EdgeClient`.
        cloud: ``HOST:PORT`` of a running adapter; ``None`` starts one on loopback in this process.
        token_file, tls_ca, plaintext: how to reach ``cloud`` (:meth:`Credentials.from_files`).
        transcripts: where the adapter's transcripts are (a local adapter writes them there; ``None`` with
            ``cloud``: the audit rests on the edge's ledger alone).
        transcript_wait: seconds to wait for an item's transcript before auditing it from the ledger.
    """

    slm: str = "embedded"
    llm: str = "embedded"
    dtype: str = "fp32"
    concurrency: int = 2
    cloud: str | None = None
    token_file: Path | None = None
    tls_ca: Path | None = None
    plaintext: bool = False
    transcripts: Path | None = None
    transcript_wait: float = 30.0

    def run_identity(self, protocol: DecodingProtocol, *, seed: int) -> dict[str, Any]:
        """The rows' :data:`~eval_harness.sweep.store.RUN_FIELDS` from the options and model files alone (no
        model loaded): what a results file from another run is refused by.  A remote adapter's model is not
        known before it answers: each row then records it (``audit.cloud_model``)."""
        from cloud_adapter.hf_loading import resolve_dtype
        from edge_sdk.models import resolve_model

        slm_source = resolve_model(self.slm)
        if self.cloud is None:
            llm_source = resolve_model(self.llm)
            llm_model: dict[str, Any] = {"name": llm_source.name, "sha256": model_digest(llm_source)}
            dtype = str(resolve_dtype(self.dtype, "cpu")).removeprefix("torch.")  # the local adapter's, on the CPU
        else:
            llm_model = {"name": None, "sha256": None,
                         "note": "a remote adapter's model: each row's audit.cloud_model, as the adapter reported it"}
            dtype = None
        return {"models": {"slm": {"name": slm_source.name, "sha256": model_digest(slm_source)}, "llm": llm_model},
                "dtype": dtype, "backend": "deployed", "protocol": protocol.describe(), "seed": seed}

    def build(self, protocol: DecodingProtocol, *, seed: int,
              identity: Mapping[str, Any] | None = None) -> tuple[DeployedRunner, Vocabulary, RunMetadata]:
        """The runner (over a local adapter or ``cloud``), the vocabulary the metrics read and the rows' metadata
        (``identity``: the :meth:`run_identity` a caller already has, else computed)."""
        import threading

        identity = identity if identity is not None else self.run_identity(protocol, seed=seed)
        common: dict[str, Any] = {"edge_model": resolve_model(self.slm), "concurrency": self.concurrency,
                                  "transcript_wait_s": self.transcript_wait}
        if self.cloud is None:
            runner = self._local(common)
            adapter: dict[str, Any] = {"address": runner.address, "started_by": "decodeleak (in-process, loopback)",
                                       "exposure_k": runner.local_adapter.engine.exposure_k}  # type: ignore[union-attr]
        else:
            credentials = Credentials.from_files(token_file=self.token_file, root_cert=self.tls_ca,
                                                 plaintext=self.plaintext)
            runner = DeployedRunner(self.cloud, credentials=credentials, transcripts=self.transcripts, **common)
            adapter = {"address": self.cloud, "started_by": "its operator", "tls": not self.plaintext,
                       "exposure_k": None}
        adapter["transcripts"] = str(runner.transcripts) if runner.transcripts is not None else None
        edge = runner.policy_backend
        tokenizer_lock = threading.Lock()  # result rows are built in several item threads at once

        def tokenize(text: str) -> list[int]:
            with tokenizer_lock:
                return edge.tokenize(text, add_bos=False)

        vocab = Vocabulary(tokenize, Vocabulary.from_slm(edge).piece)
        metadata = RunMetadata.of_run(identity, edge={"runtime": "llama.cpp", "instances": self.concurrency},
                                      adapter=adapter)
        return runner, vocab, metadata

    def _local(self, common: dict[str, Any]) -> DeployedRunner:
        """A runner over an adapter of its own on loopback, its cloud model in the run's dtype.

        Both halves share this machine's cores: the cloud's torch threads and the edge's llama.cpp threads
        each get their share (:func:`cloud_adapter.local.split_cores`), since oversubscribed cores make both
        spin against each other.
        """
        import torch

        from cloud_adapter.hf_loading import resolve_dtype
        from cloud_adapter.llm import TransformersLLM
        from cloud_adapter.local import split_cores

        if self.transcripts is None:
            raise ValueError("a local adapter writes its transcripts somewhere: give transcripts")
        edge_threads, cloud_threads = split_cores()
        torch.set_num_threads(cloud_threads)
        llm = TransformersLLM(resolve_model(self.llm), dtype=resolve_dtype(self.dtype, "cpu"))
        return DeployedRunner.with_local_adapter(llm, self.transcripts, edge_threads=edge_threads, **common)
