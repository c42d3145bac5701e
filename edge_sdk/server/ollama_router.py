"""Ollama's routes on the same server: ``GET /api/version``, ``GET /api/tags``, ``POST /api/show``, ``POST /api/chat``
and ``POST /api/generate``, for the apps and tools that speak Ollama's API (many hard-code ``/api/chat`` and
``/api/tags``).

A chat or generate request is translated to the OpenAI request that asks for the same generation
(:mod:`edge_sdk.server.ollama_protocol`) and queued like one; the answer is Ollama's: one JSON object, or a
stream of newline-delimited JSON objects (``application/x-ndjson``) whose last has ``"done": true``.  Errors are
Ollama's, ``{"error": "message"}`` with the HTTP status; an error after the first token ends the stream with such
a line (the ``ollama`` client raises it).  As on the OpenAI routes, every line carries what the cloud saw in
``coveil`` (a step's report; the ledger's summary on the last line and beside a late error).  ``logprobs`` (with
``top_logprobs``) puts each token's log-probability on its line (all of them in one object), under the fused
distribution the token was chosen from, as on the OpenAI routes (:mod:`edge_sdk.server.router`).

The model is listed as ``NAME:latest`` (Ollama's spelling) and answers to ``NAME`` too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from edge_sdk.server.errors import EndpointError, validation_message
from edge_sdk.server.ollama_protocol import (
    OLLAMA_API_VERSION,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaGenerationRequest,
    OllamaLogprob,
    OllamaModel,
    OllamaModelDetails,
    OllamaPart,
    OllamaReply,
    OllamaShow,
    OllamaTags,
    OllamaTopLogprob,
)
from edge_sdk.server.protocol import ChatCompletionRequest, LedgerSummary, TokenLogprob
from edge_sdk.server.router import CLIENT_GONE, client_gone, next_unless_gone, serving_of
from edge_sdk.server.serving import Done, EdgeServing, Failed, Generation, Job, StepOut

ollama_router = APIRouter()

#: the tag Ollama gives a model named without one
DEFAULT_TAG = "latest"


def ollama_error(error: EndpointError, ledger: LedgerSummary | None = None) -> JSONResponse:
    """Ollama's error body, ``{"error": message}``, with the ledger of what had left the device (``coveil``)."""
    return JSONResponse(error_body(error, ledger), status_code=error.status, headers=error.headers)


def error_body(error: EndpointError, ledger: LedgerSummary | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"error": error.message}
    if ledger is not None:
        body["coveil"] = ledger.model_dump()
    return body


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def listed_name(served: str) -> str:
    return served if ":" in served else f"{served}:{DEFAULT_TAG}"


def check_model(serving: EdgeServing, model: str) -> None:
    served = serving.settings.served_model_name
    if model not in (served, listed_name(served)):
        raise EndpointError(404, f"model {model!r} not found: this endpoint serves {listed_name(served)!r}")


def model_details(serving: EdgeServing) -> OllamaModelDetails:
    metadata = getattr(serving.client.slm, "metadata", {})
    family = metadata.get("general.architecture", "unknown")
    return OllamaModelDetails(family=family, families=[family],
                              parameter_size=metadata.get("general.size_label", ""))


def modified_at(request: Request) -> str:
    """When the endpoint started (the model was loaded then)."""
    started = datetime.fromtimestamp(request.app.state.started, timezone.utc)
    return started.isoformat().replace("+00:00", "Z")


async def read_body(request: Request, schema: type[OllamaGenerationRequest] | None) -> Any:
    """The request's JSON, validated against ``schema``; a bad body is an :class:`EndpointError` that names the
    field, never its value."""
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


# -- model information -------------------------------------------------------------------------------


@ollama_router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION}


@ollama_router.get("/api/tags")
async def tags(request: Request) -> JSONResponse:
    serving = serving_of(request)
    name = listed_name(serving.settings.served_model_name)
    source = getattr(serving.client.slm, "source", None)
    path = getattr(source, "gguf_path", None)
    size = path.stat().st_size if path is not None and path.is_file() else 0
    model = OllamaModel(name=name, model=name, modified_at=modified_at(request), size=size, digest="",
                        details=model_details(serving))
    return JSONResponse(OllamaTags(models=[model]).model_dump())


@ollama_router.post("/api/show")
async def show(request: Request) -> JSONResponse:
    serving = serving_of(request)
    try:
        body = await read_body(request, None)
        check_model(serving, str(body.get("model") or body.get("name") or ""))
    except EndpointError as error:
        return ollama_error(error)
    details = model_details(serving)
    metadata = getattr(serving.client.slm, "metadata", {})
    info = {"general.architecture": details.family, f"{details.family}.context_length": serving.n_ctx}
    stops = "".join(f'stop "{stop}"\n' for stop in getattr(serving.chat_template, "stops", ()))
    shown = OllamaShow(modelfile=f"FROM {serving.client.slm.name}\n{stops}", parameters=stops,
                       template=metadata.get("tokenizer.chat_template", ""), details=details, model_info=info,
                       capabilities=["completion"], modified_at=modified_at(request))
    return JSONResponse(shown.model_dump())


# -- generations -------------------------------------------------------------------------------------


@ollama_router.post("/api/chat")
async def chat(request: Request) -> Response:
    return await ollama_generate(request, OllamaChatRequest, reply_field="message")


@ollama_router.post("/api/generate")
async def generate(request: Request) -> Response:
    return await ollama_generate(request, OllamaGenerateRequest, reply_field="response")


async def ollama_generate(
    connection: Request, schema: type[OllamaChatRequest | OllamaGenerateRequest], reply_field: str
) -> Response:
    """Check, translate and queue the request; answer whole or as an NDJSON stream."""
    started = time.perf_counter()
    serving = serving_of(connection)
    try:
        body = await read_body(connection, schema)
        check_model(serving, body.model)
        refused = body.refused()
        if refused is not None:
            raise EndpointError(400, f"{refused[0]} is not supported: {refused[1]}", param=refused[0])
        if isinstance(body, OllamaGenerateRequest) and not body.prompt:  # Ollama's "load the model" request
            return JSONResponse(OllamaPart(model=body.model, created_at=now_rfc3339(), response="", done=True,
                                           done_reason="load").model_dump(exclude_none=True))
        try:
            openai_request = body.as_openai(serving.settings.served_model_name)
        except ValidationError as exc:
            message, param = validation_message(exc.errors(include_input=False))
            raise EndpointError(400, message, param=param) from None
        prepare: Callable[[], Generation] = (
            (lambda: serving.prepare_chat(openai_request)) if isinstance(openai_request, ChatCompletionRequest)
            else (lambda: serving.prepare_completion(openai_request)))
        generation = await anyio.to_thread.run_sync(prepare)
        job = serving.submit(generation)
    except EndpointError as error:
        return ollama_error(error)
    lines = _Lines(body.model, reply_field, started)
    gone = asyncio.ensure_future(client_gone(connection))
    try:
        first = await next_unless_gone(job, gone)
        if first is None:
            return Response(status_code=CLIENT_GONE)
        if isinstance(first, Failed):
            return ollama_error(first.error, first.ledger)
        lines.first_token()
        if body.stream:
            return StreamingResponse(_stream(job, first, lines), media_type="application/x-ndjson")
        return await _whole(job, first, gone, lines)
    except BaseException:
        job.cancel()
        raise
    finally:
        gone.cancel()


class _Lines:
    """The reply's NDJSON objects, timed as Ollama times them (nanoseconds from the request's arrival)."""

    def __init__(self, model: str, reply_field: str, started: float) -> None:
        self.model = model
        self.reply_field = reply_field
        self.started = started
        self.first_at = started

    def first_token(self) -> None:
        self.first_at = time.perf_counter()

    def _reply(self, text: str) -> dict[str, Any]:
        return {"message": OllamaReply(content=text)} if self.reply_field == "message" else {"response": text}

    @staticmethod
    def logprobs(entries: list[TokenLogprob] | None) -> list[OllamaLogprob] | None:
        """OpenAI's per-token log-probabilities in Ollama's shape (token and log-probability, no bytes)."""
        if entries is None:
            return None
        return [OllamaLogprob(token=e.token, logprob=e.logprob, top_logprobs=[
            OllamaTopLogprob(token=t.token, logprob=t.logprob) for t in e.top_logprobs]) for e in entries]

    def part(self, text: str, step: dict, logprobs: TokenLogprob | None = None) -> OllamaPart:
        return OllamaPart(model=self.model, created_at=now_rfc3339(), done=False, coveil={"step": step},
                          logprobs=self.logprobs(None if logprobs is None else [logprobs]), **self._reply(text))

    def last(self, text: str, done: Done, logprobs: list[TokenLogprob] | None = None) -> OllamaPart:
        ended = time.perf_counter()
        return OllamaPart(
            model=self.model, created_at=now_rfc3339(), done=True, done_reason=done.finish_reason,
            total_duration=round((ended - self.started) * 1e9), load_duration=0,
            prompt_eval_count=done.usage.prompt_tokens, prompt_eval_duration=round((self.first_at - self.started) * 1e9),
            eval_count=done.usage.completion_tokens, eval_duration=round((ended - self.first_at) * 1e9),
            coveil=done.ledger, logprobs=self.logprobs(logprobs), **self._reply(text),
        )


def ndjson(part: OllamaPart) -> str:
    return part.model_dump_json(exclude_none=True) + "\n"


async def _whole(job: Job, first: StepOut | Done, gone: asyncio.Future[None], lines: _Lines) -> Response:
    pieces: list[str] = []
    logprobs: list[TokenLogprob] = []
    event: StepOut | Done | Failed | None = first
    try:
        while not isinstance(event, Done):
            if event is None:
                return Response(status_code=CLIENT_GONE)
            if isinstance(event, Failed):
                return ollama_error(event.error, event.ledger)
            pieces.append(event.text)
            if event.logprobs is not None:
                logprobs.append(event.logprobs)
            event = await next_unless_gone(job, gone)
    finally:
        job.cancel()  # a no-op once done; stops the generation if this handler is cancelled
    asked = job.generation.decoder.settings.logprobs is not None
    return JSONResponse(json.loads(ndjson(lines.last("".join(pieces) + event.text, event,
                                                     logprobs if asked else None))))


async def _stream(job: Job, first: StepOut | Done, lines: _Lines) -> AsyncIterator[str]:
    event: StepOut | Done | Failed = first
    try:
        while True:
            if isinstance(event, StepOut):
                yield ndjson(lines.part(event.text, event.report.model_dump(), event.logprobs))
            elif isinstance(event, Done):
                yield ndjson(lines.last(event.text, event))
                return
            else:
                yield json.dumps(error_body(event.error, event.ledger)) + "\n"  # the ollama client raises it
                return
            event = await job.next()
    finally:
        job.cancel()  # the client went away (or the stream ended): stop at the next step
