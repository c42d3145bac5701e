"""The run-ahead depth rule (:class:`~edge_sdk.protocol.drafting.DraftSchedule`) by hand, and the public fake cloud
drafting by it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_sdk.protocol import wire
from edge_sdk.protocol.drafting import DraftSchedule
from edge_sdk.testing import ScriptedCloud


def test_the_depth_is_turnaround_over_forward_plus_one_within_the_lookahead() -> None:
    schedule = DraftSchedule(8)
    assert schedule.depth == 1  # nothing measured yet
    schedule.observe_forward(0.010)
    assert schedule.depth == 1  # no turnaround yet
    schedule.observe_turnaround(0.025)
    assert schedule.depth == 4  # ceil(25 / 10) + 1
    schedule.observe_turnaround(0.125)  # 0.025 + 0.3 * (0.125 - 0.025) = 0.055: ceil(5.5) + 1 = 7
    assert schedule.turnaround_s == pytest.approx(0.055) and schedule.depth == 7
    schedule.observe_turnaround(1.0)  # far past: capped at the lookahead
    assert schedule.depth == 8
    # turnaround 0.055 + 0.3 * 0.945 = 0.3385, forward 0.01 + 0.3 * 9.99 = 3.007: ceil(0.11) + 1 = 2
    schedule.observe_forward(10.0)
    assert schedule.depth == 2
    assert DraftSchedule(0).depth == 0
    instant = DraftSchedule(3)
    instant.observe_forward(0.0)
    assert instant.depth == 3  # a cloud whose forward takes no time drafts as deep as agreed
    with pytest.raises(ValueError, match="lookahead"):
        DraftSchedule(-1)


def test_the_fake_cloud_drafts_by_the_schedule() -> None:
    """One row ahead until the edge's turnaround is measured, then (forwards taking 0.1 s, a turnaround of 0.12 s)
    ceil(1.2) + 1 = 3 rows, within the agreed 5."""
    rows = [np.log(np.full(4, 0.25, np.float32))] * 8
    cloud = ScriptedCloud(4, rows, delay_s=0.1, max_lookahead=5)
    session = cloud.session()
    request = wire.SessionRequest(prompt_ids=(1,), mode="edge", vocab_size=4, top_m=2, lookahead=5, max_new_tokens=8)
    list(session.handle(wire.encode_open(request)))
    assert session.schedule.depth == 1
    while session.can_draft():
        list(session.draft())
    assert len(session.drafts) == 1
    session.sent_at[0] = (time.monotonic() - 0.12, False)  # the edge answers the awaited row 0.12 s after it left
    list(session.handle(wire.encode_token(0, int(session.drafts[0]))))
    assert 0.12 <= session.schedule.turnaround_s < 0.2 and session.schedule.depth == 3
    while session.can_draft():
        list(session.draft())
    assert len(session.drafts) == 3
