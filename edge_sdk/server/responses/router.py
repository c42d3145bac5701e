"""``POST /v1/responses``: OpenAI's Responses API, stateless, whole or streamed, over the one request lifecycle.

The request becomes the chat request that asks for the same generation
(:mod:`edge_sdk.server.responses.protocol`) and is served by :func:`edge_sdk.server.lifecycle.serve_generation`.
The answer is a ``response`` object with one assistant ``message`` item, or its stream of server-sent events,
each with its ``sequence_number``: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per decided token (``coveil``: what the cloud
saw at its step), ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete`` at ``max_output_tokens``) whose response carries the
ledger's summary in ``coveil``.  Errors are OpenAI's (``{"error": {...}}`` with the status), and an ``error`` event
once a stream has begun.

With function tools the reply is read whole (:class:`edge_sdk.server.tools.HeldReply`): a call is a
``function_call`` output item, streamed once the generation ends as ``response.output_item.added``, one
``response.function_call_arguments.delta``, ``response.function_call_arguments.done`` and
``response.output_item.done``; a text reply as the text events above, in one delta.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edge_sdk.server.errors import renamed
from edge_sdk.server.lifecycle import reply_logprobs, reply_text, serve_dialect
from edge_sdk.server.openai.protocol import TokenLogprob
from edge_sdk.server.responses.protocol import (
    PARAM_NAMES,
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from edge_sdk.server.serving import Done, Event, Failed, Generation, StepOut
from edge_sdk.server.tools import HeldReply, ToolCall

responses_router = APIRouter()


@responses_router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await serve_dialect(request, ResponsesRequest, _ResponsesFormat)


class _ResponsesFormat:
    """The Responses API's dialect of the lifecycle."""

    media_type = "text/event-stream"

    def __init__(self, request: ResponsesRequest | None, tools: bool = False) -> None:
        self.request = request
        self.held = HeldReply() if tools else None
        self.response_id = f"resp_{secrets.token_hex(12)}"
        self.item_id = f"msg_{secrets.token_hex(12)}"
        self.created_at = int(time.time())
        self.sequence = 0
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []

    def response(self, status: str, output: list[OutputMessage | OutputFunctionCall],
                 done: Done | None = None) -> ResponseObject:
        request = self.request
        assert request is not None
        usage = incomplete = None
        if done is not None:
            usage = ResponseUsage(input_tokens=done.usage.prompt_tokens, output_tokens=done.usage.completion_tokens,
                                  total_tokens=done.usage.total_tokens)
            incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        text = {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)} \
            if request.text and request.text.format else {"format": {"type": "text"}}
        return ResponseObject(id=self.response_id, created_at=self.created_at, status=status, model=request.model,
                              output=output, instructions=request.instructions,
                              max_output_tokens=request.max_output_tokens, temperature=request.temperature,
                              top_p=request.top_p, text=text, metadata=request.metadata or {},
                              incomplete_details=incomplete, usage=usage,
                              tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
                              tool_choice=self._tool_choice(),
                              coveil=None if done is None else done.ledger)

    def _tool_choice(self) -> str | dict[str, Any]:
        assert self.request is not None
        choice = self.request.tool_choice
        if choice is None:
            return "auto" if self.request.tools else "none"
        return choice if isinstance(choice, str) else choice.model_dump()

    def output(self, status: str, reply: ToolCall | str,
               logprobs: list[TokenLogprob] | None) -> OutputMessage | OutputFunctionCall:
        """The reply's output item: its call, or its text."""
        if isinstance(reply, ToolCall):
            return OutputFunctionCall(id=f"fc_{secrets.token_hex(12)}", call_id=reply.id, name=reply.name,
                                      arguments=reply.arguments_json, status=status)
        return self.message(status, reply, logprobs)

    def message(self, status: str, text: str, logprobs: list[TokenLogprob] | None) -> OutputMessage:
        return OutputMessage(id=self.item_id, status=status, content=[OutputText(text=text, logprobs=logprobs)])

    def event(self, name: str, **fields: Any) -> str:
        payload = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps(payload)}\n\n"

    def _part(self, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return OutputText(text=text, logprobs=logprobs).model_dump(exclude_none=True)

    # -- the lifecycle's dialect -------------------------------------------------------------------------
    def error(self, failed: Failed) -> Response:
        error = renamed(failed.error, PARAM_NAMES)
        return JSONResponse(Failed(error, failed.ledger).body(), status_code=error.status, headers=error.headers)

    def started(self, generation: Generation) -> list[str]:
        self.logprobs_asked = generation.decoder.settings.logprobs is not None
        opening = self.response("in_progress", []).model_dump(mode="json")
        lines = [self.event("response.created", response=opening),
                 self.event("response.in_progress", response=opening)]
        return lines if self.held is not None else [*lines, *self._text_opened()]  # with tools: known at the end

    def _text_opened(self) -> list[str]:
        item = self.message("in_progress", "", None).model_dump(exclude_none=True)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", **where, part=self._part("", None))]

    def _call_events(self, call: OutputFunctionCall) -> list[str]:
        where = {"item_id": call.id, "output_index": 0}
        opened = call.model_copy(update={"arguments": "", "status": "in_progress"})
        return [self.event("response.output_item.added", output_index=0, item=opened.model_dump()),
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self.event("response.function_call_arguments.done", **where, arguments=call.arguments),
                self.event("response.output_item.done", output_index=0, item=call.model_dump())]

    def streamed(self, step: Event) -> list[str]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if isinstance(step, StepOut) and self.held is not None:  # the reply is read whole at the end
            self.held.hold(step.text)
            return []
        if isinstance(step, Done) and self.held is not None:
            status = "incomplete" if step.finish_reason == "length" else "completed"
            reply = self.held.read(step.text)
            if isinstance(reply, ToolCall):
                item = self.output(status, reply, None)
                assert isinstance(item, OutputFunctionCall)
                final = self.response(status, [item], step)
                return [*self._call_events(item),
                        self.event(f"response.{status}", response=final.model_dump(mode="json"))]
            self.held = None  # a text reply: streamed as one delta
            return [*self._text_opened(), *self.streamed(Done(step.finish_reason, step.usage, step.ledger, reply,
                                                              step.stop_string))]
        if isinstance(step, StepOut):
            self.text.append(step.text)
            logprobs = [] if step.logprobs is None else [step.logprobs.model_dump()]
            self.logprobs.extend([] if step.logprobs is None else [step.logprobs])
            return [self.event("response.output_text.delta", **where, delta=step.text, logprobs=logprobs,
                               coveil=step.report.model_dump())]
        if isinstance(step, Done):
            lines = [self.event("response.output_text.delta", **where, delta=step.text, logprobs=[])] \
                if step.text else []
            text = "".join(self.text) + step.text
            logprobs = self.logprobs if self.logprobs_asked else None
            status = "incomplete" if step.finish_reason == "length" else "completed"
            final = self.response(status, [self.message(status, text, logprobs)], step)
            return [*lines,
                    self.event("response.output_text.done", **where, text=text,
                               logprobs=[entry.model_dump() for entry in logprobs or []]),
                    self.event("response.content_part.done", **where, part=self._part(text, logprobs)),
                    self.event("response.output_item.done", output_index=0,
                               item=final.output[0].model_dump(exclude_none=True)),
                    self.event(f"response.{status}", response=final.model_dump(mode="json"))]
        error = renamed(step.error, PARAM_NAMES)
        return [self.event("error", code=error.code or error.type, message=error.message, param=error.param,
                           coveil=None if step.ledger is None else step.ledger.model_dump())]

    def whole(self, generation: Generation, steps: list[StepOut], done: Done) -> Response:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        text = reply_text(steps, done)
        item = self.output(status, text if self.held is None else self.held.read(text),
                           reply_logprobs(generation, steps))
        return JSONResponse(self.response(status, [item], done).model_dump(mode="json", exclude_none=False))
