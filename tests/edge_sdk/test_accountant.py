"""The epsilon ledger: what each baseline's releasing steps spend, against independent references.

The model-free tests check the accountant's arithmetic (dp-accounting's own accountants composed here, hand
computations, the exact composition of randomised response); the model tests (marked) run the decoding loop:
early stops, withheld and empty steps, and the ``max_epsilon`` switch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from edge_sdk.privacy.accountant import PrivacyAccountant, ReleaseEvent, randomized_response_noise
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import CoGenesis, CoVeil, DPFusion, DPLogit, InvisibleInk, LDPSampler, Undefended
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings


def spent(policy, mode: str, releases: int, **kwargs) -> PrivacyAccountant:
    accountant = PrivacyAccountant(policy.release_event(mode), **kwargs)
    for step in range(releases):
        accountant.record(step, steered=True)
    return accountant


@pytest.mark.slow
def test_a_dp_logit_generation_is_the_exact_gaussian_composition_by_dp_accountings_pld() -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    policy = DPLogit(epsilon=1.0, delta=1e-5)
    for steps in (1, 24, 256):
        reference = PLDAccountant(value_discretization_interval=1e-4)  # composed here from the policy's sigma
        reference.compose(dp_event.GaussianDpEvent(policy.sigma / math.sqrt(2.0)), steps)
        assert spent(policy, "cloud", steps).epsilon() == pytest.approx(reference.get_epsilon(1e-5), abs=3e-3)
    # one token is exactly the calibrated epsilon (the RDP conversion read 1.09), 24 tokens 6.02 (RDP: 6.49)
    assert spent(policy, "cloud", 1).epsilon() == pytest.approx(1.0, abs=1e-9)
    assert spent(policy, "cloud", 24).epsilon() == pytest.approx(6.0198, abs=1e-3)
    assert spent(policy, "cloud", 24).summary()["source_relation"] is None  # sqrt 2 already bounds any two contexts


def test_dp_fusion_spends_t_eps_plus_the_improved_conversion_at_its_order() -> None:
    from dp_accounting import rdp

    # hand: 24 tokens at eps = 1 per token, order 2, delta 1e-5: 24 + log(1/2) - (log(1e-5) + log 2) / 1
    policy = DPFusion(epsilon=1.0, order=2.0, delta=1e-5)
    assert spent(policy, "edge", 24).epsilon() == pytest.approx(24.0 + 11.512925464970229 - 2 * math.log(2.0))
    # 3 tokens at eps = 0.5, order 3, delta 1e-6, reproduced by dp-accounting's conversion at that one order
    policy = DPFusion(epsilon=0.5, order=3.0, delta=1e-6)
    assert spent(policy, "edge", 3).epsilon() == pytest.approx(rdp.compute_epsilon([3.0], [1.5], 1e-6)[0])
    # the source's relation (a context against the public row): b = 0.4 eps per token at order 2, second
    summary = spent(DPFusion(epsilon=1.0), "edge", 24).summary()
    assert summary["relation"] == "any two private contexts"
    assert summary["source_relation"]["epsilon_spent"] == pytest.approx(rdp.compute_epsilon([2.0], [9.6], 1e-5)[0])
    assert "weaker" in summary["source_relation"]["relation"]
    # eps = 0: lambda = 0 at every step (the public distribution only), nothing is spent
    assert spent(DPFusion(epsilon=0.0), "edge", 24).epsilon() == 0.0
    # cloud-side the uploaded probabilities are not DP: the ledger says non-private
    cloud = spent(DPFusion(epsilon=1.0), "cloud", 1).summary()
    assert cloud["guarantee"] == "non-private" and cloud["epsilon_spent"] is None and cloud["relation"] is None
    assert spent(DPFusion(epsilon=0.0), "cloud", 24).epsilon() == 0.0  # lambda = 0: the public distribution


def randomized_response_delta(epsilon: float, k: int, target: float) -> float:
    """The exact delta at ``target`` of ``k`` composed epsilon-DP binary randomised responses (the optimal
    composition of Kairouz, Oh & Viswanath): the loss is ``epsilon * (k - 2j)`` with probability
    ``C(k, j) q^(k-j) (1-q)^j``, ``q = e^eps / (1 + e^eps)``, and delta = E[(1 - e^(target - loss))_+]."""
    q = math.exp(epsilon) / (1.0 + math.exp(epsilon))
    total = 0.0
    for j in range(k + 1):
        p_true = math.comb(k, j) * q ** (k - j) * (1 - q) ** j
        p_other = math.comb(k, j) * q**j * (1 - q) ** (k - j)
        total += max(0.0, p_true - math.exp(target) * p_other)
    return total


def test_ldp_sampler_composes_as_randomised_response_exactly() -> None:
    policy = LDPSampler(epsilon=0.5)
    # at delta 0, pure DP composes to k * eps (hand: 10 * 0.5)
    assert spent(policy, "edge", 10).epsilon() == pytest.approx(5.0, rel=1e-12)
    assert spent(policy, "edge", 10).accountant == "basic composition (exact at delta 0)"
    # at delta 1e-5 the PLD is tighter than k * eps, and it is the exact composition up to its discretisation:
    # the exact delta at the reported epsilon is at most 1e-5, and 0.01 below it more than 1e-5
    epsilon = spent(LDPSampler(epsilon=0.1), "edge", 100, delta=1e-5).epsilon()
    assert epsilon < 0.6 * 100 * 0.1
    assert randomized_response_delta(0.1, 100, epsilon) <= 1e-5 * (1 + 1e-6)
    assert randomized_response_delta(0.1, 100, epsilon - 0.01) > 1e-5
    # binary randomised response at p = 2 / (1 + e^eps) reports the truth with odds e^eps (hand: eps = log 3)
    p = randomized_response_noise(math.log(3.0))
    assert p == pytest.approx(0.5) and (1 - p / 2) / (p / 2) == pytest.approx(3.0)


def test_invisible_ink_spends_its_budget_over_the_generation_it_was_calibrated_for() -> None:
    from edge_sdk.privacy.analysis import zcdp_epsilon

    policy = InvisibleInk(epsilon=10.0, delta=1e-6, max_new_tokens=24)
    full = spent(policy, "edge", 24).epsilon()
    assert 10.0 - 1e-6 <= full <= 10.0 + 1e-9  # the whole budget, never more
    # fewer tokens: the CKS conversion of their composed rho (a continuous infimum, so at most the accountant's
    # grid of orders above it), well below the budget; two contexts move each clipped logit by 2C
    rho = (2 * policy.clip / policy.temperature) ** 2 / 2
    assert zcdp_epsilon(12 * rho, 1e-6) <= spent(policy, "edge", 12).epsilon() <= zcdp_epsilon(12 * rho, 1e-6) * 1.01
    assert spent(policy, "edge", 12).epsilon() < 7.5
    # the source's figure (a context against none, rho / 4), second and smaller, reproduced by dp-accounting
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    reference = RdpAccountant()
    reference.compose(dp_event.ZCDpEvent(rho / 4), 24)
    source = spent(policy, "edge", 24).summary()["source_relation"]["epsilon_spent"]
    assert source == pytest.approx(reference.get_epsilon(1e-6), rel=1e-2) and source < 5.0


@pytest.mark.parametrize("policy, mode", [(CoVeil(), "cloud"), (CoVeil(), "edge"), (Undefended(), "cloud"),
                                          (CoGenesis(), "cloud")])
def test_a_heuristic_spends_infinity_once_it_releases_and_nothing_before(policy, mode) -> None:
    accountant = PrivacyAccountant(policy.release_event(mode))
    accountant.record(0, steered=False)  # an empty upload / the cloud's own top token: nothing released
    assert accountant.epsilon() == 0.0 and accountant.releases == 0
    assert accountant.summary()["epsilon_spent"] is None  # still no guarantee to state: not "0"
    accountant.record(1, steered=True)
    summary = accountant.summary()
    assert math.isinf(accountant.epsilon())
    assert summary["guarantee"] == "non-private" and summary["epsilon_spent"] is None and summary["events"] == 1
    assert accountant.describe().startswith("non-private")


def test_would_exceed_and_the_budget_switch() -> None:
    # DP-Fusion at eps = 1 per token, delta 1e-5: n releases spend n + 11.5129 - 2 log 2 = n + 10.1266, so two
    # spend 12.13 <= 12.5 and a third 13.13 > 12.5
    accountant = PrivacyAccountant(DPFusion(epsilon=1.0).release_event("edge"), max_epsilon=12.5)
    assert not accountant.would_exceed(12.5)
    flags = []
    for step in range(6):
        flags.append(accountant.withholds(step))
        if not flags[-1]:
            accountant.record(step, steered=False)  # a DP draw is a release whatever it turned out to be
    assert flags == [False, False, True, True, True, True]
    assert accountant.releases == 2 and accountant.withheld_from == 2
    summary = accountant.summary()
    assert summary["epsilon_spent"] == pytest.approx(2.0 + 11.512925464970229 - 2 * math.log(2.0))
    assert "step 2" in summary["withheld_reason"] and "max_epsilon 12.5" in summary["withheld_reason"]
    # a heuristic under a budget releases nothing at all
    heuristic = PrivacyAccountant(CoVeil().release_event("cloud"), max_epsilon=100.0)
    assert heuristic.withholds(0) and "non-private" in heuristic.stop_reason()


def test_bad_budgets_and_deltas_are_refused() -> None:
    event = DPLogit().release_event("cloud")
    with pytest.raises(ValueError, match="delta"):
        PrivacyAccountant(event, delta=0.0)  # approximate DP has no finite epsilon at delta 0
    with pytest.raises(ValueError, match="max_epsilon must be finite and >= 0"):
        PrivacyAccountant(event, max_epsilon=-1.0)
    with pytest.raises(ValueError, match="non-private"):
        ReleaseEvent("non_private", value=1.0)
    assert PrivacyAccountant(LDPSampler().release_event("edge"), delta=0.0).delta == 0.0


@pytest.mark.parametrize(("policy", "mode", "budget", "one"), [
    (DPFusion(epsilon=1.0), "edge", 5.0, "11.13"),  # 1 + 10.1266: the conversion alone costs 10.1 at 1e-5
    (DPLogit(epsilon=1.0), "cloud", 0.5, "1"),  # one upload is the calibrated 1
    (LDPSampler(epsilon=2.0), "edge", 1.0, "2"),
])
def test_a_max_epsilon_no_release_can_meet_is_an_error_naming_it_and_the_range(policy, mode, budget, one) -> None:
    with pytest.raises(ValueError, match=rf"max_epsilon {budget:g} cannot be met.* working range is max_epsilon >= "
                                         rf"{one}"):
        PrivacyAccountant(policy.release_event(mode), max_epsilon=budget)
    # before any model work: the decoder refuses it when it is built (the model is only read for its vocabulary)
    with pytest.raises(ValueError, match="max_epsilon"):
        CollaborativeDecoder(_VocabularyOnly(), policy, DecodeSettings(mode=mode, max_epsilon=budget),
                             slm_prompt=[1], cloud_prompt=[1], meter=LeakageMeter(frozenset()),
                             rng=np.random.default_rng(0))
    PrivacyAccountant(policy.release_event(mode), max_epsilon=float(one) * 1.01)  # just above: accepted


@dataclass
class _VocabularyOnly:
    """What the decoder reads of a model before any step: its vocabulary size and end tokens."""

    vocab_size: int = 8
    eos_token_ids: frozenset[int] = frozenset({0})


def decoder_for(policy, mode: str, max_new_tokens: int) -> CollaborativeDecoder:
    return CollaborativeDecoder(_VocabularyOnly(), policy, DecodeSettings(mode=mode, max_new_tokens=max_new_tokens),
                                slm_prompt=[1], cloud_prompt=[1], meter=LeakageMeter(frozenset()),
                                rng=np.random.default_rng(0))


def test_the_decoder_calibrates_for_the_generations_own_length() -> None:
    # InvisibleInk at eps = 10 over 24 tokens spends its 10 in those 24 tokens (calibrated for 256 it spent ~2.6)
    decoder = decoder_for(InvisibleInk(epsilon=10.0), "edge", 24)
    assert decoder.policy.max_new_tokens == 24
    assert spent(decoder.policy, "edge", 24).epsilon() == pytest.approx(10.0, abs=1e-6)
    # DP-Fusion's generation epsilon is stated for the generation's length: 24 * 2 + log(1e5) - 2 log 2
    decoder = decoder_for(DPFusion(epsilon=2.0), "edge", 24)
    assert decoder.policy.generation_epsilon() == pytest.approx(48.0 + 11.512925464970229 - 2 * math.log(2.0))
    assert decoder.ledger.privacy()["events"] == 0 and decoder.ledger.privacy()["epsilon_spent"] == 0.0


# -- the decoding loop (the embedded model) ------------------------------------------------------------------------

OTHER_CONTEXT = "She reports a dry cough, a fever and chest pain since a long flight last week."


@pytest.fixture(scope="module")
def client(slm, engine):
    from edge_sdk.client import EdgeClient

    return EdgeClient(lambda: engine.session("tests"), slm=slm)


class StopAfter:
    """A stopping rule that ends the generation after ``n`` tokens (as a stop string would)."""

    def __init__(self, slm, n: int) -> None:
        self.slm, self.n = slm, n

    def allows_end(self, text: str) -> bool:
        return True

    def is_done(self, text: str) -> bool:
        return len(self.slm.tokenize(text, add_bos=False)) >= self.n


@pytest.mark.model
def test_an_early_stop_spends_less_than_a_full_generation(client, slm) -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

    policy = DPLogit(epsilon=1.0)
    full = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=policy, max_new_tokens=6,
                           rng=np.random.default_rng(0), stopping=StopAfter(slm, 100))
    early = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=policy, max_new_tokens=6,
                            rng=np.random.default_rng(0), stopping=StopAfter(slm, 2))
    assert early.finish_reason == "stop_rule" and len(early.ledger.entries) < len(full.ledger.entries)
    for result in (early, full):
        privacy = result.ledger.privacy()
        assert privacy["events"] == len(result.ledger.entries)  # every DP-Logit upload is a release
        reference = PLDAccountant(value_discretization_interval=1e-4)
        reference.compose(dp_event.GaussianDpEvent(policy.sigma / math.sqrt(2.0)), privacy["events"])
        assert privacy["epsilon_spent"] == pytest.approx(reference.get_epsilon(1e-5), abs=3e-3)
    assert early.ledger.privacy()["epsilon_spent"] < full.ledger.privacy()["epsilon_spent"]
    assert "epsilon" in full.ledger.summary() and "Gaussian composition (exact)" in full.ledger.summary()


@pytest.mark.model
def test_withheld_and_unsteered_steps_spend_nothing(client) -> None:
    from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

    # every step withheld by the exposure budget: a DP policy records no release and spends 0
    withheld = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=DPLogit(epsilon=1.0),
                               max_new_tokens=3, exposure_budget=0.0, rng=np.random.default_rng(0))
    assert all(entry.withheld for entry in withheld.ledger.entries)
    assert withheld.ledger.privacy()["events"] == 0 and withheld.ledger.privacy()["epsilon_spent"] == 0.0
    # a heuristic records exactly the steps the private context steered (an empty upload records nothing); at
    # lam = 4 CoVeil masks some steps' upload entirely, so the generation holds both kinds of step
    result = client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=CoVeil(lam=4.0), max_new_tokens=8)
    steered = [entry.step for entry in result.ledger.entries if entry.values_uploaded > 0]
    assert 0 < len(steered) < len(result.ledger.entries)
    assert result.ledger.accountant.release_steps == steered
    assert result.ledger.privacy()["guarantee"] == "non-private" and result.ledger.privacy()["epsilon_spent"] is None


class RecordingCloud:
    """A cloud handler that keeps the bytes of every message the edge sends."""

    def __init__(self, handler) -> None:
        self.handler, self.sent = handler, []

    def handle(self, message):
        self.sent.append(message.SerializeToString())
        return self.handler.handle(message)

    def abandon(self, reason: str) -> None:
        self.handler.abandon(reason)


@pytest.mark.model
def test_the_epsilon_budget_switch_is_the_same_for_any_private_context(client, engine) -> None:
    """The max_epsilon switch reads public numbers and the count of releases only.  Edge-side DP-Fusion at eps = 1
    per token and delta 1e-5 spends 2 + 10.13 = 12.13 in two releases and 13.13 in three (hand), so with
    max_epsilon 12.5 every generation withholds from step 2, whatever its private context and whatever its draws."""
    from edge_sdk.protocol.connection import CloudConnection
    from edge_sdk.protocol.channels import InProcessChannel
    from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

    def run(context: str, alpha: float) -> tuple[list[bool], list[bytes], list[int]]:
        decoder = client.decoder(PUBLIC_PROMPT, context, mode="edge", policy=DPFusion(epsilon=1.0), alpha=alpha,
                                 max_new_tokens=6, max_epsilon=12.5, rng=np.random.default_rng(11))
        cloud = RecordingCloud(engine.session("tests"))
        list(decoder.steps(CloudConnection(InProcessChannel(cloud))))
        assert decoder.ledger.privacy()["withheld_from"] == 2
        return [entry.withheld for entry in decoder.ledger.entries], cloud.sent, decoder.tokens

    switch = [False, False, True, True, True, True]
    # alpha = 1: the synced token never reads the SLM, so two contexts behave the same in public and everything
    # the edge sends, the switch included, must be byte-identical
    a, b = run(PRIVATE_CONTEXT, 1.0), run(OTHER_CONTEXT, 1.0)
    assert a[0] == b[0] == switch and a[1] == b[1]
    # the real mechanism: the tokens differ with the context (and are sometimes the cloud's own top), the switch not
    real = [run(context, 0.3) for context in (PRIVATE_CONTEXT, OTHER_CONTEXT)]
    assert real[0][0] == real[1][0] == switch
