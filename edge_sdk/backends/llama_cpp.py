"""The edge SLM on llama.cpp (through llama-cpp-python's low-level wrappers).

Built on ``llama_cpp._internals`` (model, context, batch) rather than the
high-level ``Llama`` class: that class allocates an unused
``n_batch x n_vocab`` float array (0.5 GB at 512 x 262k), and ``n_ctx x n_vocab``
when asked for every position's logits.  Here each decode asks for the logits
of its last position only, and :meth:`LlamaCppSLM.append` copies that one row
(``llama_get_logits_ith(ctx, -1)``), nothing more.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.models import ModelSource, embedded_model, tokenizer_vocab_size, vocab_fingerprint


log = logging.getLogger(__name__)

#: the ctypes callback handed to llama.cpp (kept referenced: the C side holds only a pointer)
_native_log_callback: Any = None
_native_verbose = False


def _route_native_logs(llama_cpp: Any, verbose: bool) -> None:
    """Send llama.cpp's (and ggml's) own log lines to stderr only when ``verbose``; else to this module's logger
    at DEBUG, so an app embedding the SDK prints nothing it did not ask for."""
    global _native_log_callback, _native_verbose
    _native_verbose = verbose
    if _native_log_callback is not None:
        return

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data: Any) -> None:
        line = text.decode("utf-8", errors="replace")
        if _native_verbose:
            print(line, end="", file=sys.stderr, flush=True)
        elif line.strip():
            log.debug("llama.cpp: %s", line.rstrip())

    _native_log_callback = callback
    llama_cpp.llama_log_set(callback, None)


class LlamaCppSLM:
    """A GGUF model in llama.cpp holding one sequence; a repeated prompt is served from its KV cache.

    Args:
        model: a :class:`~edge_sdk.models.ModelSource` with a GGUF path, or a path; ``None`` = embedded default.
        n_ctx: context window in tokens (private context + public query + generation).
        n_threads: decode threads (default: physical cores as llama.cpp sees them, at most 8).
        n_gpu_layers: layers to offload to a GPU build of llama.cpp (0 = CPU only, -1 = all).
        n_batch: prompt tokens per decode call during prefill.
        verbose: let llama.cpp print its load and context logs to stderr.
    """

    def __init__(
        self,
        model: ModelSource | str | os.PathLike | None = None,
        *,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        n_batch: int = 256,
        verbose: bool = False,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        _route_native_logs(llama_cpp, verbose)

        if model is None:
            model = embedded_model()
        elif not isinstance(model, ModelSource):
            path = Path(model)
            model = ModelSource(name=path.name, gguf_path=path)
        if model.gguf_path is None or not model.gguf_path.is_file():
            raise FileNotFoundError(f"the llama.cpp backend needs a GGUF file; got {model}")
        self.source = model
        self.name = model.name
        self._llama_cpp = llama_cpp
        threads = n_threads or max(1, min(8, os.cpu_count() or 1))

        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        self._model = _internals.LlamaModel(path_model=str(model.gguf_path), params=model_params, verbose=False)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        self._ctx = _internals.LlamaContext(model=self._model, params=ctx_params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_outputs = self._model.n_vocab()  # logits per row, padding rows included
        vocab = self._model.vocab
        get_text = llama_cpp.llama_vocab_get_text
        self._token_strings = [get_text(vocab, i) for i in range(self.n_outputs)]
        # the shared tokenizer ids: rows past them are padding ("[PAD<id>]") and never take part in fusion
        self.vocab_size = tokenizer_vocab_size(self._token_strings)
        del self._token_strings[self.vocab_size :]
        self.eos_token_ids = frozenset(
            i for i in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)
        ) or frozenset({self._model.token_eos()})
        self.bos_token_id = self._model.token_bos()
        #: the GGUF's key/value metadata (``general.architecture``, ``tokenizer.chat_template`` when it has one)
        self.metadata: dict[str, str] = dict(self._model.metadata())
        #: whether the tokenizer puts BOS before a text (``tokenizer.ggml.add_bos_token``)
        self.add_bos_token = bool(self._model.add_bos_token())
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNUSED | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        #: control, unused and unknown tokens ("<eos>", "<unused0>"): never text, as a tokenizer's decode skips them
        self.special_token_ids = frozenset(
            i for i in range(self.vocab_size) if llama_cpp.llama_vocab_get_attr(vocab, i) & special
        )
        self._tokens: list[int] = []
        # the last prompt prefilled (its K/V still open the cache) and its next-token logits
        self._last_prefill: tuple[list[int], np.ndarray] | None = None
        self.evaluated_tokens = 0  # tokens run through the model so far (prompt and appended)
        self._fingerprint: bytes | None = None
        self._pieces: list[bytes] | None = None  # token_pieces(), built on first use

    # -- tokenizer ---------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special``: read control-token strings (``<start_of_turn>``) as those tokens,
        as a rendered chat template needs, instead of as plain text."""
        return list(self._model.tokenize(text.encode("utf-8"), add_bos, special))

    def token_text(self, token_id: int) -> str:
        """The tokenizer's string for one id, control tokens included (``<bos>``, ``<end_of_turn>``)."""
        return self._token_strings[token_id].decode("utf-8", errors="replace")

    def detokenize(self, ids: list[int]) -> str:
        return self._model.detokenize(list(ids), special=False).decode("utf-8", errors="replace")

    def token_strings(self) -> list[bytes]:
        """Every tokenizer entry's raw string, in id order (what the vocabulary fingerprint hashes)."""
        return list(self._token_strings)

    def token_pieces(self) -> list[bytes]:
        """Every id's bytes as it adds them to a text, in id order (``▁The`` → ``b" The"``, ``<0x0A>`` →
        ``b"\\n"``; a control token as its name): what a grammar over the vocabulary matches
        (:mod:`edge_sdk.grammar`), unlike :meth:`token_strings`, the tokenizer's raw entries."""
        if self._pieces is None:
            to_piece, vocab = self._llama_cpp.llama_token_to_piece, self._model.vocab
            buffer = ctypes.create_string_buffer(1024)
            pieces = []
            for token_id in range(self.vocab_size):
                n = to_piece(vocab, token_id, buffer, len(buffer), 0, True)
                if n < 0:  # longer than the buffer: -n bytes are needed
                    buffer = ctypes.create_string_buffer(-n)
                    n = to_piece(vocab, token_id, buffer, len(buffer), 0, True)
                pieces.append(bytes(buffer[:n]))
            self._pieces = pieces
        return list(self._pieces)

    def vocab_fingerprint(self) -> bytes:
        if self._fingerprint is None:
            self._fingerprint = vocab_fingerprint(self.token_strings())
        return self._fingerprint

    # -- decoding ----------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The sequence currently in the KV cache."""
        return list(self._tokens)

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Make the cached sequence ``ids``; return the next-token logits.

        The result depends on ``ids`` alone, never on what ran before.  That
        rules out general prefix reuse: llama.cpp's numbers depend on how a
        sequence was cut into decode calls (measured on the embedded model:
        logits up to ~1.0 apart when the same prompt is evaluated whole or
        after a cached prefix of 1, 10 or 127 tokens), so the same item could
        decode differently after a different one.  Instead ``ids`` is evaluated
        from an empty cache, except that a prompt equal to the last one
        prefilled is served from the cache (its K/V are kept, the generated
        tokens after it dropped) with the logits stored then: a second policy
        or a second generation over the same private context costs nothing.
        """
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        if len(ids) >= self.n_ctx:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context window n_ctx={self.n_ctx}")
        if self._last_prefill is not None and ids == self._last_prefill[0]:
            self._truncate(len(ids))  # only append() extends the cache past the prompt
            return self._last_prefill[1].copy()
        self._last_prefill = None
        self._truncate(0)
        for start in range(0, len(ids), self.n_batch):
            self._decode(ids[start : start + self.n_batch])
        logits = self._last_logits()
        self._last_prefill = (ids, logits)
        return logits.copy()

    def append(self, token_id: int) -> np.ndarray:
        """Extend the sequence by ``token_id``; return the next-token logits."""
        if not self._tokens:
            raise RuntimeError("append before prefill: the sequence is empty")
        if len(self._tokens) + 1 >= self.n_ctx:
            raise ValueError(f"the context window n_ctx={self.n_ctx} is full")
        self._decode([int(token_id)])
        return self._last_logits()

    def _truncate(self, n: int) -> None:
        if n < len(self._tokens):
            self._ctx.kv_cache_seq_rm(-1, n, -1)
            del self._tokens[n:]

    def _decode(self, chunk: list[int]) -> None:
        self._batch.set_batch(chunk, n_past=len(self._tokens), logits_all=False)
        self._ctx.decode(self._batch)
        self._tokens.extend(chunk)
        self.evaluated_tokens += len(chunk)

    def _last_logits(self) -> np.ndarray:
        row = self._llama_cpp.llama_get_logits_ith(self._ctx.ctx, -1)
        if not row:
            raise RuntimeError("llama.cpp returned no logits for the last position")
        return np.ctypeslib.as_array(row, shape=(self.n_outputs,))[: self.vocab_size].copy()

    def close(self) -> None:
        """Free the native context and model (also done at garbage collection)."""
        self._batch.close()
        self._ctx.close()
        self._model.close()
