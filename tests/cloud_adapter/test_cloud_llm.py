"""TransformersLLM: batched decode steps must give what each sequence alone gives.

A tiny random Gemma-3 (sliding window 6, so windows are crossed within a few
steps) covers the padding/re-batching logic in a fraction of a second; the
embedded Gemma-3 270M (``@pytest.mark.model``) checks the real model in
float32 (logits within 1e-3) and bf16 (same greedy tokens, close logits).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cloud_adapter.hf_loading import forward_with_cache
from cloud_adapter.llm import CloudSequence, KVSlot, TransformersLLM

# Which sequences step at each step of a membership schedule; "+D" opens D before that step,
# "-A" drops A for good (as a closed session would).  Covers: all together, one skipping a step
# and coming back in another order, a new one joining, one leaving, the steady state, and one alone.
SCHEDULE: list[tuple[str, ...]] = [
    ("A", "B", "C"),
    ("A", "C"),  # B lags
    ("C", "B", "A"),  # B back, other order
    ("+D", "A", "B", "C", "D"),  # D joins
    ("A", "B", "C", "D"),  # steady state
    ("-A", "B", "C", "D"),  # A leaves
    ("B", "C", "D"),
    ("D",),  # alone
]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run these tests on one intra-op thread (restored after).

    On a small CPU shared with other jobs, OpenMP threads that wait for a descheduled sibling make
    each forward 10-30x slower and erratic; one thread keeps this file fast and its time stable.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_schedule(
    llm: TransformersLLM, prompts: dict[str, list[int]], schedule: list[tuple[str, ...]], *, batched_open: bool = True
) -> tuple[dict[str, CloudSequence], dict[str, CloudSequence], list[tuple[str, np.ndarray, np.ndarray]]]:
    """Run ``schedule`` batched and, in lock step, each sequence alone (batch of one, no padding).

    Tokens are greedy from the batched logits.  Returns the batched and reference sequences and,
    per (step, sequence), the pair of logit rows [V] (batched, alone) to compare.
    """
    first = [name for name in prompts if name != "D"]
    opened = llm.open_many([prompts[n] for n in first]) if batched_open else [llm.open(prompts[n]) for n in first]
    seqs = dict(zip(first, opened))
    refs = {n: llm.open(prompts[n]) for n in first}
    pairs = [(n, seqs[n].next_logits.copy(), refs[n].next_logits.copy()) for n in first]
    for members in schedule:
        names = [m for m in members if m[0] not in "+-"]
        for m in members:
            if m.startswith("+"):
                seqs[m[1:]], refs[m[1:]] = llm.open(prompts[m[1:]]), llm.open(prompts[m[1:]])
            elif m.startswith("-") and m[1:] in seqs:
                del seqs[m[1:]], refs[m[1:]]
        tokens = {n: int(np.argmax(seqs[n].next_logits)) for n in names}
        llm.step([(seqs[n], tokens[n]) for n in names])
        for n in names:
            llm.step([(refs[n], tokens[n])])
            pairs.append((n, seqs[n].next_logits.copy(), refs[n].next_logits.copy()))
    for n in seqs:
        assert seqs[n].ids == refs[n].ids
    return seqs, refs, pairs


# -- a tiny random Gemma-3: fast, and crosses the sliding window ------------------------------------


class _StubTokenizer:
    """The bits of a tokenizer TransformersLLM reads: a vocabulary size and special ids."""

    eos_token_id = 1
    bos_token_id = 2

    def __len__(self) -> int:
        return 90  # fewer than the model's 100 logits, as with padded embedding tables

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<t{i}>" for i in ids]


@pytest.fixture(scope="module")
def tiny() -> TransformersLLM:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=256,
        pad_token_id=0,
    )
    return TransformersLLM.from_loaded(Gemma3ForCausalLM(config).float(), _StubTokenizer(), name="tiny-gemma3")


TINY_PROMPTS = {"A": [2, 17, 33], "B": [2, 5, 9, 40, 41, 42, 7, 8, 60], "C": [2, 70], "D": [2, 11, 12, 13, 14]}


def test_tiny_batched_steps_match_each_alone(tiny: TransformersLLM) -> None:
    seqs, _, pairs = run_schedule(tiny, TINY_PROMPTS, SCHEDULE + [("B", "C", "D")] * 4)
    for name, batched, alone in pairs:
        assert batched.shape == (90,) and batched.dtype == np.float32
        assert np.argmax(batched) == np.argmax(alone), name
        assert np.abs(batched - alone).max() < 1e-4, name
    # and against a plain no-cache forward of the whole sequence (window crossed: lengths > 6)
    for seq in seqs.values():
        assert len(seq) > 6
        with torch.inference_mode():
            full = tiny.model(input_ids=torch.tensor([seq.ids])).logits[0, -1, :90].float().numpy()
        assert np.abs(full - seq.next_logits).max() < 1e-4


def test_tiny_open_many_matches_open(tiny: TransformersLLM) -> None:
    prompts = list(TINY_PROMPTS.values())
    many = tiny.open_many(prompts)
    for prompt, seq in zip(prompts, many):
        alone = tiny.open(prompt)
        assert seq.ids == prompt
        assert np.abs(seq.next_logits - alone.next_logits).max() < 1e-4
    # pad positions are zeroed, never NaN (a masked NaN still poisons attention: 0 * NaN = NaN)
    batch = many[0].cache.batch
    assert all(torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all() for layer in batch.cache.layers)
    with pytest.raises(ValueError):
        tiny.open_many([[2, 3], []])


def test_tiny_steady_state_reuses_the_batch(tiny: TransformersLLM) -> None:
    a, b, c = (tiny.open(p) for p in list(TINY_PROMPTS.values())[:3])
    tiny.step([(a, 3), (b, 4), (c, 5)])  # membership change: one gather
    batch = a.cache.batch
    assert b.cache.batch is batch and c.cache.batch is batch and batch.size == 3
    rows = {id(s): s.cache.row for s in (a, b, c)}
    for _ in range(3):  # same set, any order: the same batch, no re-gathering
        tiny.step([(c, 6), (a, 7), (b, 8)])
        assert all(s.cache.batch is batch and s.cache.row == rows[id(s)] for s in (a, b, c))
    assert batch.lengths == [len(s) for s in sorted((a, b, c), key=lambda s: s.cache.row)]
    tiny.step([(a, 9)])  # a alone: a new batch of one; b and c keep their rows
    assert a.cache.batch is not batch and a.cache.batch.size == 1 and b.cache.batch is batch


def test_tiny_left_behind_rows_are_compacted(tiny: TransformersLLM) -> None:
    """Rows left in an old batch stay put until half of it is stale, then move to a compact batch."""
    prompts = list(TINY_PROMPTS.values())
    seqs = tiny.open_many(prompts)
    refs = [tiny.open(p) for p in prompts]
    old = seqs[0].cache.batch
    assert old.size == 4

    def step(members: list[int]) -> None:
        tiny.step([(seqs[i], 7 + i) for i in members])
        for i in members:
            tiny.step([(refs[i], 7 + i)])

    step([0])  # 3 of 4 rows still live in `old`: nothing copied for them
    assert seqs[1].cache.batch is old and seqs[3].cache.batch is old
    del seqs[3], refs[3]  # a session closes: its row in `old` goes stale, 2 of 4 live
    step([1])  # 1 of 4 live -> seqs[2] moves to a batch of its own
    assert seqs[2].cache.batch is not old and seqs[2].cache.batch.size == 1
    step([0, 1, 2])
    step([2, 0])
    for seq, ref in zip(seqs, refs):
        assert seq.ids == ref.ids
        assert np.abs(seq.next_logits - ref.next_logits).max() < 1e-4


def test_tiny_step_edge_cases(tiny: TransformersLLM) -> None:
    seq = tiny.open([2, 3, 4])
    tiny.step([])  # nothing to do
    assert seq.ids == [2, 3, 4]
    with pytest.raises(ValueError):
        tiny.step([(seq, 5), (seq, 6)])
    with pytest.raises(ValueError):
        tiny.open([])


def test_tiny_standalone_cache_copy(tiny: TransformersLLM) -> None:
    """``KVSlot.to_dynamic_cache`` gives a batch-of-one DynamicCache that decodes like the row."""
    a, b = tiny.open_many([[2, 3, 4, 5, 6, 7, 8, 9], [2, 3]])
    tiny.step([(a, 10), (b, 11)])
    assert isinstance(b.cache, KVSlot) and b.cache.length == 3
    cache = b.cache.to_dynamic_cache(tiny.model.config)
    tiny.step([(b, 12)])
    with torch.inference_mode():
        logits, _ = forward_with_cache(tiny.model, cache, input_ids=torch.tensor([[12]]))
    assert np.abs(logits[0, -1, :90].numpy() - b.next_logits).max() < 1e-4


def test_the_cache_goes_in_by_the_supported_name_without_a_warning(tiny: TransformersLLM) -> None:
    """Prefill, batched prefill, a batched step and a lagging step warn nothing (``past_key_values`` is
    deprecated in the installed transformers: each call warned)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = tiny.open_many([[2, 3, 4, 5], [2, 3]])
        c = tiny.open([2, 7, 8])
        tiny.step([(a, 10), (b, 11), (c, 12)])
        tiny.step([(b, 13)])
    assert [str(w.message) for w in caught] == []


def test_decoding_through_the_cache_argument_gives_the_deprecated_arguments_logits_bit_for_bit(
        tiny: TransformersLLM) -> None:
    """The reference: the model called directly with ``past_key_values`` (what this class passed before), one
    sequence, prefill then three steps; the class's rows must equal it exactly."""
    import warnings

    from transformers import DynamicCache

    prompt, tokens = [2, 3, 4, 5, 6], [10, 11, 12]
    seq = tiny.open(prompt)
    rows = [seq.next_logits.copy()]
    for token in tokens:
        tiny.step([(seq, token)])
        rows.append(seq.next_logits.copy())
    reference = []
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        cache = DynamicCache(config=tiny.model.config)
        out = tiny.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        reference.append(out.logits[0, -1, : tiny.vocab_size].float().numpy())
        for position, token in enumerate(tokens, len(prompt)):
            out = tiny.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            reference.append(out.logits[0, -1, : tiny.vocab_size].float().numpy())
    for ours, theirs in zip(rows, reference, strict=True):
        assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("gpu", [True, False])
def test_a_device_map_chooses_the_dtype_of_the_gpus_it_fills(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    """``--device-map auto`` with ``--dtype auto``: bf16 on bf16 GPUs, not the host CPU's float32."""
    from cloud_adapter import hf_loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(hf_loading, "cpu_has_native_bf16", lambda: False)
    assert hf_loading.dtype_device("cpu", "auto") == ("cuda" if gpu else "cpu")
    assert hf_loading.resolve_dtype("auto", hf_loading.dtype_device("cpu", "auto")) is (
        torch.bfloat16 if gpu else torch.float32)
    assert hf_loading.dtype_device("cpu", None) == "cpu" and hf_loading.dtype_device("cuda:1", None) == "cuda:1"
    assert hf_loading.dtype_device("cpu", "cpu") == "cpu" and hf_loading.dtype_device("cpu", "cuda:0") == "cuda:0"


# -- the embedded Gemma-3 270M ---------------------------------------------------------------------


def _prompts(llm: TransformersLLM) -> dict[str, list[int]]:
    texts = {
        "A": "The capital of France is",
        "B": "Write a short poem about the sea, the wind and the long grey evenings of the north:",
        "C": "def fibonacci(n):",
        "D": "Photosynthesis converts light energy into chemical energy. In plants, it happens in",
    }
    return {name: llm.tokenize(text) for name, text in texts.items()}


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities [V] from logits [V] (float64)."""
    e = np.exp(logits.astype(np.float64) - logits.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def gemma_fp32(gemma_llm) -> TransformersLLM:
    return gemma_llm


@pytest.mark.model
def test_gemma_fp32_batched_steps_match_each_alone(gemma_fp32: TransformersLLM) -> None:
    prompts = _prompts(gemma_fp32)
    assert len({len(p) for p in prompts.values()}) == 4  # different lengths, so rows are padded
    _, _, pairs = run_schedule(gemma_fp32, prompts, SCHEDULE)
    for name, batched, alone in pairs:
        assert batched.shape == (gemma_fp32.vocab_size,) and batched.dtype == np.float32
        assert np.argmax(batched) == np.argmax(alone), name
        assert np.abs(batched - alone).max() < 1e-3, name


@pytest.mark.model
def test_gemma_bf16_batched_greedy_matches_each_alone() -> None:
    llm = TransformersLLM(dtype="bf16")
    schedule = SCHEDULE + [("B", "C", "D"), ("B", "D"), ("D", "C", "B")] * 3  # 17 steps
    _, _, pairs = run_schedule(llm, _prompts(llm), schedule)
    assert len(pairs) > 40
    for name, batched, alone in pairs:
        # greedy tokens agree; where the lone run itself has a near tie (top-2 within 2 bf16 ulps
        # at |logit| ~ 20), the batched pick must be one of the tied tokens
        top = int(np.argmax(batched))
        assert top == int(np.argmax(alone)) or alone[top] >= alone.max() - 0.25, name
        # bf16 rounding differs with the batch shape: logits (|x| up to ~30, bf16 ulp 0.125 there)
        # agree to some ulps (2.03 at most measured on an Intel Xeon with avx512_bf16 and no AMX, transformers 5.24, where
        # 2.0 had held on other hosts), probabilities to a few 1e-3
        assert np.abs(batched - alone).max() < 3.0, name
        assert np.abs(_softmax(batched) - _softmax(alone)).max() < 0.05, name
