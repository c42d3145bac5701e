"""The slot engine over two ranks (tensor parallel, gloo on the CPU): rank 0 serves, rank 1 replays its forwards.

Each rank loads a saved tiny Qwen2 with transformers' ``tp_plan="auto"`` (half of every layer's heads and MLP
columns) and holds half of the KV heads in its slot cache.  The rows rank 0 reads through joins, a draft rolled
back and a session leaving are those of one process holding the whole model: the same greedy tokens, logits
within 1e-5 (a row-parallel matmul sums its halves after an all-reduce, so the last bits may differ).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud_adapter.backends.rows import RowSpec
from cloud_adapter.backends.slots import SlotLLM
from cloud_adapter.llm import TransformersLLM
from edge_sdk.models import ModelSource
from tests.support.tiny_models import bpe_tokenizer, random_qwen

PROMPTS = [[5, 9, 13, 2, 40, 41, 7], [3, 4], [60, 61, 62, 63, 64]]


def schedule(slots: SlotLLM) -> list[np.ndarray]:
    """Greedy steps through joins, a three-token draft rolled back and a session leaving; every row read."""
    rows: list[np.ndarray] = []
    seqs = [slots.open(PROMPTS[0], RowSpec(top_n=4)), slots.open(PROMPTS[1], RowSpec(top_n=4))]
    rows += [s.next_row.logits().copy() for s in seqs]
    for step in range(4):
        if step == 2:
            seqs.append(slots.open(PROMPTS[2], RowSpec(top_n=4)))
            rows.append(seqs[-1].next_row.logits().copy())
        slots.step([(s, int(s.next_row.ids[0])) for s in seqs])
        rows += [s.next_row.logits().copy() for s in seqs]
    kept = len(seqs[1].ids)
    for token in (11, 12, 13):
        slots.step([(seqs[1], token)])
    slots.truncate(seqs[1], kept)
    slots.release(seqs[0])
    slots.step([(s, int(17)) for s in seqs[1:]])
    rows += [s.next_row.logits().copy() for s in seqs[1:]]
    return rows


def _rank(rank: int, world: int, port: int, model_dir: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        llm = TransformersLLM(ModelSource(name="tiny-tp", hf_name_or_dir=model_dir), dtype="fp32", tp_plan="auto")
        slots = SlotLLM(llm, max_slots=3, max_len=48)
        if rank == 0:
            try:
                results.put(("rows", slots.kv_heads, schedule(slots)))
            finally:
                slots.stop_followers()
        else:
            slots.follow()
            results.put(("follower", slots.kv_heads, None))
    except BaseException as exc:  # reported to the test, which fails with it
        results.put(("error", rank, repr(exc)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = bpe_tokenizer()
    path = tmp_path_factory.mktemp("tiny-tp")
    random_qwen(tokenizer, output_rows=448, seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_two_ranks_read_the_rows_of_one_process(model_dir: Path) -> None:
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    ranks = [context.Process(target=_rank, args=(rank, 2, port, str(model_dir), results)) for rank in range(2)]
    for process in ranks:
        process.start()
    outcomes = [results.get(timeout=300) for _ in ranks]
    for process in ranks:
        process.join(timeout=60)
    errors = [o for o in outcomes if o[0] == "error"]
    assert not errors, errors
    (_, kv_heads, sharded), = [o for o in outcomes if o[0] == "rows"]
    assert kv_heads == 1 and [o[1] for o in outcomes if o[0] == "follower"] == [1]  # 2 KV heads over 2 ranks

    whole = TransformersLLM(ModelSource(name="tiny-one", hf_name_or_dir=str(model_dir)), dtype="fp32")
    alone = schedule(SlotLLM(whole, max_slots=3, max_len=48))
    assert len(alone) == len(sharded)
    for mine, theirs in zip(sharded, alone):
        assert np.abs(mine - theirs).max() < 1e-5
        assert int(np.argmax(mine)) == int(np.argmax(theirs))
