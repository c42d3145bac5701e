"""``coveil demo``: a laptop-to-cloud run of collaborative decoding, undefended vs CoVeil.

Starts a cloud adapter on loopback (or uses ``--cloud``), runs the edge SDK
over a few MedPriv and CommPriv items in both fusion modes, and reports task
accuracy, DecodeLeak evidence recall and the traffic each way, with a
privacy-utility plot.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cloud_adapter.local import local_cloud, split_cores
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import Credentials, EdgeClient, GenerationResult
from edge_sdk.backends.pieces import piece_reader
from edge_sdk.policies import CoVeil, Policy, Undefended
from eval_harness.datasets import DecodeLeakItem, load_task
from eval_harness.metrics import METRIC_SPECS, MetricSpec, Vocabulary, demo_metrics, evidence_recall
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners.reference import ItemRun

#: the rule sets the demo scores each metric by: the paper's definitions and the authors' evaluate_leakage.py
DEMO_RULES = ("paper", "release")


def metric_key(name: str, compat: str, k: int) -> str:
    return f"{name}@{k}" if compat == "paper" else f"{name}@{k} ({compat})"


def demo_columns(k: int) -> dict[str, tuple[MetricSpec, str]]:
    """The demo's metric columns: summary key → (the metric's spec, its column title), for every registered
    metric marked ``demo`` (:func:`~eval_harness.metrics.demo_metrics`) under each of :data:`DEMO_RULES`."""
    return {metric_key(name, compat, k): (METRIC_SPECS[name], METRIC_SPECS[name].label
                                          + ("" if compat == "paper" else f" ({compat})"))
            for compat in DEMO_RULES for name in demo_metrics()}


@dataclass
class RunRow:
    """Aggregates of one (mode, policy) over all items."""

    mode: str
    policy: str
    k: int = 100
    correct: list[bool] = field(default_factory=list)
    answered: list[bool] = field(default_factory=list)
    recall: dict[str, list[float]] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    tokens: int = 0
    seconds: float = 0.0
    full_requests: int = 0

    def add(self, item: DecodeLeakItem, result: GenerationResult, seconds: float, vocab: Vocabulary,
            protocol: DecodingProtocol) -> None:
        trace = result.ledger.exposure_trace()
        names = demo_metrics()
        for compat in DEMO_RULES:
            recall = evidence_recall(item.evidence_spans, trace, self.k, vocab, names=names,
                                     public_query=item.public_query, compat=compat)
            for name in names:
                self.recall.setdefault(metric_key(name, compat, self.k), []).append(recall[f"{name}@{self.k}"])
        letter = protocol.predicted(item, result.text)
        self.answered.append(letter is not None)
        self.correct.append(letter == item.answer)
        self.bytes_up += result.ledger.bytes_up
        self.bytes_down += result.ledger.bytes_down
        self.tokens += len(result.token_ids)
        self.seconds += seconds
        self.full_requests += result.ledger.full_requests

    def summary(self) -> dict[str, float | str]:
        tokens = max(self.tokens, 1)
        return {
            "mode": self.mode,
            "policy": self.policy,
            "accuracy": float(np.mean(self.correct)),
            "answered": float(np.mean(self.answered)),
            **{key: float(np.mean(values)) for key, values in self.recall.items()},
            "up_bytes_per_token": self.bytes_up / tokens,
            "down_bytes_per_token": self.bytes_down / tokens,
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "full_requests": self.full_requests,
        }


def policy_label(policy: Policy) -> str:
    return f"coveil λ={policy.lam:g}" if isinstance(policy, CoVeil) else policy.name


def demo_policies(lams: Sequence[float]) -> list[Policy]:
    return [Undefended(), *(CoVeil(lam=lam) for lam in lams)]


def decode_item(client: EdgeClient, protocol: DecodingProtocol, item: DecodeLeakItem, policy: Policy, *,
                mode: str, exposure_k: int) -> GenerationResult:
    """One item under the harness's ``protocol``: the cloud reads ``protocol.public_prompt(item)``, the SLM the
    private context right before the question, and the generation ends once ``Answer: (X)`` is written."""
    return ItemRun.of(protocol, item, policy).generate(client, mode=mode, alpha=protocol.alpha,
                                                       max_new_tokens=protocol.max_new_tokens, exposure_k=exposure_k)


def run_demo(
    *,
    items_per_task: int,
    max_new_tokens: int,
    modes: Sequence[str],
    lams: Sequence[float],
    cloud: str | None,
    credentials: Credentials,
    model: str | None,
    out_dir: Path,
    alpha: float,
    quiet: bool = False,
) -> list[dict[str, float | str]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(quiet=quiet, width=None if sys.stdout.isatty() else 132)
    out_dir.mkdir(parents=True, exist_ok=True)
    items = [item for task in ("medpriv", "commpriv") for item in load_task(task, items_per_task)]
    # The harness's protocol: the worked example, the private context right before the question, reason then
    # ``Answer: (X)``, and the generation ending once the answer letter is written (a base model otherwise goes
    # on writing more questions and answers after its own).
    protocol = DecodingProtocol(max_new_tokens=max_new_tokens, alpha=alpha)
    policies = demo_policies(lams)
    rows = {(mode, policy_label(p)): RunRow(mode, policy_label(p)) for mode in modes for p in policies}
    with contextlib.ExitStack() as stack:
        edge_threads = None
        if cloud is None:
            edge_threads, cloud_threads = split_cores()
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coveil-demo-")))
            with console.status("starting the cloud adapter on loopback (the first run converts the model once)"):
                cloud = stack.enter_context(local_cloud(workdir, model=model, threads=cloud_threads))
            console.print(f"cloud adapter ready at {cloud} ({cloud_threads} torch threads, {edge_threads} for llama.cpp)")
            credentials = Credentials(plaintext=True)  # our own adapter, on loopback
        slm = LlamaCppSLM(model if model and model.endswith(".gguf") else None, n_threads=edge_threads)
        vocab = Vocabulary(lambda text: slm.tokenize(text, add_bos=False), piece_reader(slm))
        client = stack.enter_context(EdgeClient(cloud, slm=slm, credentials=credentials))
        total = len(items) * len(rows)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("decoding", total=total)
            for item in items:
                for (mode, label), row in rows.items():
                    policy = next(p for p in policies if policy_label(p) == label)
                    progress.update(task, description=f"{item.item_id} {mode}-side {policy.name}")
                    started = time.perf_counter()
                    result = decode_item(client, protocol, item, policy, mode=mode, exposure_k=row.k)
                    row.add(item, result, time.perf_counter() - started, vocab, protocol)
                    progress.advance(task)
    summaries = [row.summary() for row in rows.values()]
    _print_table(console, summaries, len(items))
    (out_dir / "demo_results.json").write_text(json.dumps(summaries, indent=2))
    plot = _plot(summaries, out_dir / "privacy_utility.png")
    console.print(f"results: {out_dir / 'demo_results.json'}; plot: {plot}")
    return summaries


def _print_table(console, summaries: list[dict[str, float | str]], n_items: int) -> None:  # noqa: ANN001
    from rich.table import Table

    k = 100
    table = Table(title=f"Collaborative decoding on {n_items} MedPriv + CommPriv items: DecodeLeak @K={k}, the "
                        "paper's definitions and (release) the authors' evaluate_leakage.py; bold: the most private "
                        "policy of each fusion mode")
    columns = demo_columns(k)
    for column in ("mode", "policy", "acc.", "answered", *(title for _, title in columns.values()), "up B/tok",
                   "down B/tok", "tok/s", "full req."):
        table.add_column(column, justify="left" if column in ("mode", "policy") else "right")
    best = best_demo_cells(summaries, k)
    for index, s in enumerate(summaries):
        recall = [f"{spec.scale * float(s[key]):.1f}{'%' if spec.percent else ''}"
                  for key, (spec, _) in columns.items()]
        table.add_row(
            str(s["mode"]), str(s["policy"]), f"{s['accuracy']:.0%}", f"{s['answered']:.0%}",
            *(f"[bold]{cell}[/bold]" if (index, key) in best else cell for cell, key in zip(recall, columns)),
            f"{s['up_bytes_per_token']:,.0f}", f"{s['down_bytes_per_token']:,.0f}",
            f"{s['tokens_per_s']:.1f}", f"{s['full_requests']}",
        )
    console.print(table)


def best_demo_cells(summaries: Sequence[dict[str, float | str]], k: int) -> set[tuple[int, str]]:
    """``(summary index, column key)`` of the most private policy of each fusion mode in each metric column, by
    the metric's :attr:`~eval_harness.metrics.MetricSpec.better` (every tied one)."""
    best: set[tuple[int, str]] = set()
    for mode in dict.fromkeys(s["mode"] for s in summaries):
        members = [i for i, s in enumerate(summaries) if s["mode"] == mode]
        for key, (spec, _) in demo_columns(k).items():
            best |= {(members[j], key) for j in spec.best([float(summaries[i][key]) for i in members])}
    return best


def _plot(summaries: list[dict[str, float | str]], path: Path) -> Path:
    """Accuracy against the first demo metric at K = 100 (Token-ER@100), one line per fusion mode; labels
    alternate above and below their point (cloud-side above first, edge-side below first) so that neighbouring
    points never write over each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, (spec, title) = next(iter(demo_columns(100).items()))
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    for mode, marker, side in (("cloud", "o", 1), ("edge", "s", -1)):
        points = sorted((s for s in summaries if s["mode"] == mode), key=lambda s: float(s[key]))
        if not points:
            continue
        xs = [spec.scale * float(s[key]) for s in points]
        ys = [100 * float(s["accuracy"]) for s in points]
        (line,) = ax.plot(xs, ys, marker=marker, linestyle="--", label=f"{mode}-side fusion")
        for rank, (s, x, y) in enumerate(zip(points, xs, ys)):
            undefended = s["policy"] == "undefended"
            if undefended:  # the reference point: hollow and larger
                ax.plot([x], [y], marker=marker, markersize=11, markerfacecolor="none", color=line.get_color())
            up = side if rank % 2 == 0 else -side
            ax.annotate(str(s["policy"]), (x, y), textcoords="offset points", xytext=(0, 10 * up),
                        ha="center", va="bottom" if up > 0 else "top", fontsize=8, color=line.get_color())
    ax.set_xlabel(f"{title}@100{' (%)' if spec.percent else ''}: private evidence the cloud could read; "
                  f"{spec.direction()}")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-5, 105)
    ax.set_title("Privacy-utility trade-off (hollow marker: undefended)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
