"""CoVeil in logit space: the authors' release rules on raw logits, hand-worked and against a reference.

The reference below is written from the rule's statement (a plain loop over
Python numbers, exact ``Fraction`` arithmetic), not from the implementation.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.policies import CoVeil

from edge_sdk.protocol.signals import CloudUpload, SyncedToken
from edge_sdk.policies.coveil import (
    coveil_select,
    coveil_select_logit,
    coveil_select_logit_sparse,
    coveil_upload,
    coveil_upload_logit,
    coveil_upload_logit_sparse,
)
from edge_sdk.protocol.wire import CloudDistribution


def z(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# -- hand-worked steps -----------------------------------------------------------------------------


def test_cloud_side_hand_worked() -> None:
    # z_S = [3, 1, -2, 0.5], z_L = [2, 2.5, 0, 1], alpha = 0.5, K = 3
    # C = TopK(z_S, 3) = [0, 1, 3];  r = 0.5 z_L + 0.5 z_S on C = [2.5, 1.75, 0, 0.75]  ->  w = 0
    # g(0) = -0.5*3*(1 - 1/3) + lam*|3 - 2| = -1 + lam;  g(1) = -0.5*1*(0 - 1/3) + lam*1.5 = 1/6 + 1.5 lam
    # g(3) = -0.5*0.5*(-1/3) + lam*0.5 = 1/12 + 0.5 lam
    z_slm, z_llm = z(3, 1, -2, 0.5), z(2, 2.5, 0, 1)
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=0.0, k=3).tolist() == [0]
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=0.5, k=3).tolist() == [0]
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=1.0, k=3).tolist() == []  # g(0) = 0 is not < 0
    # K = 4 adds id 2 (z_S = -2): g(2) = -0.5*(-2)*(0 - 1/4) + lam*2 = -0.25 + 2 lam; g(0) = -1.125 + lam
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=0.0, k=4).tolist() == [0, 2]
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=0.1, k=4).tolist() == [0, 2]  # g(2) = -0.05
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=0.2, k=4).tolist() == [0]  # g(2) = +0.15


def test_cloud_side_winner_counts_the_slm_on_the_candidates_only() -> None:
    # id 2 is outside C = TopK(z_S, 3) = [0, 1, 3], so r(2) = 0.5 * z_L(2) = 2.75 beats r(0) = 2.5: w = 2.
    # (Fusing the whole vocabulary instead gives 0.5*5.5 + 0.5*(-8) = -1.25 at id 2, and w would be 0.)
    # With w outside C every candidate's indicator is 0: g(0) = -0.5*3*(-1/3) = 0.5 > 0, nothing is uploaded.
    z_slm, z_llm = z(3, 1, -8, 0.5), z(2, 2.5, 5.5, 1)
    assert coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=0.0, k=3).tolist() == []


def test_edge_side_hand_worked() -> None:
    # z_L = [4, 3, 2, 0], z_S = [0, 1, 5, 2], alpha = 0.5, K = 2
    # f = [2, 2, 3.5, 1] -> argmax f = 2;  TopK(z_L, 2) = [0, 1];  C = [0, 1, 2] (by decreasing z_L)
    # r = 0.5 z_L + 0.5 z_S on C = [2, 2, 3.5, 0] -> w = 2
    # u(0) = 0, u(1) = -(0.5*1*(-1/3)) = 1/6, u(2) = -(0.5*5*(2/3)) = -5/3
    # means over C: z_S 2, z_L 3;  p(0) = -2 - 1 = -3, p(1) = -1 - 0 = -1, p(2) = 3 + 1 = 4
    # lam = 0: J = u -> 2;  lam = 0.2: J = [-0.6, -0.033, -0.867] -> 2;  lam = 0.3: J = [-0.9, -0.133, -0.467] -> 0
    z_llm, z_slm = z(4, 3, 2, 0), z(0, 1, 5, 2)
    assert coveil_select_logit(z_slm, z_llm, alpha=0.5, lam=0.0, k=2) == 2
    assert coveil_select_logit(z_slm, z_llm, alpha=0.5, lam=0.2, k=2) == 2
    assert coveil_select_logit(z_slm, z_llm, alpha=0.5, lam=0.3, k=2) == 0
    assert coveil_select(z_slm, z_llm, alpha=0.5, lam=0.3, k=2, space="logit") == 0


def test_edge_side_adds_an_outside_winner_and_recomputes() -> None:
    # z_L = [5, 4, 0, -3], z_S = [-10, -10, 0, 2], alpha = 0.5, K = 1
    # f = [-2.5, -3, 0, -0.5] -> argmax f = 2;  C = {TopK(z_L,1) = 0, 2} = [0, 2]
    # r = [2.5 - 5, 2, 0 + 0, -1.5] = [-2.5, 2, 0, -1.5] -> w = 1, outside C: C = [0, 1, 2]
    # recomputed r = [-2.5, 2 - 5, 0, -1.5] -> w = 2
    # u = [-(0.5*(-10)*(-1/3)), same, 0] = [-5/3, -5/3, 0];  means z_S -20/3, z_L 3
    # p = [-10/3 - 2, -10/3 - 1, 20/3 + 3] = [-16/3, -13/3, 29/3]
    # lam = 0.5: J = [-5/3 - 8/3, -5/3 - 13/6, 0 + 29/6] = [-4.33, -3.83, 4.83] -> 0
    # Without adding w (C = [0, 2], w = 1 outside): u = [-(0.5*(-10)*(-1/2)), 0] = [-2.5, 0];
    # means z_S -5, z_L 2.5; p = [-5 - 2.5, 5 + 2.5] = [-7.5, 7.5]; lam = 0.5 -> J = [-6.25, 3.75] -> 0 as well,
    # so the distinguishing case is lam = 0 with the tie of ids 0 and 1 (both -5/3): first in C's order, 0.
    z_llm, z_slm = z(5, 4, 0, -3), z(-10, -10, 0, 2)
    assert coveil_select_logit(z_slm, z_llm, alpha=0.5, lam=0.5, k=1) == 0
    assert coveil_select_logit(z_slm, z_llm, alpha=0.5, lam=0.0, k=1) == 0
    assert reference_select(z_slm.tolist(), z_llm.tolist(), Fraction(1, 2), Fraction(0), 1)[1] == {0, 1}


# -- an independent reference ----------------------------------------------------------------------


def _top(values: list[Fraction], k: int) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def _argmax(values: list[Fraction]) -> int:
    return _top(values, 1)[0]


def reference_upload(z_s: list[float], z_l: list[float], alpha: Fraction, lam: Fraction, k: int) -> list[int]:
    s = [Fraction(v) for v in z_s]
    big = [Fraction(v) for v in z_l]
    pool = _top(s, k)
    r = [alpha * big[i] + ((1 - alpha) * s[i] if i in pool else 0) for i in range(len(s))]
    w = _argmax(r)
    chosen = []
    for c in pool:
        g = -(1 - alpha) * s[c] * ((1 if c == w else 0) - Fraction(1, len(pool))) + lam * abs(s[c] - big[c])
        if g < 0:
            chosen.append(c)
    return sorted(chosen)


def reference_select(z_s: list[float], z_l: list[float], alpha: Fraction, lam: Fraction, k: int) -> tuple[list[int], set[int]]:
    """The candidate order and the set of exact minimisers of the edge-side objective."""
    s = [Fraction(v) for v in z_s]
    big = [Fraction(v) for v in z_l]
    fused = [alpha * big[i] + (1 - alpha) * s[i] for i in range(len(s))]

    def ordered(ids: set[int]) -> list[int]:
        return sorted(ids, key=lambda i: (-big[i], i))

    pool = ordered(set(_top(big, k)) | {_argmax(fused), _argmax(big)})

    def winner(ids: list[int]) -> int:
        return _argmax([alpha * big[i] + ((1 - alpha) * s[i] if i in ids else 0) for i in range(len(s))])

    w = winner(pool)
    if w not in pool:
        pool = ordered(set(pool) | {w})
        w = winner(pool)
    mean_s = sum(s[c] for c in pool) / len(pool)
    mean_l = sum(big[c] for c in pool) / len(pool)
    objective = {
        c: -(1 - alpha) * s[c] * ((1 if c == w else 0) - Fraction(1, len(pool)))
        + lam * ((s[c] - mean_s) - (big[c] - mean_l))
        for c in pool
    }
    best = min(objective.values())
    return pool, {c for c, value in objective.items() if value == best}


logit_rows = st.integers(2, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(-8, 8).map(lambda v: v / 2), min_size=n, max_size=n),
        st.lists(st.integers(-8, 8).map(lambda v: v / 2), min_size=n, max_size=n),
    )
)


@settings(max_examples=300, deadline=None)
@given(logit_rows, st.sampled_from([0.25, 0.5, 0.75]), st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       st.sampled_from([1, 2, 4, 8]))
def test_cloud_side_matches_the_reference(rows, alpha, lam, k) -> None:
    # halves, quarter weights and K a power of two: every float32 step is exact, so equality is exact
    z_s, z_l = rows
    got = coveil_upload_logit(z(*z_s), z(*z_l), alpha=alpha, lam=lam, k=k).tolist()
    assert got == reference_upload(z_s, z_l, Fraction(alpha), Fraction(lam), k)
    assert got == coveil_upload(z(*z_s), z(*z_l), alpha=alpha, lam=lam, k=k, space="logit").tolist()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(logit_rows, st.sampled_from([0.25, 0.5, 0.75]), st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       st.integers(1, 6))
def test_edge_side_matches_the_reference(rows, alpha, lam, k) -> None:
    z_s, z_l = rows
    pool, minimisers = reference_select(z_s, z_l, Fraction(alpha), Fraction(lam), k)
    chosen = coveil_select_logit(z(*z_s), z(*z_l), alpha=alpha, lam=lam, k=k)
    assert chosen in minimisers
    if len(minimisers) == 1:
        assert chosen == next(iter(minimisers))


# -- sparse cloud rows -----------------------------------------------------------------------------


def peaked_logits(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    z_llm = (rng.standard_normal(vocab) * 2.0).astype(np.float32)
    z_slm = (z_llm + rng.standard_normal(vocab)).astype(np.float32)
    z_llm[rng.integers(0, vocab, 4)] += 10.0
    z_slm[rng.integers(0, vocab, 4)] += 10.0
    return z_slm, z_llm


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_sparse_logit_decisions_equal_full_ones_when_certified(mode: str) -> None:
    rng = np.random.default_rng(7)
    policy = CoVeil(lam=1.0, k=20, space="logit")
    certified = 0
    for trial in range(200):
        vocab = 3000
        z_slm, z_llm = peaked_logits(rng, vocab)
        if trial % 3 == 0:  # models that agree closely: the SLM's candidates sit in the cloud's top-M
            z_slm = (z_llm + 0.1 * rng.standard_normal(vocab)).astype(np.float32)
        top_m = int(rng.choice([25, 64, 256]))
        dist = CloudDistribution.sparse_from(0, z_llm, top_m)
        lower = dist.lower_dense(vocab, fill=np.finfo(np.float32).min)
        decision = policy.decide_sparse(mode, z_slm, lower, dist.ids, dist.tail_bound, alpha=0.5)
        full = policy.decide(mode, z_slm, z_llm, alpha=0.5)
        if decision is None:
            continue
        certified += 1
        if mode == "cloud":
            assert isinstance(decision, CloudUpload)
            assert decision.ids.tolist() == full.ids.tolist() and decision.space == "logit"
        else:
            assert isinstance(decision, SyncedToken) and decision.token_id == full.token_id
    assert certified >= 40  # the certificates are not vacuous


def test_sparse_logit_certificates_refuse_what_they_cannot_know() -> None:
    # cloud-side: C = TopK(z_S, 2) = [2, 3]; the cloud sent only ids 0 and 1: z_L(3) is unknown
    z_slm = z(0, 1, 9, 8)
    assert coveil_upload_logit_sparse(z_slm, np.array([0, 2]), z(5, 4), 3.0, alpha=0.5, lam=1.0, k=2) is None
    # every candidate known (z_L(2) = z_L(3) = -8): r(2) = -4 + 4.5 = 0.5, r(3) = -4 + 4 = 0, but an omitted
    # id with z_L up to the bound 6 has r up to 0.5*6 = 3 and could be the winner
    assert coveil_upload_logit_sparse(z_slm, np.array([2, 3]), z(-8, -8), 6.0, alpha=0.5, lam=1.0, k=2) is None
    # edge-side: K = 2 but only two ids were sent, their last one being the bound: an omitted id may tie it
    assert coveil_select_logit_sparse(z(1, 2, 3), np.array([0, 1]), z(5, 4), 4.0, alpha=0.5, lam=1.0, k=2) is None


def test_full_row_decisions_never_read_the_sparse_fill() -> None:
    """A complete row (every id sent) is certified whatever the bound says."""
    rng = np.random.default_rng(3)
    z_slm, z_llm = peaked_logits(rng, 300)
    ids = np.argsort(-z_llm, kind="stable")
    got = coveil_select_logit_sparse(z_slm, ids, z_llm[ids], 1e30, alpha=0.5, lam=1.0, k=10)
    assert got == coveil_select_logit(z_slm, z_llm, alpha=0.5, lam=1.0, k=10)
    up = coveil_upload_logit_sparse(z_slm, ids, z_llm[ids], 1e30, alpha=0.5, lam=1.0, k=10)
    assert up is not None and up.tolist() == coveil_upload_logit(z_slm, z_llm, alpha=0.5, lam=1.0, k=10).tolist()


def test_certificates_hold_when_the_bound_nearly_cancels() -> None:
    """alpha*b and (1-alpha)*max z_S omitted nearly cancel: a margin relative to their sum (~0) let an omitted
    id's rounding beat the bound, and the sparse rule certified id 0 where the full rule picks id 2."""
    from edge_sdk.policies import Undefended

    z_llm = z(0, -30, -30)
    z_slm = z(-0.05712250620126724, -5000, 12.800020217895508)
    assert coveil_select_logit(z_slm, z_llm, alpha=0.3, lam=0.0, k=1) == 2  # 0.3*-30 + 0.7*12.8 = 0.96 > -0.04
    dist = CloudDistribution.sparse_from(0, z_llm, 2)
    assert dist.ids.tolist() == [0, 1] and dist.tail_bound == -30.0
    lower = dist.lower_dense(3, fill=np.finfo(np.float32).min)
    assert coveil_select_logit_sparse(z_slm, dist.ids, dist.values, dist.tail_bound, alpha=0.3, lam=0.0, k=1) in (2, None)
    decision = Undefended(space="logit").decide_sparse("edge", z_slm, lower, dist.ids, dist.tail_bound, alpha=0.3)
    assert decision is None or decision.token_id == 2
