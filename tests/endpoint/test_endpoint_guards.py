"""The endpoint's guards without a model: the allowlist of request fields, the private marker on a content part,
the HTTP guards (content type, Origin, body size, the key on every path, the page's headers, no CORS), stop
strings that cost linear time, the queue's count of waiting clients, and errors that quote nothing."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from edge_sdk.prompts import Prompts
from edge_sdk.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from edge_sdk.server.serving import EdgeServing
from edge_sdk.server.settings import ServerSettings

SECRET = "Zorblat Quexley's notes"


# -- fakes ---------------------------------------------------------------------------------------------------


class WordSLM:
    """Tokenises one id per word, after BOS (id 1)."""

    name = "words"

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        return [1] * add_bos + [2] * len(text.split())


class RecordingRenderer:
    """A chat template that records each conversation it renders (the cloud's is rendered first)."""

    stops: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, str]]] = []

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        self.rendered.append([dict(m) for m in messages])
        return [1] + [2] * sum(len(m["content"].split()) + 1 for m in messages)


class RecordingClient:
    """Builds no decoder: records the prompts and settings a generation would decode with."""

    def __init__(self) -> None:
        self.slm = WordSLM()
        self.prompts: list[Prompts] = []
        self.settings: list[dict] = []

    def decoder(self, prompts: Prompts, **settings: object) -> str:
        self.prompts.append(prompts)
        self.settings.append(settings)
        return "decoder"

    def cloud_status(self, timeout_s: float) -> str:
        return "serving"


@pytest.fixture
def recording() -> tuple[EdgeServing, RecordingClient, RecordingRenderer]:
    client, renderer = RecordingClient(), RecordingRenderer()
    serving = EdgeServing(client, renderer, ServerSettings(cloud="c:1"), n_ctx=512)  # type: ignore[arg-type]
    yield serving, client, renderer
    serving.close()


# -- N2/N14: an allowlist of fields, and the private marker on a content part ---------------------------------


def test_a_content_part_marked_private_joins_the_private_context_and_never_the_cloud_prompt(recording) -> None:
    """Before, the part's ``coveil_private`` was an ignored extra field and its text went to the cloud."""
    serving, client, renderer = recording
    request = ChatCompletionRequest(model="coveil", messages=[
        {"role": "system", "content": [{"type": "text", "text": SECRET, "coveil_private": True}]},
        {"role": "user", "content": [{"type": "text", "text": "Which organ? "},
                                     {"type": "text", "text": "The patient is jaundiced.", "coveil_private": True},
                                     {"type": "text", "text": "One word."}]},
    ])
    serving.prepare_chat(request)
    cloud_conversation = renderer.rendered[0]
    assert cloud_conversation == [{"role": "user", "content": "Which organ? One word."}]  # the system part: gone
    assert client.prompts[-1].private_text == f"{SECRET}\n\nThe patient is jaundiced."
    # the SLM's conversation holds it, before the last user message's public text
    assert renderer.rendered[1][-1]["content"] == f"{SECRET}\n\nThe patient is jaundiced.\n\nWhich organ? One word."


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": SECRET, "confidential": True}]},
    {"messages": [{"role": "user", "content": SECRET, "private": True}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET, "private": True}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET, "confidential": True}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET, "coveil-private": True}]}]},
    {"messages": [{"role": "user", "content": "q"}], "confidential_context": SECRET},
    {"messages": [{"role": "user", "content": "q"}], "coveil": {"private_context": "x", "secret": SECRET}},
    {"messages": [{"role": "user", "content": "q"}], "stream_options": {"private": True}},
], ids=["message confidential", "message private", "part private", "part confidential", "part coveil-private",
        "top level", "coveil object", "stream options"])
def test_any_field_the_endpoint_does_not_know_is_refused_by_name(body: dict) -> None:
    """An allowlist everywhere: a denylist of marker names let ``"confidential": true`` through (ignored, and its
    message sent to the cloud)."""
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(model="coveil", **body)
    errors = caught.value.errors(include_input=False)
    unknown = [error for error in errors if error["type"] == "extra_forbidden"]  # (a content's str branch fails too)
    assert len(unknown) == 1
    assert unknown[0]["loc"][-1] in {"confidential", "private", "coveil-private", "confidential_context", "secret"}
    assert SECRET not in str(errors)
    with pytest.raises(ValidationError):
        CompletionRequest(model="coveil", prompt="q", confidential=True)


def test_the_fields_openai_clients_send_are_known() -> None:
    """A reply appended to the conversation as the openai client returns it, and OpenAI's request fields that
    change nothing here, pass; a marker that is not a boolean does not."""
    reply = {"role": "assistant", "content": "Liver.", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}
    request = ChatCompletionRequest(
        model="coveil", messages=[{"role": "user", "content": "q", "name": "ann"}, reply,
                                  {"role": "user", "content": "why?"}],
        metadata={"app": "x"}, store=False, parallel_tool_calls=True, stream_options={"include_usage": True},
        coveil={"private_context": "notes"})
    assert request.unsupported() is None
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = ChatCompletionRequest(model="coveil", messages=[{**reply, "tool_calls": [call]}])
    assert tool.unsupported() is None  # a reply's call joins the conversation (edge_sdk/server/tools.py)
    legacy = ChatCompletionRequest(model="coveil", messages=[{**reply, "function_call": {"name": "f"}}])
    assert legacy.unsupported()[0] == "messages.0"
    assert ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q"}],
                                 modalities=["audio"]).unsupported()[0] == "modalities"
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q", "coveil_private": "yes"}])


# -- N4, N6, N13, N16: the HTTP guards ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_app(request: pytest.FixtureRequest):
    """The endpoint over a :class:`RecordingClient` on loopback, one per module and API key (``indirect`` param:
    the key, or ``None``): stopping a server takes uvicorn ~0.2 s."""
    from edge_sdk.server.app import create_app, running

    key = getattr(request, "param", None)
    client = RecordingClient()
    app = create_app(ServerSettings(cloud="c:1"), client=client, chat_template=RecordingRenderer(),  # type: ignore[arg-type]
                     n_ctx=512, api_key=key)
    with running(app) as base_url:
        yield base_url, client


@pytest.fixture
def served(served_app):
    """``served_app`` with its client's records emptied: each test sees only what its own requests reached."""
    _, client = served_app
    client.prompts.clear()
    client.settings.clear()
    return served_app


def call(base_url: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, chunked: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request; ``(status, headers lower-cased, body)``."""
    parsed = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        if chunked:
            connection.putrequest(method, path)
            for name, value in (headers or {}).items():
                connection.putheader(name, value)
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            for start in range(0, len(body or b""), 65536):
                piece = body[start : start + 65536]
                try:
                    connection.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                except (BrokenPipeError, ConnectionResetError):  # refused mid-body
                    break
            else:
                connection.send(b"0\r\n\r\n")
        else:
            connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def chat_body(**fields: object) -> bytes:
    return json.dumps({"model": "coveil", "messages": [{"role": "user", "content": "Which organ?"}],
                       "max_tokens": 1, "coveil": {"private_context": SECRET}, **fields}).encode()


JSON = {"Content-Type": "application/json"}


#: headers a browser puts on every request a page sends (one is enough to tell one)
BROWSER_HEADERS = [{"Origin": "http://127.0.0.1:5173"}, {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Mode": "no-cors"},
                   {"Referer": "http://evil.example/"}]


@pytest.mark.parametrize("browser", BROWSER_HEADERS, ids=lambda headers: next(iter(headers)))
@pytest.mark.parametrize("content_type", [None, "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_a_post_that_is_not_declared_json_is_refused_before_it_is_read(served, content_type: str | None,
                                                                       browser: dict[str, str]) -> None:
    """The three kinds of body a page on another site may POST without a CORS preflight (none, text/plain, a
    form) are 415 from a browser (any of its headers), whatever the installed FastAPI does with them; nothing
    reaches the SLM (a loopback page passes the Origin check: this one alone stands)."""
    base_url, client = served
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, _, body = call(base_url, "POST", "/v1/chat/completions", chat_body(), {**headers, **browser})
    assert status == 415 and json.loads(body)["error"]["code"] == "unsupported_media_type"
    assert client.prompts == []
    status, _, _ = call(base_url, "POST", "/v1/chat/completions", chat_body(),
                        {"Content-Type": "Application/JSON; charset=utf-8", **browser})
    assert status != 415 and len(client.prompts) == 1


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded"], ids=["none", "curl -d"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_curl_d_without_a_content_type_is_read_as_json_when_no_browser_sent_it(served, content_type: str | None,
                                                                               path: str) -> None:
    """Every Ollama example is ``curl URL -d '{...}'``: curl declares a form (or, with ``--data-binary`` and no
    type, nothing). Without any browser header it is read as JSON; other declared types stay 415."""
    base_url, client = served
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = chat_body() if path.startswith("/v1") else json.dumps(
        {"model": "coveil", "messages": [{"role": "user", "content": "q"}], "stream": False}).encode()
    status, _, _ = call(base_url, "POST", path, body, headers)
    assert status != 415 and len(client.prompts) == 1
    status, _, _ = call(base_url, "POST", path, body, {"Content-Type": "text/plain"})
    assert status == 415 and len(client.prompts) == 1


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://evil.example", False), ("https://evil.example:443", False), ("null", False),
    ("http://127.0.0.1:5173", True), ("http://localhost:3000", True), ("http://[::1]:8080", True),
])
def test_a_request_from_a_page_on_another_site_is_refused(served, origin: str, allowed: bool) -> None:
    base_url, client = served
    status, headers, body = call(base_url, "POST", "/v1/chat/completions", chat_body(), {**JSON, "Origin": origin})
    if allowed:
        assert status != 403 and len(client.prompts) == 1
    else:
        assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed" and client.prompts == []
    assert "access-control-allow-origin" not in headers


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:3000"])
def test_no_origin_is_ever_allowed_to_read_an_answer(served, origin: str) -> None:
    """No CORS: a preflight is not granted and no answer names an origin (``allow_origins=["*"]`` added to the app
    passed every test before this one)."""
    base_url, _ = served
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    asked = [("OPTIONS", "/v1/chat/completions", preflight), ("GET", "/v1/models", {"Origin": origin}),
             ("GET", "/coveil/info", {"Origin": origin})]
    for method, path, headers in asked:
        _, answer, _ = call(base_url, method, path, headers=headers)
        assert not [name for name in answer if name.startswith("access-control-")], (method, path, answer)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_413_before_it_is_parsed(served, chunked: bool) -> None:
    """A 4 MiB private context was tokenised (3.2 s) before its 400; now it is refused unread."""
    import time

    base_url, client = served
    huge = chat_body(coveil={"private_context": "word " * (4 * 1024 * 1024 // 5)})
    started = time.perf_counter()
    status, _, body = call(base_url, "POST", "/v1/chat/completions", huge, JSON, chunked=chunked)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert client.prompts == [] and time.perf_counter() - started < 2.0
    assert ServerSettings(cloud="c:1").max_request_bytes == 256 * 1024 < len(huge)


@pytest.mark.parametrize("served_app", ["k3y"], indirect=True)
def test_with_a_key_every_path_needs_it_and_the_page_takes_it_from_its_address(served) -> None:
    base_url, _ = served
    for path in ("/health", "/openapi.json", "/", "/static/app.js", "/coveil/info", "/v1/models"):
        status, _, body = call(base_url, "GET", path)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", path
        assert call(base_url, "GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(base_url, "GET", path, headers={"Authorization": "Bearer k3y"})[0] == 200, path
    # the page's address carries the key; it comes back as an HttpOnly, same-site cookie for the page's files
    assert call(base_url, "GET", "/?key=wrong")[0] == 401
    status, headers, _ = call(base_url, "GET", "/?key=k3y")
    assert status == 200 and headers["set-cookie"] == "coveil_key=k3y; Path=/; HttpOnly; SameSite=Strict"
    assert call(base_url, "GET", "/static/app.js", headers={"Cookie": "coveil_key=k3y"})[0] == 200
    assert call(base_url, "GET", "/static/app.js", headers={"Cookie": "coveil_key=nope"})[0] == 401
    # the API never takes the cookie: a request another site makes carries no key
    for method, path, body in [("GET", "/coveil/info", None), ("POST", "/v1/chat/completions", chat_body())]:
        assert call(base_url, method, path, body, {**JSON, "Cookie": "coveil_key=k3y"})[0] == 401


def test_the_page_cannot_be_framed_and_runs_only_its_own_scripts(served) -> None:
    base_url, _ = served
    for path in ("/", "/static/app.js", "/v1/models"):
        status, headers, _ = call(base_url, "GET", path)
        assert status == 200
        policy = dict(part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";"))
        assert policy["frame-ancestors"] == "'none'" and policy["script-src"] == "'self'"
        assert policy["default-src"] == "'self'" and policy["connect-src"] == "'self'"
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"


ATTACK_PAGE = """<!doctype html><title>waiting</title><script>
fetch("%(target)s/v1/chat/completions", {method: "POST", mode: "no-cors", body: new Blob([%(body)s])})
  .then(() => { document.title = "sent"; }, (error) => { document.title = "failed " + error; });
</script>"""


@pytest.mark.slow
@pytest.mark.parametrize("site", ["127.0.0.1", "evil.example"])
def test_a_cross_origin_post_without_content_type_from_chromium_reaches_nothing(site: str, tmp_path) -> None:
    """A real browser on a page of another origin (another loopback port: only the content-type check stands;
    a public name mapped to loopback: the Origin check too) POSTs a JSON body with no Content-Type, which needs
    no CORS preflight. The endpoint answers 415 or 403 and the SLM never sees the request."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from edge_sdk.server.app import create_app, running
    from tests.support.browser import headless_chromium
    from tests.support.http_serving import serving_in_thread

    client = RecordingClient()
    app = create_app(ServerSettings(cloud="c:1"), client=client, chat_template=RecordingRenderer(),  # type: ignore[arg-type]
                     n_ctx=512)
    answered: list[tuple[str, str, int]] = []

    async def recording(scope, receive, send):
        async def sending(message):
            if message["type"] == "http.response.start":
                answered.append((scope["method"], scope["path"], message["status"]))
            await send(message)
        await app(scope, receive, sending if scope["type"] == "http" else send)

    with running(recording) as base_url:  # type: ignore[arg-type]
        page = (ATTACK_PAGE % {"target": base_url, "body": json.dumps(chat_body().decode())}).encode()

        class Attacker(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        with serving_in_thread(ThreadingHTTPServer(("127.0.0.1", 0), Attacker)) as attacker:
            rules = "--host-resolver-rules=MAP evil.example 127.0.0.1"
            with headless_chromium(tmp_path / "profile", arguments=(rules,)) as browser:
                browser.get(f"http://{site}:{attacker.server_address[1]}/")
                from selenium.webdriver.support.ui import WebDriverWait

                WebDriverWait(browser, 30).until(lambda b: b.title != "waiting")
                assert browser.title == "sent"  # no-cors: the page learns nothing, but the request went out
    posts = [status for method, path, status in answered if method == "POST"]
    assert posts == [415 if site == "127.0.0.1" else 403]
    assert client.prompts == []


# -- N7: stop strings in linear time, and a queue that forgets who left ------------------------------------------


def test_stop_strings_longer_than_the_cap_or_more_than_four_are_refused() -> None:
    """Four 320,000-character stops cost 4.2 s per token before the cap."""
    base = {"model": "coveil", "messages": [{"role": "user", "content": "q"}]}
    assert ChatCompletionRequest(**base, stop=["x" * 256] * 4).unsupported() is None
    assert ChatCompletionRequest(**base, stop=["x" * 320_000] * 4).unsupported()[0] == "stop"
    assert ChatCompletionRequest(**base, stop="x" * 257).unsupported()[0] == "stop"
    assert CompletionRequest(model="coveil", prompt="q", stop=["a"] * 5).unsupported()[0] == "stop"


class CountingText(str):
    """A text that records where each ``find`` starts."""

    starts: list[int]

    def find(self, sub: str, start: int = 0, *args: int) -> int:  # type: ignore[override]
        type(self).starts.append(start)
        return super().find(sub, start, *args)


def test_each_stop_search_reads_only_the_new_end_of_the_text() -> None:
    """Called with the whole text after every token, the stopping rule searched all of it each time (O(n²))."""
    from edge_sdk.server.serving import StopStrings

    rule = StopStrings(["END!"])
    text = ""
    CountingText.starts = []
    for step in range(2000):
        text += "word "
        assert not rule.is_done(CountingText(text))
        assert CountingText.starts[-1] >= len(text) - 5 - len("END!") - 16, step
    assert rule.is_done(CountingText(text + "EN")) is False and rule.is_done(CountingText(text + "END!")) is True


_letters = st.text(alphabet="ab\n", max_size=6)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(stops=st.lists(_letters.filter(bool), min_size=1, max_size=4), pieces=st.lists(_letters, max_size=30))
def test_incremental_stop_matching_agrees_with_searching_the_whole_text(stops: list[str], pieces: list[str]) -> None:
    """The reference: search everything fed so far from its start, and hold back any suffix a stop begins with."""
    from edge_sdk.server.serving import StopStrings, StopText

    shown, rule = StopText(stops), StopStrings(stops)
    text, out = "", ""
    for piece in pieces:
        text += piece
        out += shown.feed(piece)
        first = min((at for at in (text.find(stop) for stop in stops) if at >= 0), default=None)
        assert rule.is_done(text) == (first is not None)
        if first is not None:
            assert out == text[:first] and shown.stopped
            break
        held = max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        assert out == text[: len(text) - held]


class HeldStream:
    """A generation that waits for ``release``, then decides one token."""

    def __init__(self, release) -> None:
        from edge_sdk.privacy.ledger import PrivacyLedger

        self.release = release
        self.ledger = PrivacyLedger(mode="cloud", policy="coveil")
        self.token_ids: list[int] = []
        self.finish_reason = "max_new_tokens"

    def __enter__(self) -> HeldStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def steps(self):
        from edge_sdk.client import StreamStep

        self.release.wait(timeout=30)
        self.ledger.entries.append(ledger_entry(0))
        self.token_ids.append(7)
        yield StreamStep("x", self.ledger.entries[-1])


def ledger_entry(step: int, values: int = 3):
    from edge_sdk.privacy.ledger import LedgerEntry

    return LedgerEntry(step=step, token_id=7, policy="coveil", signal="upload", values_uploaded=values,
                       full_requested=False, withheld=False, steered=False, bytes_up=10, bytes_down=20,
                       leak_share=0.0, edge_ms=1.0, wait_ms=1.0, cloud_forward_ms=1.0)


def test_clients_that_queued_and_left_free_their_places_at_once() -> None:
    """Before, a queued job counted against --max-queue until the worker reached it: 16 clients that queued and
    left locked everyone out with 429 for as long as the running generation took."""
    import asyncio
    import threading

    from edge_sdk.server.errors import EndpointError
    from edge_sdk.server.serving import Generation

    release = threading.Event()

    class Client:
        slm = None

        def run(self, decoder: object, began_at: float | None = None) -> HeldStream:
            return HeldStream(release)

    serving = EdgeServing(Client(), None, ServerSettings(cloud="c:1", max_queue=2), n_ctx=64)  # type: ignore[arg-type]

    def generation(i: int) -> Generation:
        return Generation(f"r{i}", decoder=None, prompts=Prompts((1, 2), (2,)), stops=())  # type: ignore[arg-type]

    async def scenario() -> list[str]:
        running = serving.submit(generation(0))
        while not serving.busy:
            await asyncio.sleep(0.01)
        for job in [serving.submit(generation(1)), serving.submit(generation(2))]:
            job.cancel()  # their clients went away while they waited
        assert serving.waiting == 0
        kept = [serving.submit(generation(3)), serving.submit(generation(4))]  # 429 before
        with pytest.raises(EndpointError) as caught:
            serving.submit(generation(5))
        assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "1"}
        release.set()
        served = []
        for job in (running, *kept):
            await job.next()
            served.append(job.generation.request_id if (await job.next()).finish_reason else "")
        return served

    try:
        assert asyncio.run(scenario()) == ["r0", "r3", "r4"]
    finally:
        serving.close()


# -- N12: errors that quote nothing private, and a failure that says what had left ------------------------------


def test_a_missing_never_upload_span_is_named_by_position_not_quoted(recording) -> None:
    from edge_sdk.server.errors import EndpointError

    serving, _, _ = recording
    request = ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "Which organ?"}],
                                    coveil={"private_context": "Ann has jaundice.",
                                            "never_upload": ["Ann", "Zorblat Quexley"]})
    with pytest.raises(EndpointError) as caught:
        serving.prepare_chat(request)
    assert caught.value.status == 400 and caught.value.param == "coveil.never_upload"
    assert "never_upload[1]" in caught.value.message and "Zorblat" not in caught.value.message


@pytest.mark.parametrize("route", ["openai", "ollama"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_that_fails_after_steps_were_sent_returns_the_ledger_of_what_left(stream: bool,
                                                                                      route: str) -> None:
    """Before, a request that failed after two uploads answered a bare 503: the app could not tell what the cloud
    had already seen.  Ollama's route answers in its own shape: ``{"error": message, "coveil": ledger}``, as the
    whole body or as the stream's last line."""
    from edge_sdk.server.app import create_app, running
    from edge_sdk.protocol.status import CloudError

    class FailingStream(HeldStream):
        def steps(self):
            from edge_sdk.client import StreamStep

            for step in range(2):
                self.ledger.entries.append(ledger_entry(step, values=5))
                self.token_ids.append(7)
                yield StreamStep("x", self.ledger.entries[-1])
            raise CloudError("UNAVAILABLE", "the adapter went away")

    class Client(RecordingClient):
        def run(self, decoder: object, began_at: float | None = None) -> FailingStream:
            return FailingStream(None)

    app = create_app(ServerSettings(cloud="c:1"), client=Client(), chat_template=RecordingRenderer(),  # type: ignore[arg-type]
                     n_ctx=512)
    with running(app) as base_url:
        if route == "openai":
            status, _, body = call(base_url, "POST", "/v1/chat/completions", chat_body(stream=stream), JSON)
        else:
            ollama_body = json.dumps({"model": "coveil", "stream": stream,
                                      "options": {"coveil": {"private_context": SECRET}},
                                      "messages": [{"role": "user", "content": "Which organ?"}]}).encode()
            status, _, body = call(base_url, "POST", "/api/chat", ollama_body, JSON)
    if stream:  # the stream had begun: its last event is the error, with the ledger
        assert status == 200
        if route == "openai":
            events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
        else:
            events = [json.loads(line) for line in body.decode().splitlines()]
            assert [event["coveil"]["step"]["values_uploaded"] for event in events[:-1]] == [5, 5]
        reply = events[-1]
    else:
        assert status == 503
        reply = json.loads(body)
    if route == "ollama":  # Ollama's error is the message itself
        assert "cloud adapter cannot be reached" in reply["error"] and "went away" not in reply["error"]
    else:
        assert reply["error"]["code"] == "cloud_unavailable" and "went away" not in reply["error"]["message"]
    assert reply["coveil"]["steps"] == 2 and reply["coveil"]["values_uploaded"] == 10
    assert reply["coveil"]["bytes_up"] == 20


# -- /health reports the cloud; the channel retries the adapter every 2 s at most --------------------------------


def health_server(port: int):
    """A gRPC server on ``port`` answering health checks only, the decoder's service SERVING."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from edge_sdk.client import CLOUD_SERVICE

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set(CLOUD_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"127.0.0.1:{port}")
    return server


def test_health_reports_the_cloud_down_then_back() -> None:
    """It said "ok" while the cloud adapter was down."""
    import time

    from cloud_adapter.local import free_loopback_port
    from edge_sdk.client import EdgeClient
    from edge_sdk.server.app import create_app, running

    port = free_loopback_port()
    settings = ServerSettings(cloud=f"127.0.0.1:{port}", plaintext=True)
    client = EdgeClient(settings.cloud, slm=WordSLM(), credentials=settings.credentials())  # type: ignore[arg-type]
    app = create_app(settings, client=client, chat_template=None, n_ctx=64)
    server = health_server(port)
    try:
        with running(app) as base_url:
            status, _, body = call(base_url, "GET", "/health")
            assert status == 503 and json.loads(body) == {"status": "cloud_unavailable", "cloud": "unreachable",
                                                          "busy": False, "waiting": 0}
            server.start()
            deadline = time.monotonic() + 5
            while (reply := call(base_url, "GET", "/health"))[0] != 200:
                assert time.monotonic() < deadline, reply
                time.sleep(0.2)
            assert json.loads(reply[2])["status"] == "ok" and json.loads(reply[2])["cloud"] == "serving"
    finally:
        server.stop(None)
        client.close()


@pytest.mark.slow
def test_the_channel_retries_a_down_adapter_at_most_2_5_s_apart() -> None:
    """gRPC's default backoff spaces connection attempts up to 120 s apart, and a session fails at once until the
    next attempt: after a 90 s outage the endpoint answered 503 for ~24 s after the adapter was back.  A listener
    that closes every connection counts the attempts over 12 s: the default backoff's gaps reach 4 s there."""
    import socket
    import threading
    import time

    from edge_sdk.client import Credentials, EdgeClient

    listener = socket.create_server(("127.0.0.1", 0))
    attempts: list[float] = []

    def refuse() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            attempts.append(time.monotonic())
            connection.close()

    threading.Thread(target=refuse, daemon=True).start()
    client = EdgeClient(f"127.0.0.1:{listener.getsockname()[1]}", slm=WordSLM(),  # type: ignore[arg-type]
                        credentials=Credentials(plaintext=True))
    started = time.monotonic()
    try:
        while time.monotonic() - started < 12:
            assert client.cloud_status(0.2) != "serving"
            time.sleep(0.2)
    finally:
        client.close()
        listener.close()
    gaps = [later - earlier for earlier, later in zip([started, *attempts], attempts + [started + 12])]
    assert len(attempts) >= 5 and max(gaps) < 2.5 * 1.25, [round(gap, 2) for gap in gaps]


# -- the embedded model's first impression: a base model gets a question-and-answer prompt ------------------------


class TextSLM(WordSLM):
    """Records the text each tokenisation was asked for."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, bool]] = []

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        self.texts.append((text, special))
        return super().tokenize(text, add_bos=add_bos)


def test_a_model_without_a_chat_template_reads_questions_and_answers() -> None:
    from edge_sdk.prompts import QuestionAnswerPrompt, chat_prompts

    slm = TextSLM()
    prompt = QuestionAnswerPrompt(slm)  # type: ignore[arg-type]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
                    {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Which organ?"}]
    prompts = chat_prompts(prompt, conversation, "Ann has jaundice.")
    cloud_text, slm_text = slm.texts[0][0], slm.texts[1][0]
    assert cloud_text == "Be brief.\n\nQuestion: Name a fruit.\nAnswer: Apple.\nQuestion: Which organ?\nAnswer:"
    assert slm_text == ("Be brief.\n\nQuestion: Name a fruit.\nAnswer: Apple.\n"
                        "Question: Ann has jaundice.\n\nWhich organ?\nAnswer:")
    assert not any(special for _, special in slm.texts)  # "<start_of_turn>" in a message stays text
    assert prompts.private_text == "Ann has jaundice." and prompt.stops == ("\nQuestion:",)


def test_the_endpoint_ends_a_completion_style_reply_at_the_next_question() -> None:
    from edge_sdk.prompts import QuestionAnswerPrompt

    client = RecordingClient()
    serving = EdgeServing(client, QuestionAnswerPrompt(client.slm), ServerSettings(cloud="c:1"),  # type: ignore[arg-type]
                          n_ctx=512)
    try:
        serving.prepare_chat(ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q"}],
                                                   stop=["END"]))
        assert client.settings[-1]["stopping"].stops == ("END", "\nQuestion:")
        serving.prepare_completion(CompletionRequest(model="coveil", prompt="raw text"))  # the app's own format
        assert client.settings[-1]["stopping"] is None
    finally:
        serving.close()


@pytest.mark.parametrize("served_app", ["k3y; x=1,\"y\" z"], indirect=True)
def test_the_key_in_the_page_address_reaches_no_log_line_and_any_key_makes_a_cookie(served) -> None:
    """uvicorn logs each request's path with its query string: ``/?key=KEY`` is taken out of it first. A key
    with characters a cookie cannot hold is quoted in it."""
    import logging

    base_url, _ = served
    key = "k3y; x=1,\"y\" z"
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access, handler = logging.getLogger("uvicorn.access"), Capture()
    access.addHandler(handler)
    saved = access.level
    access.setLevel(logging.INFO)
    try:
        status, headers, _ = call(base_url, "GET", "/?" + urllib.parse.urlencode({"key": key, "lang": "en"}))
        assert call(base_url, "GET", "/?key=wrong-guess")[0] == 401
    finally:
        access.removeHandler(handler)
        access.setLevel(saved)
    assert status == 200 and any('"GET /?lang=en HTTP/1.1" 200' in line for line in lines), lines
    assert not [line for line in lines if "k3y" in line or "key=" in line or "wrong-guess" in line]
    cookie = headers["set-cookie"].split(";", 1)[0]
    assert cookie == "coveil_key=" + urllib.parse.quote(key, safe="")
    assert call(base_url, "GET", "/static/app.js", headers={"Cookie": cookie})[0] == 200
