"""How the edge talks to the cloud for one session, independent of the carrier.

:class:`CloudConnection` speaks the protocol of ``proto/coveil.proto`` in
terms of typed values (distributions, uploads, tokens) and counts the bytes
each direction carries.  Underneath, a :class:`MessageChannel` moves protobuf
messages:

* :class:`GrpcChannel` over a real gRPC bidirectional stream;
* :class:`InProcessChannel` straight into a cloud session handler object in
  the same process (tests, the harness), through the same encoding, so byte
  counts and validation are identical.

The decoding loop (:mod:`edge_sdk.decoding`) is written once against
:class:`CloudConnection`.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, Protocol, overload

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.fusion import certified_cloud_pick
from edge_sdk.logprobs import TokenLogprobs
from edge_sdk.policies.base import CloudUpload
from edge_sdk.protocol.status import RETRYABLE_CODES, CloudError

if TYPE_CHECKING:  # for annotations only: gRPC and the generated code load with the first session
    import grpc

    from edge_sdk._wire.coveil_pb2 import (
        CloudMessage,
        Distribution,
        EdgeMessage,
        Finished,
        SessionOpened,
        TokenChosen,
    )


class _StreamingCall(Protocol):
    """gRPC's bidirectional call as the channel uses it: the cloud's messages, and whether the call ended."""

    def __next__(self) -> CloudMessage: ...

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


class MessageChannel(Protocol):
    """Moves protobuf messages of one session: ``EdgeMessage`` out, ``CloudMessage`` in.  A new carrier implements
    these three methods (and is handed to ``EdgeClient(channel=...)`` by a zero-argument factory, one channel per
    session); :class:`CloudConnection` does the rest.

    The carrier's duties, each a defence (``tests/test_carriers.py`` holds every carrier to them):

    * **Begin the stream at the first** :meth:`send`, not before: the edge connects before its SLM prefills the
      private prompt, and a stream begun at once lets the cloud time that prefill (it grows with the private
      context) from the stream's start to the open.
    * **Return from** :meth:`send` **only once the message is written** to the transport: otherwise the write
      happens whenever another thread runs, and behind the SLM's next forward on a busy core, so the message
      leaves on the private context's clock.  A stream that has already ended makes :meth:`send` return at once;
      :meth:`receive` then raises why.
    * **Errors are** :class:`~edge_sdk.protocol.status.CloudError` with a gRPC status name (the status the cloud ended the
      stream with, or ``UNAVAILABLE``, retryable, for a stream that broke), so the loop resumes alike over any
      carrier.
    * **Bytes cross unchanged and uncompressed**: padding fixes every message's size (a compressed size would
      depend on its content).

    ``crosses_network`` (a class attribute; a channel without one counts as ``True``): whether anyone but this
    process can time the messages.  Only such sessions are paced by default (``DecodeSettings.auto_pace_ms``).
    """

    def send(self, message: EdgeMessage) -> None: ...

    def receive(self) -> CloudMessage: ...

    def close(self) -> None: ...


class CloudSessionHandler(Protocol):
    """The cloud side of one session as an in-process object (``cloud_adapter.engine.SessionHandler``)."""

    def handle(self, message: EdgeMessage) -> Iterable[CloudMessage]: ...

    def abandon(self, reason: str) -> None: ...


class InProcessChannel:
    """Hands each message to a cloud session handler in this process and queues its replies.

    A handler that runs ahead (``can_draft()``/``draft()``, as the cloud adapter's session does) drafts after
    each message as deep as it will before the edge's next one: the schedule of a cloud infinitely quicker than
    the edge.
    """

    crosses_network = False  # the cloud runs in this process: nothing times the messages but this process

    def __init__(self, handler: CloudSessionHandler) -> None:
        self._handler = handler
        self._replies: list[CloudMessage] = []

    def send(self, message: EdgeMessage) -> None:
        # round-trip through bytes: the same validation and sizes as on the wire
        edge_message = type(message).FromString(message.SerializeToString())
        try:
            self._replies.extend(self._handler.handle(edge_message))
            can_draft = getattr(self._handler, "can_draft", None)
            while can_draft is not None and can_draft():
                self._replies.extend(self._handler.draft())  # type: ignore[attr-defined]
        except CloudError as exc:  # the status a server would end the stream with, as the edge receives it
            raise CloudError(exc.code, exc.message, retryable=exc.code in RETRYABLE_CODES) from exc

    def receive(self) -> CloudMessage:
        if not self._replies:
            raise CloudError("FAILED_PRECONDITION", "the cloud sent nothing for this request")
        reply = self._replies.pop(0)
        return type(reply).FromString(reply.SerializeToString())

    def close(self) -> None:
        self._handler.abandon("closed")



class GrpcChannel:
    """One ``Decode`` bidirectional stream on a gRPC channel, begun by the first :meth:`send`
    (:class:`MessageChannel`'s duties: gRPC's headers go out when the call begins).

    :meth:`send` returns once gRPC has written the message to the transport: gRPC asks the request iterator for
    the next message only after the previous one's send completed, so a send waits for that ask.
    """

    #: how often a blocked :meth:`send` checks whether the call has ended
    _POLL_S = 0.05
    crosses_network = True

    def __init__(
        self, grpc_channel: grpc.Channel, *, metadata: tuple[tuple[str, str], ...] = (), timeout_s: float | None = None
    ) -> None:
        import grpc

        from edge_sdk._wire import coveil_pb2_grpc

        self._grpc = grpc
        self._outbox: queue.SimpleQueue[EdgeMessage | None] = queue.SimpleQueue()  # None: the stream is closed
        self._written = threading.Semaphore(0)  # one release per message gRPC has finished sending
        self._stub = coveil_pb2_grpc.CollaborativeDecodingStub(grpc_channel)
        self._metadata, self._timeout_s = metadata, timeout_s
        # begun by the first send (a defence: the stream's start would otherwise tell the cloud when the edge
        # began its prefill, whose length grows with the private context)
        self._call: _StreamingCall | None = None

    def _begun(self) -> _StreamingCall:
        if self._call is None:
            self._call = self._stub.Decode(self._outgoing(), metadata=self._metadata, timeout=self._timeout_s)
        return self._call

    def _outgoing(self) -> Iterator[EdgeMessage]:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            yield message
            self._written.release()  # gRPC asks for the next message once this one is sent

    def send(self, message: EdgeMessage) -> None:
        self._outbox.put(message)
        call = self._begun()
        while not self._written.acquire(timeout=self._POLL_S):
            if call.done():  # the stream broke: receive() reports why
                return

    def receive(self) -> CloudMessage:
        try:
            return next(self._begun())
        except StopIteration:
            raise CloudError("UNAVAILABLE", "the cloud ended the stream", retryable=True) from None
        except self._grpc.RpcError as exc:
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            raise CloudError(code, exc.details() or "", retryable=code in RETRYABLE_CODES) from exc

    def close(self) -> None:
        self._outbox.put(None)
        if self._call is not None:
            self._call.cancel()


@dataclass
class ByteCounter:
    """Serialized protobuf bytes each direction (what a network would carry, before framing)."""

    edge_to_cloud: int = 0
    cloud_to_edge: int = 0


class CloudConnection:
    """The edge's view of one cloud session.

    Every call maps to one protocol message; ``bytes`` counts them.  Calls
    follow the protocol order: :meth:`open`, then per step
    :meth:`distribution`, optionally :meth:`request_full`, then
    :meth:`upload` (cloud-side fusion) or :meth:`sync_token` (edge-side).
    """

    def __init__(self, channel: MessageChannel, *, lookahead: int = 0, padded: bool = True) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be non-negative (0 = lockstep), got {lookahead}")
        self._channel = channel
        self.lookahead = lookahead  # the deepest run-ahead this edge accepts (sent when the session opens)
        #: a defence: every step signal leaves padded to a size fixed by public settings (an older cloud ignores
        #: the padding), and the cloud is asked to pad its own messages (wire.pad_edge_message, pad_cloud_message)
        self.padded = padded
        self._max_upload = 0  # the policy's public maximum of values per upload (set when the session opens)
        self.bytes = ByteCounter()
        self.info: wire.SessionInfo | None = None
        self._request: wire.SessionRequest | None = None
        self.finish_reason: str | None = None
        self._held: deque[CloudMessage] = deque()  # distributions read while waiting for another message, in order
        # run-ahead: the (step, token) the next row must name: the step after the last confirmed token, that token
        self._follows: tuple[int, int] | None = None
        # cloud-side run-ahead: picks taken from the certificate, each (step, token, finished), whose TokenChosen
        # is still to be read and checked
        self._unread_picks: deque[tuple[int, int, bool]] = deque()
        #: cloud-side fusion: how many steps the cloud has acknowledged, the resume prefix the session opened with
        #: and then every step whose TokenChosen was read (a pick taken from a certificate is not, until then)
        self.steps_acknowledged = 0
        self._current: wire.CloudDistribution | None = None  # the row the edge decides the awaited step from
        self.rows_dropped = 0  # drafted rows that assumed another token than the one confirmed
        self.picks_certified = 0  # cloud-side steps whose pick the edge read off the certificate without waiting
        #: cloud-side fusion with logprobs asked for: those the cloud sent with the last token it picked
        self.chosen_logprobs: TokenLogprobs | None = None

    @property
    def crosses_network(self) -> bool:
        """Whether the session's messages cross a network (anyone but this process can time them)."""
        return bool(getattr(self._channel, "crosses_network", True))

    @property
    def run_ahead(self) -> bool:
        """Whether the cloud agreed to run ahead in this session."""
        return self.info is not None and self.info.lookahead > 0

    def _send(self, message: EdgeMessage) -> None:
        if self.padded and self._request is not None:
            message = wire.pad_edge_message(message, vocab_size=self._request.vocab_size, max_upload=self._max_upload)
        self.bytes.edge_to_cloud += message.ByteSize()
        self._channel.send(message)

    def _read(self) -> CloudMessage:
        message = self._channel.receive()
        self.bytes.cloud_to_edge += message.ByteSize()
        return message

    def _hold(self, message: CloudMessage) -> None:
        """Keep a drafted row read ahead of the message awaited, within the most an honest cloud can have sent then:
        one per agreed run-ahead step, per step whose pick is still unread, and one.  A cloud sending more would have
        the device hold rows without bound (a full row is a megabyte): ``RESOURCE_EXHAUSTED``, and the session is
        closed (the error is not retried)."""
        assert self.info is not None, "open the session first"
        limit = self.info.lookahead + len(self._unread_picks) + 1
        if len(self._held) >= limit:
            raise CloudError("RESOURCE_EXHAUSTED", f"the cloud sent more than {limit} rows ahead of the message the "
                             "edge awaited", retryable=False)
        self._held.append(message)

    def _next_message(self) -> CloudMessage:
        """The next message that is not the pick of a step taken from a certificate (those are checked here)."""
        message = self._read()
        while message.WhichOneof("kind") == "token" and self._unread_picks:
            self._check_pick(message.token)
            message = self._read()
        return message

    def _check_pick(self, chosen: TokenChosen) -> None:
        """The cloud's pick of the oldest step whose token the edge took from a certificate: it must agree."""
        step, token, finished = self._unread_picks.popleft()
        if (chosen.step, chosen.token_id, chosen.finished) != (step, token, finished):
            raise CloudError("DATA_LOSS", f"the cloud chose token {chosen.token_id} at step {chosen.step} where "
                             f"its row and the upload certify {token} at step {step}")
        self.steps_acknowledged = step + 1

    def _ended_early(self, finished: Finished) -> CloudError:
        """The cloud ended the session before the message the edge awaited: keep its reason, the error to raise."""
        self.finish_reason = finished.reason
        return CloudError("ABORTED", f"the cloud finished the session early ({finished.reason})")

    def confirm_picks(self) -> None:
        """Read and check the cloud's picks of every step whose token was taken from a certificate (a generation
        that the edge's stopping rule ends there); drafted rows read meanwhile are dropped."""
        while self._unread_picks:
            message = self._read()
            kind = message.WhichOneof("kind")
            if kind == "token":
                self._check_pick(message.token)
            elif kind == "finished":
                raise self._ended_early(message.finished)
            elif kind != "distribution":
                raise CloudError("INTERNAL", f"protocol violation: expected token, the cloud sent {kind}")

    @overload
    def _receive(self, expected: Literal["opened"], *, hold: bool = False) -> SessionOpened: ...
    @overload
    def _receive(self, expected: Literal["distribution"], *, hold: bool = False) -> Distribution: ...
    @overload
    def _receive(self, expected: Literal["token"], *, hold: bool = False) -> TokenChosen: ...
    @overload
    def _receive(self, expected: Literal["finished"], *, hold: bool = False) -> Finished: ...

    def _receive(self, expected: str, *, hold: bool = False) -> SessionOpened | Distribution | TokenChosen | Finished:
        """The next message, which must be ``expected``.  ``hold``: distributions read first are kept for
        :meth:`distribution` (drafted rows that arrive before a token or a full row)."""
        while True:
            message = self._held.popleft() if expected == "distribution" and self._held else self._next_message()
            kind = message.WhichOneof("kind")
            if hold and kind == "distribution" and expected != "distribution":
                self._hold(message)
                continue
            if kind == "finished" and expected != "finished":
                raise self._ended_early(message.finished)
            if kind != expected:
                raise CloudError("INTERNAL", f"protocol violation: expected {expected}, the cloud sent {kind}")
            return getattr(message, kind)

    def open(self, request: wire.SessionRequest, *, max_upload: int | None = None) -> wire.SessionInfo:
        """Open the session; ``max_upload``: the most values a step's upload may hold, a public number the
        policy's rule fixes (padded signals are all the size of the largest; default: the whole vocabulary)."""
        request = replace(request, lookahead=self.lookahead, padded=self.padded)
        self._request = request
        self._max_upload = request.vocab_size if max_upload is None else max_upload
        self._send(wire.encode_open(request))
        info = wire.decode_opened(self._receive("opened"))
        self.steps_acknowledged = len(request.resume_prefix)
        if info.lookahead > self.lookahead:
            raise CloudError("INTERNAL", f"the cloud chose run-ahead depth {info.lookahead}, more than the "
                             f"{self.lookahead} asked for")
        self.info = info
        return info

    def distribution(self) -> wire.CloudDistribution:
        """The cloud's (sparse) distribution for the next step.

        Run-ahead: the first row that follows the token last confirmed (it names that token); drafted rows that
        assumed another token, and rows past the next step, are dropped (they came before the cloud learned the
        confirmed token, whose row follows them).
        """
        while True:
            dist = self._decode_distribution(self._receive("distribution"))
            if self._follows is None or (dist.step, dist.assumes_token) == self._follows:
                self._current = dist
                return dist
            if dist.step < self._follows[0] or dist.step > self._follows[0] + self.lookahead:
                raise CloudError("INTERNAL", f"the cloud sent step {dist.step}, expected {self._follows[0]}")
            self.rows_dropped += 1

    def _decode_distribution(self, message: Distribution) -> wire.CloudDistribution:
        """Parse a distribution and check it against what was asked; anything else ends the session.

        Malformed (NaN, infinities, bad lengths, ids out of order), fewer
        values than the ``top_m`` asked for, or, in probability space, values
        outside [0, 1]: a policy never sees it.
        """
        assert self.info is not None and self._request is not None, "open the session first"
        try:
            dist = wire.decode_distribution(message, self.info.vocab_size)
        except ValueError as exc:
            raise CloudError("DATA_LOSS", f"the cloud sent a malformed distribution: {exc}") from None
        values = dist.dense if dist.dense is not None else dist.values
        if dist.dense is None and len(dist.ids) < min(self._request.top_m, self.info.vocab_size):
            raise CloudError("DATA_LOSS", f"the cloud sent {len(dist.ids)} values, fewer than the "
                             f"{self._request.top_m} asked for")
        if self._request.space == "prob" and values.size:
            total = float(values.sum(dtype=np.float64))
            if float(values.min()) < 0 or float(values.max()) > 1 or total > 1 + 1e-3 or (
                dist.dense is not None and total < 1 - 1e-3
            ):
                raise CloudError("DATA_LOSS", "the cloud sent probabilities that are not a distribution")
        return dist

    def request_full(self, step: int) -> wire.CloudDistribution:
        """Ask for the full distribution of ``step`` (the cloud learns that we asked)."""
        assert self.info is not None, "open the session first"
        self._send(wire.encode_request_full(step))
        full = self._decode_distribution(self._receive_for_step(step))
        if not full.is_full or full.step != step:
            raise CloudError("DATA_LOSS", f"the cloud answered the full-row request of step {step} with a "
                             f"{'full' if full.is_full else 'sparse'} row of step {full.step}")
        self._current = full
        return full

    def _receive_for_step(self, step: int) -> Distribution:
        """The distribution of ``step`` (a full row asked for); drafted rows of later steps read first are held."""
        while True:
            message = self._next_message()
            kind = message.WhichOneof("kind")
            if kind == "distribution" and message.distribution.step > step:
                self._hold(message)
                continue
            if kind == "finished":
                raise self._ended_early(message.finished)
            if kind != "distribution":
                raise CloudError("INTERNAL", f"protocol violation: expected distribution, the cloud sent {kind}")
            return message.distribution

    def upload(self, step: int, upload: CloudUpload, *, no_stop: bool = False) -> tuple[int, bool]:
        """Cloud-side fusion: send the upload, return ``(token the cloud picked, finished)``.

        ``no_stop``: the cloud must not pick an end-of-generation id this step.  Run-ahead: a pick the cloud's row
        and the upload certify is returned at once and checked when the cloud's ``TokenChosen`` is read; until
        then the step is not acknowledged (:attr:`steps_acknowledged`).
        """
        assert self.info is not None, "open the session first"
        self._send(wire.encode_upload(step, upload, vocab_size=self.info.vocab_size, no_stop=no_stop))
        certain = self._certified_pick(step, upload, no_stop) if self.run_ahead else None
        finished = certain is not None and (certain in self.info.eos_token_ids or step + 1 >= self.info.max_new_tokens)
        if certain is not None and not finished:  # the pick is pinned down: go on without waiting (checked later)
            self._unread_picks.append((step, certain, finished))
            self._follows = (step + 1, certain)
            self.picks_certified += 1
            return certain, finished
        # the last token is always read from the cloud: every pick taken from a certificate is checked before the
        # generation ends (a mismatch found after the end would be taken for a stream that broke there)
        chosen = self._receive("token", hold=True)
        if chosen.step != step:
            raise CloudError("INTERNAL", f"the cloud answered step {chosen.step} to step {step}")
        if chosen.token_id >= self.info.vocab_size:
            raise CloudError("DATA_LOSS", f"the cloud chose token {chosen.token_id}, outside the vocabulary")
        self.steps_acknowledged = step + 1
        if self.run_ahead:
            self._follows = (step + 1, int(chosen.token_id))
        self.chosen_logprobs = self._chosen_logprobs(chosen)
        return int(chosen.token_id), bool(chosen.finished)

    def _chosen_logprobs(self, chosen: TokenChosen) -> TokenLogprobs | None:
        """The log-probabilities sent with a picked token, checked; ``None`` when the session asked for none
        (``DATA_LOSS`` when asked for and missing or malformed, or sent unasked)."""
        assert self.info is not None and self._request is not None
        try:
            logprobs = wire.decode_token_logprobs(chosen, self.info.vocab_size, self._request.top_logprobs)
        except ValueError as exc:
            raise CloudError("DATA_LOSS", f"the cloud sent malformed log-probabilities: {exc}") from None
        if (logprobs is not None) != self._request.logprobs:
            raise CloudError("DATA_LOSS", "the cloud's log-probabilities do not match what the session asked for")
        return logprobs

    def _certified_pick(self, step: int, upload: CloudUpload, no_stop: bool) -> int | None:
        """Cloud-side greedy fusion: the token the cloud picks with ``upload``, when this step's row certifies it
        (:func:`~edge_sdk.fusion.certified_cloud_pick`), else ``None``.  Reads only what the cloud holds (its
        row, the upload and the public settings), so when the edge waits tells the cloud nothing.  With logprobs
        asked for (public) the edge waits for them: they come with the cloud's pick."""
        request, info, dist = self._request, self.info, self._current
        assert request is not None and info is not None
        if request.temperature != 0.0 or request.logprobs or dist is None or dist.step != step:
            return None
        if dist.dense is not None:
            known_ids, known_llm, tail_bound = np.arange(info.vocab_size), dist.dense, 0.0
        else:
            known_ids, known_llm, tail_bound = dist.ids, dist.values, dist.tail_bound
        stop_ids = np.fromiter(sorted(info.eos_token_ids), np.int64) if no_stop else np.empty(0, np.int64)
        return certified_cloud_pick(known_ids, known_llm, tail_bound, upload.ids, upload.values, request.alpha,
                                    info.vocab_size, stop_ids)

    def sync_token(self, step: int, token_id: int) -> None:
        """Edge-side fusion: send the chosen token (the reply is the next distribution)."""
        self._send(wire.encode_token(step, token_id))
        if self.run_ahead:
            self._follows = (step + 1, int(token_id))

    def finished(self) -> str:
        """Read the cloud's end-of-session message (drafted rows before it are dropped); return its reason."""
        self._held.clear()
        self.finish_reason = self._receive("finished", hold=True).reason
        self._held.clear()
        return self.finish_reason

    def close(self) -> None:
        """Tell the cloud we are done (if the session is still open) and release the channel."""
        try:
            if self.info is not None and self.finish_reason is None:
                self._send(wire.encode_close())
                self._held.clear()
                self.finish_reason = self._receive("finished", hold=True).reason
        except CloudError:
            pass  # the stream is already gone; nothing left to release remotely
        finally:
            self._channel.close()
