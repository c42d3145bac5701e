"""The OpenAI API's request and response schemas, as far as the endpoint serves them, and the ``coveil`` extension.

Requests are read against an allowlist: every model here names the fields it
knows (OpenAI's, and the ``coveil`` extension) and refuses any other with a
400 naming it.  A field the endpoint knows but cannot honour (``n > 1``,
``top_logprobs`` > 20, ...) is refused by :meth:`GenerationRequest.unsupported`.
Nothing unknown is ignored: an ignored privacy marker (``"private": true``,
``"confidential": true``, a misspelt ``coveil_private``) would send text the
app meant to keep on the device to the cloud.

The private part travels as ``extra_body={"coveil": {...}}`` (the ``openai``
client sends ``extra_body`` as top-level fields): :class:`CoveilOptions`.  A
message, or one text part of a message's content, may be marked private
(``"coveil_private": true``): its text joins the private context (in message
order, before ``coveil.private_context``) instead of going to the cloud.

Responses carry the privacy ledger's summary in a ``coveil`` field
(:class:`LedgerSummary`); a stream's chunks carry each step's report
(:class:`StepReport`) and its last chunk the summary.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from edge_sdk.grammar import ANY_JSON_OBJECT
from edge_sdk.decode_settings import AUTO
from edge_sdk.server.settings import MAX_CLOCK_MS
from edge_sdk.server.tools import Tool, ToolChoice, chosen_tools, reply_schema, result_text
from edge_sdk.logprobs import MAX_TOP_LOGPROBS

#: OpenAI's limit on stop strings per request
MAX_STOPS = 4
#: the longest stop string accepted, in characters (matching a stop of length L costs O(L) per token: four
#: 320,000-character stops cost 4.2 s per token before this cap)
MAX_STOP_CHARS = 256

FusionModeName = Literal["cloud", "edge"]
#: what the cloud saw at one step: nothing of the private side, the synchronised token, an upload of k values,
#: a request for the full distribution (the strongest applies)
CloudSaw = Literal["nothing", "token", "upload", "full"]


class CoveilOptions(BaseModel):
    """The private part of a request: it conditions the edge SLM only and never leaves the device as text."""

    model_config = ConfigDict(extra="forbid")

    private_context: str = ""
    mode: FusionModeName | None = None
    policy: str | None = None
    params: dict[str, StrictBool | StrictInt | StrictFloat | str] = Field(default_factory=dict)
    exposure_budget: float | None = Field(default=None, ge=0.0, le=1.0)
    max_epsilon: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    epsilon_delta: float | None = Field(default=None, ge=0.0, lt=1.0)
    never_upload: list[str] = Field(default_factory=list)
    alpha: float | None = Field(default=None, ge=0.0, le=1.0)
    # each signal leaves on a public schedule of this many ms (edge_sdk.decoding.DecodeSettings.pace_ms); "auto":
    # the pace the endpoint measured once on a public prompt (the first request that asks waits for it)
    pace_ms: float | Literal["auto"] | None = None
    # the session opens on a public grid of this many ms (DecodeSettings.prefill_budget_ms)
    prefill_budget_ms: float | None = Field(default=None, gt=0.0, le=MAX_CLOCK_MS, allow_inf_nan=False)
    # this request's deepest run-ahead, 0: lockstep (DecodeSettings.lookahead; default the server's --lookahead)
    lookahead: StrictInt | None = Field(default=None, ge=0)

    @field_validator("pace_ms", mode="before")
    @classmethod
    def _pace(cls, value: Any) -> float | str | None:
        if value is None or value == AUTO:
            return value
        refusal = f"a pace is a number of ms in (0, {MAX_CLOCK_MS:g}], or {AUTO!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(refusal)
        try:
            pace = float(value)
        except OverflowError:  # an integer past any float
            raise ValueError(refusal) from None
        if not 0 < pace <= MAX_CLOCK_MS:  # NaN fails too
            raise ValueError(refusal)
        return pace


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    """A call an earlier reply made (``message.tool_calls[i]`` as the ``openai`` client returns it)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_reply(self) -> str:
        """The reply's text that made this call (the shape the tools grammar writes)."""
        try:
            arguments = json.loads(self.function.arguments or "{}")
        except ValueError:
            arguments = {}
        return json.dumps({"name": self.function.name, "arguments": arguments}, separators=(",", ":"))


class TextPart(BaseModel):
    """One text part of a message's content (images and audio are not served); ``coveil_private`` moves this
    part's text into the private context, the message's other parts stay public."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str
    coveil_private: StrictBool = False


class ChatMessage(BaseModel):
    """One message; ``developer`` reads as ``system``; ``coveil_private`` moves its text into the private context.

    ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``tool_calls`` are the fields of a reply the
    ``openai`` client returns, so an app can append a reply to its conversation as it got it (a call the reply
    made joins the conversation as its JSON, :mod:`edge_sdk.server.tools`); audio or a legacy ``function_call``
    is refused (:meth:`ChatCompletionRequest.unsupported`).  A ``tool`` message is a tool's result: it joins the
    conversation as a user turn naming the call (public unless marked private)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    coveil_private: StrictBool = False
    refusal: str | None = None
    annotations: list[dict] | None = None
    audio: dict | None = None
    function_call: dict | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    def own_text(self) -> str:
        """The message's text as the model reads it: a call the reply made as its JSON (:mod:`edge_sdk.server.tools`),
        a tool's result as the turn that brings it in."""
        text = self.content if isinstance(self.content, str) else ""
        if self.tool_calls:
            text += "".join(call.as_reply() for call in self.tool_calls)
        if self.role == "tool":
            return result_text(self.name, text)
        return text

    def public_text(self) -> str:
        """The text the cloud may read: nothing of a private message, else the parts not marked private."""
        if self.coveil_private:
            return ""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if not part.coveil_private)
        return self.own_text()

    def private_text(self) -> str:
        """The text that joins the private context: all of a private message, else its private parts."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if self.coveil_private or part.coveil_private)
        return self.own_text() if self.coveil_private else ""

    def is_public(self) -> bool:
        """Whether the message goes to the cloud at all (a private message, or one whose every part is private,
        does not)."""
        if self.coveil_private:
            return False
        if isinstance(self.content, list) and self.content:
            return not all(part.coveil_private for part in self.content)
        return True

    def template_role(self) -> str:
        return {"developer": "system", "tool": "user"}.get(self.role, self.role)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks; chunks here are not padded


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the reply must satisfy (``strict`` is always so here)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid under a schema (edge-side fusion)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(BaseModel):
    """What ``/v1/chat/completions`` and ``/v1/completions`` share (an unknown field is refused, see the module
    docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    coveil: CoveilOptions | None = None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the reply must satisfy (``json_object``: any object), or ``None`` for free text."""
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return dict(ANY_JSON_OBJECT)
        assert self.response_format.json_schema is not None  # unsupported() refuses it missing
        return self.response_format.json_schema.json_schema

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(stops)

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, why)`` for the first parameter set to something the endpoint cannot do, else ``None``."""
        if self.n not in (None, 1):
            return "n", "one choice per request: the device runs one SLM sequence per generation"
        if self.top_p not in (None, 1.0):
            return "top_p", "nucleus sampling is not offered: tokens are picked by the fusion policy (or by the " \
                "cloud's temperature sampling in cloud-side fusion)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                return name, "penalties would change the fused distribution outside the policy"
        if self.logit_bias:
            return "logit_bias", "logit biases would change the fused distribution outside the policy"
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            return "response_format", "a json_schema response format needs its json_schema.schema"
        stops = self.stop_strings()
        if len(stops) > MAX_STOPS or any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
            return "stop", f"up to {MAX_STOPS} non-empty stop strings of at most {MAX_STOP_CHARS} characters"
        return None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # OpenAI's fields that change nothing here: accepted and not used
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # OpenAI's fields for what the endpoint does not serve: refused when set (``unsupported``)
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            return "top_logprobs", f"at most {MAX_TOP_LOGPROBS} alternatives per token"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "alternatives are returned with logprobs: true only"
        if self.functions or self.function_call:
            return "functions", "the legacy functions are not served: send tools"
        try:
            tools, _ = chosen_tools(self.tools or [], self.tool_choice)
        except ValueError as exc:
            return "tool_choice", str(exc)
        if tools and self.response_format is not None and self.response_format.type != "text":
            return "response_format", "a reply is either under the tools' grammar or under a response format"
        for position, message in enumerate(self.messages):
            if message.function_call or message.audio:
                return f"messages.{position}", "audio and legacy function calls in a message are not served"
        if self.modalities not in (None, ["text"]) or self.audio:
            return "modalities", "only text replies are served"
        for name in ("prediction", "reasoning_effort", "verbosity", "web_search_options"):
            if getattr(self, name) is not None:
                return name, "not served by the edge model"
        return super().unsupported()

    def reply_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def called_tools(self) -> list[Tool]:
        """The tools the reply may call (none: ``tool_choice: "none"`` or no tools)."""
        return chosen_tools(self.tools or [], self.tool_choice)[0]

    def json_schema(self) -> dict[str, Any] | None:
        """With tools, the reply's schema (:func:`edge_sdk.server.tools.reply_schema`); else the response format's."""
        tools, text_allowed = chosen_tools(self.tools or [], self.tool_choice)
        return reply_schema(tools, text_allowed) if tools else super().json_schema()

    def logprobs_count(self) -> int | None:
        """How many alternatives per token to return with each token's log-probability (``None``: none at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    """``/v1/completions``: one prompt, as text, token ids (what lm-eval sends) or text parts (a part marked
    ``coveil_private`` joins the private context, as in a chat message); ``echo`` returns the prompt before the
    reply, and with ``logprobs`` each prompt token's fused log-probability (edge-side only: see
    :meth:`edge_sdk.decoding.CollaborativeDecoder.prompt_logprobs`)."""

    prompt: str | list[str] | list[int] | list[list[int]] | list[TextPart]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0)

    def unsupported(self) -> tuple[str, str] | None:
        parts = self.prompt_parts()
        if isinstance(self.prompt, list) and len(self.prompt) != 1 and not self.prompt_ids() and parts is None:
            return "prompt", "one prompt per request"
        marked = [position for position, part in enumerate(parts or ()) if part.coveil_private]
        if self.echo and marked:
            return "echo", f"prompt[{marked[0]}] is marked coveil_private, and echo returns (with logprobs scores) " \
                "the prompt as the cloud reads it, which holds no private part: send the private text in " \
                "coveil.private_context, or leave echo off"
        if self.echo and self.stream:
            return "echo", "an echoed prompt is answered whole: set stream to false"
        if self.suffix:
            return "suffix", "insertion (suffix) is not served"
        if self.best_of not in (None, 1):
            return "best_of", "one candidate per request"
        if self.logprobs is not None and self.logprobs > MAX_TOP_LOGPROBS:
            return "logprobs", f"at most {MAX_TOP_LOGPROBS} alternatives per token"
        return super().unsupported()

    def prompt_parts(self) -> list[TextPart] | None:
        """The prompt's text parts (``None``: sent as text or token ids)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], TextPart):
            return self.prompt  # type: ignore[return-value]
        return None

    def prompt_text(self) -> str | None:
        """The prompt's public text: the text, or its parts not marked private (``None``: sent as token ids)."""
        parts = self.prompt_parts()
        if parts is not None:
            return "".join(part.text for part in parts if not part.coveil_private)
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0] if self.prompt else ""
        return prompt if isinstance(prompt, str) else None

    def private_text(self) -> str:
        """The text of the prompt's parts marked ``coveil_private`` (it joins the private context)."""
        return "".join(part.text for part in self.prompt_parts() or () if part.coveil_private)

    def prompt_ids(self) -> list[int] | None:
        """The prompt as token ids (``None``: sent as text)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], list):
            return self.prompt[0] if len(self.prompt) == 1 else None
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], int):
            return list(self.prompt)  # type: ignore[arg-type]
        return None

    def echo_scored(self) -> bool:
        """Whether the prompt's tokens are scored (echo with logprobs)."""
        return self.echo and self.logprobs is not None

    def reply_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


class EmbeddingRequest(BaseModel):
    """``/v1/embeddings``: one text or a list of texts (token-id inputs are refused: send text)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self) -> list[str]:
        """The inputs as texts; a :class:`ValueError` naming the first that is not one (``input[i]``)."""
        items = [self.input] if isinstance(self.input, str) else self.input
        for position, item in enumerate(items):
            if not isinstance(item, str):
                raise ValueError(f"input[{position}]: token ids are not served, send the text")
        return items


# -- responses ---------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int  # the SLM's prompt (private context included): what the device read
    completion_tokens: int
    total_tokens: int


class StepReport(BaseModel):
    """What the cloud saw at one step: ``saw`` its kind, ``values_left`` how many values of the edge's left the
    device (the upload's values, or 1 for a synchronised token id; the live page colours each token by it)."""

    step: int
    token_id: int
    saw: CloudSaw
    values_left: int
    values_uploaded: int
    full_requested: bool
    withheld: bool
    steered: bool
    bytes_up: int
    bytes_down: int
    leakage_meter: float


class SourceRelation(BaseModel):
    """A source's own, weaker figure (a context against none), shown beside ``epsilon_spent``, never for it."""

    relation: str
    epsilon_spent: float


class EpsilonLedger(BaseModel):
    """What the generation spent (:meth:`edge_sdk.privacy.ledger.PrivacyLedger.privacy`): ``epsilon_spent`` at ``delta``
    for ``relation`` over ``events`` releases, null with ``guarantee`` "non-private" for a policy with no DP
    guarantee; ``in_words`` what that means to the person (the odds, or a heuristic's counts)."""

    guarantee: Literal["dp", "non-private"]
    epsilon_spent: float | None
    relation: str | None
    source_relation: SourceRelation | None
    in_words: str
    delta: float
    accountant: str
    event: str
    events: int
    max_epsilon: float | None
    withheld_from: int | None
    withheld_reason: str | None
    note: str


class LedgerSummary(BaseModel):
    """The privacy ledger of one generation, summed (``summary`` is the SDK's one-line form)."""

    mode: FusionModeName
    policy: str
    steps: int
    values_uploaded: int
    full_requests: int
    bytes_up: int
    bytes_down: int
    leakage_meter: float
    steered_steps: int
    withheld_steps: int
    exposure_budget_spent: bool
    reconnects: int
    prefill_overrun: bool  # the SLM's prefill ran past coveil.prefill_budget_ms (the open then shows by how many)
    exposure_k: int
    cloud_prompt_tokens: int
    queue_ms: float
    summary: str
    privacy: EpsilonLedger | None = None
    notes: list[str] = Field(default_factory=list)  # what the app should know, e.g. a system message sent as public
    # steps counted above (the cloud saw them) whose tokens a stop string cut from the reply: the reply, its
    # logprobs, its stream and the page show none of them
    cut_steps: int = 0


class TopLogprob(BaseModel):
    """One token and its log-probability under the fused row (``bytes``: its UTF-8 bytes; a token may hold part
    of a character)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A chosen token's log-probability and the fused row's ``top_logprobs`` best tokens (see the README: the
    row the token was chosen from, at the side that chose it, masked and renormalised)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, log-probability, best alternatives and offset."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it to score it by)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def of(cls, entries: list[TokenLogprob], offset: int = 0, *, unscored_head: str | None = None) -> CompletionLogprobs:
        """``entries`` as the legacy shape, the first token at character ``offset`` of the reply; ``unscored_head``:
        a token before them with no log-probability (an echoed prompt's BOS)."""
        head = [] if unscored_head is None else [unscored_head]
        offsets = []
        for token in [*head, *(entry.token for entry in entries)]:
            offsets.append(offset)
            offset += len(token)
        return cls(tokens=[*head, *(e.token for e in entries)],
                   token_logprobs=[*(None for _ in head), *(e.logprob for e in entries)],
                   top_logprobs=[*(None for _ in head), *({t.token: t.logprob for t in e.top_logprobs} for e in entries)],
                   text_offset=offsets)


class ChunkExtension(BaseModel):
    """A stream chunk's ``coveil`` field: the step it carries, or (last chunk) the ledger's summary."""

    step: StepReport | None = None
    ledger: LedgerSummary | None = None


class ReplyFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ReplyToolCall(BaseModel):
    index: int | None = None  # streamed deltas number their calls
    id: str
    type: Literal["function"] = "function"
    function: ReplyFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ReplyToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    coveil: LedgerSummary


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ReplyToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    coveil: ChunkExtension | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A ``text_completion``; streamed chunks have the same shape (``finish_reason`` ``None`` until the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    coveil: LedgerSummary | ChunkExtension | None = None


class EmbeddingExtension(BaseModel):
    """An embedding response's ``coveil`` field: computed on the device, nothing sent to the cloud."""

    cloud: Literal["nothing"] = "nothing"
    bytes_up: Literal[0] = 0
    bytes_down: Literal[0] = 0
    pooling: str
    normalized: Literal[True] = True
    summary: str


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 vector's little-endian bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    coveil: EmbeddingExtension


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "coveil"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
