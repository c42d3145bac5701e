"""DecodeLeak evidence-recall metrics as the paper defines them, on real pieces of both tokenizer families.

Every expected number is worked out by hand in the comments; the byte-level
vocabulary is the BPE tokenizer trained in tests/edge_sdk/test_pieces.py's way, whose
pieces ``test_trained_tokenizer_pieces`` pins.
"""

from __future__ import annotations

import functools
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.backends.pieces import PieceDecoder
from edge_sdk.privacy.meter import ExposureTrace, words
from edge_sdk.registry import UnknownNameError
from eval_harness.datasets import item_from_row
from eval_harness.metrics import paper
from eval_harness.metrics import (
    METRICS,
    RecallCase,
    Vocabulary,
    auc_at_k,
    evidence,
    evidence_counts,
    evidence_ids,
    evidence_recall,
    exposed_ids,
    register_metric,
    rouge1_er_at_k,
    span_er_at_k,
    token_er_at_k,
)

from tests.support.tiny_models import trained_bpe

@functools.cache
def bpe():
    """(tokenizer, Vocabulary) of a byte-level BPE trained on the clinical corpus, read through its raw "Ġ" pieces."""
    tokenizer = trained_bpe()
    return tokenizer, Vocabulary.from_hf(tokenizer)


def ids(*pieces: str) -> tuple[int, ...]:
    tokenizer, _ = bpe()
    found = tuple(tokenizer.token_to_id(p) for p in pieces)
    assert None not in found, pieces
    return found


SPANS = ("the bilirubin", "not jaundice", "swollen liver", "the patient")
QUERY = "Is the patient well?"  # holds "the patient": that span is not private evidence


def trace() -> ExposureTrace:
    """Four steps recorded at k = 3; the last one saw two ids."""
    return ExposureTrace(3, (
        ids("Ġthe", "Ġ", "Ġliver"),
        ids(".", "biliru", "Ġnot"),
        ids("bin", "Ċ", "Ġswollen"),
        ids("Ġis", "Ġjaundice"),
    ))


def test_pieces_the_numbers_rely_on() -> None:
    tokenizer, _ = bpe()
    assert tokenizer.encode(" bilirubin").tokens == ["Ġ", "biliru", "bin"]
    for word in ("the", "not", "jaundice", "swollen", "liver", "patient"):
        assert tokenizer.encode(" " + word).tokens == ["Ġ" + word]


def test_evidence_on_a_byte_level_vocabulary() -> None:
    _, vocab = bpe()
    found = evidence(SPANS, vocab, public_query=QUERY)
    # "the patient" occurs in the query: left out.  T(P_1) = {biliru, bin} ("the" is a stop word, "Ġ" a space),
    # T(P_2) = {Ġnot, Ġjaundice}, T(P_3) = {Ġswollen, Ġliver}
    assert found.span_tokens == (frozenset(ids("biliru", "bin")), frozenset(ids("Ġnot", "Ġjaundice")),
                                 frozenset(ids("Ġswollen", "Ġliver")))
    assert found.tokens == frozenset(ids("biliru", "bin", "Ġnot", "Ġjaundice", "Ġswollen", "Ġliver"))
    assert found.words == {"bilirubin", "not", "jaundice", "swollen", "liver"}
    assert evidence_counts(SPANS, vocab, public_query=QUERY) == {
        "evidence_tokens": 6, "evidence_words": 5, "evidence_spans": 4, "public_spans": 1, "empty_spans": 0}
    # without the query, "the patient" is evidence: + Ġpatient
    assert evidence_ids(SPANS, vocab) == set(found.tokens) | set(ids("Ġpatient"))


def test_recall_metrics_hand_worked_on_a_byte_level_vocabulary() -> None:
    _, vocab = bpe()
    got = evidence_recall(SPANS, trace(), [1, 2, 3], vocab, public_query=QUERY)
    # best ranks of the six evidence ids: bin 1; biliru 2, Ġjaundice 2; Ġliver 3, Ġnot 3, Ġswollen 3
    assert got["token_er@1"] == pytest.approx(1 / 6)
    assert got["token_er@2"] == pytest.approx(3 / 6)
    assert got["token_er@3"] == pytest.approx(6 / 6)
    assert got["auc@3"] == pytest.approx((1 / 6 + 3 / 6 + 6 / 6) / 3)
    # spans {biliru, bin}, {Ġnot, Ġjaundice}, {Ġswollen, Ġliver}
    assert got["span_er@1"] == pytest.approx((1 / 2 + 0 + 0) / 3)
    assert got["span_er@2"] == pytest.approx((2 / 2 + 1 / 2 + 0) / 3)
    assert got["span_er@3"] == pytest.approx(1.0)
    # words read across steps: "bilirubin" = biliru (step 1, rank 2) + bin (step 2, rank 1), so k = 2;
    # "jaundice" k = 2; "liver", "not", "swollen" k = 3.  At k = 1 the text is " the.bin is": none.
    assert got["rouge1_er@1"] == 0.0
    assert got["rouge1_er@2"] == pytest.approx(2 / 5)
    assert got["rouge1_er@3"] == pytest.approx(5 / 5)
    # the one-metric functions agree with the table
    assert token_er_at_k(SPANS, trace(), 2, vocab, public_query=QUERY) == got["token_er@2"]
    assert span_er_at_k(SPANS, trace(), 2, vocab, public_query=QUERY) == got["span_er@2"]
    assert rouge1_er_at_k(SPANS, trace(), 2, vocab, public_query=QUERY) == got["rouge1_er@2"]
    assert auc_at_k(SPANS, trace(), 3, vocab, public_query=QUERY) == got["auc@3"]


def test_a_word_split_over_steps_counts_for_rouge() -> None:
    """Fails on the old code, which read each exposed id alone: all of "bilirubin" exposed, ROUGE1-ER 0.5."""
    _, vocab = bpe()
    spans = ["bilirubin", "liver"]
    exposed = ExposureTrace(2, (ids("Ġ", "Ġliver"), ids("biliru", "."), ids("Ġthe", "bin")))
    got = evidence_recall(spans, exposed, 2, vocab, names=("token_er", "rouge1_er"))
    # T = {biliru, bin, Ġliver}, all within rank 2; W = {bilirubin, liver}, both readable at k = 2
    # ("Ġ" rank 1, "biliru" rank 1, "bin" rank 2 spell " bilirubin" over steps 0..2)
    assert got == {"token_er@2": 1.0, "rouge1_er@2": 1.0}
    # a character split over two byte-level tokens: "naïve" = Ġn a Ã ¯ v e, one piece per step
    naive = ExposureTrace(1, tuple((i,) for i in ids("Ġn", "a", "Ã", "¯", "v", "e")))
    assert rouge1_er_at_k(["naïve"], naive, 1, vocab) == 1.0
    assert rouge1_er_at_k(["naïve"], ExposureTrace(1, naive.steps[:5]), 1, vocab) == 0.0  # "naïv" is not it


def test_hyphenated_words_are_tokenised_as_written() -> None:
    """Fails on the old code, which split "70-year-old" into " 70", " year", " old"."""
    _, vocab = bpe()
    # " 70-year-old" = Ġ70 - year - old: content ids {Ġ70, year, old}
    assert evidence_ids(["70-year-old"], vocab) == set(ids("Ġ70", "year", "old"))
    exposed = ExposureTrace(1, tuple((i,) for i in ids("Ġ70", "-", "year", "-", "old")))
    assert evidence_recall(["70-year-old"], exposed, 1, vocab, names=("token_er", "rouge1_er")) == {
        "token_er@1": 1.0, "rouge1_er@1": 1.0}


def test_negations_are_evidence() -> None:
    """Fails on the old code: "not" was a stop word and "no" a short fragment, so both spans were empty."""
    _, vocab = bpe()
    assert evidence_counts(["not", "no fever"], vocab) == {
        "evidence_tokens": 3, "evidence_words": 3, "evidence_spans": 2, "public_spans": 0, "empty_spans": 0}
    exposed = ExposureTrace(1, (ids("Ġnot"), ids("Ġthe")))
    assert token_er_at_k(["not", "no fever"], exposed, 1, vocab) == pytest.approx(1 / 3)  # Ġnot of Ġnot Ġno Ġfever


def test_k_beyond_the_recorded_cutoff_is_an_error() -> None:
    """Fails on the old code, which silently read the ids it had."""
    _, vocab = bpe()
    for name in METRICS.names():
        with pytest.raises(ValueError, match="K=4 is larger"):
            evidence_recall(SPANS, trace(), 4, vocab, names=(name,))
    with pytest.raises(ValueError, match="K=4 is larger"):
        evidence_recall([], trace(), 4, vocab, names=("span_er",))  # even with nothing to count
    with pytest.raises(TypeError, match="ExposureTrace"):
        token_er_at_k(SPANS, [[1, 2], [3]], 2, vocab)  # type: ignore[arg-type]
    assert exposed_ids(trace(), 1) == set(ids("Ġthe", ".", "bin", "Ġis"))


def test_unknown_names_and_modes() -> None:
    _, vocab = bpe()
    with pytest.raises(UnknownNameError, match="did you mean 'token_er'"):
        evidence_recall(SPANS, trace(), 1, vocab, names=("token-er",))
    with pytest.raises(ValueError, match="compat"):
        evidence_recall(SPANS, trace(), 1, vocab, compat="paperr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        register_metric("token_er", lambda case, k: 0.0)


def test_a_registered_metric_reads_the_case(monkeypatch: pytest.MonkeyPatch) -> None:
    _, vocab = bpe()
    monkeypatch.setattr(METRICS, "_entries", dict(METRICS._entries))  # registrations end with the test

    @METRICS.register("exposed_evidence_ids")
    def exposed_evidence_ids(case: RecallCase, k: int) -> float:
        return float(sum(1 for i in case.evidence.tokens if case.token_ranks(k).get(i, k + 1) <= k))

    assert evidence_recall(SPANS, trace(), 2, vocab, names=("exposed_evidence_ids",), public_query=QUERY) == {
        "exposed_evidence_ids@2": 3.0}  # bin, biliru, Ġjaundice
    assert "exposed_evidence_ids@2" in evidence_recall(SPANS, trace(), 2, vocab)


@pytest.mark.model
def test_hand_worked_on_gemma_pieces(slm) -> None:
    vocab = Vocabulary.from_slm(slm)
    tokenize = functools.partial(slm.tokenize, add_bos=False)
    pieces = [slm.token_strings()[i].decode() for i in tokenize(" 70-year-old no fever")]
    assert pieces == ["▁", "7", "0", "-", "year", "-", "old", "▁no", "▁fever"]
    space, seven, zero, dash, year, _, old, no, fever = tokenize(" 70-year-old no fever")
    (the,) = tokenize(" the")
    spans = ["70-year-old", "no fever"]
    # T = {7, 0, year, old} (numbers, and fragments of more than two letters) | {▁no, ▁fever}
    assert evidence_ids(spans, vocab) == {seven, zero, year, old, no, fever}
    exposed = ExposureTrace(2, ((space, seven), (zero, the), (dash,), (year, fever), (dash,), (old,)))
    got = evidence_recall(spans, exposed, [1, 2], vocab, names=("token_er", "span_er", "rouge1_er", "auc"))
    # rank 1: 0, year, old -> 3/6; rank 2 adds 7 and ▁fever -> 5/6 (▁no never)
    assert got["token_er@1"] == pytest.approx(3 / 6) and got["token_er@2"] == pytest.approx(5 / 6)
    assert got["auc@2"] == pytest.approx((3 / 6 + 5 / 6) / 2)
    # spans: {7, 0, year, old} 3/4 then 4/4; {▁no, ▁fever} 0 then 1/2
    assert got["span_er@1"] == pytest.approx((3 / 4 + 0) / 2) and got["span_er@2"] == pytest.approx((1 + 1 / 2) / 2)
    # W = {70-year-old, no, fever}: "70-year-old" is spelled by ▁ (rank 1) 7 (rank 2) 0 - year - old (rank 1)
    # up to the trace's end; "▁fever" (rank 2) is followed by "-" "old" only, so "fever" is never written whole.
    # At k = 1 the text is " 0-year-old": no word of W
    assert got["rouge1_er@1"] == 0.0 and got["rouge1_er@2"] == pytest.approx(1 / 3)
    # the two texts written one Gemma piece a step: no word is read that the text does not hold
    for text, absent, present in ((" A 70-year-old man", ["year", "old"], ["70-year-old", "man"]),
                                  (" 130/85 mmHg", ["13", "30", "85"], ["130/85", "mmhg"])):
        written = ExposureTrace(1, tuple((i,) for i in tokenize(text)))
        assert paper.word_cutoffs(frozenset(absent + present), written, vocab) == dict.fromkeys(present, 1), text


# -- words need real word boundaries ---------------------------------------------------------------------


def _plain(pieces: list[str]) -> tuple[Vocabulary, dict[str, int]]:
    """A vocabulary whose pieces are the given texts (id = position), and piece → id; it tokenises no text
    (ROUGE1-ER reads the evidence's words, not its ids)."""
    index = {piece: i for i, piece in enumerate(pieces)}
    return Vocabulary(lambda text: [], PieceDecoder(pieces, "plain")), index


def _text_trace(vocab_index: dict[str, int], *pieces: str) -> ExposureTrace:
    """The trace of a text written one piece a step (k = 1)."""
    return ExposureTrace(1, tuple((vocab_index[p],) for p in pieces))


def test_a_step_boundary_is_not_a_word_boundary() -> None:
    """Fails on the old reader, which took every step boundary as a word boundary at a run's two ends."""
    vocab, at = _plain([" A", " ", "7", "0", "-", "year", "old", " man", "1", "3", "5", "/", "8", " mmHg", ".", "(", ")"])
    # " A 70-year-old man" at k = 1: its words are A, 70-year-old, man; "year" and "old" were never written
    man = _text_trace(at, " A", " ", "7", "0", "-", "year", "-", "old", " man")
    cutoffs = paper.word_cutoffs(frozenset({"year", "old", "70-year-old", "man", "70"}), man, vocab)
    assert cutoffs == {"70-year-old": 1, "man": 1}
    assert rouge1_er_at_k(["year old"], man, 1, vocab) == 0.0
    assert rouge1_er_at_k(["70-year-old man"], man, 1, vocab) == 1.0
    # " 135/85 mmHg." at k = 1: "13", "35" and "85" are not words of it, "135/85" and "mmhg" are
    pressure = _text_trace(at, " ", "1", "3", "5", "/", "8", "5", " mmHg", ".")
    cutoffs = paper.word_cutoffs(frozenset({"13", "35", "85", "135", "135/85", "mmhg"}), pressure, vocab)
    assert cutoffs == {"135/85": 1, "mmhg": 1}
    # edge punctuation across steps still bounds a word: " (" "year" ")" " man" reads "year"
    bracket = _text_trace(at, " ", "(", "year", ")", " man")
    assert paper.word_cutoffs(frozenset({"year"}), bracket, vocab) == {"year": 1}
    # the trace's start and end are boundaries: "year" alone, and "old" ending the text
    assert paper.word_cutoffs(frozenset({"year", "old"}), _text_trace(at, "year", "-", "old"), vocab) == {}
    assert paper.word_cutoffs(frozenset({"year", "old"}), _text_trace(at, "year"), vocab) == {"year": 1}


def test_a_word_is_bounded_by_the_ranks_that_close_it() -> None:
    """The boundary after a word is part of its run: its rank counts."""
    vocab, at = _plain([" year", "-", "old", " man", "."])
    # step 0: " year"; step 1: "-" (rank 1) or " man" (rank 3); step 2: "old"
    exposed = ExposureTrace(3, ((at[" year"],), (at["-"], at["."], at[" man"]), (at["old"],)))
    # k = 1: " year-old" (no word "year"); k = 2: " year.old" (still none); k = 3: " year man..." reads it
    assert paper.word_cutoffs(frozenset({"year", "old"}), exposed, vocab) == {"year": 3}
    assert [rouge1_er_at_k(["year"], exposed, k, vocab) for k in (1, 2, 3)] == [0.0, 0.0, 1.0]


PLAIN_PIECES = [" ", "x", "q", "xq", "-", "(", ")", " x", "q ", "x-q", ".", " xq.", "x q", "\n"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PLAIN_PIECES), max_size=10))
def test_at_k1_the_words_read_are_the_words_of_the_decoded_text(pieces: list[str]) -> None:
    """At k = 1 the one run is the decoded text: the words read are exactly its words (edge_sdk.privacy.meter.words)."""
    vocab, at = _plain(PLAIN_PIECES)
    text = "".join(pieces)
    candidates = frozenset({"x", "q", "xq", "qx", "x-q", "xqx", "qq", "xx"})
    got = paper.word_cutoffs(candidates, _text_trace(at, *pieces), vocab)
    assert set(got) == candidates & set(words(text)), text
    assert set(got.values()) <= {1}


def _written_by_brute_force(word: str, exposed: ExposureTrace, vocab: Vocabulary) -> int | None:
    """The least max-rank over every run of consecutive steps (every choice of one id a step) whose text holds
    ``word`` as a whitespace-separated chunk, edge punctuation stripped, that does not touch a run end the
    trace goes on past (a reference that enumerates the runs instead of following an automaton)."""
    best = None
    steps = exposed.steps
    for first in range(len(steps)):
        for last in range(first, len(steps)):
            for choice in itertools.product(*(list(enumerate(s, 1)) for s in steps[first:last + 1])):
                text = vocab.decode([i for _, i in choice], skip_special=True).lower()
                chunks = re.split(r"\s", text)
                for n, chunk in enumerate(chunks):
                    open_left = n == 0 and first > 0
                    open_right = n == len(chunks) - 1 and last < len(steps) - 1
                    if not open_left and not open_right and words(chunk) == [word]:
                        cost = max(rank for rank, _ in choice)
                        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(PLAIN_PIECES), min_size=1, max_size=3, unique=True), max_size=5))
def test_word_cutoffs_agree_with_enumerating_every_run(chosen: list[list[str]]) -> None:
    vocab, at = _plain(PLAIN_PIECES)
    exposed = ExposureTrace(3, tuple(tuple(at[p] for p in step) for step in chosen))
    candidates = ["x", "q", "xq", "qx", "x-q", "xqx", "qq", "xx"]
    expected = {w: c for w in candidates if (c := _written_by_brute_force(w, exposed, vocab)) is not None}
    assert paper.word_cutoffs(frozenset(candidates), exposed, vocab) == expected


# -- properties ----------------------------------------------------------------------------------------

PHRASES = ["the bilirubin", "not jaundice", "swollen liver", "the patient", "70-year-old", "no fever", "naïve"]


@st.composite
def traces(draw: st.DrawFn) -> ExposureTrace:
    k = draw(st.integers(1, 6))
    size = bpe()[0].get_vocab_size()
    steps = draw(st.lists(st.lists(st.integers(0, size - 1), max_size=k, unique=True), max_size=8))
    return ExposureTrace(k, tuple(tuple(s) for s in steps))


@settings(max_examples=60, deadline=None)
@given(traces(), st.lists(st.sampled_from(PHRASES), max_size=4), st.sampled_from(["paper", "release"]))
def test_recall_properties(exposed: ExposureTrace, spans: list[str], compat: str) -> None:
    _, vocab = bpe()
    got = evidence_recall(spans, exposed, range(1, exposed.k + 1), vocab, public_query=QUERY, compat=compat)
    assert all(0.0 <= value <= 1.0 for value in got.values())
    for name in ("token_er", "span_er", "rouge1_er"):
        curve = [got[f"{name}@{k}"] for k in range(1, exposed.k + 1)]
        assert curve == sorted(curve), name  # E^k only grows with k
    for k in range(1, exposed.k + 1):
        assert got[f"auc@{k}"] <= got[f"token_er@{k}"] + 1e-12  # a mean of a non-decreasing curve up to k


@settings(max_examples=40, deadline=None)
@given(traces(), st.sampled_from(PHRASES), st.data())
def test_paper_metrics_do_not_depend_on_ids_past_k(exposed: ExposureTrace, span: str, data: st.DataObject) -> None:
    _, vocab = bpe()
    k = data.draw(st.integers(1, exposed.k))
    assert evidence_recall([span], exposed, k, vocab) == evidence_recall([span], exposed.truncated(k), k, vocab)


@settings(max_examples=40, deadline=None)
@given(traces(), st.integers(0, 7), st.lists(st.integers(1, 6), min_size=4, max_size=4))
def test_pieces_on_consecutive_steps_spell_the_word(exposed: ExposureTrace, at: int, ranks: list[int]) -> None:
    """Ġ, biliru, bin, Ġ at ranks a, b, c, d on four consecutive steps: "bilirubin" is read by k = max(a, b, c, d)."""
    _, vocab = bpe()
    k = max(exposed.k, *ranks)
    steps = [list(s) for s in exposed.steps] + [[] for _ in range(at + 4 - len(exposed.steps))]
    planted_ranks = []
    for offset, (piece, rank) in enumerate(zip(("Ġ", "biliru", "bin", "Ġ"), ranks)):
        (token,) = ids(piece)
        rest = [i for i in steps[at + offset] if i != token]
        steps[at + offset] = (rest[:rank - 1] + [token] + rest[rank - 1:])[:k]
        planted_ranks.append(steps[at + offset].index(token) + 1)  # the step may have held fewer than rank - 1 ids
    planted = ExposureTrace(k, tuple(tuple(s) for s in steps))
    assert rouge1_er_at_k(["bilirubin"], planted, max(planted_ranks), vocab) == 1.0


# -- the benchmark rows ----------------------------------------------------------------------------------


def test_items_and_answer_parsing() -> None:
    row = {"_id": "x1", "public_query": "Which?", "options": {"A": "a", "B": "b", "C": "c", "D": "d"},
           "private_context": "secret", "filtered_context": "one, two ,", "answer_idx": "B"}
    item = item_from_row(row)
    assert item.evidence_spans == ("one", "two")
    assert item.public_prompt.endswith("Answer: (") and "(D) d" in item.public_prompt
    with pytest.raises(ValueError, match="lacks"):
        item_from_row({"_id": "x2"})
