"""Source-format splitters: one rule per format turns a QA item into public query + options and private context.

The cloud may see the public query and the options; the private context stays on the edge (the paper's
"Source-to-instance conversion"):

* ``medqa`` (MedQA-USMLE JSONL: ``question``, ``options``, ``answer_idx``): the question is a clinical
  vignette followed by one final question sentence. The public query is the text after the **last sentence
  boundary** (a ``.``, ``?`` or ``!`` followed by whitespace), the private context everything before it.
  This is the rule MedPriv was cut by: every one of its 1,000 rows is rebuilt exactly from
  ``private_context + " " + public_query`` (tests/eval_harness/test_construction_sources.py).
* ``cosmosqa`` (Cosmos QA JSONL: ``context``, ``question``, ``answer0``..``answer3``, ``label``): the passage
  is private, the question public.
* ``generic``: named fields, ``--fields public=question,private=notes,options=choices,answer=label[,id=uid]``.

Each item keeps an id (the record's own id field when it has one, else ``<file stem>_<line index>``) and the
split it came from (the file's name with ``.`` as ``_``: ``train.jsonl`` gives ``train_jsonl``, as in the
published files). A record that is malformed (not an object, a field missing or of the wrong type, an answer
that is not one of the options) stops the read with its file and line; an item whose text the rule cannot
split (no sentence boundary, an empty side) is skipped and counted with its reason.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sdk.registry import Registry

#: a sentence boundary: sentence-final punctuation, then whitespace, then more text
SENTENCE_BOUNDARY = re.compile(r"(?<=[.?!])\s+(?=\S)")
OPTION_LETTERS = string.ascii_uppercase


class UnsplittableItem(ValueError):
    """An item the format's rule cannot split into a public query and a private context (skipped, counted)."""


@dataclass(frozen=True)
class SplitItem:
    """One source item split for the cloud-edge setting: ``x_pub`` (query + options) and ``x_priv``."""

    item_id: str
    split: str
    public_query: str
    options: dict[str, str]
    answer_idx: str
    private_context: str

    @property
    def answer(self) -> str:
        """The correct option's text."""
        return self.options[self.answer_idx]

    def to_row(self) -> dict[str, Any]:
        """The row of ``items.jsonl`` (keyed by the item id)."""
        return {"key": self.item_id, "_split": self.split, "public_query": self.public_query,
                "options": self.options, "answer_idx": self.answer_idx, "private_context": self.private_context}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SplitItem:
        return cls(item_id=str(row["key"]), split=row["_split"], public_query=row["public_query"],
                   options=dict(row["options"]), answer_idx=row["answer_idx"], private_context=row["private_context"])


@dataclass(frozen=True)
class Fields:
    """Named fields of a ``generic`` source: ``public=...,private=...,options=...,answer=...[,id=...]``."""

    public: str
    private: str
    options: str
    answer: str
    id: str | None = None

    @classmethod
    def parse(cls, text: str) -> Fields:
        """``"public=question,private=context,options=choices,answer=label"`` as :class:`Fields`."""
        names: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            role, sep, name = part.partition("=")
            role, name = role.strip(), name.strip()
            if not sep or not name:
                raise ValueError(f"a field is ROLE=NAME, got {part!r}")
            if role not in ("public", "private", "options", "answer", "id"):
                raise ValueError(f"unknown field role {role!r}: the roles are public, private, options, answer, id")
            if role in names:
                raise ValueError(f"field role {role!r} given twice")
            names[role] = name
        missing = [role for role in ("public", "private", "options", "answer") if role not in names]
        if missing:
            raise ValueError(f"--fields lacks {', '.join(missing)} (e.g. public=question,private=context,"
                             "options=choices,answer=label)")
        return cls(**names)


@dataclass(frozen=True)
class SourceFormat:
    """A source format: how one record becomes ``(public_query, private_context, options, answer_idx, id)``."""

    name: str
    domain: str  # the screening prompt it defaults to
    split: Callable[[Mapping[str, Any], Fields | None], tuple[str, str, dict[str, str], str, str | None]]


SOURCE_FORMATS: Registry[SourceFormat] = Registry("source format")


def split_vignette(question: str) -> tuple[str, str]:
    """``(private_context, public_query)`` of a MedQA question: the public query is the text after the last
    sentence boundary (``[.?!]`` then whitespace), the private context the text before it."""
    text = question.strip()
    boundaries = list(SENTENCE_BOUNDARY.finditer(text))
    if not boundaries:
        raise UnsplittableItem("one sentence only: no vignette before the question")
    last = boundaries[-1]
    return text[: last.start()], text[last.end():]


def _text(record: Mapping[str, Any], name: str) -> str:
    if name not in record:
        raise ValueError(f"lacks the field {name!r} (it has {', '.join(map(repr, record)) or 'none'})")
    value = record[name]
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {type(value).__name__}")
    return value


def _options(value: object, name: str) -> dict[str, str]:
    """Options as letter → text, from an object (``{"A": ...}``), a MedQA list of ``{"key", "value"}``, or a list
    of texts (lettered A, B, ...)."""
    if isinstance(value, Mapping) and value:
        options = dict(value)
    elif isinstance(value, list) and value and all(isinstance(o, Mapping) and {"key", "value"} <= set(o)
                                                   for o in value):
        options = {o["key"]: o["value"] for o in value}
    elif isinstance(value, list) and value and len(value) <= len(OPTION_LETTERS):
        options = dict(zip(OPTION_LETTERS, value))
    else:
        raise ValueError(f"field {name!r} must hold the options: an object of letter -> text, or a non-empty list")
    if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in options.items()):
        raise ValueError(f"field {name!r}: every option needs a non-empty string key and a string text")
    return options


def _answer_letter(answer: object, options: Mapping[str, str], name: str) -> str:
    """The option key an answer names: a key itself, a 0-based index into the options, or one option's exact text."""
    if isinstance(answer, str) and answer in options:
        return answer
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(options):
        return list(options)[answer]
    if isinstance(answer, str):
        matches = [key for key, text in options.items() if text == answer]
        if len(matches) == 1:
            return matches[0]
    raise ValueError(f"field {name!r} = {answer!r} names none of the options {sorted(options)} "
                     "(give an option key, a 0-based index or one option's exact text)")


def _record_id(record: Mapping[str, Any], *names: str) -> str | None:
    for name in names:
        if name in record and record[name] is not None:
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
                raise ValueError(f"field {name!r} must be a non-empty string or integer id, got {value!r}")
            return str(value)
    return None


def _split_medqa(record: Mapping[str, Any], fields: Fields | None) -> tuple[str, str, dict[str, str], str, str | None]:
    options = _options(record.get("options"), "options")
    private, public = split_vignette(_text(record, "question"))
    answer_idx = _answer_letter(record.get("answer_idx"), options, "answer_idx")
    if "answer" in record and record["answer"] != options[answer_idx]:
        raise ValueError(f"answer {record['answer']!r} is not option {answer_idx} ({options[answer_idx]!r})")
    return public, private, options, answer_idx, _record_id(record, "id", "_id")


def _split_cosmosqa(record: Mapping[str, Any],
                    fields: Fields | None) -> tuple[str, str, dict[str, str], str, str | None]:
    answers = []
    while f"answer{len(answers)}" in record:
        answers.append(f"answer{len(answers)}")
    if len(answers) < 2:
        raise ValueError("lacks the options answer0, answer1, ...")
    options = {OPTION_LETTERS[i]: _text(record, name) for i, name in enumerate(answers)}
    label = record.get("label")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
        raise ValueError(f"label must be the 0-based index of the correct answer, got {record.get('label')!r}")
    return (_text(record, "question"), _text(record, "context"), options, OPTION_LETTERS[label],
            _record_id(record, "id", "_id"))


def _split_generic(record: Mapping[str, Any],
                   fields: Fields | None) -> tuple[str, str, dict[str, str], str, str | None]:
    if fields is None:
        raise ValueError("the generic format needs --fields public=...,private=...,options=...,answer=...")
    if fields.options not in record:
        raise ValueError(f"lacks the field {fields.options!r}")
    if fields.answer not in record:
        raise ValueError(f"lacks the field {fields.answer!r}")
    options = _options(record[fields.options], fields.options)
    answer_idx = _answer_letter(record[fields.answer], options, fields.answer)
    item_id = _record_id(record, fields.id) if fields.id else None
    if fields.id and item_id is None:
        raise ValueError(f"lacks the field {fields.id!r}")
    return _text(record, fields.public), _text(record, fields.private), options, answer_idx, item_id


SOURCE_FORMATS.register("medqa", SourceFormat("medqa", "clinical", _split_medqa))
SOURCE_FORMATS.register("cosmosqa", SourceFormat("cosmosqa", "narrative", _split_cosmosqa))
SOURCE_FORMATS.register("generic", SourceFormat("generic", "", _split_generic))


def split_record(record: object, source: SourceFormat, fields: Fields | None, *, default_id: str,
                 split: str) -> SplitItem:
    """One record as a :class:`SplitItem` (``ValueError`` if malformed, :class:`UnsplittableItem` if the rule
    cannot split it)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    public, private, options, answer_idx, item_id = source.split(record, fields)
    if not public.strip():
        raise UnsplittableItem("empty public query")
    if not private.strip():
        raise UnsplittableItem("empty private context")
    return SplitItem(item_id=item_id or default_id, split=split, public_query=public, options=options,
                     answer_idx=answer_idx, private_context=private)


@dataclass
class SourceReading:
    """The items of one or more source files, and the items skipped, by reason."""

    items: list[SplitItem] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)


def read_sources(paths: Iterable[str | Path], format_name: str, *, fields: Fields | None = None,
                 limit: int | None = None) -> SourceReading:
    """Split every record of ``paths`` (JSONL, one record a line) by the rule of ``format_name``.

    ``limit`` keeps the first N items over all files. Raises ``ValueError`` naming the file and line of a
    malformed record, or an id that two items share.
    """
    source = SOURCE_FORMATS.get(format_name)
    if fields is not None and format_name != "generic":
        raise ValueError(f"--fields is for the generic format; {format_name} has its own fields")
    reading = SourceReading()
    seen: dict[str, str] = {}
    for path in map(Path, paths):
        index = 0
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                if limit is not None and len(reading.items) >= limit:
                    return reading
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                    item = split_record(record, source, fields, default_id=f"{path.stem}_{index}",
                                        split=path.name.replace(".", "_"))
                except UnsplittableItem as why:
                    reading.skipped[f"split: {why}"] += 1
                    index += 1
                    continue
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
                index += 1
                if item.item_id in seen:
                    raise ValueError(f"{where}: id {item.item_id!r} is already used at {seen[item.item_id]}")
                seen[item.item_id] = where
                reading.items.append(item)
    return reading
