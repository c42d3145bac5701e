"""The endpoint's guards without a model: the allowlist of request fields, the private marker on a content part,
the HTTP guards (content type, Origin, body size, the key on every path, the page's headers, no CORS), stop
strings that cost linear time, the queue's count of waiting clients, and errors that quote nothing."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Mapping, Sequence

import pytest
from pydantic import ValidationError

from edge_sdk.prompts import Prompts
from edge_sdk.server.protocol import ChatCompletionRequest, CompletionRequest
from edge_sdk.server.serving import EdgeServing
from edge_sdk.server.settings import ServerSettings

SECRET = "Zorblat Quexley's notes"


# -- fakes ---------------------------------------------------------------------------------------------------


class WordSLM:
    """Tokenises one id per word, after BOS (id 1)."""

    name = "words"

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        return [1] * add_bos + [2] * len(text.split())


class RecordingRenderer:
    """A chat template that records each conversation it renders (the cloud's is rendered first)."""

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, str]]] = []

    def render(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        self.rendered.append([dict(m) for m in messages])
        return [1] + [2] * sum(len(m["content"].split()) + 1 for m in messages)


class RecordingClient:
    """Builds no decoder: records the prompts and settings a generation would decode with."""

    def __init__(self) -> None:
        self.slm = WordSLM()
        self.prompts: list[Prompts] = []
        self.settings: list[dict] = []

    def decoder(self, prompts: Prompts, **settings: object) -> str:
        self.prompts.append(prompts)
        self.settings.append(settings)
        return "decoder"


@pytest.fixture
def recording() -> tuple[EdgeServing, RecordingClient, RecordingRenderer]:
    client, renderer = RecordingClient(), RecordingRenderer()
    serving = EdgeServing(client, renderer, ServerSettings(cloud="c:1"), n_ctx=512)  # type: ignore[arg-type]
    yield serving, client, renderer
    serving.close()


# -- N2/N14: an allowlist of fields, and the private marker on a content part ---------------------------------


def test_a_content_part_marked_private_joins_the_private_context_and_never_the_cloud_prompt(recording) -> None:  # noqa: ANN001
    """Before, the part's ``coveil_private`` was an ignored extra field and its text went to the cloud."""
    serving, client, renderer = recording
    request = ChatCompletionRequest(model="coveil", messages=[
        {"role": "system", "content": [{"type": "text", "text": SECRET, "coveil_private": True}]},
        {"role": "user", "content": [{"type": "text", "text": "Which organ? "},
                                     {"type": "text", "text": "The patient is jaundiced.", "coveil_private": True},
                                     {"type": "text", "text": "One word."}]},
    ])
    serving.prepare_chat(request)
    cloud_conversation = renderer.rendered[0]
    assert cloud_conversation == [{"role": "user", "content": "Which organ? One word."}]  # the system part: gone
    assert client.prompts[-1].private_text == f"{SECRET}\n\nThe patient is jaundiced."
    # the SLM's conversation holds it, before the last user message's public text
    assert renderer.rendered[1][-1]["content"] == f"{SECRET}\n\nThe patient is jaundiced.\n\nWhich organ? One word."


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": SECRET, "confidential": True}]},
    {"messages": [{"role": "user", "content": SECRET, "private": True}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET, "private": True}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET, "confidential": True}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SECRET, "coveil-private": True}]}]},
    {"messages": [{"role": "user", "content": "q"}], "confidential_context": SECRET},
    {"messages": [{"role": "user", "content": "q"}], "coveil": {"private_context": "x", "secret": SECRET}},
    {"messages": [{"role": "user", "content": "q"}], "stream_options": {"private": True}},
], ids=["message confidential", "message private", "part private", "part confidential", "part coveil-private",
        "top level", "coveil object", "stream options"])
def test_any_field_the_endpoint_does_not_know_is_refused_by_name(body: dict) -> None:
    """An allowlist everywhere: a denylist of marker names let ``"confidential": true`` through (ignored, and its
    message sent to the cloud)."""
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest(model="coveil", **body)
    errors = caught.value.errors(include_input=False)
    unknown = [error for error in errors if error["type"] == "extra_forbidden"]  # (a content's str branch fails too)
    assert len(unknown) == 1
    assert unknown[0]["loc"][-1] in {"confidential", "private", "coveil-private", "confidential_context", "secret"}
    assert SECRET not in str(errors)
    with pytest.raises(ValidationError):
        CompletionRequest(model="coveil", prompt="q", confidential=True)


def test_the_fields_openai_clients_send_are_known() -> None:
    """A reply appended to the conversation as the openai client returns it, and OpenAI's request fields that
    change nothing here, pass; a marker that is not a boolean does not."""
    reply = {"role": "assistant", "content": "Liver.", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}
    request = ChatCompletionRequest(
        model="coveil", messages=[{"role": "user", "content": "q", "name": "ann"}, reply,
                                  {"role": "user", "content": "why?"}],
        metadata={"app": "x"}, store=False, parallel_tool_calls=True, stream_options={"include_usage": True},
        coveil={"private_context": "notes"})
    assert request.unsupported() is None
    tool = ChatCompletionRequest(model="coveil", messages=[{**reply, "tool_calls": [{"id": "1"}]}])
    assert tool.unsupported()[0] == "messages.0"
    assert ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q"}],
                                 modalities=["audio"]).unsupported()[0] == "modalities"
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q", "coveil_private": "yes"}])
