"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``, ``/api/show``, ``/api/version``)
over the endpoint's one request lifecycle.

:mod:`~edge_sdk.server.ollama.protocol` reads a request against an allowlist and translates it to the OpenAI
request that asks for the same generation; :mod:`~edge_sdk.server.ollama.router` answers in Ollama's shapes (one
JSON object, or NDJSON lines, timed as Ollama times them).
"""
