"""One ``Decode`` stream on the cloud, whatever carries it: admission, the session, timeouts, drafting and logs.

A carrier (the gRPC servicer in :mod:`cloud_adapter.server`, the WebSocket route in
:mod:`cloud_adapter.websocket`) authenticates the caller, hands :func:`run_stream` an iterator of the request
bytes it reads, sends each ``CloudMessage`` it yields, and ends the stream with the status of the
:class:`~edge_sdk.protocol.status.CloudError` it raises (or normally when it returns).  Nothing here knows the carrier, so
what to do with each message, when to draft and when to give up is written once::

    for reply in run_stream(engine, client_id, requests):   # raises CloudError: end with its status
        carrier_send(reply)

Logs carry only session ids, step counts, timings, byte counts and status codes: never probabilities, token ids
or text.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
import traceback
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from google.protobuf.message import DecodeError

from edge_sdk._wire import coveil_pb2
from edge_sdk.protocol.status import CloudError

if TYPE_CHECKING:
    from cloud_adapter.limits import Admission, Limits
    from cloud_adapter.session import SessionHandler

log = logging.getLogger(__name__)


def log_event(level: int, event: str, **fields: Any) -> None:
    """Log ``event`` with structured ``fields`` (rendered as JSON or ``key=value`` by the CLI's formatters)."""
    log.log(level, event, extra={"fields": fields})


class BearerTokens:
    """The accepted bearer tokens, each one client identity (its label: a hash that does not reveal it); none: the
    server accepts every caller, identified by its host."""

    def __init__(self, token: str | Collection[str] | None) -> None:
        tokens = [token] if isinstance(token, str) else list(token or ())
        if any(not t or not t.strip() for t in tokens):
            raise ValueError("an empty bearer token would authenticate anyone who sends none: remove it")
        self._labels = {t: "token:" + hashlib.sha256(t.encode()).hexdigest()[:12] for t in tokens}

    def __bool__(self) -> bool:
        return bool(self._labels)

    def identify(self, authorization: str) -> str | None:
        """The identity an ``Authorization`` value (``Bearer <token>``) proves, ``None`` when it proves none
        (every token compared in constant time)."""
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        matches = [label for token, label in self._labels.items()
                   if hmac.compare_digest(presented.strip().encode(), token.encode())]
        return matches[0] if matches else None


class StreamEngine(Protocol):
    """What a stream needs of the cloud engine (:class:`~cloud_adapter.engine.CloudEngine`)."""

    limits: Limits
    admission: Admission

    def session(self, client_id: str) -> SessionHandler: ...


class Inbox:
    """Reads a stream's requests on a helper thread so that its handler can wait with a timeout.

    :meth:`get` returns the next message, ``None`` once the stream has ended
    (the edge half-closed, cancelled or disconnected: the carrier's iterator
    stopped or raised), and raises ``queue.Empty`` when nothing came within
    ``timeout`` seconds.  At most ``capacity`` messages are read ahead: beyond
    that the reader waits, and the carrier's flow control holds the edge back.
    """

    _END = object()

    def __init__(self, requests: Iterator[Any], capacity: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._closed = threading.Event()
        threading.Thread(target=self._read, args=(requests,), name="coveil-stream-reader", daemon=True).start()

    def _read(self, requests: Iterator[Any]) -> None:
        try:
            for message in requests:
                while not self._closed.is_set():
                    try:
                        self._queue.put(message, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self._closed.is_set():
                    return
        except Exception:  # noqa: BLE001 - the carrier's read failed (cancelled, disconnected): the stream ends
            pass
        finally:
            try:
                self._queue.put_nowait(self._END)
            except queue.Full:
                pass  # nobody reads any more: the handler has gone

    def get(self, timeout: float | None) -> Any | None:
        """``timeout=None``: do not wait (``queue.Empty`` when nothing is there yet)."""
        item = self._queue.get(block=False) if timeout is None else self._queue.get(timeout=timeout)
        return None if item is self._END else item

    def close(self) -> None:
        """The handler is done: a reader blocked on a full queue lets go."""
        self._closed.set()


class _UnopenedPlace:
    """A stream's place among the unopened streams, given back exactly once (when it opens or ends)."""

    def __init__(self, admission: Admission, client_id: str) -> None:
        self._admission, self._client_id = admission, client_id
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.stream_done(self._client_id)


def parse_edge_message(data: bytes) -> Any:
    """One request's bytes as an ``EdgeMessage``, or ``INVALID_ARGUMENT``.

    The carrier hands bytes, parsed here: a gRPC deserializer that raised inside gRPC's own request iterator
    leaked the stream's state and, after a few such streams, kept ``server.stop()`` from returning.
    """
    try:
        return coveil_pb2.EdgeMessage.FromString(data)
    except DecodeError:
        raise CloudError("INVALID_ARGUMENT", "a request is not a valid coveil.v1.EdgeMessage") from None


def run_stream(engine: StreamEngine, client_id: str, requests: Iterator[bytes]) -> Iterator[Any]:
    """The ``CloudMessage`` replies of one stream, in sending order; ``requests``: the raw bytes the edge sends.

    Raises :class:`CloudError` with the status the carrier must end the stream with: the stream refused
    (``RESOURCE_EXHAUSTED``), the edge's input refused, a timeout (``DEADLINE_EXCEEDED``), or ``INTERNAL`` for a
    bug (logged without the data).  Returns when the session finished or the edge ended the stream.
    """
    try:
        engine.admission.admit_stream(client_id)
    except CloudError as exc:
        log_event(logging.WARNING, "stream_refused", status=exc.code)
        raise
    unopened = _UnopenedPlace(engine.admission, client_id)
    handler = engine.session(client_id)
    inbox = Inbox(requests, engine.limits.inbox_messages)
    try:
        yield from drive(handler, inbox, engine.limits, unopened)
    except CloudError as exc:
        handler.abandon("idle" if exc.code == "DEADLINE_EXCEEDED" else "error")
        log_event(logging.INFO, "session_refused", session_id=handler.session_id, status=exc.code, steps=handler.steps)
        raise
    except Exception as exc:  # noqa: BLE001 - a bug: report it without the data, keep serving the others
        handler.abandon("error")
        log_event(logging.ERROR, "internal_error", session_id=handler.session_id, error_type=type(exc).__name__,
                  traceback="".join(traceback.format_tb(exc.__traceback__)))
        raise CloudError("INTERNAL", f"internal error in session {handler.session_id}; the server logged it") from None
    finally:
        inbox.close()
        unopened.release()
        handler.abandon("cancelled")  # no-op unless the edge went away mid-session
        if handler.session_id is not None:
            log_event(logging.INFO, "session_ended", session_id=handler.session_id, reason=handler.finish_reason,
                      steps=handler.steps, duration_ms=round(1000 * (time.monotonic() - handler.started_at), 1),
                      bytes_up=handler.bytes_up, bytes_down=handler.bytes_down, forwards=handler.forwards,
                      forwards_per_token=round(handler.forwards / max(1, handler.confirmed), 3))


def drive(handler: SessionHandler, inbox: Inbox, limits: Limits, unopened: _UnopenedPlace) -> Iterator[Any]:
    """Feed the edge's messages to ``handler`` and yield its replies: at most ``open_timeout_s`` for the first
    message, ``idle_timeout_s`` between later ones (``DEADLINE_EXCEEDED``); run-ahead drafts only while the edge
    has sent nothing new, so a draft never delays the answer to a message already received."""
    while not handler.finished:
        opening = handler.session_id is None
        timeout_s = limits.open_timeout_s if opening else limits.idle_timeout_s
        try:
            if not opening and handler.can_draft():
                try:
                    message = inbox.get(timeout=None)
                except queue.Empty:
                    yield from handler.draft()
                    continue
            else:
                message = inbox.get(timeout=timeout_s)
        except queue.Empty:
            what = "stream sent no open" if opening else "session idle"
            raise CloudError("DEADLINE_EXCEEDED", f"{what} for {timeout_s:g} s") from None
        if message is None:
            return
        message = parse_edge_message(message)
        unopened.release()  # it has spoken: from here on the session limits apply
        for reply in handler.handle(message):
            if opening and handler.session_id is not None:
                opening = False
                log_event(logging.INFO, "session_opened", session_id=handler.session_id,
                          open_ms=round(1000 * (time.monotonic() - handler.started_at), 1))
            yield reply
