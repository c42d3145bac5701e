"""Wire invariants, checked on the bytes that leave the edge over a real gRPC server on loopback.

For every registered policy in each mode it defines, a recording channel
keeps every serialized message the edge sends.  What left the edge must be
exactly what the ledger says (bytes, sends, upload sizes, tokens), decodable
into nothing but the public prompt and the policy's signal; a canary planted
in the private context must appear in no message and in no log line of the
edge or the server.  A resumed session's messages are inspected too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from edge_sdk.protocol import wire
from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.policies import available_policies, make_policy
from edge_sdk.decoding import run_with_resume
from edge_sdk.protocol.status import CloudError
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import GrpcChannel

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

pytestmark = pytest.mark.model

CANARY = "Quartzwhistle-7731"
PRIVATE = f"{PRIVATE_CONTEXT} The patient's codename is {CANARY}."
STEPS = 4


class RecordingChannel:
    """Wraps a message channel; keeps the bytes of every message the edge sends (and can break once)."""

    def __init__(self, inner: Any, sent: list[bytes], break_after_signals: int | None = None) -> None:
        self.inner, self.sent, self.break_after = inner, sent, break_after_signals

    def send(self, message: Any) -> None:
        self.sent.append(message.SerializeToString())
        self.inner.send(message)
        if self.break_after is not None and message.WhichOneof("kind") == "signal":
            self.break_after -= 1
            if self.break_after < 0:
                raise CloudError("UNAVAILABLE", "connection reset", retryable=True)

    def receive(self) -> Any:
        return self.inner.receive()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def adapter(gemma_llm) -> Iterator[str]:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.runners import StepBatcher
    from cloud_adapter.inprocess import serving

    llm = gemma_llm
    with StepBatcher(llm) as batcher, serving(CloudEngine(llm, runner=batcher), max_workers=8) as adapter:
        yield adapter.address


@pytest.fixture(scope="module")
def client(slm, adapter: str) -> Iterator[EdgeClient]:
    """One client for the module: it reads the SLM's vocabulary once (a second per client on Gemma-3), and every
    test here opens its own channels and builds its own decoder."""
    with EdgeClient(adapter, slm=slm, credentials=Credentials(plaintext=True)) as client:
        yield client


def decode_all(sent: list[bytes]) -> list[Any]:
    pb = wire.pb()
    return [pb.EdgeMessage.FromString(data) for data in sent]


def check_messages(slm, messages: list[Any], decoder, mode: str, resumed_from: int = 0) -> None:
    """Every message is the open (public data only), a step's signal as the ledger has it, or a bare request."""
    opened = messages[0]
    assert opened.WhichOneof("kind") == "open"
    request = wire.decode_open(opened.open)
    assert list(request.prompt_ids) == slm.tokenize(PUBLIC_PROMPT, add_bos=True)  # the public prompt only
    assert list(request.resume_prefix) == decoder.tokens[:resumed_from]  # only tokens both sides already hold
    assert request.seed == 0 or mode == "cloud"
    for message in messages[1:]:
        kind = message.WhichOneof("kind")
        if kind == "request_full":
            continue  # carries a step number, nothing else
        if kind == "close":
            continue
        assert kind == "signal", kind
        entry = decoder.ledger.entries[message.signal.step]
        if mode == "edge":
            assert message.signal.WhichOneof("signal") == "token_id"
            assert message.signal.token_id == entry.token_id == decoder.tokens[message.signal.step]
        else:
            upload = message.signal.upload
            ids = (np.arange(slm.vocab_size) if upload.dense else wire.ids_from_bytes(upload.ids))
            values = wire.values_from_bytes(upload.values)
            assert ids.size == values.size == entry.values_uploaded
            # the exposure the ledger recorded is the top of exactly these values
            order = np.lexsort((ids, -values))[: decoder.ledger.exposure_k]
            assert tuple(ids[order].tolist()) == entry.exposure


def policies_and_modes() -> list[tuple[str, str]]:
    from edge_sdk.policies import policy_class

    return [(name, mode) for name in available_policies() for mode in sorted(policy_class(name).modes)]


@pytest.mark.parametrize(("name", "mode"), policies_and_modes())
def test_what_leaves_the_edge_is_the_public_prompt_and_the_ledgered_signal(
    slm, adapter, client, caplog, name: str, mode: str
) -> None:
    caplog.set_level(logging.DEBUG)
    policy = make_policy(name, backend=slm)
    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE, mode=mode, policy=policy, max_new_tokens=STEPS)
    sent: list[bytes] = []
    grpc_channel = client._open_grpc_channel(adapter)
    try:
        connection = CloudConnection(RecordingChannel(GrpcChannel(grpc_channel), sent))
        try:
            list(decoder.steps(connection))
        finally:
            connection.close()
    finally:
        grpc_channel.close()
    messages = decode_all(sent)
    check_messages(slm, messages, decoder, mode)
    # the ledger's bytes up are the bytes that left, step by step (the open and the close are no step's)
    per_step: dict[int, int] = {}
    for message, data in zip(messages, sent):
        step = message.signal.step if message.WhichOneof("kind") == "signal" else (
            message.request_full.step if message.WhichOneof("kind") == "request_full" else None)
        if step is not None:
            per_step[step] = per_step.get(step, 0) + len(data)
    assert [per_step[e.step] for e in decoder.ledger.entries] == [e.bytes_up for e in decoder.ledger.entries]
    everything = b"".join(sent)
    assert CANARY.encode() not in everything and PRIVATE_CONTEXT.encode()[:40] not in everything
    assert CANARY not in caplog.text and "jaundice" not in caplog.text


def test_a_resumed_session_sends_public_data_and_the_same_signals(slm, adapter, client, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE, mode="cloud", policy=make_policy("dp_logit"),
                             max_new_tokens=STEPS)
    attempts: list[list[bytes]] = []
    channels = []

    def connect() -> CloudConnection:
        grpc_channel = client._open_grpc_channel(adapter)
        channels.append(grpc_channel)
        attempts.append([])
        breaking = 1 if len(attempts) == 1 else None  # the first stream breaks after its second signal
        return CloudConnection(RecordingChannel(GrpcChannel(grpc_channel), attempts[-1], breaking))

    list(run_with_resume(decoder, connect, backoff_s=0.0))
    for grpc_channel in channels:
        grpc_channel.close()
    assert len(attempts) == 2 and decoder.ledger.reconnects == 1
    first, second = decode_all(attempts[0]), decode_all(attempts[1])
    resumed_at = wire.decode_open(second[0].open).resume_prefix
    assert list(resumed_at) == decoder.tokens[: len(resumed_at)] and len(resumed_at) == 1
    check_messages(slm, second, decoder, "cloud", resumed_from=len(resumed_at))
    # the step the cloud may already have seen is sent again byte for byte, not drawn afresh
    resent = [m for m in first if m.WhichOneof("kind") == "signal" and m.signal.step == 1]
    again = [m for m in second if m.WhichOneof("kind") == "signal" and m.signal.step == 1]
    assert resent and again and resent[0].SerializeToString() == again[0].SerializeToString()
    assert CANARY.encode() not in b"".join(attempts[0] + attempts[1])
    assert CANARY not in caplog.text
