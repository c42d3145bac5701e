"""``/v1/responses`` (stateless) through the real ``openai`` client's ``responses`` API, in front of a real cloud
adapter on loopback.  Each answer is compared with the SDK's generation from the same prompts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from edge_sdk.policies import CoVeil
from edge_sdk.prompts import chat_prompts

from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, QUESTION, Cloud, Endpoint, generate_as_the_endpoint

pytestmark = pytest.mark.model

TOKENS = 4
INSTRUCTIONS = "Answer briefly."
#: the events of a streamed response, in order (deltas: one per decided token)
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def api(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def coveil(mode: str) -> dict:
    return {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": mode, "policy": "coveil", "params": {"lam": 1.0}}}


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_a_response_whole_and_streamed_answers_what_the_sdk_decodes(endpoint: Endpoint, cloud: Cloud,
                                                                    mode: str) -> None:
    response = api(endpoint).responses.create(model="coveil", instructions=INSTRUCTIONS, input=QUESTION,
                                              max_output_tokens=TOKENS, store=False, extra_body=coveil(mode))
    seen = cloud.transcripts()[-1]
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    prompts = chat_prompts(endpoint.template, conversation, PRIVATE_CONTEXT)
    direct, shown = generate_as_the_endpoint(endpoint, prompts, mode=mode, policy=CoVeil(lam=1.0),
                                             max_new_tokens=TOKENS)
    finished = direct.finish_reason == "max_new_tokens"
    assert response.object == "response" and response.output_text == shown
    assert response.status == ("incomplete" if finished else "completed")
    assert (response.incomplete_details.reason if finished else response.incomplete_details) == \
        ("max_output_tokens" if finished else None)
    assert response.usage.input_tokens == len(prompts.slm_ids) and response.usage.output_tokens == len(direct.token_ids)
    assert response.store is False and response.model_extra["coveil"]["steps"] == len(direct.token_ids)
    assert seen["prompt_ids"] == endpoint.template.render(conversation) and CANARY not in json.dumps(seen)

    events = list(api(endpoint).responses.create(model="coveil", instructions=INSTRUCTIONS, input=QUESTION,
                                                 max_output_tokens=TOKENS, stream=True, extra_body=coveil(mode)))
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == [*OPENING, *["response.output_text.delta"] * len(deltas), *CLOSING, f"response.{response.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in deltas) == shown
    assert events[-1].response.output_text == shown and events[-1].response.model_extra["coveil"]["steps"] > 0
    steps = [event.model_extra["coveil"] for event in deltas if "coveil" in event.model_extra]  # one per token
    assert len(steps) == len(direct.token_ids) and all(step["saw"] in ("nothing", "token", "upload", "full")
                                                       for step in steps)


def test_input_items_with_a_private_part_and_logprobs(endpoint: Endpoint, cloud: Cloud) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": PRIVATE_CONTEXT, "coveil_private": True},
                                          {"type": "input_text", "text": QUESTION}]}]
    response = api(endpoint).responses.create(model="coveil", input=items, max_output_tokens=3,
                                              include=["message.output_text.logprobs"], top_logprobs=2,
                                              extra_body={"coveil": {"mode": "edge"}})
    seen = cloud.transcripts()[-1]
    assert seen["prompt_ids"] == endpoint.template.render([{"role": "user", "content": QUESTION}])
    assert CANARY not in json.dumps(seen)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens and all(len(entry.top_logprobs) == 2 for entry in logprobs)
    assert all(entry.logprob <= 0 for entry in logprobs)


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": CANARY, "private": True}]}, "input"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"max_output_tokens": 100000}, "input"),  # the conversation and the reply past the context window
], ids=["previous_response_id", "store", "conversation", "image", "unknown marker", "include", "too long"])
def test_what_a_stateless_endpoint_cannot_honour_is_refused_naming_the_field(
        endpoint: Endpoint, cloud: Cloud, body: dict, param: str) -> None:
    before = len(cloud.transcripts())
    request = {"model": "coveil", "input": QUESTION, "max_output_tokens": 2, **body}
    response = httpx.post(endpoint.base_url + "/v1/responses", json=request, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"].startswith(param) and CANARY not in error["message"]
    extra = {name: value for name, value in request.items() if name not in ("model", "input")}
    with pytest.raises(openai.BadRequestError):
        api(endpoint).responses.create(model="coveil", input=request["input"], extra_body=extra)
    assert len(cloud.transcripts()) == before
