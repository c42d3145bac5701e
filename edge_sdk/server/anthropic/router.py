"""``POST /v1/messages``: Anthropic's Messages API, whole or streamed, over the one request lifecycle.

The request becomes the OpenAI chat request that asks for the same generation
(:mod:`edge_sdk.server.anthropic.protocol`) and is served by :func:`edge_sdk.server.lifecycle.serve_generation`;
the answer is Anthropic's: a ``message``, or a stream of server-sent events (``message_start``,
``content_block_start``, ``ping``, one ``content_block_delta`` per decided token, ``content_block_stop``,
``message_delta`` with the stop reason, ``message_stop``).  Each delta carries what the cloud saw at its step and
``message_delta`` (and a whole message) the ledger's summary, in ``coveil``.  Errors are Anthropic's,
``{"type": "error", "error": {"type", "message"}}`` with the HTTP status, and an ``error`` event once a stream
has begun (the ``anthropic`` client raises both).
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
    StopDelta,
    StopReason,
    TextDelta,
)
from edge_sdk.server.errors import EndpointError, renamed
from edge_sdk.server.lifecycle import prepare_for, read_body, reply_text, serve_generation, translate
from edge_sdk.server.router import serving_of
from edge_sdk.server.serving import Done, Event, Failed, Generation, StepOut

anthropic_router = APIRouter()

#: Anthropic's error type for each HTTP status the endpoint answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(error: EndpointError) -> ErrorBody:
    """``error`` in Anthropic's shape, the parameter it names spelt as this API spells it."""
    return ErrorBody(error=ErrorDetail(type=ERROR_TYPES.get(error.status, "api_error"),
                                       message=renamed(error, PARAM_NAMES).message))


def event(name: str, payload: BaseModel | dict) -> str:
    data = payload.model_dump_json(exclude_none=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"event: {name}\ndata: {data}\n\n"


@anthropic_router.post("/v1/messages")
async def messages(request: Request) -> Response:
    serving = serving_of(request)
    try:
        body = await read_body(request, MessagesRequest)
        serving.check_model(body.model)
        chat = translate(body, serving.settings.served_model_name)
    except EndpointError as error:
        return _MessagesFormat(None).error(Failed(error))
    return await serve_generation(request, serving, prepare_for(serving, chat), _MessagesFormat(body),
                                  stream=body.stream)


class _MessagesFormat:
    """The Messages API's dialect of the lifecycle."""

    media_type = "text/event-stream"

    def __init__(self, request: MessagesRequest | None) -> None:
        self.model = request.model if request is not None else ""
        self.stop_sequences = tuple(request.stop_sequences or ()) if request is not None else ()
        self.message_id = f"msg_{secrets.token_hex(12)}"

    def stop(self, done: Done) -> tuple[StopReason, str | None]:
        """Why the reply ended: one of the request's stop sequences, the length limit, else the end of a turn (the
        model's end of generation, or the prompt format's own stop)."""
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
        return [event("message_start", {"type": "message_start", "message": start.model_dump()}),
                event("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}}),
                event("ping", {"type": "ping"})]

    def streamed(self, step: Event) -> list[str]:
        if isinstance(step, StepOut):
            return [event("content_block_delta", BlockDelta(delta=TextDelta(text=step.text), coveil=step.report))]
        if isinstance(step, Done):
            lines = [event("content_block_delta", BlockDelta(delta=TextDelta(text=step.text)))] if step.text else []
            reason, sequence = self.stop(step)
            delta = MessageDelta(delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                                 usage=OutputUsage(output_tokens=step.usage.completion_tokens), coveil=step.ledger)
            return [*lines, event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    event("message_delta", delta), event("message_stop", {"type": "message_stop"})]
        body = anthropic_error(step.error)
        body.coveil = step.ledger
        return [event("error", body)]  # the anthropic client raises it

    def whole(self, generation: Generation, steps: list[StepOut], done: Done) -> Response:
        reason, sequence = self.stop(done)
        usage = MessagesUsage(input_tokens=done.usage.prompt_tokens, output_tokens=done.usage.completion_tokens)
        message = Message(id=self.message_id, model=self.model, content=[ResponseText(text=reply_text(steps, done))],
                          stop_reason=reason, stop_sequence=sequence, usage=usage, coveil=done.ledger)
        return JSONResponse(message.model_dump())
