"""The cloud adapter's limits hold against streams and requests that try to exhaust it.

The server here runs a tiny random model of the byte-level BPE family built in
the test session (tests/support/tiny_models.py), so each case costs milliseconds.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud_adapter.engine import CloudEngine
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.runners import StepBatcher
from cloud_adapter.inprocess import serving
from cloud_adapter.server import SERVICE_NAME
from cloud_adapter.stream import Inbox
from cloud_adapter.transcript import SessionTranscript, StepRecord, TranscriptStore
from edge_sdk.protocol import wire
from edge_sdk._wire import coveil_pb2_grpc
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.protocol.status import CloudError

from tests.support.tiny_models import bpe_tokenizer, random_qwen

PROMPT = "Which organ is affected? The liver, the heart or the lung."


@pytest.fixture(scope="module")
def tiny_llm() -> TransformersLLM:
    tokenizer = bpe_tokenizer()
    return TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=5), tokenizer, "tiny-bpe")


def open_request(llm: TransformersLLM, **overrides) -> wire.SessionRequest:
    fields = dict(prompt_ids=tuple(llm.tokenize(PROMPT)), mode="edge", max_new_tokens=4,
                  vocab_fingerprint=llm.vocab_fingerprint(), edge_model="test-edge", vocab_size=llm.vocab_size,
                  top_m=16)
    fields.update(overrides)
    return wire.SessionRequest(**fields)


class SilentStream:
    """A Decode stream that never sends anything until ``finish()``."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        stub = coveil_pb2_grpc.CollaborativeDecodingStub(channel)
        self.call = stub.Decode(iter(self._outbox.get, None), timeout=30)

    def status(self) -> grpc.StatusCode:
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def finish(self) -> None:
        self._outbox.put(None)


def test_streams_that_never_open_cannot_starve_the_server(tiny_llm) -> None:
    """Before, each silent stream held a pool thread for the idle timeout and counted against nothing:
    a handful froze the server, health checks included."""
    limits = Limits(max_sessions=2, max_unopened_streams=2, open_timeout_s=1.5)
    engine = CloudEngine(tiny_llm, limits)
    with serving(engine, max_workers=8) as adapter, grpc.insecure_channel(adapter.address) as channel:
        silent = [SilentStream(channel) for _ in range(10)]
        time.sleep(0.3)
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        codes = [stream.status() for stream in silent]
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8  # refused at once, holding nothing
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 2  # the admitted two waited open_timeout_s
        # their places are free again: a real session opens and decodes
        stream = SilentStream(channel)
        stream._outbox.put(wire.encode_open(open_request(tiny_llm)))
        replies = iter(stream.call)
        assert next(replies).WhichOneof("kind") == "opened"
        stream.finish()
        for stream in silent:
            stream.finish()


def test_oversized_prompts_are_refused_before_any_work(tiny_llm) -> None:
    limits = Limits(max_prompt_tokens=32)
    engine = CloudEngine(tiny_llm, limits)
    calls = []
    engine.tokenize = lambda text: calls.append(text) or tiny_llm.tokenize(text)  # type: ignore[method-assign]

    def refused(message) -> str:
        handler = engine.session("tests")
        with pytest.raises(CloudError) as caught:
            list(handler.handle(message))
        assert caught.value.code == "INVALID_ARGUMENT"
        return caught.value.message

    assert "32" in refused(wire.encode_open(open_request(tiny_llm, prompt_ids=tuple(range(33)))))
    # 33 resumed tokens after a 1-token prompt: over the limit as well
    assert "32" in refused(wire.encode_open(open_request(tiny_llm, prompt_ids=(5,), resume_prefix=tuple([7] * 32))))
    text = wire.encode_open(open_request(tiny_llm))
    text.open.text = "word " * 400  # 2000 characters can never fit 32 tokens: refused without tokenising
    assert "characters" in refused(text)
    assert calls == []
    assert engine.active_sessions == 0


def test_the_stream_inbox_reads_ahead_only_a_few_messages() -> None:
    pulled: list[int] = []

    def requests() -> Iterator[int]:
        for i in range(100):
            pulled.append(i)
            yield i

    inbox = Inbox(requests(), capacity=3)
    time.sleep(0.3)
    assert len(pulled) <= 3 + 1  # three queued and one the reader holds, waiting for room
    assert [inbox.get(timeout=1) for _ in range(5)] == [0, 1, 2, 3, 4]
    inbox.close()


def test_finished_transcripts_are_capped_by_bytes(tiny_llm) -> None:
    store = TranscriptStore(max_kept=1000, max_bytes=200_000)
    request = open_request(tiny_llm, mode="cloud")
    for n in range(12):
        transcript = SessionTranscript(f"s{n}", request, "tiny", 4, 100)
        upload = CloudUpload(np.arange(5000), np.full(5000, 0.1, np.float32))  # 60 kB of arrays per step
        transcript.steps.append(StepRecord(0, token_id=1, upload=upload, upload_size=5000))
        store.add(transcript)
    assert store.bytes_held <= 200_000
    assert 1 <= len(store) <= 3
    store.get("s11")  # the newest stays
    with pytest.raises(KeyError):
        store.get("s0")


def test_cloud_sampling_survives_alpha_zero_with_nothing_uploaded(tiny_llm) -> None:
    """alpha = 0 and an empty upload leave zeros to sample from; the cloud samples its own row instead."""
    engine = CloudEngine(tiny_llm)
    handler = engine.session("tests")
    request = open_request(tiny_llm, mode="cloud", alpha=0.0, temperature=0.7, seed=3)
    list(handler.handle(wire.encode_open(request)))
    replies = list(handler.handle(wire.encode_upload(0, CloudUpload.empty())))
    assert replies[0].WhichOneof("kind") == "token"
    assert 0 <= replies[0].token.token_id < tiny_llm.vocab_size
    handler.abandon("closed")


def test_a_failed_batch_fails_its_sessions_not_the_worker(tiny_llm) -> None:
    with StepBatcher(tiny_llm) as batcher:
        seq, _ = batcher.prefill(tiny_llm.tokenize(PROMPT))
        with pytest.raises(Exception):
            batcher.forward(seq, 10**9)  # an id no embedding has
        other, _ = batcher.prefill(tiny_llm.tokenize(PROMPT))
        assert batcher.forward(other, 5) > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker dies on purpose
def test_a_dead_model_worker_turns_health_to_not_serving_and_fails_sessions_fast(tiny_llm) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with StepBatcher(tiny_llm) as batcher:
        engine = CloudEngine(tiny_llm, runner=batcher)
        with serving(engine, max_workers=16) as adapter, grpc.insecure_channel(adapter.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            assert health.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            seq, _ = batcher.prefill(tiny_llm.tokenize(PROMPT))
            original = tiny_llm.step

            def die(batch):
                raise SystemExit("the worker's process is going down")

            tiny_llm.step = die  # type: ignore[method-assign]
            try:
                with pytest.raises(RuntimeError):
                    batcher.forward(seq, 5)  # the step in flight fails instead of hanging
            finally:
                tiny_llm.step = original  # type: ignore[method-assign]
            deadline = time.monotonic() + 5
            while health.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "health still says SERVING after the worker died"
                time.sleep(0.1)
            with pytest.raises(RuntimeError, match="died"):
                batcher.prefill(tiny_llm.tokenize(PROMPT))  # later sessions fail at once


def test_a_drop_after_the_last_token_does_not_undo_the_generation(tiny_llm) -> None:
    """The cloud's closing 'finished' message is lost: the tokens are all there, so the generation stands."""
    from cloud_adapter.llm import TransformersSLM
    from edge_sdk.client import EdgeClient

    engine = CloudEngine(tiny_llm)

    class LoseFinished:
        def __init__(self, handler) -> None:
            self.handler = handler

        def handle(self, message):
            return [reply for reply in self.handler.handle(message) if reply.WhichOneof("kind") != "finished"]

        def abandon(self, reason: str) -> None:
            self.handler.abandon(reason)

    slm = TransformersSLM(tiny_llm)
    client = EdgeClient(lambda: LoseFinished(engine.session("tests")), slm=slm, max_reconnects=0)
    for mode in ("cloud", "edge"):
        result = client.generate(PROMPT, "private note", mode=mode, max_new_tokens=3)
        assert len(result.token_ids) == 3 and result.finish_reason == "max_new_tokens", mode
    # the edge tells the cloud where it would stop
    request = client.decoder(PROMPT, "private note", mode="edge").request()
    assert set(request.stop_token_ids) == set(slm.eos_token_ids) and request.stop_token_ids


def test_one_client_cannot_lock_others_out_with_silent_streams(tiny_llm) -> None:
    limits = Limits(max_sessions=4, max_sessions_per_client=2, max_unopened_streams=10, open_timeout_s=3)
    engine = CloudEngine(tiny_llm, limits)
    with serving(engine, token=["attacker", "victim"], max_workers=24) as adapter, \
            grpc.insecure_channel(adapter.address) as channel:
        stub = coveil_pb2_grpc.CollaborativeDecodingStub(channel)
        silent = []
        for _ in range(5):
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            silent.append((outbox, stub.Decode(iter(outbox.get, None), metadata=[("authorization", "Bearer attacker")],
                                               timeout=30)))
        time.sleep(0.3)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        victim = stub.Decode(iter(outbox.get, None), metadata=[("authorization", "Bearer victim")], timeout=30)
        outbox.put(wire.encode_open(open_request(tiny_llm)))
        assert next(victim).WhichOneof("kind") == "opened"
        outbox.put(None)
        codes = []
        for box, call in silent:
            box.put(None)
            try:
                list(call)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 3  # beyond the attacker's own 2


def test_open_fields_that_would_fill_memory_are_refused(tiny_llm) -> None:
    engine = CloudEngine(tiny_llm)
    for overrides in ({"edge_model": "x" * 300}, {"stop_token_ids": tuple(range(300))}):
        with pytest.raises(CloudError) as caught:
            list(engine.session("tests").handle(wire.encode_open(open_request(tiny_llm, **overrides))))
        assert caught.value.code == "INVALID_ARGUMENT"


def test_a_malicious_cloud_gets_a_status_not_a_crash_on_the_edge(tiny_llm) -> None:
    """Rows shorter than asked, out of order, not a distribution, or a chosen token outside the vocabulary."""
    from cloud_adapter.llm import TransformersSLM
    from edge_sdk.client import EdgeClient

    engine = CloudEngine(tiny_llm)

    class Tampering:
        def __init__(self, handler, tamper) -> None:
            self.handler, self.tamper = handler, tamper

        def handle(self, message):
            for reply in self.handler.handle(message):
                self.tamper(reply)
                yield reply

        def abandon(self, reason: str) -> None:
            self.handler.abandon(reason)

    def truncate(reply) -> None:
        if reply.WhichOneof("kind") == "distribution" and reply.distribution.ids:
            reply.distribution.ids = reply.distribution.ids[:40]
            reply.distribution.values = reply.distribution.values[:40]

    def scale(reply) -> None:
        if reply.WhichOneof("kind") == "distribution" and reply.distribution.ids:
            values = wire.values_from_bytes(reply.distribution.values) * 5
            reply.distribution.values = wire.values_to_bytes(values)

    def bad_token(reply) -> None:
        if reply.WhichOneof("kind") == "token":
            reply.token.token_id = 10**9

    slm = TransformersSLM(tiny_llm)
    for tamper, mode in ((truncate, "edge"), (scale, "edge"), (bad_token, "cloud")):
        client = EdgeClient(lambda tamper=tamper: Tampering(engine.session("tests"), tamper), slm=slm,
                            max_reconnects=0)
        with pytest.raises(CloudError) as caught:
            client.generate(PROMPT, "private note", mode=mode, max_new_tokens=2)
        assert caught.value.code == "DATA_LOSS", tamper.__name__


def test_streams_of_bytes_that_are_not_protobuf_are_refused_and_the_server_still_stops(tiny_llm) -> None:
    """Before, gRPC parsed each request: bytes that are not an EdgeMessage failed inside its request iterator,
    leaking the stream's state, and after 8-12 such streams ``server.stop()`` never returned (the adapter hung on
    SIGTERM). Raw bytes over real gRPC, through a generic stub with identity serializers."""
    engine = CloudEngine(tiny_llm, Limits(max_sessions=4, max_unopened_streams=4))
    with serving(engine, max_workers=12) as adapter:
        with grpc.insecure_channel(adapter.address) as channel:
            decode = channel.stream_stream(f"/{SERVICE_NAME}/Decode", request_serializer=None,
                                           response_deserializer=None)
            not_protobuf = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\x80" * 11, b"\x0f"]
            for index in range(20):
                with pytest.raises(grpc.RpcError) as caught:
                    list(decode(iter([not_protobuf[index % len(not_protobuf)]]), timeout=10))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, index
                assert "not a valid coveil.v1.EdgeMessage" in caught.value.details()
            # the server goes on decoding: a real open over the same raw path gets its reply
            replies = decode(iter([wire.encode_open(open_request(tiny_llm)).SerializeToString()]), timeout=10)
            first = next(replies)
            assert isinstance(first, bytes) and len(first) > 0
            replies.cancel()
        started = time.monotonic()
        adapter.server.stop(2).wait(timeout=10)
        assert time.monotonic() - started < 5
        # the cancelled session's handler thread releases it as it unwinds, which may end just after stop() returns
        while engine.active_sessions and time.monotonic() - started < 10:
            time.sleep(0.01)
        assert engine.active_sessions == 0


def test_the_transcript_directory_is_capped_on_disk_oldest_first(tiny_llm, tmp_path) -> None:
    """Before, ``--transcript-dir`` grew without bound: a long-running server filled its disk."""
    import os

    from cloud_adapter.cli import build_parser
    from cloud_adapter.limits import Limits

    directory = tmp_path / "transcripts"
    directory.mkdir()
    (directory / "left-by-an-earlier-run.json").write_text("x" * 30_000)  # counted, and the oldest
    os.utime(directory / "left-by-an-earlier-run.json", ns=(1, 1))
    (directory / "notes.txt").write_text("not a transcript: never counted nor deleted")
    cap = 120_000
    store = TranscriptStore(directory=directory, max_dir_bytes=cap)
    request = open_request(tiny_llm, mode="cloud")
    for n in range(12):
        transcript = SessionTranscript(f"s{n:02d}", request, "tiny", 4, 100)
        upload = CloudUpload(np.arange(1000), np.full(1000, 0.1, np.float32))  # ~15 kB of JSON per transcript
        transcript.steps.append(StepRecord(0, token_id=1, upload=upload, upload_size=1000))
        store.add(transcript)
        on_disk = sum(path.stat().st_size for path in directory.glob("*.json"))
        assert on_disk <= cap, n
    names = sorted(path.name for path in directory.iterdir())
    assert "left-by-an-earlier-run.json" not in names and "notes.txt" in names
    kept = [name for name in names if name.startswith("s")]
    assert kept[-1] == "s11.json" and "s00.json" not in kept and len(kept) >= 3
    assert kept == [f"s{n:02d}.json" for n in range(12 - len(kept), 12)]  # the newest, contiguous
    # the cap is a serve flag, with a default written once in Limits
    args = build_parser().parse_args(["serve", "--transcript-dir-bytes", "5000"])
    assert args.transcript_dir_bytes == 5000 and Limits().transcript_dir_bytes == 4096 * 1024 * 1024
