"""``decodeleak sweep --observer`` end to end on a tiny reference pair (issue 30): each item decoded again with
the next item's private context, both generations recorded as an on-path observer and the cloud see them, the
row's ``observer`` field filled, and ``decodeleak report`` showing the observer columns beside Token-ER."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from edge_sdk.decode_settings import DecodeSettings
from eval_harness.datasets import DecodeLeakItem
from eval_harness.sweep.grid import Setting
from eval_harness.sweep.store import ResultStore, read_rows

#: three items of one question, private contexts of 4, 40 and 14 words
CONTEXTS = ("the liver is swollen", " ".join(["the patient reports a long history of fever and pain"] * 4),
            "codename quartzwhistle 7731 was admitted with jaundice and a swollen yellow liver")
ITEMS = [DecodeLeakItem(f"item-{i}", "Which organ is affected?", {"A": "heart", "B": "liver"}, context, ("liver",),
                        "B") for i, context in enumerate(CONTEXTS)]


@pytest.fixture(scope="module")
def tiny_runner():
    from edge_sdk.backends.pieces import piece_reader
    from eval_harness.decoding_protocol import DecodingProtocol
    from eval_harness.metrics import Vocabulary
    from eval_harness.runners.reference import ReferenceRunner

    from tests.support.tiny_models import tiny_pair

    slm, llm = tiny_pair()
    vocab = Vocabulary(lambda text: slm.tokenize(text, add_bos=False), piece_reader(slm.tokenizer))
    with ReferenceRunner(slm, llm, concurrency=2) as runner:
        yield runner, vocab, DecodingProtocol(max_new_tokens=4, stop_at_answer=False)


def sweep(tiny_runner, out: Path, *, observer: bool, mode: str = "cloud") -> list[dict[str, Any]]:
    from eval_harness.sweep.execute import run_sweep

    runner, vocab, protocol = tiny_runner
    with ResultStore(out) as store:
        run_sweep([Setting("medpriv", mode, "undefended")], {"medpriv": ITEMS}, runner, store, protocol=protocol,
                  vocab=vocab, metadata={}, observer=observer)
    return list(read_rows([out]))


def gaps(times_ms: list[float]) -> np.ndarray:
    return np.diff(np.asarray(times_ms))


@pytest.mark.parametrize("mode", ["cloud", "edge"])
def test_a_sweep_with_the_observer_fills_the_field_from_what_was_on_the_wire(tiny_runner, tmp_path: Path,
                                                                             mode: str) -> None:
    rows = sweep(tiny_runner, tmp_path / "rows.jsonl", observer=True, mode=mode)
    assert sorted(row["item"] for row in rows) == ["item-0", "item-1", "item-2"]
    for row in rows:
        observed = row["observer"]
        index = int(row["item"].removeprefix("item-"))
        assert observed["contrast"] == f"item-{(index + 1) % 3}"  # the next item's context, the last's the first's
        (own,), (contrast,) = observed["wire"], observed["contrast_wire"]  # one session each
        # what the recorder saw pass is what the edge's ledger counted of its steps, byte for byte: every message
        # up after the open; down, the steps' messages among the session's (its reply to the open, its end)
        up = [size for way, size, _ in own["messages"] if way == "up"]
        down = [size for way, size, _ in own["messages"] if way == "down"]
        assert sum(up[1:]) == row["bytes_up"] and sum(down[1:]) >= row["bytes_down"] > 0
        # one signal per decided token; cloud-side each leaves on the deployed public clock (50 ms) through the
        # recorder (edge-side in lockstep the cloud's round trip is the clock)
        assert len(own["signals"]) == row["tokens"] and len(contrast["signals"]) >= 1
        if mode == "cloud":
            assert gaps(own["signals"]).min() >= DecodeSettings.auto_pace_ms - 1.0
        # the scores, recomputed from the rows' recordings by an independent reference (scipy's Mann-Whitney U)
        for score, first, second in (("cloud_timing_auc", gaps(own["signals"]), gaps(contrast["signals"])),
                                     ("timing_auc", *(gaps([t for way, _, t in rec["messages"] if way == "up"][1:])
                                                      for rec in (own, contrast)))):
            u = mannwhitneyu(second, first).statistic
            assert observed[score] == pytest.approx(u / (first.size * second.size), abs=1e-6), score
        sizes = [tuple((way, size) for way, size, _ in rec["messages"]) for rec in (own, contrast)]
        assert observed["sizes_apart"] == float(sizes[0] != sizes[1])


def test_the_report_shows_the_observer_columns_beside_token_er(tiny_runner, tmp_path: Path) -> None:
    from eval_harness.cli.decodeleak import main

    out = tmp_path / "rows.jsonl"
    sweep(tiny_runner, out, observer=True)
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "tables.md").read_text()
    section = table.split("## cloud-side fusion", 1)[1]
    header = next(line for line in section.splitlines() if line.startswith("| task"))
    columns = [cell.strip() for cell in header.split("|")]
    # the attacks' scores under their labels, after the trace metrics
    assert columns.index("Token-ER@100") < columns.index("observer: sizes told apart")
    assert {"observer: timing AUC", "cloud's clock: timing AUC"} <= set(columns), header
    numbers = list(csv_rows(tmp_path / "report" / "tables.csv"))
    assert numbers and all(row["observer_sizes_apart_n"] == "3" for row in numbers)


def csv_rows(path: Path):
    import csv

    with path.open() as handle:
        yield from csv.DictReader(handle)


def test_without_the_observer_the_field_is_null_and_the_report_has_no_such_column(tiny_runner,
                                                                                  tmp_path: Path) -> None:
    from eval_harness.cli.decodeleak import main

    out = tmp_path / "rows.jsonl"
    rows = sweep(tiny_runner, out, observer=False)
    assert len(rows) == 3 and all(row["observer"] is None for row in rows)
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    assert "observer_sizes_apart" not in (tmp_path / "report" / "tables.md").read_text()
