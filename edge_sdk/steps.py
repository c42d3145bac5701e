"""The parts of one decoding step, one object per concern (the loop in :mod:`edge_sdk.decoding` strings them;
the exposure and epsilon budgets are :mod:`edge_sdk.privacy.budget`).

* :class:`SLMView`: the SLM's next-token row as the policy may read it (``never_upload`` ids removed);
* :class:`ChoiceProcessor`: a hook at the decide step restricting the ids the edge may choose (the JSON
  grammar, :class:`edge_sdk.grammar.JsonConstraint`), as transformers hands ``LogitsProcessor`` objects to its
  sampling loop;
* :class:`StepDecision`: what the decide step settled (the signal, and ``E_t^K`` the cloud can read off it);
* :class:`PendingSignal`: a step's signal from its first attempt until the cloud acknowledges it, re-sent
  byte for byte after a broken stream;
* :class:`Pacer`: the public schedule signals leave on (``pace_ms``);
* :class:`StopControl`: the text so far, whether the generation may end, whether it is done, the end ids;
* :class:`StepMeter`: one step's timings and bytes, and the :class:`~edge_sdk.privacy.ledger.LedgerEntry` they end in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edge_sdk.fusion import FusionSpace, check_finite, softmax
from edge_sdk.privacy.ledger import LedgerEntry
from edge_sdk.protocol.signals import CloudUpload, SyncedToken

if TYPE_CHECKING:
    from edge_sdk.backends.base import SLMBackend
    from edge_sdk.logprobs import TokenLogprobs
    from edge_sdk.protocol.connection import ByteCounter


class SLMView:
    """The SLM's row for the next step in the policy's space, with what it says of masked ids removed.

    ``row`` is set by :meth:`prefill` and replaced by each :meth:`advance`;
    ``lowest`` is the lowest value a row can hold in that space (0 for
    probabilities, float32's minimum for logits).
    """

    def __init__(self, slm: SLMBackend, space: FusionSpace, masked_ids: Collection[int]) -> None:
        self.slm = slm
        self.space = space
        self.masked = np.fromiter(sorted(masked_ids), dtype=np.int64)
        self.lowest = float(np.finfo(np.float32).min) if space == "logit" else 0.0  # exact in float32
        self.row: np.ndarray | None = None

    def prefill(self, ids: list[int]) -> None:
        self.row = self.arrays(self.slm.prefill(ids))

    def advance(self, token_id: int) -> None:
        self.row = self.arrays(self.slm.append(token_id))

    def arrays(self, logits: np.ndarray) -> np.ndarray:
        """The SLM's logits as the policy reads them.

        Probability space: ``softmax(z)`` with masked ids zeroed and the rest
        renormalised.  Logit space: the raw logits (what the authors' release
        fuses), masked ids lowered to float32's minimum.  The policy then
        decides as if the SLM gave the masked span nothing: a masked token
        can only be chosen on the cloud's own probability, exactly as a word
        the private context never mentions, so neither a masked value nor a
        refusal of a token the cloud pushes tells the cloud anything.
        """
        logits = check_finite(np.asarray(logits, dtype=np.float32)[: self.slm.vocab_size], "the SLM's logits")
        if self.space == "logit":
            z = logits.copy()
            if self.masked.size:
                z[self.masked] = self.lowest
            return z
        p = softmax(logits)
        if self.masked.size:
            p[self.masked] = 0.0
            total = p.sum(dtype=np.float64)
            if total > 0:
                p /= np.float32(total)
        return p


class ChoiceProcessor(Protocol):
    """A hook at the decide step: which ids the chosen token may take.

    Edge-side the decoder masks both rows the policy fuses to ``allowed()``
    (and the cloud's own top token when a budget withholds); cloud-side, where
    the cloud picks, only a JSON schema's processor can apply (it is sent with
    the session and the cloud masks its fused row).  Either way the decoder
    calls :meth:`consume` with each token appended.  It must read only public
    data (its own rules and the generated tokens): the mask shapes what is sent.
    """

    def allowed(self) -> np.ndarray:
        """A boolean row over the vocabulary: ``True`` where the id may come next."""
        ...

    def consume(self, token_id: int) -> None: ...


@dataclass(frozen=True, eq=False)
class StepDecision:
    """What the decide step settled: ``signal`` leaves the device; ``exposure`` is DecodeLeak's ``E_t^K``, the
    top-``K`` ids the cloud can read off it (:func:`edge_sdk.protocol.wire.step_exposure`).

    ``logprobs`` (edge-side, when asked for): reads the chosen token's log-probabilities off the row it was
    chosen from; the loop calls it once the signal has left, so its cost (a top-n search whose time varies with
    the private row) never delays what is sent.
    """

    signal: CloudUpload | SyncedToken
    exposure: np.ndarray
    logprobs: Callable[[], TokenLogprobs] | None = None


@dataclass(eq=False)
class PendingSignal:
    """A step from its first attempt until the cloud acknowledges its signal, over every connection it ran on.

    ``decision`` is made once and its signal then re-sent byte for byte (a
    fresh draw would hand the cloud a second sample of the same step), with
    the same ``no_stop`` (the cloud may not end the generation this step); a
    step whose full row was asked for asks again on each new connection until
    a signal is decided (the same request: the rule that asks is public).
    Cloud-side run-ahead a step may be yielded before it is acknowledged (its
    pick read off a certificate): it is then kept until the cloud's pick is read.
    """

    step: int
    withheld: bool
    no_stop: bool = False
    decision: StepDecision | None = None
    full_requests: int = 0
    sends: int = 0
    bytes_up: int = 0  # what earlier, broken attempts carried
    bytes_down: int = 0

    def keep_bytes(self, meter: StepMeter) -> None:
        """An attempt broke: what it sent and received stays on the record of the step."""
        self.bytes_up += meter.bytes_up
        self.bytes_down += meter.bytes_down


class Pacer:
    """Paced signals: step ``t``'s leaves at the first point of ``S + n * pace_ms`` (``n >= 1``) at or after it is
    ready, ``S`` the previous signal's slot (or when the cloud answered the open).  ``pace_ms=None``: no wait,
    except in the sessions :meth:`start` paces at ``auto_pace_ms`` (``None``: no wait either).  Cloud-side, when the
    edge waited for the cloud's pick of the previous step, ``S`` is when that pick arrived, if later (:meth:`restart`).

    The open: it leaves at the first point of ``B + n * prefill_budget_ms`` (``n >= 1``) at or after the SLM's
    prefill, ``B = max(b, f)``: ``b`` the earliest time the generation's private work on the device began
    (:meth:`begin`), ``f`` the latest time before which none of it can have run, when the previous generation on
    the same client ended (:meth:`not_before`).  ``prefill_budget_ms=None``: no wait.  Private work after the
    generation (:meth:`wait_after_end`) ends on the same grid from when its last session closed.
    """

    def __init__(self, pace_ms: float | None, prefill_budget_ms: float | None = None,
                 auto_pace_ms: float | None = None) -> None:
        self._pace_ms, self._auto_pace_ms = pace_ms, auto_pace_ms
        self.pace_s = None if pace_ms is None else pace_ms / 1e3  # this session's pace (set again by start)
        self.prefill_budget_s = None if prefill_budget_ms is None else prefill_budget_ms / 1e3
        self._began_at: float | None = None  # perf_counter clock
        self._not_before = -math.inf  # perf_counter clock
        self._ended_at: float | None = None  # perf_counter clock: when the last session closed (end)
        self.last_slot = 0.0  # perf_counter clock

    @property
    def began_at(self) -> float | None:
        """The open grid's origin ``B`` (``None`` until :meth:`begin`)."""
        return None if self._began_at is None else max(self._began_at, self._not_before)

    def begin(self, at: float) -> None:
        """The generation's private work on the device (tokenising its private text, the prefill) began at ``at``
        (``time.perf_counter``); the earliest call counts."""
        self._began_at = at if self._began_at is None else min(self._began_at, at)

    def not_before(self, at: float) -> None:
        """The grid starts no earlier than ``at``, when the previous generation on the same client ended: the cloud
        saw that end, and the work of this generation done before it (a queued request tokenised while the
        previous one ran) does not lie between that end and this open; the latest call counts."""
        self._not_before = max(self._not_before, at)

    def end(self) -> float:
        """The generation's last session closed now (the cloud saw it); returns when (``time.perf_counter``)."""
        self._ended_at = time.perf_counter()
        return self._ended_at

    @property
    def ended(self) -> bool:
        """Whether :meth:`end` was called: the generation's last session has closed."""
        return self._ended_at is not None

    def wait_after_end(self) -> tuple[float, bool] | None:
        """Private work after the last session closed (scoring an echoed prompt) ends at the first point of
        ``E + n * prefill_budget_ms`` (``n >= 1``), ``E`` when it closed (:meth:`end`), so when its result reaches
        the app, and whatever the app sends next, does not show how long it took: ``(that point, whether it was
        not the first)`` (``time.perf_counter``).  ``prefill_budget_ms=None``: no wait, ``None``."""
        if self.prefill_budget_s is None:
            return None
        if self._ended_at is None:
            raise ValueError("work after the generation is paced from its end: run it on an EdgeClient first")
        slots = self._wait_on_grid(self._ended_at, self.prefill_budget_s)
        return self._ended_at + slots * self.prefill_budget_s, slots > 1

    def wait_for_open(self) -> bool:
        """Sleep until the open's slot; whether the prefill ran past its first one."""
        if self.prefill_budget_s is None:
            return False
        assert self.began_at is not None, "begin() comes before the prefill"
        return self._wait_on_grid(self.began_at, self.prefill_budget_s) > 1

    def start(self, auto: bool = False) -> None:
        """The steps' grid's origin: the cloud's answer to the open; ``auto``: the session is paced at
        ``auto_pace_ms`` unless ``pace_ms`` is set (it runs ahead or fuses cloud-side: public settings both ends
        agreed on in the open)."""
        pace_ms = self._pace_ms if self._pace_ms is not None or not auto else self._auto_pace_ms
        self.pace_s = None if pace_ms is None else pace_ms / 1e3
        self.last_slot = time.perf_counter()

    def restart(self, at: float) -> None:
        """The grid starts again at ``at`` if that is later than the last slot: when the cloud's pick arrived, which
        the edge waited for doing nothing else (the cloud's forward, its pick and the link: the cloud's time)."""
        self.last_slot = max(self.last_slot, at)

    def wait_for_slot(self) -> bool:
        """Sleep until this step's slot; whether the signal missed its first one."""
        if self.pace_s is None:
            return False
        slots = self._wait_on_grid(self.last_slot, self.pace_s)
        self.last_slot += slots * self.pace_s
        return slots > 1

    @staticmethod
    def _wait_on_grid(origin: float, period_s: float) -> int:
        """Sleep until the first point ``origin + n * period_s`` (``n >= 1``) at or after now; return ``n``."""
        slots = max(1, math.ceil((time.perf_counter() - origin) / period_s))
        delay = origin + slots * period_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return slots


class StoppingRule(Protocol):
    """When a generation may end and when it is complete, read off the text generated so far.

    Both sides already hold that text, so following the rule reveals nothing
    private (cloud-side the edge only tells the cloud "not yet").
    """

    def allows_end(self, text: str) -> bool:
        """Whether an end-of-generation token may be chosen after ``text``."""
        ...

    def is_done(self, text: str) -> bool:
        """Whether the generation is complete once it reads ``text`` (decoding stops there)."""
        ...


class StopControl:
    """Where a generation may end and where it does: the end-of-generation ids and the optional rule.

    ``ids``: the SLM's end ids, joined at each open by the cloud's; ``id_array``
    the same within the vocabulary.  The text is detokenised only when a rule
    reads it, once per length of the generation.
    """

    def __init__(self, slm: SLMBackend, rule: StoppingRule | None) -> None:
        self.slm = slm
        self.rule = rule
        self.ids: frozenset[int] = frozenset(slm.eos_token_ids)
        self.id_array = np.empty(0, dtype=np.int64)
        self._text: tuple[int, str] | None = None  # (how many tokens, their text)

    def open(self, cloud_eos_ids: frozenset[int]) -> None:
        """A session opened: the cloud's end ids join the SLM's (the cloud stops where the edge would)."""
        self.ids = frozenset(self.slm.eos_token_ids) | cloud_eos_ids
        self.id_array = np.fromiter(sorted(i for i in self.ids if i < self.slm.vocab_size), dtype=np.int64)

    def text(self, tokens: list[int]) -> str:
        if self._text is None or self._text[0] != len(tokens):
            self._text = len(tokens), self.slm.detokenize(tokens)
        return self._text[1]

    def allows_end(self, tokens: list[int]) -> bool:
        """Whether an end id may be chosen after ``tokens``."""
        return self.rule is None or self.rule.allows_end(self.text(tokens))

    def is_done(self, tokens: list[int]) -> bool:
        """Whether the rule ends the generation at ``tokens`` (an end id or the length limit aside)."""
        return self.rule is not None and self.rule.is_done(self.text(tokens))


class StepMeter:
    """One step's timings and bytes (from when it was created), and the ledger entry they end in."""

    def __init__(self, counter: ByteCounter) -> None:
        self._counter = counter
        self._up0, self._down0 = counter.edge_to_cloud, counter.cloud_to_edge
        self.wait_s = 0.0  # blocked on the cloud
        self.edge_s = 0.0  # own model and policy
        self.cloud_forward_ns = 0  # as the cloud reports it for the step's distribution

    @property
    def bytes_up(self) -> int:
        return self._counter.edge_to_cloud - self._up0

    @property
    def bytes_down(self) -> int:
        return self._counter.cloud_to_edge - self._down0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time blocked on the cloud."""
        started = time.perf_counter()
        yield
        self.wait_s += time.perf_counter() - started

    @contextmanager
    def on_edge(self) -> Iterator[None]:
        """The edge's own time (a wait inside it counts in both)."""
        started = time.perf_counter()
        yield
        self.edge_s += time.perf_counter() - started

    @contextmanager
    def pacing(self) -> Iterator[None]:
        """A wait for a pacing slot inside :meth:`on_edge`: not the edge's own time."""
        started = time.perf_counter()
        yield
        self.edge_s -= time.perf_counter() - started

    def entry(
        self, pending: PendingSignal, token_id: int, *, policy: str, steered: bool, leak_share: float,
        pace_overrun: bool,
    ) -> LedgerEntry:
        """The step's :class:`~edge_sdk.privacy.ledger.LedgerEntry`: every attempt's bytes and sends, this one's timings."""
        assert pending.decision is not None, "a step is recorded once its signal was sent"
        signal = pending.decision.signal
        return LedgerEntry(
            step=pending.step,
            token_id=token_id,
            policy=policy,
            signal="upload" if isinstance(signal, CloudUpload) else "token",
            values_uploaded=len(signal) if isinstance(signal, CloudUpload) else 0,
            full_requested=pending.full_requests > 0,
            withheld=pending.withheld,
            steered=steered,
            bytes_up=pending.bytes_up + self.bytes_up,
            bytes_down=pending.bytes_down + self.bytes_down,
            leak_share=leak_share,
            edge_ms=self.edge_s * 1e3,
            wait_ms=self.wait_s * 1e3,
            cloud_forward_ms=self.cloud_forward_ns / 1e6,
            exposure=tuple(int(i) for i in pending.decision.exposure),
            sends=pending.sends,
            full_requests=pending.full_requests,
            pace_overrun=pace_overrun,
        )
