"""Issue 30: a cloud-side JSON schema is sent as it is, like the question, so it is checked for private text first."""

from __future__ import annotations

import string

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.grammar import PrivateSchemaError, check_public_schema
from edge_sdk.testing import ScriptedCloud, TableSLM

CONTEXT = "Patient Yamada Taro, 54, was seen by Dr. Okonkwo-Fitzgerald for chest pain radiating to the left arm."
QUESTION = "Which organ is affected?"


def refused_at(schema: object, **kwargs: object) -> str:
    with pytest.raises(PrivateSchemaError) as caught:
        check_public_schema(schema, private_context=CONTEXT, public_text=QUESTION, **kwargs)  # type: ignore[arg-type]
    return str(caught.value)


def test_an_enum_of_the_context_s_names_is_refused_at_its_path_without_quoting_it() -> None:
    schema = {"type": "object", "properties": {"patient": {"enum": ["Someone Else", "Yamada Taro"]}}}
    message = refused_at(schema)
    assert "$.properties.patient.enum[1]" in message and "edge" in message
    assert "Yamada" not in message and "Taro" not in message


def test_a_never_upload_span_or_one_of_its_words_is_refused_anywhere_up_to_case_and_accents() -> None:
    spans = ("Okonkwo-Fitzgerald",)
    described = {"type": "object", "description": "the note of dr FITZGERALD", "properties": {}}
    assert "$.description" in refused_at(described, never_upload=spans)
    keyed = {"type": "object", "properties": {"okónkwo": {"type": "string"}}}
    message = refused_at(keyed, never_upload=spans)
    assert "$.properties (key #0)" in message and "kwo" not in message


def test_text_the_context_shares_with_the_schema_is_refused_unless_the_question_holds_it() -> None:
    described = {"type": "string", "description": "pain radiating to the left arm, as noted"}
    assert "$.description" in refused_at(described)  # three words in a row from the context
    # short or common strings, the schema language's own names, and the question's words pass
    check_public_schema({"type": "object", "properties": {"organ": {"type": "string", "enum": ["arm", "no"]},
                                                          "affected": {"type": "boolean"}},
                         "required": ["organ"], "description": "Which organ is affected?"},
                        private_context=CONTEXT + " Which organ is affected?", public_text=QUESTION)


def test_without_private_text_any_schema_passes() -> None:
    schema = {"type": "object", "properties": {"name": {"enum": ["Yamada Taro"]}}}
    check_public_schema(schema, private_context="", public_text=QUESTION)


PIECES = ["<eos>", *string.printable]  # ASCII: letters, digits, punctuation, whitespace


def client_and_cloud() -> tuple[EdgeClient, ScriptedCloud]:
    slm = TableSLM(PIECES, default=np.zeros(len(PIECES), np.float32), eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), eos_ids={0}, max_new_tokens=2)
    return EdgeClient(cloud.session, slm=slm), cloud


def test_the_client_refuses_a_private_cloud_side_schema_before_anything_is_sent_and_takes_it_edge_side() -> None:
    """The check runs where the decoder is built: nothing reaches the cloud; edge-side the schema never leaves."""
    schema = {"type": "object", "properties": {"patient": {"enum": ["Yamada Taro"]}}}
    client, cloud = client_and_cloud()
    with client, pytest.raises(PrivateSchemaError, match=r"\$\.properties\.patient\.enum\[0\]"):
        client.generate(QUESTION, CONTEXT, mode="cloud", json_schema=schema, max_new_tokens=2)
    assert cloud.sent == []
    pytest.importorskip("llguidance")
    client, cloud = client_and_cloud()
    with client:
        client.generate(QUESTION, CONTEXT, mode="edge", json_schema=schema, max_new_tokens=2)
    opened = cloud.edge_messages()[0].open
    assert opened.json_schema == ""
