"""``/v1/responses`` (stateless) through the real ``openai`` client's ``responses`` API, in front of a real cloud
adapter on loopback.  Each answer is compared with the SDK's generation from the same prompts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from edge_sdk.policies import CoVeil
from edge_sdk.prompts import chat_prompts

from tests.support.endpoint_stack import (
    CANARY,
    PRIVATE_CONTEXT,
    QUESTION,
    TOOL_MODE_AND_ROUTE,
    Cloud,
    Endpoint,
    generate_as_the_endpoint,
)

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
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "strictness": 1}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "missing"}},
     "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
], ids=["previous_response_id", "store", "conversation", "image", "unknown marker", "include", "too long",
        "unknown tool field", "unknown function", "built-in tool"])
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


ORGAN_FUNCTION = {"type": "function", "name": "organ_info", "description": "Facts about an organ",
                  "parameters": {"type": "object", "properties": {"organ": {"enum": ["liver", "heart", "lung"]}},
                                 "required": ["organ"], "additionalProperties": False}}
WEATHER_FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                   "required": ["city"], "additionalProperties": False}}


@pytest.mark.parametrize("mode, route", TOOL_MODE_AND_ROUTE)
def test_function_tools_are_function_call_items_whole_and_streamed(endpoint: Endpoint, cloud: Cloud,
                                                                   mode: str, route: str) -> None:
    """Whole: ``tool_choice`` required, a call of either function, and the cloud read the functions (they are
    public) as the first system message; streamed: the function named, as the stream's events."""
    import jsonschema

    from edge_sdk.server.tools import Tool, instruction

    functions = [WEATHER_FUNCTION, ORGAN_FUNCTION]
    if route == "whole":
        reply = api(endpoint).responses.create(model="coveil", input=QUESTION, tools=functions,
                                               tool_choice="required", max_output_tokens=40, extra_body=coveil(mode))
        assert [item.type for item in reply.output] == ["function_call"] and reply.status == "completed"
        call = reply.output[0]
        schema = (ORGAN_FUNCTION if call.name == "organ_info" else WEATHER_FUNCTION)["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)
        shown = [Tool.model_validate({"type": "function", "function": {
            key: value for key, value in function.items() if key != "type"}}) for function in functions]
        seen = cloud.transcripts()[-1]
        assert seen["prompt_ids"] == endpoint.template.render(
            [{"role": "system", "content": instruction(shown, False)}, {"role": "user", "content": QUESTION}])
        return

    events = list(api(endpoint).responses.create(model="coveil", input=QUESTION, tools=functions,
                                                 tool_choice={"type": "function", "name": "organ_info"},
                                                 max_output_tokens=40, stream=True, extra_body=coveil(mode)))
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = events[4]
    jsonschema.validate(json.loads(done.arguments), ORGAN_FUNCTION["parameters"])
    final = events[-1].response
    assert final.output[0].type == "function_call" and final.output[0].name == "organ_info"
    assert final.output[0].arguments == done.arguments and final.model_extra["coveil"]["steps"] > 0


def test_function_call_items_join_the_conversation_public_unless_marked(endpoint: Endpoint, cloud: Cloud) -> None:
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": "call_1", "name": "organ_info", "arguments": '{"organ":"liver"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": f"{CANARY}'s liver is enlarged",
              "coveil_private": True},
             {"role": "user", "content": "So which organ?"}]
    api(endpoint).responses.create(model="coveil", input=items, max_output_tokens=2, extra_body=coveil("edge"))
    seen = cloud.transcripts()[-1]
    expected = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": '{"name":"organ_info","arguments":{"organ":"liver"}}'},
                {"role": "user", "content": "So which organ?"}]
    assert seen["prompt_ids"] == endpoint.template.render(expected) and CANARY not in json.dumps(seen)

