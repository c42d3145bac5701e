"""The privacy ledger: what left the device at each step of one generation, and why.

:class:`LedgerEntry` is one step's record (the signal, its bytes and timings,
DecodeLeak's exposure set ``E_t^K``, how often it was sent); :class:`PrivacyLedger`
is the whole generation's, with the epsilon account of the DP policies beside it.
The decoding loop (:mod:`edge_sdk.decoding`) writes it; apps, the endpoint and the
harness read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.privacy.meter import ExposureTrace
from edge_sdk.protocol.signals import FusionMode
from edge_sdk.privacy.accountant import PrivacyAccountant, odds_sentence


@dataclass(frozen=True)
class LedgerEntry:
    """What left the device at one step, and why."""

    step: int
    token_id: int
    policy: str
    signal: str  # "upload" or "token"
    values_uploaded: int  # cloud-side: how many SLM values were sent
    full_requested: bool  # the edge asked for the full cloud distribution (the cloud saw that)
    withheld: bool  # the exposure budget was spent: only a cloud-only signal was sent
    steered: bool  # the private context steered the signal (an upload, or a token other than the cloud's top)
    bytes_up: int
    bytes_down: int
    leak_share: float  # share of the private context's content tokens exposed so far
    edge_ms: float  # own model + policy time
    wait_ms: float  # time blocked on the cloud
    cloud_forward_ms: float  # the cloud's own forward pass for this step's distribution (as it reports)
    exposure: tuple[int, ...] = ()  # DecodeLeak's E_t^K: the top-K ids the cloud can read off this step
    sends: int = 1  # how often this step's signal was sent (a broken stream re-sends the same bytes)
    full_requests: int = 0  # how often the full row was asked for (once per connection the step ran on)
    pace_overrun: bool = False  # paced, and the signal was ready only after its first slot (it left at a later one)


@dataclass
class PrivacyLedger:
    """Per-step record of everything that left the device in one generation."""

    mode: FusionMode
    policy: str
    exposure_k: int = DecodeSettings.exposure_k  # K of every entry's exposure set E_t^K
    entries: list[LedgerEntry] = field(default_factory=list)
    reconnects: int = 0
    #: with a prefill budget (DecodeSettings.prefill_budget_ms), the work before the open (tokenising the private
    #: text, the SLM's prefill) ran past it and the session opened at a later point of its grid, which shows the
    #: cloud how many budgets that work took; or the work after the close (scoring an echoed prompt) did, and
    #: its result came a point later
    prefill_overrun: bool = False
    #: the id the cloud gave each session this generation ran in (one, plus one per resume), in order: the cloud
    #: chose them and sent them to the edge, so keeping them here reveals nothing; an auditor matches them to the
    #: adapter's transcripts of what it observed
    session_ids: list[str] = field(default_factory=list)
    cloud_model: str | None = None  # the model the cloud said it serves when the (last) session opened
    accountant: PrivacyAccountant | None = None  # what the releasing steps spent (epsilon), and the budget's switch

    @property
    def bytes_up(self) -> int:
        return sum(e.bytes_up for e in self.entries)

    @property
    def bytes_down(self) -> int:
        return sum(e.bytes_down for e in self.entries)

    @property
    def full_requests(self) -> int:
        return sum(e.full_requests for e in self.entries)

    @property
    def values_uploaded(self) -> int:
        return sum(e.values_uploaded for e in self.entries)

    @property
    def leak_share(self) -> float:
        return self.entries[-1].leak_share if self.entries else 0.0

    def exposure_trace(self) -> ExposureTrace:
        """DecodeLeak's exposure sequence ``{E_t^K}`` as the edge recorded it (``K`` = ``exposure_k``)."""
        return ExposureTrace(self.exposure_k, tuple(entry.exposure for entry in self.entries))

    def revealed(self) -> tuple[int, int]:
        """``(steps, values)``: how many steps released something decided from the private context (the
        accountant's releases) and how many values they sent (an upload's values, a synced token's one)."""
        if self.accountant is None:
            return 0, 0
        released = set(self.accountant.release_steps)
        entries = [entry for entry in self.entries if entry.step in released]
        return len(entries), sum(entry.values_uploaded if entry.signal == "upload" else 1 for entry in entries)

    def in_words(self) -> str | None:
        """What the generation's privacy means to the person: the odds ``e^eps`` next to a DP policy's epsilon,
        the counts for a heuristic ("3 of 212 steps revealed 5 values")."""
        if self.accountant is None:
            return None
        if self.accountant.event.private:
            return odds_sentence(self.accountant.epsilon(), self.accountant.delta)
        steps, values = self.revealed()
        return (f"no DP guarantee (a heuristic): {steps} of {len(self.entries)} steps revealed {values} values "
                f"decided by your private context")

    def privacy(self) -> dict[str, object] | None:
        """The epsilon ledger: ``epsilon_spent`` for its ``relation``, ``delta``, ``accountant``, ``events``,
        ``guarantee`` ("dp" or "non-private"), the budget and when it withheld (:meth:`PrivacyAccountant.summary`),
        and ``in_words`` (:meth:`in_words`)."""
        if self.accountant is None:
            return None
        return {**self.accountant.summary(), "in_words": self.in_words()}

    def summary(self) -> str:
        steps = len(self.entries)
        spent = "" if self.accountant is None else f"; {self.accountant.describe()}; {self.in_words()}"
        return (
            f"{steps} steps, {self.mode}-side fusion with {self.policy}: "
            f"{self.values_uploaded} SLM values uploaded, {self.full_requests} full-distribution requests, "
            f"{self.bytes_up} B up / {self.bytes_down} B down, leakage meter {self.leak_share:.1%}{spent}"
        )
