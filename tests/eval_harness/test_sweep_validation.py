"""``decodeleak sweep``/``run`` check everything before a model loads: one line each, and no model loads at all.

Every test replaces the model loader with one that fails the test, so an error found only after loading (or a
re-run with nothing to do that loads anyway) fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main, parse
from eval_harness.datasets import load_task
from eval_harness.sweep.grid import Setting, row_key


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading either model fails the test (the reference and the deployed runner load through these)."""
    import cloud_adapter.llm

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cloud_adapter.llm.TransformersLLM, "__init__", refuse)
    monkeypatch.setattr("eval_harness.runners.deployed.DeployedRunner.__init__", refuse)


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 1) -> str:
    """Run ``decodeleak ARGV``, expect exit ``code`` and exactly one line on stderr (no traceback); return it."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


RUN = ["run", "--mode", "cloud", "--policy", "coveil", "--limit", "2"]


def test_a_misspelt_policy_parameter_names_the_right_one(tmp_path: Path, capsys) -> None:
    line = one_line_error(capsys, [*RUN, "--param", "lamda=1", "--out", str(tmp_path / "r.jsonl")])
    assert "no parameter 'lamda'" in line and "did you mean 'lam'" in line


@pytest.mark.parametrize(("param", "says"), [("lam=-1", "lam must be >= 0"), ("k=2.5", "must be an integer"),
                                             ("lam=big", "must be a number")])
def test_a_refused_parameter_value_fails_before_loading(tmp_path: Path, capsys, param: str, says: str) -> None:
    assert says in one_line_error(capsys, [*RUN, "--param", param, "--out", str(tmp_path / "r.jsonl")])


def test_a_text_parameter_reaches_the_policy(tmp_path: Path, capsys) -> None:
    line = one_line_error(capsys, ["run", "--mode", "edge", "--policy", "custext", "--param", "mapping=wild",
                                   "--out", str(tmp_path / "r.jsonl")])
    assert "mapping must be one of" in line and "'wild'" in line


def test_alpha_outside_0_1_fails_before_loading(tmp_path: Path, capsys) -> None:
    assert "alpha must lie in [0, 1]" in one_line_error(capsys, [*RUN, "--alpha", "1.5", "--out",
                                                                 str(tmp_path / "r.jsonl")])


def test_every_grid_setting_is_checked_up_front(tmp_path: Path, capsys) -> None:
    grid = tmp_path / "grid.json"
    # the bad setting is the sweep's last: it must fail before the first is decoded
    grid.write_text(json.dumps({"alpha": 0.3, "cloud": {"coveil": {"lam": [0, 1]}},
                                "edge": {"dp_fusion": {"epsilon": [1, 64], "ordr": [2]}}}))
    line = one_line_error(capsys, ["sweep", str(grid), "--out", str(tmp_path / "r.jsonl")])
    assert line.startswith(f"decodeleak sweep: {grid}: edge dp_fusion") and "did you mean 'order'" in line


def test_a_grid_syntax_error_names_the_file_line_and_column(tmp_path: Path, capsys) -> None:
    grid = tmp_path / "grid.json"
    grid.write_text('{"alpha": 0.3,\n "cloud": {"coveil": {"lam": [0 1]}}}\n')
    line = one_line_error(capsys, ["sweep", str(grid), "--out", str(tmp_path / "r.jsonl")])
    # the comma is missing before the "1" on line 2, column 33
    assert f"{grid}:2:33: not valid JSON" in line


@pytest.mark.parametrize("grid", [{"alpha": "0.3", "cloud": {"coveil": {"lam": [0]}}},
                                  {"clod": {"coveil": {"lam": [0]}}, "edge": {"coveil": {"lam": [0]}}},
                                  {"cloud": {"coveil": [0, 1]}}, {"cloud": {"coveil": {"lam": []}}}])
def test_a_grid_of_the_wrong_shape_is_named(tmp_path: Path, capsys, grid: dict) -> None:
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    assert one_line_error(capsys, ["sweep", str(path), "--out", str(tmp_path / "r.jsonl")]).startswith(
        f"decodeleak sweep: {path}: ")


def test_a_missing_task_file_says_so(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "items.jsonl"
    line = one_line_error(capsys, [*RUN, "--tasks", str(missing), "--out", str(tmp_path / "r.jsonl")])
    assert f"task file {missing}: no such file" in line


@pytest.mark.parametrize(("config", "says"), [
    ({"limit": "many"}, "limit: invalid value \"many\""),
    ({"limit": 2.5}, "limit: invalid value 2.5"),
    ({"dtype": "bf17"}, "dtype: must be one of"),
    ({"verbose": "yes"}, "verbose: takes true or false"),
    ({"concurrency": True}, "concurrency: takes a value"),
    ({"param": "lam=1"}, "param: takes a list"),
])
def test_a_config_value_of_the_wrong_type_is_one_line(tmp_path: Path, capsys, config: dict, says: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_:
        parse([*RUN, "--config", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, err
    assert err.startswith(f"decodeleak run: --config {path}: ")


def test_config_values_convert_as_the_command_line_does(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"tasks": ["medpriv", "commpriv"], "limit": 3, "param": ["lam=1.5", "k=20"],
                                "verbose": True, "inversion_model": None}))
    args = parse(["run", "--mode", "cloud", "--policy", "coveil", "--config", str(path)])
    assert args.tasks == ["medpriv", "commpriv"] and args.limit == 3 and args.verbose is True
    assert args.param == [("lam", 1.5), ("k", 20)] and args.inversion_model is None


def test_a_config_syntax_error_names_line_and_column(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"limit": 2\n "seed": 1}')
    with pytest.raises(SystemExit):
        parse([*RUN, "--config", str(path)])
    assert "line 2 column 2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [(["--seed", "-1"], "--seed must be a non-negative integer"),
                                             (["--device", "gpu"], "--device is cpu, cuda or cuda:N"),
                                             (["--transcripts", "t"], "--transcripts: only for --runner deployed"),
                                             (["--runner", "deployed", "--transcript-wait", "-1"],
                                              "--transcript-wait must be non-negative"),
                                             (["--runner", "deployed", "--cloud", "127.0.0.1:1", "--plaintext",
                                               "--transcripts", "/no/such/dir"],
                                              "the transcript directory /no/such/dir does not exist"),
                                             (["--batch-invariant", "--dtype", "bf16"],
                                              "--batch-invariant: its kernels are built for float32 on the CPU"),
                                             (["--runner", "deployed", "--batch-invariant"],
                                              "--batch-invariant: only for the reference runner")])
def test_bad_option_values_fail_before_loading(tmp_path: Path, capsys, flags: list[str], says: str) -> None:
    assert says in one_line_error(capsys, [*RUN, *flags, "--out", str(tmp_path / "r.jsonl")])


def _done_rows(path: Path, settings: list[Setting], **fields: object) -> None:
    """A results file holding a row for every (setting, item) of the first two MedPriv items."""
    items = load_task("medpriv", 2)
    path.write_text("".join(json.dumps({"key": row_key(s, item.item_id), **fields}) + "\n"
                            for s in settings for item in items))


def test_a_results_file_of_another_run_is_refused_before_loading(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.jsonl"
    _done_rows(out, [Setting("medpriv", "cloud", "coveil", {"lam": 1})],
               protocol={"max_new_tokens": 8}, dtype="float32")
    line = one_line_error(capsys, [*RUN, "--param", "lam=2", "--max-new-tokens", "6", "--dtype", "fp32",
                                   "--out", str(out)])
    assert "holds rows of another run (protocol.max_new_tokens 6 here, 8 in the file)" in line


def test_a_rerun_with_nothing_left_loads_no_model(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.jsonl"
    _done_rows(out, [Setting("medpriv", "cloud", "coveil", {"lam": 1})])
    assert main([*RUN, "--param", "lam=1", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"0 rows written to {out}; 2 already there")


def test_a_ray_rerun_with_nothing_left_starts_no_ray(tmp_path: Path, capsys, monkeypatch) -> None:
    from eval_harness.sweep import ray as on_ray

    monkeypatch.setattr(on_ray, "require_ray", lambda: object())
    monkeypatch.setattr(on_ray, "connect", lambda address: pytest.fail("Ray was started"))
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"cloud": {"coveil": {"lam": [0]}}}))
    out = tmp_path / "r.jsonl"
    _done_rows(out, [Setting("medpriv", "cloud", "coveil", {"lam": 0})])
    assert main(["sweep", str(grid), "--modes", "cloud", "--limit", "2", "--ray", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"0 rows written to {out}; 2 already there")


def test_a_resumed_runs_progress_total_is_the_pairs_left(tmp_path: Path, capsys, monkeypatch) -> None:
    """The bar's total (hence its ETA) counts what this invocation decodes, not the pairs already written."""
    import contextlib

    from eval_harness.cli import sweep
    from eval_harness.sweep import execute

    totals = []

    class Bar:
        def add_task(self, description: str, total: int) -> int:
            totals.append(total)
            return 0

        def update(self, *args: object, **kwargs: object) -> None: ...

    monkeypatch.setattr(sweep, "progress_bar", lambda: contextlib.nullcontext(Bar()))
    monkeypatch.setattr(sweep, "_runner", lambda args, protocol, *rest: (contextlib.nullcontext(), None, {}))
    monkeypatch.setattr(execute, "run_sweep", lambda *args, **kwargs: execute.SweepOutcome(3, 3, 1))
    out = tmp_path / "r.jsonl"
    items = load_task("medpriv", 4)
    done = Setting("medpriv", "cloud", "coveil", {"lam": 1})
    out.write_text(json.dumps({"key": row_key(done, items[0].item_id)}) + "\n")  # 1 of the 4 pairs written
    assert main([*RUN[:-1], "4", "--param", "lam=1", "--out", str(out)]) == 0
    assert totals == [3]


@pytest.mark.parametrize("backend", ["ray", "slurm"])
def test_the_observer_attacks_run_in_a_plain_sweep_only(tmp_path: Path, capsys, backend: str) -> None:
    line = one_line_error(capsys, ["sweep", "--modes", "cloud", "--policies", "coveil", "--limit", "2", "--observer",
                                   "--backend", backend, "--out", str(tmp_path / "r.jsonl")])
    assert f"--observer sets each item against another item's private context, which a {backend} task" in line
