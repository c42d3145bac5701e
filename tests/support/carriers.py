"""Every carrier of the ``Decode`` stream, serving any in-process cloud session (the public fakes, a lying cloud)
through the real server code: :func:`cloud_adapter.stream.run_stream` behind the gRPC servicer or the WebSocket
route, on loopback.  ``carrier`` (a fixture in ``tests/conftest.py``, parametrized over :data:`CARRIERS`) gives a :class:`Carrier` whose :meth:`Carrier.channel`
makes the channel a test hands :class:`~edge_sdk.protocol.connection.CloudConnection`:

    def test_x(carrier):
        connection = CloudConnection(carrier.channel(lambda: LyingCloud(...)))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from cloud_adapter.limits import Admission, Limits
from edge_sdk.protocol.channels import CloudSessionHandler, InProcessChannel, MessageChannel

#: the carriers every suite that takes the ``carrier`` fixture runs over
CARRIERS = ("in_process", "grpc", "websocket")
#: the carriers that cross a network (a server on loopback)
NETWORK_CARRIERS = tuple(name for name in CARRIERS if name != "in_process")


class ServedSession:
    """An in-process cloud session as the stream driver runs it: the fields its logs read, the end it watches."""

    def __init__(self, handler: CloudSessionHandler) -> None:
        self.handler = handler
        self.session_id: str | None = None
        self.finished = False
        self.finish_reason: str | None = None
        self.started_at = time.monotonic()
        self.steps = self.bytes_up = self.bytes_down = self.forwards = self.confirmed = 0

    def handle(self, message: Any) -> Iterator[Any]:
        if message.WhichOneof("kind") == "open":
            self.session_id = "served"
        for reply in self.handler.handle(message):
            if reply.WhichOneof("kind") == "finished":
                self.finished, self.finish_reason = True, reply.finished.reason
            yield reply

    def can_draft(self) -> bool:
        can_draft = getattr(self.handler, "can_draft", None)
        return bool(can_draft is not None and can_draft())

    def draft(self) -> Iterator[Any]:
        return self.handler.draft()  # type: ignore[attr-defined]

    def abandon(self, reason: str) -> None:
        if not self.finished:
            self.handler.abandon(reason)


class FakeEngine:
    """What the carriers' servers need of an engine, opening each stream's session from ``factory``; ``opened_at``
    records when each stream began (the driver asks for its session at the stream's start)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.admission = Admission(self.limits)
        self.runner = None
        self.factory: Callable[[], CloudSessionHandler] | None = None
        self.opened_at: list[float] = []

    def warm_up(self) -> None:
        pass

    def session(self, client_id: str) -> ServedSession:
        self.opened_at.append(time.perf_counter())
        assert self.factory is not None, "set the cloud's session factory first"
        return ServedSession(self.factory())


class Carrier:
    """One carrier over loopback, serving ``engine`` (``in_process``: no server at all)."""

    def __init__(self, name: str, engine: FakeEngine, address: str = "", url: str = "") -> None:
        self.name, self.engine, self.address, self.url = name, engine, address, url
        self._grpc: Any = None

    def channel(self, factory: Callable[[], CloudSessionHandler]) -> MessageChannel:
        """A fresh channel to a session ``factory`` opens (over a real server unless in process)."""
        if self.name == "in_process":
            return InProcessChannel(factory())
        self.engine.factory = factory
        if self.name == "grpc":
            import grpc

            from edge_sdk.protocol.channels import GrpcChannel

            if self._grpc is None:
                self._grpc = grpc.insecure_channel(self.address)
            return GrpcChannel(self._grpc, timeout_s=30.0)
        from edge_sdk.protocol.websocket import WebSocketChannel

        return WebSocketChannel(self.url, timeout_s=30.0)

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()


def served(name: str, engine: FakeEngine, **server: Any) -> Iterator[Carrier]:
    """``engine`` served over carrier ``name`` on loopback until the generator is closed."""
    if name == "in_process":
        yield Carrier(name, engine)
        return
    if name == "grpc":
        from cloud_adapter.server import build_server

        server_, port = build_server(engine, address="127.0.0.1:0", max_workers=16, **server)  # type: ignore[arg-type]
        server_.start()
        carrier = Carrier(name, engine, address=f"127.0.0.1:{port}")
        try:
            yield carrier
        finally:
            carrier.close()
            server_.stop(None).wait()
        return
    from cloud_adapter.websocket import DECODE_PATH, start_websocket_server

    ws = start_websocket_server(engine, host="127.0.0.1", port=0, **server)  # type: ignore[arg-type]
    try:
        yield Carrier(name, engine, url=f"ws://127.0.0.1:{ws.port}{DECODE_PATH}")
    finally:
        ws.shutdown()
