"""``pace_ms="auto"`` (issue 30): the pace is measured on a public prompt as long as the SLM's window, rounded up
onto a coarse public grid, once per client; it does not depend on the private context, and the gaps the cloud
sees under it do not show the private context's length.  The link is simulated on the real clock (no model), as
in ``test_observer_timing.py``; the SLM's step grows with its sequence."""

from __future__ import annotations

import string
import threading
import time
from functools import partial

import numpy as np
import pytest
from pydantic import ValidationError

from edge_sdk.client import EdgeClient
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.decoding import CollaborativeDecoder
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.pace_calibration import on_pace_grid
from edge_sdk.policies import make_policy
from edge_sdk.testing import LinkChannel, ScriptedCloud, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.server.errors import validation_message
from edge_sdk.server.openai.protocol import CompletionRequest
from edge_sdk.server.serving import EdgeServing
from edge_sdk.server.settings import ServerSettings

from tests.promises.test_observer_timing import auc
from tests.support.side_by_side import side_by_side

VOCAB_PIECES = [" ", "\n", *string.ascii_letters, ".", ","]
STEPS = 21
#: a step of 4 ms + 4.4 us per token of the sequence: ~4 ms after a short private context, ~12 ms after 1,800
#: tokens, ~13 ms at the 2,048-token window the calibration fills (the fakes state no window: the default, 2,048)
BASE_S, PER_TOKEN_S = 0.004, 4.4e-6
SHORT, LONG = "a b", " ".join(["zq"] * 600)  # 3 and 1,799 tokens of private context


def peaked() -> np.ndarray:
    row = np.full(len(VOCAB_PIECES), -4.0, np.float32)
    row[3] = 4.0
    return row


def client() -> EdgeClient:
    slm = TableSLM(VOCAB_PIECES, default=peaked(), delay_s=lambda length: BASE_S + PER_TOKEN_S * length)
    cloud = ScriptedCloud(len(VOCAB_PIECES), default=peaked(), max_new_tokens=STEPS)
    return EdgeClient(cloud.session, slm=slm)


def test_the_grid_by_hand() -> None:
    # twice the step, rounded up onto 5, 10, 20, 50, ... 5000 ms; past it, multiples of 5000
    assert [on_pace_grid(ms) for ms in (1.0, 2.5, 2.6, 20.4, 24.9, 25.1, 2600.0, 7000.0)] == [
        5.0, 5.0, 10.0, 50.0, 50.0, 100.0, 10000.0, 15000.0]


class ClockedSLM(TableSLM):
    """The SLM whose step takes ``BASE_S + PER_TOKEN_S * length`` on a clock of its own (no sleep: a loaded host
    cannot stretch it), which the calibration reads."""

    def __init__(self) -> None:
        super().__init__(VOCAB_PIECES, default=peaked())
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def append(self, token_id: int) -> np.ndarray:
        self.now += BASE_S + PER_TOKEN_S * (len(self.sequence) + 1)
        return super().append(token_id)


def test_the_auto_pace_is_measured_on_public_text_whatever_the_private_context(monkeypatch) -> None:
    """At the window the step is 4 + 4.4e-3 x ~2,040 = ~13.0 ms: twice that, 25.9, is paced at 50 ms.  Measured on
    the private context the pace would be 10 ms after a short one (2 x ~4.0)."""
    import edge_sdk.pace_calibration as calibration

    for private in (SHORT, LONG):
        slm = ClockedSLM()
        monkeypatch.setattr(calibration, "time", slm)
        cloud = ScriptedCloud(len(VOCAB_PIECES), default=peaked(), max_new_tokens=STEPS)
        with EdgeClient(cloud.session, slm=slm) as edge:
            decoder = edge.decoder("q", private, policy="coveil", pace_ms="auto", auto_pace_ms="auto")
            assert (decoder.settings.pace_ms, decoder.settings.auto_pace_ms) == (50.0, 50.0), private
            assert edge.calibrated_pace_ms() == 50.0  # measured once, kept
            assert edge.decoder("q", LONG, policy="coveil", pace_ms="auto").settings.pace_ms == 50.0


def test_a_decoder_built_without_a_client_refuses_an_auto_pace() -> None:
    slm = TableSLM(VOCAB_PIECES, default=peaked())
    with pytest.raises(ValueError, match="pace_ms='auto' is measured by the client"):
        CollaborativeDecoder(slm, make_policy("coveil"), DecodeSettings(pace_ms="auto"), slm_prompt=[1],
                             cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    with pytest.raises(ValueError, match="pace_ms must be positive, 'auto'"):
        DecodeSettings(pace_ms="fast")


def gaps_seen_by_the_cloud(private: str, mode: str, lookahead: int) -> np.ndarray:
    with client() as edge:
        decoder = edge.decoder("q", private, policy="coveil", mode=mode, max_new_tokens=STEPS, top_m=4, exposure_k=4,
                               pace_ms="auto")
        cloud = ScriptedCloud(len(VOCAB_PIECES), default=peaked(), max_new_tokens=STEPS)
        channel = LinkChannel(cloud.session(), rtt_s=0.080, forward_s=0.004)
        list(decoder.steps(CloudConnection(channel, lookahead=lookahead)))
    return 1e3 * np.diff(channel.arrivals)


@pytest.mark.slow  # a real clock: generations paced at 50 ms a step
@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_under_the_auto_pace_the_gaps_do_not_show_the_private_context_s_length(mode: str) -> None:
    """The timing promise of ``test_observer_timing.py`` under ``pace_ms="auto"``: lockstep and run-ahead, a short
    and a long private context give gaps told apart no better than chance (AUC within 0.2-0.8), each one pace."""
    # the four generations side by side (each sleeps nearly all its time: together they take as long as one)
    runs = side_by_side(*(partial(gaps_seen_by_the_cloud, private, mode, lookahead)
                          for lookahead in (0, 8) for private in (SHORT, LONG)))
    for lookahead, short, long in ((0, *runs[:2]), (8, *runs[2:])):
        assert 0.2 <= auc(short, long) <= 0.8, (lookahead, short, long)
        assert abs(np.median(long) - np.median(short)) < 5, (lookahead, short, long)


class RecordingClockedSLM(ClockedSLM):
    """:class:`ClockedSLM` keeping what it did in order: ``("step", n)`` per step, ``("read", text)`` per text it
    tokenised."""

    def __init__(self) -> None:
        super().__init__()
        self.did: list[tuple[str, object]] = []

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        self.did.append(("read", text))
        return super().tokenize(text, add_bos=add_bos)

    def append(self, token_id: int) -> np.ndarray:
        self.did.append(("step", len(self.sequence)))
        return super().append(token_id)


def test_the_endpoint_measures_an_auto_pace_before_reading_the_private_text_and_while_the_slm_is_free(
        monkeypatch) -> None:
    """``coveil.pace_ms: "auto"`` on the endpoint: the client's pace (50 ms for this SLM, as above), measured once,
    on public text, before the request's private text is read (so it is not counted as the request's private work)
    and never while a generation holds the SLM; the next request finds it measured."""
    import edge_sdk.pace_calibration as calibration

    slm = RecordingClockedSLM()
    monkeypatch.setattr(calibration, "time", slm)
    cloud = ScriptedCloud(len(VOCAB_PIECES), default=peaked(), max_new_tokens=STEPS)
    with EdgeClient(cloud.session, slm=slm) as edge:
        serving = EdgeServing(edge, None, ServerSettings(cloud="127.0.0.1:1"), n_ctx=4096)
        try:
            request = CompletionRequest(model="coveil", prompt="q", max_tokens=2, coveil={
                "private_context": SHORT, "pace_ms": "auto"})
            with serving._slm_lock:  # a generation holds the SLM
                prepared: list = []
                waiting = threading.Thread(target=lambda: prepared.append(serving.prepare_completion(request)))
                waiting.start()
                waiting.join(0.3)
                assert waiting.is_alive() and not edge.pace_measured and slm.now == 0.0
            waiting.join(30)
            assert prepared[0].decoder.settings.pace_ms == 50.0
            steps = [i for i, (what, _) in enumerate(slm.did) if what == "step"]
            reads = [i for i, (what, text) in enumerate(slm.did) if what == "read" and SHORT in str(text)]
            assert steps and reads and max(steps) < min(reads), slm.did[-3:]
            measured_at, did = slm.now, len(slm.did)
            again = CompletionRequest(model="coveil", prompt="q", max_tokens=2, coveil={
                "private_context": LONG, "pace_ms": "auto"})
            assert serving.prepare_completion(again).decoder.settings.pace_ms == 50.0
            assert slm.now == measured_at and all(what == "read" for what, _ in slm.did[did:])  # measured once
        finally:
            serving.close()


def test_the_run_s_clocks_apply_to_requests_that_name_none(monkeypatch) -> None:
    """``--pace-ms auto --prefill-budget-ms 2000``: the pace is measured when the endpoint starts, and a request
    without ``coveil`` (lm-eval's) gets both; one naming its own keeps it."""
    import edge_sdk.pace_calibration as calibration

    slm = ClockedSLM()
    monkeypatch.setattr(calibration, "time", slm)
    cloud = ScriptedCloud(len(VOCAB_PIECES), default=peaked(), max_new_tokens=STEPS)
    with EdgeClient(cloud.session, slm=slm) as edge:
        serving = EdgeServing(edge, None, ServerSettings(cloud="127.0.0.1:1", pace_ms="auto", prefill_budget_ms=2000),
                              n_ctx=4096)
        try:
            for _ in range(300):  # the worker measures first
                if edge.pace_measured:
                    break
                time.sleep(0.01)
            assert edge.pace_measured
            plain = serving.prepare_completion(CompletionRequest(model="coveil", prompt="q", max_tokens=2))
            assert (plain.decoder.settings.pace_ms, plain.decoder.settings.prefill_budget_ms) == (50.0, 2000.0)
            own = serving.prepare_completion(CompletionRequest(model="coveil", prompt="q", max_tokens=2, coveil={
                "pace_ms": 20, "prefill_budget_ms": 500}))
            assert (own.decoder.settings.pace_ms, own.decoder.settings.prefill_budget_ms) == (20.0, 500.0)
        finally:
            serving.close()
    with pytest.raises(ValueError, match="--prefill-budget-ms must be in"):
        ServerSettings(cloud="127.0.0.1:1", prefill_budget_ms=1e9)


def test_the_endpoint_refuses_a_pace_that_is_not_a_number_of_ms_nor_auto() -> None:
    for word in ("fast", 0, True, "20", 10**400, 1e9, float("nan")):
        with pytest.raises(ValidationError) as refused:
            CompletionRequest(model="coveil", prompt="q", coveil={"pace_ms": word})
        assert validation_message(refused.value.errors()) == (
            "coveil.pace_ms: Value error, a pace is a number of ms in (0, 60000], or 'auto'", "coveil.pace_ms"), word
