"""OpenAI's API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``) and the
endpoint's own routes (``/health``, ``/coveil/info``, the live page) over the endpoint's one request lifecycle.

:mod:`~edge_sdk.server.openai.protocol` holds the OpenAI request and response schemas (every other dialect
translates its request to the OpenAI one that asks for the same generation) and the ``coveil`` extension;
:mod:`~edge_sdk.server.openai.router` answers in OpenAI's shapes.
"""
