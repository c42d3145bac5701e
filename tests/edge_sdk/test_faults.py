"""The edge SDK over a real gRPC server when the cloud goes away: resume, or fail clearly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from cloud_adapter.engine import CloudEngine
from cloud_adapter.runners import StepBatcher
from cloud_adapter.local import free_loopback_port
from cloud_adapter.inprocess import serving
from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.policies import CoVeil
from edge_sdk.protocol.status import CloudError

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

pytestmark = pytest.mark.model

PUBLIC, PRIVATE = PUBLIC_PROMPT, PRIVATE_CONTEXT
STEPS = 8


@pytest.fixture(scope="module")
def engine(gemma_llm) -> Iterator[CloudEngine]:
    with StepBatcher(gemma_llm) as batcher:
        yield CloudEngine(gemma_llm, runner=batcher)


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_a_cloud_restart_mid_generation_is_resumed(slm, engine: CloudEngine, mode: str) -> None:
    port = free_loopback_port()
    with serving(engine, port=port, max_workers=8) as first, \
            EdgeClient(first.address, slm=slm, credentials=Credentials(plaintext=True)) as client:
        uninterrupted = client.generate(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
        stream = client.stream(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
        pieces = iter(stream)
        for _ in range(3):
            next(pieces)
        first.server.stop(None).wait()  # the cloud goes down mid-session ...
        with serving(engine, port=port, max_workers=8):  # ... and comes back on the same address
            list(pieces)
    assert stream.ledger.reconnects >= 1
    assert stream.token_ids == uninterrupted.token_ids


def test_a_cloud_that_stays_away_fails_with_a_clear_error(slm) -> None:
    port = free_loopback_port()  # nothing listens here
    with EdgeClient(f"127.0.0.1:{port}", slm=slm, max_reconnects=1, credentials=Credentials(plaintext=True)) as client:
        with pytest.raises(CloudError) as failure:
            client.generate(PUBLIC, PRIVATE, mode="edge", max_new_tokens=2)
    assert failure.value.code == "UNAVAILABLE"


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_a_session_resumes_on_another_replica_when_its_own_dies(slm, engine: CloudEngine, mode: str) -> None:
    """Two adapters on loopback behind gRPC's round_robin; the one serving the session is killed mid-generation."""
    replicas = [engine, CloudEngine(engine.llm, runner=engine.runner)]
    with contextlib.ExitStack() as stack:
        adapters = [stack.enter_context(serving(e, max_workers=8)) for e in replicas]
        with EdgeClient([a.address for a in adapters], slm=slm, credentials=Credentials(plaintext=True)) as client:
            uninterrupted = client.generate(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
            stream = client.stream(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
            pieces = iter(stream)
            for _ in range(3):
                next(pieces)
            holder = next(i for i, e in enumerate(replicas) if e.active_sessions == 1)
            adapters[holder].server.stop(None)  # the replica holding the session dies and stays down
            list(pieces)
            assert replicas[1 - holder].transcripts  # the other replica finished the session
    assert stream.ledger.reconnects >= 1
    assert stream.token_ids == uninterrupted.token_ids


def test_replica_lists_become_one_balanced_target() -> None:
    from edge_sdk.client import grpc_target

    assert grpc_target(["10.0.0.1:50051", "10.0.0.2:50051"]) == "ipv4:10.0.0.1:50051,10.0.0.2:50051"
    assert grpc_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    assert grpc_target(["cloud.example:1"]) == "cloud.example:1"
    with pytest.raises(ValueError, match="dns:///"):
        grpc_target(["cloud-a.example:1", "cloud-b.example:1"])
