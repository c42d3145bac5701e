"""Unit and property tests of edge_sdk.privacy_accounting."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from edge_sdk.privacy_accounting import (
    EPSILON_UNITS,
    analytic_gaussian_sigma,
    check_positive_int,
    dp_fusion_beta,
    dp_fusion_divergence_bound,
    dp_fusion_epsilon,
    dp_fusion_step_epsilon,
    dp_fusion_token_beta,
    gaussian_delta,
    gaussian_zcdp_rho,
    invisible_ink_clip,
    rdp_epsilon,
    renyi_divergence,
    standard_normal_cdf,
    symmetric_renyi_divergence,
    zcdp_epsilon,
    zcdp_rho,
)

SETTINGS = settings(max_examples=60, deadline=None)

#: the paper's swept epsilons (appendix "Defense Baseline Adaptations and Parameter Ranges")
DP_LOGIT_GRID = (0.01, 0.05, 0.1, 0.5, 1, 2, 4, 8, 16, 32, 64)
DP_FUSION_GRID = (0, 0.1, 0.5, 1, 2, 3, 4, 8, 16, 32, 64)  # edge-side; the cloud-side grid lacks 3
INVISIBLE_INK_GRID = (1, 2, 4, 8, 16, 32, 64, 128)
#: Renyi orders for dp-accounting's conversions: dense enough that its minimum is within 1e-4 of the infimum
DENSE_ORDERS = np.concatenate([1.0 + np.geomspace(1e-3, 1.0, 2000), np.geomspace(2.0, 1e6, 20000)])


def scipy_gaussian_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """Balle & Wang's Theorem 8 written out with scipy.stats.norm (an implementation independent of ours)."""
    a = sensitivity / (2 * sigma) - epsilon * sigma / sensitivity
    b = -sensitivity / (2 * sigma) - epsilon * sigma / sensitivity
    return float(stats.norm.cdf(a) - math.exp(epsilon) * stats.norm.cdf(b))


def dp_accounting_zcdp_epsilon(rho: float, delta: float) -> float:
    """dp-accounting's epsilon of rho-zCDP: RDP ``a * rho`` at every order, its CKS conversion at the best order."""
    return float(rdp.compute_epsilon(DENSE_ORDERS, rho * DENSE_ORDERS, delta)[0])


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


@SETTINGS
@given(epsilon=st.floats(0.0, 20.0), sigma=st.floats(0.05, 20.0), sensitivity=st.floats(0.1, 5.0))
def test_gaussian_delta_matches_scipy(epsilon: float, sigma: float, sensitivity: float) -> None:
    expected = scipy_gaussian_delta(epsilon, sigma, sensitivity)
    assert gaussian_delta(epsilon, sigma, sensitivity) == pytest.approx(max(expected, 0.0), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("epsilon", DP_LOGIT_GRID)
def test_dp_logit_grid_sigma_matches_scipy_and_dp_accounting(epsilon: float) -> None:
    # DP-Logit's calibration: L2 sensitivity sqrt 2, delta 1e-5
    sigma = analytic_gaussian_sigma(epsilon, 1e-5, math.sqrt(2))
    # scipy's delta at sigma meets the target, and a sigma 1e-6 smaller does not
    assert scipy_gaussian_delta(epsilon, sigma, math.sqrt(2)) <= 1e-5 * (1 + 1e-9)
    assert scipy_gaussian_delta(epsilon, sigma * (1 - 1e-6), math.sqrt(2)) > 1e-5
    # dp-accounting calibrates sensitivity 1; delta depends on sigma / D only
    assert sigma == pytest.approx(math.sqrt(2) * dp_accounting.get_sigma_gaussian(epsilon, 1e-5), rel=1e-8)


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


@SETTINGS
@given(rho=st.floats(1e-4, 50.0), delta=st.floats(1e-9, 1e-2))
def test_zcdp_epsilon_matches_dp_accounting(rho: float, delta: float) -> None:
    # dp-accounting minimises the same CKS bound over a finite grid of orders: never below the infimum
    reference = dp_accounting_zcdp_epsilon(rho, delta)
    epsilon = zcdp_epsilon(rho, delta)
    assert epsilon <= reference * (1 + 1e-9)
    assert epsilon == pytest.approx(reference, rel=1e-4)


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


# --------------------------------------------------------------------------- Gaussian zCDP, RDP conversion


@pytest.mark.parametrize(("sigma", "sensitivity"), [(1.0, 1.0), (5.3, math.sqrt(2)), (0.4, 2.0)])
def test_gaussian_zcdp_rho_matches_dp_accounting_gaussian_rdp(sigma: float, sensitivity: float) -> None:
    # dp-accounting's Gaussian RDP (noise multiplier sigma / D) and a zCDP event with our rho give one epsilon
    orders = [1.5, 2.0, 3.0, 5.0, 8.0, 16.0, 32.0, 64.0]
    gaussian = rdp.RdpAccountant(orders)
    gaussian.compose(dp_accounting.GaussianDpEvent(noise_multiplier=sigma / sensitivity), count=7)
    zcdp = rdp.RdpAccountant(orders)
    zcdp.compose(dp_accounting.ZCDpEvent(rho=gaussian_zcdp_rho(sigma, sensitivity)), count=7)
    assert zcdp.get_epsilon(1e-5) == pytest.approx(gaussian.get_epsilon(1e-5), rel=1e-9)
    # hand-worked: D = sqrt 2, sigma = 5.3: rho = 2 / (2 * 28.09) = 1 / 28.09 = 0.0355999
    assert gaussian_zcdp_rho(5.3, math.sqrt(2)) == pytest.approx(0.0355999, abs=1e-7)


def test_rdp_epsilon_hand_worked_and_never_below_the_cks_conversion() -> None:
    # (2, 256)-RDP at delta 1e-5: 256 + log(1e5) / 1 = 267.5129
    assert rdp_epsilon(256.0, 2.0, 1e-5) == pytest.approx(267.512925, abs=1e-6)
    for order, value in [(2.0, 256.0), (3.0, 1.0), (17.0, 0.25)]:
        improved, _ = rdp.compute_epsilon([order], [value], 1e-5)
        assert rdp_epsilon(value, order, 1e-5) >= improved


def test_rdp_epsilon_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="Renyi-DP epsilon"):
        rdp_epsilon(-1.0, 2.0, 1e-5)
    with pytest.raises(ValueError, match="Renyi order"):
        rdp_epsilon(1.0, 1.0, 1e-5)


# --------------------------------------------------------------------------- Renyi divergences


def test_renyi_divergences_hand_worked() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    # sum p^2/q = 0.25/0.25 + 0.25/0.75 = 4/3;  sum q^2/p = 0.0625/0.5 + 0.5625/0.5 = 1.25
    assert renyi_divergence(p, q, 2.0) == pytest.approx(math.log(4 / 3))
    assert renyi_divergence(q, p, 2.0) == pytest.approx(math.log(1.25))
    assert symmetric_renyi_divergence(p, q, 2.0) == pytest.approx(math.log(4 / 3))
    assert symmetric_renyi_divergence(p, p, 3.0) == pytest.approx(0.0, abs=1e-12)
    # order 3: sum p^3/q^2 = 0.125/0.0625 + 0.125/0.5625 = 2.2222, halved log: log(2.2222)/2 = 0.39925
    assert renyi_divergence(p, q, 3.0) == pytest.approx(0.399254, abs=1e-6)
    # a zero is floored at 1e-10: sum p^2/q over p = [1, 0], q = [0, 1] is 1/1e-10 + 1e-20 = 1e10
    assert renyi_divergence([1.0, 0.0], [0.0, 1.0]) == pytest.approx(math.log(1e10))


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


def test_dp_fusion_token_beta_hand_worked() -> None:
    # one group: a token bounded by beta costs 4 beta, so eps = 2 per token allows beta = 1/2
    assert dp_fusion_token_beta(2.0) == 0.5
    assert dp_fusion_token_beta(0.0) == 0.0
    # N = 2, a = 2: eps_step(1/4) = log(1/2 + e/2) = 0.6201145 (above), so beta(0.6201145) = 1/4
    assert dp_fusion_token_beta(0.6201145, order=2.0, n_groups=2) == pytest.approx(0.25, abs=1e-7)


@SETTINGS
@given(epsilon=st.floats(0.0, 64.0), order=st.floats(1.1, 16.0), groups=st.integers(1, 8))
def test_dp_fusion_token_beta_inverts_the_step_epsilon(epsilon: float, order: float, groups: int) -> None:
    beta = dp_fusion_token_beta(epsilon, order=order, n_groups=groups)
    assert dp_fusion_step_epsilon(beta, order, groups) == pytest.approx(epsilon, rel=1e-9, abs=1e-12)


def test_dp_fusion_divergence_bound_is_order_times_beta() -> None:
    # dp-fusion-lib: "internal bound is alpha * beta per the paper notation"
    assert dp_fusion_divergence_bound(0.5, 2.0) == 1.0
    assert dp_fusion_divergence_bound(0.1, 3.0) == pytest.approx(0.3)
    assert dp_fusion_divergence_bound(-0.2, 2.0) == -0.4
    with pytest.raises(ValueError, match="beta"):
        dp_fusion_divergence_bound(math.nan)


def test_dp_fusion_grid_collapses_per_generation_but_not_per_token() -> None:
    # the source's (eps, delta) over T = 256 tokens leaves no budget below log(1e5) = 11.51 ...
    collapsed = [e for e in DP_FUSION_GRID if dp_fusion_beta(e, max_new_tokens=256, delta=1e-5) <= 0]
    assert collapsed == [0, 0.1, 0.5, 1, 2, 3, 4, 8]
    # ... whereas per token every grid point is its own bound, b = 2 * eps / 4 at order 2
    bounds = [dp_fusion_divergence_bound(dp_fusion_token_beta(e)) for e in DP_FUSION_GRID]
    assert bounds == [e / 2 for e in DP_FUSION_GRID]


def test_dp_fusion_step_epsilon_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="beta"):
        dp_fusion_step_epsilon(-0.1)
    with pytest.raises(ValueError, match="groups"):
        dp_fusion_step_epsilon(0.1, n_groups=0)


# --------------------------------------------------------------------------- InvisibleInk


@pytest.mark.parametrize("epsilon", INVISIBLE_INK_GRID)
def test_invisible_ink_clip_spends_epsilon_by_dp_accounting(epsilon: float) -> None:
    # T tokens, each the exponential mechanism with clip C at temperature tau: (C/tau)^2/2-zCDP per token,
    # composed by dp-accounting's RDP accountant and converted at delta = 1e-6
    clip = invisible_ink_clip(epsilon, max_new_tokens=256, delta=1e-6, temperature=1.1)
    accountant = rdp.RdpAccountant(list(DENSE_ORDERS[::10]))
    accountant.compose(dp_accounting.ZCDpEvent(rho=(clip / 1.1) ** 2 / 2), count=256)
    spent = accountant.get_epsilon(1e-6)
    assert epsilon * (1 - 1e-9) <= spent <= epsilon * (1 + 1e-3)


def test_invisible_ink_clip_hand_worked() -> None:
    # eps = 10, delta = 1e-6: rho = 1.5393, whose CKS epsilon is 10 (optimal order a = 3.845 solves
    # 1.5393 * 2.845^2 = 12.46 = log(1e6) - log(3.845); then 1.5393 * 3.845 = 5.9186 and
    # (13.8155 + 2.845 * log(1 - 1/3.845) - log 3.845) / 2.845 = (13.8155 - 0.8569 - 1.3468) / 2.845 = 4.0815,
    # 5.9186 + 4.0815 = 10.000); with T = 500, tau = 1.1: C = 1.1 * sqrt(2 * 1.5393 / 500) = 0.086315
    assert zcdp_rho(10.0, 1e-6) == pytest.approx(1.5393, abs=2e-4)
    clip = invisible_ink_clip(10.0, max_new_tokens=500, delta=1e-6, temperature=1.1)
    assert clip == pytest.approx(0.086315, abs=2e-5)


def test_invisible_ink_grid_gives_distinct_clips() -> None:
    clips = [invisible_ink_clip(e, max_new_tokens=256, temperature=1.1) for e in INVISIBLE_INK_GRID]
    assert all(0 < a < b for a, b in zip(clips, clips[1:]))


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


# --------------------------------------------------------------------------- units and checks


def test_epsilon_units_are_the_documented_four() -> None:
    assert EPSILON_UNITS == ("per_token", "per_generation", "calibration", "none")


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_check_positive_int_names_the_parameter(value: float) -> None:
    with pytest.raises(ValueError, match="upload size"):
        check_positive_int(value, "upload size")
