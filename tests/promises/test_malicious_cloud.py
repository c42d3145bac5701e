"""Promises that hold against a lying cloud, checked on the bytes the edge sends (no model: milliseconds).

The cloud here is scripted through the real wire codec.  It lists every id
except a probe set ``P`` at one value ``v`` and claims ``tail_bound = v``: a
row that passes every check the edge makes.  Asking for the full row only when
a sparse row could not certify the decision told such a cloud whether the
SLM's top token is in ``P`` (a scripted cloud recovered it out of 262,144 in
18 steps); breaking the stream after each answer gave it four such probes per
step.  Whatever ``P`` is, the edge must now send the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import pytest

from edge_sdk.protocol import wire
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import CusText, EmbeddingNeighbours, Policy, available_policies, make_policy, policy_class
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.protocol.status import CloudError
from edge_sdk.testing import ScriptedChannel, ScriptedCloud, ScriptedSession, TableSLM
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import InProcessChannel
from tests.support.carriers import Carrier
from tests.support.side_by_side import side_by_side

VOCAB = 512
TOP = 100  # the SLM's argmax: the token the lying cloud hunts for
PROBE_WITH_TOP = frozenset({TOP, *range(200, 207)})
PROBE_WITHOUT_TOP = frozenset(range(300, 308))


class PeakSLM:
    """An SLM whose every row peaks at ``top`` and falls off with the distance from it (end-of-text very low)."""

    name = "peak"

    def __init__(self, top: int = TOP, vocab_size: int = VOCAB) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, frozenset({vocab_size - 1})
        logits = -0.05 * np.abs(np.arange(vocab_size) - top).astype(np.float32)
        logits[vocab_size - 1] = -60.0
        self.row = logits

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return [1] * add_bos + [2 + ord(c) % 200 for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def vocab_fingerprint(self) -> bytes:
        return f"peak-{self.vocab_size}".encode()

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self.row.copy()

    def append(self, token_id: int) -> np.ndarray:
        return self.row.copy()


class LyingCloud:
    """A cloud session handler that lists every id but ``probe`` at one value with ``tail_bound`` that value.

    Asked to score the prompt, it sends that row at every prompt position.
    Every message it receives is kept (serialized) in ``received``, shared by
    the sessions of one generation.  ``breaks`` times it breaks the stream on
    the first message of step ``break_step`` (after keeping it).  Its token
    choice (cloud-side) is a fixed script: nothing the edge sends changes it.
    """

    def __init__(self, probe: frozenset[int], received: list[bytes], *, breaks: list[int], break_step: int = 1,
                 max_new_tokens: int = 4, vocab_size: int = VOCAB) -> None:
        self.probe, self.received, self.breaks, self.break_step = probe, received, breaks, break_step
        self.vocab = vocab_size
        self.arrivals: list[tuple[str, float]] = []  # (kind, when) of each message received
        self.max_new_tokens = max_new_tokens
        self.request: wire.SessionRequest | None = None
        self.step = 0

    def _row(self, dense: bool = False) -> Any:
        assert self.request is not None
        logit = self.request.space == "logit"
        value = np.float32(0.0 if logit else 1.0 / self.vocab)
        if dense:
            return wire.encode_distribution(wire.CloudDistribution(self.step, dense=np.full(self.vocab, value, np.float32)))
        ids = np.array([i for i in range(self.vocab) if i not in self.probe], dtype=np.int64)
        return wire.encode_distribution(wire.CloudDistribution(
            self.step, ids=ids, values=np.full(ids.size, value, np.float32), tail_bound=float(value) if self.probe else 0.0,
            tail_mass=len(self.probe) / self.vocab,
        ))

    def _maybe_break(self) -> None:
        if self.step == self.break_step and self.breaks[0] > 0:
            self.breaks[0] -= 1
            raise CloudError("UNAVAILABLE", "connection reset", retryable=True)

    def handle(self, message: Any) -> Iterator[Any]:
        self.received.append(message.SerializeToString())
        kind = message.WhichOneof("kind")
        self.arrivals.append((kind, time.perf_counter()))
        if kind == "open":
            self.request = wire.decode_open(message.open)
            self.step = len(self.request.resume_prefix)
            positions = len(self.request.prompt_ids) - 1 if self.request.score_prompt else 0
            row = wire.decode_distribution(self._row().distribution, self.vocab)  # the same row at every position
            rows = tuple(replace(row, step=position) for position in range(positions))
            yield wire.encode_opened(wire.SessionInfo(
                "lying", "liar", self.vocab, len(self.request.prompt_ids), frozenset({self.vocab - 1}),
                self.max_new_tokens, prompt_rows=rows, prompt_token_values=(float(row.values[0]),) * positions))
            yield self._row()
        elif kind == "request_full":
            self._maybe_break()
            yield self._row(dense=True)
        elif kind == "signal":
            self._maybe_break()
            assert self.request is not None
            step, self.step = self.step, self.step + 1
            done = self.step >= self.max_new_tokens
            if self.request.mode == "cloud":
                yield wire.encode_token_chosen(step, (7 * step + 3) % 50, done)
            if done:
                yield wire.encode_finished(self.step, "max_new_tokens")
            else:
                yield self._row()
        else:
            yield wire.encode_finished(self.step, "closed")

    def abandon(self, reason: str) -> None:
        pass


def policies() -> list[tuple[str, str, Policy]]:
    """Every registered policy in each mode it defines, the parameter variants that change its sparse rule."""
    neighbours = EmbeddingNeighbours(np.random.default_rng(0).standard_normal((VOCAB, 8)).astype(np.float32))
    cases = []
    for name in available_policies():
        for mode in sorted(policy_class(name).modes):
            variants: list[Policy]
            if name == "coveil":
                variants = [make_policy(name, lam=lam) for lam in (0.0, 1.0, 4.0)] + [make_policy(name, space="logit")]
            elif name == "undefended":
                variants = [make_policy(name), make_policy(name, space="logit"), make_policy(name, temperature=0.7)]
            elif name == "custext":
                variants = [CusText(neighbours=neighbours, epsilon=1.0)]
            else:
                variants = [make_policy(name)]
            cases += [(f"{policy.describe()}-{mode}", mode, policy) for policy in variants]
    return cases


def sent_to(probe: frozenset[int], mode: str, policy: Policy, *, breaks: int, vocab_size: int = VOCAB,
            masked_ids: frozenset[int] = frozenset(), carrier: Carrier | None = None,
            ) -> tuple[list[bytes], CollaborativeDecoder]:
    """Every message the edge sends to a lying cloud with ``probe``, over one generation (reconnects included), in
    process or over ``carrier``.  Unpaced (``auto_pace_ms=None``) over a carrier too, as in process: the pace
    only delays a message, never changes its bytes (``tests/promises/test_observer_timing.py`` holds the pace)."""
    received: list[bytes] = []
    left = [breaks]
    decoder = CollaborativeDecoder(
        PeakSLM(vocab_size=vocab_size), policy, DecodeSettings(mode=mode, max_new_tokens=4, auto_pace_ms=None),
        slm_prompt=[1, 5, 6, 7], cloud_prompt=[1, 5], meter=LeakageMeter(frozenset()), rng=np.random.default_rng(11),
        masked_ids=masked_ids,
    )
    def connect() -> CloudConnection:
        def lying() -> LyingCloud:
            return LyingCloud(probe, received, breaks=left, vocab_size=vocab_size)

        return CloudConnection(InProcessChannel(lying()) if carrier is None else carrier.channel(lying))

    list(run_with_resume(decoder, connect, max_reconnects=3, backoff_s=0.0))
    return received, decoder


@pytest.mark.parametrize(("label", "mode", "policy"), policies(), ids=[case[0] for case in policies()])
def test_a_lying_cloud_gets_the_same_bytes_whether_the_slm_top_token_is_in_its_probe_set_or_not(
    label: str, mode: str, policy: Policy, carrier: Carrier
) -> None:
    """Content, order and size of every message the edge sends, over three forced reconnects at step 1, over every
    carrier (in process, gRPC, WebSocket)."""
    with_top, decoder = sent_to(PROBE_WITH_TOP, mode, policy, breaks=3, carrier=carrier)
    without_top, _ = sent_to(PROBE_WITHOUT_TOP, mode, policy, breaks=3, carrier=carrier)
    # in process a break reaches the edge from its send, so it sends the step again and the cloud breaks again,
    # three times; over a network a step the edge decided itself was written before the break shows, so the edge
    # may resume past step 1, where the cloud breaks (a step that waits for the cloud's answer is sent again)
    kinds = [wire.pb().EdgeMessage.FromString(data).WhichOneof("kind") for data in with_top]
    reconnects = decoder.ledger.reconnects
    assert len(decoder.tokens) == 4 and kinds.count("open") == reconnects + 1  # one connection per reconnect
    assert reconnects == 3 if carrier.name == "in_process" else reconnects >= 1
    assert with_top == without_top


def test_the_fill_decides_as_the_filled_row_would_be_the_full_one() -> None:
    """The SLM's top token is among the omitted ids: the edge decides (and uploads it) from the filled row
    without asking for the full one, exactly as from a full row holding the fill there."""
    received, decoder = sent_to(PROBE_WITH_TOP, "cloud", make_policy("coveil", lam=0.0), breaks=0)
    kinds = [wire.pb().EdgeMessage.FromString(data).WhichOneof("kind") for data in received]
    assert "request_full" not in kinds
    assert decoder.ledger.full_requests == 0 and decoder.ledger.values_uploaded == 4  # y* = TOP, uploaded
    assert all(entry.exposure == (TOP,) for entry in decoder.ledger.entries)


def test_a_full_row_request_lost_to_a_broken_stream_is_sent_again_as_it_was_and_ledgered_each_time() -> None:
    received, decoder = sent_to(PROBE_WITH_TOP, "edge", make_policy("dp_fusion"), breaks=3)
    messages = [wire.pb().EdgeMessage.FromString(data) for data in received]
    at_step_1 = [data for data, message in zip(received, messages)
                 if message.WhichOneof("kind") == "request_full" and message.request_full.step == 1]
    assert len(at_step_1) == 4 and len(set(at_step_1)) == 1  # the same request on each of four connections
    entry = decoder.ledger.entries[1]
    assert entry.full_requests == 4 and entry.full_requested and entry.sends == 1
    assert [e.full_requests for e in decoder.ledger.entries] == [1, 4, 1, 1]
    assert decoder.ledger.full_requests == 7
    # a request: tag + length + (tag + step 1) = 4 bytes; the token signal padded to its public size: tag + length +
    # (tag + step 1, tag + a 5-byte token id) = 10, and 2 bytes of slack (hand-counted)
    assert entry.bytes_up == 4 * 4 + 12
    # what the cloud answered before each break never arrived; the dense row that did is on the entry
    assert entry.bytes_down >= VOCAB * 4


def test_the_public_fill_by_hand() -> None:
    """Ten ids, two sent; the other eight share the omitted mass 0.2 evenly (at most the tail bound)."""
    prob = wire.CloudDistribution(0, ids=np.array([3, 0]), values=np.array([0.5, 0.3], np.float32), tail_bound=0.3,
                                  tail_mass=0.2)
    assert prob.public_fill(10, "prob") == pytest.approx(0.025)
    row = prob.filled(10, "prob")
    assert row[3] == np.float32(0.5) and row[0] == np.float32(0.3) and row[5] == np.float32(0.025)
    assert float(row.sum(dtype=np.float64)) == pytest.approx(1.0, abs=1e-6)  # a distribution again
    # the same share in logit space: log Z = log(e^2 + e^1) - log(1 - 0.2) = 2.313262 + 0.223144
    logit = wire.CloudDistribution(0, ids=np.array([3, 0]), values=np.array([2.0, 1.0], np.float32), tail_bound=1.0,
                                   tail_mass=0.2)
    assert logit.public_fill(10, "logit") == pytest.approx(np.log(0.025) + 2.536406, abs=1e-5)
    # capped at the bound, and the lowest value of the space when nothing is omitted or no mass is left
    assert wire.CloudDistribution(0, ids=np.array([1]), values=np.array([0.9], np.float32), tail_bound=0.001,
                                  tail_mass=0.1).public_fill(10, "prob") == 0.001
    assert wire.CloudDistribution(0, ids=np.array([1]), values=np.array([1.0], np.float32)).public_fill(10, "prob") == 0


# -- never_upload ------------------------------------------------------------------------------------------


def test_a_full_upload_is_cut_to_the_same_public_size_whether_a_mask_is_active_or_not() -> None:
    """Undefended cloud-side uploads every id; cutting it to its 1,000 largest only while a mask was active told
    the cloud that one was.  Over a 2,048-token vocabulary both uploads now hold 1,000 values."""
    sizes = {}
    for masked in (frozenset(), frozenset({TOP + 1})):
        _, decoder = sent_to(frozenset(), "cloud", make_policy("undefended"), breaks=0, vocab_size=2048,
                             masked_ids=masked)
        sizes[bool(masked)] = [entry.values_uploaded for entry in decoder.ledger.entries]
    assert sizes[False] == sizes[True] == [1000] * 4


def test_a_masked_row_in_probability_space_is_renormalised_as_the_readme_says() -> None:
    """p = softmax(ln 4, ln 2, ln 1, ln 1) = (1/2, 1/4, 1/8, 1/8); masking id 1 (mass 1/4) leaves
    (1/2, 0, 1/8, 1/8) / (3/4) = (2/3, 0, 1/6, 1/6): every other value divided by 1 - masked mass, so a large
    upload still sums to 1 and does not give the masked mass away."""
    slm = PeakSLM(vocab_size=4)
    decoder = CollaborativeDecoder(slm, make_policy("undefended"), DecodeSettings(mode="cloud"), slm_prompt=[1],
                                   cloud_prompt=[1], meter=LeakageMeter(frozenset()), masked_ids=frozenset({1}))
    row = decoder.view.arrays(np.log(np.array([4.0, 2.0, 1.0, 1.0], np.float32)))
    assert row == pytest.approx([2 / 3, 0.0, 1 / 6, 1 / 6], abs=1e-6)


# -- pacing ------------------------------------------------------------------------------------------------


class SlowSLM(PeakSLM):
    """Each step takes 0.5 ms per token of context so far: the longer the private context, the slower."""

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.length = len(ids)
        return super().prefill(ids)

    def append(self, token_id: int) -> np.ndarray:
        self.length += 1
        time.sleep(self.length / 2e3)
        return super().append(token_id)


def signal_times(context_tokens: int, pace_ms: float | None) -> tuple[list[float], CollaborativeDecoder]:
    """When each signal reached the cloud, in ms after the open did."""
    cloud = LyingCloud(frozenset(), [], breaks=[0], max_new_tokens=5)
    decoder = CollaborativeDecoder(
        SlowSLM(), make_policy("coveil"), DecodeSettings(mode="edge", max_new_tokens=5, pace_ms=pace_ms),
        slm_prompt=list(range(context_tokens)), cloud_prompt=[1, 5], meter=LeakageMeter(frozenset()),
    )
    list(decoder.steps(CloudConnection(InProcessChannel(cloud))))
    opened = cloud.arrivals[0][1]
    return [1e3 * (when - opened) for kind, when in cloud.arrivals if kind == "signal"], decoder


@pytest.mark.slow
def test_paced_signals_leave_on_a_public_schedule_whatever_the_private_context_s_length() -> None:
    """Unpaced, a 200-token context's SLM steps are ~100 ms slower than a 5-token one's, and the cloud sees it in
    the gaps between signals; paced at 200 ms, signal t reaches the cloud (t + 1) * 200 ms after the open (and
    at most a scheduler's delay later), for either, and no step overran."""
    lengths = (5, 200)  # each context's generation beside the other's: each sleeps nearly all its time
    unpaced = {n: times for n, (times, _) in zip(lengths, side_by_side(*(partial(signal_times, n, None)
                                                                        for n in lengths)))}
    assert unpaced[200][-1] - unpaced[5][-1] > 300  # 4 steps x ~97 ms: the test can tell the two contexts apart
    paced = {}
    for n, (times, decoder) in zip(lengths, side_by_side(*(partial(signal_times, n, 200.0) for n in lengths))):
        paced[n] = times
        assert not any(entry.pace_overrun for entry in decoder.ledger.entries)
        for step, at in enumerate(paced[n]):  # never early; late only by the scheduler's delay in waking up
            assert (step + 1) * 200 - 1 <= at <= (step + 1) * 200 + 100, (n, step, paced[n])
    assert abs(paced[200][-1] - paced[5][-1]) < 100


def test_a_step_that_misses_its_slot_leaves_at_a_later_one_and_says_so() -> None:
    """Paced at 50 ms, an SLM step of 80+ ms misses its first slot: the signal waits for a later one."""
    times, decoder = signal_times(160, 50.0)
    assert [entry.pace_overrun for entry in decoder.ledger.entries] == [False, True, True, True, True]
    assert times[-1] >= 50 + 4 * 100 - 1, times  # each later step waited at least two slots
    with pytest.raises(ValueError, match="pace_ms must be positive"):
        DecodeSettings(pace_ms=0)


# -- rows held ------------------------------------------------------------------------------------------------


class FloodingChannel(ScriptedChannel):
    """After each signal, the cloud sends 150 drafted rows of the next step before its pick: rows the edge would
    hold until the pick it waits for arrives (a full row is a megabyte on Gemma-3)."""

    def send(self, message: Any) -> None:
        super().send(message)
        if message.WhichOneof("kind") == "signal":
            row = wire.encode_distribution(wire.CloudDistribution(
                message.signal.step + 1, ids=np.arange(4), values=np.full(4, 0.25, np.float32), assumes_token=3))
            self._pending.appendleft(iter([row] * 150))


def test_a_cloud_that_sends_rows_without_end_gets_resource_exhausted_and_the_session_closed() -> None:
    """Cloud-side with logprobs asked, the edge waits for each pick and holds the drafted rows read before it: at
    most the agreed depth, the unread picks and one; past that ``RESOURCE_EXHAUSTED`` (not retried) and the
    session is closed."""
    peaked = np.full(8, -4.0, np.float32)
    peaked[3] = 4.0
    cloud = ScriptedCloud(8, default=peaked, max_new_tokens=6)
    decoder = CollaborativeDecoder(
        TableSLM([chr(97 + i) for i in range(8)], default=peaked), make_policy("coveil"),
        DecodeSettings(mode="cloud", max_new_tokens=6, top_m=4, logprobs=0), slm_prompt=[1, 2], cloud_prompt=[1],
        meter=LeakageMeter(frozenset()),
    )
    sessions: list[ScriptedSession] = []

    def connect() -> CloudConnection:
        sessions.append(cloud.session())
        return CloudConnection(FloodingChannel(sessions[-1]), lookahead=2)

    with pytest.raises(CloudError) as caught:
        list(run_with_resume(decoder, connect, backoff_s=0.0))
    assert caught.value.code == "RESOURCE_EXHAUSTED" and not caught.value.retryable
    assert "more than 3 rows" in caught.value.message
    assert len(sessions) == 1 and sessions[0].finish_reason == "closed"
