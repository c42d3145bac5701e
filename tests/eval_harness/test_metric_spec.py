"""A metric registered once (one :class:`MetricSpec` and its function) reaches the tables, the figures and the
demo, and each honours its direction: the most private setting is the one its ``better`` says."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from edge_sdk.client import EdgeClient
from edge_sdk.backends.pieces import piece_reader
from edge_sdk.policies import Undefended
from edge_sdk.testing import ScriptedCloud, TableSLM
from eval_harness import demo
from eval_harness.datasets import DecodeLeakItem
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.metrics import METRIC_SPECS, METRICS, MetricSpec, RecallCase, Vocabulary, register_metric
from eval_harness.report import plots
from eval_harness.report.tables import markdown, metrics_recorded, table, table_numbers

from tests.eval_harness.test_demo_protocol import PIECES, SCRIPTED, one_hot


def hidden_er(case: RecallCase, k: int) -> float:
    """The share of evidence tokens the cloud could NOT read: higher is more private."""
    return 1.0 - case.recall(case.evidence.tokens, k)


@pytest.fixture
def hidden(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``hidden_er`` registered for the test only, shown everywhere, higher is better."""
    monkeypatch.setattr(METRICS, "_entries", dict(METRICS._entries))
    saved = dict(METRIC_SPECS)
    register_metric("hidden_er", hidden_er, "Hidden-ER", better="higher", demo=True)
    yield
    METRIC_SPECS.clear()
    METRIC_SPECS.update(saved)


def row(policy: str, item: str, token_er: float, **more: Any) -> dict[str, Any]:
    metrics = {f"{name}@{k}": value for k in (1, 100) for name, value in
               (("token_er", token_er), ("hidden_er", 1.0 - token_er))}
    return {"task": "medpriv", "mode": "cloud", "policy": policy, "params": more, "correct": True, "item_id": item,
            "metrics": metrics}


#: undefended leaks 60% of the evidence (hides 40%), coveil 10% (hides 90%)
ROWS = [row("undefended", "a", 0.5), row("undefended", "b", 0.7), row("coveil", "a", 0.1, lam=1),
        row("coveil", "b", 0.1, lam=1)]


def test_a_spec_refuses_a_direction_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="better"):
        MetricSpec("x", "X", fn=hidden_er, better="smaller")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trace metric"):
        MetricSpec("x", "X")  # neither a function nor a row field to read


def test_the_tables_show_a_registered_metric_and_bold_its_best_by_its_direction(hidden: None) -> None:
    assert "hidden_er@100" in metrics_recorded(ROWS)
    undefended, coveil = table(ROWS)
    # Token-ER: lower is more private, coveil's 10.0 is bold; Hidden-ER: higher is, coveil's 90.0 (not the 40.0)
    assert coveil["token_er@100"].startswith("**10.0** [") and undefended["token_er@100"].startswith("60.0 [")
    assert coveil["hidden_er@100"].startswith("**90.0** [") and undefended["hidden_er@100"].startswith("40.0 [")
    assert "Hidden-ER@100" in markdown(table(ROWS)).splitlines()[0]
    numbers = table_numbers(ROWS)[0]
    assert numbers["hidden_er@100"] == pytest.approx(40.0) and numbers["hidden_er@100_n"] == 2


def test_the_figures_draw_a_registered_metric_with_its_direction(hidden: None, monkeypatch, tmp_path) -> None:
    drawn: list[Any] = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, out, stem, **_: drawn.append(fig) or [out / stem])
    fig = plots.privacy_utility_figure(ROWS, "medpriv", "cloud")
    labels = [ax.get_xlabel() for ax in fig.axes if ax.get_visible()]
    assert "Hidden-ER@100 (%), higher is more private" in labels
    assert "Token-ER@100 (%), lower is more private" in labels
    plots.leakage_vs_k(ROWS, tmp_path, policy="coveil")
    (k_figure,) = drawn
    assert "Hidden-ER@K (%), higher is more private" in [ax.get_ylabel() for ax in k_figure.axes]


def test_the_demo_scores_shows_and_ranks_a_registered_metric(hidden: None) -> None:
    item = DecodeLeakItem(item_id="q1", public_query="Which organ filters blood?",
                          options={"A": "Heart", "B": "Kidney", "C": "Lung", "D": "Skin"},
                          private_context="Creatinine 3.1", evidence_spans=("Creatinine",), answer="B")
    slm = TableSLM(PIECES, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), [one_hot(p) for p in SCRIPTED] * 2, eos_ids={0})
    protocol = DecodingProtocol(max_new_tokens=8)
    with EdgeClient(cloud.session, slm=slm) as client:
        result = demo.decode_item(client, protocol, item, Undefended(), mode="edge", exposure_k=100)
    run = demo.RunRow("edge", "undefended", k=100)
    run.add(item, result, 0.1, Vocabulary(lambda text: slm.tokenize(text, add_bos=False), piece_reader(slm)),
            protocol)
    summary = run.summary()
    # scored by both rule sets, each the complement of Token-ER under the same rules
    for key in ("@100", "@100 (release)"):
        assert summary[f"hidden_er{key}"] == pytest.approx(1.0 - float(summary[f"token_er{key}"]))

    # two policies of one mode, by hand: one reads none of the evidence (hides all), the other half of it
    private = {**summary, "policy": "private",
               **{key: 1.0 if key.startswith("hidden_er") else 0.0 for key in summary if "_er@" in key}}
    leaky = {**summary, "policy": "leaky", **{key: 0.5 for key in summary if "_er@" in key}}
    console = Console(record=True, width=400)
    demo._print_table(console, [private, leaky], 1)
    text = console.export_text()
    assert "Hidden-ER" in text and "Hidden-ER (release)" in text and "100.0%" in text
    best = demo.best_demo_cells([private, leaky], 100)
    assert (0, "hidden_er@100") in best and (1, "hidden_er@100") not in best  # higher is better: 100% beats 50%
    assert (0, "token_er@100") in best and (1, "token_er@100") not in best  # lower is better: 0% beats 50%
