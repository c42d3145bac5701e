"""A row is the same however the run was cut: --concurrency 1 or 4, two shards, Ray, a SLURM array (submitit's
local executor) and a preempted task requeued, a kill then a resume; and
``decodeleak recompute`` re-scores every row from the file alone, catching a tampered one.

Two of the three settings are deterministic, dp_logit draws from each item's seeded generator.  Rows are
compared whole but for what records the cut itself (``batching``) and the cloud's forward times (inside
``bytes_down``).  Each row holds its full exposure trace (every id of the tiny vocabulary, ranked), which is
where a batched forward's rounding shows first: with --padded-batches, --concurrency 4 reorders a near-tie.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.cli.decodeleak import main
from eval_harness.sweep.exposure_codec import decode_trace, encode_trace
from eval_harness.sweep.store import read_rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # tiny models in transformers, sweeps in processes, Ray and SLURM
GRID = {"alpha": 0.3, "cloud": {"undefended": {}, "dp_logit": {"epsilon": [4]}}, "edge": {"coveil": {"lam": [1]}}}
#: what a row says of how the run was cut, and the cloud's forward times (``forward_ns`` in its replies)
CUT_FIELDS = ("batching", "bytes_down")


@pytest.fixture(scope="module")
def options(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A grid file and the tiny random edge/cloud pair (tests/support/tiny_models.py) as transformers directories."""
    from tests.support.tiny_models import save_tiny_pair

    dirs = save_tiny_pair(tmp_path_factory.mktemp)
    grid = tmp_path_factory.mktemp("grid") / "grid.json"
    grid.write_text(json.dumps(GRID))
    return [str(grid), "--slm", dirs[0], "--llm", dirs[1], "--limit", "6", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def alone(options: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run every cut is compared with: one item at a time."""
    out = tmp_path_factory.mktemp("alone") / "results.jsonl"
    assert main(["sweep", *options, "--concurrency", "1", "--out", str(out)]) == 0
    return out


def uncut(paths: list[Path]) -> dict[str, dict]:
    """The rows of ``paths`` by key, less :data:`CUT_FIELDS`."""
    return {row["key"]: {k: v for k, v in row.items() if k not in CUT_FIELDS} for row in read_rows(paths)}


def test_the_rows_record_the_batching_and_what_recomputes_them(alone: Path) -> None:
    rows = list(read_rows([alone]))
    assert len(rows) == 18
    for row in rows:
        assert row["batching"] == {"concurrency": 1, "lockstep": True, "forwards": "per-sequence",
                                   "batch_invariant": True, "dtype": "float32",
                                   "torch_threads": row["batching"]["torch_threads"]}
        assert row["dtype"] == "float32"  # the default: a full-precision reference
        assert decode_trace(row["exposure"]).k == 1000 and len(decode_trace(row["exposure"])) == row["tokens"]
        assert len(row["dataset"]["sha256"]) == len(row["dataset"]["item_sha256"]) == 64
        assert len(row["code"]["sha256"]) == 64 and len(row["vocabulary"]["sha256"]) == 64
    coveil = next(row for row in rows if row["policy"] == "coveil")
    assert coveil["params"] == {"lam": 1} and coveil["policy_params"] == {"lam": 1, "k": 50, "space": "prob"}


def test_each_row_records_the_policy_parameters_the_run_used(options: list[str], tmp_path: Path) -> None:
    out = tmp_path / "dp_fusion.jsonl"
    assert main(["run", "--mode", "edge", "--policy", "dp_fusion", "--param", "epsilon=1", *options[1:5],
                 "--limit", "1", "--max-new-tokens", "6", "--out", str(out)]) == 0
    (row,) = read_rows([out])
    # its epsilon budget covers the run's 6 tokens, not the class default of 256 it would record unset
    assert row["policy_params"]["max_new_tokens"] == 6 == row["protocol"]["max_new_tokens"]


@pytest.mark.parametrize("concurrency", [4])
def test_concurrency_does_not_change_a_row(options: list[str], alone: Path, tmp_path: Path, concurrency: int) -> None:
    out = tmp_path / "together.jsonl"
    assert main(["sweep", *options, "--concurrency", str(concurrency), "--out", str(out)]) == 0
    assert {row["batching"]["concurrency"] for row in read_rows([out])} == {concurrency}
    assert uncut([out]) == uncut([alone])


def test_two_shards_give_the_rows_of_one_run(options: list[str], alone: Path, tmp_path: Path) -> None:
    shards = [tmp_path / f"shard-{i}.jsonl" for i in (1, 2)]
    for i, out in enumerate(shards, 1):
        assert main(["sweep", *options, "--concurrency", "4", "--shard", f"{i}/2", "--out", str(out)]) == 0
    assert all(len(list(read_rows([out]))) < 18 for out in shards)
    assert uncut(shards) == uncut([alone])


@pytest.fixture
def local_ray() -> Iterator[None]:
    import ray

    from eval_harness.sweep.ray import connect

    assert connect("local", num_cpus=2)
    yield
    ray.shutdown()


def test_a_ray_run_gives_the_rows_of_one_process(options: list[str], alone: Path, tmp_path: Path,
                                                 local_ray: None) -> None:
    out = tmp_path / "ray.jsonl"
    assert main(["sweep", *options, "--concurrency", "3", "--out", str(out), "--ray", "--ray-shards", "2"]) == 0
    assert uncut([out]) == uncut([alone])


def test_a_slurm_array_gives_the_rows_of_one_process_and_a_requeued_task_redoes_nothing(
        options: list[str], alone: Path, tmp_path: Path) -> None:
    import pickle

    out = tmp_path / "slurm.jsonl"
    assert main(["sweep", *options, "--concurrency", "3", "--out", str(out), "--backend", "slurm",
                 "--slurm-cluster", "local", "--slurm-tasks", "2", "--slurm-time", "10"]) == 0
    assert uncut([out]) == uncut([alone])
    shards = sorted((tmp_path / "slurm.jsonl.slurm").glob("shard-*-of-2-*.jsonl"))
    assert len(shards) == 2 and sum(len(list(read_rows([s]))) for s in shards) == 18
    assert oct((tmp_path / "slurm.jsonl.slurm").stat().st_mode & 0o777) == "0o700"  # items and rows are private
    # the task submitit pickled for the first shard, as a requeue after preemption would run it: its file cut
    # back to its first two rows (the rest lost to the preemption), then the checkpoint's resubmission run
    pickled = next((tmp_path / "slurm.jsonl.slurm" / "submitit").glob("*_submitted.pkl"))
    task = pickle.loads(pickled.read_bytes()).function
    lines = task.path.read_text().splitlines(keepends=True)
    task.path.write_text("".join(lines[:2]))
    requeued = task.checkpoint()
    assert requeued.function is task
    assert requeued.result() == len(lines) - 2  # only what the preemption lost is decoded again
    assert task.path.read_text().splitlines(keepends=True)[:2] == lines[:2]  # what was done is left as it was
    assert uncut([task.path]) == {key: row for key, row in uncut([alone]).items() if key in uncut([task.path])}
    assert len(list(read_rows([task.path]))) == len(lines)
    assert task.checkpoint().result() == 0  # a requeue after the last row: nothing to do
    # a re-run of the command merges, finds nothing pending and submits nothing
    assert main(["sweep", *options, "--out", str(out), "--backend", "slurm", "--slurm-cluster", "local"]) == 0
    assert len(list(read_rows([out]))) == 18


def test_a_killed_sweep_resumed_gives_the_rows_of_one_run(options: list[str], alone: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed.jsonl"
    command = [sys.executable, "-c", "import sys; from eval_harness.cli.decodeleak import main; sys.exit(main())",
               "sweep", *options, "--concurrency", "2", "--out", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while (not out.exists() or out.read_text().count("\n") < 3) and time.monotonic() < deadline:
            assert process.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    written = len(list(read_rows([out])))
    assert 3 <= written < 18  # killed mid-sweep
    assert main(["sweep", *options, "--concurrency", "4", "--out", str(out)]) == 0
    assert uncut([out]) == uncut([alone])


def recompute(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, tuple[int, float, int]], str]:
    """``decodeleak recompute path``: its exit status, ``{quantity: (rows, max_abs_diff, disagreeing)}`` and its
    summary line."""
    status = main(["recompute", str(path)])
    lines = capsys.readouterr().out.strip().splitlines()
    table = {}
    for line in lines[1:]:
        parts = line.split()
        if len(parts) >= 4 and parts[1].isdigit():
            table[parts[0]] = (int(parts[1]), float(parts[2]), int(parts[3]))
    return status, table, next(line for line in lines if "rows re-scored" in line)


def test_recompute_agrees_with_every_row_of_a_run(alone: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, table, last = recompute(alone, capsys)
    assert status == 0 and last == "18 of 18 rows re-scored; 0 disagree with what they store"
    assert table["metrics.token_er@100"] == table["metrics.auc@1000:release"] == (18, 0.0, 0)
    assert table["evidence.evidence_tokens"] == table["correct"] == (18, 0.0, 0)


def rewritten(source: Path, target: Path, change: Callable[[dict], dict]) -> Path:
    """``source`` with its first row passed through ``change``."""
    rows = list(read_rows([source]))
    rows[0] = change(json.loads(json.dumps(rows[0])))
    target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return target


def test_recompute_catches_a_tampered_metric_and_a_tampered_trace(alone: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def metric(row: dict) -> dict:
        row["metrics"]["span_er@50"] += 0.25
        return row

    status, table, last = recompute(rewritten(alone, tmp_path / "metric.jsonl", metric), capsys)
    assert status == 1 and "1 disagree" in last
    assert table["metrics.span_er@50"] == (18, 0.25, 1) and table["metrics.span_er@100"][2] == 0

    def trace(row: dict) -> dict:  # the cloud saw nothing: every metric recomputes to 0
        steps = decode_trace(row["exposure"])
        row["exposure"] = encode_trace(ExposureTrace(steps.k, tuple(() for _ in steps.steps)))
        return row

    status, table, _ = recompute(rewritten(alone, tmp_path / "trace.jsonl", trace), capsys)
    assert status == 1 and table["metrics.token_er@1000"][2] == 1


def test_recompute_sees_a_trace_edit_that_changes_no_metric(alone: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    def reordered(row: dict) -> dict:  # the last step's two lowest-ranked ids swapped, the digest left as it was
        trace = decode_trace(row["exposure"])
        *head, last = trace.steps
        edited = encode_trace(ExposureTrace(trace.k, (*head, (*last[:-2], last[-1], last[-2]))))
        row["exposure"] = {**edited, "sha256": row["exposure"]["sha256"]}
        return row

    status = main(["recompute", str(rewritten(alone, tmp_path / "reordered.jsonl", reordered))])
    captured = capsys.readouterr()
    assert status == 1 and "0 disagree with what they store; 1 could not be re-scored" in captured.out
    assert "does not match its sha256" in captured.err


def test_recompute_scores_a_trace_worked_by_hand(alone: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A trace whose steps rank every id of the tiny vocabulary first, one id a step: every evidence token is in
    E^1, so Token-ER@K = 1 and AUC@K = (1/K) sum_k Token-ER@k = 1 at every K, under both rule sets."""
    def everything_first(row: dict) -> dict:
        row["exposure"] = encode_trace(ExposureTrace(1000, tuple((i,) for i in range(400))))
        row["metrics"].update({name: 1.0 for name in row["metrics"] if name.startswith(("token_er@", "auc@"))})
        return row

    _, table, _ = recompute(rewritten(alone, tmp_path / "hand.jsonl", everything_first), capsys)
    for k in (1, 100, 1000):
        for rules in ("", ":release"):
            assert table[f"metrics.token_er@{k}{rules}"] == table[f"metrics.auc@{k}{rules}"] == (18, 0.0, 0)


def test_recompute_refuses_a_row_whose_item_changed(alone: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def item(row: dict) -> dict:
        row["dataset"]["item_sha256"] = "0" * 64
        return row

    status = main(["recompute", str(rewritten(alone, tmp_path / "item.jsonl", item))])
    captured = capsys.readouterr()
    assert status == 1 and "17 of 18 rows re-scored; 0 disagree with what they store; 1 could not be re-scored" in (
        captured.out)
    assert "its digest differs: the dataset changed" in captured.err
