"""Structured output through the endpoint (``response_format`` on the OpenAI routes, ``format`` on Ollama's), in
front of a real cloud adapter: every reply parses and validates against its schema (``jsonschema``, an
independent validator), in both modes: edge-side the edge masks where it picks the token, cloud-side the cloud
(the schema sent with the session, compiled over the cloud model's token bytes).
"""

from __future__ import annotations

import json

import jsonschema
import ollama
import openai
import pytest

from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, QUESTION, Cloud, Endpoint

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": QUESTION + " Reply in JSON."}]
SCHEMAS = {
    "enum and boolean": {"type": "object", "properties": {"organ": {"type": "string",
                                                                    "enum": ["liver", "heart", "lung"]},
                                                          "sure": {"type": "boolean"}},
                         "required": ["organ", "sure"], "additionalProperties": False},
    "short string": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
                     "required": ["answer"], "additionalProperties": False},
    # a space the grammar must see as a space (the tokenizer's raw entries spell it "\u2581")
    "two words": {"type": "object", "properties": {"words": {"type": "string",
                                                             "pattern": "^[a-z]{1,10} [a-z]{1,10}$"}},
                  "required": ["words"], "additionalProperties": False},
    "array of enums": {"type": "object", "properties": {"organs": {
        "type": "array", "items": {"enum": ["liver", "kidney", "skin"]}, "minItems": 1, "maxItems": 2}},
        "required": ["organs"], "additionalProperties": False},
}
EDGE = {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}
CLOUD = {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": "cloud"}}


def api(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def transcripts(cloud: Cloud) -> list[dict]:
    files = sorted(cloud.transcript_dir.glob("*.json"), key=lambda path: path.stat().st_mtime_ns)
    return [json.loads(path.read_text()) for path in files]


#: the second route each schema x mode case asks besides the whole OpenAI reply: each schema goes through all three
#: routes (one mode each), each route under each mode with two schemas; the grammar is the route's and mode's alike
SECOND_ROUTE = {("enum and boolean", "edge"): "streamed", ("enum and boolean", "cloud"): "ollama",
                ("short string", "edge"): "ollama", ("short string", "cloud"): "streamed",
                ("two words", "edge"): "streamed", ("two words", "cloud"): "ollama",
                ("array of enums", "edge"): "ollama", ("array of enums", "cloud"): "streamed"}


@pytest.mark.parametrize("mode", ["edge", "cloud"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_each_reply_parses_and_validates_whole_and_streamed(endpoint: Endpoint, cloud: Cloud, name: str,
                                                            mode: str) -> None:
    """The whole OpenAI reply for every schema in both modes, then the case's :data:`SECOND_ROUTE` (the OpenAI
    stream, or Ollama's ``format``)."""
    schema = SCHEMAS[name]
    options = EDGE if mode == "edge" else CLOUD
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    whole = api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=40,
                                                  response_format=response_format, extra_body=options)
    seen = transcripts(cloud)[-1]
    assert whole.choices[0].finish_reason == "stop"  # the document ended itself, before the token limit
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    assert whole.model_extra["coveil"]["mode"] == mode and whole.model_extra["coveil"]["full_requests"] == 0
    assert seen["prompt_ids"] == endpoint.template.render(MESSAGES) and CANARY not in json.dumps(seen)
    if SECOND_ROUTE[name, mode] == "streamed":
        chunks = list(api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=40,
                                                            stream=True, response_format=response_format,
                                                            extra_body=options))
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        jsonschema.validate(json.loads(streamed), schema)
    else:  # Ollama's format: the schema itself
        reply = ollama.Client(host=endpoint.base_url, timeout=120).chat(
            model="coveil", messages=MESSAGES, format=schema, options={"num_predict": 40, **options})
        assert reply.done_reason == "stop"
        jsonschema.validate(json.loads(reply.message.content), schema)


def test_json_object_mode_replies_with_an_object(endpoint: Endpoint) -> None:
    """An object of unbounded size: the base model keeps adding keys (at 60 tokens it had not closed its object
    either, edge- or cloud-side), so the reply is the opening of an object, a whole one if it ends first."""
    reply = api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=12,
                                                  response_format={"type": "json_object"}, extra_body=EDGE)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")
    raw = ollama.Client(host=endpoint.base_url, timeout=120).generate(
        model="coveil", prompt="The organ that makes bile, as JSON:", raw=True, format="json",
        options={"num_predict": 12, **EDGE})
    assert raw.response.lstrip().startswith("{")


@pytest.mark.parametrize("options", [EDGE, CLOUD], ids=["edge", "cloud"])
def test_a_schema_that_cannot_compile_is_a_400(endpoint: Endpoint, cloud: Cloud, options: dict) -> None:
    sessions = len(transcripts(cloud))
    for schema in ({"type": "strin"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}):
        with pytest.raises(openai.BadRequestError) as caught:
            api(endpoint).chat.completions.create(
                model="coveil", messages=MESSAGES, extra_body=options,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert caught.value.body["param"] == "response_format"
        assert "cannot be compiled" in caught.value.body["message"]
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=endpoint.base_url).chat(model="coveil", messages=MESSAGES, format={"type": "strin"},
                                                   options=options)
    assert refused.value.status_code == 400 and "cannot be compiled" in refused.value.error
    assert len(transcripts(cloud)) == sessions  # refused before any cloud session


def test_the_adapter_refuses_a_schema_it_cannot_compile_or_one_for_edge_side_fusion(cloud: Cloud) -> None:
    """INVALID_ARGUMENT before the session is admitted: not JSON, not a schema the engine compiles, longer than
    64 KiB, or a schema (or logprobs) in an edge-side session, where the edge applies them itself."""
    from dataclasses import replace

    from edge_sdk.protocol.status import CloudError
    from edge_sdk.protocol import wire

    engine = cloud.engine
    base = wire.SessionRequest(prompt_ids=(2, 651), mode="cloud", vocab_fingerprint=engine.fingerprint,
                               vocab_size=engine.llm.vocab_size, max_new_tokens=8)
    for changes, says in (({"json_schema": "{not json"}, "not JSON"), ({"json_schema": '{"type": "strin"}'},
                                                                     "cannot be compiled"),
                          ({"mode": "edge", "json_schema": "{}"}, "cloud-side fusion"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"json_schema": json.dumps({"enum": ["x" * 70_000]})}, "longer than")):
        handler = engine.session("refusals")
        with pytest.raises(CloudError, match=says) as caught:
            list(handler.handle(wire.encode_open(replace(base, **changes))))
        assert caught.value.code == "INVALID_ARGUMENT" and handler.session_id is None


def test_what_a_schema_changes_on_the_wire_depends_on_the_schema_alone(endpoint: Endpoint) -> None:
    """The session request under a schema is the same whatever the private context (full rows asked for: top_m is
    the vocabulary), and differs from the free request in top_m only."""
    from dataclasses import replace

    from edge_sdk.prompts import chat_prompts

    schema = SCHEMAS["enum and boolean"]
    requests = [endpoint.client.decoder(chat_prompts(endpoint.template, MESSAGES, context), mode="edge",
                                        json_schema=schema).request()
                for context in (PRIVATE_CONTEXT, "Nothing private here at all, and much longer " * 5)]
    assert requests[0] == requests[1] and requests[0].top_m == endpoint.client.slm.vocab_size
    free = endpoint.client.decoder(chat_prompts(endpoint.template, MESSAGES, PRIVATE_CONTEXT), mode="edge").request()
    assert replace(free, top_m=requests[0].top_m) == requests[0] and free.top_m < requests[0].top_m
    # cloud-side the schema is sent (json_schema) and nothing else changes: the cloud masks where it picks
    cloud_side = endpoint.client.decoder(chat_prompts(endpoint.template, MESSAGES, PRIVATE_CONTEXT), mode="cloud",
                                         json_schema=schema).request()
    free = endpoint.client.decoder(chat_prompts(endpoint.template, MESSAGES, PRIVATE_CONTEXT), mode="cloud").request()
    assert json.loads(cloud_side.json_schema) == schema and replace(cloud_side, json_schema="") == free


def test_the_grammar_reads_each_id_as_the_bytes_it_adds_to_the_text(endpoint: Endpoint) -> None:
    """The pieces of a tokenised text join to that text (a space, a newline, a byte token), where the raw
    tokenizer entries hold "\u2581" for a space and "<0x0A>" for a newline byte."""
    slm = endpoint.client.slm
    text = " The liver\n\tswells: 12 mg/dl. \u00e9t\u00e9"
    pieces = slm.token_pieces()
    ids = slm.tokenize(text, add_bos=False)
    assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")
    assert len(pieces) == slm.vocab_size and pieces[slm.tokenize("\n", add_bos=False)[0]] == b"\n"


def test_the_cloud_reads_each_id_as_the_same_bytes_as_the_edge(endpoint: Endpoint, cloud: Cloud) -> None:
    """Cloud-side the grammar runs over the transformers tokenizer's pieces (read off its decoder): on the embedded
    pair they are llama.cpp's token_to_piece bytes for every one of the 262,144 ids."""
    assert cloud.engine.llm.token_pieces() == endpoint.client.slm.token_pieces()


def test_a_byte_level_tokenizers_pieces_join_to_the_text() -> None:
    """A GPT-2-style byte-level BPE ("Ġthe" for " the", "Ċ" for a newline) read into token bytes."""
    from cloud_adapter.llm import token_pieces
    from tests.support.tiny_models import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    pieces = token_pieces(tokenizer, tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    text = "the liver\nswells: 12 mg/dl. \u00e9t\u00e9"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")


def test_a_spent_exposure_budget_still_answers_within_the_schema(endpoint: Endpoint) -> None:
    """Budget 0: every step sends the cloud's own top token, the best one the schema allows."""
    schema = SCHEMAS["enum and boolean"]
    reply = api(endpoint).chat.completions.create(
        model="coveil", messages=MESSAGES, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"coveil": {**EDGE["coveil"], "exposure_budget": 0.0}})
    ledger = reply.model_extra["coveil"]
    assert ledger["withheld_steps"] == ledger["steps"] > 0 and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_a_schema_whose_mask_step_runs_past_the_cap_is_refused_when_compiled() -> None:
    """The first step's mask is timed when the schema compiles: past ``max_step_ms`` it is refused (here a cap no
    step can meet); llguidance's per-step work limits are set to the same budget for the later steps."""
    pytest.importorskip("llguidance")
    from edge_sdk.grammar import GrammarError, JsonConstraint
    from edge_sdk.testing import TableSLM

    slm = TableSLM(["<eos>", "{", "}", '"a"', ":", "1", " "], eos_ids={0})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with pytest.raises(GrammarError, match="ms for one step, more than"):
        JsonConstraint(slm, schema, max_step_ms=1e-6)
    allowed = JsonConstraint(slm, schema).allowed()  # the default cap: a plain schema compiles
    assert allowed[1] and not allowed[2]
