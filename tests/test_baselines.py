"""Unit and property tests of the six baseline defences (edge_sdk.policies.baselines)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.fusion import fuse, log_probs, sample_from, softmax, top_k_ids
from edge_sdk.policies import UnsupportedModeError, available_policies, make_policy
from edge_sdk.policies.baselines import (
    CoGenesis,
    CusText,
    DPFusion,
    DPLogit,
    EmbeddingNeighbours,
    InvisibleInk,
    LDPSampler,
    cogenesis_upload_ids,
    custext_probabilities,
    custext_replace,
    dp_fusion_lambda,
    dp_fusion_mixture,
    dp_logit_upload,
    invisible_ink_distribution,
    ldp_sampler_distribution,
    ldp_sampler_ratio_bounds,
    load_token_embeddings,
    renyi_divergence,
    symmetric_renyi_divergence,
)
from edge_sdk.privacy_accounting import analytic_gaussian_sigma, dp_fusion_beta, invisible_ink_clip

SETTINGS = settings(max_examples=60, deadline=None)

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
def distribution_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(2, 24))
    return draw(distributions(size=n)), draw(distributions(size=n))


def assert_distribution(q: np.ndarray) -> None:
    assert np.all(q >= 0)
    assert float(np.sum(q, dtype=np.float64)) == pytest.approx(1.0, abs=1e-5)


# --------------------------------------------------------------------------- registry


def test_all_six_baselines_are_registered_with_their_modes() -> None:
    assert {"cogenesis", "dp_logit", "dp_fusion"} <= set(available_policies("cloud"))
    assert {"custext", "ldp_sampler", "dp_fusion", "invisible_ink"} <= set(available_policies("edge"))
    assert "custext" not in available_policies("cloud")
    assert "cogenesis" not in available_policies("edge")


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
    mode = "edge" if "edge" in policy.modes else "cloud"
    with pytest.raises(ValueError, match="numpy.random.Generator"):
        policy.decide(mode, P_SLM, P_LLM, alpha=0.5)


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


def test_dp_logit_calibrates_sigma_for_probability_vectors() -> None:
    policy = DPLogit(epsilon=2.0, delta=1e-5)
    assert policy.sigma == analytic_gaussian_sigma(2.0, 1e-5, math.sqrt(2.0))
    assert "sigma" not in policy.describe()


def test_dp_logit_upload_hand_worked() -> None:
    # the mechanism adds sigma * z with z the generator's next five standard normals,
    # keeps the top two noisy entries and clamps them at zero
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0], dtype=np.float32)
    z = np.random.default_rng(3).standard_normal(5)
    noisy = p + 0.1 * z
    expected_ids = np.argsort(-noisy, kind="stable")[:2]
    ids, values = dp_logit_upload(p, sigma=0.1, upload_k=2, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(values, np.maximum(noisy[expected_ids], 0.0))


@SETTINGS
@given(p=distributions(), epsilon=st.floats(0.01, 64.0), upload_k=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
def test_dp_logit_uploads_non_negative_values_reproducibly(
    p: np.ndarray, epsilon: float, upload_k: int, seed: int
) -> None:
    policy = DPLogit(epsilon=epsilon, upload_k=upload_k)
    first = policy.cloud_upload(p, p, alpha=0.5, rng=np.random.default_rng(seed))
    second = policy.cloud_upload(p, p, alpha=0.5, rng=np.random.default_rng(seed))
    assert len(first) == min(upload_k, p.size)
    assert np.all(first.values >= 0)
    np.testing.assert_array_equal(first.ids, second.ids)
    np.testing.assert_array_equal(first.values, second.values)


@pytest.mark.parametrize(
    "kwargs", [{"epsilon": -1.0}, {"delta": 0.0}, {"delta": 1.0}, {"upload_k": 0}], ids=lambda kw: next(iter(kw))
)
def test_dp_logit_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DPLogit(**kwargs)


# --------------------------------------------------------------------------- DP-Fusion


def test_renyi_divergences_hand_worked() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    # sum p^2/q = 0.25/0.25 + 0.25/0.75 = 4/3;  sum q^2/p = 0.0625/0.5 + 0.5625/0.5 = 1.25
    assert renyi_divergence(p, q, 2.0) == pytest.approx(math.log(4 / 3))
    assert renyi_divergence(q, p, 2.0) == pytest.approx(math.log(1.25))
    assert symmetric_renyi_divergence(p, q, 2.0) == pytest.approx(math.log(4 / 3))
    assert symmetric_renyi_divergence(p, p, 3.0) == pytest.approx(0.0, abs=1e-12)


def test_dp_fusion_lambda_hand_worked() -> None:
    # p_priv = [1, 0], p_pub = [1/2, 1/2]: the mixture is [(1+l)/2, (1-l)/2] and
    # D_2(m||q) = log(1 + l^2) <= D_2(q||m) = -log(1 - l^2), so the largest feasible
    # l is sqrt(1 - e^-b) = sqrt(1 - e^-0.3) = 0.509100
    weight = dp_fusion_lambda(np.array([1.0, 0.0]), np.array([0.5, 0.5]), 0.3)
    assert weight <= math.sqrt(1 - math.exp(-0.3))
    assert weight == pytest.approx(0.509100, abs=2e-6)


def test_dp_fusion_lambda_edge_cases() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    assert dp_fusion_lambda(p, q, 0.3) == 1.0  # D(p, q) = 0.2877 <= 0.3
    assert dp_fusion_lambda(p, q, 0.0) == 0.0
    assert dp_fusion_lambda(p, q, -1.0) == 0.0
    mixture, weight = dp_fusion_mixture(p, q, -1.0)
    assert weight == 0.0
    np.testing.assert_array_equal(mixture, q)


@SETTINGS
@given(pair=distribution_pairs(), bound=st.floats(1e-4, 3.0), order=st.sampled_from([1.5, 2.0, 4.0]))
def test_dp_fusion_mixture_is_a_distribution_within_its_bound(
    pair: tuple[np.ndarray, np.ndarray], bound: float, order: float
) -> None:
    private, public = pair
    mixture, weight = dp_fusion_mixture(private, public, bound, order=order)
    assert 0.0 <= weight <= 1.0
    assert_distribution(mixture)
    assert symmetric_renyi_divergence(mixture, public, order) <= bound + 1e-9


@SETTINGS
@given(pair=distribution_pairs(), bound=st.floats(1e-4, 2.0), factor=st.floats(1.0, 10.0))
def test_dp_fusion_lambda_is_monotone_in_the_bound(
    pair: tuple[np.ndarray, np.ndarray], bound: float, factor: float
) -> None:
    private, public = pair
    assert dp_fusion_lambda(private, public, bound) <= dp_fusion_lambda(private, public, bound * factor)


def test_dp_fusion_policy_maps_epsilon_to_the_bound() -> None:
    policy = DPFusion(epsilon=32.0, max_new_tokens=128)
    assert policy.bound == dp_fusion_beta(32.0, max_new_tokens=128, delta=1e-5, order=2.0)


def test_dp_fusion_below_the_delta_term_uses_only_the_public_distribution() -> None:
    policy = DPFusion(epsilon=1.0, upload_k=3)  # 1 < log(1e5): bound < 0, lambda = 0
    upload = policy.decide("cloud", P_SLM, P_LLM, alpha=0.5)
    # top three of p_llm = [0.3, 0.1, 0.35, 0.05, 0.2] are ids 2, 0, 4
    np.testing.assert_array_equal(upload.ids, [0, 2, 4])
    np.testing.assert_allclose(upload.values, [0.3, 0.35, 0.2], rtol=1e-6)


@SETTINGS
@given(
    pair=distribution_pairs(),
    epsilon=st.floats(0.0, 64.0),
    alpha=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_dp_fusion_edge_samples_from_the_fused_mixture(
    pair: tuple[np.ndarray, np.ndarray], epsilon: float, alpha: float, seed: int
) -> None:
    p_slm, p_llm = (p.astype(np.float32) for p in pair)
    policy = DPFusion(epsilon=epsilon, max_new_tokens=4)
    token = policy.edge_token(p_slm, p_llm, alpha=alpha, rng=np.random.default_rng(seed)).token_id
    expected = sample_from(fuse(p_llm, policy.mixture(p_slm, p_llm), alpha), np.random.default_rng(seed))
    assert token == expected
    assert policy.edge_token(p_slm, p_llm, alpha=alpha, rng=np.random.default_rng(seed)).token_id == token


def test_dp_fusion_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="Renyi order"):
        DPFusion(order=1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        DPFusion(max_new_tokens=0)
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


def test_custext_probabilities_hand_worked() -> None:
    # similarities [1, 0.8, 0.6] -> u = [1, 0.5, 0]; eps = 2 -> weights [e, e^0.5, 1] / 5.3670031
    np.testing.assert_allclose(
        custext_probabilities(np.array([1.0, 0.8, 0.6]), 2.0), [0.5064804, 0.3071959, 0.1863237], atol=1e-7
    )
    np.testing.assert_allclose(custext_probabilities(np.array([0.3, 0.3]), 5.0), [0.5, 0.5])
    np.testing.assert_allclose(custext_probabilities(np.array([1.0, 0.0, -1.0]), 0.0), [1 / 3] * 3)


@SETTINGS
@given(
    similarities=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=30),
    epsilon=st.floats(0.0, 32.0),
)
def test_custext_probabilities_are_an_exponential_mechanism(similarities: list[float], epsilon: float) -> None:
    probabilities = custext_probabilities(np.asarray(similarities), epsilon)
    assert_distribution(probabilities)
    # utilities lie in [0, 1], so no two outputs differ by more than a factor e^(eps/2)
    assert probabilities.max() <= probabilities.min() * math.exp(epsilon / 2) * (1 + 1e-9)


def test_custext_replaces_the_fused_argmax_within_its_neighbours() -> None:
    # fused at alpha = 0.5: [0.2, 0.25, 0.2, 0.175, 0.175] -> argmax 1; 1's nearest three are
    # itself (1.0), 4 (0.96) and 0 (0.8)
    policy = CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), epsilon=1.0, n_neighbours=3)
    tokens = {policy.edge_token(P_SLM, P_LLM, alpha=0.5, rng=np.random.default_rng(s)).token_id for s in range(60)}
    assert tokens == {0, 1, 4}
    # a huge budget keeps the argmax itself (u = 1 against u = 0 for the farthest)
    greedy = CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), epsilon=500.0, n_neighbours=3)
    assert greedy.edge_token(P_SLM, P_LLM, alpha=0.5, rng=np.random.default_rng(0)).token_id == 1


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), token=st.integers(0, 4), epsilon=st.floats(0.0, 32.0))
def test_custext_same_seed_same_token(seed: int, token: int, epsilon: float) -> None:
    neighbours = EmbeddingNeighbours(CIRCLE_EMBEDDINGS)
    draws = [
        custext_replace(token, neighbours, epsilon=epsilon, n_neighbours=4, rng=np.random.default_rng(seed))
        for _ in range(2)
    ]
    assert draws[0] == draws[1]
    assert draws[0] in neighbours.of(token, 4)[0]


def test_custext_requires_neighbours() -> None:
    with pytest.raises(ValueError, match="EmbeddingNeighbours"):
        make_policy("custext", epsilon=4.0)
    with pytest.raises(ValueError, match="n_neighbours"):
        CusText(EmbeddingNeighbours(CIRCLE_EMBEDDINGS), n_neighbours=0)


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], raw_dtypes: dict[str, object] | None = None) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=(raw_dtypes or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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


def test_ldp_sampler_ratio_bounds_hand_worked() -> None:
    # e^eps = 2, gamma = 2: m = 3 / (2 + 2) = 0.75, e^eps * m = 1.5
    low, high = ldp_sampler_ratio_bounds(math.log(2.0), 2.0)
    assert low == pytest.approx(0.75)
    assert high == pytest.approx(1.5)
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


@SETTINGS
@given(pair=distribution_pairs(), epsilon=st.floats(0.0, 64.0), seed=st.integers(0, 2**32 - 1))
def test_ldp_sampler_policy_draws_from_q_reproducibly(
    pair: tuple[np.ndarray, np.ndarray], epsilon: float, seed: int
) -> None:
    p_slm, p_llm = (p.astype(np.float32) for p in pair)
    policy = LDPSampler(epsilon=epsilon)
    token = policy.edge_token(p_slm, p_llm, alpha=0.5, rng=np.random.default_rng(seed)).token_id
    q = ldp_sampler_distribution(p_slm, p_llm, epsilon=epsilon, gamma=2.0)
    assert token == sample_from(q, np.random.default_rng(seed))


@pytest.mark.parametrize(
    ("private", "public", "kwargs", "message"),
    [
        ([0.5, 0.5], [0.5, 0.5], {"epsilon": 1.0, "gamma": 0.5}, "gamma"),
        ([0.5, 0.5], [0.5, 0.5], {"epsilon": -1.0}, "epsilon"),
        ([0.0, 0.0], [0.5, 0.5], {"epsilon": 1.0}, "private distribution"),
        ([0.5, 0.5], [-0.5, 1.5], {"epsilon": 1.0}, "public anchor"),
        ([0.5, 0.5], [0.3, 0.3, 0.4], {"epsilon": 1.0}, "differ in length"),
    ],
)
def test_ldp_sampler_rejects_bad_input(private: list, public: list, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ldp_sampler_distribution(private, public, **kwargs)


# --------------------------------------------------------------------------- InvisibleInk


def test_invisible_ink_distribution_hand_worked() -> None:
    p_llm = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=np.float32)
    p_slm = np.array([0.0625, 0.0625, 0.125, 0.25, 0.5], dtype=np.float32)
    # C = 0.5, k = 2: threshold log(0.25) - 1 = -2.386 keeps log 0.5, log 0.25, log 0.125 (ids 0-2);
    # differences log(1/8), log(1/4), 0 clip to -0.5, -0.5, 0, so the weights are
    # [0.5 e^-0.5, 0.25 e^-0.5, 0.125] = [0.303265, 0.151633, 0.125] / 0.579898
    ids, probabilities = invisible_ink_distribution(p_slm, p_llm, clip=0.5, top_k=2)
    np.testing.assert_array_equal(ids, [0, 1, 2])
    np.testing.assert_allclose(probabilities, [0.522963, 0.261482, 0.215555], atol=1e-6)


def test_invisible_ink_without_clip_is_the_public_top_k() -> None:
    ids, probabilities = invisible_ink_distribution(P_SLM, P_LLM, clip=0.0, top_k=2)
    # top two of p_llm = [0.3, 0.1, 0.35, 0.05, 0.2] are ids 0 and 2
    np.testing.assert_array_equal(ids, [0, 2])
    np.testing.assert_allclose(probabilities, [0.3 / 0.65, 0.35 / 0.65], rtol=1e-6)


@SETTINGS
@given(
    pair=distribution_pairs(),
    clip=st.floats(0.0, 3.0),
    top_k=st.integers(1, 30),
    temperature=st.floats(0.5, 2.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_invisible_ink_never_samples_outside_top_k_plus(
    pair: tuple[np.ndarray, np.ndarray], clip: float, top_k: int, temperature: float, seed: int
) -> None:
    p_slm, p_llm = (p.astype(np.float32) for p in pair)
    z_public = log_probs(p_llm).astype(np.float64)
    kth = np.sort(z_public)[::-1][min(top_k, z_public.size) - 1]
    allowed = set(np.flatnonzero(z_public >= kth - 2 * clip - 1e-6).tolist())
    ids, probabilities = invisible_ink_distribution(p_slm, p_llm, clip=clip, top_k=top_k, temperature=temperature)
    assert set(ids.tolist()) <= allowed
    assert len(ids) >= min(top_k, p_llm.size)
    assert_distribution(probabilities)
    # the clipped logits z_bar stay within C of z_pub, so over V_k+ the log-odds of any two
    # tokens differ from the public ones by at most 2C / tau
    public_log_odds = (z_public[ids][:, None] - z_public[ids][None, :]) / temperature
    log_odds = np.log(probabilities)[:, None] - np.log(probabilities)[None, :]
    assert np.all(np.abs(log_odds - public_log_odds) <= 2 * clip / temperature + 1e-4)
    policy = InvisibleInk(epsilon=8.0, top_k=top_k, temperature=temperature)
    first = policy.edge_token(p_slm, p_llm, alpha=0.5, rng=np.random.default_rng(seed)).token_id
    again = policy.edge_token(p_slm, p_llm, alpha=0.5, rng=np.random.default_rng(seed)).token_id
    assert first == again
    policy_ids, _ = invisible_ink_distribution(p_slm, p_llm, clip=policy.clip, top_k=top_k, temperature=temperature)
    assert first in set(policy_ids.tolist())


def test_invisible_ink_policy_maps_epsilon_to_the_clip() -> None:
    policy = InvisibleInk(epsilon=16.0, temperature=1.2, max_new_tokens=100)
    assert policy.clip == invisible_ink_clip(16.0, max_new_tokens=100, delta=1e-6, temperature=1.2)


def test_invisible_ink_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="top_k"):
        InvisibleInk(top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        InvisibleInk(temperature=0.0)
    with pytest.raises(ValueError, match="clip bound"):
        invisible_ink_distribution(P_SLM, P_LLM, clip=-1.0, top_k=2)


# --------------------------------------------------------------------------- full vocabulary


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
        DPFusion(epsilon=64.0),
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
    assert 0.0 < dp_fusion_lambda(p_slm, p_llm, DPFusion(epsilon=64.0).bound) < 1.0


def test_dp_logit_uploads_valid_probabilities_even_under_large_noise() -> None:
    """The cloud refuses probability uploads outside [0, 1]; clamping is free post-processing."""
    p = np.full(1000, 1e-3, np.float32)
    ids, values = dp_logit_upload(p, sigma=50.0, upload_k=100, rng=np.random.default_rng(3))
    assert len(ids) == 100
    assert float(values.min()) >= 0.0 and float(values.max()) <= 1.0
