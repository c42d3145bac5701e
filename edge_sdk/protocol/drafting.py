"""When and how deep the cloud drafts past the awaited step (run-ahead): one rule for the cloud adapter's session
and the public fake cloud (:class:`~edge_sdk.testing.ScriptedCloud`), so a changed rule changes what the fakes
test.

*When*: over a network the cloud drafts while the edge has sent nothing new (``cloud_adapter.stream.drive``);
in process, where the edge waits for each answer, that is after each message, as deep as the handler drafts
(:func:`answer`).  *How deep*: :class:`DraftSchedule`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any


def answer(handler: Any, message: Any) -> Iterator[Iterable[Any]]:
    """A cloud session handler's replies to ``message``, then each run-ahead draft's, for as long as it drafts
    before the edge's next message (a handler without ``can_draft``/``draft`` never drafts).  The adapter's session
    moves as its replies are produced: consume each batch before asking for the next (the fake's move when a
    batch is made, so its replies, and their scripted delays, may be read later)."""
    yield handler.handle(message)
    can_draft = getattr(handler, "can_draft", None)
    while can_draft is not None and can_draft():
        yield handler.draft()


class DraftSchedule:
    """The draft depth ``ceil(turnaround / forward) + 1`` within the agreed lookahead: the rows the edge would
    otherwise wait a round trip for, plus one.

    ``turnaround`` (seconds from a row the edge waited for to its next signal, the link's whole round trip with
    the edge's own step) and ``forward`` (seconds of one forward) are exponential moving averages, the newest
    sample weighted :attr:`SMOOTHING`.  Depth 1 until both are measured; the agreed lookahead for a cloud
    whose forward takes no measurable time (a fake's without a delay).  ``lookahead`` 0 (lockstep): depth 0.
    """

    #: weight of the newest sample in both averages
    SMOOTHING = 0.3

    def __init__(self, lookahead: int) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be non-negative (0 = lockstep), got {lookahead}")
        self.lookahead = lookahead
        self.turnaround_s: float | None = None
        self.forward_s: float | None = None

    @classmethod
    def _average(cls, previous: float | None, sample: float) -> float:
        return sample if previous is None else previous + cls.SMOOTHING * (sample - previous)

    def observe_turnaround(self, seconds: float) -> None:
        """A row the edge waited for was answered ``seconds`` after it was sent."""
        self.turnaround_s = self._average(self.turnaround_s, seconds)

    def observe_forward(self, seconds: float) -> None:
        """One forward took ``seconds``."""
        self.forward_s = self._average(self.forward_s, seconds)

    @property
    def depth(self) -> int:
        """How many rows past the awaited step the cloud drafts now."""
        if not self.lookahead:
            return 0
        if self.forward_s is not None and self.forward_s <= 0.0:  # turnaround / 0: as deep as agreed
            return self.lookahead
        if self.turnaround_s is None or self.forward_s is None:
            return 1
        return max(1, min(self.lookahead, math.ceil(self.turnaround_s / self.forward_s) + 1))
