"""How the edge talks to the cloud for one session, independent of the carrier.

:class:`CloudConnection` speaks the protocol of ``proto/coveil.proto`` in terms of typed values (distributions,
uploads, tokens) and counts the bytes each direction carries; underneath, a
:class:`~edge_sdk.protocol.channels.MessageChannel` moves the protobuf messages.  The decoding loop
(:mod:`edge_sdk.decoding`) is written once against :class:`CloudConnection`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.fusion import certified_cloud_pick
from edge_sdk.logprobs import TokenLogprobs
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.protocol.status import CloudError

if TYPE_CHECKING:  # for annotations only: the generated code loads with the first session
    from edge_sdk._wire.coveil_pb2 import (
        CloudMessage,
        Distribution,
        EdgeMessage,
        Finished,
        SessionOpened,
        TokenChosen,
    )
    from edge_sdk.protocol.channels import MessageChannel


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
        # cloud-side fusion: what the caller keeps to send a step again, by step, for each step answered here or
        # left unacknowledged by the previous session (open's ``unacknowledged``), in step order
        self._uploaded: dict[int, Any] = {}
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

    def open(self, request: wire.SessionRequest, *, max_upload: int | None = None,
             unacknowledged: Sequence[tuple[int, Any]] = ()) -> wire.SessionInfo:
        """Open the session; ``max_upload``: the most values a step's upload may hold, a public number the
        policy's rule fixes (padded signals are all the size of the largest; default: the whole vocabulary).
        ``unacknowledged``: ``(step, kept)`` of the steps the previous session left unacknowledged (its
        :meth:`unacknowledged`, the resume prefix ending before the first), which this one sends again: they stay
        among :meth:`unacknowledged` until its cloud acknowledges them."""
        request = replace(request, lookahead=self.lookahead, padded=self.padded)
        self._request = request
        self._max_upload = request.vocab_size if max_upload is None else max_upload
        self._send(wire.encode_open(request))
        try:
            info = wire.decode_opened(self._receive("opened"))
        except ValueError as exc:  # its prompt rows (echo with logprobs)
            raise CloudError("DATA_LOSS", f"the cloud sent a malformed opening: {exc}") from None
        self.steps_acknowledged = len(request.resume_prefix)
        self._uploaded = dict(unacknowledged)
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

    def unacknowledged(self) -> list[Any]:
        """What the caller kept (``upload(..., keep=)``) of each step answered but not acknowledged, in step order:
        picks taken from certificates whose ``TokenChosen`` has not been read.  After a break they are what the
        next session must send again, as lockstep re-sends its one unanswered step."""
        return [kept for step, kept in self._uploaded.items() if step >= self.steps_acknowledged]

    def upload(self, step: int, upload: CloudUpload, *, no_stop: bool = False, keep: Any = None) -> tuple[int, bool]:
        """Cloud-side fusion: send the upload, return ``(token the cloud picked, finished)``.

        ``no_stop``: the cloud must not pick an end-of-generation id this step.  Run-ahead: a pick the cloud's row
        and the upload certify is returned at once and checked when the cloud's ``TokenChosen`` is read; until
        then the step is not acknowledged (:attr:`steps_acknowledged`) and ``keep`` is among
        :meth:`unacknowledged`.
        """
        assert self.info is not None, "open the session first"
        self._send(wire.encode_upload(step, upload, vocab_size=self.info.vocab_size, no_stop=no_stop))
        certain = self._certified_pick(step, upload, no_stop) if self.run_ahead else None
        finished = certain is not None and (certain in self.info.eos_token_ids or step + 1 >= self.info.max_new_tokens)
        if certain is not None and not finished:  # the pick is pinned down: go on without waiting (checked later)
            self._unread_picks.append((step, certain, finished))
            self._uploaded[step] = keep
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
