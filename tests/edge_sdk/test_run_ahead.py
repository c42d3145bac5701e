"""Run-ahead (issue 21): the cloud drafts rows past the awaited step; the edge's messages and tokens stay lockstep's.

The loop properties run on the public fakes (a :class:`~edge_sdk.testing.TableSLM` and a
:class:`~edge_sdk.testing.ScriptedCloud` whose rows depend on the token before them, so a row drafted on the
wrong token differs from the right one); the rest on the real cloud engine over the tiny transformers pair, in
process and over real gRPC.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_sdk.protocol import wire
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import CoVeil, EmbeddingNeighbours, Policy, Undefended, available_policies, make_policy
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.protocol.status import CloudError
from edge_sdk.testing import ScriptedChannel, ScriptedCloud, ScriptedSession, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import InProcessChannel
from tests.support.carriers import NETWORK_CARRIERS, Carrier, FakeEngine, served

EOS = 0
PROMPT_PRIVATE, PROMPT_PUBLIC = [5, 3, 1], [1]
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: every registered policy in each mode it defines, and the logit-space variants of the two that have them
CASES: list[tuple[str, str, dict[str, Any]]] = [
    *((mode, name, {}) for mode in ("cloud", "edge") for name in available_policies(mode)),
    ("cloud", "undefended", {"space": "logit"}), ("edge", "undefended", {"space": "logit"}),
    ("cloud", "coveil", {"lam": 1.0}), ("edge", "coveil", {"lam": 1.0}),
]


def make(name: str, params: dict[str, Any], vocab: int) -> Policy:
    if name == "custext":  # CusText reads token embeddings: a fixed random table over this vocabulary
        embeddings = np.random.default_rng(3).normal(size=(vocab, 4)).astype(np.float32)
        return make_policy(name, neighbours=EmbeddingNeighbours(embeddings), **params)
    return make_policy(name, **params)


def pieces(vocab: int) -> list[str]:
    return ["<eos>"] + [f" w{i}" for i in range(1, vocab)]


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    """A vocabulary, the SLM's and the cloud's rows after each id (so every row depends on the token before it)."""
    vocab = draw(st.integers(4, 8))
    row = hnp.arrays(np.float32, vocab, elements=st.floats(-5, 5, width=32))
    slm_rows = draw(st.lists(row, min_size=vocab + 1, max_size=vocab + 1))
    cloud_rows = draw(st.lists(row, min_size=vocab + 1, max_size=vocab + 1))
    if draw(st.booleans()):  # most runs go the whole length; the others may end at EOS
        for r in (*slm_rows, *cloud_rows):
            r[EOS] = -30.0
    steps = draw(st.integers(1, 7))
    breaks = draw(st.lists(st.integers(0, steps - 1), max_size=2))  # streams that break after a step's signal
    return {"vocab": vocab, "slm_rows": slm_rows, "cloud_rows": cloud_rows, "steps": steps, "breaks": breaks,
            "top_m": draw(st.integers(1, vocab)), "lookahead": draw(st.integers(1, 4))}


def build(scenario: dict[str, Any]) -> tuple[TableSLM, ScriptedCloud]:
    vocab = scenario["vocab"]
    slm = TableSLM(pieces(vocab), {(i,): r for i, r in enumerate(scenario["slm_rows"][1:])},
                   default=scenario["slm_rows"][0], eos_ids={EOS})
    cloud = ScriptedCloud(vocab, {(i,): r for i, r in enumerate(scenario["cloud_rows"][1:])},
                          default=scenario["cloud_rows"][0], eos_ids={EOS},
                          break_after_signal=scenario.get("breaks", ()))
    return slm, cloud


class BreakingChannel(ScriptedChannel):
    """A scripted channel that keeps the messages the edge reads and whose stream breaks (``UNAVAILABLE``, retryable)
    when the edge reads its ``break_at``-th message; every send and read after that fails too."""

    def __init__(self, session: ScriptedSession, break_at: int | None = None) -> None:
        super().__init__(session)
        self.break_at = break_at
        self.received: list[Any] = []
        self.broken = False

    def send(self, message: Any) -> None:
        if self.broken:
            raise CloudError("UNAVAILABLE", "the stream is gone", retryable=True)
        super().send(message)

    def receive(self) -> Any:
        self.broken = self.broken or len(self.received) + 1 == self.break_at
        if self.broken:
            raise CloudError("UNAVAILABLE", "connection reset", retryable=True)
        self.received.append(super().receive())
        return self.received[-1]


@dataclass
class Run:
    decoder: CollaborativeDecoder
    cloud: ScriptedCloud
    connections: list[CloudConnection]
    channels: list[BreakingChannel]


def run(scenario: dict[str, Any], mode: str, policy: Policy, lookahead: int, *, reads: Sequence[int] = (),
        carrier: Carrier | None = None) -> Run:
    """One generation over the loop and ``run_with_resume``; the scenario's ``breaks`` break a stream after a step's
    signal reached the cloud, ``reads[i]`` the ``i``-th stream when the edge reads that many-th message (in process);
    over ``carrier`` (a real server on loopback) when given."""
    slm, cloud = build(scenario)
    settings_ = DecodeSettings(mode=mode, max_new_tokens=scenario["steps"], top_m=scenario["top_m"], exposure_k=1)
    decoder = CollaborativeDecoder(slm, policy, settings_, slm_prompt=PROMPT_PRIVATE, cloud_prompt=PROMPT_PUBLIC,
                                   meter=LeakageMeter(frozenset()), rng=np.random.default_rng(11))
    result = Run(decoder, cloud, [], [])

    def connect() -> CloudConnection:
        if carrier is not None:
            result.connections.append(CloudConnection(carrier.channel(cloud.session), lookahead=lookahead))
            return result.connections[-1]
        n = len(result.channels)
        result.channels.append(BreakingChannel(cloud.session(), reads[n] if n < len(reads) else None))
        result.connections.append(CloudConnection(result.channels[-1], lookahead=lookahead))
        return result.connections[-1]

    breaks = len(scenario.get("breaks", ())) + len(reads)
    list(run_with_resume(decoder, connect, max_reconnects=breaks, backoff_s=0.0))
    return result


def observed_steps(transcript: dict[str, Any]) -> list[dict[str, Any]]:
    """What the cloud observed at each step (its bytes down, drafts included, left out)."""
    return [{key: value for key, value in step.items() if key != "bytes_down"} for step in transcript["steps"]]


def ledger_view(decoder: CollaborativeDecoder) -> list[tuple[Any, ...]]:
    """What each ledger entry says left the device (timings and bytes down, which run-ahead changes, left out)."""
    return [(e.step, e.token_id, e.signal, e.values_uploaded, e.full_requested, e.withheld, e.steered, e.bytes_up,
             e.exposure, e.sends, e.full_requests) for e in decoder.ledger.entries]


def check_lockstep_bytes(scenario: dict[str, Any], case: tuple[str, str, dict[str, Any]],
                         carrier: Carrier | None = None) -> None:
    """Run-ahead sends lockstep's bytes in lockstep's order and decides lockstep's tokens."""
    mode, name, params = case
    if mode == "cloud":  # a break may come while certified picks are unread: the next test's property
        scenario = {**scenario, "breaks": []}
    lock_run = run(scenario, mode, make(name, params, scenario["vocab"]), 0, carrier=carrier)
    ahead_run = run(scenario, mode, make(name, params, scenario["vocab"]), scenario["lookahead"], carrier=carrier)
    lockstep, lock_cloud, ahead, ahead_cloud = lock_run.decoder, lock_run.cloud, ahead_run.decoder, ahead_run.cloud
    assert ahead_run.connections[0].info.lookahead == scenario["lookahead"]  # the cloud agreed: it did run ahead
    assert ahead.tokens == lockstep.tokens
    assert ledger_view(ahead) == ledger_view(lockstep)
    # every message byte for byte (a broken stream's resume included); the opens differ in the depth offered alone
    assert len(ahead_cloud.sent) == len(lock_cloud.sent)
    for ahead_bytes, lock_bytes in zip(ahead_cloud.sent, lock_cloud.sent, strict=True):
        message = wire.pb().EdgeMessage.FromString(ahead_bytes)
        if message.WhichOneof("kind") == "open":
            assert message.open.lookahead == scenario["lookahead"]
            message.open.ClearField("lookahead")
            ahead_bytes = message.SerializeToString()
        assert ahead_bytes == lock_bytes


@pytest.mark.slow
@PROPERTY
@given(scenario=scenarios(), case=st.sampled_from(CASES))
def test_run_ahead_sends_the_same_bytes_in_the_same_order_and_decides_the_same_tokens(scenario, case) -> None:
    check_lockstep_bytes(scenario, case)


@pytest.fixture(scope="module", params=NETWORK_CARRIERS)
def network_carrier(request: pytest.FixtureRequest) -> Any:
    yield from served(request.param, FakeEngine())


@settings(PROPERTY, max_examples=12)
@given(scenario=scenarios(), case=st.sampled_from(CASES))
def test_over_a_network_carrier_run_ahead_sends_lockstep_s_bytes(network_carrier, scenario, case) -> None:
    """The same property over a real carrier on loopback (the cloud drafts between the edge's messages, as the
    driver schedules it, not after each), on streams that do not break: over a network a break shows at the
    edge's next read, which run-ahead makes later than lockstep's (the broken streams' property is in process's).
    Fewer examples, each a few streams."""
    check_lockstep_bytes({**scenario, "breaks": []}, case, network_carrier)


def edge_messages(session: ScriptedSession) -> list[Any]:
    """What the edge sent on one session: the open, full-row requests and signals (a close after a break left out)."""
    messages = [wire.pb().EdgeMessage.FromString(data) for data in session.sent]
    return [m for m in messages if m.WhichOneof("kind") in ("open", "request_full", "signal")]


def message_step(message: Any) -> int:
    return message.signal.step if message.WhichOneof("kind") == "signal" else message.request_full.step


def steps_acknowledged(opened_with: int, channel: BreakingChannel) -> int:
    """How many steps the cloud acknowledged on a stream, read off what the edge received: the prefix it opened
    with, then every step up to the last whose TokenChosen arrived (the cloud picks in order)."""
    picks = [m.token.step for m in channel.received if m.WhichOneof("kind") == "token"]
    return max([opened_with, *(step + 1 for step in picks)])


CLOUD_CASES = [case for case in CASES if case[0] == "cloud"]


@pytest.mark.slow
@PROPERTY
@given(scenario=scenarios(), case=st.sampled_from(CLOUD_CASES), reads=st.lists(st.integers(1, 30), max_size=2))
def test_a_broken_run_ahead_stream_resumes_where_the_cloud_acknowledged_and_resends_the_rest(scenario, case,
                                                                                            reads) -> None:
    """Cloud-side, greedy: streams break after a signal reached the cloud or as the edge reads (often while picks
    taken from certificates are unread).  Each resumed session opens with the tokens the cloud acknowledged on the
    broken stream (counted off the messages the edge read) and then sends every step from there on, in order,
    each the bytes lockstep sends for it: what lockstep broken at that point sends.  The tokens are lockstep's and
    each ledger entry counts every send and byte of its step."""
    mode, name, params = case
    lock_run = run({**scenario, "breaks": []}, mode, make(name, params, scenario["vocab"]), 0)
    lock_messages = edge_messages(lock_run.cloud.sessions[0])
    lock_open = wire.decode_open(lock_messages[0].open)
    lock_signals = {m.signal.step: m.SerializeToString() for m in lock_messages if m.WhichOneof("kind") == "signal"}
    ahead_run = run(scenario, mode, make(name, params, scenario["vocab"]), scenario["lookahead"], reads=reads)
    ahead = ahead_run.decoder
    assert ahead.tokens == lock_run.decoder.tokens
    opened_with = 0  # the steps the cloud acknowledged before this stream
    sends: Counter[int] = Counter()
    full_requests: Counter[int] = Counter()
    bytes_up: Counter[int] = Counter()
    for session, channel in zip(ahead_run.cloud.sessions, ahead_run.channels, strict=True):
        messages = edge_messages(session)
        assert wire.decode_open(messages[0].open) == replace(
            lock_open, resume_prefix=tuple(ahead.tokens[:opened_with]), lookahead=scenario["lookahead"])
        signals = [m for m in messages if m.WhichOneof("kind") == "signal"]
        assert [m.signal.step for m in signals] == list(range(opened_with, opened_with + len(signals)))
        assert [m.SerializeToString() for m in signals] == [lock_signals[m.signal.step] for m in signals]
        for message in messages[1:]:
            (sends if message.WhichOneof("kind") == "signal" else full_requests)[message_step(message)] += 1
            bytes_up[message_step(message)] += message.ByteSize()
        opened_with = steps_acknowledged(opened_with, channel)
    entries = ahead.ledger.entries
    assert [(e.sends, e.full_requests, e.bytes_up) for e in entries] == [
        (sends[e.step], full_requests[e.step], bytes_up[e.step]) for e in entries]
    decided = [(e.step, e.token_id, e.signal, e.values_uploaded, e.full_requested, e.withheld, e.steered, e.exposure)
               for e in lock_run.decoder.ledger.entries]
    assert [(e.step, e.token_id, e.signal, e.values_uploaded, e.full_requested, e.withheld, e.steered, e.exposure)
            for e in entries] == decided


def test_a_draft_the_edge_does_not_confirm_is_dropped_and_the_row_after_its_token_is_used() -> None:
    """Hand-worked, edge-side undefended fusion (alpha = 0.5, full rows), ids {0 eos, 1 a, 2 b, 3 prompt}.

    Step 0, cloud row (0, 2, 0, -9): p ~ (.107, .787, .107, 0); SLM (0, 0, 5, -9): p ~ (.0066, .0066, .987, 0).
    Fused a = (.787 + .0066) / 2 = .397 < b = (.107 + .987) / 2 = .547: the edge takes b; the cloud drafted
    its top, a.  Step 1, the SLM after b is (0, 5, 0, -9): p ~ (.0066, .987, .0066, 0).  The right cloud row
    (after b) is (0, 4, 0, -9): p ~ (.018, .965, .018, 0), fused a = (.965 + .987) / 2 = .976: a.  The
    drafted row (after a) is (0, 0, 8, -9): p ~ (.0003, .0003, .9993, 0), fused a = .494 < b = .503: used,
    the stale row would give b.
    """
    vocab = 4
    slm = TableSLM(pieces(vocab), {(2,): [0.0, 5.0, 0.0, -9.0]}, default=[0.0, 0.0, 5.0, -9.0], eos_ids={EOS})
    cloud = ScriptedCloud(vocab, {(1,): [0.0, 0.0, 8.0, -9.0], (2,): [0.0, 4.0, 0.0, -9.0]},
                          default=[0.0, 2.0, 0.0, -9.0], eos_ids={EOS})
    settings_ = DecodeSettings(mode="edge", alpha=0.5, max_new_tokens=2, top_m=vocab, exposure_k=1)
    decoder = CollaborativeDecoder(slm, Undefended(), settings_, slm_prompt=[3], cloud_prompt=[3],
                                   meter=LeakageMeter(frozenset()))
    connection = cloud.connect(lookahead=1)
    list(decoder.steps(connection))
    assert decoder.tokens == [2, 1]
    assert connection.rows_dropped == 1  # the row drafted after a


def test_an_older_sdk_gets_lockstep_from_a_newer_adapter(tiny_pair_engine) -> None:
    """An open without the lookahead field (what an older SDK sends: proto3 leaves a 0 out) is answered with 0
    and no row names an assumed token."""
    engine, slm = tiny_pair_engine
    request = wire.SessionRequest(prompt_ids=tuple(engine.llm.tokenize("the patient")), mode="edge",
                                  max_new_tokens=6, vocab_fingerprint=engine.fingerprint, vocab_size=slm.vocab_size,
                                  top_m=16)
    message = wire.encode_open(request)
    assert 16 not in {field.number for field, _ in message.open.ListFields()}  # the field is not on the wire
    handler = engine.session("old-sdk")
    replies = list(handler.handle(message))
    assert [r.WhichOneof("kind") for r in replies] == ["opened", "distribution"]
    assert replies[0].opened.lookahead == 0 and not handler.can_draft()
    for step in range(5):
        replies = list(handler.handle(wire.encode_token(step, 7)))
        assert [r.WhichOneof("kind") for r in replies] == ["distribution"]
        assert not replies[0].distribution.HasField("assumes_token")
        assert not handler.can_draft()


class OlderAdapter:
    """A session handler as an adapter from before run-ahead answers: the offered depth is never read (the open
    reaches it without the field), its opened message carries none, and it never drafts (no ``can_draft``).
    ``replies``: every message it sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.replies: list[Any] = []

    def handle(self, message: Any) -> Any:
        if message.WhichOneof("kind") == "open":
            message.open.ClearField("lookahead")
        replies = list(self.inner.handle(message))
        for reply in replies:
            assert reply.WhichOneof("kind") != "opened" or 8 not in {f.number for f, _ in
                                                                   reply.opened.ListFields()}
        self.replies += replies
        return replies

    def abandon(self, reason: str) -> None:
        self.inner.abandon(reason)


#: a generation on the fakes for the client-level tests below: a table SLM over text pieces and a cloud whose row
#: depends on the last token (so the edge's picks and the cloud's top part ways and drafts can miss)
CLIENT_PIECES = ["<eos>", " the", " patient", " private", " note", "\n\n", " a", " b"]


def client_fakes(max_lookahead: int = 8) -> tuple[TableSLM, ScriptedCloud]:
    rng = np.random.default_rng(5)
    vocab = len(CLIENT_PIECES)

    def table() -> dict[tuple[int, ...], np.ndarray]:
        rows = {(i,): rng.normal(0, 2, vocab) for i in range(vocab)}
        for row in rows.values():
            row[EOS] = -10.0  # no early end: the generations run their length
        return rows

    slm = TableSLM(CLIENT_PIECES, table(), eos_ids={EOS})
    cloud = ScriptedCloud(vocab, table(), eos_ids={EOS}, max_lookahead=max_lookahead)
    return slm, cloud


def test_a_newer_sdk_decodes_in_lockstep_with_an_older_adapter() -> None:
    from edge_sdk.client import EdgeClient

    slm, older_cloud = client_fakes()
    older: list[OlderAdapter] = []

    def older_session() -> OlderAdapter:
        older.append(OlderAdapter(older_cloud.session()))
        return older[-1]

    newer = EdgeClient(older_session, slm=slm, lookahead=4)
    _, plain_cloud = client_fakes()
    plain = EdgeClient(plain_cloud.session, slm=slm, lookahead=0)
    result = newer.generate(" the patient", " private note", mode="edge", policy="undefended", max_new_tokens=8)
    assert len(result.token_ids) > 2
    assert result.token_ids == plain.generate(" the patient", " private note", mode="edge", policy="undefended",
                                              max_new_tokens=8).token_ids
    assert older_cloud.sessions[-1].lookahead == 0  # the offer never reached it
    rows = [r.distribution for r in older[-1].replies if r.WhichOneof("kind") == "distribution"]
    assert len(rows) == len(result.token_ids)  # one row per step: nothing drafted
    assert not any(row.HasField("assumes_token") for row in rows)


@pytest.fixture(scope="module")
def tiny_pair_engine() -> tuple[Any, Any]:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.llm import TransformersSLM

    from tests.support.tiny_models import tiny_pair

    edge, cloud = tiny_pair()
    return CloudEngine(cloud), TransformersSLM(edge)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_the_real_engine_with_run_ahead_observes_what_it_observes_in_lockstep(tiny_pair_engine, mode) -> None:
    """Greedy tokens are lockstep's token for token, the cloud's transcript (what it observed) is the same, and the
    run-ahead session did draft: more forwards than confirmed tokens, some rolled back (the tiny models disagree
    often)."""
    from edge_sdk.client import EdgeClient

    engine, slm = tiny_pair_engine
    client = EdgeClient(lambda: engine.session("t"), slm=slm)
    observed = {}
    for lookahead in (0, 3):
        result = client.generate("the patient has", "canary zebra", mode=mode, policy=CoVeil(lam=1.0),
                                 max_new_tokens=16, lookahead=lookahead)
        transcript = engine.transcript(result.ledger.session_ids[-1])
        observed[lookahead] = (result.token_ids, observed_steps(transcript))
        if lookahead:
            assert transcript["lookahead"] == 3
            assert transcript["forwards"] > len(result.token_ids) - 1 and transcript["drafts_dropped"] > 0
    assert observed[3] == observed[0]


def test_a_rolled_back_sequence_decodes_as_one_that_never_held_the_draft(tiny_pair_engine) -> None:
    """TransformersLLM.truncate: the logits after a rollback and a new token equal, bit for bit, those of a
    sequence that stepped the same confirmed tokens without the draft."""
    engine, _ = tiny_pair_engine
    llm = engine.llm
    prompt = llm.tokenize("the patient has")
    plain, drafted = llm.open(prompt), llm.open(prompt)
    for token in (5, 9):
        llm.step([(plain, token)])
        llm.step([(drafted, token)])
    for token in (11, 12, 13):  # three drafts the edge did not confirm
        llm.step([(drafted, token)])
    llm.truncate(drafted, len(plain.ids))
    llm.step([(plain, 20)])
    llm.step([(drafted, 20)])
    assert drafted.ids == plain.ids
    np.testing.assert_array_equal(drafted.next_logits, plain.next_logits)


@pytest.mark.parametrize("carrier_name", ["grpc", "websocket"])
def test_run_ahead_over_a_real_carrier_changes_nothing_the_cloud_observes(tiny_pair_engine, carrier_name) -> None:
    """The canary over a real gRPC or WebSocket stream: with a private canary in the context, the cloud's transcript
    and the tokens are those of lockstep, while the adapter drafted (its transcript counts the forwards)."""
    from cloud_adapter.inprocess import serving
    from edge_sdk.client import Credentials, EdgeClient

    engine, slm = tiny_pair_engine
    with serving(engine, ws_port=0) as adapter:
        cloud = adapter.address if carrier_name == "grpc" else adapter.ws_url
        with EdgeClient(cloud, slm=slm, credentials=Credentials(plaintext=True)) as client:
            seen = {}
            for lookahead in (0, 4):
                result = client.generate("the patient has", "canary: the patient is Zebulon Quark", mode="edge",
                                         policy="coveil", max_new_tokens=12, lookahead=lookahead)
                transcript = engine.transcript(result.ledger.session_ids[-1])
                seen[lookahead] = (result.token_ids, observed_steps(transcript))
                assert transcript["lookahead"] == lookahead
                if lookahead:
                    assert transcript["forwards"] > len(result.token_ids) - 1
    assert seen[4] == seen[0]


#: the cloud's row at every step of :func:`certified_decoder`'s generation
CERTIFIED_ROW = np.log([1e-3, 0.7, 0.2, 0.098, 1e-3])


class AfterTwoWords:
    """A stopping rule: the generation is complete once it reads two words."""

    def allows_end(self, text: str) -> bool:
        return True

    def is_done(self, text: str) -> bool:
        return len(text.split()) >= 2


def certified_decoder(stopping: AfterTwoWords | None = None) -> CollaborativeDecoder:
    """Cloud-side undefended fusion (alpha = 0.3, probabilities) of a uniform SLM (every upload value 0.2), three
    tokens.  With :data:`CERTIFIED_ROW`, the cloud's top-3 (.7, .2, .098) at ids (1, 2, 3), the rest at most .098:
    fused 1 = .21 + .14 = .35 beats 2 (.06 + .14 = .2) and any omitted id (at most .3 * .098 + .14 = .169): the
    pick, 1, is certain."""
    slm = TableSLM(pieces(5), {}, default=[0.0] * 5, eos_ids={EOS})
    return CollaborativeDecoder(slm, Undefended(), DecodeSettings(mode="cloud", max_new_tokens=3, top_m=3),
                                slm_prompt=[2], cloud_prompt=[1], meter=LeakageMeter(frozenset()), stopping=stopping)


def certified_run(channel_type: Any = None) -> tuple[CollaborativeDecoder, CloudConnection]:
    decoder = certified_decoder()
    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    connection = CloudConnection((channel_type or ScriptedChannel)(cloud.session()), lookahead=2)
    list(decoder.steps(connection))
    return decoder, connection


def test_a_cloud_side_pick_certified_by_the_row_is_taken_without_waiting_and_checked_later() -> None:
    decoder, connection = certified_run()
    assert decoder.tokens == [1, 1, 1]
    assert connection.picks_certified == 2  # the last pick, which ends the generation, is read from the cloud


class LyingPicks(ScriptedChannel):
    """The cloud names token 2 in every ``TokenChosen`` (its rows, and so the certificates, say 1)."""

    def receive(self) -> Any:
        reply = super().receive()
        if reply.WhichOneof("kind") == "token":
            reply.token.token_id = 2
        return reply


def test_a_cloud_that_names_another_token_than_the_certified_pick_is_caught() -> None:
    with pytest.raises(CloudError) as caught:
        certified_run(LyingPicks)
    assert caught.value.code == "DATA_LOSS"


def test_a_cloud_that_lies_about_the_picks_a_stopping_rule_ended_on_is_caught() -> None:
    """The edge's stopping rule ends :func:`certified_decoder`'s generation after two tokens, both taken off
    certificates: their picks are read and checked before the generation ends (they were only read when the
    session closed, whose errors are not the generation's: a lie there went unnoticed)."""
    decoder = certified_decoder(AfterTwoWords())
    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    with pytest.raises(CloudError) as caught:
        list(decoder.steps(CloudConnection(LyingPicks(cloud.session()), lookahead=2)))
    assert caught.value.code == "DATA_LOSS"
    honest = certified_decoder(AfterTwoWords())
    list(honest.steps(CloudConnection(ScriptedChannel(cloud.session()), lookahead=2)))
    assert honest.tokens == [1, 1] and honest.finish_reason == "stop_rule"


def test_a_stream_broken_while_a_stopping_rule_s_last_picks_are_read_resumes_resends_and_ends() -> None:
    """As above, honest, its first stream breaking as the edge reads the last message it needs (step 1's pick):
    the cloud acknowledged step 0 only, so the second session resumes after it, re-sends step 1's upload byte
    for byte, reads its pick and ends there (nothing yielded again, no step past the rule's end)."""
    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    unbroken = BreakingChannel(cloud.session())
    list(certified_decoder(AfterTwoWords()).steps(CloudConnection(unbroken, lookahead=2)))
    assert unbroken.received[-1].WhichOneof("kind") == "token" and unbroken.received[-1].token.step == 1

    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    decoder = certified_decoder(AfterTwoWords())
    channels = iter([BreakingChannel(cloud.session(), break_at=len(unbroken.received)),
                     BreakingChannel(cloud.session())])
    events = list(run_with_resume(decoder, lambda: CloudConnection(next(channels), lookahead=2), max_reconnects=1,
                                  backoff_s=0.0))
    assert [event.token_id for event in events] == decoder.tokens == [1, 1]
    first, second = (edge_messages(session) for session in cloud.sessions)
    assert wire.decode_open(second[0].open).resume_prefix == (1,)
    assert [m.WhichOneof("kind") for m in second[1:]] == ["signal"]
    assert second[1].SerializeToString() == first[2].SerializeToString()  # step 1's upload, as first sent
    assert [entry.sends for entry in decoder.ledger.entries] == [1, 2]
    assert decoder.finish_reason == "stop_rule"


def test_a_stream_broken_while_certified_picks_are_unread_resends_their_uploads_on_the_next() -> None:
    """:func:`certified_decoder`'s generation, lookahead 2, its first stream breaking as the edge reads its fifth
    message.  The cloud queued the open's reply and the rows of steps 0, 1 and 2 (1 and 2 drafted on its pick 1)
    before any pick, so the edge read those four, took picks 0 and 1 off their certificates and broke reading
    step 2's (the last is always read): the cloud acknowledged no step.  Lockstep broken there (after step 0's
    upload) resumes with no prefix and sends the uploads of steps 0, 1 and 2: so does the second session, the
    bytes of the first stream; each step's ledger entry counts its two sends and both sends' bytes."""
    decoder = certified_decoder()
    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    channels = iter([BreakingChannel(cloud.session(), break_at=5), BreakingChannel(cloud.session())])
    events = list(run_with_resume(decoder, lambda: CloudConnection(next(channels), lookahead=2), max_reconnects=1,
                                  backoff_s=0.0))
    assert [event.token_id for event in events] == decoder.tokens == [1, 1, 1]
    first, second = (edge_messages(session) for session in cloud.sessions)
    assert [m.WhichOneof("kind") for m in first] == ["open", "signal", "signal", "signal"]
    assert [m.WhichOneof("kind") for m in second] == ["open", "signal", "signal", "signal"]
    assert wire.decode_open(second[0].open).resume_prefix == ()
    assert [m.signal.step for m in second[1:]] == [0, 1, 2]
    assert [m.SerializeToString() for m in second[1:]] == [m.SerializeToString() for m in first[1:]]
    assert [entry.sends for entry in decoder.ledger.entries] == [2, 2, 2]
    assert [entry.bytes_up for entry in decoder.ledger.entries] == [2 * m.ByteSize() for m in first[1:]]


def test_a_stream_broken_again_while_it_resends_keeps_every_unacknowledged_step() -> None:
    """As above, and the second stream breaks too, after re-sending step 0 (certified again, so still unread) and
    before step 1: the third session resumes with no prefix and sends steps 0, 1 and 2 again, the bytes of the
    first (the steps the second never re-sent stay unacknowledged, kept by the connection that carried them)."""
    decoder = certified_decoder()
    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    channels = iter([BreakingChannel(cloud.session(), break_at=5), BreakingChannel(cloud.session(), break_at=3),
                     BreakingChannel(cloud.session())])
    list(run_with_resume(decoder, lambda: CloudConnection(next(channels), lookahead=2), max_reconnects=2,
                         backoff_s=0.0))
    assert decoder.tokens == [1, 1, 1]
    first, second, third = (edge_messages(session) for session in cloud.sessions)
    assert [m.signal.step for m in second[1:]] == [0]
    assert wire.decode_open(third[0].open).resume_prefix == ()
    assert [m.signal.step for m in third[1:]] == [0, 1, 2]
    assert [m.SerializeToString() for m in third[1:]] == [m.SerializeToString() for m in first[1:]]
    assert [entry.sends for entry in decoder.ledger.entries] == [3, 2, 2]


def test_a_resumed_cloud_that_picks_another_token_at_a_resent_step_is_caught() -> None:
    """As above, but the second session's cloud has (.2, .7) at ids (1, 2) at step 1: the re-sent upload fuses to
    2 = .21 + .14 = .35 over 1 = .06 + .14 = .2 (any omitted id at most .169), while the user already has 1 at
    step 1: DATA_LOSS, and nothing more is yielded."""
    decoder = certified_decoder()
    cloud = ScriptedCloud(5, [CERTIFIED_ROW] * 3, eos_ids={EOS})
    other = ScriptedCloud(5, [CERTIFIED_ROW, np.log([1e-3, 0.2, 0.7, 0.098, 1e-3]), CERTIFIED_ROW], eos_ids={EOS})
    channels = iter([BreakingChannel(cloud.session(), break_at=5), BreakingChannel(other.session())])
    events = []
    with pytest.raises(CloudError) as caught:
        for event in run_with_resume(decoder, lambda: CloudConnection(next(channels), lookahead=2),
                                     max_reconnects=1, backoff_s=0.0):
            events.append(event)
    assert caught.value.code == "DATA_LOSS" and "step 1" in caught.value.message
    assert [event.token_id for event in events] == [1, 1]


def test_in_process_channel_without_draft_methods_still_decodes() -> None:
    """A handler that cannot draft (no can_draft) is served in lockstep by the in-process channel."""
    cloud = ScriptedCloud(4, [np.log([0.1, 0.6, 0.2, 0.1])] * 2, eos_ids={EOS})
    session = cloud.session()

    class Plain:
        def handle(self, message: Any) -> Any:
            return list(session.handle(message))

        def abandon(self, reason: str) -> None:
            session.abandon(reason)

    slm = TableSLM(pieces(4), {}, default=[0.0, 1.0, 0.0, 0.0], eos_ids={EOS})
    decoder = CollaborativeDecoder(slm, Undefended(), DecodeSettings(mode="edge", max_new_tokens=2, top_m=4,
                                                                     exposure_k=1),
                                   slm_prompt=[2], cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    list(decoder.steps(CloudConnection(InProcessChannel(Plain()), lookahead=2)))
    assert decoder.tokens == [1, 1]


def test_coveil_edge_serve_takes_lookahead_and_refuses_a_negative_one(capsys: pytest.CaptureFixture[str]) -> None:
    from edge_sdk.server.settings import ServerSettings
    from eval_harness.cli import main

    assert main(["edge", "serve", "--cloud", "127.0.0.1:1", "--lookahead", "-1"]) == 1
    assert capsys.readouterr().err.strip() == "coveil edge: --lookahead must be 0 (lockstep) or more, got -1"
    assert ServerSettings(cloud="127.0.0.1:1").lookahead == wire.MAX_LOOKAHEAD  # run-ahead on by default
    with pytest.raises(SystemExit):
        main(["edge", "serve", "--help"])
    assert "--lookahead N" in capsys.readouterr().out


def test_no_client_makes_the_adapter_draft_past_its_limit(tiny_pair_engine) -> None:
    """An edge offering 8 rows gets the adapter's --max-lookahead (2); after a slow turnaround (the depth rule
    then wants every row it may) the adapter drafts exactly 2 rows past the awaited step and stops."""
    import time

    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.limits import Limits

    engine = CloudEngine(tiny_pair_engine[0].llm, Limits(max_lookahead=2))
    request = wire.SessionRequest(prompt_ids=tuple(engine.llm.tokenize("the patient")), mode="edge",
                                  max_new_tokens=20, vocab_fingerprint=engine.fingerprint,
                                  vocab_size=engine.llm.vocab_size, top_m=16, lookahead=8)
    handler = engine.session("greedy-client")
    opened = list(handler.handle(wire.encode_open(request)))[0].opened
    assert opened.lookahead == 2
    for step in range(3):
        time.sleep(0.3)  # an edge far slower than a forward: the turnaround asks for the deepest drafts
        list(handler.handle(wire.encode_token(step, 7)))  # not the tiny model's top at these steps: each draft misses
        drafted = 0
        while handler.can_draft():
            list(handler.draft())
            drafted += 1
        assert drafted == 2
    handler.abandon("closed")


@pytest.mark.parametrize("asks", ["json_schema", "temperature", "dense_rows"])
def test_a_schema_sampling_or_dense_rows_are_served_in_lockstep(tiny_pair_engine, asks) -> None:
    """A draft would need the grammar's state past the awaited step (a cloud-side schema), would advance the
    session's seeded generator (cloud-side sampling), or would send a whole row (every row dense, as an
    edge-side schema asks): the adapter answers an offered depth with 0 and never drafts."""
    engine, slm = tiny_pair_engine
    extra = {"json_schema": {"json_schema": '{"type":"object"}'}, "temperature": {"temperature": 0.7, "seed": 3},
             "dense_rows": {"mode": "edge", "top_m": slm.vocab_size}}[asks]
    request = wire.SessionRequest(**{**dict(prompt_ids=tuple(engine.llm.tokenize("the patient")), mode="cloud",
                                            max_new_tokens=6, vocab_fingerprint=engine.fingerprint,
                                            vocab_size=slm.vocab_size, top_m=16, lookahead=8), **extra})
    handler = engine.session("schema")
    replies = list(handler.handle(wire.encode_open(request)))
    assert replies[0].opened.lookahead == 0 and not handler.can_draft()
    free = engine.session("free")
    replies = list(free.handle(wire.encode_open(replace(request, json_schema="", temperature=0.0, top_m=16))))
    assert replies[0].opened.lookahead == 8 and free.can_draft()  # the same open without it runs ahead


def test_with_logprobs_asked_cloud_side_the_edge_waits_for_each_pick() -> None:
    """The logprobs come with the cloud's TokenChosen, so no pick is taken from the certificate: each step's
    logprobs are the cloud's own for the token it picked (without logprobs the same generation certifies picks)."""
    from edge_sdk.client import EdgeClient

    certified = {}
    for logprobs in (2, None):
        slm, cloud = client_fakes()
        decoder = EdgeClient(cloud.session, slm=slm).decoder(" the patient", " private note", mode="cloud",
                                                             policy=CoVeil(lam=1.0), max_new_tokens=8,
                                                             logprobs=logprobs)
        connection = cloud.connect(lookahead=3)
        steps = list(decoder.steps(connection))
        assert len(steps) == 8 and connection.info.lookahead == 3
        if logprobs:
            assert all(step.logprobs is not None and step.logprobs.token_id == step.token_id for step in steps)
        certified[logprobs] = connection.picks_certified
    assert certified[2] == 0 and certified[None] > 0, certified
