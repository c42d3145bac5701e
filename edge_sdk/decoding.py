"""The collaborative decoding loop, written once for every transport.

Per step ``t`` the edge has ``p_slm`` (private context + public query + the
shared prefix) and receives the cloud's ``p_llm`` (public query + prefix).
Its policy turns them into the one signal that leaves the device; the loop
records that in the :class:`~edge_sdk.privacy.ledger.PrivacyLedger` and the
:class:`~edge_sdk.privacy.meter.LeakageMeter`.

A step is named parts (:meth:`CollaborativeDecoder.steps`): receive the
cloud's row, decide the signal, send it, record, advance.  Each concern is
an object of :mod:`edge_sdk.steps` (the SLM's view, the exposure budget, the
pending signal, the pacer, the stop control, the step's meter); what differs
by fusion mode is the generation's :class:`~edge_sdk.sides.FusionSide`.

Both models only need the last token to go on, so the loop sends its signal
first and then runs its own model while the cloud runs its own: a step costs
about ``max(edge, cloud) + one round trip``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.privacy.accountant import PrivacyAccountant
from edge_sdk.backends.base import SLMBackend
from edge_sdk.decode_settings import AUTO, DecodeSettings
from edge_sdk.fusion import fuse
from edge_sdk.grammar import JsonConstraint, mask_row
from edge_sdk.logprobs import TokenLogprobs, token_logprobs
from edge_sdk.privacy.masking import FULL_UPLOAD_LIMIT
from edge_sdk.policies.base import Policy
from edge_sdk.protocol.signals import Observation
from edge_sdk.privacy.budget import ExposureBudget
from edge_sdk.privacy.ledger import LedgerEntry, PrivacyLedger
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.sides import SIDES, fusion_side
from edge_sdk.steps import (
    ChoiceProcessor,
    Pacer,
    PendingSignal,
    SLMView,
    StepDecision,
    StepMeter,
    StopControl,
    StoppingRule,
)
from edge_sdk.protocol.status import CloudError
from edge_sdk.protocol.connection import CloudConnection


@dataclass
class StepEvent:
    """One decided token as the loop yields it."""

    token_id: int
    entry: LedgerEntry
    logprobs: TokenLogprobs | None = None  # when DecodeSettings.logprobs asks for them


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
            runs (see :meth:`edge_sdk.steps.SLMView.arrays`).
        rng: the generator randomised policies draw from (seed it from OS entropy: anything derived from
            what crosses the wire would let the cloud replay the policy's noise).
        stopping: when the generation may end and when it is complete (``None``: at an end-of-generation
            token or ``max_new_tokens``).
        processors: hooks restricting the ids the chosen token may take at each step, such as a JSON schema's
            :class:`~edge_sdk.grammar.JsonConstraint`.  Edge-side the edge masks where it picks; cloud-side only
            one JSON schema can apply: it is sent with the session, the cloud masks where it picks, and the edge
            checks each token the cloud picks against its own copy of the grammar.
        prompt_prefix: echo with logprobs (edge-side only): the SLM ids the public prompt's tokens follow when
            its positions are scored (BOS, the private context and its separator); the session then asks for the
            cloud's rows at the prompt's positions (:meth:`prompt_logprobs`).  ``None``: the prompt is not scored.
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
        processors: Sequence[ChoiceProcessor] = (),
        prompt_prefix: Sequence[int] | None = None,
    ) -> None:
        if settings.mode not in policy.modes:
            raise ValueError(f"policy {policy.name!r} does not support {settings.mode}-side fusion")
        if prompt_prefix is not None and not SIDES[settings.mode].scores_prompt:
            raise ValueError("the prompt's log-probabilities are served in edge-side fusion only: cloud-side the fused "
                             "row is the cloud's, made from an upload the edge would send at every prompt position")
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
        self.rng = rng
        self.processors = tuple(processors)
        self.view = SLMView(slm, policy.space, masked_ids)
        self.budget = ExposureBudget(settings.exposure_budget, self.accountant)
        if AUTO in (settings.pace_ms, settings.auto_pace_ms):
            raise ValueError("pace_ms='auto' is measured by the client (EdgeClient.decoder resolves it): give the "
                             "decoder a pace in ms (edge_sdk.pace_calibration.calibrated_pace_ms)")
        self.pacer = Pacer(settings.pace_ms, settings.prefill_budget_ms, settings.auto_pace_ms)
        self.stop = StopControl(slm, stopping)
        #: what the loop does differently where the token is picked (the cloud, or the edge)
        self.side = fusion_side(settings, policy_name=policy.name, space=policy.space, processors=self.processors,
                                stop=self.stop, pacer=self.pacer, vocab_size=slm.vocab_size,
                                masks_ids=bool(self.view.masked.size))
        self.tokens: list[int] = []
        self.ledger = PrivacyLedger(mode=settings.mode, policy=policy.describe(), exposure_k=settings.exposure_k,
                                    accountant=self.accountant)
        self.finish_reason: str | None = None
        self._p_llm_buffer = np.zeros(slm.vocab_size, dtype=np.float32)  # the sparse cloud view, reused
        self._pending: PendingSignal | None = None  # begun, but the cloud has not acknowledged its signal
        # the connection of the last session: what its cloud acknowledged decides where the next one resumes and
        # which steps it sends again (CloudConnection.unacknowledged: cloud-side picks read off certificates)
        self._previous: CloudConnection | None = None
        self.prompt_prefix = None if prompt_prefix is None else list(prompt_prefix)
        #: echo with logprobs: the cloud's rows at the prompt's positions and their values at its tokens (the opening's)
        self._prompt_rows: tuple[tuple[wire.CloudDistribution, ...], tuple[float, ...]] | None = None

    @property
    def top_m(self) -> int:
        """How many cloud values to ask for per sparse step (:meth:`~edge_sdk.sides.FusionSide.top_m`)."""
        return self.side.top_m()

    @property
    def max_upload(self) -> int:
        """The most values a step's upload may hold, from public settings only: the policy's maximum, and in
        probability space a whole-vocabulary upload cut to ``FULL_UPLOAD_LIMIT`` (:meth:`~edge_sdk.sides.CloudSide.checked`).  Every
        padded step signal is the size of the largest (:func:`edge_sdk.protocol.wire.pad_edge_message`)."""
        vocab_size = self.slm.vocab_size
        largest = self.policy.max_upload(vocab_size)
        if largest >= vocab_size and self.policy.space == "prob":
            return min(FULL_UPLOAD_LIMIT, vocab_size)
        return largest

    def request(self) -> wire.SessionRequest:
        s = self.settings
        return wire.SessionRequest(
            prompt_ids=tuple(self.cloud_prompt),
            mode=s.mode,
            alpha=s.alpha,
            space=self.policy.space,
            temperature=s.temperature,
            max_new_tokens=s.max_new_tokens,
            vocab_fingerprint=self.slm.vocab_fingerprint(),
            edge_model=self.slm.name,
            vocab_size=self.slm.vocab_size,
            top_m=self.top_m,
            resume_prefix=self._acknowledged_tokens(),
            stop_token_ids=tuple(sorted(self.slm.eos_token_ids)),  # the cloud stops where the edge would
            score_prompt=self.prompt_prefix is not None,
            **self.side.open_fields(),  # the cloud's seed, logprobs and schema: cloud-side only
        )

    def _acknowledged_tokens(self) -> tuple[int, ...]:
        """The tokens a resumed session opens with: those the cloud acknowledged, up to the first unacknowledged
        step (cloud-side run-ahead), whose upload is re-sent instead."""
        unacknowledged = self._unacknowledged()
        return tuple(self.tokens[: unacknowledged[0].step if unacknowledged else len(self.tokens)])

    def _unacknowledged(self) -> list[PendingSignal]:
        """The steps yielded whose picks the last session's cloud did not acknowledge, in order."""
        return self._previous.unacknowledged() if self._previous is not None else []

    # -- the loop ------------------------------------------------------------------------------------
    def steps(self, connection: CloudConnection) -> Iterator[StepEvent]:
        """Open (or resume) the session on ``connection`` and decode until the end.

        Per step: receive the cloud's row, decide the signal (once: a step
        whose signal was sent but never acknowledged sends exactly that signal
        again on the next connection, since a fresh draw would hand the cloud a
        second sample of the same step), send it, record what the cloud could
        read off it, advance.  A step whose full-row request got no reply asks
        again; every send of either is on the step's ledger entry.  Cloud-side
        run-ahead, steps yielded on picks read off certificates whose
        ``TokenChosen`` never came before a break are unacknowledged too: the
        next connection resumes before the first of them and re-sends them
        first (:meth:`_replay`), as lockstep resumed there would.
        """
        if self.view.row is None:
            self.pacer.begin(time.perf_counter())  # unless whoever built this decoder said earlier when it began
            # a defence: the SLM prefills the private prompt *before* the session opens, so the cloud's clock
            # starts after the only step whose duration grows with the private context's length (or drops when
            # a repeated prompt is served from the cache): step 0's timing tells it nothing of either
            self.view.prefill(self.slm_prompt + self.tokens)
            # a defence: with a prefill budget the open leaves on a grid that starts when the generation began,
            # so the gap since the previous session (on the same client) does not show the prefill's length
            self.ledger.prefill_overrun = self.pacer.wait_for_open()
        replay = self._unacknowledged()
        max_steps = self._open(connection, replay)
        self._previous = connection  # from here on, what this session's cloud acknowledged counts
        self._replay(connection, replay, max_steps)
        if self.finish_reason == "stop_rule":  # the rule had ended it: the replay re-sent its last steps
            self._finish(connection, self.tokens[-1])
            return
        yield from self._decode(connection, max_steps)

    def _decode(self, connection: CloudConnection, max_steps: int) -> Iterator[StepEvent]:
        """The steps from the first one not yet yielded to the end of the generation."""
        while len(self.tokens) < max_steps:
            step = len(self.tokens)
            step_meter = StepMeter(connection.bytes)
            dist = self._receive(connection, step, step_meter)
            with step_meter.on_edge():
                no_stop = not self.stop.allows_end(self.tokens)
                pending = self._pending_signal(step, max_steps, no_stop)
            try:
                with step_meter.on_edge():
                    dist, request_overrun = self._decide(connection, pending, dist, no_stop, step_meter)
                overrun = self.pacer.wait_for_slot()  # a defence: paced, the send time is the public schedule's
                token, finished = self._send(connection, pending, no_stop, max_steps, step_meter)
            except CloudError:
                pending.keep_bytes(step_meter)
                raise
            self._pending = None
            overrun = overrun or request_overrun
            logprobs = self._logprobs(connection, pending)  # after the send: reading them never delays a signal
            steered = self._record(pending, dist, token)
            finished = self._advance(token, finished, step_meter)
            entry = step_meter.entry(pending, token, policy=self.policy.name, steered=steered,
                                     leak_share=self.meter.share, pace_overrun=overrun)
            self.ledger.entries.append(entry)
            yield StepEvent(token, entry, logprobs)
            if finished:
                self._finish(connection, token)
                return
        self.finish_reason = "max_new_tokens"

    # -- the loop's steps, in its order --------------------------------------------------------------
    def _open(self, connection: CloudConnection, replay: list[PendingSignal]) -> int:
        """Open the session (``replay``: the steps it sends again first); the number of steps it may run (the
        edge's and the cloud's limit)."""
        info = connection.open(self.request(), max_upload=self.max_upload,
                               unacknowledged=[(pending.step, pending) for pending in replay])
        # the cloud's reply, after its own prefill (the SLM's came before); a defence: over a network a session that
        # runs ahead, or fuses cloud-side, is paced (auto_pace_ms), else its signals would leave one SLM step apart
        self.pacer.start(auto=connection.crosses_network and self.side.paced_over_network(connection))
        self.ledger.session_ids.append(info.session_id)
        self.ledger.cloud_model = info.cloud_model
        if info.vocab_size != self.slm.vocab_size:  # the fingerprint matched; the sizes must too
            raise CloudError(
                "FAILED_PRECONDITION",
                f"the cloud model {info.cloud_model!r} reports a vocabulary of {info.vocab_size} tokens, the edge "
                f"model {self.slm.name!r} has {self.slm.vocab_size}",
            )
        self.stop.open(info.eos_token_ids)
        if self.prompt_prefix is not None and self._prompt_rows is None:
            if len(info.prompt_rows) != len(self.cloud_prompt) - 1:
                raise CloudError("FAILED_PRECONDITION", f"the cloud sent {len(info.prompt_rows)} rows for the "
                                 f"{len(self.cloud_prompt) - 1} prompt positions asked: the adapter predates echo "
                                 "with logprobs (upgrade it)")
            self._prompt_rows = (info.prompt_rows, info.prompt_token_values)
        for processor in self.processors:  # the grammar ends where the session agreed, on both sides
            if isinstance(processor, JsonConstraint):
                processor.agree_end_ids(info.eos_token_ids)
        return min(self.settings.max_new_tokens, info.max_new_tokens)

    def _receive(self, connection: CloudConnection, step: int, step_meter: StepMeter) -> wire.CloudDistribution:
        """The cloud's row for ``step``."""
        with step_meter.waiting():
            dist = connection.distribution()
        if dist.step != step:
            raise CloudError("INTERNAL", f"the cloud sent step {dist.step}, expected {step}")
        step_meter.cloud_forward_ns = dist.forward_ns  # a full row sent on request carries no forward of its own
        return dist

    def _pending_signal(self, step: int, max_steps: int, no_stop: bool) -> PendingSignal:
        """``step``'s signal as begun on an earlier connection (it is re-sent byte for byte), or a new one that the
        exposure budget may withhold."""
        if self._pending is None or self._pending.step != step:
            self._pending = PendingSignal(step, withheld=self.budget.withholds(step, max_steps), no_stop=no_stop)
        return self._pending

    def _replay(self, connection: CloudConnection, replay: list[PendingSignal], max_steps: int) -> None:
        """Re-send the steps the cloud never acknowledged, each on its row, byte for byte, as lockstep re-sends its
        one unacknowledged step: their picks were read off certificates and the stream broke before the cloud's
        ``TokenChosen`` came, so the cloud may never have received their uploads.

        The session resumed before the first of them (:meth:`request`).  A
        step's decision is made, so no full row is asked for; the cloud's
        pick must be the token already yielded (else ``DATA_LOSS``).  None is
        yielded again and the SLM, already past them, is not touched; the
        sends and bytes go on the step's ledger entry.
        """
        for pending in replay:
            step_meter = StepMeter(connection.bytes)
            try:
                self._receive(connection, pending.step, step_meter)
                self.pacer.wait_for_slot()  # on a slot, as any send
                token, finished = self._send(connection, pending, pending.no_stop, max_steps, step_meter)
            finally:
                self._record_resend(pending, step_meter)
            yielded = self.tokens[pending.step]
            if token != yielded or finished:
                raise CloudError("DATA_LOSS", f"resumed, the cloud chose token {token} at step {pending.step}"
                                 f"{' and ended the generation' if finished else ''} where its row and the upload "
                                 f"had certified {yielded}, already yielded")

    def _record_resend(self, pending: PendingSignal, step_meter: StepMeter) -> None:
        """A yielded step sent again: its sends and this attempt's bytes go on its ledger entry."""
        entry = self.ledger.entries[pending.step]
        assert entry.step == pending.step, "one ledger entry per step, in order"
        self.ledger.entries[pending.step] = replace(entry, sends=pending.sends,
                                                    bytes_up=entry.bytes_up + step_meter.bytes_up,
                                                    bytes_down=entry.bytes_down + step_meter.bytes_down)

    def _decide(
        self, connection: CloudConnection, pending: PendingSignal, dist: wire.CloudDistribution, no_stop: bool,
        step_meter: StepMeter,
    ) -> tuple[wire.CloudDistribution, bool]:
        """Decide ``pending``'s signal unless it was already (a resend); the row it was decided on, and whether a
        paced full-row request missed its first slot.

        A policy that reads full rows asks for the full row at every step
        (:meth:`~edge_sdk.policies.base.Policy.needs_full_row`: the policy and
        the mode alone decide, never ``p_slm``).  Paced, the request leaves on
        a slot too (a defence: else it would leave one SLM step after the row
        arrived, on the private context's clock).
        """
        if pending.decision is not None:
            return dist, False
        decision = self._decision(dist, pending.withheld, no_stop)
        overrun = False
        if decision is None:
            pending.full_requests += 1
            with step_meter.pacing():
                overrun = self.pacer.wait_for_slot()
            with step_meter.waiting():
                dist = connection.request_full(pending.step)
            decision = self._decision(dist, pending.withheld, no_stop)
            if decision is None:
                raise CloudError("DATA_LOSS", f"the cloud answered step {pending.step}'s full-row request with a "
                                 "sparse row")
        pending.decision = decision
        if not pending.withheld:
            self.budget.record_release(pending.step, decision.signal, dist)
        return dist, overrun

    def _send(
        self, connection: CloudConnection, pending: PendingSignal, no_stop: bool, max_steps: int, step_meter: StepMeter
    ) -> tuple[int, bool]:
        """Send the step's signal (the same bytes on every attempt): the token, and whether the generation ended
        (:meth:`~edge_sdk.sides.FusionSide.send`: cloud-side the edge waits for the pick unless it is certified)."""
        pending.sends += 1
        return self.side.send(connection, pending, no_stop, max_steps, step_meter)

    def _logprobs(self, connection: CloudConnection, pending: PendingSignal) -> TokenLogprobs | None:
        """The chosen token's log-probabilities when asked for: edge-side read off the decision's fused row,
        cloud-side as the cloud sent them with its pick."""
        assert pending.decision is not None
        return self.side.logprobs(connection, pending.decision)

    def _record(self, pending: PendingSignal, dist: wire.CloudDistribution, token: int) -> bool:
        """What the cloud can read off the acknowledged step, on the leakage meter (reported, never decides
        anything); whether it counts as steered."""
        assert pending.decision is not None
        self.side.observe(self.meter, pending.decision, token)
        return self.budget.count_steered(pending.decision.signal, dist)

    def _advance(self, token: int, finished: bool, step_meter: StepMeter) -> bool:
        """Append ``token`` wherever the generation is followed; whether the generation has ended."""
        self.tokens.append(token)
        for processor in self.processors:
            self.side.consume(processor, token)
        if self.stop.is_done(self.tokens) and not finished:  # the rule ends it here: the edge closes the session
            finished, self.finish_reason = True, "stop_rule"
        if not finished:
            with step_meter.on_edge():
                # a defence: the SLM's next step runs after the send, so when the signal left does not include
                # it (its cost grows with the private context); it runs while the cloud computes its own
                self.view.advance(token)
        return finished

    def _finish(self, connection: CloudConnection, token: int) -> None:
        if self.finish_reason == "stop_rule":
            # cloud-side run-ahead: the picks taken from certificates are checked before the generation ends (a
            # break here resumes, re-sends them and ends); the session is then closed by whoever owns the
            # connection (run_with_resume does)
            connection.confirm_picks()
            return
        try:
            self.finish_reason = connection.finished()
        except CloudError:  # the stream broke after the last token: the generation itself is complete
            self.finish_reason = "eos" if token in self.stop.ids else "max_new_tokens"

    def prompt_logprobs(self, top_n: int) -> list[TokenLogprobs]:
        """Echo with logprobs: each public prompt token's log-probability after the first (the cloud prompt's
        BOS), with the ``top_n`` best ids', under the fused row of its position, read as generation's edge-side
        logprobs are (:mod:`edge_sdk.logprobs`): ``log(f_i / sum f)``, ``f = alpha * p_llm + (1 - alpha) * p_slm``,
        ``p_llm`` the cloud's row sent with the opening (at its public fill, exact at the prompt's token) and
        ``p_slm`` the SLM's row after :attr:`prompt_prefix` and the public tokens before it (``never_upload`` ids
        masked).  Nothing is sent: call it once the generation's last session closed (it runs the SLM over the
        public prompt, a step per token, so no signal of this generation waits on it), through
        :meth:`EdgeClient.score_prompt <edge_sdk.client.EdgeClient.score_prompt>`, which keeps its time off the
        cloud's clock.
        """
        if self._prompt_rows is None or self.prompt_prefix is None or not self.pacer.ended:
            raise ValueError("the prompt is scored once a session opened with prompt_prefix has closed")
        rows, token_values = self._prompt_rows
        vocab_size, space, alpha = self.slm.vocab_size, self.policy.space, self.settings.alpha
        scored = []
        for position, (row, value) in enumerate(zip(rows, token_values)):
            token = self.cloud_prompt[position + 1]
            if position == 0:
                self.view.prefill(self.prompt_prefix)
            else:
                self.view.advance(self.cloud_prompt[position])
            assert self.view.row is not None
            p_llm = row.filled(vocab_size, space, out=self._p_llm_buffer)
            p_llm[token] = value
            scored.append(token_logprobs(fuse(p_llm, self.view.row, alpha), space, token, top_n))
        return scored

    # -- the decide step -----------------------------------------------------------------------------
    def _decision(self, dist: wire.CloudDistribution, withheld: bool, no_stop: bool) -> StepDecision | None:
        """The step's decision from the SLM's row and ``dist``, or ``None`` when the policy reads the full row and
        ``dist`` is sparse.

        A sparse row is read with every omitted id at its public fill
        (:meth:`~edge_sdk.protocol.wire.CloudDistribution.filled`).  ``no_stop``
        (edge-side): end-of-generation ids are out of the choice this step;
        cloud-side the cloud is told instead.  The processors' ``allowed()``
        ids mask both rows the policy fuses (edge-side: cloud-side the cloud masks).
        """
        stops = self.side.excluded_stops(no_stop)
        allowed = self.side.allowed()
        if withheld:
            signal, fused = self._cloud_only_signal(dist, stops, allowed)
        elif not dist.is_full and self.policy.needs_full_row(self.side.mode):
            return None
        else:
            signal, fused = self._policy_signal(dist, stops, allowed)
        # edge-side with logprobs asked for: read under fused(), the masked row the token was chosen from
        return StepDecision(signal, exposure=wire.step_exposure(signal, dist, self.settings.exposure_k),
                            logprobs=self.side.logprob_reader(signal, fused))

    def _restrict(self, row: np.ndarray, stops: np.ndarray | None, allowed: np.ndarray | None) -> np.ndarray:
        """``row`` without the ids this step excludes: the stop ids at the space's lowest value, and under processors
        every id they do not allow (:func:`~edge_sdk.grammar.mask_row`).  ``row`` itself is never written."""
        lowest = self.view.lowest
        if stops is not None:
            row = row.copy()
            row[stops] = lowest
        return mask_row(row, allowed, lowest=lowest) if allowed is not None else row

    def _cloud_only_signal(
        self, dist: wire.CloudDistribution, stops: np.ndarray | None, allowed: np.ndarray | None
    ) -> tuple[Observation, Callable[[], np.ndarray]]:
        """The budget is spent: a signal the cloud could have produced on its own (nothing uploaded, or the
        cloud's own top token: its best one the stop rule and the processors allow,
        :meth:`~edge_sdk.sides.FusionSide.cloud_only_signal`); and the row it was chosen from (the cloud's, at its
        public fill, masked)."""
        vocab_size = self.slm.vocab_size

        def cloud_row() -> np.ndarray:
            return self._restrict(dist.filled(vocab_size, self.policy.space), stops, allowed)

        def excluded(token: int) -> bool:
            return (stops is not None and token in self.stop.ids) or (allowed is not None and not allowed[token])

        def cloud_sent_row() -> np.ndarray:  # omitted ids at the lowest value
            row = dist.lower_dense(vocab_size, out=self._p_llm_buffer, fill=self.view.lowest)
            return self._restrict(row, stops, allowed)

        return self.side.cloud_only_signal(dist, excluded, cloud_sent_row), cloud_row

    def _policy_signal(
        self, dist: wire.CloudDistribution, stops: np.ndarray | None, allowed: np.ndarray | None
    ) -> tuple[Observation, Callable[[], np.ndarray]]:
        """The policy's signal from the SLM's view and the cloud's row, both restricted to the ids allowed, as it
        leaves (:meth:`~edge_sdk.sides.FusionSide.checked`: a whole-vocabulary upload cut to ``FULL_UPLOAD_LIMIT``,
        a token checked against the processors); and the fused row ``alpha * p_llm + (1 - alpha) * p_slm`` of
        those two (edge-side, the row a token was chosen from)."""
        assert self.view.row is not None, "the SLM prefills before the first step"
        p_slm = self._restrict(self.view.row, stops, allowed)
        p_llm = self._restrict(dist.filled(self.slm.vocab_size, self.policy.space, out=self._p_llm_buffer), stops,
                               allowed)
        signal = self.side.checked(self.policy.decide(self.side.mode, p_slm, p_llm, alpha=self.settings.alpha,
                                                      rng=self.rng), allowed)
        alpha = self.settings.alpha
        return signal, lambda: fuse(p_llm, p_slm, alpha)


def run_with_resume(
    decoder: CollaborativeDecoder,
    connect: Callable[[], CloudConnection],
    *,
    max_reconnects: int = 3,
    backoff_s: float = 0.5,
) -> Iterator[StepEvent]:
    """Drive ``decoder`` over connections from ``connect``, reopening after a retryable failure.

    A reopened session replays only public data: the public prompt and the
    tokens the cloud acknowledged, then the signals of the steps it did not
    acknowledge, byte for byte.  After ``max_reconnects`` failed attempts the last
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
