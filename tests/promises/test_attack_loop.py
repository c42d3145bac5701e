"""Attack review of issue 19 on the decoding loop and ``never_upload`` (no model: milliseconds to seconds).

Each test here is a finding of the review: it failed on the code the review started from.  The lying cloud and
the slow SLM are the ones of ``tests/promises/test_malicious_cloud.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from edge_sdk.protocol import wire
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.privacy.masking import folded_vocabulary, never_upload_ids
from edge_sdk.policies import Policy, make_policy
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.protocol.status import CloudError
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import InProcessChannel
from tests.promises.test_malicious_cloud import LyingCloud, PeakSLM, SlowSLM, policies
from tests.promises.test_never_upload import masked_pieces
from tests.support.side_by_side import side_by_side

# -- pacing: a full-row request is a message the cloud times too ----------------------------------------------


def arrival_times(context_tokens: int, policy: str, pace_ms: float) -> list[tuple[str, float]]:
    """Every message the edge sent after the open, as ``(kind, ms after the open arrived)``."""
    cloud = LyingCloud(frozenset(), [], breaks=[0], max_new_tokens=2)
    decoder = CollaborativeDecoder(
        SlowSLM(), make_policy(policy), DecodeSettings(mode="edge", max_new_tokens=2, pace_ms=pace_ms),
        slm_prompt=list(range(context_tokens)), cloud_prompt=[1, 5], meter=LeakageMeter(frozenset()),
        rng=np.random.default_rng(0),
    )
    list(decoder.steps(CloudConnection(InProcessChannel(cloud))))
    opened = cloud.arrivals[0][1]
    return [(kind, 1e3 * (when - opened)) for kind, when in cloud.arrivals[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dp_fusion", "ldp_sampler"])
def test_paced_full_row_requests_leave_on_the_public_schedule_whatever_the_private_context_s_length(
    policy: str,
) -> None:
    """Finding: ``pace_ms`` held back the signal but not the full-row request that the edge-side samplers send
    at every step.  That request left as soon as the SLM's step for the previous token was done, so the gap
    between a signal and the next request was the SLM's step time: ~3 ms for a 5-token private context, ~500 ms
    for a 1,000-token one (SlowSLM: 0.5 ms per token of context), the very channel pacing is meant to close (N17).
    (InvisibleInk and undefended sampling take the same path.)

    Paced at 800 ms, every message must reach the cloud on the grid of 800 ms slots after the open (never early,
    late only by the scheduler's delay in waking up, up to 250 ms on a busy machine), for both context lengths."""
    pace = 800.0
    lengths = (5, 1000)  # the two generations side by side: each sleeps nearly all its time
    runs = dict(zip(lengths, side_by_side(*(lambda n=n: arrival_times(n, policy, pace) for n in lengths))))
    for context_tokens, times in runs.items():
        kinds = [kind for kind, _ in times]
        assert kinds.count("request_full") == 2 and kinds.count("signal") == 2
        for kind, at in times:
            assert at >= pace - 1 and at % pace <= 250, (context_tokens, kind, times)
    assert [kind for kind, _ in runs[5]] == [kind for kind, _ in runs[1000]]
    assert max(abs(a - b) for (_, a), (_, b) in zip(runs[5], runs[1000])) < 250


# -- never_upload: each part of a hyphenated (or otherwise joined) word ---------------------------------------

PIECES = [" ", ".", "-", "'", "Seen", " with", " and", " Okonkwo", "Okonkwo", " Fitzgerald", "Fitzgerald",
          " FITZGERALD", " fitzgerald", " Anne", "Anne", " O", "O", "Brien", " Brien", "brien", " Smith",
          *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]


def masked(spans: list[str], context: str) -> set[str]:
    return masked_pieces(PIECES, spans, context)


def test_never_upload_masks_every_word_of_a_hyphenated_name_as_the_model_may_write_it_alone() -> None:
    """Finding: a span's words were its whitespace-separated parts, so ``Okonkwo-Fitzgerald`` was one word and
    the token `` Fitzgerald`` (the surname written alone, with its leading space) was not masked.  On the embedded
    Gemma-3 270M, masking ``Mariangela Okonkwo-Fitzgerald`` left `` Fitzgerald`` the SLM's top value after
    ``Okonkwo-`` (0.17 after the mask's renormalisation: the masked spelling held 99.8% of the mass), and
    `` Fitz`` its top value after ``Mariangela``."""
    got = masked(["Okonkwo-Fitzgerald"], "Seen with Okonkwo-Fitzgerald.")
    assert {" Okonkwo", "Okonkwo", "Fitzgerald", " Fitzgerald", " FITZGERALD", " fitzgerald"} <= got
    assert "-" not in got and "." not in got
    got = masked(["Anne O'Brien"], "Seen with Anne O'Brien.")
    assert {" Anne", "Brien", " Brien", "brien"} <= got and "'" not in got


def test_never_upload_masks_the_tokens_that_spell_a_prefix_of_a_masked_word() -> None:
    """Open finding: only the tokens of a span's own tokenisations (and whole-word vocabulary matches) are masked.
    On the embedded Gemma-3 270M, ``Mariangela`` tokenises as `` Mari`` + ``ang`` + ``ela``; with those masked the
    SLM's top unmasked tokens at the name's position were `` Maria`` (3.4% after the renormalisation), `` M`` and
    `` Mary``, and after `` Mari`` it put 14% on ``angel``: the cloud reads the name's start off an upload.  A
    token spelling a prefix of three or more letters of a masked word (here `` Mari``, `` Maria``) should be
    masked with it."""
    pieces = [" ", ".", "Seen", " with", " Mari", " Maria", "ang", "ela", "angel",
              *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]

    def tokenize_pieces(text: str) -> list[int]:
        """Greedy longest match, except that (as in a BPE tokeniser's merges) `` Maria`` is never produced."""
        ids, at = [], 0
        while at < len(text):
            best = max((i for i, p in enumerate(pieces) if text.startswith(p, at) and p != " Maria"),
                       key=lambda i: len(pieces[i]))
            ids.append(best)
            at += len(pieces[best])
        return ids

    vocabulary = folded_vocabulary(pieces.__getitem__, len(pieces))
    got = {pieces[i] for i in never_upload_ids(["Mariangela"], "Seen with Mariangela.", tokenize_pieces,
                                               pieces.__getitem__, vocabulary)}
    assert " Mari" in got  # the span's own first token
    assert " Maria" in got  # a prefix of the word the model may write instead


# -- N1's test varied only the cloud: a request rule that reads p_slm alone passed it ------------------------


class ScaledPeakSLM(PeakSLM):
    """``PeakSLM`` with its peak at ``top`` and logits ``-scale * |i - top|``: a large scale is a confident SLM."""

    def __init__(self, top: int, scale: float) -> None:
        super().__init__(top=top)
        self.row = (-scale * np.abs(np.arange(self.vocab_size) - top)).astype(np.float32)
        self.row[self.vocab_size - 1] = -60.0


def requests_sent(slm: PeakSLM, mode: str, policy: Policy, probe: frozenset[int]) -> list[tuple[bytes, int]]:
    """Every message but the signals that the edge sends to a lying cloud over one generation with three forced
    reconnects, as ``(bytes, tokens resumed)``: what the edge asks for and when.  The signals are the policy's and
    differ with the context, and so do the tokens a reopened session replays (edge-side they are the signals): an
    open is compared without them."""
    received: list[bytes] = []
    left = [3]
    decoder = CollaborativeDecoder(
        slm, policy, DecodeSettings(mode=mode, max_new_tokens=4), slm_prompt=[1, 5, 6, 7], cloud_prompt=[1, 5],
        meter=LeakageMeter(frozenset()), rng=np.random.default_rng(11),
    )
    list(run_with_resume(decoder, lambda: CloudConnection(InProcessChannel(
        LyingCloud(probe, received, breaks=left))), max_reconnects=3, backoff_s=0.0))
    asked = []
    for data in received:
        message = wire.pb().EdgeMessage.FromString(data)
        if message.WhichOneof("kind") == "signal":
            continue
        resumed = len(wire.ids_from_bytes(message.open.resume_prefix.ids)) if message.HasField("open") else 0
        if message.HasField("open"):
            message.open.ClearField("resume_prefix")
        asked.append((message.SerializeToString(), resumed))
    return asked


@pytest.mark.parametrize(("label", "mode", "policy"), policies(), ids=[case[0] for case in policies()])
def test_what_the_edge_asks_for_is_the_same_for_any_private_context(label: str, mode: str, policy: Policy) -> None:
    """Finding on the test of N1: it compared two clouds against one SLM, so a rule that asked for the full row
    from ``p_slm`` alone (``or p_slm.max() > 0.9``, say) sent the same bytes in both runs and passed it, and
    every other test.  Here the clouds stay and the private side changes: a confident SLM peaked on the probe
    set's token, and a flat one peaked elsewhere; the opens, requests and closes must be the same bytes."""
    probe = frozenset({100, *range(200, 207)})
    confident, flat = ScaledPeakSLM(top=100, scale=5.0), ScaledPeakSLM(top=400, scale=0.01)
    assert requests_sent(confident, mode, policy, probe) == requests_sent(flat, mode, policy, probe)


# -- the epsilon budget's switch: its test could not see a switch that reads the private side -------------------


def withheld_steps(slm: PeakSLM, private_ids: frozenset[int]) -> list[bool]:
    """Edge-side DP-Fusion at eps = 1 per token under max_epsilon 12.5 against a lying cloud: which steps withheld."""
    decoder = CollaborativeDecoder(
        slm, make_policy("dp_fusion", epsilon=1.0),
        DecodeSettings(mode="edge", max_new_tokens=6, max_epsilon=12.5),
        slm_prompt=[1, 5, 6, 7], cloud_prompt=[1, 5], meter=LeakageMeter(private_ids), rng=np.random.default_rng(3),
    )
    cloud = LyingCloud(frozenset(), [], breaks=[0], max_new_tokens=6)
    list(decoder.steps(CloudConnection(InProcessChannel(cloud))))
    return [entry.withheld for entry in decoder.ledger.entries]


def test_the_epsilon_switch_is_the_same_whatever_the_slm_says_and_whatever_the_meter_reads() -> None:
    """Finding on the test of the epsilon budget (``test_accountant.py``): it compares two private contexts whose
    first two steps happened to move nothing private, so a switch that also withheld once the leakage meter moved
    (``or meter.share > 0``) passed it.  DP-Fusion at eps = 1 and delta 1e-5 spends 2 + 10.13 = 12.13 in two
    releases and 13.13 in three (by hand), so under max_epsilon 12.5 every generation withholds from step 2: for a
    confident SLM whose every token is private (the meter moves at once) as for a flat one with nothing private."""
    switch = [False, False, True, True, True, True]
    assert withheld_steps(ScaledPeakSLM(top=100, scale=5.0), frozenset(range(90, 111))) == switch
    assert withheld_steps(ScaledPeakSLM(top=400, scale=0.01), frozenset()) == switch


# -- a full-row request answered with a sparse row -----------------------------------------------------------


class SparseOnRequestCloud(LyingCloud):
    """Answers a full-row request with another sparse row."""

    def handle(self, message: Any) -> Iterator[Any]:
        if message.WhichOneof("kind") == "request_full":
            self.received.append(message.SerializeToString())
            yield self._row()
            return
        yield from super().handle(message)


def test_a_sparse_answer_to_a_full_row_request_is_the_cloud_s_error() -> None:
    """Finding: a cloud that answered a full-row request with a sparse row hit an ``assert`` in the loop (an
    ``AssertionError``: the endpoint's 500 "internal error", and under ``python -O`` a crash further on); it is a
    protocol violation of the cloud's, a ``CloudError`` (DATA_LOSS) like any other malformed answer."""
    decoder = CollaborativeDecoder(
        PeakSLM(), make_policy("dp_fusion"), DecodeSettings(mode="edge", max_new_tokens=2), slm_prompt=[1, 5, 6],
        cloud_prompt=[1, 5], meter=LeakageMeter(frozenset()), rng=np.random.default_rng(0),
    )
    cloud = SparseOnRequestCloud(frozenset(), [], breaks=[0])
    with pytest.raises(CloudError) as raised:
        list(decoder.steps(CloudConnection(InProcessChannel(cloud))))
    assert raised.value.code == "DATA_LOSS" and "full" in raised.value.message
