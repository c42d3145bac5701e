"""decodeleak report: tables from a small fixed JSONL, hand-checked; no model library imported."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from eval_harness.report.tables import bootstrap_interval, csv_text, lines, markdown, table, table_numbers

from tests.support.cli_runs import decodeleak_in_fresh_process



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
    assert csv_text(cells).splitlines()[0].startswith("task,mode,policy,params,alpha,items,accuracy")


def test_settings_decoded_at_another_alpha_are_lines_of_their_own() -> None:
    at = [dict(r, alpha=0.3) for r in ROWS] + [dict(r, key=r["key"] + "-a5", alpha=0.5) for r in ROWS[:2]]
    at[-1]["metrics"] = {"token_er@100": 0.1, "token_er@100:release": 0.1}  # item b at alpha 0.5
    cells = table(at, metrics=("token_er@100",))
    assert [(c["policy"], c["alpha"], c["items"]) for c in cells] == [
        ("undefended", "0.3", "2"), ("coveil", "0.3", "3"), ("undefended", "0.5", "2")]
    assert cells[0]["token_er@100"].startswith("60.0 [")  # (0.5 + 0.7) / 2, nothing of alpha 0.5 mixed in
    assert cells[2]["token_er@100"].startswith("30.0 [")  # (0.5 + 0.1) / 2


def report_in_a_fresh_process(rows: list[dict], tmp_path: Path) -> Path:
    """``decodeleak report`` over ``rows`` in its own interpreter; checks it imported no model library."""
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report"
    done, heavy = decodeleak_in_fresh_process(["report", str(results), "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert heavy == []  # the report reads rows only
    return out


def test_the_report_command_writes_markdown_and_csv(tmp_path: Path) -> None:
    out = report_in_a_fresh_process(ROWS, tmp_path)
    # (2 settings in the cloud-side table + the undefended table's one line) x (paper, release) rules
    assert (out / "tables.md").read_text().count("| medpriv |") == 6
    assert (out / "tables.csv").read_text().startswith("rules,task,mode,policy")


@pytest.mark.slow
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


def scored(item: str, mode: str, policy: str, params: dict, correct: bool, metrics: dict,
           inversion: tuple[float, float] | None) -> dict:
    """A row as a sweep with the inversion attack writes it (``inversion`` null when the attack did not run)."""
    return {"key": f"{mode}-{policy}-{json.dumps(params)}-{item}", "task": "medpriv", "mode": mode, "policy": policy,
            "params": params, "item": item, "correct": correct, "metrics": metrics,
            "inversion": None if inversion is None else {"attacker": "local:test", "k": 100, "recall": inversion[0],
                                                         "f1": inversion[1], "reconstruction": "..."}}


FULL = {"token_er@100": 0.5, "rouge1_er@100": 0.4, "span_er@100": 0.2, "auc@100": 0.3}
INVERSION_ROWS = [
    scored("a", "cloud", "undefended", {}, True, FULL, (0.4, 0.3)),
    scored("b", "cloud", "undefended", {}, False, {"token_er@100": 0.7, "rouge1_er@100": 0.6, "span_er@100": 0.4,
                                                   "auc@100": 0.5}, (0.2, 0.1)),
    scored("a", "edge", "undefended", {}, True, {"token_er@100": 0.3}, (0.5, 0.4)),
    scored("b", "edge", "undefended", {}, True, {"token_er@100": 0.3}, (0.3, 0.2)),
    scored("c", "edge", "undefended", {}, False, {"token_er@100": 0.6}, None),  # decoded, not attacked
    scored("a", "cloud", "coveil", {"lam": 1}, True, {"token_er@100": 0.1}, (0.1, 0.05)),
    scored("b", "cloud", "coveil", {"lam": 1}, True, {"token_er@100": 0.0}, (0.1, 0.15)),
]


def test_the_undefended_table_has_the_papers_columns_with_inversion() -> None:
    from eval_harness.report.tables import undefended_table

    cloud, edge = undefended_table(INVERSION_ROWS)
    assert list(cloud) == ["task", "fusion", "alpha", "items", "accuracy", "token_er@100", "rouge1_er@100", "span_er@100",
                           "auc@100", "inversion_recall", "inversion_f1"]
    # cloud-side: 2 items, 1 correct; Token-ER (0.5 + 0.7) / 2 = 60%, ROUGE1-ER 50%, Span-ER 30%, AUC 40%;
    # inversion recall (0.4 + 0.2) / 2 = 30%, F1 (0.3 + 0.1) / 2 = 20%
    assert (cloud["fusion"], cloud["items"], cloud["accuracy"]) == ("cloud-side", "2", "50.0")
    for column, mean in (("token_er@100", "60.0"), ("rouge1_er@100", "50.0"), ("span_er@100", "30.0"),
                         ("auc@100", "40.0"), ("inversion_recall", "30.0"), ("inversion_f1", "20.0")):
        assert cloud[column].startswith(mean + " [") and "n=" not in cloud[column], column
    # edge-side: 3 items, 2 correct; Token-ER (0.3 + 0.3 + 0.6) / 3 = 40%; the attack ran on 2 of the 3 items:
    # recall (0.5 + 0.3) / 2 = 40%; a resampled mean of two values is 0.3, 0.4 or 0.5 (1/4, 1/2, 1/4), so the
    # 95% interval is [30, 50]; the cell says it covers 2 items
    assert (edge["items"], edge["accuracy"]) == ("3", "66.7")
    assert edge["token_er@100"].startswith("40.0 [")
    assert edge["inversion_recall"] == "40.0 [30.0, 50.0] n=2"
    assert edge["rouge1_er@100"] == "-"  # not recorded


def test_per_method_tables_gain_inversion_columns_when_rows_have_them() -> None:
    from eval_harness.report.tables import metrics_recorded

    leakage = ("token_er@100", "rouge1_er@100", "span_er@100", "auc@100")
    assert metrics_recorded(ROWS) == leakage  # rows without the attack: no inversion columns
    assert metrics_recorded(INVERSION_ROWS) == leakage + ("inversion_recall", "inversion_f1")
    cells = table([r for r in INVERSION_ROWS if r["mode"] == "cloud"], metrics=metrics_recorded(INVERSION_ROWS))
    coveil = cells[1]
    assert coveil["policy"] == "coveil" and coveil["items"] == "2"
    assert coveil["inversion_recall"] == "**10.0** [10.0, 10.0]"  # both 0.1; bold: below undefended
    assert coveil["inversion_f1"].startswith("**10.0** [")  # (0.05 + 0.15) / 2


def test_the_report_command_writes_the_undefended_table(tmp_path: Path) -> None:
    out = report_in_a_fresh_process(INVERSION_ROWS, tmp_path)
    text = (out / "tables.md").read_text()
    assert text.count("## Undefended DecodeLeak") == 2  # by the paper's rules and by the release's
    assert "| medpriv | edge-side |  | 3 | 66.7 |" in text and "40.0 [30.0, 50.0] n=2" in text
    undefended = list(csv.DictReader((out / "undefended.csv").read_text().splitlines()))
    metrics = ("token_er@100", "rouge1_er@100", "span_er@100", "auc@100", "inversion_recall", "inversion_f1")
    assert list(undefended[0]) == ["rules", "task", "fusion", "alpha", "items", "accuracy",
                                   *(f"{m}{part}" for m in metrics for part in ("", "_lo", "_hi", "_n"))]
    assert len(undefended) == 2 * 2  # (cloud, edge) x (paper, release)
    # numbers, not text: the edge-side attack ran on 2 of 3 items, recall (0.5 + 0.3) / 2 = 40% in [30, 50]
    edge = next(r for r in undefended if r["rules"] == "paper" and r["fusion"] == "edge-side")
    assert (edge["items"], float(edge["accuracy"])) == ("3", pytest.approx(200 / 3, abs=1e-4))
    assert [float(edge[f"inversion_recall{part}"]) for part in ("", "_lo", "_hi")] == [40.0, 30.0, 50.0]
    assert edge["inversion_recall_n"] == "2" and edge["rouge1_er@100"] == "" and edge["rouge1_er@100_n"] == "0"
    assert (out / "tables.csv").read_text().splitlines()[0].endswith(
        "inversion_recall,inversion_recall_lo,inversion_recall_hi,inversion_recall_n,"
        "inversion_f1,inversion_f1_lo,inversion_f1_hi,inversion_f1_n")


def tradeoff_rows() -> list[dict]:
    """Two methods whose curves cross near the undefended point: their end labels compete for the same space."""
    rows = [scored(f"u{i}", "cloud", "undefended", {}, i < 3, {"token_er@100": 0.5}, (0.40, 0.3)) for i in range(4)]
    for lam in (0, 0.5, 1, 2, 4):
        recall = 0.40 - 0.07 * lam
        rows += [scored(f"i{i}", "cloud", "coveil", {"lam": lam}, i < 3 - (lam >= 2), {"token_er@100": 0.1},
                        (recall, recall / 2)) for i in range(4)]
    for eps in (1, 2, 4, 8):
        recall = 0.10 + 0.035 * eps
        rows += [scored(f"i{i}", "cloud", "dp_logit", {"epsilon": eps}, i < (1 if eps < 4 else 3),
                        {"token_er@100": 0.1}, (recall, recall / 2)) for i in range(4)]
    return rows


def test_the_inversion_tradeoff_figure_draws_each_method_and_labels_nothing_over_another(tmp_path: Path) -> None:
    from eval_harness.report.plots import inversion_tradeoff_figure

    fig = inversion_tradeoff_figure(tradeoff_rows(), "medpriv", "cloud")
    ax = fig.axes[0]
    curves = {line.get_label(): line for line in ax.get_lines()}
    # in the order of the swept values: CoVeil's recall is 40 - 7 lam (%) for lam = 0, 0.5, 1, 2, 4, its accuracy
    # 3 of 4 below lam = 2 and 2 of 4 from there; DP-Logit's recall is 10 + 3.5 eps for eps = 1, 2, 4, 8
    assert list(curves["coveil"].get_xdata()) == pytest.approx([40.0, 36.5, 33.0, 26.0, 12.0])
    assert list(curves["coveil"].get_ydata()) == pytest.approx([75.0, 75.0, 75.0, 50.0, 50.0])
    assert list(curves["dp_logit"].get_xdata()) == pytest.approx([13.5, 17.0, 24.0, 38.0])
    star = ax.collections[0]
    assert list(star.get_offsets()[0]) == pytest.approx([40.0, 75.0])  # undefended: recall 40%, 3 of 4 correct
    renderer = fig.canvas.get_renderer()
    notes = [t for t in ax.texts]
    assert sorted(t.get_text() for t in notes) == ["epsilon=1", "epsilon=8", "lam=0", "lam=4"]
    boxes = [t.get_window_extent(renderer) for t in notes]
    legend = ax.get_legend().get_window_extent(renderer)
    for i, box in enumerate(boxes):
        assert not box.overlaps(legend)
        assert all(not box.overlaps(other) for other in boxes[i + 1:]), [t.get_text() for t in notes]


@pytest.mark.slow
def test_the_plot_command_draws_the_inversion_tradeoff(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in tradeoff_rows()))
    from eval_harness.cli.decodeleak import main

    assert main(["plot", str(results), "--out", str(tmp_path / "plots")]) == 0
    for ext in ("png", "pdf"):
        assert (tmp_path / "plots" / f"inversion_tradeoff_medpriv_cloud.{ext}").stat().st_size > 10_000
    assert not list((tmp_path / "plots").glob("inversion_tradeoff_*_edge.*"))  # no edge rows: no edge figure


def two_task_rows() -> list[dict]:
    """CoVeil at lam = 0, 1, 2 and undefended, 2 items each, on two tasks whose leakage differs by 40 points:
    medpriv's Token-ER@100 is 50 - 10 lam (%), commpriv's 90 - 10 lam; every item correct on medpriv, none on
    commpriv.  The labels of CoVeil's two ends (lam=0 and lam=2) sit next to the undefended star and a curve."""
    rows = []
    for task, base, correct in (("medpriv", 0.5, True), ("commpriv", 0.9, False)):
        for policy, params, er in [("undefended", {}, base)] + [("coveil", {"lam": lam}, base - lam / 10)
                                                                 for lam in (0, 1, 2)]:
            rows += [{"key": f"{task}-{policy}-{params}-{i}", "task": task, "mode": "edge", "policy": policy,
                      "params": params, "item": f"i{i}", "correct": correct,
                      "metrics": {"token_er@100": er, "span_er@100": er / 2}} for i in range(2)]
    return rows


@pytest.mark.slow
def test_privacy_utility_draws_each_task_apart_and_labels_nothing_over_another(tmp_path: Path) -> None:
    from eval_harness.report.plots import privacy_utility, privacy_utility_figure

    rows = two_task_rows()
    fig = privacy_utility_figure(rows, "medpriv", "edge")
    token_ax = fig.axes[0]
    (coveil,) = [line for line in token_ax.get_lines() if line.get_label() == "coveil"]
    # medpriv only, in order of leakage: lam = 2, 1, 0 at 30, 40, 50 %, all correct (commpriv's 70..90 % absent)
    assert list(coveil.get_xdata()) == pytest.approx([30.0, 40.0, 50.0])
    assert list(coveil.get_ydata()) == pytest.approx([100.0, 100.0, 100.0])
    assert [list(c.get_offsets()[0]) for c in token_ax.collections] == [pytest.approx([50.0, 100.0])]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        notes = list(ax.texts)
        assert sorted(t.get_text() for t in notes) == ["lam=0", "lam=2"]
        boxes = [t.get_window_extent(renderer) for t in notes]
        assert not boxes[0].overlaps(boxes[1])
        assert all(ax.get_window_extent(renderer).contains(b.x0, b.y0) for b in boxes)
    paths = privacy_utility(rows, tmp_path)
    assert sorted(p.name for p in paths) == ["privacy_utility_edge_commpriv.pdf", "privacy_utility_edge_commpriv.png",
                                             "privacy_utility_edge_medpriv.pdf", "privacy_utility_edge_medpriv.png"]


def test_report_and_plot_name_a_row_that_is_not_a_result_in_one_line(tmp_path: Path, capsys) -> None:
    from eval_harness.cli.decodeleak import main

    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"key": "a", "task": "medpriv"}) + "\n")
    for command in ("report", "plot"):
        assert main([command, str(results), "--out", str(tmp_path / command)]) == 1
        assert capsys.readouterr().err == (f"decodeleak {command}: {results}:1: row 'a' is not a decodeleak result "
                                           "row: it has no mode, policy, correct, metrics\n")


def test_tables_and_figures_name_metrics_by_their_registered_labels() -> None:
    from eval_harness.metrics import metric_label

    head = markdown(table(ROWS, metrics=("token_er@100", "auc@100"))).splitlines()[0]
    assert head.endswith("| accuracy | epsilon_spent | Token-ER@100 | AUC@100 |")
    assert metric_label("span_er@100:release") == "Span-ER@100:release"
    assert metric_label("rouge1_er") == "ROUGE1-ER" and metric_label("accuracy") == "accuracy"


def with_privacy(row: dict, epsilon: float | None, guarantee: str = "dp", delta: float = 1e-5) -> dict:
    return dict(row, privacy={"guarantee": guarantee, "epsilon_spent": epsilon, "delta": delta,
                              "accountant": "rdp (dp-accounting)", "events": 3})


def test_the_report_carries_the_epsilon_each_setting_spent() -> None:
    rows = [with_privacy(row("a", "dp_logit", {"epsilon": 1}, True, 0.2, 0.1), 3.0),
            with_privacy(row("b", "dp_logit", {"epsilon": 1}, False, 0.2, 0.1), 5.0),  # stopped earlier
            with_privacy(ROWS[2], None, "non-private"), with_privacy(ROWS[3], 0.0, "non-private"),  # CoVeil
            ROWS[0]]  # a row written before the ledger
    cells = {c["policy"]: c["epsilon_spent"] for c in table(rows, metrics=("token_er@100",))}
    # hand: (3 + 5) / 2 = 4 at delta 1e-5; one CoVeil item released nothing, the other did: the line is non-private
    assert cells == {"dp_logit": "4 (delta 1e-05)", "coveil": "non-private", "undefended": "-"}
    # the CSV carries it as numbers, and every column the Markdown table has
    numbers = {n["policy"]: n for n in table_numbers(rows, metrics=("token_er@100",))}
    assert {k: numbers["dp_logit"][k] for k in ("epsilon_spent", "epsilon_delta", "epsilon_n", "guarantee")} == {
        "epsilon_spent": 4.0, "epsilon_delta": "1e-05", "epsilon_n": 2, "guarantee": "dp"}
    assert (numbers["coveil"]["guarantee"], numbers["coveil"]["epsilon_spent"]) == ("non-private", None)
    assert (numbers["undefended"]["guarantee"], numbers["undefended"]["epsilon_n"]) == (None, 0)
    assert set(table(rows, metrics=("token_er@100",))[0]) <= set(numbers["dp_logit"])


@pytest.mark.slow
def test_the_epsilon_figure_draws_leakage_and_a_readable_accuracy_panel_for_the_dp_baselines(tmp_path: Path) -> None:
    from eval_harness.report.plots import privacy_utility_epsilon_figure

    rows = [with_privacy(r, None, "non-private") for r in tradeoff_rows() if r["policy"] != "dp_logit"]
    for eps, spent, token_er in ((1, 6.5, 0.30), (8, 70.7, 0.55)):  # hand: two settings, four items each
        rows += [with_privacy(scored(f"i{i}", "cloud", "dp_logit", {"epsilon": eps}, i < 1 + eps // 4,
                                     {"token_er@100": token_er}, (0.2, 0.1)), spent) for i in range(4)]
    fig = privacy_utility_epsilon_figure(rows, "medpriv", "cloud", metrics=("token_er@100",))
    leakage, accuracy = fig.axes[:2]
    (curve,) = leakage.get_lines()  # CoVeil and undefended have no epsilon
    assert curve.get_label() == "dp_logit" and leakage.get_xscale() == "log"
    assert leakage.get_ylabel().startswith("Token-ER@100 (%)")
    assert list(curve.get_xdata()) == pytest.approx([6.5, 70.7])
    assert list(curve.get_ydata()) == pytest.approx([30.0, 55.0])  # the mean Token-ER@100 of each setting
    (curve,) = accuracy.get_lines()
    assert accuracy.get_ylabel() == "accuracy (%)"
    assert list(curve.get_ydata()) == pytest.approx([25.0, 75.0])  # 1 of 4, then 3 of 4 correct
    low, high = accuracy.get_ylim()
    assert low <= 25.0 and high >= 75.0 and high - low >= 20.0  # a readable span, not +-0.04 points
    assert privacy_utility_epsilon_figure(tradeoff_rows(), "medpriv", "cloud") is None  # no row has a ledger
    flat = [dict(r, key=r["key"] + "-flat", alpha=0.9) for r in rows if r["policy"] == "dp_logit"]
    for r in flat:
        r["correct"] = True  # a constant accuracy: the axis still spans 20 points around it
    low, high = privacy_utility_epsilon_figure(flat, "medpriv", "cloud").axes[-1].get_ylim()
    assert high - low >= 20.0
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from eval_harness.cli.decodeleak import main

    assert main(["plot", str(results), "--out", str(tmp_path / "plots"), "--epsilon-axis"]) == 0
    assert (tmp_path / "plots" / "privacy_utility_epsilon_cloud.png").stat().st_size > 10_000
