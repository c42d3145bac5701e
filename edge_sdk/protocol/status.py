"""The one error type of a session, at both ends: a gRPC status code name and a message.

The cloud adapter raises :class:`CloudError` for what the edge sent (a
malformed message, a limit, the wrong step): the server ends the stream with
that status (``cloud_adapter.server``), an in-process session hands the same
error to the edge.  The edge raises it for what the cloud sent or did (a
malformed distribution, a broken stream) and receives it for the status a
stream ended with; ``retryable`` says whether reopening the session may
succeed.  Messages name what is wrong, never private data.
"""

from __future__ import annotations

#: gRPC status codes after which reopening the session may succeed
RETRYABLE_CODES = frozenset({"UNAVAILABLE", "ABORTED", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "CANCELLED"})


#: gRPC's status codes by name, with their numbers (the WebSocket carrier ends a stream with ``4000 + number``)
STATUS_NUMBERS: dict[str, int] = {name: number for number, name in enumerate((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))}
#: a WebSocket close code ``CLOSE_STATUS_BASE + n`` carries gRPC status ``n`` (``4008``: ``RESOURCE_EXHAUSTED``)
CLOSE_STATUS_BASE = 4000
#: RFC 6455's close code for a message larger than the endpoint accepts (``Limits.max_message_bytes``)
MESSAGE_TOO_BIG = 1009
#: the most UTF-8 bytes a WebSocket close reason may hold (a control frame's 125 less the 2-byte code)
CLOSE_REASON_BYTES = 123


class CloudError(RuntimeError):
    """A session's error status: ``code`` names a ``grpc.StatusCode`` member, ``message`` says why.

    ``retryable``: the edge may reopen the session after it (set where the
    edge receives a status: from its code, :data:`RETRYABLE_CODES`).
    """

    def __init__(self, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class CloudReplyRejected(CloudError):
    """The edge's own check of what the cloud sent failed (``DATA_LOSS``): the edge ended the session, not the
    cloud, and an error shown to a user says so."""

    def __init__(self, message: str) -> None:
        super().__init__("DATA_LOSS", message)


def close_frame(code: str, message: str) -> tuple[int, str]:
    """The WebSocket close code and reason that end a stream with status ``code``: ``4000 + its number``, and
    ``message`` cut to :data:`CLOSE_REASON_BYTES` bytes of UTF-8 (never inside a character)."""
    reason = message.encode()[:CLOSE_REASON_BYTES].decode("utf-8", "ignore")
    return CLOSE_STATUS_BASE + STATUS_NUMBERS.get(code, STATUS_NUMBERS["UNKNOWN"]), reason


def status_of_close(close_code: int | None, reason: str) -> CloudError:
    """The :class:`CloudError` a WebSocket stream's close means to the edge: ``4000 + n`` is gRPC status ``n``
    with ``reason`` its message; 1009 (a message too big) is ``RESOURCE_EXHAUSTED``, as gRPC's size limit; a normal
    close (1000) before the awaited message, or a connection lost without a close frame, is ``UNAVAILABLE``
    (retryable), as a gRPC stream that ended early."""
    names = {number: name for name, number in STATUS_NUMBERS.items()}
    name = names.get((close_code or 0) - CLOSE_STATUS_BASE)
    if close_code == MESSAGE_TOO_BIG:  # a message past the peer's limit: gRPC's RESOURCE_EXHAUSTED, not retried
        return CloudError("RESOURCE_EXHAUSTED", f"a message exceeded the peer's size limit {reason}".strip())
    if name is None:
        why = "the cloud ended the stream" if close_code == 1000 else f"the stream closed ({close_code}) {reason}"
        return CloudError("UNAVAILABLE", why.strip(), retryable=True)
    return CloudError(name, reason, retryable=name in RETRYABLE_CODES)
