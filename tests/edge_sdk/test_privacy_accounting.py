"""Unit and property tests of edge_sdk.privacy.analysis."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

from edge_sdk.privacy.analysis import (
    EPSILON_UNITS,
    analytic_gaussian_sigma,
    check_positive_int,
    dp_fusion_bound,
    dp_fusion_context_orders,
    dp_fusion_pair_rdp,
    gaussian_composition_epsilon,
    gaussian_delta,
    gaussian_zcdp_rho,
    invisible_ink_clip,
    rdp_epsilon,
    renyi_divergence,
    standard_normal_cdf,
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


@pytest.mark.slow
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


def test_rdp_epsilon_is_the_improved_conversion_hand_worked_and_by_dp_accounting() -> None:
    # (2, 256)-RDP at delta 1e-5: 256 + log(1/2) - (log(1e-5) + log 2) / 1 = 256 - 0.693147 + 11.512925 - 0.693147
    assert rdp_epsilon(256.0, 2.0, 1e-5) == pytest.approx(266.126631, abs=1e-6)
    # Mironov's plain conversion is log(2)/1 - log(1/2) = 1.386 looser at order 2
    assert 256.0 + math.log(1e5) - rdp_epsilon(256.0, 2.0, 1e-5) == pytest.approx(2 * math.log(2.0))
    for order, value in [(2.0, 256.0), (3.0, 1.0), (17.0, 0.25), (1.5, 24.0)]:
        reference, _ = rdp.compute_epsilon([order], [value], 1e-5)  # dp-accounting's conversion at that order
        assert rdp_epsilon(value, order, 1e-5) == pytest.approx(reference, rel=1e-12)
    assert rdp_epsilon(0.0, 2.0, 0.5) == 0.0  # floored at 0


def test_rdp_epsilon_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="Renyi-DP epsilon"):
        rdp_epsilon(-1.0, 2.0, 1e-5)
    with pytest.raises(ValueError, match="Renyi order"):
        rdp_epsilon(1.0, 1.0, 1e-5)


# --------------------------------------------------------------------------- the Gaussian composition


def scipy_composition_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """n Gaussians at noise multiplier z are mu-GDP with mu = sqrt(n)/z: its profile with scipy, solved by brentq."""
    mu = math.sqrt(releases) / noise_multiplier

    def excess(epsilon: float) -> float:
        return float(stats.norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * stats.norm.cdf(-mu / 2 - epsilon / mu)
                     - delta)

    return 0.0 if excess(0.0) <= 0 else float(optimize.brentq(excess, 0.0, 500.0, xtol=1e-12))


@pytest.mark.parametrize(("noise_multiplier", "releases"), [(3.73, 1), (3.73, 24), (3.73, 256), (0.5, 3), (40.0, 10)])
def test_gaussian_composition_epsilon_is_the_exact_gdp_profile(noise_multiplier: float, releases: int) -> None:
    assert gaussian_composition_epsilon(noise_multiplier, releases, 1e-5) == pytest.approx(
        scipy_composition_epsilon(noise_multiplier, releases, 1e-5), rel=1e-7, abs=1e-9)


def test_gaussian_composition_epsilon_matches_dp_accountings_pld() -> None:
    from dp_accounting.pld import PLDAccountant

    sigma = analytic_gaussian_sigma(1.0, 1e-5, math.sqrt(2.0))
    for releases in (1, 24):
        pld = PLDAccountant(value_discretization_interval=1e-4)
        pld.compose(dp_accounting.GaussianDpEvent(sigma / math.sqrt(2.0)), releases)
        exact = gaussian_composition_epsilon(sigma / math.sqrt(2.0), releases, 1e-5)
        assert exact == pytest.approx(pld.get_epsilon(1e-5), abs=2e-3)
    # one token is exactly the calibrated epsilon (the RDP conversion read 1.09); 24 read 6.02 (RDP: 6.49)
    assert gaussian_composition_epsilon(sigma / math.sqrt(2.0), 1, 1e-5) == pytest.approx(1.0, abs=1e-9)
    assert gaussian_composition_epsilon(sigma / math.sqrt(2.0), 24, 1e-5) == pytest.approx(6.02, abs=5e-3)
    assert gaussian_composition_epsilon(sigma / math.sqrt(2.0), 0, 1e-5) == 0.0


# --------------------------------------------------------------------------- Renyi divergences


def test_renyi_divergences_hand_worked() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    # sum p^2/q = 0.25/0.25 + 0.25/0.75 = 4/3;  sum q^2/p = 0.0625/0.5 + 0.5625/0.5 = 1.25
    assert renyi_divergence(p, q, 2.0) == pytest.approx(math.log(4 / 3))
    assert renyi_divergence(q, p, 2.0) == pytest.approx(math.log(1.25))
    assert renyi_divergence(p, p, 3.0) == pytest.approx(0.0, abs=1e-12)
    # order 3: sum p^3/q^2 = 0.125/0.0625 + 0.125/0.5625 = 2.2222, halved log: log(2.2222)/2 = 0.39925
    assert renyi_divergence(p, q, 3.0) == pytest.approx(0.399254, abs=1e-6)
    # exact: mass where the second has none is an infinite divergence; none where the first has none adds nothing
    assert renyi_divergence([1.0, 0.0], [0.0, 1.0]) == math.inf
    assert renyi_divergence([1.0, 0.0], [0.5, 0.5]) == pytest.approx(math.log(2.0))


# --------------------------------------------------------------------------- DP-Fusion


def test_dp_fusion_pair_bound_hand_worked() -> None:
    # order 2: the context orders are 4 and 3, and eps_token = ((2 - 1/2)/(2 - 1) + 1) * b = 2.5 b
    assert dp_fusion_context_orders(2.0) == (4.0, 3.0)
    assert dp_fusion_pair_rdp(0.4, 2.0) == pytest.approx(1.0)
    assert dp_fusion_bound(1.0, 2.0) == pytest.approx(0.4)
    # order 3: orders 6 and 5, ((3 - 1/2)/2 + 1) b = 2.25 b
    assert dp_fusion_pair_rdp(1.0, 3.0) == pytest.approx(2.25)
    assert dp_fusion_bound(0.0) == 0.0
    with pytest.raises(ValueError, match="epsilon"):
        dp_fusion_bound(-1.0)
    with pytest.raises(ValueError, match="bound"):
        dp_fusion_pair_rdp(math.nan)


def plain_renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """D_a(p||q) written out (p, q positive)."""
    return float(np.log(np.sum(p**order * q ** (1 - order))) / (order - 1))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 12), order=st.sampled_from([1.5, 2.0, 3.0]))
def test_the_weak_triangle_inequality_the_pair_bound_rests_on(seed: int, size: int, order: float) -> None:
    """Mironov 2017, Prop. 11 at p = q = 2, on random triples: D_a(P||R) <= (a-1/2)/(a-1) D_2a(P||Q) +
    D_(2a-1)(Q||R), so a bound b on both context terms bounds any pair by dp_fusion_pair_rdp(b)."""
    rng = np.random.default_rng(seed)
    p, q, r = (rng.dirichlet(np.full(size, 0.5)) + 1e-12 for _ in range(3))
    p, q, r = p / p.sum(), q / q.sum(), r / r.sum()
    forward, reverse = dp_fusion_context_orders(order)
    bound = max(plain_renyi(p, q, forward), plain_renyi(q, r, reverse))
    assert plain_renyi(p, r, order) <= dp_fusion_pair_rdp(bound, order) * (1 + 1e-9) + 1e-12


def test_dp_fusion_paper_grid_gives_distinct_bounds() -> None:
    bounds = [dp_fusion_bound(e) for e in DP_FUSION_GRID]
    assert bounds[0] == 0.0 and all(a < b for a, b in zip(bounds, bounds[1:]))


# --------------------------------------------------------------------------- InvisibleInk


@pytest.mark.parametrize("epsilon", INVISIBLE_INK_GRID)
def test_invisible_ink_clip_spends_epsilon_by_dp_accounting(epsilon: float) -> None:
    # T tokens, each the exponential mechanism whose logits two contexts move by up to 2C at temperature tau:
    # (2C/tau)^2/2-zCDP per token, composed by dp-accounting's RDP accountant and converted at delta = 1e-6
    clip = invisible_ink_clip(epsilon, max_new_tokens=256, delta=1e-6, temperature=1.1)
    accountant = rdp.RdpAccountant(list(DENSE_ORDERS[::10]))
    accountant.compose(dp_accounting.ZCDpEvent(rho=(2 * clip / 1.1) ** 2 / 2), count=256)
    spent = accountant.get_epsilon(1e-6)
    assert epsilon * (1 - 1e-9) <= spent <= epsilon * (1 + 1e-3)


def test_invisible_ink_clip_hand_worked() -> None:
    # eps = 10, delta = 1e-6: rho = 1.5393, whose CKS epsilon is 10 (optimal order a = 3.845 solves
    # 1.5393 * 2.845^2 = 12.46 = log(1e6) - log(3.845); then 1.5393 * 3.845 = 5.9186 and
    # (13.8155 + 2.845 * log(1 - 1/3.845) - log 3.845) / 2.845 = (13.8155 - 0.8569 - 1.3468) / 2.845 = 4.0815,
    # 5.9186 + 4.0815 = 10.000); with T = 500, tau = 1.1 and two contexts 2C apart:
    # C = 1.1 * sqrt(1.5393 / 500 / 2) = 0.0431575, half the source's 0.086315 (a context against none)
    assert zcdp_rho(10.0, 1e-6) == pytest.approx(1.5393, abs=2e-4)
    clip = invisible_ink_clip(10.0, max_new_tokens=500, delta=1e-6, temperature=1.1)
    assert clip == pytest.approx(0.0431575, abs=1e-5)


def test_invisible_ink_grid_gives_distinct_clips() -> None:
    clips = [invisible_ink_clip(e, max_new_tokens=256, temperature=1.1) for e in INVISIBLE_INK_GRID]
    assert all(0 < a < b for a, b in zip(clips, clips[1:]))


@SETTINGS
@given(epsilon=st.floats(0.1, 128.0), tokens=st.integers(1, 1024))
def test_invisible_ink_clip_halves_when_tokens_quadruple(epsilon: float, tokens: int) -> None:
    short = invisible_ink_clip(epsilon, max_new_tokens=tokens)
    long = invisible_ink_clip(epsilon, max_new_tokens=4 * tokens)
    assert long == pytest.approx(short / 2)
    # and the per-token zCDP cost of that clip between two contexts, (2C)^2/2, composes back to epsilon
    assert zcdp_epsilon(tokens * (2 * short) ** 2 / 2, 1e-6) == pytest.approx(epsilon, rel=1e-6)


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


def test_zcdp_rho_holds_at_a_tiny_delta() -> None:
    """At delta = 1e-300 the optimal order is ~140, far below 1/delta: 200 halvings from 1/delta never reached it
    and rho came out 0 (InvisibleInk's clip 0, a budget silently thrown away); dp-accounting agrees on the result."""
    rho = zcdp_rho(10.0, 1e-300)
    assert rho > 0.03
    assert dp_accounting_zcdp_epsilon(rho, 1e-300) == pytest.approx(10.0, rel=1e-3)
