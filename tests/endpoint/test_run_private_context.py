"""The run's private context (``coveil edge serve --private-context-file``) and the cap on a scored prompt.

An app that cannot send the ``coveil`` field (lm-eval) still decodes with a private context: the endpoint's, read
once at start. A request without one of its own is conditioned on it (the SLM reads it: its scores are those of
the same request sending the text itself), one with its own uses that instead, and the cloud's transcripts and
every log line never hold it. Echo with logprobs makes the cloud hold the prompt's logits whole, so a prompt
longer than ``MAX_SCORED_PROMPT_TOKENS`` is refused on both sides, before anything is sent or computed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cloud_adapter.limits import Limits
from cloud_adapter.validation import validate_request
from edge_sdk.prompts import CONTEXT_SEPARATOR
from edge_sdk.protocol import wire
from edge_sdk.protocol.status import CloudError
from edge_sdk.server.cli import add_serve_parser
from edge_sdk.server.settings import ServerSettings
from tests.endpoint.test_endpoint_echo import CONTEXT, reference_logprob
from tests.endpoint.test_endpoint_logprobs import next_transcript
from tests.endpoint.test_structured_output import transcripts
from tests.support.endpoint_stack import CANARY, PRIVATE_CONTEXT, Cloud, Endpoint, LogCapture, start_endpoint

OTHER_CONTEXT = "The patient reports a sore knee after a fall while skiing."


@pytest.fixture(scope="module")
def endpoint(cloud: Cloud, slm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    """The endpoint as an lm-eval run starts it: edge-side by default, the run's private context from a file."""
    workdir = tmp_path_factory.mktemp("endpoint")
    context_file = workdir / "private.txt"
    context_file.write_text(PRIVATE_CONTEXT + "\n")
    with start_endpoint(cloud.address, slm, workdir, default_mode="edge",
                        private_context_file=context_file) as started:
        yield started


def openai_client(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_request_without_coveil_is_conditioned_on_the_runs_private_context(
        endpoint: Endpoint, cloud: Cloud, gemma_llm, slm, server_logs: LogCapture) -> None:
    client = openai_client(endpoint)
    ids = slm.tokenize(CONTEXT, add_bos=False)
    before = len(transcripts(cloud))
    reply = client.completions.create(model="coveil", prompt=ids, echo=True, logprobs=1, max_tokens=1)
    run_prefix = slm.tokenize(PRIVATE_CONTEXT + CONTEXT_SEPARATOR, add_bos=True)
    assert reply.usage.prompt_tokens == len(run_prefix) + len(ids)  # the SLM read the run's context first
    scored = reply.choices[0].logprobs.token_logprobs
    for position in (1, len(ids) - 1):  # scored by the SLM after the run's context
        assert scored[position] == pytest.approx(reference_logprob(gemma_llm, slm, run_prefix, ids, position),
                                                 abs=2e-3)
    seen = next_transcript(cloud, before)
    assert seen["prompt_ids"] == slm.tokenize("", add_bos=True) + ids
    assert CANARY not in json.dumps(seen) and "jaundice" not in json.dumps(seen)

    # a request's own private context overrides the run's
    before = len(transcripts(cloud))
    own = client.completions.create(model="coveil", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                    extra_body={"coveil": {"private_context": OTHER_CONTEXT}})
    own_prefix = slm.tokenize(OTHER_CONTEXT + CONTEXT_SEPARATOR, add_bos=True)
    assert own.usage.prompt_tokens == len(own_prefix) + len(ids)
    assert own.choices[0].logprobs.token_logprobs[1] == pytest.approx(
        reference_logprob(gemma_llm, slm, own_prefix, ids, 1), abs=2e-3)
    assert own.choices[0].logprobs.token_logprobs[1] != pytest.approx(scored[1], abs=1e-3)
    next_transcript(cloud, before)

    # a chat request without coveil reads it too: its SLM prompt is the one of the request sending the run's text
    def chat_prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="coveil", messages=[{"role": "user", "content": "Which organ?"}],
                                              max_tokens=1, **extra).usage.prompt_tokens

    unmarked = chat_prompt_tokens()
    assert unmarked == chat_prompt_tokens(extra_body={"coveil": {"private_context": PRIVATE_CONTEXT}})
    assert unmarked != chat_prompt_tokens(extra_body={"coveil": {"private_context": OTHER_CONTEXT}})
    assert all(CANARY not in json.dumps(t) for t in transcripts(cloud))
    assert CANARY not in server_logs.text and "jaundice" not in server_logs.text


def test_the_info_route_names_the_runs_private_context_file_but_never_its_text(endpoint: Endpoint) -> None:
    info = httpx.get(endpoint.base_url + "/coveil/info", timeout=30).json()
    assert info["run_private_context"] == {"file": str(endpoint.settings.private_context_file),
                                           "characters": len(PRIVATE_CONTEXT)}  # the file's text, stripped
    assert CANARY not in json.dumps(info) and "jaundice" not in json.dumps(info)


def test_a_scored_prompt_past_the_public_cap_is_refused_and_nothing_is_sent(endpoint: Endpoint, cloud: Cloud,
                                                                            slm) -> None:
    client = openai_client(endpoint)
    ids = (slm.tokenize(" the liver", add_bos=False) * wire.MAX_SCORED_PROMPT_TOKENS)[:wire.MAX_SCORED_PROMPT_TOKENS]
    before = len(transcripts(cloud))
    with pytest.raises(openai.BadRequestError) as refused:  # BOS + 2048 ids: one past the cap
        client.completions.create(model="coveil", prompt=ids, echo=True, logprobs=0, max_tokens=1)
    error = refused.value.body
    assert error["param"] == "prompt" and "at most 2048 tokens" in error["message"]
    assert "2049" in error["message"] and "max_length" in error["message"]
    assert len(transcripts(cloud)) == before


def test_the_cloud_refuses_a_scored_prompt_past_the_cap_before_its_forward() -> None:
    """An edge that skipped its own check meets the cloud's, at validation (before any prefill)."""
    limits, vocab = Limits(), 262_144
    for length, scored in ((2048, True), (2049, False)):  # at the cap; past it but asking for no rows
        request = wire.SessionRequest(prompt_ids=tuple([2] * length), mode="edge", score_prompt=scored)
        assert validate_request(request, vocab_size=vocab, eos_ids={1}, limits=limits) > 0
    request = wire.SessionRequest(prompt_ids=tuple([2] * 2049), mode="edge", score_prompt=True)
    with pytest.raises(CloudError) as error:
        validate_request(request, vocab_size=vocab, eos_ids={1}, limits=limits)
    assert error.value.code == "OUT_OF_RANGE" and "at most 2048 tokens, got 2049" in error.value.message


def settings_with(context_file: Path) -> ServerSettings:
    return ServerSettings(cloud="127.0.0.1:1", plaintext=True, private_context_file=context_file)


def test_the_private_context_file_is_read_once_and_errors_never_quote_it(tmp_path: Path) -> None:
    context_file = tmp_path / "private.txt"
    context_file.write_text(f"  {PRIVATE_CONTEXT}\n")
    settings = settings_with(context_file)
    assert settings.run_private_context() == PRIVATE_CONTEXT
    assert ServerSettings(cloud="127.0.0.1:1", plaintext=True).run_private_context() == ""

    with pytest.raises(ValueError, match="--private-context-file: no such file"):
        settings_with(tmp_path / "missing.txt")
    context_file.write_text(" \n")
    with pytest.raises(ValueError, match="--private-context-file: .* is empty"):
        settings_with(context_file).run_private_context()
    context_file.write_bytes(CANARY.encode() + b"\xff\xfe")
    with pytest.raises(ValueError, match="is not UTF-8 text") as error:
        settings_with(context_file).run_private_context()
    assert CANARY not in str(error.value)


def test_serve_offers_the_flag_with_its_meaning() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    serve = add_serve_parser(parser.add_subparsers())
    text = serve.format_help()
    assert "--private-context-file FILE" in text and "never logged" in text
    args = serve.parse_args(["--cloud", "127.0.0.1:1", "--private-context-file", "ctx.txt"])
    assert args.private_context_file == Path("ctx.txt")


def test_a_prompt_part_marked_private_conditions_the_slm_and_echoing_it_is_refused(endpoint: Endpoint, cloud: Cloud,
                                                                                   slm) -> None:
    """A completion prompt's text part marked ``coveil_private`` joins the private context (before the request's
    own); ``echo`` of such a prompt is a 400 naming the part, before any session opens."""
    client = openai_client(endpoint)
    parts = [{"type": "text", "text": "Notes: " + OTHER_CONTEXT, "coveil_private": True},
             {"type": "text", "text": CONTEXT}]
    for echo in ({"echo": True}, {"echo": True, "logprobs": 1}):
        before = len(transcripts(cloud))
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="coveil", prompt=parts, max_tokens=1, **echo)
        error = refused.value.body
        assert error["param"] == "echo" and "prompt[0] is marked coveil_private" in error["message"]
        assert "skiing" not in error["message"]
        time.sleep(0.2)  # a session the refusal let through would have ended by now
        assert len(transcripts(cloud)) == before

    before = len(transcripts(cloud))
    reply = client.completions.create(model="coveil", prompt=parts, max_tokens=1)
    private = "Notes: " + OTHER_CONTEXT + "\n\n" + PRIVATE_CONTEXT  # the part, then the run's context
    assert reply.usage.prompt_tokens == len(slm.tokenize(private + CONTEXT_SEPARATOR + CONTEXT, add_bos=True))
    seen = next_transcript(cloud, before)
    assert seen["prompt_ids"] == slm.tokenize(CONTEXT, add_bos=True)  # the public part alone
    assert "skiing" not in json.dumps(seen) and CANARY not in json.dumps(seen)
