"""Privacy accounting for the DP baselines: calibrations and conversions.

Pure ``math`` functions (no numpy, no scipy) that turn a target privacy level
into each baseline's noise or bound parameter:

* :func:`analytic_gaussian_sigma`: the Gaussian mechanism's noise scale at a
  given ``(epsilon, delta)`` (Balle & Wang 2018), used by DP-Logit;
* :func:`zcdp_epsilon` / :func:`zcdp_rho`: the zero-concentrated-DP to
  approximate-DP conversion of Canonne, Kamath & Steinke (2020) and its
  inverse, used by InvisibleInk;
* :func:`dp_fusion_step_epsilon`, :func:`dp_fusion_epsilon` and
  :func:`dp_fusion_beta`: DP-Fusion's Renyi accounting and the map from a
  total epsilon to the per-token divergence bound;
* :func:`invisible_ink_clip`: InvisibleInk's logit-difference clip from a
  total epsilon.

Every function validates its arguments and raises ``ValueError`` with the
offending value.
"""

from __future__ import annotations

import math

#: Bisection steps for the monotone one-dimensional searches below; each
#: halves a bracket, so 200 steps exhaust float64 precision from any bracket.
_BISECTION_STEPS = 200


def _check_delta(delta: float) -> float:
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


def _check_order(order: float) -> float:
    order = float(order)
    if not (order > 1.0 and math.isfinite(order)):
        raise ValueError(f"Renyi order must be finite and > 1, got {order}")
    return order


def _check_tokens(max_new_tokens: int) -> int:
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    return int(max_new_tokens)


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
    delta = _check_delta(delta)
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
    rho = float(rho)
    if not (rho >= 0.0 and math.isfinite(rho)):
        raise ValueError(f"zCDP rho must be finite and >= 0, got {rho}")
    log_inv_delta = -math.log(_check_delta(delta))
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
    return max(0.0, _zcdp_order_objective(high, rho, log_inv_delta))


def zcdp_rho(epsilon: float, delta: float) -> float:
    """The largest ``rho`` with ``zcdp_epsilon(rho, delta) <= epsilon`` (inverse of :func:`zcdp_epsilon`).

    ``zcdp_epsilon`` is non-decreasing in ``rho`` (the objective is, for every
    order ``a``), so ``rho`` is bracketed by doubling and bisected; the lower
    end is returned so the epsilon budget is never exceeded.  Returns 0 when
    even ``rho -> 0`` cannot meet ``epsilon`` strictly (``epsilon = 0``).
    """
    epsilon = check_epsilon(epsilon)
    delta = _check_delta(delta)
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


def dp_fusion_step_epsilon(beta: float, order: float = 2.0, n_groups: int = 1) -> float:
    """DP-Fusion's Renyi-DP cost of one token at divergence bound ``beta`` (Thareja et al.)::

        eps_step = log((N-1)/N + e^{(a-1)*4*beta} / N) / (a-1)

    with ``N`` private groups; for ``N = 1`` this is ``4*beta``.  Evaluated as
    ``(x - log N + log1p((N-1) e^-x)) / (a-1)`` with ``x = (a-1)*4*beta >= 0``,
    which cannot overflow.
    """
    order = _check_order(order)
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
    return _check_tokens(max_new_tokens) * step - math.log(_check_delta(delta)) / (order - 1.0)


def dp_fusion_beta(epsilon: float, *, max_new_tokens: int, delta: float = 1e-5, order: float = 2.0) -> float:
    """The per-token divergence bound that spends a total ``epsilon`` over ``T`` tokens (one group)::

        beta = (eps - log(1/delta)/(a-1)) / (4*T)

    The inverse of :func:`dp_fusion_epsilon` for ``N = 1``.  It is negative
    when ``eps <= log(1/delta)/(a-1)`` (about 11.5 at ``delta = 1e-5``,
    ``a = 2``): no private signal fits the budget and DP-Fusion falls back to
    the public distribution.
    """
    epsilon = check_epsilon(epsilon)
    order = _check_order(order)
    return (epsilon + math.log(_check_delta(delta)) / (order - 1.0)) / (4.0 * _check_tokens(max_new_tokens))


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
