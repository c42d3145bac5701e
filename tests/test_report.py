"""decodeleak report: tables from a small fixed JSONL, hand-checked; no model library imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.report.tables import bootstrap_interval, csv_text, lines, markdown, table

from tests.cli_runs import decodeleak_in_fresh_process



def row(item: str, policy: str, params: dict, correct: bool, token_er: float, release: float) -> dict:
    return {"key": f"{policy}-{item}", "task": "medpriv", "mode": "cloud", "policy": policy, "params": params,
            "item": item, "correct": correct,
            "metrics": {"token_er@100": token_er, "token_er@100:release": release, "span_er@100": token_er / 2}}


ROWS = [
    row("a", "undefended", {}, True, 0.50, 0.40),
    row("b", "undefended", {}, False, 0.70, 0.60),
    row("a", "coveil", {"lam": 1}, True, 0.10, 0.05),
    row("b", "coveil", {"lam": 1}, True, 0.00, 0.00),
    row("c", "coveil", {"lam": 1}, False, 0.20, 0.10),
]


def test_lines_group_settings_with_their_item_counts() -> None:
    grouped = lines(ROWS, ("token_er@100", "span_er@100"))
    assert [(g.policy, g.items) for g in grouped] == [("undefended", 2), ("coveil", 3)]
    # undefended: (0.5 + 0.7) / 2 = 0.6; coveil: (0.1 + 0 + 0.2) / 3 = 0.1; span_er is half of each
    assert grouped[0].mean("token_er@100") == pytest.approx(0.6)
    assert grouped[1].mean("token_er@100") == pytest.approx(0.1)
    assert grouped[1].mean("span_er@100") == pytest.approx(0.05)
    assert lines(ROWS, ("token_er@100",), suffix=":release")[0].mean("token_er@100") == pytest.approx(0.5)


def test_cells_carry_the_mean_its_interval_and_the_item_count() -> None:
    cells = table(ROWS, metrics=("token_er@100", "auc@100"))
    assert cells[0]["items"] == "2" and cells[0]["accuracy"] == "50.0"  # one of two correct
    assert cells[1]["params"] == "lam=1" and cells[1]["accuracy"] == "66.7"  # two of three
    assert cells[0]["token_er@100"].startswith("60.0 [") and cells[0]["auc@100"] == "-"  # not recorded
    low, high = bootstrap_interval([0.5, 0.7])
    assert 0.5 <= low <= 0.6 <= high <= 0.7  # a resampled mean lies between the smallest and largest value
    assert bootstrap_interval([0.3] * 5) == (pytest.approx(0.3), pytest.approx(0.3))
    text = markdown(cells, "Cloud-side")
    assert text.startswith("Cloud-side\n\n| task | mode | policy |") and text.count("\n| medpriv |") == 2
    assert csv_text(cells).splitlines()[0].startswith("task,mode,policy,params,items,accuracy")


def test_the_report_command_writes_markdown_and_csv(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "report"
    done, heavy = decodeleak_in_fresh_process(["report", str(results), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert heavy == []  # the report reads rows only
    assert (out / "tables.md").read_text().count("| medpriv |") == 4  # 2 settings x (paper, release) tables
    assert (out / "tables.csv").read_text().startswith("rules,task,mode,policy")


def test_the_plot_command_draws_one_figure_per_mode(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    rows = []
    for mode in ("cloud", "edge"):
        rows += [row(f"u{i}", "undefended", {}, rng.random() < 0.5, 0.6, 0.5) | {"mode": mode, "key": f"{mode}-u{i}"}
                 for i in range(4)]
        for lam in (0, 1, 2, 4):
            rows += [row(f"i{i}", "coveil", {"lam": lam}, rng.random() < 0.6 - lam / 20, 0.5 / (1 + lam), 0.4)
                     | {"mode": mode, "key": f"{mode}-{lam}-{i}"} for i in range(4)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from eval_harness.cli.decodeleak import main

    assert main(["plot", str(results), "--out", str(tmp_path / "plots")]) == 0
    for mode in ("cloud", "edge"):
        for ext in ("png", "pdf"):
            assert (tmp_path / "plots" / f"privacy_utility_{mode}.{ext}").stat().st_size > 10_000
