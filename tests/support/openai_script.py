"""A scripted OpenAI-compatible chat endpoint on loopback: each reply is chosen by a function of the request."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.http_serving import serving_in_thread

class ScriptedEndpoint:
    """``POST /v1/chat/completions`` answered by ``script(body)``: the assistant's content, ``(status, headers)`` or
    ``(status, headers, message)`` to fail with, or a dict sent whole as a 200's body; every request body is kept in
    ``requests``."""

    def __init__(self, script: Callable[[dict], str | dict | tuple]) -> None:
        self.script = script
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint._lock:
                    endpoint.requests.append(body)
                reply = endpoint.script(body)
                if isinstance(reply, tuple):
                    status, headers, message = (*reply, f"scripted {reply[0]}")[:3]
                    data = json.dumps({"error": {"message": message, "type": "scripted"}}).encode()
                elif isinstance(reply, dict):
                    status, headers, data = 200, {}, json.dumps(reply).encode()
                else:
                    status, headers = 200, {}
                    data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                       "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_port}/v1"

    @contextmanager
    def running(self) -> Iterator[ScriptedEndpoint]:
        with serving_in_thread(self._server):
            yield self


def stage_of(body: dict) -> str:
    """``extract`` or ``screen``: which of the judge's prompts a request carries."""
    return "extract" if "evidence_spans" in body["messages"][0]["content"] else "screen"


def screening_reply(keep: bool, answerable: bool = False) -> str:
    return json.dumps({"decisive_private_clue": "a clue" if keep else "", "answerable_without_context": answerable,
                       "keep": keep, "reason": "scripted"})


def extraction_reply(spans: list[str]) -> str:
    return json.dumps({"evidence_spans": spans, "rationale": "scripted"})
