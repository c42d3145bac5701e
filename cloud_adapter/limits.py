"""What one cloud server allows, and the admission of sessions against those limits.

:class:`Limits` is the single source of every limit's default: ``coveil-cloud
serve`` builds its flags from the fields (their ``help`` metadata), so a
default is written once.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from edge_sdk.cli_flags import positive_float, positive_int
from edge_sdk.protocol.status import CloudError

_MiB = 1024 * 1024


def _limit(default: float | int | None, help: str, *, seconds: bool = False) -> object:
    """A limit's field: its default, help, and how ``coveil-cloud serve`` reads its flag."""
    kind = {"type": positive_float, "metavar": "SECONDS"} if seconds else {"type": positive_int, "metavar": "N"}
    return field(default=default, metadata={"help": help, **kind})


@dataclass(frozen=True)
class Limits:
    """What one cloud server allows (every field is a ``coveil-cloud serve`` flag: ``--max-sessions`` ...)."""

    max_sessions: int = _limit(24, "concurrent sessions over all clients")  # type: ignore[assignment]
    max_sessions_per_client: int = _limit(8, "concurrent sessions of one client identity")  # type: ignore[assignment]
    max_unopened_streams: int = _limit(  # type: ignore[assignment]
        32, "streams that have sent nothing yet (each holds a server thread until its first message)"
    )
    open_timeout_s: float = _limit(10.0, "seconds a new stream may take to send its first message", seconds=True)  # type: ignore[assignment]
    idle_timeout_s: float = _limit(  # type: ignore[assignment]
        300.0, "seconds a session may stay silent before it is evicted and its KV cache freed", seconds=True
    )
    max_new_tokens: int = _limit(  # type: ignore[assignment]
        1024, "most tokens one session may decode (also the default when the edge asks for 0)"
    )
    max_prompt_tokens: int = _limit(  # type: ignore[assignment]
        4096, "most tokens of public prompt plus resumed prefix one session may open with"
    )
    max_upload: int | None = _limit(None, "most ids one upload may carry; None: the vocabulary size")  # type: ignore[assignment]
    max_message_bytes: int = _limit(8 * _MiB, "largest gRPC message accepted or sent")  # type: ignore[assignment]
    max_lookahead: int = _limit(  # type: ignore[assignment]
        8, "deepest run-ahead one session may have the server draft (steps past its last confirmed token; 0 = "
        "lockstep only): each draft is a forward the edge may never use"
    )
    inbox_messages: int = _limit(  # type: ignore[assignment]
        4, "messages of one stream read ahead of its session (beyond that, gRPC flow control holds the edge)"
    )
    transcript_bytes: int = _limit(  # type: ignore[assignment]
        256 * _MiB, "memory the finished sessions' transcripts may hold (the oldest are dropped first)"
    )
    transcript_dir_bytes: int = _limit(  # type: ignore[assignment]
        4096 * _MiB, "disk the transcripts in --transcript-dir may take (the oldest files are deleted first)"
    )

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_sessions_per_client", "max_unopened_streams", "max_new_tokens",
                     "max_prompt_tokens", "max_message_bytes", "inbox_messages", "transcript_bytes",
                     "transcript_dir_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_lookahead < 0:
            raise ValueError(f"Limits.max_lookahead must be non-negative, got {self.max_lookahead}")
        for name in ("open_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)}")
        if self.max_upload is not None and self.max_upload < 0:
            raise ValueError(f"Limits.max_upload must be non-negative, got {self.max_upload}")

    @property
    def max_prompt_chars(self) -> int:
        """A text prompt longer than this cannot fit ``max_prompt_tokens`` (refused before it is tokenised)."""
        return 32 * self.max_prompt_tokens


class Admission:
    """Counts live sessions (per client and in all) and unopened streams against :class:`Limits`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._sessions: Counter[str] = Counter()
        self._unopened = 0
        self._unopened_by: Counter[str] = Counter()

    @property
    def sessions(self) -> int:
        with self._lock:
            return sum(self._sessions.values())

    def admit_stream(self, client_id: str) -> None:
        """A new stream that has sent nothing yet; ``RESOURCE_EXHAUSTED`` beyond ``max_unopened_streams`` in all
        or beyond ``max_sessions_per_client`` for one client (so one client's silent streams cannot lock out
        the others)."""
        with self._lock:
            if self._unopened >= self.limits.max_unopened_streams:
                raise CloudError(
                    "RESOURCE_EXHAUSTED",
                    f"{self._unopened} streams are already waiting to open a session; retry later",
                )
            if self._unopened_by[client_id] >= self.limits.max_sessions_per_client:
                raise CloudError(
                    "RESOURCE_EXHAUSTED",
                    f"this client already has {self._unopened_by[client_id]} streams that sent nothing yet",
                )
            self._unopened += 1
            self._unopened_by[client_id] += 1

    def stream_done(self, client_id: str) -> None:
        """A stream admitted by :meth:`admit_stream` spoke or ended."""
        with self._lock:
            self._unopened -= 1
            self._unopened_by[client_id] -= 1
            if not self._unopened_by[client_id]:
                del self._unopened_by[client_id]

    def admit_session(self, client_id: str) -> None:
        with self._lock:
            if sum(self._sessions.values()) >= self.limits.max_sessions:
                raise CloudError(
                    "RESOURCE_EXHAUSTED",
                    f"the server is at its limit of {self.limits.max_sessions} concurrent sessions; retry later",
                )
            if self._sessions[client_id] >= self.limits.max_sessions_per_client:
                raise CloudError(
                    "RESOURCE_EXHAUSTED",
                    f"this client already has {self.limits.max_sessions_per_client} open sessions, its limit; "
                    "close one first",
                )
            self._sessions[client_id] += 1

    def session_done(self, client_id: str) -> None:
        with self._lock:
            self._sessions[client_id] -= 1
            if not self._sessions[client_id]:
                del self._sessions[client_id]
