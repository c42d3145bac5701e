"""Fusion math: hand-worked cases and properties of TopK, rank tests and certification."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_sdk.fusion import (
    certify_fused_top_k,
    fuse,
    fuse_upload,
    in_top_k,
    pick_token,
    sample_from,
    softmax,
    top_k_ids,
)
from tests.conftest import distribution_pairs


def reference_top_k(values: np.ndarray, k: int) -> np.ndarray:
    ids = np.arange(len(values))
    return np.lexsort((ids, -values.astype(np.float64)))[:k]


def test_fuse_hand_worked() -> None:
    p_llm = np.array([0.5, 0.5, 0.0], np.float32)
    p_slm = np.array([0.0, 0.2, 0.8], np.float32)
    # 0.3*[.5,.5,0] + 0.7*[0,.2,.8] = [.15, .29, .56]
    np.testing.assert_allclose(fuse(p_llm, p_slm, 0.3), [0.15, 0.29, 0.56], rtol=1e-6)
    # only id 1 uploaded: [.15, .15 + .14, 0]
    np.testing.assert_allclose(fuse_upload(p_llm, np.array([1]), np.array([0.2]), 0.3), [0.15, 0.29, 0.0], rtol=1e-6)


def test_softmax_matches_definition() -> None:
    z = np.array([1.0, 2.0, 3.0], np.float32)
    expected = np.exp(z) / np.exp(z).sum()
    np.testing.assert_allclose(softmax(z), expected, rtol=1e-6)
    np.testing.assert_allclose(softmax(z, temperature=2.0), np.exp(z / 2) / np.exp(z / 2).sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        softmax(z, temperature=0.0)


def test_top_k_breaks_ties_by_lower_id() -> None:
    values = np.array([0.1, 0.3, 0.3, 0.2, 0.3], np.float32)
    assert top_k_ids(values, 2).tolist() == [1, 2]
    assert top_k_ids(values, 4).tolist() == [1, 2, 4, 3]
    assert top_k_ids(values, 0).tolist() == []
    assert top_k_ids(values, 10).tolist() == [1, 2, 4, 3, 0]


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 9000), elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 3.5])),
    st.integers(1, 300),
)
def test_top_k_equals_full_sort_with_ties(values: np.ndarray, k: int) -> None:
    np.testing.assert_array_equal(top_k_ids(values, k), reference_top_k(values, k))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 200))
def test_top_k_equals_full_sort_on_large_random_vocabularies(seed: int, k: int) -> None:
    gen = np.random.default_rng(seed)
    values = gen.standard_normal(50_000).astype(np.float32)
    np.testing.assert_array_equal(top_k_ids(values, k), reference_top_k(values, k))


@settings(max_examples=300, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 60), elements=st.sampled_from([0.0, 0.1, 0.2, 0.3])),
    st.data(),
)
def test_in_top_k_agrees_with_selection(values: np.ndarray, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(values) - 1))
    k = data.draw(st.integers(0, len(values) + 1))
    assert in_top_k(values, i, k) == (i in set(top_k_ids(values, k).tolist()))


def test_pick_token_greedy_and_seeded_sampling() -> None:
    p = np.array([0.1, 0.6, 0.3], np.float32)
    assert pick_token(p) == 1
    draws = [pick_token(p, temperature=1.0, rng=np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    with pytest.raises(ValueError, match="Generator"):
        pick_token(p, temperature=1.0)
    with pytest.raises(ValueError, match="not all zero"):
        sample_from(np.zeros(3), np.random.default_rng(0))


def test_sample_from_follows_the_weights() -> None:
    gen = np.random.default_rng(0)
    counts = np.bincount([sample_from(np.array([1.0, 3.0, 0.0]), gen) for _ in range(4000)], minlength=3)
    assert counts[2] == 0
    assert 0.70 < counts[1] / 4000 < 0.80


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(distribution_pairs(2, 80), st.integers(1, 40), st.integers(1, 8), st.floats(0.0, 1.0))
def test_certified_top_k_is_the_true_top_k(pair: tuple[np.ndarray, np.ndarray], m: int, k: int, alpha: float) -> None:
    """Whenever the sparse view certifies, the fused top-k from it equals the one from the full p_llm."""
    p_slm, p_llm = pair
    ids = reference_top_k(p_llm, m)
    tail = float(p_llm[ids[-1]]) if len(ids) < len(p_llm) else 0.0
    before = p_slm.copy()
    certified = certify_fused_top_k(p_slm, ids, p_llm[ids], tail, alpha, k)
    np.testing.assert_array_equal(p_slm, before)  # the row is restored
    if certified:
        lower = np.zeros_like(p_llm)
        lower[ids] = p_llm[ids]
        np.testing.assert_array_equal(
            top_k_ids(fuse(lower, p_slm, alpha), k), top_k_ids(fuse(p_llm, p_slm, alpha), k)
        )


def test_certification_refuses_when_the_tail_could_win() -> None:
    p_llm = np.array([0.5, 0.3, 0.2], np.float32)
    p_slm = np.array([0.0, 0.0, 1.0], np.float32)
    # cloud sent only id 0; id 2 could reach 0.3*0.5 + 0.7*1.0 > 0.3*0.5
    assert not certify_fused_top_k(p_slm, np.array([0]), p_llm[[0]], 0.5, 0.3, 1)
    assert certify_fused_top_k(p_slm, np.array([0, 1, 2]), p_llm, 0.0, 0.3, 2)


def test_sampling_at_a_tiny_temperature_is_the_argmax_not_a_crash() -> None:
    # 20 ids, the largest 0.062: 0.062 ** (1 / 0.002) = 10**-604, which float64 rounds to 0 for every id
    p = np.full(20, 0.0494, dtype=np.float32)
    p[13] = 0.062
    for temperature in (0.002, 1e-6):
        assert pick_token(p, temperature=temperature, rng=np.random.default_rng(0)) == 13
    # two equal maxima stay a fair choice between them
    p[4] = 0.062
    draws = {pick_token(p, temperature=0.002, rng=np.random.default_rng(seed)) for seed in range(40)}
    assert draws == {4, 13}
