"""The device's OpenAI endpoint through the unmodified ``openai`` client, in front of a real cloud adapter.

What the cloud received is read back from the adapter's transcripts on disk; what both servers logged is
captured from their loggers (``tests/support/endpoint_stack.py``).  Generations are a few tokens long.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import urllib.parse
from pathlib import Path

import openai
import pytest

from edge_sdk.policies import CoVeil, Undefended
from edge_sdk.prompts import chat_prompts, plain_prompts
from edge_sdk.protocol.connection import CloudConnection
from edge_sdk.protocol.channels import GrpcChannel

from tests.support.endpoint_stack import (
    CANARY,
    PRIVATE_CONTEXT,
    QUESTION,
    SESSIONS_PER_CLIENT,
    TOKEN,
    Cloud,
    Endpoint,
    LogCapture,
    generate_as_the_endpoint,
    start_endpoint,
)

pytestmark = pytest.mark.model

TOKENS = 4
MESSAGES = [{"role": "user", "content": QUESTION}]


def api(endpoint: Endpoint, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def transcripts(cloud: Cloud) -> list[dict]:
    """Every finished session's transcript, oldest first."""
    files = sorted(cloud.transcript_dir.glob("*.json"), key=lambda path: path.stat().st_mtime_ns)
    return [json.loads(path.read_text()) for path in files]


def raw_request(base_url: str, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """One HTTP request outside the openai client (to send what it never would)."""
    parsed = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if payload.startswith(b"{") else {"raw": payload.decode()}
    finally:
        connection.close()


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_chat_completions_whole_and_streamed_in_both_fusion_modes(endpoint: Endpoint, cloud: Cloud, mode: str) -> None:
    client = api(endpoint)
    options = {"private_context": PRIVATE_CONTEXT, "mode": mode, "policy": "coveil", "params": {"lam": 1.0}}
    whole = client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=TOKENS,
                                           extra_body={"coveil": options})
    # the endpoint returns what the SDK decodes from the chat-templated prompts
    prompts = chat_prompts(endpoint.template, MESSAGES, PRIVATE_CONTEXT)
    direct, shown = generate_as_the_endpoint(endpoint, prompts, mode=mode, policy=CoVeil(lam=1.0),
                                             max_new_tokens=TOKENS)
    assert whole.choices[0].message.content == shown
    assert whole.choices[0].finish_reason == ("length" if direct.finish_reason == "max_new_tokens" else "stop")
    ledger = whole.model_extra["coveil"]
    assert ledger["mode"] == mode and ledger["policy"] == "coveil(lam=1.0, k=50)"
    assert ledger["steps"] == whole.usage.completion_tokens == len(direct.token_ids)
    assert whole.usage.prompt_tokens == len(prompts.slm_ids) > ledger["cloud_prompt_tokens"] == len(prompts.cloud_ids)
    assert ledger["bytes_up"] > 0 and ledger["bytes_down"] > 0 and 0.0 <= ledger["leakage_meter"] <= 1.0

    # what the cloud received: exactly the public conversation in the model's chat template, nothing private
    seen = transcripts(cloud)[-2]  # the endpoint's session (the direct generation's came last)
    assert seen["mode"] == mode
    assert seen["prompt_ids"] == list(prompts.cloud_ids) == endpoint.template.render(MESSAGES)
    assert CANARY not in endpoint.client.slm.detokenize(seen["prompt_ids"]) and CANARY not in json.dumps(seen)

    stream = client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"coveil": options})
    chunks = list(stream)
    steps = [c.model_extra["coveil"]["step"] for c in chunks if (c.model_extra.get("coveil") or {}).get("step")]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    cut = last.model_extra["coveil"]["ledger"]["cut_steps"]  # tokens a stop string cut: neither shown nor streamed
    assert text == shown and len(steps) == len(direct.token_ids) - cut
    assert [s["token_id"] for s in steps] == direct.token_ids[: len(steps)]
    # edge-side the cloud sees each synchronised token; cloud-side an upload (or nothing), never a token
    allowed = {"token", "full"} if mode == "edge" else {"upload", "nothing", "full"}
    assert {s["saw"] for s in steps} <= allowed
    assert last.model_extra["coveil"]["ledger"]["steps"] == len(steps) + cut
    assert chunks[-1].usage.completion_tokens == len(steps) + cut and chunks[-1].choices == []


def test_the_embedded_base_model_answers_the_question_instead_of_repeating_it(endpoint: Endpoint) -> None:
    """In Gemma's chat template (the embedded GGUF has none) the base model repeated the private context and the
    question; asked in the question-and-answer form it answers in a few words ("The heart." in cloud-side
    CoVeil, whose cloud never reads the context; the SLM alone says "liver"), and the reply ends at the next
    question."""
    reply = api(endpoint).chat.completions.create(
        model="coveil", messages=MESSAGES, max_tokens=24,
        extra_body={"coveil": {"private_context": PRIVATE_CONTEXT, "mode": "cloud"}})
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and 0 < len(text.strip()) < 40, text
    for repeated in ("Question", "organ is affected", "jaundice", CANARY, "<start_of_turn>"):
        assert repeated not in text, text


def test_a_baseline_by_name_uploads_what_it_is_defined_to(endpoint: Endpoint, cloud: Cloud) -> None:
    """Undefended cloud-side fusion uploads the SLM's whole distribution cut to its 1,000 largest values at every
    step (a public size: listing every id would show masked ones, cutting only under a mask would say so)."""
    reply = api(endpoint).chat.completions.create(
        model="coveil", messages=MESSAGES, max_tokens=2,
        extra_body={"coveil": {"private_context": PRIVATE_CONTEXT, "mode": "cloud", "policy": "undefended"}})
    ledger = reply.model_extra["coveil"]
    assert ledger["policy"] == Undefended().describe()
    assert ledger["values_uploaded"] == reply.usage.completion_tokens * 1000
    seen = transcripts(cloud)[-1]
    assert [step["upload_size"] for step in seen["steps"]] == [1000] * reply.usage.completion_tokens
    assert CANARY not in json.dumps(seen)


def test_the_coveil_field_says_what_a_dp_generation_spent_and_when_its_budget_withheld(endpoint: Endpoint) -> None:
    """Edge-side DP-Fusion at eps = 1 per token (order 2, delta 1e-5) spends 2 + 10.13 in two tokens and 13.13 in
    three (hand: 11.51 - 2 log 2 the improved conversion): under max_epsilon 12.5 the third step is withheld, in
    the whole response and the last chunk."""
    options = {"private_context": PRIVATE_CONTEXT, "mode": "edge", "policy": "dp_fusion", "params": {"epsilon": 1.0},
               "max_epsilon": 12.5}
    client = api(endpoint)
    whole = client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=4,
                                           extra_body={"coveil": options})
    stream = list(client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=4, stream=True,
                                                 extra_body={"coveil": options}))
    last = [c for c in stream if c.choices and c.choices[0].finish_reason][-1].model_extra["coveil"]["ledger"]
    for ledger in (whole.model_extra["coveil"], last):
        privacy = ledger["privacy"]
        assert privacy["guarantee"] == "dp" and privacy["events"] == 2 and privacy["withheld_from"] == 2
        assert privacy["epsilon_spent"] == pytest.approx(2.0 + 11.512925464970229 - 2 * math.log(2.0))
        assert privacy["relation"] == "any two private contexts" and privacy["in_words"].startswith("whoever sees")
        assert ledger["withheld_steps"] == ledger["steps"] - 2


def test_text_completions_whole_and_streamed(endpoint: Endpoint, cloud: Cloud) -> None:
    client = api(endpoint)
    prompt = "The organ that makes bile is the"
    options = {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": "edge"}}
    whole = client.completions.create(model="coveil", prompt=prompt, max_tokens=3, extra_body=options)
    seen = transcripts(cloud)[-1]
    direct = endpoint.client.generate(prompt, PRIVATE_CONTEXT, mode="edge", policy=CoVeil(), max_new_tokens=3)
    assert whole.choices[0].text == direct.text and whole.model_extra["coveil"]["mode"] == "edge"
    assert seen["prompt_ids"] == list(plain_prompts(endpoint.client.slm, prompt).cloud_ids)
    streamed = list(client.completions.create(model="coveil", prompt=prompt, max_tokens=3, stream=True,
                                              extra_body=options))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct.text
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


def test_a_message_marked_private_conditions_only_the_slm(endpoint: Endpoint, cloud: Cloud) -> None:
    """A message with ``coveil_private`` reaches the SLM as private context: the same prompts, the same answer,
    as passing its text in ``coveil.private_context``; the cloud's prompt is the rest of the conversation."""
    client = api(endpoint)
    marked = [{"role": "user", "content": PRIVATE_CONTEXT, "coveil_private": True}, *MESSAGES]
    by_message = client.chat.completions.create(model="coveil", messages=marked, max_tokens=3,
                                                extra_body={"coveil": {"mode": "edge"}})
    seen = transcripts(cloud)[-1]
    by_field = client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=3,
                                              extra_body={"coveil": {"mode": "edge",
                                                                     "private_context": PRIVATE_CONTEXT}})
    assert by_message.choices[0].message.content == by_field.choices[0].message.content
    assert by_message.usage.prompt_tokens == by_field.usage.prompt_tokens
    assert seen["prompt_ids"] == endpoint.template.render(MESSAGES) and CANARY not in json.dumps(seen)
    # one text part of the question marked private: the same, and the cloud's prompt is the question alone
    parts = [{"role": "user", "content": [{"type": "text", "text": PRIVATE_CONTEXT, "coveil_private": True},
                                          {"type": "text", "text": QUESTION}]}]
    by_part = client.chat.completions.create(model="coveil", messages=parts, max_tokens=3,
                                             extra_body={"coveil": {"mode": "edge"}})
    seen = transcripts(cloud)[-1]
    assert by_part.choices[0].message.content == by_field.choices[0].message.content
    assert by_part.usage.prompt_tokens == by_field.usage.prompt_tokens
    assert seen["prompt_ids"] == endpoint.template.render(MESSAGES) and CANARY not in json.dumps(seen)
    assert CANARY not in endpoint.client.slm.detokenize(seen["prompt_ids"])


def test_bad_requests_get_openai_errors(endpoint: Endpoint) -> None:
    client = api(endpoint)

    def refused(error: type[openai.APIStatusError], **kwargs) -> dict:
        kwargs = {"model": "coveil", "messages": MESSAGES, "max_tokens": 2, **kwargs}
        with pytest.raises(error) as caught:
            client.chat.completions.create(**kwargs)
        assert CANARY not in json.dumps(caught.value.body)  # errors name the problem, never quote the text
        return caught.value.body

    assert refused(openai.BadRequestError, n=2)["param"] == "n"
    assert "did you mean 'coveil'" in refused(openai.BadRequestError,
                                              extra_body={"coveil": {"policy": "coveill"}})["message"]
    assert refused(openai.BadRequestError, extra_body={"coveil": {"mode": "middle",
                                                                  "private_context": PRIVATE_CONTEXT}})["param"] \
        == "coveil.mode"
    assert refused(openai.BadRequestError, extra_body={"coveil": {"params": {"lamb": 1}}})["param"] == "coveil.params"
    assert "never_upload[0] is empty or does not occur" in refused(openai.BadRequestError, extra_body={
        "coveil": {"private_context": PRIVATE_CONTEXT, "never_upload": ["Dr. Wu"]}})["message"]
    assert refused(openai.BadRequestError, temperature=7,
                   extra_body={"coveil": {"private_context": PRIVATE_CONTEXT}})["param"] == "temperature"
    assert refused(openai.BadRequestError, messages=[{"role": "assistant", "content": "x",
                                                      "function_call": {"name": "f", "arguments": "{}"}}])
    assert refused(openai.NotFoundError, model="gpt-4o")["code"] == "model_not_found"
    too_long = refused(openai.BadRequestError, extra_body={"coveil": {"private_context": PRIVATE_CONTEXT * 40}})
    assert too_long["code"] == "context_length_exceeded" and "maximum context length is 512" in too_long["message"]
    # a body that is not JSON, past the openai client
    status, body = raw_request(endpoint.base_url, "POST", "/v1/chat/completions", b"{not json",
                               {"Content-Type": "application/json"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_an_unreachable_cloud_is_503_whole_or_streamed(slm, tmp_path: Path, server_logs: LogCapture) -> None:
    from cloud_adapter.local import free_loopback_port

    dead = f"127.0.0.1:{free_loopback_port()}"  # nothing listens there
    with start_endpoint(dead, slm, tmp_path, max_reconnects=0) as endpoint:
        client = api(endpoint)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=2, stream=stream,
                                               extra_body={"coveil": {"private_context": PRIVATE_CONTEXT}})
            assert caught.value.status_code == 503 and caught.value.body["code"] == "cloud_unavailable"


def test_the_cloud_quota_is_429(endpoint: Endpoint, cloud: Cloud) -> None:
    """The adapter allows this device SESSIONS_PER_CLIENT sessions; with all of them held, a request is refused
    with 429 insufficient_quota, and served again once they close."""
    import grpc

    channel = grpc.insecure_channel(cloud.address)
    held = []
    request = endpoint.client.decoder("public text only", max_new_tokens=4).request()
    for _ in range(SESSIONS_PER_CLIENT):
        connection = CloudConnection(GrpcChannel(channel, metadata=(("authorization", f"Bearer {TOKEN}"),)))
        connection.open(request)
        held.append(connection)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=2)
        assert caught.value.body["type"] == "insufficient_quota"
        assert caught.value.body["code"] == "cloud_quota_exhausted"
    finally:
        for connection in held:
            connection.close()
        channel.close()
    assert api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=1).choices


def test_the_api_key_and_the_loopback_host_guard(cloud: Cloud, slm, tmp_path: Path) -> None:
    with start_endpoint(cloud.address, slm, tmp_path, api_key="s3cret") as endpoint:
        with pytest.raises(openai.AuthenticationError) as caught:
            api(endpoint, key="wrong").models.list()
        assert caught.value.body["code"] == "invalid_api_key"
        assert [m.id for m in api(endpoint, key="s3cret").models.list()] == ["coveil"]
        # every path needs the key, /health included: it tells when the device is busy and whether the cloud is up
        assert raw_request(endpoint.base_url, "GET", "/health")[0] == 401
        assert raw_request(endpoint.base_url, "GET", "/health", headers={"Authorization": "Bearer s3cret"})[0] == 200
        # a page elsewhere reaching 127.0.0.1 through DNS rebinding names its own host
        status, body = raw_request(endpoint.base_url, "GET", "/v1/models",
                                   headers={"Host": "attacker.example", "Authorization": "Bearer s3cret"})
        assert status == 403 and body["error"]["code"] == "host_not_allowed"


def test_concurrent_requests_queue_for_the_one_slm(endpoint: Endpoint) -> None:
    """Three requests at once: each gets exactly its own answer (the one it gets alone), the later ones after
    waiting their turn."""
    client = api(endpoint)
    contexts = [PRIVATE_CONTEXT, "The patient's kidneys are failing.", "The patient has a cough and pneumonia."]

    def ask(context: str) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=2,
                                              extra_body={"coveil": {"private_context": context, "mode": "edge"}})

    alone = [ask(context).choices[0].message.content for context in contexts]
    replies: dict[int, openai.types.chat.ChatCompletion] = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, ask(contexts[i]))) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [replies[i].choices[0].message.content for i in range(3)] == alone
    waited = sorted(replies[i].model_extra["coveil"]["queue_ms"] for i in range(3))
    assert waited[-1] > 50.0  # the last in line waited for at least one whole generation


def test_the_private_context_is_in_no_log_line_nor_transcript(endpoint: Endpoint, cloud: Cloud,
                                                               server_logs: LogCapture) -> None:
    """Everything the endpoint and the adapter logged in this module (the tests above, when they ran first), and
    at least one whole and one streamed request of each fusion mode made here, so the test stands alone."""
    client = api(endpoint)
    for mode in ("cloud", "edge"):
        options = {"private_context": PRIVATE_CONTEXT, "mode": mode}
        client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=TOKENS,
                                       extra_body={"coveil": options})
        for _ in client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=TOKENS, stream=True,
                                                extra_body={"coveil": options}):
            pass
    assert "request chatcmpl-" in server_logs.text and "POST /v1/chat/completions" in server_logs.text
    for secret in (CANARY, "bilirubin", "jaundice", "kidneys are failing"):
        assert secret not in server_logs.text
    # the transcripts hold token ids: decode what the cloud was given as its prompt, and look for the private
    # context's own ids in it (searching the JSON for text found nothing even when the whole private prompt went)
    slm = endpoint.client.slm
    private_ids = slm.tokenize(PRIVATE_CONTEXT, add_bos=False)
    seen = transcripts(cloud)
    assert len(seen) >= 4
    for transcript in seen:
        prompt_ids = transcript["prompt_ids"]
        assert CANARY not in slm.detokenize(prompt_ids) and "bilirubin" not in slm.detokenize(prompt_ids)
        windows = {tuple(prompt_ids[i : i + 8]) for i in range(len(prompt_ids) - 7)}
        assert not windows & {tuple(private_ids[i : i + 8]) for i in range(len(private_ids) - 7)}
        assert CANARY not in json.dumps(transcript)
