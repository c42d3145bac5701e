"""Drafts advanced by the engine itself and the cloud-side pick read off the kept row on the device.

* Engine drafting (``StepBatcher(engine_drafts=True)``: the worker forwards each run-ahead session's draft token as
  soon as its row is computed) sends the edge the very messages the session's own drafting sends: the same rows,
  the same ``assumes_token``, in the same order, every mode x lookahead, over the slot engine and the transformers
  backend.  The depth is held at the agreed lookahead (it otherwise follows measured times).
* The greedy cloud-side pick computed in torch (``fused_scores_on_device``) equals the numpy rule
  (``edge_sdk.fusion.cloud_scores`` then ``argmax``) float for float, over rows with exact ties and values an ulp
  apart; the slot engine with its rows kept as tensors picks the transformers backend's tokens cloud-side.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_adapter.backends.rows import GreedyPick, RowSpec, StepRow, fused_scores_on_device, greedy_picks
from cloud_adapter.backends.slots import SlotLLM
from cloud_adapter.engine import CloudEngine
from cloud_adapter.llm import TransformersLLM, TransformersSLM
from cloud_adapter.runners import StepBatcher
from edge_sdk.client import EdgeClient
from edge_sdk.fusion import cloud_scores
from edge_sdk.policies import CoVeil, make_policy
from edge_sdk.protocol.drafting import DraftSchedule
from tests.support.tiny_models import tiny_pair


class Recording:
    """A cloud session handler that keeps every message it sends (``forward_ns``, a timing, the padding that tops it
    up, and the random session id cleared)."""

    def __init__(self, handler: Any, sent: list[bytes]) -> None:
        self._handler, self._sent = handler, sent

    def _kept(self, replies: Any) -> Any:
        for reply in replies:
            copied = type(reply).FromString(reply.SerializeToString())
            copied.ClearField("padding")  # its length tops the message up to a public size, timing included
            if copied.WhichOneof("kind") == "distribution":
                copied.distribution.forward_ns = 0
            elif copied.WhichOneof("kind") == "opened":
                copied.opened.session_id = ""  # a fresh random id each session
            self._sent.append(copied.SerializeToString())
            yield reply

    def handle(self, message: Any) -> Any:
        return self._kept(self._handler.handle(message))

    def can_draft(self) -> bool:
        return self._handler.can_draft()

    def draft(self) -> Any:
        return self._kept(self._handler.draft())

    def abandon(self, reason: str) -> None:
        self._handler.abandon(reason)


@pytest.fixture(scope="module")
def pair() -> tuple[TransformersLLM, TransformersLLM]:
    return tiny_pair()


def _slots(cloud: TransformersLLM, *, device_rows: bool = False) -> SlotLLM:
    """The slot engine over a copy of ``cloud``'s weights (it takes over the model it serves)."""
    served = TransformersLLM.from_loaded(copy.deepcopy(cloud.model), cloud.tokenizer, cloud.name)
    return SlotLLM(served, max_slots=4, max_len=128, device_rows=device_rows)


def _runner(backend: str, cloud: TransformersLLM, engine_drafts: bool, *, device_rows: bool = False) -> StepBatcher:
    model = _slots(cloud, device_rows=device_rows) if backend == "slots" else cloud
    return StepBatcher(model, engine_drafts=engine_drafts)  # type: ignore[arg-type]


def _messages(pair: Any, backend: str, engine_drafts: bool, mode: str, lookahead: int) -> tuple[list[bytes], Any]:
    edge, cloud = pair
    sent: list[bytes] = []
    with _runner(backend, cloud, engine_drafts) as batcher:
        engine = CloudEngine(cloud, runner=batcher)
        client = EdgeClient(lambda: Recording(engine.session("t"), sent), slm=TransformersSLM(edge))
        result = client.generate("the patient has", "canary zebra", mode=mode, policy=CoVeil(lam=1.0),
                                 max_new_tokens=16, lookahead=lookahead)
        transcript = engine.transcript(result.ledger.session_ids[-1])
    return sent, (result.token_ids, transcript, batcher.drafted_steps)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["slots", "transformers"])
@pytest.mark.parametrize("mode", ["edge", "cloud"])
@pytest.mark.parametrize("lookahead", [1, 3])
def test_engine_drafting_sends_the_messages_the_session_s_own_drafting_sends(pair, backend, mode, lookahead,
                                                                             monkeypatch) -> None:
    monkeypatch.setattr(DraftSchedule, "depth", property(lambda self: self.lookahead))
    own, (own_tokens, own_transcript, own_drafted) = _messages(pair, backend, False, mode, lookahead)
    engine, (tokens, transcript, drafted) = _messages(pair, backend, True, mode, lookahead)
    assert engine == own
    assert tokens == own_tokens
    assert own_drafted == 0 and drafted > 0  # the engine did draft
    # the tiny models disagree often: drafts were vetoed and rolled back on both paths alike
    assert transcript["drafts_dropped"] == own_transcript["drafts_dropped"] > 0
    assert transcript["forwards"] == own_transcript["forwards"]


def test_a_vetoed_engine_draft_rolls_the_slot_back_by_its_length(pair) -> None:
    """The engine drafts three tokens past a session's confirmed ones; the session's own token (not the draft)
    resets the slot's length to the confirmed tokens before its forward, and the row after it equals the row of a
    sequence that never held the drafts."""
    _, cloud = pair
    prompt = cloud.tokenize("the patient has")
    slots = _slots(cloud)
    with StepBatcher(slots, engine_drafts=True) as batcher:  # type: ignore[arg-type]
        spec = RowSpec(top_n=4)
        seq, _ = batcher.prefill(prompt, spec=spec)
        plain, _ = batcher.prefill(prompt, spec=spec)
        assert batcher.run_ahead(seq, rule=None, spec=spec, end_ids=frozenset())
        assert batcher.plan_drafts(seq, len(prompt) + 3)
        drafted = [batcher.take_draft(seq) for _ in range(3)]
        assert [d.token for d in drafted[1:]] == [int(d.row.ids[0]) for d in drafted[:2]]  # each its row's top id
        assert seq.cache.length == len(prompt) + 3
        other = (drafted[0].token + 1) % cloud.vocab_size
        batcher.plan_drafts(seq, len(prompt) + 1)  # no draft past the session's own token (to read its length)
        batcher.forward(seq, other, truncate_to=len(prompt))
        batcher.forward(plain, other)
        assert seq.ids == plain.ids and seq.cache.length == len(prompt) + 1
        np.testing.assert_array_equal(batcher.forwarded_row(seq).values, plain.next_row.values)
        batcher.release(seq)
        batcher.release(plain)
        assert slots.free_slots == slots.slots


# -- the cloud-side pick on the device ------------------------------------------------------------------------
_VALUES = [0.0, -0.0, 0.25, 0.5, 1.0, 1.5, -2.0, 3.0]
_ulp_apart = st.sampled_from(_VALUES).flatmap(
    lambda v: st.sampled_from([v, float(np.nextafter(np.float32(v), np.float32(9))),
                               float(np.nextafter(np.float32(v), np.float32(-9)))]))


@st.composite
def picks(draw: Any) -> tuple[np.ndarray, GreedyPick]:
    vocab = draw(st.integers(2, 24))
    row = np.array(draw(st.lists(_ulp_apart, min_size=vocab, max_size=vocab)), np.float32)
    space = draw(st.sampled_from(["prob", "logit"]))
    if space == "prob":
        row = np.abs(row)
    ids = np.array(sorted(draw(st.sets(st.integers(0, vocab - 1), max_size=vocab))), np.int64)
    values = np.array(draw(st.lists(_ulp_apart, min_size=len(ids), max_size=len(ids))), np.float32)
    alpha = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0, 1 / 3]))
    stop = np.array(sorted(draw(st.sets(st.integers(0, vocab + 2), max_size=3))), np.int64)
    return row, GreedyPick(ids, values, alpha, space, stop)


@settings(max_examples=400, deadline=None)
@given(cases=st.lists(picks(), min_size=1, max_size=4))
def test_the_pick_on_the_device_is_the_numpy_rule_s_ties_and_near_ties_included(cases) -> None:
    rows = []
    for row, pick in cases:
        expected, _ = cloud_scores(row, pick.upload_ids, pick.upload_values, pick.alpha, space=pick.space,
                                   temperature=0.0, stop_ids=pick.stop_ids)
        scores = fused_scores_on_device(torch.from_numpy(row), pick).numpy()
        np.testing.assert_array_equal(scores.view(np.int32), expected.view(np.int32))  # bit for bit
        tensor = torch.from_numpy(row)
        rows.append((StepRow(RowSpec(pick.space), np.empty(0, np.int64), row[:0], row[:0], True, tensor, tensor),
                     int(np.argmax(expected))))
    width = {row.kept_values.shape[0] for row, _ in rows}
    if len(width) == 1:  # one batch: one stacked pick, one copy back
        assert greedy_picks([r for r, _ in rows], [pick for _, pick in cases]) == [t for _, t in rows]
    for (row, token), (_, pick) in zip(rows, cases):
        assert row.greedy_cloud_pick(pick) == token


@pytest.mark.slow
@pytest.mark.parametrize("lookahead", [0, 3])
@pytest.mark.parametrize("space", ["prob", "logit"])
def test_cloud_side_sessions_on_device_rows_pick_the_transformers_backend_s_tokens(pair, lookahead, space) -> None:
    """The slot engine with its rows kept as tensors (``device_rows``: every cloud-side pick and draft read off the
    kept row in torch) against the transformers backend's numpy rows: the same tokens, cloud-side."""
    edge, cloud = pair
    tokens = {}
    for backend in ("transformers", "slots"):
        with _runner(backend, cloud, True, device_rows=True) as batcher:
            engine = CloudEngine(cloud, runner=batcher)
            client = EdgeClient(lambda engine=engine: engine.session("t"), slm=TransformersSLM(edge))
            policy = CoVeil(lam=1.0) if space == "prob" else make_policy("undefended", space="logit")
            result = client.generate("the patient has", "canary zebra", mode="cloud", policy=policy,
                                     max_new_tokens=16, lookahead=lookahead)
            tokens[backend] = result.token_ids
    assert len(tokens["slots"]) > 1 and tokens["slots"] == tokens["transformers"]


def test_a_failed_engine_draft_fails_its_session_only(pair) -> None:
    """A draft step that raises reaches the session that takes it; the worker goes on serving the others."""
    _, cloud = pair
    slots = _slots(cloud)
    forward = slots._forward
    with StepBatcher(slots, engine_drafts=True) as batcher:  # type: ignore[arg-type]
        spec = RowSpec(top_n=4)
        seq, _ = batcher.prefill([5, 6, 7], spec=spec)
        other, _ = batcher.prefill([5, 6, 7], spec=spec)

        def failing(batch_slots: Any, tokens: list[list[int]]) -> Any:
            if any(s.index == seq.cache.index for s in batch_slots):
                raise RuntimeError("a kernel failed")
            return forward(batch_slots, tokens)

        slots._forward = failing  # type: ignore[method-assign]
        assert batcher.run_ahead(seq, rule=None, spec=spec, end_ids=frozenset())
        assert batcher.plan_drafts(seq, 5)
        with pytest.raises(RuntimeError, match="a kernel failed"):
            batcher.take_draft(seq)
        batcher.forward(other, 9)
        assert other.ids[-1] == 9 and other.next_row is not None
        batcher.release(seq)
        batcher.release(other)


def test_the_engine_drafts_without_the_session_asking_two_rows_ahead_of_what_it_took(pair) -> None:
    """Once a session lets it, the worker steps the sequence on its own draft tokens: two rows are drafted with no
    call from the session (``DRAFT_LEAD``), the third only once the session takes one."""
    _, cloud = pair
    with StepBatcher(_slots(cloud), engine_drafts=True) as batcher:  # type: ignore[arg-type]
        spec = RowSpec(top_n=4)
        seq, _ = batcher.prefill([5, 6, 7], spec=spec)
        assert batcher.run_ahead(seq, rule=None, spec=spec, end_ids=frozenset())
        assert batcher.plan_drafts(seq, 3 + 8)

        def drafted(n: int) -> bool:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and batcher.drafted_steps < n:
                time.sleep(0.01)
            time.sleep(0.2)  # a further draft would have run by now
            return batcher.drafted_steps == n and len(seq.ids) == 3 + n

        assert drafted(2)
        first = batcher.take_draft(seq)
        assert drafted(3)
        assert [first.token] == seq.ids[3:4]
        batcher.release(seq)
