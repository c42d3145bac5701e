"""Observer attacks: what sizes and times tell apart, beside what the signal's contents tell (Token-ER).

Two attackers, each typed to see only its own view of a generation:

* the **on-path observer** (:class:`PathView`) sees, under TLS, each message's size and when it passed, in both
  directions, and nothing of its contents (a TLS record is the message's frame plus a constant: its size is the
  message's);
* the **cloud's clock** (:class:`CloudClock`) sees when each of the edge's signals arrived.

Each is scored on two private contexts of one item, run through the same public settings (a question, a policy,
the models): :func:`sizes_told_apart` (whether an observer who replays both candidates tells them apart exactly
from the size sequences, 0 or 1 per item) and :func:`timing_auc` (the AUC of one gap against the other context's:
0.5 when the gaps say nothing of which context was used, 1 or 0 when they separate completely).
:func:`observer_scores` gives a result row's ``observer`` field, which ``decodeleak report`` shows beside
Token-ER (their :class:`~eval_harness.metrics.MetricSpec` entries, ``observer_*``).

:class:`RecordingChannel` produces both views from any message channel the decoder talks through; it says it
crosses a network, so the decoder behaves as it does deployed (its public clock included), in process too.
:class:`RecordingClient` puts one under each session of an :class:`~edge_sdk.client.EdgeClient` while asked to;
``decodeleak sweep --observer`` records each item against a second private context through it and fills the
rows' ``observer`` field (:func:`eval_harness.sweep.execute.observer_field`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.protocol.channels import MessageChannel
from edge_sdk.client import EdgeClient


@dataclass(frozen=True)
class PathView:
    """What an on-path observer of one generation read: ``(direction, size in bytes, time in s)`` per message,
    ``direction`` ``"up"`` (edge to cloud) or ``"down"``, in the order they passed."""

    messages: tuple[tuple[str, int, float], ...]

    def sizes(self) -> tuple[tuple[str, int], ...]:
        return tuple((direction, size) for direction, size, _ in self.messages)

    def up_gaps(self) -> np.ndarray:
        """Seconds between consecutive messages of the edge's after its first (the open)."""
        times = [at for direction, _, at in self.messages if direction == "up"][1:]
        return np.diff(np.asarray(times, dtype=np.float64))


@dataclass(frozen=True)
class CloudClock:
    """When each of the edge's signals (step signals and full-row requests) reached the cloud, in seconds."""

    arrivals: tuple[float, ...]

    def gaps(self) -> np.ndarray:
        return np.diff(np.asarray(self.arrivals, dtype=np.float64))


@dataclass
class RecordingChannel:
    """A :class:`~edge_sdk.protocol.channels.MessageChannel` that records both views of the messages it moves."""

    inner: MessageChannel
    messages: list[tuple[str, int, float]] = field(default_factory=list)
    signal_arrivals: list[float] = field(default_factory=list)
    crosses_network = True  # the decoder behaves as deployed: its public clock applies

    def send(self, message: Any) -> None:
        at = time.perf_counter()
        self.messages.append(("up", message.ByteSize(), at))
        if message.WhichOneof("kind") in ("signal", "request_full"):
            self.signal_arrivals.append(at)
        self.inner.send(message)

    def receive(self) -> Any:
        message = self.inner.receive()
        self.messages.append(("down", message.ByteSize(), time.perf_counter()))
        return message

    def close(self) -> None:
        self.inner.close()

    def path_view(self) -> PathView:
        return PathView(tuple(self.messages))

    def cloud_clock(self) -> CloudClock:
        return CloudClock(tuple(self.signal_arrivals))

    def record(self) -> dict[str, Any]:
        """Both views as a result row keeps them (JSON; times in ms from the first message, rounded to 1 us):
        ``messages`` ``[[direction, size, ms], ...]`` and ``signals`` ``[ms, ...]``."""
        start = self.messages[0][2] if self.messages else 0.0
        return {"messages": [[direction, size, round(1e3 * (at - start), 3)] for direction, size, at in self.messages],
                "signals": [round(1e3 * (at - start), 3) for at in self.signal_arrivals]}


class RecordingClient(EdgeClient):
    """An :class:`~edge_sdk.client.EdgeClient` whose sessions record both observer views while
    :meth:`recording` is on (one :class:`RecordingChannel` per session, resumed sessions included); otherwise
    an :class:`EdgeClient` exactly (its sessions then keep the carrier's own ``crosses_network``)."""

    _sink: list[RecordingChannel] | None = None

    @contextmanager
    def recording(self, sink: list[RecordingChannel]) -> Iterator[None]:
        """Record the sessions opened inside the block into ``sink``."""
        self._sink = sink
        try:
            yield
        finally:
            self._sink = None

    def _carrier(self) -> MessageChannel:
        carrier = super()._carrier()
        if self._sink is None:
            return carrier
        recorder = RecordingChannel(carrier)  # the carrier the client chose, seen through the recorder
        self._sink.append(recorder)
        return recorder


def sizes_told_apart(first: Sequence[PathView], second: Sequence[PathView]) -> bool:
    """Whether the on-path observer tells the two contexts apart from sizes alone: some generation of one has a
    size sequence no generation of the other has (runs of the same context may differ in how many drafted rows
    went out; only sizes no run of the other context shows tell them apart)."""
    first_sizes, second_sizes = {view.sizes() for view in first}, {view.sizes() for view in second}
    return not (first_sizes & second_sizes) and bool(first_sizes) and bool(second_sizes)


def timing_auc(first: np.ndarray, second: np.ndarray) -> float:
    """``P(b > a) + P(b = a) / 2`` for a gap ``a`` of the first context and ``b`` of the second (the Mann-Whitney
    statistic over the product of the sample sizes): 0.5 when the gaps say nothing of the context."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if not a.size or not b.size:
        return float("nan")
    greater = (b[:, None] > a[None, :]).sum()
    ties = (b[:, None] == a[None, :]).sum()
    return float((greater + 0.5 * ties) / (a.size * b.size))


def observer_scores(first: Sequence[RecordingChannel], second: Sequence[RecordingChannel]) -> dict[str, float]:
    """A result row's ``observer`` field from the recorded generations of one item's two private contexts:
    ``sizes_apart`` (0 or 1), ``timing_auc`` (the on-path observer's, on the edge's gaps) and
    ``cloud_timing_auc`` (the cloud's, on its signals' arrivals)."""
    return {
        "sizes_apart": float(sizes_told_apart([c.path_view() for c in first], [c.path_view() for c in second])),
        "timing_auc": timing_auc(np.concatenate([c.path_view().up_gaps() for c in first]),
                                 np.concatenate([c.path_view().up_gaps() for c in second])),
        "cloud_timing_auc": timing_auc(np.concatenate([c.cloud_clock().gaps() for c in first]),
                                       np.concatenate([c.cloud_clock().gaps() for c in second])),
    }
