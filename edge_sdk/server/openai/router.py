"""The HTTP routes: the OpenAI API (``/v1/...``), ``/health``, ``/coveil/info`` and the live page (``/``).

Each generating route is a dialect over the one request lifecycle of :mod:`edge_sdk.server.lifecycle` (checks,
queue, disconnects): an error before the first token is an HTTP error with OpenAI's body; after it, a streamed
response ends with an ``error`` event (which the ``openai`` client raises), a complete one with the error's
status.  Streams are server-sent events: one chunk per decided
token (its ``coveil.step`` says what the cloud saw), a last chunk with the
finish reason and ``coveil.ledger``, the usage chunk when asked
(``stream_options.include_usage``), then ``data: [DONE]``.  With ``logprobs`` each token's chunk carries its
log-probabilities, sent once the stop strings' look-ahead has released its text (a token whose text a stop
string cut is not shown, and neither are its log-probabilities nor its step: the ledger counts it as
``cut_steps``), a complete response all of them.  They are taken under the fused distribution the token was chosen
from, at the side that chose it (edge-side the edge, cloud-side the cloud, which sends them with the token),
after that step's masks (stop ids, the JSON schema, ``never_upload``), renormalised, before any temperature:
``log(f_i / sum f)``, ``f = alpha * p_llm + (1 - alpha) * p_slm`` (logit space: the log-softmax of the fused
logits); see :mod:`edge_sdk.logprobs`.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from pathlib import Path

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel

from edge_sdk.policies import available_policies
from edge_sdk.server.errors import EndpointError
from edge_sdk.server.openai.protocol import (
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
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    GenerationRequest,
    ModelCard,
    ModelList,
    ReplyFunction,
    ReplyToolCall,
    TokenLogprob,
)
from edge_sdk.server.lifecycle import reply_logprobs, reply_text, serve_generation, serving_of, uses_tools
from edge_sdk.server.serving import Done, Event, Failed, Generation, StepOut
from edge_sdk.server.tools import ToolCall, read_reply

STATIC_DIR = Path(__file__).parent.parent / "static"  # the live page, beside the dialect folders

router = APIRouter()


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
    serving.cloud_seen(cloud)  # known down: generating requests are answered 503 at once for a while
    status = "stopped" if not serving.alive else "ok" if cloud == "serving" else "cloud_unavailable"
    body = {"status": status, "cloud": cloud, "busy": serving.busy, "waiting": serving.waiting}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/coveil/info")
async def info(request: Request) -> dict:
    """What the page needs to offer its choices: the served model, policies and defaults, and the run's private
    context (``--private-context-file``: its path and length, never its text), which every request without a
    private context of its own is conditioned on."""
    serving = serving_of(request)
    settings = serving.settings
    run_context = None if not serving.run_context else {
        "file": str(settings.private_context_file), "characters": len(serving.run_context)}
    return {
        "model": settings.served_model_name,
        "edge_model": serving.client.slm.name,
        "chat_template": getattr(serving.chat_template, "source", None),
        "n_ctx": serving.n_ctx,
        "policies": available_policies(),
        "defaults": {"mode": settings.default_mode, "policy": settings.default_policy,
                     "max_tokens": settings.default_max_tokens},
        "api_key_required": request.app.state.api_key is not None,
        "run_private_context": run_context,
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
    return await serve_generation(request, serving, lambda: serving.prepare_chat(body), _ChatFormat(body),
                                  stream=body.stream)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = serving_of(request)
    return await serve_generation(request, serving, lambda: serving.prepare_completion(body),
                                  _CompletionFormat(body), stream=body.stream)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """The inputs' vectors from the device's model alone (:mod:`edge_sdk.server.embeddings`): no cloud session."""
    serving = serving_of(request)
    try:
        serving.check_model(body.model)
        try:
            texts = body.texts()
        except ValueError as exc:
            raise EndpointError(400, str(exc), param="input") from None
        embedded = await anyio.to_thread.run_sync(lambda: serving.embed(texts, dimensions=body.dimensions))
    except EndpointError as error:
        return error_response(error)
    data = [Embedding(index=i, embedding=embedded.base64(i) if body.encoding_format == "base64" else vector)
            for i, vector in enumerate(embedded.vectors.tolist())]
    usage = EmbeddingUsage(prompt_tokens=embedded.prompt_tokens, total_tokens=embedded.prompt_tokens)
    answer = EmbeddingList(data=data, model=body.model, usage=usage, coveil=embedded.note())
    return Response(answer.model_dump_json(), media_type="application/json")


class _OpenAIFormat(ABC):
    """What OpenAI's two generation routes share: error bodies, server-sent events, the last chunk, ``[DONE]``."""

    media_type = "text/event-stream"

    def __init__(self, request: GenerationRequest) -> None:
        self.model = request.model
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.created = int(time.time())
        self.first = True

    def error(self, failed: Failed) -> Response:
        return failure_response(failed)

    def started(self, generation: Generation) -> list[str]:
        self.request_id = generation.request_id
        return []

    def streamed(self, event: Event) -> list[str]:
        if isinstance(event, StepOut):
            chunk = self.chunk(event.text, ChunkExtension(step=event.report), logprobs=event.logprobs)
            self.first = False
            return [sse(chunk)]
        if isinstance(event, Done):
            lines = [sse(self.chunk(event.text, ChunkExtension(ledger=event.ledger), finish_reason=event.finish_reason))]
            if self.include_usage:
                lines.append(sse(self.usage_chunk(event)))
            return [*lines, "data: [DONE]\n\n"]
        return [f"data: {json.dumps(event.body())}\n\n"]  # the openai client raises it

    def whole(self, generation: Generation, steps: list[StepOut], done: Done) -> Response:
        completion = self.complete(reply_text(steps, done), done, reply_logprobs(generation, steps))
        return JSONResponse(completion.model_dump())

    @abstractmethod
    def chunk(self, text: str, extension: ChunkExtension, finish_reason: str | None = None,
              logprobs: TokenLogprob | None = None) -> BaseModel:
        """One streamed chunk: a step's text, or (``finish_reason``) the last."""

    @abstractmethod
    def usage_chunk(self, done: Done) -> BaseModel:
        """The usage chunk (``stream_options.include_usage``)."""

    @abstractmethod
    def complete(self, text: str, done: Done, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """The whole reply."""


class _ChatFormat(_OpenAIFormat):
    """Chat completions' response shapes.  With tools the reply is read whole (:func:`edge_sdk.server.tools.read_reply`):
    a stream's steps carry no text, its last chunk the call (``finish_reason: "tool_calls"``) or the text."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        super().__init__(request)
        self.tools = uses_tools(request)
        self.held: list[str] = []  # with tools: the reply's text so far

    def reply(self, text: str, finish_reason: str) -> tuple[str | None, list[ReplyToolCall] | None, str]:
        """``(content, tool_calls, finish_reason)`` of a reply whose text is ``text``."""
        if not self.tools:
            return text, None, finish_reason
        read = read_reply(text)
        if isinstance(read, ToolCall):
            call = ReplyToolCall(index=0, id=read.id, function=ReplyFunction(name=read.name,
                                                                            arguments=read.arguments_json))
            return None, [call], "tool_calls"
        return (read if isinstance(read, str) else text), None, finish_reason

    def streamed(self, event: Event) -> list[str]:
        if self.tools and isinstance(event, StepOut):  # the step is reported; its text waits for the whole reply
            self.held.append(event.text)
            event = StepOut("", event.report, event.logprobs)
        elif self.tools and isinstance(event, Done):
            self.held.append(event.text)
            return super().streamed(Done(event.finish_reason, event.usage, event.ledger, "".join(self.held),
                                         event.stop_string))
        return super().streamed(event)

    def chunk(self, text: str, extension: ChunkExtension, finish_reason: str | None = None,
              logprobs: TokenLogprob | None = None) -> BaseModel:
        calls = None
        if self.tools and finish_reason is not None:
            text, calls, finish_reason = self.reply(text, finish_reason)
            text = text or ""
        delta = ChatDelta(role="assistant" if self.first else None, content=text if text or self.first else None,
                          tool_calls=calls)
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                 logprobs=None if logprobs is None else ChatLogprobs(content=[logprobs]))
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, coveil=extension,
                                   choices=[choice])

    def usage_chunk(self, done: Done) -> BaseModel:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=done.usage)

    def complete(self, text: str, done: Done, logprobs: list[TokenLogprob] | None) -> BaseModel:
        content, calls, finish_reason = self.reply(text, done.finish_reason)
        choice = ChatChoice(message=AssistantMessage(content=content, tool_calls=calls), finish_reason=finish_reason,
                            logprobs=None if logprobs is None else ChatLogprobs(content=logprobs))
        return ChatCompletion(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                              usage=done.usage, coveil=done.ledger)


class _CompletionFormat(_OpenAIFormat):
    """Text completions' response shapes (streamed chunks are ``text_completion`` objects too)."""

    def __init__(self, request: CompletionRequest) -> None:
        super().__init__(request)
        self.offset = 0  # streamed: the character offset of the next token's text in the reply

    def chunk(self, text: str, extension: ChunkExtension, finish_reason: str | None = None,
              logprobs: TokenLogprob | None = None) -> BaseModel:
        legacy = None
        if logprobs is not None:
            legacy = CompletionLogprobs.of([logprobs], self.offset)
            self.offset += len(logprobs.token)
        return Completion(id=self.request_id, created=self.created, model=self.model, coveil=extension,
                          choices=[CompletionChoice(text=text, finish_reason=finish_reason, logprobs=legacy)])

    def usage_chunk(self, done: Done) -> BaseModel:
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=[], usage=done.usage)

    def started(self, generation: Generation) -> list[str]:
        self.echo, self.echo_head = generation.echo, generation.echo_head
        return super().started(generation)

    def complete(self, text: str, done: Done, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """The reply; echoed, after the prompt, whose scored tokens' log-probabilities come first."""
        head = None
        if self.echo is not None:
            text, head = self.echo + text, self.echo_head
            if logprobs is not None:
                logprobs = [*(done.prompt_logprobs or []), *logprobs]
        legacy = None if logprobs is None else CompletionLogprobs.of(logprobs, unscored_head=head)
        return Completion(id=self.request_id, created=self.created, model=self.model, usage=done.usage,
                          coveil=done.ledger,
                          choices=[CompletionChoice(text=text, finish_reason=done.finish_reason, logprobs=legacy)])
