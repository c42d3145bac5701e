"""The review page: a local HTTP server over a build directory's :class:`~eval_harness.construction.review.ReviewLog`.

``GET /`` serves the page (three static files, nothing from the network), ``GET /api/items`` every proposed item
with its state and its private context cut into highlighted segments, ``POST /api/items/<id>`` one decision
(``{"status": ..., "spans": [...]}``), written to ``review.jsonl`` before the reply; a decision the rules refuse
gets ``400 {"error": ...}`` and changes nothing.

It listens on loopback only and answers only requests addressed to a loopback host (no DNS rebinding); it sends
no CORS headers and takes decisions only as ``application/json``, which a page of another origin cannot send
without a preflight this server never grants.

Loopback is not a credential: any local process (another user's included) can connect. So, as Jupyter does, each
run draws a secret (:func:`secrets.token_urlsafe`, 256 bits) and answers only a request that carries it: either
``?token=<secret>`` in the URL (the address printed and opened; the reply sets the secret as an ``HttpOnly``,
``SameSite=Strict`` cookie scoped to this port and redirects to the same path without it) or that cookie. Both
are compared in constant time (:func:`hmac.compare_digest`). Anything else gets ``403`` and no data.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from eval_harness.construction.review import ReviewLog

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"/": ("review.html", "text/html; charset=utf-8"),
                "/static/review.js": ("review.js", "text/javascript; charset=utf-8"),
                "/static/review.css": ("review.css", "text/css; charset=utf-8")}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
MAX_BODY = 1 << 20


def _host_is_loopback(host_header: str | None) -> bool:
    if not host_header:
        return False
    host = host_header.rsplit(":", 1)[0] if not host_header.startswith("[") else host_header.split("]")[0] + "]"
    return host in LOOPBACK_HOSTS


def _carries(secret: str, given: str | None) -> bool:
    """Whether ``given`` is ``secret``, compared in constant time (no timing oracle on a prefix)."""
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


class ReviewServer:
    """The review page over ``directory`` at ``http://127.0.0.1:<port>/?token=<secret>`` (``port=0``: any free port).

    ``url`` is the address to open (it carries this run's secret); ``base_url`` is the same without it, which the
    server refuses until the secret's cookie is set. ``serve_forever()`` blocks; ``start()`` serves from a daemon
    thread (for tests); ``close()`` stops.
    """

    def __init__(self, directory: str | Path, *, port: int = 0) -> None:
        self.log = ReviewLog(directory)
        self.directory = Path(directory)
        self.token = secrets.token_urlsafe(32)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.port = self._httpd.server_port
        self.cookie_name = f"coveil-review-{self.port}"  # cookies are not scoped by port: one name per server
        self.base_url = f"http://127.0.0.1:{self.port}/"
        self.url = f"{self.base_url}?token={self.token}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def _json(self, status: int, value: Any) -> None:
                self._send(status, json.dumps(value, ensure_ascii=False).encode(), "application/json")

            def _cookie_token(self) -> str | None:
                try:
                    morsel = SimpleCookie(self.headers.get("Cookie", "")).get(server.cookie_name)
                except CookieError:
                    return None
                return None if morsel is None else morsel.value

            def _refused(self) -> bool:
                if not _host_is_loopback(self.headers.get("Host")):
                    self._json(HTTPStatus.FORBIDDEN, {"error": "the review page answers only loopback hosts"})
                    return True
                if _carries(server.token, self._cookie_token()):
                    return False
                self._json(HTTPStatus.FORBIDDEN, {"error": "open the address decodeleak review printed (it carries "
                                                           "this run's secret)"})
                return True

            def _token_in_query(self) -> bool:
                """A GET whose ``?token=`` is the secret: set the cookie and redirect to the path without it."""
                given = parse_qs(urlsplit(self.path).query).get("token")
                if not given or not _carries(server.token, given[0]) or \
                        not _host_is_loopback(self.headers.get("Host")):
                    return False
                self.send_response(HTTPStatus.SEE_OTHER)
                self.send_header("Set-Cookie", f"{server.cookie_name}={server.token}; Path=/; HttpOnly; "
                                               "SameSite=Strict")
                self.send_header("Location", urlsplit(self.path).path)
                self.send_header("Content-Length", "0")
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                return True

            def do_GET(self) -> None:
                if self._token_in_query() or self._refused():
                    return
                path = urlsplit(self.path).path
                if path in STATIC_FILES:
                    name, content_type = STATIC_FILES[path]
                    self._send(HTTPStatus.OK, (STATIC_DIR / name).read_bytes(), content_type)
                elif path == "/api/items":
                    self._json(HTTPStatus.OK, {"directory": str(server.directory), "counts": server.log.counts(),
                                               "items": [entry.to_json() for entry in server.log.items()]})
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {path}"})

            def do_POST(self) -> None:
                if self._refused():
                    return
                path = urlsplit(self.path).path
                if not path.startswith("/api/items/"):
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {path}"})
                    return
                if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
                    self._json(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "send the decision as application/json"})
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0:
                    self._json(HTTPStatus.BAD_REQUEST, {"error": "Content-Length is not a byte count"})
                    return
                if length > MAX_BODY:
                    self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "decision too large"})
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                    if not isinstance(body, dict):
                        raise ValueError("a decision is an object {status, spans}")
                    entry = server.log.decide(unquote(path.removeprefix("/api/items/")), body.get("status"),
                                              body.get("spans", []))
                except KeyError as exc:
                    self._json(HTTPStatus.NOT_FOUND, {"error": str(exc.args[0])})
                    return
                except ValueError as exc:
                    self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                    return
                self._json(HTTPStatus.OK, {"item": entry.to_json(), "counts": server.log.counts()})

            def log_message(self, *args: object) -> None:  # requests carry private text: log none
                pass

        return Handler

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def start(self) -> ReviewServer:
        threading.Thread(target=self._httpd.serve_forever, daemon=True, name="review-page").start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
