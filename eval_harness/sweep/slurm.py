"""A sweep on SLURM through submitit: one array task per shard, each writing its own JSONL file, merged into one.

The driver (``decodeleak sweep --backend slurm``) lists the (setting, item) pairs not yet in ``--out``, cuts them
into N contiguous shards in grid order (:func:`eval_harness.sweep.ray.plan_shards`, as for Ray: whole settings
per shard, so the runner's batches stay full) and submits one SLURM array of N tasks (at most
``array_parallelism`` running at once), each asking for the partition, time, GPUs and CPUs given.  A task loads
its models once (one model load per worker, not per setting) and runs
:func:`~eval_harness.sweep.execute.run_sweep` over its pairs into its own shard file
(:func:`shard_path`, under ``OUT.slurm/``): a cluster's nodes share a filesystem, not a process, so each task is
the only writer of its file and keeps the store's guarantees (a flush and fsync per row, torn-line recovery).

**Preemption.**  Each task is a :class:`ShardTask`, a submitit checkpointable: when SLURM preempts it or its time
runs out, submitit asks it to :meth:`ShardTask.checkpoint` and requeues the same task.  The requeued task opens
the same shard file, and the store's resume skips every row already written, so it redoes nothing done (the
row in flight at the signal is the most that is lost).

**Merging.**  The driver waits for the array (unless ``wait`` is off), then appends every shard file's rows
that ``--out`` lacks to ``--out`` (:func:`merge_shards`), so the three backends leave the same single file.
A later run of the same command merges first, so an array left running (``--slurm-no-wait``, or a driver
that was killed) is gathered then.

**Private data.**  A task's pickle (its items: private contexts) and its rows sit under ``OUT.slurm/``, made
0700 (:func:`edge_sdk.private_files.private_dir`); each task is sent only its shard's items.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from eval_harness.datasets import DecodeLeakItem
from eval_harness.decoding_protocol import DecodingProtocol
from edge_sdk.private_files import private_dir
from eval_harness.provenance import code_digest, code_dirs, items_digest
from eval_harness.sweep.grid import Setting, row_key
from eval_harness.sweep.ray import ShardPlan, shard_items
from eval_harness.sweep.store import ResultStore, read_rows

if TYPE_CHECKING:
    from eval_harness.sweep.execute import ReferenceSpec


def require_submitit() -> ModuleType:
    """The ``submitit`` module, or an ImportError that names the extra to install."""
    try:
        import submitit
    except ImportError:
        raise ImportError("--backend slurm needs submitit: pip install 'coveil[harness]'") from None
    return submitit


@dataclass(frozen=True)
class SlurmOptions:
    """What each array task asks SLURM for, and where submitit keeps its files.

    Attributes:
        partition: the SLURM partition (``None``: the cluster's default).
        time_min: each task's time limit in minutes (a task that reaches it is requeued and resumes).
        gpus_per_task: GPUs per task (one task per node's GPU group; the models load once per task).
        cpus_per_task: CPUs per task (torch uses that many threads).
        mem_gb: memory per task in GB (``None``: the partition's default).
        array_parallelism: at most this many tasks of the array run at once.
        cluster: ``"slurm"``, or ``"local"`` (submitit's local executor: the same tasks as subprocesses of this
            machine, what CI runs), or ``None`` (submitit picks: SLURM where ``sbatch`` is found).
        max_requeues: how many times one task may be requeued after preemption or timeout.
    """

    partition: str | None = None
    time_min: int = 240
    gpus_per_task: int = 0
    cpus_per_task: int = 4
    mem_gb: int | None = None
    array_parallelism: int = 64
    cluster: str | None = None
    max_requeues: int = 8

    def executor(self, folder: Path) -> Any:
        """A submitit executor for these options, its files under ``folder``."""
        submitit = require_submitit()
        executor = submitit.AutoExecutor(folder=folder, cluster=self.cluster, slurm_max_num_timeout=self.max_requeues)
        parameters: dict[str, Any] = {"name": "decodeleak", "timeout_min": self.time_min, "tasks_per_node": 1,
                                      "nodes": 1, "cpus_per_task": self.cpus_per_task,
                                      "gpus_per_node": self.gpus_per_task,
                                      "slurm_array_parallelism": self.array_parallelism}
        if self.partition is not None:
            parameters["slurm_partition"] = self.partition
        if self.mem_gb is not None:
            parameters["mem_gb"] = self.mem_gb
        executor.update_parameters(**parameters)
        return executor


def shard_folder(out: Path) -> Path:
    """Where a SLURM sweep into ``out`` keeps its shard files and submitit's: ``OUT.slurm/`` beside it."""
    return out.with_name(out.name + ".slurm")


def shard_path(out: Path, units: Sequence[tuple[Setting, str]], index: int, count: int) -> Path:
    """Shard ``index`` (0-based) of ``count``'s file: ``OUT.slurm/shard-<i>-of-<N>-<plan>.jsonl``, ``plan`` a digest
    of its pairs' keys, so a requeued task finds its own file and a later plan never appends to an old one."""
    plan = hashlib.sha256("".join(row_key(s, item_id) + "\n" for s, item_id in units).encode()).hexdigest()[:10]
    return shard_folder(out) / f"shard-{index + 1}-of-{count}-{plan}.jsonl"


@dataclass
class ShardTask:
    """One array task: check the code, load the models, run ``units`` into ``path`` (skipping rows already
    there); returns the rows it wrote.  Checkpointable: on preemption or timeout submitit requeues it as is."""

    units: list[tuple[Setting, str]]
    items: dict[str, list[DecodeLeakItem]]
    path: Path
    spec: ReferenceSpec
    protocol: DecodingProtocol
    seed: int
    driver_code: str
    dataset_sha256: dict[str, str]

    def __call__(self) -> int:
        here = code_digest()
        if here != self.driver_code:
            dirs = ", ".join(str(d) for d in code_dirs())
            raise RuntimeError(f"this task imports other code than the driver ({dirs}: sha256 {here[:12]}, driver "
                               f"{self.driver_code[:12]}); install the driver's checkout on the cluster's shared "
                               "filesystem and run decodeleak from it")
        from eval_harness.sweep.execute import run_sweep

        settings = list({s.key: s for s, _ in self.units}.values())
        with ResultStore(self.path) as store:
            if all(row_key(s, item_id) in store for s, item_id in self.units):
                return 0  # a requeue after the last row: no model loads
            identity = self.spec.run_identity(self.protocol, seed=self.seed)
            store.check_run(identity)
            runner, vocab, metadata = self.spec.build(self.protocol, seed=self.seed, identity=identity)
            with runner:
                outcome = run_sweep(settings, self.items, runner, store, protocol=self.protocol, vocab=vocab,
                                    metadata=metadata.row(), seed=self.seed, units=self.units,
                                    dataset_sha256=self.dataset_sha256)
        return outcome.written

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """What submitit resubmits on preemption or timeout: this same task (its file holds its progress)."""
        return require_submitit().helpers.DelayedSubmission(self)


def shard_tasks(plan: ShardPlan, items: Mapping[str, Sequence[DecodeLeakItem]], out: Path, *, spec: ReferenceSpec,
                protocol: DecodingProtocol, seed: int) -> list[ShardTask]:
    """One :class:`ShardTask` per shard of ``plan``, each sent only its own items."""
    driver_code = code_digest()
    dataset_sha256 = {task: items_digest(task_items) for task, task_items in items.items()}
    count = len(plan.shards)
    return [ShardTask(list(units), shard_items(units, items), shard_path(out, units, j, count), spec, protocol, seed,
                      driver_code, dataset_sha256) for j, units in enumerate(plan.shards)]


def merge_shards(out: Path, store: ResultStore, on_row: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Append to ``store`` (the sweep's ``--out``) every row of ``OUT.slurm/``'s shard files it lacks; the rows
    appended."""
    folder = shard_folder(out)
    paths = sorted(folder.glob("shard-*.jsonl")) if folder.is_dir() else []
    merged = 0
    for row in read_rows(paths):
        if row["key"] not in store:
            store.append(row)
            merged += 1
            if on_row is not None:
                on_row(row)
    return merged


@dataclass
class SlurmSubmission:
    """An array submitted: its jobs (one per shard) and the array's id."""

    jobs: list[Any]

    @property
    def array_id(self) -> str:
        return str(self.jobs[0].job_id).split("_")[0] if self.jobs else ""


def submit(tasks: Sequence[ShardTask], options: SlurmOptions, out: Path) -> SlurmSubmission:
    """Submit ``tasks`` as one SLURM array (submitit's batch), files under ``OUT.slurm/`` (0700)."""
    executor = options.executor(private_dir(shard_folder(out) / "submitit"))
    with executor.batch():
        jobs = [executor.submit(task) for task in tasks]
    return SlurmSubmission(jobs)


def failures(submission: SlurmSubmission) -> list[tuple[int, str]]:
    """Wait for every task of ``submission``; ``(shard index, "ErrorType: first line")`` of those that failed."""
    failed = []
    for index, job in enumerate(submission.jobs):
        try:
            job.result()
        except Exception as error:  # noqa: BLE001 - each task's failure is reported with its shard
            lines = str(error).strip().splitlines()
            failed.append((index, f"{type(error).__name__}: {lines[-1] if lines else '(no message)'}"))
    return failed
