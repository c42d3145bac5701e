"""The public clock of ``edge_sdk.steps.Pacer``: work after a generation's last session ends on the prefill
budget's grid from that close (real clocks, a few hundred ms)."""

from __future__ import annotations

import time

import pytest

from edge_sdk.steps import Pacer


@pytest.mark.parametrize(("work_s", "points", "overrun"), [(0.05, 1, False), (0.3, 2, True)])
def test_work_after_the_end_returns_at_the_first_grid_point_after_it(work_s: float, points: int,
                                                                     overrun: bool) -> None:
    pacer = Pacer(None, prefill_budget_ms=200)
    ended = pacer.end()
    time.sleep(work_s)  # scoring an echoed prompt, say
    assert pacer.wait_after_end() is overrun
    returned = time.perf_counter() - ended
    assert points * 0.2 <= returned < points * 0.2 + 0.1, returned


def test_without_a_budget_nothing_waits_and_an_unended_generation_is_refused_with_one() -> None:
    pacer = Pacer(None)
    start = time.perf_counter()
    assert pacer.wait_after_end() is False
    assert time.perf_counter() - start < 0.05
    with pytest.raises(ValueError, match="EdgeClient"):
        Pacer(None, prefill_budget_ms=200).wait_after_end()
