"""``decodeleak compare-quant``'s three passes over one item set, each resumable from its JSONL file.

1. **Reference, end to end.**  The collaborative loop with the full-precision SLM (transformers) for every
   (mode, policy), through the reference runner: ``reference.jsonl``, ``decodeleak sweep``'s row format.
2. **Step by step along a shared prefix.**  Each mode's prefix is the reference's CoVeil generation in that
   mode (the states CoVeil visits when deployed).  Every quantised SLM is teacher-forced along it beside the
   reference SLM and the cloud LLM (:mod:`~eval_harness.compare.teacher`), and each step compared
   (:mod:`~eval_harness.compare.drift`): ``steps.jsonl``, one row per (variant, mode, item) with per-step lists.
3. **Each variant, end to end.**  The same loop with the quantised SLM in llama.cpp against the same cloud
   engine (:class:`~eval_harness.runners.llama_cpp_edge.LlamaCppEdgeRunner`): ``<variant>.jsonl``.

Rows carry the protocol, the models' digests and the dtype; a file written by another configuration is
refused rather than silently mixed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_sdk.decode_settings import DecodeSettings
from eval_harness.compare.quantize import Variant
from eval_harness.datasets import DecodeLeakItem
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.sweep.grid import Setting, row_key
from eval_harness.sweep.store import ResultStore, read_rows

if TYPE_CHECKING:
    from edge_sdk.protocol.signals import FusionMode
    from eval_harness.compare.drift import StepDrift
    from eval_harness.metrics import Vocabulary
    from eval_harness.runners.reference import ItemRunner, ReferenceRunner

#: the policies an end-to-end comparison runs (CoVeil's reference runs are the shared prefixes)
POLICIES = ("undefended", "coveil")
#: fields that must agree between a results file and the run appending to it
RUN_FIELDS = ("protocol", "dtype")


@dataclass(frozen=True)
class QuantAudit:
    """What is compared: fusion modes, policies, CoVeil's parameters and the fusion weight."""

    modes: tuple[str, ...] = ("cloud", "edge")
    policies: tuple[str, ...] = POLICIES
    lam: float = 1.0
    k: int = 50
    space: str = "prob"
    alpha: float = DecodeSettings.alpha

    def __post_init__(self) -> None:
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown:
            raise ValueError(f"compare-quant runs {', '.join(POLICIES)}; not {', '.join(unknown)}")
        if "coveil" not in self.policies:
            raise ValueError("compare-quant needs coveil among the policies: its reference runs are the shared "
                             "prefixes")

    def setting(self, task: str, mode: str, policy: str) -> Setting:
        """The sweep setting of one (task, mode, policy); parameters at their defaults are left out."""
        params: dict[str, Any] = {}
        if policy == "coveil":
            params["lam"] = self.lam
            if self.k != 50:
                params["k"] = self.k
        if self.space != "prob":
            params["space"] = self.space
        return Setting(task, mode, policy, params, self.alpha)

    def settings(self, tasks: Sequence[str]) -> list[Setting]:
        return [self.setting(task, mode, policy) for task in tasks for mode in self.modes for policy in self.policies]


def check_run(path: Path, expected: Mapping[str, Any]) -> None:
    """Refuse a results file whose rows were written with another protocol, dtype or models."""
    if not path.exists():
        return
    for row in read_rows([path]):
        for name, value in expected.items():
            if row.get(name) != value:
                raise ValueError(f"{path} holds rows written with another {name}; give compare-quant another --out "
                                 "(or delete the file)")


def variant_metadata(metadata: Mapping[str, Any], variant: Variant) -> dict[str, Any]:
    """A reference row's metadata with the edge model replaced by ``variant`` (the cloud stays)."""
    return {
        **metadata,
        "models": {**metadata["models"], "slm": {"name": variant.describe(), "sha256": variant.sha256,
                                                 "file_type": variant.info.file_type,
                                                 "derived_from": variant.derived_from},
                   "slm_reference": metadata["models"]["slm"]},
        "backend": "llama.cpp edge, transformers cloud (in-process engine)",
    }


class QuantComparison:
    """The three passes over ``items`` for ``variants``, written under ``out_dir``.

    Args:
        runner: the reference runner (reference SLM and cloud LLM in transformers).
        vocab: the vocabulary the DecodeLeak metrics read.
        metadata: what every reference row records (models, dtype, protocol, seed policy, version).
        protocol: the decoding protocol.
        items: the items of each task.
        audit: modes, policies and CoVeil's parameters.
        variants: the quantised SLMs.
        out_dir: where ``reference.jsonl``, ``steps.jsonl`` and ``<variant>.jsonl`` go.
        seed: the randomised policies' seed (none of the compared policies draws; kept for the row format).
    """

    def __init__(self, runner: ReferenceRunner, vocab: Vocabulary, metadata: Mapping[str, Any],
                 protocol: DecodingProtocol, items: Mapping[str, Sequence[DecodeLeakItem]], audit: QuantAudit,
                 variants: Sequence[Variant], out_dir: Path, *, seed: int = 0) -> None:
        self.runner, self.vocab, self.metadata, self.protocol = runner, vocab, dict(metadata), protocol
        self.items, self.audit, self.variants, self.out_dir, self.seed = items, audit, list(variants), out_dir, seed
        self.settings = audit.settings(list(items))
        self.reference_path = out_dir / "reference.jsonl"
        self.steps_path = out_dir / "steps.jsonl"
        expected = {name: self.metadata[name] for name in RUN_FIELDS}
        check_run(self.reference_path, {**expected, "models": self.metadata["models"]})
        check_run(self.steps_path, {**expected, "models": self.metadata["models"]})
        for variant in self.variants:
            check_run(self.variant_path(variant), {**expected, "models": variant_metadata(metadata, variant)["models"]})

    def variant_path(self, variant: Variant) -> Path:
        return self.out_dir / f"{variant.name}.jsonl"

    @property
    def total(self) -> int:
        """Rows the three passes write (what the progress bar counts)."""
        pairs = sum(len(self.items[s.task]) for s in self.settings)
        prefixes = sum(len(self.items[task]) for task in self.items) * len(self.audit.modes)
        return pairs * (1 + len(self.variants)) + prefixes * len(self.variants)

    def _sweep(self, runner: ItemRunner, path: Path, metadata: Mapping[str, Any], on_row: Callable[[], None]) -> int:
        from eval_harness.sweep.execute import run_sweep

        with ResultStore(path) as store:
            outcome = run_sweep(self.settings, self.items, runner, store, protocol=self.protocol, vocab=self.vocab,
                                metadata=metadata, seed=self.seed, on_row=lambda row: on_row())
        return outcome.skipped

    def run_reference(self, on_row: Callable[[], None]) -> int:
        """Pass 1; returns how many rows were already there."""
        return self._sweep(self.runner, self.reference_path, self.metadata, on_row)

    def run_variants(self, on_row: Callable[[], None], *, on_variant: Callable[[Variant], None] | None = None) -> int:
        """Pass 3; returns how many rows were already there."""
        from eval_harness.runners.llama_cpp_edge import LlamaCppEdgeRunner

        skipped = 0
        for variant in self.variants:
            if on_variant is not None:
                on_variant(variant)
            with LlamaCppEdgeRunner(variant.path, self.runner, concurrency=self.runner.concurrency) as edge:
                skipped += self._sweep(edge, self.variant_path(variant), variant_metadata(self.metadata, variant),
                                       on_row)
        return skipped

    def step_key(self, variant: Variant, setting: Setting, item_id: str) -> str:
        return f"{variant.name}.{variant.sha256[:12]}-{row_key(setting, item_id)}"

    def run_steps(self, on_row: Callable[[], None]) -> int:
        """Pass 2 (needs pass 1's CoVeil rows); returns how many rows were already there."""
        from edge_sdk.backends.llama_cpp import LlamaCppSLM
        from edge_sdk.prompts import plain_prompts
        from edge_sdk.policies import make_policy
        from eval_harness.compare.teacher import drift_along

        prefixes = {row["key"]: row for row in read_rows([self.reference_path])} if self.reference_path.exists() else {}
        reference, cloud = self.runner.slm_model, self.runner.llm
        end_ids = sorted(reference.eos_token_ids | cloud.eos_token_ids)
        skipped = 0
        with ResultStore(self.steps_path) as store:
            pending = []
            for task, items in self.items.items():
                for mode in self.audit.modes:
                    setting = self.audit.setting(task, mode, "coveil")
                    for item in items:
                        todo = [v for v in self.variants if self.step_key(v, setting, item.item_id) not in store]
                        skipped += len(self.variants) - len(todo)
                        if todo:
                            prefix = prefixes.get(row_key(setting, item.item_id))
                            if prefix is None:
                                raise ValueError(f"no reference CoVeil run of {item.item_id} ({mode}-side) in "
                                                 f"{self.reference_path}: run the reference pass first")
                            pending.append((setting, item, todo, prefix["token_ids"]))
            models = {v.name: LlamaCppSLM(v.path, n_ctx=2048) for v in self.variants} if pending else {}
            try:
                for setting, item, todo, tokens in pending:
                    # the prompts as the sweep builds them: the private context after the preamble, before the item
                    slm_prompt = list(plain_prompts(reference, self.protocol.question_prompt(item), item.private_context,
                                                    public_preamble=self.protocol.preamble).slm_ids)
                    cloud_prompt = cloud.tokenize(self.protocol.public_prompt(item), add_bos=True)
                    mode: FusionMode = setting.mode  # type: ignore[assignment]
                    drift = drift_along(
                        tokens, slm_prompt=slm_prompt, cloud_prompt=cloud_prompt, reference=reference, cloud=cloud,
                        quantised={v.name: models[v.name] for v in todo},
                        policy=make_policy("coveil", **setting.params), mode=mode, alpha=setting.alpha,
                        end_ids=end_ids, stopping=self.protocol.stopping(item), detokenize=reference.detokenize,
                    )
                    for variant in todo:
                        store.append(self.step_row(variant, setting, item, drift[variant.name]))
                        on_row()
            finally:
                for model in models.values():
                    model.close()
        return skipped

    def step_row(self, variant: Variant, setting: Setting, item: DecodeLeakItem,
                 drift: Sequence[StepDrift]) -> dict[str, Any]:
        """One (variant, mode, item): the per-step lists and what makes them reproducible."""
        from eval_harness.compare.drift import OVERLAP_KS

        return {
            "key": self.step_key(variant, setting, item.item_id),
            "variant": variant.name,
            "variant_sha256": variant.sha256,
            "task": setting.task,
            "item": item.item_id,
            "mode": setting.mode,
            "prefix": f"reference {setting.label()}",
            "setting": setting.key,
            "params": dict(setting.params),
            "alpha": setting.alpha,
            "steps": len(drift),
            "kl": [round(d.kl, 7) for d in drift],
            "top1": [d.top1_agrees for d in drift],
            **{f"overlap@{k}": [d.overlaps[i] for d in drift] for i, k in enumerate(OVERLAP_KS)},
            "decision_agrees": [d.decision_agrees for d in drift],
            **{name: self.metadata[name] for name in ("models", "dtype", "protocol", "version")},
        }

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        """This run's rows (its items, settings and variants only, whatever else the files hold): the step
        rows, the reference's results and each variant's."""
        pairs = {row_key(s, item.item_id) for s in self.settings for item in self.items[s.task]}
        step_keys = {self.step_key(v, self.audit.setting(task, mode, "coveil"), item.item_id)
                     for v in self.variants for task, items in self.items.items() for mode in self.audit.modes
                     for item in items}

        def mine(path: Path, keys: set[str]) -> list[dict[str, Any]]:
            return [row for row in read_rows([path]) if row["key"] in keys] if path.exists() else []

        return (mine(self.steps_path, step_keys), mine(self.reference_path, pairs),
                {v.name: mine(self.variant_path(v), pairs) for v in self.variants})
