"""GrpcChannel's send contract, against a stand-in for gRPC's request consumer (no model, no server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from edge_sdk.protocol import channels
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
    channel = channels.GrpcChannel(object())
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
    channel = channels.GrpcChannel(object())
    channel.send("open")
    started = time.monotonic()
    channel.send("token")  # never written: must come back once the call is over
    assert time.monotonic() - started < 2.0
    assert [m for m, _ in fake_grpc.calls[-1].written] == ["open"]


# -- one status error at both ends -------------------------------------------------------------------------------
class RefusingHandler:
    """A cloud session handler that refuses every message with the status it was given."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def handle(self, message: Any) -> Iterator[Any]:
        raise self.error

    def abandon(self, reason: str) -> None:
        pass


@pytest.mark.parametrize(("code", "retryable"), [("UNAVAILABLE", True), ("INTERNAL", True),
                                                 ("INVALID_ARGUMENT", False), ("RESOURCE_EXHAUSTED", False)])
def test_an_in_process_refusal_reaches_the_edge_as_a_served_status_would(code: str, retryable: bool) -> None:
    """The cloud's handler raises the one status error; in process the edge receives what a gRPC stream ending with
    that status gives it: the same type, code and message, retryable by the code alone (what the handler said
    about retrying is its own business: a server sends only the code)."""
    from edge_sdk.protocol import wire
    from edge_sdk.protocol.status import CloudError

    channel = channels.InProcessChannel(RefusingHandler(CloudError(code, "no", retryable=not retryable)))
    with pytest.raises(CloudError) as caught:
        channel.send(wire.encode_close())
    assert (caught.value.code, caught.value.message, caught.value.retryable) == (code, "no", retryable)


def wire_open_message(**fields: Any) -> Any:
    from edge_sdk.protocol import wire

    return wire.pb().OpenSession(protocol_version=wire.PROTOCOL_VERSION, **fields)


def test_the_cloud_adapter_refuses_with_the_status_error_the_edge_catches() -> None:
    """One type at both ends: a check of the cloud adapter raises the error the SDK exports."""
    import edge_sdk
    from cloud_adapter.limits import Limits
    from cloud_adapter.validation import check_open_message

    message = wire_open_message(edge_model="x" * 300)
    with pytest.raises(edge_sdk.CloudError) as caught:
        check_open_message(message, cloud_model="m", fingerprint=b"", limits=Limits())
    assert caught.value.code == "INVALID_ARGUMENT" and "longer than" in caught.value.message
