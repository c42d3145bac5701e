"""The API dialects the endpoint serves, each written once: where its router is and what ``coveil edge serve
--help`` says it serves.  :func:`~edge_sdk.server.app.create_app` includes every router in this order; the
command's description lists what they serve (reading this module imports no FastAPI: the parser is built without
it).  A new dialect is one entry here (``docs/walkthroughs/new-route.md``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServedDialect:
    """One dialect: ``router`` its ``APIRouter`` as ``"module:attribute"``; ``serves`` its routes in words (every
    POST route named: ``tests/endpoint/test_served_dialects.py`` checks)."""

    router: str
    serves: str

    def load(self) -> Any:
        """The ``APIRouter`` (imports the dialect's module, and FastAPI with it)."""
        module, attribute = self.router.split(":")
        return getattr(importlib.import_module(module), attribute)


#: every dialect, in the order the app includes their routers
SERVED_DIALECTS = (
    ServedDialect("edge_sdk.server.openai.router:router",
                  "the OpenAI API (POST /v1/chat/completions with tools, /v1/completions, /v1/embeddings, streaming "
                  "or not; GET /v1/models, /health)"),
    ServedDialect("edge_sdk.server.ollama.router:ollama_router",
                  "Ollama's /api/chat, /api/generate, /api/embed, /api/tags, /api/show"),
    ServedDialect("edge_sdk.server.anthropic.router:anthropic_router", "Anthropic's POST /v1/messages"),
    ServedDialect("edge_sdk.server.responses.router:responses_router", "OpenAI's POST /v1/responses"),
)
