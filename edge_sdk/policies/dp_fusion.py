"""DP-Fusion (Thareja et al., ICLR 2026) in both fusion modes: mix the private distribution towards a public one.

The mixing weight of one step is the largest ``lambda`` whose mixture stays
within ``b`` of the public distribution at the Renyi orders that bound any two
private contexts (:func:`dp_fusion_lambda`); the accounting that maps
``epsilon`` to ``b`` is in :mod:`edge_sdk.privacy.analysis`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from edge_sdk.privacy.accountant import ReleaseEvent
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import check_alpha, top_k_ids
from edge_sdk.policies.base import Policy, require_rng
from edge_sdk.protocol.signals import CloudUpload, FusionMode, SyncedToken
from edge_sdk.policies.ldp_sampler import sample_index
from edge_sdk.privacy.analysis import (
    RENYI_PROBABILITY_FLOOR,
    EpsilonUnit,
    check_delta,
    check_epsilon,
    check_order,
    check_positive_int,
    dp_fusion_bound,
    dp_fusion_context_orders,
    dp_fusion_pair_rdp,
    rdp_epsilon,
)

#: relative width at which the reverse-direction search stops (the source bisects to 1e-6 absolute)
_WEIGHT_TOLERANCE = 1e-12
#: a feasible point that uses all but this fraction of the slack ``limit - total(0)`` ends that search
_SLACK_TOLERANCE = 1e-12
#: rounds of that search (Illinois converges superlinearly, bisection steps keep it within ~3x bisection's)
_WEIGHT_STEPS = 300

#: the largest Renyi order DP-Fusion takes: its bound is checked at 2a (float64 sums of m^2a q^(1-2a))
MAX_ORDER = 8.0

_SCRATCH = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, ...]:
    """Five float64 work arrays of length ``n`` and a boolean one, views of buffers kept per thread and grown
    only when a longer row comes (fresh 2 MB arrays cost ~500 page faults each)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None or buffers[0].shape[0] < n:
        buffers = _SCRATCH.buffers = (*(np.empty(n) for _ in range(5)), np.empty(n, dtype=bool))
    return tuple(buffer[:n] for buffer in buffers)


def _scratch32(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 work arrays of length ``n``, kept per thread."""
    buffers = getattr(_SCRATCH, "buffers32", None)
    if buffers is None or buffers[0].shape[0] != n:
        buffers = _SCRATCH.buffers32 = (np.empty(n, np.float32), np.empty(n, np.float32))
    return buffers


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``sum a * b`` in one single-threaded pass (BLAS's threaded dot stalls when the other cores are busy)."""
    return float(np.einsum("i,i->", a, b))


def dp_fusion_rows(p_private: np.ndarray, p_public: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two rows DP-Fusion bounds and draws from (float64, fresh arrays)::

        S = {y : p_pub(y) > 0}                                   (public: e.g. the ids a mask zeroed are out)
        p~ = max(p_priv / sum p_priv, 1e-10) on S, 0 elsewhere, renormalised
        q~ = max(p_pub / sum p_pub, 1e-10) on S, 0 elsewhere, renormalised

    Every private row then gives a ``p~`` on the public support ``S`` with every ratio ``p~/q~`` within
    ``[1e-10 / (1 + |S| 1e-10), (1 + |S| 1e-10) / 1e-10]``, so every divergence is finite and the token drawn
    is drawn from exactly the distribution that was bounded (the source bounds floored rows and draws from
    the raw ones, where an exact zero makes the true epsilon infinite).
    """
    private, public, ids = _floored_rows(p_private, p_public)
    return _expanded(private, ids, np.shape(p_public)[0]), _expanded(public, ids, np.shape(p_public)[0])


def _expanded(row: np.ndarray, ids: np.ndarray | None, n: int) -> np.ndarray:
    """``row`` over the support ``ids`` as a fresh full-length row (zero off the support)."""
    if ids is None:
        return row.copy()
    full = np.zeros(n)
    full[ids] = row
    return full


def _floored_rows(p_private: np.ndarray, p_public: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(p~, q~, ids)`` of :func:`dp_fusion_rows` on the support only, in this thread's scratch buffers:
    ``ids`` the support's ids, ``None`` when it is the whole vocabulary (nearly always: every row is then
    positive and no pass needs a mask)."""
    private, public = np.asarray(p_private), np.asarray(p_public)
    if private.shape != public.shape or private.ndim != 1:
        raise ValueError(
            f"private and public distributions must be 1-D of one length, got {private.shape} and {public.shape}"
        )
    *rows, support = _scratch(private.shape[0])
    np.greater(public, 0, out=support)
    ids = None if support.all() else np.flatnonzero(support)
    size = private.shape[0] if ids is None else ids.size
    for source, row, what in ((private, rows[0], "private"), (public, rows[1], "public")):
        row = row[:size]
        np.copyto(row, source if ids is None else source[ids])
        total = float(row.sum() if ids is None else source.sum(dtype=np.float64))  # the whole row's mass
        if not (total > 0 and math.isfinite(total)):
            raise ValueError(f"the {what} distribution needs a positive finite mass, got {total}")
        np.maximum(row, RENYI_PROBABILITY_FLOOR * total, out=row)  # max(p / T, floor) * T
        row /= row.sum()
    return rows[0][:size], rows[1][:size], ids


def dp_fusion_lambda(p_private: np.ndarray, p_public: np.ndarray, bound: float, *, order: float = 2.0) -> float:
    """DP-Fusion's per-step mixing weight, calibrated so that **any two private contexts** stay close::

        lambda = 0                                                          if b <= 0
               = max{l in [0, 1] : D_2a(m_l||q~) <= b  and  D_(2a-1)(q~||m_l) <= b},   m_l = l*p~ + (1-l)*q~

    on the rows of :func:`dp_fusion_rows`.  Through the weak triangle inequality
    (:func:`~edge_sdk.privacy.analysis.dp_fusion_pair_rdp`) the mixtures of any two contexts are then
    within ``D_a <= (4a-3)/(2a-2) * b`` of each other, and each within ``D_a <= b`` of the public row (the
    source's relation; the source bounds only that, the symmetric ``D_a`` against the public row).  Both sums
    are convex in ``l`` (``m_l`` is affine and positive on the support)::

        F(l) = sum m^(2a) q^(1-2a)        (a polynomial in l when 2a is an integer: 4 at order 2)
        G(l) = sum q^(2a-1) m^(2-2a)

    so the feasible set is an interval ``[0, l*]``, found to a relative 1e-12: the forward root from the
    polynomial's coefficients (other orders search ``F``), the reverse sum checked at it and, only when it
    binds, searched by :func:`_largest_feasible`.  The result never exceeds the bound and is non-decreasing
    in ``b`` up to that accuracy (two bounds an ulp apart may give roots a relative 1e-12 apart either way).
    """
    return _Mixing(p_private, p_public, bound, order).weight()


class _Mixing:
    """One step's rows (:func:`dp_fusion_rows`) and the two convex constraints of :func:`dp_fusion_lambda`."""

    def __init__(self, p_private: np.ndarray, p_public: np.ndarray, bound: float, order: float) -> None:
        self.forward_order, self.reverse_order = dp_fusion_context_orders(order)
        self.private, self.public, self.ids = _floored_rows(p_private, p_public)
        self.n = np.shape(p_public)[0]
        size = self.public.shape[0]
        self.direction, self.work, self.term = (buffer[:size] for buffer in _scratch(np.shape(p_public)[0])[2:5])
        np.subtract(self.private, self.public, out=self.direction)
        self.trivial: float | None = None  # the weight when it needs no search
        self.base = float(self.public.sum())  # F(0) = G(0)
        if not bound > 0:
            self.trivial = 0.0
            return
        if bound >= math.log((1.0 + size * RENYI_PROBABILITY_FLOOR) / RENYI_PROBABILITY_FLOOR):
            self.trivial = 1.0  # beyond D_inf of any two such rows: no divergence of any order reaches b
            return
        forward_exponent, reverse_exponent = (self.forward_order - 1.0) * bound, (self.reverse_order - 1.0) * bound
        if forward_exponent >= 700.0:
            raise ValueError(f"DP-Fusion's Renyi order {order} is too large for float64 sums at bound {bound:.4g}")
        self.forward_limit, self.reverse_limit = math.exp(forward_exponent), math.exp(reverse_exponent)
        self._coefficients: list[float] | None = None
        if self.base > self.reverse_limit:  # a bound below the rounding of a sum near 1
            self.trivial = 0.0

    def draw(self, private: bool, rng: np.random.Generator) -> int:
        """One id drawn from ``p~`` (``private``) or ``q~``."""
        index = sample_index(self.private if private else self.public, rng)
        return index if self.ids is None else int(self.ids[index])

    def mixture(self, weight: float) -> np.ndarray:
        """``weight * p~ + (1 - weight) * q~`` as a fresh full-length row."""
        return _expanded(self.public + weight * self.direction, self.ids, self.n)

    def forward_root(self) -> float:
        """The largest weight the forward constraint ``F <= e^{(2a-1) b}`` allows (an upper bound on lambda)."""
        if self.trivial is not None:
            return self.trivial
        if self.forward_order == int(self.forward_order):
            return _largest_feasible(self._forward_polynomial, self.base, self.forward_limit, 1.0)
        return _largest_feasible(self._forward, self.base, self.forward_limit, 1.0)

    def allows(self, weight: float) -> bool:
        """Whether ``weight <= lambda``, i.e. ``weight`` is feasible, without solving for ``lambda``.

        First a two-pass test that rejects most weights: ``D_2a >= D_2`` and
        ``e^{D_2(m||q)} = sum m^2/q = 1 + l^2 chi2`` (``chi2 = sum d^2/q``; ``sum d = 0``), so
        ``(1 + l^2 chi2)^(2a-1) > e^{(2a-1) b}`` rules ``l`` out.  Otherwise the
        forward polynomial and the reverse sum are checked at ``l``.
        """
        if self.trivial is not None:
            return weight <= self.trivial
        if weight > 1.0:
            return False
        chi2 = _dot(np.divide(self.direction, self.public, out=self.work), self.direction)
        if (self.forward_order - 1.0) * math.log1p(weight * weight * chi2) > math.log(self.forward_limit):
            return False
        forward = self._forward_polynomial if self.forward_order == int(self.forward_order) else self._forward
        return forward(weight) <= self.forward_limit and self._reverse(weight) <= self.reverse_limit

    def weight(self) -> float:
        """``lambda``: the forward root, lowered to the reverse constraint's root when that binds."""
        weight = self.forward_root()
        if self.trivial is not None or weight == 0.0:
            return weight
        return _largest_feasible(self._reverse, self.base, self.reverse_limit, weight)

    def _forward_polynomial(self, weight: float) -> float:
        """``F(l) = sum_k C(n, k) l^k s_k`` with ``s_k = sum d^k q^(1-k)`` (``n = 2a``; the sums read once)."""
        if self._coefficients is None:
            n = int(self.forward_order)
            ratio = np.divide(self.direction, self.public, out=self.work)
            np.copyto(self.term, self.direction)
            sums = [self.base, float(self.direction.sum())]
            for _ in range(2, n + 1):
                self.term *= ratio
                sums.append(float(self.term.sum()))
            self._coefficients = [math.comb(n, k) * sums[k] for k in range(n + 1)]
        total = 0.0
        for coefficient in reversed(self._coefficients):
            total = total * weight + coefficient
        return total

    def _forward(self, weight: float) -> float:
        # F = sum m^n q^(1-n) = sum m u^(n-1), u = m/q (general orders only: temporaries are fine here)
        mixture = self.public + weight * self.direction
        return _dot(np.power(mixture / self.public, self.forward_order - 1.0), mixture)

    def _reverse(self, weight: float) -> float:
        # G = sum q^r m^(1-r) = sum q s^(r-1), s = q/m
        work = self.work
        np.multiply(self.direction, weight, out=work)
        work += self.public
        np.divide(self.public, work, out=work)
        if self.reverse_order == 3.0:
            np.square(work, out=work)
        else:
            np.power(work, self.reverse_order - 1.0, out=work)
        return _dot(work, self.public)


def _largest_feasible(total: Callable[[float], float], base: float, limit: float, high: float) -> float:
    """Largest ``l`` in ``[0, high]`` with ``total(l) <= limit``, given ``total(0) = base <= limit``.

    The feasible set is an interval ``[0, l*]`` (``total`` is convex).  If
    ``high`` is feasible it is the answer; otherwise Illinois regula falsi
    runs on ``f(l) = limit / total(l) - 1`` (positive exactly where ``l`` is
    feasible).  Near a pole of the reverse sum (``total ~ A / (1 - l + c)``)
    ``f`` is nearly linear in ``l``, so interpolation converges in a few steps
    where Newton or bisection crawl; where it is far from linear (the forward
    polynomial of degree 2a), two steps in a row that do not halve the
    bracket are followed by a bisection step.  Every end of the bracket is an
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
    slow = 0  # steps in a row that did not halve the bracket
    for _ in range(_WEIGHT_STEPS):
        width = high - low
        if width <= _WEIGHT_TOLERANCE * high:
            break
        guess = high - f_high * (high - low) / (f_high - f_low)
        if slow >= 2 or not low < guess < high:  # far from linear (a steep polynomial): bisect
            guess, slow = 0.5 * (low + high), 0
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
        slow = slow + 1 if high - low > 0.5 * width else 0
    return low


def dp_fusion_mixture(
    p_private: np.ndarray, p_public: np.ndarray, bound: float, *, order: float = 2.0
) -> tuple[np.ndarray, float]:
    """``(lambda * p~ + (1 - lambda) * q~, lambda)``: the bounded distribution of :func:`dp_fusion_lambda`, on
    the rows of :func:`dp_fusion_rows` (float64, a fresh full-length row)."""
    mixing = _Mixing(p_private, p_public, bound, order)
    weight = mixing.weight()
    return mixing.mixture(weight), weight


@dataclass
class DPFusion(Policy):
    """DP-Fusion in both fusion modes: ``p_slm`` mixed towards ``p_llm`` by the bound ``b``.

    The private distribution is ``p_slm``; the public one is ``p_llm``.  This
    is this project's adaptation: the original runs the same model a second
    time on the redacted (public) context, which on the edge would double the
    SLM's compute, whereas the cloud's distribution is already public.

    **What epsilon means.**  ``epsilon`` is the Renyi-DP budget at order ``a`` of **one token, between any two
    private contexts**.  Each context's mixture is held within ``b`` of the public row at the orders ``2a``
    and ``2a - 1`` (:func:`dp_fusion_lambda`), which bounds any two contexts' mixtures by the weak triangle
    inequality::

        b = (2a - 2) / (4a - 3) * eps          (dp_fusion_bound: 0.4 eps at order 2)
        D_a(m||m') <= (4a - 3) / (2a - 2) * b = eps

    so ``T`` tokens are ``(a, T * eps)``-Renyi-DP, i.e. ``(rdp_epsilon(T * eps, a, delta), delta)``-DP
    (:meth:`generation_epsilon`, the improved conversion).  Against the public row alone (the source's
    relation, a context against none) a token costs only ``b``: the ledger shows that as a second, labelled
    figure.  A total ``(eps, delta)`` over the generation is not used: the conversion alone costs about 10 at
    ``delta = 1e-5``, so the paper's grid below that would all give ``lambda = 0``.  Read per token, every grid
    point is a distinct bound; ``eps = 0`` gives ``lambda = 0`` (only the public distribution).

    * edge-side: the synced token is one draw from ``alpha * q~ + (1 - alpha) * mixture`` on the floored rows
      of :func:`dp_fusion_rows` (temperature 1): mixing in more of the public row only shrinks both
      divergences (the first sum is convex in ``m``, the second quasi-convex), so the draw keeps the bound;
      ``epsilon_units["edge"]`` is "per_token".
    * cloud-side: the edge uploads the mixture's probabilities on its top
      ``upload_k`` ids.  Releasing probabilities is not sampling one token, so
      **no DP guarantee follows**: there ``epsilon`` is only the knob that
      sets ``b`` the same way (``epsilon_units["cloud"]`` is "calibration").

    Args:
        epsilon: per-token Renyi-DP budget between any two contexts (the swept parameter).
        order: Renyi order ``a`` (1 < a <= 8).
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
        if not check_order(self.order) <= MAX_ORDER:
            raise ValueError(f"DP-Fusion's Renyi order must lie in (1, {MAX_ORDER:g}], got {self.order}")
        self._bound = dp_fusion_bound(check_epsilon(self.epsilon), self.order)

    def max_upload(self, vocab_size: int) -> int:
        return min(self.upload_k, vocab_size)

    @property
    def bound(self) -> float:
        """The per-context bound ``b`` on ``D_2a(m||q)`` and ``D_(2a-1)(q||m)`` (0: nothing private is used)."""
        return self._bound

    def generation_epsilon(self) -> float:
        """The ``(eps, delta)`` of ``max_new_tokens`` edge-side tokens, any two contexts: ``(a, T * eps)``-RDP
        through the improved conversion."""
        return rdp_epsilon(self.max_new_tokens * self.epsilon, self.order, self.delta)

    def for_generation(self, max_new_tokens: int) -> DPFusion:
        """This policy with ``max_new_tokens`` set to the generation's length (:meth:`generation_epsilon`)."""
        return self if max_new_tokens == self.max_new_tokens else replace(self, max_new_tokens=max_new_tokens)

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """Edge-side each token is ``(a, eps)``-Renyi-DP at the order ``a`` alone between any two contexts, and
        ``(a, b)`` against the public row (the source's relation, the second figure); cloud-side the uploaded
        probabilities carry no DP guarantee (``epsilon`` only calibrates ``b`` there), except at
        ``epsilon = 0``, where every upload is the public distribution's and nothing is spent."""
        if mode == "cloud" and self._bound == 0.0:  # lambda = 0: the upload is the public distribution's
            return ReleaseEvent("pure_dp", 0.0, note="epsilon 0: every upload is the public distribution's")
        if mode == "cloud":
            return ReleaseEvent.non_private(
                "cloud-side DP-Fusion uploads probabilities: epsilon calibrates the bound, the release is not DP"
            )
        return ReleaseEvent(
            "renyi", dp_fusion_pair_rdp(self._bound, self.order), delta=self.delta, order=self.order,
            note="each token: one draw from the bounded mixture",
            source_value=self._bound,
        )

    def weight(self, p_slm: np.ndarray, p_llm: np.ndarray) -> float:
        """This step's mixing weight ``lambda``."""
        return dp_fusion_lambda(p_slm, p_llm, self._bound, order=self.order)

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
        """One draw from ``alpha * q~ + (1 - alpha) * (l * p~ + (1 - l) * q~)`` (the rows of :func:`dp_fusion_rows`).

        That is ``(1 - w) * q~ + w * p~`` with ``w = (1 - alpha) * l``:
        a uniform ``u`` picks ``p~`` iff ``u < w``, then
        :func:`~edge_sdk.policies.ldp_sampler.sample_index` draws from the
        chosen one.  ``u < w`` iff ``u / (1 - alpha)`` is a feasible weight, so
        it is decided by :meth:`_Mixing.allows` (two passes for most ``u``).
        """
        generator = require_rng(rng, self.name)
        share = 1.0 - check_alpha(alpha)
        mixing = _Mixing(p_slm, p_llm, self._bound, self.order)
        # the draw comes from p~ with probability share * lambda: decide that first, so lambda itself
        # is never solved for (lambda >= l iff l is feasible, the feasible set being [0, lambda])
        threshold = float(generator.random())
        private = share > 0 and threshold > 0 and mixing.allows(threshold / share)  # u < share * lambda, as
        # 0 < u <= share * lambda: the same probability, and lambda = 0 never draws p~
        return SyncedToken(mixing.draw(private, generator))
