"""llama-cpp-python's own OpenAI-compatible server with the embedded model, on loopback, for the endpoint tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

MODEL_ALIAS = "gemma-3-270m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_cpp_server(n_ctx: int = 4096, n_threads: int = 1,
                     chat_format: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """The server's base URL (``http://127.0.0.1:PORT/v1``, model ``gemma-3-270m``) and its process.

    ``chat_format`` names llama-cpp-python's chat format (the embedded GGUF carries no chat template, and without
    one the server falls back to Llama-2's: ``gemma`` is the model's own)."""
    from edge_sdk.models import embedded_gguf_path

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(embedded_gguf_path()), "--host", "127.0.0.1",
         "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(n_threads), "--model_alias", MODEL_ALIAS,
         *(["--chat_format", chat_format] if chat_format else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/models", timeout=2)
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("llama_cpp.server did not come up")
            time.sleep(0.5)
    try:
        yield base, process
    finally:
        process.terminate()
        process.wait(timeout=30)
