"""The edge SDK over a real gRPC server when the cloud goes away: resume, or fail clearly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cloud_adapter.engine import CloudEngine
from cloud_adapter.runners import StepBatcher
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.local import free_loopback_port
from cloud_adapter.server import build_server
from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.policies import CoVeil
from edge_sdk.transport import CloudError

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

pytestmark = pytest.mark.model

PUBLIC, PRIVATE = PUBLIC_PROMPT, PRIVATE_CONTEXT
STEPS = 8


@pytest.fixture(scope="module")
def engine() -> Iterator[CloudEngine]:
    llm = TransformersLLM(dtype="fp32")
    with StepBatcher(llm) as batcher:
        yield CloudEngine(llm, runner=batcher)


def start_server(engine: CloudEngine, port: int):  # noqa: ANN201
    server, bound = build_server(engine, address=f"127.0.0.1:{port}", max_workers=8)
    assert bound == port
    server.start()
    return server


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_a_cloud_restart_mid_generation_is_resumed(slm, engine: CloudEngine, mode: str) -> None:
    port = free_loopback_port()
    server = start_server(engine, port)
    try:
        with EdgeClient(f"127.0.0.1:{port}", slm=slm, credentials=Credentials(plaintext=True)) as client:
            uninterrupted = client.generate(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
            stream = client.stream(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
            pieces = iter(stream)
            for _ in range(3):
                next(pieces)
            server.stop(None)  # the cloud goes down mid-session ...
            server = start_server(engine, port)  # ... and comes back on the same address
            list(pieces)
    finally:
        server.stop(None)
    assert stream.ledger.reconnects >= 1
    assert stream.token_ids == uninterrupted.token_ids


def test_a_cloud_that_stays_away_fails_with_a_clear_error(slm) -> None:
    port = free_loopback_port()  # nothing listens here
    with EdgeClient(f"127.0.0.1:{port}", slm=slm, max_reconnects=1, credentials=Credentials(plaintext=True)) as client:
        with pytest.raises(CloudError) as failure:
            client.generate(PUBLIC, PRIVATE, mode="edge", max_new_tokens=2)
    assert failure.value.code == "UNAVAILABLE"
