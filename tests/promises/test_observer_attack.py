"""DecodeLeak's observer attacks (issue 30): an on-path observer's sizes and times and the cloud's clock, scored on
two private contexts of one item, over the public fakes behind a simulated 60 ms link."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest

from eval_harness.attacks.observer import RecordingChannel, observer_scores, timing_auc
from eval_harness.report.tables import metrics_recorded, table
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import make_policy
from edge_sdk.testing import LinkChannel, ScriptedCloud, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from tests.support.side_by_side import side_by_side

VOCAB = 256
SHORT, LONG = 16, 1200


class ContextSLM(TableSLM):
    """A long private context steers the SLM to id 200 (a two-byte varint), a short one to id 3; each step takes
    10 ms and 20 us more per token of context."""

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.peak = 200 if len(ids) > 100 else 3
        return super().prefill(ids)

    def _next(self) -> np.ndarray:
        row = super()._next()
        row[self.peak] = 8.0
        return row


def peaked(token: int) -> np.ndarray:
    row = np.zeros(VOCAB, np.float32)
    row[token] = 8.0
    return row


def generation(context_tokens: int, mode: str, *, protected: bool) -> RecordingChannel:
    slm = ContextSLM([f"p{i}" for i in range(VOCAB)], default=np.zeros(VOCAB, np.float32),
                     delay_s=lambda length: 0.010 + 20e-6 * length)
    # after either context's token the cloud's own top is that token again: its drafts hold, as in run-ahead's use
    cloud = ScriptedCloud(VOCAB, {(token,): peaked(token) for token in (3, 200)}, default=np.zeros(VOCAB, np.float32),
                          max_new_tokens=12)
    settings = DecodeSettings(mode=mode, max_new_tokens=12, top_m=8, exposure_k=8,
                              **({} if protected else {"auto_pace_ms": None}))
    decoder = CollaborativeDecoder(slm, make_policy("undefended"), settings, slm_prompt=[1] * context_tokens,
                                   cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    channel = RecordingChannel(LinkChannel(cloud.session(), rtt_s=0.060, forward_s=0.004))
    list(decoder.steps(CloudConnection(channel, lookahead=8, padded=protected)))
    return channel


def short_and_long(mode: str, *, protected: bool) -> tuple[list[RecordingChannel], list[RecordingChannel]]:
    """One generation after each context, the two side by side (each sleeps nearly all its time)."""
    short, long = side_by_side(*(partial(generation, n, mode, protected=protected) for n in (SHORT, LONG)))
    return [short], [long]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_the_observer_attacks_tell_the_contexts_apart_only_without_the_defences(mode: str) -> None:
    """Unprotected, the token ids' varints and the uploads' values give the contexts' sizes away and the SLM's
    step their timing (run-ahead); with the default padding and public clock neither does."""
    bare = observer_scores(*short_and_long(mode, protected=False))
    assert bare["sizes_apart"] == 1.0 and bare["cloud_timing_auc"] > 0.9 and bare["timing_auc"] > 0.9, bare
    defended = observer_scores(*short_and_long(mode, protected=True))
    assert defended["sizes_apart"] == 0.0, defended
    assert 0.2 <= defended["cloud_timing_auc"] <= 0.8 and 0.2 <= defended["timing_auc"] <= 0.8, defended


def test_the_timing_auc_by_hand() -> None:
    # 3 of the 4 pairs have b > a, one tie: (3 + 0.5) / 4
    assert timing_auc(np.array([1.0, 2.0]), np.array([2.0, 3.0])) == pytest.approx(3.5 / 4)
    assert timing_auc(np.array([1.0]), np.array([1.0])) == 0.5


def test_decodeleak_report_shows_the_observer_scores_beside_token_er() -> None:
    def row(policy: str, observer: dict[str, float] | None) -> dict[str, Any]:
        return {"task": "medpriv", "mode": "cloud", "policy": policy, "correct": True, "params": {},
                "metrics": {"token_er@100": 0.25}, "observer": observer}

    rows = [row("coveil", {"sizes_apart": 0.0, "timing_auc": 0.5, "cloud_timing_auc": 0.5}),
            row("undefended", {"sizes_apart": 1.0, "timing_auc": 0.75, "cloud_timing_auc": 1.0})]
    observer = ("observer_sizes_apart", "observer_timing_auc", "observer_cloud_timing_auc")
    metrics = metrics_recorded(rows)
    assert metrics[0] == "token_er@100" and metrics[-3:] == observer
    cells = table(rows, metrics=metrics)
    # bold: the more private of the two, lower for sizes told apart, nearer chance (50%) for a timing AUC
    assert cells[0]["observer_sizes_apart"].startswith("**0.0** [")
    assert cells[0]["observer_timing_auc"].startswith("**50.0** [") and cells[1]["observer_timing_auc"].startswith("75.0 [")
    assert cells[1]["observer_cloud_timing_auc"].startswith("100.0 [")
    assert observer[0] not in metrics_recorded([row("coveil", None)])
