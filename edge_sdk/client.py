"""The app-facing API: :class:`EdgeClient`.

>>> client = EdgeClient("cloud.example:50051", slm=LlamaCppSLM(), credentials=Credentials(token="..."))
>>> result = client.generate("Which diagnosis fits?", private_context="...notes...", mode="edge")
>>> result.text, result.ledger.summary()

The private context is only ever given to the local SLM; the cloud receives
the public query, the policy's per-step signals and the tokens chosen.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.activity import ActivityLog
from edge_sdk.backends.base import SLMBackend
from edge_sdk.decode_settings import AUTO, DecodeSettings
from edge_sdk.grammar import JsonConstraint, check_public_schema
from edge_sdk.backends.pieces import piece_reader
from edge_sdk.privacy.meter import LeakageMeter, content_token_ids
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.logprobs import TokenLogprobs
from edge_sdk.privacy.masking import folded_vocabulary, never_upload_ids
from edge_sdk.pace_calibration import calibrated_pace_ms
from edge_sdk.policies import Policy, make_policy
from edge_sdk.prompts import CONTEXT_SEPARATOR, Prompts, plain_prompts
from edge_sdk.decoding import CollaborativeDecoder, StepEvent, run_with_resume
from edge_sdk.steps import StoppingRule
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import CloudSessionHandler, GrpcChannel, InProcessChannel, MessageChannel, is_loopback
from edge_sdk.protocol.websocket import WebSocketCarrier
from edge_sdk.protocol.wire import MAX_LOOKAHEAD

__all__ = ["CONTEXT_SEPARATOR", "Credentials", "EdgeClient", "GenerationResult", "GenerationStream", "StreamStep"]

#: what a partly decoded UTF-8 character reads as until its last byte arrives
_INCOMPLETE = "\ufffd"
#: the default deadline of one session's stream (a generation of 1024 tokens at 2 tokens/s fits)
DEFAULT_SESSION_TIMEOUT_S = 900.0
#: gRPC's reconnect backoff on the adapter's channel, first and longest (ms): see ``_open_grpc_channel``
RECONNECT_BACKOFF_MS = (500, 2000)
#: the service the adapter reports to gRPC health checks (``proto/coveil.proto``'s package and service)
CLOUD_SERVICE = "coveil.v1.CollaborativeDecoding"


def grpc_target(cloud: str | Sequence[str]) -> str:
    """The gRPC target for one address or several replicas (``["10.0.0.1:50051", "10.0.0.2:50051"]`` →
    ``"ipv4:10.0.0.1:50051,10.0.0.2:50051"``, which gRPC balances with ``round_robin``)."""
    if isinstance(cloud, str):
        return cloud
    addresses = [str(a).strip() for a in cloud]
    if not addresses:
        raise ValueError("no cloud adapter address given")
    if len(addresses) == 1:
        return addresses[0]
    families = set()
    for address in addresses:
        host = address.rsplit(":", 1)[0].strip("[]")
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise ValueError(
                f"replica {address!r} is not an ip:port: list IP addresses, or give one DNS name whose records "
                "name the replicas ('dns:///cloud.example:50051')"
            ) from None
    if len(families) != 1:
        raise ValueError("list replicas of one address family (all IPv4 or all IPv6)")
    return f"ipv{families.pop()}:" + ",".join(addresses)


@dataclass(frozen=True)
class Credentials:
    """How to authenticate to a cloud adapter.

    TLS is the default: with no ``root_cert`` the server is verified against
    the system's trust roots.  ``plaintext=True`` turns TLS off and is
    accepted only for a loopback address (a local adapter); the client never
    falls back to plaintext on its own.

    Args:
        token: bearer token sent as ``authorization: Bearer <token>`` (``None``: none; never empty).
        root_cert: PEM of the CA that signed the server's certificate (``None``: the system's roots).
        client_cert, client_key: PEM pair for mutual TLS.
        plaintext: no TLS (loopback only).
    """

    token: str | None = None
    root_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    plaintext: bool = False

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ValueError("an empty bearer token authenticates nobody: pass token=None for no token")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together (mutual TLS)")
        if self.plaintext and (self.root_cert is not None or self.client_cert is not None):
            raise ValueError("plaintext=True cannot use TLS material (root_cert, client_cert)")

    def __repr__(self) -> str:
        shown = [f"token={'<set>' if self.token else None}"]
        shown += [f"{name}={'<set>' if getattr(self, name) is not None else None}"
                  for name in ("root_cert", "client_cert", "client_key")]
        return f"Credentials({', '.join(shown)}, plaintext={self.plaintext})"

    @classmethod
    def from_files(
        cls,
        *,
        token_file: str | Path | None = None,
        root_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        plaintext: bool = False,
    ) -> Credentials:
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        token = Path(token_file).read_text().strip() if token_file else None
        if token_file and not token:
            raise ValueError(f"token file {token_file} is empty")
        return cls(token, read(root_cert), read(client_cert), read(client_key), plaintext)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self, address: str) -> Any:
        """``grpc.ChannelCredentials`` for ``address``, or ``None`` for plaintext (loopback only)."""
        import grpc

        if self.plaintext:
            if not is_loopback(address):
                raise ValueError(
                    f"refusing plaintext to {address}: it is not a loopback address; give the adapter's CA "
                    "(root_cert / --tls-ca) or rely on the system's trust roots"
                )
            return None
        return grpc.ssl_channel_credentials(self.root_cert, self.client_key, self.client_cert)


@dataclass
class GenerationResult:
    """A finished generation: the text, its token ids and the privacy ledger."""

    text: str
    token_ids: list[int]
    ledger: PrivacyLedger
    finish_reason: str


@dataclass(frozen=True)
class StreamStep:
    """One decided token: the text it completes and what the cloud saw at its step.

    ``text`` is empty while the token ends inside a multi-byte character (its
    bytes come out with the token that completes it).
    """

    text: str
    entry: LedgerEntry
    logprobs: TokenLogprobs | None = None  # the token's log-probabilities, when the decoder was asked for them


class GenerationStream:
    """An iterator over the text of each decided token, with the generation's ledger.

    Iterating yields text only; :meth:`steps` yields every step with its ledger
    entry (what a live view colours each token by).
    """

    def __init__(self, slm: SLMBackend, decoder: CollaborativeDecoder, events: Iterator[StepEvent]) -> None:
        self._slm = slm
        self._decoder = decoder
        self._events = events
        self._emitted = ""

    @property
    def ledger(self) -> PrivacyLedger:
        return self._decoder.ledger

    @property
    def token_ids(self) -> list[int]:
        return list(self._decoder.tokens)

    @property
    def text(self) -> str:
        return self._slm.detokenize(self._decoder.tokens)

    @property
    def finish_reason(self) -> str | None:
        """Why decoding ended (``eos``, ``max_new_tokens``, ``stop_rule``), ``None`` while it runs."""
        return self._decoder.finish_reason

    def steps(self) -> Iterator[StreamStep]:
        """Decode step by step: each decided token with the text it completes and its ledger entry."""
        for event in self._events:
            text = self.text
            piece = ""
            # a token can end mid-character: emit once the text extends what was shown by whole characters
            if not text.endswith(_INCOMPLETE) and text.startswith(self._emitted) and len(text) > len(self._emitted):
                piece, self._emitted = text[len(self._emitted) :], text
            yield StreamStep(piece, event.entry, event.logprobs)

    def __iter__(self) -> Iterator[str]:
        for step in self.steps():
            if step.text:
                yield step.text

    def close(self) -> None:
        """Stop decoding and close the cloud session."""
        self._events.close()  # type: ignore[attr-defined]

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_process_channel(cloud: Callable[[], CloudSessionHandler]) -> MessageChannel:
    """A channel straight into a fresh session of an in-process cloud."""
    return InProcessChannel(cloud())


Vocabulary = tuple[Callable[[int], str], dict[str, tuple[int, ...]]]
_VOCABULARY_LOCK = threading.Lock()
#: where :func:`vocabulary_of` keeps an SLM's vocabulary reading, on the SLM
_VOCABULARY_ATTRIBUTE = "_coveil_vocabulary"


def _read_vocabulary(slm: SLMBackend) -> Vocabulary:
    """Each id's piece, and every id by its folded piece (:func:`~edge_sdk.privacy.masking.folded_vocabulary`)."""
    piece = piece_reader(slm)
    return piece, folded_vocabulary(piece, slm.vocab_size)


def vocabulary_of(slm: SLMBackend) -> Future[Vocabulary]:
    """``slm``'s pieces and ``never_upload``'s folded index of them, read once per SLM in a background thread (about
    a second for Gemma-3's 262k pieces) and kept on the SLM for every client over it; an
    SLM that takes no new attribute gets a reading per call."""
    with _VOCABULARY_LOCK:
        reading = getattr(slm, _VOCABULARY_ATTRIBUTE, None)
        if reading is None:
            reading = _started(slm)
            try:
                setattr(slm, _VOCABULARY_ATTRIBUTE, reading)
            except AttributeError:  # __slots__, a frozen dataclass: nowhere to keep it
                pass
        return reading


def _started(slm: SLMBackend) -> Future[Vocabulary]:
    building = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coveil-vocabulary")
    reading = building.submit(_read_vocabulary, slm)
    building.shutdown(wait=False)
    return reading


class EdgeClient:
    """Collaborative decoding from the device.

    Args:
        cloud: ``"host:port"`` of a cloud adapter; several replicas as a list of
            ``"ip:port"`` (or one DNS name with several records, ``"dns:///cloud.example:50051"``):
            sessions are spread over them by gRPC's ``round_robin`` policy and a
            session whose replica dies resumes on another; a ``ws://`` or ``wss://`` URL: the adapter's
            WebSocket route (``coveil-cloud serve --ws-port``, :mod:`edge_sdk.protocol.websocket`); or a
            zero-argument callable returning a cloud session handler (in-process use: tests, harness).
        channel: instead of ``cloud``, any carrier: a zero-argument factory returning a fresh
            :class:`~edge_sdk.protocol.channels.MessageChannel` for each session (its duties are written there).
        slm: the edge model (e.g. :class:`edge_sdk.backends.llama_cpp.LlamaCppSLM`).
        credentials: token and TLS material for a remote adapter.
        timeout_s: per-session deadline on the gRPC stream (``None`` = none); the channel also pings the
            adapter every 20 s, so a dead connection is noticed within half a minute, not at the deadline.
        max_reconnects: how often a broken session is reopened before giving up.
        lookahead: the deepest run-ahead this client's generations accept unless their settings say
            (``DecodeSettings.lookahead``, which wins: ``generate(..., lookahead=0)``): rows the cloud drafts past
            the last confirmed token, so a round trip is not paid per token (the cloud adapts the depth to the
            link); 0 = lockstep.  What the edge sends is the same either way.  Default: ``wire.MAX_LOOKAHEAD`` (8)
            to a remote adapter, 0 in process (no round trip to hide: drafts would only add work).
        activity_log: where each finished generation's activity record goes (:meth:`activity`); default a
            bounded log in memory, ``ActivityLog(path=...)`` to keep it in a private file.
    """

    def __init__(
        self,
        cloud: str | Sequence[str] | Callable[[], CloudSessionHandler] | None = None,
        *,
        slm: SLMBackend,
        channel: Callable[[], MessageChannel] | None = None,
        credentials: Credentials | None = None,
        timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
        max_reconnects: int = 3,
        lookahead: int | None = None,
        activity_log: ActivityLog | None = None,
    ) -> None:
        if lookahead is None:
            lookahead = 0 if callable(cloud) else MAX_LOOKAHEAD
        if lookahead < 0:
            raise ValueError(f"lookahead must be non-negative (0 = lockstep), got {lookahead}")
        self.lookahead = lookahead
        self.slm = slm
        self.credentials = credentials or Credentials()
        self.timeout_s = timeout_s
        self.max_reconnects = max_reconnects
        if (cloud is None) == (channel is None):
            raise ValueError("give the cloud (an address, a ws:// URL or a session factory) or a channel factory")
        self._in_process = callable(cloud)
        self._target: str | None = None  # the gRPC target, where gRPC carries the sessions (the default)
        if isinstance(cloud, str) and cloud.startswith(("ws://", "wss://")):
            channel = WebSocketCarrier(cloud, self.credentials, timeout_s=timeout_s)
        elif callable(cloud):
            channel = partial(_in_process_channel, cloud)
        elif cloud is not None:
            self._target = grpc_target(cloud)
        self._channel = channel  # None: gRPC, on one channel shared by the sessions
        self._grpc_channel: Any = None
        # the SLM's pieces and never_upload's folded index of them, built once from now on in the background: every
        # generation waits for both, masked or not, so the first that masks a span opens when an unmasked one
        # would (built at the first never_upload, the index's 0.5-1.5 s for Gemma-3 told the cloud a mask was new)
        self._vocabulary = vocabulary_of(self.slm)
        self._idle_since = -math.inf  # when this client's last generation ended (perf_counter clock)
        self._pace_lock = threading.Lock()
        self._calibrated_pace_ms: float | None = None
        self.activity_log = activity_log if activity_log is not None else ActivityLog()

    def calibrated_pace_ms(self) -> float:
        """The pace ``pace_ms="auto"`` (or ``auto_pace_ms="auto"``) stands for on this client: measured on a public
        prompt at the first call (:func:`~edge_sdk.pace_calibration.calibrated_pace_ms`; call it when the client
        starts to take that time then), the same for every generation after it."""
        with self._pace_lock:
            if self._calibrated_pace_ms is None:
                self._vocabulary.result()  # the SLM to itself: its pieces are read in the background till then
                self._calibrated_pace_ms = calibrated_pace_ms(self.slm)
                # the SLM was busy on public work till now: the next generation's private work begins after it
                self._idle_since = max(self._idle_since, time.perf_counter())
            return self._calibrated_pace_ms

    @property
    def pace_measured(self) -> bool:
        """Whether :meth:`calibrated_pace_ms` has measured the pace (a call returns at once)."""
        return self._calibrated_pace_ms is not None

    def _paced(self, settings: DecodeSettings) -> DecodeSettings:
        """``settings`` with an ``"auto"`` pace replaced by :meth:`calibrated_pace_ms`."""
        auto = {name: self.calibrated_pace_ms() for name in ("pace_ms", "auto_pace_ms")
                if getattr(settings, name) == AUTO}
        return settings.overridden(**auto) if auto else settings

    # -- connections -------------------------------------------------------------------------------
    def _connect(self, settings: DecodeSettings) -> CloudConnection:
        """A connection for a generation under ``settings``: its run-ahead depth, else this client's."""
        lookahead = self.lookahead if settings.lookahead is None else settings.lookahead
        return CloudConnection(self._carrier(), lookahead=lookahead)

    def _carrier(self) -> MessageChannel:
        """The channel one session's messages travel: the ``channel`` factory's, else over gRPC."""
        if self._channel is not None:
            return self._channel()
        if self._grpc_channel is None:
            self._grpc_channel = self._open_grpc_channel(self._target)
        return GrpcChannel(self._grpc_channel, metadata=self.credentials.metadata, timeout_s=self.timeout_s)

    def _open_grpc_channel(self, target: str) -> Any:
        import grpc

        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.lb_policy_name", "round_robin"),  # one session per replica in turn, skipping dead ones
            # after an outage a session fails at once (UNAVAILABLE) until the channel's next connection attempt;
            # gRPC spaces those attempts up to 120 s apart (an endpoint answered 503 for ~24 s after a 90 s outage
            # had ended), here at most RECONNECT_BACKOFF_MS: one TCP connect every 2 s while the adapter is down
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ]
        tls = self.credentials.channel_credentials(target)
        if tls is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, tls, options=options)

    def cloud_status(self, timeout_s: float = 1.0) -> str:
        """The adapter's state by gRPC health checking (its service :data:`CLOUD_SERVICE`): ``"serving"``,
        ``"not_serving"`` (up, its model not ready or dead), ``"unreachable"`` (no answer within ``timeout_s``),
        or ``"unknown"`` (it does not answer health checks); an in-process cloud is ``"serving"``.  Needs
        ``grpcio-health-checking`` (the ``server`` extra).  Another carrier answers through its factory's
        ``status(timeout_s)`` (the WebSocket route's: whether it accepts a stream), else ``"unknown"``."""
        if self._in_process:
            return "serving"
        if self._target is None:  # another carrier: its factory may say
            status = getattr(self._channel, "status", None)
            return str(status(timeout_s)) if status is not None else "unknown"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self._grpc_channel is None:
            self._grpc_channel = self._open_grpc_channel(self._target)
        stub = health_pb2_grpc.HealthStub(self._grpc_channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=CLOUD_SERVICE), timeout=timeout_s,
                               metadata=self.credentials.metadata)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "unreachable"
            return "not_serving" if exc.code() == grpc.StatusCode.NOT_FOUND else "unknown"
        return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"

    def close(self) -> None:
        """Close the gRPC channel (sessions close themselves)."""
        if self._grpc_channel is not None:
            self._grpc_channel.close()
            self._grpc_channel = None

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- generation --------------------------------------------------------------------------------
    def decoder(
        self,
        public_query: str | Prompts,
        private_context: str = "",
        *,
        settings: DecodeSettings | None = None,
        policy: Policy | str = "coveil",
        never_upload: Sequence[str] = (),
        rng: np.random.Generator | None = None,
        stopping: StoppingRule | None = None,
        json_schema: dict[str, Any] | None = None,
        prompt_prefix: Sequence[int] | None = None,
        **overrides: Any,
    ) -> CollaborativeDecoder:
        """Build the decoder for one generation (what :meth:`stream` runs).

        ``settings`` (default :class:`~edge_sdk.decode_settings.DecodeSettings`'s defaults: ``alpha`` 0.3,
        cloud-side fusion, 256 tokens ...) with ``overrides`` applied to a copy: ``mode=``, ``alpha=``,
        ``max_new_tokens=``, ``temperature=``, ``top_m=``, ``seed=``, ``exposure_k=``, ``exposure_budget=``,
        ``max_epsilon=``, ``epsilon_delta=``, ``pace_ms=``, ``lookahead=`` (this generation's run-ahead depth,
        over the client's); a name that is not a setting is a ``TypeError``.

        ``seed`` is the *cloud's* sampling seed for cloud-side fusion at
        ``temperature > 0``; it is public (sent when the session opens, never in
        edge-side fusion) and never seeds the edge.  Randomised policies draw
        from ``rng``: by default a generator seeded from OS entropy per
        generation, so nothing the cloud sees lets it replay the edge's noise.
        Pass an explicit generator only where reproducibility matters more
        (tests, audits run in one process).

        ``public_query`` is text (the SLM then reads ``private_context + "\\n\\n" + public_query``,
        :func:`edge_sdk.prompts.plain_prompts`) or ready :class:`~edge_sdk.prompts.Prompts`, e.g. a
        conversation rendered with the model's chat template (:func:`edge_sdk.prompts.chat_prompts`), which
        carry their private text themselves.  ``temperature``: the cloud's sampling temperature in
        cloud-side fusion (0 = greedy).

        ``max_epsilon``: a privacy budget for the DP policies.  Before one more
        releasing step would spend more than it (at ``epsilon_delta``; default
        the policy's own delta) the edge sends only what the cloud could
        produce alone, as ``exposure_budget`` does; the switch depends only on
        public numbers and the count of releasing steps.  A heuristic policy
        (no DP guarantee) releases nothing under a budget.  What was spent:
        ``result.ledger.privacy()``.

        ``json_schema``: the reply is a JSON document valid under this (public) schema: the fused distribution
        is masked to the ids the schema allows where the token is picked (:mod:`edge_sdk.grammar`), edge-side by
        the edge (which then asks for full rows), cloud-side by the cloud (the schema is sent with the session;
        the edge checks each token against its own copy of the grammar, and uploads as without a schema); a
        schema that cannot be compiled raises :class:`edge_sdk.grammar.GrammarError`.  A cloud-side schema is
        public like the question: one that holds a ``never_upload`` span or text of the private context is
        refused (:class:`~edge_sdk.grammar.PrivateSchemaError`, naming where; :func:`edge_sdk.grammar.check_public_schema`);
        apply a private schema edge-side (``mode="edge"``).

        ``logprobs``: each step's :class:`~edge_sdk.logprobs.TokenLogprobs` (the token's log-probability and
        the ``logprobs`` best ids', 0 to 20) under the fused row it was chosen from
        (:mod:`edge_sdk.logprobs`): edge-side computed on the device (nothing sent changes), cloud-side sent by
        the cloud with each token it picks (the session asks for them).

        ``prompt_prefix`` (edge-side only): score the public prompt too, after the generation
        (:meth:`~edge_sdk.decoding.CollaborativeDecoder.prompt_logprobs`), its tokens read after these SLM ids.
        """
        # an "auto" pace is measured on public text before any private work begins
        settings = self._paced((settings or DecodeSettings()).overridden(**overrides))
        began_at = time.perf_counter()  # before the private text is read: the prefill budget's grid starts here
        piece, vocabulary = self._vocabulary.result()  # before the SLM is used here (the build reads it)
        if isinstance(policy, str):
            policy = make_policy(policy, backend=self.slm)  # a policy that needs the model builds from it
        slm = self.slm
        if isinstance(public_query, Prompts):
            if private_context:
                raise ValueError("Prompts carry their private text: pass no private_context beside them")
            prompts = public_query
        else:
            prompts = plain_prompts(slm, public_query, private_context)
        private_context = prompts.private_text
        private_ids = content_token_ids(private_context, lambda t: slm.tokenize(t, add_bos=False), piece)
        masked = never_upload_ids(never_upload, private_context, lambda t: slm.tokenize(t, add_bos=False), piece,
                                  vocabulary)
        if json_schema is not None and settings.mode == "cloud":  # a defence: the schema is sent as it is
            check_public_schema(json_schema, private_context=private_context, never_upload=tuple(never_upload),
                                public_text=slm.detokenize(list(prompts.cloud_ids)))
        decoder = CollaborativeDecoder(
            slm,
            policy,
            settings,
            slm_prompt=list(prompts.slm_ids),
            cloud_prompt=list(prompts.cloud_ids),
            meter=LeakageMeter(frozenset(private_ids)),
            masked_ids=masked,
            # the policy's randomness comes from OS entropy, never from anything on the wire
            rng=rng if rng is not None else np.random.default_rng(),
            stopping=stopping,
            processors=[JsonConstraint(slm, json_schema)] if json_schema is not None else (),
            prompt_prefix=prompt_prefix,
        )
        decoder.pacer.begin(began_at)
        return decoder

    def stream(self, public_query: str | Prompts, private_context: str = "", *,
               settings: DecodeSettings | None = None, **kwargs: Any) -> GenerationStream:
        """Decode token by token: iterate the returned stream for each token's text as it is decided.

        The stream's ``ledger`` fills in step by step; :meth:`GenerationStream.close`
        (or leaving a ``with`` block, or stopping the iteration and dropping the
        stream) closes the cloud session.  Arguments as for :meth:`decoder`.
        """
        return self.run(self.decoder(public_query, private_context, settings=settings, **kwargs))

    def run(self, decoder: CollaborativeDecoder, *, began_at: float | None = None) -> GenerationStream:
        """Stream a decoder built by :meth:`decoder` (build it first to check a request's settings before any
        model or network work; the stream runs on this client's connections, resuming as :meth:`stream` does).

        The prefill budget's grid (``DecodeSettings.prefill_budget_ms``) starts when the generation's private
        work on the device began: when :meth:`decoder` began building it, or ``began_at`` if earlier
        (``time.perf_counter``: an endpoint that tokenised the private text itself gives when it began), but no
        earlier than when this client's previous generation ended (a decoder built while that one ran).  Run a
        decoder as soon as it is built: the wait between the two is counted as private work, and a wait past the
        budget opens a budget later (``ledger.prefill_overrun``)."""
        return GenerationStream(self.slm, decoder, self._steps(decoder, began_at))

    def score_prompt(self, decoder: CollaborativeDecoder, top_n: int) -> list[TokenLogprobs]:
        """Echo with logprobs: ``decoder``'s :meth:`~edge_sdk.decoding.CollaborativeDecoder.prompt_logprobs`,
        once its generation ran on this client.  That SLM work (a prefill over the private context, a step per
        public token) comes after the close and grows with the private context, and an app asks its next
        question once this one is answered: with ``prefill_budget_ms`` the rows come back at the first point of
        the budget's grid from the close (:meth:`~edge_sdk.steps.Pacer.wait_after_end`; a scoring past the first
        sets ``ledger.prefill_overrun``), even when scoring fails, and this client's next generation's grid
        starts no earlier than that point, so neither an app's next request nor one that arrived meanwhile opens
        at a time that depends on the scoring.  Without a budget the cloud can time it, as any unbudgeted
        prefill."""
        try:
            return decoder.prompt_logprobs(top_n)
        finally:
            answered = decoder.pacer.wait_after_end() if decoder.pacer.ended else None
            if answered is not None:
                answered_at, overrun = answered
                decoder.ledger.prefill_overrun = decoder.ledger.prefill_overrun or overrun
                self._idle_since = max(self._idle_since, answered_at)

    def _steps(self, decoder: CollaborativeDecoder, began_at: float | None) -> Iterator[StepEvent]:
        """``decoder``'s steps over this client's connections, its grid set as :meth:`run` says."""
        if began_at is not None:
            decoder.pacer.begin(began_at)
        decoder.pacer.not_before(self._idle_since)
        return self._sessions(decoder)

    def _sessions(self, decoder: CollaborativeDecoder) -> Iterator[StepEvent]:
        """:func:`run_with_resume` on this client's connections; when it ends, so does the generation, which the
        next one's grid may not start before."""
        try:
            yield from run_with_resume(decoder, lambda: self._connect(decoder.settings),
                                       max_reconnects=self.max_reconnects)
        finally:
            self._idle_since = decoder.pacer.end()
            ended = decoder.finish_reason or (
                "max_new_tokens" if len(decoder.tokens) >= decoder.settings.max_new_tokens else "interrupted")
            self.activity_log.record(decoder.ledger, finish_reason=ended)

    def activity(self) -> list[dict[str, Any]]:
        """One record per finished generation, oldest first: when, mode, policy, what was sent, the steps that
        revealed something, epsilon with its relation and delta, the session ids (:mod:`edge_sdk.activity`).
        ``json.dumps`` it to export; ``self.activity_log.export()`` gives the same as one JSON document."""
        return self.activity_log.entries()

    def generate(self, public_query: str | Prompts, private_context: str = "", *,
                 settings: DecodeSettings | None = None, **kwargs: Any) -> GenerationResult:
        """Decode to the end; return the text and the privacy ledger.  Arguments as for :meth:`decoder`."""
        decoder = self.decoder(public_query, private_context, settings=settings, **kwargs)
        for _event in self._steps(decoder, None):
            pass
        return GenerationResult(
            text=self.slm.detokenize(decoder.tokens),
            token_ids=list(decoder.tokens),
            ledger=decoder.ledger,
            finish_reason=decoder.finish_reason or "max_new_tokens",
        )
