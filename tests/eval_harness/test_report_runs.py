"""report and plot read one run: files of different runs (fp32 and bf16, two inversion attackers), a key two files
hold with different rows, and rows of different code are refused; what they derive names the files it read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main
from eval_harness.report.runs import label, read_run

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
    assert [r["item"] for r in read_run([first, second]).rows] == ["1", "2", "3"]


@pytest.mark.slow
def test_fp32_and_bf16_files_are_refused_naming_the_field_and_where(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    fp32 = write(tmp_path / "fp32.jsonl", [row("1"), row("2")])
    bf16 = write(tmp_path / "bf16.jsonl", [row("3"), row("4", dtype="bfloat16")])
    with pytest.raises(ValueError, match=r'^rows of different runs: dtype "bfloat16" in .*bf16.jsonl:2, "float32" in '
                                         r'.*fp32.jsonl:1; give each run its own report$'):
        read_run([fp32, bf16])
    for command in ("report", "plot"):
        assert main([command, str(fp32), str(bf16), "--out", str(tmp_path / command)]) == 1
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"decodeleak {command}: rows of different runs: dtype") and "\n" not in error
        assert not (tmp_path / command).exists()


def test_two_attackers_scores_of_the_same_items_are_refused_not_the_first_files(tmp_path: Path) -> None:
    mine = write(tmp_path / "local.jsonl", [attacked("1", "local:gemma", 0.4), attacked("2", "local:gemma", 0.2)])
    theirs = write(tmp_path / "api.jsonl", [attacked("1", "endpoint:gpt", 0.9), attacked("2", "endpoint:gpt", 0.8)])
    with pytest.raises(ValueError, match=r'inversion.attacker "endpoint:gpt" in .*api.jsonl:1, "local:gemma"'):
        read_run([mine, theirs])
    assert main(["report", str(mine), str(theirs), "--out", str(tmp_path / "report")]) == 1
    # the attack run on a subset only, by one attacker: one run
    partial = write(tmp_path / "partial.jsonl", [row("1"), attacked("2", "local:gemma", 0.2)])
    more = write(tmp_path / "more.jsonl", [attacked("3", "local:gemma", 0.6)])
    assert len(read_run([partial, more]).rows) == 3
    # but item 1 unattacked in one file and attacked in another: which one a table shows would be the order's
    with pytest.raises(ValueError, match=r"key s-1 holds different rows .*\(differing: inversion\)"):
        read_run([partial, mine])


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


def test_one_key_with_different_rows_is_refused_whatever_the_order(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.jsonl", [row("1"), row("2")])
    changed = row("2", correct=False)
    changed["metrics"] = {**changed["metrics"], "token_er@100": 0.9}
    b = write(tmp_path / "b.jsonl", [row("3"), changed])
    for files in ((a, b), (b, a)):
        first, second = (f"{f}:{2}" for f in files)
        with pytest.raises(ValueError, match=rf"^key s-2 holds different rows in {first} and {second} \(differing: "
                                             r"correct, metrics.token_er@100\); the report would depend on"):
            read_run(files)
        for command in ("report", "plot"):
            assert main([command, *map(str, files), "--out", str(tmp_path / command)]) == 1
            error = capsys.readouterr().err.strip()
            assert "key s-2 holds different rows" in error and "\n" not in error
            assert not (tmp_path / command).exists()
    # the same row in both files (a copy, or a shard written twice) is read once
    copy = write(tmp_path / "copy.jsonl", [row("2")])
    assert [r["item"] for r in read_run([a, copy]).rows] == ["1", "2"]
    # the same content written with other spacing and key order is the same row
    respaced = tmp_path / "respaced.jsonl"
    respaced.write_text(json.dumps(dict(reversed(list(row("1").items()))), indent=None, separators=(", ", ": ")) + "\n")
    assert len(read_run([a, respaced]).rows) == 2


def test_rows_of_different_code_are_refused_unless_mixing_is_asked_for(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    before = write(tmp_path / "before.jsonl", [row("1", code={"sha256": "aaa"}), row("2", code={"sha256": "aaa"})])
    after = write(tmp_path / "after.jsonl", [row("3", code={"sha256": "bbb"})])
    with pytest.raises(ValueError, match=r"^rows scored by different code: code.sha256 bbb in .*after.jsonl:1 \(key "
                                         r"s-3\), aaa in .*before.jsonl:1 \(key s-1\); pass --allow-code-change"):
        read_run([before, after])
    assert main(["report", str(before), str(after), "--out", str(tmp_path / "refused")]) == 1
    assert "different code" in capsys.readouterr().err
    assert read_run([before, after], allow_code_change=True).code_digests == ["aaa", "bbb"]
    out = tmp_path / "mixed"
    assert main(["report", str(before), str(after), "--out", str(out), "--allow-code-change"]) == 0
    assert "code.sha256 aaa, bbb" in (out / "tables.md").read_text()
    # the same key scored by both versions is still two rows for one key: refused, naming the code digest
    rescored = write(tmp_path / "rescored.jsonl", [row("2", code={"sha256": "bbb"})])
    with pytest.raises(ValueError, match=r"key s-2 holds different rows .*\(differing: code.sha256\)"):
        read_run([before, rescored], allow_code_change=True)


@pytest.mark.slow
def test_tables_and_figures_record_the_digest_of_every_file_they_read(tmp_path: Path) -> None:
    import hashlib

    from PIL import Image

    shards = [write(tmp_path / "s1.jsonl", [row("1"), row("2")]), write(tmp_path / "s2.jsonl", [row("3")])]
    digests = [hashlib.sha256(path.read_bytes()).hexdigest() for path in shards]  # independent of the reader
    assert main(["report", *map(str, shards), "--out", str(tmp_path / "report")]) == 0
    sources = json.loads((tmp_path / "report" / "sources.json").read_text())
    assert [(s["path"], s["sha256"], s["rows"]) for s in sources["sources"]] == [
        (str(shards[0]), digests[0], 2), (str(shards[1]), digests[1], 1)]
    assert set(sources["derived"]) == {"tables.md", "tables.csv", "undefended.csv"}
    tables = (tmp_path / "report" / "tables.md").read_text()
    assert all(digest in tables for digest in digests)
    assert main(["plot", *map(str, shards), "--out", str(tmp_path / "plots")]) == 0
    figure = tmp_path / "plots" / "privacy_utility_cloud.png"
    recorded = json.loads(Image.open(figure).info["Description"])
    assert [s["sha256"] for s in recorded["sources"]] == digests
    assert digests[0].encode() in (tmp_path / "plots" / "privacy_utility_cloud.pdf").read_bytes()
    assert figure.name in json.loads((tmp_path / "plots" / "sources.json").read_text())["derived"]
