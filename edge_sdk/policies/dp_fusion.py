"""DP-Fusion (Thareja et al., ICLR 2026) in both fusion modes: mix the private distribution towards a public one.

The mixing weight of one step is the largest ``lambda`` whose mixture stays
within a symmetric Renyi divergence ``b`` of the public distribution
(:func:`dp_fusion_lambda`); the accounting that maps ``epsilon`` to ``b`` is in
:mod:`edge_sdk.privacy_accounting`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from edge_sdk.accountant import ReleaseEvent
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import check_alpha, fuse, top_k_ids
from edge_sdk.policies.base import CloudUpload, FusionMode, Policy, SyncedToken, require_rng
from edge_sdk.policies.ldp_sampler import sample_index
from edge_sdk.privacy_accounting import (
    RENYI_PROBABILITY_FLOOR,
    EpsilonUnit,
    check_delta,
    check_epsilon,
    check_order,
    check_positive_int,
    dp_fusion_divergence_bound,
    dp_fusion_step_epsilon,
    dp_fusion_token_beta,
    rdp_epsilon,
)

#: relative width at which the reverse-direction search stops (the source bisects to 1e-6 absolute)
_WEIGHT_TOLERANCE = 1e-12
#: a feasible point that uses all but this fraction of the slack ``limit - total(0)`` ends that search
_SLACK_TOLERANCE = 1e-12
#: rounds of that search (Illinois converges superlinearly; a safety cap)
_WEIGHT_STEPS = 100

_SCRATCH = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three float64 work arrays of length ``n``, kept per thread (fresh 2 MB arrays cost ~500 page faults each)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None or buffers[0].shape[0] != n:
        buffers = _SCRATCH.buffers = tuple(np.empty(n) for _ in range(3))
    return buffers


def _scratch32(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 work arrays of length ``n``, kept per thread."""
    buffers = getattr(_SCRATCH, "buffers32", None)
    if buffers is None or buffers[0].shape[0] != n:
        buffers = _SCRATCH.buffers32 = (np.empty(n, np.float32), np.empty(n, np.float32))
    return buffers


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``sum a * b`` in one single-threaded pass (BLAS's threaded dot stalls when the other cores are busy)."""
    return float(np.einsum("i,i->", a, b))


def dp_fusion_lambda(p_private: np.ndarray, p_public: np.ndarray, bound: float, *, order: float = 2.0) -> float:
    """DP-Fusion's per-step mixing weight (Thareja et al.)::

        lambda = 0                                                          if b <= 0
               = max{l in [0, 1] : D(l*p_priv + (1-l)*p_pub, p_pub) <= b}   otherwise

    with ``D`` the symmetric Renyi divergence of order ``a``, both inputs
    renormalised to sum 1 (a row with ids masked out is the distribution it
    is drawn from once renormalised), then floored at 1e-10 (:data:`~edge_sdk.privacy_accounting.RENYI_PROBABILITY_FLOOR`)
    *before* mixing; the source floors the mixture after mixing, which moves
    each entry by at most 1e-10.  Flooring first makes the mixture
    ``m = q + l*d`` (``q`` the floored public, ``d = p - q``) positive and
    affine in ``l``, so both sums of ``D`` are convex in ``l``::

        F(l) = sum m^a q^(1-a)   (order 2: sum q + 2l sum d + l^2 sum d^2/q, a quadratic)
        G(l) = sum q^a m^(1-a)

    and the feasible set ``{l : F, G <= e^{(a-1) b}}`` is an interval
    ``[0, l*]``: ``l*`` is found to a relative 1e-12, not bisected to 1e-6.
    At order 2 the forward root is closed-form (other orders search ``F``);
    the reverse sum is checked at it (four passes) and, only when it binds,
    searched by :func:`_largest_feasible`.  The result never exceeds the bound
    and is non-decreasing in ``b``.
    """
    return _Mixing(p_private, p_public, bound, order).weight()


class _Mixing:
    """One step's floored distributions and the two convex constraints of :func:`dp_fusion_lambda`."""

    def __init__(self, p_private: np.ndarray, p_public: np.ndarray, bound: float, order: float) -> None:
        self.order = check_order(order)
        private, public = np.asarray(p_private), np.asarray(p_public)
        if private.shape != public.shape or private.ndim != 1:
            raise ValueError(
                f"private and public distributions must be 1-D of one length, got {private.shape} and {public.shape}"
            )
        self.trivial: float | None = None  # the weight when it needs no search
        self.exponent = (self.order - 1.0) * bound
        if not bound > 0:
            self.trivial = 0.0
            return
        if self.exponent >= 700.0:  # e^b would overflow, and floored at 1e-10 no D exceeds log(1e10) = 23 (+1e-4)
            self.trivial = 1.0
            return
        self.limit = math.exp(self.exponent)
        self.direction, self.floored, self.work = _scratch(private.shape[0])
        np.copyto(self.direction, private)
        np.copyto(self.floored, public)
        # a row with ids masked out (end-of-generation ids while the answer is unfinished) sums to less than 1 and
        # is drawn from renormalised: calibrate what is drawn (a smaller sum would loosen both constraints)
        for row, what in ((self.direction, "private"), (self.floored, "public")):
            total = float(row.sum())
            if not (total > 0 and math.isfinite(total)):
                raise ValueError(f"the {what} distribution needs a positive finite mass, got {total}")
            row /= total
        np.clip(self.direction, RENYI_PROBABILITY_FLOOR, np.inf, out=self.direction)
        np.clip(self.floored, RENYI_PROBABILITY_FLOOR, np.inf, out=self.floored)
        self.direction -= self.floored
        self.base = float(self.floored.sum())  # F(0) = G(0)
        if self.base > self.limit:
            self.trivial = 0.0

    def forward_root(self) -> float:
        """The largest weight the forward constraint ``F <= e^{(a-1) b}`` allows (an upper bound on lambda)."""
        if self.trivial is not None:
            return self.trivial
        if self.order == 2.0:
            return _order_two_forward_root(self.direction, self.floored, self.work, self.base, self.limit)
        return _largest_feasible(self._forward, self.base, self.limit, 1.0)

    def reverse_allows(self, weight: float) -> bool:
        """Whether ``G(weight) <= e^{(a-1) b}`` (four passes)."""
        return self._reverse(weight) <= self.limit

    def weight(self) -> float:
        """``lambda``: the forward root, lowered to the reverse constraint's root when that binds."""
        weight = self.forward_root()
        if self.trivial is not None or weight == 0.0:
            return weight
        return _largest_feasible(self._reverse, self.base, self.limit, weight)

    def _forward(self, weight: float) -> float:
        # F = sum m^a q^(1-a) = sum m u^(a-1), u = m/q (general orders only: temporaries are fine here)
        mixture = self.floored + weight * self.direction
        return _dot(np.power(mixture / self.floored, self.order - 1.0), mixture)

    def _reverse(self, weight: float) -> float:
        # G = sum q^a m^(1-a) = sum q s^(a-1), s = q/m
        work = self.work
        np.multiply(self.direction, weight, out=work)
        work += self.floored
        np.divide(self.floored, work, out=work)
        if self.order != 2.0:
            np.power(work, self.order - 1.0, out=work)
        return _dot(work, self.floored)


def _order_two_forward_root(
    direction: np.ndarray, floored: np.ndarray, work: np.ndarray, base: float, limit: float
) -> float:
    """Largest ``l`` in [0, 1] with ``A + 2Bl + Cl^2 <= L`` (``A = sum q``, ``B = sum d``, ``C = sum d^2/q``).

    The stable root ``l = (L - A) / (B + sqrt(B^2 + C (L - A)))`` (no cancellation
    for ``B >= 0``; the textbook form otherwise); the quadratic is re-evaluated
    at the root and the root nudged down until it holds, so rounding cannot
    make it infeasible.
    """
    linear = float(direction.sum())
    np.divide(direction, floored, out=work)
    curvature = _dot(work, direction)
    slack = limit - base
    if curvature <= 0.0:  # p = q after flooring: every mixture is p itself
        return 1.0 if base + 2.0 * linear <= limit else 0.0
    root = math.sqrt(linear * linear + curvature * slack)
    weight = slack / (linear + root) if linear >= 0 else (root - linear) / curvature
    weight = min(weight, 1.0)
    while weight > 0.0 and base + weight * (2.0 * linear + weight * curvature) > limit:
        weight = math.nextafter(weight, 0.0)
    return weight


def _largest_feasible(total: Callable[[float], float], base: float, limit: float, high: float) -> float:
    """Largest ``l`` in ``[0, high]`` with ``total(l) <= limit``, given ``total(0) = base <= limit``.

    The feasible set is an interval ``[0, l*]`` (``total`` is convex).  If
    ``high`` is feasible it is the answer; otherwise Illinois regula falsi
    runs on ``f(l) = limit / total(l) - 1`` (positive exactly where ``l`` is
    feasible).  Near a pole of the reverse sum (``total ~ A / (1 - l + c)``)
    ``f`` is nearly linear in ``l``, so interpolation converges in a few steps
    where Newton or bisection crawl.  Every end of the bracket is an
    evaluated point classified by its own ``f``, and the feasible end is
    returned once the bracket's relative width is 1e-12 (or a feasible point
    leaves less than 1e-12 of the slack ``limit - base``): the result never
    exceeds the bound, whatever the interpolation does.
    """
    value = total(high)
    if value <= limit:
        return high
    low, f_low = 0.0, limit / base - 1.0
    f_high = limit / value - 1.0
    side = 0
    for _ in range(_WEIGHT_STEPS):
        if high - low <= _WEIGHT_TOLERANCE * high:
            break
        guess = high - f_high * (high - low) / (f_high - f_low)
        if not low < guess < high:
            guess = 0.5 * (low + high)
        value = total(guess)
        f_guess = limit / value - 1.0
        if value <= limit:
            if limit - value <= _SLACK_TOLERANCE * (limit - base):  # the bound is met as tightly as it can be
                return guess
            low, f_low = guess, f_guess
            if side == -1:
                f_high *= 0.5
            side = -1
        else:
            high, f_high = guess, f_guess
            if side == 1:
                f_low *= 0.5
            side = 1
    return low


def dp_fusion_mixture(
    p_private: np.ndarray, p_public: np.ndarray, bound: float, *, order: float = 2.0
) -> tuple[np.ndarray, float]:
    """``(lambda * p_priv + (1 - lambda) * p_pub, lambda)`` with ``lambda`` from :func:`dp_fusion_lambda` (float64)."""
    weight = dp_fusion_lambda(p_private, p_public, bound, order=order)
    public = np.asarray(p_public, dtype=np.float64)
    return public + weight * (np.asarray(p_private, dtype=np.float64) - public), weight


@dataclass
class DPFusion(Policy):
    """DP-Fusion in both fusion modes: ``p_slm`` mixed towards ``p_llm`` by the bound ``b``.

    The private distribution is ``p_slm``; the public one is ``p_llm``.  This
    is this project's adaptation: the original runs the same model a second
    time on the redacted (public) context, which on the edge would double the
    SLM's compute, whereas the cloud's distribution is already public.

    **What epsilon means.**  ``epsilon`` is the Renyi-DP budget of **one
    token** at order ``a`` (one private group)::

        beta = eps / 4                    (dp_fusion_token_beta: a token bounded by beta costs 4 * beta)
        b = a * beta = a * eps / 4        (dp_fusion_divergence_bound: dp-fusion-lib's "paper notation")

    so ``T`` tokens are ``(a, T * eps)``-Renyi-DP, i.e.
    ``(T * eps + log(1/delta)/(a-1), delta)``-DP (:meth:`generation_epsilon`).
    A total ``(eps, delta)`` over the generation is not used because it cannot
    mean the paper's grid: the source's worst case
    ``beta = (eps - log(1/delta)/(a-1)) / (4T)`` is negative for every
    ``eps <= log(1/delta)/(a-1)`` (11.5 at ``delta = 1e-5``, ``a = 2``), so
    eps in {0, ..., 8} would all give ``lambda = 0``.  Read per token, every
    grid point is a distinct bound (``b = eps/2`` at order 2); ``eps = 0``
    gives ``lambda = 0`` (only the public distribution), and a bound above the
    pair's own divergence (at most ``log 1e10 = 23`` nats with the 1e-10
    floor, so any ``eps >= 46`` at order 2) gives ``lambda = 1``.

    * edge-side: the synced token is one draw from
      ``alpha * p_llm + (1 - alpha) * mixture`` (temperature 1); the draw is
      what carries the guarantee, so ``epsilon_units["edge"]`` is "per_token".
    * cloud-side: the edge uploads the mixture's probabilities on its top
      ``upload_k`` ids.  Releasing probabilities is not sampling one token, so
      **no DP guarantee follows**: there ``epsilon`` is only the knob that
      sets ``b`` the same way (``epsilon_units["cloud"]`` is "calibration").

    Args:
        epsilon: per-token Renyi-DP budget (the swept parameter; the default 2 is dp-fusion-lib's default
            ``beta = 0.5``).
        order: Renyi order ``a``.
        delta: delta of :meth:`generation_epsilon` (accounting only).
        max_new_tokens: generation length ``T`` of :meth:`generation_epsilon` (accounting only; the decoder sets
            it to the generation's own length, :meth:`for_generation`).
        upload_k: cloud-side upload size.
    """

    name = "dp_fusion"
    modes = frozenset({"cloud", "edge"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"cloud": "calibration", "edge": "per_token"}

    epsilon: float = 2.0
    order: float = 2.0
    delta: float = 1e-5
    max_new_tokens: int = DecodeSettings.max_new_tokens  # the generation length the budget covers
    upload_k: int = 100
    _bound: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive_int(self.upload_k, "DP-Fusion upload size upload_k")
        check_positive_int(self.max_new_tokens, "max_new_tokens")
        check_delta(self.delta)
        beta = dp_fusion_token_beta(check_epsilon(self.epsilon), order=check_order(self.order))
        self._bound = dp_fusion_divergence_bound(beta, self.order)

    def max_upload(self, vocab_size: int) -> int:
        return min(self.upload_k, vocab_size)

    @property
    def bound(self) -> float:
        """The per-token bound ``b`` on the symmetric divergence (0: nothing private is used)."""
        return self._bound

    def generation_epsilon(self) -> float:
        """The ``(eps, delta)`` of ``max_new_tokens`` edge-side tokens: ``T * eps + log(1/delta)/(a-1)``."""
        return rdp_epsilon(self.max_new_tokens * self.epsilon, self.order, self.delta)

    def for_generation(self, max_new_tokens: int) -> DPFusion:
        """This policy with ``max_new_tokens`` set to the generation's length (:meth:`generation_epsilon`)."""
        return self if max_new_tokens == self.max_new_tokens else replace(self, max_new_tokens=max_new_tokens)

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """Edge-side each token is ``(a, eps_step(b / a))``-Renyi-DP at the order ``a`` alone; cloud-side the
        uploaded probabilities carry no DP guarantee (``epsilon`` only calibrates ``b`` there), except at
        ``epsilon = 0``, where every upload is the public distribution's and nothing is spent."""
        if mode == "cloud" and self._bound == 0.0:  # lambda = 0: the upload is the public distribution's
            return ReleaseEvent("pure_dp", 0.0, note="epsilon 0: every upload is the public distribution's")
        if mode == "cloud":
            return ReleaseEvent.non_private(
                "cloud-side DP-Fusion uploads probabilities: epsilon calibrates the bound, the release is not DP"
            )
        return ReleaseEvent(
            "renyi", dp_fusion_step_epsilon(self._bound / self.order, self.order), delta=self.delta,
            order=self.order, note="each token: one draw from the bounded mixture, any two private contexts",
        )

    def weight(self, p_slm: np.ndarray, p_llm: np.ndarray) -> float:
        """This step's mixing weight ``lambda``."""
        return dp_fusion_lambda(p_slm, p_llm, self._bound, order=self.order)

    def mixture(self, p_slm: np.ndarray, p_llm: np.ndarray) -> np.ndarray:
        """This step's calibrated distribution ``lambda * p_slm + (1 - lambda) * p_llm`` (float32)."""
        return fuse(p_slm, p_llm, self.weight(p_slm, p_llm))

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        weight = self.weight(p_slm, p_llm)
        mixture, scaled = _scratch32(np.shape(p_slm)[0])
        np.multiply(p_llm, np.float32(1.0 - weight), out=mixture)
        mixture += np.multiply(p_slm, np.float32(weight), out=scaled)
        return CloudUpload.of(mixture, top_k_ids(mixture, self.upload_k))

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        """One draw from ``alpha * p_llm + (1 - alpha) * (l * p_slm + (1 - l) * p_llm)``.

        That is ``(1 - w) * p_llm + w * p_slm`` with ``w = (1 - alpha) * l``:
        a uniform ``u`` picks ``p_slm`` iff ``u < w``, then
        :func:`~edge_sdk.policies.ldp_sampler.sample_index` draws from the
        chosen one.  ``u < w`` iff ``u / (1 - alpha)`` is a feasible weight, so
        it is decided by the closed-form forward root and, only when ``u`` falls
        below it, one reverse-sum evaluation.
        """
        generator = require_rng(rng, self.name)
        share = 1.0 - check_alpha(alpha)
        mixing = _Mixing(p_slm, p_llm, self._bound, self.order)
        # the draw comes from p_slm with probability share * lambda: decide that first, so lambda itself
        # is only bounded, never solved for (lambda >= l iff l is feasible, the feasible set being [0, lambda])
        threshold = float(generator.random())
        private = share > 0 and threshold < share * mixing.forward_root()
        if private and mixing.trivial is None:
            private = mixing.reverse_allows(threshold / share)
        return SyncedToken(sample_index(p_slm if private else p_llm, generator))
