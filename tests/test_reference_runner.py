"""The reference runner: many items at once through both models' batchers give what one at a time gives."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_adapter.llm import TransformersLLM
from edge_sdk.policies import CoVeil, DPLogit, Undefended
from eval_harness.runners.reference import ItemRun, ReferenceRunner

from tests.tiny_models import CORPUS, tiny_pair


@pytest.fixture(scope="module")
def pair() -> tuple[TransformersLLM, TransformersLLM]:
    return tiny_pair()


def items(policy_of) -> list[ItemRun]:
    # ragged prompts and contexts: padding must not change anyone's tokens
    return [ItemRun(f"item-{i}", CORPUS[i % len(CORPUS)][: 20 + 7 * i], " ".join(CORPUS[: 1 + i % 3]), policy_of(i),
                    rng=np.random.default_rng(i)) for i in range(6)]


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_batched_items_decode_as_when_alone(pair, mode: str) -> None:
    slm, llm = pair
    def policy_of(i):
        return (Undefended(), CoVeil(lam=0.5), DPLogit(epsilon=4.0) if mode == "cloud" else CoVeil(lam=2.0))[i % 3]

    with ReferenceRunner(slm, llm, concurrency=1) as alone:
        expected = [r.token_ids for r in alone.run(items(policy_of), mode=mode, alpha=0.3, max_new_tokens=8)]
    finished = []
    with ReferenceRunner(slm, llm, concurrency=6, max_wait_ms=10_000) as together:
        results = together.run(items(policy_of), mode=mode, alpha=0.3, max_new_tokens=8,
                               on_result=lambda item, result: finished.append(item.item_id))
        slm_batches, llm_batches = together.batch_sizes
    assert [r.token_ids for r in results] == expected
    assert sorted(finished) == sorted(f"item-{i}" for i in range(6))
    assert max(slm_batches) == max(llm_batches) == 6  # all six items stepped in one forward of each model
    assert all(len(r.ledger.entries) == len(r.token_ids) for r in results)
