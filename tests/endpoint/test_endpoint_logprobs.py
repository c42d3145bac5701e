"""Log-probabilities and the other app-facing options of issue 23 over the real endpoint, in front of a real cloud
adapter, read by the ``openai`` and ``ollama`` clients: each token's log-probability under the fused row it was
chosen from (edge-side computed on the device, cloud-side sent by the cloud), ``seed``, ``max_completion_tokens``
and a ``tool_choice`` that names no tool."""

from __future__ import annotations

import math
import time

import numpy as np
import ollama
import openai
import pytest

from edge_sdk.fusion import softmax
from edge_sdk.prompts import chat_prompts
from tests.support.endpoint_stack import PRIVATE_CONTEXT, QUESTION, Cloud, Endpoint
from tests.endpoint.test_structured_output import transcripts

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": QUESTION}]


def api(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def options(mode: str, policy: str = "coveil") -> dict:
    return {"coveil": {"private_context": PRIVATE_CONTEXT, "mode": mode, "policy": policy}}


def next_transcript(cloud: Cloud, before: int) -> dict:
    """The transcript of the session that ends after ``before`` were on disk (the adapter writes it as the session
    ends, which may come just after the reply)."""
    deadline = time.monotonic() + 30
    while len(seen := transcripts(cloud)) <= before:
        assert time.monotonic() < deadline, "the session's transcript was never written"
        time.sleep(0.05)
    return seen[-1]


def check_entries(entries, top_n: int, *, greedy: bool) -> None:
    """Log-probabilities: at most 0, alternatives by decreasing value, their probabilities summing to at most 1;
    the chosen token is the row's best when the policy takes the fused argmax (``greedy``)."""
    for entry in entries:
        alternatives = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and len(alternatives) == top_n
        assert alternatives == sorted(alternatives, reverse=True) and sum(map(math.exp, alternatives)) <= 1 + 1e-5
        assert entry.logprob <= alternatives[0] + 1e-6
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        if greedy:
            assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(alternatives[0])


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_chat_logprobs_whole_and_streamed(endpoint: Endpoint, cloud: Cloud, mode: str) -> None:
    client = api(endpoint)
    before = len(transcripts(cloud))
    whole = client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=4, logprobs=True,
                                           top_logprobs=3, extra_body=options(mode, "undefended"))
    entries = whole.choices[0].logprobs.content
    ledger = whole.model_extra["coveil"]  # a token a stop string cut has no entry: the reply does not show it
    assert len(entries) + ledger["cut_steps"] == whole.usage.completion_tokens == ledger["steps"]
    check_entries(entries, 3, greedy=True)
    assert whole.choices[0].message.content.startswith("".join(e.token for e in entries)[:1])
    seen = next_transcript(cloud, before)
    assert seen["logprobs"] == (mode == "cloud") and seen["top_logprobs"] == (3 if mode == "cloud" else 0)
    stream = client.chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=4, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body=options(mode))
    streamed = [c.choices[0].logprobs.content[0] for c in stream if c.choices and c.choices[0].logprobs]
    assert 0 < len(streamed) <= 4
    check_entries(streamed, 2, greedy=False)  # CoVeil picks among the top K by its objective


def test_edge_side_logprobs_are_the_fused_row_of_both_models(endpoint: Endpoint, gemma_llm) -> None:
    """Step 0, undefended edge-side at alpha 0.3, against the row computed here from both models independently:
    the SLM's llama.cpp logits (a fresh prefill) and the cloud model's transformers logits, each softmaxed and
    fused, ``log(0.3 * p_llm + 0.7 * p_slm)`` (the edge decides from the cloud's top 256 values, the rest at the
    public fill: at the fused row's top that differs from the exact row by far less than the tolerance)."""
    from edge_sdk.backends.llama_cpp import LlamaCppSLM

    reply = api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, max_tokens=1, logprobs=True,
                                                  top_logprobs=5, extra_body=options("edge", "undefended"))
    prompts = chat_prompts(endpoint.template, MESSAGES, PRIVATE_CONTEXT)
    reference_slm = LlamaCppSLM(n_ctx=512, n_threads=1)
    p_slm = softmax(reference_slm.prefill(list(prompts.slm_ids))[: reference_slm.vocab_size]).astype(np.float64)
    seq = gemma_llm.open(list(prompts.cloud_ids))
    p_llm = softmax(np.asarray(seq.next_logits, dtype=np.float32)).astype(np.float64)
    expected = np.log(0.3 * p_llm + 0.7 * p_slm)
    best = np.argsort(-expected, kind="stable")[:5]
    got = reply.choices[0].logprobs.content[0]
    assert [bytes(t.bytes) for t in got.top_logprobs] == [reference_slm.token_pieces()[i] for i in best]
    assert [t.logprob for t in got.top_logprobs] == pytest.approx(expected[best], abs=2e-3)


def test_completion_logprobs_in_the_legacy_shape(endpoint: Endpoint) -> None:
    reply = api(endpoint).completions.create(model="coveil", prompt="The organ that makes bile is the", max_tokens=4,
                                             logprobs=2, extra_body=options("cloud", "undefended"))
    legacy = reply.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == reply.usage.completion_tokens
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(legacy.tokens))]
    for token, logprob, alternatives in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs, strict=True):
        assert len(alternatives) == 2 and logprob == pytest.approx(max(alternatives.values()))
        assert alternatives[token] == pytest.approx(logprob)


@pytest.mark.parametrize("mode", ["edge", "cloud"])
def test_ollama_logprobs(endpoint: Endpoint, mode: str) -> None:
    client = ollama.Client(host=endpoint.base_url, timeout=120)
    reply = client.chat(model="coveil", messages=MESSAGES, logprobs=True, top_logprobs=2,
                        options={"num_predict": 6, **options(mode, "undefended")})
    # eval_count counts every decoded token; a token a stop string cut from the reply has no entry
    assert 0 < len(reply.logprobs) <= reply.eval_count
    for entry in reply.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    parts = list(client.generate(model="coveil", prompt="The organ that makes bile is the", raw=True, stream=True,
                                 logprobs=True, options={"num_predict": 4, **options(mode)}))
    assert sum(len(part.logprobs or []) for part in parts) == parts[-1].eval_count


def test_more_than_twenty_alternatives_is_a_400(endpoint: Endpoint) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert caught.value.body["param"] == "top_logprobs" and "at most 20" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        api(endpoint).completions.create(model="coveil", prompt="q", logprobs=21)
    assert caught.value.body["param"] == "logprobs"


def test_seed_is_the_clouds_sampling_seed_cloud_side(endpoint: Endpoint, cloud: Cloud) -> None:
    """The same seed, the same sample; the cloud's transcript holds the seed and temperature it sampled with."""
    ask = dict(model="coveil", messages=MESSAGES, max_tokens=8, temperature=1.5, extra_body=options("cloud"))
    before = len(transcripts(cloud))
    first = api(endpoint).chat.completions.create(seed=7, **ask).choices[0].message.content
    seen = next_transcript(cloud, before)
    assert (seen["seed"], seen["temperature"]) == (7, 1.5)
    assert api(endpoint).chat.completions.create(seed=7, **ask).choices[0].message.content == first
    others = {api(endpoint).chat.completions.create(seed=seed, **ask).choices[0].message.content for seed in (8, 9)}
    assert others != {first}


def test_max_completion_tokens_caps_the_reply_over_max_tokens(endpoint: Endpoint) -> None:
    reply = api(endpoint).chat.completions.create(
        model="coveil", messages=[{"role": "user", "content": "Describe the liver at length."}], max_tokens=30,
        max_completion_tokens=3, extra_body=options("edge"))
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_a_tool_choice_naming_no_tool_is_a_400_that_says_why(endpoint: Endpoint) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        api(endpoint).chat.completions.create(model="coveil", messages=MESSAGES, tools=[tool],
                                              tool_choice={"type": "function", "function": {"name": "g"}})
    assert caught.value.body["param"] == "tool_choice" and "not in tools" in caught.value.body["message"]


def test_stop_ends_the_reply_before_the_stop_string_whole_and_streamed_with_usage(endpoint: Endpoint) -> None:
    ask = dict(model="coveil", messages=[{"role": "user", "content": "Describe the liver in two sentences."}],
               max_tokens=16, extra_body=options("edge"))
    free = api(endpoint).chat.completions.create(**ask).choices[0].message.content
    word = free.split()[2]  # a word well inside the reply
    stopped = api(endpoint).chat.completions.create(stop=[word], **ask)
    assert stopped.choices[0].message.content == free[: free.index(word)]
    assert stopped.choices[0].finish_reason == "stop"
    chunks = list(api(endpoint).chat.completions.create(stop=[word], stream=True,
                                                        stream_options={"include_usage": True}, **ask))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == free[: free.index(word)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == stopped.usage.completion_tokens
