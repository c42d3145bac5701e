"""The collaborative decoding loop, written once for every transport.

Per step ``t`` the edge has ``p_slm`` (private context + public query + the
shared prefix) and receives the cloud's ``p_llm`` (public query + prefix).
Its policy turns them into the one signal that leaves the device; the loop
records that in the :class:`PrivacyLedger` and the :class:`LeakageMeter`.

Both models only need the last token to go on, so the loop sends its signal
first and then runs its own model while the cloud runs its own: a step costs
about ``max(edge, cloud) + one round trip``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Protocol
from dataclasses import dataclass, field

import numpy as np

from edge_sdk import wire
from edge_sdk.accountant import PrivacyAccountant
from edge_sdk.backends.base import SLMBackend
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import check_finite, softmax
from edge_sdk.grammar import JsonConstraint, mask_row
from edge_sdk.leakage import ExposureTrace, LeakageMeter
from edge_sdk.masking import FULL_UPLOAD_LIMIT
from edge_sdk.policies.base import CloudUpload, FusionMode, Policy, SyncedToken
from edge_sdk.transport import CloudConnection, CloudError


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

    def privacy(self) -> dict[str, object] | None:
        """The epsilon ledger: ``epsilon_spent``, ``delta``, ``accountant``, ``events``, ``guarantee`` ("dp" or
        "non-private"), the budget and when it withheld (:meth:`PrivacyAccountant.summary`)."""
        return None if self.accountant is None else self.accountant.summary()

    def summary(self) -> str:
        steps = len(self.entries)
        spent = "" if self.accountant is None else f"; {self.accountant.describe()}"
        return (
            f"{steps} steps, {self.mode}-side fusion with {self.policy}: "
            f"{self.values_uploaded} SLM values uploaded, {self.full_requests} full-distribution requests, "
            f"{self.bytes_up} B up / {self.bytes_down} B down, leakage meter {self.leak_share:.1%}{spent}"
        )


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


@dataclass(eq=False)
class _OpenStep:
    """A step from its first attempt until the cloud acknowledges its signal, over every connection it ran on.

    ``signal`` is decided once and then re-sent byte for byte; a step whose
    full row was asked for asks again on each new connection until a signal
    is decided (the same request: the rule that asks is public).
    """

    step: int
    withheld: bool
    signal: CloudUpload | SyncedToken | None = None
    exposure: np.ndarray | None = None
    full_requests: int = 0
    sends: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class StepEvent:
    """One decided token as the loop yields it."""

    token_id: int
    entry: LedgerEntry


class CollaborativeDecoder:
    """Runs one generation: holds the shared prefix and can resume on a new connection.

    Args:
        slm: the edge model backend.
        policy: the defence deciding each step's signal.
        settings: :class:`DecodeSettings`.
        slm_prompt: ids the SLM conditions on (private context + public query).
        cloud_prompt: ids the cloud conditions on (public query only).
        meter: the live leakage meter for this private context.
        masked_ids: ids of ``never_upload`` spans: the SLM's values for them are removed before the policy
            runs (see :meth:`_edge_arrays`).
        rng: the generator randomised policies draw from (seed it from OS entropy: anything derived from
            what crosses the wire would let the cloud replay the policy's noise).
        stopping: when the generation may end and when it is complete (``None``: at an end-of-generation
            token or ``max_new_tokens``).
    """

    def __init__(
        self,
        slm: SLMBackend,
        policy: Policy,
        settings: DecodeSettings,
        *,
        slm_prompt: list[int],
        cloud_prompt: list[int],
        meter: LeakageMeter,
        masked_ids: frozenset[int] = frozenset(),
        rng: np.random.Generator | None = None,
        stopping: StoppingRule | None = None,
        constraint: JsonConstraint | None = None,
    ) -> None:
        if settings.mode not in policy.modes:
            raise ValueError(f"policy {policy.name!r} does not support {settings.mode}-side fusion")
        if constraint is not None and settings.mode != "edge":
            raise ValueError("a JSON schema constrains edge-side fusion only: cloud-side, the cloud picks the token")
        policy = policy.for_generation(settings.max_new_tokens)  # a budget spread over T tokens: this T
        self.slm = slm
        self.policy = policy
        self.accountant = PrivacyAccountant(
            policy.release_event(settings.mode), delta=settings.epsilon_delta, max_epsilon=settings.max_epsilon
        )
        self.settings = settings
        self.slm_prompt = list(slm_prompt)
        self.cloud_prompt = list(cloud_prompt)
        self.meter = meter
        self.masked = np.fromiter(sorted(masked_ids), dtype=np.int64)
        # the lowest value a row can hold in the policy's space: 0 for probabilities, float32's minimum for logits
        self._lowest = np.float32(np.finfo(np.float32).min if policy.space == "logit" else 0.0)
        self.rng = rng
        self.stopping = stopping
        # structured output: masks the fused distribution where the edge picks (edge_sdk.grammar); the loop hook
        # for logits processors is not there yet, so the mask is applied in _decide and advanced on append
        self.constraint = constraint
        self.tokens: list[int] = []
        self.ledger = PrivacyLedger(mode=settings.mode, policy=policy.describe(), exposure_k=settings.exposure_k,
                                    accountant=self.accountant)
        self.finish_reason: str | None = None
        self._p_slm: np.ndarray | None = None  # the policy's view of the SLM's next distribution
        self._p_llm_buffer = np.zeros(slm.vocab_size, dtype=np.float32)  # the sparse cloud view, reused
        self._stop_ids: frozenset[int] = frozenset(slm.eos_token_ids)
        self._stop_array = np.empty(0, dtype=np.int64)  # the same, as an array (set when the session opens)
        self._open_step: _OpenStep | None = None  # begun, but the cloud has not acknowledged its signal
        self._steered_steps = 0  # steps whose signal the private context steered (what the budget counts)
        self._last_slot = 0.0  # paced: the last signal's slot (or when the open was answered), perf_counter clock

    @property
    def top_m(self) -> int:
        """How many cloud values to ask for per sparse step.

        Edge-side the exposure set ``E_t^K`` is the cloud's own top ``K``, so at
        least ``K`` values are asked for: the ledger then records ``K`` ids per
        step whatever ``settings.top_m`` says.
        """
        s = self.settings
        if self.constraint is not None:  # a masked row needs every value (public: the schema alone decides it)
            return self.slm.vocab_size
        top_m = max(s.top_m, s.exposure_k) if s.mode == "edge" else s.top_m
        return min(top_m, self.slm.vocab_size)

    def request(self) -> wire.SessionRequest:
        s = self.settings
        return wire.SessionRequest(
            prompt_ids=tuple(self.cloud_prompt),
            mode=s.mode,
            alpha=s.alpha,
            space=self.policy.space,
            temperature=s.temperature,
            seed=s.seed if s.mode == "cloud" else 0,  # the cloud's own sampling seed: it samples only cloud-side
            max_new_tokens=s.max_new_tokens,
            vocab_fingerprint=self.slm.vocab_fingerprint(),
            edge_model=self.slm.name,
            vocab_size=self.slm.vocab_size,
            top_m=self.top_m,
            resume_prefix=tuple(self.tokens),
            stop_token_ids=tuple(sorted(self.slm.eos_token_ids)),  # the cloud stops where the edge would
        )

    # -- one step ------------------------------------------------------------------------------------
    def _edge_arrays(self, logits: np.ndarray) -> np.ndarray:
        """The SLM's row in the policy's space, with what it says of masked ids removed.

        Probability space: ``softmax(z)`` with masked ids zeroed and the rest
        renormalised.  Logit space: the raw logits (what the authors' release
        fuses), masked ids lowered to float32's minimum.  The policy then
        decides as if the SLM gave the masked span nothing: a masked token
        can only be chosen on the cloud's own probability, exactly as a word
        the private context never mentions, so neither a masked value nor a
        refusal of a token the cloud pushes tells the cloud anything.
        """
        logits = check_finite(np.asarray(logits, dtype=np.float32)[: self.slm.vocab_size], "the SLM's logits")
        if self.policy.space == "logit":
            z = logits.copy()
            if self.masked.size:
                z[self.masked] = self._lowest
            return z
        p = softmax(logits)
        if self.masked.size:
            p[self.masked] = 0.0
            total = p.sum(dtype=np.float64)
            if total > 0:
                p /= np.float32(total)
        return p

    def _decide(
        self, p_slm: np.ndarray, dist: wire.CloudDistribution, withheld: bool, no_stop: bool = False
    ) -> CloudUpload | SyncedToken | None:
        """The step's signal, or ``None`` when the policy reads the full row and ``dist`` is sparse.

        A sparse row is read with every omitted id at its public fill
        (:meth:`~edge_sdk.wire.CloudDistribution.filled`); whether the full
        row is asked for depends on the policy and the mode alone
        (:meth:`~edge_sdk.policies.base.Policy.needs_full_row`), never on ``p_slm``.
        ``no_stop`` (edge-side): end-of-generation ids are out of the choice this step; cloud-side the cloud
        is told instead.
        """
        mode, alpha = self.settings.mode, self.settings.alpha
        stops = self._stop_array if no_stop and mode == "edge" else None
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if withheld:  # budget spent: a signal the cloud could have produced on its own
            if mode == "cloud":
                return CloudUpload.empty(self.policy.space)
            token = dist.top_id()  # the cloud's own top token (its best one that does not end, if it may not)
            if (stops is not None and token in self._stop_ids) or (allowed is not None and not allowed[token]):
                row = dist.lower_dense(self.slm.vocab_size, out=self._p_llm_buffer, fill=self._lowest).copy()
                if stops is not None:
                    row[stops] = self._lowest
                if allowed is not None:
                    row = mask_row(row, allowed, lowest=self._lowest)
                token = int(np.argmax(row))
            return SyncedToken(token)
        if not dist.is_full and self.policy.needs_full_row(mode):
            return None
        p_llm = dist.filled(self.slm.vocab_size, self.policy.space, out=self._p_llm_buffer)
        if stops is not None:
            p_llm = p_llm.copy() if p_llm is dist.dense else p_llm
            p_llm[stops] = self._lowest
            p_slm = p_slm.copy()
            p_slm[stops] = self._lowest
        if allowed is not None:  # the schema's ids only, in both rows the policy fuses
            p_llm = mask_row(p_llm, allowed, lowest=self._lowest)
            p_slm = mask_row(p_slm, allowed, lowest=self._lowest)
        signal = self.policy.decide(mode, p_slm, p_llm, alpha=alpha, rng=self.rng)
        if isinstance(signal, CloudUpload) and len(signal) >= self.slm.vocab_size and (
            self.policy.space == "prob" or self.masked.size
        ):
            # every id listed: masked ones (at the floor) would stand out.  Probability space cuts whether or
            # not a mask is active (else the cut says one is); logit space only under a mask, since the cloud
            # counts an id left out as a logit of 0, which would change the release's fusion of every row
            signal = signal.largest(FULL_UPLOAD_LIMIT)
        if allowed is not None and isinstance(signal, SyncedToken) and not allowed[signal.token_id]:
            raise ValueError(f"policy {self.policy.name!r} chose a token outside the JSON schema's grammar")
        return signal

    def _wait_for_slot(self) -> bool:
        """Paced: sleep until this step's slot (see ``DecodeSettings.pace_ms``); whether it missed its first one."""
        if self.settings.pace_ms is None:
            return False
        pace = self.settings.pace_ms / 1e3
        slots = max(1, math.ceil((time.perf_counter() - self._last_slot) / pace))
        self._last_slot += slots * pace
        delay = self._last_slot - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return slots > 1

    @staticmethod
    def _steered(signal: CloudUpload | SyncedToken, dist: wire.CloudDistribution) -> bool:
        """Whether the private context steered this step's signal, as the cloud itself can tell.

        Cloud-side: anything was uploaded.  Edge-side: the token is not the
        cloud's own top token.  The exposure budget counts only these steps, so
        when it switches depends on nothing the cloud has not already seen
        (counting private words instead made the switch an oracle: a cloud
        pushing a probe word learned whether it was one of them).
        """
        if isinstance(signal, CloudUpload):
            return len(signal) > 0
        return signal.token_id != dist.top_id()

    def steps(self, connection: CloudConnection) -> Iterator[StepEvent]:
        """Open (or resume) the session on ``connection`` and decode until the end.

        The SLM prefills the private prompt *before* the session opens: the
        cloud's clock then starts after the only step whose duration grows
        with the private context's length (or drops when a repeated prompt is
        served from the cache), so step 0's timing tells it nothing of either.
        A step whose signal was sent but never acknowledged (the stream broke)
        sends exactly that signal again on the next connection: a fresh draw
        would hand the cloud a second sample of the same step.  A step whose
        full-row request got no reply asks again; every send of either is on
        the step's ledger entry.
        """
        if self._p_slm is None:
            self._p_slm = self._edge_arrays(self.slm.prefill(self.slm_prompt + self.tokens))
        info = connection.open(self.request())
        self._last_slot = time.perf_counter()  # the cloud's reply, after its own prefill (the SLM's came before)
        self.ledger.session_ids.append(info.session_id)
        self.ledger.cloud_model = info.cloud_model
        if info.vocab_size != self.slm.vocab_size:  # the fingerprint matched; the sizes must too
            raise CloudError(
                "FAILED_PRECONDITION",
                f"the cloud model {info.cloud_model!r} reports a vocabulary of {info.vocab_size} tokens, the edge "
                f"model {self.slm.name!r} has {self.slm.vocab_size}",
            )
        self._stop_ids = frozenset(self.slm.eos_token_ids) | info.eos_token_ids
        self._stop_array = np.fromiter(sorted(i for i in self._stop_ids if i < self.slm.vocab_size), dtype=np.int64)
        max_steps = min(self.settings.max_new_tokens, info.max_new_tokens)
        k = self.settings.exposure_k
        text: str | None = None  # the generated text, read only when a stopping rule needs it
        while len(self.tokens) < max_steps:
            step = len(self.tokens)
            up0, down0 = connection.bytes.edge_to_cloud, connection.bytes.cloud_to_edge
            wait = time.perf_counter()
            dist = connection.distribution()
            wait_s = time.perf_counter() - wait
            if dist.step != step:
                raise CloudError("INTERNAL", f"the cloud sent step {dist.step}, expected {step}")
            cloud_forward_ns = dist.forward_ns  # a full row sent on request carries no forward of its own
            started = time.perf_counter()
            if self.stopping is not None and text is None:  # a resumed session: the text so far, once
                text = self.slm.detokenize(self.tokens)
            no_stop = self.stopping is not None and not self.stopping.allows_end(text)
            sent = self._open_step if self._open_step is not None and self._open_step.step == step else None
            if sent is None:
                budget = self.settings.exposure_budget
                # one more steered step must keep the share within the budget: at most floor(budget * max_steps)
                withheld = budget is not None and self._steered_steps + 1 > budget * max_steps
                withheld = self.accountant.withholds(step) or withheld  # public numbers and the release count only
                sent = self._open_step = _OpenStep(step, withheld)
            try:
                if sent.signal is None:
                    signal = self._decide(self._p_slm, dist, sent.withheld, no_stop)
                    if signal is None:  # the policy reads full rows: asked for at every step
                        sent.full_requests += 1
                        wait = time.perf_counter()
                        dist = connection.request_full(step)
                        wait_s += time.perf_counter() - wait
                        signal = self._decide(self._p_slm, dist, sent.withheld, no_stop)
                        assert signal is not None, "a full distribution always decides"
                    sent.signal, sent.exposure = signal, wire.step_exposure(signal, dist, k)
                    if not sent.withheld:  # recorded when decided: a send that broke may still have reached the cloud
                        self.accountant.record(step, steered=self._steered(signal, dist))
                edge_s = time.perf_counter() - started
                overrun = self._wait_for_slot()
                signal, exposure = sent.signal, sent.exposure
                sent.sends += 1
                if isinstance(signal, CloudUpload):
                    wait = time.perf_counter()
                    token, finished = connection.upload(step, signal, no_stop=no_stop)
                    wait_s += time.perf_counter() - wait
                    uploaded = len(signal)
                else:
                    token, uploaded = signal.token_id, 0
                    connection.sync_token(step, token)
                    finished = token in self._stop_ids or step + 1 >= max_steps
            except CloudError:
                # what this attempt sent stays on the record of the step
                sent.bytes_up += connection.bytes.edge_to_cloud - up0
                sent.bytes_down += connection.bytes.cloud_to_edge - down0
                raise
            self._open_step = None
            self.meter.observe(exposure)  # what the cloud can read off this step (reported, never decides anything)
            if isinstance(signal, SyncedToken):
                self.meter.observe([token])
            steered = self._steered(signal, dist)
            self._steered_steps += steered
            self.tokens.append(token)
            if self.constraint is not None:
                self.constraint.consume(token)
            if self.stopping is not None:  # one detokenisation per step serves this test and the next step's
                text = self.slm.detokenize(self.tokens)
            done = self.stopping is not None and self.stopping.is_done(text)
            if done and not finished:  # the rule ends it here: the edge closes the session
                finished, self.finish_reason = True, "stop_rule"
            if not finished:
                started_own = time.perf_counter()
                # the SLM's next step (and its softmax) run while the cloud computes its own
                self._p_slm = self._edge_arrays(self.slm.append(token))
                edge_s += time.perf_counter() - started_own
            entry = LedgerEntry(
                step=step,
                token_id=token,
                policy=self.policy.name,
                signal="upload" if isinstance(signal, CloudUpload) else "token",
                values_uploaded=uploaded,
                full_requested=sent.full_requests > 0,
                withheld=sent.withheld,
                steered=steered,
                bytes_up=sent.bytes_up + connection.bytes.edge_to_cloud - up0,
                bytes_down=sent.bytes_down + connection.bytes.cloud_to_edge - down0,
                leak_share=self.meter.share,
                edge_ms=edge_s * 1e3,
                wait_ms=wait_s * 1e3,
                cloud_forward_ms=cloud_forward_ns / 1e6,
                exposure=tuple(int(i) for i in exposure),
                sends=sent.sends,
                full_requests=sent.full_requests,
                pace_overrun=overrun,
            )
            self.ledger.entries.append(entry)
            yield StepEvent(token, entry)
            if finished:
                if self.finish_reason == "stop_rule":
                    return  # the session is closed by whoever owns the connection (run_with_resume does)
                try:
                    self.finish_reason = connection.finished()
                except CloudError:  # the stream broke after the last token: the generation itself is complete
                    self.finish_reason = "eos" if token in self._stop_ids else "max_new_tokens"
                return
        self.finish_reason = "max_new_tokens"


def run_with_resume(
    decoder: CollaborativeDecoder,
    connect: Callable[[], CloudConnection],
    *,
    max_reconnects: int = 3,
    backoff_s: float = 0.5,
) -> Iterator[StepEvent]:
    """Drive ``decoder`` over connections from ``connect``, reopening after a retryable failure.

    A reopened session replays only public data: the public prompt and the
    tokens already chosen.  After ``max_reconnects`` failed attempts the last
    error propagates.  The connection is closed however the loop ends
    (including when the consumer stops iterating).
    """
    attempts = 0
    while True:
        connection: CloudConnection | None = None
        try:
            connection = connect()
            yield from decoder.steps(connection)
            return
        except CloudError as exc:
            if not exc.retryable or attempts >= max_reconnects:
                raise
            attempts += 1
            decoder.ledger.reconnects += 1
            time.sleep(backoff_s * attempts)
        finally:
            if connection is not None:
                connection.close()
