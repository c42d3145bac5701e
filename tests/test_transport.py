"""GrpcChannel's send contract, against a stand-in for gRPC's request consumer (no model, no server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from edge_sdk import transport
from edge_sdk._wire import coveil_pb2_grpc

SEND_DURATION_S = 0.2


class SlowWriterCall:
    """Pulls requests like gRPC does: next message only once the previous one's (slow) write completed."""

    def __init__(self, requests: Iterator[Any], *, stop_after: int | None = None) -> None:
        self.written: list[tuple[Any, float]] = []
        self._done = threading.Event()
        self._stop_after = stop_after
        threading.Thread(target=self._consume, args=(requests,), daemon=True).start()

    def _consume(self, requests: Iterator[Any]) -> None:
        for message in requests:
            if self._stop_after is not None and len(self.written) >= self._stop_after:
                break  # the stream broke: this message is never written
            time.sleep(SEND_DURATION_S)
            self.written.append((message, time.monotonic()))
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._done.set()


class FakeGrpc:
    """Replaces the generated stub; ``stop_after`` makes the next call's stream break after that many writes."""

    def __init__(self) -> None:
        self.calls: list[SlowWriterCall] = []
        self.stop_after: int | None = None

    def stub(self, channel: Any) -> FakeGrpc:
        return self

    def Decode(self, requests: Iterator[Any], **_: Any) -> SlowWriterCall:  # noqa: N802
        self.calls.append(SlowWriterCall(requests, stop_after=self.stop_after))
        return self.calls[-1]


@pytest.fixture
def fake_grpc(monkeypatch: pytest.MonkeyPatch) -> FakeGrpc:
    fake = FakeGrpc()
    monkeypatch.setattr(coveil_pb2_grpc, "CollaborativeDecodingStub", fake.stub)
    return fake


def test_send_returns_only_after_the_message_was_written(fake_grpc: FakeGrpc) -> None:
    channel = transport.GrpcChannel(object())
    assert fake_grpc.calls == []  # the stream begins with its first message (the open, after the SLM's prefill)
    for message in ("open", "token"):
        channel.send(message)
        returned = time.monotonic()
        call = fake_grpc.calls[-1]
        assert len(fake_grpc.calls) == 1
        assert call.written[-1][0] == message, "send returned before gRPC wrote the message"
        assert call.written[-1][1] <= returned
    channel.close()


def test_send_on_a_broken_stream_returns_instead_of_hanging(fake_grpc: FakeGrpc) -> None:
    fake_grpc.stop_after = 1
    channel = transport.GrpcChannel(object())
    channel.send("open")
    started = time.monotonic()
    channel.send("token")  # never written: must come back once the call is over
    assert time.monotonic() - started < 2.0
    assert [m for m, _ in fake_grpc.calls[-1].written] == ["open"]
