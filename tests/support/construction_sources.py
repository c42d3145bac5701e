"""Source items rebuilt from the shipped benchmark rows (MedQA- and Cosmos QA-style), for the construction tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

from eval_harness.datasets import DATA_DIR


def shipped(name: str) -> list[dict]:
    """The rows of a shipped benchmark file (``MEDPRIV.jsonl``, ``COMMPRIV.jsonl``)."""
    return [json.loads(line) for line in (DATA_DIR / name).read_text(encoding="utf-8").splitlines()]


def medqa_record(row: dict) -> dict:
    """A MedQA-style item: the private vignette followed by the public question sentence."""
    return {"id": row["_id"], "question": row["private_context"] + " " + row["public_query"],
            "options": row["options"], "answer_idx": row["answer_idx"], "answer": row["answer"], "meta_info": "step1"}


def cosmosqa_record(row: dict) -> dict:
    """A Cosmos QA-style item: the passage and the question, the options as answer0..answer3, the label an index."""
    return {"id": row["_id"], "context": row["private_context"], "question": row["public_query"],
            **{f"answer{i}": row["options"][letter] for i, letter in enumerate("ABCD")},
            "label": "ABCD".index(row["answer_idx"])}


def write_by_split(rows: list[dict], records: list[dict], directory: Path) -> list[Path]:
    """Records into one file per source split, named as the split says (``train_jsonl`` -> ``train.jsonl``)."""
    files: dict[str, list[str]] = {}
    for row, record in zip(rows, records):
        files.setdefault(row["_split"].replace("_", "."), []).append(json.dumps(record, ensure_ascii=False))
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, lines in files.items():
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(directory / name)
    return paths


def spans_of(row: dict) -> list[str]:
    """A shipped row's spans (its ``filtered_context``, comma-separated)."""
    return [span.strip() for span in row["filtered_context"].split(",") if span.strip()]


def survives_validation(span: str, row: dict) -> bool:
    """Independently of the judge's checks: in the context as whole words, not in the question nor as whole words
    in an option's text, case-insensitively."""
    in_context = re.search(rf"(?<!\w){re.escape(span)}(?!\w)", row["private_context"])
    in_option = any(re.search(rf"(?<!\w){re.escape(span)}(?!\w)", option, re.IGNORECASE)
                    for option in row["options"].values())
    return bool(in_context) and span.lower() not in row["public_query"].lower() and not in_option


def clean(row: dict) -> bool:
    """Whether every published span of ``row`` would pass the judge's validation as it is (and none repeats)."""
    spans = spans_of(row)
    return len(set(spans)) == len(spans) and all(survives_validation(span, row) for span in spans)


def fixed_judge(rows: list[dict], spans: dict[str, list[str]]):
    """A scripted endpoint that keeps every item of ``rows`` and proposes ``spans[item id]`` for it."""
    from tests.support.openai_script import ScriptedEndpoint, extraction_reply, screening_reply, stage_of

    def script(body: dict) -> str:
        user = body["messages"][-1]["content"]
        (row,) = [r for r in rows if r["private_context"] in user and r["public_query"] in user]
        return screening_reply(True) if stage_of(body) == "screen" else extraction_reply(spans[row["_id"]])

    return ScriptedEndpoint(script)
