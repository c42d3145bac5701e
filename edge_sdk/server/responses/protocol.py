"""The Responses API's request and response schemas, as far as the stateless endpoint serves them.

A request is read against an allowlist (an unknown field is a 400 naming it, never ignored) and becomes the
:class:`~edge_sdk.server.openai.protocol.ChatCompletionRequest` for the same generation: ``instructions`` the system
message, ``input`` (a text: the user's message; or message items) the conversation, ``max_output_tokens``,
``text.format`` the response format, ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` the
log-probabilities.  The private part rides in a top-level ``coveil`` object (``extra_body``), or an input item
or one of its text parts marked ``"coveil_private": true`` joins the private context.

Function tools: ``tools`` (``{"type": "function", "name", "description", "parameters"}``) and ``tool_choice``
(``none``, ``auto``, ``required``, ``{"type": "function", "name"}``) become the chat request's, so the reply is
constrained by the same grammar (:mod:`edge_sdk.server.tools`); a ``function_call`` input item joins the
conversation as the call it was, a ``function_call_output`` item as its result (public unless it is marked
``"coveil_private": true``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from edge_sdk.logprobs import MAX_TOP_LOGPROBS
from edge_sdk.server.openai.protocol import ChatCompletionRequest, CoveilOptions, LedgerSummary, TokenLogprob
from edge_sdk.server.tools import FunctionSpec, call_message, function_tool, named_choice, result_message

#: the ``include`` entry that asks for each output token's log-probabilities
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: the OpenAI chat request's parameter names as this API names them (in errors)
PARAM_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


class InputText(BaseModel):
    """A text part of an input item (``output_text``: an earlier reply's, sent back); ``coveil_private`` moves it
    into the private context."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    coveil_private: StrictBool = False
    annotations: list[dict] | None = None
    logprobs: list[dict] | None = None

    def as_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text, "coveil_private": self.coveil_private}


class OtherPart(BaseModel):
    """A part the endpoint does not serve (images, files, audio, a refusal): read only to be refused by name."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_image", "input_file", "input_audio", "refusal"]


class InputItem(BaseModel):
    """What an input item sent back from an earlier response may carry besides its own fields (not used)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    status: str | None = None


class MessageItem(InputItem):
    """A message of the conversation (``type`` may be left out, as the API allows)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OtherPart]
    coveil_private: StrictBool = False


class FunctionCallItem(InputItem):
    """A call an earlier response made (its ``function_call`` output item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class FunctionOutputItem(InputItem):
    """A call's result; ``coveil_private`` keeps it on the device."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    coveil_private: StrictBool = False


class OtherItem(BaseModel):
    """An item the endpoint does not serve here (reasoning, references to stored items, built-in tools' calls):
    read only to be refused by name."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning", "item_reference", "file_search_call",
                  "web_search_call", "computer_call", "computer_call_output", "image_generation_call",
                  "code_interpreter_call", "local_shell_call", "local_shell_call_output", "mcp_call",
                  "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "custom_tool_call",
                  "custom_tool_call_output"]


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON valid under ``schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        inner: dict[str, Any] = {"name": self.name or "response", "strict": self.strict}
        if self.json_schema is not None:
            inner["schema"] = self.json_schema
        return {"type": "json_schema", "json_schema": inner if self.json_schema is not None else None}


class FunctionTool(FunctionSpec):
    """``tools[i]``: a function the reply may call, the chat request's function flattened into the tool (built-in
    tools are refused by their type)."""

    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (stateless)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionOutputItem | OtherItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    text: TextOptions | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt: dict | None = None
    stream_options: dict | None = None
    # OpenAI's fields that change nothing here: accepted and not used
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    coveil: CoveilOptions | None = None

    def refused(self) -> tuple[str, str] | None:
        """``(param, why)`` for the first field set to something the endpoint cannot do (the translated request
        refuses the rest)."""
        if self.previous_response_id is not None:
            return "previous_response_id", "this endpoint is stateless and keeps no responses: send the " \
                "conversation so far as input items"
        if self.conversation is not None:
            return "conversation", "this endpoint is stateless and keeps no conversations: send them as input items"
        if self.store:
            return "store", "this endpoint is stateless and stores nothing: send store: false"
        if self.background:
            return "background", "responses are answered while the request waits (nothing is stored to poll)"
        if self.prompt is not None:
            return "prompt", "stored prompt templates are not served"
        if self.reasoning and self.reasoning.get("effort") not in (None, "none", "minimal"):
            return "reasoning", "the edge model does not reason before it answers"
        if self.truncation == "auto":
            return "truncation", "a conversation past the context window is refused, not cut"
        for name in self.include or []:
            if name != LOGPROBS_INCLUDE:
                return "include", f"only {LOGPROBS_INCLUDE!r} is served"
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            return "top_logprobs", f"at most {MAX_TOP_LOGPROBS} alternatives per token"
        if isinstance(self.input, list):
            for position, item in enumerate(self.input):
                if isinstance(item, OtherItem):
                    return f"input.{position}", f"{item.type} items are not served"
                if isinstance(item, MessageItem) and isinstance(item.content, list):
                    for index, part in enumerate(item.content):
                        if isinstance(part, OtherPart):
                            return f"input.{position}.content.{index}", f"{part.type} parts are not served: only text"
        return None

    def logprobs_asked(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def as_openai(self, served_model: str) -> ChatCompletionRequest:
        """The OpenAI chat request for the same generation."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            names: dict[str, str] = {}  # each earlier call's id → its function, to name its result
            for item in self.input:
                if isinstance(item, FunctionCallItem):
                    names[item.call_id] = item.name
                    messages.append(call_message(item.call_id, item.name, item.arguments))
                    continue
                if isinstance(item, FunctionOutputItem):
                    messages.append(result_message(item.call_id, names.get(item.call_id), item.output,
                                                   private=item.coveil_private))
                    continue
                assert isinstance(item, MessageItem)  # refused() refuses the others
                content = item.content if isinstance(item.content, str) else [
                    part.as_part() for part in item.content if isinstance(part, InputText)]
                messages.append({"role": item.role, "content": content, "coveil_private": item.coveil_private})
        fields: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                                  "max_tokens": self.max_output_tokens, "coveil": self.coveil}
        if self.tools is not None:
            fields["tools"] = [function_tool(tool.name, tool.description, tool.parameters) for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = named_choice(self.tool_choice.name) \
                if isinstance(self.tool_choice, NamedFunctionChoice) else self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        if self.logprobs_asked():
            fields["logprobs"], fields["top_logprobs"] = True, self.top_logprobs or 0
        return ChatCompletionRequest(model=served_model, messages=messages, stream=self.stream,
                                     **{k: v for k, v in fields.items() if v is not None})


# -- responses ---------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class OutputFunctionCall(BaseModel):
    """A call the reply made."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int  # the SLM's prompt (private context included): what the device read
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A ``response``; ``coveil`` the ledger's summary once the generation ended (or failed after steps)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: str | dict[str, Any] = "none"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    usage: ResponseUsage | None = None
    coveil: LedgerSummary | None = None
