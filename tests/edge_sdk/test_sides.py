"""The two fusion sides (:mod:`edge_sdk.sides`): a policy whose signal is the other side's kind is refused before
anything of it leaves, and each side asks the cloud for what it needs (hand-checked against the settings)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.policies import Policy
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.protocol.signals import CloudUpload, SyncedToken
from edge_sdk.sides import CloudSide, EdgeSide
from edge_sdk.testing import ScriptedCloud, TableSLM

PIECES = ["<eos>", " a", " b", " c"]


@dataclass
class CrossedSignals(Policy):
    """Gives an upload where a token is due and a token where an upload is."""

    name = "crossed_signals"
    modes = frozenset({"cloud", "edge"})

    def llm_support(self, mode: str) -> int | None:
        return 0

    def cloud_upload(self, p_slm, p_llm, *, alpha, rng=None):
        return SyncedToken(int(np.argmax(p_slm)))

    def edge_token(self, p_slm, p_llm, *, alpha, rng=None):
        return CloudUpload.of(p_slm, np.arange(len(p_slm)))


def decoder(mode: str, policy: Policy, **settings: object) -> CollaborativeDecoder:
    slm = TableSLM(PIECES, default=np.log([0.1, 0.6, 0.2, 0.1]), eos_ids={0})
    return CollaborativeDecoder(slm, policy, DecodeSettings(mode=mode, max_new_tokens=2, **settings),
                                slm_prompt=[2], cloud_prompt=[2], meter=LeakageMeter(frozenset({1})))


@pytest.mark.parametrize(("mode", "given"), [("cloud", "SyncedToken"), ("edge", "CloudUpload")])
def test_a_signal_of_the_other_side_is_refused_before_it_is_sent(mode: str, given: str) -> None:
    cloud = ScriptedCloud(len(PIECES), default=np.log([0.1, 0.5, 0.3, 0.1]), eos_ids={0})
    with pytest.raises(TypeError, match=f"policy 'crossed_signals' gave a {given} in {mode}-side fusion"):
        list(run_with_resume(decoder(mode, CrossedSignals()), cloud.connect, backoff_s=0.0))
    assert "signal" not in [message.WhichOneof("kind") for message in cloud.edge_messages()]  # nothing of it left


def test_each_side_asks_the_cloud_for_what_it_needs() -> None:
    # top_m 2, K 3, logprobs 4, seed 9 over a vocabulary of 4: edge-side at least K values, no cloud seed and no
    # cloud logprobs (the edge picks); cloud-side top_m values, the cloud's seed and its logprobs
    edge = decoder("edge", CrossedSignals(), top_m=2, exposure_k=3, logprobs=4, seed=9)
    cloud = decoder("cloud", CrossedSignals(), top_m=2, exposure_k=3, logprobs=4, seed=9)
    assert isinstance(edge.side, EdgeSide) and isinstance(cloud.side, CloudSide)
    assert (edge.request().top_m, edge.request().seed, edge.request().logprobs, edge.request().top_logprobs) == (
        3, 0, False, 0)
    assert (cloud.request().top_m, cloud.request().seed, cloud.request().logprobs,
            cloud.request().top_logprobs) == (2, 9, True, 4)
