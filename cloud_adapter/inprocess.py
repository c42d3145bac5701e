"""A cloud adapter served in this process, for the harness, the tests and the benchmarks.

:func:`serving` starts the same gRPC server ``coveil-cloud serve`` runs
(:func:`cloud_adapter.server.build_server`: the model warmed up, health SERVING)
on a loopback port and stops it on leaving the block, as vLLM's test helper
``RemoteOpenAIServer`` does for its server::

    with serving(CloudEngine(llm, runner=batcher), token="secret") as adapter:
        with EdgeClient(adapter.address, slm=slm, credentials=Credentials(token="secret", plaintext=True)):
            ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.server import TlsConfig


@dataclass(frozen=True)
class InProcessAdapter:
    """A started adapter: where it listens (``address`` = ``host:port``) and its gRPC server; ``ws_url``: its
    WebSocket route's URL when it serves one."""

    address: str
    port: int
    server: grpc.Server
    ws_url: str | None = None


@contextlib.contextmanager
def serving(
    engine: CloudEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | Collection[str] | None = None,
    tls: TlsConfig | None = None,
    max_workers: int = 32,
    grace_s: float | None = None,
    ws_port: int | None = None,
) -> Iterator[InProcessAdapter]:
    """Serve ``engine`` on ``host:port`` (``0``: a free port) until the block ends, then stop the server and
    wait until it has stopped (streams still open get ``grace_s`` seconds; ``None``: cancelled at once).

    ``token``, ``tls`` and ``max_workers`` are :func:`~cloud_adapter.server.build_server`'s; ``ws_port``: also the
    WebSocket route on that port (0: a free one).  The engine (and its runner) belong to the caller: they outlive
    the server.
    """
    from cloud_adapter.server import build_server

    server, bound = build_server(engine, address=f"{host}:{port}", token=token, tls=tls, max_workers=max_workers)
    server.start()
    websocket, ws_url = None, None
    try:
        if ws_port is not None:
            from cloud_adapter.websocket import DECODE_PATH, start_websocket_server

            websocket = start_websocket_server(engine, host=host, port=ws_port, token=token, tls=tls)
            ws_url = f"{'wss' if tls else 'ws'}://{host}:{websocket.port}{DECODE_PATH}"
        yield InProcessAdapter(f"{host}:{bound}", bound, server, ws_url)
    finally:
        if websocket is not None:
            websocket.stop_accepting()
        server.stop(grace_s).wait()
        if websocket is not None:
            websocket.shutdown()
