"""Private-context inversion: typed to see only what the cloud saw; run against a real OpenAI-compatible server."""

from __future__ import annotations

import dataclasses
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from edge_sdk.leakage import ExposureTrace
from eval_harness.attacks.inversion import (
    CloudObservation,
    EndpointInversion,
    TransformersInversion,
    inversion_messages,
    parse_reconstruction,
    rouge1,
)
from eval_harness.llm.client import ChatClient

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

CANARY = "Quartzwhistle-7731"


def test_rouge1_hand_worked() -> None:
    # rouge-score lowercases and splits on non-alphanumerics: the private context has 8 tokens
    # (the patient s liver is swollen and yellow), the reconstruction 4 (the liver is swollen), all 4 shared:
    # recall 4/8 = 0.5, precision 4/4 = 1, F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    score = rouge1("the liver is swollen", "The patient's liver is swollen and yellow")
    assert score["rouge1_recall"] == pytest.approx(0.5)
    assert score["rouge1_f1"] == pytest.approx(2 / 3)


def test_the_attack_sees_only_what_the_cloud_observed() -> None:
    assert [f.name for f in dataclasses.fields(CloudObservation)] == ["public_query", "exposures"]
    for attack in (EndpointInversion, TransformersInversion):
        parameters = list(inspect.signature(attack.reconstruct).parameters)
        assert parameters == ["self", "observation"]
        assert inspect.get_annotations(attack.reconstruct)["observation"] == "CloudObservation"
    observation = CloudObservation("Which organ is affected?", ExposureTrace(3, ((5, 6, 7), (8,))))
    messages = inversion_messages(observation, {5: " liver", 6: " jaundice", 7: "\n", 8: " yes"}.get, k=2)
    user = messages[-1]["content"]
    assert "step 1: liver | jaundice" in user and "step 2: yes" in user  # the top k = 2 ids of each step
    assert "Which organ is affected?" in user
    assert parse_reconstruction("Note: The patient drinks.") == "The patient drinks."
    assert parse_reconstruction("The patient drinks.") == "The patient drinks."


class FlakyEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that fails with 503 the first ``failures`` times."""

    failures = 2
    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FlakyEndpoint.requests.append(body)
        if len(FlakyEndpoint.requests) <= FlakyEndpoint.failures:
            self.send_response(503)
            self.end_headers()
            return
        reply = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "Note: a swollen liver."}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_the_client_retries_transient_failures_and_caches_every_call(tmp_path: Path) -> None:
    server = HTTPServer(("127.0.0.1", 0), FlakyEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ChatClient(f"http://127.0.0.1:{server.server_port}/v1", "test-model", cache_dir=tmp_path,
                            backoff_s=0.01)
        messages = [{"role": "user", "content": "hello"}]
        assert client.complete(messages, temperature=0.0) == "Note: a swollen liver."
        assert client.calls == 3 and len(FlakyEndpoint.requests) == 3  # two 503s, then the answer
        assert client.complete(messages, temperature=0.0) == "Note: a swollen liver."
        assert client.calls == 3  # the second time from the cache
        assert client.complete(messages, temperature=0.5) == "Note: a swollen liver."
        assert client.calls == 4  # other parameters, another request
    finally:
        server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server():
    """llama-cpp-python's own OpenAI-compatible server with the embedded model, on loopback."""
    from edge_sdk.models import embedded_gguf_path

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(embedded_gguf_path()), "--host", "127.0.0.1",
         "--port", str(port), "--n_ctx", "4096", "--n_threads", "1", "--model_alias", "gemma-3-270m"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/models", timeout=2)
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("llama_cpp.server did not come up")
            time.sleep(0.5)
    try:
        yield base, process
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.model
def test_inversion_through_a_real_openai_compatible_server(slm, gemma_llm, llama_server, tmp_path: Path) -> None:
    from cloud_adapter.engine import CloudEngine
    from edge_sdk.client import EdgeClient
    from edge_sdk.leakage import piece_reader
    from edge_sdk.policies import Undefended

    base, _ = llama_server
    engine = CloudEngine(gemma_llm)
    private = f"{PRIVATE_CONTEXT} Codename {CANARY}."
    result = EdgeClient(lambda: engine.session("tests"), slm=slm).generate(
        PUBLIC_PROMPT, private, mode="cloud", policy=Undefended(), max_new_tokens=4)
    observation = CloudObservation(PUBLIC_PROMPT, result.ledger.exposure_trace())
    client = ChatClient(base, "gemma-3-270m", cache_dir=tmp_path)
    attack = EndpointInversion(client, piece_reader(slm), k=20, max_tokens=48)
    reconstruction = attack.reconstruct(observation)
    assert reconstruction.strip()
    score = rouge1(reconstruction, private)
    assert 0.0 <= score["rouge1_recall"] <= 1.0 and 0.0 <= score["rouge1_f1"] <= 1.0
    # what went to the attacker is what the cloud saw: the canary's text is in no cached request
    cached = list(tmp_path.rglob("*.json"))
    assert len(cached) == 1 and CANARY not in cached[0].read_text()
    assert client.calls == 1
    again = EndpointInversion(ChatClient(base, "gemma-3-270m", cache_dir=tmp_path), piece_reader(slm), k=20,
                              max_tokens=48)
    assert again.reconstruct(observation) == reconstruction and again.client.calls == 0  # a re-run costs nothing


@pytest.mark.model
def test_inversion_with_the_local_transformers_model(slm, gemma_llm) -> None:
    from edge_sdk.leakage import piece_reader

    observation = CloudObservation(PUBLIC_PROMPT, ExposureTrace(3, ((100, 200, 300), (400, 500, 600))))
    reconstruction = TransformersInversion(gemma_llm, piece_reader(slm), k=3, max_new_tokens=16).reconstruct(observation)
    assert isinstance(reconstruction, str) and reconstruction.strip()
