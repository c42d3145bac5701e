"""``/v1/messages`` through the real ``anthropic`` client, in front of a real cloud adapter on loopback.

What the cloud received is read back from the adapter's transcripts; each answer is compared with the SDK's
generation from the same prompts.  Generations are a few tokens long.
"""

from __future__ import annotations

import json

import anthropic
import httpx
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
SYSTEM = "Answer briefly."


def client(endpoint: Endpoint) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=120)


def coveil(mode: str) -> dict:
    return {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": mode, "policy": "coveil", "params": {"lam": 1.0}}}


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_messages_whole_and_streamed_answer_what_the_sdk_decodes(endpoint: Endpoint, cloud: Cloud, mode: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    reply = client(endpoint).messages.create(model="coveil", max_tokens=TOKENS, system=SYSTEM, messages=messages,
                                             extra_body=coveil(mode))
    seen = cloud.transcripts()[-1]
    conversation = [{"role": "system", "content": SYSTEM}, *messages]
    prompts = chat_prompts(endpoint.template, conversation, PRIVATE_CONTEXT)
    direct, shown = generate_as_the_endpoint(endpoint, prompts, mode=mode, policy=CoVeil(lam=1.0),
                                             max_new_tokens=TOKENS)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == shown
    assert reply.stop_reason == ("max_tokens" if direct.finish_reason == "max_new_tokens" else "end_turn")
    assert reply.usage.input_tokens == len(prompts.slm_ids) and reply.usage.output_tokens == len(direct.token_ids)
    assert reply.model_extra["coveil"]["steps"] == len(direct.token_ids)
    # the system message went to the cloud: the response says so, and how to keep it on the device
    assert len(reply.model_extra["coveil"]["notes"]) == 1 and "system message" in reply.model_extra["coveil"]["notes"][0]
    # the cloud read the public conversation (the system message too) in the model's format, nothing private
    assert seen["prompt_ids"] == endpoint.template.render(conversation) and CANARY not in json.dumps(seen)

    with client(endpoint).messages.stream(model="coveil", max_tokens=TOKENS, system=SYSTEM, messages=messages,
                                          extra_body=coveil(mode)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == shown and final.content[0].text == shown
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == len(direct.token_ids)


def test_a_text_block_marked_private_conditions_only_the_slm(endpoint: Endpoint, cloud: Cloud) -> None:
    content = [{"type": "text", "text": PRIVATE_CONTEXT, "coveil_private": True}, {"type": "text", "text": QUESTION}]
    reply = client(endpoint).messages.create(model="coveil", max_tokens=2,
                                             messages=[{"role": "user", "content": content}],
                                             system=[{"type": "text", "text": "Be brief.", "coveil_private": True}])
    seen = cloud.transcripts()[-1]
    assert reply.model_extra["coveil"]["notes"] == []  # the system block was private: nothing to say
    assert seen["prompt_ids"] == endpoint.template.render([{"role": "user", "content": QUESTION}])
    assert CANARY not in json.dumps(seen) and CANARY not in endpoint.client.slm.detokenize(seen["prompt_ids"])


def test_a_stop_sequence_ends_the_reply_and_is_named(endpoint: Endpoint) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    free = client(endpoint).messages.create(model="coveil", max_tokens=8, messages=messages, extra_body=coveil("edge"))
    text = free.content[0].text
    assert len(text) >= 3, "the model's reply is too short to cut"
    stop = text[2]
    cut = client(endpoint).messages.create(model="coveil", max_tokens=8, messages=messages, stop_sequences=[stop],
                                           extra_body=coveil("edge"))
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x",
                                                                               "media_type": "image/png"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": CANARY, "private": True}]}]}, "private"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"top_k": 5}, "top_k"),
    ({"tools": [{"name": "x", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"},
      "unknown_tool_field": 1}, "unknown_tool_field"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "strictness": 1}]}, "strictness"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {"$ref": "#/nowhere"}}], "tool_choice": {"type": "any"}}, "tools"),
], ids=["image", "unknown marker", "too many stops", "top_k", "unknown field", "max_tokens", "unknown tool field",
        "unknown tool", "schema that cannot compile"])
def test_bad_requests_are_anthropic_errors_naming_the_field_and_reach_no_cloud(
        endpoint: Endpoint, cloud: Cloud, body: dict, where: str) -> None:
    before = len(cloud.transcripts())
    request = {"model": "coveil", "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}], **body}
    response = httpx.post(endpoint.base_url + "/v1/messages", json=request, timeout=60)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert where in error["error"]["message"] and CANARY not in error["error"]["message"]
    extra = {name: value for name, value in request.items() if name not in ("model", "max_tokens", "messages")}
    with pytest.raises(anthropic.BadRequestError):
        client(endpoint).messages.create(model="coveil", max_tokens=request["max_tokens"],
                                         messages=request["messages"], extra_body=extra)
    assert len(cloud.transcripts()) == before


def test_an_unknown_model_is_a_not_found_error(endpoint: Endpoint) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(endpoint).messages.create(model="claude-opus", max_tokens=2,
                                         messages=[{"role": "user", "content": QUESTION}])
    assert caught.value.body["error"]["type"] == "not_found_error"


ORGAN_TOOL = {"name": "organ_info", "description": "Facts about an organ",
              "input_schema": {"type": "object", "properties": {"organ": {"enum": ["liver", "heart", "lung"]}},
                               "required": ["organ"], "additionalProperties": False}}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                 "required": ["city"], "additionalProperties": False}}


def tools_shown(tools: list[dict]) -> list:
    """The tools as the chat request's (the cloud's system message shows them so)."""
    from edge_sdk.server.tools import Tool

    return [Tool.model_validate({"type": "function", "function": {
        "name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}})
        for tool in tools]


@pytest.mark.parametrize("mode, route", TOOL_MODE_AND_ROUTE)
def test_tools_are_tool_use_blocks_whole_and_streamed(endpoint: Endpoint, cloud: Cloud, mode: str,
                                                      route: str) -> None:
    """Whole: ``tool_choice`` any, a call of either tool, and the cloud read the tools (they are public) as the
    first system message, nothing private; streamed: the tool named."""
    import jsonschema

    from edge_sdk.server.tools import instruction

    messages = [{"role": "user", "content": QUESTION}]
    if route == "whole":
        reply = client(endpoint).messages.create(model="coveil", max_tokens=40, messages=messages,
                                                 tools=[WEATHER_TOOL, ORGAN_TOOL], tool_choice={"type": "any"},
                                                 extra_body=coveil(mode))
        assert reply.stop_reason == "tool_use" and [block.type for block in reply.content] == ["tool_use"]
        call = reply.content[0]
        assert call.id.startswith("toolu_") and call.name in ("get_weather", "organ_info")
        jsonschema.validate(call.input, (ORGAN_TOOL if call.name == "organ_info" else WEATHER_TOOL)["input_schema"])
        seen = cloud.transcripts()[-1]
        assert seen["prompt_ids"] == endpoint.template.render(
            [{"role": "system", "content": instruction(tools_shown([WEATHER_TOOL, ORGAN_TOOL]), False)}, *messages])
        assert CANARY not in json.dumps(seen)
        return

    with client(endpoint).messages.stream(model="coveil", max_tokens=40, messages=messages,
                                          tools=[WEATHER_TOOL, ORGAN_TOOL],
                                          tool_choice={"type": "tool", "name": "organ_info"},
                                          extra_body=coveil(mode)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [block.type for block in final.content] == ["tool_use"]
    assert final.content[0].name == "organ_info"
    jsonschema.validate(final.content[0].input, ORGAN_TOOL["input_schema"])
    assert final.usage.output_tokens > 0


def test_tool_use_and_tool_result_blocks_join_the_conversation_public_unless_marked(endpoint: Endpoint,
                                                                                   cloud: Cloud) -> None:
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "organ_info",
                                                   "input": {"organ": "liver"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": f"{CANARY}'s liver is enlarged", "coveil_private": True},
                                             {"type": "text", "text": "So which organ?"}]}]
    client(endpoint).messages.create(model="coveil", max_tokens=2, messages=messages, extra_body=coveil("edge"))
    seen = cloud.transcripts()[-1]
    expected = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": '{"name":"organ_info","arguments":{"organ":"liver"}}'},
                {"role": "user", "content": "So which organ?"}]
    assert seen["prompt_ids"] == endpoint.template.render(expected) and CANARY not in json.dumps(seen)

