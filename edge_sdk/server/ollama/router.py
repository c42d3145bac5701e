"""Ollama's routes on the same server: ``GET /api/version``, ``GET /api/tags``, ``POST /api/show``, ``POST /api/chat``,
``POST /api/generate`` and ``POST /api/embed`` (the device's model alone, :mod:`edge_sdk.server.embeddings`), for the apps and tools that speak Ollama's API (many hard-code ``/api/chat`` and
``/api/tags``).

A chat or generate request is translated to the OpenAI request that asks for the same generation
(:mod:`edge_sdk.server.ollama.protocol`) and served by the one request lifecycle
(:mod:`edge_sdk.server.lifecycle`); the answer is Ollama's: one JSON object, or a
stream of newline-delimited JSON objects (``application/x-ndjson``) whose last has ``"done": true``.  Errors are
Ollama's, ``{"error": "message"}`` with the HTTP status; an error after the first token ends the stream with such
a line (the ``ollama`` client raises it).  As on the OpenAI routes, every line carries what the cloud saw in
``coveil`` (a step's report; the ledger's summary on the last line and beside a late error); as the ``ollama``
client drops that field, a whole reply (and an error after steps were sent) also carries the summary in
``X-Coveil-*`` response headers.  ``logprobs`` (with
``top_logprobs``) puts each token's log-probability on its line (all of them in one object), under the fused
distribution the token was chosen from, as on the OpenAI routes (:mod:`edge_sdk.server.openai.router`).

The model is listed as ``NAME:latest`` (Ollama's spelling) and answers to ``NAME`` too.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from edge_sdk.server.errors import EndpointError
from edge_sdk.server.ollama.protocol import (
    OLLAMA_API_VERSION,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    OllamaGenerateRequest,
    OllamaLogprob,
    OllamaModel,
    OllamaModelDetails,
    OllamaPart,
    OllamaFunction,
    OllamaReply,
    OllamaToolCall,
    OllamaShow,
    OllamaTags,
    OllamaTopLogprob,
)
from edge_sdk.server.openai.protocol import LedgerSummary, TokenLogprob
from edge_sdk.server.lifecycle import (
    prepare_for,
    read_body,
    refuse,
    reply_logprobs,
    reply_text,
    serve_generation,
    serving_of,
    translate,
    uses_tools,
)
from edge_sdk.server.serving import Done, EdgeServing, Event, Failed, Generation, StepOut
from edge_sdk.server.tools import ToolCall, read_reply

ollama_router = APIRouter()

#: the tag Ollama gives a model named without one
DEFAULT_TAG = "latest"


def ollama_error(error: EndpointError, ledger: LedgerSummary | None = None) -> JSONResponse:
    """Ollama's error body, ``{"error": message}``, with the ledger of what had left the device (``coveil``)."""
    headers = {**error.headers, **(ledger_headers(ledger) if ledger is not None else {})}
    return JSONResponse(error_body(error, ledger), status_code=error.status, headers=headers)


def ledger_headers(ledger: LedgerSummary) -> dict[str, str]:
    """What left the device, as response headers: the ``ollama`` client drops the body's ``coveil`` field, an app
    (or ``curl -i``) can still read these.  ASCII (``epsilon`` for the Greek letter)."""
    summary = ledger.summary.replace("\u03b5", "epsilon").replace("\u03b4", "delta")
    return {"X-Coveil-Summary": summary.encode("ascii", "replace").decode("ascii"),
            "X-Coveil-Mode": ledger.mode, "X-Coveil-Policy": ledger.policy,
            "X-Coveil-Bytes-Up": str(ledger.bytes_up), "X-Coveil-Bytes-Down": str(ledger.bytes_down),
            "X-Coveil-Values-Uploaded": str(ledger.values_uploaded),
            "X-Coveil-Full-Requests": str(ledger.full_requests),
            "X-Coveil-Leakage-Meter": f"{ledger.leakage_meter:.4f}"}


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
                       capabilities=["completion", "embedding", "tools"], modified_at=modified_at(request))
    return JSONResponse(shown.model_dump())


# -- generations -------------------------------------------------------------------------------------


@ollama_router.post("/api/chat")
async def chat(request: Request) -> Response:
    return await ollama_generate(request, OllamaChatRequest, reply_field="message")


@ollama_router.post("/api/generate")
async def generate(request: Request) -> Response:
    return await ollama_generate(request, OllamaGenerateRequest, reply_field="response")


@ollama_router.post("/api/embed")
async def embed(request: Request) -> Response:
    """The inputs' vectors from the device's model alone (:mod:`edge_sdk.server.embeddings`): no cloud session."""
    started = time.perf_counter()
    serving = serving_of(request)
    try:
        body = await read_body(request, OllamaEmbedRequest)
        check_model(serving, body.model)
        refuse(body.refused())
        texts = [body.input] if isinstance(body.input, str) else body.input
        embedded = await anyio.to_thread.run_sync(
            lambda: serving.embed(texts, dimensions=body.dimensions, truncate=body.truncate))
    except EndpointError as error:
        return ollama_error(error)
    answer = OllamaEmbedResponse(model=body.model, embeddings=embedded.vectors.tolist(),
                                 total_duration=round((time.perf_counter() - started) * 1e9), load_duration=0,
                                 prompt_eval_count=embedded.prompt_tokens, coveil=embedded.note())
    return Response(answer.model_dump_json(), media_type="application/json")


async def ollama_generate(
    connection: Request, schema: type[OllamaChatRequest | OllamaGenerateRequest], reply_field: str
) -> Response:
    """Check and translate the request; the one lifecycle queues it and answers whole or as an NDJSON stream."""
    started = time.perf_counter()
    serving = serving_of(connection)
    try:
        body = await read_body(connection, schema)
        check_model(serving, body.model)
        if isinstance(body, OllamaGenerateRequest) and not body.prompt and body.refused() is None:
            # Ollama's "load the model" request
            return JSONResponse(OllamaPart(model=body.model, created_at=now_rfc3339(), response="", done=True,
                                           done_reason="load").model_dump(exclude_none=True))
        openai_request = translate(body, serving.settings.served_model_name)
    except EndpointError as error:
        return ollama_error(error)
    tools = uses_tools(openai_request)
    return await serve_generation(connection, serving, prepare_for(serving, openai_request),
                                  _Lines(body.model, reply_field, started, tools=tools), stream=body.stream)


class _Lines:
    """Ollama's dialect: the reply's NDJSON objects, timed as Ollama times them (nanoseconds from the request's
    arrival)."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, reply_field: str, started: float, *, tools: bool = False) -> None:
        self.model = model
        self.tools = tools  # the reply is read whole: steps carry no text, the last line the call or the text
        self.held: list[str] = []
        self.reply_field = reply_field
        self.arrived = started  # when the request arrived
        self.first_at = started

    def _reply(self, text: str) -> dict[str, Any]:
        return {"message": OllamaReply(content=text)} if self.reply_field == "message" else {"response": text}

    def _last_reply(self, text: str) -> dict[str, Any]:
        """The last line's reply: with tools, the call the whole text made (or the text it answered)."""
        if not self.tools:
            return self._reply(text)
        read = read_reply(text)
        if isinstance(read, ToolCall):
            call = OllamaToolCall(function=OllamaFunction(name=read.name, arguments=read.arguments))
            return {"message": OllamaReply(content="", tool_calls=[call])}
        return self._reply(read if isinstance(read, str) else text)

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
        first_at = self.first_at  # when the first token was decided
        return OllamaPart(
            model=self.model, created_at=now_rfc3339(), done=True, done_reason=done.finish_reason,
            total_duration=round((ended - self.arrived) * 1e9), load_duration=0,
            prompt_eval_count=done.usage.prompt_tokens, prompt_eval_duration=round((first_at - self.arrived) * 1e9),
            eval_count=done.usage.completion_tokens, eval_duration=round((ended - first_at) * 1e9),
            coveil=done.ledger, logprobs=self.logprobs(logprobs), **self._last_reply(text),
        )

    # -- the lifecycle's dialect -------------------------------------------------------------------------
    def error(self, failed: Failed) -> Response:
        return ollama_error(failed.error, failed.ledger)

    def started(self, generation: Generation) -> list[str]:
        self.first_at = time.perf_counter()
        return []

    def streamed(self, event: Event) -> list[str]:
        if isinstance(event, StepOut):
            self.held.append(event.text)
            return [ndjson(self.part("" if self.tools else event.text, event.report.model_dump(), event.logprobs))]
        if isinstance(event, Done):
            return [ndjson(self.last("".join(self.held) + event.text if self.tools else event.text, event))]
        return [json.dumps(error_body(event.error, event.ledger)) + "\n"]  # the ollama client raises it

    def whole(self, generation: Generation, steps: list[StepOut], done: Done) -> Response:
        part = self.last(reply_text(steps, done), done, reply_logprobs(generation, steps))
        return JSONResponse(json.loads(ndjson(part)), headers=ledger_headers(done.ledger))


def ndjson(part: OllamaPart) -> str:
    return part.model_dump_json(exclude_none=True) + "\n"
