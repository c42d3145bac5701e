"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/version``): its request
schemas, read against an allowlist as the OpenAI routes' are, and their translation to the OpenAI requests the
endpoint serves.

An Ollama request becomes the :class:`~edge_sdk.server.openai.protocol.ChatCompletionRequest` (or, for ``/api/generate``
with ``raw``, the :class:`~edge_sdk.server.openai.protocol.CompletionRequest`) that asks for the same generation, so both
APIs share one path to the SLM and one set of refusals.  The private part rides in ``options["coveil"]`` (the
``ollama`` client passes ``options`` through untouched) with the fields of the OpenAI routes' ``coveil`` object
(:class:`~edge_sdk.server.openai.protocol.CoveilOptions`); a chat message may be marked ``"coveil_private": true``.  As
there, a field or option that is not known is refused by name, never ignored: an ignored privacy marker would send
the text it marks to the cloud.

Options map to OpenAI's parameters: ``num_predict`` → ``max_tokens`` (``-1`` or absent: the server's default),
``temperature``, ``seed``, ``stop``, ``top_p``, ``presence_penalty``, ``frequency_penalty`` (refused unless
neutral, as on the OpenAI routes).  Other sampling options (``top_k``, ``min_p``, ``repeat_penalty``, ``mirostat``,
...) would change the fused distribution outside the policy and are refused unless set to the value that leaves it
alone.  Load-time options (``num_ctx``, ``num_thread``, ``num_gpu``, ...) are fixed when ``coveil edge serve``
loads the model: accepted and not used.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from edge_sdk.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CoveilOptions,
    EmbeddingExtension,
    LedgerSummary,
)

#: the Ollama release whose API these routes follow (``GET /api/version``; some apps refuse an older server)
OLLAMA_API_VERSION = "0.12.0"

#: options set when the model is loaded (by ``coveil edge serve``): accepted, not used
LOAD_TIME_OPTIONS = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                     "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep")
#: sampling options that would reshape the fused distribution, with the value that leaves it alone
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "tfs_z": 1.0, "repeat_penalty": 1.0,
                    "repeat_last_n": 0, "mirostat": 0, "mirostat_tau": None, "mirostat_eta": None,
                    "penalize_newline": None}


class OllamaOptions(BaseModel):
    """``options``: the runtime options this endpoint honours, the rest by name (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    coveil: CoveilOptions | None = None
    num_predict: int | None = Field(default=None, ge=-2)
    temperature: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # sampling options refused unless neutral (NEUTRAL_SAMPLING)
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    # load-time options (LOAD_TIME_OPTIONS): accepted, not used
    numa: bool | None = None
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None

    def refused(self) -> tuple[str, str] | None:
        """``(option, why)`` for the first sampling option set to a value that is not neutral."""
        for name, neutral in NEUTRAL_SAMPLING.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                return f"options.{name}", "it would change the fused distribution outside the policy"
        return None

    def openai_fields(self) -> dict[str, Any]:
        """The OpenAI parameters these options ask for (only those set)."""
        fields: dict[str, Any] = {
            "temperature": self.temperature, "seed": self.seed, "stop": self.stop, "top_p": self.top_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "coveil": self.coveil,
            "max_tokens": self.num_predict if self.num_predict is not None and self.num_predict > 0 else None,
        }
        return {name: value for name, value in fields.items() if value is not None}


class OllamaMessage(BaseModel):
    """One chat message; ``coveil_private`` moves its text into the private context (as on the OpenAI routes)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    coveil_private: StrictBool = False
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict] | None = None
    tool_name: str | None = None


class OllamaGenerationRequest(BaseModel):
    """What ``/api/chat`` and ``/api/generate`` share; ``stream`` defaults to true, as in Ollama."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["", "json"] | dict | None = None
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None  # the model stays loaded while the endpoint runs
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def refused(self) -> tuple[str, str] | None:
        """``(param, why)`` for a field this endpoint cannot honour (the OpenAI request refuses the rest)."""
        if self.think not in (None, False):
            return "think", "the edge model does not think before it answers"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "alternatives are returned with logprobs: true only"
        return self.options.refused() if self.options else None

    def common_fields(self, served_model: str) -> dict[str, Any]:
        """The OpenAI request's fields for this request's model, options and format (``"json"``: any JSON
        object; a schema: JSON valid under it)."""
        fields = {"model": served_model, "stream": self.stream,
                  **(self.options.openai_fields() if self.options else {})}
        if self.logprobs:  # as a chat request takes them (a raw prompt's completion request takes the count)
            fields["logprobs"], fields["top_logprobs"] = True, self.top_logprobs or 0
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": self.format}}
        return fields


class OllamaChatRequest(OllamaGenerationRequest):
    """``/api/chat``; ``tools`` as on the OpenAI routes (the model may call one or answer in text: ``"auto"``)."""

    messages: list[OllamaMessage] = Field(min_length=1)
    tools: list[dict] | None = None

    def refused(self) -> tuple[str, str] | None:
        for position, message in enumerate(self.messages):
            if message.images:
                return f"messages.{position}.images", "only text is served"
        return super().refused()

    def as_openai(self, served_model: str) -> ChatCompletionRequest:
        messages = [{"role": m.role, "content": m.content or "", "coveil_private": m.coveil_private,
                     **({"name": m.tool_name} if m.tool_name else {}),
                     **({"tool_calls": [openai_call(call, i) for i, call in enumerate(m.tool_calls)]}
                        if m.tool_calls else {})} for m in self.messages]
        tools = {"tools": self.tools} if self.tools else {}
        return ChatCompletionRequest(messages=messages, **tools, **self.common_fields(served_model))


def openai_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An Ollama reply's ``tool_calls[i]`` (``{"function": {"name", "arguments": {...}}}``) as OpenAI's."""
    function = call.get("function") or {}
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": str(function.get("name", "")), "arguments": json.dumps(function.get("arguments") or {})}}


class OllamaGenerateRequest(OllamaGenerationRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "insertion (suffix) is not served"
        if self.template:
            return "template", "the prompt format is the model's own"
        if self.context:
            return "context", "a tokenised history is not taken back: send the conversation to /api/chat"
        if self.images:
            return "images", "only text is served"
        if self.raw and self.system:
            return "system", "a raw prompt has no system message"
        return super().refused()

    def as_openai(self, served_model: str) -> ChatCompletionRequest | CompletionRequest:
        """A raw prompt is completed as it is; else it is the user's message (after ``system``) in the model's
        prompt format, as Ollama applies its template."""
        if self.raw:
            fields = self.common_fields(served_model)
            if fields.pop("logprobs", None):
                fields["logprobs"] = fields.pop("top_logprobs")
            return CompletionRequest(prompt=self.prompt, **fields)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return ChatCompletionRequest(messages=[*system, {"role": "user", "content": self.prompt}],
                                     **self.common_fields(served_model))


class OllamaEmbedRequest(BaseModel):
    """``/api/embed``: a text or texts, embedded by the device's model alone; ``truncate`` (Ollama's default: true)
    cuts an input past the context window instead of refusing it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.options is not None and self.options.coveil is not None:
            return "options.coveil", "an embedding has no private context: nothing of its input leaves the device"
        return self.options.refused() if self.options else None


# -- responses ---------------------------------------------------------------------------------------


class OllamaFunction(BaseModel):
    name: str
    arguments: dict[str, Any]


class OllamaToolCall(BaseModel):
    function: OllamaFunction


class OllamaReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[OllamaToolCall] | None = None


class OllamaTopLogprob(BaseModel):
    token: str
    logprob: float


class OllamaLogprob(OllamaTopLogprob):
    """Ollama's per-token log-probability with the best alternatives of the same (fused) row."""

    top_logprobs: list[OllamaTopLogprob] | None = None


class OllamaPart(BaseModel):
    """One NDJSON line of a streamed reply, or (``done``) the last line, or a whole reply.

    Durations are in nanoseconds: ``prompt_eval_duration`` until the first token was decided (the prompt read on
    the device, the cloud's first step), ``eval_duration`` the rest; ``prompt_eval_count`` is the SLM's prompt,
    private context included.  ``coveil`` is a step's report, or (``done``) the ledger's summary."""

    model: str
    created_at: str
    message: OllamaReply | None = None  # /api/chat
    response: str | None = None  # /api/generate
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    coveil: LedgerSummary | dict | None = None
    logprobs: list[OllamaLogprob] | None = None  # each token's, when asked (the README says of which row)


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int
    coveil: EmbeddingExtension


class OllamaModelDetails(BaseModel):
    parent_model: str = ""
    format: str = "gguf"
    family: str
    families: list[str]
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaTags(BaseModel):
    models: list[OllamaModel]


class OllamaShow(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str
