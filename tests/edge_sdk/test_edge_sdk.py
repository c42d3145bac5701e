"""The edge SDK's decoding loop end to end, in process, against the real cloud engine and embedded model."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.fusion import fuse, softmax
from edge_sdk.policies import CoVeil, Undefended, make_policy
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.protocol.status import CloudError
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import InProcessChannel

from tests.conftest import PRIVATE_CONTEXT, PUBLIC_PROMPT

pytestmark = pytest.mark.model

PUBLIC, PRIVATE = PUBLIC_PROMPT, PRIVATE_CONTEXT
STEPS = 8
#: the logit-space loops against a direct run: each token costs a forward of both models on both sides
LOGIT_STEPS = 4


@pytest.fixture(scope="module")
def client(slm, engine) -> EdgeClient:
    return EdgeClient(lambda: engine.session("tests"), slm=slm)


def reference_undefended_greedy(slm, llm, alpha: float, steps: int) -> list[int]:
    """Fused greedy decoding computed directly on both models' full distributions."""
    from edge_sdk.client import CONTEXT_SEPARATOR

    z_slm = slm.prefill(slm.tokenize(PRIVATE + CONTEXT_SEPARATOR + PUBLIC, add_bos=True))
    seq = llm.open(llm.tokenize(PUBLIC))
    tokens: list[int] = []
    for _ in range(steps):
        token = int(np.argmax(fuse(softmax(seq.next_logits), softmax(z_slm), alpha)))
        tokens.append(token)
        if token in slm.eos_token_ids:
            break
        z_slm = slm.append(token)
        llm.step([(seq, token)])
    return tokens


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_undefended_matches_direct_fused_greedy(client, slm, engine, mode: str) -> None:
    result = client.generate(PUBLIC, PRIVATE, mode=mode, policy=Undefended(), max_new_tokens=STEPS)
    assert result.token_ids == reference_undefended_greedy(slm, engine.llm, 0.3, STEPS)
    assert len(result.ledger.entries) == len(result.token_ids)


def test_what_the_cloud_observes_does_not_depend_on_what_ran_before(client, engine) -> None:
    """Undefended cloud-side fusion uploads all of p_slm: the transcript shows its values bit for bit."""

    def observed(private: str) -> list[list[float]]:
        decoder = client.decoder(PUBLIC, private, mode="cloud", policy=Undefended(), max_new_tokens=3)
        connection = CloudConnection(InProcessChannel(engine.session("tests")))
        list(decoder.steps(connection))
        return [step["upload_values"] for step in engine.transcript(connection.info.session_id)["steps"]]

    observed("A different record: the patient reports chest pain on exertion and shortness of breath.")
    first = observed(PRIVATE)
    assert observed(PRIVATE) == first  # a repeat, right after generating from the same prompt
    observed(PRIVATE[:40])  # a prompt sharing a prefix with it
    assert observed(PRIVATE) == first


def test_sparse_cloud_distribution_gives_the_same_decisions_as_full(client, slm) -> None:
    for mode in ("cloud", "edge"):
        sparse = client.generate(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=0.5), max_new_tokens=STEPS, top_m=256)
        full = client.generate(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=0.5), max_new_tokens=STEPS,
                               top_m=slm.vocab_size)
        assert sparse.token_ids == full.token_ids
        assert full.ledger.full_requests == 0
        assert all(e.cloud_forward_ms > 0 for e in sparse.ledger.entries + full.ledger.entries)
        per_token_down = sparse.ledger.bytes_down / len(sparse.token_ids)
        assert per_token_down < full.ledger.bytes_down / len(full.token_ids) / 10
        # top_m = vocabulary size travels dense: 4 bytes per entry (plus framing, and the token in cloud mode)
        assert all(4 * slm.vocab_size < e.bytes_down < 4 * slm.vocab_size + 64 for e in full.ledger.entries)


def test_ledger_exposure_equals_the_cloud_transcript(client, engine) -> None:
    from edge_sdk.privacy.meter import ExposureTrace

    # top_m = 16 < K = 100: edge-side the edge still records K ids per step (it asks for at least K values)
    for mode, top_m in (("cloud", 256), ("edge", 256), ("edge", 16)):
        decoder = client.decoder(PUBLIC, PRIVATE, mode=mode, policy=Undefended(), max_new_tokens=4, top_m=top_m)
        connection = CloudConnection(InProcessChannel(engine.session("tests")))
        list(decoder.steps(connection))
        transcript = engine.transcript(connection.info.session_id)
        assert [tuple(s["exposure"]) for s in transcript["steps"]] == [e.exposure for e in decoder.ledger.entries]
        assert decoder.ledger.exposure_trace() == ExposureTrace.from_transcript(transcript)
        assert transcript["exposure_k"] == decoder.ledger.exposure_k == 100
        assert all(len(e.exposure) == 100 for e in decoder.ledger.entries), (mode, top_m)
        assert [s["token_id"] for s in transcript["steps"]] == decoder.tokens


def test_coveil_uploads_at_most_one_value_per_step(client) -> None:
    result = client.generate(PUBLIC, PRIVATE, mode="cloud", policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
    assert all(e.values_uploaded <= 1 for e in result.ledger.entries)
    undefended = client.generate(PUBLIC, PRIVATE, mode="cloud", policy=Undefended(), max_new_tokens=STEPS)
    assert result.ledger.leak_share <= undefended.ledger.leak_share
    # undefended uploads its 1,000 largest values per step (8 bytes each), CoVeil at most one
    assert result.ledger.bytes_up < undefended.ledger.bytes_up / 100


def test_never_upload_spans_and_exposure_budget(client, slm) -> None:
    lam0 = CoVeil(lam=0.0)
    masked = client.generate(PUBLIC, PRIVATE, mode="cloud", policy=Undefended(), max_new_tokens=4,
                             never_upload=["jaundice", "bilirubin"])
    decoder = client.decoder(PUBLIC, PRIVATE, never_upload=["jaundice", "bilirubin"])
    assert decoder.view.masked.size > 0
    for entry in masked.ledger.entries:
        assert not set(entry.exposure) & set(decoder.view.masked.tolist())
    budget = client.generate(PUBLIC, PRIVATE, mode="cloud", policy=lam0, max_new_tokens=4, exposure_budget=0.0)
    assert all(e.withheld and e.values_uploaded == 0 for e in budget.ledger.entries)
    with pytest.raises(ValueError, match="does not occur"):
        client.decoder(PUBLIC, PRIVATE, never_upload=["not in the context"])


def test_stream_yields_the_generated_text_and_keeps_the_ledger(client) -> None:
    stream = client.stream(PUBLIC, PRIVATE, mode="edge", policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
    pieces = list(stream)
    whole = client.generate(PUBLIC, PRIVATE, mode="edge", policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
    assert "".join(pieces) == whole.text == stream.text
    assert len(stream.ledger.entries) == len(whole.token_ids)


def test_a_cancelled_stream_closes_its_cloud_session(client, engine) -> None:
    with client.stream(PUBLIC, PRIVATE, mode="cloud", policy=CoVeil(lam=1.0), max_new_tokens=STEPS) as stream:
        next(iter(stream))
        assert engine.active_sessions == 1
    assert engine.active_sessions == 0
    assert len(stream.ledger.entries) < STEPS


def test_a_dropped_connection_resumes_with_public_data_only(slm, engine) -> None:
    """The first connection dies after two steps; the session reopens with the chosen tokens."""
    from edge_sdk.decoding import run_with_resume

    class DropAfter:
        def __init__(self, handler, steps: int) -> None:
            self.handler, self.left = handler, steps

        def handle(self, message):
            if message.WhichOneof("kind") == "signal":
                self.left -= 1
                if self.left < 0:
                    raise CloudError("UNAVAILABLE", "connection reset", retryable=True)
            return self.handler.handle(message)

        def abandon(self, reason: str) -> None:
            self.handler.abandon(reason)

    handlers = iter([DropAfter(engine.session("tests"), 2)])

    def connect() -> CloudConnection:
        handler = next(handlers, None) or engine.session("tests")
        return CloudConnection(InProcessChannel(handler))

    client = EdgeClient(lambda: engine.session("tests"), slm=slm)
    uninterrupted = client.generate(PUBLIC, PRIVATE, mode="edge", policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
    decoder = client.decoder(PUBLIC, PRIVATE, mode="edge", policy=CoVeil(lam=1.0), max_new_tokens=STEPS)
    list(run_with_resume(decoder, connect, backoff_s=0.0))
    assert decoder.ledger.reconnects == 1
    assert decoder.tokens == uninterrupted.token_ids


def test_every_registered_policy_runs_in_its_modes(client, slm) -> None:
    from edge_sdk.policies import available_policies

    for name in available_policies():
        # CusText over the SLM's own embeddings, built once per file (the test below selects it by name too)
        policy = make_policy(name, backend=slm)
        for mode in sorted(policy.modes):
            result = client.generate(PUBLIC, PRIVATE, mode=mode, policy=policy, max_new_tokens=3, seed=1)
            assert len(result.token_ids) == 3, (name, mode)


def test_a_full_upload_travels_dense_and_the_loop_cuts_it_to_its_largest_values(slm, engine) -> None:
    from edge_sdk.protocol import wire

    p = np.random.default_rng(0).dirichlet(np.ones(slm.vocab_size)).astype(np.float32)
    full = wire.encode_upload(0, Undefended().cloud_upload(p, p, alpha=0.3), vocab_size=slm.vocab_size)
    sparse = wire.encode_upload(0, CoVeil(lam=0.0).cloud_upload(p, p, alpha=0.3))
    assert full.signal.upload.dense and not full.signal.upload.ids
    assert full.ByteSize() < 4 * slm.vocab_size + 64  # values only: half of listing every id too
    assert not sparse.signal.upload.dense
    client = EdgeClient(lambda: engine.session("tests"), slm=slm)
    decoder = client.decoder(PUBLIC, PRIVATE, mode="cloud", policy=Undefended(), max_new_tokens=2)
    connection = CloudConnection(InProcessChannel(engine.session("tests")))
    list(decoder.steps(connection))
    step = engine.transcript(connection.info.session_id)["steps"][0]
    # probability space: cut to its 1,000 largest values, mask or no mask (a cut only under a mask would say so)
    assert step["upload_size"] == 1000 == len(step["upload_ids"])
    assert step["exposure"] == list(decoder.ledger.entries[0].exposure)


def test_every_policy_is_selectable_by_name_custext_with_the_slm_embeddings(client) -> None:
    result = client.generate(PUBLIC, PRIVATE, mode="edge", policy="custext", max_new_tokens=2, seed=3)
    assert result.ledger.policy.startswith("custext")
    assert len(result.token_ids) == 2
    for name in ("undefended", "coveil", "cogenesis", "dp_logit", "dp_fusion"):
        assert client.generate(PUBLIC, PRIVATE, mode="cloud", policy=name, max_new_tokens=1).token_ids


# -- logit space: raw logits on both ends, the authors' release rules --------------------------------


def direct_logit_run(slm, llm, steps: int, choose) -> tuple[list[int], list[np.ndarray]]:
    """Greedy collaborative decoding on both models' raw logit rows; ``choose(z_slm, z_llm) -> token``."""
    from edge_sdk.client import CONTEXT_SEPARATOR

    z_slm = slm.prefill(slm.tokenize(PRIVATE + CONTEXT_SEPARATOR + PUBLIC, add_bos=True))
    seq = llm.open(llm.tokenize(PUBLIC))
    tokens, rows = [], []
    for _ in range(steps):
        rows.append(z_slm.copy())
        token = choose(z_slm, seq.next_logits)
        tokens.append(token)
        if token in slm.eos_token_ids:
            break
        z_slm = slm.append(token)
        llm.step([(seq, token)])
    return tokens, rows


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_logit_space_loop_fuses_raw_logits(client, slm, engine, mode: str) -> None:
    from edge_sdk.fusion import fuse_upload
    from edge_sdk.policies.coveil import coveil_select_logit, coveil_upload_logit

    alpha, lam = 0.5, 1.0
    if mode == "cloud":
        def choose(z_slm, z_llm):
            ids = coveil_upload_logit(z_slm, z_llm, alpha=alpha, lam=lam, k=50)
            return int(np.argmax(fuse_upload(z_llm, ids, z_slm[ids], alpha)))
    else:
        def choose(z_slm, z_llm):
            return coveil_select_logit(z_slm, z_llm, alpha=alpha, lam=lam, k=50)

    expected, rows = direct_logit_run(slm, engine.llm, LOGIT_STEPS, choose)
    decoder = client.decoder(PUBLIC, PRIVATE, mode=mode, policy=CoVeil(lam=lam, space="logit"), alpha=alpha,
                             max_new_tokens=LOGIT_STEPS)
    connection = CloudConnection(InProcessChannel(engine.session("tests")))
    list(decoder.steps(connection))
    assert decoder.tokens == expected
    transcript = engine.transcript(connection.info.session_id)
    assert transcript["space"] == "logit"
    if mode == "cloud":
        uploads = [(s["upload_ids"], s["upload_values"]) for s in transcript["steps"]]
        assert any(ids for ids, _ in uploads)
        for (ids, values), z_slm in zip(uploads, rows):  # the cloud saw the SLM's raw logits, nothing rescaled
            np.testing.assert_array_equal(np.array(values, np.float32), z_slm[ids])
    # CoVeil decides from the cloud's top values at the public fill: it never asks for the full row
    assert decoder.ledger.full_requests == 0


def test_undefended_in_logit_space_is_the_release_fusion(client, slm, engine) -> None:
    expected, _ = direct_logit_run(slm, engine.llm, LOGIT_STEPS, lambda zs, zl: int(np.argmax(0.5 * zl + 0.5 * zs)))
    for mode in ("cloud", "edge"):
        result = client.generate(PUBLIC, PRIVATE, mode=mode, policy=Undefended(space="logit"), alpha=0.5,
                                 max_new_tokens=LOGIT_STEPS)
        assert result.token_ids == expected, mode


def test_budget_fallback_never_picks_a_token_the_cloud_left_out(client, engine) -> None:
    """Edge-side, once the budget is spent the cloud's own top token is sent; in logit space omitted ids
    were filled with 0, above every negative logit, so the old argmax over the sparse row could pick one."""
    for space in ("prob", "logit"):
        decoder = client.decoder(PUBLIC, PRIVATE, mode="edge", policy=Undefended(space=space), alpha=0.5,
                                 max_new_tokens=4, exposure_budget=0.0)
        connection = CloudConnection(InProcessChannel(engine.session("tests")))
        list(decoder.steps(connection))
        transcript = engine.transcript(connection.info.session_id)
        for step in transcript["steps"]:  # exposure[0] is the cloud's own argmax
            assert step["token_id"] == step["exposure"][0], space


def test_non_finite_logits_are_refused_on_both_ends(slm, engine) -> None:
    from edge_sdk.protocol import wire
    from edge_sdk.fusion import NonFiniteError

    class NaNAfterPrefill:
        """The SLM, except that its second row holds a NaN."""

        def __init__(self, inner) -> None:
            self.inner = inner
            self.name, self.vocab_size, self.eos_token_ids = inner.name, inner.vocab_size, inner.eos_token_ids

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def append(self, token_id: int) -> np.ndarray:
            row = self.inner.append(token_id)
            row[17] = np.nan
            return row

    client = EdgeClient(lambda: engine.session("tests"), slm=NaNAfterPrefill(slm))
    with pytest.raises(NonFiniteError, match="SLM's logits.*id 17"):
        client.generate(PUBLIC, PRIVATE, mode="edge", policy=Undefended(), max_new_tokens=3)
    assert engine.active_sessions == 0

    # a distribution with an infinity never reaches a policy: the edge ends the session with DATA_LOSS
    message = wire.encode_distribution(wire.CloudDistribution(step=0, dense=np.array([0.5, np.inf], np.float32)))
    with pytest.raises(ValueError, match="non-finite"):
        wire.decode_distribution(message.distribution, 2)
    # the cloud refuses an upload holding NaN
    handler = engine.session("tests")
    request = client.decoder(PUBLIC, PRIVATE, mode="cloud", policy=Undefended()).request()
    list(handler.handle(wire.encode_open(request)))
    bad = CloudUpload(np.array([1, 2]), np.array([0.5, np.nan], np.float32))
    with pytest.raises(CloudError, match="finite"):
        list(handler.handle(wire.encode_upload(0, bad)))
    handler.abandon("error")
