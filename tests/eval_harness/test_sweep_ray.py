"""``decodeleak sweep --ray``: shards as Ray tasks on a local instance, rows gathered into one JSONL, resumable."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from eval_harness.cli.decodeleak import main, parse
from eval_harness.datasets import load_task
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.sweep.execute import ReferenceSpec
from eval_harness.sweep.grid import Setting, row_key
from eval_harness.provenance import code_digest
from eval_harness.sweep.ray import RowInbox, connect, plan_shards, run_shard
from eval_harness.sweep.store import ResultStore, read_rows

pytestmark = pytest.mark.slow  # a local Ray instance and tiny models

#: two deterministic settings (greedy decoding): 2 settings x 2 items = 4 rows
GRID = {"alpha": 0.3, "cloud": {"undefended": {}}, "edge": {"coveil": {"lam": [1]}}}


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory: pytest.TempPathFactory) -> ReferenceSpec:
    """The tiny random edge/cloud pair of tests/support/tiny_models.py, saved as transformers directories."""
    from tests.support.tiny_models import save_tiny_pair

    dirs = save_tiny_pair(tmp_path_factory.mktemp)
    return ReferenceSpec(slm=dirs[0], llm=dirs[1], dtype="fp32", concurrency=2)


@pytest.fixture(scope="module")
def tiny_models(tiny_spec: ReferenceSpec) -> list[str]:
    """The command line's options for the tiny pair: 2 items, 4 tokens."""
    return ["--slm", tiny_spec.slm, "--llm", tiny_spec.llm, "--limit", "2", "--max-new-tokens", "4",
            "--dtype", tiny_spec.dtype, "--concurrency", str(tiny_spec.concurrency)]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray instance for this module, with this checkout's code shipped to its workers."""
    import ray

    assert not ray.is_initialized()
    assert connect("local", num_cpus=2)
    yield
    ray.shutdown()


def grid_file(tmp_path: Path, grid: dict) -> str:
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    return str(path)


def without_wire_timing(row: dict) -> dict:
    """A row less ``bytes_down`` (the cloud's replies carry its forward time, ``forward_ns``, a varint) and
    ``batching`` (a Ray task runs torch on its own CPUs: ``torch_threads``)."""
    return {key: value for key, value in row.items() if key not in ("bytes_down", "batching")}


def test_ray_rows_are_a_plain_sweeps_and_a_rerun_does_only_what_is_missing(
    tmp_path: Path, tiny_models: list[str], local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = grid_file(tmp_path, GRID)
    plain, on_ray = tmp_path / "plain.jsonl", tmp_path / "ray.jsonl"
    assert main(["sweep", grid, "--out", str(plain), *tiny_models]) == 0
    assert main(["sweep", grid, "--out", str(on_ray), "--ray", "--ray-shards", "2", *tiny_models]) == 0
    assert f"4 rows written to {on_ray} by 2 Ray tasks; 0 already there" in capsys.readouterr().out
    expected = {row["key"]: row for row in read_rows([plain])}
    items = [item.item_id for item in load_task("medpriv", 2)]
    settings = [Setting("medpriv", "cloud", "undefended"), Setting("medpriv", "edge", "coveil", {"lam": 1})]
    assert sorted(expected) == sorted(row_key(s, i) for s in settings for i in items)  # the grid, once
    rows = {row["key"]: row for row in read_rows([on_ray])}
    assert sorted(rows) == sorted(expected)
    for key, row in rows.items():  # same tokens, metrics and metadata as in one process
        assert row["tokens"] == 4 and row["text"] == expected[key]["text"]
        assert without_wire_timing(row) == without_wire_timing(expected[key])

    before = on_ray.read_bytes()
    assert main(["sweep", grid, "--out", str(on_ray), "--ray", *tiny_models]) == 0
    assert f"0 rows written to {on_ray}; 4 already there" in capsys.readouterr().out  # without starting Ray
    assert on_ray.read_bytes() == before

    lines = before.decode().splitlines(keepends=True)
    on_ray.write_text(lines[0] + lines[3])  # two rows lost
    lost = {json.loads(line)["key"] for line in (lines[1], lines[2])}
    assert main(["sweep", grid, "--out", str(on_ray), "--ray", "--ray-shards", "2", *tiny_models]) == 0
    assert f"2 rows written to {on_ray} by 2 Ray tasks; 2 already there" in capsys.readouterr().out
    after = on_ray.read_text().splitlines(keepends=True)
    assert after[:2] == [lines[0], lines[3]]  # what was there is untouched
    assert {json.loads(line)["key"] for line in after[2:]} == lost
    for r in read_rows([on_ray]):
        assert without_wire_timing(r) == without_wire_timing(expected[r["key"]])


def test_a_failed_shard_is_named_and_the_other_shards_rows_are_kept(
    tmp_path: Path, tiny_models: list[str], local_ray: None, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    # the edge setting's policy is registered in this process only (a driver checks every setting before it
    # starts Ray): the workers do not know it, so shard 2 of 2 (grid order: cloud first) fails there
    from edge_sdk.policies import POLICIES, CoVeil

    class DriverOnly(CoVeil):
        name = "driver_only"

    monkeypatch.setitem(POLICIES._entries, DriverOnly.name, DriverOnly)
    grid = grid_file(tmp_path, {"alpha": 0.3, "cloud": {"undefended": {}}, "edge": {"driver_only": {"lam": [1]}}})
    out = tmp_path / "results.jsonl"
    assert main(["sweep", grid, "--out", str(out), "--ray", "--ray-shards", "2", *tiny_models]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("decodeleak sweep: shard 2/2 failed: UnknownNameError: ")
    assert "unknown policy 'driver_only'" in error and "2 rows written" in error
    assert {(row["mode"], row["policy"]) for row in read_rows([out])} == {("cloud", "undefended")}
    assert len(list(read_rows([out]))) == 2


def test_a_retried_task_skips_the_rows_that_already_arrived(tiny_spec: ReferenceSpec, local_ray: None) -> None:
    """What Ray's retry of a task whose worker died runs: run_shard again, with some of its rows in the inbox."""
    import ray

    setting = Setting("medpriv", "cloud", "undefended")
    items = {"medpriv": load_task("medpriv", 3)}
    units = [(setting, item.item_id) for item in items["medpriv"]]
    inbox = ray.remote(num_cpus=0)(RowInbox).remote()
    arrived = {"key": row_key(*units[1]), "from": "the first attempt"}
    ray.get(inbox.put.remote(arrived))
    written = run_shard(units, items, inbox, spec=tiny_spec, protocol=DecodingProtocol(max_new_tokens=2), seed=0,
                        driver_code=code_digest())
    rows = ray.get(inbox.take.remote())
    assert written == 2 and rows[0] == arrived  # the two items decode at once: either may finish first
    assert sorted(row["key"] for row in rows[1:]) == sorted([row_key(*units[0]), row_key(*units[2])])
    assert all(row["tokens"] == 2 for row in rows[1:]) and ray.get(inbox.take.remote()) == []
    assert ray.get(inbox.received.remote([row_key(*u) for u in units] + ["other"])) == [row_key(*u) for u in units]
    ray.kill(inbox)


def test_shards_are_contiguous_runs_of_what_is_pending(tmp_path: Path) -> None:
    items = {"medpriv": load_task("medpriv", 5)}
    settings = [Setting("medpriv", "cloud", "undefended")]
    ids = [item.item_id for item in items["medpriv"]]
    with ResultStore(tmp_path / "results.jsonl") as store:
        plan = plan_shards(settings, items, store, count=2)
        assert [[i for _, i in part] for part in plan.shards] == [ids[:2], ids[2:]]  # floor(5/2) = 2, then 3
        store.append({"key": row_key(settings[0], ids[0])})
        store.append({"key": row_key(settings[0], ids[3])})
        plan = plan_shards(settings, items, store, count=8)  # more shards than pairs: one pair each
        assert [[i for _, i in part] for part in plan.shards] == [[ids[1]], [ids[2]], [ids[4]]]
        assert plan.skipped == 2
        for i in ids[1:3] + ids[4:]:
            store.append({"key": row_key(settings[0], i)})
        assert plan_shards(settings, items, store, count=2).shards == []
        with pytest.raises(ValueError, match="at least one shard"):
            plan_shards(settings, items, store, count=0)


def test_the_code_digest_follows_the_source_and_a_worker_refuses_other_code(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "pkg", tmp_path / "b" / "pkg"
    for root in (first, second):
        (root / "sub").mkdir(parents=True)
        (root / "__init__.py").write_text("x = 1\n")
        (root / "sub" / "mod.py").write_text("y = 2\n")
        (root / "__pycache__").mkdir()
        (root / "__pycache__" / "cached.py").write_text(str(root))  # not source
    assert code_digest([first]) == code_digest([second])  # content and relative paths, not location
    (second / "sub" / "mod.py").write_text("y = 3\n")
    assert code_digest([first]) != code_digest([second])
    assert len(code_digest()) == 64
    with pytest.raises(RuntimeError, match="imports other code than the driver"):
        run_shard([], {}, None, spec=None, protocol=None, seed=0, driver_code="0" * 64)  # type: ignore[arg-type]


def test_ray_flags_fail_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    grid = grid_file(tmp_path, GRID)
    with pytest.raises(SystemExit):
        parse(["sweep", "--ray", grid])  # the grid file taken for an address
    assert "a grid file goes before --ray" in capsys.readouterr().err
    assert parse(["sweep", grid, "--ray"]).ray == "local"
    assert parse(["sweep", grid, "--ray", "ray://head:10001"]).ray == "ray://head:10001"
    out = tmp_path / "out.jsonl"
    assert main(["sweep", grid, "--limit", "1", "--out", str(out), "--ray", "--ray-gpus-per-task", "1"]) == 1
    assert "needs --device cuda or --device-map auto" in capsys.readouterr().err
    # the tasks decode only: an attack asked for must not be dropped from the rows without a word
    assert main(["sweep", grid, "--limit", "1", "--out", str(out), "--ray", "--inversion", "local"]) == 1
    assert "--ray runs no inversion attack" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    assert main(["sweep", grid, "--limit", "1", "--out", str(out), "--ray"]) == 1
    assert capsys.readouterr().err.strip() == ("decodeleak sweep: --ray needs Ray, an optional dependency: "
                                               "pip install 'coveil[ray]'")
    assert not out.exists()


def test_a_local_instance_listens_on_loopback_only(local_ray: None) -> None:
    """Before, ``--ray local`` bound the instance's servers to the machine's network address and ``::``: any host
    that reached it could join the object store every private context passes through."""
    import ipaddress

    import psutil
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()  # where its daemons log
    pids = {process.pid for process in psutil.process_iter(["cmdline"])
            if any(session in part for part in process.info["cmdline"] or ())}
    pids |= {child.pid for child in psutil.Process().children(recursive=True)}
    listening = {conn.laddr.ip for conn in psutil.net_connections("inet")
                 if conn.status == psutil.CONN_LISTEN and conn.pid in pids}
    assert listening, "found none of the instance's servers"

    def loopback(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)

    assert all(loopback(address) for address in listening), listening


def test_each_task_is_sent_only_the_items_of_its_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, one object of every item (every private context) was put in the object store for every task.
    Here a stand-in for Ray records what each submitted task is given."""
    from eval_harness.sweep import ray as on_ray

    submitted: list[tuple] = []

    class Handle:  # what ray.remote(...) returns: .remote() submits, .options() configures
        def __init__(self, target: object) -> None:
            self.target = target

        def options(self, **_: object) -> Handle:
            return self

        def remote(self, *args: object, **kwargs: object) -> object:
            if self.target is on_ray.run_shard:
                submitted.append(args)
                return f"task-{len(submitted)}"
            return Inbox()

    class Inbox:
        class take:
            @staticmethod
            def remote() -> str:
                return "no rows"

    class FakeRay:
        def remote(self, *args: object, **kwargs: object) -> object:
            return Handle(args[0]) if args else (lambda target: Handle(target))

        def put(self, value: object) -> object:
            raise AssertionError("nothing is put in the object store for every task")

        def wait(self, refs: list, **_: object) -> tuple[list, list]:
            return refs, []

        def get(self, ref: object) -> object:
            return [] if ref == "no rows" else 0

        def kill(self, _: object) -> None:
            pass

    monkeypatch.setattr(on_ray, "require_ray", FakeRay)
    items = {"medpriv": load_task("medpriv", 5), "commpriv": load_task("commpriv", 3)}
    settings = [Setting("medpriv", "cloud", "undefended"), Setting("commpriv", "cloud", "undefended")]
    with ResultStore(tmp_path / "out.jsonl") as store:
        plan = plan_shards(settings, items, store, count=3)
        on_ray.run_on_ray(plan, items, store, spec=None, protocol=DecodingProtocol(max_new_tokens=2), seed=0)
    assert len(submitted) == 3
    sent = []
    for units, shard_items, *_ in submitted:
        named = sorted((s.task, item_id) for s, item_id in units)
        given = sorted((task, item.item_id) for task, task_items in shard_items.items() for item in task_items)
        assert given == sorted(set(named))  # exactly the items its units name, nothing else
        sent += given
    assert sorted(sent) == sorted({(task, item.item_id) for task in items for item in items[task]})


def test_connecting_keeps_rays_info_lines_and_the_workers_output_out_of_the_terminal(monkeypatch) -> None:
    """Ray's INFO lines (instance started, each code package pushed) and every task's model-loading bars echoed
    as '(run_shard pid=...)' lines cluttered the sweep's progress bar; a caller's own choice still wins."""
    import logging

    from eval_harness.sweep import ray as on_ray

    calls: list[dict] = []

    class FakeRay:
        @staticmethod
        def is_initialized() -> bool:
            return False

        @staticmethod
        def init(**options: object) -> None:
            calls.append(options)

    monkeypatch.setattr(on_ray, "require_ray", lambda: FakeRay)
    assert on_ray.connect("local") and on_ray.connect("auto", log_to_driver=True)
    assert calls[0]["logging_level"] == logging.ERROR and calls[0]["log_to_driver"] is False
    assert calls[1]["logging_level"] == logging.ERROR and calls[1]["log_to_driver"] is True
