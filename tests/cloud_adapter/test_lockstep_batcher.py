"""LockstepBatcher: every client waiting on a model steps in one forward; groups out of step merge."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cloud_adapter.llm import CloudSequence
from cloud_adapter.runners import LockstepBatcher, ModelLane


class LoggingModel:
    """Stands in for a model: appends ``(name, kind, batch size)`` to a log shared by every model."""

    def __init__(self, name: str, log: list[tuple[str, str, int]]) -> None:
        self.name, self.log = name, log

    def open_many(self, prompts: list[list[int]]) -> list[CloudSequence]:
        self.log.append((self.name, "prefill", len(prompts)))
        return [CloudSequence(list(p), None, np.zeros(4, np.float32)) for p in prompts]

    def step(self, batch: list[tuple[CloudSequence, int]]) -> None:
        self.log.append((self.name, "step", len(batch)))
        for seq, token in batch:
            seq.ids.append(token)


def run_clients(batcher: LockstepBatcher, plans: list[list[tuple[ModelLane, float]]]) -> list[list[int]]:
    """Each plan in a thread of its own as a registered client: prefill on every lane, then step the lanes in
    the plan's order, working ``seconds`` before each step.  Returns each client's sequences' ids."""
    lanes = batcher.lanes
    registered = threading.Barrier(len(plans))
    outcomes: list[list[int]] = [[] for _ in plans]

    def client(i: int) -> None:
        with batcher.participant():
            registered.wait()  # every client counts before anyone asks for a forward
            seqs = {id(lane): lane.prefill([1, 2, 3])[0] for lane in lanes}
            for step, (lane, seconds) in enumerate(plans[i]):
                time.sleep(seconds)
                lane.forward(seqs[id(lane)], 10 * i + step)
            outcomes[i] = [token for seq in seqs.values() for token in seq.ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_clients_that_work_for_different_times_still_step_together() -> None:
    log: list[tuple[str, str, int]] = []
    with LockstepBatcher([LoggingModel("edge", log), LoggingModel("cloud", log)], max_wait_ms=10_000) as batcher:
        edge, cloud = batcher.lanes
        # four clients alternate cloud, edge, cloud, edge, each working 0, 30, 60 or 90 ms between forwards:
        # a batch gathered by a window of arrivals would split them
        run_clients(batcher, [[(lane, 0.03 * i) for lane in (cloud, edge, cloud, edge)] for i in range(4)])
    assert log == [
        ("edge", "prefill", 4), ("cloud", "prefill", 4),  # prefills first, all four at once
        ("cloud", "step", 4), ("edge", "step", 4), ("cloud", "step", 4), ("edge", "step", 4),
    ]
    assert edge.stats.batch_sizes == {4: 2} and cloud.stats.prefill_sizes == {4: 1}


def test_two_groups_out_of_step_merge_after_one_batch() -> None:
    log: list[tuple[str, str, int]] = []
    with LockstepBatcher([LoggingModel("a", log), LoggingModel("b", log)], max_wait_ms=10_000) as batcher:
        a, b = batcher.lanes
        ids = run_clients(batcher, [[(a, 0.0), (b, 0.0)] * 3, [(b, 0.0), (a, 0.0)] * 3])
    steps = [(name, size) for name, kind, size in log if kind == "step"]
    # client 0 waits on a, client 1 on b: a tie, the first lane goes; its client then joins the other on b
    assert steps == [("a", 1), ("b", 2), ("a", 2), ("b", 2), ("a", 2), ("b", 2), ("a", 1)]
    # each client's tokens went to its own sequences, in its own order
    assert ids == [[1, 2, 3, 0, 2, 4, 1, 2, 3, 1, 3, 5], [1, 2, 3, 11, 13, 15, 1, 2, 3, 10, 12, 14]]


def test_a_client_busy_elsewhere_is_waited_for_at_most_max_wait() -> None:
    log: list[tuple[str, str, int]] = []
    with LockstepBatcher([LoggingModel("m", log)], max_wait_ms=200) as batcher:
        (lane,) = batcher.lanes
        started = time.monotonic()
        seq, _ = lane.prefill([1])  # nobody registered: served at once
        assert time.monotonic() - started < 0.15
        registered, release = threading.Event(), threading.Event()

        def busy() -> None:
            with batcher.participant():
                registered.set()
                release.wait()  # registered, but asks for nothing

        def stepper() -> None:
            with batcher.participant():
                lane.forward(seq, 7)

        threads = [threading.Thread(target=busy), threading.Thread(target=stepper)]
        threads[0].start()
        registered.wait()
        started = time.monotonic()
        threads[1].start()
        threads[1].join()
        waited = time.monotonic() - started
        release.set()
        threads[0].join()
    assert 0.2 <= waited < 2.0
    assert log == [("m", "prefill", 1), ("m", "step", 1)] and seq.ids == [1, 7]


def logits_through(batcher: LockstepBatcher, prompts: list[list[int]], steps: int) -> list[list[np.ndarray]]:
    """Each prompt as a client of ``batcher`` on its one lane, greedy for ``steps`` tokens: every row it saw."""
    (lane,) = batcher.lanes
    registered = threading.Barrier(len(prompts))
    rows: list[list[np.ndarray]] = [[] for _ in prompts]

    def client(i: int) -> None:
        with batcher.participant():
            registered.wait()
            seq, _ = lane.prefill(prompts[i])
            rows[i].append(seq.next_logits.copy())
            for _ in range(steps):
                lane.forward(seq, int(np.argmax(seq.next_logits)))
                rows[i].append(seq.next_logits.copy())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("per_sequence", [True, False])
def test_per_sequence_forwards_give_each_client_the_logits_it_gets_alone(per_sequence: bool, dtype: str) -> None:
    """A row must not depend on which items shared its batch: with per-sequence forwards every logit of a client
    stepped among others equals, bit for bit, what it gets alone, in float32 and in bf16; one padded forward of
    several rows does not (on torch's CPU kernels a batched row rounds differently, about 1e-7 in float32), which
    this checks too."""
    import torch

    from cloud_adapter.llm import TransformersLLM
    from tests.support.tiny_models import tiny_pair

    tiny, _ = tiny_pair()
    llm = TransformersLLM.from_loaded(tiny.model.to(getattr(torch, dtype)), tiny.tokenizer, "tiny")
    prompts = [[5 + i for i in range(n)] for n in (7, 12, 30, 5)]  # ragged: padding in the batched prefill
    alone = []
    for prompt in prompts:
        with LockstepBatcher([llm], per_sequence=per_sequence) as batcher:
            alone += logits_through(batcher, [prompt], steps=4)
    with LockstepBatcher([llm], max_wait_ms=10_000, per_sequence=per_sequence) as batcher:
        together = logits_through(batcher, prompts, steps=4)
        assert batcher.lanes[0].stats.batch_sizes == {4: 4}  # the four stepped together (counted as batches)
    same = all(np.array_equal(a, b) for rows_alone, rows_together in zip(alone, together)
               for a, b in zip(rows_alone, rows_together, strict=True))
    assert same == per_sequence
