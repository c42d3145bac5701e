"""Tools through the real ``openai`` and ``ollama`` clients on the embedded model, in front of a real cloud adapter:
the grammar built from the tools' schemas makes every reply a valid call (or, ``auto``, a call or text), checked
with ``jsonschema`` (an independent validator), even where a 270M model's choice is poor."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest

from edge_sdk.server.tools import Tool, instruction

from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, QUESTION, Cloud, Endpoint

pytestmark = pytest.mark.model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ORGAN = {"type": "function", "function": {
    "name": "organ_info", "description": "Facts about an organ",
    "parameters": {"type": "object", "properties": {"organ": {"enum": ["liver", "heart", "lung"]}},
                   "required": ["organ"], "additionalProperties": False}}}
TOOLS = [WEATHER, ORGAN]
MESSAGES = [{"role": "user", "content": QUESTION}]


def api(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def coveil(mode: str) -> dict:
    return {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": mode}}


def check_call(name: str, arguments: dict) -> None:
    tool = next(tool for tool in TOOLS if tool["function"]["name"] == name)
    jsonschema.validate(arguments, tool["function"]["parameters"])


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_required_and_named_choices_are_valid_calls_whole_and_streamed(endpoint: Endpoint, cloud: Cloud,
                                                                       mode: str) -> None:
    reply = api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, tools=TOOLS,
                                                  tool_choice="required", max_tokens=40, extra_body=coveil(mode))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    check_call(call.function.name, json.loads(call.function.arguments))
    # the tools and the reply's shape are public: the cloud read them as the first system message
    seen = cloud.transcripts()[-1]
    shown = [Tool.model_validate(tool) for tool in TOOLS]
    assert seen["prompt_ids"] == endpoint.template.render(
        [{"role": "system", "content": instruction(shown, False)}, *MESSAGES])
    assert CANARY not in json.dumps(seen)

    named = {"type": "function", "function": {"name": "organ_info"}}
    chunks = list(api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, tools=TOOLS,
                                                        tool_choice=named, max_tokens=40, stream=True,
                                                        extra_body=coveil(mode)))
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "organ_info"
    check_call("organ_info", json.loads(calls[0].function.arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    steps = [chunk for chunk in chunks if (chunk.model_extra.get("coveil") or {}).get("step")]
    assert len(steps) == chunks[-1].model_extra["coveil"]["ledger"]["steps"] > 0  # each call token is a step


def test_auto_is_a_call_or_text_and_none_leaves_the_tools_out(endpoint: Endpoint, cloud: Cloud) -> None:
    reply = api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                                  extra_body=coveil("edge"))
    message = reply.choices[0].message
    if message.tool_calls:
        check_call(message.tool_calls[0].function.name, json.loads(message.tool_calls[0].function.arguments))
    else:
        assert isinstance(message.content, str) and reply.choices[0].finish_reason in ("stop", "length")
    api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=2, extra_body=coveil("edge"))
    assert cloud.transcripts()[-1]["prompt_ids"] == endpoint.template.render(MESSAGES)


def test_a_tool_result_joins_the_conversation_public_unless_marked(endpoint: Endpoint, cloud: Cloud) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "organ_info", "arguments": '{"organ":"liver"}'}}
    conversation = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": f"{CANARY}'s liver is enlarged",
                     "coveil_private": True},
                    {"role": "user", "content": "So which organ?"}]
    api(endpoint).chat.completions.create(model="coveil", messages=conversation, max_tokens=2,
                                          extra_body=coveil("edge"))
    seen = cloud.transcripts()[-1]
    expected = [*MESSAGES, {"role": "assistant", "content": '{"name":"organ_info","arguments":{"organ":"liver"}}'},
                {"role": "user", "content": "So which organ?"}]
    assert seen["prompt_ids"] == endpoint.template.render(expected) and CANARY not in json.dumps(seen)


def test_ollama_chat_with_tools_returns_ollama_tool_calls(endpoint: Endpoint) -> None:
    client = ollama.Client(host=endpoint.base_url, timeout=120)
    options = {"num_predict": 40, "coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}
    reply = client.chat(model="coveil", messages=MESSAGES, tools=[ORGAN], options=options)
    if reply.message.tool_calls:
        call = reply.message.tool_calls[0].function
        assert call.name == "organ_info"
        # the ollama client sends a tool's parameters without additionalProperties: that schema is the grammar's
        sent = {key: value for key, value in ORGAN["function"]["parameters"].items() if key != "additionalProperties"}
        jsonschema.validate(dict(call.arguments), sent)
    else:
        assert isinstance(reply.message.content, str)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{**WEATHER, "strictness": 1}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "n": 2}, "n"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
], ids=["unknown field", "schema that cannot compile", "unknown function", "n", "with a response format"])
def test_bad_tool_requests_name_the_field_and_reach_no_cloud(endpoint: Endpoint, cloud: Cloud, fields: dict,
                                                             param: str) -> None:
    before = len(cloud.transcripts())
    body = {"model": "coveil", "messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(endpoint.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(param)
    assert len(cloud.transcripts()) == before
