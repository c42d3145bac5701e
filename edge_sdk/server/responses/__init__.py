"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the endpoint's one request lifecycle.

:mod:`~edge_sdk.server.responses.protocol` reads a request against an allowlist and translates it to the chat
request that asks for the same generation; :mod:`~edge_sdk.server.responses.router` answers with a ``response``
object or its stream of ``response.*`` events.  Nothing is stored: ``store`` is accepted only as false (or
unset), and ``previous_response_id`` is refused rather than ignored (the conversation so far must be sent).
"""
