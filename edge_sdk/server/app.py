"""The FastAPI app: the routes, the request guard, OpenAI-style errors for every failure, and uvicorn.

Every request passes :class:`~edge_sdk.server.guards.RequestGuard` first (loopback host, Origin, the API key on
every path, a JSON content type on POSTs, the body's size, the page's security headers); no CORS header is ever
sent, so other origins cannot read the endpoint's answers.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from edge_sdk.activity import ActivityLog
from edge_sdk.backends.base import SLMBackend
from edge_sdk.client import EdgeClient
from edge_sdk.prompts import ChatRenderer
from edge_sdk.server.errors import EndpointError, validation_message
from edge_sdk.server.guards import RequestGuard
from edge_sdk.server.dialects import SERVED_DIALECTS
from edge_sdk.server.openai.router import STATIC_DIR
from edge_sdk.server.serving import EdgeServing
from edge_sdk.server.settings import ServerSettings

log = logging.getLogger("coveil.edge.server")

def create_app(
    settings: ServerSettings,
    *,
    client: EdgeClient,
    chat_template: ChatRenderer | None,
    n_ctx: int,
    api_key: str | None = None,
) -> FastAPI:
    """The endpoint over ``client`` (its SLM is then used by the endpoint's worker thread only)."""
    settings.check_exposure(api_key)
    serving = EdgeServing(client, chat_template, settings, n_ctx=n_ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        serving.close()

    app = FastAPI(title="CoVeil private endpoint", version="0.1.0", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.serving = serving
    app.state.api_key = api_key
    app.state.started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        error = EndpointError(400, message, param=param)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = EndpointError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(error.body(), status_code=exc.status_code)

    for dialect in SERVED_DIALECTS:
        app.include_router(dialect.load())
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(RequestGuard, host=settings.host, api_key=api_key,
                       max_request_bytes=settings.max_request_bytes)
    return app


def build_client(settings: ServerSettings) -> tuple[EdgeClient, SLMBackend, ChatRenderer]:
    """Load the SLM and its chat template and connect the edge client as ``settings`` say."""
    from edge_sdk.backends.chat_template import LlamaCppChatTemplate
    from edge_sdk.backends.llama_cpp import LlamaCppSLM
    from edge_sdk.models import resolve_model

    slm = LlamaCppSLM(resolve_model(settings.model), n_ctx=settings.n_ctx, n_threads=settings.threads)
    template = LlamaCppChatTemplate.for_model(slm, settings.chat_template)
    target = settings.cloud_addresses
    client = EdgeClient(target if len(target) > 1 else target[0], slm=slm, credentials=settings.credentials(),
                        lookahead=settings.lookahead, activity_log=ActivityLog(path=settings.activity_log))
    return client, slm, template


def serve(settings: ServerSettings) -> None:
    """Load the model and serve until SIGINT/SIGTERM (uvicorn)."""
    import uvicorn

    api_key = settings.api_key()
    settings.check_exposure(api_key)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.log_level, handlers=[handler], force=True)
    if settings.cleartext_warning():
        log.warning(settings.cleartext_warning())
    client, slm, template = build_client(settings)
    log.info("edge model %s, chat template: %s", slm.name, getattr(template, "source", "none"))
    app = create_app(settings, client=client, chat_template=template, n_ctx=settings.n_ctx, api_key=api_key)
    scheme = "https" if settings.ssl_certfile else "http"
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    log.info("serving on %s://%s:%d (page: /, OpenAI base_url: %s://%s:%d/v1), cloud adapter %s", scheme, host,
             settings.port, scheme, host, settings.port, settings.cloud)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                    ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile, log_config=None)
    finally:
        client.close()


@contextmanager
def running(app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a background thread for the block; yield its base URL (tests, benchmarks,
    an app that embeds the endpoint)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None))
    thread = threading.Thread(target=server.run, name="coveil-endpoint", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the endpoint could not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
