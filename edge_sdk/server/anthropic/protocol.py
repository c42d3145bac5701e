"""The Messages API's request and response schemas, as far as the endpoint serves them.

A request is read against an allowlist, as the OpenAI routes' are (an unknown field is a 400 naming it, never
ignored), and becomes the :class:`~edge_sdk.server.openai.protocol.ChatCompletionRequest` that asks for the same
generation: ``system`` the system message, ``max_tokens``, ``stop_sequences`` the stop strings, ``temperature``
the cloud's sampling temperature in cloud-side fusion.  The private part rides in a top-level ``coveil`` object
(``extra_body={"coveil": {...}}`` with the ``anthropic`` client; the fields of
:class:`~edge_sdk.server.openai.protocol.CoveilOptions`), or a text block of ``system`` or of a message marked
``"coveil_private": true`` joins the private context.

Tools: ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``
with its ``name``, ``none``) become the chat request's, so the reply is constrained by the same grammar
(:mod:`edge_sdk.server.tools`); an earlier reply's ``tool_use`` block joins the conversation as the call it made,
a ``tool_result`` block as the tool's result (public unless it is marked ``"coveil_private": true``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from edge_sdk.server.openai.protocol import ChatCompletionRequest, CoveilOptions, LedgerSummary, StepReport
from edge_sdk.server.tools import call_message, function_tool, named_choice, result_message

#: the OpenAI request's parameter names as this API names them (in errors)
PARAM_NAMES = {"stop": "stop_sequences"}


class TextBlock(BaseModel):
    """A text block; ``coveil_private`` moves its text into the private context (the message's other blocks stay
    public)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str
    coveil_private: StrictBool = False
    cache_control: dict | None = None  # a prompt-cache hint: accepted, nothing is cached across requests
    citations: list[dict] | None = None

    def as_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text, "coveil_private": self.coveil_private}


class ToolUseBlock(BaseModel):
    """A call an earlier reply made (an assistant message's block, as the ``anthropic`` client returns it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(BaseModel):
    """A tool's result (a user message's block); ``coveil_private`` keeps it on the device."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    coveil_private: StrictBool = False
    cache_control: dict | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class OtherBlock(BaseModel):
    """A block of a kind the endpoint does not serve (images, documents, thinking, server tools): read only to be
    refused by name (:meth:`MessagesRequest.refused`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "container_upload"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | OtherBlock


class ToolSpec(BaseModel):
    """``tools[i]``: a function the reply may call (client tools; server tools are refused as unknown fields)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(BaseModel):
    """``tool_choice``: ``auto`` (a call or text), ``any`` (a call), ``tool`` (a call to ``name``), ``none``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # a reply makes one call at most here

    def as_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return named_choice(self.name or "")
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesRequest(BaseModel):
    """``POST /v1/messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # user_id: accepted, not used
    service_tier: str | None = None
    thinking: dict | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    container: str | None = None
    mcp_servers: list[dict] | None = None
    coveil: CoveilOptions | None = None

    def refused(self) -> tuple[str, str] | None:
        """``(param, why)`` for the first field set to something the endpoint cannot do (the translated request
        refuses the rest)."""
        if self.top_k not in (None, 0):
            return "top_k", "it would change the fused distribution outside the policy"
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            return "thinking", "the edge model does not think before it answers"
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            return "tool_choice", "a tool choice of type tool names the tool"
        for name in ("container", "mcp_servers"):
            if getattr(self, name):
                return name, "not served by the edge model"
        for position, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for index, block in enumerate(message.content):
                    if isinstance(block, OtherBlock):
                        return f"messages.{position}.content.{index}", f"{block.type} blocks are not served: only text"
        return None

    def as_openai(self, served_model: str) -> ChatCompletionRequest:
        """The OpenAI chat request for the same generation."""
        messages: list[dict[str, Any]] = []
        if isinstance(self.system, str) and self.system:
            messages.append({"role": "system", "content": self.system})
        elif isinstance(self.system, list) and self.system:
            messages.append({"role": "system", "content": [block.as_part() for block in self.system]})
        names: dict[str, str] = {}  # each earlier call's id → its function, to name its result
        for message in self.messages:
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
                continue
            for block in message.content:
                if isinstance(block, ToolUseBlock):
                    names[block.id] = block.name
                    messages.append(call_message(block.id, block.name, block.input))
                elif isinstance(block, ToolResultBlock):
                    messages.append(result_message(block.tool_use_id, names.get(block.tool_use_id), block.text(),
                                                   private=block.coveil_private))
            text = [block.as_part() for block in message.content if isinstance(block, TextBlock)]
            if text or not any(isinstance(block, ToolUseBlock | ToolResultBlock) for block in message.content):
                messages.append({"role": message.role, "content": text})
        fields = {"temperature": self.temperature, "top_p": self.top_p, "stop": self.stop_sequences,
                  "coveil": self.coveil,
                  "tools": None if self.tools is None else [
                      function_tool(tool.name, tool.description, tool.input_schema) for tool in self.tools],
                  "tool_choice": None if self.tool_choice is None else self.tool_choice.as_openai()}
        return ChatCompletionRequest(model=served_model, messages=messages, max_tokens=self.max_tokens,
                                     stream=self.stream, **{k: v for k, v in fields.items() if v is not None})


# -- responses ---------------------------------------------------------------------------------------


class ResponseText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseToolUse(BaseModel):
    """A call the reply made."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    input_tokens: int  # the SLM's prompt (private context included): what the device read
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    """A whole reply (also the ``message_start`` event's message, empty); ``coveil`` the ledger's summary."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseText | ResponseToolUse]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage
    coveil: LedgerSummary | None = None


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class BlockDelta(BaseModel):
    """``content_block_delta``: a token's text; ``coveil`` what the cloud saw at its step."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = 0
    delta: TextDelta
    coveil: StepReport | None = None


class StopDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class OutputUsage(BaseModel):
    output_tokens: int


class MessageDelta(BaseModel):
    """``message_delta``: why the reply ended; ``coveil`` the ledger's summary."""

    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: OutputUsage
    coveil: LedgerSummary


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    """Anthropic's error: ``{"type": "error", "error": {"type", "message"}}``; ``coveil`` what had left the
    device when a generation failed after its first step."""

    type: Literal["error"] = "error"
    error: ErrorDetail
    coveil: LedgerSummary | None = None
