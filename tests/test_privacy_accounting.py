"""Unit and property tests of edge_sdk.privacy_accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.privacy_accounting import (
    analytic_gaussian_sigma,
    dp_fusion_beta,
    dp_fusion_epsilon,
    dp_fusion_step_epsilon,
    gaussian_delta,
    invisible_ink_clip,
    standard_normal_cdf,
    zcdp_epsilon,
    zcdp_rho,
)

SETTINGS = settings(max_examples=60, deadline=None)


def brute_force_cks_epsilon(rho: float, delta: float) -> float:
    """The CKS infimum over a dense log-spaced grid of orders a in (1, 1e9]."""
    orders = np.exp(np.linspace(np.log(1 + 1e-9), np.log(1e9), 400_000))
    values = rho * orders + (-math.log(delta) + (orders - 1) * np.log1p(-1 / orders) - np.log(orders)) / (orders - 1)
    return max(0.0, float(values.min()))


# --------------------------------------------------------------------------- Gaussian mechanism


def test_standard_normal_cdf_known_values() -> None:
    assert standard_normal_cdf(0.0) == 0.5
    assert standard_normal_cdf(1.959963984540054) == pytest.approx(0.975, abs=1e-12)
    assert standard_normal_cdf(-30.0) == pytest.approx(4.906714e-198, rel=1e-6)  # erfc keeps the far tail


def test_gaussian_delta_hand_worked() -> None:
    # eps = 0, s = D = 1: Phi(1/2) - Phi(-1/2) = 2 * 0.6914625 - 1 = 0.3829249
    assert gaussian_delta(0.0, 1.0, 1.0) == pytest.approx(0.3829249, abs=1e-7)
    # eps = 1, s = D = 1: Phi(-1/2) - e * Phi(-3/2) = 0.3085375 - 2.7182818 * 0.0668072 = 0.1269370
    assert gaussian_delta(1.0, 1.0, 1.0) == pytest.approx(0.1269370, abs=1e-6)


def test_gaussian_delta_large_epsilon_does_not_overflow() -> None:
    assert 0.0 <= gaussian_delta(2000.0, 1.0, 1.0) < 1e-300


def test_analytic_sigma_hand_worked() -> None:
    # eps = 1, delta = 1e-5, D = 1: the classical bound sqrt(2 ln(1.25e5)) = 4.845 is loose;
    # the exact calibration is 3.7306 (Balle & Wang's analytic mechanism)
    sigma = analytic_gaussian_sigma(1.0, 1e-5)
    assert sigma == pytest.approx(3.7306, abs=1e-3)
    assert sigma < math.sqrt(2 * math.log(1.25 / 1e-5))


@SETTINGS
@given(
    epsilon=st.floats(0.0, 64.0),
    delta=st.floats(1e-8, 0.5),
    sensitivity=st.floats(0.01, 10.0),
)
def test_analytic_sigma_is_the_smallest_satisfying_sigma(epsilon: float, delta: float, sensitivity: float) -> None:
    # near eps = 0 delta(eps, sigma) is a difference of two terms near 1/2, so it is
    # only accurate to ~1e-16 absolute: the margins below allow for that
    sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    assert gaussian_delta(epsilon, sigma, sensitivity) <= delta
    assert gaussian_delta(epsilon, sigma * (1 - 1e-5), sensitivity) > delta
    # delta depends on sigma only through sigma / D
    assert sigma == pytest.approx(sensitivity * analytic_gaussian_sigma(epsilon, delta), rel=1e-6)


@SETTINGS
@given(epsilon=st.floats(0.0, 60.0), step=st.floats(0.01, 4.0), delta=st.floats(1e-8, 0.1))
def test_analytic_sigma_decreases_as_epsilon_grows(epsilon: float, step: float, delta: float) -> None:
    assert analytic_gaussian_sigma(epsilon + step, delta) < analytic_gaussian_sigma(epsilon, delta)


@pytest.mark.parametrize(
    ("epsilon", "delta", "sensitivity"),
    [(-0.1, 1e-5, 1.0), (math.inf, 1e-5, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1e-5, 0.0)],
)
def test_analytic_sigma_rejects_bad_input(epsilon: float, delta: float, sensitivity: float) -> None:
    with pytest.raises(ValueError):
        analytic_gaussian_sigma(epsilon, delta, sensitivity)


def test_gaussian_delta_rejects_non_positive_sigma() -> None:
    with pytest.raises(ValueError, match="sigma"):
        gaussian_delta(1.0, 0.0, 1.0)


# --------------------------------------------------------------------------- zCDP conversion


def test_zcdp_epsilon_of_zero_rho_is_zero() -> None:
    assert zcdp_epsilon(0.0, 1e-6) == 0.0


@pytest.mark.parametrize(("rho", "delta"), [(1e-4, 1e-5), (0.1, 1e-6), (1.0, 1e-6), (10.0, 1e-5)])
def test_zcdp_epsilon_matches_grid_minimum_and_beats_the_simple_bound(rho: float, delta: float) -> None:
    epsilon = zcdp_epsilon(rho, delta)
    assert epsilon == pytest.approx(brute_force_cks_epsilon(rho, delta), rel=1e-6)
    # CKS improves on Bun & Steinke's rho + 2 sqrt(rho log(1/delta)), e.g. 7.766 < 8.434 at rho = 1, delta = 1e-6
    assert epsilon < rho + 2 * math.sqrt(rho * math.log(1 / delta))


def test_zcdp_epsilon_hand_worked() -> None:
    # rho = 1, delta = 1e-6: the optimal order solves (a-1)^2 = log(1e6) - log(a), a = 4.5085,
    # giving eps = 4.5085 + (13.8155 + 3.5085 * log(1 - 1/4.5085) - log(4.5085)) / 3.5085 = 7.7662
    assert zcdp_epsilon(1.0, 1e-6) == pytest.approx(7.76622, abs=1e-5)


@SETTINGS
@given(epsilon=st.floats(0.01, 200.0), delta=st.floats(1e-9, 0.1))
def test_zcdp_rho_round_trips(epsilon: float, delta: float) -> None:
    rho = zcdp_rho(epsilon, delta)
    assert rho > 0
    recovered = zcdp_epsilon(rho, delta)
    assert recovered <= epsilon
    assert recovered == pytest.approx(epsilon, rel=1e-6)


@SETTINGS
@given(rho=st.floats(0.0, 50.0), extra=st.floats(1e-3, 5.0), delta=st.floats(1e-9, 0.1))
def test_zcdp_epsilon_is_non_decreasing_in_rho(rho: float, extra: float, delta: float) -> None:
    assert zcdp_epsilon(rho + extra, delta) >= zcdp_epsilon(rho, delta)


def test_zcdp_rho_of_zero_epsilon_is_zero() -> None:
    assert zcdp_rho(0.0, 1e-6) == 0.0


@pytest.mark.parametrize(("rho", "delta"), [(-1.0, 1e-6), (math.nan, 1e-6), (1.0, 0.0), (1.0, 2.0)])
def test_zcdp_epsilon_rejects_bad_input(rho: float, delta: float) -> None:
    with pytest.raises(ValueError):
        zcdp_epsilon(rho, delta)


# --------------------------------------------------------------------------- DP-Fusion


def test_dp_fusion_beta_hand_worked() -> None:
    # (16 - log(1e5)/1) / (4 * 256) = (16 - 11.5129255) / 1024 = 0.00438191
    assert dp_fusion_beta(16.0, max_new_tokens=256, delta=1e-5, order=2.0) == pytest.approx(0.00438191, abs=1e-8)
    # below log(1/delta)/(a-1) the bound is negative: nothing private fits
    assert dp_fusion_beta(8.0, max_new_tokens=256) < 0


def test_dp_fusion_step_epsilon_hand_worked() -> None:
    assert dp_fusion_step_epsilon(0.1, order=2.0, n_groups=1) == pytest.approx(0.4)
    # N = 2, a = 2, beta = 1/4: log(1/2 + e/2) = log(1.8591409) = 0.6201145
    assert dp_fusion_step_epsilon(0.25, order=2.0, n_groups=2) == pytest.approx(0.6201145, abs=1e-7)
    # e^(15 * 4 * 50) overflows a float; the stable form gives 4 * 50 - log(3) / 15
    assert dp_fusion_step_epsilon(50.0, order=16.0, n_groups=3) == pytest.approx(200 - math.log(3) / 15)


@SETTINGS
@given(
    epsilon=st.floats(12.0, 500.0),
    tokens=st.integers(1, 2048),
    order=st.floats(1.5, 16.0),
    delta=st.floats(1e-9, 1e-3),
)
def test_dp_fusion_beta_inverts_the_total_epsilon(epsilon: float, tokens: int, order: float, delta: float) -> None:
    beta = dp_fusion_beta(epsilon, max_new_tokens=tokens, delta=delta, order=order)
    if beta >= 0:
        assert dp_fusion_epsilon(beta, max_new_tokens=tokens, delta=delta, order=order) == pytest.approx(epsilon)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epsilon": 16.0, "max_new_tokens": 0},
        {"epsilon": 16.0, "max_new_tokens": 256, "order": 1.0},
        {"epsilon": -1.0, "max_new_tokens": 256},
        {"epsilon": 16.0, "max_new_tokens": 256, "delta": 0.0},
    ],
)
def test_dp_fusion_beta_rejects_bad_input(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        dp_fusion_beta(**kwargs)


def test_dp_fusion_step_epsilon_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="beta"):
        dp_fusion_step_epsilon(-0.1)
    with pytest.raises(ValueError, match="groups"):
        dp_fusion_step_epsilon(0.1, n_groups=0)


# --------------------------------------------------------------------------- InvisibleInk


def test_invisible_ink_clip_hand_worked() -> None:
    # C = tau * s * sqrt(2 * rho / T) with rho from the CKS inverse
    rho = zcdp_rho(10.0, 1e-6)
    expected = 1.1 * math.sqrt(2 * rho / 500)
    assert invisible_ink_clip(10.0, max_new_tokens=500, delta=1e-6, temperature=1.1) == pytest.approx(expected)


@SETTINGS
@given(epsilon=st.floats(0.1, 128.0), tokens=st.integers(1, 1024))
def test_invisible_ink_clip_halves_when_tokens_quadruple(epsilon: float, tokens: int) -> None:
    short = invisible_ink_clip(epsilon, max_new_tokens=tokens)
    long = invisible_ink_clip(epsilon, max_new_tokens=4 * tokens)
    assert long == pytest.approx(short / 2)
    # and the per-token zCDP cost of that clip composes back to epsilon
    assert zcdp_epsilon(tokens * short**2 / 2, 1e-6) == pytest.approx(epsilon, rel=1e-6)


def test_invisible_ink_clip_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="temperature"):
        invisible_ink_clip(1.0, max_new_tokens=10, temperature=0.0)
    with pytest.raises(ValueError, match="private references"):
        invisible_ink_clip(1.0, max_new_tokens=10, n_private=0)
