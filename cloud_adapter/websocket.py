"""The WebSocket face of the cloud adapter: the ``Decode`` stream at ``/coveil/v1/decode`` (what browsers speak).

The same stream as gRPC's, driven by the same :func:`~cloud_adapter.stream.run_stream` (same admission, limits,
transcripts and per-client accounting), beside it on ``--ws-port``:

* the client offers the subprotocol ``coveil.v1`` (the upgrade is refused otherwise: HTTP 400);
* auth: ``Authorization: Bearer <token>``, or, from a browser (which cannot set headers), a second offered
  subprotocol ``coveil.bearer.<base64url(token), no padding>`` that the server never echoes; without a valid
  token the upgrade is refused with HTTP 401;
* every *binary* message is one serialized protobuf, ``EdgeMessage`` up, ``CloudMessage`` down; a text message
  closes the stream with 1003;
* a normal end is close code 1000 after the cloud's last message; an error is ``4000 + gRPC status code`` with
  the status message (:func:`edge_sdk.protocol.status.close_frame`);
* once the model worker died, or the server began to stop, a new upgrade is refused with HTTP 503 (what gRPC's
  health check says NOT_SERVING for, and its server's stop refuses); streams already running go on.

Served by the ``websockets`` library's threaded server: one thread per connection, as gRPC's pool gives each
stream one.
"""

from __future__ import annotations

import base64
import binascii
import http
import ipaddress
import logging
import ssl
import threading
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import Server, ServerConnection, serve

from cloud_adapter.stream import BearerTokens, StreamEngine, log_event, run_stream
from edge_sdk.protocol.status import CloudError, close_frame
from edge_sdk.protocol.websocket import SUBPROTOCOL, load_pem_chain

if TYPE_CHECKING:
    from websockets.http11 import Request, Response

    from cloud_adapter.server import TlsConfig

#: the route of the ``Decode`` stream
DECODE_PATH = "/coveil/v1/decode"
#: the prefix of the subprotocol that carries a browser's bearer token
BEARER_SUBPROTOCOL = "coveil.bearer."
#: close code of a text message (RFC 6455: data the endpoint cannot accept)
UNSUPPORTED_DATA = 1003


def bearer_subprotocol(token: str) -> str:
    """The subprotocol that carries ``token`` for a client that cannot set headers: ``coveil.bearer.`` and the
    token in base64url without padding."""
    return BEARER_SUBPROTOCOL + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")


def _offered(request: Request) -> list[str]:
    return [p.strip() for value in request.headers.get_all("Sec-WebSocket-Protocol") for p in value.split(",")]


def _presented(request: Request) -> str:
    """The ``Authorization`` value the request carries: its header, else the one its bearer subprotocol encodes."""
    header = request.headers.get("Authorization")
    if header is not None:
        return header
    for offered in _offered(request):
        if offered.startswith(BEARER_SUBPROTOCOL):
            encoded = offered.removeprefix(BEARER_SUBPROTOCOL)
            try:
                return "Bearer " + base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, UnicodeDecodeError):
                return ""
    return ""


def _host_identity(address: tuple[str, ...] | str) -> str:
    """The identity of a caller when no tokens are configured: its host, as gRPC names its peers (``ipv4:1.2.3.4``,
    ``ipv6:[::1]``), so one host is one client over both carriers."""
    host = address[0] if isinstance(address, tuple) else str(address)
    try:
        return f"ipv4:{host}" if ipaddress.ip_address(host).version == 4 else f"ipv6:[{host}]"
    except ValueError:
        return host


class DecodeRoute:
    """Refuses upgrades that are not a ``Decode`` stream, not authenticated, or come when no new stream is taken
    (:meth:`refuse_new`), and runs each accepted one."""

    def __init__(self, engine: StreamEngine, tokens: BearerTokens) -> None:
        self._engine, self._tokens = engine, tokens
        self.refusal: str | None = None  # why no new stream is taken (None: they are)

    def refuse_new(self, reason: str) -> None:
        """From now on refuse every new upgrade with HTTP 503 saying ``reason``; running streams go on."""
        self.refusal = self.refusal or reason

    def _client_id(self, connection: ServerConnection, request: Request) -> str | None:
        if not self._tokens:
            return _host_identity(connection.remote_address)
        return self._tokens.identify(_presented(request))

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """The HTTP answer that refuses the upgrade, or ``None`` to accept it."""
        if request.path.split("?", 1)[0] != DECODE_PATH:
            return connection.respond(http.HTTPStatus.NOT_FOUND, f"the Decode stream is at {DECODE_PATH}\n")
        if SUBPROTOCOL not in _offered(request):
            return connection.respond(http.HTTPStatus.BAD_REQUEST, f"offer the subprotocol {SUBPROTOCOL}\n")
        if self._client_id(connection, request) is None:
            log_event(logging.WARNING, "unauthenticated_call")
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or invalid bearer token: send "
                                      "'Authorization: Bearer <token>' or the subprotocol coveil.bearer.<token>\n")
        if self.refusal is not None:
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, f"not serving: {self.refusal}\n")
        return None

    @staticmethod
    def select_subprotocol(connection: ServerConnection, offered: Collection[str]) -> str | None:
        return SUBPROTOCOL if SUBPROTOCOL in offered else None  # never the bearer one

    def __call__(self, connection: ServerConnection) -> None:
        """One accepted stream: its binary messages through :func:`run_stream`, its replies back, then the close."""
        assert connection.request is not None
        client_id = self._client_id(connection, connection.request)
        assert client_id is not None, "process_request refused it"
        try:
            for reply in run_stream(self._engine, client_id, self._requests(connection)):
                connection.send(reply.SerializeToString())
        except CloudError as exc:
            connection.close(*close_frame(exc.code, exc.message))
        except ConnectionClosed:
            return  # the edge went away (run_stream's end abandoned the session)
        else:
            connection.close(1000)

    @staticmethod
    def _requests(connection: ServerConnection) -> Iterator[bytes]:
        """The stream's binary messages until the edge closes; a text message closes it with 1003."""
        for message in connection:
            if isinstance(message, str):
                connection.close(UNSUPPORTED_DATA, "coveil.v1 carries binary protobuf messages, not text")
                return
            yield message


def _server_context(tls: TlsConfig) -> ssl.SSLContext:
    """An SSL context serving ``tls``'s chain and key, requiring a client certificate from its CA when it has one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_pem_chain(context, tls.cert_chain, tls.private_key)
    if tls.client_ca is not None:
        context.load_verify_locations(cadata=tls.client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class WebSocketServer:
    """The WebSocket server :func:`start_websocket_server` started: its ``port``; :meth:`stop_accepting` then
    :meth:`shutdown` (running streams close with 1001)."""

    def __init__(self, server: Server, route: DecodeRoute) -> None:
        self._server, self.route = server, route
        self.port = int(server.socket.getsockname()[1])

    def stop_accepting(self, reason: str = "the server is shutting down") -> None:
        self.route.refuse_new(reason)

    def shutdown(self) -> None:
        self.stop_accepting()
        self._server.shutdown()


def start_websocket_server(
    engine: StreamEngine, *, host: str, port: int, token: str | Collection[str] | None = None,
    tls: TlsConfig | None = None,
) -> WebSocketServer:
    """A WebSocket server for ``engine`` serving on a thread (``port`` 0 picks one); it refuses new streams once
    the engine's model worker died.  ``token`` and ``tls`` as gRPC's (:func:`cloud_adapter.server.build_server`)."""
    route = DecodeRoute(engine, BearerTokens(token))
    server = serve(route, host.strip("[]"), port, ssl=_server_context(tls) if tls is not None else None,
                   process_request=route.process_request, select_subprotocol=route.select_subprotocol,
                   compression=None,  # compressed sizes would depend on the content: padding fixes sizes
                   max_size=engine.limits.max_message_bytes, max_queue=engine.limits.inbox_messages)
    runner = getattr(engine, "runner", None)
    death_callbacks = getattr(runner, "on_death", None)
    if death_callbacks is not None:
        death_callbacks.append(lambda: route.refuse_new("the model worker died"))
        if getattr(runner, "died", False):  # it died before the callback was in place
            route.refuse_new("the model worker died")
    threading.Thread(target=server.serve_forever, name="coveil-websocket", daemon=True).start()
    return WebSocketServer(server, route)
