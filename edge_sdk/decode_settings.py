"""Every decode default, written once: :class:`DecodeSettings`.

The fusion weight ``alpha``, ``max_new_tokens``, the cloud's ``top_m``, DecodeLeak's ``K``
(``exposure_k``) and the rest have their default here and nowhere else: the wire's
:class:`~edge_sdk.protocol.wire.SessionRequest`, :meth:`EdgeClient.generate <edge_sdk.client.EdgeClient.generate>`,
the endpoint, the harness's protocol and sweeps, and every CLI read them from this class (as
transformers' ``GenerationConfig`` is the one home of its generation defaults).  A call overrides a
copy (:meth:`DecodeSettings.overridden`); a name that is not a setting is refused.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.cli_flags import non_negative_int, positive_float, positive_float_or_auto, positive_int
from edge_sdk.logprobs import MAX_TOP_LOGPROBS
from edge_sdk.protocol.signals import FUSION_MODES, FusionMode

#: ``pace_ms`` / ``auto_pace_ms``: the client measures the pace on public work (:mod:`edge_sdk.pace_calibration`)
AUTO = "auto"


def _setting(default: Any, help: str, **flag: Any) -> Any:
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class DecodeSettings:
    """Per-generation settings shared by both ends (all public).

    Each field's ``metadata`` holds its description (``help``) and how a command line reads it (``type``,
    ``metavar``): a CLI builds the flag from the field (:func:`edge_sdk.cli_flags.add_dataclass_flags`).
    """

    mode: FusionMode = _setting("cloud", "fusion mode: 'cloud' (the cloud fuses and picks) or 'edge'")
    #: the cloud LLM's weight in the fusion ``p = alpha * p_llm + (1 - alpha) * p_slm`` (the paper's 0.3)
    alpha: float = _setting(0.3, "the cloud LLM's fusion weight", type=float)
    max_new_tokens: int = _setting(256, "tokens per answer (default: {default}, the paper's)", type=positive_int, metavar="N")
    #: the cloud's values per sparse step (its top ``top_m``) unless a session asks for more
    top_m: int = _setting(256, "the cloud's values per step (its top top_m) unless the edge needs more",
                          type=positive_int, metavar="M")
    temperature: float = _setting(0.0, "cloud-side sampling temperature when the cloud picks (0: greedy)",
                                    type=float)
    #: the cloud's sampling seed (cloud-side fusion only); the edge never uses it
    seed: int = _setting(0, "the cloud's sampling seed (cloud-side fusion only)", type=int)
    #: DecodeLeak's K: the size of each step's exposure set E_t^K the meter, the ledger and transcripts record
    exposure_k: int = _setting(100, "K of the per-step exposure set E_t^K", type=positive_int, metavar="K")
    #: the largest share of the generation's steps (of max_new_tokens) whose signal the private context may
    #: steer (a non-empty upload, a token other than the cloud's own top); after that only signals the cloud could
    #: produce alone are sent.  The cloud can count those steps itself: the switch tells it nothing new.
    exposure_budget: float | None = _setting(None, "share of steps the private context may steer (0..1)",
                                            type=float)
    #: a privacy budget for the DP policies: before one more release would spend more than max_epsilon (at
    #: epsilon_delta; None: the policy's own delta) only cloud-only signals are sent, as for exposure_budget
    max_epsilon: float | None = _setting(None, "privacy budget of the DP policies (epsilon)",
                                        type=positive_float)
    epsilon_delta: float | None = _setting(None, "the delta max_epsilon is stated at (default: the policy's)",
                                          type=float)
    #: pacing: step t's signal leaves at the first point of the grid ``S + n * pace_ms`` (n >= 1; ``S`` the
    #: previous signal's slot, or when the cloud's answer to the open arrived; cloud-side, when a pick the edge waited
    #: for arrived, if later) at or after it is ready, so its send time depends on the public schedule and the
    #: cloud's own timing, not on how long the SLM took (which grows with the private context).  ``None``: each
    #: signal leaves as soon as it is decided, but where ``auto_pace_ms`` applies.  ``"auto"``: the pace
    #: :func:`~edge_sdk.pace_calibration.calibrated_pace_ms` measures once per client on a public prompt
    #: (:meth:`EdgeClient.calibrated_pace_ms <edge_sdk.client.EdgeClient.calibrated_pace_ms>`).
    pace_ms: float | str | None = _setting(None, "send each step's signal on a fixed grid of this many ms ('auto': "
                                           "measured once on a public prompt)", type=positive_float_or_auto,
                                           metavar="MS")
    #: the public clock of the sessions whose signals would otherwise leave one SLM step apart: with ``pace_ms``
    #: unset, a session over a network that runs ahead (the next row is on the device before the SLM is done) or
    #: fuses cloud-side (the SLM's step begins when the cloud's pick arrives) sends on the grid of ``pace_ms`` at
    #: this pace (an in-process cloud, as the harness runs, is not paced: nothing else times it).
    #: The gap between two signals is then the pace whenever the step fits in it, a whole number of paces otherwise
    #: (``pace_overrun``); the SLM's step grows with the private context.  Edge-side lockstep is not paced by it
    #: (its SLM step runs while the cloud's row is on its way: hidden behind a round trip and a forward, not
    #: shorter ones).  ``None``: off; ``"auto"``: as for ``pace_ms``.
    auto_pace_ms: float | str | None = _setting(50.0, "with no pace_ms, send each run-ahead or cloud-side signal "
                                                "on a grid of this many ms (default: {default}; 'auto': measured "
                                                "once on a public prompt)", type=positive_float_or_auto,
                                                metavar="MS")
    #: the session opens at the first point of ``B + n * prefill_budget_ms`` (n >= 1; ``B`` when the generation
    #: began on the device, before its private text was tokenised) at or after the SLM's prefill is done, so when
    #: it opens (after the previous session on the same client, say) does not show how long the private context
    #: is.  Set it above the longest prefill: one that runs past it opens at a later point, which shows how many
    #: budgets it took (``ledger.prefill_overrun``).  Work after the last session closed (scoring an echoed prompt)
    #: returns on the same grid from the close.  ``None``: the session opens as soon as the SLM has prefilled.
    prefill_budget_ms: float | None = _setting(None, "open each session on a grid of this many ms from when the "
                                               "generation began, whatever the prefill took", type=positive_float,
                                               metavar="MS")
    #: log-probabilities of each chosen token and of the ``logprobs`` best ids of the fused row it was chosen from
    #: (edge_sdk.logprobs; 0: the token's alone); cloud-side the cloud sends them, so the session asks for them
    logprobs: int | None = _setting(None, "log-probabilities of each token and of this many best alternatives "
                                    "(0-20) under the fused row it was chosen from", type=int, metavar="N")
    #: run-ahead: the deepest this generation accepts (rows the cloud drafts past the last confirmed token, so a
    #: token does not wait a round trip; the cloud adapts the depth to the link, up to its own cap); 0: lockstep.
    #: What the edge sends is the same either way.  ``None``: the client's default (``EdgeClient(lookahead=)``:
    #: ``wire.MAX_LOOKAHEAD`` to a remote adapter, 0 in process); a value here wins over it.
    lookahead: int | None = _setting(None, "deepest run-ahead accepted: rows the cloud drafts past the last confirmed "
                                     "token (0: lockstep; default: the client's)", type=non_negative_int,
                                     metavar="N")

    def __post_init__(self) -> None:
        if self.mode not in FUSION_MODES:
            raise ValueError(f"fusion mode must be one of {FUSION_MODES}, got {self.mode!r}")
        for name in ("max_new_tokens", "top_m", "exposure_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, what in (("pace_ms", "no pacing"), ("auto_pace_ms", "none")):
            value = getattr(self, name)
            if value is not None and value != AUTO and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be positive, 'auto' (or None for {what}), got {value!r}")
        if self.prefill_budget_ms is not None and not self.prefill_budget_ms > 0:
            raise ValueError(f"prefill_budget_ms must be positive (or None for none), got {self.prefill_budget_ms}")
        if self.exposure_budget is not None and not 0.0 <= self.exposure_budget <= 1.0:
            raise ValueError(f"exposure_budget must lie in [0, 1], got {self.exposure_budget}")
        if self.lookahead is not None and (isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int)
                                           or self.lookahead < 0):
            raise ValueError(f"lookahead must be an integer of 0 (lockstep) or more (or None for the client's "
                             f"default), got {self.lookahead!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must lie in 0..{MAX_TOP_LOGPROBS} (or None for none), got {self.logprobs}")

    def overridden(self, **overrides: Any) -> DecodeSettings:
        """A copy with ``overrides`` applied; a name that is not a field is a ``TypeError`` naming it and the
        fields there are (as an unexpected keyword argument is)."""
        known = [spec.name for spec in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TypeError(f"unknown decode setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                            f"(DecodeSettings has: {', '.join(known)})")
        return dataclasses.replace(self, **overrides) if overrides else self
