"""A sweep on a Ray cluster: one task per shard, every row gathered into the driver's one JSONL file.

The driver (the ``decodeleak sweep --ray`` process) opens its results file,
lists the (setting, item) pairs not in it yet and cuts them into N
contiguous shards in grid order, so that a shard holds whole settings and
the runner's batches stay full.  It submits one Ray task per shard; each
task asks for ``--ray-cpus-per-task`` CPUs and ``--ray-gpus-per-task``
GPUs, loads its own models on its worker and runs
:func:`~eval_harness.sweep.execute.run_sweep` over its pairs.  The driver
itself loads no model.

**Where rows go.**  A worker on another node cannot write the driver's
disk, and a driver connected through Ray Client (``ray://``) is not on the
cluster at all.  So each task hands every finished row to a small inbox
actor (:class:`RowInbox`; the call returns once the actor holds the row),
and the driver pulls the inbox a few times a second and appends what it
finds to its :class:`~eval_harness.sweep.store.ResultStore`.  The driver
is the file's only writer: it stays one append-only JSONL with the store's
guarantees (a flush and fsync per row, torn-line recovery), and a plain
sweep and a Ray sweep resume the same file.  Pulling was chosen over a
store actor that writes the file itself because such an actor writes the
disk of the node it runs on, which is not the driver's under Ray Client;
and over streaming generator tasks because Ray Client does not wait on
those.

**Resuming.**  Pairs already in the file are never submitted.  A task that
Ray retries (its worker or node died) first asks the inbox which of its
rows already arrived and skips them; a row that still arrives twice is
dropped by its key.  Killing the driver loses only the rows in flight (at
most one per item being decoded); a re-run does those and the rest.

**Failures.**  A task that raises is reported as it fails (which shard, the
error); the other shards go on and their rows are written; then
:class:`ShardsFailed` names every failed shard.  What was written stays.

**Private data.**  A task's arguments (its items: private contexts) and its rows (decoded answers) pass
through the cluster's object store and its network channels.  Each task is sent only the items its
shard names (:func:`shard_items`), never the whole task list; a local instance (``--ray local``) listens
on loopback only (:func:`_loopback_only`) with no dashboard.  A cluster's own channels are its operator's
to secure (Ray's token authentication, TLS between nodes): the README says how.

**Code.**  :func:`connect` ships the driver's own ``edge_sdk``,
``cloud_adapter`` and ``eval_harness`` to the workers (``runtime_env``
``py_modules``), so the cluster runs the code the driver runs, not a copy
its image holds; every task compares a digest of the source it imported
with the driver's (:func:`eval_harness.provenance.code_digest`) and refuses to run on a mismatch
(e.g. a Ray instance started elsewhere without that ``runtime_env``).  The
workers' Python still needs the dependencies (``coveil[cloud,harness]``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from eval_harness.datasets import DecodeLeakItem
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.provenance import code_digest, code_dirs, items_digest
from eval_harness.sweep.grid import Setting, pending_pairs, row_key
from eval_harness.sweep.store import ResultStore

if TYPE_CHECKING:  # the driver and the inbox import no model library; a shard task does (run_shard)
    from eval_harness.sweep.execute import ReferenceSpec

#: how often the driver pulls the inbox while tasks run (seconds)
POLL_SECONDS = 0.25


def require_ray() -> ModuleType:
    """The ``ray`` module, or an ImportError that names the extra to install."""
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs Ray, an optional dependency: pip install 'coveil[ray]'") from None
    return ray


def connect(address: str = "local", **init_options: Any) -> bool:
    """Join the Ray cluster at ``address``, shipping this code to its workers.

    ``"local"`` starts a new instance on this machine (not one that
    ``ray start`` or ``RAY_ADDRESS`` points at); ``"auto"`` joins this node's
    cluster; ``ray://HOST:PORT`` connects through Ray Client.
    ``init_options`` go to ``ray.init`` (e.g. ``num_cpus`` for a local
    instance).  Returns whether this call connected (and so should
    disconnect); an already initialised Ray is used as it is.

    Ray's own log lines below ERROR (starting the instance, pushing each code
    package) and the workers' output (each task's model-loading bars, echoed
    under the sweep's progress bar) stay out of the terminal: a task's failure
    still reaches the driver as its exception, and the workers' logs stay in
    Ray's session directory.
    """
    ray = require_ray()
    if ray.is_initialized():
        return False
    init_options.setdefault("logging_level", logging.ERROR)
    init_options.setdefault("log_to_driver", False)
    runtime_env = {"py_modules": [str(d) for d in code_dirs()]}
    if address != "local":
        ray.init(address=address, runtime_env=runtime_env, **init_options)
        return True
    init_options.setdefault("include_dashboard", False)
    with _loopback_only():
        ray.init(address=address, runtime_env=runtime_env, _node_ip_address="127.0.0.1", **init_options)
    return True


@contextmanager
def _loopback_only() -> Iterator[None]:
    """While a local instance starts, Ray takes this machine's loopback address as its node address.

    Every private context of a sweep passes through the instance's object store, so its servers must not be
    reachable from the network. Ray resolves a node address of 127.0.0.1 to the machine's reachable one (and binds
    its servers there and on ``::``) unless multi-node clusters are off: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
    which Ray reads when it is imported, by this process (``ray_constants.ENABLE_RAY_CLUSTER``, set here too in
    case ``ray`` was imported already) and by the daemons ``ray.init`` starts (they inherit the environment).
    Both are restored once the instance runs.
    """
    from ray._private import ray_constants

    variable = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    before_env, before_flag = os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[variable] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_flag
        if before_env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before_env


def shard_items(units: Sequence[tuple[Setting, str]],
                items: Mapping[str, Sequence[DecodeLeakItem]]) -> dict[str, list[DecodeLeakItem]]:
    """The items ``units`` name, by task, in their task's order: all a shard's task is sent (no other private
    context reaches its worker or the object store on its behalf)."""
    wanted: dict[str, set[str]] = {}
    for setting, item_id in units:
        wanted.setdefault(setting.task, set()).add(item_id)
    return {task: [item for item in items[task] if item.item_id in ids] for task, ids in wanted.items()}


def default_shard_count(cpus_per_task: float, gpus_per_task: float) -> int:
    """How many tasks the cluster runs at once: its GPUs over ``gpus_per_task`` (CPUs over ``cpus_per_task``)."""
    resources = require_ray().cluster_resources()
    if gpus_per_task > 0:
        return max(1, int(resources.get("GPU", 0) // gpus_per_task))
    return max(1, int(resources.get("CPU", 1) // max(cpus_per_task, 1e-9)))


@dataclass(frozen=True)
class ShardPlan:
    """The pairs a Ray sweep still has to run, cut into shards.

    Attributes:
        pending: every (setting, item id) pair not in the results file, in grid order.
        shards: ``pending`` cut into contiguous runs of near-equal length (none empty).
        skipped: pairs (of the ``--shard`` share) already in the file.
    """

    pending: list[tuple[Setting, str]]
    shards: list[list[tuple[Setting, str]]]
    skipped: int


def plan_shards(
    settings: Sequence[Setting],
    items: Mapping[str, Sequence[DecodeLeakItem]],
    store: ResultStore,
    *,
    count: int,
    shard_of: tuple[int, int] = (0, 1),
) -> ShardPlan:
    """The pending pairs of ``shard_of``'s share in ``min(count, pending)`` contiguous shards.

    Shard ``j`` of ``n`` holds ``pending[floor(j L / n) : floor((j + 1) L / n)]``
    for ``L`` pending pairs.  Cutting what is pending (not the whole grid)
    keeps a resumed sweep balanced however the last run ended.
    """
    if count < 1:
        raise ValueError(f"a Ray sweep needs at least one shard, got {count}")
    pending, skipped = pending_pairs(settings, items, store, shard_of)
    n = min(count, len(pending))
    shards = [pending[j * len(pending) // n : (j + 1) * len(pending) // n] for j in range(n)]
    return ShardPlan(pending=pending, shards=shards, skipped=skipped)


class RowInbox:
    """The actor rows travel through: tasks put finished rows, the driver takes them (run as a Ray actor)."""

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._keys: set[str] = set()

    def put(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        self._keys.add(str(row["key"]))

    def take(self) -> list[dict[str, Any]]:
        """Every row put since the last take, in arrival order."""
        rows, self._rows = self._rows, []
        return rows

    def received(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` whose rows were ever put (a retried task skips them)."""
        return [key for key in keys if key in self._keys]


class RelayStore:
    """A task's stand-in for the driver's store: a row is done if it was before the task began; rows go to the inbox.

    Implements :class:`~eval_harness.sweep.store.RowStore`.
    """

    def __init__(self, inbox: Any, done: set[str]) -> None:
        self._inbox, self._done = inbox, set(done)

    def __contains__(self, key: object) -> bool:
        return key in self._done

    def append(self, row: Mapping[str, Any]) -> None:
        require_ray().get(self._inbox.put.remote(dict(row)))  # back once the inbox holds it
        self._done.add(str(row["key"]))


def run_shard(
    units: Sequence[tuple[Setting, str]],
    items: Mapping[str, Sequence[DecodeLeakItem]],
    inbox: Any,
    *,
    spec: ReferenceSpec,
    protocol: DecodingProtocol,
    seed: int,
    driver_code: str,
    dataset_sha256: Mapping[str, str] | None = None,
) -> int:
    """One Ray task: check the code, load the models, run ``units`` through the reference runner; rows written."""
    here = code_digest()
    if here != driver_code:
        dirs = ", ".join(str(d) for d in code_dirs())
        raise RuntimeError(f"this worker imports other code than the driver ({dirs}: sha256 {here[:12]}, driver "
                           f"{driver_code[:12]}); start Ray through decodeleak (or ray.init with "
                           "eval_harness.sweep.ray.connect) so the driver's code is shipped")
    from eval_harness.sweep.execute import run_sweep

    ray = require_ray()
    done = set(ray.get(inbox.received.remote([row_key(s, item_id) for s, item_id in units])))
    settings = list({s.key: s for s, _ in units}.values())
    runner, vocab, metadata = spec.build(protocol, seed=seed)
    with runner:
        outcome = run_sweep(settings, items, runner, RelayStore(inbox, done), protocol=protocol, vocab=vocab,
                            metadata=metadata.row(), seed=seed, units=units, dataset_sha256=dataset_sha256)
    return outcome.written


class ShardsFailed(RuntimeError):
    """Some Ray tasks failed; the rows of the others (and the failed ones' rows so far) were written.

    Attributes:
        failures: ``(shard index, "ErrorType: message")`` per failed task.
        written: rows written by the whole sweep.
    """

    def __init__(self, failures: list[tuple[int, str]], count: int, written: int) -> None:
        self.failures, self.written = failures, written
        super().__init__("; ".join(f"shard {index + 1}/{count} failed: {reason}" for index, reason in failures))


@dataclass
class RaySweepOutcome:
    """What a Ray sweep did: rows written, and rows that arrived twice (a retried task) and were dropped."""

    written: int
    duplicates: int


def failure_reason(error: BaseException) -> str:
    """``"ErrorType: first line"`` of the task's own exception (Ray wraps it in a RayTaskError)."""
    cause = getattr(error, "cause", None)
    shown = cause if isinstance(cause, BaseException) else error
    lines = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {lines[0] if lines else '(no message)'}"


def run_on_ray(
    plan: ShardPlan,
    items: Mapping[str, Sequence[DecodeLeakItem]],
    store: ResultStore,
    *,
    spec: ReferenceSpec,
    protocol: DecodingProtocol,
    seed: int,
    cpus_per_task: float = 1.0,
    gpus_per_task: float = 0.0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    on_failure: Callable[[int, str], None] | None = None,
) -> RaySweepOutcome:
    """Run ``plan``'s shards as Ray tasks on the connected cluster, appending each row to ``store`` as it arrives.

    Raises :class:`ShardsFailed` once every task has ended if any failed.
    On Ctrl-C the tasks are cancelled, the rows that had arrived are
    written, and the KeyboardInterrupt goes on.
    """
    ray = require_ray()
    outcome = RaySweepOutcome(written=0, duplicates=0)
    if not plan.shards:
        return outcome
    inbox = ray.remote(num_cpus=0)(RowInbox).remote()
    task = ray.remote(run_shard).options(num_cpus=cpus_per_task, num_gpus=gpus_per_task)
    driver_code = code_digest()

    # the rows' dataset digest is over each task's whole item list, which no Ray task is sent
    dataset_sha256 = {task: items_digest(task_items) for task, task_items in items.items()}
    running = {
        task.remote(units, shard_items(units, items), inbox, spec=spec, protocol=protocol, seed=seed,
                    driver_code=driver_code, dataset_sha256=dataset_sha256): j
        for j, units in enumerate(plan.shards)
    }

    def drain() -> None:
        for row in ray.get(inbox.take.remote()):
            if row["key"] in store:  # a retried task redid a row that had arrived
                outcome.duplicates += 1
                continue
            store.append(row)
            outcome.written += 1
            if on_row is not None:
                on_row(row)

    failures: list[tuple[int, str]] = []
    try:
        while running:
            ended, _ = ray.wait(list(running), num_returns=len(running), timeout=POLL_SECONDS)
            drain()
            for ref in ended:
                index = running.pop(ref)
                try:
                    ray.get(ref)
                except Exception as error:  # noqa: BLE001 - any task error is reported with its shard
                    failures.append((index, failure_reason(error)))
                    if on_failure is not None:
                        on_failure(index, failures[-1][1])
        drain()  # rows put just before the last task ended
    except KeyboardInterrupt:
        for ref in running:
            ray.cancel(ref, force=True)
        drain()
        raise
    finally:
        ray.kill(inbox)
    if failures:
        raise ShardsFailed(sorted(failures), len(plan.shards), outcome.written)
    return outcome
