"""``decodeleak``: rows written as they finish, re-runs skip them, shards split the work, every row reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main
from eval_harness.datasets import load_task
from eval_harness.sweep.store import read_rows

pytestmark = pytest.mark.model

COMMON = ["--limit", "2", "--max-new-tokens", "6", "--dtype", "fp32", "--concurrency", "2"]


def test_run_writes_reproducible_rows_and_a_rerun_skips_them(tmp_path: Path, capsys, models_loaded_once) -> None:
    out = tmp_path / "run.jsonl"
    one = [*COMMON, "--limit", "1"]  # one item: what a row records is checked on one row (the later flag wins)
    assert main(["run", "--mode", "edge", "--policy", "coveil", "--param", "lam=1", "--alpha", "0.5", "--out", str(out),
                 *one]) == 0
    rows = list(read_rows([out]))
    assert [row["item"] for row in rows] == [item.item_id for item in load_task("medpriv", 1)]
    row = rows[0]
    assert row["mode"] == "edge" and row["policy"] == "coveil" and row["params"] == {"lam": 1}
    assert row["epsilon_unit"] == "none" and row["alpha"] == 0.5 == row["protocol"]["alpha"] and row["tokens"] <= 6
    assert row["privacy"]["guarantee"] == "non-private" and row["privacy"]["accountant"] == "none"  # the ledger
    assert {"token_er@100", "token_er@100:release", "span_er@10", "auc@50", "rouge1_er@100"} <= set(row["metrics"])
    assert row["evidence"]["evidence_tokens"] > 0
    assert row["models"]["slm"]["sha256"] and row["dtype"] == "float32" and row["protocol"]["max_new_tokens"] == 6
    assert row["version"] and "SeedSequence" in row["seed_policy"]
    capsys.readouterr()
    assert main(["run", "--mode", "edge", "--policy", "coveil", "--param", "lam=1", "--alpha", "0.5", "--out", str(out),
                 *one]) == 0
    assert "0 rows written" in capsys.readouterr().out and len(list(read_rows([out]))) == 1


def test_a_sweep_in_two_shards_covers_the_grid_once(tmp_path: Path, models_loaded_once) -> None:
    config = tmp_path / "grid.json"
    config.write_text(json.dumps({"alpha": 0.3, "cloud": {"coveil": {"lam": [0, 2]}, "cogenesis": {"b": [4]}}}))
    outs = [tmp_path / f"shard-{i}.jsonl" for i in (1, 2)]
    for i, out in enumerate(outs, 1):
        assert main(["sweep", str(config), "--modes", "cloud", "--shard", f"{i}/2", "--out", str(out), *COMMON]) == 0
    rows = list(read_rows(outs))
    assert len(rows) == 3 * 2  # 3 settings x 2 items, each pair in exactly one shard
    assert sorted({(r["policy"], json.dumps(r["params"])) for r in rows}) == [
        ("cogenesis", '{"b": 4}'), ("coveil", '{"lam": 0}'), ("coveil", '{"lam": 2}')]
    assert main(["sweep", str(tmp_path / "missing.json"), "--out", str(outs[0]), *COMMON]) == 1


def test_a_config_file_sets_defaults_the_command_line_overrides(tmp_path: Path) -> None:
    from eval_harness.cli.decodeleak import parse

    config = tmp_path / "audit.json"
    config.write_text(json.dumps({"limit": 20, "tasks": "medpriv,commpriv", "policies": "coveil", "max-new-tokens": 64}))
    args = parse(["sweep", "--config", str(config)])
    assert args.limit == 20 and args.tasks == ["medpriv", "commpriv"] and args.policies == ["coveil"]
    assert args.max_new_tokens == 64
    assert parse(["sweep", "--config", str(config), "--limit", "3"]).limit == 3  # the flag wins
    config.write_text(json.dumps({"no_such_option": 1}))
    with pytest.raises(SystemExit):
        parse(["sweep", "--config", str(config)])
