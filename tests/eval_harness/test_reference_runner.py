"""The reference runner: many items at once through both models' batchers give what one at a time gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_adapter.llm import TransformersLLM
from edge_sdk.policies import CoVeil, DPLogit, Undefended
from eval_harness.runners.reference import ItemRun, ReferenceRunner

from tests.support.tiny_models import CORPUS, tiny_pair


@pytest.fixture(scope="module")
def pair() -> tuple[TransformersLLM, TransformersLLM]:
    return tiny_pair()


def items(policy_of) -> list[ItemRun]:
    # ragged prompts and contexts: padding must not change anyone's tokens
    return [ItemRun(f"item-{i}", CORPUS[i % len(CORPUS)][: 20 + 7 * i], " ".join(CORPUS[: 1 + i % 3]), policy_of(i),
                    rng=np.random.default_rng(i)) for i in range(6)]


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_batch_invariant_forward_gives_each_item_the_row_it_gets_alone() -> None:
    from eval_harness.runners.batch_invariant import PackedOutputLinear, TiledLinear, greedy_rows, make_batch_invariant

    _, llm = tiny_pair()
    prompts = [llm.tokenize(CORPUS[i % len(CORPUS)])[: 5 + 4 * i] for i in range(8)]  # ragged: padded batches
    plain_alone, plain_together = (greedy_rows(llm, prompts, 6, together=t) for t in (False, True))
    # the plain padded forward rounds rows by their batch (the test can tell), though it keeps the tokens here
    assert (plain_alone != plain_together).any()
    make_batch_invariant(llm.model)
    assert isinstance(llm.model.lm_head, PackedOutputLinear)
    assert all(isinstance(m, (TiledLinear, PackedOutputLinear)) for m in llm.model.modules()
               if isinstance(m, torch.nn.Linear))
    alone, together = (greedy_rows(llm, prompts, 6, together=t) for t in (False, True))
    assert np.array_equal(alone, together)  # every bit of every row of 8 items x 6 steps
    # a left-padded prefill of all eight prompts (and a one-token prompt, one position like a decode step) gives
    # each the row of its prefill alone: a prefill's products run over each sequence's own rows, alone or padded
    prefilled = [seq.next_logits for seq in llm.open_many([*prompts, prompts[0][:1]])]
    assert all(np.array_equal(row, llm.open(prompt).next_logits)
               for row, prompt in zip(prefilled, [*prompts, prompts[0][:1]]))
    assert np.abs(alone - plain_alone).max() < 1e-4  # the same model: only the rounding moved
    # a prefill reads each sequence's rows off its left padding: a right-padded mask is refused, not misread
    with pytest.raises(ValueError, match="left padding only"):
        llm.model(input_ids=torch.tensor([prompts[1], prompts[1]]),
                  attention_mask=torch.tensor([[1] * len(prompts[1]), [1] * (len(prompts[1]) - 2) + [0, 0]]))


def test_the_runner_decodes_batch_invariant_batches_as_alone() -> None:
    slm, llm = tiny_pair(seeds=(43, 44))  # its own pair: the runner turns both models' kernels
    def policy_of(i):
        return (Undefended(), CoVeil(lam=0.5), DPLogit(epsilon=4.0))[i % 3]

    runs = {}
    for concurrency in (1, 6):
        with ReferenceRunner(slm, llm, concurrency=concurrency, max_wait_ms=10_000,
                             forwards="batch-invariant") as runner:
            results = runner.run(items(policy_of), mode="cloud", alpha=0.3, max_new_tokens=8)
            runs[concurrency] = ([r.token_ids for r in results], [r.ledger.exposure_trace() for r in results],
                                 runner.batch_sizes, runner.batching)
    assert runs[6][0] == runs[1][0] and runs[6][1] == runs[1][1]  # tokens and every rank of every trace
    assert max(runs[6][2][1]) == 6  # the cloud model stepped all six items in one forward
    assert runs[6][3]["forwards"] == "batch-invariant" and runs[6][3]["batch_invariant"] is True
