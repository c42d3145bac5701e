"""Issue 30: what an on-path observer reads of message sizes under TLS.

The real stack (an ``EdgeClient`` and a TLS adapter over the tiny transformers model) through recording proxies:
the observer's TLS record lengths, and the HTTP/2 DATA frames inside them (one gRPC message each, here).  Every
message the edge sends, and every row, pick and end the cloud sends, is padded to a size that depends only on
public settings, so two private contexts that steer different tokens and uploads give the same sizes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.protocol import wire
from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import make_policy
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.testing import ScriptedChannel, ScriptedCloud, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from tests.support.record_proxy import Http2Frames, RecordLengths
from tests.support.tiny_models import bpe_tokenizer, random_qwen
from tests.support.tls_material import pem_pair

pytest.importorskip("cryptography")

CONTEXTS = ("The liver is swollen.", "Alice has a broken wrist and a cough since Monday.")
QUESTION = "Which organ is affected?"
STEPS = 8
TLS_RECORD_OVERHEAD = 17  # TLS 1.3 with AES-GCM: the inner content type and the 16-byte tag
GRPC_PREFIX = 5  # a gRPC message's compressed flag and length, before it in the DATA frame


@dataclass
class Stack:
    slm: Any
    ca_pem: bytes
    outer: RecordLengths  # between the edge and the frame recorder: the edge's TLS records
    frames: Http2Frames
    inner: RecordLengths  # between the frame recorder and the adapter: the adapter's TLS records


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.inprocess import serving
    from cloud_adapter.llm import TransformersLLM, TransformersSLM
    from cloud_adapter.server import TlsConfig

    tokenizer = bpe_tokenizer()
    llm = TransformersLLM.from_loaded(random_qwen(tokenizer, output_rows=448, seed=9), tokenizer, "tiny-bpe")
    ca_key, ca_cert, _, ca_pem = pem_pair("coveil test CA", None, is_ca=True)
    _, _, key_pem, cert_pem = pem_pair("coveil cloud", (ca_key, ca_cert))
    with serving(CloudEngine(llm), tls=TlsConfig(cert_pem, key_pem), max_workers=8) as adapter:
        inner = RecordLengths(adapter.address)
        frames = Http2Frames(inner.address, ca_pem=ca_pem, cert_pem=cert_pem, key_pem=key_pem,
                             workdir=str(tmp_path_factory.mktemp("proxy")))
        outer = RecordLengths(frames.address)
        yield Stack(TransformersSLM(llm), ca_pem, outer, frames, inner)
        for proxy in (outer, frames, inner):
            proxy.close()


@dataclass
class Seen:
    tokens: list[int]
    up: list[int]  # DATA frame lengths, edge to cloud
    down: list[int]
    up_records: list[int]
    down_records: list[int]


def observe(stack: Stack, context: str, mode: str, lookahead: int) -> Seen:
    for proxy in (stack.outer, stack.frames, stack.inner):
        proxy.clear()
    with EdgeClient(stack.outer.address, slm=stack.slm, credentials=Credentials(root_cert=stack.ca_pem),
                    lookahead=lookahead) as client:
        tokens = client.generate(QUESTION, context, mode=mode, max_new_tokens=STEPS, alpha=0.1).token_ids
    time.sleep(0.2)  # the last frames of the close reach the recorders
    return Seen(tokens, stack.frames.data_frames("up"), stack.frames.data_frames("down"),
                list(stack.outer.records["up"]), list(stack.inner.records["down"]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_an_on_path_observer_reads_the_same_sizes_for_two_private_contexts(stack: Stack, mode: str) -> None:
    """Each of the edge's messages has one public size per kind (the open is the public prompt's; every signal
    the policy's largest), and so has each of the cloud's rows, picks and its end: the DATA frames (what the TLS
    records carry, give or take the flow-control and ping frames gRPC flushes with them) are the same sequence for
    both contexts in lockstep, and the same sizes in run-ahead (how many drafted rows went out there depends on
    which drafts the edge confirmed).  Without the padding the same runs differ (token ids and the cloud's
    ``forward_ns`` are varints, an upload holds 0 or 1 values), so the test can tell."""
    for lookahead in (0, 8):
        first, second = (observe(stack, context, mode, lookahead) for context in CONTEXTS)
        assert first.up == second.up and len(first.up) == STEPS + 1, (lookahead, first.up, second.up)
        assert len(set(first.up[2:])) == 1  # every signal of steps 1..127 the same size (step 0's field is omitted)
        if lookahead == 0:
            assert first.down == second.down, (first.down, second.down)
        else:
            assert set(first.down) == set(second.down), (first.down, second.down)
        # the observer's own view, TLS records, carries these frames with 17 bytes of TLS each (and whatever control
        # frames gRPC flushed with them, and the handshake)
        assert sum(first.up_records) >= sum(first.up) + TLS_RECORD_OVERHEAD
        assert sum(first.down_records) >= sum(first.down) + TLS_RECORD_OVERHEAD
    # hand-counted: a token signal is tag + length + (tag + step, tag + a 5-byte id) = 10 bytes and 2 of slack;
    # CoVeil's largest upload (one value) adds tag + length + (4 id bytes, 4 value bytes, 2 tags, 2 lengths) and
    # no_stop's 2 bytes: 22 bytes; each frame holds the message and gRPC's 5-byte prefix
    assert first.up[2] == (22 if mode == "cloud" else 12) + GRPC_PREFIX


def test_without_the_padding_the_same_runs_differ(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The protection removed (the codec's padding a no-op on both ends), the observer tells the two contexts
    apart in cloud-side lockstep: the picks' token ids and the rows' varints change the frames' sizes."""
    monkeypatch.setattr(wire, "pad_edge_message", lambda message, **_: message)
    monkeypatch.setattr(wire, "pad_cloud_message", lambda message, _request: message)
    first, second = (observe(stack, context, "cloud", 0) for context in CONTEXTS)
    assert first.tokens != second.tokens
    assert first.down != second.down


# -- the codec's padding, without the stack ------------------------------------------------------------------


@given(st.integers(min_value=2, max_value=70_000))
@settings(max_examples=200, deadline=None)
def test_padding_adds_exactly_the_bytes_asked_for(extra: int) -> None:
    """protobuf's own serialiser is the reference: the padded message is ``extra`` bytes longer, whatever the jumps
    of the entries' length prefixes (130 and 16,387 bytes cannot be one entry)."""
    message = wire.encode_token(5, 7)
    base = message.ByteSize()
    wire.pad_to(message, base + extra)
    assert len(message.SerializeToString()) == base + extra


def test_padding_is_appended_so_an_older_peer_reads_the_same_message() -> None:
    """Field 15 is serialised last: the padded bytes are the unpadded ones followed by padding entries only (tag
    0x7a), which a parser without the field skips as unknown."""
    plain = wire.encode_token(5, 300)
    padded = wire.pad_edge_message(wire.encode_token(5, 300), vocab_size=448, max_upload=1)
    data, base = padded.SerializeToString(), plain.SerializeToString()
    assert data.startswith(base) and data[len(base)] == 0x7A and len(data) > len(base)
    with pytest.raises(ValueError, match="more than the policy's public maximum"):
        wire.pad_edge_message(wire.encode_upload(0, _upload(2)), vocab_size=448, max_upload=1)


def _upload(n: int) -> Any:
    return CloudUpload(np.arange(n), np.full(n, 0.5, np.float32))


def _scripted_run(padded: bool, *, cloud_pads: bool = True) -> tuple[list[int], ScriptedCloud, list[Any]]:
    """A cloud-side CoVeil generation over the scripted cloud; what the cloud sent back, decoded."""
    peaked = np.full(8, -4.0, np.float32)
    peaked[3] = 4.0
    slm = TableSLM([chr(97 + i) for i in range(8)], default=peaked)
    cloud = ScriptedCloud(8, default=peaked, max_new_tokens=4)
    replies: list[Any] = []

    def connect() -> CloudConnection:
        session = cloud.session()
        if not cloud_pads:  # an adapter from before padding: it reads OpenSession.padded as an unknown field
            handle = session.handle
            session.handle = lambda message: handle(_without_padded(message))  # type: ignore[method-assign]
        channel = ScriptedChannel(session)
        receive = channel.receive
        channel.receive = lambda: replies.append(receive()) or replies[-1]  # type: ignore[method-assign]
        return CloudConnection(channel, padded=padded)

    decoder = CollaborativeDecoder(slm, make_policy("coveil"), DecodeSettings(mode="cloud", max_new_tokens=4,
                                                                              top_m=4), slm_prompt=[1, 2],
                                   cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    tokens = [event.token_id for event in run_with_resume(decoder, connect, backoff_s=0.0)]
    return tokens, cloud, replies


def _without_padded(message: Any) -> Any:
    if message.WhichOneof("kind") == "open":
        message.open.padded = False
    return message


def test_padding_is_negotiated_in_the_open_and_older_peers_still_decode() -> None:
    """A newer edge pads its signals and asks; a newer cloud answers ``padded`` and pads its rows, picks and end;
    an older edge asks nothing and gets plain messages; an older cloud answers nothing and sends plain ones, while
    the edge still pads its own.  The tokens are the same every way."""
    tokens, cloud, replies = _scripted_run(True)
    assert all(message.padding for message in replies if message.WhichOneof("kind") != "opened")
    assert replies[0].opened.padded and all(message.padding for message in cloud.edge_messages()[1:])
    older_edge, plain_cloud, plain = _scripted_run(False)
    assert not any(message.padding for message in plain) and not plain[0].opened.padded
    assert not any(message.padding for message in plain_cloud.edge_messages())
    older_cloud, _, unpadded = _scripted_run(True, cloud_pads=False)
    assert not any(message.padding for message in unpadded)
    assert tokens == older_edge == older_cloud
