"""The gRPC face of the cloud adapter: ``coveil.v1.CollaborativeDecoding/Decode``.

A synchronous ``grpc.server`` gives each stream one pool thread, which drives
one :class:`~cloud_adapter.session.SessionHandler`; the model itself runs on
the engine's runner (a :class:`~cloud_adapter.runners.StepBatcher` in
production), never on a stream's thread.

Every stream holds a pool thread, so streams are bounded before they cost
anything: at most ``Limits.max_unopened_streams`` may wait for their open
(each for at most ``Limits.open_timeout_s``), at most ``Limits.max_sessions``
decode, and the pool keeps threads beyond both for health checks and refusals.

Security: an optional set of bearer tokens (metadata
``authorization: Bearer <token>``; each token is one client identity, without
tokens the identity is the peer's address), optional TLS or mTLS, per-client
session limits.  Logs carry only session ids, step counts, timings, byte
counts and status codes: never probabilities, token ids or text.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cloud_adapter.stream import BearerTokens, log_event, run_stream
from edge_sdk._wire import coveil_pb2, coveil_pb2_grpc
from edge_sdk.protocol.status import CloudError

if TYPE_CHECKING:  # the engine imports torch: a command line reads its TLS and token files before that
    from cloud_adapter.engine import CloudEngine

log = logging.getLogger(__name__)

#: the service name under which gRPC health checking reports the decoder
SERVICE_NAME: str = coveil_pb2.DESCRIPTOR.services_by_name["CollaborativeDecoding"].full_name


@dataclass(frozen=True)
class TlsConfig:
    """PEM-encoded server certificate chain and key; with ``client_ca``, clients must present a certificate (mTLS)."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = None

    def __repr__(self) -> str:
        return f"TlsConfig(cert_chain=<{len(self.cert_chain)} bytes>, private_key=<hidden>, mtls={self.client_ca is not None})"

    @classmethod
    def from_files(cls, cert: Path, key: Path, client_ca: Path | None = None) -> TlsConfig:
        return cls(
            cert_chain=Path(cert).read_bytes(),
            private_key=Path(key).read_bytes(),
            client_ca=Path(client_ca).read_bytes() if client_ca is not None else None,
        )

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def _peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5555`` → ``ipv4:127.0.0.1`` (one identity per host, not per connection)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class DecodeServicer(coveil_pb2_grpc.CollaborativeDecodingServicer):
    """Runs one :class:`SessionHandler` per ``Decode`` stream.

    Args:
        engine: the shared cloud engine.
        tokens: accepted bearer tokens; empty = no authentication.
    """

    def __init__(self, engine: CloudEngine, tokens: Collection[str] = ()) -> None:
        self._engine = engine
        self._tokens = BearerTokens(tokens)

    def Decode(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        """One stream: ``request_iterator`` yields each request's raw bytes (see :func:`add_decode_service`),
        driven by :func:`~cloud_adapter.stream.run_stream`; its error ends the stream with that status."""
        client_id = self._authenticate(context)
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            yield from run_stream(self._engine, client_id, request_iterator)
        except CloudError as exc:
            status = (getattr(grpc.StatusCode, exc.code), exc.message)
        if status is not None:
            context.abort(*status)

    def _authenticate(self, context: grpc.ServicerContext) -> str:
        """The caller's identity: its token's label, or its host when no tokens are configured."""
        if not self._tokens:
            return _peer_host(context.peer())
        client_id = self._tokens.identify(str(dict(context.invocation_metadata()).get("authorization", "")))
        if client_id is not None:
            return client_id
        log_event(logging.WARNING, "unauthenticated_call")
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or invalid bearer token: send metadata 'authorization: Bearer <token>'")
        raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def add_decode_service(servicer: DecodeServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as ``coveil.v1.CollaborativeDecoding`` with requests passed as bytes (parsed by the
    driver, :func:`~cloud_adapter.stream.parse_edge_message`) and replies serialized by gRPC."""
    method = grpc.stream_stream_rpc_method_handler(
        servicer.Decode, request_deserializer=None,
        response_serializer=coveil_pb2.CloudMessage.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Decode": method}),))


def _assemble(
    engine: CloudEngine,
    *,
    address: str,
    token: str | Collection[str] | None,
    tls: TlsConfig | None,
    max_workers: int,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    tokens = [token] if isinstance(token, str) else list(token or ())
    if not BearerTokens(tokens):
        log.warning("no bearer token configured: any client that reaches %s can open sessions", address)
    streams = engine.limits.max_sessions + engine.limits.max_unopened_streams
    if max_workers <= streams:
        log.warning("max_workers=%d leaves no thread beyond the %d streams (sessions and unopened) for health checks "
                    "and refusals", max_workers, streams)
    message_limit = engine.limits.max_message_bytes
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="coveil-rpc"),
        options=[
            ("grpc.max_receive_message_length", message_limit),
            ("grpc.max_send_message_length", message_limit),
            ("grpc.so_reuseport", 0),
            # edges ping every 20 s to notice a dead connection; allow it, also between sessions
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    add_decode_service(DecodeServicer(engine, tokens), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    start = time.perf_counter()
    engine.warm_up()
    log_event(logging.INFO, "model_warm", warm_up_ms=round(1000 * (time.perf_counter() - start), 1))
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    death_callbacks = getattr(engine.runner, "on_death", None)
    if death_callbacks is not None:

        def not_serving() -> None:
            """The model worker died: report NOT_SERVING, so a load balancer stops sending sessions here."""
            log_event(logging.ERROR, "model_worker_died")
            for service in ("", SERVICE_NAME):
                health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

        death_callbacks.append(not_serving)
    return server, port, health_servicer


def build_server(
    engine: CloudEngine,
    *,
    address: str,
    token: str | Collection[str] | None = None,
    tls: TlsConfig | None = None,
    max_workers: int = 32,
) -> tuple[grpc.Server, int]:
    """A ready, not yet started server for ``engine`` bound to ``address`` (``host:0`` picks a port).

    Warms the model up and reports SERVING to gRPC health checks before it
    returns.  ``token`` is one bearer token or several (one per client
    identity); ``None`` leaves the server open.  Returns ``(server, bound_port)``;
    call ``server.start()``.
    """
    server, port, _ = _assemble(engine, address=address, token=token, tls=tls, max_workers=max_workers)
    return server, port


def serve(
    engine: CloudEngine,
    *,
    address: str,
    token: str | Collection[str] | None = None,
    tls: TlsConfig | None = None,
    max_workers: int = 32,
    grace_s: float = 10.0,
    ws_port: int | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting and give in-flight streams ``grace_s`` to finish.

    ``ws_port``: also serve the stream over WebSocket on this port of the same host (0 picks one; ``None``: gRPC
    only), with the same tokens, TLS, limits and transcripts (:mod:`cloud_adapter.websocket`).  Must run in the
    main thread (it installs the signal handlers).
    """
    server, port, health_servicer = _assemble(engine, address=address, token=token, tls=tls, max_workers=max_workers)
    websocket = None
    if ws_port is not None:
        from cloud_adapter.websocket import start_websocket_server

        websocket = start_websocket_server(engine, host=address.rpartition(":")[0], port=ws_port, token=token, tls=tls)
        log_event(logging.INFO, "serving_websocket", port=websocket.port, path="/coveil/v1/decode",
                  tls=tls is not None)
    stop = threading.Event()

    def request_stop(signum: int, _frame: Any) -> None:
        log_event(logging.INFO, "shutdown_requested", signal=signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    server.start()
    log_event(logging.INFO, "serving", address=address, port=port, tls=tls is not None,
              mtls=tls is not None and tls.client_ca is not None, auth=bool(token))
    try:
        while not stop.wait(1.0):
            pass
    finally:
        health_servicer.enter_graceful_shutdown()
        if websocket is not None:  # no new stream on either carrier during the grace
            websocket.stop_accepting()
        server.stop(grace_s).wait()
        if websocket is not None:  # after gRPC's grace: its streams had as long; the rest close with 1001
            websocket.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log_event(logging.INFO, "stopped", active_sessions=engine.active_sessions)
