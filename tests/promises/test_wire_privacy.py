"""Privacy promises on the wire: what the cloud observes never lets it reproduce the edge's randomness."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.policies import DPLogit
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import InProcessChannel

from tests.support.carriers import NETWORK_CARRIERS, Carrier, FakeEngine, served
from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", params=NETWORK_CARRIERS)
def carrier(request: pytest.FixtureRequest) -> Any:
    """The promises over every network carrier (the model's time dominates: in process they add nothing the
    malicious-cloud and run-ahead suites do not already run in process)."""
    yield from served(request.param, FakeEngine())


@pytest.fixture(scope="module")
def client(slm, engine) -> EdgeClient:
    return EdgeClient(lambda: engine.session("tests"), slm=slm)


def first_upload(client: EdgeClient, engine, carrier: Carrier, **kwargs) -> list[tuple[int, float]]:
    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=DPLogit(epsilon=1.0),
                             max_new_tokens=1, **kwargs)
    connection = CloudConnection(carrier.channel(lambda: engine.session("tests")))
    list(decoder.steps(connection))
    step = engine.transcript(connection.info.session_id)["steps"][0]
    return list(zip(step["upload_ids"], step["upload_values"]))


def test_the_edge_noise_is_not_derived_from_anything_the_cloud_sees(client, engine, carrier) -> None:
    """Two generations with identical public inputs (same seed on the wire) draw different DP-Logit noise:
    the cloud cannot replay it.  With the edge seeded from the wire, both uploads were bit-identical."""
    a = first_upload(client, engine, carrier, seed=7)
    b = first_upload(client, engine, carrier, seed=7)
    assert a != b
    # the comparison can tell: with one explicit generator state, the uploads agree bit for bit
    same = [first_upload(client, engine, carrier, rng=np.random.default_rng(5)) for _ in range(2)]
    assert same[0] == same[1]


def test_the_cloud_sampling_seed_is_sent_only_in_cloud_side_fusion(client) -> None:
    for mode, sent in (("cloud", 1234), ("edge", 0)):
        decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode=mode, seed=1234)
        assert decoder.request().seed == sent, mode


# -- never_upload ----------------------------------------------------------------------------------


def masked_ids(slm, spans: list[str], context: str) -> frozenset[int]:
    from edge_sdk.backends.pieces import piece_reader
    from edge_sdk.privacy.masking import never_upload_ids

    return never_upload_ids(spans, context, lambda t: slm.tokenize(t, add_bos=False), piece_reader(slm))


def test_never_upload_masks_every_spelling_of_any_span(slm) -> None:
    context = "Seen by Dr. Li with 王小明; she was not febrile. The Jaundice was new."
    tokens = lambda text: set(slm.tokenize(text, add_bos=False))  # noqa: E731
    # a non-ASCII name: every token of it, with or without a leading space
    name = masked_ids(slm, ["王小明"], context)
    assert tokens("王小明") <= name and tokens(" 王小明") <= name
    # a short name and title: the words in every case, never the "." between them
    doctor = masked_ids(slm, ["Dr. Li"], context)
    assert tokens(" Li") | tokens("Li") | tokens(" li") | tokens(" LI") <= doctor
    assert not tokens(".") & doctor
    # a stop word marked on purpose is masked, and so is a variant in another case without the space
    negation = masked_ids(slm, ["not"], context)
    assert tokens(" not") | tokens("Not") | tokens(" NOT") <= negation
    assert tokens(" jaundice") | tokens("jaundice") <= masked_ids(slm, ["Jaundice"], context)
    with pytest.raises(ValueError, match="no token that could be masked"):
        masked_ids(slm, [";"], context)
    with pytest.raises(ValueError, match="does not occur"):
        masked_ids(slm, ["Dr. Wu"], context)


def test_a_masked_id_is_never_uploaded_nor_missing_from_a_predictable_set(client, engine, slm, carrier) -> None:
    from edge_sdk.privacy.masking import FULL_UPLOAD_LIMIT
    from edge_sdk.policies import Undefended

    spans = ["jaundice", "bilirubin"]
    masked = masked_ids(slm, spans, PRIVATE_CONTEXT)
    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=Undefended(), max_new_tokens=3,
                             never_upload=spans)
    connection = CloudConnection(carrier.channel(lambda: engine.session("tests")))
    list(decoder.steps(connection))
    for entry, step in zip(decoder.ledger.entries, engine.transcript(connection.info.session_id)["steps"]):
        # the full upload became its top values: the masked ids hide among the many ids left out
        assert step["upload_size"] == entry.values_uploaded == FULL_UPLOAD_LIMIT
        assert not set(step["upload_ids"]) & masked


class FavouringCloud:
    """A cloud handler whose every full distribution puts ``mass`` on one token (a curious cloud probing it)."""

    def __init__(self, handler, token: int, mass: float = 0.99) -> None:
        self.handler, self.token, self.mass = handler, token, mass
        self.tops: list[int] = []  # the top id of each row it sent

    def handle(self, message):
        from edge_sdk.protocol import wire

        for reply in self.handler.handle(message):
            if reply.WhichOneof("kind") == "distribution" and reply.distribution.dense:
                dense = wire.values_from_bytes(reply.distribution.dense).copy()
                dense *= (1.0 - self.mass) / (1.0 - dense[self.token])  # still a distribution: the edge checks
                dense[self.token] = self.mass
                reply.distribution.dense = wire.values_to_bytes(dense)
                self.tops.append(int(np.argmax(dense)))
            yield reply

    def abandon(self, reason: str) -> None:
        self.handler.abandon(reason)


def test_a_masked_word_looks_to_a_probing_cloud_like_a_word_the_context_never_mentions(client, engine, slm) -> None:
    """A curious cloud pushes one probe token with 0.99 of its mass and watches what the edge does.  Refusing
    a masked probe would tell it the probe is in the hidden span; instead the edge decides as if its SLM gave
    the masked span nothing, i.e. exactly as for a word the private context never mentions."""
    from edge_sdk.policies import Undefended

    masked_probe = slm.tokenize(" jaundice", add_bos=False)[0]
    public_probe = slm.tokenize(" umbrella", add_bos=False)[0]

    def sent(probe: int, alpha: float, never_upload: list[str]) -> list[bool]:
        decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="edge", policy=Undefended(), alpha=alpha,
                                 max_new_tokens=3, top_m=slm.vocab_size, never_upload=never_upload)
        list(decoder.steps(CloudConnection(InProcessChannel(FavouringCloud(engine.session("tests"), probe)))))
        return [token == probe for token in decoder.tokens]

    for alpha in (0.3, 0.9):
        assert sent(masked_probe, alpha, ["jaundice"]) == sent(public_probe, alpha, ["jaundice"]), alpha


# -- retries ---------------------------------------------------------------------------------------


class LoseReplyAt:
    """Hands every message to the cloud, but loses the cloud's reply to the signal of step ``step`` once:
    the upload arrived, the edge never heard back."""

    def __init__(self, handler, step: int) -> None:
        self.handler, self.step = handler, step

    def handle(self, message):
        from edge_sdk.protocol.status import CloudError

        replies = list(self.handler.handle(message))
        if message.WhichOneof("kind") == "signal" and message.signal.step == self.step:
            raise CloudError("UNAVAILABLE", "connection reset", retryable=True)
        return replies

    def abandon(self, reason: str) -> None:
        self.handler.abandon(reason)


def test_a_retried_step_sends_exactly_the_bytes_it_sent_before(client, engine, carrier) -> None:
    from edge_sdk.decoding import run_with_resume

    sessions = []

    def session() -> Any:
        sessions.append(engine.session("tests"))
        return LoseReplyAt(sessions[-1], 1) if len(sessions) == 1 else sessions[-1]

    def connect() -> CloudConnection:
        return CloudConnection(carrier.channel(session))

    # DP-Logit draws fresh noise from OS entropy: a second draw for step 1 would differ
    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="cloud", policy=DPLogit(epsilon=1.0),
                             max_new_tokens=3)
    list(run_with_resume(decoder, connect, backoff_s=0.0))
    first, second = (engine.transcript(h.session_id) for h in sessions)
    seen_first = [(s["upload_ids"], s["upload_values"]) for s in first["steps"] if s["step"] == 1]
    seen_second = [(s["upload_ids"], s["upload_values"]) for s in second["steps"] if s["step"] == 1]
    assert seen_first and seen_first == seen_second
    entry = decoder.ledger.entries[1]
    assert entry.sends == 2 and [e.sends for e in decoder.ledger.entries] == [1, 2, 1]
    # the ledger records both sends of step 1: at least twice the bytes of step 1's upload message
    from edge_sdk.protocol import wire
    from edge_sdk.protocol.signals import CloudUpload

    upload = CloudUpload(np.array(seen_first[0][0]), np.array(seen_first[0][1], np.float32))
    assert entry.bytes_up >= 2 * wire.encode_upload(1, upload).ByteSize()


def test_the_private_prompt_is_prefilled_before_the_session_opens(slm, engine, carrier) -> None:
    """Step 0's timing would otherwise carry the private context's length (and whether it repeats)."""
    events: list[str] = []

    class RecordingSLM:
        def __init__(self, inner) -> None:
            self.inner = inner
            self.name, self.vocab_size, self.eos_token_ids = inner.name, inner.vocab_size, inner.eos_token_ids

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def prefill(self, ids):
            events.append("prefill")
            return self.inner.prefill(ids)

    class RecordingCloud:
        def __init__(self, handler) -> None:
            self.handler = handler

        def handle(self, message):
            events.append(message.WhichOneof("kind"))
            return self.handler.handle(message)

        def abandon(self, reason: str) -> None:
            self.handler.abandon(reason)

    client = EdgeClient(channel=lambda: carrier.channel(lambda: RecordingCloud(engine.session("tests"))),
                        slm=RecordingSLM(slm))
    client.generate(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="edge", max_new_tokens=2)
    assert events[:2] == ["prefill", "open"]


def test_the_exposure_budget_is_no_oracle_for_words_the_cloud_pushes(client, engine, slm, carrier) -> None:
    """A curious cloud pushes a probe word and watches when withholding starts.  The budget counts only the steps
    the private context steered as the cloud itself sees them (a token other than its own top), so the switch
    comes at the same step whether the probe is a word of the private context or not, and the cloud could
    have computed it from its own transcript."""
    from edge_sdk.policies import CoVeil, Undefended

    private_probe = slm.tokenize(" bilirubin", add_bos=False)[0]
    public_probe = slm.tokenize(" umbrella", add_bos=False)[0]
    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT)
    assert private_probe in decoder.meter.private_content_ids and public_probe not in decoder.meter.private_content_ids

    def withheld(probe: int, alpha: float, mass: float, policy=CoVeil(lam=1.0)) -> list[bool]:  # noqa: B008
        decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="edge", policy=policy, alpha=alpha,
                                 max_new_tokens=6, top_m=slm.vocab_size, exposure_budget=0.2)
        clouds: list[FavouringCloud] = []

        def favouring() -> FavouringCloud:
            clouds.append(FavouringCloud(engine.session("tests"), probe, mass))
            return clouds[-1]

        list(decoder.steps(CloudConnection(carrier.channel(favouring))))
        cloud = clouds[0]
        # the cloud's own count: steps whose token was not the top of the row it sent, before each step
        steered = np.cumsum([0] + [token != top for token, top in zip(decoder.tokens, cloud.tops)])[:-1]
        flags = [entry.withheld for entry in decoder.ledger.entries]
        assert flags == [bool(n + 1 > 0.2 * 6) for n in steered]  # at most floor(0.2 * 6) = 1 steered step
        return flags

    for alpha in (0.3, 0.6):  # a strong push: the switch comes at the same step for either probe
        assert withheld(private_probe, alpha, 0.99) == withheld(public_probe, alpha, 0.99)
    # a push the SLM disagrees with: the edge steers away, the budget runs out, and still only by what the cloud saw
    assert any(withheld(public_probe, 0.1, 0.99, Undefended()))


def test_a_cloud_cannot_misstate_its_own_top_token(client, engine, slm, carrier) -> None:
    """The budget and the fallback read the cloud's top token off the order of its sparse row; a row whose ids
    are not listed by decreasing value ends the session instead of being believed."""
    from edge_sdk.protocol import wire
    from edge_sdk.protocol.status import CloudError

    class Reordering:
        def __init__(self, handler) -> None:
            self.handler = handler

        def handle(self, message):
            for reply in self.handler.handle(message):
                if reply.WhichOneof("kind") == "distribution" and reply.distribution.ids:
                    ids = wire.ids_from_bytes(reply.distribution.ids)
                    values = wire.values_from_bytes(reply.distribution.values)
                    reply.distribution.ids = wire.ids_to_bytes(ids[::-1])
                    reply.distribution.values = wire.values_to_bytes(values[::-1])
                yield reply

        def abandon(self, reason: str) -> None:
            self.handler.abandon(reason)

    decoder = client.decoder(PUBLIC_PROMPT, PRIVATE_CONTEXT, mode="edge", max_new_tokens=2, exposure_budget=0.5)
    with pytest.raises(CloudError) as caught:
        list(decoder.steps(CloudConnection(carrier.channel(lambda: Reordering(engine.session("tests"))))))
    assert caught.value.code == "DATA_LOSS" and "decreasing" in str(caught.value)
