"""One public end-of-generation set, agreed when the session opens, under both sides' JSON grammars.

llama.cpp counts id 212 (``</s>``) as an end of generation; transformers reads it as text.  Each side compiled the
schema's grammar over its own end set, so the cloud could pick 212 inside a JSON string where the edge's grammar
forbids it: a 502 ``DATA_LOSS`` said to come from the adapter.  Now both compile over the session's end set (the
cloud's ends and the edge's), and an edge check that fails says it was the edge's.
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from edge_sdk.grammar import JsonConstraint
from edge_sdk.server.errors import from_cloud_error
from edge_sdk.protocol.status import CloudError, CloudReplyRejected

from tests.support.endpoint_stack import PRIVATE_CONTEXT, Cloud, Endpoint, start_endpoint

pytestmark = pytest.mark.model

END_TEXT_ID = 212  # "</s>"
ANY_TAG = {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 8}}, "required": ["tag"],
           "additionalProperties": False}
COPIED_TAG = {"type": "object", "properties": {"tag": {"const": "</s>"}}, "required": ["tag"],
              "additionalProperties": False}


def advanced(constraint: JsonConstraint, tokens: list[int]) -> JsonConstraint:
    for token in tokens:
        constraint.consume(token)
    return constraint


def test_the_two_vocabularies_disagree_on_id_212(slm, gemma_llm) -> None:
    """The case itself: an end to llama.cpp, text to transformers, and the cloud's own grammar lets it into a
    string where the edge's does not."""
    assert END_TEXT_ID in slm.eos_token_ids and END_TEXT_ID not in gemma_llm.eos_token_ids
    inside = slm.tokenize('{"tag":"', add_bos=False)
    assert advanced(JsonConstraint(gemma_llm, ANY_TAG), inside).allowed()[END_TEXT_ID]
    assert not advanced(JsonConstraint(slm, ANY_TAG), inside).allowed()[END_TEXT_ID]


def test_over_the_agreed_set_both_grammars_allow_the_same_ids_and_end_only_when_complete(slm, gemma_llm) -> None:
    agreed = slm.eos_token_ids | gemma_llm.eos_token_ids
    inside = slm.tokenize('{"tag":"', add_bos=False)
    edge = advanced(JsonConstraint(slm, ANY_TAG, end_ids=agreed), inside)
    cloud = advanced(JsonConstraint(gemma_llm, ANY_TAG, end_ids=agreed), inside)
    assert not cloud.allowed()[END_TEXT_ID]
    assert np.array_equal(edge.allowed(), cloud.allowed())
    rest = slm.tokenize('ab"}', add_bos=False)
    edge, cloud = advanced(edge, rest), advanced(cloud, rest)
    ends = np.flatnonzero(edge.allowed())
    assert set(ends) == set(agreed) and np.array_equal(edge.allowed(), cloud.allowed())


def test_agreeing_late_replays_what_was_consumed(slm, gemma_llm) -> None:
    """The edge builds its grammar before the session opens; it follows the agreed set from the open on."""
    agreed = slm.eos_token_ids | gemma_llm.eos_token_ids | {2}
    inside = slm.tokenize('{"tag":"a', add_bos=False)
    late = advanced(JsonConstraint(slm, ANY_TAG), inside)
    late.agree_end_ids(agreed)
    assert np.array_equal(late.allowed(), advanced(JsonConstraint(slm, ANY_TAG, end_ids=agreed), inside).allowed())


def test_an_edge_check_that_fails_says_the_edge_ended_the_session() -> None:
    mine = from_cloud_error(CloudReplyRejected("the cloud chose token 212, outside the JSON schema's grammar"))
    theirs = from_cloud_error(CloudError("DATA_LOSS", "anything the adapter says"))
    assert mine.code == "cloud_reply_rejected" and mine.message.startswith("the edge ended the session")
    assert "212" in mine.message
    assert theirs.code == "cloud_error" and "the cloud adapter ended the session" in theirs.message
    assert "anything" not in theirs.message


@pytest.fixture(scope="module")
def lockstep(cloud: Cloud, slm, tmp_path_factory: pytest.TempPathFactory):
    with start_endpoint(cloud.address, slm, tmp_path_factory.mktemp("lockstep"), lookahead=0) as started:
        yield started


def half_factorial() -> list:
    """Every schema x mode x lookahead, with log-probabilities asked for in half of them, chosen so that each two
    of the four factors still meet in all four combinations (logprobs = the parity of the other three: a 2^(4-1)
    design), at half the generations of the full 16."""
    cases = []
    for schema, schema_id in ((ANY_TAG, "any tag"), (COPIED_TAG, "copies </s>")):
        for mode in ("cloud", "edge"):
            for lookahead in ("run-ahead", "lockstep"):
                logprobs = ((schema is COPIED_TAG) + (mode == "edge") + (lookahead == "lockstep")) % 2 == 1
                cases.append(pytest.param(schema, logprobs, mode, lookahead, id="-".join(
                    (schema_id, "logprobs" if logprobs else "no logprobs", mode, lookahead))))
    return cases


@pytest.mark.parametrize("schema, logprobs, mode, lookahead", half_factorial())
def test_a_reply_under_a_schema_ends_as_both_sides_agree(endpoint: Endpoint, lockstep: Endpoint, schema: dict,
                                                         logprobs: bool, mode: str, lookahead: str) -> None:
    served = endpoint if lookahead == "run-ahead" else lockstep
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="coveil", max_tokens=24, logprobs=logprobs, top_logprobs=2 if logprobs else None,
        messages=[{"role": "user", "content": "Write the closing tag </s> as JSON: {\"tag\": \"</s>\"}"}],
        response_format={"type": "json_schema", "json_schema": {"name": "tag", "schema": schema}},
        extra_body={"coveil": {"private_context": PRIVATE_CONTEXT, "mode": mode}})
    document = json.loads(reply.choices[0].message.content)
    assert set(document) == {"tag"} and reply.choices[0].finish_reason == "stop"
    if schema is COPIED_TAG:
        assert document == {"tag": "</s>"}
    assert (reply.choices[0].logprobs is not None) == logprobs
