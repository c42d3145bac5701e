"""The public clock of ``edge_sdk.steps.Pacer``: work after a generation's last session ends on the prefill
budget's grid from that close (real clocks, a few hundred ms)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.privacy.ledger import PrivacyLedger
from edge_sdk.steps import Pacer
from edge_sdk.testing import ScriptedCloud, TableSLM


@pytest.mark.parametrize(("work_s", "points", "overrun"), [(0.05, 1, False), (0.3, 2, True)])
def test_work_after_the_end_returns_at_the_first_grid_point_after_it(work_s: float, points: int,
                                                                     overrun: bool) -> None:
    pacer = Pacer(None, prefill_budget_ms=200)
    ended = pacer.end()
    time.sleep(work_s)  # scoring an echoed prompt, say
    assert pacer.wait_after_end() == (pytest.approx(ended + points * 0.2, abs=1e-9), overrun)
    returned = time.perf_counter() - ended
    assert points * 0.2 <= returned < points * 0.2 + 0.1, returned


def test_without_a_budget_nothing_waits_and_an_unended_generation_is_refused_with_one() -> None:
    pacer = Pacer(None)
    start = time.perf_counter()
    assert pacer.wait_after_end() is None
    assert time.perf_counter() - start < 0.05
    with pytest.raises(ValueError, match="EdgeClient"):
        Pacer(None, prefill_budget_ms=200).wait_after_end()


class FailingScoring:
    """A decoder whose generation closed and whose scoring then fails."""

    def __init__(self) -> None:
        self.pacer = Pacer(None, prefill_budget_ms=200)
        self.ledger = PrivacyLedger(mode="edge", policy="coveil")
        self.closed_at = self.pacer.end()

    def prompt_logprobs(self, top_n: int) -> list:
        time.sleep(0.05)
        raise RuntimeError("the SLM failed")


def test_a_failed_scoring_answers_on_the_grid_too_and_the_client_s_next_grid_starts_there() -> None:
    """The error of a scoring that failed reaches the app at the grid point too (its time would show how far the
    SLM got over the private context), and the client's next generation starts its grid no earlier."""
    cloud = ScriptedCloud(4, default=np.zeros(4, np.float32))
    with EdgeClient(cloud.session, slm=TableSLM(["a", "b", "c", "d"], default=np.zeros(4, np.float32))) as client:
        decoder = FailingScoring()
        with pytest.raises(RuntimeError, match="the SLM failed"):
            client.score_prompt(decoder, 0)  # type: ignore[arg-type]
        assert 0.2 <= time.perf_counter() - decoder.closed_at < 0.3
        nxt = Pacer(None, prefill_budget_ms=100)
        nxt.begin(decoder.closed_at)  # a request tokenised before the close
        nxt.not_before(client._idle_since)
        assert nxt.began_at == pytest.approx(decoder.closed_at + 0.2, abs=1e-9)
