"""The public fake cloud held to the real one: the same rows through :class:`~edge_sdk.testing.ScriptedCloud` and
through the cloud adapter's :class:`~cloud_adapter.session.SessionHandler` (the tiny random Qwen2) give the same
message streams, byte for byte, for every registered policy in each mode it defines, in lockstep and with
run-ahead (lookahead 2: drafted rows, cloud-side picks read off certificates, drafts the edge vetoes), so the loop's
properties proved on the fake hold for the real cloud.

Compared byte for byte after clearing the three fields that differ by construction: the session id (a uuid on
the adapter), each row's measured ``forward_ns`` and the padding (its length pads ``forward_ns`` to a public
size).  With run-ahead both ends draft at the agreed depth: the depth rule
(:class:`~edge_sdk.protocol.drafting.DraftSchedule`, one class for both) reads the measured forward and turnaround
times, which the real session measures on the clock and the fake reads off its scripted delays, so it is held to
the agreed lookahead here and tested on its own in ``tests/edge_sdk/test_drafting.py``.
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
from edge_sdk.protocol.drafting import DraftSchedule
from edge_sdk.testing import ScriptedChannel, ScriptedCloud, TableSLM

pytestmark = pytest.mark.slow  # the tiny random Qwen2 in transformers, not the embedded model

#: every registered policy in each mode it defines, and undefended fusion in logit space
CASES: list[tuple[str, str, dict[str, Any]]] = [
    *((mode, name, {}) for mode in ("cloud", "edge") for name in available_policies(mode)),
    ("cloud", "undefended", {"space": "logit"}), ("edge", "undefended", {"space": "logit"}),
]


#: the run-ahead depths every case runs at (0: lockstep)
LOOKAHEADS = (0, 2)


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
        super().__init__(llm.vocab_size, name=llm.name, eos_ids=llm.eos_token_ids,
                         max_lookahead=engine.limits.max_lookahead)
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
               prompt: list[int], lookahead: int) -> tuple[Recording, CloudConnection]:
    vocab = llm.vocab_size
    slm_row = np.random.default_rng(7).normal(0, 3, vocab).astype(np.float32)
    slm = CloudVocabularySLM([f"t{i}" for i in range(vocab)], default=slm_row, eos_ids=llm.eos_token_ids)
    slm.fingerprint = llm.vocab_fingerprint()
    decoder = CollaborativeDecoder(slm, policy(name, params, vocab), DecodeSettings(mode=mode, max_new_tokens=6, top_m=8),
                                   slm_prompt=[3, *prompt], cloud_prompt=prompt, meter=LeakageMeter(frozenset()),
                                   rng=np.random.default_rng(11))
    recording = Recording(channel)
    connection = CloudConnection(recording, lookahead=lookahead)
    list(decoder.steps(connection))
    return recording, connection


@pytest.fixture(autouse=True)
def agreed_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends draft as deep as the session agreed (the depth a cloud with an unmeasurably quick forward has)."""
    monkeypatch.setattr(DraftSchedule, "depth", property(lambda schedule: schedule.lookahead))


def both_clouds(engine: Any, mode: str, name: str, params: dict[str, Any], lookahead: int) -> tuple[
        tuple[Recording, CloudConnection], tuple[Recording, CloudConnection], Any]:
    """The generation through the adapter's session and through the fake, and the adapter's session handler."""
    llm = engine.llm
    prompt = list(llm.tokenize("the patient has"))
    handler = engine.session("contract")
    real = generation(InProcessChannel(handler), mode, name, params, llm, prompt, lookahead)
    fake = generation(ScriptedChannel(ModelRows(engine, prompt).session()), mode, name, params, llm, prompt, lookahead)
    return real, fake, handler


@pytest.mark.parametrize("lookahead", LOOKAHEADS)
@pytest.mark.parametrize(("mode", "name", "params"), CASES, ids=[f"{m}-{n}{'-logit' if p else ''}" for m, n, p in CASES])
def test_the_fake_cloud_sends_what_the_adapter_s_session_sends(engine, mode: str, name: str, params,
                                                                lookahead: int) -> None:
    (real, real_connection), (fake, fake_connection), _ = both_clouds(engine, mode, name, params, lookahead)
    assert len(real.received) > 3  # an open and several steps
    assert real_connection.info.lookahead == lookahead  # the adapter agreed: it did run ahead
    assert fake.sent == real.sent
    assert fake.received == real.received
    assert (fake_connection.rows_dropped, fake_connection.picks_certified) == (
        real_connection.rows_dropped, real_connection.picks_certified)


@pytest.mark.parametrize(("mode", "name"), [("edge", "invisible_ink"), ("cloud", "dp_logit")])
def test_the_run_ahead_cases_hold_kept_and_vetoed_drafts(engine, mode: str, name: str) -> None:
    """The run-ahead comparison covers what run-ahead adds: drafts the edge confirmed (their rows used as sent),
    drafts it vetoed (the cloud dropped them and sent the confirmed token's row), and cloud-side picks read off
    certificates; the same on both clouds."""
    (real, real_connection), (fake, _), handler = both_clouds(engine, mode, name, {}, max(LOOKAHEADS))
    assert fake.received == real.received
    assert handler.draft_agreements > 0 and handler.drafts_dropped > 0, (handler.draft_agreements,
                                                                          handler.drafts_dropped)
    assert real_connection.rows_dropped > 0
    if mode == "cloud":
        assert real_connection.picks_certified > 0
