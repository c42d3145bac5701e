"""Embeddings on the device (``/v1/embeddings``, ``/api/embed``) through the real ``openai`` and ``ollama`` clients.

The endpoint's cloud address is a recording TCP listener: anything the endpoint sent toward the adapter (a
connection, a byte) would be recorded there.  Vectors are checked against an independent computation: llama.cpp's
per-token states (no pooling) averaged and normalised here with numpy.
"""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.support.endpoint_stack import Endpoint, start_endpoint

pytestmark = pytest.mark.model

TEXTS = ["The liver filters the blood.", "Jaundice turns the skin yellow.", "Paris is the capital of France."]


class RecordingListener:
    """A TCP listener in the cloud adapter's place: counts every connection and byte that reaches it."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.connections = 0
        self.bytes = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        with connection:
            while data := connection.recv(65536):
                self.bytes += len(data)

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(scope="module")
def listener() -> Iterator[RecordingListener]:
    recording = RecordingListener()
    yield recording
    recording.close()


@pytest.fixture(scope="module")
def endpoint(listener: RecordingListener, slm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    with start_endpoint(listener.address, slm, tmp_path_factory.mktemp("embed")) as started:
        yield started


def reference_vectors(gguf: Path, texts: list[str], n_ctx: int) -> np.ndarray:
    """Mean of llama.cpp's per-token output states, L2-normalised: computed here, not by the endpoint's code."""
    import llama_cpp

    llama = llama_cpp.Llama(model_path=str(gguf), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
                            n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1, verbose=False)
    rows = []
    for text in texts:
        states = np.asarray(llama.embed(text), dtype=np.float64)  # one row per token
        mean = states.mean(axis=0)
        rows.append(mean / np.linalg.norm(mean))
    llama.close()
    return np.array(rows)


def openai_client(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0)


def test_openai_embeddings_are_the_mean_pooled_normalised_states_and_nothing_reaches_the_cloud(
        endpoint: Endpoint, listener: RecordingListener, slm) -> None:
    client = openai_client(endpoint)
    batched = client.embeddings.create(model="coveil", input=TEXTS)  # the client asks for base64 by default
    floats = client.embeddings.create(model="coveil", input=TEXTS, encoding_format="float")
    single = client.embeddings.create(model="coveil", input=TEXTS[2], encoding_format="float")
    expected = reference_vectors(slm.source.gguf_path, TEXTS, slm.n_ctx)

    got = np.array([item.embedding for item in floats.data])
    assert got.shape == (3, expected.shape[1]) and [item.index for item in floats.data] == [0, 1, 2]
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # batched in one decode vs one text at a time, in float32: elements differ by up to 3e-3, directions do not
    assert (np.sum(got * expected, axis=1) > 0.9995).all()
    assert np.allclose(np.array([item.embedding for item in batched.data]), got, atol=1e-6)
    assert np.dot(single.data[0].embedding, got[2]) > 0.9995
    # related sentences are nearer each other than the unrelated one
    assert got[0] @ got[1] > got[0] @ got[2]
    tokens = sum(len(slm.tokenize(text, add_bos=True)) for text in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    note = floats.model_extra["coveil"]
    assert note["cloud"] == "nothing" and note["bytes_up"] == note["bytes_down"] == 0 and note["pooling"] == "mean"
    assert listener.connections == 0 and listener.bytes == 0


def test_base64_embeddings_are_the_float32_little_endian_vectors(endpoint: Endpoint) -> None:
    body = {"model": "coveil", "input": TEXTS[:2], "encoding_format": "base64"}
    raw = httpx.post(endpoint.base_url + "/v1/embeddings", json=body, timeout=120).json()
    floats = httpx.post(endpoint.base_url + "/v1/embeddings", json={**body, "encoding_format": "float"},
                        timeout=120).json()
    for encoded, plain in zip(raw["data"], floats["data"]):
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(plain["embedding"], dtype=np.float32))


def test_ollama_embed_gives_the_same_vectors_and_truncates_only_when_asked(
        endpoint: Endpoint, listener: RecordingListener, slm) -> None:
    client = ollama.Client(host=endpoint.base_url, timeout=120)
    answer = client.embed(model="coveil", input=TEXTS)
    reference = openai_client(endpoint).embeddings.create(model="coveil", input=TEXTS, encoding_format="float")
    assert np.allclose(np.array(answer.embeddings), np.array([item.embedding for item in reference.data]),
                       atol=1e-6)
    assert answer.prompt_eval_count == reference.usage.prompt_tokens
    long_text = "liver " * (slm.n_ctx + 50)
    cut = client.embed(model="coveil", input=long_text)  # Ollama's default: truncate
    assert len(cut.embeddings[0]) == len(answer.embeddings[0]) and cut.prompt_eval_count == slm.n_ctx
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="coveil", input=["fine", long_text], truncate=False)
    assert refused.value.status_code == 400 and "input[1]" in refused.value.error
    assert listener.connections == 0 and listener.bytes == 0


@pytest.mark.parametrize("body, param", [
    ({"input": TEXTS, "dimensions": 64}, "dimensions"),
    ({"input": [[1, 2, 3]]}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": []}, "input"),
    ({"input": "liver " * 600}, "input"),
    ({"input": "x", "private": True}, "private"),
    ({"input": "x", "model": "gpt-4"}, "model"),
], ids=["dimensions", "token ids", "empty text", "no input", "too long", "unknown field", "model"])
def test_bad_embedding_requests_are_refused_naming_the_field(endpoint: Endpoint, listener: RecordingListener,
                                                             body: dict, param: str) -> None:
    response = httpx.post(endpoint.base_url + "/v1/embeddings", json={"model": "coveil", **body}, timeout=120)
    assert response.status_code in (400, 404)
    assert response.json()["error"]["param"] == param
    assert listener.connections == 0 and listener.bytes == 0


def test_the_native_dimension_is_accepted(endpoint: Endpoint) -> None:
    client = openai_client(endpoint)
    size = len(client.embeddings.create(model="coveil", input="x", encoding_format="float").data[0].embedding)
    assert len(client.embeddings.create(model="coveil", input="x", dimensions=size,
                                        encoding_format="float").data[0].embedding) == size


def test_the_listener_records_what_a_grpc_channel_sends() -> None:
    """The recording channel can fail the tests above: a gRPC channel to it is seen, and its bytes counted."""
    recording = RecordingListener()
    channel = grpc.insecure_channel(recording.address)
    with pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=1.0)
    channel.close()
    recording.close()
    assert recording.connections > 0 and recording.bytes > 0
