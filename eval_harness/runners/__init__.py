"""Runners: the one decoding loop driven over many items (reference: both models in transformers; deployed:
the llama.cpp edge over gRPC against a cloud adapter, audited from its transcripts).

Each runner is registered by name (:data:`RUNNERS`) as its *spec*: a frozen dataclass saying what the runner
loads, with ``run_identity(protocol, seed=...)`` (the rows' run identity from the model files alone, nothing
loaded) and ``build(protocol, seed=..., identity=...)`` (the runner, the vocabulary the metrics read and the
rows' :class:`RunMetadata`).  The targets are ``"module:attr"`` strings resolved on use (as lm-eval's registry
placeholders), so naming a runner loads no model library; a command line only builds the spec from its
options (``decodeleak --runner NAME``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.registry import Registry
from eval_harness.provenance import package_version, source_digest

#: runner name -> ``"module:attr"`` of its spec class
RUNNERS: Registry[str] = Registry("runner")
RUNNERS.register("reference", "eval_harness.sweep.execute:ReferenceSpec")
RUNNERS.register("deployed", "eval_harness.runners.deployed:DeployedSpec")

#: how the randomised policies of a run are seeded (every row says so)
SEED_POLICY = ("randomised policies draw from numpy's default_rng(SeedSequence([seed, setting key, item id])): "
               "reproducible in-process audits; the SDK itself seeds from OS entropy")


def runner_spec(name: str) -> Any:
    """The spec class registered as ``name`` (imported now); an unknown name is refused with suggestions."""
    module, _, attr = RUNNERS.get(name).partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class RunMetadata:
    """What every row of a run records beside its own results.

    The first five fields are the run's identity (:data:`eval_harness.sweep.store.RUN_FIELDS`: a results file
    holds one run); ``seed_policy``, ``version`` and ``code`` (the sources' sha256) every run records; the rest
    one runner records: where the reference runner's models ran (``device``, ``batching``, ``vocabulary``), or
    the deployed runner's edge and adapter (``edge``, ``adapter``).
    """

    models: Mapping[str, Any]
    dtype: str | None
    backend: str
    protocol: Mapping[str, Any]
    seed: int
    device: str | None = None
    batching: Mapping[str, Any] | None = None
    vocabulary: Mapping[str, Any] | None = None
    edge: Mapping[str, Any] | None = None
    adapter: Mapping[str, Any] | None = None
    seed_policy: str = SEED_POLICY
    version: str = field(default_factory=package_version)
    code: Mapping[str, Any] = field(default_factory=lambda: {"sha256": source_digest()})

    @classmethod
    def of_run(cls, identity: Mapping[str, Any], **details: Any) -> RunMetadata:
        """The metadata of the run ``identity`` names (its five identity fields), with ``details``."""
        return cls(**identity, **details)

    def row(self) -> dict[str, Any]:
        """The fields as a row carries them: the identity, then the runner's own, then seed policy, version and
        code (fields a runner does not record left out)."""
        order = ("models", "dtype", "backend", "protocol", "seed", "device", "batching", "vocabulary", "edge",
                 "adapter", "seed_policy", "version", "code")
        optional = {"device", "batching", "vocabulary", "edge", "adapter"}
        values = {name: getattr(self, name) for name in order}
        return {name: value for name, value in values.items() if not (name in optional and value is None)}
