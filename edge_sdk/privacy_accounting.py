"""Privacy accounting for the DP baselines: calibrations, conversions, divergences.

Functions that turn a target privacy level into each baseline's noise or
bound parameter, and the quantities that accounting is stated in:

* :func:`analytic_gaussian_sigma`: the Gaussian mechanism's noise scale at a
  given ``(epsilon, delta)`` (Balle & Wang 2018), used by DP-Logit, and
  :func:`gaussian_zcdp_rho`, its zero-concentrated-DP cost;
* :func:`zcdp_epsilon` / :func:`zcdp_rho`: the zero-concentrated-DP to
  approximate-DP conversion of Canonne, Kamath & Steinke (2020) and its
  inverse, used by InvisibleInk (:func:`zcdp_optimal_order` the order it converts at); :func:`rdp_epsilon` the plain Renyi-DP one;
* :func:`renyi_divergence` / :func:`symmetric_renyi_divergence`: the
  divergences DP-Fusion bounds;
* :func:`dp_fusion_step_epsilon`, :func:`dp_fusion_epsilon`,
  :func:`dp_fusion_beta`, :func:`dp_fusion_token_beta` and
  :func:`dp_fusion_divergence_bound`: DP-Fusion's Renyi accounting and the
  maps from an epsilon to the per-token divergence bound;
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

#: DP-Fusion's floor on probabilities inside the Renyi divergence (the source clamps at 1e-10).
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


def _zcdp_order_objective(order: float, rho: float, log_inv_delta: float) -> float:
    """``f(a) = rho*a + (log(1/delta) + (a-1)*log(1-1/a) - log(a)) / (a-1)``."""
    return rho * order + (log_inv_delta + (order - 1.0) * math.log1p(-1.0 / order) - math.log(order)) / (order - 1.0)


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
    return max(0.0, _zcdp_order_objective(order, float(rho), -math.log(float(delta))))


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
        for _ in range(_BISECTION_STEPS):
            middle = 0.5 * (low + high)
            if middle in (low, high):
                break
            if rho * (middle - 1.0) ** 2 < log_inv_delta - math.log(middle):
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
    """``(a, eps_a)``-Renyi-DP implies ``(eps_a + log(1/delta)/(a-1), delta)``-DP (Mironov 2017, Prop. 3).

    The conversion DP-Fusion's accounting uses; CKS's sharper one (Prop. 12,
    :func:`zcdp_epsilon`'s objective at one order) subtracts a further
    ``log(a)/(a-1) - log(1 - 1/a)`` that this one keeps, so it is never smaller.
    """
    if not (rdp >= 0.0 and math.isfinite(rdp)):
        raise ValueError(f"Renyi-DP epsilon must be finite and >= 0, got {rdp}")
    return rdp - math.log(check_delta(delta)) / (check_order(order) - 1.0)


def renyi_divergence(p: np.ndarray, q: np.ndarray, order: float = 2.0) -> float:
    """``D_a(p||q) = log(sum_i p_i^a q_i^(1-a)) / (a-1)`` with ``p, q`` floored at 1e-10 (not renormalised)."""
    order = check_order(order)
    p = np.maximum(np.asarray(p, dtype=np.float64), RENYI_PROBABILITY_FLOOR)
    q = np.maximum(np.asarray(q, dtype=np.float64), RENYI_PROBABILITY_FLOOR)
    return math.log(float(np.dot(p, (p / q) ** (order - 1.0)))) / (order - 1.0)


def symmetric_renyi_divergence(p: np.ndarray, q: np.ndarray, order: float = 2.0) -> float:
    """DP-Fusion's ``D(p, q) = max(D_a(p||q), D_a(q||p))`` (floored at 1e-10 as in :func:`renyi_divergence`)."""
    return max(renyi_divergence(p, q, order), renyi_divergence(q, p, order))


def dp_fusion_step_epsilon(beta: float, order: float = 2.0, n_groups: int = 1) -> float:
    """DP-Fusion's Renyi-DP cost of one token at divergence bound ``beta`` (Thareja et al.)::

        eps_step = log((N-1)/N + e^{(a-1)*4*beta} / N) / (a-1)

    with ``N`` private groups; for ``N = 1`` this is ``4*beta``.  Evaluated as
    ``(x - log N + log1p((N-1) e^-x)) / (a-1)`` with ``x = (a-1)*4*beta >= 0``,
    which cannot overflow.
    """
    order = check_order(order)
    if not (beta >= 0.0 and math.isfinite(beta)):
        raise ValueError(f"divergence bound beta must be finite and >= 0, got {beta}")
    if int(n_groups) != n_groups or n_groups < 1:
        raise ValueError(f"number of private groups must be a positive integer, got {n_groups}")
    exponent = (order - 1.0) * 4.0 * beta
    return (exponent - math.log(n_groups) + math.log1p((n_groups - 1) * math.exp(-exponent))) / (order - 1.0)


def dp_fusion_epsilon(
    beta: float, *, max_new_tokens: int, delta: float = 1e-5, order: float = 2.0, n_groups: int = 1
) -> float:
    """DP-Fusion's total ``(eps, delta)`` over ``T`` tokens each bounded by ``beta`` (worst case)::

        eps = T * eps_step(beta) + log(1/delta) / (a-1)

    which is ``4*T*beta + log(1/delta)/(a-1)`` for one private group.
    """
    step = dp_fusion_step_epsilon(beta, order, n_groups)
    return _check_tokens(max_new_tokens) * step - math.log(check_delta(delta)) / (order - 1.0)


def dp_fusion_beta(epsilon: float, *, max_new_tokens: int, delta: float = 1e-5, order: float = 2.0) -> float:
    """The per-token divergence budget that spends a total ``(epsilon, delta)`` over ``T`` tokens (one group)::

        beta = (eps - log(1/delta)/(a-1)) / (4*T)

    The inverse of :func:`dp_fusion_epsilon` for ``N = 1`` (the source's
    worst-case accounting).  It is negative when ``eps <= log(1/delta)/(a-1)``
    (about 11.5 at ``delta = 1e-5``, ``a = 2``): the Renyi-to-``(eps, delta)``
    conversion alone costs that much, so no private signal fits the budget.
    Hence :class:`~edge_sdk.policies.dp_fusion.DPFusion` reads its ``epsilon``
    per token (:func:`dp_fusion_token_beta`) instead.
    """
    epsilon = check_epsilon(epsilon)
    order = check_order(order)
    return (epsilon + math.log(check_delta(delta)) / (order - 1.0)) / (4.0 * _check_tokens(max_new_tokens))


def dp_fusion_token_beta(epsilon: float, *, order: float = 2.0, n_groups: int = 1) -> float:
    """The divergence budget ``beta`` whose one token costs Renyi-DP ``epsilon`` at order ``a``.

    The inverse of :func:`dp_fusion_step_epsilon`: with ``x = (a-1) * eps``,
    ``e^x = (N-1)/N + e^{(a-1)*4*beta}/N`` gives::

        beta = (x + log(N - (N-1) e^-x)) / (4 * (a-1))       (= eps / 4 for one group)

    Unlike :func:`dp_fusion_beta` this needs no ``delta``: a per-token
    Renyi-DP budget is positive for every ``eps > 0``, and ``T`` such tokens
    are ``(a, T * eps)``-Renyi-DP, i.e. ``(rdp_epsilon(T * eps, a, delta), delta)``-DP.
    """
    epsilon = check_epsilon(epsilon)
    order = check_order(order)
    n_groups = check_positive_int(n_groups, "number of private groups")
    exponent = (order - 1.0) * epsilon
    return (exponent + math.log(n_groups - (n_groups - 1) * math.exp(-exponent))) / (4.0 * (order - 1.0))


def dp_fusion_divergence_bound(beta: float, order: float = 2.0) -> float:
    """The bound DP-Fusion's mixing weight enforces on the symmetric divergence: ``b = a * beta``.

    The reference library (dp-fusion-lib) takes ``beta`` "in paper notation"
    and bounds ``max(D_a(mix||pub), D_a(pub||mix))`` by ``a * beta``; the
    accounting above is in terms of ``beta``.  A negative ``beta`` maps to a
    negative bound (no private signal: ``lambda = 0``).
    """
    if not math.isfinite(beta):
        raise ValueError(f"divergence budget beta must be finite, got {beta}")
    return check_order(order) * float(beta)


def invisible_ink_clip(
    epsilon: float,
    *,
    max_new_tokens: int,
    delta: float = 1e-6,
    temperature: float = 1.0,
    n_private: int = 1,
) -> float:
    """InvisibleInk's clip bound ``C`` for a total ``(epsilon, delta)`` over ``T`` tokens.

    Sampling ``softmax(z_bar / tau)`` with differences clipped to ``[-C, C]``
    and ``s`` private references is ``rho_token = (C / (s*tau))^2 / 2``-zCDP per
    token; composing ``T`` tokens and converting with Canonne-Kamath-Steinke::

        rho = zcdp_rho(eps, delta),   rho_token = rho / T,   C = tau * s * sqrt(2 * rho_token)
    """
    if not temperature > 0:
        raise ValueError(f"sampling temperature must be > 0, got {temperature}")
    if int(n_private) != n_private or n_private < 1:
        raise ValueError(f"number of private references must be a positive integer, got {n_private}")
    rho_token = zcdp_rho(epsilon, delta) / _check_tokens(max_new_tokens)
    return temperature * n_private * math.sqrt(2.0 * rho_token)
