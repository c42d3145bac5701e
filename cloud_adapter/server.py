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

import hashlib
import hmac
import logging
import queue
import signal
import threading
import time
import traceback
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cloud_adapter.engine import CloudEngine
from cloud_adapter.session import SessionHandler
from edge_sdk._wire import coveil_pb2, coveil_pb2_grpc
from edge_sdk.status import CloudError

log = logging.getLogger(__name__)

#: the service name under which gRPC health checking reports the decoder
SERVICE_NAME: str = coveil_pb2.DESCRIPTOR.services_by_name["CollaborativeDecoding"].full_name


def log_event(level: int, event: str, **fields: Any) -> None:
    """Log ``event`` with structured ``fields`` (rendered as JSON or ``key=value`` by the CLI's formatters)."""
    log.log(level, event, extra={"fields": fields})


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


def _client_label(token: str) -> str:
    """A stable identity for a token that does not reveal it."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def _peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5555`` → ``ipv4:127.0.0.1`` (one identity per host, not per connection)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class _Inbox:
    """Reads a stream's requests on a helper thread so that its handler can wait with a timeout.

    :meth:`get` returns the next message, ``None`` once the stream has ended
    (the edge half-closed, cancelled or disconnected), and raises
    ``queue.Empty`` when nothing came within ``timeout`` seconds.  At most
    ``capacity`` messages are read ahead: beyond that the reader waits, and
    gRPC's flow control holds the edge back.
    """

    _END = object()

    def __init__(self, requests: Iterator[Any], capacity: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._closed = threading.Event()
        threading.Thread(target=self._read, args=(requests,), name="coveil-stream-reader", daemon=True).start()

    def _read(self, requests: Iterator[Any]) -> None:
        try:
            for message in requests:
                while not self._closed.is_set():
                    try:
                        self._queue.put(message, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self._closed.is_set():
                    return
        except grpc.RpcError:
            pass  # cancelled or disconnected: the stream simply ends
        finally:
            try:
                self._queue.put_nowait(self._END)
            except queue.Full:
                pass  # nobody reads any more: the handler has gone

    def get(self, timeout: float | None) -> Any | None:
        """``timeout=None``: do not wait (``queue.Empty`` when nothing is there yet)."""
        item = self._queue.get(block=False) if timeout is None else self._queue.get(timeout=timeout)
        return None if item is self._END else item

    def close(self) -> None:
        """The handler is done: a reader blocked on a full queue lets go."""
        self._closed.set()


class _UnopenedPlace:
    """A stream's place among the unopened streams, given back exactly once (when it opens or ends)."""

    def __init__(self, engine: CloudEngine, client_id: str) -> None:
        self._engine, self._client_id = engine, client_id
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._engine.admission.stream_done(self._client_id)


class DecodeServicer(coveil_pb2_grpc.CollaborativeDecodingServicer):
    """Runs one :class:`SessionHandler` per ``Decode`` stream.

    Args:
        engine: the shared cloud engine.
        tokens: accepted bearer tokens; empty = no authentication.
    """

    def __init__(self, engine: CloudEngine, tokens: Collection[str] = ()) -> None:
        self._engine = engine
        self._clients: Mapping[str, str] = {token: _client_label(token) for token in tokens}

    def Decode(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        """One stream: ``request_iterator`` yields each request's raw bytes (see :func:`add_decode_service`)."""
        client_id = self._authenticate(context)
        try:
            self._engine.admission.admit_stream(client_id)
        except CloudError as exc:
            log_event(logging.WARNING, "stream_refused", status=exc.code)
            context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        unopened = _UnopenedPlace(self._engine, client_id)
        handler = self._engine.session(client_id)
        inbox = _Inbox(request_iterator, self._engine.limits.inbox_messages)
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            yield from self._drive(handler, inbox, unopened)
        except CloudError as exc:
            handler.abandon("idle" if exc.code == "DEADLINE_EXCEEDED" else "error")
            log_event(logging.INFO, "session_refused", session_id=handler.session_id, status=exc.code,
                      steps=handler.steps)
            status = (getattr(grpc.StatusCode, exc.code), exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug: report it without the data, keep serving the others
            handler.abandon("error")
            log_event(logging.ERROR, "internal_error", session_id=handler.session_id, error_type=type(exc).__name__,
                      traceback="".join(traceback.format_tb(exc.__traceback__)))
            status = (grpc.StatusCode.INTERNAL, f"internal error in session {handler.session_id}; the server logged it")
        finally:
            inbox.close()
            unopened.release()
            handler.abandon("cancelled")  # no-op unless the edge went away mid-session
            if handler.session_id is not None:
                log_event(logging.INFO, "session_ended", session_id=handler.session_id, reason=handler.finish_reason,
                          steps=handler.steps, duration_ms=round(1000 * (time.monotonic() - handler.started_at), 1),
                          bytes_up=handler.bytes_up, bytes_down=handler.bytes_down, forwards=handler.forwards,
                          forwards_per_token=round(handler.forwards / max(1, handler.confirmed), 3))
        if status is not None:
            context.abort(*status)

    def _drive(self, handler: SessionHandler, inbox: _Inbox, unopened: _UnopenedPlace) -> Iterator[Any]:
        limits = self._engine.limits
        while not handler.finished:
            opening = handler.session_id is None
            timeout_s = limits.open_timeout_s if opening else limits.idle_timeout_s
            try:
                if not opening and handler.can_draft():  # run-ahead: draft while the edge has not spoken
                    try:
                        message = inbox.get(timeout=None)
                    except queue.Empty:
                        yield from handler.draft()
                        continue
                else:
                    message = inbox.get(timeout=timeout_s)
            except queue.Empty:
                what = "stream sent no open" if opening else "session idle"
                raise CloudError("DEADLINE_EXCEEDED", f"{what} for {timeout_s:g} s") from None
            if message is None:
                return
            message = _parse_edge_message(message)
            unopened.release()  # it has spoken: from here on the session limits apply
            for reply in handler.handle(message):
                if opening and handler.session_id is not None:
                    opening = False
                    log_event(logging.INFO, "session_opened", session_id=handler.session_id,
                              open_ms=round(1000 * (time.monotonic() - handler.started_at), 1))
                yield reply

    def _authenticate(self, context: grpc.ServicerContext) -> str:
        """The caller's identity: its token's label, or its host when no tokens are configured."""
        if not self._clients:
            return _peer_host(context.peer())
        header = dict(context.invocation_metadata()).get("authorization", "")
        scheme, _, presented = str(header).partition(" ")
        if scheme.lower() == "bearer":
            matches = [label for token, label in self._clients.items()
                       if hmac.compare_digest(presented.strip().encode(), token.encode())]
            if matches:
                return matches[0]
        log_event(logging.WARNING, "unauthenticated_call")
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or invalid bearer token: send metadata 'authorization: Bearer <token>'")
        raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def _parse_edge_message(data: bytes) -> Any:
    """One request's bytes as an ``EdgeMessage``, or ``INVALID_ARGUMENT``.

    gRPC is handed no deserializer (:func:`add_decode_service`): bytes that are not a protobuf raised inside gRPC's
    own request iterator leaked the stream's state and, after a few such streams, kept ``server.stop()`` from
    returning. Parsed here, they end the stream like any other protocol error.
    """
    try:
        return coveil_pb2.EdgeMessage.FromString(data)
    except DecodeError:
        raise CloudError("INVALID_ARGUMENT", "a request is not a valid coveil.v1.EdgeMessage") from None


def add_decode_service(servicer: DecodeServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as ``coveil.v1.CollaborativeDecoding`` with requests passed as bytes (parsed by the
    handler, :func:`_parse_edge_message`) and replies serialized by gRPC."""
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
    if any(not t or not t.strip() for t in tokens):
        raise ValueError("an empty bearer token would authenticate anyone who sends none: remove it")
    if not tokens:
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
) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting and give in-flight streams ``grace_s`` to finish.

    Must run in the main thread (it installs the signal handlers).
    """
    server, port, health_servicer = _assemble(engine, address=address, token=token, tls=tls, max_workers=max_workers)
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
        server.stop(grace_s).wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log_event(logging.INFO, "stopped", active_sessions=engine.active_sessions)
