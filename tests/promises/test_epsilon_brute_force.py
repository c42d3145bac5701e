"""The ledger's epsilon against the exact epsilon of whole generations, by enumeration on small vocabularies.

Two private contexts give each step's SLM row (a function of the context and the prefix so far, drawn spiky
from a seeded Dirichlet, some with exact zeros); the cloud's row is a function of the prefix only.  Every
sequence of ``T`` tokens over a vocabulary of ``V`` has its exact probability under each context (the product of
the policy's per-step distributions), and the exact epsilon at ``delta`` is the smallest ``eps`` whose
hockey-stick divergence ``sum (P - e^eps Q)_+`` is at most ``delta`` in both directions.  It never exceeds
what the ledger (:class:`~edge_sdk.privacy.accountant.PrivacyAccountant`) says ``T`` releases spent.  The source's
weaker relation (a context against none) does not hold between two contexts: for InvisibleInk the source's
figure is exceeded by a concrete pair, the reason the ledger charges the 2C sensitivity.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from edge_sdk.privacy.accountant import PrivacyAccountant
from edge_sdk.policies import DPFusion, InvisibleInk, LDPSampler
from edge_sdk.policies.dp_fusion import dp_fusion_mixture, dp_fusion_rows
from edge_sdk.policies.invisible_ink import invisible_ink_distribution
from edge_sdk.policies.ldp_sampler import ldp_sampler_distribution

VOCAB = 4
TOKENS = 3

Rows = Callable[[int, tuple[int, ...]], tuple[np.ndarray, np.ndarray]]


def spiky_rows(seed: int) -> Rows:
    """``(p_slm, p_llm)`` at a prefix for context 0 or 1: Dirichlet(0.15) rows, every third SLM row with an exact
    zero; the cloud's row depends on the prefix only."""

    def rows(context: int, prefix: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        slm = np.random.default_rng([seed, 1 + context, *prefix, 99]).dirichlet(np.full(VOCAB, 0.15))
        if (len(prefix) + context + seed) % 3 == 0:
            slm[np.argmin(slm)] = 0.0
            slm /= slm.sum()
        llm = np.random.default_rng([seed, 0, *prefix, 99]).dirichlet(np.full(VOCAB, 0.6))
        return slm.astype(np.float32), llm.astype(np.float32)

    return rows


def opposed_rows(context: int, prefix: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The worst case for a clipped-logit sampler: each context all but certain of its own token, the cloud
    indifferent, at every step."""
    slm = np.full(VOCAB, 1e-6)
    slm[context] = 1.0
    return (slm / slm.sum()).astype(np.float32), np.full(VOCAB, 1.0 / VOCAB, dtype=np.float32)


def sequence_probabilities(step: Callable[[np.ndarray, np.ndarray], np.ndarray], rows: Rows,
                           context: int) -> np.ndarray:
    """The probability of every sequence of TOKENS ids (in lexicographic order) under ``context``."""
    out = np.empty(VOCAB**TOKENS)
    for index, sequence in enumerate(itertools.product(range(VOCAB), repeat=TOKENS)):
        probability = 1.0
        for t, token in enumerate(sequence):
            distribution = np.asarray(step(*rows(context, sequence[:t])), dtype=np.float64)
            probability *= distribution[token] / distribution.sum()
        out[index] = probability
    return out


def exact_epsilon(p: np.ndarray, q: np.ndarray, delta: float) -> float:
    """The smallest eps with max(sum (p - e^eps q)_+, sum (q - e^eps p)_+) <= delta (bisection; inf if none)."""

    def hockey_stick(epsilon: float) -> float:
        scale = math.exp(epsilon)
        return max(float(np.maximum(p - scale * q, 0).sum()), float(np.maximum(q - scale * p, 0).sum()))

    if hockey_stick(0.0) <= delta:
        return 0.0
    if delta == 0.0:
        support = (p > 0) | (q > 0)
        if np.any((p[support] == 0) | (q[support] == 0)):
            return math.inf
        return float(np.max(np.abs(np.log(p[support] / q[support]))))
    low, high = 0.0, 1.0
    while hockey_stick(high) > delta:
        low, high = high, 2 * high
        if high > 600:
            return math.inf
    for _ in range(100):
        middle = 0.5 * (low + high)
        low, high = (low, middle) if hockey_stick(middle) <= delta else (middle, high)
    return high


def ledger_epsilon(policy, releases: int, *, source: bool = False) -> float:
    accountant = PrivacyAccountant(policy.release_event("edge"))
    for step in range(releases):
        accountant.record(step, steered=True)
    return accountant.source_epsilon() if source else accountant.epsilon()


def invisible_ink_step(policy: InvisibleInk):
    return lambda p_slm, p_llm: invisible_ink_distribution(p_slm, p_llm, clip=policy.clip,
                                                           temperature=policy.temperature)[1]


def dp_fusion_step(policy: DPFusion, alpha: float):
    def step(p_slm: np.ndarray, p_llm: np.ndarray) -> np.ndarray:
        mixture, _ = dp_fusion_mixture(p_slm, p_llm, policy.bound, order=policy.order)
        public = dp_fusion_rows(p_slm, p_llm)[1]
        return alpha * public + (1 - alpha) * mixture

    return step


def ldp_step(policy: LDPSampler):
    return lambda p_slm, p_llm: ldp_sampler_distribution(p_slm, p_llm, epsilon=policy.epsilon, gamma=policy.gamma)


def assert_within_the_ledger(step, policy, rows: Rows, delta: float) -> float:
    exact = exact_epsilon(sequence_probabilities(step, rows, 0), sequence_probabilities(step, rows, 1), delta)
    ledger = ledger_epsilon(policy, TOKENS)
    assert exact <= ledger * (1 + 1e-6) + 1e-9, f"exact {exact} > ledger {ledger}"
    return exact


@pytest.mark.parametrize("epsilon", [0.5, 2.0, 8.0])
@pytest.mark.parametrize("seed", range(6))
def test_invisible_ink_never_spends_more_than_its_ledger(epsilon: float, seed: int) -> None:
    policy = InvisibleInk(epsilon=epsilon, max_new_tokens=TOKENS)
    assert_within_the_ledger(invisible_ink_step(policy), policy, spiky_rows(seed), policy.delta)


def iid_sequence_probabilities(p: np.ndarray, q: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence of ``tokens`` iid draws grouped by its counts (a sequence's probability depends on nothing
    else, so the hockey-stick sum over types is the sum over sequences): the multinomial probability of each
    count vector under ``p`` and under ``q``."""
    first, second = [], []
    for cuts in itertools.combinations(range(tokens + p.size - 1), p.size - 1):
        edges = (-1, *cuts, tokens + p.size - 1)
        counts = np.array([edges[i + 1] - edges[i] - 1 for i in range(p.size)])
        log_types = math.lgamma(tokens + 1) - sum(math.lgamma(n + 1) for n in counts)
        first.append(math.exp(log_types + float(np.sum(counts * np.log(p)))))
        second.append(math.exp(log_types + float(np.sum(counts * np.log(q)))))
    return np.array(first), np.array(second)


@pytest.mark.parametrize(("epsilon", "source_spends"), [(1.0, 1.32), (8.0, 11.2), (10.0, 14.2), (64.0, 66.2)])
def test_invisible_ink_over_24_tokens_of_two_opposed_contexts(epsilon: float, source_spends: float) -> None:
    """24 tokens of two contexts each sure of its own token (the rows do not depend on the prefix, so the tokens
    are iid and the sequences are enumerated by their counts).  The ledger's clip keeps the exact epsilon within
    the ledger; the clip the source's relation calibrates (twice it: a context against none moves a logit by C)
    spends more than the epsilon it was calibrated to (14.2 at 10: the audit's figure)."""
    tokens = 24
    policy = InvisibleInk(epsilon=epsilon, max_new_tokens=tokens)
    ledger = ledger_epsilon(policy, tokens)
    assert ledger == pytest.approx(epsilon, rel=1e-6)
    for clip in (policy.clip, 2 * policy.clip):
        p, q = (np.asarray(invisible_ink_distribution(*opposed_rows(context, ()), clip=clip,
                                                      temperature=policy.temperature)[1], dtype=np.float64)
                for context in (0, 1))
        exact = exact_epsilon(*iid_sequence_probabilities(p / p.sum(), q / q.sum(), tokens), policy.delta)
        if clip == policy.clip:
            assert exact <= ledger
        else:
            assert exact > epsilon and exact == pytest.approx(source_spends, abs=0.05)


@pytest.mark.parametrize(("epsilon", "alpha"), [(0.5, 0.0), (2.0, 0.0), (2.0, 0.3), (8.0, 0.0), (16.0, 0.5)])
@pytest.mark.parametrize("seed", range(6))
def test_dp_fusion_edge_never_spends_more_than_its_ledger(epsilon: float, alpha: float, seed: int) -> None:
    policy = DPFusion(epsilon=epsilon)
    assert_within_the_ledger(dp_fusion_step(policy, alpha), policy, spiky_rows(seed), policy.delta)


@pytest.mark.parametrize("seed", range(6))
def test_dp_fusion_per_token_divergence_between_two_contexts_is_at_most_epsilon(seed: int) -> None:
    """The per-token claim itself: D_2 between the distributions two contexts' tokens are drawn from is at most
    the per-token epsilon (the source's bound against the public row let it reach 4-8x that)."""
    rows = spiky_rows(seed)
    for epsilon in (0.1, 1.0, 4.0):
        policy = DPFusion(epsilon=epsilon)
        step = dp_fusion_step(policy, 0.0)
        for prefix in [(), (0,), (2, 1)]:
            p, q = (np.asarray(step(*rows(context, prefix)), dtype=np.float64) for context in (0, 1))
            for first, second in ((p, q), (q, p)):
                assert math.log(float(np.sum(first**2 / second))) <= epsilon * (1 + 1e-9)


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_ldp_sampler_never_spends_more_than_its_ledger(epsilon: float, seed: int) -> None:
    policy = LDPSampler(epsilon=epsilon)
    assert_within_the_ledger(ldp_step(policy), policy, spiky_rows(seed), 0.0)


def renyi_two(p: np.ndarray, q: np.ndarray) -> float:
    return math.log(float(np.sum(p * p / q)))


def source_relation_mixture(p_slm: np.ndarray, p_llm: np.ndarray, epsilon: float) -> np.ndarray:
    """The source's calibration, bisected here: the largest mixture of the floored rows whose symmetric D_2
    against the public row is at most 2 * eps / 4 (dp-fusion-lib's b = a * beta, beta = eps / 4)."""
    p, q = dp_fusion_rows(p_slm, p_llm)
    low, high = 0.0, 1.0
    for _ in range(100):
        middle = 0.5 * (low + high)
        mixture = q + middle * (p - q)
        low, high = (middle, high) if max(renyi_two(mixture, q), renyi_two(q, mixture)) <= epsilon / 2 else (low, middle)
    return q + low * (p - q)


@pytest.mark.parametrize(("epsilon", "source_reaches"), [(1.0, 1.09), (2.0, 2.18)])
def test_dp_fusion_bounded_against_the_public_row_only_exceeds_its_claim_between_two_contexts(
    epsilon: float, source_reaches: float
) -> None:
    """The source's relation holds each context near the public row; two opposed contexts are then further
    apart than the per-token epsilon claimed (1.09 at 1).  The two-context calibration keeps them within it."""
    source = [source_relation_mixture(*opposed_rows(context, ()), epsilon) for context in (0, 1)]
    assert renyi_two(source[0], source[1]) == pytest.approx(source_reaches, abs=0.01)
    assert renyi_two(source[0], source[1]) > epsilon
    policy = DPFusion(epsilon=epsilon)
    ours = [dp_fusion_mixture(*opposed_rows(context, ()), policy.bound)[0] for context in (0, 1)]
    assert renyi_two(ours[0], ours[1]) <= epsilon
