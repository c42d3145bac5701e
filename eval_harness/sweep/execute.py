"""Running a sweep: settings x items through the reference runner, one JSONL row per finished pair.

Rows are written as they finish (:class:`~eval_harness.sweep.store.ResultStore`),
pairs already in the store are skipped, and a shard takes only its share of
the pairs.  Each row carries what makes it reproducible: the models and
their file digests, the dtype, the backend, the policy and its parameters
(with what its epsilon means), the protocol, the seed policy and the
package version.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.client import GenerationResult
from edge_sdk.policies import make_policy, policy_class
from eval_harness.datasets import DecodeLeakItem
from eval_harness.metrics import Vocabulary, evidence_counts, evidence_recall
from eval_harness.protocol import DecodingProtocol
from eval_harness.runners.reference import ItemRun, ItemRunner
from eval_harness.sweep.grid import Setting, row_key, shard
from eval_harness.sweep.store import ResultStore

#: the cutoffs K each row's DecodeLeak metrics are given at
METRIC_KS = (10, 50, 100)
SEED_POLICY = ("randomised policies draw from numpy's default_rng(SeedSequence([seed, setting key, item id])): "
               "reproducible in-process audits; the SDK itself seeds from OS entropy")


def file_digest(path: str | Path | None) -> str | None:
    """sha256 of a model file (``None`` when the model has no single file)."""
    if path is None:
        return None
    digest = hashlib.sha256()
    with Path(path).open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_version() -> str:
    try:
        return version("coveil")
    except PackageNotFoundError:  # pragma: no cover - only when run from a bare checkout
        return "unknown"


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
) -> dict[str, Any]:
    """One JSONL row: the setting, the item, accuracy, DecodeLeak metrics in both rule sets, and the metadata."""
    trace = result.ledger.exposure_trace()
    ks = [k for k in METRIC_KS if k <= trace.k]
    metrics: dict[str, float] = {}
    for compat in ("paper", "release"):
        values = evidence_recall(item.evidence_spans, trace, ks, vocab, public_query=item.public_query, compat=compat)
        metrics.update(values if compat == "paper" else {f"{key}:release": v for key, v in values.items()})
    predicted = protocol.predicted(item, result.text)
    return {
        "key": row_key(setting, item.item_id),
        "setting": setting.key,
        "task": setting.task,
        "item": item.item_id,
        "mode": setting.mode,
        "policy": setting.policy,
        "params": dict(setting.params),
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
        "evidence": evidence_counts(item.evidence_spans, vocab, public_query=item.public_query),
        "uploaded_values": result.ledger.values_uploaded,
        "full_requests": result.ledger.full_requests,
        "bytes_up": result.ledger.bytes_up,
        "bytes_down": result.ledger.bytes_down,
        **metadata,
    }


@dataclass
class SweepOutcome:
    """What one sweep invocation did."""

    pending: int  # pairs this shard had left when it started
    written: int  # rows written now
    skipped: int  # pairs already in the store


def run_sweep(
    settings: Sequence[Setting],
    items: Mapping[str, Sequence[DecodeLeakItem]],
    runner: ItemRunner,
    store: ResultStore,
    *,
    protocol: DecodingProtocol,
    vocab: Vocabulary,
    metadata: Mapping[str, Any],
    seed: int = 0,
    shard_of: tuple[int, int] = (0, 1),
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> SweepOutcome:
    """Every (setting, item) of this shard not yet in ``store``, setting by setting, items of a setting at once."""
    by_id = {task: {item.item_id: item for item in task_items} for task, task_items in items.items()}
    units = [(s, item.item_id) for s in settings for item in items[s.task]]
    mine = list(shard(units, *shard_of))
    pending = [(s, i) for s, i in mine if row_key(s, i) not in store]
    lock = threading.Lock()
    written = 0
    grouped: dict[str, tuple[Setting, list[str]]] = {}
    for s, item_id in pending:  # in grid order, each setting once
        grouped.setdefault(s.key, (s, []))[1].append(item_id)
    for setting, item_ids in grouped.values():
        runs = []
        policy = make_policy(setting.policy, backend=runner.policy_backend, **setting.params)  # stateless: shared
        for item_id in item_ids:
            item = by_id[setting.task][item_id]
            runs.append(ItemRun(item_id, protocol.public_prompt(item), item.private_context, policy,
                                rng=item_rng(seed, setting, item_id), stopping=protocol.stopping(item)))

        def finished(run: ItemRun, result: GenerationResult, setting: Setting = setting) -> None:
            nonlocal written
            row = result_row(setting, by_id[setting.task][run.item_id], result, protocol=protocol, vocab=vocab,
                             metadata=metadata)
            with lock:
                store.append(row)
                written += 1
            if on_row is not None:
                on_row(row)

        runner.run(runs, mode=setting.mode, alpha=setting.alpha, max_new_tokens=protocol.max_new_tokens,
                   on_result=finished, exposure_k=max(METRIC_KS))
    return SweepOutcome(pending=len(pending), written=written, skipped=len(mine) - len(pending))

