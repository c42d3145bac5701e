"""LDP-Sampler, edge-side: the locally optimal pure epsilon-LDP sampler with ``p_llm`` as the public anchor.

After Ghoukasian, Lee & Asoodeh, "Locally Optimal Private Sampling: Beyond the
Global Minimax" (NeurIPS 2025), specialised to a vocabulary.  Also home of
:func:`sample_index`, the one-pass draw from a full-vocabulary distribution
that the edge-side baselines share.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk.privacy.accountant import ReleaseEvent
from edge_sdk.fusion import sample_from
from edge_sdk.policies.base import Policy, require_rng
from edge_sdk.protocol.signals import FusionMode, SyncedToken
from edge_sdk.privacy.analysis import EpsilonUnit, check_epsilon

#: ids per block of :func:`sample_index`'s two-level inverse CDF
SAMPLE_BLOCK = 512
#: steps of the normaliser search (Illinois converges superlinearly; this is a safety cap)
_ROOT_STEPS = 200
_SCRATCH = threading.local()
#: log t at which every ratio of P's support (>= 1e-45 / 1 for float32 inputs) sits on its ceiling,
#: while P0 * m / t stays a normal float64 (>= 1e-45 * 1e-150)
_SATURATED_LOG_T = math.log(1e150)
#: the probes stay where exp(log t) is finite
_MAX_LOG_T = 700.0
#: |S(t) - 1| at which the normaliser search stops (a few float64 roundings of a sum near 1)
_MASS_TOLERANCE = 1e-15


class BlockSampler:
    """Repeated draws of an id with probability ``weights(i) / sum(weights)``, two uniforms per draw.

    :func:`edge_sdk.fusion.sample_from` builds the cumulative sum of the
    whole array, a sequential pass that costs ~60 argmax passes at a 262k
    vocabulary.  Here the ids are cut into blocks of :data:`SAMPLE_BLOCK`;
    one vectorised pass sums each block, then each draw picks a block with
    probability ``block sum / total`` and an id inside it with probability
    ``weight / block sum`` (both by ``sample_from``), so each id is drawn with
    probability ``weight / total`` and never an id of weight zero.  Same
    generator state, same ids.
    """

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = np.asarray(weights)
        n = self.weights.shape[0]
        full = n // SAMPLE_BLOCK * SAMPLE_BLOCK
        self._sums = np.empty(full // SAMPLE_BLOCK + (full < n), dtype=np.float64)
        if full:
            blocks = self.weights[:full].reshape(-1, SAMPLE_BLOCK)
            np.sum(blocks, axis=1, dtype=np.float64, out=self._sums[: full // SAMPLE_BLOCK])
        if full < n:
            self._sums[-1] = self.weights[full:].sum(dtype=np.float64)

    def draw(self, rng: np.random.Generator) -> int:
        block = sample_from(self._sums, rng)
        start = block * SAMPLE_BLOCK
        return start + sample_from(self.weights[start : start + SAMPLE_BLOCK], rng)


def sample_index(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One draw of an id with probability ``weights(i) / sum(weights)`` (:class:`BlockSampler`; one pass)."""
    weights = np.asarray(weights)
    if weights.shape[0] <= SAMPLE_BLOCK:
        return sample_from(weights, rng)
    return BlockSampler(weights).draw(rng)


def ldp_sampler_ratio_bounds(epsilon: float, gamma: float) -> tuple[float, float]:
    """``(m, e^eps * m)`` with ``m = (gamma + 1) / (e^eps + gamma)``, computed without overflow."""
    epsilon = check_epsilon(epsilon)
    if not (gamma >= 1.0 and math.isfinite(gamma)):
        raise ValueError(f"neighbourhood ratio gamma must be finite and >= 1, got {gamma}")
    decay = math.exp(-epsilon)
    return (gamma + 1.0) * decay / (1.0 + gamma * decay), (gamma + 1.0) / (1.0 + gamma * decay)


def _checked_pair(p_private: np.ndarray, p_public: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    private, public = np.asarray(p_private), np.asarray(p_public)
    for array, what in ((private, "private distribution P"), (public, "public anchor P0")):
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"{what} must be a non-empty 1-D array")
        top = float(array.max())  # NaN and infinities propagate into the maximum
        if not (math.isfinite(top) and top > 0 and float(array.min()) >= 0):
            raise ValueError(f"{what} must be non-negative and finite with positive mass")
    if private.shape != public.shape:
        raise ValueError(f"P and P0 differ in length: {private.size} vs {public.size}")
    return private, public


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``sum a * b`` in one single-threaded pass (BLAS's threaded dot stalls when the other cores are busy)."""
    return float(np.einsum("i,i->", a, b))


def ldp_sampler_weights(p_private: np.ndarray, p_public: np.ndarray, *, epsilon: float, gamma: float) -> np.ndarray:
    """The sampler's distribution ``Q`` up to a factor ``1 + O(1e-13)`` (float64; see :func:`ldp_sampler_distribution`).

    With the likelihood ratio ``k = P / P0`` and ``s0 = sum P0``,
    ``Q(x) = P0(x) / s0 * clip(k(x) * t, m, M)``, and the normaliser ``t = 1/r``
    solves ``S(t) = t / s0 * sum_x P0(x) * clip(k(x), m/t, M/t) = 1``: two
    passes (a scalar clip and a product sum) per evaluation.  ``S`` is
    non-decreasing and piecewise linear in ``t`` with breakpoints ``m/k(x)``
    and ``M/k(x)``, and ``S(t)/t`` is non-increasing, so :func:`_bracket`
    brackets the root in ``log t`` from a few full evaluations.  Inside a
    bracket ``[t_a, t_b]`` every id whose two breakpoints both lie outside it
    keeps its state (floor, linear or ceiling), so those ids add ``C + t * K``
    with ``C, K`` read off the two end evaluations; only the ids with a
    breakpoint inside are kept for the remaining steps (:func:`_compacted_mass`).
    No sort; about a dozen vocabulary passes in all.  (A policy needs only one
    draw from ``Q``, which :func:`ldp_sampler_draw` makes without ``t``.)
    """
    private, public = _checked_pair(p_private, p_public)
    weights, ratio, work = (np.empty(private.shape[0]) for _ in range(3))
    scale = _sampler_into(private, public, *ldp_sampler_ratio_bounds(epsilon, gamma), weights, ratio, work)
    work *= scale
    return work


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three float64 work arrays of length ``n``, kept per thread (fresh 2 MB arrays cost ~500 page faults each)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None or buffers[0].shape[0] != n:
        buffers = _SCRATCH.buffers = tuple(np.empty(n) for _ in range(3))
    return buffers


def _flags(n: int, third: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Boolean work arrays of length ``n``, kept per thread: the first two, or the third."""
    flags = getattr(_SCRATCH, "flags", None)
    if flags is None or flags[0].shape[0] != n:
        flags = _SCRATCH.flags = tuple(np.empty(n, dtype=bool) for _ in range(3))
    return flags[2] if third else flags[:2]


def _sampler_into(
    private: np.ndarray,
    public: np.ndarray,
    low: float,
    high: float,
    weights: np.ndarray,
    ratio: np.ndarray,
    work: np.ndarray,
) -> float:
    """Write ``Q * c`` into ``work`` and return ``c`` (``private``, ``public`` already checked)."""
    np.copyto(weights, public)
    total = float(weights.sum())
    if low == high:  # eps = 0: Q = P0
        np.copyto(work, weights)
        return 1.0 / total
    np.copyto(ratio, private)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(ratio, weights, out=ratio)  # P0 = 0: inf or NaN, and its weight is 0

    def full_mass(log_t: float) -> float:
        t = math.exp(log_t)
        np.clip(ratio, low / t, high / t, out=work)
        return t * _dot(weights, work) / total

    value = full_mass(0.0)
    if math.isnan(value):  # 0/0 where both are 0; any finite ratio gives the same (zero) contribution
        np.nan_to_num(ratio, copy=False, nan=0.0, posinf=np.inf)
        value = full_mass(0.0)
    bracket = _bracket(full_mass, 0.0, value, saturated=lambda: full_mass(_SATURATED_LOG_T))
    if bracket is None:
        if not _root_exists(ratio, weights, low, high):
            np.copyto(work, _disjoint_support_weights(ratio, weights, low, high))
            return 1.0 / total
        bracket = _bracket(full_mass, 0.0, value)
    if isinstance(bracket, float):
        log_t = bracket
    else:
        log_t = _solve_in_bracket(_compacted_mass(ratio, weights, total, low, high, bracket), bracket)
    t = math.exp(log_t)
    np.clip(ratio, low / t, high / t, out=work)
    work *= weights
    return t / total


def _root_exists(ratio: np.ndarray, weights: np.ndarray, low: float, high: float) -> bool:
    """Whether ``S(t) = 1`` has a root, i.e. ``S(inf) > 1`` (S is non-decreasing and ``S(0+) = m <= 1``).

    ``S(inf) = M * w(P > 0) + m * w(P = 0)`` exceeds 1 exactly when
    ``gamma * w(P > 0) > w(P = 0)`` (as ``M - 1 = gamma * (1 - m)``); both masses
    are summed directly, free of cancellation.
    """
    inside, outside = _support_masses(ratio, weights)
    return (high - 1.0) / (1.0 - low) * inside > outside


def _support_masses(ratio: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """``(w(P > 0), w(P = 0))``, each summed directly."""
    positive = (ratio > 0).astype(np.float64)
    inside = _dot(weights, positive)
    np.subtract(1.0, positive, out=positive)
    return inside, _dot(weights, positive)


def _disjoint_support_weights(ratio: np.ndarray, weights: np.ndarray, low: float, high: float) -> np.ndarray:
    """``Q`` when no normaliser works: ``P``'s support ``S`` holds at most ``1/(gamma+1)`` of ``P0``'s mass.

    The limit ``r -> 0`` keeps ``Q = M * P0`` on ``S`` and scales ``P0`` off
    ``S`` by ``c = (1 - M * w(S)) / w(not S)``, which lies in ``[m, M]``
    exactly when ``S(inf) <= 1 <= M``.
    """
    inside, outside = _support_masses(ratio, weights)
    scale = 1.0 - (high - 1.0) * inside / outside
    return weights * np.where(ratio > 0, high, scale)


Bracket = tuple[float, float, float, float]
#: the normaliser's mass as a function of ``log t``
Mass = Callable[[float], float]


def _bracket(mass: Mass, log_t: float, value: float, saturated: Callable[[], float] | None = None
            ) -> Bracket | float | None:
    """``(a, f(a), b, f(b))`` with ``f = mass - 1``, ``a < b`` and ``f(a) < 0 < f(b)``, or a root found on the way.

    ``mass`` is non-decreasing with ``d mass / d log t <= mass``, so from a
    point with ``f`` the root lies at least ``|log(1 + f)|`` away, towards
    ``-f``; each probe goes twice the larger of that and the secant's step.
    If a probe upwards falls short and ``saturated()`` (the mass as ``t -> inf``)
    is at most ``1 + 1e-9``, there may be no root: ``None`` (the caller decides
    exactly).
    """
    x_prev, f_prev = log_t, value - 1.0
    if abs(f_prev) <= _MASS_TOLERANCE:
        return log_t
    step = abs(math.log1p(f_prev))
    for _ in range(_ROOT_STEPS):
        x = min(max(x_prev + math.copysign(2.0 * step, -f_prev), -_MAX_LOG_T), _MAX_LOG_T)
        f = mass(x) - 1.0
        if abs(f) <= _MASS_TOLERANCE:
            return x
        if (f > 0) != (f_prev > 0):
            (a, fa), (b, fb) = sorted(((x_prev, f_prev), (x, f)))
            return a, fa, b, fb
        if f < 0 and saturated is not None:
            if saturated() <= 1.0 + 1e-9:
                return None
            saturated = None
        # the secant's step when it is informative, at most 4x the last (S may be flat: then grow geometrically)
        secant = abs(f * (x - x_prev) / (f - f_prev)) if abs(f - f_prev) > 1e-12 else math.inf
        step = max(abs(math.log1p(f)), min(secant, 4.0 * step))
        x_prev, f_prev = x, f
    raise RuntimeError("LDP-Sampler: no bracket for the normaliser")  # unreachable when a root exists


def _compacted_mass(ratio: np.ndarray, weights: np.ndarray, total: float, low: float, high: float,
                    bracket: Bracket) -> Mass:
    """``mass`` on ``[a, b]`` from the ids with a breakpoint inside; the others enter as ``C + t * K``."""
    a, fa, b, fb = bracket
    ta, tb = math.exp(a), math.exp(b)
    # id x changes state inside [ta, tb] iff m/k or M/k falls in it, i.e. k in [m/tb, m/ta] or [M/tb, M/ta]
    keep, test = _flags(ratio.shape[0])
    np.greater_equal(ratio, low / tb, out=keep)
    keep &= np.less_equal(ratio, low / ta, out=test)
    np.greater_equal(ratio, high / tb, out=test)
    np.logical_and(test, np.less_equal(ratio, high / ta, out=_flags(ratio.shape[0], third=True)), out=test)
    keep |= test
    ids = np.flatnonzero(keep)
    ratio, weights = ratio[ids], weights[ids] / total

    def active(t: float) -> float:
        return t * _dot(weights, np.clip(ratio, low / t, high / t))

    fixed_a, fixed_b = fa + 1.0 - active(ta), fb + 1.0 - active(tb)
    slope = (fixed_b - fixed_a) / (tb - ta)
    intercept = fixed_a - ta * slope

    def mass(log_t: float) -> float:
        t = math.exp(log_t)
        return intercept + t * slope + active(t)

    return mass


def _solve_in_bracket(mass: Mass, bracket: Bracket) -> float:
    """Illinois regula falsi on ``f = mass - 1`` to a relative width of 1e-13 or ``|f| <= 1e-15``."""
    a, fa, b, fb = bracket
    side = 0
    for _ in range(_ROOT_STEPS):
        if b - a <= 1e-13 * max(1.0, abs(a)):
            break
        x = b - fb * (b - a) / (fb - fa)
        if not a < x < b:
            x = 0.5 * (a + b)
        f = mass(x) - 1.0
        if abs(f) <= _MASS_TOLERANCE:
            return x
        if (f > 0) == (fb > 0):
            b, fb = x, f
            if side == 1:
                fa *= 0.5
            side = 1
        else:
            a, fa = x, f
            if side == -1:
                fb *= 0.5
            side = -1
    return a if abs(fa) <= abs(fb) else b


def ldp_sampler_draw(
    p_private: np.ndarray, p_public: np.ndarray, *, epsilon: float, gamma: float, rng: np.random.Generator
) -> int:
    """One id drawn from :func:`ldp_sampler_distribution`'s ``Q``, without solving for its normaliser.

    Rejection sampling from the anchor: propose ``x ~ P0`` and accept with
    probability ``Q(x) / (M * P0(x)) = clip(k(x) * t*, m, M) / M`` (``Q <= M * P0``,
    so this is a valid acceptance probability and accepted ids follow ``Q``
    exactly; ``M`` proposals are expected, at most ``gamma + 1``).  With ``u``
    uniform, accept iff ``u * M < clip(k(x) * t*, m, M)``: always when
    ``u * M < m``, otherwise iff ``t* > tau = u * M / k(x)``, and as ``S`` is
    non-decreasing that holds iff ``S(tau) < 1``: one evaluation of ``S``
    (two passes) decides it, where the root search costs ~10.  Each
    evaluation also bounds ``t*`` (``S(t)/t`` is non-increasing), so later
    proposals are often decided without one.  When ``S`` never reaches 1
    (:func:`ldp_sampler_distribution`'s disjoint-support case) ids off
    ``P``'s support are accepted with probability ``c / M``.
    """
    private, public = _checked_pair(p_private, p_public)
    low, high = ldp_sampler_ratio_bounds(epsilon, gamma)
    weights, ratio, work = _scratch(private.shape[0])
    np.copyto(weights, public)
    proposals = BlockSampler(weights)
    if low == high:  # eps = 0: Q = P0
        return proposals.draw(rng)
    total = float(weights.sum())
    np.copyto(ratio, private)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(ratio, weights, out=ratio)
    cleaned = False

    def mass(t: float) -> float:
        nonlocal cleaned
        np.clip(ratio, low / t, high / t, out=work)
        value = t * _dot(weights, work) / total
        if math.isnan(value) and not cleaned:  # 0/0 where both are 0: those ids have no weight
            np.nan_to_num(ratio, copy=False, nan=0.0, posinf=np.inf)
            cleaned = True
            return mass(t)
        return value

    t_low, t_high = 0.0, math.inf  # t* in [t_low, t_high]
    off_support_ceiling: float | None = None  # c / M when there is no root, else m / M
    while True:
        x = proposals.draw(rng)
        threshold = float(rng.random()) * high  # accept iff threshold < clip(k(x) t*, m, M)
        if threshold < low:
            return x
        ratio_x = float(private[x]) / float(public[x])
        if ratio_x == 0.0:  # off P's support: clip(0, m, M) = m unless no root exists
            if off_support_ceiling is None:
                off_support_ceiling = low
                if not _root_exists(np.nan_to_num(ratio, nan=0.0), weights, low, high):
                    inside, outside = _support_masses(np.nan_to_num(ratio, nan=0.0), weights)
                    off_support_ceiling = 1.0 - (high - 1.0) * inside / outside
            if threshold < off_support_ceiling:
                return x
            continue
        tau = threshold / ratio_x
        if tau < t_low:
            return x
        if tau >= t_high:
            continue
        value = mass(tau)
        if value < 1.0:
            t_low = max(t_low, tau / value)
            return x
        t_high = min(t_high, tau / value)


def ldp_sampler_distribution(
    p_private: np.ndarray, p_public: np.ndarray, *, epsilon: float, gamma: float = 2.0
) -> np.ndarray:
    """The locally optimal pure ``eps``-LDP sampler (Ghoukasian, Lee & Asoodeh, NeurIPS 2025)::

        m = (gamma + 1) / (e^eps + gamma)
        Q(x) = clip(P(x) / r, m * P0(x), e^eps * m * P0(x)),   r such that sum_x Q(x) = 1

    ``P`` private, ``P0`` public anchor (``P0`` renormalised; ``P``'s scale is
    absorbed by ``r``).  Because ``Q / P0`` lies in ``[m, e^eps * m]``
    whatever ``P`` is, the output is ``eps``-LDP even when ``P`` leaves the
    ``gamma``-neighbourhood of ``P0``.  Returns ``Q`` (float64, sums to 1).

    ``r`` is found by :func:`ldp_sampler_weights`.  When ``P``'s support ``S``
    holds at most ``1/(gamma+1)`` of ``P0``'s mass (e.g. after float32
    underflow) no ``r`` works: the limit ``r -> 0`` keeps ``Q = e^eps * m * P0``
    on ``S`` and scales ``P0`` off ``S`` by the constant that makes the total
    1, which lies in ``[m, e^eps * m]``.  At ``eps = 0``, ``Q = P0``.
    """
    q = ldp_sampler_weights(p_private, p_public, epsilon=epsilon, gamma=gamma)
    q /= q.sum()
    return q


@dataclass
class LDPSampler(Policy):
    """LDP-Sampler, edge-side: the synced token is one draw from :func:`ldp_sampler_distribution`.

    ``P = p_slm`` (private), ``P0 = p_llm`` (public anchor); ``epsilon`` is
    the budget of **one token** (pure ``eps``-LDP: any two private
    distributions give output probabilities within a factor ``e^eps``), used
    as is, so every grid point is a distinct sampler.  The fusion weight
    ``alpha`` plays no part: the sampler's output replaces fusion.

    ``gamma`` (>= 1, default 2) is the neighbourhood ratio
    ``P0/gamma <= P <= gamma * P0`` the sampler is minimax-optimal for.  It
    never weakens the guarantee (``Q/P0`` stays in ``[m, e^eps * m]`` whatever
    ``P`` is); it only places that band of width ``e^eps``::

        m = (gamma + 1) / (e^eps + gamma)   rises from 2/(e^eps + 1) (gamma = 1) to 1 (gamma -> inf)

    A small ``gamma`` lets ``Q`` push unlikely tokens far below ``P0`` but
    raise a token by less than 2x; a large one lets ``Q`` raise a token by up
    to ``e^eps`` but barely lower any (at the limit ``Q = P0``).  Choose it
    as the typical ratio ``max(P/P0, P0/P)`` on the tokens that carry the
    answer, measured on *public* calibration prompts (tuning it on the private
    contexts would itself leak); the source defines no value for language
    models, and 2 is this project's default.

    The band's top ``e^eps * m = e^eps (gamma + 1) / (e^eps + gamma)`` never
    exceeds ``gamma + 1``, so once ``e^eps >> gamma`` a larger epsilon changes
    almost nothing: at ``gamma = 2`` the paper's eps = 32 and 64 give the same
    ``Q`` (total variation 1e-14 on benchmarks/policy_step's pair) and eps = 8
    is within 5e-4 of them.  Distinct settings, but not distinct samplers.

    Args:
        epsilon: per-token budget (the swept parameter).
        gamma: neighbourhood ratio the sampler is tuned for.
    """

    name = "ldp_sampler"
    modes = frozenset({"edge"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"edge": "per_token"}

    epsilon: float = 2.0
    gamma: float = 2.0

    def __post_init__(self) -> None:
        ldp_sampler_ratio_bounds(self.epsilon, self.gamma)

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """Each token: pure ``epsilon``-LDP (stated at delta 0 unless the ledger is asked for another)."""
        return ReleaseEvent("pure_dp", check_epsilon(self.epsilon),
                            note="each token: one draw of the eps-LDP sampler")

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        return SyncedToken(ldp_sampler_draw(p_slm, p_llm, epsilon=self.epsilon, gamma=self.gamma, rng=generator))
