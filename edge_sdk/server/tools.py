"""Tools (function calling): the model's choice between a text reply and a call, constrained by a grammar built from
the tools' JSON schemas, and its reply read back as a call.

The reply is one JSON document under :func:`reply_schema`, applied where the token is picked by the same grammar
engine as ``response_format`` (:mod:`edge_sdk.grammar`; cloud-side the schema goes with the session):

* a call: ``{"name": NAME, "arguments": {...}}``, ``arguments`` valid under that tool's ``parameters``;
* a text reply (``tool_choice: "auto"`` only): ``{"content": "..."}``.

``tool_choice``: ``"none"`` (no tools: free text, the tools not even shown to the model), ``"auto"`` (either),
``"required"`` (a call to any tool), a named function (a call to that one).  The tools and the instruction are
public (they join the conversation the cloud reads, as a system message); a call's tokens are steps like any
other, fused and ledgered.  A tool's result in a later message (role ``tool``) joins the conversation as a user
turn naming the call, public unless marked ``coveil_private``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: what the model is told of the reply's shape (public: it joins the cloud's conversation)
INSTRUCTION = ("You can call these functions:\n{tools}\nTo call one, reply with only the JSON object "
               '{{"name": <function name>, "arguments": <its arguments>}}.{text}')
TEXT_ALLOWED = ' To answer in text instead, reply with only {"content": <your answer>}.'


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    """``tools[i]``: a function the model may call (OpenAI's and Ollama's shape)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


def chosen_tools(tools: list[Tool], choice: ToolChoice | None) -> tuple[list[Tool], bool]:
    """The tools the reply may call and whether it may be text instead (``ValueError`` for a name no tool has)."""
    if not tools or choice == "none":
        return [], True
    if isinstance(choice, NamedChoice):
        named = [tool for tool in tools if tool.function.name == choice.function.name]
        if not named:
            raise ValueError("tool_choice names a function that is not in tools")
        return named, False
    return tools, choice != "required"


def reply_schema(tools: list[Tool], text_allowed: bool) -> dict[str, Any]:
    """The JSON schema of a reply that calls one of ``tools`` (or, ``text_allowed``, answers in text)."""
    calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                               "arguments": tool.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]
    text = [{"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
             "additionalProperties": False}] if text_allowed else []
    options = calls + text
    return options[0] if len(options) == 1 else {"anyOf": options}


def instruction(tools: list[Tool], text_allowed: bool) -> str:
    """The system text that shows the model its tools and the reply's shape."""
    listed = "\n".join(json.dumps(tool.function.model_dump(exclude_none=True), separators=(",", ":"))
                       for tool in tools)
    return INSTRUCTION.format(tools=listed, text=TEXT_ALLOWED if text_allowed else "")


@dataclass(frozen=True)
class ToolCall:
    """A call the reply made: its id, the function's name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, separators=(",", ":"))


def read_reply(text: str) -> ToolCall | str | None:
    """A tools reply as a call, or its text (``{"content": ...}``); ``None`` when it is not a whole document (the
    generation was cut by ``max_tokens``)."""
    try:
        document = json.loads(text)
    except ValueError:
        return None
    if isinstance(document, dict) and "name" in document:
        return ToolCall(f"call_{secrets.token_hex(12)}", str(document["name"]), dict(document.get("arguments") or {}))
    if isinstance(document, dict) and isinstance(document.get("content"), str):
        return document["content"]
    return None


def result_text(name: str | None, content: str) -> str:
    """A tool's result as the user turn that brings it into the conversation."""
    return f"Result of {name or 'the function call'}: {content}"


# -- what the Anthropic and Responses dialects send, as the chat request's tools and messages -----------------


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A dialect's function as a ``tools[i]`` of the chat request (its schema checked there, by name)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def named_choice(name: str) -> dict[str, Any]:
    """``tool_choice`` naming one function, as the chat request spells it."""
    return {"type": "function", "function": {"name": name}}


def call_message(call_id: str, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """An earlier reply's call as the chat request's assistant message (it joins the conversation as its JSON)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, separators=(",", ":"))
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}]}


def result_message(call_id: str, name: str | None, content: str, *, private: bool) -> dict[str, Any]:
    """A tool's result as the chat request's ``tool`` message (public unless ``private``)."""
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content, "coveil_private": private}


class HeldReply:
    """A tools reply streamed: its steps' text is held (a call is read whole) and read once the generation ends."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def hold(self, text: str) -> None:
        self.parts.append(text)

    def read(self, rest: str) -> ToolCall | str:
        """The call, or the text (``{"content": ...}``'s, else the raw text of a reply cut short)."""
        text = "".join(self.parts) + rest
        read = read_reply(text)
        return text if read is None else read
