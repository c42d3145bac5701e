"""report and plot read one run: files of different runs (fp32 and bf16, two inversion attackers) are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main
from eval_harness.report.runs import check_one_run, label

RUN = {"models": {"slm": {"name": "edge", "sha256": "ab"}, "llm": {"name": "cloud", "sha256": "cd"}},
       "dtype": "float32", "backend": "reference", "protocol": {"max_new_tokens": 8}, "seed": 0,
       "batching": {"concurrency": 4, "lockstep": True, "forwards": "per-sequence", "batch_invariant": True}}


def row(item: str, **fields) -> dict:
    return {"key": f"s-{item}", "task": "medpriv", "item": item, "mode": "cloud", "policy": "undefended",
            "params": {}, "alpha": 0.3, "correct": True, "metrics": {f"{m}@100": 0.5 for m in
                                                                     ("token_er", "rouge1_er", "span_er", "auc")},
            "inversion": None, **RUN, **fields}


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def attacked(item: str, attacker: str, recall: float) -> dict:
    return row(item, inversion={"attacker": attacker, "k": 100, "max_new_tokens": 256, "prompt": "v1",
                                "recall": recall, "f1": recall, "reconstruction": "..."})


def test_shards_of_one_run_merge_and_rows_older_than_a_field_match(tmp_path: Path) -> None:
    first = write(tmp_path / "a.jsonl", [row("1"), row("2")])
    older = {k: v for k, v in row("3").items() if k != "batching"} | {"protocol": None}  # before those were recorded
    second = write(tmp_path / "b.jsonl", [older, row("2")])
    assert [r["item"] for r in check_one_run([first, second])] == ["1", "2", "3"]


def test_fp32_and_bf16_files_are_refused_naming_the_field_and_where(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    fp32 = write(tmp_path / "fp32.jsonl", [row("1"), row("2")])
    bf16 = write(tmp_path / "bf16.jsonl", [row("3"), row("4", dtype="bfloat16")])
    with pytest.raises(ValueError, match=r'^rows of different runs: dtype "bfloat16" in .*bf16.jsonl:2, "float32" in '
                                         r'.*fp32.jsonl:1; give each run its own report$'):
        check_one_run([fp32, bf16])
    for command in ("report", "plot"):
        assert main([command, str(fp32), str(bf16), "--out", str(tmp_path / command)]) == 1
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"decodeleak {command}: rows of different runs: dtype") and "\n" not in error
        assert not (tmp_path / command).exists()


def test_two_attackers_scores_of_the_same_items_are_refused_not_the_first_files(tmp_path: Path) -> None:
    mine = write(tmp_path / "local.jsonl", [attacked("1", "local:gemma", 0.4), attacked("2", "local:gemma", 0.2)])
    theirs = write(tmp_path / "api.jsonl", [attacked("1", "endpoint:gpt", 0.9), attacked("2", "endpoint:gpt", 0.8)])
    with pytest.raises(ValueError, match=r'inversion.attacker "endpoint:gpt" in .*api.jsonl:1, "local:gemma"'):
        check_one_run([mine, theirs])
    assert main(["report", str(mine), str(theirs), "--out", str(tmp_path / "report")]) == 1
    # the attack run on a subset only, by one attacker: one run
    partial = write(tmp_path / "partial.jsonl", [row("1"), attacked("2", "local:gemma", 0.2)])
    assert len(check_one_run([partial, mine])) == 2


def test_the_report_says_the_dtype_and_the_batching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [row("1"), row("2")]
    assert label(rows) == "dtype=float32, batching: one forward per item (rows independent of their batch)"
    padded = {**RUN["batching"], "forwards": "padded", "batch_invariant": False}
    assert label([row("1", dtype="bfloat16", batching=padded), row("2", dtype="bfloat16")]) == (
        "dtype=bfloat16, batching: 1 of 2 rows from padded batched forwards (such a row depends on which items "
        "shared its batches)")
    path = write(tmp_path / "run.jsonl", rows)
    assert main(["report", str(path), "--out", str(tmp_path / "report")]) == 0
    assert capsys.readouterr().out.startswith(
        "# DecodeLeak report: 2 rows from 1 file(s) of one run; dtype=float32, batching: one forward per item")
