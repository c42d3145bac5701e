"""The cloud's pick rule (cloud-side fusion), written once in :func:`edge_sdk.fusion.cloud_scores`: its callers (the
cloud adapter's session, the public fake cloud, the edge's run-ahead certifier) against a reference written out
here id by id, over rows full of ties."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edge_sdk.protocol import wire
from edge_sdk.fusion import certified_cloud_pick, cloud_scores, top_k_ids
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.testing import ScriptedCloud

NONE = np.empty(0, np.int64)


def reference_pick(row: list[float], uploaded: dict[int, float], alpha: float, stops: set[int]) -> int:
    """The cloud's greedy pick, id by id in float64: ``a * row + (1 - a) * upload`` where uploaded, ``a * row``
    elsewhere, the row alone at ``alpha = 0`` with nothing uploaded; stop ids are never picked unless every id is
    one; ties to the lower id."""
    a = 1.0 if alpha == 0.0 and not uploaded else alpha
    best, best_score = None, None
    for i, value in enumerate(row):
        if i in stops:
            continue
        score = a * value + ((1 - a) * uploaded[i] if i in uploaded else 0.0)
        if best_score is None or score > best_score:
            best, best_score = i, score
    return best if best is not None else 0


def greedy(row: np.ndarray, uploaded: dict[int, float], alpha: float, stops: set[int], space: str = "prob") -> int:
    ids = np.array(sorted(uploaded), np.int64)
    values = np.array([uploaded[i] for i in sorted(uploaded)], np.float32)
    scores, raw = cloud_scores(row, ids, values, alpha, space=space, temperature=0.0,  # type: ignore[arg-type]
                               stop_ids=np.array(sorted(stops), np.int64))
    assert raw == (space == "logit")
    return int(np.argmax(scores))


def test_the_pick_rule_by_hand() -> None:
    row = np.array([0.5, 0.3, 0.2], np.float32)
    # 0.3 * [.5, .3, .2] + 0.7 * [0, 0, .9] = [.15, .09, .69]
    assert greedy(row, {2: 0.9}, 0.3, set()) == 2
    # alpha = 0 with nothing uploaded: the row alone (not argmax of zeros, which is id 0 by accident)
    assert greedy(np.array([0.2, 0.5, 0.3], np.float32), {}, 0.0, set()) == 1
    # alpha = 0 with an upload: the upload alone; ids not uploaded score 0
    assert greedy(row, {1: 0.4}, 0.0, set()) == 1
    # the stop id 0 out of the choice: .15 stays lowest-ranked at 0, so id 1 (.09 + .7 * .2 = .23) wins over 2 (.06)
    assert greedy(row, {1: 0.2}, 0.3, {0}) == 1
    # a tie (.15 = .15) goes to the lower id
    assert greedy(np.array([0.5, 0.5, 0.0], np.float32), {}, 0.3, set()) == 0
    # raw logits: a stop id is lowered below any logit, not to 0 (which would beat the negative ones)
    logits = np.array([-1.0, -2.0, -3.0], np.float32)
    assert greedy(logits, {}, 0.5, {0}, space="logit") == 1
    scores, raw = cloud_scores(logits, NONE, np.empty(0, np.float32), 0.5, space="logit", temperature=0.0,
                               stop_ids=np.array([0, 7]))  # an id past the row is ignored
    assert raw and scores[0] == np.finfo(np.float32).min
    # sampling in logit space draws from softmax(s): probabilities (summing to 1), not raw logits
    scores, raw = cloud_scores(logits, NONE, np.empty(0, np.float32), 1.0, space="logit", temperature=0.7,
                               stop_ids=NONE)
    e = np.exp([0.0, -1.0, -2.0])
    assert not raw
    np.testing.assert_allclose(scores, e / e.sum(), rtol=1e-6)


#: few distinct values, so rows and uploads are full of ties
TIED = st.sampled_from([0.0, 0.0625, 0.125, 0.25, 0.5])


@st.composite
def cases(draw: Any) -> tuple[np.ndarray, dict[int, float], float, set[int]]:
    vocab = draw(st.integers(2, 9))
    row = np.array(draw(st.lists(TIED, min_size=vocab, max_size=vocab)), np.float32)
    uploaded = draw(st.dictionaries(st.integers(0, vocab - 1), TIED, max_size=vocab))
    alpha = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    stops = draw(st.sets(st.integers(0, vocab - 1), max_size=vocab - 1))
    return row, uploaded, alpha, stops


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_pick_rule_is_the_reference_over_ties(case: tuple[np.ndarray, dict[int, float], float, set[int]]) -> None:
    row, uploaded, alpha, stops = case
    assert greedy(row, uploaded, alpha, stops) == reference_pick(row.tolist(), uploaded, alpha, stops)


@settings(max_examples=300, deadline=None)
@given(cases(), st.integers(1, 9))
def test_a_certified_pick_is_the_reference_pick(case, top_m: int) -> None:
    """The certifier reads the row's top ``top_m`` and a tail bound (the largest omitted value): whenever it answers,
    its answer is the cloud's pick (a drift here is a ``DATA_LOSS`` in production), and on the whole row it answers
    unless the best two tie."""
    row, uploaded, alpha, stops = case
    known = top_k_ids(row, min(top_m, row.size))
    omitted = np.setdiff1d(np.arange(row.size), known)
    tail = float(row[omitted].max()) if omitted.size else 0.0
    ids = np.array(sorted(uploaded), np.int64)
    values = np.array([uploaded[i] for i in sorted(uploaded)], np.float32)
    stop_ids = np.array(sorted(stops), np.int64)
    expected = reference_pick(row.tolist(), uploaded, alpha, stops)
    certain = certified_cloud_pick(known, row[known], tail, ids, values, alpha, row.size, stop_ids)
    assert certain is None or certain == expected
    whole = certified_cloud_pick(np.arange(row.size), row, 0.0, ids, values, alpha, row.size, stop_ids)
    a = 1.0 if alpha == 0.0 and not uploaded else alpha
    scores = sorted((a * v + ((1 - a) * uploaded[i] if i in uploaded else 0.0) for i, v in enumerate(row)
                     if i not in stops), reverse=True)
    if len(scores) == 1 or scores[0] > scores[1]:
        assert whole == expected


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans())
# normalised to [1/6, 1/6, 2/3]: ids 0 and 2 score 1/3 each, apart by less than float32 rounding
@example((np.array([0.125, 0.125, 0.5], np.float32), {0: 0.5}, 0.5, set()), False)
def test_the_fake_cloud_picks_by_the_reference(case, no_stop: bool) -> None:
    """The public fake (:class:`~edge_sdk.testing.ScriptedCloud`) answers an upload with the reference's pick."""
    row, uploaded, alpha, stops = case
    if not stops:
        stops = {row.size - 1}
    cloud = ScriptedCloud(row.size, [np.log(np.maximum(row, 1e-6))], eos_ids=stops)
    session = cloud.session()
    request = wire.SessionRequest(prompt_ids=(1,), mode="cloud", alpha=alpha, top_m=row.size, vocab_size=row.size,
                                  max_new_tokens=1)
    sent = list(session.handle(wire.encode_open(request)))
    dense = wire.decode_distribution(sent[1].distribution, row.size).dense
    assert dense is not None
    ids = np.array(sorted(uploaded), np.int64)
    upload = CloudUpload(ids, np.array([uploaded[i] for i in sorted(uploaded)], np.float32))
    chosen = next(iter(session.handle(wire.encode_upload(0, upload, vocab_size=row.size, no_stop=no_stop))))
    # the fake normalises the row (softmax of its log), so its values are no longer dyadic: where the best two
    # float64 scores lie within float32 rounding of each other, the cloud's float32 scores may tie, and the tie
    # goes to the lower of them
    lowered = stops if no_stop else set()
    a = 1.0 if alpha == 0.0 and not uploaded else alpha
    scores = {i: a * v + ((1 - a) * uploaded[i] if i in uploaded else 0.0)
              for i, v in enumerate(dense.tolist()) if i not in lowered}
    best = max(scores.values(), default=0.0)
    near_best = sorted(i for i, score in scores.items() if best - score <= 4 * np.finfo(np.float32).eps * best)
    expected = reference_pick(dense.tolist(), uploaded, alpha, lowered)
    assert chosen.token.token_id == expected or chosen.token.token_id in near_best[:near_best.index(expected)]


@pytest.mark.parametrize("space", ["prob", "logit"])
def test_the_real_cloud_session_picks_by_the_reference(space: str) -> None:
    """The cloud adapter's session (the tiny random Qwen2) answers uploads with the reference's pick over the dense
    row it sent, stop ids lowered on ``no_stop`` steps."""
    from cloud_adapter.engine import CloudEngine

    from tests.support.tiny_models import tiny_pair

    _, cloud = tiny_pair()
    engine = CloudEngine(cloud)
    vocab = cloud.vocab_size
    for alpha, no_stop in ((0.3, False), (0.0, True), (0.5, True)):
        handler = engine.session("pick-rule")
        request = wire.SessionRequest(prompt_ids=tuple(cloud.tokenize("the patient")), mode="cloud", alpha=alpha,
                                      space=space, top_m=vocab, vocab_size=vocab, max_new_tokens=3,
                                      vocab_fingerprint=engine.fingerprint)
        replies = list(handler.handle(wire.encode_open(request)))
        for step in range(2):
            dense = wire.decode_distribution(replies[-1].distribution, vocab).dense
            assert dense is not None
            runner_up = int(top_k_ids(dense, 2)[1])  # upload on the runner-up, so the upload changes the pick
            uploaded = {runner_up: float(np.abs(dense).max()) * 4}
            upload = CloudUpload(np.array([runner_up]), np.array([uploaded[runner_up]], np.float32), space)
            replies = list(handler.handle(wire.encode_upload(step, upload, vocab_size=vocab, no_stop=no_stop)))
            stops = set(cloud.eos_token_ids) if no_stop else set()
            assert replies[0].token.token_id == reference_pick(dense.tolist(), uploaded, alpha, stops)
        handler.abandon("closed")
