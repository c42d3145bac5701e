"""The slot engine (cloud_adapter/backends/slots.py) against the transformers path it replaces on GPUs.

The oracle is ``TransformersLLM`` (transformers' own cache and attention) on a copy of the same weights, in
float32 on the CPU: rows agree to 1e-4 and greedy tokens are the same, through joins, leaves, drafts and
rollbacks, on Qwen2 (grouped KV heads), Llama and Gemma-3 (sliding-window layers, a window shorter than the
sequences).  Row summaries on the device are held to the edge's numpy rule (``top_k_ids``) on random rows
with ties and signed zeros.
"""

from __future__ import annotations

import copy
from dataclasses import replace
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_adapter.backends.rows import RowSpec, StepRow, _summarize_on_device, summarize_row, top_ids_on_device
from cloud_adapter.backends.slots import SlotLLM, check_weights_placed
from cloud_adapter.llm import CloudSequence, TransformersLLM
from cloud_adapter.runners import StepBatcher
from edge_sdk.fusion import softmax, top_k_ids
from edge_sdk.protocol.status import CloudError
from tests.support.tiny_models import END, bpe_tokenizer

TOLERANCE = 1e-4


def _tiny(kind: str, seed: int = 7) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    tokenizer = bpe_tokenizer()
    common = dict(vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  eos_token_id=tokenizer.convert_tokens_to_ids(END), bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:  # two sliding-window layers of 5 positions around a global one
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, head_dim=8, sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"],
            query_pre_attn_scalar=8,
        ))
    model = model.eval()
    reference = TransformersLLM.from_loaded(model, tokenizer, f"tiny-{kind}")
    served = TransformersLLM.from_loaded(copy.deepcopy(model), tokenizer, f"tiny-{kind}")
    return reference, served


@pytest.fixture(scope="module", params=["qwen2", "llama", "gemma3"])
def pair(request: pytest.FixtureRequest) -> tuple[TransformersLLM, SlotLLM]:
    reference, served = _tiny(request.param)
    return reference, SlotLLM(served, max_slots=4, max_len=64, prefill_chunk=7)


def _logits(llm: Any, seq: CloudSequence) -> np.ndarray:
    return seq.next_logits if seq.next_logits is not None else seq.next_row.logits()


def _close(a: np.ndarray, b: np.ndarray) -> None:
    assert np.abs(a - b).max() < TOLERANCE
    assert int(np.argmax(a)) == int(np.argmax(b))


def test_rows_match_the_transformers_path_through_joins_leaves_drafts_and_rollbacks(pair: Any) -> None:
    reference, slots = pair
    prompts = [[5, 9, 13, 2, 40, 41, 7, 8, 30, 31, 12], [3, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]]
    ref = [reference.open(p) for p in prompts]
    mine = [slots.open(p, RowSpec(top_n=8)) for p in prompts]
    for r, m in zip(ref, mine):
        _close(_logits(reference, r), _logits(slots, m))
    # greedy steps for all three, then only the first and third (the second lags), then all again
    for stepping in ([0, 1, 2], [0, 2], [0, 2], [0, 1, 2], [1], [0, 1, 2]):
        tokens = [int(np.argmax(_logits(reference, ref[i]))) for i in stepping]
        assert tokens == [int(m) for m in (mine[i].next_row.ids[0] for i in stepping)]
        reference.step([(ref[i], t) for i, t in zip(stepping, tokens)])
        slots.step([(mine[i], t) for i, t in zip(stepping, tokens)])
        for i in stepping:
            _close(_logits(reference, ref[i]), _logits(slots, mine[i]))
    # a 3-token draft on the second sequence, rolled back: the next row is that of a sequence that never held it
    kept = len(mine[1].ids)
    for token in (11, 12, 13):
        slots.step([(mine[1], token)])
    slots.truncate(mine[1], kept)
    token = int(np.argmax(_logits(reference, ref[1])))
    reference.step([(ref[1], token)])
    slots.step([(mine[1], token), (mine[2], 17)])
    _close(_logits(reference, ref[1]), _logits(slots, mine[1]))
    # a session leaves; a new one takes its slot and sees none of the old KV
    slots.release(mine[0])
    fresh_ref, fresh = reference.open([20, 21, 22]), slots.open([20, 21, 22], RowSpec(top_n=8))
    assert fresh.cache.index == 0
    _close(_logits(reference, fresh_ref), _logits(slots, fresh))
    for seq in (mine[1], mine[2], fresh):
        slots.release(seq)


def test_a_step_of_few_sessions_in_a_wide_range_reads_their_kv_by_index(pair: Any) -> None:
    """Slots 0 and 3 step while 1 and 2 stay: the range would be half riders, so the rows are read by index."""
    reference, slots = pair
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16]]
    mine = [slots.open(p, RowSpec(top_n=4)) for p in prompts]
    ref = [reference.open(p) for p in prompts]
    reference.step([(ref[0], 3), (ref[3], 4)])
    slots.step([(mine[0], 3), (mine[3], 4)])
    for i in (0, 3):
        _close(_logits(reference, ref[i]), _logits(slots, mine[i]))
    reference.step([(r, 5) for r in ref])
    slots.step([(m, 5) for m in mine])
    for r, m in zip(ref, mine):
        _close(_logits(reference, r), _logits(slots, m))
    for seq in mine:
        slots.release(seq)


def test_admission_by_slots_and_length_names_the_numbers() -> None:
    _, served = _tiny("qwen2")
    slots = SlotLLM(served, max_slots=2, max_len=16)
    held = [slots.open([1, 2, 3]), slots.open([4, 5])]
    with pytest.raises(CloudError) as full:
        slots.open([6])
    assert full.value.code == "RESOURCE_EXHAUSTED" and "all 2 KV slots" in str(full.value)
    slots.release(held[0])
    with pytest.raises(CloudError) as long:
        slots.open(list(range(1, 17)))
    assert long.value.code == "INVALID_ARGUMENT" and "16 tokens" in str(long.value)
    assert slots.free_slots == 1  # the refused prompt took no slot
    reopened = slots.open([7, 8])
    assert reopened.cache.index == 0
    for _ in range(16 - 2):  # a slot holds 16 tokens: 2 of the prompt, 14 generated
        slots.step([(reopened, 9)])
    with pytest.raises(CloudError, match="filled its slot"):
        slots.step([(reopened, 9)])


def test_the_slot_count_follows_the_kv_budget() -> None:
    _, served = _tiny("qwen2")
    # 3 layers x 2 KV heads x 8 dims x 2 (K and V) x 4 bytes = 384 B a token; 64 tokens a slot = 24,576 B
    assert SlotLLM(served, max_len=64, kv_bytes=5 * 24_576 + 100).slots == 5
    with pytest.raises(ValueError, match="no room for one slot"):
        SlotLLM(copy.deepcopy(served), max_len=64, kv_bytes=1000)


def test_a_weight_off_the_device_is_refused_by_name() -> None:
    _, served = _tiny("qwen2")
    with pytest.raises(ValueError, match=r"weight model\.embed_tokens\.weight lies on cpu, not cuda"):
        check_weights_placed(served.model, torch.device("cuda"))
    served.model.hf_device_map = {"model.layers.1": "disk"}
    with pytest.raises(ValueError, match="layer model.layers.1 is mapped to disk"):
        check_weights_placed(served.model, torch.device("cpu"))


def test_served_through_the_step_batcher_each_session_gets_its_rows() -> None:
    """Concurrent sessions through ``StepBatcher`` (the server's runner) over the slot engine: each session's greedy
    tokens are those of the transformers path alone, and a prefill waiting behind continuous steps runs after one."""
    reference, served = _tiny("llama")
    slots = SlotLLM(served, max_slots=4, max_len=64)
    prompts = [[5, 9, 13, 2], [3, 4, 8, 8, 8, 8], [60, 61]]
    expected = []
    for prompt in prompts:
        seq = reference.open(prompt)
        for _ in range(6):
            reference.step([(seq, int(np.argmax(seq.next_logits)))])
        expected.append(seq.ids[len(prompt):])
    got: dict[int, list[int]] = {}
    with StepBatcher(slots, batch_window_ms=5) as batcher:  # type: ignore[arg-type]

        def run(i: int) -> None:
            seq, _ = batcher.prefill(prompts[i], spec=RowSpec(top_n=2))
            for _ in range(6):
                batcher.forward(seq, int(seq.next_row.ids[0]))
            got[i] = seq.ids[len(prompts[i]):]
            batcher.release(seq)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [got[i] for i in range(3)] == expected
    assert slots.free_slots == 4


class SteppingLLM:
    """A model whose every step takes 20 ms, recording the order of steps and prefills."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def open_many(self, prompts: list[list[int]]) -> list[CloudSequence]:
        self.log.append("prefill")
        return [CloudSequence(list(p), None, np.zeros(4, np.float32)) for p in prompts]

    def step(self, batch: list[tuple[CloudSequence, int]]) -> None:
        time.sleep(0.02)
        self.log.append("step")
        for seq, token in batch:
            seq.ids.append(token)


def test_a_prefill_under_continuous_decoding_waits_at_most_one_step() -> None:
    """Two sessions step back to back without a pause (as run-ahead drafts do); a new session's prefill runs after
    the step batch in progress, where before it waited until no step was queued."""
    llm = SteppingLLM()
    stop = threading.Event()
    with StepBatcher(llm, batch_window_ms=0) as batcher:  # type: ignore[arg-type]
        seqs = [batcher.prefill([1])[0] for _ in range(2)]

        def decode(seq: CloudSequence) -> None:
            while not stop.is_set():
                batcher.forward(seq, 2)

        threads = [threading.Thread(target=decode, args=(seq,)) for seq in seqs]
        for thread in threads:
            thread.start()
        time.sleep(0.1)
        asked = len(llm.log)
        batcher.prefill([3, 4])
        stop.set()
        for thread in threads:
            thread.join()
    after = llm.log[asked:]
    assert "prefill" in after and after.index("prefill") <= 1, llm.log


# -- row summaries ---------------------------------------------------------------------------------------------
_row_values = st.lists(st.sampled_from([0.0, -0.0, 1.5, -1.5, 2.0, 3.25, -7.0, 1e-30, 1e30, -1e30]),
                       min_size=2, max_size=40)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_row_values, min_size=1, max_size=3), n=st.integers(1, 40))
def test_device_top_ids_order_as_the_edge_does_ties_and_signed_zeros_included(rows: list[list[float]],
                                                                               n: int) -> None:
    width = min(len(r) for r in rows)
    values = np.array([r[:width] for r in rows], dtype=np.float32)
    k = min(n, width)
    got = top_ids_on_device(torch.from_numpy(values), k).numpy()
    for b in range(values.shape[0]):
        np.testing.assert_array_equal(got[b], top_k_ids(values[b], k))


def test_a_device_summary_sends_the_values_it_picks_from() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 500)).astype(np.float32)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie at the top: the lower id first
    specs = [RowSpec("prob", 5), RowSpec("logit", 7), RowSpec("prob", 500, dense=True)]
    rows = _summarize_on_device(torch.from_numpy(logits), specs)
    assert list(rows[1].ids[:2]) == [10, 20]
    for b, (row, spec) in enumerate(zip(rows, specs)):
        full = row.full_values()
        np.testing.assert_array_equal(row.values, full[row.ids])  # the same floats, bit for bit
        np.testing.assert_array_equal(row.ids, top_k_ids(full, min(spec.top_n, 500)))
        np.testing.assert_allclose(row.probs, softmax(logits[b])[row.ids], rtol=1e-5)
        np.testing.assert_array_equal(row.logits(), logits[b])
    np.testing.assert_array_equal(rows[1].values, logits[1][rows[1].ids])


def test_a_row_with_a_non_finite_logit_is_flagged() -> None:
    logits = np.zeros(8, np.float32)
    logits[3] = np.nan
    assert not summarize_row(logits, RowSpec()).finite
    assert not _summarize_on_device(torch.from_numpy(logits[None]), [RowSpec()])[0].finite
    assert isinstance(summarize_row(np.ones(8, np.float32), RowSpec()), StepRow)


def test_an_out_of_memory_prefill_fails_that_session_only() -> None:
    """The device runs out of memory while one prompt prefills: that session gets RESOURCE_EXHAUSTED, its slot is
    free again, and a session already decoding goes on with the rows it would have had."""
    reference, served = _tiny("qwen2")
    slots = SlotLLM(served, max_slots=3, max_len=32)
    running, alone = slots.open([5, 6, 7], RowSpec(top_n=4)), reference.open([5, 6, 7])
    forward = slots._forward

    def short_of_memory(batch_slots: Any, tokens: list[list[int]]) -> Any:
        if len(tokens[0]) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(batch_slots, tokens)

    slots._forward = short_of_memory  # type: ignore[method-assign]
    with pytest.raises(CloudError) as refused:
        slots.open(list(range(1, 10)), RowSpec(top_n=4))
    assert refused.value.code == "RESOURCE_EXHAUSTED" and "9 tokens" in str(refused.value)
    assert slots.free_slots == 2
    slots.step([(running, 9)])
    reference.step([(alone, 9)])
    _close(alone.next_logits, _logits(slots, running))


def test_a_sticky_device_error_stops_the_worker_so_health_reports_not_serving() -> None:
    """An error that leaves the CUDA context unusable ends the batcher's worker (its on_death callbacks run: the
    server reports NOT_SERVING) instead of failing each later session in turn; an ordinary error does not."""
    _, served = _tiny("qwen2")
    slots = SlotLLM(served, max_slots=2, max_len=32)
    died = threading.Event()
    failure = [RuntimeError("shape mismatch in a custom kernel")]

    def broken(batch_slots: Any, tokens: list[list[int]]) -> Any:
        raise failure[0]

    with StepBatcher(slots) as batcher:  # type: ignore[arg-type]
        batcher.on_death.append(died.set)
        seq, _ = batcher.prefill([5, 6], spec=RowSpec(top_n=2))
        slots._forward = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="shape mismatch"):
            batcher.forward(seq, 3)
        assert not died.is_set()
        failure[0] = RuntimeError("CUDA error: an illegal memory access was encountered")
        with pytest.raises(RuntimeError, match="illegal memory access"):
            batcher.forward(seq, 3)
        assert died.wait(5)
        with pytest.raises(RuntimeError, match="died"):
            batcher.prefill([1], spec=RowSpec())


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", "2"], "--tp 2 needs `torchrun --nproc-per-node 2 coveil-cloud serve --tp 2` (WORLD_SIZE is unset)"),
    (["--tp", "2", "--backend", "transformers"], "--tp runs on the slots backend"),
])
def test_tensor_parallel_serving_says_how_to_launch_it(flags: list[str], message: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from cloud_adapter.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if "--backend" in flags:
        monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err


def test_a_session_that_could_outgrow_its_slot_is_refused_when_it_opens() -> None:
    """Prompt plus max_new_tokens past a slot: INVALID_ARGUMENT at open, naming the numbers, before any forward
    (a slot filling mid-batch would fail the whole batch)."""
    from cloud_adapter.engine import CloudEngine
    from edge_sdk.protocol import wire

    _, served = _tiny("qwen2")
    slots = SlotLLM(served, max_slots=2, max_len=16)
    with StepBatcher(slots) as batcher:  # type: ignore[arg-type]
        engine = CloudEngine(served, runner=batcher)
        request = wire.SessionRequest(prompt_ids=(5, 6, 7, 8, 9, 10), mode="edge", max_new_tokens=11,
                                      vocab_fingerprint=served.vocab_fingerprint(), edge_model="test",
                                      vocab_size=served.vocab_size, top_m=4)
        with pytest.raises(CloudError) as refused:
            list(engine.session("client").handle(wire.encode_open(request)))
        assert refused.value.code == "INVALID_ARGUMENT"
        assert "6 tokens and max_new_tokens 11 exceed the 16 tokens" in str(refused.value)
        assert slots.free_slots == 2
        fits = list(engine.session("client").handle(wire.encode_open(replace(request, max_new_tokens=10))))
        assert [m.WhichOneof("kind") for m in fits] == ["opened", "distribution"]


def test_a_long_prefill_runs_one_chunk_between_step_batches() -> None:
    """A session decodes without a pause while a 40-token prompt prefills 8 tokens a forward: the prompt's five
    chunks alternate with step batches (the decoding session is never held up by more than one chunk), and both
    sessions' greedy tokens are those of the transformers path alone."""
    reference, served = _tiny("llama")
    slots = SlotLLM(served, max_slots=4, max_len=64, prefill_chunk=8)
    forwards: list[int] = []  # each forward's query length: 8 = a prompt chunk, 1 = a step
    forward = slots._forward

    def logged(batch_slots: Any, tokens: list[list[int]]) -> Any:
        forwards.append(len(tokens[0]))
        if len(tokens[0]) > 1:
            time.sleep(0.03)  # a chunk as long as a real one: the decoding session's next step is queued by its end
        return forward(batch_slots, tokens)

    slots._forward = logged  # type: ignore[method-assign]
    short, long = [5, 9, 13, 2], [(7 * i) % 90 + 1 for i in range(40)]
    expected = {}
    for name, prompt, steps in (("short", short, 24), ("long", long, 3)):
        seq = reference.open(prompt)
        for _ in range(steps):
            reference.step([(seq, int(np.argmax(seq.next_logits)))])
        expected[name] = seq.ids[len(prompt):]
    got: dict[str, list[int]] = {}
    with StepBatcher(slots, batch_window_ms=0) as batcher:  # type: ignore[arg-type]
        decoding = threading.Event()

        def decode() -> None:
            seq, _ = batcher.prefill(short, spec=RowSpec(top_n=2))
            for i in range(24):
                if i == 4:
                    decoding.set()
                batcher.forward(seq, int(seq.next_row.ids[0]))
            got["short"] = seq.ids[len(short):]
            batcher.release(seq)

        thread = threading.Thread(target=decode)
        thread.start()
        decoding.wait()
        seq, forward_ns = batcher.prefill(long, spec=RowSpec(top_n=2))
        for _ in range(3):
            batcher.forward(seq, int(seq.next_row.ids[0]))
        got["long"] = seq.ids[len(long):]
        batcher.release(seq)
        thread.join()
    assert got == expected
    assert forward_ns > 0
    chunks = [i for i, q in enumerate(forwards) if q == 8]
    assert len(chunks) == 5, forwards
    assert all(forwards[i + 1] == 1 for i in chunks[:-1]), forwards  # a step batch after each chunk but the last
    assert slots.free_slots == 4


def test_a_prefill_abandoned_between_chunks_gives_its_slot_back() -> None:
    _, served = _tiny("qwen2")
    slots = SlotLLM(served, max_slots=2, max_len=32, prefill_chunk=4)
    chunks = slots.opening(list(range(1, 11)), RowSpec(top_n=2))
    next(chunks)
    assert slots.free_slots == 1
    chunks.close()
    assert slots.free_slots == 2
