"""Log-probabilities of the chosen tokens (:mod:`edge_sdk.logprobs`) over the real decoding loop and the public
fakes: values against fused rows worked by hand, and what the edge sends with logprobs on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk.protocol import wire
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.logprobs import log_distribution, token_logprobs
from edge_sdk.policies import Undefended
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, StepEvent, run_with_resume
from edge_sdk.testing import ScriptedCloud, TableSLM
from edge_sdk.protocol.status import CloudError

PIECES = ["<eos>", " a", " b", " c"]
P_SLM = [0.1, 0.6, 0.2, 0.1]
P_LLM = [0.1, 0.3, 0.5, 0.1]
# alpha = 0.5: fused = 0.5 * P_LLM + 0.5 * P_SLM = [0.10, 0.45, 0.35, 0.10]; the argmax is id 1 (" a")


class NoEndYet:
    """A stopping rule that never lets the generation end: end-of-generation ids are masked at every step."""

    def allows_end(self, text: str) -> bool:
        return False

    def is_done(self, text: str) -> bool:
        return False


def run(mode: str, *, logprobs: int | None, stopping=None, cloud_rows=None, max_new_tokens: int = 1,
        break_after_signal=()):
    slm = TableSLM(PIECES, {(): np.log(P_SLM)}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), cloud_rows or {(): np.log(P_LLM)}, eos_ids={0},
                          break_after_signal=break_after_signal)
    settings = DecodeSettings(mode=mode, alpha=0.5, max_new_tokens=max_new_tokens, top_m=4, exposure_k=4,
                              logprobs=logprobs)
    decoder = CollaborativeDecoder(slm, Undefended(), settings, slm_prompt=[3, 1], cloud_prompt=[1],
                                   meter=LeakageMeter(frozenset()), stopping=stopping)
    events = list(run_with_resume(decoder, cloud.connect, backoff_s=0.0))
    return events, cloud


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_logprobs_are_the_fused_rows_worked_by_hand(mode: str) -> None:
    (event,), _ = run(mode, logprobs=2)
    assert event.token_id == 1
    lp = event.logprobs
    assert lp is not None and lp.token_id == 1
    assert lp.logprob == pytest.approx(math.log(0.45), abs=1e-5)
    assert [i for i, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.45), math.log(0.35)], abs=1e-5)


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_a_masked_id_is_out_of_the_row_and_the_rest_renormalised(mode: str) -> None:
    """``no_stop``: id 0 is masked, so the row is [0, 0.45, 0.35, 0.10] / 0.9 = [0, 0.5, 0.3889, 0.1111]."""
    (event,), _ = run(mode, logprobs=4, stopping=NoEndYet())
    lp = event.logprobs
    assert lp.logprob == pytest.approx(math.log(0.5), abs=1e-5)
    assert [i for i, _ in lp.top] == [1, 2, 3]  # the masked id is never listed
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.5), math.log(0.35 / 0.9), math.log(0.1 / 0.9)],
                                                   abs=1e-5)


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_a_step_resent_after_a_broken_stream_reports_the_same_logprobs(mode: str) -> None:
    (event,), cloud = run(mode, logprobs=3, break_after_signal=[0])
    assert len(cloud.sessions) == 2 and event.logprobs == run(mode, logprobs=3)[0][0].logprobs


def test_edge_side_logprobs_change_nothing_the_edge_sends() -> None:
    _, without = run("edge", logprobs=None, max_new_tokens=3)
    _, with_them = run("edge", logprobs=20, max_new_tokens=3)
    assert with_them.sent == without.sent and len(without.sent) == 4  # open and three tokens, byte for byte


def test_edge_side_logprobs_change_nothing_sent_where_rows_are_sparse() -> None:
    """A 64-token vocabulary with the cloud sending its top 4: 20 log-probabilities per step need ids the sparse
    row does not list, and they are read at its public fill, never by asking for more (no full-row request, the
    same ``top_m``, the same bytes).  On the 4-token vocabulary above every row is already full, so asking for
    full rows, or opening with ``top_m`` = the vocabulary, would pass unnoticed there."""
    vocab = 64
    pieces = ["<eos>", *(f" w{i}" for i in range(1, vocab))]

    def row(seed: int) -> np.ndarray:
        logits = np.random.default_rng(seed).normal(size=vocab).astype(np.float32)
        logits[0] = -20.0
        return logits

    def sent(logprobs: int | None) -> tuple[list[bytes], list[StepEvent]]:
        slm = TableSLM(pieces, default=row(1), eos_ids={0})
        cloud = ScriptedCloud(vocab, default=row(2), eos_ids={0})
        settings = DecodeSettings(mode="edge", alpha=0.5, max_new_tokens=3, top_m=4, exposure_k=4, logprobs=logprobs)
        decoder = CollaborativeDecoder(slm, Undefended(), settings, slm_prompt=[3, 1], cloud_prompt=[1],
                                       meter=LeakageMeter(frozenset()))
        return cloud.sent, list(run_with_resume(decoder, cloud.connect, backoff_s=0.0))

    without, _ = sent(None)
    with_them, events = sent(20)
    assert with_them == without and len(without) == 4  # the open and three tokens: no full-row request
    assert all(len(event.logprobs.top) == 20 for event in events)  # ids past the four the cloud listed
    assert wire.pb().EdgeMessage.FromString(with_them[0]).open.top_m == 4


def test_cloud_side_logprobs_change_the_open_message_only_by_asking() -> None:
    """Cloud-side the session asks (``logprobs``, ``top_logprobs``); every other byte the edge sends is the same."""
    _, without = run("cloud", logprobs=None, max_new_tokens=3)
    _, with_them = run("cloud", logprobs=5, max_new_tokens=3)
    assert with_them.sent[1:] == without.sent[1:] and len(without.sent) == 4
    opened = with_them.edge_messages()[0].open
    assert opened.logprobs and opened.top_logprobs == 5
    opened.logprobs, opened.top_logprobs = False, 0
    assert opened.SerializeToString() == without.edge_messages()[0].open.SerializeToString()


def test_no_logprobs_are_read_without_asking() -> None:
    events, cloud = run("edge", logprobs=None)
    assert events[0].logprobs is None
    assert not cloud.edge_messages()[0].open.logprobs


def test_a_cloud_that_sends_no_logprobs_when_asked_is_refused() -> None:
    slm = TableSLM(PIECES, {(): np.log(P_SLM)}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), {(): np.log(P_LLM)}, eos_ids={0})
    settings = DecodeSettings(mode="cloud", alpha=0.5, max_new_tokens=1, top_m=4, exposure_k=4, logprobs=1)
    decoder = CollaborativeDecoder(slm, Undefended(), settings, slm_prompt=[3, 1], cloud_prompt=[1],
                                   meter=LeakageMeter(frozenset()))
    original = cloud.session

    def forgetful():
        session = original()
        handle = session.handle

        def without_logprobs(message):
            for reply in handle(message):
                if reply.WhichOneof("kind") == "token":
                    reply.token.ClearField("logprobs")
                yield reply
        session.handle = without_logprobs
        return session
    cloud.session = forgetful
    with pytest.raises(CloudError, match="log-probabilities"):
        list(run_with_resume(decoder, cloud.connect, backoff_s=0.0))


def test_log_distribution_of_logits_is_a_log_softmax_worked_by_hand() -> None:
    """z = [0, log 3, min]: softmax [1/4, 3/4, 0]; the masked (float32-lowest) logit is -inf."""
    z = np.array([0.0, math.log(3.0), np.finfo(np.float32).min], dtype=np.float32)
    assert log_distribution(z, "logit") == pytest.approx([math.log(0.25), math.log(0.75), -math.inf])
    lp = token_logprobs(z, "logit", 0, 3)
    assert [i for i, _ in lp.top] == [1, 0]  # the masked id is not listed
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.75), math.log(0.25)])


def test_more_than_twenty_alternatives_are_refused() -> None:
    with pytest.raises(ValueError, match="0..20"):
        DecodeSettings(logprobs=21)


def test_edge_side_logprobs_are_read_only_after_the_signal_left(monkeypatch) -> None:
    """Their top-n search takes a time that varies with the private row: it must not run before the send."""
    import edge_sdk.sides as session_module  # where the edge side reads them

    slm = TableSLM(PIECES, {(): np.log(P_SLM)}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), {(): np.log(P_LLM)}, eos_ids={0})
    sent_when_read: list[int] = []
    real = session_module.token_logprobs

    def spy(*args, **kwargs):
        sent_when_read.append(len(cloud.sent))
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "token_logprobs", spy)
    decoder = CollaborativeDecoder(slm, Undefended(), DecodeSettings(mode="edge", alpha=0.5, max_new_tokens=2,
                                                                     top_m=4, exposure_k=4, logprobs=2),
                                   slm_prompt=[3, 1], cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    list(run_with_resume(decoder, cloud.connect, backoff_s=0.0))
    assert sent_when_read == [2, 3]  # the open and step t's token had left when step t's were read
