"""CoVeil: hand-worked steps and the invariants of both rules."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.fusion import fuse, top_k_ids
from edge_sdk.policies import CoVeil, available_policies, make_policy
from edge_sdk.protocol.signals import CloudUpload, SyncedToken
from edge_sdk.policies.coveil import (
    _omitted_upper_bounds,
    coveil_select,
    coveil_select_sparse,
    coveil_upload,
    coveil_upload_scores,
    coveil_upload_sparse,
)
from tests.conftest import distribution_pairs, distributions


def general_upload(p_slm: np.ndarray, p_llm: np.ndarray, alpha: float, lam: float, k: int) -> np.ndarray:
    """The general rule S = {i in C : g(i) < 0}, no fast path."""
    candidates = top_k_ids(p_slm, k)
    y_star = int(np.argmax(fuse(p_llm, p_slm, alpha)))
    g = coveil_upload_scores(p_slm, p_llm, candidates, y_star, alpha=alpha, lam=lam)
    return np.sort(candidates[g < 0])


P_SLM = np.array([0.6, 0.3, 0.1, 0.0], np.float32)
P_LLM = np.array([0.1, 0.2, 0.3, 0.4], np.float32)


def test_cloud_side_hand_worked() -> None:
    # p_fuse = 0.3*P_LLM + 0.7*P_SLM = [.45, .27, .16, .12] -> y* = 0; C = Top2(p_slm) = {0, 1}
    # g(0) = -0.7*0.6*(1 - 1/2) + lam*|0.6 - 0.1| = -0.21 + 0.5*lam
    # g(1) = -0.7*0.3*(0 - 1/2) + lam*|0.3 - 0.2| = 0.105 + 0.1*lam  (never negative)
    assert coveil_upload(P_SLM, P_LLM, alpha=0.3, lam=0.4, k=2).tolist() == [0]  # g(0) = -0.01
    assert coveil_upload(P_SLM, P_LLM, alpha=0.3, lam=0.42, k=2).tolist() == []  # g(0) = 0
    assert coveil_upload(P_SLM, P_LLM, alpha=0.3, lam=0.5, k=2).tolist() == []
    scores = coveil_upload_scores(P_SLM, P_LLM, np.array([0, 1]), 0, alpha=0.3, lam=0.4)
    np.testing.assert_allclose(scores, [-0.01, 0.145], atol=1e-7)


def test_edge_side_hand_worked() -> None:
    # p_fuse = [.45, .27, .16, .12]; J(i) = -(p_fuse(i) - .45) + lam*(p_slm(i) - p_llm(i))
    # lam=1: J = [0.5, 0.28, 0.09, -0.07] -> 3;  lam=0.2: J = [0.1, 0.2, 0.25, 0.25] -> 0
    assert coveil_select(P_SLM, P_LLM, alpha=0.3, lam=1.0, k=4) == 3
    assert coveil_select(P_SLM, P_LLM, alpha=0.3, lam=0.2, k=4) == 0
    assert coveil_select(P_SLM, P_LLM, alpha=0.3, lam=1.0, k=3) == 2  # id 3 is outside Top3(p_fuse)


def test_tie_break_prefers_higher_fused_then_lower_id() -> None:
    p_slm = np.array([0.25, 0.25, 0.25, 0.25], np.float32)
    p_llm = np.array([0.25, 0.25, 0.25, 0.25], np.float32)
    assert coveil_select(p_slm, p_llm, alpha=0.5, lam=3.0, k=4) == 0


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(distribution_pairs(), st.floats(0.0, 1.0), st.floats(0.0, 20.0), st.integers(1, 70))
def test_fast_path_equals_general_rule(pair, alpha: float, lam: float, k: int) -> None:
    p_slm, p_llm = pair
    np.testing.assert_array_equal(
        coveil_upload(p_slm, p_llm, alpha=alpha, lam=lam, k=k), general_upload(p_slm, p_llm, alpha, lam, k)
    )


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(distribution_pairs(), st.floats(0.0, 1.0), st.floats(0.0, 20.0), st.integers(1, 70))
def test_upload_lies_in_top_k_of_slm(pair, alpha: float, lam: float, k: int) -> None:
    p_slm, p_llm = pair
    upload = coveil_upload(p_slm, p_llm, alpha=alpha, lam=lam, k=k)
    assert set(upload.tolist()) <= set(top_k_ids(p_slm, k).tolist())
    logit_upload = coveil_upload(np.log(p_slm + 1e-9), np.log(p_llm + 1e-9), alpha=alpha, lam=lam, k=k, space="logit")
    assert set(logit_upload.tolist()) <= set(top_k_ids(np.log(p_slm + 1e-9), k).tolist())


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(distribution_pairs(), st.floats(0.0, 0.99), st.integers(2, 70))
def test_lambda_zero_uploads_exactly_y_star_and_keeps_it_the_argmax(pair, alpha: float, k: int) -> None:
    p_slm, p_llm = pair
    y_star = int(np.argmax(fuse(p_llm, p_slm, alpha)))
    upload = coveil_upload(p_slm, p_llm, alpha=alpha, lam=0.0, k=k)
    if y_star in set(top_k_ids(p_slm, k).tolist()) and p_slm[y_star] > 0:
        assert upload.tolist() == [y_star]
        masked = CloudUpload.of(p_slm, upload).fuse_with(p_llm, alpha)
        assert int(np.argmax(masked)) == y_star
    else:
        assert upload.tolist() == []


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(distribution_pairs(), st.floats(0.0, 1.0), st.integers(1, 70))
def test_edge_side_lambda_zero_returns_y_star(pair, alpha: float, k: int) -> None:
    p_slm, p_llm = pair
    assert coveil_select(p_slm, p_llm, alpha=alpha, lam=0.0, k=k) == int(np.argmax(fuse(p_llm, p_slm, alpha)))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(distribution_pairs(), st.floats(0.0, 1.0), st.integers(1, 70))
def test_large_lambda_uploads_nothing_unless_the_models_agree(pair, alpha: float, k: int) -> None:
    p_slm, p_llm = pair
    upload = coveil_upload(p_slm, p_llm, alpha=alpha, lam=1e6, k=k)
    # only a token with (almost) no edge-cloud discrepancy can survive an enormous privacy weight
    assert all(abs(float(p_slm[i]) - float(p_llm[i])) < 1e-5 for i in upload)


@settings(max_examples=200, deadline=None)
@given(distribution_pairs(), st.floats(0.0, 1.0), st.floats(0.0, 5.0), st.integers(1, 70))
def test_edge_side_choice_is_a_candidate_minimising_j(pair, alpha: float, lam: float, k: int) -> None:
    p_slm, p_llm = pair
    p_fuse = fuse(p_llm, p_slm, alpha).astype(np.float64)
    candidates = top_k_ids(fuse(p_llm, p_slm, alpha), k)
    chosen = coveil_select(p_slm, p_llm, alpha=alpha, lam=lam, k=k)
    assert chosen in set(candidates.tolist())
    objective = -(p_fuse - p_fuse[candidates[0]]) + lam * (p_slm.astype(np.float64) - p_llm)
    assert objective[chosen] <= objective[candidates].min() + 1e-12


def test_policy_objects_report_what_the_cloud_sees() -> None:
    policy = make_policy("coveil", lam=0.4, k=2)
    upload = policy.decide("cloud", P_SLM, P_LLM, alpha=0.3)
    assert isinstance(upload, CloudUpload)
    assert upload.ids.tolist() == [0] and upload.values.tolist() == [pytest.approx(0.6)]
    assert upload.exposure(100).tolist() == [0]
    token = policy.decide("edge", P_SLM, P_LLM, alpha=0.3)
    assert isinstance(token, SyncedToken)
    assert {"coveil", "undefended"} <= set(available_policies("cloud"))


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="lam"):
        CoVeil(lam=-1.0)
    with pytest.raises(ValueError, match="pool size"):
        CoVeil(k=0)
    with pytest.raises(ValueError, match="space"):
        CoVeil(space="bits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha"):
        coveil_upload(P_SLM, P_LLM, alpha=1.5)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_upload_validation() -> None:
    with pytest.raises(ValueError, match="unique"):
        CloudUpload(np.array([2, 2]), np.array([0.1, 0.2]))
    upload = CloudUpload(np.array([5, 1]), np.array([0.5, 0.1]))
    assert upload.ids.tolist() == [1, 5] and upload.values.tolist() == [pytest.approx(0.1), pytest.approx(0.5)]


def sparse_view(p_llm: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, float]:
    """What the cloud sends: its top-m ids, a dense lower bound (0 where omitted) and the tail bound."""
    ids = top_k_ids(p_llm, m)
    lower = np.zeros_like(p_llm)
    lower[ids] = p_llm[ids]
    tail = float(p_llm[ids[-1]]) if len(ids) < len(p_llm) else 0.0
    return ids, lower, tail


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(distribution_pairs(2, 80), st.integers(1, 40), st.integers(1, 30), st.floats(0.0, 1.0), st.floats(0.0, 5.0))
def test_sparse_decisions_are_the_full_decisions_whenever_certified(pair, m: int, k: int, alpha: float, lam: float):
    p_slm, p_llm = pair
    ids, lower, tail = sparse_view(p_llm, m)
    policy = CoVeil(lam=lam, k=k)
    for mode in ("cloud", "edge"):
        sparse = policy.decide_sparse(mode, p_slm, lower, ids, tail, alpha=alpha)
        full = policy.decide(mode, p_slm, p_llm, alpha=alpha)
        if sparse is not None:
            assert type(sparse) is type(full)
            if isinstance(full, SyncedToken):
                assert sparse.token_id == full.token_id
            else:
                assert sparse.ids.tolist() == full.ids.tolist()
                assert sparse.values.tolist() == full.values.tolist()
    token = coveil_select_sparse(p_slm, lower, ids, tail, alpha=alpha, lam=lam, k=k)
    if token is not None:
        assert token == coveil_select(p_slm, p_llm, alpha=alpha, lam=lam, k=k)


@settings(max_examples=500, deadline=None)
@given(distributions(2, 80), st.data(), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(-0.5, 1.5))
def test_omitted_upper_bounds_equal_a_full_vocabulary_pass(p_slm, data, alpha: float, tail_bound: float, shift: float):
    known = np.zeros(p_slm.shape[0], dtype=bool)
    known[data.draw(st.lists(st.integers(0, p_slm.shape[0] - 1), max_size=p_slm.shape[0]))] = True
    j = data.draw(st.integers(0, p_slm.shape[0] - 1))
    # levels right at some ub(j) (the cancellation case lowest ~ alpha * b included), or anywhere
    full_upper = np.where(known, -np.inf, alpha * tail_bound + (1.0 - alpha) * p_slm.astype(np.float64))
    lowest = float(full_upper[j]) if np.isfinite(full_upper[j]) and shift < 0.5 else alpha * tail_bound * shift
    ids, upper = _omitted_upper_bounds(p_slm, known, alpha, tail_bound, lowest)
    assert ids.tolist() == np.flatnonzero(full_upper >= lowest).tolist()
    assert upper.tolist() == full_upper[full_upper >= lowest].tolist()


def test_cloud_side_sparse_upload_breaks_a_fused_tie_to_the_lower_id_as_the_full_rule() -> None:
    # ids 1 and 3 tie exactly for the top fused value (0.3 * 0.3 + 0.7 * 0.3); the cloud sent its top-3
    # (3, 1, 0), every omitted p_llm <= 0.2; omitted id 4 reaches at most 0.3 * 0.2 + 0.7 * 0.25 = 0.235
    p_slm = np.array([0.1, 0.3, 0.05, 0.3, 0.25], np.float32)
    p_llm = np.array([0.2, 0.3, 0.05, 0.3, 0.15], np.float32)
    ids = np.array([3, 1, 0])
    lower = np.zeros_like(p_llm)
    lower[ids] = p_llm[ids]
    policy = CoVeil(lam=0.0, k=3)
    sparse = policy.decide_sparse("cloud", p_slm, lower, ids, 0.2, alpha=0.3)
    full = policy.decide("cloud", p_slm, p_llm, alpha=0.3)
    assert sparse is not None and sparse.ids.tolist() == full.ids.tolist() == [1]
    # with p_slm(4) = 0.35 the omitted id could reach 0.3 * 0.2 + 0.7 * 0.35 = 0.305 > 0.3: not certified
    p_slm = np.array([0.05, 0.3, 0.0, 0.3, 0.35], np.float32)
    assert coveil_upload_sparse(p_slm, ids, p_llm[ids], 0.2, alpha=0.3, lam=0.0, k=3) is None
    assert coveil_upload_sparse(p_slm, ids, p_llm[ids], 0.1, alpha=0.3, lam=0.0, k=3).tolist() == [1]


def test_the_finer_edge_certificate_accepts_a_tail_token_that_cannot_win() -> None:
    # Top-2 fused = {0, 3}; the cloud sent ids 0-2 only.  Omitted id 3 enters TopK through p_slm, but
    # J(3) >= p_fuse(0) + (lam - 1 + alpha)*0.3 - (alpha + lam)*b is far above J(0) = 0 at lam = 2.
    p_slm = np.array([0.7, 0.0, 0.0, 0.3], np.float32)
    p_llm = np.array([0.6, 0.2, 0.15, 0.05], np.float32)
    ids, lower, tail = sparse_view(p_llm, 3)
    assert CoVeil(lam=2.0, k=2).llm_support("edge") is not None
    from edge_sdk.fusion import certify_fused_top_k

    assert not certify_fused_top_k(p_slm, ids, p_llm[ids], tail, 0.3, 2)  # the generic certificate refuses
    assert coveil_select_sparse(p_slm, lower, ids, tail, alpha=0.3, lam=2.0, k=2) == 0
    assert CoVeil(lam=2.0, k=2).decide_sparse("edge", p_slm, lower, ids, tail, alpha=0.3) == SyncedToken(0)


@pytest.mark.parametrize(("params", "error"), [
    ({"lam": True}, "coveil parameter lam must be a number, got True"),
    ({"lam": "1"}, "coveil parameter lam must be a number, got '1'"),
    ({"k": 1.5}, "coveil parameter k must be an integer, got 1.5"),
    ({"k": False}, "coveil parameter k must be a number, got False"),
])
def test_a_parameter_of_the_wrong_type_is_refused_by_name(params: dict, error: str) -> None:
    # JSON and command lines hand over bools, strings and fractions where a number or a pool size is meant
    with pytest.raises(ValueError, match=re.escape(error)):
        make_policy("coveil", **params)


def test_a_whole_float_is_a_pool_size_and_an_int_a_weight() -> None:
    policy = make_policy("coveil", lam=2, k=7.0)
    assert (policy.lam, type(policy.lam), policy.k, type(policy.k)) == (2.0, float, 7, int)
    assert make_policy("invisible_ink", top_k=None).top_k is None  # an optional field keeps None
