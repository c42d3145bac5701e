"""Fakes for testing the decoding loop and your own policies without a model (as lm-eval ships ``DummyLM``).

* :class:`TableSLM`: an :class:`~edge_sdk.backends.base.SLMBackend` over a small vocabulary of text pieces
  whose next-token logits come from a table keyed by the ids that end the sequence.
* :class:`ScriptedCloud`: a cloud that replays fixed rows through the real wire codec (every message is
  encoded to bytes and decoded as the other end would), records every message the edge sent, and can be
  slow, lie, or break the stream at a chosen step.
* :class:`LinkChannel`: one of its sessions behind a simulated link (round trip, the cloud's forward), on the
  real clock, recording when each signal reached the cloud: what the cloud can time.

A generation over the real loop, in milliseconds::

    import numpy as np
    from edge_sdk.privacy.meter import LeakageMeter
    from edge_sdk.policies import CoVeil
    from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
    from edge_sdk.testing import ScriptedCloud, TableSLM

    pieces = ["<eos>", " the", " liver", " heart", "."]
    slm = TableSLM(pieces, {(1,): np.log([0.05, 0.05, 0.8, 0.05, 0.05])}, eos_ids={0})
    cloud = ScriptedCloud(len(pieces), [np.log([0.1, 0.5, 0.2, 0.1, 0.1])] * 3, eos_ids={0})
    decoder = CollaborativeDecoder(slm, CoVeil(lam=0.0), DecodeSettings(mode="cloud", max_new_tokens=3, top_m=2),
                                   slm_prompt=[2, 1], cloud_prompt=[1], meter=LeakageMeter(frozenset({2})))
    tokens = [event.token_id for event in run_with_resume(decoder, cloud.connect, backoff_s=0.0)]
    cloud.edge_messages()  # what left the edge: the open, each step's signal, any full-row request

``EdgeClient(cloud.session, slm=slm)`` runs the same cloud behind the client's own API.

Rows are logits over the vocabulary (give ``np.log(p)`` for a distribution ``p``).  Importing this module
loads numpy only; the scripted cloud needs the generated protobuf code when it runs (as any session does).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.fusion import check_finite, cloud_scores, softmax
from edge_sdk.logprobs import token_logprobs
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.protocol.status import CloudError
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.drafting import DraftSchedule, answer

#: a row of logits, one per vocabulary id
Row = Sequence[float] | np.ndarray
#: seconds to wait, fixed or as a function of a length (the SLM) or a step (the cloud)
Delay = float | Callable[[int], float]


def _row(values: Row, vocab_size: int, what: str) -> np.ndarray:
    row = check_finite(np.asarray(values, dtype=np.float32).reshape(-1), what)
    if row.shape[0] != vocab_size:
        raise ValueError(f"{what} has {row.shape[0]} values, the vocabulary has {vocab_size}")
    return row


class _SuffixTable:
    """Rows keyed by id tuples; a sequence reads the row of the longest key that ends it (``()`` ends every one)."""

    def __init__(self, rows: Mapping[tuple[int, ...], Row], default: Row | None, vocab_size: int, what: str) -> None:
        self.rows = {tuple(int(i) for i in key): _row(row, vocab_size, f"{what} row {key}")
                     for key, row in rows.items()}
        if () not in self.rows:
            self.rows[()] = np.zeros(vocab_size, np.float32) if default is None else _row(
                default, vocab_size, f"{what} default row")
        elif default is not None:
            raise ValueError(f"{what}: give the default row either as the key () or as default, not both")
        self.lengths = sorted({len(key) for key in self.rows}, reverse=True)

    def lookup(self, sequence: Sequence[int]) -> np.ndarray:
        for length in self.lengths:
            if length <= len(sequence):
                row = self.rows.get(tuple(sequence[len(sequence) - length:]))
                if row is not None:
                    return row
        raise AssertionError("unreachable: the key () ends every sequence")


def _seconds(delay: Delay, at: int) -> float:
    return float(delay(at) if callable(delay) else delay)


class TableSLM:
    """An edge model from a table: the next-token logits of a sequence are the row of the longest key ending it.

    Args:
        pieces: the vocabulary, one text piece per id (``detokenize`` joins them; ``tokenize`` matches the
            longest piece at each position).
        rows: ``{ids: logits}``: a sequence (prompt and generated ids) that ends with ``ids`` gets ``logits``;
            the longest matching key wins.
        default: the row of a sequence no key ends (all zeros, uniform, when not given).
        eos_ids: end-of-generation ids.
        bos_id: the id ``tokenize(..., add_bos=True)`` puts first (none when ``None``).
        delay_s: seconds each forward pass takes, or a function of the sequence's length then (a slower
            prefill for a longer private prompt, say).
        name: the model name the edge reports.

    ``prefill(ids)`` sets the sequence and ``append(id)`` extends it; both return a fresh float32 row, so the
    result depends on the ids alone (the backend protocol's determinism contract).
    """

    def __init__(
        self,
        pieces: Sequence[str],
        rows: Mapping[tuple[int, ...], Row] | None = None,
        *,
        default: Row | None = None,
        eos_ids: Iterable[int] = (),
        bos_id: int | None = None,
        delay_s: Delay = 0.0,
        name: str = "table-slm",
    ) -> None:
        if not pieces:
            raise ValueError("the vocabulary needs at least one piece")
        self.pieces = list(pieces)
        self.name = name
        self.vocab_size = len(self.pieces)
        self.eos_token_ids = frozenset(int(i) for i in eos_ids)
        self.bos_id = bos_id
        self.delay_s = delay_s
        self.table = _SuffixTable(rows or {}, default, self.vocab_size, "TableSLM")
        self.sequence: list[int] = []
        for token in (*self.eos_token_ids, *([] if bos_id is None else [bos_id])):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"special id {token} is outside the vocabulary of {self.vocab_size}")

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        """Greedy longest-piece match from left to right (``ValueError`` where no piece fits)."""
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        at = 0
        while at < len(text):
            best = max((i for i, piece in enumerate(self.pieces) if piece and text.startswith(piece, at)),
                       key=lambda i: len(self.pieces[i]), default=None)
            if best is None:
                raise ValueError(f"no piece of the vocabulary matches {text[at:at + 20]!r}")
            ids.append(best)
            at += len(self.pieces[best])
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def token_pieces(self) -> list[bytes]:
        """Each id's piece as UTF-8 bytes (what a JSON schema's grammar reads, :mod:`edge_sdk.grammar`)."""
        return [piece.encode("utf-8") for piece in self.pieces]

    @property
    def bos_token_id(self) -> int | None:
        return self.bos_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The end-of-generation and BOS ids: never text to a grammar."""
        return self.eos_token_ids | (frozenset() if self.bos_id is None else {self.bos_id})

    def vocab_fingerprint(self) -> bytes:
        """SHA-256 of the pieces (two tables with the same vocabulary share it)."""
        return hashlib.sha256("\x00".join(self.pieces).encode()).digest()

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.sequence = [int(i) for i in ids]
        return self._next()

    def append(self, token_id: int) -> np.ndarray:
        self.sequence.append(int(token_id))
        return self._next()

    def _next(self) -> np.ndarray:
        seconds = _seconds(self.delay_s, len(self.sequence))
        if seconds > 0:
            time.sleep(seconds)
        return self.table.lookup(self.sequence).copy()


class ScriptedCloud:
    """A cloud that replays fixed rows; hand :meth:`connect` to ``run_with_resume`` or :meth:`session` to
    ``EdgeClient``.

    It speaks the protocol as the cloud adapter does (opened, then per step a distribution; a dense row on a
    full-row request; the chosen token and ``finished`` in cloud-side fusion), and every message crosses as
    bytes through :mod:`edge_sdk.protocol.wire`'s codec.  Cloud-side fusion picks greedily:
    ``argmax(alpha * row + (1 - alpha) * upload)`` (the row alone when ``alpha = 0`` and nothing is
    uploaded), with end-of-generation ids out of the choice on ``no_stop``, and sends that row's
    log-probabilities with the token when the session asks (:mod:`edge_sdk.logprobs`).  It holds no tokenizer
    and ignores a session's ``json_schema``: a cloud that does not keep to the schema.

    Args:
        vocab_size: the vocabulary's size.
        rows: the cloud's logits ``z_llm`` per step (a sequence: step ``t`` reads ``rows[t]``, ``default``
            after its end) or by what ends the cloud's sequence (a mapping, read as :class:`TableSLM` reads
            its table; the sequence is the public prompt and the tokens chosen).  The cloud sends their
            softmax in probability space and the logits themselves in logit space.
        default: the row no step or key gives (uniform when not given).
        eos_ids: the cloud model's end-of-generation ids (the edge's stop ids are added when it opens).
        max_new_tokens: the cloud's limit on a generation.
        delay_s: seconds the cloud takes for each step's distribution, or a function of the step.
        lie: replaces each sparse distribution before it is sent (arbitrary ids, values, ``tail_bound``);
            the full rows sent on request stay honest.
        break_after_signal: steps whose signal breaks the stream once it arrived (the cloud saw it and never
            answered; a step listed twice breaks twice).
        break_after_full_request: the same for a step's full-row request.
        name: the model name the cloud reports.
        max_lookahead: the deepest run-ahead the cloud agrees to (0: lockstep only).  When a session runs
            ahead, the cloud drafts after each message as deep as the cloud adapter's rule allows
            (:class:`~edge_sdk.protocol.drafting.DraftSchedule`: the agreed depth once the edge's turnaround is
            measured, a scripted delay being the forward's time): edge-side on its row's top token,
            cloud-side on its pick from the row alone, each drafted row naming the token it assumes.

    ``sent`` holds every message the edge sent, as bytes, in order, over all sessions;
    :meth:`edge_messages` decodes them.  ``sessions`` holds each session opened, in order.
    """

    def __init__(
        self,
        vocab_size: int,
        rows: Sequence[Row] | Mapping[tuple[int, ...], Row] = (),
        *,
        default: Row | None = None,
        eos_ids: Iterable[int] = (),
        max_new_tokens: int = 1024,
        delay_s: Delay = 0.0,
        lie: Callable[[wire.CloudDistribution], wire.CloudDistribution] | None = None,
        break_after_signal: Iterable[int] = (),
        break_after_full_request: Iterable[int] = (),
        name: str = "scripted-cloud",
        max_lookahead: int = wire.MAX_LOOKAHEAD,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_lookahead = max_lookahead
        if isinstance(rows, Mapping):
            self.by_step: list[np.ndarray] = []
            self.table = _SuffixTable(rows, default, vocab_size, "ScriptedCloud")
        else:
            self.by_step = [_row(row, vocab_size, f"ScriptedCloud step {t}") for t, row in enumerate(rows)]
            self.table = _SuffixTable({}, default, vocab_size, "ScriptedCloud")
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.max_new_tokens = max_new_tokens
        self.delay_s = delay_s
        self.lie = lie
        self.breaks: dict[str, list[int]] = {"signal": list(break_after_signal),
                                             "request_full": list(break_after_full_request)}
        self.name = name
        self.sent: list[bytes] = []
        self.sessions: list[ScriptedSession] = []

    def row(self, step: int, sequence: Sequence[int]) -> np.ndarray:
        """The logits of ``step``, whose sequence (public prompt and tokens chosen) is ``sequence``."""
        return self.by_step[step] if step < len(self.by_step) else self.table.lookup(sequence)

    def session(self) -> ScriptedSession:
        """A fresh cloud session handler (what ``EdgeClient(cloud.session, ...)`` calls per connection)."""
        session = ScriptedSession(self, f"scripted-{len(self.sessions)}")
        self.sessions.append(session)
        return session

    def connect(self, lookahead: int = 0) -> CloudConnection:
        """A connection to a fresh session whose replies (and the delays before them) come as the edge reads;
        ``lookahead``: the deepest run-ahead the edge accepts (0: lockstep)."""
        return CloudConnection(ScriptedChannel(self.session()), lookahead=lookahead)

    def edge_messages(self) -> list[Any]:
        """Every message the edge sent, decoded from :attr:`sent` (``EdgeMessage`` protos)."""
        pb = wire.pb()
        return [pb.EdgeMessage.FromString(data) for data in self.sent]

    def take_break(self, kind: str, step: int) -> bool:
        """Whether the stream breaks after this ``kind`` of message of ``step`` (each listed break once)."""
        if step in self.breaks[kind]:
            self.breaks[kind].remove(step)
            return True
        return False


class ScriptedSession:
    """One session of a :class:`ScriptedCloud`: consumes ``EdgeMessage`` protos, returns ``CloudMessage`` ones.

    :meth:`handle` applies the message at once (a refusal or a scripted break raises
    :class:`~edge_sdk.protocol.connection.CloudError` from it); the replies it returns wait out their delays as
    they are read.
    """

    def __init__(self, cloud: ScriptedCloud, session_id: str) -> None:
        self.cloud = cloud
        self.session_id = session_id
        self.sent: list[bytes] = []  # what the edge sent on this session, as bytes
        self.request: wire.SessionRequest | None = None
        self.sequence: list[int] = []  # the public prompt and the tokens chosen
        self.step = 0
        self.eos: frozenset[int] = frozenset()
        self.max_new_tokens = 0
        self.rows: list[np.ndarray] = []  # the rows sent and not yet confirmed ([0]: the awaited step's)
        self.sent_at: list[tuple[float, bool]] = []  # per row in ``rows``: when it left, and whether drafted
        self.drafts: list[int] = []  # run-ahead: the tokens assumed past the confirmed ones (in ``sequence``)
        self.lookahead = 0
        self.schedule = DraftSchedule(0)  # how deep the session drafts now (the cloud adapter's rule)
        self.full_sent = False
        self.finish_reason: str | None = None  # "broken" after a scripted break

    def handle(self, message: Any) -> Iterator[Any]:
        data = message.SerializeToString()
        self.sent.append(data)
        self.cloud.sent.append(data)
        if self.finish_reason is not None:
            raise CloudError("FAILED_PRECONDITION" if self.finish_reason != "broken" else "UNAVAILABLE",
                             f"the scripted session has ended ({self.finish_reason})",
                             retryable=self.finish_reason == "broken")
        kind = message.WhichOneof("kind")
        if kind == "open":
            return self._replies(self._open(wire.decode_open(message.open)))
        if kind == "close":
            return self._replies([(0.0, self._finish("closed"))])
        if self.request is None:
            raise CloudError("NOT_FOUND", f"no session is open: send open before {kind}")
        if kind == "request_full":
            self._check_step(message.request_full.step, "request_full")
            if self.full_sent:
                raise CloudError("INVALID_ARGUMENT", f"the full row of step {self.step} was already sent")
            self.full_sent = True
            return self._replies([(0.0, wire.encode_distribution(wire.CloudDistribution(self.step, dense=self.rows[0])))])
        if kind == "signal":
            self._check_step(message.signal.step, "signal")
            return self._replies(self._apply(message.signal))
        raise CloudError("INVALID_ARGUMENT", f"unexpected edge message {kind!r}")

    def abandon(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def _check_step(self, step: int, kind: str) -> None:
        if step != self.step:
            raise CloudError("INVALID_ARGUMENT", f"expected step {self.step}, got {step}")
        if self.cloud.take_break(kind, step):
            self.finish_reason = "broken"
            raise CloudError("UNAVAILABLE", f"scripted break after the {kind} of step {step}", retryable=True)

    def _open(self, request: wire.SessionRequest) -> list[tuple[float, Any]]:
        if self.request is not None:
            raise CloudError("FAILED_PRECONDITION", "this session is already open")
        if request.vocab_size != self.cloud.vocab_size:
            raise CloudError("FAILED_PRECONDITION", f"the edge's vocabulary has {request.vocab_size} ids, the "
                             f"cloud's {self.cloud.vocab_size}")
        if request.mode == "cloud" and request.temperature != 0.0:
            raise CloudError("INVALID_ARGUMENT", "the scripted cloud decodes greedily (temperature 0)")
        self.request = request
        self.sequence = [*request.prompt_ids, *request.resume_prefix]
        self.step = len(request.resume_prefix)
        self.eos = self.cloud.eos_ids | frozenset(request.stop_token_ids)
        self.max_new_tokens = min(request.max_new_tokens or self.cloud.max_new_tokens, self.cloud.max_new_tokens)
        self.lookahead = min(request.lookahead, self.cloud.max_lookahead)
        self.schedule = DraftSchedule(self.lookahead)
        info = wire.SessionInfo(self.session_id, self.cloud.name, self.cloud.vocab_size, len(request.prompt_ids),
                                self.eos, self.max_new_tokens, lookahead=self.lookahead, padded=request.padded)
        return [(0.0, wire.encode_opened(info)), self._distribution()]

    def _distribution(self, assumes: int | None = None, drafted: bool = False) -> tuple[float, Any]:
        """The next row's distribution message (the awaited step's, or a drafted one past it), after the scripted
        delay: sparse top ``top_m``, dense if all; ``assumes``: the token before it the message names."""
        assert self.request is not None
        step = self.step + len(self.drafts)
        logits = self.cloud.row(step, self.sequence)
        probabilities = softmax(logits)
        values = logits.copy() if self.request.space == "logit" else probabilities
        self.rows.append(values)
        seconds = _seconds(self.cloud.delay_s, step)
        self.schedule.observe_forward(seconds)
        self.sent_at.append((time.monotonic() + seconds, drafted))
        forward_ns = int(seconds * 1e9)
        if self.request.top_m >= self.cloud.vocab_size:
            dist = wire.CloudDistribution(step, dense=values, forward_ns=forward_ns)
        else:
            dist = wire.CloudDistribution.sparse_from(
                step, values, self.request.top_m, forward_ns,
                probabilities=probabilities if self.request.space == "logit" else None)
            if self.cloud.lie is not None:
                dist = self.cloud.lie(dist)
        if assumes is not None:
            dist = replace(dist, assumes_token=assumes)
        return seconds, wire.encode_distribution(dist)

    def _draft_token(self) -> int:
        """The token assumed after the last row sent: edge-side its top, cloud-side the pick of an empty upload."""
        assert self.request is not None
        row = self.rows[-1]
        if self.request.mode == "cloud":
            return self._pick(CloudUpload.empty(self.request.space), row, no_stop=False)
        return int(np.argmax(row))

    def can_draft(self) -> bool:
        """Whether the session runs ahead and has a row left to draft (within the depth, before an end)."""
        if self.finish_reason is not None or not self.rows or len(self.drafts) >= self.schedule.depth:
            return False
        if self.step + len(self.drafts) + 1 >= self.max_new_tokens:
            return False
        return self._draft_token() not in self.eos

    def draft(self) -> Iterator[Any]:
        """One drafted row, naming the token it assumes."""
        token = self._draft_token()
        self.drafts.append(token)
        self.sequence.append(token)
        return self._replies([self._distribution(assumes=token, drafted=True)])

    def _apply(self, signal: Any) -> list[tuple[float, Any]]:
        assert self.request is not None
        step = self.step
        replies: list[tuple[float, Any]] = []
        logprobs = None
        if self.request.mode == "cloud":
            upload = wire.decode_upload(signal.upload, self.cloud.vocab_size, self.request.space)
            scores = self._fused(upload, self.rows[0], no_stop=signal.no_stop)
            token = int(np.argmax(scores))
            if self.request.logprobs:
                logprobs = token_logprobs(scores, self.request.space, token, self.request.top_logprobs)
        else:
            token = int(signal.token_id)
        self.rows.pop(0)
        sent_at, drafted = self.sent_at.pop(0)
        if not drafted:  # the edge waited for this row: the link's whole turnaround
            self.schedule.observe_turnaround(time.monotonic() - sent_at)
        self.full_sent = False
        self.step += 1
        reason = "eos" if token in self.eos else "max_new_tokens" if self.step >= self.max_new_tokens else None
        if self.request.mode == "cloud":
            replies.append((0.0, wire.encode_token_chosen(step, token, reason is not None, logprobs)))
        if reason is not None:
            replies.append((0.0, self._finish(reason)))
            return replies
        if self.drafts and self.drafts[0] == token:  # the draft holds: its row already went out
            self.drafts.pop(0)
            return replies
        if self.drafts:  # a miss: drop every draft
            del self.sequence[len(self.sequence) - len(self.drafts):]
            self.drafts, self.rows, self.sent_at = [], [], []
        self.sequence.append(token)
        replies.append(self._distribution(assumes=token if self.lookahead else None))
        return replies

    def _pick(self, upload: Any, values: np.ndarray, *, no_stop: bool) -> int:
        """The token the cloud picks: the argmax of :meth:`_fused`."""
        return int(np.argmax(self._fused(upload, values, no_stop=no_stop)))

    def _fused(self, upload: Any, values: np.ndarray, *, no_stop: bool) -> np.ndarray:
        """The row the token is picked from: the cloud's pick rule :func:`~edge_sdk.fusion.cloud_scores` (greedy)."""
        assert self.request is not None
        stop_ids = np.fromiter(self.eos, dtype=np.int64) if no_stop else np.empty(0, np.int64)
        scores, _ = cloud_scores(values, upload.ids, upload.values, self.request.alpha, space=self.request.space,
                                 temperature=0.0, stop_ids=stop_ids)
        return scores

    def _replies(self, timed: list[tuple[float, Any]]) -> Iterator[Any]:
        """The replies in order, each after its delay (spent when it is read), padded as the session asked."""
        for seconds, message in timed:
            if seconds > 0:
                time.sleep(seconds)
            yield message if self.request is None else wire.pad_cloud_message(message, self.request)

    def _finish(self, reason: str) -> Any:
        self.finish_reason = reason
        return wire.encode_finished(self.step, reason)




class ScriptedChannel:
    """A :class:`~edge_sdk.protocol.channels.MessageChannel` to a :class:`ScriptedSession`.

    Both directions cross as bytes; the replies are read when the edge reads them, so a scripted delay
    shows in the edge's wait for that reply, as a real stream's would.
    """

    crosses_network = False  # a test double in this process (a subclass that simulates a link says so)

    def __init__(self, session: ScriptedSession) -> None:
        self._session = session
        self._pending: deque[Iterator[Any]] = deque()

    def send(self, message: Any) -> None:
        # run-ahead: as deep as the schedule allows before the edge's next message; each batch read lazily
        self._pending.extend(iter(replies) for replies in answer(self._session, type(message).FromString(
            message.SerializeToString())))

    def receive(self) -> Any:
        while self._pending:
            reply = next(self._pending[0], None)
            if reply is not None:
                return type(reply).FromString(reply.SerializeToString())
            self._pending.popleft()
        raise CloudError("FAILED_PRECONDITION", "the cloud sent nothing for this request")

    def close(self) -> None:
        self._session.abandon("closed")


class LinkChannel:
    """A :class:`ScriptedSession` behind a simulated link, on the real clock (what the cloud can time).

    A message reaches the cloud ``rtt_s / 2`` after the edge sent it; the cloud computes one row at a time
    (``forward_s`` each), drafting as deep as the schedule allows after each message, and each reply reaches the edge
    ``rtt_s / 2`` after it left, in order.  ``arrivals`` holds when each of the edge's signals reached the cloud
    (``time.perf_counter``): the cloud's view of the edge's clock.
    """

    crosses_network = True

    def __init__(self, session: ScriptedSession, *, rtt_s: float, forward_s: float) -> None:
        self._session = session
        self.rtt_s, self.forward_s = rtt_s, forward_s
        self._inbox: deque[tuple[float, Any]] = deque()  # (when it reaches the edge, message), in order
        self._cloud_free = 0.0  # when the cloud is done with the rows it has to compute
        self.arrivals: list[float] = []

    def send(self, message: Any) -> None:
        at_cloud = time.perf_counter() + self.rtt_s / 2
        if message.WhichOneof("kind") == "signal":
            self.arrivals.append(at_cloud)
        replies = [reply for batch in answer(self._session, type(message).FromString(message.SerializeToString()))
                   for reply in batch]
        for reply in replies:
            leaves = max(self._cloud_free, at_cloud)
            if reply.WhichOneof("kind") == "distribution":
                leaves = self._cloud_free = leaves + self.forward_s
            reaches = max(leaves + self.rtt_s / 2, self._inbox[-1][0] if self._inbox else 0.0)  # one stream
            self._inbox.append((reaches, reply))

    def receive(self) -> Any:
        if not self._inbox:
            raise CloudError("FAILED_PRECONDITION", "the cloud sent nothing for this request")
        reaches, reply = self._inbox.popleft()
        delay = reaches - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return type(reply).FromString(reply.SerializeToString())

    def close(self) -> None:
        self._session.abandon("closed")
