"""One request's life, whatever API dialect asked for it: check, queue, answer whole or streamed, cancel.

Every generating route (OpenAI's chat and completions, Ollama's chat and generate, Anthropic's messages, the
Responses API) is a :class:`Dialect` over :func:`serve_generation`: the dialect says how its answers look (its
error body, its stream's events, its whole reply), this module does everything else once:

* the request is checked and its prompts built off the event loop (``prepare``; tokenising a long private context
  takes a while), then queued (:meth:`EdgeServing.submit`); an :class:`EndpointError` before the queue is the
  dialect's error response, nothing sent to the cloud;
* the job's first event decides the response: a failure before the first token is an HTTP error in the dialect's
  shape; after it a stream ends with the dialect's error event, a whole reply is the error with its status;
* while a request waits in the queue or for a whole reply, its connection is watched: a client that went away has
  its generation dropped or stopped (the server would otherwise decode it to the end for nobody); a stream stops
  its generation when its client stops reading.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from edge_sdk.server.errors import EndpointError, validation_message
from edge_sdk.server.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenLogprob
from edge_sdk.server.serving import Done, EdgeServing, Event, Failed, Generation, Job, StepOut

ModelT = TypeVar("ModelT", bound=BaseModel)

#: the answer to a request whose client went away (nginx's "client closed request"; nobody reads it)
CLIENT_GONE = 499


class Dialect(Protocol):
    """How one API answers (one instance per request: it may keep a stream's state)."""

    #: the stream's media type (``text/event-stream``, ``application/x-ndjson``)
    media_type: str

    def error(self, failed: Failed) -> Response:
        """The response for a request that failed before its first token (or, whole, at any point)."""

    def started(self, generation: Generation) -> list[str]:
        """The first event arrived (the first token was decided): what a stream sends before it (Anthropic's
        ``message_start``, ...; a whole reply sends nothing of it)."""

    def streamed(self, event: Event) -> Iterable[str]:
        """What a stream sends for one event (a failure: its error event; the stream ends after ``Done``)."""

    def whole(self, generation: Generation, steps: list[StepOut], done: Done) -> Response:
        """The complete reply of a generation that ended with ``done``."""


def reply_text(steps: list[StepOut], done: Done) -> str:
    """The text of a whole reply: every step's showable text, then what a stop string's look-ahead held."""
    return "".join(step.text for step in steps) + done.text


def reply_logprobs(generation: Generation, steps: list[StepOut]) -> list[TokenLogprob] | None:
    """Each shown token's log-probabilities when the request asked for them, else ``None``."""
    if generation.decoder.settings.logprobs is None:
        return None
    return [step.logprobs for step in steps if step.logprobs is not None]


def stream_headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(extra or {})}


async def read_body(request: Request, schema: type[ModelT] | None) -> Any:
    """The request's JSON object, validated against ``schema`` (routes whose errors are not OpenAI's read their body
    so); a bad body is an :class:`EndpointError` that names the field, never its value."""
    try:
        payload = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EndpointError(400, "the body is not JSON") from None
    if not isinstance(payload, dict):
        raise EndpointError(400, "the body is not a JSON object")
    if schema is None:
        return payload
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_input=False))
        raise EndpointError(400, message, param=param) from None


class Translatable(Protocol):
    """A dialect's request that asks for a generation the OpenAI chat (or completion) request describes."""

    def refused(self) -> tuple[str, str] | None:
        """``(param, why)`` for the first field set to something the endpoint cannot do."""

    def as_openai(self, served_model: str) -> ChatCompletionRequest | CompletionRequest:
        """The OpenAI request for the same generation."""


def refuse(refused: tuple[str, str] | None) -> None:
    """A 400 naming the field a request's ``refused()`` found, if any."""
    if refused is not None:
        raise EndpointError(400, f"{refused[0]} is not supported: {refused[1]}", param=refused[0])


def translate(body: Translatable, served_model: str) -> ChatCompletionRequest | CompletionRequest:
    """``body``'s OpenAI request, after its own refusals (a 400 naming the field; the OpenAI request's schema
    errors too)."""
    refuse(body.refused())
    try:
        return body.as_openai(served_model)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_input=False))
        raise EndpointError(400, message, param=param) from None


def serving_of(connection: Request) -> EdgeServing:
    return connection.app.state.serving


def uses_tools(request: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the reply is read as a tools reply (a ``tool_choice`` naming no tool is refused by name when the
    request is checked: no tools until then)."""
    try:
        return isinstance(request, ChatCompletionRequest) and bool(request.called_tools())
    except ValueError:
        return False


async def serve_dialect(connection: Request, schema: type[ModelT],
                        dialect: Callable[[ModelT | None, bool], Dialect]) -> Response:
    """A dialect's route: read its body against ``schema``, translate it to the OpenAI request for the same
    generation and serve that; ``dialect(body, tools)`` answers (``dialect(None, False)``: a request refused before
    its body was read whole, in the dialect's error shape)."""
    serving = serving_of(connection)
    try:
        body = await read_body(connection, schema)
        serving.check_model(body.model)
        request = translate(body, serving.settings.served_model_name)
    except EndpointError as error:
        return dialect(None, False).error(Failed(error))
    return await serve_generation(connection, serving, prepare_for(serving, request), dialect(body, uses_tools(request)),
                                  stream=bool(getattr(body, "stream", False)))


def prepare_for(serving: EdgeServing, request: ChatCompletionRequest | CompletionRequest) -> Callable[[], Generation]:
    """What checks ``request`` and builds its generation (off the event loop)."""
    if isinstance(request, ChatCompletionRequest):
        return lambda: serving.prepare_chat(request)
    return lambda: serving.prepare_completion(request)


async def client_gone(connection: Request) -> None:
    """Return once ``connection``'s client has gone away (its body is read: the next message is the disconnect).

    ``Request.is_disconnected`` cannot tell behind the app's HTTP middleware (its receive never answers in a
    cancelled scope), so this waits for the message itself."""
    while (await connection.receive())["type"] != "http.disconnect":
        pass


async def next_unless_gone(job: Job, gone: asyncio.Future[None]) -> Event | None:
    """The job's next event, or ``None`` (the job cancelled) once ``gone`` says the client went away."""
    pending = asyncio.ensure_future(job.next())
    done, _ = await asyncio.wait({pending, gone}, return_when=asyncio.FIRST_COMPLETED)
    if pending in done:
        return pending.result()
    pending.cancel()
    job.cancel()
    return None


async def serve_generation(
    connection: Request, serving: EdgeServing, prepare: Callable[[], Generation], dialect: Dialect, *, stream: bool
) -> Response:
    """Check and queue the request ``prepare`` builds, wait for its first event, and answer whole or streamed in
    ``dialect``'s shapes."""
    try:
        serving.check_cloud()  # known down: a 503 at once
        generation = await anyio.to_thread.run_sync(prepare)
        job = serving.submit(generation)
    except EndpointError as error:
        return dialect.error(Failed(error))
    gone = asyncio.ensure_future(client_gone(connection))
    try:
        first = await next_unless_gone(job, gone)
        if first is None:
            return Response(status_code=CLIENT_GONE)
        if isinstance(first, Failed):
            return dialect.error(first)
        opening = dialect.started(generation)
        if stream:
            return StreamingResponse(_stream(job, opening, first, dialect), media_type=dialect.media_type,
                                     headers=stream_headers())
        return await _whole(job, first, gone, dialect)
    except BaseException:
        job.cancel()
        raise
    finally:
        gone.cancel()  # a stream watches its client itself


async def _whole(job: Job, first: StepOut | Done, gone: asyncio.Future[None], dialect: Dialect) -> Response:
    steps: list[StepOut] = []
    event: Event | None = first
    try:
        while not isinstance(event, Done):
            if event is None:
                return Response(status_code=CLIENT_GONE)
            if isinstance(event, Failed):
                return dialect.error(event)
            steps.append(event)
            event = await next_unless_gone(job, gone)
    finally:
        job.cancel()  # a no-op once done; stops the generation if this handler is cancelled
    return dialect.whole(job.generation, steps, event)


async def _stream(job: Job, opening: list[str], first: StepOut | Done, dialect: Dialect) -> AsyncIterator[str]:
    event: Event = first
    try:
        for line in opening:
            yield line
        while True:
            for line in dialect.streamed(event):
                yield line
            if not isinstance(event, StepOut):
                return
            event = await job.next()
    finally:
        job.cancel()  # the client went away (or the stream ended): stop at the next step
