"""Anthropic's Messages API (``POST /v1/messages``) over the endpoint's one request lifecycle.

:mod:`~edge_sdk.server.anthropic.protocol` reads a request against an allowlist and translates it to the OpenAI
chat request that asks for the same generation; :mod:`~edge_sdk.server.anthropic.router` answers in Anthropic's
shapes (a ``message``, its server-sent events, ``{"type": "error", "error": {...}}``).
"""
