"""``decodeleak build-benchmark``: split, screen and extract over a build directory, each stage checkpointed.

The build directory holds

* ``build.json``: the settings the build was made with (sources and their digests, format, model, JSON mode,
  prompts and their digests); a re-run with other settings is refused, since its verdicts would mix;
* ``items.jsonl``: the split items (:class:`~eval_harness.construction.sources.SplitItem` rows);
* ``screening.jsonl``: one row per screened item (kept or not, the reason, the judge's raw reply);
* ``extraction.jsonl``: one row per item kept by screening (its valid spans, the dropped ones and why);
* ``summary.json``: the counts of the last run, by stage and reason.

Each row is appended and flushed as its item finishes (:class:`~eval_harness.sweep.store.ResultStore`, keyed
by item id), and every judge call is cached on disk by :class:`~eval_harness.llm.client.ChatClient`, so a
crash or Ctrl-C loses at most the calls in flight and a re-run asks only for what is missing.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval_harness.construction.judge import KEPT, Judge
from eval_harness.construction.sources import SplitItem
from edge_sdk.private_files import private_dir, write_private_text
from eval_harness.sweep.store import ResultStore

MANIFEST = "build.json"
ITEMS = "items.jsonl"
SCREENING = "screening.jsonl"
EXTRACTION = "extraction.jsonl"
SUMMARY = "summary.json"
#: settings a re-run must share with the build it resumes (the endpoint's address and --limit may change)
PINNED = ("format", "fields", "sources", "domain", "model", "json_mode", "max_tokens", "system_role", "bounds",
          "screen_prompt", "extract_prompt", "reasoning_model")


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_stage(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of one stage file by item id (``{}`` when the stage has not run)."""
    if not path.exists():
        return {}
    rows: dict[str, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows[str(row["key"])] = row
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                if not line.endswith("\n"):  # a torn last line: the next run sets it aside
                    break
                raise ValueError(f"{path}:{number}: not a stage row ({exc})") from None
    return rows


def read_items(directory: Path) -> list[SplitItem]:
    """The split items of a build directory, in source order."""
    path = directory / ITEMS
    if not path.exists():
        raise ValueError(f"{directory} is not a build directory: no {ITEMS} (run decodeleak build-benchmark first)")
    return [SplitItem.from_row(row) for row in read_stage(path).values()]


def check_manifest(directory: Path, manifest: Mapping[str, Any]) -> None:
    """Write ``build.json``, or check that the one there was made with the same pinned settings."""
    path = directory / MANIFEST
    if path.exists():
        before = json.loads(path.read_text(encoding="utf-8"))
        changed = [name for name in PINNED if before.get(name) != manifest.get(name)]
        if changed:
            name = changed[0]
            raise ValueError(f"{directory} holds a build made with other settings ({', '.join(changed)}: "
                             f"{json.dumps(before.get(name))[:80]} there, {json.dumps(manifest.get(name))[:80]} "
                             "now); give another --out")
    private_dir(directory)
    write_private_text(path, json.dumps(dict(manifest), indent=2, ensure_ascii=False) + "\n")


@dataclass
class StageCounts:
    """One stage over the build's items: how many kept, rejected by reason, spans dropped by reason."""

    name: str
    total: int = 0
    kept: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    spans_kept: int = 0
    spans_dropped: Counter[str] = field(default_factory=Counter)
    asked: int = 0  # items sent to the judge in this run (the rest were in the stage file already)

    def add(self, row: Mapping[str, Any]) -> None:
        self.total += 1
        if row["kept"]:
            self.kept += 1
        else:
            self.rejected[row["reason"]] += 1
        self.spans_kept += len(row.get("spans", ()))
        self.spans_dropped.update(d["reason"] for d in row.get("dropped", ()))

    def describe(self) -> str:
        """``screen: 7 kept, 5 rejected (4 judge: ..., 1 invalid JSON)``."""
        line = f"{self.name}: {self.kept} kept, {sum(self.rejected.values())} rejected"
        if self.rejected:
            line += " (" + ", ".join(f"{n} {reason}" for reason, n in self.rejected.most_common()) + ")"
        if self.spans_kept or self.spans_dropped:
            line += f"; spans: {self.spans_kept} kept, {sum(self.spans_dropped.values())} dropped"
            if self.spans_dropped:
                line += " (" + ", ".join(f"{n} {reason}" for reason, n in self.spans_dropped.most_common()) + ")"
        return line

    def to_json(self) -> dict[str, Any]:
        return {"items": self.total, "kept": self.kept, "rejected": dict(self.rejected),
                "spans_kept": self.spans_kept, "spans_dropped": dict(self.spans_dropped),
                "asked_this_run": self.asked}


class JudgeEndpointError(ValueError):
    """The judge's endpoint refused a request for good (after the client's retries): the build stops, rows kept.

    (Not :class:`edge_sdk.server.errors.EndpointError`, the OpenAI-style error the edge endpoint answers with.)
    """


def _explain(exc: BaseException, stage: str, json_mode: str) -> JudgeEndpointError | None:
    """A one-line error for a failure of the endpoint (``None`` for anything else)."""
    status = getattr(exc, "status_code", None)
    full_message = str(getattr(exc, "message", exc))
    message = full_message[:200]
    if status in (400, 422):
        if any(name in full_message for name in ("max_tokens", "max_completion_tokens", "temperature")):
            hint = ("; an OpenAI reasoning model (o1, o3, o4-mini, GPT-5 ...) takes neither max_tokens nor "
                    "temperature 0: pass --reasoning-model")
        else:
            hint = {"schema": "; if it has no OpenAI structured outputs, try --json-mode object-schema "
                              "(llama-cpp-python) or object", "object-schema": "; try --json-mode schema or object"
                    }.get(json_mode, "")
        return JudgeEndpointError(f"the endpoint refused a {stage} request ({status}: {message}){hint}")
    if status in (401, 403):
        return JudgeEndpointError(f"the endpoint refused the key ({status}: {message}); set it in the variable "
                             "--api-key-env names")
    if status is not None:
        return JudgeEndpointError(f"the endpoint failed a {stage} request ({status}: {message})")
    if type(exc).__name__ in ("APIConnectionError", "APITimeoutError"):
        return JudgeEndpointError(f"cannot reach the endpoint for a {stage} request ({message})")
    return None


def run_stage(counts: StageCounts, items: Sequence[SplitItem], store: ResultStore,
              ask: Callable[[SplitItem], dict[str, Any]], *, parallel: int, json_mode: str,
              on_row: Callable[[StageCounts], None] = lambda counts: None) -> None:
    """Ask ``ask`` about every item not in ``store`` yet (``parallel`` at once), append each row as it comes.

    ``counts`` takes every item's row, those already stored first; ``on_row`` is called after each. When a call
    fails for good, the items not started are cancelled, the calls in flight are let finish and their rows
    written, and the failure is raised (as an :class:`JudgeEndpointError` when the endpoint refused).
    """
    pending = [item for item in items if item.item_id not in store]
    executor = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix=f"judge-{counts.name}")
    written: set[Future[dict[str, Any]]] = set()

    def write(future: Future[dict[str, Any]]) -> None:
        row = future.result()
        store.append(row)
        written.add(future)
        counts.asked += 1
        counts.add(row)
        on_row(counts)

    try:
        futures = [executor.submit(ask, item) for item in pending]
        for future in as_completed(futures):
            failure = future.exception()
            if failure is None:
                write(future)
                continue
            executor.shutdown(wait=True, cancel_futures=True)
            for other in futures:
                if other.done() and not other.cancelled() and other.exception() is None and other not in written:
                    write(other)
            raise (_explain(failure, counts.name, json_mode) or failure) from failure
    finally:  # Ctrl-C: stop at once; what finished is written
        executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class BuildSummary:
    """What a build run did: the items split (and skipped) and each stage's counts."""

    items: int
    skipped: Counter[str]
    stages: list[StageCounts]

    def lines(self) -> list[str]:
        split = f"split: {self.items} items"
        if self.skipped:
            split += f", {sum(self.skipped.values())} skipped (" + ", ".join(
                f"{n} {reason}" for reason, n in self.skipped.most_common()) + ")"
        return [split, *(stage.describe() for stage in self.stages)]

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "skipped": dict(self.skipped),
                **{stage.name: stage.to_json() for stage in self.stages}}


def _stage(path: Path, name: str, items: Sequence[SplitItem], ask: Callable[[SplitItem], dict[str, Any]], *,
           parallel: int, json_mode: str,
           progress: Callable[[str, int], Callable[[StageCounts], None]] | None) -> StageCounts:
    """One stage over ``items``, its rows in ``path``: the counts over every item, stored before or asked now."""
    counts = StageCounts(name)
    with ResultStore(path) as store:
        done = read_stage(path)
        for item in items:
            if item.item_id in done:
                counts.add(done[item.item_id])
        on_row = progress(name, len(items)) if progress is not None else (lambda counts: None)
        on_row(counts)
        run_stage(counts, items, store, ask, parallel=parallel, json_mode=json_mode, on_row=on_row)
    return counts


def build(directory: Path, items: Sequence[SplitItem], skipped: Counter[str], judge: Judge, *,
          manifest: Mapping[str, Any], parallel: int = 4,
          progress: Callable[[str, int], Callable[[StageCounts], None]] | None = None) -> BuildSummary:
    """Run the stages over ``items`` in ``directory``: store the items, screen them, extract from the kept.

    ``progress(stage, total)`` gives the callback each finished item's counts go to (a progress bar).
    """
    check_manifest(directory, manifest)
    with ResultStore(directory / ITEMS) as store:
        stored = read_stage(directory / ITEMS)
        for item in items:
            if item.item_id in stored:
                if SplitItem.from_row(stored[item.item_id]) != item:
                    raise ValueError(f"item {item.item_id} in {directory / ITEMS} differs from the sources now; "
                                     "give another --out")
            else:
                store.append(item.to_row())
    options = {"parallel": parallel, "json_mode": manifest["json_mode"], "progress": progress}
    screened = _stage(directory / SCREENING, "screen", items, judge.screen, **options)
    verdicts = read_stage(directory / SCREENING)
    kept = [item for item in items if verdicts[item.item_id]["kept"]]
    extracted = _stage(directory / EXTRACTION, "extract", kept, judge.extract, **options)
    stages = [screened, extracted]
    summary = BuildSummary(len(items), skipped, stages)
    write_private_text(directory / SUMMARY, json.dumps(summary.to_json(), indent=2, ensure_ascii=False) + "\n")
    return summary


def proposals(directory: Path) -> Iterable[tuple[SplitItem, dict[str, Any]]]:
    """The items the judge proposes (kept by both stages), each with its extraction row, in source order."""
    extraction = read_stage(directory / EXTRACTION)
    for item in read_items(directory):
        row = extraction.get(item.item_id)
        if row is not None and row["reason"] == KEPT:
            yield item, row
