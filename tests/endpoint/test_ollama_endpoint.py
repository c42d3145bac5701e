"""The device's Ollama routes through the real ``ollama`` client, in front of a real cloud adapter on loopback.

What the cloud received is read back from the adapter's transcripts (``tests/support/endpoint_stack.py``); each
answer is compared with the SDK's generation from the same prompts.  Generations are a few tokens long.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from edge_sdk.policies import CoVeil
from edge_sdk.prompts import chat_prompts, plain_prompts

from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, QUESTION, Cloud, Endpoint, generate_as_the_endpoint

pytestmark = pytest.mark.model

TOKENS = 4
MESSAGES = [{"role": "user", "content": QUESTION}]


def client(endpoint: Endpoint) -> ollama.Client:
    return ollama.Client(host=endpoint.base_url, timeout=120)


def transcripts(cloud: Cloud) -> list[dict]:
    files = sorted(cloud.transcript_dir.glob("*.json"), key=lambda path: path.stat().st_mtime_ns)
    return [json.loads(path.read_text()) for path in files]


def refused(call, *args, **kwargs) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as caught:
        call(*args, **kwargs)
    assert CANARY not in str(caught.value)  # errors name the problem, never quote the text
    return caught.value


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_chat_whole_and_streamed_answers_what_the_sdk_decodes(endpoint: Endpoint, cloud: Cloud, mode: str) -> None:
    options = {"num_predict": TOKENS, "coveil": {"private_context": PRIVATE_CONTEXT, "mode": mode,
                                                 "policy": "coveil", "params": {"lam": 1.0}}}
    whole = client(endpoint).chat(model="coveil", messages=MESSAGES, options=options)
    seen = transcripts(cloud)[-1]
    prompts = chat_prompts(endpoint.template, MESSAGES, PRIVATE_CONTEXT)
    direct, shown = generate_as_the_endpoint(endpoint, prompts, mode=mode, policy=CoVeil(lam=1.0),
                                             max_new_tokens=TOKENS)
    assert whole.message.role == "assistant" and whole.message.content == shown
    assert whole.done and whole.done_reason == ("length" if direct.finish_reason == "max_new_tokens" else "stop")
    assert whole.eval_count == len(direct.token_ids) and whole.prompt_eval_count == len(prompts.slm_ids)
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    # the cloud read the public conversation in the model's prompt format, nothing private
    assert seen["mode"] == mode and seen["prompt_ids"] == endpoint.template.render(MESSAGES)
    assert CANARY not in endpoint.client.slm.detokenize(seen["prompt_ids"]) and CANARY not in json.dumps(seen)

    parts = list(client(endpoint).chat(model="coveil:latest", messages=MESSAGES, options=options, stream=True))
    assert "".join(part.message.content for part in parts) == shown
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == len(direct.token_ids)


def test_each_ndjson_line_says_what_the_cloud_saw_and_the_last_the_ledger(endpoint: Endpoint) -> None:
    """The ``ollama`` client drops fields it does not know; the lines themselves carry ``coveil``."""
    body = {"model": "coveil", "messages": MESSAGES, "stream": True,
            "options": {"num_predict": TOKENS, "coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}}
    with httpx.stream("POST", endpoint.base_url + "/api/chat", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    steps = [line["coveil"]["step"] for line in lines[:-1]]
    assert len(steps) + lines[-1]["coveil"]["cut_steps"] == lines[-1]["eval_count"] == lines[-1]["coveil"]["steps"]
    assert {step["saw"] for step in steps} <= {"token", "full"} and lines[-1]["coveil"]["mode"] == "edge"


def test_generate_reads_the_prompt_as_the_users_message_or_raw(endpoint: Endpoint, cloud: Cloud) -> None:
    options = {"num_predict": 3, "coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}
    answered = client(endpoint).generate(model="coveil", prompt=QUESTION, options=options)
    seen = transcripts(cloud)[-1]
    chatted = client(endpoint).chat(model="coveil", messages=MESSAGES, options=options)
    assert answered.response == chatted.message.content and answered.done
    assert seen["prompt_ids"] == endpoint.template.render(MESSAGES)
    # raw: the prompt completed as it is, the cloud reading the prompt alone
    prompt = "The organ that makes bile is the"
    raw = client(endpoint).generate(model="coveil", prompt=prompt, raw=True, options=options)
    seen = transcripts(cloud)[-1]
    direct = endpoint.client.generate(prompt, PRIVATE_CONTEXT, mode="edge", policy=CoVeil(), max_new_tokens=3)
    assert raw.response == direct.text
    assert seen["prompt_ids"] == list(plain_prompts(endpoint.client.slm, prompt).cloud_ids)
    streamed = list(client(endpoint).generate(model="coveil", prompt=prompt, raw=True, options=options,
                                              stream=True))
    assert "".join(part.response for part in streamed) == direct.text
    # an empty prompt is Ollama's "load the model": done at once, nothing generated
    loaded = client(endpoint).generate(model="coveil", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_version_tags_and_show_describe_the_served_model(endpoint: Endpoint) -> None:
    listed = client(endpoint).list().models
    assert [model.model for model in listed] == ["coveil:latest"]
    assert listed[0].size == endpoint.client.slm.source.gguf_path.stat().st_size
    assert listed[0].details.family == "gemma3"
    shown = client(endpoint).show("coveil")
    assert shown.modelinfo["gemma3.context_length"] == endpoint.client.slm.n_ctx == 512
    assert shown.capabilities == ["completion", "embedding", "tools"]
    assert httpx.get(endpoint.base_url + "/api/version").json()["version"].count(".") == 2
    assert refused(client(endpoint).show, "llama3").status_code == 404


def test_unknown_markers_options_and_fields_are_refused_never_sent(endpoint: Endpoint, cloud: Cloud) -> None:
    sessions = len(transcripts(cloud))
    secret = [{"role": "user", "content": PRIVATE_CONTEXT}, *MESSAGES]
    # the private part misplaced at the options' top level, or misspelt inside coveil
    error = refused(client(endpoint).chat, model="coveil", messages=MESSAGES,
                    options={"private_context": PRIVATE_CONTEXT})
    assert error.status_code == 400 and "options.private_context" in error.error
    error = refused(client(endpoint).chat, model="coveil", messages=MESSAGES,
                    options={"coveil": {"private_contxt": PRIVATE_CONTEXT}})
    assert error.status_code == 400 and "options.coveil.private_contxt" in error.error
    # a marker the endpoint does not know, on a message (sent past the client, which drops unknown fields)
    body = {"model": "coveil", "stream": False, "messages": [{**secret[0], "private": True}, MESSAGES[0]]}
    response = httpx.post(endpoint.base_url + "/api/chat", json=body, timeout=60)
    assert response.status_code == 400 and "messages.0.private: unknown field" in response.json()["error"]
    assert CANARY not in response.text
    # sampling options that would reshape the fused distribution, images, thinking, another model
    assert "options.top_k" in refused(client(endpoint).chat, model="coveil", messages=MESSAGES,
                                      options={"top_k": 40}).error
    assert "messages.0.images" in refused(client(endpoint).chat, model="coveil",
                                          messages=[{**MESSAGES[0], "images": ["aGk="]}]).error
    assert "think" in refused(client(endpoint).chat, model="coveil", messages=MESSAGES, think=True).error
    for ask, param in (({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, None)):
        for raw in (False, True):
            error = refused(client(endpoint).generate, model="coveil", prompt=QUESTION, raw=raw, **ask)
            named = param or ("logprobs" if raw else "top_logprobs")  # a raw prompt's count is the completion's
            assert error.status_code == 400 and f"{named} is not supported" in error.error
    assert refused(client(endpoint).chat, model="llama3", messages=MESSAGES).status_code == 404
    assert len(transcripts(cloud)) == sessions  # none of these opened a cloud session


def test_a_message_marked_private_over_raw_http_conditions_only_the_slm(endpoint: Endpoint, cloud: Cloud) -> None:
    """The Ollama routes take ``coveil_private`` on a message like the OpenAI routes (from a client that sends it;
    the ``ollama`` Python client drops unknown message fields, so through it the private part goes in
    ``options["coveil"]``)."""
    marked = {"model": "coveil", "stream": False, "options": {"num_predict": 3, "coveil": {"mode": "edge"}},
              "messages": [{"role": "user", "content": PRIVATE_CONTEXT, "coveil_private": True}, *MESSAGES]}
    by_message = httpx.post(endpoint.base_url + "/api/chat", json=marked, timeout=120).json()
    seen = transcripts(cloud)[-1]
    by_option = client(endpoint).chat(model="coveil", messages=MESSAGES, options={
        "num_predict": 3, "coveil": {"mode": "edge", "private_context": PRIVATE_CONTEXT}})
    assert by_message["message"]["content"] == by_option.message.content
    assert by_message["prompt_eval_count"] == by_option.prompt_eval_count
    assert seen["prompt_ids"] == endpoint.template.render(MESSAGES) and CANARY not in json.dumps(seen)


def test_options_stop_seed_and_temperature_reach_the_generation(endpoint: Endpoint, cloud: Cloud) -> None:
    """``stop`` ends the reply before the stop string; ``seed`` and ``temperature`` are the cloud's sampling seed
    and temperature in cloud-side fusion (the same seed, the same sample; the transcript says the temperature)."""
    options = {"num_predict": 8, "coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}
    free = client(endpoint).chat(model="coveil", messages=MESSAGES, options=options).message.content
    word = free.split()[-1]
    stopped = client(endpoint).chat(model="coveil", messages=MESSAGES, options={**options, "stop": [word]})
    assert stopped.message.content == free[: free.index(word)] and stopped.done_reason == "stop"

    sampled = {"num_predict": 8, "temperature": 1.5, "coveil": {"private_context": PRIVATE_CONTEXT,
                                                                 "mode": "cloud"}}
    first = client(endpoint).chat(model="coveil", messages=MESSAGES, options={**sampled, "seed": 7})
    assert transcripts(cloud)[-1]["temperature"] == 1.5
    again = client(endpoint).chat(model="coveil", messages=MESSAGES, options={**sampled, "seed": 7})
    assert first.message.content == again.message.content
    others = {client(endpoint).chat(model="coveil", messages=MESSAGES, options={**sampled, "seed": seed}).message.content
              for seed in (8, 9, 10)}
    assert others != {first.message.content}  # another seed, another sample (three alike would be no seed at all)


def test_a_whole_reply_carries_the_ledger_in_headers_the_ollama_client_cannot_drop(endpoint: Endpoint) -> None:
    body = {"model": "coveil", "messages": MESSAGES, "stream": False,
            "options": {"num_predict": TOKENS, "coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}}
    response = httpx.post(endpoint.base_url + "/api/chat", json=body, timeout=120)
    ledger = response.json()["coveil"]
    assert response.headers["x-coveil-summary"] == ledger["summary"].encode("ascii", "replace").decode()
    assert int(response.headers["x-coveil-bytes-up"]) == ledger["bytes_up"] > 0
    assert int(response.headers["x-coveil-bytes-down"]) == ledger["bytes_down"] > 0
    assert int(response.headers["x-coveil-values-uploaded"]) == ledger["values_uploaded"]
    assert response.headers["x-coveil-mode"] == "edge" and float(response.headers["x-coveil-leakage-meter"]) == \
        pytest.approx(ledger["leakage_meter"], abs=1e-4)
