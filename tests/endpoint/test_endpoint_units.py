"""The endpoint's pieces that need no model: stop strings, error mapping, settings, the queue, the command line,
and the stream's hold-back of a partly decoded character."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edge_sdk.client import GenerationStream
from edge_sdk.prompts import Prompts
from edge_sdk.server.errors import EndpointError, from_cloud_error
from edge_sdk.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from edge_sdk.server.serving import EdgeServing, Generation, StopText, cloud_saw, step_report
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.server.settings import ServerSettings
from edge_sdk.decoding import StepEvent
from edge_sdk.protocol.status import CloudError


def entry(step: int = 0, *, signal: str = "token", values: int = 0, full: bool = False) -> LedgerEntry:
    return LedgerEntry(step=step, token_id=7, policy="coveil", signal=signal, values_uploaded=values,
                       full_requested=full, withheld=False, steered=False, bytes_up=10, bytes_down=20,
                       leak_share=0.0, edge_ms=1.0, wait_ms=1.0, cloud_forward_ms=1.0)


# -- stop strings -------------------------------------------------------------------------------------------


def test_stop_text_shows_nothing_that_could_still_become_a_stop_string() -> None:
    shown = StopText(["END", "\n\n"])
    assert shown.feed("The liver") == "The liver"
    assert shown.feed(" E") == " "  # "E" may start "END": held back
    assert shown.feed("N") == ""  # "EN" still may
    assert shown.feed("X") == "ENX"  # "ENX" is no stop's beginning: released
    assert shown.feed("\n") == ""  # may start "\n\n"
    assert shown.feed("\nmore") == ""  # the stop: nothing of it or after it is shown
    assert shown.stopped and shown.result == "The liver ENX"  # that stop began at the first newline
    assert shown.feed("later") == "" and shown.flush() == ""


def test_stop_text_finds_a_stop_inside_one_piece_and_flushes_what_it_held() -> None:
    shown = StopText(["stop"])
    assert shown.feed("go on and stop here") == "go on and " and shown.stopped
    held = StopText(["stop"])
    assert held.feed("a st") == "a " and held.flush() == "st" and not held.stopped
    assert StopText([]).feed("anything at all") == "anything at all"


# -- what the cloud saw, and the cloud's statuses --------------------------------------------------------


def test_each_step_is_labelled_by_the_strongest_thing_the_cloud_saw() -> None:
    assert cloud_saw(entry(signal="upload", values=0)) == "nothing"
    assert cloud_saw(entry(signal="upload", values=3)) == "upload"
    assert cloud_saw(entry(signal="token")) == "token"
    assert cloud_saw(entry(signal="token", full=True)) == "full"
    assert cloud_saw(entry(signal="upload", values=3, full=True)) == "full"


def test_each_step_reports_how_many_values_left_the_device() -> None:
    """The page colours by this count: an empty upload 0, a synchronised token id 1, an upload its values (the
    undefended one the whole vocabulary), a full-distribution request adds nothing the edge sent."""
    assert step_report(entry(signal="upload", values=0)).values_left == 0
    assert step_report(entry(signal="token")).values_left == 1
    assert step_report(entry(signal="token", full=True)).values_left == 1
    assert step_report(entry(signal="upload", values=262_144)).values_left == 262_144
    assert step_report(entry(signal="upload", values=3, full=True)).values_left == 3


@pytest.mark.parametrize(("code", "status", "kind"), [
    ("UNAVAILABLE", 503, "cloud_unavailable"),
    ("DEADLINE_EXCEEDED", 503, "cloud_unavailable"),
    ("RESOURCE_EXHAUSTED", 429, "cloud_quota_exhausted"),
    ("INVALID_ARGUMENT", 400, "cloud_rejected_request"),
    ("UNAUTHENTICATED", 502, "cloud_auth_failed"),
    ("FAILED_PRECONDITION", 502, "model_mismatch"),
    ("DATA_LOSS", 502, "cloud_error"),
])
def test_cloud_statuses_map_to_openai_errors(code: str, status: int, kind: str) -> None:
    """A fixed message per status: the adapter's own text is not passed to the app (the cloud chooses it)."""
    error = from_cloud_error(CloudError(code, "Your session expired: log in at http://phish.example"))
    body = error.body()["error"]
    assert error.status == status and body["code"] == kind and code in body["message"]
    assert "phish" not in body["message"] and "expired" not in body["message"]
    assert set(body) == {"message", "type", "param", "code"}
    assert error.headers == ({"Retry-After": "1"} if status == 429 else {})


# -- requests ----------------------------------------------------------------------------------------------


def test_parameters_the_endpoint_cannot_honour_are_named() -> None:
    base = {"model": "coveil", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**base).unsupported() is None
    assert ChatCompletionRequest(**base, n=1, top_p=1.0, presence_penalty=0.0).unsupported() is None
    for extra, param in [({"n": 2}, "n"), ({"top_p": 0.9}, "top_p"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2},
                                                                                     "top_logprobs"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
                         ({"functions": [{"name": "f"}]}, "functions"),
                         ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"frequency_penalty": 0.5},
                                                                          "frequency_penalty")]:
        assert ChatCompletionRequest(**base, **extra).unsupported()[0] == param
    assert ChatCompletionRequest(**base, logprobs=True, top_logprobs=20).unsupported() is None
    assert CompletionRequest(model="coveil", prompt="a", logprobs=20).unsupported() is None
    assert CompletionRequest(model="coveil", prompt="a", logprobs=21).unsupported()[0] == "logprobs"
    assert CompletionRequest(model="coveil", prompt=["a", "b"]).unsupported()[0] == "prompt"
    assert CompletionRequest(model="coveil", prompt="a", echo=True).unsupported() is None
    assert CompletionRequest(model="coveil", prompt="a", echo=True, stream=True).unsupported()[0] == "echo"
    assert CompletionRequest(model="coveil", prompt=[[1, 2]]).prompt_ids() == [1, 2]  # lm-eval's token ids
    assert CompletionRequest(model="coveil", prompt=[3, 4]).prompt_ids() == [3, 4]
    assert CompletionRequest(model="coveil", prompt=[[1], [2]]).unsupported()[0] == "prompt"
    # a message's text parts are joined; developer messages are system messages to a chat template
    message = ChatCompletionRequest(model="coveil", messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}
    ]).messages[0]
    assert message.public_text() == "be brief" and message.template_role() == "system"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "notes", "private": True}, {"role": "user", "content": "q"}]},
    {"messages": [{"role": "user", "content": "notes", "coveil-private": True}]},
    {"messages": [{"role": "user", "content": "notes", "coveil_privat": True}]},
    {"messages": [{"role": "user", "content": "q"}], "private_context": "notes"},
    {"messages": [{"role": "user", "content": "q"}], "never_upload": ["notes"]},
], ids=["message private", "message coveil-private", "message misspelt", "top-level context", "top-level span"])
def test_a_misplaced_privacy_marker_is_refused_rather_than_ignored(body: dict) -> None:
    """Ignored, each of these would send text the app meant to keep on the device to the cloud (or decode
    without the private context it believes it passed)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(model="coveil", **body)
    assert "notes" not in str(caught.value.errors(include_input=False))
    # OpenAI's own message and request fields pass
    request = ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q", "name": "ann"}],
                                    metadata={"app": "x"}, coveil={"private_context": "notes"})
    assert request.coveil is not None and request.coveil.private_context == "notes"


# -- settings and the command line -------------------------------------------------------------------------


def test_listening_beyond_loopback_needs_an_api_key(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        ServerSettings(cloud="c:1", host=host).check_exposure(None)
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without an API key"):
        ServerSettings(cloud="c:1", host="0.0.0.0").check_exposure(None)
    ServerSettings(cloud="c:1", host="0.0.0.0").check_exposure("a key")
    # beyond loopback, plain HTTP carries private contexts readable across the network: a warning at start
    assert "plain HTTP" in ServerSettings(cloud="c:1", host="0.0.0.0").cleartext_warning()
    assert ServerSettings(cloud="c:1").cleartext_warning() is None
    key_file = tmp_path / "key"
    key_file.write_text("  k3y\n")
    assert ServerSettings(cloud="c:1", api_key_file=key_file).api_key() == "k3y"
    with pytest.raises(ValueError, match="go together"):
        ServerSettings(cloud="c:1", ssl_certfile=tmp_path / "cert.pem")
    (tmp_path / "key.pem").write_text("a key")
    # a missing certificate is named before the model loads (it was "[Errno 2] No such file" from uvicorn's bind)
    with pytest.raises(ValueError, match=f"--ssl-certfile: no such file: {tmp_path / 'cert.pem'}"):
        ServerSettings(cloud="c:1", ssl_certfile=tmp_path / "cert.pem", ssl_keyfile=tmp_path / "key.pem")
    with pytest.raises(ValueError, match="--max-queue must be at least 1"):
        ServerSettings(cloud="c:1", max_queue=0)
    with pytest.raises(ValueError, match="--port must be 0..65535, got 99999"):
        ServerSettings(cloud="c:1", port=99999)


def test_plaintext_to_a_remote_cloud_is_refused_at_start() -> None:
    """Before, the endpoint started and answered every request 500 (the channel refused it per request)."""
    ServerSettings(cloud="127.0.0.1:50051,[::1]:50051", plaintext=True)
    for cloud in ("10.1.2.3:50051", "127.0.0.1:50051,10.1.2.3:50051"):
        with pytest.raises(ValueError, match="--plaintext is accepted for a loopback --cloud only"):
            ServerSettings(cloud=cloud, plaintext=True)
    ServerSettings(cloud="10.1.2.3:50051")  # TLS: fine


def test_a_missing_model_file_is_named_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from eval_harness.cli import main

    missing = tmp_path / "nope.gguf"
    assert main(["edge", "serve", "--cloud", "127.0.0.1:1", "--plaintext", "--model", str(missing)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"coveil edge: GGUF file not found: {missing}"


def test_coveil_edge_serve_refuses_an_open_host_in_one_line(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from eval_harness.cli import main

    monkeypatch.delenv("COVEIL_API_KEY", raising=False)
    assert main(["edge", "serve", "--cloud", "127.0.0.1:1", "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("coveil edge: refusing to listen on 0.0.0.0") and "\n" not in err
    with pytest.raises(SystemExit):
        main(["edge", "serve", "--help"])
    help_text = capsys.readouterr().out
    assert "A request without a 'coveil' field" in help_text and "--default-policy" in help_text
    with pytest.raises(SystemExit) as caught:
        main(["edge", "serve"])  # --cloud is required
    assert caught.value.code == 2


# -- the stream's text ---------------------------------------------------------------------------------------


class ScriptedSLM:
    """An SLM whose detokenisation of the first n tokens is ``texts[n - 1]``."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def detokenize(self, ids: list[int]) -> str:
        return self.texts[len(ids) - 1]


@dataclass
class ScriptedDecoder:
    tokens: list[int] = field(default_factory=list)
    ledger: PrivacyLedger = field(default_factory=lambda: PrivacyLedger(mode="edge", policy="coveil"))
    finish_reason: str | None = None

    def events(self, n: int):
        for step in range(n):
            self.tokens.append(step)
            yield StepEvent(step, entry(step))


def test_a_character_split_over_tokens_is_shown_once_whole() -> None:
    """Byte-fallback tokens: "é" arrives as two tokens; until the second, the text ends in U+FFFD."""
    texts = ["a", "a\ufffd", "aé", "aéb"]
    decoder = ScriptedDecoder()
    stream = GenerationStream(ScriptedSLM(texts), decoder, decoder.events(len(texts)))  # type: ignore[arg-type]
    assert [step.text for step in stream.steps()] == ["a", "", "é", "b"]


# -- the queue ---------------------------------------------------------------------------------------------


class BlockingStream:
    """A generation that, once ``release`` is set, decides ``limit`` tokens ``pause`` seconds apart (counted)."""

    def __init__(self, release: threading.Event, limit: int = 1, pause: float = 0.0) -> None:
        self.release = release
        self.limit = limit
        self.pause = pause
        self.ledger = PrivacyLedger(mode="cloud", policy="coveil")
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def __enter__(self) -> BlockingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def steps(self):
        import time

        from edge_sdk.client import StreamStep

        self.release.wait(timeout=30)
        for step in range(self.limit):
            time.sleep(self.pause)
            self.ledger.entries.append(entry(step, signal="upload", values=1))
            self.token_ids.append(7)
            yield StreamStep("x", self.ledger.entries[-1])
        self.finish_reason = "max_new_tokens"


class BlockingClient:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.slm = None

    def run(self, decoder: object, began_at: float | None = None) -> BlockingStream:
        return BlockingStream(self.release)


def test_requests_beyond_the_queue_are_refused_with_429_and_the_rest_served_in_order() -> None:
    client = BlockingClient()
    serving = EdgeServing(client, None, ServerSettings(cloud="c:1", max_queue=2), n_ctx=64)  # type: ignore[arg-type]

    def generation(i: int) -> Generation:
        return Generation(f"r{i}", decoder=None, prompts=Prompts((1, 2), (2,)), stops=())  # type: ignore[arg-type]

    async def scenario() -> list[str]:
        running = serving.submit(generation(0))
        while not serving.busy:  # the worker took the first: the queue is empty again
            await asyncio.sleep(0.01)
        waiting = [serving.submit(generation(1)), serving.submit(generation(2))]
        with pytest.raises(EndpointError) as caught:
            serving.submit(generation(3))
        assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
        client.release.set()
        finished = []
        for job in (running, *waiting):
            assert (await job.next()).text == "x"
            done = await job.next()
            finished.append((job.generation.request_id, done.finish_reason, done.ledger.queue_ms))
        return finished

    try:
        finished = asyncio.run(scenario())
    finally:
        serving.close()
    assert [name for name, _, _ in finished] == ["r0", "r1", "r2"]
    assert all(reason == "length" for _, reason, _ in finished)
    assert finished[2][2] >= finished[1][2]  # the later in line waited at least as long


def test_invalid_requests_are_400_without_quoting_them(tmp_path: Path) -> None:
    """FastAPI's validation error would echo the input; the endpoint names the field and the problem only."""
    from edge_sdk.server.app import create_app, running

    class NoModelClient:
        slm = type("SLM", (), {"name": "none"})()

    settings = ServerSettings(cloud="c:1")
    app = create_app(settings, client=NoModelClient(), chat_template=None, n_ctx=64)  # type: ignore[arg-type]
    secret = "Zorblat Quexley's notes"
    body = {"model": "coveil", "messages": [{"role": "user", "content": 5}],
            "coveil": {"private_context": secret, "not_a_field": secret}}
    with running(app) as base_url:
        parsed = urllib.parse.urlsplit(base_url)
        connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        reply = json.loads(response.read())
        connection.close()
        files = {}
        for path in ("/", "/static/app.js", "/static/style.css"):
            page = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
            page.request("GET", path)
            files[path] = page.getresponse().read().decode()
            page.close()
    assert response.status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert "coveil.not_a_field" in reply["error"]["message"] and "messages.0.content" in reply["error"]["message"]
    assert "Zorblat" not in json.dumps(reply)
    # the page is served from the package and loads nothing from elsewhere (it works offline)
    assert "<title>CoVeil" in files["/"] and "addStep" in files["/static/app.js"]
    assert sorted(re.findall(r'(?:src|href)="([^"]*)"', files["/"])) == ["/static/app.js", "/static/style.css"]
    assert not [name for name, text in files.items() if re.search(r"https?:|//cdn|@import|url\(", text)]


# -- the context window ------------------------------------------------------------------------------------


class WordSLM:
    """Tokenises one id per word, after BOS (id 1)."""

    name = "words"

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        return [1] * add_bos + [2] * len(text.split())


class RecordingClient:
    """Builds no decoder: records the settings a generation would decode with."""

    def __init__(self) -> None:
        self.slm = WordSLM()
        self.settings: list[dict] = []

    def decoder(self, prompts: Prompts, **settings: object) -> str:
        self.settings.append(settings)
        return "decoder"


@pytest.mark.parametrize("prompt_words", [7, 8, 12])  # the prompt fills the 8-token window, or overflows it
def test_a_prompt_that_leaves_no_room_for_a_reply_is_context_length_exceeded(prompt_words: int) -> None:
    """Without ``max_tokens`` the reply gets the room left; with none left the request is a 400 (it was a 500
    from the SLM's prefill, after the cloud session had been opened)."""
    client = RecordingClient()
    serving = EdgeServing(client, None, ServerSettings(cloud="c:1"), n_ctx=8)  # type: ignore[arg-type]
    try:
        request = CompletionRequest(model="coveil", prompt=" ".join(["word"] * prompt_words))
        with pytest.raises(EndpointError) as caught:
            serving.prepare_completion(request)
        assert caught.value.status == 400 and caught.value.code == "context_length_exceeded"
        assert f"you requested {prompt_words + 2} tokens ({prompt_words + 1} in the prompt" in caught.value.message
        # one token of room: the reply defaults to it
        serving.prepare_completion(CompletionRequest(model="coveil", prompt=" ".join(["word"] * 6)))
        assert client.settings[-1]["max_new_tokens"] == 1
    finally:
        serving.close()


def test_the_default_reply_length_sent_to_the_cloud_says_nothing_of_the_private_context() -> None:
    """Without max_tokens the open's max_new_tokens came from the SLM's room, i.e. it was n_ctx minus the private
    context's length.  Now it comes from the public prompt: contexts of 0, 10 and 30 words send the same value, or
    (when it does not fit beside the context) are refused before anything is sent."""
    for default, expected in ((256, [97]), (50, [50, 50, 50])):
        client = RecordingClient()
        serving = EdgeServing(client, None, ServerSettings(cloud="c:1", default_max_tokens=default),  # type: ignore[arg-type]
                              n_ctx=100)
        try:
            for words in (0, 10, 30):
                request = CompletionRequest(model="coveil", prompt="a question",
                                            coveil={"private_context": " ".join(["secret"] * words)} if words else None)
                try:
                    serving.prepare_completion(request)
                except EndpointError as refused:
                    assert refused.code == "context_length_exceeded" and "max_tokens unset" in refused.message
            assert [settings["max_new_tokens"] for settings in client.settings] == expected, default
            assert all(settings == client.settings[0] for settings in client.settings[1:])
        finally:
            serving.close()


# -- a client that goes away -------------------------------------------------------------------------------


class EndlessClient(RecordingClient):
    def __init__(self) -> None:
        super().__init__()
        self.streams: list[BlockingStream] = []
        self.released = threading.Event()
        self.released.set()

    def run(self, decoder: object, began_at: float | None = None) -> BlockingStream:
        """A 400-token generation, a token every 10 ms."""
        self.streams.append(BlockingStream(self.released, limit=400, pause=0.01))
        return self.streams[-1]


def test_a_complete_request_whose_client_went_away_stops_decoding() -> None:
    """Non-streamed, nothing tells the server the client left until it writes the answer: it checks the
    connection while it waits, and stops the generation (before, it decoded all 400 tokens, ~4 s, for nobody)."""
    import socket
    import time

    from edge_sdk.server.app import create_app, running

    client = EndlessClient()
    app = create_app(ServerSettings(cloud="c:1"), client=client, chat_template=None,  # type: ignore[arg-type]
                     n_ctx=4096)
    body = json.dumps({"model": "coveil", "prompt": "a question", "max_tokens": 400}).encode()
    with running(app) as base_url:
        parsed = urllib.parse.urlsplit(base_url)
        with socket.create_connection((parsed.hostname, parsed.port)) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                               b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 5
            while not client.streams or not client.streams[0].token_ids:
                assert time.monotonic() < deadline, "the generation never started"
                time.sleep(0.01)
        closed_at = time.monotonic()
        serving = app.state.serving
        while serving.busy and time.monotonic() < closed_at + 3:
            time.sleep(0.02)
        stopped_after = time.monotonic() - closed_at
    assert not serving.busy and stopped_after < 1.5, f"still decoding {stopped_after:.1f} s after the client left"
    assert len(client.streams[0].token_ids) < 200


def test_the_ledger_summary_carries_the_epsilon_the_generation_spent() -> None:
    """Every response's and the last chunk's ``coveil`` field: epsilon spent, delta, accountant, events (hand: 3
    DP-Fusion tokens at eps = 1 per token, order 2, delta 1e-5 spend 3 + log(1e5) - 2 log 2, for any two private
    contexts, with the odds in words); a heuristic's is non-private, told in counts."""
    from edge_sdk.privacy.accountant import PrivacyAccountant
    from edge_sdk.policies import CoVeil, DPFusion
    from edge_sdk.server.serving import ledger_summary

    def summary(policy, mode: str, **budget) -> dict:
        accountant = PrivacyAccountant(policy.release_event(mode), **budget)
        for step in range(3):
            if not accountant.withholds(step):
                accountant.record(step, steered=True)
        ledger = PrivacyLedger(mode=mode, policy=policy.name, entries=[entry(s) for s in range(3)],
                               accountant=accountant)
        return json.loads(ledger_summary(ledger, cloud_prompt_tokens=4, queue_ms=0.0).model_dump_json())["privacy"]

    dp = summary(DPFusion(epsilon=1.0), "edge")
    assert dp["guarantee"] == "dp" and dp["events"] == 3 and dp["delta"] == 1e-5
    assert dp["epsilon_spent"] == pytest.approx(3.0 + 11.512925464970229 - 2 * math.log(2.0))
    assert dp["relation"] == "any two private contexts" and "weaker" in dp["source_relation"]["relation"]
    assert dp["in_words"].startswith("whoever sees what left the device is at most 500,000 times more likely")
    budgeted = summary(DPFusion(epsilon=1.0), "edge", max_epsilon=12.5)  # a third token would spend 13.13
    assert budgeted["events"] == 2 and budgeted["withheld_from"] == 2 and "max_epsilon 12.5" in budgeted["withheld_reason"]
    heuristic = summary(CoVeil(), "cloud")
    assert heuristic["guarantee"] == "non-private" and heuristic["epsilon_spent"] is None
    assert heuristic["in_words"].startswith("no DP guarantee (a heuristic): 3 of 3 steps revealed")
    with pytest.raises(ValueError, match="max_epsilon"):
        ChatCompletionRequest.model_validate({"model": "coveil", "messages": [{"role": "user", "content": "q"}],
                                              "coveil": {"max_epsilon": -1}})
