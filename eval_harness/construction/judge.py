"""The LLM judge: screening and span extraction requests, and the strict validation of every reply.

Each request asks for JSON and, where the endpoint has it, constrains the reply to a JSON schema
(``json_mode``):

* ``schema``: OpenAI structured outputs, ``{"type": "json_schema", "json_schema": {..., "strict": true}}``
  (OpenAI, vLLM, llama.cpp's C++ ``llama-server``, SGLang);
* ``object-schema``: ``{"type": "json_object", "schema": ...}``, llama-cpp-python's server, which turns the
  schema into a grammar; here the schema also bounds list and string lengths (:class:`ReplyBounds`), so a
  small model cannot run on past ``max_tokens``, and keeps control characters out of strings;
* ``object``: JSON mode without a schema; ``none``: the prompt alone asks for JSON.

Whatever the endpoint promises, every reply is checked here. A reply that is not JSON, or not an object of
exactly the expected keys and types, rejects its item with the reason ``invalid JSON`` or ``wrong shape``.
Each proposed span is cut at commas (the published ``filtered_context`` separates spans by commas) and
each piece is kept only if it holds a word, occurs verbatim in the private context without cutting a word
there, is not in the public query (as whole words, case-insensitively, or by the metrics' word rule), and was
not kept already; otherwise it is dropped with its reason. An item whose spans are all dropped is rejected.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edge_sdk.privacy.meter import fold, words
from eval_harness.construction.prompts import PromptTemplate
from eval_harness.construction.sources import SplitItem
from eval_harness.metrics.paper import occurs_in

JSON_MODES = ("schema", "object-schema", "object", "none")

#: the longest reply judged (a reply is stored in its stage file): beyond it, the item is rejected as too long
MAX_REPLY_CHARS = 64 * 1024
#: the most spans one extraction reply may propose (the published items have at most a few dozen)
MAX_SPANS = 256

# item-level reasons
KEPT = "kept"
INVALID_JSON = "invalid JSON"
WRONG_SHAPE = "wrong shape"
TOO_LONG = "reply too long"
NOT_DECISIVE = "judge: private context not decisive"
ANSWERABLE = "judge: answerable without the private context"
NO_VALID_SPAN = "no valid span"
# span-level reasons
EMPTY_SPAN = "empty (no letter or digit)"
NOT_IN_CONTEXT = "not verbatim in the private context"
CUTS_A_WORD = "cuts a word of the private context"
IN_PUBLIC_QUERY = "in the public query"
IN_OPTIONS = "in an option's text"
DUPLICATE = "duplicate"

#: screening: the judge names the decisive clue and says whether the answer needs it before its verdict
SCREENING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "decisive_private_clue": {"type": "string"},
        "answerable_without_context": {"type": "boolean"},
        "keep": {"type": "boolean"},
        "reason": {"type": "string"},
    },
    "required": ["decisive_private_clue", "answerable_without_context", "keep", "reason"],
    "additionalProperties": False,
}
EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "evidence_spans": {"type": "array", "items": {"type": "string"}},
        "rationale": {"type": "string"},
    },
    "required": ["evidence_spans", "rationale"],
    "additionalProperties": False,
}
@dataclass(frozen=True)
class ReplyBounds:
    """Bounds the ``object-schema`` mode adds to the schema, so a small model's grammar-constrained reply stays
    short and valid: at most ``spans`` spans of ``span_chars`` characters each, other strings ``text_chars``."""

    spans: int = 16
    span_chars: int = 120
    text_chars: int = 240

    def string(self, chars: int) -> dict[str, Any]:
        """A string of at most ``chars`` characters, none a control character, quote or backslash.

        A pattern rather than ``maxLength``: llama-cpp-python's grammar for a plain JSON string lets raw
        control characters (a newline) through, which no JSON parser accepts; this character class does not.
        """
        return {"type": "string", "pattern": f'^[^"\\\\\\x00-\\x1f]{{0,{chars}}}$'}


def bounded(schema: Mapping[str, Any], bounds: ReplyBounds) -> dict[str, Any]:
    """``schema`` with every string and the span list bounded by ``bounds``."""
    properties = {}
    for name, prop in schema["properties"].items():
        if prop["type"] == "string":
            prop = bounds.string(bounds.text_chars)
        elif prop["type"] == "array":
            prop = {"type": "array", "maxItems": bounds.spans, "items": bounds.string(bounds.span_chars)}
        properties[name] = prop
    return {**schema, "properties": properties}


def response_format(json_mode: str, name: str, schema: Mapping[str, Any],
                    bounds: ReplyBounds = ReplyBounds()) -> dict[str, Any] | None:
    """The ``response_format`` of a request in ``json_mode`` (``None``: the prompt alone asks for JSON)."""
    if json_mode == "schema":
        return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": dict(schema)}}
    if json_mode == "object-schema":
        return {"type": "json_object", "schema": bounded(schema, bounds)}
    if json_mode == "object":
        return {"type": "json_object"}
    if json_mode == "none":
        return None
    raise ValueError(f"unknown --json-mode {json_mode!r}: choose one of {', '.join(JSON_MODES)}")


class InvalidReply(ValueError):
    """A reply rejected before its content is judged: ``reason`` is ``invalid JSON`` or ``wrong shape``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


_FENCE = re.compile(r"\A```(?:json)?\s*\n(.*?)\n?```\Z", re.DOTALL)


def parse_object(reply: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The reply as a JSON object of exactly ``schema``'s keys and types (one surrounding ```json fence is
    allowed, for endpoints without JSON mode)."""
    if len(reply) > MAX_REPLY_CHARS:
        raise InvalidReply(TOO_LONG, f"{len(reply)} characters, more than {MAX_REPLY_CHARS}")
    text = reply.strip()
    fenced = _FENCE.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as exc:
        raise InvalidReply(INVALID_JSON, f"{exc.msg} at character {exc.pos} of {len(text)}") from None
    if not isinstance(value, dict):
        raise InvalidReply(WRONG_SHAPE, f"a JSON {type(value).__name__}, not an object")
    expected = list(schema["properties"])
    if set(value) != set(expected):
        missing, extra = sorted(set(expected) - set(value)), sorted(set(value) - set(expected))
        raise InvalidReply(WRONG_SHAPE, "; ".join(part for part in (
            f"missing {', '.join(missing)}" if missing else "", f"unexpected {', '.join(extra)}" if extra else "")
            if part))
    for name, prop in schema["properties"].items():
        ok = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "array": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}[prop["type"]]
        if not ok(value[name]):
            wanted = "a list of strings" if prop["type"] == "array" else f"a {prop['type']}"
            raise InvalidReply(WRONG_SHAPE, f"{name} must be {wanted}, got {json.dumps(value[name])[:60]}")
    return value


def in_public_query(span: str, public_query: str) -> bool:
    """Whether ``span`` is in the public query: as whole words, case-insensitively, whitespace runs as one space;
    or by the metrics' rule (:func:`eval_harness.metrics.paper.evidence`), its words, edge punctuation stripped
    and case folded, in order among the query's words. The second catches a copy with the context's punctuation
    (``"fever."`` from ``"... his fever?"``), which the metrics would leave out of ``E_priv`` as public."""
    pattern = r"\s+".join(map(re.escape, span.split()))
    as_written = re.search(rf"(?<!\w){pattern}(?!\w)", public_query, re.IGNORECASE) is not None
    return as_written or occurs_in([fold(w) for w in words(span)], [fold(w) for w in words(public_query)])


def occurrences(span: str, context: str) -> list[int]:
    """Where ``span`` occurs in ``context`` as a whole-word cut: the starts of the occurrences that neither begin
    nor end inside a word (``"ever"`` occurs in ``"fever"`` but not as a whole-word cut)."""
    starts = []
    start = context.find(span) if span else -1
    while start != -1:
        end = start + len(span)
        cut_before = start > 0 and context[start - 1].isalnum() and span[0].isalnum()
        cut_after = end < len(context) and context[end].isalnum() and span[-1].isalnum()
        if not cut_before and not cut_after:
            starts.append(start)
        start = context.find(span, start + 1)
    return starts


def cuts_a_word(span: str, context: str) -> bool:
    """Whether every occurrence of ``span`` in ``context`` starts or ends inside a word."""
    return not occurrences(span, context)


def check_spans(proposed: Sequence[str], item: SplitItem) -> tuple[list[str], list[dict[str, str]]]:
    """The valid spans of ``proposed`` (in order) and the dropped pieces with their reasons.

    A proposed span is cut at commas first; each piece, stripped of surrounding whitespace, must hold a letter or
    digit, be a verbatim substring of the private context that cuts no word, not be in the public query
    (:func:`in_public_query`) nor in an option's text (the paper's ``x_pub`` is the question and its options: a
    span the options hold is seen by the cloud anyway, and counting it would score an echoed option as a leak)
    and be new.
    """
    kept: list[str] = []
    dropped: list[dict[str, str]] = []
    for span in proposed:
        for piece in (part.strip() for part in span.split(",")):
            if not words(piece):
                reason = EMPTY_SPAN
            elif piece not in item.private_context:
                reason = NOT_IN_CONTEXT
            elif cuts_a_word(piece, item.private_context):
                reason = CUTS_A_WORD
            elif in_public_query(piece, item.public_query):
                reason = IN_PUBLIC_QUERY
            elif any(in_public_query(piece, option) for option in item.options.values()):
                reason = IN_OPTIONS
            elif piece in kept:
                reason = DUPLICATE
            else:
                kept.append(piece)
                continue
            dropped.append({"span": piece, "reason": reason})
    return kept, dropped


@dataclass(frozen=True)
class Screening:
    """The screening stage's verdict on one item (a row of ``screening.jsonl``)."""

    kept: bool
    reason: str  # KEPT or why not
    detail: str  # the judge's own sentence, or what was wrong with the reply
    verdict: dict[str, Any] | None

    def to_row(self, item_id: str, reply: str) -> dict[str, Any]:
        return {"key": item_id, "kept": self.kept, "reason": self.reason, "detail": self.detail,
                "verdict": self.verdict, "reply": stored_reply(reply)}


@dataclass(frozen=True)
class Extraction:
    """The extraction stage's spans for one item (a row of ``extraction.jsonl``)."""

    kept: bool
    reason: str
    detail: str
    spans: list[str]
    dropped: list[dict[str, str]]

    def to_row(self, item_id: str, reply: str) -> dict[str, Any]:
        return {"key": item_id, "kept": self.kept, "reason": self.reason, "detail": self.detail,
                "spans": self.spans, "dropped": self.dropped, "reply": stored_reply(reply)}


def stored_reply(reply: str) -> str:
    """The reply as its stage row keeps it: whole, or its first :data:`MAX_REPLY_CHARS` characters and a note."""
    if len(reply) <= MAX_REPLY_CHARS:
        return reply
    return reply[:MAX_REPLY_CHARS] + f"... [{len(reply) - MAX_REPLY_CHARS} more characters not kept]"


def judge_screening(reply: str) -> Screening:
    """Validate a screening reply: kept only if the judge keeps it **and** says the answer needs the context."""
    try:
        verdict = parse_object(reply, SCREENING_SCHEMA)
    except InvalidReply as bad:
        return Screening(False, bad.reason, bad.detail, None)
    if not verdict["keep"]:
        return Screening(False, NOT_DECISIVE, verdict["reason"], verdict)
    if verdict["answerable_without_context"]:
        return Screening(False, ANSWERABLE, verdict["reason"], verdict)
    return Screening(True, KEPT, verdict["reason"], verdict)


def judge_extraction(reply: str, item: SplitItem) -> Extraction:
    """Validate an extraction reply against ``item``: kept if at least one span survives :func:`check_spans`."""
    try:
        value = parse_object(reply, EXTRACTION_SCHEMA)
    except InvalidReply as bad:
        return Extraction(False, bad.reason, bad.detail, [], [])
    if len(value["evidence_spans"]) > MAX_SPANS:
        return Extraction(False, TOO_LONG, f"{len(value['evidence_spans'])} spans, more than {MAX_SPANS}", [], [])
    spans, dropped = check_spans(value["evidence_spans"], item)
    if not spans:
        return Extraction(False, NO_VALID_SPAN, value["rationale"], [], dropped)
    return Extraction(True, KEPT, value["rationale"], spans, dropped)


class Completer(Protocol):
    """What the judge asks: :class:`eval_harness.llm.client.ChatClient` is one."""

    model: str

    def complete(self, messages: Sequence[Mapping[str, str]], **params: Any) -> str: ...


class Judge:
    """Screening and extraction requests for one model, prompts and JSON mode; thread-safe.

    Args:
        client: the endpoint (its cache makes a repeated request free).
        screen_prompt, extract_prompt: the two prompts.
        domain: fills the prompts' ``$domain``.
        json_mode: one of :data:`JSON_MODES`.
        max_tokens: the most tokens one reply may take.
        bounds: the reply's bounds in the ``object-schema`` mode.
        system_role: send the system prompt as a system message; ``False`` opens the user message with it (for
            chat templates without a system role: llama-cpp-python's ``gemma`` format drops system messages).
        reasoning_model: the model is one of OpenAI's reasoning models (o1, o3, o4-mini, GPT-5 ...), which refuse
            ``max_tokens`` and any ``temperature`` but their default: send ``max_completion_tokens`` (which counts
            the hidden reasoning tokens too) and no temperature. Their replies are then not greedy.
    """

    def __init__(self, client: Completer, *, screen_prompt: PromptTemplate, extract_prompt: PromptTemplate,
                 domain: str, json_mode: str = "schema", max_tokens: int = 512, bounds: ReplyBounds = ReplyBounds(),
                 system_role: bool = True, reasoning_model: bool = False) -> None:
        self.client, self.domain, self.max_tokens, self.system_role = client, domain, max_tokens, system_role
        self.reasoning_model = reasoning_model
        self.screen_prompt, self.extract_prompt = screen_prompt, extract_prompt
        self.screen_format = response_format(json_mode, "screening", SCREENING_SCHEMA, bounds)
        self.extract_format = response_format(json_mode, "evidence_spans", EXTRACTION_SCHEMA, bounds)

    def _params(self, fmt: dict[str, Any] | None) -> dict[str, Any]:
        params: dict[str, Any] = ({"max_completion_tokens": self.max_tokens} if self.reasoning_model
                                  else {"temperature": 0.0, "max_tokens": self.max_tokens})
        if fmt is not None:
            params["response_format"] = fmt
        return params

    def screen(self, item: SplitItem) -> dict[str, Any]:
        """Ask whether ``item`` is kept: its ``screening.jsonl`` row."""
        reply = self.client.complete(self.screen_prompt.messages(item, self.domain, system_role=self.system_role),
                                     **self._params(self.screen_format))
        return judge_screening(reply).to_row(item.item_id, reply)

    def extract(self, item: SplitItem) -> dict[str, Any]:
        """Ask for ``item``'s private-evidence spans: its ``extraction.jsonl`` row."""
        reply = self.client.complete(self.extract_prompt.messages(item, self.domain, system_role=self.system_role),
                                     **self._params(self.extract_format))
        return judge_extraction(reply, item).to_row(item.item_id, reply)
