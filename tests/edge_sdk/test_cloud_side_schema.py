"""Cloud-side structured output over the public fakes: what the edge sends under a schema, and a cloud that does
not keep to it (the schema is sent with the session; the cloud masks where it picks, the edge checks each token)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_sdk.grammar import JsonConstraint
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import CoVeil, Undefended
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.testing import ScriptedCloud, TableSLM
from edge_sdk.protocol.status import CloudError

PIECES = ["<eos>", "{", "}", '"a"', ":", "1", "x", " "]
EOS, OPEN, CLOSE, KEY, COLON, ONE, X = 0, 1, 2, 3, 4, 5, 6
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def peaked(token: int) -> np.ndarray:
    row = np.zeros(len(PIECES), np.float32)
    row[token] = 10.0
    return row


def run(policy, *, schema: dict | None, picks: list[int], max_new_tokens: int = 8):
    """A cloud-side generation whose cloud row peaks at ``picks`` step by step (alpha 0.9: the cloud's choice)."""
    slm = TableSLM(PIECES, {(OPEN,): np.log([0.05, 0.05, 0.05, 0.5, 0.05, 0.1, 0.15, 0.05])}, eos_ids={EOS})
    cloud = ScriptedCloud(len(PIECES), [peaked(t) for t in picks], eos_ids={EOS})
    decoder = CollaborativeDecoder(
        slm, policy, DecodeSettings(mode="cloud", alpha=0.9, max_new_tokens=max_new_tokens, top_m=3, exposure_k=3),
        slm_prompt=[X, OPEN], cloud_prompt=[OPEN], meter=LeakageMeter(frozenset({X})),
        processors=[JsonConstraint(slm, schema)] if schema is not None else ())
    tokens = [event.token_id for event in run_with_resume(decoder, cloud.connect, backoff_s=0.0)]
    return tokens, cloud


@pytest.mark.parametrize("policy", [CoVeil(lam=0.0, k=3), Undefended()], ids=["coveil", "undefended"])
def test_cloud_side_a_schema_changes_only_the_open_message_by_naming_itself(policy) -> None:
    """Same top_m, same uploads byte for byte: the edge neither masks nor asks for full rows cloud-side."""
    document = [OPEN, KEY, COLON, ONE, CLOSE, EOS]
    free_tokens, free = run(policy, schema=None, picks=document)
    tokens, constrained = run(policy, schema=SCHEMA, picks=document)
    assert tokens == free_tokens == document
    assert constrained.sent[1:] == free.sent[1:] and len(free.sent) == 1 + len(document)
    opened, free_open = constrained.edge_messages()[0].open, free.edge_messages()[0].open
    assert json.loads(opened.json_schema) == SCHEMA and free_open.json_schema == ""
    assert opened.top_m == free_open.top_m == 3
    opened.json_schema = ""
    assert opened.SerializeToString() == free_open.SerializeToString()


def test_a_cloud_that_ignores_the_schema_is_caught_at_its_first_token_outside_it() -> None:
    """The scripted cloud does not apply schemas: it picks 'x' after '{', which no object under SCHEMA holds."""
    tokens, _ = run(Undefended(), schema=None, picks=[OPEN, X, CLOSE, EOS])
    assert tokens == [OPEN, X, CLOSE, EOS]  # free text: accepted
    with pytest.raises(CloudError, match="outside the JSON schema's grammar") as caught:
        run(Undefended(), schema=SCHEMA, picks=[OPEN, X, CLOSE, EOS])
    assert caught.value.code == "DATA_LOSS" and not caught.value.retryable
