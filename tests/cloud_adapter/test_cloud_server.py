"""The cloud adapter end to end: a real gRPC server on loopback, the embedded model, a bare stub client.

The client below is written against the generated stub and the codec in
``edge_sdk.protocol.wire`` only, so these tests pin the wire behaviour, not an SDK's.
The model runs in float32 so that batched and single-sequence forwards pick
the same greedy tokens.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud_adapter.backends.slots import SlotLLM
from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.runners import StepBatcher
from cloud_adapter.llm import CloudSequence, TransformersLLM
from cloud_adapter.inprocess import serving
from cloud_adapter.server import SERVICE_NAME, TlsConfig
from edge_sdk.protocol import wire
from edge_sdk._wire import coveil_pb2, coveil_pb2_grpc
from edge_sdk.fusion import softmax, top_k_ids
from edge_sdk.protocol.signals import CloudUpload

from tests.support.tls_material import pem_pair

pytestmark = pytest.mark.model

TOKEN = "test-token"
NEW_TOKENS = 6
EXPOSURE_K = 10
PROMPT = "The capital of France is"
OTHER_PROMPT = "Water boils at a temperature of"


def greedy_reference(llm: TransformersLLM, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding straight on the model: argmax of p_llm, stopping at EOS."""
    seq = llm.open(prompt_ids)
    tokens: list[int] = []
    while True:
        token = int(np.argmax(softmax(seq.next_logits)))
        tokens.append(token)
        if token in llm.eos_token_ids or len(tokens) == n:
            return tokens
        llm.step([(seq, token)])


@dataclass
class Cloud:
    llm: TransformersLLM
    engine: CloudEngine
    batcher: StepBatcher
    channel: grpc.Channel
    transcript_dir: Path
    reference: dict[str, list[int]]
    prompt_logits: np.ndarray  # the model's raw next-token logits after PROMPT


@pytest.fixture(scope="module", params=["transformers", "slots"])
def cloud(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          gemma_llm: TransformersLLM) -> Iterator[Cloud]:
    """The adapter over each backend: the edge must not tell them apart (same tests, same greedy tokens as the
    transformers model decoding alone)."""
    llm = gemma_llm
    # computed before the server exists: nothing else touches the model meanwhile
    reference = {text: greedy_reference(llm, llm.tokenize(text), NEW_TOKENS) for text in (PROMPT, OTHER_PROMPT)}
    prompt_logits = llm.open(llm.tokenize(PROMPT)).next_logits.copy()
    transcript_dir = tmp_path_factory.mktemp("transcripts")
    if request.param == "slots":  # the slot engine takes over its model: a copy of the weights
        llm = TransformersLLM.from_loaded(copy.deepcopy(gemma_llm.model), gemma_llm.tokenizer, gemma_llm.name)
        batcher = StepBatcher(SlotLLM(llm, max_slots=8, max_len=256))  # type: ignore[arg-type]
    else:
        batcher = StepBatcher(llm)
    engine = CloudEngine(llm, Limits(max_sessions_per_client=2, max_new_tokens=64), transcript_dir, EXPOSURE_K,
                         runner=batcher)
    with batcher, serving(engine, token=TOKEN, max_workers=8) as adapter, \
            grpc.insecure_channel(adapter.address) as channel:
        yield Cloud(llm, engine, batcher, channel, transcript_dir, reference, prompt_logits)


# -- a bare client ---------------------------------------------------------------------------------

_END = object()


class Stream:
    """One ``Decode`` stream driven message by message."""

    def __init__(self, channel: grpc.Channel, token: str | None = TOKEN) -> None:
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        metadata = [("authorization", f"Bearer {token}")] if token is not None else []
        stub = coveil_pb2_grpc.CollaborativeDecodingStub(channel)
        self._replies = stub.Decode(iter(self._outbox.get, _END), metadata=metadata, timeout=60)

    def send(self, message: Any) -> None:
        self._outbox.put(message)

    def recv(self, kind: str) -> Any:
        reply = next(self._replies)
        assert reply.WhichOneof("kind") == kind, f"expected {kind}, got {reply}"
        return getattr(reply, kind)

    def end(self) -> None:
        self._outbox.put(_END)

    def expect_status(self, code: grpc.StatusCode, *fragments: str) -> None:
        """Skip replies until the stream fails; it must fail with ``code`` and a message holding ``fragments``."""
        with pytest.raises(grpc.RpcError) as caught:
            for _ in self._replies:
                pass
        assert caught.value.code() == code, caught.value.details()
        for fragment in fragments:
            assert fragment in caught.value.details()


def open_request(llm: TransformersLLM, mode: str, prompt: str = PROMPT, **overrides: Any) -> wire.SessionRequest:
    fields: dict[str, Any] = dict(
        prompt_ids=tuple(llm.tokenize(prompt)), mode=mode, alpha=0.3, max_new_tokens=NEW_TOKENS,
        vocab_fingerprint=llm.vocab_fingerprint(), edge_model="test-edge", vocab_size=llm.vocab_size, top_m=32,
    )
    fields.update(overrides)
    return wire.SessionRequest(**fields)


def open_stream(cloud: Cloud, request: wire.SessionRequest) -> tuple[Stream, wire.SessionInfo, wire.CloudDistribution]:
    stream = Stream(cloud.channel)
    stream.send(wire.encode_open(request))
    info = wire.decode_opened(stream.recv("opened"))
    first = wire.decode_distribution(stream.recv("distribution"), info.vocab_size)
    return stream, info, first


def decode_edge_greedy(cloud: Cloud, prompt: str, *, use_full: bool) -> tuple[str, list[int]]:
    """Edge-side fusion where the edge always sends the cloud's own argmax; returns (session id, tokens)."""
    stream, info, dist = open_stream(cloud, open_request(cloud.llm, "edge", prompt))
    tokens: list[int] = []
    while True:
        if use_full:
            stream.send(wire.encode_request_full(dist.step))
            dist = wire.decode_distribution(stream.recv("distribution"), info.vocab_size)
            token = int(np.argmax(dist.dense))
        else:
            token = int(dist.ids[0])
        tokens.append(token)
        stream.send(wire.encode_token(dist.step, token))
        if token in info.eos_token_ids or len(tokens) == info.max_new_tokens:
            finished = stream.recv("finished")
            assert finished.steps == len(tokens)
            assert finished.reason == ("eos" if token in info.eos_token_ids else "max_new_tokens")
            stream.end()
            return info.session_id, tokens
        dist = wire.decode_distribution(stream.recv("distribution"), info.vocab_size)
        assert dist.step == len(tokens)


def assert_still_serving(cloud: Cloud) -> None:
    _, tokens = decode_edge_greedy(cloud, PROMPT, use_full=False)
    assert tokens == cloud.reference[PROMPT]


# -- decoding ---------------------------------------------------------------------------------------


def test_health_check_reports_serving(cloud: Cloud) -> None:
    stub = health_pb2_grpc.HealthStub(cloud.channel)
    for service in ("", SERVICE_NAME):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_edge_fusion_with_full_distributions_reproduces_greedy_decoding(cloud: Cloud) -> None:
    session_id, tokens = decode_edge_greedy(cloud, PROMPT, use_full=True)
    assert tokens == cloud.reference[PROMPT]

    transcript = cloud.engine.transcript(session_id)
    assert transcript["mode"] == "edge" and transcript["edge_model"] == "test-edge"
    assert [step["step"] for step in transcript["steps"]] == list(range(len(tokens)))
    assert [step["token_id"] for step in transcript["steps"]] == tokens
    assert all(step["full_requested"] for step in transcript["steps"])
    assert all(len(step["exposure"]) == EXPOSURE_K and "upload_ids" not in step for step in transcript["steps"])
    # the edge-mode exposure is the cloud's own top-K, led by the greedy token
    assert [step["exposure"][0] for step in transcript["steps"]] == tokens
    assert json.loads((cloud.transcript_dir / f"{session_id}.json").read_text()) == transcript


def test_sparse_distribution_is_the_top_of_the_full_one(cloud: Cloud) -> None:
    for space in ("prob", "logit"):
        stream, info, sparse = open_stream(cloud, open_request(cloud.llm, "edge", space=space, top_m=16))
        stream.send(wire.encode_request_full(0))
        full = wire.decode_distribution(stream.recv("distribution"), info.vocab_size)
        assert full.is_full and full.step == 0 and full.dense.shape == (info.vocab_size,)
        np.testing.assert_array_equal(sparse.ids, top_k_ids(full.dense, 16))
        np.testing.assert_array_equal(sparse.values, full.dense[sparse.ids])
        assert sparse.tail_bound == sparse.values[-1]
        if space == "logit":  # raw logits, as the release fuses them: the model's own row, not normalised
            np.testing.assert_allclose(full.dense, cloud.prompt_logits, rtol=0, atol=1e-4)
            shifted = np.exp(full.dense.astype(np.float64) - full.dense.max())
            probs = shifted / shifted.sum()
        else:
            probs = full.dense.astype(np.float64)
        assert probs.sum() == pytest.approx(1.0, abs=1e-4)
        assert sparse.tail_mass == pytest.approx(1.0 - probs[sparse.ids].sum(), abs=1e-5)
        stream.send(wire.encode_close())
        assert stream.recv("finished").reason == "closed"
        stream.end()


def test_cloud_fusion_picks_argmax_of_the_masked_fusion(cloud: Cloud) -> None:
    llm = cloud.llm
    forced = llm.tokenize(" Berlin", add_bos=False)[0]
    stream, info, dist = open_stream(cloud, open_request(llm, "cloud", alpha=0.3))
    tokens, uploads = [], []
    for step in range(NEW_TOKENS):
        stream.send(wire.encode_request_full(step))
        p_llm = wire.decode_distribution(stream.recv("distribution"), info.vocab_size).dense
        if step == 0:  # an upload that outweighs the cloud: 0.7 * 1.0 beats 0.3 * max p_llm
            upload = CloudUpload(np.array([forced]), np.array([1.0]))
        else:  # the cloud's own top 5 with their order reversed
            top = top_k_ids(p_llm, 5)
            upload = CloudUpload(top, np.linspace(0.05, 0.6, 5))
        uploads.append(upload)
        stream.send(wire.encode_upload(step, upload))
        chosen = stream.recv("token")
        # step 0: the forced token.  Later: top[4] carries 0.6, top[j] 0.05 + 0.1375 j; top[4] scores
        # 0.7 * 0.6 + 0.3 p_4 and beats top[j] iff 0.7 (0.6 - v_j) > 0.3 (p_j - p_4), which holds because the
        # (j+1)-th largest probability is at most 1/(j+1) (0.385 > 0.3, 0.289 > 0.15, 0.193 > 0.1, 0.096 > 0.075);
        # an id not uploaded scores at most 0.3 p_4 < 0.42
        expected = forced if step == 0 else int(top[4])
        assert chosen.step == step and chosen.token_id == expected
        tokens.append(chosen.token_id)
        if chosen.finished:
            break
        assert wire.decode_distribution(stream.recv("distribution"), info.vocab_size).step == step + 1
    assert tokens[0] == forced
    finished = stream.recv("finished")
    assert finished.steps == len(tokens)
    stream.end()

    steps = cloud.engine.transcript(info.session_id)["steps"]
    assert [step["token_id"] for step in steps] == tokens
    for step, upload in zip(steps, uploads):
        assert step["upload_ids"] == upload.ids.tolist()
        assert step["upload_values"] == upload.values.tolist()
        assert len(step["exposure"]) == min(EXPOSURE_K, len(upload))
        assert step["exposure"][0] == int(upload.ids[np.argmax(upload.values)])
        assert step["full_requested"] and step["bytes_up"] > 0 and step["bytes_down"] > 0


def test_two_concurrent_sessions_decode_as_when_alone(cloud: Cloud) -> None:
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(prompt: str) -> None:
        try:
            results[prompt] = decode_edge_greedy(cloud, prompt, use_full=False)[1]
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(prompt,)) for prompt in (PROMPT, OTHER_PROMPT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert results == cloud.reference


class RecordingLLM:
    """Stands in for the model in :class:`StepBatcher`: records every step and prefill batch.

    ``step_gate``, when set, holds each step until the test opens it; a prompt holding ``BAD_TOKEN``
    makes its prefill fail.
    """

    BAD_TOKEN = -1

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.prefills: list[list[int]] = []  # the prompt lengths of each open_many call
        self.step_gate: threading.Event | None = None

    def open_many(self, prompts: list[list[int]]) -> list[CloudSequence]:
        self.prefills.append([len(p) for p in prompts])
        if any(self.BAD_TOKEN in p for p in prompts):
            raise ValueError("bad prompt")
        return [CloudSequence(list(p), None, np.zeros(4, np.float32)) for p in prompts]

    def step(self, batch: list[tuple[CloudSequence, int]]) -> None:
        if self.step_gate is not None:
            self.step_gate.wait()
        self.batches.append(len(batch))
        for seq, token in batch:
            seq.ids.append(token)


def test_step_batcher_folds_concurrent_steps_into_one_forward() -> None:
    llm = RecordingLLM()
    with StepBatcher(llm, batch_window_ms=1000) as batcher:  # type: ignore[arg-type]
        seqs = [batcher.prefill([1, 2, 3])[0] for _ in range(3)]
        threads = [threading.Thread(target=batcher.forward, args=(seq, 7)) for seq in seqs]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # all three live sequences asked: the batch ran at once, without waiting out the window
        assert llm.batches == [3] and time.monotonic() - started < 0.9
        batcher.release(seqs[2])
        threads = [threading.Thread(target=batcher.forward, args=(seq, 8)) for seq in seqs[:2]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert llm.batches == [3, 2]
    assert [seq.ids for seq in seqs] == [[1, 2, 3, 7, 8], [1, 2, 3, 7, 8], [1, 2, 3, 7]]


class SlowStepLLM(RecordingLLM):
    """A batched step takes ``STEP_S`` whatever its size (a slow host)."""

    STEP_S = 0.4

    def step(self, batch: list[tuple[CloudSequence, int]]) -> None:
        time.sleep(self.STEP_S)
        super().step(batch)


def test_step_batcher_waits_for_a_session_expected_back_within_one_step_of_a_slow_host() -> None:
    """The window is the larger of ``batch_window_ms`` and the recent step time: on a host whose step takes
    400 ms, a session back 150 ms after its forward was delivered (its edge's or its thread's turn) joins the
    batch of one that came back at once, where a fixed 50 ms window ran two batches of one (each a full step)."""
    llm = SlowStepLLM()
    with StepBatcher(llm, batch_window_ms=50) as batcher:  # type: ignore[arg-type]
        seqs = [batcher.prefill([1, 2])[0] for _ in range(2)]

        def step_after(seq: CloudSequence, token: int, delay_s: float) -> None:
            time.sleep(delay_s)
            batcher.forward(seq, token)

        for token in (7, 8, 9):
            delays = (0.0, 0.0) if token == 7 else (0.0, 0.15)  # the first step teaches the batcher its step time
            threads = [threading.Thread(target=step_after, args=(seq, token, delay)) for seq, delay in zip(seqs, delays)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert batcher.window_s >= 0.3
    assert llm.batches == [2, 2, 2]
    assert [seq.ids for seq in seqs] == [[1, 2, 7, 8, 9]] * 2


def test_step_batcher_prefills_waiting_prompts_together_and_isolates_a_failing_one() -> None:
    llm = RecordingLLM()
    with StepBatcher(llm) as batcher:  # type: ignore[arg-type]
        running = batcher.prefill([1, 2])[0]
        llm.step_gate = threading.Event()
        stepping = threading.Thread(target=batcher.forward, args=(running, 5))
        stepping.start()  # the worker is now busy in a step: the next prefills queue up
        prompts = [[1] * 10, [1] * 12, [1, RecordingLLM.BAD_TOKEN] * 5, [1] * 50, [1] * 9]
        outcomes: dict[int, object] = {}

        def open_one(i: int) -> None:
            try:
                outcomes[i] = batcher.prefill(prompts[i])[0].ids
            except ValueError as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=open_one, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
            time.sleep(0.05)  # arrival order = prompt order
        llm.step_gate.set()
        for thread in [stepping, *threads]:
            thread.join()
    # 10, 12, 10 pad to 36 <= 2 x 32 real tokens; 50 would pad to 200 > 2 x 82, so it starts the next
    # batch, where 50 and 9 pad to 100 <= 2 x 59.  The first batch fails (bad prompt): each alone again.
    assert llm.prefills[0] == [2]
    assert llm.prefills[1:] == [[10, 12, 10], [10], [12], [10], [50, 9]]
    assert isinstance(outcomes[2], ValueError)
    assert {i: outcomes[i] for i in (0, 1, 3, 4)} == {i: prompts[i] for i in (0, 1, 3, 4)}
    assert batcher.prefill_sizes == {1: 3, 2: 1}  # failed prefills are not counted: [2], [10], [12], [50, 9]


def test_close_ends_the_session(cloud: Cloud) -> None:
    stream, info, _ = open_stream(cloud, open_request(cloud.llm, "edge"))
    stream.send(wire.encode_token(0, int(cloud.reference[PROMPT][0])))
    stream.recv("distribution")
    stream.send(wire.encode_close())
    finished = stream.recv("finished")
    assert (finished.steps, finished.reason) == (1, "closed")
    stream.end()
    transcript = cloud.engine.transcript(info.session_id)
    assert transcript["finish_reason"] == "closed" and len(transcript["steps"]) == 1


# -- bad input --------------------------------------------------------------------------------------


def _raw_upload(step: int, ids: list[int], values: list[float]) -> Any:
    return coveil_pb2.EdgeMessage(signal=coveil_pb2.StepSignal(
        step=step, upload=coveil_pb2.Upload(ids=wire.ids_to_bytes(np.array(ids)),
                                            values=wire.values_to_bytes(np.array(values)))))


BAD_SIGNALS: dict[str, tuple[str, Callable[[int], list[Any]], tuple[str, ...]]] = {
    # name: (fusion mode, the messages sent after open (given the vocabulary size), fragments of the error)
    "wrong step": ("edge", lambda vocab: [wire.encode_token(3, 0)], ("expected step 0, got 3",)),
    "token outside the vocabulary": ("edge", lambda vocab: [wire.encode_token(0, vocab)], ("outside the vocabulary",)),
    "upload in edge mode": ("edge", lambda vocab: [_raw_upload(0, [1], [0.5])], ("needs a token_id",)),
    "token in cloud mode": ("cloud", lambda vocab: [wire.encode_token(0, 1)], ("needs an upload",)),
    "upload id outside the vocabulary": ("cloud", lambda vocab: [_raw_upload(0, [5, vocab], [0.1, 0.2])],
                                         ("outside the vocabulary",)),
    "NaN value": ("cloud", lambda vocab: [_raw_upload(0, [5, 6], [0.1, float("nan")])], ("finite",)),
    "negative probability": ("cloud", lambda vocab: [_raw_upload(0, [5, 6], [0.1, -0.2])], ("[0, 1]",)),
    "duplicate ids": ("cloud", lambda vocab: [_raw_upload(0, [5, 5], [0.1, 0.2])], ("unique",)),
    "ids and values of different lengths": ("cloud", lambda vocab: [_raw_upload(0, [5, 6], [0.1])],
                                            ("2 ids but 1",)),
    "dense upload of the wrong size": ("cloud", lambda vocab: [_dense_upload(0, [0.5, 0.5])], ("dense upload",)),
    "second full request": ("edge", lambda vocab: [wire.encode_request_full(0)] * 2, ("already sent",)),
}


def _dense_upload(step: int, values: list[float]):
    pb = wire.pb()
    upload = pb.Upload(values=np.asarray(values, np.float32).tobytes(), dense=True)
    return pb.EdgeMessage(signal=pb.StepSignal(step=step, upload=upload))


@pytest.mark.parametrize("name", list(BAD_SIGNALS))
def test_bad_signal_is_refused_and_the_server_keeps_serving(cloud: Cloud, name: str) -> None:
    mode, bad_messages, fragments = BAD_SIGNALS[name]
    stream, info, _ = open_stream(cloud, open_request(cloud.llm, mode))
    for message in bad_messages(info.vocab_size):
        stream.send(message)
    stream.expect_status(grpc.StatusCode.INVALID_ARGUMENT, *fragments)
    assert cloud.engine.transcript(info.session_id)["finish_reason"] == "error"
    assert_still_serving(cloud)


BAD_OPENS: dict[str, tuple[dict[str, Any], grpc.StatusCode, tuple[str, ...]]] = {
    "vocabulary mismatch": ({"vocab_fingerprint": b"\0" * 32, "edge_model": "other-family"},
                            grpc.StatusCode.FAILED_PRECONDITION, ("other-family", "gemma-3-270m")),
    "prompt id outside the vocabulary": ({"prompt_ids": (2, 10**6)}, grpc.StatusCode.INVALID_ARGUMENT,
                                         ("outside the vocabulary",)),
    "empty prompt": ({"prompt_ids": ()}, grpc.StatusCode.INVALID_ARGUMENT, ("empty",)),
    "alpha above 1": ({"alpha": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, ("alpha",)),
    "too many new tokens": ({"max_new_tokens": 65}, grpc.StatusCode.INVALID_ARGUMENT, ("limit of 64",)),
    "top_m above the vocabulary": ({"top_m": 10**6}, grpc.StatusCode.INVALID_ARGUMENT, ("top_m",)),
}


@pytest.mark.parametrize("name", list(BAD_OPENS))
def test_bad_open_is_refused_and_the_server_keeps_serving(cloud: Cloud, name: str) -> None:
    overrides, code, fragments = BAD_OPENS[name]
    stream = Stream(cloud.channel)
    stream.send(wire.encode_open(open_request(cloud.llm, "edge", **overrides)))
    stream.expect_status(code, *fragments)
    assert_still_serving(cloud)


def test_signal_before_open_is_not_found(cloud: Cloud) -> None:
    stream = Stream(cloud.channel)
    stream.send(wire.encode_token(0, 1))
    stream.expect_status(grpc.StatusCode.NOT_FOUND, "send open")


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_bad_bearer_token_is_unauthenticated(cloud: Cloud, token: str | None) -> None:
    stream = Stream(cloud.channel, token=token)
    stream.send(wire.encode_open(open_request(cloud.llm, "edge")))
    stream.expect_status(grpc.StatusCode.UNAUTHENTICATED, "bearer token")
    assert_still_serving(cloud)


def test_sessions_beyond_the_client_limit_are_refused(cloud: Cloud) -> None:
    held = [open_stream(cloud, open_request(cloud.llm, "edge"))[0] for _ in range(2)]
    stream = Stream(cloud.channel)
    stream.send(wire.encode_open(open_request(cloud.llm, "edge")))
    stream.expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "2 open sessions")
    for open_one in held:
        open_one.send(wire.encode_close())
        assert open_one.recv("finished").reason == "closed"
        open_one.end()
    assert_still_serving(cloud)


def test_idle_session_is_evicted(cloud: Cloud) -> None:
    engine = CloudEngine(cloud.llm, Limits(idle_timeout_s=0.3), runner=cloud.batcher)
    with serving(engine, max_workers=4) as adapter:
        with grpc.insecure_channel(adapter.address) as channel:
            stream = Stream(channel, token=None)
            stream.send(wire.encode_open(open_request(cloud.llm, "edge")))
            info = wire.decode_opened(stream.recv("opened"))
            stream.recv("distribution")
            started = time.monotonic()
            stream.expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, "session idle for 0.3 s")
            assert time.monotonic() - started < 5
        assert engine.transcript(info.session_id)["finish_reason"] == "idle"
        assert engine.active_sessions == 0


def test_mutual_tls_admits_only_clients_with_a_certificate(cloud: Cloud) -> None:
    pytest.importorskip("cryptography")
    ca_key, ca_cert, _, ca_pem = pem_pair("coveil test CA", None, is_ca=True)
    _, _, server_key_pem, server_cert_pem = pem_pair("coveil cloud", (ca_key, ca_cert))
    _, _, client_key_pem, client_cert_pem = pem_pair("coveil edge", (ca_key, ca_cert))
    engine = CloudEngine(cloud.llm, runner=cloud.batcher)
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    with serving(engine, max_workers=4, tls=TlsConfig(server_cert_pem, server_key_pem, client_ca=ca_pem)) as adapter:
        with_cert = grpc.ssl_channel_credentials(ca_pem, client_key_pem, client_cert_pem)
        with grpc.secure_channel(adapter.address, with_cert) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.secure_channel(adapter.address, grpc.ssl_channel_credentials(ca_pem)) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
