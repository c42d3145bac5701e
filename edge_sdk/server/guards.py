"""The checks every request passes before any route reads it (an ASGI middleware, outermost in the app).

In order, each answered with OpenAI's error body:

1. **Host, on loopback** (``403 host_not_allowed``): bound to loopback, a request must name a loopback host
   (``127.0.0.1``, ``localhost``, ``[::1]``), so a web page elsewhere cannot reach the endpoint through DNS
   rebinding.
2. **Origin** (``403 origin_not_allowed``): a browser names the page that sent a request in ``Origin``; it must be
   this endpoint itself, a loopback page, or a page on the configured ``--host``.  ``Origin: null`` (a sandboxed
   frame, a ``data:`` page) is refused.
3. **The API key** (``401 invalid_api_key``): with a key configured, *every* path needs it, ``/health``,
   ``/openapi.json``, the page and its files included: ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as the
   ``anthropic`` client sends it).  A browser cannot send that
   header when it opens the page, so the page (``/`` and ``/static/...``) also takes the key as ``/?key=KEY``, which
   sets it as an HttpOnly ``SameSite=Strict`` cookie for the page's files; the API routes take the header only, so
   the cookie never authorises a request another site makes.
4. **A JSON body** (``415 unsupported_media_type``): a POST must say ``Content-Type: application/json``.  A page
   on another site can send a POST without a CORS preflight only as ``text/plain``, a form or without a type;
   none of these is read from a browser (FastAPI refuses them too since 0.132; this check does not rest on that).
   A form or no type from a client that is no browser (no ``Origin``, ``Referer`` nor ``Sec-Fetch-*`` header:
   ``curl URL -d '{...}'``, as every Ollama example is written) is read as JSON.
5. **Body size** (``413 request_too_large``): a body over ``--max-request-bytes`` is refused as soon as its
   ``Content-Length`` says so, or, sent in chunks, once it has grown past the limit, before it is parsed or
   tokenised (a 4 MiB private context cost 3.2 s of tokenising before its 400).

Every response carries headers that keep the page out of other sites' frames and its scripts to its own files
(``Content-Security-Policy``, ``X-Frame-Options``, ``X-Content-Type-Options``, ``Referrer-Policy``).  No CORS
header is ever sent, so no other origin can read an answer.
"""

from __future__ import annotations

import hmac
import json
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any

from edge_sdk.protocol.channels import is_loopback
from edge_sdk.server.errors import EndpointError

Scope = MutableMapping[str, Any]

#: what ``curl URL -d '{...}'`` declares (a form), or ``--data-binary`` with no type (nothing): read as JSON when
#: no browser sent the request (a page on another site can send both without a CORS preflight)
CURL_MEDIA_TYPES = ("", "application/x-www-form-urlencoded")
#: headers a browser adds to every request a page sends (``Origin`` on every POST, the ``Sec-Fetch-*`` metadata)
BROWSER_HEADERS = ("origin", "referer", "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user")
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the cookie the page's files accept the API key from (set by ``/?key=KEY``)
KEY_COOKIE = "coveil_key"
#: on every response: the page loads its own files only, runs no inline script, and is never framed
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                 b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'; "
                                 b"object-src 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


def host_name(host_header: str) -> str:
    """The host of a ``Host`` header (``[::1]:8000`` → ``::1``, ``localhost:8000`` → ``localhost``)."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def is_page_path(path: str) -> bool:
    return path == "/" or path.startswith("/static/")


def take_page_key(scope: Scope) -> str | None:
    """The key given in the page's address (``GET /?key=KEY``), taken out of the request's query string, so no
    access log line carries it (uvicorn logs the path with its query); ``None`` when none is given."""
    if scope["path"] != "/" or scope["method"] != "GET" or not scope.get("query_string"):
        return None
    pairs = urllib.parse.parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
    keys = [value for name, value in pairs if name == "key"]
    if not keys:
        return None
    scope["query_string"] = urllib.parse.urlencode([(n, v) for n, v in pairs if n != "key"]).encode("latin-1")
    return keys[0]


class RequestGuard:
    """The ASGI middleware that applies the checks of the module docstring to every HTTP request.

    Args:
        app: the app it guards.
        host: the configured ``--host`` (a page there may send requests).
        api_key: the key every request must present, or ``None``.
        max_request_bytes: the largest body read.
    """

    def __init__(self, app: ASGIApp, *, host: str, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.host = host.strip("[]").lower()
        self.loopback = is_loopback(host)
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        given = take_page_key(scope)
        page_key = given if given and self.api_key and hmac.compare_digest(given.encode(), self.api_key.encode()) \
            else None
        try:
            self.check(scope, headers, page_key)
        except EndpointError as error:
            await _answer(send, error)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                receive = await self.read_body(receive)
            except EndpointError as error:
                await _answer(send, error)
                return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
                if page_key:  # /?key=KEY: the page's files take the key from this cookie from now on
                    value = urllib.parse.quote(page_key, safe="")
                    cookie = f"{KEY_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict"
                    message["headers"].append((b"set-cookie", cookie.encode("latin-1")))
            await send(message)

        await self.app(scope, receive, send_with_headers)

    # -- the checks --------------------------------------------------------------------------------------
    def check(self, scope: Scope, headers: dict[str, str], page_key: str | None) -> None:
        """Raise the error of the first check the request fails (size by ``Content-Length`` here; a chunked body
        is counted as it is read); ``page_key``: the right key given in the page's address."""
        if self.loopback and not is_loopback(host_name(headers.get("host", ""))):
            raise EndpointError(403, "this endpoint answers requests addressed to a loopback host only",
                                type="permission_error", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, headers.get("host", "")):
            raise EndpointError(403, "requests from pages on other sites are refused (Origin is neither this "
                                "endpoint, a loopback page nor a page on its --host)", type="permission_error",
                                code="origin_not_allowed")
        if self.api_key is not None and page_key is None and not self.authorised(scope, headers):
            raise EndpointError(401, "missing or wrong API key (send Authorization: Bearer KEY; open the page as "
                                "/?key=KEY)", type="invalid_request_error", code="invalid_api_key")
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                if media_type not in CURL_MEDIA_TYPES or any(name in headers for name in BROWSER_HEADERS):
                    raise EndpointError(415, "a POST's body must be JSON, sent with Content-Type: application/json",
                                        type="invalid_request_error", code="unsupported_media_type")
                # curl -d, no browser: its body is read as the JSON it is
                scope["headers"] = [(name, value) for name, value in scope["headers"]
                                    if name.lower() != b"content-type"] + [(b"content-type", b"application/json")]
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
            if not length.isdigit():
                raise EndpointError(400, "Content-Length is not a byte count", code="invalid_content_length")
            raise self.too_large()

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        """Whether the page at ``origin`` may send requests: this endpoint itself (same host and port), a page on
        loopback, or one on the configured host."""
        parsed = urllib.parse.urlsplit(origin)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            return False  # "null" and anything that is no web origin
        if parsed.netloc.lower() == host_header.lower():
            return True
        hostname = parsed.hostname.lower()
        return is_loopback(hostname) or (hostname == self.host and self.host not in ("0.0.0.0", "::"))

    def authorised(self, scope: Scope, headers: dict[str, str]) -> bool:
        """Whether the request presents the key: as ``Authorization: Bearer KEY``, or, for the page and its
        files only, as the cookie ``/?key=KEY`` set."""
        assert self.api_key is not None
        expected = self.api_key.encode()
        presented = headers.get("authorization", "")
        if presented.startswith("Bearer ") and hmac.compare_digest(presented[7:].encode(), expected):
            return True
        if "x-api-key" in headers and hmac.compare_digest(headers["x-api-key"].encode(), expected):
            return True  # how the anthropic client sends its key
        if scope["method"] != "GET" or not is_page_path(scope["path"]):
            return False
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001  (a malformed cookie header authorises nothing)
            return False
        if KEY_COOKIE not in cookie:
            return False
        return hmac.compare_digest(urllib.parse.unquote(cookie[KEY_COOKIE].value).encode(), expected)

    def too_large(self) -> EndpointError:
        return EndpointError(413, f"the request body is over {self.max_request_bytes} bytes (--max-request-bytes)",
                             type="invalid_request_error", code="request_too_large")

    async def read_body(self, receive: Receive) -> Receive:
        """Read the whole body (413 once it is over the limit, however it is sent); return a ``receive`` that
        gives it to the app in one message, then passes on what the connection says next (its disconnect)."""
        chunks, read = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: the app sees that
                return _replay([message], receive)
            read += len(message.get("body", b""))
            if read > self.max_request_bytes:
                raise self.too_large()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that gives ``messages`` first, then ``receive``'s."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _answer(send: Send, error: EndpointError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *SECURITY_HEADERS]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
