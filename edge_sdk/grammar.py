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
import time
from typing import Any, Protocol

import numpy as np

#: the schema ``response_format: {"type": "json_object"}`` (Ollama's ``format: "json"``) stands for
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile (its message names why, never quotes private text)."""


class PrivateSchemaError(GrammarError):
    """A cloud-side schema that holds private text (:func:`check_public_schema`); its message names the path in the
    schema and never quotes the text."""


#: JSON Schema keywords whose string value is a name of the schema language, never an app's text
_LANGUAGE_VALUES = frozenset({"type", "format", "$schema", "$ref", "$id", "$anchor", "$dynamicRef",
                              "contentEncoding", "contentMediaType"})
#: JSON Schema keywords (keys) that are the language's own words; every other key is an app's name (a property)
_KEYWORDS = frozenset({
    "type", "format", "$schema", "$ref", "$id", "$anchor", "$dynamicRef", "$defs", "definitions", "$comment",
    "properties", "patternProperties", "additionalProperties", "required", "items", "prefixItems", "enum", "const",
    "default", "examples", "description", "title", "pattern", "minLength", "maxLength", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "uniqueItems", "minProperties",
    "maxProperties", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "contentEncoding", "contentMediaType",
    "dependentRequired", "dependentSchemas", "propertyNames", "contains", "minContains", "maxContains",
    "unevaluatedItems", "unevaluatedProperties", "additionalItems", "readOnly", "writeOnly", "deprecated", "nullable",
})
#: a schema string counts as text of the private context when, folded, it occurs there whole (on word boundaries,
#: and not in the public query) with at least this many letters, and is two words or more or one the context
#: capitalises mid-sentence (a name); shorter strings ("no", "age") and lone common words ("patient") say nothing
MIN_PRIVATE_LETTERS = 4
#: a longer schema string (a description) counts when it shares this many consecutive words with the private context
#: that the public query does not hold
MIN_SHARED_WORDS = 3


def _folded_words(text: str) -> list[str]:
    """``text``'s words up to case, accents and punctuation around them (as the mask compares words)."""
    from edge_sdk.privacy.masking import fold

    return [word for word in (fold(part).strip(_PUNCTUATION) for part in text.split()) if word]


_PUNCTUATION = "\"'`.,;:!?()[]{}<>«»“”‘’"


def _occurs(words: list[str], within: str) -> bool:
    """Whether ``words`` occur consecutively in ``within`` (a space-joined, space-padded folded word list)."""
    return bool(words) and f" {' '.join(words)} " in within


def _names(text: str) -> set[str]:
    """The folded words ``text`` capitalises mid-sentence (not first, nor after ``.``, ``?`` or ``!``)."""
    from edge_sdk.privacy.masking import fold

    names, sentence_start = set(), True
    for part in text.split():
        bare = part.strip(_PUNCTUATION)
        if bare[:1].isupper() and not sentence_start:
            names.add(fold(bare))
        sentence_start = part.endswith((".", "?", "!")) and not (len(bare) <= 3 and bare[:1].isupper())  # "Dr."
    return names


def _word_parts(text: str) -> set[str]:
    """Every word of ``text`` and every part punctuation joins inside one, folded (``Okonkwo-Fitzgerald``:
    ``okonkwo-fitzgerald``, ``okonkwo``, ``fitzgerald``), as ``never_upload``'s mask reads a span."""
    from edge_sdk.privacy.masking import fold, spoken_words

    return {folded for word in spoken_words(text) if (folded := fold(word).strip(_PUNCTUATION))}


def _private_text(text: str, spans: list[list[str]], span_words: set[str], context: str, names: set[str],
                  public: str) -> bool:
    """Whether ``text`` holds a ``never_upload`` span (or one of its words) or text of the private context."""
    words = _folded_words(text)
    if any(_occurs(span, f" {' '.join(words)} ") for span in spans):
        return True
    if span_words & _word_parts(text):
        return True
    whole = " ".join(words)
    if (sum(ch.isalpha() for ch in whole) >= MIN_PRIVATE_LETTERS and (len(words) > 1 or whole in names)
            and _occurs(words, context) and not _occurs(words, public)):
        return True
    for start in range(max(0, len(words) - MIN_SHARED_WORDS + 1)):
        run = words[start:start + MIN_SHARED_WORDS]
        if _occurs(run, context) and not _occurs(run, public):
            return True
    return False


def check_public_schema(schema: Any, *, private_context: str, never_upload: list[str] | tuple[str, ...] = (),
                        public_text: str = "") -> None:
    """Refuse a cloud-side schema (sent to the cloud as it is, like the question) that holds private text.

    Every string of the schema (each app-named key, each value but the schema language's own names) is compared,
    up to case, accents and the punctuation around words (as ``never_upload``'s mask folds them), with the spans
    and the private context: it must hold no ``never_upload`` span nor any word of one, must not itself occur in
    the private context (at least :data:`MIN_PRIVATE_LETTERS` letters, and two words or a name the context
    capitalises mid-sentence: an enum of the patients' names) and must
    share no run of :data:`MIN_SHARED_WORDS` words with it, text the public query holds aside.  Raises
    :class:`PrivateSchemaError` naming the first such place as a path (``$.properties.patient.enum[1]``; a key
    is named by its position), without quoting it.
    """
    spans = [words for words in (_folded_words(span) for span in never_upload) if words]
    span_words = {word for span in never_upload for word in _word_parts(span)}
    context = f" {' '.join(_folded_words(private_context))} "
    names = _names(private_context)
    public = f" {' '.join(_folded_words(public_text))} "

    def refuse(path: str) -> None:
        raise PrivateSchemaError(f"the JSON schema holds private text at {path} (a span of never_upload or text of "
                                 "the private context): a cloud-side schema is sent to the cloud as it is, like the "
                                 "question; keep private values out of it, or apply it edge-side (mode='edge')")

    def walk(node: Any, path: str, parent_key: str | None) -> None:
        if isinstance(node, dict):
            for position, (key, value) in enumerate(node.items()):
                named = key in _KEYWORDS and parent_key not in ("properties", "patternProperties", "$defs",
                                                                 "definitions", "dependentRequired",
                                                                 "dependentSchemas")
                if not named and _private_text(str(key), spans, span_words, context, names, public):
                    refuse(f"{path} (key #{position})")
                walk(value, f"{path}.{key}", key if named else None)
        elif isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, f"{path}[{index}]", parent_key if parent_key in ("type", "required") else None)
        elif isinstance(node, str) and parent_key not in _LANGUAGE_VALUES and _private_text(
                node, spans, span_words, context, names, public):
            refuse(path)

    walk(schema, "$", None)


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


#: the most one mask step may take, in ms: a schema whose first mask takes longer is refused when it is compiled,
#: and llguidance's per-step work limits are set to this budget at its documented speeds (lexer fuel ~14k/ms, Earley
#: items ~20k/ms), so a later step that would run past it ends the generation with a GrammarError instead of holding
#: the GIL (some regex patterns cost 331 ms a step over Gemma-3's 262,144 ids; a plain schema ~0.25 ms)
MAX_MASK_STEP_MS = 50.0
_LEXER_FUEL_PER_MS, _EARLEY_ITEMS_PER_MS = 14_000, 20_000


class JsonConstraint:
    """The ids that keep one generation's text valid JSON under ``schema`` (see the module docstring).

    ``end_ids``: the ids that end the generation (default: the vocabulary's own ends).  Both sides of a session
    must compile the grammar over one end set, the public one the session agreed when it opened
    (:attr:`edge_sdk.protocol.wire.SessionInfo.eos_token_ids`: the cloud's ends and the edge's), else one side may pick
    an id the other reads as text, or as an end inside a string (:meth:`agree_end_ids`).

    Raises :class:`GrammarError` when the schema cannot be compiled.
    """

    def __init__(self, vocabulary: GrammarVocabulary, schema: dict[str, Any], *,
                 end_ids: frozenset[int] | None = None, max_step_ms: float = MAX_MASK_STEP_MS) -> None:
        if not callable(getattr(vocabulary, "token_pieces", None)):
            raise TypeError(f"structured output needs the SLM's token_pieces() (the llama.cpp backend has them); "
                            f"{type(vocabulary).__name__} has none")
        self._vocabulary = vocabulary
        self.vocab_size = vocabulary.vocab_size
        self.schema = schema
        self.end_ids = frozenset(vocabulary.eos_token_ids if end_ids is None else end_ids)
        self.max_step_ms = max_step_ms
        self._consumed: list[int] = []
        self._first: np.ndarray | None = None
        self._matcher = self._compile()
        started = time.perf_counter()
        self._first = self.allowed()  # the first step's mask, timed (and kept for it)
        took_ms = 1e3 * (time.perf_counter() - started)
        if took_ms > max_step_ms:
            raise GrammarError(f"the JSON schema's grammar took {took_ms:.0f} ms for one step, more than the "
                               f"{max_step_ms:g} ms allowed: simplify its patterns")

    def _compile(self) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(self.schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
        limits = LLParserLimits(step_lexer_fuel=max(1, int(self.max_step_ms * _LEXER_FUEL_PER_MS)),
                                step_max_items=max(1, int(self.max_step_ms * _EARLEY_ITEMS_PER_MS)),
                                verbose_errors=False)
        matcher = LLMatcher(_lltokenizer(self._vocabulary, self.end_ids), grammar, log_level=0, limits=limits)
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
        self._first = None  # the kept first mask was the old grammar's
        for token in self._consumed:
            if not self._matcher.consume_token(int(token)):
                raise ValueError(f"token {token} is outside the JSON grammar under the agreed end set")

    def allowed(self) -> np.ndarray:
        """A boolean row over the vocabulary: ``True`` where the id may come next (:class:`GrammarError` when the
        step ran past the per-step work limits)."""
        first, self._first = self._first, None
        if first is not None:
            return first
        bias = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)[: self.vocab_size]
        if self._matcher.is_error():
            raise GrammarError(f"the JSON schema's grammar ran past its per-step limit: {self._matcher.get_error()}")
        return bias > 0

    def consume(self, token_id: int) -> None:
        self._first = None
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
