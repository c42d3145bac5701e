"""Echo with logprobs on ``/v1/completions`` (what lm-eval's loglikelihood tasks send), over the real endpoint in
front of a real cloud adapter: the real ``lm_eval`` ``local-completions`` model scores hand-made requests, each
prompt token's log-probability is the fusion of the cloud's row (one prefill of the public prompt) and the SLM's
row after the private context, and only the public prompt reaches the cloud."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch

from edge_sdk.protocol import wire
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.prompts import CONTEXT_SEPARATOR
from tests.endpoint.test_endpoint_logprobs import next_transcript
from tests.endpoint.test_structured_output import transcripts
from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, Cloud, Endpoint, start_endpoint

pytestmark = pytest.mark.model

ALPHA = DecodeSettings.alpha  # the endpoint's default fusion weight (coveil's policy fuses in probability space)
CONTEXT = "The capital of France is"
CONTINUATIONS = (" Paris", " a banana")


@pytest.fixture(scope="module")
def endpoint(cloud: Cloud, slm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    """lm-eval sends no ``coveil`` field: the endpoint's default mode is edge-side fusion for this run."""
    with start_endpoint(cloud.address, slm, tmp_path_factory.mktemp("endpoint"), default_mode="edge") as started:
        yield started


def reference_logprob(gemma_llm, slm, prefix: list[int], ids: list[int], position: int) -> float:
    """``log(alpha * p_llm + (1 - alpha) * p_slm)`` of ``ids[position]`` by hand: the cloud model's softmax over
    a plain transformers forward of ``[BOS] + ids``, the SLM's after ``prefix`` and ``ids[:position]`` (both rows sum to
    1, so the fused row does too, up to the sparse row's public fill)."""
    bos = slm.tokenize("", add_bos=True)
    with torch.inference_mode():
        logits = gemma_llm.model(input_ids=torch.tensor([bos + ids])).logits[0, len(bos) - 1 + position]
    p_llm = torch.softmax(logits.double()[: slm.vocab_size], dim=0).numpy()
    z = slm.prefill(prefix)  # then token by token, as a generation's SLM steps (llama.cpp's batch kernels differ)
    for token in ids[:position]:
        z = slm.append(token)
    z = z.astype(np.float64)
    p_slm = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    token = ids[position]
    return float(np.log(ALPHA * p_llm[token] + (1 - ALPHA) * p_slm[token]))


def test_lm_eval_scores_loglikelihood_requests(endpoint: Endpoint, cloud: Cloud, gemma_llm, slm,
                                               served_tokenizer_dir) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # lm-eval tokenises with the served model's tokenizer
    model = LocalCompletionsAPI(base_url=endpoint.base_url + "/v1/completions", model="coveil",
                                tokenizer=str(served_tokenizer_dir), tokenizer_backend="huggingface", max_retries=1,
                                num_concurrent=1, timeout=300)
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=(CONTEXT, continuation), idx=i)
                for i, continuation in enumerate(CONTINUATIONS)]
    before = len(transcripts(cloud))
    scores = model.loglikelihood(requests)
    assert len(scores) == 2
    bos = slm.tokenize("", add_bos=True)
    for (logprob, _greedy), continuation in zip(scores, CONTINUATIONS):
        context_ids = slm.tokenize(CONTEXT, add_bos=False)
        ids = context_ids + slm.tokenize(continuation, add_bos=False)
        expected = sum(reference_logprob(gemma_llm, slm, bos, ids, position)
                       for position in range(len(context_ids), len(ids)))
        assert logprob == pytest.approx(expected, abs=2e-3)
    assert scores[0][0] > scores[1][0]  # Paris over a banana, under the fused distribution
    seen = next_transcript(cloud, before)
    assert seen["mode"] == "edge"


def test_echo_scores_the_public_prompt_after_the_private_context(endpoint: Endpoint, cloud: Cloud, gemma_llm,
                                                                 slm) -> None:
    """The request lm-eval sends, with a private context: the prompt's tokens are scored with the SLM reading the
    private context first; the cloud's session holds the public prompt alone."""
    client = openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ids = slm.tokenize(CONTEXT + CONTINUATIONS[0], add_bos=False)
    before = len(transcripts(cloud))
    reply = client.completions.create(model="coveil", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                      temperature=0, extra_body={"coveil": {"private_context": PRIVATE_CONTEXT}})
    legacy = reply.choices[0].logprobs
    assert len(legacy.token_logprobs) == len(ids) + 1  # each prompt token, then the generated one
    assert reply.choices[0].text.startswith(CONTEXT + CONTINUATIONS[0])
    prefix = slm.tokenize(PRIVATE_CONTEXT + CONTEXT_SEPARATOR, add_bos=True)
    for position in range(len(ids)):
        assert legacy.token_logprobs[position] == pytest.approx(
            reference_logprob(gemma_llm, slm, prefix, ids, position), abs=2e-3)
        assert len(legacy.top_logprobs[position]) == 1
    seen = next_transcript(cloud, before)
    sent = json.dumps(seen)
    assert CANARY not in sent and "jaundice" not in sent
    assert seen["prompt_ids"] == slm.tokenize("", add_bos=True) + ids  # the public prompt, nothing else


def test_echo_with_logprobs_cloud_side_is_refused_and_nothing_is_sent(endpoint: Endpoint, cloud: Cloud) -> None:
    client = openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = len(transcripts(cloud))
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="coveil", prompt=CONTEXT, echo=True, logprobs=1, max_tokens=1,
                                  extra_body={"coveil": {"mode": "cloud"}})
    error = refused.value.body
    assert error["param"] == "echo" and "edge-side fusion only" in error["message"]
    assert len(transcripts(cloud)) == before  # refused before any session opened
    echoed = client.completions.create(model="coveil", prompt=CONTEXT, echo=True, max_tokens=2)
    assert echoed.choices[0].text.startswith(CONTEXT) and echoed.choices[0].logprobs is None


def test_an_adapter_that_predates_prompt_rows_is_named() -> None:
    """An older adapter ignores ``score_prompt`` (an unknown field) and opens with no rows: the edge says so."""
    from edge_sdk.client import EdgeClient
    from edge_sdk.protocol.status import CloudError
    from edge_sdk.testing import ScriptedCloud, TableSLM

    opened = wire.pb().SessionOpened(session_id="s", vocab_size=4, max_new_tokens=4)
    assert wire.decode_opened(opened).prompt_rows == ()  # what an older adapter's opening reads as
    slm = TableSLM(["<eos>", " the", " liver", "."], {}, eos_ids={0})
    client = EdgeClient(ScriptedCloud(4, eos_ids={0}).session, slm=slm)
    decoder = client.decoder(" the liver.", mode="edge", policy="undefended", max_new_tokens=1, prompt_prefix=[])
    with pytest.raises(CloudError, match="predates echo with logprobs"):
        list(client.run(decoder).steps())
