"""``compat="release"``: the rules of the authors' evaluate_leakage.py, worked by hand on real pieces.

The byte-level vocabulary, spans, query and trace are test_metrics.py's; the
hand-worked numbers below were also checked once against the release's own
script run on the same tokenizer (outside this repository).
"""

from __future__ import annotations

import functools

import pytest

from edge_sdk.backends.pieces import PieceDecoder
from edge_sdk.privacy.meter import ExposureTrace
from eval_harness.metrics import Vocabulary, evidence, evidence_recall, token_er_at_k
from eval_harness.metrics.release import RELEASE_STOP_WORDS, is_filtered, normalised_phrase
from tests.eval_harness.test_metrics import QUERY, SPANS, bpe, ids, trace


def test_release_filter() -> None:
    assert len(RELEASE_STOP_WORDS) == 10
    kept = ["not", " Liver ", "70", "7", "year", "bin"]
    dropped = ["no", "is", "the", "The", "answer", "...", " ", "\n", "'s", "é", "-.-", "___"]
    assert [is_filtered(t) for t in kept] == [False] * len(kept)
    assert [is_filtered(t) for t in dropped] == [True] * len(dropped)  # 2 characters or fewer, no letter, template
    assert normalised_phrase("  Swollen,  LIVER (left)! ") == "swollen liver left"


def test_release_hand_worked_on_a_byte_level_vocabulary() -> None:
    tokenizer, vocab = bpe()
    # the surviving words joined and tokenised as one text, the first without a leading space:
    assert tokenizer.encode("bilirubin not jaundice swollen liver patient").tokens == [
        "biliru", "bin", "Ġnot", "Ġjaundice", "Ġswollen", "Ġliver", "Ġpatient"]
    # spans alone, as written:
    assert tokenizer.encode("the bilirubin").tokens == ["the", "Ġ", "biliru", "bin"]
    assert tokenizer.encode("not jaundice").tokens == ["n", "o", "t", "Ġjaundice"]
    assert tokenizer.encode("swollen liver").tokens == ["s", "woll", "en", "Ġliver"]
    found = evidence(SPANS, vocab, public_query=QUERY, compat="release")
    assert found.tokens == frozenset(ids("biliru", "bin", "Ġnot", "Ġjaundice", "Ġswollen", "Ġliver", "Ġpatient"))
    assert found.span_tokens == (frozenset(ids("biliru", "bin")), frozenset(ids("Ġjaundice")),
                                 frozenset(ids("woll", "Ġliver")))  # "the patient" is in the query
    got = evidence_recall(SPANS, trace(), [1, 2, 3], vocab, public_query=QUERY, compat="release")
    # content ids per step (Ġthe, Ġ, ., Ċ, Ġis filtered): [Ġliver] [biliru, Ġnot] [bin, Ġswollen] [Ġjaundice]
    # E^1 = {Ġliver, biliru, bin, Ġjaundice}: 4 of 7; E^2 adds Ġnot, Ġswollen: 6 of 7 (Ġpatient never)
    assert got["token_er@1"] == pytest.approx(4 / 7)
    assert got["token_er@2"] == got["token_er@3"] == pytest.approx(6 / 7)
    assert got["auc@3"] == pytest.approx((4 / 7 + 6 / 7 + 6 / 7) / 3)
    # spans {biliru, bin} 1, {Ġjaundice} 1, {woll, Ġliver} 1/2 at every k
    assert got["span_er@1"] == got["span_er@3"] == pytest.approx((1 + 1 + 1 / 2) / 3)
    # rank paths: r=1 " the.bin is" (no word); r=2 "  biliru\n jaundice" (jaundice);
    # r=3 " liver not swollen" (the last step has no 3rd id).  W = 6 words, "patient" included
    assert got["rouge1_er@1"] == 0.0
    assert got["rouge1_er@2"] == pytest.approx(1 / 6)
    assert got["rouge1_er@3"] == pytest.approx(4 / 6)


def test_release_takes_each_steps_first_k_content_ids() -> None:
    _, vocab = bpe()
    exposed = ExposureTrace(3, (ids("Ġthe", ".", "Ġliver"),))
    # release: T = {woll, Ġliver}; the step's first content id is Ġliver -> 1/2
    assert token_er_at_k(["swollen liver"], exposed, 1, vocab, compat="release") == pytest.approx(1 / 2)
    # the paper: E^1 = {Ġthe}; T = {Ġswollen, Ġliver} -> 0
    assert token_er_at_k(["swollen liver"], exposed, 1, vocab) == 0.0
    # the release truncates to its max_k before filtering: a trace cut to k = 1 has no content id left
    assert token_er_at_k(["swollen liver"], exposed.truncated(1), 1, vocab, compat="release") == 0.0


def test_public_spans_are_matched_differently() -> None:
    _, vocab = bpe()
    spans = ["swollen liver", "patient"]
    # release: "patient" is a substring of "patients" and leaves Span-ER only; the paper matches whole words
    release = evidence(spans, vocab, public_query="Are the patients well?", compat="release")
    paper = evidence(spans, vocab, public_query="Are the patients well?")
    assert release.public_spans == 1 and len(release.span_tokens) == 1
    assert ids("Ġpatient")[0] in release.tokens  # Token-ER still counts it
    assert paper.public_spans == 0 and len(paper.span_tokens) == 2
    # the paper leaves a span the query holds word for word out of every metric
    in_query = evidence(spans, vocab, public_query="Is the patient well?")
    assert in_query.public_spans == 1 and ids("Ġpatient")[0] not in in_query.tokens


def test_release_words_are_case_sensitive() -> None:
    _, vocab = bpe()
    exposed = ExposureTrace(1, (ids("Ġliver"),))
    assert evidence_recall(["Liver"], exposed, 1, vocab, names=("rouge1_er",), compat="release") == {
        "rouge1_er@1": 0.0}
    assert evidence_recall(["Liver"], exposed, 1, vocab, names=("rouge1_er",)) == {"rouge1_er@1": 1.0}


@pytest.mark.model
def test_release_hand_worked_on_gemma_pieces(slm) -> None:
    vocab = Vocabulary.from_slm(slm)
    tokenize = functools.partial(slm.tokenize, add_bos=False)
    strings = slm.token_strings()
    assert [strings[i] for i in tokenize("fever not")] == [b"f", b"ever", "▁not".encode()]
    (the,), (fever,), (comma,), (not_,), (no,) = (tokenize(t) for t in (" the", " fever", ",", " not", " no"))
    (not_alone,) = tokenize("not")
    ever = tokenize("fever not")[1]
    spans = ["no fever", "not"]
    # release: "no" is dropped; "fever not" -> f (dropped) ever ▁not; spans alone: {▁fever}, {not}
    found = evidence(spans, vocab, compat="release")
    assert found.tokens == {ever, not_} and found.span_tokens == (frozenset({fever}), frozenset({not_alone}))
    exposed = ExposureTrace(2, ((the, fever), (comma, not_)))
    got = evidence_recall(spans, exposed, [1, 2], vocab, compat="release")
    # content ids: [▁fever] [▁not] -> E^1 = {▁fever, ▁not}: of T = {ever, ▁not}, 1/2
    assert got["token_er@1"] == got["token_er@2"] == pytest.approx(1 / 2)
    assert got["span_er@1"] == pytest.approx((1 + 0) / 2)
    # rank paths: r=1 " the," ; r=2 " fever not" -> fever, not
    assert got["rouge1_er@1"] == 0.0 and got["rouge1_er@2"] == 1.0
    # the paper: T = {▁no, ▁fever, ▁not}, both exposed ones at rank 2
    paper = evidence_recall(spans, exposed, [1, 2], vocab, names=("token_er", "rouge1_er"))
    assert paper == {"token_er@1": 0.0, "rouge1_er@1": 0.0, "token_er@2": pytest.approx(2 / 3),
                     "rouge1_er@2": pytest.approx(2 / 3)}
    assert no not in found.tokens


def _plain_vocab(words: list[str], fillers: int) -> Vocabulary:
    """Ids 0..fillers-1 are two-character pieces the release filters ("f0", "f1", ...); then " word" per word."""
    pieces = [chr(0x61 + n // 26) + chr(0x61 + n % 26) for n in range(fillers)] + [" " + w for w in words]
    index = {piece: i for i, piece in enumerate(pieces)}
    return Vocabulary(lambda text: [index[" " + w] for w in text.split()], PieceDecoder(pieces, "plain"))


def test_release_reads_each_step_cut_to_max_k_then_its_content_ids() -> None:
    vocab = _plain_vocab(["swollen", "liver"], fillers=199)
    swollen, liver = 199, 200
    assert [is_filtered(vocab.piece(i)) for i in (0, 198, swollen, liver)] == [True, True, False, False]
    fill = iter(range(199))
    # one step recorded 200 deep: raw ranks 1-60 filler, 61 " liver", 62-150 filler, 151 " swollen", 152-200 filler
    step = [next(fill) for _ in range(60)] + [liver] + [next(fill) for _ in range(89)] + [swollen]
    step += [next(fill) for _ in range(49)]
    assert len(step) == 200 and step.index(liver) + 1 == 61 and step.index(swollen) + 1 == 151
    deep = ExposureTrace(200, (tuple(step),))
    # T = {swollen, liver}.  The release (ks 10,50,100, auc_k 100) cuts the step to its first 100 ids, whose only
    # content id is " liver" (its 1st content id): Token-ER = Span-ER = 1/2 at K = 10 and 100, AUC@100 = 1/2.
    # ROUGE1-ER reads raw rank paths: the rank-61 path is " liver", so 1/2 from K = 61 on.
    got = evidence_recall(["swollen liver"], deep, [10, 100], vocab, compat="release")
    assert got == {"token_er@10": 0.5, "span_er@10": 0.5, "rouge1_er@10": 0.0, "auc@10": 0.5,
                   "token_er@100": 0.5, "span_er@100": 0.5, "rouge1_er@100": 0.5, "auc@100": 0.5}
    # the same ids recorded 100 deep score the same: the recorded depth does not move a release number
    assert evidence_recall(["swollen liver"], deep.truncated(100), [10, 100], vocab, compat="release") == got
    # at K = 200 the release (ks including 200) cuts to 200: " swollen" is the 2nd content id
    at_200 = evidence_recall(["swollen liver"], deep, 200, vocab, names=("token_er", "auc"), compat="release")
    assert at_200 == {"token_er@200": 1.0, "auc@200": pytest.approx((0.5 + 199 * 1.0) / 200)}
