"""The review page: a local HTTP server over a build directory's :class:`~eval_harness.construction.review.ReviewLog`.

``GET /`` serves the page (three static files, nothing from the network), ``GET /api/items`` every proposed item
with its state and its private context cut into highlighted segments, ``POST /api/items/<id>`` one decision
(``{"status": ..., "spans": [...]}``), written to ``review.jsonl`` before the reply; a decision the rules refuse
gets ``400 {"error": ...}`` and changes nothing.

It listens on loopback only and answers only requests addressed to a loopback host (no DNS rebinding); it sends
no CORS headers and takes decisions only as ``application/json``, which a page of another origin cannot send
without a preflight this server never grants.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

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


class ReviewServer:
    """The review page over ``directory`` at ``http://127.0.0.1:<port>/`` (``port=0``: any free port).

    ``serve_forever()`` blocks; ``start()`` serves from a daemon thread (for tests); ``close()`` stops.
    """

    def __init__(self, directory: str | Path, *, port: int = 0) -> None:
        self.log = ReviewLog(directory)
        self.directory = Path(directory)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.port = self._httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}/"

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

            def _refused(self) -> bool:
                if _host_is_loopback(self.headers.get("Host")):
                    return False
                self._json(HTTPStatus.FORBIDDEN, {"error": "the review page answers only loopback hosts"})
                return True

            def do_GET(self) -> None:
                if self._refused():
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
