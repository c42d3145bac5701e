"""Structured output: a JSON schema as a mask over the vocabulary, applied where the token is chosen.

:class:`JsonConstraint` follows one generation: :meth:`~JsonConstraint.allowed` is the set of ids that keep the
text a prefix of a JSON document valid under the schema (an end-of-generation id only once it is complete), and
:meth:`~JsonConstraint.consume` advances it by the chosen id.  It is a processor of the decoder's decide step
(:class:`edge_sdk.steps.ChoiceProcessor`): the decoder masks the fused distribution with it before the policy
picks (edge-side fusion): a disallowed id gets probability 0 (or the lowest logit), the rest are
renormalised, so the choice is the policy's among the ids the schema allows.  The schema is public: it depends on
nothing private, nor does the mask, which follows the generated tokens the cloud already sees.

The grammar engine is llguidance (Microsoft's Rust library behind Guidance, maintained, CPU-only wheels): it
compiles a JSON schema in milliseconds and computes a mask over Gemma's 262,144 ids in about 0.25 ms; it is
imported only when a constraint is built, so ``import edge_sdk`` stays numpy-only.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Protocol

import numpy as np

#: the schema ``response_format: {"type": "json_object"}`` (Ollama's ``format: "json"``) stands for
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile (its message names why, never quotes private text)."""


class GrammarVocabulary(Protocol):
    """What a constraint reads of a tokenizer (an :class:`~edge_sdk.backends.base.SLMBackend` has it all)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]

    def token_pieces(self) -> list[bytes]: ...

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]: ...


class _Tokenizer:
    """The vocabulary as llguidance's ``TokenizerWrapper`` reads it: the ids of ``end_ids`` end the generation and
    are never text (``</s>``, id 212, is text to transformers' Gemma tokenizer and an end to llama.cpp's).

    llguidance writes a string the grammar forces (a ``const``) as the tokenizer tokenises it, so both sides must
    tokenise it alike: the text of an id that is never text (an end, a control token) is tokenised character by
    character, on either side (transformers would write ``</s>`` as id 212, llama.cpp as three text tokens)."""

    def __init__(self, vocabulary: GrammarVocabulary, end_ids: frozenset[int]) -> None:
        self.eos_token_id = min(end_ids)
        self.bos_token_id = vocabulary.bos_token_id
        self.tokens = vocabulary.token_pieces()[: vocabulary.vocab_size]  # the bytes each id adds to the text
        not_text = vocabulary.special_token_ids | end_ids
        self.special_token_ids = sorted(not_text)
        self._vocabulary = vocabulary
        spelt = {self.tokens[i].decode("utf-8", errors="replace") for i in not_text if i < len(self.tokens)}
        alternatives = sorted((piece for piece in spelt if piece), key=len, reverse=True)
        self._not_text = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def _text(self, text: str) -> list[int]:
        return self._vocabulary.tokenize(text, add_bos=False) if text else []

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if self._not_text is None:
            return self._text(text)
        ids: list[int] = []
        start = 0
        for found in self._not_text.finditer(text):
            ids += self._text(text[start : found.start()])
            ids += [i for character in found.group() for i in self._text(character)]
            start = found.end()
        return ids + self._text(text[start:])


#: (id(vocabulary), end ids) -> (vocabulary, llguidance.LLTokenizer) (building one takes ~0.8 s)
_tokenizers: dict[tuple[int, frozenset[int]], Any] = {}
_tokenizers_lock = threading.Lock()


def _lltokenizer(vocabulary: GrammarVocabulary, end_ids: frozenset[int]) -> Any:
    from llguidance import LLTokenizer, TokenizerWrapper

    with _tokenizers_lock:
        cached = _tokenizers.get((id(vocabulary), end_ids))
        if cached is None or cached[0] is not vocabulary:
            tokenizer = LLTokenizer(TokenizerWrapper(_Tokenizer(vocabulary, end_ids)), eos_token=sorted(end_ids))
            cached = _tokenizers[(id(vocabulary), end_ids)] = (vocabulary, tokenizer)
        return cached[1]


class JsonConstraint:
    """The ids that keep one generation's text valid JSON under ``schema`` (see the module docstring).

    ``end_ids``: the ids that end the generation (default: the vocabulary's own ends).  Both sides of a session
    must compile the grammar over one end set, the public one the session agreed when it opened
    (:attr:`edge_sdk.wire.SessionInfo.eos_token_ids`: the cloud's ends and the edge's), else one side may pick
    an id the other reads as text, or as an end inside a string (:meth:`agree_end_ids`).

    Raises :class:`GrammarError` when the schema cannot be compiled.
    """

    def __init__(self, vocabulary: GrammarVocabulary, schema: dict[str, Any], *,
                 end_ids: frozenset[int] | None = None) -> None:
        if not callable(getattr(vocabulary, "token_pieces", None)):
            raise TypeError(f"structured output needs the SLM's token_pieces() (the llama.cpp backend has them); "
                            f"{type(vocabulary).__name__} has none")
        self._vocabulary = vocabulary
        self.vocab_size = vocabulary.vocab_size
        self.schema = schema
        self.end_ids = frozenset(vocabulary.eos_token_ids if end_ids is None else end_ids)
        self._consumed: list[int] = []
        self._matcher = self._compile()

    def _compile(self) -> Any:
        from llguidance import LLMatcher

        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(self.schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
        matcher = LLMatcher(_lltokenizer(self._vocabulary, self.end_ids), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        return matcher

    def agree_end_ids(self, end_ids: frozenset[int]) -> None:
        """Follow the session's agreed end set from now on (recompiled and advanced past the tokens consumed so
        far; nothing changes when it is already this constraint's)."""
        end_ids = frozenset(end_ids)
        if end_ids == self.end_ids:
            return
        self.end_ids = end_ids
        self._matcher = self._compile()
        for token in self._consumed:
            if not self._matcher.consume_token(int(token)):
                raise ValueError(f"token {token} is outside the JSON grammar under the agreed end set")

    def allowed(self) -> np.ndarray:
        """A boolean row over the vocabulary: ``True`` where the id may come next."""
        bias = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)[: self.vocab_size]
        return bias > 0

    def consume(self, token_id: int) -> None:
        if not self._matcher.consume_token(int(token_id)):
            raise ValueError(f"token {token_id} is outside the JSON grammar: {self._matcher.get_error()}")
        self._consumed.append(int(token_id))


def mask_row(row: np.ndarray, allowed: np.ndarray, *, lowest: float) -> np.ndarray:
    """``row`` (one distribution over the vocabulary, in probability or logit space) restricted to ``allowed``.

    Logit space (``lowest`` < 0): disallowed ids set to ``lowest``.  Probability space (``lowest`` = 0):
    ``p'_i = p_i / sum_{j allowed} p_j`` for allowed ``i``, else 0; if the allowed ids hold no mass at all,
    uniform over them (the choice must stay inside the grammar).
    """
    masked = np.where(allowed, row, np.float32(lowest)).astype(np.float32)
    if lowest < 0:
        return masked
    total = masked.sum(dtype=np.float64)
    if total > 0:
        return (masked / np.float32(total)).astype(np.float32)
    return (allowed / np.float32(allowed.sum())).astype(np.float32)
