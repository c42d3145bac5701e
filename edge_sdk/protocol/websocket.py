"""The WebSocket carrier: a session's ``Decode`` stream over a WebSocket (``ws://`` or ``wss://``), beside gRPC.

The cloud adapter serves it with ``coveil-cloud serve --ws-port PORT`` at ``/coveil/v1/decode``
(:mod:`cloud_adapter.websocket`).  Each binary message is one serialized protobuf; the client offers the
subprotocol ``coveil.v1`` and sends ``Authorization: Bearer <token>``; the stream ends with close code 1000, or
``4000 + gRPC status`` with the status message (:func:`edge_sdk.protocol.status.status_of_close` maps it back to the
:class:`~edge_sdk.protocol.status.CloudError` gRPC would raise).  Compression is off on both sides: a compressed message's
size would depend on its content, which padding exists to hide.

    client = EdgeClient("wss://cloud.example:8443/coveil/v1/decode", slm=slm, credentials=Credentials(token="..."))
"""

from __future__ import annotations

import ssl
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from edge_sdk.protocol.channels import is_loopback
from edge_sdk.protocol.status import RETRYABLE_CODES, CloudError, status_of_close

if TYPE_CHECKING:
    from edge_sdk._wire.coveil_pb2 import CloudMessage, EdgeMessage

#: the subprotocol of the ``Decode`` stream
SUBPROTOCOL = "coveil.v1"
#: the largest message the edge accepts from the cloud (a dense row of a 262,144-id vocabulary is 1 MiB)
MAX_MESSAGE_BYTES = 64 << 20
#: what an HTTP status that refused the upgrade means as a session's status
_REFUSED = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "UNIMPLEMENTED",
            429: "RESOURCE_EXHAUSTED"}


class Credentials(Protocol):
    """The token and TLS material a carrier reads (``edge_sdk.client.Credentials``)."""

    token: str | None
    root_cert: bytes | None
    client_cert: bytes | None
    client_key: bytes | None
    plaintext: bool


class WebSocketChannel:
    """One ``Decode`` stream on a WebSocket connection, opened by the first :meth:`send` (the carrier duties of
    :class:`~edge_sdk.protocol.channels.MessageChannel`); :meth:`send` returns once the message is written to the socket
    (the ``websockets`` library's synchronous send writes before it returns)."""

    crosses_network = True

    def __init__(self, url: str, *, token: str | None = None, ssl_context: ssl.SSLContext | None = None,
                 timeout_s: float | None = None) -> None:
        self._url, self._token, self._ssl, self._timeout_s = url, token, ssl_context, timeout_s
        self._connection: Any = None
        self._deadline: float | None = None

    def _begun(self) -> Any:
        if self._connection is not None:
            return self._connection
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect

        if self._timeout_s is not None:
            self._deadline = time.monotonic() + self._timeout_s
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            self._connection = connect(
                self._url, subprotocols=[SUBPROTOCOL], additional_headers=headers, ssl=self._ssl,
                compression=None, max_size=MAX_MESSAGE_BYTES, open_timeout=min(10.0, self._timeout_s or 10.0),
                legacy=True)  # the connection itself, not a context manager (it lives across calls)
        except InvalidStatus as exc:
            status = exc.response.status_code
            code = _REFUSED.get(status, "UNAVAILABLE" if status >= 500 else "UNKNOWN")
            raise CloudError(code, f"the cloud refused the WebSocket upgrade: HTTP {status}",
                             retryable=code in RETRYABLE_CODES) from None
        except (OSError, TimeoutError, WebSocketException) as exc:  # refused, TLS, a broken handshake
            raise CloudError("UNAVAILABLE", f"cannot open a WebSocket to the cloud: {exc}", retryable=True) from None
        if self._connection.subprotocol != SUBPROTOCOL:
            self._connection.close()
            raise CloudError("UNIMPLEMENTED", f"the server did not select the subprotocol {SUBPROTOCOL}")
        return self._connection

    def send(self, message: EdgeMessage) -> None:
        from websockets.exceptions import ConnectionClosed

        connection = self._begun()
        try:
            connection.send(message.SerializeToString())
        except ConnectionClosed:
            return  # the stream ended: receive() reports why

    def receive(self) -> CloudMessage:
        from google.protobuf.message import DecodeError
        from websockets.exceptions import ConnectionClosed

        from edge_sdk._wire.coveil_pb2 import CloudMessage

        connection = self._begun()
        remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        try:
            data = connection.recv(timeout=remaining)
        except TimeoutError:
            raise CloudError("DEADLINE_EXCEEDED", f"the session ran past its {self._timeout_s:g} s deadline",
                             retryable=True) from None
        except ConnectionClosed as exc:
            close = exc.rcvd
            raise status_of_close(close.code if close else None, close.reason if close else "") from None
        if isinstance(data, str):
            connection.close(1003, "coveil.v1 carries binary protobuf messages, not text")
            raise CloudError("INTERNAL", "the cloud sent a text message", retryable=True)
        try:
            return CloudMessage.FromString(data)
        except DecodeError:
            raise CloudError("INTERNAL", "the cloud sent a message that is not a CloudMessage", retryable=True) from None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()


class WebSocketCarrier:
    """A carrier factory (``EdgeClient(channel=...)``): a fresh :class:`WebSocketChannel` to ``url`` per session,
    with ``credentials``' token and TLS material (``ws://`` only with ``plaintext=True`` to a loopback host,
    ``wss://`` otherwise; the server is verified against ``root_cert`` or the system's roots)."""

    def __init__(self, url: str, credentials: Credentials, *, timeout_s: float | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"a WebSocket cloud is a ws:// or wss:// URL with a host, got {url!r}")
        if (parts.scheme == "ws") != credentials.plaintext:
            raise ValueError("ws:// is plaintext: pass Credentials(plaintext=True) (loopback only), or use wss://")
        if parts.scheme == "ws" and not is_loopback(parts.hostname):
            raise ValueError(f"refusing plaintext to {parts.hostname}: it is not a loopback address; use wss://")
        self.url = url if parts.path not in ("", "/") else url.rstrip("/") + "/coveil/v1/decode"
        self._token, self._timeout_s = credentials.token, timeout_s
        self._ssl = _client_context(credentials) if parts.scheme == "wss" else None

    def __call__(self) -> WebSocketChannel:
        return WebSocketChannel(self.url, token=self._token, ssl_context=self._ssl, timeout_s=self._timeout_s)

    def status(self, timeout_s: float = 1.0) -> str:
        """The route's state as ``EdgeClient.cloud_status`` reports it: ``"serving"`` (it accepts a stream),
        ``"not_serving"`` (it refuses with HTTP 5xx), ``"unreachable"`` (no answer within ``timeout_s``), or
        ``"unknown"`` (another refusal, e.g. a token it does not accept).  The probe opens a stream, sends nothing
        and closes it."""
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect

        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            with connect(self.url, subprotocols=[SUBPROTOCOL], additional_headers=headers, ssl=self._ssl,
                         compression=None, open_timeout=timeout_s, close_timeout=timeout_s):
                return "serving"
        except InvalidStatus as exc:
            return "not_serving" if exc.response.status_code >= 500 else "unknown"
        except (OSError, TimeoutError, WebSocketException):
            return "unreachable"


def _client_context(credentials: Credentials) -> ssl.SSLContext:
    """Verifies the server against ``root_cert`` (else the system's roots); presents the client pair for mTLS."""
    context = ssl.create_default_context(cadata=credentials.root_cert.decode() if credentials.root_cert else None)
    if credentials.client_cert is not None and credentials.client_key is not None:
        load_pem_chain(context, credentials.client_cert, credentials.client_key)
    return context


def load_pem_chain(context: ssl.SSLContext, chain: bytes, key: bytes) -> None:
    """Load a PEM certificate chain and its key into ``context`` (through a private temporary directory: ``ssl``
    loads a chain only from files)."""
    with tempfile.TemporaryDirectory(prefix="coveil-tls-") as folder:
        chain_file, key_file = Path(folder, "chain.pem"), Path(folder, "key.pem")
        chain_file.write_bytes(chain)
        key_file.touch(mode=0o600)
        key_file.write_bytes(key)
        context.load_cert_chain(chain_file, key_file)
