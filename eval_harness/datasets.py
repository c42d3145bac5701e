"""DecodeLeak benchmark items and the prompts built from them, behind a task registry.

A task turns one JSONL row into a :class:`DecodeLeakItem`: the public query
(with its options, sent to the cloud), the private context (edge only), the
private-evidence spans (the leakage targets) and the gold answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edge_sdk.registry import Registry

DATA_DIR = Path(__file__).resolve().parent / "data"
LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class DecodeLeakItem:
    """One instance ``(x_pub, x_priv, E_priv)`` with its multiple-choice answer."""

    item_id: str
    public_query: str
    options: dict[str, str]
    private_context: str
    evidence_spans: tuple[str, ...]
    answer: str  # the gold letter

    @property
    def public_prompt(self) -> str:
        """What the cloud sees: the question, the options and the answer format."""
        options = "\n".join(f"({letter}) {self.options[letter].strip()}" for letter in LETTERS if letter in self.options)
        return (
            f"Question: {self.public_query.strip()}\n"
            f"Options:\n{options}\n"
            "Reply with the letter of the correct option, then one short sentence of reasoning.\n"
            "Answer: ("
        )


def item_from_row(row: object) -> DecodeLeakItem:
    """Parse one row of the published MedPriv/CommPriv JSONL format (raises ``ValueError`` if malformed)."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    missing = [key for key in ("_id", "public_query", "options", "private_context", "filtered_context",
                               "answer_idx") if key not in row]
    if missing:
        raise ValueError(f"row {row.get('_id', '?')} lacks {', '.join(missing)}")
    item_id = row["_id"]
    if not isinstance(item_id, (str, int)) or isinstance(item_id, bool) or not str(item_id).strip():
        raise ValueError(f"row _id must be a non-empty string, got {item_id!r}")
    for key in ("public_query", "private_context", "filtered_context"):
        if not isinstance(row[key], str):
            raise ValueError(f"row {item_id}: {key} must be a string, got {type(row[key]).__name__}")
    options = row["options"]
    if not isinstance(options, dict) or not options or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in options.items()
    ):
        raise ValueError(f"row {item_id}: options must map option letters to their texts")
    if row["answer_idx"] not in options:
        raise ValueError(f"row {item_id}: answer_idx {row['answer_idx']!r} is not one of the options {sorted(options)}")
    spans = tuple(span.strip() for span in row["filtered_context"].split(",") if span.strip())
    return DecodeLeakItem(
        item_id=str(item_id),
        public_query=row["public_query"],
        options={k: str(v) for k, v in options.items()},
        private_context=row["private_context"],
        evidence_spans=spans,
        answer=row["answer_idx"],
    )


def read_jsonl(path: Path, limit: int | None = None) -> Iterator[DecodeLeakItem]:
    with path.open(encoding="utf-8") as lines:
        number = 0
        try:
            for number, line in enumerate(lines, 1):
                if limit is not None and number > limit:
                    return
                if line.strip():
                    yield item_from_row(json.loads(line))
        except ValueError as exc:  # JSON errors, malformed rows and undecodable bytes alike
            raise ValueError(f"{path}:{number + 1 if isinstance(exc, UnicodeDecodeError) else number}: {exc}") from exc


#: benchmark tasks by name: each loads its items (``limit`` = the first N, ``None`` = all)
TASKS: Registry[Callable[[int | None], list[DecodeLeakItem]]] = Registry("task")


def register_task(name: str, loader: Callable[[int | None], list[DecodeLeakItem]]) -> None:
    TASKS.register(name, loader)


def load_task(name_or_path: str, limit: int | None = None) -> list[DecodeLeakItem]:
    """Items of a registered task (``medpriv``, ``commpriv``) or of a JSONL file in the same format."""
    if name_or_path in TASKS:
        return TASKS.get(name_or_path)(limit)
    path = Path(name_or_path)
    if path.suffix == ".jsonl" and path.is_file():
        return list(read_jsonl(path, limit))
    if path.suffix == ".jsonl" or path.exists() or len(path.parts) > 1:  # meant as a file
        problem = "is not a .jsonl file" if path.exists() else "no such file"
        raise ValueError(f"task file {name_or_path}: {problem} (a task is {', '.join(TASKS.names())} or a .jsonl "
                         "path of items in their format)")
    raise ValueError(f"unknown task {name_or_path!r}: choose one of {', '.join(TASKS.names())} or a .jsonl path")


register_task("medpriv", lambda limit: list(read_jsonl(DATA_DIR / "MEDPRIV.jsonl", limit)))
register_task("commpriv", lambda limit: list(read_jsonl(DATA_DIR / "COMMPRIV.jsonl", limit)))
