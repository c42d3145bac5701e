"""The public fake cloud held to the real one: the same rows through :class:`~edge_sdk.testing.ScriptedCloud` and
through the cloud adapter's :class:`~cloud_adapter.session.SessionHandler` (the tiny random Qwen2) give the same
message streams, byte for byte, for every registered policy in each mode it defines, so the loop's properties
proved on the fake hold for the real cloud.

Compared byte for byte after clearing the three fields that differ by construction: the session id (a uuid on
the adapter), each row's measured ``forward_ns`` and the padding (its length pads ``forward_ns`` to a public
size).  Lockstep only: with run-ahead the real session's depth follows the measured forward and turnaround times
(:class:`~edge_sdk.protocol.drafting.DraftSchedule`), so its stream is not a function of the rows alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import EmbeddingNeighbours, Policy, available_policies, make_policy
from edge_sdk.protocol.channels import InProcessChannel, MessageChannel
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.testing import ScriptedChannel, ScriptedCloud, TableSLM

pytestmark = pytest.mark.model

#: every registered policy in each mode it defines, and undefended fusion in logit space
CASES: list[tuple[str, str, dict[str, Any]]] = [
    *((mode, name, {}) for mode in ("cloud", "edge") for name in available_policies(mode)),
    ("cloud", "undefended", {"space": "logit"}), ("edge", "undefended", {"space": "logit"}),
]


@pytest.fixture(scope="module")
def engine() -> Any:
    from cloud_adapter.engine import CloudEngine

    from tests.support.tiny_models import tiny_pair

    _, cloud = tiny_pair()
    return CloudEngine(cloud)


class ModelRows(ScriptedCloud):
    """A scripted cloud whose row at any sequence is the tiny model's, computed on the adapter's own path: a prefill
    of the public prompt, then one forward per token."""

    def __init__(self, engine: Any, prompt: Sequence[int]) -> None:
        llm = engine.llm
        super().__init__(llm.vocab_size, name=llm.name, eos_ids=llm.eos_token_ids, max_lookahead=0)
        self.runner, self.prompt = engine.runner, list(prompt)
        self.cache: dict[tuple[int, ...], np.ndarray] = {}

    def row(self, step: int, sequence: Sequence[int]) -> np.ndarray:
        key = tuple(sequence)
        assert list(key[:len(self.prompt)]) == self.prompt
        if key not in self.cache:
            seq, _ = self.runner.prefill(self.prompt)
            for token in key[len(self.prompt):]:
                self.runner.forward(seq, token)
            self.cache[key] = np.array(seq.next_logits, dtype=np.float32)
            self.runner.release(seq)
        return self.cache[key]


class Recording:
    """A channel that keeps every message the edge sent and received, as bytes."""

    crosses_network = False

    def __init__(self, inner: MessageChannel) -> None:
        self.inner, self.sent, self.received = inner, [], []

    def send(self, message: Any) -> None:
        self.sent.append(message.SerializeToString())
        self.inner.send(message)

    def receive(self) -> Any:
        message = self.inner.receive()
        self.received.append(normalised(message))
        return message

    def close(self) -> None:
        self.inner.close()


def normalised(message: Any) -> bytes:
    """``message``'s bytes with the session id, ``forward_ns`` and padding cleared."""
    message = type(message).FromString(message.SerializeToString())
    message.ClearField("padding")
    if message.WhichOneof("kind") == "opened":
        message.opened.session_id = ""
    if message.WhichOneof("kind") == "distribution":
        message.distribution.forward_ns = 0
    return message.SerializeToString()


def policy(name: str, params: dict[str, Any], vocab: int) -> Policy:
    if name == "custext":  # CusText reads token embeddings: a fixed random table over this vocabulary
        embeddings = np.random.default_rng(3).normal(size=(vocab, 4)).astype(np.float32)
        return make_policy(name, neighbours=EmbeddingNeighbours(embeddings), **params)
    return make_policy(name, **params)


class CloudVocabularySLM(TableSLM):
    """A table SLM that says it shares the cloud model's vocabulary (the adapter refuses any other)."""

    fingerprint = b""

    def vocab_fingerprint(self) -> bytes:
        return self.fingerprint


def generation(channel: MessageChannel, mode: str, name: str, params: dict[str, Any], llm: Any,
               prompt: list[int]) -> Recording:
    vocab = llm.vocab_size
    slm_row = np.random.default_rng(7).normal(0, 3, vocab).astype(np.float32)
    slm = CloudVocabularySLM([f"t{i}" for i in range(vocab)], default=slm_row, eos_ids=llm.eos_token_ids)
    slm.fingerprint = llm.vocab_fingerprint()
    decoder = CollaborativeDecoder(slm, policy(name, params, vocab), DecodeSettings(mode=mode, max_new_tokens=6, top_m=8),
                                   slm_prompt=[3, *prompt], cloud_prompt=prompt, meter=LeakageMeter(frozenset()),
                                   rng=np.random.default_rng(11))
    recording = Recording(channel)
    list(decoder.steps(CloudConnection(recording, lookahead=0)))
    return recording


@pytest.mark.parametrize(("mode", "name", "params"), CASES, ids=[f"{m}-{n}{'-logit' if p else ''}" for m, n, p in CASES])
def test_the_fake_cloud_sends_what_the_adapter_s_session_sends(engine, mode: str, name: str, params) -> None:
    llm = engine.llm
    prompt = list(llm.tokenize("the patient has"))
    real = generation(InProcessChannel(engine.session("contract")), mode, name, params, llm, prompt)
    fake = generation(ScriptedChannel(ModelRows(engine, prompt).session()), mode, name, params, llm, prompt)
    assert len(real.received) > 3  # an open and several steps
    assert fake.sent == real.sent
    assert fake.received == real.received
