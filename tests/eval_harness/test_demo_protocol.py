"""``coveil demo`` decodes each item under the harness's protocol (public fakes, no model).

The demo once asked a base model for the answer letter first with no stopping rule: the model went on writing
more "Answer:" lines and questions after its own, and the demo read its accuracy off the first character.  Now
it uses :class:`~eval_harness.decoding_protocol.DecodingProtocol`: the cloud reads the worked example and the question, the
generation ends once ``Answer: (X)`` is written, and the letter is read by the protocol's rule.
"""

from __future__ import annotations

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.client import EdgeClient
from edge_sdk.backends.pieces import piece_reader
from edge_sdk.policies import Undefended
from edge_sdk.testing import ScriptedCloud, TableSLM
from eval_harness.datasets import DecodeLeakItem
from eval_harness.demo import RunRow, decode_item
from eval_harness.metrics import Vocabulary
from eval_harness.decoding_protocol import WORKED_EXAMPLE, DecodingProtocol

#: every printable character, so that any prompt tokenizes, and four pieces the scripted cloud writes
SCRIPTED = [" because", " Answer: (B)", "\nQuestion: next?", "\nAnswer: (C)"]
PIECES = ["<eos>", "\n", *(chr(c) for c in range(32, 127)), *SCRIPTED]


def one_hot(piece: str, weight: float = 8.0) -> np.ndarray:
    row = np.zeros(len(PIECES), dtype=np.float32)
    row[PIECES.index(piece)] = weight
    return row


def test_the_demo_reads_the_protocols_prompt_stops_at_the_answer_and_scores_its_letter() -> None:
    item = DecodeLeakItem(item_id="q1", public_query="Which organ filters blood?",
                          options={"A": "Heart", "B": "Kidney", "C": "Lung", "D": "Skin"},
                          private_context="Creatinine 3.1", evidence_spans=("Creatinine",), answer="B")
    slm = TableSLM(PIECES, eos_ids={0})  # uniform: the fused argmax is the cloud's
    # the cloud would go on past the answer, as a base model does: reason, answer, a new question, another answer
    cloud = ScriptedCloud(len(PIECES), [one_hot(p) for p in SCRIPTED] * 2, eos_ids={0})
    protocol = DecodingProtocol(max_new_tokens=8)
    with EdgeClient(cloud.session, slm=slm) as client:
        result = decode_item(client, protocol, item, Undefended(), mode="edge", exposure_k=4)

    assert result.text == " because Answer: (B)"  # not " because Answer: (B)\nQuestion: next?\nAnswer: (C)..."
    assert result.finish_reason == "stop_rule"
    opened = next(m for m in cloud.edge_messages() if m.WhichOneof("kind") == "open")
    cloud_prompt = slm.detokenize(list(wire.ids_from_bytes(opened.open.token_ids.ids)))
    assert cloud_prompt.startswith(WORKED_EXAMPLE) and cloud_prompt.endswith("(D) Skin\nReason:")
    assert "Creatinine" not in cloud_prompt

    row = RunRow("edge", "undefended", k=4)
    row.add(item, result, 0.1, Vocabulary(lambda text: slm.tokenize(text, add_bos=False), piece_reader(slm)),
            protocol)
    summary = row.summary()
    assert summary["accuracy"] == 1.0 and summary["answered"] == 1.0
