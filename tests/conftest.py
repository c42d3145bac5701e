"""Shared fixtures: random distributions for the math tests, the embedded models for integration tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def distributions(min_size: int = 2, max_size: int = 64) -> st.SearchStrategy[np.ndarray]:
    """Probability vectors (float32, non-negative, summing to 1) with frequent ties and zeros."""
    weights = hnp.arrays(
        np.float32,
        st.integers(min_size, max_size),
        elements=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 100.0, width=32)),
    )
    return weights.filter(lambda w: w.sum() > 0).map(lambda w: (w / w.sum(dtype=np.float64)).astype(np.float32))


def distribution_pairs(min_size: int = 2, max_size: int = 64) -> st.SearchStrategy[tuple[np.ndarray, np.ndarray]]:
    """Two distributions over one vocabulary."""
    return st.integers(min_size, max_size).flatmap(
        lambda n: st.tuples(distributions(n, n), distributions(n, n))
    )


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
