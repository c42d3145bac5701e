"""DecodeLeak evidence-recall metrics on a hand-made vocabulary."""

from __future__ import annotations

import pytest

from eval_harness.datasets import item_from_row, predicted_letter
from eval_harness.metrics import Vocabulary, evidence_ids, evidence_recall, exposed_ids

WORDS = ["<pad>", " jaundice", " swollen", " liver", " the", " bilirubin", " heart", " of"]
VOCAB = Vocabulary(
    tokenize=lambda text: [WORDS.index(" " + w) for w in text.split()],
    piece=WORDS.__getitem__,
)
SPANS = ["jaundice", "swollen liver", "the bilirubin"]  # content ids {1}, {2, 3}, {5} ("the" is a stop word)


def test_evidence_and_exposure_sets() -> None:
    assert evidence_ids(SPANS, VOCAB) == {1, 2, 3, 5}
    assert exposed_ids([[3, 6, 1], [2]], k=2) == {3, 6, 2}


def test_recall_metrics_hand_worked() -> None:
    exposures = [[3, 6, 1], [2, 4]]  # E^1 = {3, 2}; E^2 = {3, 6, 2, 4}; E^3 adds 1
    at_2 = evidence_recall(SPANS, exposures, 2, VOCAB)
    assert at_2["token_er@2"] == pytest.approx(2 / 4)  # {2, 3} of {1, 2, 3, 5}
    assert at_2["span_er@2"] == pytest.approx((0 + 1 + 0) / 3)
    assert at_2["rouge1_er@2"] == pytest.approx(2 / 4)  # swollen, liver of jaundice/swollen/liver/bilirubin
    assert at_2["auc@2"] == pytest.approx((2 / 4 + 2 / 4) / 2)
    at_3 = evidence_recall(SPANS, exposures, 3, VOCAB, names=("token_er", "auc"))
    assert at_3 == {"token_er@3": pytest.approx(3 / 4), "auc@3": pytest.approx((0.5 + 0.5 + 0.75) / 3)}
    assert evidence_recall([], exposures, 2, VOCAB)["token_er@2"] == 0.0


def test_items_and_answer_parsing() -> None:
    row = {"_id": "x1", "public_query": "Which?", "options": {"A": "a", "B": "b", "C": "c", "D": "d"},
           "private_context": "secret", "filtered_context": "one, two ,", "answer_idx": "B"}
    item = item_from_row(row)
    assert item.evidence_spans == ("one", "two")
    assert item.public_prompt.endswith("Answer: (") and "(D) d" in item.public_prompt
    assert predicted_letter("B) because") == "B" and predicted_letter("none") is None
    with pytest.raises(ValueError, match="lacks"):
        item_from_row({"_id": "x2"})
