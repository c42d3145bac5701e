"""What a generation spent: a stateful privacy accountant over the pure calibrations.

:mod:`edge_sdk.privacy.analysis` holds the math (calibrations and
conversions, no state); this module keeps the account of one generation, as
Opacus's accountants sit over its ``analysis/`` and Google's ``dp-accounting``
composes ``DpEvent``\\ s.  A policy states what one releasing step costs
(:meth:`~edge_sdk.policies.base.Policy.release_event`, a :class:`ReleaseEvent`);
the decoding loop records one event per step that released something the
mechanism protects and nothing for a step that released nothing private (a
step withheld by a budget, or a heuristic's step that sent only what the cloud
could produce alone).  :meth:`PrivacyAccountant.epsilon` composes the events:

* ``gaussian`` (DP-Logit): the exact composition of Gaussian mechanisms
  (:func:`~edge_sdk.privacy.analysis.gaussian_composition_epsilon`);
* ``zcdp`` (InvisibleInk): dp-accounting's RDP accountant;
* ``pure_dp`` (LDP-Sampler): dp-accounting's PLD accountant over binary
  randomised response, which dominates every pure ``eps``-DP mechanism
  (at ``delta = 0``: ``n * eps``, exact);
* ``renyi`` (DP-Fusion, edge-side): a bound known at one Renyi order only,
  which no dp-accounting event expresses: composed here by hand, converted by
  the improved conversion (:func:`~edge_sdk.privacy.analysis.rdp_epsilon`);
* ``non_private`` (the heuristics): ``eps = inf`` from the first release.

``dp-accounting`` is imported only when a ``zcdp`` or a ``pure_dp`` event is
composed at a ``delta > 0``, so ``import edge_sdk``, the heuristics, DP-Logit
and DP-Fusion stay numpy-only.

Every event's epsilon is for the relation :data:`RELATION`, "any two private
contexts": each bound holds whatever the SLM's distribution is, so the one
record a neighbour replaces is the whole private context.  Where a source
states its epsilon for a weaker relation (a context against none, the public
row), the event carries that figure too (``source_value``), composed the same
way and shown second, labelled :data:`SOURCE_RELATION`, never in place of the
first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from edge_sdk.privacy.analysis import (
    check_delta,
    check_order,
    gaussian_composition_epsilon,
    randomized_response_noise,
    renyi_composition_epsilon,
    zcdp_optimal_order,
)

ReleaseKind = Literal["gaussian", "zcdp", "pure_dp", "renyi", "non_private"]
RELEASE_KINDS: tuple[str, ...] = ("gaussian", "zcdp", "pure_dp", "renyi", "non_private")

#: which accountant composes each kind (the summary's ``accountant``)
ACCOUNTANTS: dict[str, str] = {
    "gaussian": "Gaussian composition (exact)",
    "zcdp": "rdp (dp-accounting)",
    "pure_dp": "pld (dp-accounting)",
    "renyi": "renyi at one order, improved conversion (hand)",
    "non_private": "none",
}

#: the neighbouring relation every ``epsilon_spent`` is stated for
RELATION = "any two private contexts"
#: the weaker relation of a source's own figure (``ReleaseEvent.source_value``)
SOURCE_RELATION = "one private context against none (the public row only): the source's relation, weaker"


def odds_factor(epsilon: float) -> str:
    """``e^eps`` for people: two significant figures (``1.1`` at 0.1, ``22,000`` at 10), more below 1.1 so it
    never reads 1 (``1.01`` at 0.01), powers of ten past a billion."""
    if math.isinf(epsilon):
        return "unboundedly many"
    odds = math.exp(epsilon) if epsilon < 700 else math.inf
    if epsilon == 0:
        return "1"
    if math.isinf(odds) or odds >= 1e9:
        exponent = epsilon / math.log(10.0)
        return f"{10 ** (exponent - math.floor(exponent)):.2g} × 10^{math.floor(exponent)}"
    digits = 2 if odds >= 1.1 else 1 - math.floor(math.log10(math.expm1(epsilon)))
    rounded = float(f"{odds:.{digits}g}")
    return f"{rounded:,.0f}" if rounded >= 100 else f"{rounded:g}"


def odds_sentence(epsilon: float, delta: float) -> str:
    """What ``epsilon`` means to the person it protects, in one sentence."""
    chance = f", except with probability {delta:g}" if delta > 0 else ""
    return (f"whoever sees what left the device is at most {odds_factor(epsilon)} times more likely to tell your "
            f"context from any other{chance} (e^epsilon, epsilon {epsilon:.3g})")


@dataclass(frozen=True)
class ReleaseEvent:
    """The privacy cost of one releasing step, in the form the policy's source composes it.

    * ``gaussian``: the Gaussian mechanism, ``value`` its noise multiplier
      ``sigma / Delta`` (noise scale over the L2 distance of any two inputs);
    * ``zcdp``: ``value``-zCDP, i.e. ``(a, a * value)``-Renyi-DP at every order
      ``a``; ``horizon`` the generation length the calibration spread its budget
      over (the accountant also converts at the order that calibration used);
    * ``pure_dp``: pure ``value``-DP;
    * ``renyi``: ``(order, value)``-Renyi-DP at the one ``order`` only;
    * ``non_private``: no DP guarantee (``value`` is infinite).

    ``value`` is for :data:`RELATION` (any two private contexts); ``source_value``, when the source states a
    smaller figure for its own weaker relation (:data:`SOURCE_RELATION`), is that same parameter there.
    ``delta`` is the delta the source states its epsilon at (0 for pure DP),
    the default the ledger states the spent epsilon at.  ``note`` says what the
    epsilon protects, or why there is none.
    """

    kind: ReleaseKind
    value: float = math.inf
    delta: float = 0.0
    order: float | None = None
    horizon: int | None = None
    note: str = ""
    source_value: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in RELEASE_KINDS:
            raise ValueError(f"release kind must be one of {RELEASE_KINDS}, got {self.kind!r}")
        if self.kind == "non_private":
            if self.value != math.inf:
                raise ValueError(f"a non-private release has an infinite epsilon, got {self.value}")
            return
        if not (self.value >= 0 and math.isfinite(self.value)):
            raise ValueError(f"a {self.kind} release needs a finite parameter >= 0, got {self.value}")
        if self.kind == "gaussian" and not self.value > 0:
            raise ValueError(f"a Gaussian release needs a noise multiplier > 0, got {self.value}")
        if self.kind == "renyi":
            check_order(self.order if self.order is not None else math.nan)
        if self.source_value is not None and not 0.0 <= self.source_value <= self.value:
            raise ValueError(f"a source's weaker relation costs at most the event, got {self.source_value} > "
                             f"{self.value}")

    @property
    def private(self) -> bool:
        """Whether the release carries a DP guarantee."""
        return self.kind != "non_private"

    def describe(self) -> str:
        """A short label, e.g. ``gaussian(noise_multiplier=1.23)``."""
        if self.kind == "gaussian":
            return f"gaussian(noise_multiplier={self.value:.6g})"
        if self.kind == "zcdp":
            return f"zcdp(rho={self.value:.6g})"
        if self.kind == "pure_dp":
            return f"pure_dp(epsilon={self.value:.6g})"
        if self.kind == "renyi":
            return f"renyi(order={self.order:g}, epsilon={self.value:.6g})"
        return "non_private"

    @classmethod
    def non_private(cls, note: str) -> ReleaseEvent:
        """A release with no DP guarantee (``eps = inf``), with the reason."""
        return cls("non_private", note=note)


class _ComposedEpsilons:
    """``eps(n)`` at ``delta`` after ``n`` releases, composed by a dp-accounting accountant one event at a time.

    One event at a time, because dp-accounting 0.6.0's PLD accountant drops
    the count of a composed ``RandomizedResponseDpEvent`` (``compose(event, 10)``
    composes it once).  Memoised: a generation only asks for ``n`` and ``n + 1``.
    """

    def __init__(self, event: ReleaseEvent, delta: float) -> None:
        try:
            from dp_accounting import NeighboringRelation, dp_event
        except ImportError as error:
            raise ImportError(
                f"the epsilon ledger of a {event.kind} release needs dp-accounting: pip install 'coveil[edge]'"
            ) from error
        from dp_accounting.pld import PLDAccountant
        from dp_accounting.rdp import RdpAccountant
        from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

        self.delta = delta
        self._accountant: Any
        if event.kind == "zcdp":
            orders = list(DEFAULT_RDP_ORDERS)
            if event.horizon is not None and event.value > 0:  # the order the calibration's CKS conversion used
                orders.append(zcdp_optimal_order(event.horizon * event.value, delta))
            self._accountant = RdpAccountant(orders=sorted(orders))
            self._event = dp_event.ZCDpEvent(event.value)
        elif event.kind == "pure_dp":
            # randomised response's PLD has two atoms and its composition n + 1: a fine grid costs nothing
            self._accountant = PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-6)
            self._event = dp_event.RandomizedResponseDpEvent(randomized_response_noise(event.value), 2)
        else:
            raise ValueError(f"dp-accounting does not compose a {event.kind!r} release here")
        self._epsilons = [0.0]

    def __call__(self, releases: int) -> float:
        while len(self._epsilons) <= releases:
            self._accountant.compose(self._event)
            self._epsilons.append(float(self._accountant.get_epsilon(self.delta)))
        return self._epsilons[releases]


def _epsilon_curve(event: ReleaseEvent, delta: float) -> Callable[[int], float]:
    if event.kind == "non_private":
        return lambda releases: 0.0 if releases == 0 else math.inf
    if event.value == 0.0:  # a zero-cost release (eps = 0 or rho = 0): the output ignores the private context
        return lambda releases: 0.0
    if event.kind == "pure_dp" and delta == 0.0:
        # n pure eps-DP releases are (n * eps)-DP, and for randomised response exactly so; the PLD accountant
        # truncates its tails and reports infinity at delta 0 after a few hundred compositions
        return lambda releases: releases * event.value
    if event.kind == "renyi":
        assert event.order is not None
        return lambda releases: renyi_composition_epsilon(releases, event.value, event.order, delta)
    if event.kind == "gaussian":
        return lambda releases: gaussian_composition_epsilon(event.value, releases, delta)
    return _ComposedEpsilons(event, delta)


@dataclass
class PrivacyAccountant:
    """The account of one generation: which steps released, what that spent, and the ``max_epsilon`` budget.

    Args:
        event: what one releasing step costs (the policy's :class:`ReleaseEvent`).
        delta: the delta the spent epsilon is stated at (``None``: the event's own; pure DP allows 0).
        max_epsilon: the budget: once one more release would spend more, every later step is withheld
            (``None``: no budget).
    """

    event: ReleaseEvent
    delta: float | None = None
    max_epsilon: float | None = None
    release_steps: list[int] = field(default_factory=list)
    #: the first step the budget withheld (``None`` while it has not)
    withheld_from: int | None = None
    _curve: Callable[[int], float] = field(init=False, repr=False)
    _source_curve: Callable[[int], float] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.delta is None:
            self.delta = self.event.delta
        self.delta = float(self.delta)
        if self.event.kind in ("gaussian", "zcdp", "renyi"):
            check_delta(self.delta)  # approximate DP: no finite epsilon at delta = 0
        elif not 0.0 <= self.delta < 1.0:
            raise ValueError(f"delta must lie in [0, 1), got {self.delta}")
        self._curve = _epsilon_curve(self.event, self.delta)
        source = self.event.source_value
        self._source_curve = None if source is None else _epsilon_curve(replace(self.event, value=source), self.delta)
        if self.max_epsilon is not None:
            self.max_epsilon = float(self.max_epsilon)
            if not (self.max_epsilon >= 0.0 and math.isfinite(self.max_epsilon)):
                raise ValueError(f"max_epsilon must be finite and >= 0, got {self.max_epsilon}")
            one = self.epsilon(1)
            if self.event.private and self.max_epsilon < one:
                raise ValueError(
                    f"max_epsilon {self.max_epsilon:g} cannot be met: one release of this policy already spends "
                    f"epsilon {one:.4g} at delta {self.delta:g} ({RELATION}); the working range is max_epsilon >= "
                    f"{one:.4g} (or a smaller per-token epsilon, a larger delta)"
                )

    @property
    def accountant(self) -> str:
        """Which accountant composes the releases (the summary's ``accountant``)."""
        if self.event.kind == "pure_dp" and self.delta == 0.0:
            return "basic composition (exact at delta 0)"
        return ACCOUNTANTS[self.event.kind]

    @property
    def releases(self) -> int:
        """How many steps released something the mechanism protects."""
        return len(self.release_steps)

    def epsilon(self, releases: int | None = None) -> float:
        """The epsilon spent at ``delta`` after ``releases`` releases (default: those recorded), any two contexts."""
        return self._curve(self.releases if releases is None else int(releases))

    def source_epsilon(self, releases: int | None = None) -> float | None:
        """The same releases for the source's weaker relation (:data:`SOURCE_RELATION`), ``None`` without one."""
        if self._source_curve is None:
            return None
        return self._source_curve(self.releases if releases is None else int(releases))

    def would_exceed(self, max_epsilon: float) -> bool:
        """Whether one more release would spend more than ``max_epsilon`` (Flower's ``would_exceed``)."""
        return self.epsilon(self.releases + 1) > max_epsilon

    def withholds(self, step: int) -> bool:
        """Whether ``step`` must send only a cloud-only signal because the budget is spent.

        It reads only public numbers (the event's parameters, ``delta``,
        ``max_epsilon``) and the count of releasing steps, never the private
        context; once it withholds, it withholds every later step (a withheld
        step records nothing, so the account stands still).
        """
        if self.withheld_from is None and self.max_epsilon is not None and self.would_exceed(self.max_epsilon):
            self.withheld_from = step
        return self.withheld_from is not None

    def record(self, step: int, *, steered: bool) -> None:
        """Record ``step``'s signal, decided from the private context (not withheld).

        A DP mechanism's signal is a release whatever it turned out to be (the
        draw is what the guarantee covers, so the count never depends on its
        outcome); a heuristic's signal is a release only when the private
        context ``steered`` it (something other than what the cloud could
        produce alone).
        """
        if self.event.private or steered:
            self.release_steps.append(step)

    def stop_reason(self) -> str | None:
        """Why the budget withheld, in words (``None`` when it has not)."""
        if self.withheld_from is None:
            return None
        after = self.epsilon(self.releases + 1)
        spent = "no finite epsilon (non-private policy)" if math.isinf(after) else f"epsilon {after:.4g}"
        return (f"from step {self.withheld_from} only cloud-only signals were sent: one more release would spend "
                f"{spent} > max_epsilon {self.max_epsilon:g} at delta {self.delta:g}")

    def summary(self) -> dict[str, Any]:
        """The ledger's privacy summary, JSON-ready: ``epsilon_spent`` is ``None`` for a non-private policy, even
        one none of whose steps the private context steered (whether a step is steered is itself decided from the
        private context, so "0" would claim a guarantee the policy does not have).  ``relation`` names what
        ``epsilon_spent`` holds for; ``source_relation`` (or ``None``) is the source's weaker figure, labelled."""
        source = self.source_epsilon()
        return {
            "guarantee": "dp" if self.event.private else "non-private",
            "epsilon_spent": self.epsilon() if self.event.private else None,
            "relation": RELATION if self.event.private else None,
            "source_relation": None if source is None else {"relation": SOURCE_RELATION, "epsilon_spent": source},
            "delta": self.delta,
            "accountant": self.accountant,
            "event": self.event.describe(),
            "events": self.releases,
            "max_epsilon": self.max_epsilon,
            "withheld_from": self.withheld_from,
            "withheld_reason": self.stop_reason(),
            "note": self.event.note,
        }

    def describe(self) -> str:
        """One line for people: what this generation spent."""
        if not self.event.private:
            line = f"non-private: {self.event.note} ({self.releases} steps steered by the private context)"
        else:
            line = (f"epsilon {self.epsilon():.4g} at delta {self.delta:g} over {self.releases} releases, "
                    f"{RELATION} ({self.event.describe()}, {self.accountant})")
        reason = self.stop_reason()
        return line if reason is None else f"{line}; {reason}"
