"""``POST /v1/messages``: Anthropic's Messages API, whole or streamed, over the one request lifecycle.

The request becomes the OpenAI chat request that asks for the same generation
(:mod:`edge_sdk.server.anthropic.protocol`) and is served by :func:`edge_sdk.server.lifecycle.serve_generation`;
the answer is Anthropic's: a ``message``, or a stream of server-sent events (``message_start``,
``content_block_start``, ``ping``, one ``content_block_delta`` per decided token, ``content_block_stop``,
``message_delta`` with the stop reason, ``message_stop``).  Each delta carries what the cloud saw at its step and
``message_delta`` (and a whole message) the ledger's summary, in ``coveil``.  Errors are Anthropic's,
``{"type": "error", "error": {"type", "message"}}`` with the HTTP status, and an ``error`` event once a stream
has begun (the ``anthropic`` client raises both).

With tools the reply is read whole (:class:`edge_sdk.server.tools.HeldReply`): a call is a ``tool_use`` block
(``stop_reason: "tool_use"``), streamed as its ``content_block_start`` and one ``input_json_delta``; the steps of a
streamed tools reply are ``ping`` events carrying what the cloud saw at each.
"""

from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from edge_sdk.server.anthropic.protocol import (
    PARAM_NAMES,
    BlockDelta,
    ErrorBody,
    ErrorDetail,
    Message,
    MessageDelta,
    MessagesRequest,
    MessagesUsage,
    OutputUsage,
    ResponseText,
    ResponseToolUse,
    StopDelta,
    StopReason,
    TextDelta,
)
from edge_sdk.server.errors import EndpointError, renamed
from edge_sdk.server.lifecycle import reply_text, serve_dialect
from edge_sdk.server.serving import Done, Event, Failed, Generation, StepOut
from edge_sdk.server.tools import HeldReply, ToolCall

anthropic_router = APIRouter()

#: Anthropic's error type for each HTTP status the endpoint answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(error: EndpointError) -> ErrorBody:
    """``error`` in Anthropic's shape, the parameter it names spelt as this API spells it (Anthropic's error has
    no ``param``: the message names it)."""
    error = renamed(error, PARAM_NAMES)
    named = error.message if not error.param or error.param in error.message else f"{error.param}: {error.message}"
    return ErrorBody(error=ErrorDetail(type=ERROR_TYPES.get(error.status, "api_error"), message=named))


def event(name: str, payload: BaseModel | dict) -> str:
    data = payload.model_dump_json(exclude_none=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"event: {name}\ndata: {data}\n\n"


@anthropic_router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await serve_dialect(request, MessagesRequest, _MessagesFormat)


class _MessagesFormat:
    """The Messages API's dialect of the lifecycle."""

    media_type = "text/event-stream"

    def __init__(self, request: MessagesRequest | None, tools: bool = False) -> None:
        self.model = request.model if request is not None else ""
        self.stop_sequences = tuple(request.stop_sequences or ()) if request is not None else ()
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.held = HeldReply() if tools else None

    @staticmethod
    def content(reply: ToolCall | str) -> ResponseText | ResponseToolUse:
        if isinstance(reply, ToolCall):
            return ResponseToolUse(id=f"toolu_{reply.id.removeprefix('call_')}", name=reply.name, input=reply.arguments)
        return ResponseText(text=reply)

    def stop(self, done: Done, call: bool = False) -> tuple[StopReason, str | None]:
        """Why the reply ended: a call, one of the request's stop sequences, the length limit, else the end of a turn
        (the model's end of generation, or the prompt format's own stop)."""
        if call:
            return "tool_use", None
        if done.stop_string is not None and done.stop_string in self.stop_sequences:
            return "stop_sequence", done.stop_string
        return ("max_tokens", None) if done.finish_reason == "length" else ("end_turn", None)

    def error(self, failed: Failed) -> Response:
        body = anthropic_error(failed.error)
        body.coveil = failed.ledger
        return JSONResponse(body.model_dump(exclude_none=True), status_code=failed.error.status,
                            headers=failed.error.headers)

    def started(self, generation: Generation) -> list[str]:
        usage = MessagesUsage(input_tokens=len(generation.prompts.slm_ids), output_tokens=0)
        start = Message(id=self.message_id, model=self.model, content=[], usage=usage)
        opening = [event("message_start", {"type": "message_start", "message": start.model_dump()})]
        if self.held is None:  # with tools the block is known at the end
            opening.append(self.block_start(ResponseText(text="")))
        return [*opening, event("ping", {"type": "ping"})]

    @staticmethod
    def block_start(block: ResponseText | ResponseToolUse) -> str:
        started = block.model_dump()
        if isinstance(block, ResponseToolUse):
            started["input"] = {}  # its input follows as JSON deltas
        return event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": started})

    def streamed(self, step: Event) -> list[str]:
        if isinstance(step, StepOut) and self.held is not None:
            self.held.hold(step.text)
            return [event("ping", {"type": "ping", "coveil": step.report.model_dump()})]
        if isinstance(step, StepOut):
            return [event("content_block_delta", BlockDelta(delta=TextDelta(text=step.text), coveil=step.report))]
        if isinstance(step, Done):
            call = False
            if self.held is not None:
                block = self.content(self.held.read(step.text))
                call = isinstance(block, ResponseToolUse)
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block.input, separators=(",", ":"))} \
                    if isinstance(block, ResponseToolUse) else {"type": "text_delta", "text": block.text}
                lines = [self.block_start(block),
                         event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})]
            else:
                lines = [event("content_block_delta", BlockDelta(delta=TextDelta(text=step.text)))] if step.text else []
            reason, sequence = self.stop(step, call)
            delta = MessageDelta(delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                                 usage=OutputUsage(output_tokens=step.usage.completion_tokens), coveil=step.ledger)
            return [*lines, event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    event("message_delta", delta), event("message_stop", {"type": "message_stop"})]
        body = anthropic_error(step.error)
        body.coveil = step.ledger
        return [event("error", body)]  # the anthropic client raises it

    def whole(self, generation: Generation, steps: list[StepOut], done: Done) -> Response:
        text = reply_text(steps, done)
        block = self.content(text if self.held is None else self.held.read(text))
        reason, sequence = self.stop(done, isinstance(block, ResponseToolUse))
        usage = MessagesUsage(input_tokens=done.usage.prompt_tokens, output_tokens=done.usage.completion_tokens)
        message = Message(id=self.message_id, model=self.model, content=[block],
                          stop_reason=reason, stop_sequence=sequence, usage=usage, coveil=done.ledger)
        return JSONResponse(message.model_dump())
