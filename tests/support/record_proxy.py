"""Proxies on the path between the edge and a TLS adapter that record what an on-path observer sees.

:class:`RecordLengths` forwards bytes and reads the TLS record headers (lengths, per direction, in order: all an
observer of a TLS connection reads).  :class:`Http2Frames` terminates the edge's TLS with a certificate of the test CA
and opens its own to the adapter, so it can tell the DATA frames that carry the gRPC messages from the flow-control
and ping frames gRPC adds to a record whenever it happens to flush them together.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from collections.abc import Callable

#: HTTP/2 frame types
DATA = 0
#: the client's connection preface, before its first frame
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class _Forwarder:
    """Listens on loopback and hands each accepted connection, with a fresh one to ``target``, to ``_pump``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        host, port = self.target.rsplit(":", 1)
        while True:
            try:
                edge, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connected, args=(edge, host, int(port)), daemon=True).start()

    def _connected(self, edge: socket.socket, host: str, port: int) -> None:
        cloud = self._wrap(edge, socket.create_connection((host, port)), host)
        if cloud is None:
            return
        edge_side, cloud_side = cloud
        threading.Thread(target=self._pump, args=(edge_side, cloud_side, "up"), daemon=True).start()
        self._pump(cloud_side, edge_side, "down")

    def _wrap(self, edge: socket.socket, cloud: socket.socket, host: str) -> tuple[socket.socket, socket.socket] | None:
        return edge, cloud

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        parse = self._parser(direction)
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                for sock in (source, sink):
                    try:
                        sock.close()
                    except OSError:
                        pass
                return
            with self._lock:
                parse(data)
            try:
                sink.sendall(data)
            except OSError:
                return

    def _parser(self, direction: str) -> Callable[[bytes], None]:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()


class RecordLengths(_Forwarder):
    """A plain TCP forwarder that reads the TLS record headers passing through it: ``records[direction]``, the
    lengths in order, as an on-path observer of a TLS connection reads them (nothing else)."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.records: dict[str, list[int]] = {"up": [], "down": []}

    def clear(self) -> None:
        with self._lock:
            self.records = {"up": [], "down": []}

    def _parser(self, direction: str) -> Callable[[bytes], None]:
        pending = [b""]

        def parse(data: bytes) -> None:
            buffer = pending[0] + data
            while len(buffer) >= 5:
                length = int.from_bytes(buffer[3:5], "big")
                if len(buffer) < 5 + length:
                    break
                self.records[direction].append(length)
                buffer = buffer[5 + length:]
            pending[0] = buffer

        return parse


class Http2Frames(_Forwarder):
    """Terminates the edge's TLS (``cert_pem``/``key_pem``, of the CA the edge trusts) and opens its own to
    ``target`` (verified against ``ca_pem``), recording the HTTP/2 frames of each direction:
    ``frames[direction]``, ``(type, length)`` in order."""

    def __init__(self, target: str, *, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, workdir: str) -> None:
        with open(f"{workdir}/proxy.pem", "wb") as out:
            out.write(cert_pem + key_pem)
        self._serve = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._serve.load_cert_chain(f"{workdir}/proxy.pem")
        self._serve.set_alpn_protocols(["h2"])
        self._connect = ssl.create_default_context(cadata=ca_pem.decode())
        self._connect.set_alpn_protocols(["h2"])
        self.frames: dict[str, list[tuple[int, int]]] = {"up": [], "down": []}
        super().__init__(target)

    def clear(self) -> None:
        with self._lock:
            self.frames = {"up": [], "down": []}

    def data_frames(self, direction: str) -> list[int]:
        """The lengths of the DATA frames that carry bytes (a gRPC message and its 5-byte prefix each, here)."""
        return [length for kind, length in self.frames[direction] if kind == DATA and length]

    def _connected(self, edge: socket.socket, host: str, port: int) -> None:
        """One thread per connection (OpenSSL's objects take no concurrent read and write): whichever side has
        bytes is read and its bytes forwarded."""
        wrapped = self._wrap(edge, socket.create_connection((host, port)), host)
        if wrapped is None:
            return
        sides = {wrapped[0]: (wrapped[1], self._parser("up")), wrapped[1]: (wrapped[0], self._parser("down"))}
        while True:
            ready = [sock for sock in sides if isinstance(sock, ssl.SSLSocket) and sock.pending()]
            ready = ready or select.select(list(sides), [], [], 1.0)[0]
            for source in ready:
                sink, parse = sides[source]
                try:
                    data = source.recv(65536)
                    if data:
                        with self._lock:
                            parse(data)
                        sink.sendall(data)
                except (OSError, ssl.SSLError):
                    data = b""
                if not data:
                    for sock in sides:
                        sock.close()
                    return

    def _wrap(self, edge: socket.socket, cloud: socket.socket, host: str) -> tuple[socket.socket, socket.socket] | None:
        try:
            return (self._serve.wrap_socket(edge, server_side=True),
                    self._connect.wrap_socket(cloud, server_hostname=host))
        except (OSError, ssl.SSLError):
            edge.close()
            cloud.close()
            return None

    def _parser(self, direction: str) -> Callable[[bytes], None]:
        pending, preface = [b""], [direction == "up"]

        def parse(data: bytes) -> None:
            buffer = pending[0] + data
            if preface[0]:
                if len(buffer) < len(PREFACE):
                    pending[0] = buffer
                    return
                buffer, preface[0] = buffer[len(PREFACE):], False
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                self.frames[direction].append((buffer[3], length))
                buffer = buffer[9 + length:]
            pending[0] = buffer

        return parse
