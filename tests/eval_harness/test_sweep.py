"""Sweep settings, shards and the JSONL store: resumable, order-independent, crash-safe."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_sdk.policies import make_policy, policy_class
from eval_harness.sweep.grid import Setting, expand, load_grids, parse_shard, row_key, shard
from eval_harness.sweep.store import ResultStore, read_rows

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_grids_are_the_papers() -> None:
    settings = expand(load_grids(), ["medpriv"])
    counts = {}
    for s in settings:
        counts[(s.mode, s.policy)] = counts.get((s.mode, s.policy), 0) + 1
    # the appendix's grids, counted by hand: 12 + 9 + 11 + 10 lambdas/epsilons cloud-side, 12 + 11 + 8 + 11 + 8
    # edge-side, plus one undefended run per mode
    assert counts == {
        ("cloud", "undefended"): 1, ("cloud", "coveil"): 12, ("cloud", "cogenesis"): 9, ("cloud", "dp_logit"): 11,
        ("cloud", "dp_fusion"): 10, ("edge", "undefended"): 1, ("edge", "coveil"): 12, ("edge", "custext"): 11,
        ("edge", "ldp_sampler"): 8, ("edge", "dp_fusion"): 11, ("edge", "invisible_ink"): 8,
    }
    assert {s.alpha for s in settings} == {0.3}
    assert [s.params["lam"] for s in settings if s.mode == "edge" and s.policy == "coveil"] == [
        0, 0.5, 1, 1.25, 1.5, 1.75, 1.8, 2, 2.25, 2.5, 3, 4]
    for s in settings:  # every point is a valid setting of its policy
        if s.policy == "custext":
            assert set(s.params) <= {f for f in policy_class("custext").__dataclass_fields__}
        else:
            make_policy(s.policy, **s.params)
    assert len({s.key for s in settings}) == len(settings) == 94  # 43 cloud-side + 51 edge-side


def test_keys_are_stable_and_mean_the_setting() -> None:
    a = Setting("medpriv", "cloud", "coveil", {"lam": 1.0, "k": 50})
    b = Setting("medpriv", "cloud", "coveil", {"k": 50, "lam": 1.0})
    assert a.key == b.key and a == b
    assert a.key != Setting("medpriv", "cloud", "coveil", {"lam": 2.0, "k": 50}).key
    assert a.key != Setting("commpriv", "cloud", "coveil", {"lam": 1.0, "k": 50}).key
    assert a.key != Setting("medpriv", "cloud", "coveil", {"lam": 1.0, "k": 50}, alpha=0.5).key
    # a hand-computed digest: the key is sha256 of the canonical JSON, so it survives processes and machines
    import hashlib

    canonical = '{"alpha":0.3,"mode":"cloud","params":{"k":50,"lam":1.0},"policy":"coveil","task":"medpriv"}'
    assert a.key == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    with pytest.raises(ValueError, match="does not define edge-side"):
        Setting("medpriv", "edge", "cogenesis")
    with pytest.raises(KeyError, match="did you mean 'coveil'"):
        Setting("medpriv", "cloud", "coveli")


def test_shards_split_every_unit_once_whatever_the_order() -> None:
    settings = expand(load_grids(), ["medpriv", "commpriv"], policies=["coveil", "cogenesis"])
    units = [(s, f"item-{i}") for s in settings for i in range(7)]
    parts = [list(shard(units, i, 4)) for i in range(4)]
    keys = [[row_key(s, item) for s, item in part] for part in parts]
    assert sum(map(len, keys)) == len(units) and len(set().union(*map(set, keys))) == len(units)
    assert all(len(part) > 0 for part in parts)
    reversed_parts = [list(shard(reversed(units), i, 4)) for i in range(4)]
    assert [sorted(row_key(s, x) for s, x in p) for p in reversed_parts] == [sorted(k) for k in keys]
    assert parse_shard("2/8") == (1, 8)
    for bad in ("0/8", "9/8", "2-8", "x/2"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_the_store_resumes_by_key_and_sets_a_torn_line_aside(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "results.jsonl"
    with ResultStore(path) as store:
        store.append({"key": "a", "value": 1})
        store.append({"key": "b", "value": 2})
        with pytest.raises(ValueError, match="already"):
            store.append({"key": "a", "value": 3})
    with path.open("a") as out:
        out.write('{"key": "c", "val')  # the process died mid-write
    with ResultStore(path) as store:
        assert "a" in store and "b" in store and "c" not in store and len(store) == 2
        assert store.recovered_bytes == len('{"key": "c", "val')
        store.append({"key": "c", "value": 3})
    assert [row["key"] for row in read_rows([path])] == ["a", "b", "c"]
    assert (tmp_path / "runs" / "results.jsonl.torn").read_text() == '{"key": "c", "val\n'


def test_the_store_holds_one_run_and_refuses_a_rerun_of_another(tmp_path: Path) -> None:
    """Keys name a setting and an item only: a re-run with another protocol or model must not skip their pairs
    as done and mix two runs' rows in one file."""
    run = {"models": {"slm": {"name": "edge", "sha256": "ab"}}, "dtype": "float32", "backend": "reference",
           "protocol": {"max_new_tokens": 8}, "seed": 0, "device": "cpu", "version": "1"}
    path = tmp_path / "results.jsonl"
    with ResultStore(path) as store:
        store.check_run(run)  # an empty file takes any run
        store.append({"key": "a", **run})
    longer = {**run, "protocol": {"max_new_tokens": 256}}
    with ResultStore(path) as store:
        store.check_run({**run, "device": "cuda:0", "version": "2"})  # where and with which release: same run
        with pytest.raises(ValueError, match=r"protocol.max_new_tokens 256 here, 8 in the file.*its own --out"):
            store.check_run(longer)
        for other in ({**run, "seed": 1}, {**run, "dtype": "bfloat16"},
                      {**run, "models": {"slm": {"name": "edge", "sha256": "cd"}}}):
            with pytest.raises(ValueError, match="another run"):
                store.append({"key": "b", **other})  # a row arriving from elsewhere (a Ray task) is checked too
        store.append({"key": "b", **run})
    assert [row["key"] for row in read_rows([path])] == ["a", "b"]


def test_the_store_resumes_rows_written_before_a_run_field_was_recorded(tmp_path: Path) -> None:
    """Rows from before a checkpoint had a digest (sha256 null) or before the protocol gained a field are the
    same run as a re-run that records them: it resumes; a recorded value that differs is still refused."""
    old = {"models": {"slm": {"name": "edge", "sha256": None}}, "dtype": "float32", "backend": "reference",
           "protocol": {"max_new_tokens": 8}, "seed": 0}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"key": "a", **old}) + "\n")
    now = {**old, "models": {"slm": {"name": "edge", "sha256": "ab"}},
           "protocol": {"max_new_tokens": 8, "alpha": 0.3}}
    with ResultStore(path) as store:
        store.check_run(now)
        store.append({"key": "b", **now})
        with pytest.raises(ValueError, match=r"models.slm.sha256 \"cd\" here, \"ab\" in the file"):
            store.check_run({**now, "models": {"slm": {"name": "edge", "sha256": "cd"}}})
        with pytest.raises(ValueError, match=r"models.slm.name \"other\" here, \"edge\" in the file"):
            store.check_run({**now, "models": {"slm": {"name": "other", "sha256": "ab"}}})
        with pytest.raises(ValueError, match=r"protocol.max_new_tokens 9 here, 8 in the file"):
            store.check_run({**now, "protocol": {"max_new_tokens": 9, "alpha": 0.3}})
    assert [row["key"] for row in read_rows([path])] == ["a", "b"]


def test_rows_written_before_a_kill_are_kept(tmp_path: Path) -> None:
    """A writer killed with SIGKILL mid-run loses nothing it had finished; a re-run skips those keys."""
    path = tmp_path / "results.jsonl"
    writer = (
        "import sys, time\n"
        "from eval_harness.sweep.store import ResultStore\n"
        f"store = ResultStore({str(path)!r})\n"
        "for i in range(10_000):\n"
        "    store.append({'key': f'k{i}', 'payload': 'x' * 200})\n"
        "    if i == 49: print('ready', flush=True)\n"
        "    time.sleep(0.002)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", writer], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    with ResultStore(path) as store:
        done = len(store)
        assert done >= 50
        assert all(f"k{i}" in store for i in range(done))  # every finished row, in order, nothing torn
        store.append({"key": f"k{done}", "payload": "resumed"})
    rows = list(read_rows([path]))
    assert [row["key"] for row in rows] == [f"k{i}" for i in range(done + 1)]


def test_shard_files_merge_without_duplicates(tmp_path: Path) -> None:
    first, second = tmp_path / "shard-1.jsonl", tmp_path / "shard-2.jsonl"
    first.write_text(json.dumps({"key": "a", "v": 1}) + "\n" + json.dumps({"key": "b", "v": 2}) + "\n")
    second.write_text(json.dumps({"key": "b", "v": 9}) + "\n" + json.dumps({"key": "c", "v": 3}) + "\n")
    assert [(r["key"], r["v"]) for r in read_rows([first, second])] == [("a", 1), ("b", 2), ("c", 3)]
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(read_rows([tmp_path / "bad.jsonl"]))


def test_a_checkpoint_directory_has_a_digest_of_its_files_names_and_bytes(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    from edge_sdk.models import ModelSource
    from eval_harness.provenance import model_digest

    monkeypatch.setenv("COVEIL_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"layers": 2}')
    (model / "sub" / "model.safetensors").write_bytes(b"\x00weights")
    (model / "README.md").write_text("not part of the model")
    (model / ".cache").mkdir()
    (model / ".cache" / "x.json").write_text("a download's bookkeeping")

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    # by hand: the sorted relative paths of the checkpoint files, each with its sha256
    config, weights = sha(b'{"layers": 2}'), sha(b"\x00weights")
    expected = sha(f"config.json\t{config}\nsub/model.safetensors\t{weights}\n".encode())
    source = ModelSource(name="tiny", hf_name_or_dir=str(model))
    assert model_digest(source) == expected
    assert model_digest(source) == expected  # again, from the per-file cache
    (model / "sub" / "model.safetensors").write_bytes(b"\x01weights")  # same size, new bytes and mtime
    assert model_digest(source) not in (expected, None)
    assert model_digest(ModelSource(name="absent", hf_name_or_dir="nobody/no-such-model-here")) is None
    (model / "sub" / "model.safetensors").write_bytes(b"\x00weights")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("COVEIL_CACHE_DIR", str(blocked))  # the cache cannot be written: the digest still is
    assert model_digest(source) == expected


def test_a_gguf_digest_is_read_once_per_version_of_the_file(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    from edge_sdk.models import ModelSource
    from eval_harness import provenance

    monkeypatch.setenv("COVEIL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03weights")
    source = ModelSource(name="tiny", gguf_path=gguf)
    expected = hashlib.sha256(b"GGUF\x03weights").hexdigest()
    assert provenance.model_digest(source) == expected
    reads: list[Path] = []
    real = provenance.file_digest
    monkeypatch.setattr(provenance, "file_digest", lambda path: reads.append(Path(path)) or real(path))
    assert provenance.model_digest(source) == expected and reads == []  # from the cache: the file is not read
    gguf.write_bytes(b"GGUF\x03weighty")  # another size and mtime: read anew
    assert provenance.model_digest(source) == hashlib.sha256(b"GGUF\x03weighty").hexdigest()
    assert reads == [gguf.resolve()]


def test_results_are_private_files_whatever_the_umask(tmp_path: Path) -> None:
    """Before, a results file (every decoded answer of every private context) was written 0644 in 0755 folders."""
    import os

    previous = os.umask(0o022)
    try:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        path = shared / "runs" / "deep" / "sweep.jsonl"
        with ResultStore(path) as store:
            store.append({"key": "a", "models": "m", "text": "private"})
        assert path.stat().st_mode & 0o777 == 0o600
        assert {d.stat().st_mode & 0o777 for d in (path.parent, path.parent.parent)} == {0o700}
        assert shared.stat().st_mode & 0o777 == 0o755  # a folder that was there is left as it was
        # a file an older version wrote 0644 is narrowed when opened; a torn line is set aside privately too
        old = tmp_path / "old.jsonl"
        old.write_text('{"key": "a"}\n{"key": "b", "te')
        old.chmod(0o644)
        ResultStore(old).close()
        assert old.stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "old.jsonl.torn").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(previous)
