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
