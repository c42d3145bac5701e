"""Privacy accounting for the DP baselines: calibrations, conversions, divergences.

Functions that turn a target privacy level into each baseline's noise or
bound parameter, and the quantities that accounting is stated in:

* :func:`analytic_gaussian_sigma`: the Gaussian mechanism's noise scale at a
  given ``(epsilon, delta)`` (Balle & Wang 2018), used by DP-Logit,
  :func:`gaussian_composition_epsilon`, the exact epsilon of ``n`` of them,
  and :func:`gaussian_zcdp_rho`, their zero-concentrated-DP cost;
* :func:`zcdp_epsilon` / :func:`zcdp_rho`: the zero-concentrated-DP to
  approximate-DP conversion of Canonne, Kamath & Steinke (2020) and its
  inverse, used by InvisibleInk (:func:`zcdp_optimal_order` the order it converts at); :func:`rdp_epsilon` the
  improved Renyi-DP one, and :func:`renyi_composition_epsilon` ``n`` releases at one Renyi order through it;
* :func:`randomized_response_noise`: binary randomised response at a given loss, the mechanism that dominates
  every pure-DP one (LDP-Sampler's accounting);
* :func:`renyi_divergence`: the divergence DP-Fusion bounds;
* :func:`dp_fusion_context_orders`, :func:`dp_fusion_pair_rdp` and
  :func:`dp_fusion_bound`: DP-Fusion's bound between any two private contexts
  (the weak triangle inequality through the public row) and its inverse;
* :func:`invisible_ink_clip`: InvisibleInk's logit-difference clip from a
  total epsilon.

Each baseline says what its ``epsilon`` covers (:data:`EPSILON_UNITS`):
one token, one whole generation, or nothing provable ("calibration": a knob
calibrated by a DP formula whose release is not DP).  Every function
validates its arguments and raises ``ValueError`` with the offending value;
the checks are public so the policies validate the same way.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

#: What a baseline's ``epsilon`` bounds: the privacy loss of one token
#: ("per_token"), of a whole generation of ``max_new_tokens`` tokens
#: ("per_generation"), or nothing ("calibration": the number sets a
#: parameter through a DP formula but the released values carry no DP
#: guarantee); "none" for a policy with no epsilon at all.
EpsilonUnit = Literal["per_token", "per_generation", "calibration", "none"]
EPSILON_UNITS: tuple[str, ...] = ("per_token", "per_generation", "calibration", "none")

#: DP-Fusion's floor on probabilities: both rows are floored and renormalised before they are bounded and drawn from
RENYI_PROBABILITY_FLOOR = 1e-10

#: Bisection steps for the monotone one-dimensional searches below; each
#: halves a bracket, so 200 steps exhaust float64 precision from any bracket.
_BISECTION_STEPS = 200


def check_delta(delta: float) -> float:
    """Return ``delta`` as a float if ``0 < delta < 1``, else raise ``ValueError``."""
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return delta


def check_epsilon(epsilon: float) -> float:
    """Return ``epsilon`` as a float if it is a finite, non-negative privacy budget, else raise ``ValueError``."""
    epsilon = float(epsilon)
    if not (epsilon >= 0.0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    return epsilon


def check_order(order: float) -> float:
    """Return the Renyi order as a float if it is finite and ``> 1``, else raise ``ValueError``."""
    order = float(order)
    if not (order > 1.0 and math.isfinite(order)):
        raise ValueError(f"Renyi order must be finite and > 1, got {order}")
    return order


def check_positive_int(value: int, what: str) -> int:
    """Return ``value`` as an int if it is a positive integer, else raise ``ValueError`` naming ``what``."""
    if int(value) != value or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value}")
    return int(value)


def _check_tokens(max_new_tokens: int) -> int:
    return check_positive_int(max_new_tokens, "max_new_tokens")


def standard_normal_cdf(x: float) -> float:
    """``Phi(x) = erfc(-x / sqrt 2) / 2`` (``erfc`` keeps the lower tail's relative precision)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """The exact ``delta`` of the Gaussian mechanism at ``epsilon`` (Balle & Wang 2018, Thm. 8)::

        delta(eps, s) = Phi(D/(2s) - eps*s/D) - e^eps * Phi(-D/(2s) - eps*s/D)

    for noise ``N(0, s^2 I)`` added to a query of L2 sensitivity ``D``.  The
    second term is formed as ``exp(eps + log Phi(.))`` so a large ``eps``
    cannot overflow.
    """
    epsilon = check_epsilon(epsilon)
    if not sigma > 0:
        raise ValueError(f"noise scale sigma must be > 0, got {sigma}")
    if not sensitivity > 0:
        raise ValueError(f"L2 sensitivity must be > 0, got {sensitivity}")
    half_ratio = sensitivity / (2.0 * sigma)
    shift = epsilon * sigma / sensitivity
    upper = standard_normal_cdf(half_ratio - shift)
    lower_tail = standard_normal_cdf(-half_ratio - shift)
    scaled_lower = math.exp(epsilon + math.log(lower_tail)) if lower_tail > 0.0 else 0.0
    return max(0.0, upper - scaled_lower)


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """The smallest ``sigma`` with ``gaussian_delta(epsilon, sigma, sensitivity) <= delta``.

    ``delta(eps, s)`` falls monotonically from 1 (``s -> 0``) to 0
    (``s -> inf``), so the answer is bracketed by doubling/halving from
    ``s = D`` and then bisected; the upper end of the final bracket is
    returned, so the condition always holds.  Unlike the classical
    ``sigma = D * sqrt(2 ln(1.25/delta)) / eps`` this is valid for every
    ``eps >= 0`` (including ``eps >= 1`` and ``eps = 0``).
    """
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    if not sensitivity > 0:
        raise ValueError(f"L2 sensitivity must be > 0, got {sensitivity}")

    def satisfied(sigma: float) -> bool:
        return gaussian_delta(epsilon, sigma, sensitivity) <= delta

    high = float(sensitivity)
    while not satisfied(high):
        high *= 2.0
    low = high
    while satisfied(low):
        low /= 2.0
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if satisfied(middle):
            high = middle
        else:
            low = middle
    return high


def gaussian_composition_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """The exact ``epsilon`` at ``delta`` of ``n`` Gaussian mechanisms, each of noise multiplier ``z = sigma / D``.

    ``n`` such releases are exactly one Gaussian mechanism of sensitivity ``sqrt(n)`` at noise 1 times ``z``
    (Dong, Roth & Su 2019: ``mu``-GDP with ``mu = sqrt(n) / z`` composes by adding ``mu^2``), whose privacy
    profile is :func:`gaussian_delta` (Balle & Wang 2018, Thm. 8).  ``delta(eps)`` falls with ``eps``, so the
    smallest ``eps >= 0`` with ``gaussian_delta(eps) <= delta`` is bracketed by doubling and bisected; the upper
    end is returned, so ``delta`` always holds.  ``n = 0`` is 0.
    """
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise multiplier must be finite and > 0, got {noise_multiplier}")
    delta = check_delta(delta)
    releases = int(releases)
    if releases < 0:
        raise ValueError(f"number of releases must be >= 0, got {releases}")
    sensitivity = math.sqrt(releases)
    if releases == 0 or gaussian_delta(0.0, noise_multiplier, sensitivity) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gaussian_delta(high, noise_multiplier, sensitivity) > delta:
        low, high = high, 2.0 * high
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if gaussian_delta(middle, noise_multiplier, sensitivity) <= delta:
            high = middle
        else:
            low = middle
    return high


def gaussian_zcdp_rho(sigma: float, sensitivity: float = 1.0) -> float:
    """The Gaussian mechanism's zero-concentrated-DP cost ``rho = D^2 / (2 sigma^2)`` (Bun & Steinke 2016, Prop. 1.6).

    Equivalently it is ``(a, a * rho)``-Renyi-DP at every order ``a > 1``
    (Mironov 2017, Prop. 7); ``T`` releases compose to ``T * rho``-zCDP, which
    :func:`zcdp_epsilon` converts to ``(eps, delta)``.
    """
    if not sigma > 0:
        raise ValueError(f"noise scale sigma must be > 0, got {sigma}")
    if not sensitivity > 0:
        raise ValueError(f"L2 sensitivity must be > 0, got {sensitivity}")
    return sensitivity**2 / (2.0 * sigma**2)


def zcdp_epsilon(rho: float, delta: float) -> float:
    """``rho``-zCDP implies ``(eps, delta)``-DP with (Canonne, Kamath & Steinke 2020, Prop. 12)::

        eps(rho, delta) = inf_{a > 1}  rho*a + (log(1/delta) + (a-1)*log(1-1/a) - log(a)) / (a-1)

    The objective's derivative is ``f'(a) = rho - (log(1/delta) - log a) / (a-1)^2``,
    which increases through zero exactly once on ``(1, 1/delta)`` when
    ``rho > 0``; the minimiser solves ``rho*(a-1)^2 = log(1/delta) - log a``
    (an increasing function of ``a``) and is found by bisection.  The result
    is floored at 0 (``rho = 0`` gives ``log(1 - delta) < 0`` there).
    """
    order = zcdp_optimal_order(rho, delta)
    return rdp_epsilon(float(rho) * order, order, delta)  # rho-zCDP is (a, rho*a)-RDP at every order a


def zcdp_optimal_order(rho: float, delta: float) -> float:
    """The Renyi order at which :func:`zcdp_epsilon`'s infimum is attained (the upper end of its bisection).

    The root of ``rho*(a-1)^2 = log(1/delta) - log a`` on ``(1, 1/delta)``
    (``1/delta`` when ``rho = 0``).  An RDP accountant that converts at this
    order among others reproduces the CKS conversion of ``rho``-zCDP.
    """
    rho = float(rho)
    if not (rho >= 0.0 and math.isfinite(rho)):
        raise ValueError(f"zCDP rho must be finite and >= 0, got {rho}")
    log_inv_delta = -math.log(check_delta(delta))
    low, high = 1.0, 1.0 / float(delta)
    if rho > 0.0:
        # the root has rho*(a-1)^2 <= log(1/delta): a tight upper end, so 200 halvings reach it at any delta
        high = min(high, 1.0 + math.sqrt(log_inv_delta / rho))
        for _ in range(_BISECTION_STEPS):
            middle = 0.5 * (low + high)
            if middle in (low, high):
                break
            if rho * (middle - 1.0) * (middle - 1.0) < log_inv_delta - math.log(middle):  # no ** overflow
                low = middle
            else:
                high = middle
    return high


def zcdp_rho(epsilon: float, delta: float) -> float:
    """The largest ``rho`` with ``zcdp_epsilon(rho, delta) <= epsilon`` (inverse of :func:`zcdp_epsilon`).

    ``zcdp_epsilon`` is non-decreasing in ``rho`` (the objective is, for every
    order ``a``), so ``rho`` is bracketed by doubling and bisected; the lower
    end is returned so the epsilon budget is never exceeded.  Returns 0 when
    even ``rho -> 0`` cannot meet ``epsilon`` strictly (``epsilon = 0``).
    """
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    if epsilon == 0.0:
        return 0.0
    low, high = 0.0, max(1.0, epsilon)
    while zcdp_epsilon(high, delta) <= epsilon:
        low, high = high, 2.0 * high
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if zcdp_epsilon(middle, delta) <= epsilon:
            low = middle
        else:
            high = middle
    return low


def rdp_epsilon(rdp: float, order: float, delta: float) -> float:
    """``(a, e)``-Renyi-DP implies ``(eps, delta)``-DP with the improved conversion::

        eps = max(0, e + log(1 - 1/a) - (log(delta) + log(a)) / (a - 1))

    (Balle et al. 2020, Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12; dp-accounting's own).  It is
    ``log(a)/(a-1) - log(1 - 1/a)`` below Mironov's plain ``e + log(1/delta)/(a-1)`` (1.386 at order 2).
    """
    if not (rdp >= 0.0 and math.isfinite(rdp)):
        raise ValueError(f"Renyi-DP epsilon must be finite and >= 0, got {rdp}")
    order = check_order(order)
    log_delta = math.log(check_delta(delta))
    return max(0.0, rdp + math.log1p(-1.0 / order) - (log_delta + math.log(order)) / (order - 1.0))


def renyi_composition_epsilon(releases: int, step_rdp: float, order: float, delta: float) -> float:
    """``(eps, delta)`` of ``n`` releases each ``(a, e)``-Renyi-DP at the one order ``a``::

        eps(n) = n * e + log(1 - 1/a) - (log(delta) + log(a)) / (a - 1)      (n >= 1; eps(0) = 0)

    Renyi-DP at a fixed order composes by adding (Mironov 2017, Prop. 1):
    ``n`` releases are ``(a, n * e)``-RDP, converted by the improved conversion
    (:func:`rdp_epsilon`; DP-Fusion's source uses
    Mironov's plain one, 1.386 looser at order 2).
    Nothing released (``n = 0``, or ``e = 0``: every release is the public
    distribution itself) is 0.  dp-accounting's RDP accountant cannot do
    this: its events bound every order of its grid, DP-Fusion's bound holds
    at ``a`` alone.
    """
    if releases == 0 or step_rdp == 0.0:
        return 0.0
    return rdp_epsilon(releases * step_rdp, order, delta)


def renyi_divergence(p: np.ndarray, q: np.ndarray, order: float = 2.0) -> float:
    """``D_a(p||q) = log(sum_i p_i^a q_i^(1-a)) / (a-1)``, exact: ``inf`` where ``p`` has mass ``q`` lacks."""
    order = check_order(order)
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if np.any((q == 0) & (p > 0)):
        return math.inf
    support = p > 0
    total = float(np.sum(p[support] * (p[support] / q[support]) ** (order - 1.0)))
    return math.log(total) / (order - 1.0)


def dp_fusion_context_orders(order: float) -> tuple[float, float]:
    """The orders ``(2a, 2a - 1)`` at which DP-Fusion bounds each context's mixture against the public row.

    Mironov's weak triangle inequality (2017, Prop. 11, at ``p = q = 2``) gives, for any three
    distributions::

        D_a(P||R) <= (a - 1/2)/(a - 1) * D_2a(P||Q) + D_(2a-1)(Q||R)

    With ``Q`` the public row and ``P, R`` the mixtures of two private contexts, bounding
    ``D_2a(m||q)`` and ``D_(2a-1)(q||m)`` for every context bounds ``D_a`` between any two of them.
    """
    order = check_order(order)
    return 2.0 * order, 2.0 * order - 1.0


def dp_fusion_pair_rdp(bound: float, order: float = 2.0) -> float:
    """The Renyi-DP cost at order ``a`` of one token, **any two private contexts**, when each context's
    mixture has ``D_2a(m||q) <= b`` and ``D_(2a-1)(q||m) <= b`` (:func:`dp_fusion_context_orders`)::

        eps_token = ((a - 1/2)/(a - 1) + 1) * b = (4a - 3) / (2a - 2) * b        (5b/2 at order 2)

    Against the public row alone (the source's relation, a context against none) the same token costs ``b``:
    ``D_a <= D_2a`` and ``D_a <= D_(2a-1)`` (Renyi divergences grow with the order).
    """
    order = check_order(order)
    if not (bound >= 0.0 and math.isfinite(bound)):
        raise ValueError(f"DP-Fusion divergence bound must be finite and >= 0, got {bound}")
    return (4.0 * order - 3.0) / (2.0 * order - 2.0) * bound


def dp_fusion_bound(epsilon: float, order: float = 2.0) -> float:
    """The per-context bound ``b`` whose token costs Renyi-DP ``epsilon`` at order ``a`` between any two
    contexts: the inverse of :func:`dp_fusion_pair_rdp`, ``b = (2a - 2) / (4a - 3) * eps`` (``0.4 eps`` at 2)."""
    order = check_order(order)
    return (2.0 * order - 2.0) / (4.0 * order - 3.0) * check_epsilon(epsilon)


def invisible_ink_clip(
    epsilon: float,
    *,
    max_new_tokens: int,
    delta: float = 1e-6,
    temperature: float = 1.0,
    n_private: int = 1,
) -> float:
    """InvisibleInk's clip bound ``C`` for a total ``(epsilon, delta)`` over ``T`` tokens, any two contexts.

    Sampling ``softmax(z_bar / tau)`` with ``z_bar = z_pub + clip(z_priv - z_pub, -C, C)`` averaged over ``s``
    private references: each logit of ``z_bar`` moves by at most ``C/s`` between a context and none (the
    source's relation) and by ``Delta = 2C/s`` between any two contexts.  The exponential mechanism with
    scores of sensitivity ``Delta`` is ``(2 Delta / tau)``-bounded-range, hence ``(Delta/tau)^2 / 2``-zCDP
    (Cesar & Rogers 2021), so ``rho_token = 2 (C / (s*tau))^2`` between two contexts (four times the source's
    ``(C / (s*tau))^2 / 2``).  Composing ``T`` tokens and converting with Canonne-Kamath-Steinke::

        rho = zcdp_rho(eps, delta),   rho_token = rho / T,   C = tau * s * sqrt(rho_token / 2)
    """
    if not temperature > 0:
        raise ValueError(f"sampling temperature must be > 0, got {temperature}")
    if int(n_private) != n_private or n_private < 1:
        raise ValueError(f"number of private references must be a positive integer, got {n_private}")
    rho_token = zcdp_rho(epsilon, delta) / _check_tokens(max_new_tokens)
    return temperature * n_private * math.sqrt(0.5 * rho_token)


def randomized_response_noise(epsilon: float) -> float:
    """dp-accounting's noise parameter ``p`` of binary randomised response whose loss is ``epsilon``.

    Binary randomised response reports the true bit with probability
    ``1 - p/2`` and the other with ``p/2``; its privacy loss is
    ``log((1 - p/2) / (p/2)) = epsilon`` for ``p = 2 / (1 + e^epsilon)``.  It
    dominates every pure ``epsilon``-DP mechanism, and so does its ``n``-fold
    composition dominate ``n`` of them (Kairouz, Oh & Viswanath 2015, Thm. 3.3),
    so its PLD composes an ``epsilon``-LDP sampler tightly.
    """
    return 2.0 / (1.0 + math.exp(check_epsilon(epsilon)))
