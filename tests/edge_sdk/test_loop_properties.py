"""Properties of the real decoding loop (``CollaborativeDecoder``, ``run_with_resume``), driven in milliseconds.

The edge model is a :class:`~edge_sdk.testing.TableSLM` and the cloud a :class:`~edge_sdk.testing.ScriptedCloud`
whose rows hypothesis draws; every message crosses the real wire codec.  Each property is read off what the
edge actually sent (the bytes the cloud recorded) or checked against an independent reference: a decision
on the full rows worked out in the test, a run that never sees a sparse row, an unbroken run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edge_sdk.protocol import wire
from edge_sdk.fusion import softmax
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import CoGenesis, CoVeil, DPLogit, Policy, Undefended
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.testing import ScriptedCloud, TableSLM

EOS = 0
PROMPT_PRIVATE, PROMPT_PUBLIC = [5, 3, 1], [1]  # the SLM reads private + public ids, the cloud the public ones
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pieces(vocab: int) -> list[str]:
    return ["<eos>"] + [f" w{i}" for i in range(1, vocab)]


def logit_rows(vocab: int, count: int) -> st.SearchStrategy[list[np.ndarray]]:
    row = hnp.arrays(np.float32, vocab, elements=st.floats(-6, 6, width=32))
    return st.lists(row, min_size=count, max_size=count)


@st.composite
def scenarios(draw: Any, *, max_steps: int = 6, eos_free: bool = True) -> dict[str, Any]:
    """A vocabulary, an SLM table (a default row and a row after each of a few ids) and the cloud's rows."""
    vocab = draw(st.integers(4, 9))
    steps = draw(st.integers(1, max_steps))
    slm_rows = draw(logit_rows(vocab, vocab))
    cloud_rows = draw(logit_rows(vocab, steps))
    if eos_free:  # no end-of-generation before max_new_tokens, so every run has its full length
        for row in (*slm_rows, *cloud_rows):
            row[EOS] = -30.0
    return {"vocab": vocab, "steps": steps, "slm_rows": slm_rows, "cloud_rows": cloud_rows}


def flat_tail(row: np.ndarray, top: int) -> np.ndarray:
    """``row`` with every id outside its ``top`` largest (ties to the lower id) at the lowest of them."""
    row = row.copy()
    tail = sorted(range(len(row)), key=lambda i: (-row[i], i))[top:]
    if tail:
        row[tail] = row[tail].min()
    return row


def build(scenario: dict[str, Any], *, eos: bool = True, **cloud_options: Any) -> tuple[TableSLM, ScriptedCloud]:
    """The scenario's SLM and cloud; ``eos=False``: no end-of-generation id (a randomised policy may pick any)."""
    vocab = scenario["vocab"]
    table = {(i,): row for i, row in enumerate(scenario["slm_rows"][1:], start=1)}
    eos_ids = {EOS} if eos else set()
    slm = TableSLM(pieces(vocab), table, default=scenario["slm_rows"][0], eos_ids=eos_ids)
    cloud = ScriptedCloud(vocab, scenario["cloud_rows"], eos_ids=eos_ids, **cloud_options)
    return slm, cloud


def decode(slm: TableSLM, cloud: ScriptedCloud, policy: Policy, *, reconnects: int = 0, **options: Any
           ) -> CollaborativeDecoder:
    masked = options.pop("masked", frozenset())
    stopping = options.pop("stopping", None)
    rng = options.pop("rng", None)
    options.setdefault("exposure_k", 1)  # edge-side the edge asks for at least K values: keep sparse rows sparse
    decoder = CollaborativeDecoder(
        slm, policy, DecodeSettings(**options), slm_prompt=PROMPT_PRIVATE, cloud_prompt=PROMPT_PUBLIC,
        meter=LeakageMeter(frozenset()), masked_ids=masked, rng=rng, stopping=stopping,
    )
    list(run_with_resume(decoder, cloud.connect, max_reconnects=reconnects, backoff_s=0.0))
    return decoder


def signals(cloud: ScriptedCloud) -> list[Any]:
    """The ``StepSignal`` messages the edge sent, in order (a re-sent step appears again)."""
    return [m.signal for m in cloud.edge_messages() if m.WhichOneof("kind") == "signal"]


def signal_bytes_by_step(cloud: ScriptedCloud) -> dict[int, list[bytes]]:
    pb = wire.pb()
    by_step: dict[int, list[bytes]] = {}
    for data in cloud.sent:
        message = pb.EdgeMessage.FromString(data)
        if message.WhichOneof("kind") == "signal":
            by_step.setdefault(message.signal.step, []).append(data)
    return by_step


def upload_of(signal: Any, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``(ids, values)`` an upload carries, parsed here from its raw fields."""
    values = np.frombuffer(signal.upload.values, dtype="<f4")
    ids = np.arange(vocab) if signal.upload.dense else np.frombuffer(signal.upload.ids, dtype="<u4").astype(int)
    return ids, values


def cloud_top(row: np.ndarray) -> int:
    """The cloud's own top token in the probabilities it sent (float32: logits 1e-45 apart tie there), ties to
    the lower id."""
    sent = softmax(row)
    return int(np.flatnonzero(sent == sent.max())[0])


def softmax64(z: np.ndarray) -> np.ndarray:
    e = np.exp(np.asarray(z, dtype=np.float64) - float(np.max(z)))
    return e / e.sum()


# -- the exposure budget -------------------------------------------------------------------------------------
BUDGET_POLICIES = [("cloud", Undefended()), ("cloud", CoVeil(lam=0.0, k=3)), ("edge", Undefended()),
                   ("edge", CoVeil(lam=0.5, k=3))]


@FAST
@given(scenario=scenarios(max_steps=8), budget=st.one_of(st.integers(0, 20).map(lambda i: i / 20),
                                                         st.floats(0, 1)),
       which=st.sampled_from(range(len(BUDGET_POLICIES))))
def test_the_budget_caps_steered_steps_and_switches_on_what_the_cloud_saw(scenario, budget, which) -> None:
    mode, policy = BUDGET_POLICIES[which]
    slm, cloud = build(scenario)
    steps = scenario["steps"]
    decoder = decode(slm, cloud, policy, mode=mode, max_new_tokens=steps, exposure_budget=budget)
    sent = signals(cloud)
    assert [s.step for s in sent] == list(range(steps))
    # steered, as the cloud itself tells from the signal: anything uploaded, or a token other than its own top
    steered = [len(s.upload.values) > 0 if mode == "cloud" else s.token_id != cloud_top(scenario["cloud_rows"][t])
               for t, s in enumerate(sent)]
    # the share of the steps, as the float it is given as (1/3 of 3 steps is one step, although the decimal
    # 0.3333333333333333 times 3 is just under one in exact arithmetic)
    allowed = budget * steps
    assert sum(steered) <= allowed
    # the switch: withheld from the first step after which the cloud could count the allowance as spent
    before = np.concatenate([[0], np.cumsum(steered)[:-1]])
    withheld = [entry.withheld for entry in decoder.ledger.entries]
    for t in range(steps):
        assert withheld[t] == (before[t] + 1 > allowed), (t, before, withheld)
        if withheld[t]:
            assert not steered[t]


def test_a_budget_of_a_fifth_of_six_steps_lets_one_step_be_steered() -> None:
    """Hand-worked: 0.2 * 6 = 1.2 steps, so one steered step (two would be a third of the generation)."""
    scenario = {"vocab": 4, "steps": 6, "slm_rows": [np.array([-30, 0, 1, 2], np.float32)] * 4,
                "cloud_rows": [np.array([-30, 2, 1, 0], np.float32)] * 6}
    slm, cloud = build(scenario)
    decoder = decode(slm, cloud, Undefended(), mode="cloud", max_new_tokens=6, exposure_budget=0.2)
    assert [len(s.upload.values) > 0 for s in signals(cloud)] == [True, False, False, False, False, False]
    assert [e.withheld for e in decoder.ledger.entries] == [False, True, True, True, True, True]


# -- resend of an unacknowledged signal ----------------------------------------------------------------------
@FAST
@given(scenario=scenarios(max_steps=6), data=st.data(), mode=st.sampled_from(["cloud", "edge"]))
def test_a_broken_stream_resends_the_unacknowledged_step_byte_for_byte(scenario, data, mode) -> None:
    steps = scenario["steps"]
    broken = data.draw(st.integers(0, steps - 1), label="break after the signal of step")
    slm, cloud = build(scenario, eos=False, break_after_signal=[broken])
    # randomised: a fresh decision at the resent step would draw new noise (cloud-side) or a new token
    policy = DPLogit(epsilon=1.0) if mode == "cloud" else Undefended(temperature=1.0)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    decoder = decode(slm, cloud, policy, mode=mode, max_new_tokens=steps, reconnects=1, rng=rng)
    assert len(cloud.sessions) == 2
    second = cloud.sessions[1]
    by_step = signal_bytes_by_step(cloud)
    assert len(by_step[broken]) == 2 and by_step[broken][0] == by_step[broken][1]
    assert all(len(sent) == 1 for step, sent in by_step.items() if step != broken)
    assert second.request is not None and list(second.request.resume_prefix) == decoder.tokens[:broken]
    assert decoder.ledger.reconnects == 1
    assert [e.sends for e in decoder.ledger.entries] == [2 if t == broken else 1 for t in range(steps)]
    # the ledger counts every byte each step's signal cost, both sends included
    assert [e.bytes_up for e in decoder.ledger.entries] == [sum(map(len, by_step[t])) for t in range(steps)]


# -- never_upload masking ------------------------------------------------------------------------------------
MASK_POLICIES = [("cloud", Undefended(space="logit")), ("edge", Undefended(space="logit")),
                 ("cloud", CoVeil(lam=0.3, k=3, space="logit")), ("edge", CoVeil(lam=0.3, k=3, space="logit")),
                 ("cloud", Undefended()), ("edge", Undefended()), ("cloud", CoGenesis(b=2))]


@FAST
@given(scenario=scenarios(max_steps=5), data=st.data(), which=st.sampled_from(range(len(MASK_POLICIES))))
def test_masked_ids_carry_no_slm_value_and_their_values_change_nothing_sent(scenario, data, which) -> None:
    mode, policy = MASK_POLICIES[which]
    vocab, steps = scenario["vocab"], scenario["steps"]
    masked = frozenset(data.draw(st.sets(st.integers(1, vocab - 1), min_size=1, max_size=vocab - 2), label="mask"))
    other = data.draw(logit_rows(vocab, vocab), label="other SLM values at the masked ids")
    slm, cloud = build(scenario)
    decode(slm, cloud, policy, mode=mode, max_new_tokens=steps, masked=masked)
    if mode == "cloud":
        floor = np.finfo(np.float32).min if policy.space == "logit" else 0.0
        for signal in signals(cloud):
            ids, values = upload_of(signal, vocab)
            assert all(value == floor for i, value in zip(ids, values) if i in masked)
    # the SLM says something else about the masked ids only: in logit space nothing sent changes by a bit
    if policy.space == "logit":
        changed = dict(scenario, slm_rows=[row.copy() for row in scenario["slm_rows"]])
        for row, replacement in zip(changed["slm_rows"], other):
            row[sorted(masked)] = replacement[sorted(masked)]
        slm_b, cloud_b = build(changed)
        decode(slm_b, cloud_b, policy, mode=mode, max_new_tokens=steps, masked=masked)
        assert cloud_b.sent == cloud.sent


# -- a sparse row decides as the full row would where the public fill is exact ----------------------------------
# Since the full-row request became a public rule (issue 19, N1), a policy that reads a sparse row decides with its
# omitted ids at the public fill (the omitted mass shared evenly): the decision is the full row's whenever the
# cloud's omitted values are all equal, so the fill is what they are.
CERTIFYING = [("cloud", Undefended()), ("edge", Undefended()), ("edge", Undefended(space="logit")),
              ("cloud", CoVeil(lam=0.0, k=2)), ("cloud", CoVeil(lam=1.0, k=3)), ("edge", CoVeil(lam=0.5, k=3)),
              ("cloud", CoGenesis(b=2))]
# (logit space is left out: there the fill is log(tail mass / n) + log Z, which rounds off the flat tail's value in
# the last bit, so exact ties between a filled id and a sent one break either way)


@FAST
@given(scenario=scenarios(max_steps=5), data=st.data(), which=st.sampled_from(range(len(CERTIFYING))),
       alpha=st.sampled_from([0.0, 0.3, 0.5, 1.0]))
def test_a_sparse_row_with_a_flat_tail_gives_the_decision_of_the_full_row(scenario, data, which, alpha) -> None:
    mode, policy = CERTIFYING[which]
    vocab, steps = scenario["vocab"], scenario["steps"]
    top_m = data.draw(st.integers(1, vocab - 1), label="top_m")
    scenario = dict(scenario, cloud_rows=[flat_tail(row, top_m) for row in scenario["cloud_rows"]])
    slm, cloud = build(scenario)
    sparse = decode(slm, cloud, policy, mode=mode, max_new_tokens=steps, top_m=top_m, alpha=alpha)
    # the reference: the same generation where every row the cloud sends is its full row
    slm_full, cloud_full = build(scenario)
    full = decode(slm_full, cloud_full, policy, mode=mode, max_new_tokens=steps, top_m=vocab, alpha=alpha)
    assert not any(e.full_requested for e in full.ledger.entries)
    assert sparse.tokens == full.tokens
    assert [s.SerializeToString() for s in signals(cloud)] == [s.SerializeToString() for s in signals(cloud_full)]


@FAST
@given(scenario=scenarios(max_steps=5), alpha=st.sampled_from([0.0, 0.3, 0.5, 1.0]), top_m=st.integers(1, 3))
def test_edge_side_undefended_picks_the_fused_argmax_worked_out_here(scenario, alpha, top_m) -> None:
    """Reference: ``argmax(alpha * p_llm + (1 - alpha) * p_slm)`` in float64 from the tables, step by step.  The
    cloud's rows have a flat tail below the ``top_m`` ids it sends, so the public fill at which the edge reads the
    omitted ids is what they are."""
    scenario = dict(scenario, cloud_rows=[flat_tail(row, top_m) for row in scenario["cloud_rows"]])
    slm, cloud = build(scenario)
    decoder = decode(slm, cloud, Undefended(), mode="edge", max_new_tokens=scenario["steps"], top_m=top_m,
                     alpha=alpha)
    last = PROMPT_PRIVATE[-1]
    for t, token in enumerate(decoder.tokens):
        p_slm = softmax64(scenario["slm_rows"][last])
        p_llm = softmax64(scenario["cloud_rows"][t])
        fused = alpha * p_llm + (1 - alpha) * p_slm
        best = float(fused.max())
        # float32 rounding may order near-ties either way: the pick must be within rounding of the best
        assert fused[token] >= best - 1e-6, (t, token, fused)
        last = token


def test_a_peaked_sparse_row_certifies_without_asking_for_the_full_row() -> None:
    """Hand-worked: p_llm = (., .7, .1, .1, .1), p_slm = (., .1, .7, .1, .1), alpha = 0.5, top_m = 2.

    Sent: ids 1, 2 (0.7, 0.1), tail bound 0.1.  Fused: id 1: .5*.7+.5*.1 = .4, id 2: .5*.1+.5*.7 = .4,
    omitted ids at most .5*.1 + .5*.1 = .1 < .4: the top-1 is certified from the sparse row (tie to id 1).
    """
    z_llm = np.log(np.array([1e-9, 0.7, 0.1, 0.1, 0.1]))
    z_slm = np.log(np.array([1e-9, 0.1, 0.7, 0.1, 0.1]))
    scenario = {"vocab": 5, "steps": 1, "slm_rows": [z_slm] * 5, "cloud_rows": [z_llm]}
    slm, cloud = build(scenario)
    decoder = decode(slm, cloud, Undefended(), mode="edge", max_new_tokens=1, top_m=2, alpha=0.5)
    assert decoder.tokens == [1] and not decoder.ledger.entries[0].full_requested
    assert [m.WhichOneof("kind") for m in cloud.edge_messages()] == ["open", "signal"]


# -- the stop rule -----------------------------------------------------------------------------------------
class ShortestThenMarker:
    """May end once the text holds ``min_chars`` characters; done once it ends with ``marker``."""

    def __init__(self, min_chars: int, marker: str) -> None:
        self.min_chars, self.marker = min_chars, marker

    def allows_end(self, text: str) -> bool:
        return len(text) >= self.min_chars

    def is_done(self, text: str) -> bool:
        return text.endswith(self.marker)


@FAST
@given(scenario=scenarios(max_steps=8, eos_free=False), data=st.data(),
       which=st.sampled_from(range(len(BUDGET_POLICIES))))
def test_the_stop_rule_ends_where_it_says_and_forbids_ending_before(scenario, data, which) -> None:
    mode, policy = BUDGET_POLICIES[which]
    vocab, steps = scenario["vocab"], scenario["steps"]
    words = pieces(vocab)
    rule = ShortestThenMarker(data.draw(st.integers(0, 12), label="min_chars"),
                              words[data.draw(st.integers(1, vocab - 1), label="marker id")])
    slm, cloud = build(scenario)
    decoder = decode(slm, cloud, policy, mode=mode, max_new_tokens=steps, stopping=rule)
    tokens = decoder.tokens
    # replay the rule by hand over the tokens chosen: where it forbade an end, and where it is done
    texts = ["".join(words[i] for i in tokens[:t]) for t in range(len(tokens) + 1)]
    for t, token in enumerate(tokens):
        if not rule.allows_end(texts[t]):
            assert token != EOS, (t, texts[t])
        if t < len(tokens) - 1:  # not the last: nothing before it ended the generation
            assert token != EOS and not rule.is_done(texts[t + 1])
    done = rule.is_done(texts[-1])
    assert done or tokens[-1] == EOS or len(tokens) == steps
    if done and tokens[-1] != EOS and len(tokens) < steps:
        assert decoder.finish_reason == "stop_rule"
    if mode == "cloud":  # the cloud was told, and only told, whether an end is allowed: no_stop per step
        assert [s.no_stop for s in signals(cloud)] == [not rule.allows_end(texts[t]) for t in range(len(tokens))]


# -- resume ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@FAST
@given(scenario=scenarios(max_steps=6), data=st.data(), which=st.sampled_from(range(len(CERTIFYING))),
       budget=st.sampled_from([None, 0.0, 0.5, 1.0]))
def test_a_resumed_generation_gives_the_tokens_of_an_unbroken_one(scenario, data, which, budget) -> None:
    mode, policy = CERTIFYING[which]
    vocab, steps = scenario["vocab"], scenario["steps"]
    breaks = data.draw(st.lists(st.integers(0, steps - 1), max_size=3), label="breaks after signals")
    full_breaks = data.draw(st.lists(st.integers(0, steps - 1), max_size=2), label="breaks after full requests")
    top_m = data.draw(st.integers(1, vocab), label="top_m")
    options = dict(mode=mode, max_new_tokens=steps, top_m=top_m, exposure_budget=budget)
    slm, cloud = build(scenario)
    unbroken = decode(slm, cloud, policy, **options)
    slm_b, cloud_b = build(scenario, break_after_signal=breaks, break_after_full_request=full_breaks)
    resumed = decode(slm_b, cloud_b, policy, reconnects=len(breaks) + len(full_breaks), **options)
    assert resumed.tokens == unbroken.tokens
    assert resumed.ledger.reconnects == len(cloud_b.sessions) - 1
    # each step's signal is the unbroken run's, however often it was sent
    once = {t: sent[0] for t, sent in signal_bytes_by_step(cloud).items()}
    assert {t: set(sent) for t, sent in signal_bytes_by_step(cloud_b).items()} == {t: {b} for t, b in once.items()}
    assert [e.withheld for e in resumed.ledger.entries] == [e.withheld for e in unbroken.ledger.entries]


# -- the fakes themselves ------------------------------------------------------------------------------------
def test_the_table_slm_reads_the_longest_key_that_ends_the_sequence() -> None:
    default, after_1, after_2_1 = (np.full(3, v, np.float32) for v in (0.0, 1.0, 2.0))
    slm = TableSLM(["a", "b", "ab"], {(1,): after_1, (2, 1): after_2_1}, default=default)
    assert slm.prefill([0]).tolist() == [0.0] * 3
    assert slm.append(1).tolist() == [1.0] * 3  # (0, 1) ends with (1,)
    assert slm.prefill([2, 1]).tolist() == [2.0] * 3  # (2, 1) beats (1,)
    assert slm.tokenize("abab", add_bos=False) == [2, 2] and slm.detokenize([0, 1, 2]) == "abab"
    with pytest.raises(ValueError, match="no piece"):
        slm.tokenize("c", add_bos=False)
    with pytest.raises(ValueError, match="3 values, the vocabulary has 2"):
        TableSLM(["a", "b"], default=[0.0, 0.0, 0.0])


def test_the_scripted_cloud_lies_as_told_and_the_edge_refuses_a_malformed_row() -> None:
    """A lie that passes the codec reaches the policy; one that breaks a wire check ends the session.

    Hand-worked, alpha = 0.5, top_m = 2: p_llm = (0, .4, .35, .25), p_slm = (0, .2, .3, .5).  Sent: ids 1, 2
    with tail bound .35 and tail mass .25.  Greedy undefended never asks for the full row (issue 19, N1: a public
    rule); the omitted ids 0 and 3 stand at the public fill min(.35, .25 / 2) = .125.  Fused: id 1 .3, id 2 .325,
    id 3 .5 * .125 + .5 * .5 = .3125: id 2 (the full row would give id 3, .375: the fill's cost).  A cloud
    claiming a tail bound of 0 fills at 0: id 3 .25, still id 2, and the messages are the same.
    """
    from edge_sdk.protocol.status import CloudError

    def claims_an_empty_tail(dist: wire.CloudDistribution) -> wire.CloudDistribution:
        return wire.CloudDistribution(dist.step, dist.ids, dist.values, tail_bound=0.0, tail_mass=dist.tail_mass)

    def claims_a_larger_tail(dist: wire.CloudDistribution) -> wire.CloudDistribution:
        return wire.CloudDistribution(dist.step, dist.ids, dist.values, tail_bound=float(dist.values[-1]) + 0.5)

    scenario = {"vocab": 4, "steps": 1, "slm_rows": [np.log([1e-9, 0.2, 0.3, 0.5])] * 4,
                "cloud_rows": [np.log([1e-9, 0.4, 0.35, 0.25])]}
    kinds = []
    for lie in (None, claims_an_empty_tail):
        slm, cloud = build(scenario, lie=lie)
        decoder = decode(slm, cloud, Undefended(), mode="edge", max_new_tokens=1, top_m=2, alpha=0.5)
        kinds.append((decoder.tokens, [m.WhichOneof("kind") for m in cloud.edge_messages()]))
    assert kinds == [([2], ["open", "signal"]), ([2], ["open", "signal"])]
    slm, cloud = build(scenario, lie=claims_a_larger_tail)
    with pytest.raises(CloudError, match="DATA_LOSS: .*tail bound exceeds a value it sent"):
        decode(slm, cloud, Undefended(), mode="edge", max_new_tokens=1, top_m=2)


def test_an_upload_of_the_first_ids_only_travels_sparse_and_reads_back_whole() -> None:
    """Ids 0 and 1 of a 4-id vocabulary: sent as values only, the cloud could not tell which ids they were."""
    from edge_sdk.protocol.signals import CloudUpload

    upload = CloudUpload(np.array([0, 1]), np.array([0.25, 0.5], np.float32))
    message = wire.encode_upload(3, upload, vocab_size=4).signal.upload
    assert not message.dense and np.frombuffer(message.ids, "<u4").tolist() == [0, 1]
    back = wire.decode_upload(message, 4)
    assert back.ids.tolist() == [0, 1] and back.values.tolist() == [0.25, 0.5]
    whole = wire.encode_upload(3, CloudUpload(np.arange(4), np.full(4, 0.25, np.float32)), vocab_size=4)
    assert whole.signal.upload.dense and not whole.signal.upload.ids
    assert wire.decode_upload(whole.signal.upload, 4).ids.tolist() == [0, 1, 2, 3]


def test_the_fakes_take_the_time_they_are_told_and_serve_the_edge_client() -> None:
    """A 30 ms cloud step shows in the edge's wait for it and in the forward time the cloud reports; a prefill
    of the SLM that grows with the prompt's length delays the session's open; ``EdgeClient`` drives the same
    cloud through its session handlers."""
    import time

    from edge_sdk.client import EdgeClient

    pieces = ["<eos>", "a", "b", "\n", " ", "liver", " liver", "?"]
    slm = TableSLM(pieces, default=np.log([1e-6, .1, .1, .1, .1, .1, .4, .1]), eos_ids={0},
                   delay_s=lambda length: 0.01 * length if length > 2 else 0.0)
    cloud = ScriptedCloud(len(pieces), default=np.log([1e-6, .1, .3, .1, .1, .1, .2, .1]), eos_ids={0},
                          delay_s=lambda step: 0.03 if step == 1 else 0.0)
    started = time.perf_counter()
    decoder = CollaborativeDecoder(slm, Undefended(), DecodeSettings(mode="cloud", max_new_tokens=3),
                                   slm_prompt=[1, 2, 1, 2], cloud_prompt=[2], meter=LeakageMeter(frozenset()))
    list(run_with_resume(decoder, cloud.connect))
    assert time.perf_counter() - started >= 0.04 + 0.05 + 0.06 + 0.03  # prefill of 4, appends at 5 and 6, step 1
    entries = decoder.ledger.entries
    assert [e.cloud_forward_ms for e in entries] == [0.0, 30.0, 0.0]
    assert entries[1].wait_ms >= 30.0
    result = EdgeClient(cloud.session, slm=slm).generate("ab?", "a liver", mode="cloud", policy="undefended",
                                                         max_new_tokens=2)
    assert result.token_ids == [6, 6] and result.text == " liver liver"  # 0.3 * .2 + 0.7 * .4 beats the rest
    assert [m.WhichOneof("kind") for m in cloud.edge_messages()[-3:]] == ["open", "signal", "signal"]


def test_the_fakes_module_example_runs_as_written() -> None:
    """The usage example in ``edge_sdk.testing``'s docstring decodes its three tokens."""
    import textwrap

    import edge_sdk.testing

    doc = edge_sdk.testing.__doc__
    code = textwrap.dedent(doc.split("in milliseconds::\n", 1)[1].split("\n\n``EdgeClient", 1)[0])
    namespace: dict[str, Any] = {}
    exec(compile(code, "edge_sdk.testing example", "exec"), namespace)
    assert len(namespace["tokens"]) == 3 and namespace["decoder"].ledger.entries[0].values_uploaded <= 1


# -- the decide step's processors ----------------------------------------------------------------------------
class AllowOnly:
    """A processor allowing a fixed set of ids; it records the tokens it was advanced by."""

    def __init__(self, vocab: int, ids: set[int]) -> None:
        self.row = np.isin(np.arange(vocab), sorted(ids))
        self.consumed: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.row.copy()

    def consume(self, token_id: int) -> None:
        self.consumed.append(token_id)


def test_two_processors_leave_the_choice_to_the_ids_both_allow() -> None:
    """Edge-side undefended, alpha = 0.3: argmax of 0.3 * p_llm + 0.7 * p_slm over the allowed ids, each row
    renormalised over them.  p_llm = (.02, .6, .06, .12, .2), p_slm = (.05, .3, .15, .05, .45).
    A = {1, 2, 3} and B = {2, 3, 4}: over {2, 3}, p_llm' = (1/3, 2/3), p_slm' = (3/4, 1/4); fused 2: 0.1 + 0.525 =
    0.625, 3: 0.2 + 0.175 = 0.375, so 2.  A alone: p_llm' = (.6, .06, .12) / .78, p_slm' = (.6, .3, .1); fused
    1: .2308 + .42 = .6508 wins (2: .0231 + .21, 3: .0462 + .07), so 1.  B alone: p_llm' = (.06, .12, .2) / .38,
    p_slm' = (.15, .05, .45) / .65; fused 4: .1579 + .4846 = .6425 wins, so 4."""
    p_llm = np.array([.02, .6, .06, .12, .2])
    p_slm = np.array([.05, .3, .15, .05, .45])
    chosen = {}
    for name, allow in {"both": ({1, 2, 3}, {2, 3, 4}), "A": ({1, 2, 3},), "B": ({2, 3, 4},)}.items():
        processors = [AllowOnly(5, ids) for ids in allow]
        slm = TableSLM(pieces(5), default=np.log(p_slm), eos_ids={EOS})
        cloud = ScriptedCloud(5, default=np.log(p_llm), eos_ids={EOS})
        decoder = CollaborativeDecoder(
            slm, Undefended(), DecodeSettings(mode="edge", alpha=0.3, max_new_tokens=1, exposure_k=1),
            slm_prompt=PROMPT_PRIVATE, cloud_prompt=PROMPT_PUBLIC, meter=LeakageMeter(frozenset()),
            processors=processors,
        )
        chosen[name] = [event.token_id for event in run_with_resume(decoder, cloud.connect, backoff_s=0.0)]
        assert all(processor.consumed == chosen[name] for processor in processors)
    assert chosen == {"both": [2], "A": [1], "B": [4]}
