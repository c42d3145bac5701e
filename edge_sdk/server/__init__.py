"""The device's OpenAI-compatible endpoint: apps keep their ``openai`` client, the private context stays on the device.

``coveil edge serve --cloud HOST:PORT`` runs it (``pip install 'coveil[server]'``).  One module per concern:

* :mod:`~edge_sdk.server.settings`: every option and its default (the command line is built from it);
* one folder per API dialect over one lifecycle: :mod:`~edge_sdk.server.openai` (its ``protocol``: the OpenAI request
  and response schemas every dialect translates to, and the ``coveil`` extension), :mod:`~edge_sdk.server.ollama`,
  :mod:`~edge_sdk.server.anthropic`, :mod:`~edge_sdk.server.responses`, each a ``protocol`` and a ``router``;
* :mod:`~edge_sdk.server.errors`: OpenAI-style error objects, and the cloud's statuses mapped to them;
* :mod:`~edge_sdk.server.serving`: requests to prompts and decoder settings, the one SLM's queue;
* :mod:`~edge_sdk.server.lifecycle`: one request's life (check, queue, whole or streamed, disconnects), shared by
  every dialect: :mod:`~edge_sdk.server.openai.router` (OpenAI's routes), :mod:`~edge_sdk.server.ollama.router`,
  :mod:`~edge_sdk.server.anthropic` (``/v1/messages``), :mod:`~edge_sdk.server.responses` (``/v1/responses``);
* :mod:`~edge_sdk.server.embeddings`: embeddings from the device's model alone; :mod:`~edge_sdk.server.tools`: the
  tools' grammar and calls;
* :mod:`~edge_sdk.server.dialects`: each dialect named once (its router, what ``--help`` says it serves);
* :mod:`~edge_sdk.server.app`: the app, its guards, uvicorn;
* ``static/``: the live page served at ``GET /`` (no build step, nothing from the network).

``import edge_sdk`` never loads this package (nor FastAPI).
"""
