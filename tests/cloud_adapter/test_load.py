"""32 concurrent sessions against one adapter on loopback: no errors, and nothing left behind after they close."""

from __future__ import annotations

import gc
import weakref

import grpc
import pytest

from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.loadgen import run_load
from cloud_adapter.runners import StepBatcher
from cloud_adapter.inprocess import serving

from tests.support.tiny_models import CORPUS, bpe_tokenizer, random_qwen

SESSIONS = 32


@pytest.mark.slow
@pytest.mark.parametrize("lookahead", [0, 4])
def test_32_concurrent_sessions_decode_and_leave_no_kv_cache_behind(lookahead: int) -> None:
    """In lockstep and with run-ahead (drafted forwards batched with the others; misses roll the KV back)."""
    tokenizer = bpe_tokenizer()
    llm = TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=21), tokenizer, "tiny-bpe")
    text = " ".join(CORPUS)
    prompts = [llm.tokenize(text)[: 8 + 3 * i] for i in range(SESSIONS)]  # ragged: 8 .. 101 tokens
    limits = Limits(max_sessions=SESSIONS, max_sessions_per_client=SESSIONS, max_unopened_streams=SESSIONS)
    with StepBatcher(llm) as batcher:
        sequences: list[weakref.ref] = []
        prefill = batcher.prefill

        def recording_prefill(prompt_ids, *, spec=None):
            seq, elapsed = prefill(prompt_ids, spec=spec)
            sequences.append(weakref.ref(seq))
            return seq, elapsed

        batcher.prefill = recording_prefill  # type: ignore[method-assign]
        engine = CloudEngine(llm, limits, runner=batcher)
        with serving(engine, max_workers=SESSIONS + limits.max_unopened_streams + 8) as adapter, \
                grpc.insecure_channel(adapter.address) as channel:
            report = run_load(channel, prompts, fingerprint=llm.vocab_fingerprint(), vocab_size=llm.vocab_size,
                              tokens=12, lookahead=lookahead)
        assert report.errors == []
        assert len(report.step_seconds) == SESSIONS * 12
        assert report.percentile_ms(50) <= report.percentile_ms(95) < 5_000
        assert max(batcher.batch_sizes) > 1  # the sessions were batched together
        assert engine.active_sessions == 0 and engine.admission.sessions == 0
        gc.collect()
        # every session's sequence (and with it its KV cache) is gone once the sessions closed
        assert len(sequences) == SESSIONS + 1  # the warm-up's and the sessions'
        assert [ref for ref in sequences if ref() is not None] == []
