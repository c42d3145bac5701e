"""What differs between the two fusion modes, one class per side, so the loop (:mod:`edge_sdk.decoding`) reads
receive → decide → send → record → advance without testing the mode.

* :class:`CloudSide` (``mode="cloud"``): the signal is an upload of some of the SLM's values; the cloud fuses
  ``p = alpha * p_llm + (1 - alpha) * p_slm`` and picks, so the edge waits for the pick (or, running ahead, reads
  it off the certificate the cloud's row and the upload give), takes the pick's log-probabilities from the cloud,
  tells the cloud when it may not end, and checks each pick against its own copy of a JSON schema's grammar.
* :class:`EdgeSide` (``mode="edge"``): the signal is the token the edge picks from the fused row; the edge masks
  where it picks (stop ids, processors), computes log-probabilities itself, and the token it sends is on the
  meter as soon as it leaves.

Each side is built once per generation from the decoder's parts (:func:`fusion_side`).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edge_sdk.grammar import JsonConstraint
from edge_sdk.logprobs import TokenLogprobs, token_logprobs
from edge_sdk.privacy.masking import FULL_UPLOAD_LIMIT
from edge_sdk.protocol.signals import CloudUpload, SyncedToken
from edge_sdk.protocol.status import CloudReplyRejected

if TYPE_CHECKING:
    from edge_sdk.decode_settings import DecodeSettings
    from edge_sdk.fusion import FusionSpace
    from edge_sdk.privacy.meter import LeakageMeter
    from edge_sdk.protocol import wire
    from edge_sdk.protocol.connection import CloudConnection
    from edge_sdk.protocol.signals import FusionMode, Observation
    from edge_sdk.steps import ChoiceProcessor, Pacer, PendingSignal, StepDecision, StepMeter, StopControl

#: a row with the ids a step excludes lowered, built only when read
LazyRow = Callable[[], np.ndarray]


class FusionSide(ABC):
    """Where the step's token is picked, and everything the loop does differently because of it.

    Args:
        settings: the generation's :class:`~edge_sdk.decode_settings.DecodeSettings`.
        policy_name: the policy's name (for errors); ``space`` its array space.
        processors: the decide step's hooks (a JSON schema's grammar).
        stop: the generation's end ids and stopping rule.
        pacer: the public schedule signals leave on.
        vocab_size: the SLM's vocabulary.
        masks_ids: whether ``never_upload`` removed any id from the SLM's row (:class:`~edge_sdk.steps.SLMView`).
    """

    mode: ClassVar[FusionMode]
    #: whether the public prompt's positions can be scored after the generation (echo with logprobs,
    #: :meth:`~edge_sdk.decoding.CollaborativeDecoder.prompt_logprobs`): only where the edge fuses
    scores_prompt: ClassVar[bool]

    def __init__(self, settings: DecodeSettings, *, policy_name: str, space: FusionSpace,
                 processors: Sequence[ChoiceProcessor], stop: StopControl, pacer: Pacer, vocab_size: int,
                 masks_ids: bool) -> None:
        self.settings = settings
        self.policy_name, self.space = policy_name, space
        self.processors = tuple(processors)
        self.stop, self.pacer = stop, pacer
        self.vocab_size, self.masks_ids = vocab_size, masks_ids

    # -- the open --------------------------------------------------------------------------------------
    @abstractmethod
    def top_m(self) -> int:
        """How many cloud values to ask for per sparse step."""

    @abstractmethod
    def open_fields(self) -> dict[str, Any]:
        """The open's fields that depend on the side: the cloud's sampling ``seed``, whether it sends
        ``logprobs`` (and ``top_logprobs``) with its picks, the ``json_schema`` it masks its pick with."""

    @abstractmethod
    def paced_over_network(self, connection: CloudConnection) -> bool:
        """Whether a session over a network is paced at ``auto_pace_ms`` (unless ``pace_ms`` is set): whenever
        its signals would otherwise leave one SLM step apart."""

    # -- decide ----------------------------------------------------------------------------------------
    @abstractmethod
    def excluded_stops(self, no_stop: bool) -> np.ndarray | None:
        """The end ids the edge lowers before it decides (``None``: none)."""

    @abstractmethod
    def allowed(self) -> np.ndarray | None:
        """The ids every processor allows this step, where the edge masks (``None``: no mask)."""

    @abstractmethod
    def cloud_only_signal(self, dist: wire.CloudDistribution, excluded: Callable[[int], bool],
                          cloud_row: LazyRow) -> Observation:
        """A signal the cloud could have produced on its own (the budget is spent); ``excluded(id)``: whether the
        step excludes the id, ``cloud_row()`` the cloud's row with the excluded ids at the space's lowest value."""

    @abstractmethod
    def checked(self, signal: Observation, allowed: np.ndarray | None) -> Observation:
        """The policy's signal as it leaves (refused when it is not this side's kind)."""

    @abstractmethod
    def logprob_reader(self, signal: Observation, fused: LazyRow) -> Callable[[], TokenLogprobs] | None:
        """How the edge reads the token's log-probabilities off ``fused()``, when it computes them."""

    # -- send ------------------------------------------------------------------------------------------
    @abstractmethod
    def send(self, connection: CloudConnection, pending: PendingSignal, no_stop: bool, max_steps: int,
             step_meter: StepMeter) -> tuple[int, bool]:
        """Send ``pending``'s signal (the same bytes on every attempt): the step's token, and whether the
        generation ended."""

    # -- record ----------------------------------------------------------------------------------------
    @abstractmethod
    def logprobs(self, connection: CloudConnection, decision: StepDecision) -> TokenLogprobs | None:
        """The chosen token's log-probabilities when asked for (read after the send)."""

    @abstractmethod
    def observe(self, meter: LeakageMeter, decision: StepDecision, token: int) -> None:
        """Put what the cloud can read off the acknowledged step on the leakage meter."""

    # -- advance ---------------------------------------------------------------------------------------
    @abstractmethod
    def consume(self, processor: ChoiceProcessor, token: int) -> None:
        """Move ``processor`` past ``token``; a token it refuses is an error of whoever picked it."""

    def _wrong_kind(self, signal: Observation) -> TypeError:
        return TypeError(f"policy {self.policy_name!r} gave a {type(signal).__name__} in {self.mode}-side fusion")


class CloudSide(FusionSide):
    """Cloud-side fusion: the edge uploads, the cloud fuses and picks (module docstring)."""

    mode = "cloud"
    scores_prompt = False  # the fused row is the cloud's, made from an upload at every prompt position

    def __init__(self, settings: DecodeSettings, **parts: Any) -> None:
        super().__init__(settings, **parts)
        if len(self.processors) > 1 or any(not isinstance(p, JsonConstraint) for p in self.processors):
            raise ValueError("cloud-side the cloud picks the token: only one JSON schema (sent with the session) "
                             "can constrain it")

    def top_m(self) -> int:
        return min(self.settings.top_m, self.vocab_size)

    def open_fields(self) -> dict[str, Any]:
        s = self.settings
        return {"seed": s.seed, "logprobs": s.logprobs is not None, "top_logprobs": s.logprobs or 0,
                "json_schema": self._schema()}

    def _schema(self) -> str:
        """The JSON schema the cloud masks its pick with (public); ``""`` for none."""
        if not self.processors:
            return ""
        constraint = self.processors[0]
        assert isinstance(constraint, JsonConstraint)
        # in the app's key order: the grammar writes an object's properties in its schema's order, so sorted keys
        # would have the cloud write {"arguments", "name"} where the edge's grammar expects {"name", "arguments"}
        return json.dumps(constraint.schema, separators=(",", ":"))

    def paced_over_network(self, connection: CloudConnection) -> bool:
        return True  # the SLM's step begins when the cloud's pick arrives

    def excluded_stops(self, no_stop: bool) -> None:
        return None  # the cloud is told instead (no_stop)

    def allowed(self) -> None:
        return None  # the cloud masks where it picks

    def cloud_only_signal(self, dist: wire.CloudDistribution, excluded: Callable[[int], bool],
                          cloud_row: LazyRow) -> CloudUpload:
        return CloudUpload.empty(self.space)  # nothing uploaded

    def checked(self, signal: Observation, allowed: np.ndarray | None) -> CloudUpload:
        if not isinstance(signal, CloudUpload):
            raise self._wrong_kind(signal)
        if len(signal) >= self.vocab_size and (self.space == "prob" or self.masks_ids):
            # every id listed: masked ones (at the floor) would stand out.  Probability space cuts whether or
            # not a mask is active (else the cut says one is); logit space only under a mask, since the cloud
            # counts an id left out as a logit of 0, which would change the release's fusion of every row
            return signal.largest(FULL_UPLOAD_LIMIT)
        return signal

    def logprob_reader(self, signal: Observation, fused: LazyRow) -> None:
        return None  # the cloud sends them with its pick

    def send(self, connection: CloudConnection, pending: PendingSignal, no_stop: bool, max_steps: int,
             step_meter: StepMeter) -> tuple[int, bool]:
        assert pending.decision is not None and isinstance(pending.decision.signal, CloudUpload)
        certified = connection.picks_certified
        with step_meter.waiting():  # the cloud answers with its pick
            picked = connection.upload(pending.step, pending.decision.signal, no_stop=no_stop, keep=pending)
        if connection.picks_certified == certified:  # waited for the pick: the next slot counts from its arrival
            self.pacer.restart(time.perf_counter())
        return picked

    def logprobs(self, connection: CloudConnection, decision: StepDecision) -> TokenLogprobs | None:
        return connection.chosen_logprobs

    def observe(self, meter: LeakageMeter, decision: StepDecision, token: int) -> None:
        meter.observe(decision.exposure)  # the upload's; the cloud picked the token itself

    def consume(self, processor: ChoiceProcessor, token: int) -> None:
        try:
            processor.consume(token)
        except ValueError:
            raise CloudReplyRejected(f"the cloud chose token {token}, outside the JSON schema's grammar "
                                     "(the edge's check)") from None


class EdgeSide(FusionSide):
    """Edge-side fusion: the cloud sends its row, the edge fuses, picks and sends the token (module docstring)."""

    mode = "edge"
    scores_prompt = True

    def top_m(self) -> int:
        """Every value under a processor (a masked row needs them all: public, the processors decide); else at
        least ``K``, since the exposure set ``E_t^K`` is the cloud's own top ``K`` (the ledger then records ``K``
        ids per step whatever ``settings.top_m`` says)."""
        if self.processors:
            return self.vocab_size
        return min(max(self.settings.top_m, self.settings.exposure_k), self.vocab_size)

    def open_fields(self) -> dict[str, Any]:
        # the cloud samples nothing and sends no logprobs: the edge picks, and computes or applies them itself
        return {"seed": 0, "logprobs": False, "top_logprobs": 0, "json_schema": ""}

    def paced_over_network(self, connection: CloudConnection) -> bool:
        # lockstep's SLM step runs while the cloud's row is on its way; running ahead the row is already here
        return connection.run_ahead

    def excluded_stops(self, no_stop: bool) -> np.ndarray | None:
        return self.stop.id_array if no_stop else None

    def allowed(self) -> np.ndarray | None:
        if not self.processors:
            return None
        return np.logical_and.reduce([processor.allowed() for processor in self.processors])

    def cloud_only_signal(self, dist: wire.CloudDistribution, excluded: Callable[[int], bool],
                          cloud_row: LazyRow) -> SyncedToken:
        """The cloud's own top token, its best one the step does not exclude (only an id the cloud sent can be
        its own top: ``cloud_row`` holds omitted ids at the lowest value)."""
        token = dist.top_id()
        if excluded(token):
            token = int(np.argmax(cloud_row()))
        return SyncedToken(token)

    def checked(self, signal: Observation, allowed: np.ndarray | None) -> SyncedToken:
        if not isinstance(signal, SyncedToken):
            raise self._wrong_kind(signal)
        if allowed is not None and not allowed[signal.token_id]:
            raise ValueError(f"policy {self.policy_name!r} chose a token its processors do not allow (a JSON "
                             "schema's grammar)")
        return signal

    def logprob_reader(self, signal: Observation, fused: LazyRow) -> Callable[[], TokenLogprobs] | None:
        if self.settings.logprobs is None:
            return None
        assert isinstance(signal, SyncedToken)
        top_n, space, token = self.settings.logprobs, self.space, signal.token_id
        return lambda: token_logprobs(fused(), space, token, top_n)

    def send(self, connection: CloudConnection, pending: PendingSignal, no_stop: bool, max_steps: int,
             step_meter: StepMeter) -> tuple[int, bool]:
        assert pending.decision is not None and isinstance(pending.decision.signal, SyncedToken)
        token = pending.decision.signal.token_id
        connection.sync_token(pending.step, token)  # the cloud's answer is the next step's row
        return token, token in self.stop.ids or pending.step + 1 >= max_steps

    def logprobs(self, connection: CloudConnection, decision: StepDecision) -> TokenLogprobs | None:
        return decision.logprobs() if decision.logprobs is not None else None

    def observe(self, meter: LeakageMeter, decision: StepDecision, token: int) -> None:
        meter.observe(decision.exposure)
        meter.observe([token])  # the token itself is what left

    def consume(self, processor: ChoiceProcessor, token: int) -> None:
        processor.consume(token)  # the edge picked it: a refusal is the edge's own error


#: the side of each fusion mode
SIDES: dict[str, type[FusionSide]] = {side.mode: side for side in (CloudSide, EdgeSide)}


def fusion_side(settings: DecodeSettings, **parts: Any) -> FusionSide:
    """The side of ``settings.mode``, built from the decoder's parts (:class:`FusionSide`'s arguments)."""
    return SIDES[settings.mode](settings, **parts)
