"""Issue 30: what the cloud can time.  Signals leave on a public clock, so the gaps between them do not show the SLM's
step (which grows with the private context), in lockstep and run-ahead, in both fusion modes.

The link is simulated on the real clock (no model): a message reaches the cloud half a round trip after the edge
sent it; the cloud computes one row at a time (``FORWARD_S`` each), drafting as deep as agreed, and each reply
reaches the edge half a round trip after it left.  The SLM's step grows ``SLM_S_PER_TOKEN`` per token of context,
as the attack review's scripted SLM did.  The cloud's view is the sequence of times the edge's signals reached it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import make_policy
from edge_sdk.testing import LinkChannel, ScriptedCloud, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from tests.support.side_by_side import side_by_side

RTT_S = 0.080
FORWARD_S = 0.004
SLM_BASE_S, SLM_S_PER_TOKEN = 0.010, 20e-6
SHORT, LONG = 16, 1200  # tokens of private context: SLM steps of ~10 ms and ~34 ms
STEPS = 21  # 20 gaps
VOCAB = 8
PEAK = 3  # both models' top token at every step: every draft holds


def gaps_seen_by_the_cloud(context_tokens: int, mode: str, lookahead: int, **settings: Any) -> np.ndarray:
    """ms between consecutive signals as they reached the cloud, over one generation."""
    peaked = np.full(VOCAB, -4.0, np.float32)
    peaked[PEAK] = 4.0
    slm = TableSLM([chr(97 + i) for i in range(VOCAB)], default=peaked,
                   delay_s=lambda length: SLM_BASE_S + SLM_S_PER_TOKEN * length)
    cloud = ScriptedCloud(VOCAB, default=peaked, max_new_tokens=STEPS)
    decoder = CollaborativeDecoder(
        slm, make_policy("coveil"), DecodeSettings(mode=mode, max_new_tokens=STEPS, top_m=4, exposure_k=4,
                                                   **settings),
        slm_prompt=[1] * context_tokens, cloud_prompt=[1], meter=LeakageMeter(frozenset()),
    )
    channel = LinkChannel(cloud.session(), rtt_s=RTT_S, forward_s=FORWARD_S)
    list(decoder.steps(CloudConnection(channel, lookahead=lookahead)))
    assert len(channel.arrivals) == STEPS
    return 1e3 * np.diff(channel.arrivals)


#: gaps closer than this count as tied: a remote cloud reads them through milliseconds of network jitter, and
#: on this host a sleep's wake-up under load shifts a paced gap by 0.1-0.2 ms with the SLM's step
RESOLUTION_MS = 1.0


def auc(short: np.ndarray, long: np.ndarray) -> float:
    """P(a long-context gap > a short-context one by more than ``RESOLUTION_MS``) + P(within it) / 2: Mann-Whitney's
    AUC over every pair, with gaps within the resolution counted as ties."""
    difference = long[:, None] - short[None, :]
    return float(np.mean(difference > RESOLUTION_MS) + 0.5 * np.mean(np.abs(difference) <= RESOLUTION_MS))


def test_the_auc_counts_pairs_by_hand() -> None:
    # long 3, 5, 9 against short 4, 4.5: pairs 3-4 (-1.0, a tie), 3-4.5 (lower), 5-4 (+1.0, a tie), 5-4.5 (tie),
    # 9-4 and 9-4.5 (higher): (2 + 3/2) / 6
    assert auc(np.array([4.0, 4.5]), np.array([3.0, 5.0, 9.0])) == pytest.approx(3.5 / 6)
    far = np.arange(20.0)
    assert auc(far, far + 30) == 1.0 and auc(far + 30, far) == 0.0
    # without the resolution this is Mann-Whitney's AUC (U over the product of the sizes)
    assert mannwhitneyu(far + 30, far).statistic / 400 == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_the_gaps_the_cloud_sees_do_not_show_the_private_context_s_length(mode: str) -> None:
    """Edge-side lockstep hides the SLM's step behind the round trip and the cloud's forward.  Run-ahead, with the
    next row already on the device, would send one SLM step apart (unpaced: ~10 vs ~34 ms, told apart at AUC ~1),
    and cloud-side lockstep one round trip plus one SLM step apart (the SLM's step begins when the pick arrives:
    ~95 vs ~120 ms), so both are paced by default (``auto_pace_ms``): each gap is one pace (or, after a pick the
    edge waited for, the round trip and one pace) for either context."""
    for lookahead, (short, long) in short_and_long(mode, (0, 8)).items():
        assert 0.2 <= auc(short, long) <= 0.8, (lookahead, short, long)
        assert abs(np.median(long) - np.median(short)) < 5, (lookahead, short, long)
    pace = DecodeSettings.auto_pace_ms
    assert np.median(long) == pytest.approx(pace, abs=5), long  # run-ahead: the pace, not the SLM's ~34 ms
    # the protection removed: the same test tells the two contexts apart
    short, long = short_and_long(mode, (8,), auto_pace_ms=None)[8]
    assert auc(short, long) > 0.9 and np.median(long) - np.median(short) > 15, (short, long)


def short_and_long(mode: str, lookaheads: tuple[int, ...], **settings: Any
                   ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """:func:`gaps_seen_by_the_cloud` after the short and the long private context, at each of ``lookaheads``: the
    generations side by side (each sleeps nearly all its time: together they take as long as one, under the same
    load)."""
    runs = side_by_side(*(partial(gaps_seen_by_the_cloud, n, mode, lookahead, **settings)
                          for lookahead in lookaheads for n in (SHORT, LONG)))
    return {lookahead: (runs[2 * i], runs[2 * i + 1]) for i, lookahead in enumerate(lookaheads)}


@pytest.mark.slow
def test_an_explicit_pace_paces_lockstep_and_run_ahead_alike() -> None:
    """``pace_ms`` overrides the default pace, in edge-side lockstep too (which the default leaves unpaced): the
    signals reach the cloud one pace apart (a busy host's late wake-up shows in one gap and is made up in the next)."""
    lockstep, run_ahead = side_by_side(*(partial(gaps_seen_by_the_cloud, LONG, "edge", lookahead, pace_ms=120.0)
                                         for lookahead in (0, 8)))
    for lookahead, gaps in ((0, lockstep), (8, run_ahead)):
        assert np.median(gaps) == pytest.approx(120.0, abs=3), (lookahead, gaps)
    with pytest.raises(ValueError, match="auto_pace_ms must be positive"):
        DecodeSettings(auto_pace_ms=0)
