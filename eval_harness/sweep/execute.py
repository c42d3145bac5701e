"""Running a sweep: settings x items through a runner (reference or deployed), one JSONL row per finished pair.

Rows are written as they finish (:class:`~eval_harness.sweep.store.ResultStore`),
pairs already in the store are skipped, and a shard takes only its share of
the pairs.  Each row carries what makes it reproducible: the models and
their file digests, the dtype, the batching, the backend, the policy with
every parameter (defaults filled in, with what its epsilon means), the
protocol, the seed policy, the package version and a digest of its source
code; and what makes it recomputable without a model (``decodeleak
recompute``): the exposure trace at the recorded K
(:mod:`~eval_harness.sweep.exposure_codec`), digests of the dataset and of
the item, and the tokenizer's fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_sdk.client import GenerationResult
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.privacy.meter import ExposureTrace
from edge_sdk.policies import Policy, make_policy, policy_class
from eval_harness.attacks.inversion import CloudObservation, InversionAttack, inversion_cell
from eval_harness.attacks.observer import observer_scores
from eval_harness.datasets import DecodeLeakItem
from eval_harness.metrics import Vocabulary, evidence_counts, evidence_recall
from eval_harness.provenance import item_digest, items_digest, model_digest, tokenizer_fingerprint
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners import RunMetadata
from eval_harness.runners.audit import AuditedResult
from eval_harness.runners.reference import ItemRun, ReferenceRunner
from eval_harness.sweep.exposure_codec import encode_trace
from eval_harness.sweep.grid import Setting, pending_pairs, row_key
from eval_harness.sweep.store import RowStore

#: the cutoffs K each row's DecodeLeak metrics are given at (the leakage-vs-K curves; the sweep records K = 1000)
METRIC_KS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def policy_parameters(policy: Policy) -> dict[str, Any]:
    """Every parameter the policy ran with, defaults filled in (CoVeil's ``k = 50`` too): its dataclass fields
    that its constructor takes and that are plain JSON values (CusText's embedding neighbours are built from the
    edge model, which the row's digests name)."""
    values = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    return {name: value for name, value in values.items() if value is None or isinstance(value, (bool, int, float, str))}


def reference_vocabulary(tokenizer: Any) -> Vocabulary:
    """The vocabulary the metrics read for a transformers tokenizer: its ids without BOS, and its pieces.

    The sweep and ``decodeleak recompute`` both build it here, so a recomputed row reads the same vocabulary."""
    from edge_sdk.backends.pieces import piece_reader

    return Vocabulary(lambda text: list(tokenizer(text, add_special_tokens=False).input_ids), piece_reader(tokenizer))


def item_rng(seed: int, setting: Setting, item_id: str) -> np.random.Generator:
    words = [seed, int(setting.key, 16), int(hashlib.sha256(item_id.encode()).hexdigest()[:15], 16)]
    return np.random.default_rng(np.random.SeedSequence(words))


def result_row(
    setting: Setting,
    item: DecodeLeakItem,
    result: GenerationResult,
    *,
    protocol: DecodingProtocol,
    vocab: Vocabulary,
    metadata: Mapping[str, Any],
    mechanism: Mapping[str, Any] | None = None,
    inversion: Mapping[str, Any] | None = None,
    policy: Policy | None = None,
    dataset_sha256: str | None = None,
    observer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One JSONL row: the setting, the item, accuracy, DecodeLeak metrics in both rule sets at every
    :data:`METRIC_KS` cutoff the trace recorded, the per-step ``mechanism`` statistics
    (:meth:`ReferenceRunner.mechanism`; ``None`` when not measured), the inversion attack's result (``None``
    when it was not run), the observer attacks' scores and recordings (:func:`observer_field`; ``None`` when not
    run), and the metadata.  With them what ``decodeleak recompute`` re-scores the metrics
    from: ``exposure`` (the trace the metrics read, :func:`~eval_harness.sweep.exposure_codec.encode_trace`),
    ``dataset`` (``dataset_sha256``: :func:`items_digest` of the task's items; ``item_sha256``), and
    ``policy_params`` (``policy``'s :func:`policy_parameters`).

    The metrics read the edge's ledger, or for an audited result of the deployed stack the cloud's own
    transcript (the row's ``audit`` says which, and whether the two agree; where they do not, the
    ledger's metrics are kept beside as ``ledger_metrics``).
    """
    audited = isinstance(result, AuditedResult)
    trace = result.exposure_trace() if audited else result.ledger.exposure_trace()
    metrics = _metrics(item, trace, vocab)
    predicted = protocol.predicted(item, result.text)
    extra: dict[str, Any] = {}
    if audited:
        extra["audit"] = result.audit
        if result.audit.get("ledger_agrees") is False:
            extra["ledger_metrics"] = _metrics(item, result.ledger.exposure_trace(), vocab)
    return {
        "key": row_key(setting, item.item_id),
        "setting": setting.key,
        "task": setting.task,
        "item": item.item_id,
        "mode": setting.mode,
        "policy": setting.policy,
        "params": dict(setting.params),
        "policy_params": policy_parameters(policy) if policy is not None else None,
        "epsilon_unit": policy_class(setting.policy).epsilon_units.get(setting.mode, "none"),
        "alpha": setting.alpha,
        "predicted": predicted,
        "answer": item.answer,
        "correct": predicted == item.answer,
        "tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "text": result.text,
        "token_ids": list(result.token_ids),  # the generation exactly (text does not always re-tokenise to it)
        "metrics": metrics,
        "exposure": encode_trace(trace),
        "dataset": {"sha256": dataset_sha256, "item_sha256": item_digest(item)},
        "evidence": evidence_counts(item.evidence_spans, vocab, public_query=item.public_query),
        "uploaded_values": result.ledger.values_uploaded,
        "full_requests": result.ledger.full_requests,
        "bytes_up": result.ledger.bytes_up,
        "bytes_down": result.ledger.bytes_down,
        "privacy": result.ledger.privacy(),  # the epsilon ledger: spent, delta, accountant, events, guarantee
        **extra,
        "mechanism": dict(mechanism) if mechanism is not None else None,
        "inversion": None if inversion is None else dict(inversion),
        "observer": None if observer is None else dict(observer),
        **metadata,
    }


def _metrics(item: DecodeLeakItem, trace: ExposureTrace, vocab: Vocabulary) -> dict[str, float]:
    """DecodeLeak's metrics of one item at every ``METRIC_KS`` cutoff the trace recorded, by both rule sets."""
    ks = [k for k in METRIC_KS if k <= trace.k]
    metrics: dict[str, float] = {}
    for compat in ("paper", "release"):
        values = evidence_recall(item.evidence_spans, trace, ks, vocab, public_query=item.public_query, compat=compat)
        metrics.update(values if compat == "paper" else {f"{key}:release": v for key, v in values.items()})
    return metrics


class Runner(Protocol):
    """What drives a sweep: the reference runner or the deployed one."""

    concurrency: int  # items decoded at once
    @property
    def policy_backend(self) -> Any: ...

    def run(self, runs: Sequence[ItemRun], *, mode: str, alpha: float, max_new_tokens: int,
            on_result: Callable[[ItemRun, GenerationResult], None] | None = None,
            exposure_k: int = DecodeSettings.exposure_k) -> Sequence[GenerationResult]: ...

    def mechanism(self, item: ItemRun, result: GenerationResult, *, mode: str,
                  alpha: float) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class ReferenceSpec:
    """What the reference runner loads: enough to build it again in another process or on another machine
    (registered as ``"reference"``, :data:`eval_harness.runners.RUNNERS`).

    Attributes:
        slm: the edge model (``"embedded"``, a GGUF file or a transformers directory / hub name).
        llm: the cloud model (same tokenizer family as ``slm``).
        dtype: both models' dtype: ``"fp32"`` (the default: a full-precision reference), or ``"bf16"``/``"fp16"``
            asked for by name (every row records it).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (ignored with ``device_map``).
        device_map: an accelerate device map for both models, e.g. ``"auto"`` to spread them over the GPUs.
        concurrency: items decoded at once.
        forwards: how a batch runs: ``"per-sequence"`` (one forward per item), ``"padded"`` or
            ``"batch-invariant"`` (:class:`ReferenceRunner`).
    """

    slm: str = "embedded"
    llm: str = "embedded"
    dtype: str = "fp32"
    device: str = "cpu"
    device_map: str | None = None
    concurrency: int = 8
    forwards: str = "per-sequence"

    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` both models load in (``"auto"`` resolved for the device), known before loading."""
        from cloud_adapter.hf_loading import dtype_device, resolve_dtype

        return resolve_dtype(self.dtype, dtype_device(self.device, self.device_map))

    def run_identity(self, protocol: DecodingProtocol, *, seed: int) -> dict[str, Any]:
        """The rows' :data:`~eval_harness.sweep.store.RUN_FIELDS` of this run, from the model files alone (no
        model is loaded), so a results file of another run is refused before anything loads."""
        from edge_sdk.models import resolve_model

        slm_source, llm_source = resolve_model(self.slm), resolve_model(self.llm)
        return {
            "models": {
                "slm": {"name": slm_source.name, "sha256": model_digest(slm_source)},
                "llm": {"name": llm_source.name, "sha256": model_digest(llm_source)},
            },
            "dtype": str(self.torch_dtype()).removeprefix("torch."),
            "backend": "reference (transformers, both models)",
            "protocol": protocol.describe(),
            "seed": seed,
        }

    def build(self, protocol: DecodingProtocol, *, seed: int,
              identity: Mapping[str, Any] | None = None) -> tuple[ReferenceRunner, Vocabulary, RunMetadata]:
        """Load both models: the runner, the vocabulary the metrics read, and the metadata every row carries
        (``identity``, the :meth:`run_identity` a caller already has, else computed, and where the models run)."""
        import torch

        from cloud_adapter.llm import TransformersLLM
        from edge_sdk.models import resolve_model

        if self.dtype == "auto":
            raise ValueError("the reference runner takes its dtype by name: fp32 (a full-precision reference), or "
                             "bf16/fp16 asked for explicitly")
        identity = identity if identity is not None else self.run_identity(protocol, seed=seed)
        dtype = self.torch_dtype()
        slm = TransformersLLM(resolve_model(self.slm), dtype=dtype, device=self.device, device_map=self.device_map)
        llm = TransformersLLM(resolve_model(self.llm), dtype=dtype, device=self.device, device_map=self.device_map)
        vocab = reference_vocabulary(slm.tokenizer)
        runner = ReferenceRunner(slm, llm, concurrency=self.concurrency, forwards=self.forwards)
        dtype_name = str(llm.dtype).removeprefix("torch.")
        metadata = RunMetadata.of_run(
            identity,
            device=f"device_map={self.device_map}" if self.device_map else str(llm.device),
            batching={**runner.batching, "dtype": dtype_name, "torch_threads": torch.get_num_threads()},
            vocabulary={"model": _model_spec(self.slm), "sha256": tokenizer_fingerprint(slm.tokenizer)},
        )
        return runner, vocab, metadata


def _model_spec(spec: str) -> str:
    """A model option as another process on this machine can resolve it: ``embedded``, or an absolute path (a
    hub name as it is)."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if spec != "embedded" and path.exists() else spec


@dataclass
class SweepOutcome:
    """What one sweep invocation did."""

    pending: int  # pairs this shard had left when it started
    written: int  # rows written now
    skipped: int  # pairs already in the store


def cloud_observation(run: ItemRun, result: GenerationResult, k: int) -> CloudObservation:
    """What the cloud observed of one item: the public prompt it was sent and the exposure sequence, cut to
    the top ``k`` the attack is defined over (the sweep records more for the metrics' leakage-vs-K curves).

    The exposure is the trace the row's metrics score: the cloud's own transcript for an audited deployment,
    else the edge ledger's record (equal to the transcript, ``tests/edge_sdk/test_edge_sdk.py``).  Nothing private goes
    in: the attack's input is built here only.
    """
    trace = result.exposure_trace() if isinstance(result, AuditedResult) else result.ledger.exposure_trace()
    return CloudObservation(run.public_prompt, trace.truncated(min(k, trace.k)))


def contrast_item(task_items: Sequence[DecodeLeakItem], item_id: str) -> DecodeLeakItem | None:
    """The item whose private context the observer attacks set against ``item_id``'s: the next item of the task
    (the first after the last), ``None`` in a task of one item.  Its context goes with ``item_id``'s public
    question, so the two generations differ in their private context only."""
    ids = [item.item_id for item in task_items]
    if len(ids) < 2:
        return None
    return task_items[(ids.index(item_id) + 1) % len(ids)]


def observer_field(own: ItemRun, contrast: ItemRun, contrast_id: str) -> dict[str, Any]:
    """A row's ``observer`` field: the observer attacks' scores of the item's generation against the same
    question with ``contrast_id``'s private context (:func:`~eval_harness.attacks.observer.observer_scores`;
    an AUC without gaps to compare is ``None``), and both generations' recordings
    (:meth:`~eval_harness.attacks.observer.RecordingChannel.record`, one per session), so the scores can be
    computed again from the row."""
    assert own.wire is not None and contrast.wire is not None, "both generations are recorded"
    scores = observer_scores(own.wire, contrast.wire)
    return {**{name: None if np.isnan(value) else value for name, value in scores.items()},
            "contrast": contrast_id, "wire": [channel.record() for channel in own.wire],
            "contrast_wire": [channel.record() for channel in contrast.wire]}


def _with_contrasts(contrasts: Mapping[str, ItemRun],
                    on_own: Callable[[ItemRun, GenerationResult], None]) -> Callable[[ItemRun, GenerationResult], None]:
    """An ``on_result`` for items and their contrast generations: ``on_own(run, result)`` for each item's own
    generation once its contrast (if it has one) has finished too; a contrast's result is not kept."""
    lock = threading.Lock()
    first_done: dict[str, tuple[ItemRun, GenerationResult] | None] = {}

    def on_result(run: ItemRun, result: GenerationResult) -> None:
        contrast = contrasts.get(run.item_id)
        if contrast is None:
            on_own(run, result)
            return
        finished = None if run is contrast else (run, result)
        with lock:
            if run.item_id not in first_done:
                first_done[run.item_id] = finished
                return
            earlier = first_done.pop(run.item_id)
        own = finished if finished is not None else earlier
        assert own is not None, "an item's own generation and its contrast finish once each"
        on_own(*own)

    return on_result


def run_sweep(
    settings: Sequence[Setting],
    items: Mapping[str, Sequence[DecodeLeakItem]],
    runner: Runner,
    store: RowStore,
    *,
    protocol: DecodingProtocol,
    vocab: Vocabulary,
    metadata: Mapping[str, Any],
    seed: int = 0,
    shard_of: tuple[int, int] = (0, 1),
    units: Sequence[tuple[Setting, str]] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    inversion: InversionAttack | None = None,
    dataset_sha256: Mapping[str, str] | None = None,
    observer: bool = False,
) -> SweepOutcome:
    """Every (setting, item) of this shard not yet in ``store``, setting by setting, items of a setting at once.

    ``dataset_sha256``: each task's :func:`items_digest` over all its items, where ``items`` holds only some of
    them (a Ray task is sent only its shard's items); default: the digest of ``items``.

    ``units`` are the (setting, item id) pairs to consider, in order (default:
    :func:`~eval_harness.sweep.grid.sweep_units` of ``settings``); ``shard_of`` then keeps its share.

    With an ``inversion`` attacker, a setting's items are decoded in waves of ``4 x max(concurrency,
    attacker batch)``; once a wave is decoded the attacker reconstructs its items (in its batches) and each
    row is written as soon as it is scored.  An interrupted wave leaves its unwritten items to the re-run.

    With ``observer``, each item is decoded a second time with another item's private context
    (:func:`contrast_item`) under the same setting and question, both generations recorded as an on-path
    observer under TLS and the cloud see them (message sizes and times: the runner's clients are
    :class:`~eval_harness.attacks.observer.RecordingClient`), and the row's ``observer`` field holds the
    observer attacks' scores (:func:`observer_field`).  The recording sessions behave as deployed over a network
    (their public clock on), so decoding takes longer; the row's other fields are as without it.  Sizes are the
    wire's with any runner; times are a deployment's with the deployed runner only (the reference runner's
    lockstep batches make each item wait for the others, up to seconds a step, and the two generations of an item
    in one batch then step alike).
    """
    by_id = {task: {item.item_id: item for item in task_items} for task, task_items in items.items()}
    if dataset_sha256 is None:
        dataset_sha256 = {task: items_digest(task_items) for task, task_items in items.items()}
    pending, skipped = pending_pairs(settings, items, store, shard_of, units)
    lock = threading.Lock()
    written = 0
    grouped: dict[str, tuple[Setting, list[str]]] = {}
    for s, item_id in pending:  # in grid order, each setting once
        grouped.setdefault(s.key, (s, []))[1].append(item_id)

    def write(row: dict[str, Any]) -> None:
        nonlocal written
        with lock:
            store.append(row)
            written += 1
        if on_row is not None:
            on_row(row)

    exposure_k = max(max(METRIC_KS), inversion.k if inversion is not None else 0)
    for setting, item_ids in grouped.values():
        runs: list[ItemRun] = []  # each item's run, followed by its contrast run where the observer is on
        contrasts: dict[str, ItemRun] = {}
        contrast_ids: dict[str, str] = {}
        # stateless: shared; calibrated for the protocol's length as the decoder will (DP-Fusion's and
        # InvisibleInk's max_new_tokens), so each row's policy_params are the parameters the run used
        policy = make_policy(setting.policy, backend=runner.policy_backend,
                             **setting.params).for_generation(protocol.max_new_tokens)
        for item_id in item_ids:
            item = by_id[setting.task][item_id]
            other = contrast_item(items[setting.task], item_id) if observer else None
            runs.append(ItemRun.of(protocol, item, policy, rng=item_rng(seed, setting, item_id),
                                   wire=None if other is None else []))
            if other is not None:
                contrasts[item_id] = ItemRun.of(protocol, item, policy, private_context=other.private_context,
                                                rng=item_rng(seed, setting, f"{item_id}/contrast"), wire=[])
                contrast_ids[item_id] = other.item_id
                runs.append(contrasts[item_id])

        def row_of(run: ItemRun, result: GenerationResult, setting: Setting = setting,
                   scored: Mapping[str, Any] | None = None, contrasts: Mapping[str, ItemRun] = contrasts,
                   contrast_ids: Mapping[str, str] = contrast_ids) -> dict[str, Any]:
            mechanism = runner.mechanism(run, result, mode=setting.mode, alpha=setting.alpha)
            contrast = contrasts.get(run.item_id)
            observed = None if contrast is None else observer_field(run, contrast, contrast_ids[run.item_id])
            return result_row(setting, by_id[setting.task][run.item_id], result, protocol=protocol, vocab=vocab,
                              metadata=metadata, mechanism=mechanism, inversion=scored, policy=run.policy,
                              dataset_sha256=dataset_sha256[setting.task], observer=observed)

        decode = dict(mode=setting.mode, alpha=setting.alpha, max_new_tokens=protocol.max_new_tokens,
                      exposure_k=exposure_k)
        if inversion is None:
            runner.run(runs, on_result=_with_contrasts(contrasts, lambda run, result: write(row_of(run, result))),
                       **decode)
            continue
        # a wave holds whole items (an item's contrast right after it)
        wave = 4 * max(runner.concurrency, getattr(inversion, "batch_size", 1)) * (2 if contrasts else 1)
        for start in range(0, len(runs), wave):
            decoded: list[tuple[ItemRun, GenerationResult]] = []
            runner.run(runs[start:start + wave],  # run() returns before the next wave: the closure is used at once
                       on_result=_with_contrasts(contrasts, lambda run, result: decoded.append((run, result))),  # noqa: B023
                       **decode)
            observations = [cloud_observation(run, result, inversion.k) for run, result in decoded]
            for index, reconstruction in inversion.reconstruct_each(observations):
                run, result = decoded[index]
                truth = by_id[setting.task][run.item_id].private_context
                write(row_of(run, result, scored=inversion_cell(inversion, reconstruction, truth)))
    return SweepOutcome(pending=len(pending), written=written, skipped=skipped)
