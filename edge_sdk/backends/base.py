"""The narrow interface the decoding loop needs from an edge language model."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class SLMBackend(Protocol):
    """A causal LM that keeps one sequence's KV cache and returns next-token logits.

    ``prefill`` sets the sequence to ``ids`` and ``append`` extends it by one
    token; both return the float32 logits of the next token over the whole
    vocabulary, as a fresh array.  ``prefill``'s result must depend on ``ids``
    alone (a backend may serve it from its cache only where that gives the same
    numbers), so that an audit's results do not depend on the order of its items.
    """

    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def vocab_fingerprint(self) -> bytes: ...

    def prefill(self, ids: list[int]) -> np.ndarray: ...

    def append(self, token_id: int) -> np.ndarray: ...
