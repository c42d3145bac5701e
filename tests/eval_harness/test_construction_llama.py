"""build-benchmark against a real OpenAI-compatible server on loopback: llama-cpp-python's server with the
embedded Gemma-3 270M, replies constrained by the JSON schema (a grammar), on two items (one MedQA-style, one
Cosmos QA-style), then finalize. A 270M judge judges badly; the point is that every reply it gives parses
to the schema's shape, that whatever spans it invents are dropped by reason, and that a re-run costs nothing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main
from eval_harness.construction import judge as J
from eval_harness.construction.pipeline import read_stage
from eval_harness.datasets import load_task

from tests.support.construction_sources import cosmosqa_record, medqa_record, shipped, write_by_split
from tests.support.llama_server import MODEL_ALIAS, llama_cpp_server

pytestmark = pytest.mark.model

#: one item of each format (greedy replies, so the same every run): the MedQA-style item is kept at screening and
#: its extraction finds no valid span, the Cosmos QA-style one is not decisive; three of each (8 judge calls, not
#: 3) added only more not-decisive verdicts
ITEMS_PER_FORMAT = 1


@pytest.fixture(scope="module")
def gemma_server():
    # the GGUF carries no chat template: the server's gemma format, which drops system messages (hence
    # --no-system-role, which opens the user turn with the system text, as Gemma's own template does)
    with llama_cpp_server(chat_format="gemma") as (base, _):
        yield base


def test_items_of_both_formats_through_a_grammar_constrained_judge(gemma_server: str, tmp_path: Path, capsys) -> None:
    kept_items = 0
    for dataset, source_format, record in (("MEDPRIV.jsonl", "medqa", medqa_record),
                                           ("COMMPRIV.jsonl", "cosmosqa", cosmosqa_record)):
        rows = shipped(dataset)[:ITEMS_PER_FORMAT]
        sources = write_by_split(rows, [record(row) for row in rows], tmp_path / source_format)
        out, cache = tmp_path / f"build-{source_format}", tmp_path / "cache"
        argv = ["build-benchmark", *map(str, sources), "--format", source_format, "--out", str(out),
                "--endpoint", gemma_server, "--model", MODEL_ALIAS, "--json-mode", "object-schema",
                "--no-system-role", "--max-tokens", "160", "--max-spans", "4", "--max-span-chars", "60",
                "--max-text-chars", "60", "--parallel", "1", "--cache", str(cache)]
        assert main(argv) == 0
        assert f"calls to {MODEL_ALIAS}" in capsys.readouterr().err

        by_id = {row["_id"]: row for row in rows}
        screening = read_stage(out / "screening.jsonl")
        assert sorted(screening) == sorted(by_id)
        # the grammar holds every reply to the schema: no invalid JSON, no wrong shape
        assert {row["reason"] for row in screening.values()} <= {J.KEPT, J.NOT_DECISIVE, J.ANSWERABLE}
        extraction = read_stage(out / "extraction.jsonl")
        assert sorted(extraction) == sorted(k for k, row in screening.items() if row["kept"])
        assert {row["reason"] for row in extraction.values()} <= {J.KEPT, J.NO_VALID_SPAN}
        for item_id, row in extraction.items():
            source = by_id[item_id]
            for span in row["spans"]:  # checked here without the judge's own functions
                assert span in source["private_context"] and span.lower() not in source["public_query"].lower()
                assert "," not in span
            proposed = json.loads(row["reply"])["evidence_spans"]
            assert len(row["spans"]) + len(row["dropped"]) >= len(proposed)  # comma pieces counted one by one
        summary = json.loads((out / "summary.json").read_text())
        assert summary["extract"]["spans_dropped"] == Counter(
            d["reason"] for row in extraction.values() for d in row["dropped"])
        kept_items += summary["screen"]["kept"]

        # every request went out as one user turn with the schema's grammar
        for path in cache.rglob("*.json"):
            request = json.loads(path.read_text())
            assert [m["role"] for m in request["messages"]] == ["user"]
            assert request["params"]["response_format"]["type"] == "json_object"
            assert "pattern" in json.dumps(request["params"]["response_format"]["schema"])

        assert main(argv) == 0  # a re-run: every call from the cache
        assert f"0 calls to {MODEL_ALIAS}" in capsys.readouterr().err

        proposals = sum(row["kept"] for row in extraction.values())
        code = main(["finalize", str(out), "--unreviewed"])
        if proposals:
            assert code == 0
            assert len(load_task(str(out / "final" / f"{out.name}.jsonl"))) == proposals
        else:
            assert code == 1 and "no item to write" in capsys.readouterr().err
    assert kept_items > 0  # some item reached the extraction stage on the real server
