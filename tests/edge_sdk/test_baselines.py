"""Unit and property tests of the six baseline defences (edge_sdk.policies.<name>, one module each)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from edge_sdk.fusion import log_probs, softmax, top_k_ids
from edge_sdk.policies import (
    CoGenesis,
    CusText,
    DPFusion,
    DPLogit,
    EmbeddingNeighbours,
    InvisibleInk,
    LDPSampler,
    UnsupportedModeError,
    available_policies,
    make_policy,
    policy_class,
)
from edge_sdk.policies.cogenesis import cogenesis_upload_ids
from edge_sdk.policies.custext import (
    TokenClusters,
    custext_output_set,
    custext_probabilities,
    custext_replace,
    embedding_neighbours_for,
    load_token_embeddings,
)
from edge_sdk.policies.dp_fusion import dp_fusion_lambda, dp_fusion_mixture
from edge_sdk.policies.dp_logit import NOISE_TAIL_LIMIT, dp_logit_upload, standard_normal_float32
from edge_sdk.policies.invisible_ink import invisible_ink_distribution
from edge_sdk.policies.ldp_sampler import (
    SAMPLE_BLOCK,
    ldp_sampler_distribution,
    ldp_sampler_draw,
    ldp_sampler_ratio_bounds,
    sample_index,
)
from edge_sdk.privacy.analysis import EPSILON_UNITS, RENYI_PROBABILITY_FLOOR

SETTINGS = settings(max_examples=60, deadline=None)
BASELINES = ("cogenesis", "dp_logit", "dp_fusion", "custext", "ldp_sampler", "invisible_ink")

# the five-token pair most hand-worked examples below use
P_SLM = np.array([0.1, 0.4, 0.05, 0.3, 0.15], dtype=np.float32)
P_LLM = np.array([0.3, 0.1, 0.35, 0.05, 0.2], dtype=np.float32)

# unit-circle embeddings: cosine similarity to row 0 is [1, 0.8, 0, -1, 0.6]
CIRCLE_EMBEDDINGS = np.array([[1, 0], [0.8, 0.6], [0, 1], [-1, 0], [0.6, 0.8]], dtype=np.float32)


@st.composite
def distributions(draw: st.DrawFn, size: int | None = None, low: float = -8.0, high: float = 8.0) -> np.ndarray:
    """A float64 softmax of bounded logits (every entry positive)."""
    n = size if size is not None else draw(st.integers(2, 24))
    logits = draw(st.lists(st.floats(low, high), min_size=n, max_size=n))
    z = np.asarray(logits, dtype=np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


@st.composite
def distribution_pairs(draw: st.DrawFn, low: float = -8.0) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(2, 24))
    return draw(distributions(size=n, low=low)), draw(distributions(size=n, low=low))


def assert_distribution(q: np.ndarray) -> None:
    assert np.all(q >= 0)
    assert float(np.sum(q, dtype=np.float64)) == pytest.approx(1.0, abs=1e-5)


def peaked_pair(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(p_slm, p_llm): softmaxes of correlated Gaussian logits with a few boosted tokens (as benchmarks/policy_step)."""
    gen = np.random.default_rng(seed)
    z_llm = gen.standard_normal(vocab).astype(np.float32) * 2.0
    z_slm = z_llm + gen.standard_normal(vocab).astype(np.float32)
    z_llm[gen.integers(0, vocab, 5)] += 12.0
    z_slm[gen.integers(0, vocab, 5)] += 12.0
    return softmax(z_slm), softmax(z_llm)


def draw_counts(draw, n: int, size: int) -> np.ndarray:
    """How often each id comes out of ``n`` calls of ``draw(rng)`` with one seeded generator."""
    rng = np.random.default_rng(2024)
    return np.bincount([draw(rng) for _ in range(n)], minlength=size)


def assert_follows(counts: np.ndarray, q: np.ndarray) -> None:
    """Counts never hit an id of probability 0 and pass a chi-square test against ``q`` (fixed seeds: no flakes)."""
    q = np.asarray(q, dtype=np.float64)
    support = q > 0
    assert counts[~support].sum() == 0
    expected = q[support] / q[support].sum() * counts.sum()
    assert stats.chisquare(counts[support], expected).pvalue > 1e-3


# --------------------------------------------------------------------------- registry, modules, units


def test_all_six_baselines_are_registered_with_their_modes() -> None:
    assert {"cogenesis", "dp_logit", "dp_fusion"} <= set(available_policies("cloud"))
    assert {"custext", "ldp_sampler", "dp_fusion", "invisible_ink"} <= set(available_policies("edge"))
    assert "custext" not in available_policies("cloud")
    assert "cogenesis" not in available_policies("edge")


@pytest.mark.parametrize("name", BASELINES)
def test_each_baseline_lives_in_the_module_named_as_it_is_registered(name: str) -> None:
    cls = policy_class(name)
    assert cls.__module__ == f"edge_sdk.policies.{name}"
    assert getattr(importlib.import_module(f"edge_sdk.policies.{name}"), cls.__name__) is cls


def test_the_old_catch_all_module_is_gone() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("edge_sdk.policies.baselines")


@pytest.mark.parametrize("name", (*BASELINES, "undefended", "coveil"))
def test_every_mode_says_what_its_epsilon_covers(name: str) -> None:
    cls = policy_class(name)
    assert set(cls.epsilon_units) == set(cls.modes)
    assert set(cls.epsilon_units.values()) <= set(EPSILON_UNITS)


def test_epsilon_units_per_baseline() -> None:
    assert CoGenesis.epsilon_units == {"cloud": "none"}
    assert DPLogit.epsilon_units == {"cloud": "per_token"}
    # releasing the mixture's probabilities is not DP; sampling one token from it is
    assert DPFusion.epsilon_units == {"cloud": "calibration", "edge": "per_token"}
    assert CusText.epsilon_units == {"edge": "per_token"}
    assert LDPSampler.epsilon_units == {"edge": "per_token"}
    assert InvisibleInk.epsilon_units == {"edge": "per_generation"}


def test_cloud_only_policy_refuses_edge_mode() -> None:
    with pytest.raises(UnsupportedModeError):
        CoGenesis().decide("edge", P_SLM, P_LLM, alpha=0.5)
    with pytest.raises(UnsupportedModeError):
        LDPSampler().decide("cloud", P_SLM, P_LLM, alpha=0.5, rng=np.random.default_rng(0))


@pytest.mark.parametrize(
    "policy",
    [DPLogit(), DPFusion(), LDPSampler(), InvisibleInk(), CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS))],
    ids=lambda policy: policy.name,
)
def test_randomised_policies_require_an_explicit_generator(policy) -> None:
    for mode in policy.modes - ({"cloud"} if policy.name == "dp_fusion" else set()):
        with pytest.raises(ValueError, match="numpy.random.Generator"):
            policy.decide(mode, P_SLM, P_LLM, alpha=0.5)


# --------------------------------------------------------------------------- the one-pass draw


def test_sample_index_hand_worked_small() -> None:
    # below one block it is sample_from itself: one uniform u, the first id whose cumulative weight exceeds u * total
    u = np.random.default_rng(5).random()
    weights = np.array([0.0, 2.0, 0.0, 1.0, 1.0])  # cumulative 0, 2, 2, 3, 4
    expected = 1 if u * 4 < 2 else (3 if u * 4 < 3 else 4)
    assert sample_index(weights, np.random.default_rng(5)) == expected


def test_sample_index_over_many_blocks_follows_the_weights() -> None:
    rng = np.random.default_rng(0)
    weights = rng.random(3 * SAMPLE_BLOCK + 7)
    weights[rng.random(weights.size) < 0.3] = 0.0  # zero-weight ids, including whole runs, are never drawn
    weights[SAMPLE_BLOCK : 2 * SAMPLE_BLOCK] = 0.0
    hot = np.zeros_like(weights)
    hot[[5, SAMPLE_BLOCK * 2 + 3, weights.size - 1]] = [1.0, 2.0, 3.0]  # a coarse version to test by chi-square
    assert_follows(draw_counts(lambda g: sample_index(hot, g), 6000, hot.size), hot / hot.sum())
    draws = [sample_index(weights, np.random.default_rng(s)) for s in range(300)]
    assert all(weights[i] > 0 for i in draws)
    assert draws == [sample_index(weights, np.random.default_rng(s)) for s in range(300)]


# --------------------------------------------------------------------------- CoGenesis


def test_cogenesis_uploads_top_b_without_renormalising() -> None:
    upload = CoGenesis(b=2).decide("cloud", P_SLM, P_LLM, alpha=0.5)
    # the two largest of [0.1, 0.4, 0.05, 0.3, 0.15] are ids 1 (0.4) and 3 (0.3); they sum to 0.7
    np.testing.assert_array_equal(upload.ids, [1, 3])
    np.testing.assert_allclose(upload.values, [0.4, 0.3])


def test_cogenesis_with_b_above_vocabulary_uploads_everything() -> None:
    np.testing.assert_array_equal(cogenesis_upload_ids(P_SLM, 50), np.arange(5))


@SETTINGS
@given(p=distributions(), b=st.integers(1, 40))
def test_cogenesis_upload_is_exactly_min_b_v_ids_inside_top_b(p: np.ndarray, b: int) -> None:
    p = p.astype(np.float32)
    upload = CoGenesis(b=b).cloud_upload(p, p, alpha=0.5)
    assert len(upload) == min(b, p.size)
    assert set(upload.ids.tolist()) == set(top_k_ids(p, b).tolist())
    np.testing.assert_array_equal(upload.values, p[upload.ids])


def test_cogenesis_rejects_non_positive_b() -> None:
    with pytest.raises(ValueError, match="upload size B"):
        CoGenesis(b=0)


# --------------------------------------------------------------------------- DP-Logit


def test_box_muller_hand_worked() -> None:
    # one 64-bit draw: top 40 bits k give u = k / 2^40, low 24 bits j the angle 2 pi j / 2^24;
    # z = sqrt(-2 log u) * (cos, sin) of it (float32 rounding: compare to 1e-5)
    raw = int(np.random.default_rng(11).bit_generator.random_raw(1)[0])
    k, j = raw >> 24, raw & (2**24 - 1)
    radius = math.sqrt(-2.0 * math.log((k + 0.5) / 2**40))
    angle = 2.0 * math.pi * j / 2**24
    z = standard_normal_float32(2, np.random.default_rng(11))
    np.testing.assert_allclose(z, [radius * math.cos(angle), radius * math.sin(angle)], rtol=1e-5, atol=1e-6)


def test_box_muller_draws_are_standard_normal_by_scipy() -> None:
    z = standard_normal_float32(262_144, np.random.default_rng(0))
    assert z.dtype == np.float32
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # the cosine and the sine halves are each N(0, 1) and uncorrelated
    assert stats.kstest(z[: z.size // 2], "norm").pvalue > 1e-3
    assert stats.kstest(z[z.size // 2 :], "norm").pvalue > 1e-3
    assert abs(np.corrcoef(z[: z.size // 2], z[z.size // 2 :])[0, 1]) < 0.01
    # the tail limit: sqrt(2 * 41 * log 2) = sqrt(56.838) = 7.5391
    assert NOISE_TAIL_LIMIT == pytest.approx(7.5391, abs=1e-4)
    assert float(np.abs(z).max()) <= NOISE_TAIL_LIMIT
    np.testing.assert_array_equal(z, standard_normal_float32(262_144, np.random.default_rng(0)))
    assert standard_normal_float32(5, np.random.default_rng(0)).shape == (5,)


def test_dp_logit_upload_hand_worked(monkeypatch: pytest.MonkeyPatch) -> None:
    # the mechanism adds sigma * z (z: one standard normal per entry, fixed here; the Box-Muller draws are
    # tested above), keeps the top noisy entries and clamps them into [0, 1]
    calls = []

    def fixed_normals(n: int, rng: np.random.Generator) -> np.ndarray:
        calls.append(n)
        return np.array([1.0, -3.0, 3.0, 0.5, 12.0], dtype=np.float32)

    monkeypatch.setattr("edge_sdk.policies.dp_logit.standard_normal_float32", fixed_normals)
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0], dtype=np.float32)
    # noisy = p + 0.1 z = [0.6, -0.1, 0.5, 0.15, 1.2]: top two ids 4 (1.2 -> clamped to 1) and 0 (0.6)
    ids, values = dp_logit_upload(p, sigma=0.1, upload_k=2, rng=np.random.default_rng(3))
    assert calls == [5]  # the whole vector is noised, not only what is uploaded
    np.testing.assert_array_equal(ids, [4, 0])
    np.testing.assert_allclose(values, [1.0, 0.6], rtol=1e-6)
    # all five, by decreasing noisy value: 1.2, 0.6, 0.5, 0.15, -0.1 -> clamped to 1, 0.6, 0.5, 0.15, 0
    ids, values = dp_logit_upload(p, sigma=0.1, upload_k=5, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(ids, [4, 0, 2, 3, 1])
    np.testing.assert_allclose(values, [1.0, 0.6, 0.5, 0.15, 0.0], rtol=1e-6, atol=1e-7)


def test_dp_logit_sigma_at_epsilon_one_hand_worked() -> None:
    # D = sqrt 2: sigma scales with D, and at eps = 1, delta = 1e-5 the unit-sensitivity sigma is 3.7306
    assert DPLogit(epsilon=1.0, delta=1e-5).sigma == pytest.approx(math.sqrt(2) * 3.7306, abs=2e-3)
    assert "sigma" not in DPLogit().describe()


def test_dp_logit_paper_grid_gives_distinct_noise() -> None:
    sigmas = [DPLogit(epsilon=e).sigma for e in (0.01, 0.05, 0.1, 0.5, 1, 2, 4, 8, 16, 32, 64)]
    assert all(a > b > 0 for a, b in zip(sigmas, sigmas[1:]))


@SETTINGS
@given(p=distributions(), epsilon=st.floats(0.01, 64.0), upload_k=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
def test_dp_logit_uploads_valid_values_reproducibly(p: np.ndarray, epsilon: float, upload_k: int, seed: int) -> None:
    policy = DPLogit(epsilon=epsilon, upload_k=upload_k)
    first = policy.cloud_upload(p, p, alpha=0.5, rng=np.random.default_rng(seed))
    second = policy.cloud_upload(p, p, alpha=0.5, rng=np.random.default_rng(seed))
    assert len(first) == min(upload_k, p.size)
    assert np.all((first.values >= 0) & (first.values <= 1))
    np.testing.assert_array_equal(first.ids, second.ids)
    np.testing.assert_array_equal(first.values, second.values)


def test_dp_logit_uploads_valid_probabilities_even_under_large_noise() -> None:
    """The cloud refuses probability uploads outside [0, 1]; clamping is free post-processing."""
    p = np.full(1000, 1e-3, np.float32)
    ids, values = dp_logit_upload(p, sigma=50.0, upload_k=100, rng=np.random.default_rng(3))
    assert len(ids) == 100
    assert float(values.min()) >= 0.0 and float(values.max()) <= 1.0


@pytest.mark.parametrize(
    "kwargs", [{"epsilon": -1.0}, {"delta": 0.0}, {"delta": 1.0}, {"upload_k": 0}], ids=lambda kw: next(iter(kw))
)
def test_dp_logit_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DPLogit(**kwargs)


# --------------------------------------------------------------------------- DP-Fusion


def floored_rows(private: np.ndarray, public: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both rows renormalised, floored at 1e-10 on the public support, zero off it, renormalised again."""
    support = np.asarray(public) > 0
    rows = []
    for row in (private, public):
        row = np.asarray(row, dtype=np.float64) / np.sum(row, dtype=np.float64)
        row = np.where(support, np.maximum(row, RENYI_PROBABILITY_FLOOR), 0.0)
        rows.append(row / row.sum())
    return rows[0], rows[1]


def context_divergence(mixture: np.ndarray, public: np.ndarray, order: float) -> float:
    """max(D_2a(m||q), D_(2a-1)(q||m)) written out on the support (what each context's mixture is held to)."""
    s = public > 0
    m, q = mixture[s], public[s]
    forward = np.log(np.sum(m ** (2 * order) * q ** (1 - 2 * order))) / (2 * order - 1)
    reverse = np.log(np.sum(q ** (2 * order - 1) * m ** (2 - 2 * order))) / (2 * order - 2)
    return float(max(forward, reverse))


def slow_lambda(private: np.ndarray, public: np.ndarray, bound: float, order: float) -> float:
    """The reference: 200 bisection steps over the context divergence of the floored rows (feasible end kept)."""
    p, q = floored_rows(private, public)
    if bound <= 0 or context_divergence(q, q, order) > bound:
        return 0.0
    if context_divergence(p, q, order) <= bound:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if context_divergence(q + middle * (p - q), q, order) <= bound:
            low = middle
        else:
            high = middle
    return low


def test_dp_fusion_lambda_hand_worked() -> None:
    # p_priv = [1, 0], p_pub = [1/2, 1/2], order 2 (context orders 4 and 3): the mixture is [(1+l)/2, (1-l)/2];
    # D_4(m||q) = log(1 + 6l^2 + l^4)/3 and D_3(q||m) = log((1 + l^2)/(1 - l^2)^2)/2.  At b = 0.3 the reverse
    # binds: 2(1 + x) = 2 e^0.6 (1 - x)^2 with x = l^2, a quadratic: l = 0.437482 (the floor moves it ~1e-10)
    k = math.exp(0.6)
    x = ((2 * k + 1) - math.sqrt((2 * k + 1) ** 2 - 4 * k * (k - 1))) / (2 * k)
    weight = dp_fusion_lambda(np.array([1.0, 0.0]), np.array([0.5, 0.5]), 0.3)
    assert weight == pytest.approx(math.sqrt(x), abs=1e-7) and weight == pytest.approx(0.437482, abs=1e-6)
    assert 1 + 6 * x + x * x < math.exp(0.9)  # the forward sum holds there
    # forward-bound: p = [0.5, 0.5], q = [0.25, 0.75], d = p - q = [1/4, -1/4]: F(l) = sum (q + l d)^4 / q^3 =
    # 1 + 6 l^2 (1/3) + 4 l^3 (2/9) + l^4 (7/27) (sum d^2/q = 1/3, sum d^3/q^2 = 2/9, sum d^4/q^3 = 7/27);
    # at b = 0.1 its root of F = e^0.3 (numpy's polynomial roots) and the reverse sum there below e^0.2
    roots = np.roots([7 / 27, 8 / 9, 2.0, 0.0, 1.0 - math.exp(0.3)])
    root = float(max(r.real for r in roots if abs(r.imag) < 1e-12 and 0 < r.real < 1))
    q, d = np.array([0.25, 0.75]), np.array([0.25, -0.25])
    assert np.sum(q**3 / (q + root * d) ** 2) < math.exp(0.2)
    assert dp_fusion_lambda(np.array([0.5, 0.5]), np.array([0.25, 0.75]), 0.1) == pytest.approx(root, abs=1e-7)


def test_dp_fusion_lambda_edge_cases() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    # D_4(p||q) = log(4 + 4/27)/3 = 0.4742, D_3(q||p) = log(1.75)/2 = 0.2798: both within 0.48, not 0.47
    assert dp_fusion_lambda(p, q, 0.48) == 1.0
    assert dp_fusion_lambda(p, q, 0.47) < 1.0
    assert dp_fusion_lambda(p, q, 0.0) == 0.0
    assert dp_fusion_lambda(p, q, -1.0) == 0.0
    assert dp_fusion_lambda(p, q, 1e6) == 1.0
    mixture, weight = dp_fusion_mixture(p, q, -1.0)
    assert weight == 0.0
    np.testing.assert_array_equal(mixture, q)


@SETTINGS
@given(
    pair=distribution_pairs(low=-30.0),
    bound=st.floats(1e-4, 6.0),
    order=st.sampled_from([1.5, 2.0, 3.0, 4.0]),
    zeroed=st.lists(st.integers(0, 23), max_size=8),
)
def test_dp_fusion_lambda_matches_a_bisection_reference(
    pair: tuple[np.ndarray, np.ndarray], bound: float, order: float, zeroed: list[int]
) -> None:
    private, public = pair
    private = private.copy()
    private[[i for i in zeroed if i < private.size - 1]] = 0.0  # the reverse direction then often binds
    weight = dp_fusion_lambda(private, public, bound, order=order)
    reference = slow_lambda(private, public, bound, order)  # the zeroed row renormalised, as it is drawn from
    assert weight == pytest.approx(reference, rel=1e-9, abs=1e-12)
    floored_p, floored_q = floored_rows(private, public)
    # within the bound up to the rounding of a sum near 1 (~1e-16, divided by 2a - 2)
    assert context_divergence(floored_q + weight * (floored_p - floored_q), floored_q, order) <= bound + 1e-13


@SETTINGS
@given(pair=distribution_pairs(), bound=st.floats(1e-4, 2.0), factor=st.floats(1.0, 10.0))
def test_dp_fusion_lambda_is_monotone_in_the_bound(
    pair: tuple[np.ndarray, np.ndarray], bound: float, factor: float
) -> None:
    private, public = pair
    # up to the root's accuracy (a relative 1e-12): two bounds an ulp apart may give roots 7e-13 apart either way
    assert dp_fusion_lambda(private, public, bound) <= dp_fusion_lambda(private, public, bound * factor) * (1 + 1e-12)


def test_dp_fusion_maps_epsilon_per_token_between_any_two_contexts() -> None:
    # b = (2a - 2)/(4a - 3) eps: 0.4 eps at order 2, 4/9 eps at order 3 (a token then costs eps between contexts)
    assert DPFusion(epsilon=2.0).bound == pytest.approx(0.8)
    assert DPFusion(epsilon=2.0, order=3.0).bound == pytest.approx(8 / 9)
    assert DPFusion(epsilon=0.0).bound == 0.0
    # T = 256 tokens at eps = 1 are (2, 256)-RDP: 256 + log(1/2) + log(1e5) - log 2 = 266.1266 at delta = 1e-5
    assert DPFusion(epsilon=1.0).generation_epsilon() == pytest.approx(266.126631, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_fusion_paper_grid_gives_distinct_weights_on_realistic_distributions(seed: int) -> None:
    p_slm, p_llm = peaked_pair(32_768, seed)
    grid = (0, 0.1, 0.5, 1, 2, 3, 4, 8, 16, 32, 64)
    weights = [DPFusion(epsilon=e).weight(p_slm, p_llm) for e in grid]
    assert weights[0] == 0.0
    # eps 0.1 ... 16: every one its own weight, each above the previous
    assert all(0 < a < b for a, b in zip(weights[1:9], weights[2:9]))
    # b = 0.4 * 64 = 25.6 exceeds the largest log-ratio of two floored rows (log 1e10 = 23 and a little): lambda 1
    assert weights[-1] == 1.0


def test_dp_fusion_at_zero_epsilon_uploads_only_the_public_distribution() -> None:
    upload = DPFusion(epsilon=0.0, upload_k=3).decide("cloud", P_SLM, P_LLM, alpha=0.5)
    # top three of p_llm = [0.3, 0.1, 0.35, 0.05, 0.2] are ids 2, 0, 4
    np.testing.assert_array_equal(upload.ids, [0, 2, 4])
    np.testing.assert_allclose(upload.values, [0.3, 0.35, 0.2], rtol=1e-6)


def test_dp_fusion_cloud_upload_is_the_reference_mixture() -> None:
    policy = DPFusion(epsilon=0.5, upload_k=3)  # b = 0.2
    weight = slow_lambda(P_SLM, P_LLM, 0.2, 2.0)
    mixture = weight * P_SLM.astype(np.float64) + (1 - weight) * P_LLM.astype(np.float64)
    upload = policy.decide("cloud", P_SLM, P_LLM, alpha=0.5)
    expected_ids = np.sort(np.argsort(-mixture, kind="stable")[:3])
    np.testing.assert_array_equal(upload.ids, expected_ids)
    np.testing.assert_allclose(upload.values, mixture[expected_ids], rtol=1e-6)


@pytest.mark.parametrize(("epsilon", "alpha"), [(0.5, 0.3), (3.0, 0.5), (64.0, 0.0), (0.0, 0.3)])
def test_dp_fusion_edge_draws_follow_the_fused_mixture(epsilon: float, alpha: float) -> None:
    p_slm = np.array([0.7, 0.2, 0.05, 0.05, 0.0], dtype=np.float32)
    p_llm = np.array([0.05, 0.1, 0.4, 0.25, 0.2], dtype=np.float32)
    policy = DPFusion(epsilon=epsilon)
    weight = slow_lambda(p_slm, p_llm, policy.bound, 2.0)
    private, public = floored_rows(p_slm, p_llm)  # what is drawn from: the rows that were bounded
    fused = alpha * public + (1 - alpha) * (weight * private + (1 - weight) * public)
    counts = draw_counts(lambda g: policy.edge_token(p_slm, p_llm, alpha=alpha, rng=g).token_id, 8000, 5)
    assert_follows(counts, fused / fused.sum())
    token = policy.edge_token(p_slm, p_llm, alpha=alpha, rng=np.random.default_rng(9)).token_id
    assert token == policy.edge_token(p_slm, p_llm, alpha=alpha, rng=np.random.default_rng(9)).token_id


def test_dp_fusion_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="Renyi order"):
        DPFusion(order=1.0)
    with pytest.raises(ValueError, match=r"Renyi order must lie in \(1, 8\]"):
        DPFusion(order=9.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        DPFusion(max_new_tokens=0)
    with pytest.raises(ValueError, match="epsilon"):
        DPFusion(epsilon=-1.0)
    with pytest.raises(ValueError, match="one length"):
        dp_fusion_lambda(np.ones(3) / 3, np.ones(4) / 4, 0.1)


# --------------------------------------------------------------------------- CusText


def test_embedding_neighbours_rank_by_cosine_similarity() -> None:
    # scaling rows must not matter: cosine similarity normalises them
    neighbours = EmbeddingNeighbours(CIRCLE_EMBEDDINGS * np.array([[1], [3], [2], [5], [0.5]], dtype=np.float32))
    ids, similarities = neighbours.of(0, 3)
    np.testing.assert_array_equal(ids, [0, 1, 4])
    np.testing.assert_allclose(similarities, [1.0, 0.8, 0.6], atol=1e-6)
    ids, _ = neighbours.of(0, 2)
    np.testing.assert_array_equal(ids, [0, 1])  # a prefix, served from the cache
    ids, similarities = neighbours.of(0, 5)
    np.testing.assert_array_equal(ids, [0, 1, 4, 2, 3])
    np.testing.assert_allclose(similarities, [1.0, 0.8, 0.6, 0.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(neighbours.similarities(0, np.array([3, 1])), [-1.0, 0.8], atol=1e-6)


def test_embedding_neighbours_cache_is_bounded_and_float16_works() -> None:
    neighbours = EmbeddingNeighbours(CIRCLE_EMBEDDINGS.astype(np.float16), cache_size=2)
    for token in (0, 1, 2, 3):
        neighbours.of(token, 2)
    assert len(neighbours._cache) == 2
    ids, similarities = neighbours.of(0, 3)  # evicted, recomputed
    np.testing.assert_array_equal(ids, [0, 1, 4])
    np.testing.assert_allclose(similarities, [1.0, 0.8, 0.6], atol=2e-3)


def test_embedding_neighbours_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        EmbeddingNeighbours(np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match="outside the embedding vocabulary"):
        EmbeddingNeighbours(CIRCLE_EMBEDDINGS).of(5, 2)


def test_conservative_clusters_hand_worked() -> None:
    # id 0 opens {0, 1} (similarity 0.8); the next free id, 2, takes its nearest free id 4
    # (cos(2, 4) = 0.8 against cos(2, 3) = 0); 3 is left alone
    clusters = EmbeddingNeighbours(CIRCLE_EMBEDDINGS).clusters(2)
    assert [clusters.of(i).tolist() for i in range(5)] == [[0, 1], [0, 1], [2, 4], [3], [2, 4]]
    assert len(clusters) == 3


def slow_greedy_clusters(embeddings: np.ndarray, size: int) -> list[list[int]]:
    """The conservative mapping spelled out: visit ids in order; a free id takes its size-1 nearest free ids."""
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    free = list(range(len(unit)))
    clusters = []
    while free:
        anchor = free[0]
        others = sorted(free[1:], key=lambda i: (-float(unit[i] @ unit[anchor]), i))[: size - 1]
        clusters.append(sorted([anchor, *others]))
        free = [i for i in free if i not in clusters[-1]]
    return clusters


@pytest.mark.parametrize(("vocab", "size"), [(300, 20), (257, 7), (50, 1)])
def test_conservative_clusters_match_the_greedy_reference_and_partition(vocab: int, size: int) -> None:
    embeddings = np.random.default_rng(vocab).standard_normal((vocab, 6)).astype(np.float32)
    clusters = TokenClusters(EmbeddingNeighbours(embeddings)._unit, size)
    built = sorted({tuple(clusters.of(i).tolist()) for i in range(vocab)})
    assert built == sorted(tuple(c) for c in slow_greedy_clusters(embeddings, size))
    members = [i for cluster in built for i in cluster]
    assert sorted(members) == list(range(vocab))  # disjoint and covering
    assert all(i in clusters.of(i) for i in range(vocab))


def test_clusters_taken_from_their_labels_are_the_built_ones() -> None:
    embeddings = np.random.default_rng(5).standard_normal((257, 6)).astype(np.float32)
    built = TokenClusters(EmbeddingNeighbours(embeddings)._unit, 7)
    taken = TokenClusters(None, 7, labels=built.labels)
    assert len(taken) == len(built) == 37  # 36 clusters of 7 and the last 5 ids
    for i in range(257):
        np.testing.assert_array_equal(taken.of(i), built.of(i))
    with pytest.raises(ValueError, match="without a gap"):
        TokenClusters(None, 7, labels=np.array([0, 2, 2]))


def test_clusters_built_once_are_read_by_the_next_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second source over the same rows (a new process's) reads the stored partition: swapped on disk for
    singletons, it is the singletons that come back; a file that does not fit is built again."""
    monkeypatch.setenv("COVEIL_CACHE_DIR", str(tmp_path))
    embeddings = np.random.default_rng(6).standard_normal((120, 6)).astype(np.float32)
    built = EmbeddingNeighbours(embeddings).clusters(10)
    (stored,) = (tmp_path / "custext").iterdir()
    np.testing.assert_array_equal(np.load(stored), built.labels)
    np.save(stored, np.arange(120))
    assert len(EmbeddingNeighbours(embeddings).clusters(10)) == 120
    np.save(stored, np.zeros(3, dtype=np.int64))  # another vocabulary's
    again = EmbeddingNeighbours(embeddings).clusters(10)
    assert len(again) == 12 and all(np.array_equal(again.of(i), built.of(i)) for i in range(120))
    assert len(list((tmp_path / "custext").iterdir())) == 1  # no staging file left


def test_clusters_that_cannot_be_stored_leave_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while the partition is written: the clusters still come back, and nothing is left in the cache."""
    import edge_sdk.policies.custext as custext

    def disk_full(file: Any, array: np.ndarray) -> None:
        file.write(b"\x93NUMPY")
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("COVEIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(custext.np, "save", disk_full)
    embeddings = np.random.default_rng(7).standard_normal((40, 6)).astype(np.float32)
    assert len(EmbeddingNeighbours(embeddings).clusters(10)) == 4
    assert list((tmp_path / "custext").iterdir()) == []


def test_conservative_output_sets_are_shared_by_every_member() -> None:
    embeddings = np.random.default_rng(0).standard_normal((400, 8)).astype(np.float32)
    neighbours = EmbeddingNeighbours(embeddings)
    for token in (0, 17, 399):
        ids, similarities = custext_output_set(token, neighbours, 20)
        assert token in ids and len(ids) <= 20
        for member in ids:
            np.testing.assert_array_equal(custext_output_set(int(member), neighbours, 20)[0], ids)
        np.testing.assert_allclose(similarities, neighbours._unit[ids] @ neighbours._unit[token], rtol=1e-5)
    aggressive, _ = custext_output_set(17, neighbours, 20, "aggressive")
    np.testing.assert_array_equal(aggressive, neighbours.of(17, 20)[0])


def test_custext_probabilities_hand_worked() -> None:
    # similarities [1, 0.8, 0.6] -> u = [1, 0.5, 0]; eps = 2 -> weights [e, e^0.5, 1] / 5.3670031
    np.testing.assert_allclose(
        custext_probabilities(np.array([1.0, 0.8, 0.6]), 2.0), [0.5064804, 0.3071959, 0.1863237], atol=1e-7
    )
    np.testing.assert_allclose(custext_probabilities(np.array([0.3, 0.3]), 5.0), [0.5, 0.5])
    np.testing.assert_allclose(custext_probabilities(np.array([1.0, 0.0, -1.0]), 0.0), [1 / 3] * 3)


@SETTINGS
@given(similarities=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=30), epsilon=st.floats(0.0, 32.0))
def test_custext_probabilities_are_an_exponential_mechanism(similarities: list[float], epsilon: float) -> None:
    probabilities = custext_probabilities(np.asarray(similarities), epsilon)
    assert_distribution(probabilities)
    # utilities lie in [0, 1], so no two outputs differ by more than a factor e^(eps/2)
    assert probabilities.max() <= probabilities.min() * math.exp(epsilon / 2) * (1 + 1e-9)


@pytest.mark.parametrize(("mapping", "output_set"), [("aggressive", {0, 1, 4}), ("conservative", {0, 1, 4})])
def test_custext_replaces_the_fused_argmax_within_its_output_set(mapping: str, output_set: set[int]) -> None:
    # fused at alpha = 0.5: [0.2, 0.25, 0.2, 0.175, 0.175] -> argmax 1; aggressive: 1's nearest three are
    # itself (1.0), 4 (0.96) and 0 (0.8); conservative with clusters of 3: 0 opens {0, 1, 4}, 1 belongs to it
    policy = CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), epsilon=1.0, n_neighbours=3, mapping=mapping)
    tokens = {policy.edge_token(P_SLM, P_LLM, alpha=0.5, rng=np.random.default_rng(s)).token_id for s in range(80)}
    assert tokens == output_set
    # a huge budget keeps the argmax itself (u = 1 against u = 0 for the farthest)
    greedy = CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), epsilon=500.0, n_neighbours=3, mapping=mapping)
    assert greedy.edge_token(P_SLM, P_LLM, alpha=0.5, rng=np.random.default_rng(0)).token_id == 1


def test_custext_defaults_to_the_original_conservative_mapping() -> None:
    policy = CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS))
    assert (policy.mapping, policy.n_neighbours, policy.epsilon) == ("conservative", 20, 5.0)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), token=st.integers(0, 4), epsilon=st.floats(0.0, 32.0))
def test_custext_same_seed_same_token(seed: int, token: int, epsilon: float) -> None:
    neighbours = EmbeddingNeighbours(CIRCLE_EMBEDDINGS)
    draws = [
        custext_replace(token, neighbours, epsilon=epsilon, n_neighbours=4, rng=np.random.default_rng(seed))
        for _ in range(2)
    ]
    assert draws[0] == draws[1]
    assert draws[0] in custext_output_set(token, neighbours, 4)[0]


def test_custext_requires_neighbours() -> None:
    with pytest.raises(ValueError, match="EmbeddingNeighbours"):
        make_policy("custext", epsilon=4.0)
    with pytest.raises(ValueError, match="n_neighbours"):
        CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), n_neighbours=0)
    with pytest.raises(ValueError, match="mapping"):
        CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), mapping="greedy")


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], raw_dtypes: dict[str, object] | None = None) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=(raw_dtypes or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_custext_builds_itself_from_the_backend_gguf_once(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, {"token_embd.weight": CIRCLE_EMBEDDINGS})
    backend = SimpleNamespace(source=SimpleNamespace(gguf_path=path))
    first = make_policy("custext", backend=backend, epsilon=3.0, n_neighbours=2)
    second = make_policy("custext", backend=backend)
    assert isinstance(first, CusText) and first.epsilon == 3.0
    assert first.neighbours is second.neighbours is embedding_neighbours_for(path)  # loaded once per file
    np.testing.assert_array_equal(first.neighbours.of(0, 2)[0], [0, 1])
    explicit = EmbeddingNeighbours(CIRCLE_EMBEDDINGS)
    assert make_policy("custext", backend=backend, neighbours=explicit).neighbours is explicit


def test_custext_builds_itself_from_a_transformers_slm_s_own_embeddings() -> None:
    """Fails on the old from_backend, which could only read a GGUF file (a transformers SLM has none)."""
    from cloud_adapter.llm import TransformersLLM, TransformersSLM

    from tests.support.tiny_models import bpe_tokenizer, random_qwen

    tokenizer = bpe_tokenizer()
    model = random_qwen(tokenizer, output_rows=448, seed=3)
    slm = TransformersSLM(TransformersLLM.from_loaded(model, tokenizer, "tiny-edge"))
    assert getattr(slm.llm.source, "gguf_path", None) is None
    policy = make_policy("custext", backend=slm, epsilon=2.0, n_neighbours=4, mapping="aggressive")
    again = make_policy("custext", backend=TransformersSLM(slm.llm))  # another wrapper of the same model
    assert again.neighbours is policy.neighbours  # built once per matrix
    assert policy.neighbours.vocab_size == slm.vocab_size
    # the neighbours are the cosine-nearest rows of the model's own input embeddings, computed here directly
    weight = model.get_input_embeddings().weight.detach().double().numpy()[: slm.vocab_size]
    unit = weight / np.linalg.norm(weight, axis=1, keepdims=True)
    for token in (0, 17, slm.vocab_size - 1):
        similarities = unit @ unit[token]
        expected = np.argsort(-similarities, kind="stable")[:4]
        ids, values = policy.neighbours.of(token, 4)
        np.testing.assert_array_equal(ids, expected)
        np.testing.assert_allclose(values, similarities[expected], atol=1e-6)
    drawn = policy.edge_token(peaked_at_five(slm.vocab_size), peaked_at_five(slm.vocab_size), alpha=0.5,
                              rng=np.random.default_rng(0)).token_id
    assert drawn in policy.neighbours.of(5, 4)[0]  # y* = 5, replaced within its output set


def peaked_at_five(vocab: int) -> np.ndarray:
    """A distribution over ``vocab`` ids whose argmax is id 5."""
    p = np.full(vocab, 0.5 / (vocab - 1), dtype=np.float32)
    p[5] = 0.5
    return p


def test_custext_from_a_backend_without_a_gguf_file_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="neighbours="):
        make_policy("custext", backend=SimpleNamespace())
    with pytest.raises(ValueError, match="neighbours="):
        CusText.from_backend(SimpleNamespace(source=SimpleNamespace(gguf_path=None)))


def test_load_token_embeddings_round_trips_a_gguf_file(tmp_path: Path) -> None:
    embeddings = np.random.default_rng(0).standard_normal((7, 4)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, {"token_embd.weight": embeddings, "output_norm.weight": np.ones(4, dtype=np.float32)})
    loaded = load_token_embeddings(path)
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, embeddings)
    half = load_token_embeddings(path, dtype=np.float16)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, embeddings, rtol=1e-3, atol=1e-3)


def test_load_token_embeddings_dequantises_q8_0(tmp_path: Path) -> None:
    import gguf

    embeddings = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    quantised = gguf.quants.quantize(embeddings, gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "q8.gguf"
    _write_gguf(path, {"token_embd.weight": quantised}, {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0})
    loaded = load_token_embeddings(path)
    assert loaded.shape == (5, 64)
    np.testing.assert_allclose(loaded, embeddings, atol=0.03)  # Q8_0: 8-bit codes, one scale per 32


def test_load_token_embeddings_rejects_files_without_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "none.gguf"
    _write_gguf(path, {"output_norm.weight": np.ones(4, dtype=np.float32)})
    with pytest.raises(ValueError, match="token_embd.weight"):
        load_token_embeddings(path)
    with pytest.raises(ValueError, match="dtype"):
        load_token_embeddings(path, dtype=np.float64)


# --------------------------------------------------------------------------- LDP-Sampler


def slow_ldp_sampler(private: np.ndarray, public: np.ndarray, epsilon: float, gamma: float) -> np.ndarray:
    """The reference: Q = clip(P t, m P0, M P0), t by 3000 bisection steps in log t (no disjoint-support case)."""
    p = np.asarray(private, dtype=np.float64)
    q = np.asarray(public, dtype=np.float64) / np.sum(public)
    low, high = ldp_sampler_ratio_bounds(epsilon, gamma)
    lo, hi = 1e-300, 1e300
    for _ in range(3000):
        middle = math.sqrt(lo * hi)
        if middle in (lo, hi):
            break
        if np.clip(p * middle, low * q, high * q).sum() < 1:
            lo = middle
        else:
            hi = middle
    out = np.clip(p * hi, low * q, high * q)
    return out / out.sum()


def test_ldp_sampler_ratio_bounds_hand_worked() -> None:
    # e^eps = 2, gamma = 2: m = 3 / (2 + 2) = 0.75, e^eps * m = 1.5
    low, high = ldp_sampler_ratio_bounds(math.log(2.0), 2.0)
    assert low == pytest.approx(0.75)
    assert high == pytest.approx(1.5)
    # gamma moves the band, never its width e^eps: gamma = 1 gives [2/3, 4/3], gamma = 10 [11/12, 11/6]
    assert ldp_sampler_ratio_bounds(math.log(2.0), 1.0) == pytest.approx((2 / 3, 4 / 3))
    assert ldp_sampler_ratio_bounds(math.log(2.0), 10.0) == pytest.approx((11 / 12, 11 / 6))
    low, high = ldp_sampler_ratio_bounds(800.0, 2.0)  # e^800 overflows a float; the bounds do not
    assert low == 0.0
    assert high == pytest.approx(3.0)


def test_ldp_sampler_distribution_hand_worked() -> None:
    uniform = np.full(3, 1 / 3)
    # clip(P / r, 0.25, 0.5) with P = [0.7, 0.2, 0.1]: r = 0.8 gives [0.5 (clipped), 0.25, 0.25 (clipped)]
    np.testing.assert_allclose(
        ldp_sampler_distribution([0.7, 0.2, 0.1], uniform, epsilon=math.log(2.0), gamma=2.0), [0.5, 0.25, 0.25]
    )
    # P already inside [0.25, 0.5]: r = 1 and Q = P
    np.testing.assert_allclose(
        ldp_sampler_distribution([0.4, 0.35, 0.25], uniform, epsilon=math.log(2.0), gamma=2.0), [0.4, 0.35, 0.25]
    )
    # eps = 0: Q = P0 whatever P is
    np.testing.assert_allclose(ldp_sampler_distribution([1.0, 0.0, 0.0], uniform, epsilon=0.0), uniform)


def test_ldp_sampler_when_no_clip_level_reaches_one() -> None:
    # P's support {0} has P0 mass 0.1 < 1/(gamma+1): even r -> 0 gives 1.5 * 0.1 + 0.75 * 0.9 = 0.825 < 1,
    # so ids 1 and 2 take P0 scaled by c = (1 - 0.15) / 0.9 = 0.9444 (inside [0.75, 1.5])
    q = ldp_sampler_distribution([1.0, 0.0, 0.0], [0.1, 0.45, 0.45], epsilon=math.log(2.0), gamma=2.0)
    np.testing.assert_allclose(q, [0.15, 0.425, 0.425])
    # disjoint supports: nothing of P survives, Q = P0
    np.testing.assert_allclose(ldp_sampler_distribution([1.0, 0.0], [0.0, 1.0], epsilon=3.0), [0.0, 1.0])


@pytest.mark.parametrize("epsilon", [0.0, 1e-3, 1.0])
def test_ldp_sampler_keeps_tiny_anchor_entries_in_ratio(epsilon: float) -> None:
    # 1 - (1 - 1e-12) loses four digits to cancellation; the ratio bound must not
    public = np.array([1.0, 1e-12]) / (1.0 + 1e-12)
    q = ldp_sampler_distribution([1.0, 0.0], public, epsilon=epsilon, gamma=2.0)
    low, high = ldp_sampler_ratio_bounds(epsilon, 2.0)
    assert low * (1 - 1e-9) <= q[1] / public[1] <= high * (1 + 1e-9)


@SETTINGS
@given(pair=distribution_pairs(low=-30.0), epsilon=st.floats(0.01, 64.0), gamma=st.floats(1.0, 20.0))
def test_ldp_sampler_matches_a_bisection_reference(
    pair: tuple[np.ndarray, np.ndarray], epsilon: float, gamma: float
) -> None:
    private, public = pair
    q = ldp_sampler_distribution(private, public, epsilon=epsilon, gamma=gamma)
    np.testing.assert_allclose(q, slow_ldp_sampler(private, public, epsilon, gamma), rtol=1e-9, atol=1e-15)


@SETTINGS
@given(
    pair=distribution_pairs(),
    epsilon=st.floats(0.0, 64.0),
    gamma=st.floats(1.0, 20.0),
    zeroed=st.lists(st.integers(0, 23), max_size=20),
)
def test_ldp_sampler_is_a_distribution_with_bounded_ratio(
    pair: tuple[np.ndarray, np.ndarray], epsilon: float, gamma: float, zeroed: list[int]
) -> None:
    private, public = pair
    private = private.copy()
    private[[i for i in zeroed if i < private.size - 1]] = 0.0  # underflowed SLM tails; the last id stays
    q = ldp_sampler_distribution(private, public, epsilon=epsilon, gamma=gamma)
    assert_distribution(q)
    low, high = ldp_sampler_ratio_bounds(epsilon, gamma)
    ratio = q / public
    assert np.all(ratio >= low * (1 - 1e-9))
    assert np.all(ratio <= high * (1 + 1e-9))


def test_ldp_sampler_gives_zero_mass_where_the_anchor_has_none() -> None:
    q = ldp_sampler_distribution([0.5, 0.5, 0.0], [0.0, 0.5, 0.5], epsilon=1.0)
    assert q[0] == 0.0
    assert_distribution(q)


@pytest.mark.parametrize(
    ("private", "public", "epsilon", "gamma"),
    [
        ([0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3], math.log(2.0), 2.0),
        ([1.0, 0.0, 0.0], [0.1, 0.45, 0.45], math.log(2.0), 2.0),  # no normaliser: the disjoint-support case
        ([0.5, 0.5, 0.0], [0.0, 0.5, 0.5], 1.0, 2.0),
        ([0.05, 0.9, 0.05, 0.0], [0.4, 0.1, 0.3, 0.2], 3.0, 4.0),
        ([0.2, 0.3, 0.5], [0.3, 0.3, 0.4], 0.0, 2.0),
        ([0.9, 0.1, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], 2.0, 2.0),
    ],
)
def test_ldp_sampler_draws_follow_q(private: list, public: list, epsilon: float, gamma: float) -> None:
    p, q0 = np.array(private, np.float32), np.array(public, np.float32)
    q = ldp_sampler_distribution(p, q0, epsilon=epsilon, gamma=gamma)
    counts = draw_counts(lambda g: ldp_sampler_draw(p, q0, epsilon=epsilon, gamma=gamma, rng=g), 8000, len(p))
    assert_follows(counts, q)


def test_ldp_sampler_policy_on_a_full_vocabulary_draws_reproducibly_inside_the_anchor() -> None:
    p_slm, p_llm = peaked_pair(65_536, 3)
    p_llm[:1000] = 0.0
    policy = LDPSampler(epsilon=4.0, gamma=3.0)
    def tokens() -> list[int]:
        return [policy.edge_token(p_slm, p_llm, alpha=0.5, rng=np.random.default_rng(s)).token_id for s in range(40)]

    first = tokens()
    assert all(p_llm[t] > 0 for t in first)
    assert first == tokens()


@pytest.mark.parametrize(
    ("private", "public", "kwargs", "message"),
    [
        ([0.5, 0.5], [0.5, 0.5], {"epsilon": 1.0, "gamma": 0.5}, "gamma"),
        ([0.5, 0.5], [0.5, 0.5], {"epsilon": -1.0}, "epsilon"),
        ([0.0, 0.0], [0.5, 0.5], {"epsilon": 1.0}, "private distribution"),
        ([0.5, 0.5], [-0.5, 1.5], {"epsilon": 1.0}, "public anchor"),
        ([0.5, math.nan], [0.5, 0.5], {"epsilon": 1.0}, "private distribution"),
        ([0.5, 0.5], [0.3, 0.3, 0.4], {"epsilon": 1.0}, "differ in length"),
    ],
)
def test_ldp_sampler_rejects_bad_input(private: list, public: list, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ldp_sampler_distribution(private, public, **kwargs)


# --------------------------------------------------------------------------- InvisibleInk


def test_invisible_ink_defaults_are_the_originals() -> None:
    policy = InvisibleInk()
    assert policy.temperature == 1.1
    assert policy.top_k is None  # the whole vocabulary (the original's topk=-1)
    assert InvisibleInk(top_k=0).clip == policy.clip


def test_invisible_ink_distribution_hand_worked() -> None:
    p_llm = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=np.float32)
    p_slm = np.array([0.0625, 0.0625, 0.125, 0.25, 0.5], dtype=np.float32)
    # C = 0.5, k = 2, tau = 1: threshold log(0.25) - 1 = -2.386 keeps log 0.5, log 0.25, log 0.125 (ids 0-2);
    # differences log(1/8), log(1/4), 0 clip to -0.5, -0.5, 0, so the weights are
    # [0.5 e^-0.5, 0.25 e^-0.5, 0.125] = [0.303265, 0.151633, 0.125] / 0.579898
    ids, probabilities = invisible_ink_distribution(p_slm, p_llm, clip=0.5, top_k=2, temperature=1.0)
    np.testing.assert_array_equal(ids, [0, 1, 2])
    np.testing.assert_allclose(probabilities, [0.522963, 0.261482, 0.215555], atol=1e-6)
    # the whole vocabulary at tau = 2: ids 3 and 4 join with differences log 4 and log 8, clipped to +0.5, so
    # the weights (p_llm * e^clip)^(1/2) are sqrt([0.303265, 0.151633, 0.125, 0.103045, 0.103045])
    #   = [0.550695, 0.389400, 0.353553, 0.321006, 0.321006] / 1.935662
    ids, probabilities = invisible_ink_distribution(p_slm, p_llm, clip=0.5, top_k=None, temperature=2.0)
    np.testing.assert_array_equal(ids, np.arange(5))
    np.testing.assert_allclose(probabilities, [0.284500, 0.201172, 0.182652, 0.165838, 0.165838], atol=1e-6)


def test_invisible_ink_without_clip_is_the_public_top_k() -> None:
    ids, probabilities = invisible_ink_distribution(P_SLM, P_LLM, clip=0.0, top_k=2, temperature=1.0)
    # top two of p_llm = [0.3, 0.1, 0.35, 0.05, 0.2] are ids 0 and 2
    np.testing.assert_array_equal(ids, [0, 2])
    np.testing.assert_allclose(probabilities, [0.3 / 0.65, 0.35 / 0.65], rtol=1e-6)


@SETTINGS
@given(
    pair=distribution_pairs(),
    clip=st.floats(0.0, 3.0),
    top_k=st.one_of(st.none(), st.integers(1, 30)),
    temperature=st.floats(0.5, 2.0),
)
def test_invisible_ink_never_samples_outside_top_k_plus(
    pair: tuple[np.ndarray, np.ndarray], clip: float, top_k: int | None, temperature: float
) -> None:
    p_slm, p_llm = (p.astype(np.float32) for p in pair)
    z_public = log_probs(p_llm).astype(np.float64)
    kth = np.sort(z_public)[::-1][min(top_k or z_public.size, z_public.size) - 1]
    allowed = set(np.flatnonzero(z_public >= kth - 2 * clip - 1e-6).tolist())
    ids, probabilities = invisible_ink_distribution(p_slm, p_llm, clip=clip, top_k=top_k, temperature=temperature)
    assert set(ids.tolist()) <= allowed
    assert len(ids) >= min(top_k or p_llm.size, p_llm.size)
    assert_distribution(probabilities)
    # the clipped logits z_bar stay within C of z_pub, so over V_k+ the log-odds of any two
    # tokens differ from the public ones by at most 2C / tau
    public_log_odds = (z_public[ids][:, None] - z_public[ids][None, :]) / temperature
    log_odds = np.log(probabilities)[:, None] - np.log(probabilities)[None, :]
    assert np.all(np.abs(log_odds - public_log_odds) <= 2 * clip / temperature + 1e-4)


@pytest.mark.parametrize("top_k", [None, 2])
def test_invisible_ink_policy_draws_follow_its_distribution(top_k: int | None) -> None:
    policy = InvisibleInk(epsilon=8.0, top_k=top_k, max_new_tokens=4)  # a large clip: the private side shows
    ids, probabilities = invisible_ink_distribution(P_SLM, P_LLM, clip=policy.clip, top_k=top_k, temperature=1.1)
    q = np.zeros(5)
    q[ids] = probabilities
    counts = draw_counts(lambda g: policy.edge_token(P_SLM, P_LLM, alpha=0.5, rng=g).token_id, 6000, 5)
    assert_follows(counts, q)


def test_invisible_ink_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="top_k"):
        InvisibleInk(top_k=-1)
    with pytest.raises(ValueError, match="temperature"):
        InvisibleInk(temperature=0.0)
    with pytest.raises(ValueError, match="clip bound"):
        invisible_ink_distribution(P_SLM, P_LLM, clip=-1.0, top_k=2)


# --------------------------------------------------------------------------- full vocabulary


@pytest.mark.slow
def test_every_baseline_runs_on_a_262144_token_vocabulary() -> None:
    vocab = 262_144
    rng = np.random.default_rng(0)
    z_slm = (4 * rng.standard_normal(vocab)).astype(np.float32)
    p_slm = softmax(z_slm)
    p_llm = softmax(0.5 * z_slm + 3 * rng.standard_normal(vocab).astype(np.float32))
    embeddings = rng.standard_normal((vocab, 8)).astype(np.float32)
    policies = [
        CoGenesis(),
        DPLogit(),
        DPFusion(epsilon=16.0),
        CusText(EmbeddingNeighbours(embeddings)),
        LDPSampler(),
        InvisibleInk(),
    ]
    for policy in policies:
        for mode in sorted(policy.modes):
            observation = policy.decide(mode, p_slm, p_llm, alpha=0.5, rng=np.random.default_rng(1))
            if mode == "cloud":
                assert 0 < len(observation) <= 100
                assert np.all(observation.values >= 0)
            else:
                assert 0 <= observation.token_id < vocab
    assert 0.0 < dp_fusion_lambda(p_slm, p_llm, DPFusion(epsilon=16.0).bound) < 1.0


# -- end-of-generation ids masked: the session zeroes them in both rows and does not renormalise ---------------


def masked_eos_pair(eos_mass: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows as the session hands an edge-side policy while ending is not allowed: id 4 (EOS) zeroed in both."""
    p_slm = np.array([0.55, 0.25, 0.1, 0.1, 0.0]) * (1 - eos_mass)
    p_llm = np.array([0.1, 0.2, 0.3, 0.4, 0.0]) * (1 - eos_mass)
    return p_slm.astype(np.float32), p_llm.astype(np.float32)  # each sums to 1 - eos_mass


@pytest.mark.parametrize("eos_mass", [0.01, 0.5])
def test_dp_fusion_edge_stays_within_its_bound_with_eos_masked(eos_mass: float) -> None:
    """Fails on the calibration of the masked (unnormalised) rows: its weight let the drawn distribution go past
    its bound.  The masked id, zero in the public row, is off the support: never drawn, never floored."""
    p_slm, p_llm = masked_eos_pair(eos_mass)
    policy = DPFusion(epsilon=0.125)  # b = 0.4 * 0.125 = 0.05
    assert policy.bound == pytest.approx(0.05)
    # what an edge draw (alpha = 0) comes from: lambda * p~ + (1 - lambda) * q~, the rows renormalised and floored
    private, public = floored_rows(p_slm, p_llm)
    weight = policy.weight(p_slm, p_llm)
    assert context_divergence(public + weight * (private - public), public, 2.0) <= 0.05 + 1e-12
    assert weight == pytest.approx(slow_lambda(p_slm, p_llm, 0.05, 2.0), rel=1e-9)  # and it is the largest
    # the draws themselves follow that mixture, never EOS
    counts = draw_counts(lambda g: policy.edge_token(p_slm, p_llm, alpha=0.0, rng=g).token_id, 8000, 5)
    assert counts[4] == 0
    assert_follows(counts[:4], (weight * private + (1 - weight) * public)[:4])


def test_invisible_ink_clips_the_renormalised_log_probabilities_with_eos_masked() -> None:
    """Fails on the masked rows' own logs: their sums (0.95 and 0.7) shift the clipped difference by log(0.95/0.7)."""
    p_slm = np.array([0.1, 0.45, 0.4, 0.0], dtype=np.float32)  # 0.05 EOS mass zeroed
    p_llm = np.array([0.4, 0.2, 0.1, 0.0], dtype=np.float32)  # 0.3 EOS mass zeroed
    # renormalised: p_slm = [2/19, 9/19, 8/19], p_llm = [4/7, 2/7, 1/7]; log ratios -1.6917, 0.5056, 1.0809 clip
    # at C = 1 to -1, 0.5056, 1: weights [4/7 e^-1, 9/19, 1/7 e] = [0.210217, 0.473684, 0.388326] / 1.072227
    ids, probabilities = invisible_ink_distribution(p_slm, p_llm, clip=1.0, top_k=None, temperature=1.0)
    np.testing.assert_array_equal(ids, np.arange(4))
    np.testing.assert_allclose(probabilities, [0.196056, 0.441776, 0.362168, 0.0], atol=2e-6)
    # the policy draws from it (C = 1 at its own calibration is not needed: the draw reads the same weights)
    policy = InvisibleInk(epsilon=10.0, temperature=1.0)
    counts = draw_counts(lambda g: policy.edge_token(p_slm, p_llm, alpha=0.5, rng=g).token_id, 8000, 4)
    assert counts[3] == 0
    expected = invisible_ink_distribution(p_slm, p_llm, clip=policy.clip, top_k=None, temperature=1.0)[1]
    assert_follows(counts[:3], expected[:3] / expected[:3].sum())


@pytest.mark.parametrize("eos_mass", [0.01, 0.5])
def test_ldp_sampler_ratio_band_holds_against_the_renormalised_anchor_with_eos_masked(eos_mass: float) -> None:
    """The LDP sampler renormalises its anchor and absorbs P's scale already: its band holds on masked rows."""
    p_slm, p_llm = masked_eos_pair(eos_mass)
    q = ldp_sampler_distribution(p_slm, p_llm, epsilon=1.0, gamma=2.0)
    anchor = p_llm.astype(np.float64) / p_llm.sum(dtype=np.float64)
    low, high = (3 * math.exp(-1.0) / (1 + 2 * math.exp(-1.0)), 3 / (1 + 2 * math.exp(-1.0)))  # m, e^eps m
    assert q[4] == 0.0 and q.sum() == pytest.approx(1.0)
    ratio = q[:4] / anchor[:4]
    assert np.all(ratio >= low * (1 - 1e-9)) and np.all(ratio <= high * (1 + 1e-9))
