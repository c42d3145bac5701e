"""The HTTP routes: the OpenAI API (``/v1/...``), ``/health``, ``/coveil/info`` and the live page (``/``).

A generation's first event decides the response: an error before the first
token is an HTTP error with OpenAI's body; after it, a streamed response ends
with an ``error`` event (which the ``openai`` client raises), a complete one
with the error's status.  While a request waits in the queue or for a
complete response, its connection is watched: a client that went away has
its generation dropped or stopped (the server would otherwise decode it to the
end for nobody).  Streams are server-sent events: one chunk per decided
token (its ``coveil.step`` says what the cloud saw), a last chunk with the
finish reason and ``coveil.ledger``, the usage chunk when asked
(``stream_options.include_usage``), then ``data: [DONE]``.  With ``logprobs`` each token's chunk carries its
log-probabilities (every decided token's, a token whose text a stop string's look-ahead still holds back
included), a complete response all of them.  They are taken under the fused distribution the token was chosen
from, at the side that chose it (edge-side the edge, cloud-side the cloud, which sends them with the token),
after that step's masks (stop ids, the JSON schema, ``never_upload``), renormalised, before any temperature:
``log(f_i / sum f)``, ``f = alpha * p_llm + (1 - alpha) * p_slm`` (logit space: the log-softmax of the fused
logits); see :mod:`edge_sdk.logprobs`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from edge_sdk.policies import available_policies
from edge_sdk.server.errors import EndpointError
from edge_sdk.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChunkExtension,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    TokenLogprob,
)
from edge_sdk.server.serving import Done, EdgeServing, Event, Failed, Generation, Job, StepOut

STATIC_DIR = Path(__file__).parent / "static"

router = APIRouter()


def serving_of(request: Request) -> EdgeServing:
    return request.app.state.serving


def error_response(error: EndpointError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def failure_response(failed: Failed) -> JSONResponse:
    """A failed generation's error, with the ledger of what had left the device by then."""
    return JSONResponse(failed.body(), status_code=failed.error.status, headers=failed.error.headers)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


# -- the page and status ---------------------------------------------------------------------------------


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


#: how long ``/health`` waits for the cloud adapter's health check
CLOUD_CHECK_TIMEOUT_S = 1.0


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when a request could be served now: the SLM's worker runs and the cloud adapter reports SERVING to a
    gRPC health check; else 503 with ``status`` ``"stopped"`` or ``"cloud_unavailable"`` and ``cloud`` (the
    adapter's state: ``serving``, ``not_serving``, ``unreachable``, ``unknown``).  It needs the API key when one
    is set (``busy``/``waiting`` tell when this device's user is generating)."""
    serving = serving_of(request)
    cloud = await anyio.to_thread.run_sync(serving.client.cloud_status, CLOUD_CHECK_TIMEOUT_S)
    status = "stopped" if not serving.alive else "ok" if cloud == "serving" else "cloud_unavailable"
    body = {"status": status, "cloud": cloud, "busy": serving.busy, "waiting": serving.waiting}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/coveil/info")
async def info(request: Request) -> dict:
    """What the page needs to offer its choices: the served model, policies and defaults."""
    serving = serving_of(request)
    settings = serving.settings
    return {
        "model": settings.served_model_name,
        "edge_model": serving.client.slm.name,
        "chat_template": getattr(serving.chat_template, "source", None),
        "n_ctx": serving.n_ctx,
        "policies": available_policies(),
        "defaults": {"mode": settings.default_mode, "policy": settings.default_policy,
                     "max_tokens": settings.default_max_tokens},
        "api_key_required": request.app.state.api_key is not None,
    }


@router.get("/v1/coveil/activity")
async def activity(request: Request) -> Response:
    """This device's activity log (:meth:`edge_sdk.client.EdgeClient.activity`) as a JSON download: one record
    per generation, oldest first, ``{"activity": [...]}``; behind the API key like every path."""
    return Response(serving_of(request).client.activity_log.export(), media_type="application/json",
                    headers={"Content-Disposition": 'attachment; filename="coveil-activity.json"',
                             "Cache-Control": "no-store"})


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    return ModelList(data=[ModelCard(id=serving_of(request).settings.served_model_name,
                                     created=request.app.state.started)])


@router.get("/v1/models/{model_id}")
async def model(model_id: str, request: Request) -> Response:
    name = serving_of(request).settings.served_model_name
    if model_id != name:
        return error_response(EndpointError(404, f"the model {model_id!r} does not exist here; this endpoint serves "
                                            f"{name!r}", param="model", code="model_not_found"))
    return JSONResponse(ModelCard(id=name, created=request.app.state.started).model_dump())


# -- generations -----------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    serving = serving_of(request)
    return await generate(serving, body, lambda: serving.prepare_chat(body), _ChatFormat(body), request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = serving_of(request)
    return await generate(serving, body, lambda: serving.prepare_completion(body), _CompletionFormat(body), request)


class _ChatFormat:
    """Chat completions' response shapes."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        self.model = request.model

    def chunk(self, request_id: str, created: int, text: str, first: bool, extension: ChunkExtension,
              finish_reason: str | None = None, logprobs: TokenLogprob | None = None) -> BaseModel:
        delta = ChatDelta(role="assistant" if first else None, content=text if text or first else None)
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                 logprobs=None if logprobs is None else ChatLogprobs(content=[logprobs]))
        return ChatCompletionChunk(id=request_id, created=created, model=self.model, coveil=extension,
                                   choices=[choice])

    def usage_chunk(self, request_id: str, created: int, done: Done) -> BaseModel:
        return ChatCompletionChunk(id=request_id, created=created, model=self.model, choices=[], usage=done.usage)

    def complete(self, request_id: str, created: int, text: str, done: Done,
                 logprobs: list[TokenLogprob] | None) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=done.finish_reason,
                            logprobs=None if logprobs is None else ChatLogprobs(content=logprobs))
        return ChatCompletion(id=request_id, created=created, model=self.model, choices=[choice], usage=done.usage,
                              coveil=done.ledger)


class _CompletionFormat:
    """Text completions' response shapes (streamed chunks are ``text_completion`` objects too)."""

    def __init__(self, request: CompletionRequest) -> None:
        self.model = request.model
        self.offset = 0  # streamed: the character offset of the next token's text in the reply

    def chunk(self, request_id: str, created: int, text: str, first: bool, extension: ChunkExtension,
              finish_reason: str | None = None, logprobs: TokenLogprob | None = None) -> BaseModel:
        legacy = None
        if logprobs is not None:
            legacy = CompletionLogprobs.of([logprobs], self.offset)
            self.offset += len(logprobs.token)
        return Completion(id=request_id, created=created, model=self.model, coveil=extension,
                          choices=[CompletionChoice(text=text, finish_reason=finish_reason, logprobs=legacy)])

    def usage_chunk(self, request_id: str, created: int, done: Done) -> BaseModel:
        return Completion(id=request_id, created=created, model=self.model, choices=[], usage=done.usage)

    def complete(self, request_id: str, created: int, text: str, done: Done,
                 logprobs: list[TokenLogprob] | None) -> BaseModel:
        legacy = None if logprobs is None else CompletionLogprobs.of(logprobs)
        return Completion(id=request_id, created=created, model=self.model, usage=done.usage, coveil=done.ledger,
                          choices=[CompletionChoice(text=text, finish_reason=done.finish_reason, logprobs=legacy)])


#: the answer to a request whose client went away (nginx's "client closed request"; nobody reads it)
CLIENT_GONE = 499


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


async def generate(
    serving: EdgeServing,
    request: GenerationRequest,
    prepare: Callable[[], Generation],
    shapes: _ChatFormat | _CompletionFormat,
    connection: Request,
) -> Response:
    """Check and queue the request, wait for its first event, and answer whole or as a stream."""
    try:
        generation = await anyio.to_thread.run_sync(prepare)  # tokenising a long private context takes a while
        job = serving.submit(generation)
    except EndpointError as error:
        return error_response(error)
    created = int(time.time())
    gone = asyncio.ensure_future(client_gone(connection))
    try:
        return await _answer(job, gone, request, generation, shapes, created)
    except BaseException:
        job.cancel()
        raise
    finally:
        gone.cancel()  # a stream watches its client itself


async def _answer(
    job: Job, gone: asyncio.Future[None], request: GenerationRequest, generation: Generation,
    shapes: _ChatFormat | _CompletionFormat, created: int,
) -> Response:
    """Wait for the job's first event (while its client stays), then answer whole or as a stream."""
    first = await next_unless_gone(job, gone)
    if first is None:
        return Response(status_code=CLIENT_GONE)
    if isinstance(first, Failed):
        return failure_response(first)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _stream(job, first, shapes, generation.request_id, created, include_usage)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        event = first
        while not isinstance(event, Done):
            if isinstance(event, Failed):
                return failure_response(event)
            pieces.append(event.text)
            if event.logprobs is not None:
                logprobs.append(event.logprobs)
            event = await next_unless_gone(job, gone)
            if event is None:
                return Response(status_code=CLIENT_GONE)
    finally:
        job.cancel()  # a no-op once done; stops the generation if this handler is cancelled
    text = "".join(pieces) + event.text
    asked = generation.decoder.settings.logprobs is not None
    return JSONResponse(shapes.complete(generation.request_id, created, text, event,
                                        logprobs if asked else None).model_dump())


async def _stream(
    job: Job, first: StepOut | Done, shapes: _ChatFormat | _CompletionFormat, request_id: str, created: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    event: StepOut | Done | Failed = first
    is_first = True
    try:
        while True:
            if isinstance(event, StepOut):
                yield sse(shapes.chunk(request_id, created, event.text, is_first, ChunkExtension(step=event.report),
                                       logprobs=event.logprobs))
                is_first = False
            elif isinstance(event, Done):
                yield sse(shapes.chunk(request_id, created, event.text, is_first, ChunkExtension(ledger=event.ledger),
                                       finish_reason=event.finish_reason))
                if include_usage:
                    yield sse(shapes.usage_chunk(request_id, created, event))
                yield "data: [DONE]\n\n"
                return
            else:
                yield f"data: {json.dumps(event.body())}\n\n"  # the openai client raises it
                return
            event = await job.next()
    finally:
        job.cancel()  # the client went away (or the stream ended): stop at the next step
