"""Runners are registered by name like policies; a run's metadata is one dataclass; provenance has its module."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from edge_sdk.registry import UnknownNameError
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners import RUNNERS, SEED_POLICY, RunMetadata, runner_spec

IDENTITY = {"models": {"slm": {"name": "a"}, "llm": {"name": "b"}}, "dtype": "float32", "backend": "deployed",
            "protocol": {"name": "paper"}, "seed": 3}


def test_both_runners_are_registered_and_a_near_miss_is_named() -> None:
    assert RUNNERS.names() == ["deployed", "reference"]
    assert runner_spec("reference").__name__ == "ReferenceSpec"
    assert runner_spec("deployed").__name__ == "DeployedSpec"
    with pytest.raises(UnknownNameError, match="unknown runner 'deploy'; did you mean 'deployed'"):
        runner_spec("deploy")


def test_run_metadata_is_a_row_in_the_order_rows_carry_it() -> None:
    metadata = RunMetadata.of_run(IDENTITY, adapter={"address": "x"}, edge={"instances": 2}, version="1.0",
                                  code={"sha256": "c0de"})
    row = metadata.row()
    assert row == {**IDENTITY, "edge": {"instances": 2}, "adapter": {"address": "x"}, "seed_policy": SEED_POLICY,
                   "version": "1.0", "code": {"sha256": "c0de"}}
    assert list(row) == ["models", "dtype", "backend", "protocol", "seed", "edge", "adapter", "seed_policy",
                         "version", "code"]  # the reference runner's device/batching/vocabulary left out


def test_the_deployed_spec_states_a_remote_runs_identity_without_loading_anything(tmp_path: Path) -> None:
    edge = tmp_path / "edge.gguf"
    edge.write_bytes(b"GGUF not really a model")
    spec = runner_spec("deployed")(slm=str(edge), cloud="10.0.0.7:50051")
    identity = spec.run_identity(DecodingProtocol(max_new_tokens=8), seed=5)
    assert identity["models"]["slm"] == {"name": "edge.gguf",
                                         "sha256": hashlib.sha256(b"GGUF not really a model").hexdigest()}
    assert identity["models"]["llm"]["name"] is None and identity["dtype"] is None
    assert (identity["backend"], identity["seed"], identity["protocol"]["max_new_tokens"]) == ("deployed", 5, 8)
