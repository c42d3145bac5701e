"""Every carrier of the ``Decode`` stream held to :class:`~edge_sdk.protocol.channels.MessageChannel`'s contract, and the
WebSocket route's own rules (``/work``'s agreed contract: subprotocol, auth by header or browser subprotocol, TLS,
``4000 + status`` closes, text frames refused with 1003).  No model: the cloud is the public fake, served through
the real server code on loopback."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from cloud_adapter.limits import Limits
from cloud_adapter.server import TlsConfig
from cloud_adapter.websocket import DECODE_PATH, bearer_subprotocol
from edge_sdk.protocol import wire
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import make_policy
from edge_sdk.protocol.status import RETRYABLE_CODES, CloudError, close_frame, status_of_close
from edge_sdk.testing import ScriptedCloud, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.websocket import WebSocketCarrier, WebSocketChannel
from tests.support.carriers import Carrier, FakeEngine, served
from tests.support.tls_material import pem_pair

VOCAB = 6
ROWS = {(i,): np.log(np.roll([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], i)).astype(np.float32) for i in range(VOCAB)}


def generation(carrier: Carrier, mode: str, lookahead: int = 0) -> tuple[list[int], list[bytes]]:
    """Tokens and every message the fake cloud received, one undefended generation over ``carrier``."""
    pieces = ["<eos>"] + [f" w{i}" for i in range(1, VOCAB)]
    slm = TableSLM(pieces, ROWS, default=ROWS[(1,)], eos_ids={0})
    cloud = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)], eos_ids={0})
    decoder = CollaborativeDecoder(slm, make_policy("undefended"), DecodeSettings(mode=mode, max_new_tokens=5,
                                   top_m=3), slm_prompt=[1, 2], cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    list(run_with_resume(decoder, lambda: CloudConnection(carrier.channel(cloud.session), lookahead=lookahead),
                         max_reconnects=0, backoff_s=0.0))
    return decoder.tokens, cloud.sent


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_a_generation_is_the_same_over_every_carrier(carrier, mode: str) -> None:
    """The same tokens, and the same bytes in the same order at the cloud, as in process (run-ahead included)."""
    for lookahead in (0, 2):
        in_process = generation(Carrier("in_process", FakeEngine()), mode, lookahead)
        assert generation(carrier, mode, lookahead) == in_process
        assert len(in_process[0]) == 5


class Refusing:
    """A cloud session that refuses the edge's first signal with ``code``."""

    def __init__(self, code: str) -> None:
        self.code, self.cloud = code, ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)])
        self.session = self.cloud.session()

    def handle(self, message: Any) -> Any:
        if message.WhichOneof("kind") == "signal":
            raise CloudError(self.code, f"refused: {self.code} ✓")
        return self.session.handle(message)

    def abandon(self, reason: str) -> None:
        self.session.abandon(reason)


@pytest.mark.parametrize("code", ["RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAVAILABLE", "FAILED_PRECONDITION"])
def test_a_status_the_cloud_ends_with_reaches_the_edge_as_the_same_cloud_error(carrier, code: str) -> None:
    connection = CloudConnection(carrier.channel(lambda: Refusing(code)))
    connection.open(wire.SessionRequest(prompt_ids=(1,), mode="edge", vocab_size=VOCAB, top_m=3))
    connection.distribution()
    with pytest.raises(CloudError) as caught:
        connection.sync_token(0, 1)
        connection.distribution()
    error = caught.value
    assert (error.code, error.message, error.retryable) == (code, f"refused: {code} ✓", code in RETRYABLE_CODES)
    connection.close()


@pytest.mark.parametrize("name", ["grpc", "websocket"])
def test_a_stream_begins_at_the_first_send_not_when_the_channel_is_made(name: str) -> None:
    """The cloud sees a stream only once the edge sends (so it cannot time the SLM's prefill from the connect)."""
    engine = FakeEngine()
    for carrier_ in served(name, engine):
        channel = carrier_.channel(ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session)
        time.sleep(0.3)  # what a prefill of the private prompt would take
        assert engine.opened_at == []
        before = time.perf_counter()
        channel.send(wire.encode_open(wire.SessionRequest(prompt_ids=(1,), mode="edge", vocab_size=VOCAB, top_m=3)))
        assert channel.receive().WhichOneof("kind") == "opened"
        assert len(engine.opened_at) == 1 and engine.opened_at[0] >= before
        channel.close()


class RecordingSocket:
    """A socket that records what was written on it by when each write returned."""

    def __init__(self, socket: Any) -> None:
        self._socket, self.written = socket, bytearray()

    def sendall(self, data: bytes) -> None:
        self._socket.sendall(data)
        self.written += data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def test_a_websocket_send_returns_only_once_the_message_is_on_the_socket() -> None:
    engine = FakeEngine()
    for carrier_ in served("websocket", engine):
        channel = carrier_.channel(ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session)
        assert isinstance(channel, WebSocketChannel)
        connection = channel._begun()
        connection.socket = recording = RecordingSocket(connection.socket)
        message = wire.encode_open(wire.SessionRequest(prompt_ids=(1, 2, 3), mode="edge", vocab_size=VOCAB, top_m=3))
        channel.send(message)
        written, payload = bytes(recording.written), message.SerializeToString()
        # RFC 6455: FIN + binary opcode, the mask bit + the length (< 126 here), the 4-byte mask, the masked payload
        assert len(payload) < 126 and written[:2] == bytes([0x82, 0x80 | len(payload)])
        mask = written[2:6]
        assert bytes(b ^ mask[i % 4] for i, b in enumerate(written[6:6 + len(payload)])) == payload
        channel.close()


def test_close_codes_are_4000_plus_the_grpc_status_and_back() -> None:
    """The agreed codes, by hand and against grpc's own numbering; a reason cut to 123 bytes of UTF-8."""
    import grpc

    assert close_frame("RESOURCE_EXHAUSTED", "busy") == (4008, "busy")
    assert close_frame("INVALID_ARGUMENT", "x")[0] == 4003
    assert close_frame("UNAUTHENTICATED", "x")[0] == 4016
    assert close_frame("UNAVAILABLE", "x")[0] == 4014
    for code in grpc.StatusCode:
        assert close_frame(code.name, "")[0] == 4000 + code.value[0]
        error = status_of_close(4000 + code.value[0], "why")
        assert (error.code, error.message, error.retryable) == (code.name, "why", code.name in RETRYABLE_CODES)
    reason = close_frame("INTERNAL", "é" * 100)[1]  # 200 bytes: 61 whole characters fit in 123
    assert reason == "é" * 61 and len(reason.encode()) == 122
    assert status_of_close(1000, "").code == "UNAVAILABLE" and status_of_close(1000, "").retryable
    assert status_of_close(None, "").code == "UNAVAILABLE"
    assert (status_of_close(1009, "").code, status_of_close(1009, "").retryable) == ("RESOURCE_EXHAUSTED", False)


def test_a_message_past_the_server_s_limit_is_resource_exhausted_not_retried() -> None:
    """The server's ``max_message_bytes`` holds over WebSocket too (the library closes with 1009), and the edge
    reads it as gRPC's limit (``RESOURCE_EXHAUSTED``), not as a broken stream to retry."""
    engine = FakeEngine(Limits(max_message_bytes=256))
    for carrier_ in served("websocket", engine):
        channel = carrier_.channel(ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session)
        prompt = tuple(range(1, 200))  # an open of ~400 bytes
        channel.send(wire.encode_open(wire.SessionRequest(prompt_ids=prompt, mode="edge", vocab_size=VOCAB, top_m=3)))
        with pytest.raises(CloudError) as caught:
            channel.receive()
        assert caught.value.code == "RESOURCE_EXHAUSTED" and not caught.value.retryable
        channel.close()


def raw_connect(url: str, **kwargs: Any) -> Any:
    from websockets.sync.client import connect

    return connect(url, compression=None, open_timeout=5, legacy=True, **kwargs)


def test_the_websocket_route_takes_a_token_by_header_or_browser_subprotocol_and_refuses_others() -> None:
    from websockets.exceptions import InvalidStatus

    engine = FakeEngine()
    for carrier_ in served("websocket", engine, token="s3cret"):
        engine.factory = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session
        with raw_connect(carrier_.url, subprotocols=["coveil.v1"],
                         additional_headers={"Authorization": "Bearer s3cret"}) as ws:
            assert ws.subprotocol == "coveil.v1"
        # a browser: the token as a second subprotocol, never echoed back
        with raw_connect(carrier_.url, subprotocols=["coveil.v1", bearer_subprotocol("s3cret")]) as ws:
            assert ws.subprotocol == "coveil.v1"
            assert ws.response.headers["Sec-WebSocket-Protocol"] == "coveil.v1"
        assert bearer_subprotocol("s3cret") == "coveil.bearer.czNjcmV0"  # base64url of b"s3cret", unpadded
        for headers, offered in ((None, ["coveil.v1"]), ({"Authorization": "Bearer wrong"}, ["coveil.v1"]),
                                 (None, ["coveil.v1", bearer_subprotocol("wrong")]), (None, ["coveil.v1", "coveil.bearer.!!"])):
            with pytest.raises(InvalidStatus) as refused:
                raw_connect(carrier_.url, subprotocols=offered, additional_headers=headers)
            assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as refused:  # no coveil.v1 offered: the upgrade is refused
            raw_connect(carrier_.url, subprotocols=["other"], additional_headers={"Authorization": "Bearer s3cret"})
        assert refused.value.response.status_code == 400
        with pytest.raises(InvalidStatus) as refused:
            raw_connect(carrier_.url.replace(DECODE_PATH, "/other"), subprotocols=["coveil.v1"],
                        additional_headers={"Authorization": "Bearer s3cret"})
        assert refused.value.response.status_code == 404
        # the edge's channel: a missing token is UNAUTHENTICATED, not retried
        with pytest.raises(CloudError) as caught:
            WebSocketChannel(carrier_.url).send(wire.encode_close())
        assert caught.value.code == "UNAUTHENTICATED" and not caught.value.retryable


def test_an_edge_client_reads_the_websocket_route_s_state() -> None:
    from edge_sdk.client import Credentials, EdgeClient

    slm = TableSLM(["<eos>"] + [f" w{i}" for i in range(1, VOCAB)], default=ROWS[(1,)])
    engine = FakeEngine()
    for carrier_ in served("websocket", engine, token="s3cret"):
        engine.factory = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session
        good = EdgeClient(carrier_.url, slm=slm, credentials=Credentials(token="s3cret", plaintext=True))
        assert good.cloud_status() == "serving"
        bad = EdgeClient(carrier_.url, slm=slm, credentials=Credentials(token="wrong", plaintext=True))
        assert bad.cloud_status() == "unknown"
        url = carrier_.url
    gone = EdgeClient(url, slm=slm, credentials=Credentials(token="s3cret", plaintext=True))
    assert gone.cloud_status(timeout_s=1.0) == "unreachable"


def test_a_text_frame_closes_the_stream_with_1003() -> None:
    from websockets.exceptions import ConnectionClosed

    engine = FakeEngine()
    for carrier_ in served("websocket", engine):
        engine.factory = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session
        with raw_connect(carrier_.url, subprotocols=["coveil.v1"]) as ws:
            ws.send("open")
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=5)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003


def test_a_websocket_stream_that_sends_nothing_is_ended_with_4004() -> None:
    from websockets.exceptions import ConnectionClosed

    engine = FakeEngine(Limits(open_timeout_s=0.2))
    for carrier_ in served("websocket", engine):
        engine.factory = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session
        with raw_connect(carrier_.url, subprotocols=["coveil.v1"]) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4004  # DEADLINE_EXCEEDED
        assert "sent no open" in closed.value.rcvd.reason


def test_wss_serves_with_the_adapter_s_tls_material_and_the_edge_verifies_it() -> None:
    from edge_sdk.client import Credentials

    pytest.importorskip("cryptography")
    ca_key, ca_cert, _, ca_pem = pem_pair("coveil test CA", None, is_ca=True)
    _, _, key_pem, cert_pem = pem_pair("coveil cloud", (ca_key, ca_cert))
    _, _, client_key_pem, client_cert_pem = pem_pair("coveil edge", (ca_key, ca_cert))
    engine = FakeEngine()
    for carrier_ in served("websocket", engine, tls=TlsConfig(cert_pem, key_pem, client_ca=ca_pem)):
        url = carrier_.url.replace("ws://", "wss://")
        open_ = wire.encode_open(wire.SessionRequest(prompt_ids=(1,), mode="edge", vocab_size=VOCAB, top_m=3))
        engine.factory = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)]).session
        mtls = Credentials(root_cert=ca_pem, client_cert=client_cert_pem, client_key=client_key_pem)
        channel = WebSocketCarrier(url, mtls, timeout_s=10)()
        channel.send(open_)
        assert channel.receive().WhichOneof("kind") == "opened"
        channel.close()
        for credentials in (Credentials(root_cert=ca_pem), Credentials()):  # no client certificate; unknown CA
            with pytest.raises(CloudError) as caught:
                channel = WebSocketCarrier(url, credentials, timeout_s=10)()
                channel.send(open_)
                channel.receive()
            assert caught.value.code == "UNAVAILABLE"
    with pytest.raises(ValueError, match="plaintext"):
        WebSocketCarrier("ws://127.0.0.1:1/", Credentials())
    with pytest.raises(ValueError, match="loopback"):
        WebSocketCarrier("ws://cloud.example:80/", Credentials(plaintext=True))
    assert WebSocketCarrier("wss://cloud.example", Credentials()).url == "wss://cloud.example/coveil/v1/decode"


@pytest.mark.parametrize("why", ["the model worker died", "the server is shutting down"])
def test_a_new_websocket_stream_is_refused_once_the_worker_died_or_the_server_stops_and_running_ones_go_on(
        why: str) -> None:
    """What gRPC does (health NOT_SERVING once the worker died; no new stream in the stop's grace), the WebSocket
    route does too: a new upgrade gets HTTP 503 naming why, the edge reads ``not_serving`` (and retries
    elsewhere), and a generation already running finishes."""
    from websockets.exceptions import InvalidStatus

    from cloud_adapter.websocket import start_websocket_server
    from edge_sdk.client import Credentials, EdgeClient

    engine = FakeEngine()
    engine.runner = SimpleNamespace(on_death=[])
    engine.factory = ScriptedCloud(VOCAB, ROWS, default=ROWS[(2,)], eos_ids={0}).session
    server = start_websocket_server(engine, host="127.0.0.1", port=0)
    url = f"ws://127.0.0.1:{server.port}{DECODE_PATH}"
    try:
        slm = TableSLM(["<eos>"] + [f" w{i}" for i in range(1, VOCAB)], ROWS, default=ROWS[(1,)], eos_ids={0})
        decoder = CollaborativeDecoder(slm, make_policy("undefended"), DecodeSettings(mode="edge", max_new_tokens=5,
                                       top_m=3), slm_prompt=[1, 2], cloud_prompt=[1], meter=LeakageMeter(frozenset()))
        steps = run_with_resume(decoder, lambda: CloudConnection(WebSocketChannel(url)), max_reconnects=0)
        next(steps)  # a stream is running
        if why == "the model worker died":
            for callback in engine.runner.on_death:
                callback()
        else:
            server.stop_accepting()
        with pytest.raises(InvalidStatus) as refused:
            raw_connect(url, subprotocols=["coveil.v1"])
        assert refused.value.response.status_code == 503 and why in refused.value.response.body.decode()
        assert EdgeClient(url, slm=slm, credentials=Credentials(plaintext=True)).cloud_status() == "not_serving"
        list(steps)
        assert len(decoder.tokens) == 5
    finally:
        server.shutdown()


def test_a_websocket_server_started_after_the_worker_died_refuses_every_stream() -> None:
    from websockets.exceptions import InvalidStatus

    from cloud_adapter.websocket import start_websocket_server

    engine = FakeEngine()
    engine.runner = SimpleNamespace(on_death=[], died=True)  # its callbacks ran before the route existed
    server = start_websocket_server(engine, host="127.0.0.1", port=0)
    try:
        with pytest.raises(InvalidStatus) as refused:
            raw_connect(f"ws://127.0.0.1:{server.port}{DECODE_PATH}", subprotocols=["coveil.v1"])
        assert refused.value.response.status_code == 503
    finally:
        server.shutdown()
