"""``cloud_adapter.inprocess.serving``: the adapter the tests, the harness and the benchmarks serve in-process."""

from __future__ import annotations

import grpc
import pytest

from cloud_adapter.engine import CloudEngine
from cloud_adapter.inprocess import serving
from cloud_adapter.llm import TransformersLLM, TransformersSLM
from cloud_adapter.local import free_loopback_port
from edge_sdk.client import Credentials, EdgeClient
from tests.support.tiny_models import bpe_tokenizer, random_qwen

TOKEN = "in-process-token"


@pytest.fixture(scope="module")
def tiny_llm() -> TransformersLLM:
    tokenizer = bpe_tokenizer()
    return TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=3), tokenizer, "tiny-bpe")


def test_the_adapter_serves_inside_the_block_and_is_gone_after_it(tiny_llm: TransformersLLM) -> None:
    engine = CloudEngine(tiny_llm)
    port = free_loopback_port()
    with serving(engine, port=port, token=TOKEN, max_workers=4) as adapter:
        assert adapter.address == f"127.0.0.1:{port}" and adapter.port == port
        credentials = Credentials(token=TOKEN, plaintext=True)
        with EdgeClient(adapter.address, slm=TransformersSLM(tiny_llm), credentials=credentials,
                        max_reconnects=0, timeout_s=20) as client:
            assert client.cloud_status(timeout_s=5) == "serving"
            result = client.generate("Which organ?", "The liver.", mode="edge", max_new_tokens=2)
        assert len(result.token_ids) == 2
        assert engine.transcripts  # the session ran on the caller's engine
    # stopped and waited for: nothing listens on the port any more
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=1)
    assert engine.active_sessions == 0  # the engine outlives its server


def test_a_free_port_is_picked_and_the_token_is_required(tiny_llm: TransformersLLM) -> None:
    with serving(CloudEngine(tiny_llm), token=TOKEN, max_workers=4) as adapter:
        assert adapter.port > 0 and adapter.address.endswith(f":{adapter.port}")
        with EdgeClient(adapter.address, slm=TransformersSLM(tiny_llm), credentials=Credentials(plaintext=True),
                        max_reconnects=0, timeout_s=20) as client:
            with pytest.raises(Exception, match="UNAUTHENTICATED|bearer"):
                client.generate("Which organ?", "The liver.", mode="edge", max_new_tokens=1)
