"""Embeddings from the device's own model: ``/v1/embeddings`` (OpenAI) and ``/api/embed`` (Ollama).

An embedding is computed by the edge SLM's GGUF alone, through llama.cpp's embedding API, and nothing of the
input, nor of the request at all, reaches the cloud adapter: a RAG index of private documents can stay on the
device whole.  The vector of a text is

    e(x) = m / ||m||_2,   m = (1/n) * sum_{t=1..n} h_t(x)

the **mean** of the model's last hidden states ``h_t`` over the text's ``n`` tokens (BOS included, as llama.cpp
tokenises it), L2-normalised (as OpenAI's and Ollama's embeddings are: a dot product is the cosine).  The base
Gemma-3 270M is not trained as an embedding model, so its vectors are weaker for retrieval than a dedicated
embedder's; the pooling is stated in every response (``coveil.pooling``).

It runs on a second llama.cpp context over the same weights (loaded on the first request, memory-mapped), so an
embedding does not disturb the generating context's KV cache; it shares the device's cores with generations.
Inputs are batched: as many sequences per llama.cpp decode as fit in the context window.
"""

from __future__ import annotations

import base64
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.server.openai.protocol import EmbeddingExtension

#: how each text's token states become one vector (stated in every response)
POOLING = "mean"
#: the most texts one request may embed (OpenAI's limit)
MAX_INPUTS = 2048
#: tokens a tokenizer may add to a text's own (BOS, EOS)
_ADDED_TOKENS = 2


class InputTooLong(ValueError):
    """An input has more tokens than the context window and may not be truncated."""

    def __init__(self, position: int, tokens: int, limit: int) -> None:
        super().__init__(f"input[{position}] has {tokens} tokens, over the model's context of {limit}")
        self.position = position


@dataclass(frozen=True)
class Embedded:
    """The vectors of a request's texts, in order (``float32``, unit length), and the tokens they took."""

    vectors: np.ndarray
    prompt_tokens: int
    model_name: str

    def note(self) -> EmbeddingExtension:
        """The response's ``coveil`` field: where the vectors came from, and that nothing left the device."""
        return EmbeddingExtension(pooling=POOLING, summary=f"embedded on the device by {self.model_name} "
                                  f"({POOLING} pooling, L2-normalised); nothing was sent to the cloud")

    def base64(self, index: int) -> str:
        """Vector ``index`` as OpenAI's ``encoding_format: "base64"``: its little-endian float32 bytes."""
        return base64.b64encode(self.vectors[index].astype("<f4").tobytes()).decode("ascii")


class DeviceEmbedder:
    """The edge model's GGUF loaded for embeddings (see the module docstring); thread-safe, one batch at a time.

    Args:
        gguf_path: the edge SLM's weights.
        n_ctx: the longest input, in tokens (also the tokens one llama.cpp decode may hold).
        n_threads: llama.cpp threads (default: the cores, at most 8).
    """

    def __init__(self, gguf_path: Path, *, n_ctx: int, n_threads: int | None = None) -> None:
        self.gguf_path = gguf_path
        self.n_ctx = n_ctx
        self.n_threads = n_threads or max(1, min(8, os.cpu_count() or 1))
        self._llama = None
        self._lock = threading.Lock()

    def _model(self):  # noqa: ANN202  (llama_cpp.Llama, imported here)
        if self._llama is None:
            import llama_cpp

            self._llama = llama_cpp.Llama(
                model_path=str(self.gguf_path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx, n_threads=self.n_threads,
                n_threads_batch=self.n_threads, verbose=False)
        return self._llama

    @property
    def dimensions(self) -> int:
        with self._lock:
            return int(self._model().n_embd())

    def embed(self, texts: list[str], *, truncate: bool = False) -> Embedded:
        """Each text's vector; ``truncate``: cut an input past the context window to its first ``n_ctx`` tokens
        (else :class:`InputTooLong` names it, before anything is computed)."""
        with self._lock:
            llama = self._model()
            if not truncate:  # only a text of more bytes than the context could hold more tokens (a token is at
                # least a byte, beside the BOS and EOS a tokenizer may add): the rest are tokenised once, embedding
                for position, text in enumerate(texts):
                    data = text.encode("utf-8")
                    if len(data) + _ADDED_TOKENS > self.n_ctx and (count := len(llama.tokenize(data))) > self.n_ctx:
                        raise InputTooLong(position, count, self.n_ctx)
            pooled, tokens = llama.embed(texts, normalize=False, truncate=True, return_count=True)
        pooled = np.asarray(pooled, dtype=np.float32)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        vectors = pooled / np.where(norms > 0, norms, np.float32(1))
        return Embedded(vectors.astype(np.float32), int(tokens), self.gguf_path.name)
