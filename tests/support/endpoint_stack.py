"""The endpoint's test stack: a real cloud adapter (gRPC on loopback, the embedded model, transcripts on disk) and
the endpoint in front of it (uvicorn on loopback), with every log line either side writes captured.

The fixtures over it (``server_logs``, ``cloud``, ``endpoint``) are in tests/endpoint/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.runners import StepBatcher
from cloud_adapter.inprocess import serving
from edge_sdk.backends.chat_template import LlamaCppChatTemplate
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import EdgeClient
from edge_sdk.server.app import create_app, running
from edge_sdk.server.settings import ServerSettings

TOKEN = "endpoint-test-token"
#: a name no model says on its own: if it reaches the cloud or a log, the private context did
CANARY = "Zorblat Quexley"
PRIVATE_CONTEXT = f"The patient {CANARY} has jaundice, a swollen liver and raised bilirubin after years of drinking."
QUESTION = "Which organ is affected? Answer in one word."
#: sessions one client identity may hold at the adapter (the quota test holds them all)
SESSIONS_PER_CLIENT = 2
#: the mode and route of each tool test of a dialect that writes calls in its own shape (Anthropic's tool_use
#: blocks, the Responses API's function_call items): the shape is the dialect's whatever the mode, so each mode
#: once, a whole reply in one and a stream in the other; the grammar's work in each mode (the edge masks, or the
#: cloud) is held to every tool choice whole and streamed in tests/endpoint/test_endpoint_tools.py
TOOL_MODE_AND_ROUTE = (("cloud", "whole"), ("edge", "streamed"))
#: the loggers of the endpoint (uvicorn, FastAPI, the SDK) and of the cloud adapter
SERVER_LOGGERS = ("coveil", "edge_sdk", "cloud_adapter", "uvicorn", "uvicorn.error", "uvicorn.access", "fastapi",
                  "starlette", "grpc")


class LogCapture(logging.Handler):
    """Every record of the server-side loggers, formatted with its traceback."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Cloud:
    address: str
    engine: CloudEngine
    transcript_dir: Path

    def transcripts(self) -> list[dict]:
        """Every finished session's transcript, oldest first."""
        files = sorted(self.transcript_dir.glob("*.json"), key=lambda path: path.stat().st_mtime_ns)
        return [json.loads(path.read_text()) for path in files]


@dataclass
class Endpoint:
    base_url: str
    client: EdgeClient
    template: LlamaCppChatTemplate
    settings: ServerSettings


def generate_as_the_endpoint(endpoint: Endpoint, prompts, **kwargs):
    """The generation the endpoint makes from a conversation, through the SDK: ``(result, the text shown)``. It
    ends where the endpoint ends it, at the prompt format's stop (the next question of a completion-style
    prompt), and the text shown stops before it."""
    from edge_sdk.server.serving import StopStrings

    stops = endpoint.template.stops
    result = endpoint.client.generate(prompts, stopping=StopStrings(stops) if stops else None, **kwargs)
    ends = [at for at in (result.text.find(stop) for stop in stops) if at >= 0]
    return result, result.text[: min(ends)] if ends else result.text


@contextlib.contextmanager
def capture_server_logs() -> Iterator[LogCapture]:
    capture = LogCapture()
    saved = {}
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(capture)
    try:
        yield capture
    finally:
        for name in SERVER_LOGGERS:
            logger = logging.getLogger(name)
            logger.removeHandler(capture)
            logger.setLevel(saved[name])


@contextlib.contextmanager
def start_cloud(transcript_dir: Path, gemma_llm) -> Iterator[Cloud]:
    batcher = StepBatcher(gemma_llm)
    engine = CloudEngine(gemma_llm, Limits(max_sessions_per_client=SESSIONS_PER_CLIENT, max_new_tokens=64),
                         transcript_dir, 10, runner=batcher)
    with batcher, serving(engine, token=TOKEN, max_workers=8) as adapter:
        yield Cloud(adapter.address, engine, transcript_dir)


@contextlib.contextmanager
def start_endpoint(cloud_address: str, slm: LlamaCppSLM, workdir: Path, *, api_key: str | None = None,
                   max_reconnects: int = 3, **settings_kwargs) -> Iterator[Endpoint]:
    """The endpoint over the test session's SLM, as ``coveil edge serve`` builds it (plaintext: loopback)."""
    token_file = workdir / "token.txt"
    token_file.write_text(TOKEN)
    settings = ServerSettings(cloud=cloud_address, token_file=token_file, plaintext=True, **settings_kwargs)
    client = EdgeClient(cloud_address, slm=slm, credentials=settings.credentials(), max_reconnects=max_reconnects,
                        lookahead=settings.lookahead)
    template = LlamaCppChatTemplate.for_model(slm)
    app = create_app(settings, client=client, chat_template=template, n_ctx=slm.n_ctx, api_key=api_key)
    try:
        with running(app) as base_url:
            yield Endpoint(base_url, client, template, settings)
    finally:
        client.close()
