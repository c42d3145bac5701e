"""The carriers of one session's messages: the contract (:class:`MessageChannel`) and two carriers.

* :class:`GrpcChannel` over a real gRPC bidirectional stream;
* :class:`InProcessChannel` straight into a cloud session handler object in the same process (tests, the
  harness), through the same encoding, so byte counts and validation are identical.

The WebSocket carrier is :mod:`edge_sdk.protocol.websocket`.
"""

from __future__ import annotations

import ipaddress
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from edge_sdk.protocol.drafting import answer
from edge_sdk.protocol.status import RETRYABLE_CODES, CloudError

if TYPE_CHECKING:  # for annotations only: gRPC and the generated code load with the first session
    import grpc

    from edge_sdk._wire.coveil_pb2 import CloudMessage, EdgeMessage


class _StreamingCall(Protocol):
    """gRPC's bidirectional call as the channel uses it: the cloud's messages, and whether the call ended."""

    def __next__(self) -> CloudMessage: ...

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


class MessageChannel(Protocol):
    """Moves protobuf messages of one session: ``EdgeMessage`` out, ``CloudMessage`` in.  A new carrier implements
    these three methods (and is handed to ``EdgeClient(channel=...)`` by a zero-argument factory, one channel per
    session); :class:`CloudConnection` does the rest.

    The carrier's duties, each a defence (``tests/promises/test_carriers.py`` holds every carrier to them):

    * **Begin the stream at the first** :meth:`send`, not before: the edge connects before its SLM prefills the
      private prompt, and a stream begun at once lets the cloud time that prefill (it grows with the private
      context) from the stream's start to the open.
    * **Return from** :meth:`send` **only once the message is written** to the transport: otherwise the write
      happens whenever another thread runs, and behind the SLM's next forward on a busy core, so the message
      leaves on the private context's clock.  A stream that has already ended makes :meth:`send` return at once;
      :meth:`receive` then raises why.
    * **Errors are** :class:`~edge_sdk.protocol.status.CloudError` with a gRPC status name (the status the cloud ended the
      stream with, or ``UNAVAILABLE``, retryable, for a stream that broke), so the loop resumes alike over any
      carrier.
    * **Bytes cross unchanged and uncompressed**: padding fixes every message's size (a compressed size would
      depend on its content).

    ``crosses_network`` (a class attribute; a channel without one counts as ``True``): whether anyone but this
    process can time the messages.  Only such sessions are paced by default (``DecodeSettings.auto_pace_ms``).
    """

    def send(self, message: EdgeMessage) -> None: ...

    def receive(self) -> CloudMessage: ...

    def close(self) -> None: ...


class CloudSessionHandler(Protocol):
    """The cloud side of one session as an in-process object (``cloud_adapter.engine.SessionHandler``)."""

    def handle(self, message: EdgeMessage) -> Iterable[CloudMessage]: ...

    def abandon(self, reason: str) -> None: ...


class InProcessChannel:
    """Hands each message to a cloud session handler in this process and queues its replies.

    A handler that runs ahead (``can_draft()``/``draft()``, as the cloud adapter's session does) drafts after
    each message as deep as it will before the edge's next one: the schedule of a cloud infinitely quicker than
    the edge.
    """

    crosses_network = False  # the cloud runs in this process: nothing times the messages but this process

    def __init__(self, handler: CloudSessionHandler) -> None:
        self._handler = handler
        self._replies: list[CloudMessage] = []

    def send(self, message: EdgeMessage) -> None:
        # round-trip through bytes: the same validation and sizes as on the wire
        edge_message = type(message).FromString(message.SerializeToString())
        try:
            for replies in answer(self._handler, edge_message):
                self._replies.extend(replies)
        except CloudError as exc:  # the status a server would end the stream with, as the edge receives it
            raise CloudError(exc.code, exc.message, retryable=exc.code in RETRYABLE_CODES) from exc

    def receive(self) -> CloudMessage:
        if not self._replies:
            raise CloudError("FAILED_PRECONDITION", "the cloud sent nothing for this request")
        reply = self._replies.pop(0)
        return type(reply).FromString(reply.SerializeToString())

    def close(self) -> None:
        self._handler.abandon("closed")



class GrpcChannel:
    """One ``Decode`` bidirectional stream on a gRPC channel, begun by the first :meth:`send`
    (:class:`MessageChannel`'s duties: gRPC's headers go out when the call begins).

    :meth:`send` returns once gRPC has written the message to the transport: gRPC asks the request iterator for
    the next message only after the previous one's send completed, so a send waits for that ask.
    """

    #: how often a blocked :meth:`send` checks whether the call has ended
    _POLL_S = 0.05
    crosses_network = True

    def __init__(
        self, grpc_channel: grpc.Channel, *, metadata: tuple[tuple[str, str], ...] = (), timeout_s: float | None = None
    ) -> None:
        import grpc

        from edge_sdk._wire import coveil_pb2_grpc

        self._grpc = grpc
        self._outbox: queue.SimpleQueue[EdgeMessage | None] = queue.SimpleQueue()  # None: the stream is closed
        self._written = threading.Semaphore(0)  # one release per message gRPC has finished sending
        self._stub = coveil_pb2_grpc.CollaborativeDecodingStub(grpc_channel)
        self._metadata, self._timeout_s = metadata, timeout_s
        # begun by the first send (a defence: the stream's start would otherwise tell the cloud when the edge
        # began its prefill, whose length grows with the private context)
        self._call: _StreamingCall | None = None

    def _begun(self) -> _StreamingCall:
        if self._call is None:
            self._call = self._stub.Decode(self._outgoing(), metadata=self._metadata, timeout=self._timeout_s)
        return self._call

    def _outgoing(self) -> Iterator[EdgeMessage]:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            yield message
            self._written.release()  # gRPC asks for the next message once this one is sent

    def send(self, message: EdgeMessage) -> None:
        self._outbox.put(message)
        call = self._begun()
        while not self._written.acquire(timeout=self._POLL_S):
            if call.done():  # the stream broke: receive() reports why
                return

    def receive(self) -> CloudMessage:
        try:
            return next(self._begun())
        except StopIteration:
            raise CloudError("UNAVAILABLE", "the cloud ended the stream", retryable=True) from None
        except self._grpc.RpcError as exc:
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            raise CloudError(code, exc.details() or "", retryable=code in RETRYABLE_CODES) from exc

    def close(self) -> None:
        self._outbox.put(None)
        if self._call is not None:
            self._call.cancel()


def is_loopback(address: str) -> bool:
    """Whether a gRPC target names this machine: ``localhost``, ``127.0.0.0/8``, ``[::1]`` or a Unix socket."""
    if address.startswith("unix:"):
        return True
    if address.startswith(("ipv4:", "ipv6:")):  # several replicas: every one must be local
        return all(is_loopback(part) for part in address[5:].split(","))
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
