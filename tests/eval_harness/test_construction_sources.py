"""Source-format splitters: source items rebuilt from the shipped MedPriv/CommPriv rows split back field by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.construction.sources import Fields, UnsplittableItem, read_sources, split_vignette

from tests.support.construction_sources import cosmosqa_record, medqa_record, shipped, write_by_split

FIELDS = ("item_id", "split", "public_query", "options", "answer_idx", "answer", "private_context")


def assert_same_as_shipped(items: list, rows: list[dict]) -> None:
    by_id = {item.item_id: item for item in items}
    assert len(by_id) == len(rows)
    for row in rows:
        item = by_id[row["_id"]]
        expected = dict(zip(FIELDS, (row["_id"], row["_split"], row["public_query"], row["options"],
                                     row["answer_idx"], row["answer"], row["private_context"])))
        assert {name: getattr(item, name) for name in FIELDS} == expected, row["_id"]


def test_medqa_questions_rebuilt_from_medpriv_split_back_into_its_rows(tmp_path: Path) -> None:
    # a MedQA item is the private vignette followed by the public question sentence
    rows = shipped("MEDPRIV.jsonl")
    reading = read_sources(write_by_split(rows, [medqa_record(r) for r in rows], tmp_path), "medqa")
    assert not reading.skipped
    assert_same_as_shipped(reading.items, rows)


def test_cosmosqa_items_rebuilt_from_commpriv_split_back_into_its_rows(tmp_path: Path) -> None:
    rows = shipped("COMMPRIV.jsonl")
    reading = read_sources(write_by_split(rows, [cosmosqa_record(r) for r in rows], tmp_path), "cosmosqa")
    assert not reading.skipped
    assert_same_as_shipped(reading.items, rows)


def test_generic_named_fields_split_back_into_the_rows(tmp_path: Path) -> None:
    rows = shipped("COMMPRIV.jsonl")[:50] + shipped("MEDPRIV.jsonl")[:50]
    # options as a list, the answer as its text: the letters are given in list order
    records = [{"uid": r["_id"], "notes": r["private_context"], "ask": r["public_query"],
                "choices": [r["options"][letter] for letter in "ABCD"], "gold": r["answer"]} for r in rows]
    fields = Fields.parse("public=ask, private=notes, options=choices, answer=gold, id=uid")
    reading = read_sources(write_by_split(rows, records, tmp_path), "generic", fields=fields)
    assert_same_as_shipped(reading.items, rows)


def test_the_last_sentence_boundary_separates_vignette_and_question() -> None:
    # the decimal points in "2.8 mg/dL" and "7.35" are no boundary: no whitespace follows them
    assert split_vignette("Bilirubin is 2.8 mg/dL. The pH is 7.35. Which enzyme is deficient?") == (
        "Bilirubin is 2.8 mg/dL. The pH is 7.35.", "Which enzyme is deficient?")
    # a question split over lines keeps the lines after the last boundary
    assert split_vignette("A man has a cough.  Labs show:\nNa 140\nWhich is next?") == (
        "A man has a cough.", "Labs show:\nNa 140\nWhich is next?")
    assert split_vignette("What is the next step? (normal values: pH 7.35 - 7.45)") == (
        "What is the next step?", "(normal values: pH 7.35 - 7.45)")
    with pytest.raises(UnsplittableItem, match="one sentence"):
        split_vignette("Which of the following is a benzodiazepine?")


def test_unsplittable_items_are_counted_and_bad_records_named_by_line(tmp_path: Path) -> None:
    source = tmp_path / "dev.jsonl"
    good = {"question": "A girl has a rash. What is it?", "options": {"A": "x", "B": "y"}, "answer_idx": "B"}
    one_sentence = {**good, "question": "What is it?"}
    source.write_text(f"{json.dumps(good)}\n{json.dumps(one_sentence)}\n\n{json.dumps(good)}\n")
    reading = read_sources([source], "medqa")
    # ids are <stem>_<index> over non-blank lines; the second line is skipped with its reason
    assert [(item.item_id, item.split, item.private_context, item.answer) for item in reading.items] == [
        ("dev_0", "dev_jsonl", "A girl has a rash.", "y"), ("dev_2", "dev_jsonl", "A girl has a rash.", "y")]
    assert reading.skipped == {"split: one sentence only: no vignette before the question": 1}
    assert len(read_sources([source], "medqa", limit=1).items) == 1

    cosmos = tmp_path / "cosmos.jsonl"
    cosmos.write_text(json.dumps({"context": " ", "question": "Why?", "answer0": "a", "answer1": "b", "label": 1})
                      + "\n")
    assert read_sources([cosmos], "cosmosqa").skipped == {"split: empty private context": 1}

    for bad, message in (({**good, "answer_idx": "E"}, r"dev.jsonl:2: field 'answer_idx' = 'E' names none"),
                         ({"options": good["options"], "answer_idx": "A"}, r"dev.jsonl:2: lacks the field 'question'"),
                         ([1, 2], r"dev.jsonl:2: a record must be a JSON object"),
                         ({**good, "answer": "x"}, r"dev.jsonl:2: answer 'x' is not option B")):
        source.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=message):
            read_sources([source], "medqa")
    source.write_text(json.dumps({**good, "id": 7}) + "\n" + json.dumps({**good, "id": "7"}) + "\n")
    with pytest.raises(ValueError, match=r"dev.jsonl:2: id '7' is already used at .*dev.jsonl:1"):
        read_sources([source], "medqa")
    with pytest.raises(ValueError, match="unknown source format 'medq'; did you mean 'medqa'"):
        read_sources([source], "medq")


def test_generic_fields_are_checked() -> None:
    assert Fields.parse("public=q,private=c,options=o,answer=a") == Fields("q", "c", "o", "a")
    for text, message in (("public=q,private=c,options=o", "lacks answer"), ("public=q,public=r", "given twice"),
                          ("question=q", "unknown field role 'question'"), ("public", "ROLE=NAME")):
        with pytest.raises(ValueError, match=message):
            Fields.parse(text)
