"""Vocabulary pieces read back into text for both tokenizer families, content tokens, the meter, the trace.

A byte-level BPE tokenizer is trained here with the ``tokenizers`` library and
served the way llama.cpp serves a Qwen2.5 / Llama-3 GGUF (``token_strings()``
gives the raw "Ġthe" pieces); the SentencePiece side uses the embedded Gemma-3.
"""

from __future__ import annotations

import functools
import sys

import pytest

from edge_sdk.backends.pieces import PieceDecoder, byte_level_alphabet, detect_piece_family, piece_reader
from edge_sdk.privacy.meter import (
    ExposureTrace,
    LeakageMeter,
    content_token_ids,
    piece_is_content,
    word_token_ids,
    words,
)

from tests.support.tiny_models import trained_bpe

bpe_tokenizer = trained_bpe  # a byte-level BPE trained on the clinical corpus


class BpeGguf:
    """The tokenizer side of a byte-level GGUF as LlamaCppSLM exposes it: raw pieces as UTF-8 bytes."""

    def __init__(self) -> None:
        self.tok = bpe_tokenizer()
        self.vocab_size = self.tok.get_vocab_size()
        self.eos_token_ids = frozenset({self.tok.token_to_id("<|endoftext|>")})
        self.bos_token_id = -1

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return self.tok.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def token_strings(self) -> list[bytes]:
        return [self.tok.id_to_token(i).encode("utf-8") for i in range(self.vocab_size)]


def bpe_id(piece: str) -> int:
    token_id = bpe_tokenizer().token_to_id(piece)
    assert token_id is not None, piece
    return token_id


def bpe_pieces(text: str) -> list[str]:
    return bpe_tokenizer().encode(text).tokens


def test_trained_tokenizer_pieces() -> None:
    """The pieces every hand-worked number below relies on."""
    assert bpe_pieces(" the") == ["Ġthe"] and bpe_pieces(" not") == ["Ġnot"] and bpe_pieces(" no") == ["Ġno"]
    assert bpe_pieces(" bilirubin") == ["Ġ", "biliru", "bin"]
    assert bpe_pieces(" 70-year-old") == ["Ġ70", "-", "year", "-", "old"]
    assert bpe_pieces(" patient's") == ["Ġpatient", "'s"]
    assert bpe_pieces(" naïve") == ["Ġn", "a", "Ã", "¯", "v", "e"]  # ï = C3 AF, one byte per piece
    assert bpe_pieces("\n") == ["Ċ"]


# -- the piece decoder ------------------------------------------------------------------------------


def test_byte_level_alphabet_is_gpt2s() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))  # one character per byte
    # printable Latin-1 stands for itself; the 68 others take U+0100.. in byte order:
    # 0x00..0x20 are the first 33 (U+0100..U+0120), 0x7F..0xA0 the next 34 (U+0121..U+0142), 0xAD the last
    assert alphabet["a"] == 0x61 and alphabet["~"] == 0x7E and alphabet["ÿ"] == 0xFF
    assert alphabet["\u0100"] == 0x00 and alphabet["Ċ"] == 0x0A and alphabet["Ġ"] == 0x20
    assert alphabet["\u0121"] == 0x7F and alphabet["\u0142"] == 0xA0 and alphabet["\u0143"] == 0xAD


def test_byte_level_pieces_read_as_text() -> None:
    pieces = ["Ġthe", "Ċ", "Ã", "¯", "ĠcafÃ©", "<|endoftext|>"]
    decoder = PieceDecoder(pieces, family="byte_level", special_ids=[5])
    assert decoder(0) == " the" and decoder(1) == "\n"
    assert decoder(2) == "\ufffd"  # half of a two-byte character
    assert decoder.decode([2, 3]) == "ï"  # the bytes are joined before decoding
    assert decoder(4) == " café"
    assert decoder(5) == "<|endoftext|>" and decoder.decode([0, 5], skip_special=True) == " the"


def test_sentencepiece_pieces_read_as_text() -> None:
    decoder = PieceDecoder(["▁the", "<0x0A>", "<0xC3>", "<0xAF>", "▁▁", "café"], family="sentencepiece")
    assert decoder(0) == " the" and decoder(1) == "\n" and decoder(4) == "  " and decoder(5) == "café"
    assert decoder(2) == "\ufffd" and decoder.decode([2, 3]) == "ï"


def test_family_is_detected_from_the_pieces() -> None:
    gguf = BpeGguf()
    assert detect_piece_family(s.decode() for s in gguf.token_strings()) == "byte_level"
    assert detect_piece_family(["▁the", "<0x0A>", "s"]) == "sentencepiece"
    assert detect_piece_family(["the", "s"]) == "plain"
    assert PieceDecoder(["Ġthe", "Ċ"]).family == "byte_level"
    assert PieceDecoder(["Ġthe"], family="sentencepiece")(0) == "Ġthe"  # told explicitly, not detected
    with pytest.raises(ValueError, match="family"):
        PieceDecoder(["a"], family="wordpiece")  # type: ignore[arg-type]


def test_piece_reader_on_a_byte_level_gguf_backend() -> None:
    """Fails on the old reader, which handed the raw "Ġthe" to the content filter."""
    gguf = BpeGguf()
    piece = piece_reader(gguf)
    assert piece(bpe_id("Ġthe")) == " the" and piece(bpe_id("Ċ")) == "\n"
    assert not piece_is_content(piece(bpe_id("Ġthe")))
    assert not piece_is_content(piece(bpe_id("Ċ")))


def test_piece_reader_on_transformers_and_tokenizers_objects() -> None:
    from transformers import PreTrainedTokenizerFast

    end = bpe_id("<|endoftext|>")
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(), eos_token="<|endoftext|>")
    for reader in (piece_reader(hf), piece_reader(bpe_tokenizer())):
        assert reader.family == "byte_level" and end in reader.special_ids
        assert reader(bpe_id("Ġliver")) == " liver"
        ids = bpe_tokenizer().encode(" naïve liver").ids
        assert reader.decode(ids) == " naïve liver"


@pytest.mark.model
def test_gemma_pieces_are_sentencepiece(slm) -> None:
    piece = piece_reader(slm)
    assert piece.family == "sentencepiece"
    strings = slm.token_strings()
    the = slm.tokenize(" the", add_bos=False)
    assert len(the) == 1 and strings[the[0]] == "▁the".encode() and piece(the[0]) == " the"
    newline_byte = strings.index(b"<0x0A>")
    assert piece(newline_byte) == "\n"
    assert piece(slm.tokenize("\n", add_bos=False)[0]) == "\n"
    ids = slm.tokenize(" 70-year-old naïve patient", add_bos=False)
    assert piece.decode(ids) == slm.detokenize(ids) == " 70-year-old naïve patient"


# -- content words and tokens ------------------------------------------------------------------------


def test_words_keep_inner_punctuation() -> None:
    assert words("A 70-year-old (male), no fever; 120/80 mg/dL, don't.") == [
        "A", "70-year-old", "male", "no", "fever", "120/80", "mg/dL", "don't"]


def test_content_tokens_on_a_byte_level_vocabulary() -> None:
    gguf = BpeGguf()
    piece = piece_reader(gguf)
    text = "the liver is not swollen and there is no fever"
    # content words: liver, not, swollen, no, fever (the, is, and, there: stop words; not and no: negations)
    expected = {bpe_id(p) for p in ("Ġliver", "Ġnot", "Ġswollen", "Ġno", "Ġfever")}
    assert content_token_ids(text, lambda t: gguf.tokenize(t, add_bos=False), piece) == expected


def test_fragments_numbers_and_hyphenated_words() -> None:
    gguf = BpeGguf()
    piece = piece_reader(gguf)
    tokenize = functools.partial(gguf.tokenize, add_bos=False)
    # " bilirubin" = "Ġ" (a space: no content) + "biliru" + "bin"
    assert content_token_ids("bilirubin", tokenize, piece) == {bpe_id("biliru"), bpe_id("bin")}
    # " 70-year-old" is tokenised whole, as written: " 70" (a number), "year", "old"; "-" is punctuation
    assert content_token_ids("70-year-old", tokenize, piece) == {bpe_id("Ġ70"), bpe_id("year"), bpe_id("old")}
    # "'s" is a one-letter fragment of "patient's"
    assert content_token_ids("patient's", tokenize, piece) == {bpe_id("Ġpatient")}


@pytest.mark.model
def test_negations_are_evidence_with_gemma(slm) -> None:
    """Fails on the old list, which dropped "not" (a whole MedPriv span 30 times) and every 2-letter word."""
    piece = piece_reader(slm)
    tokenize = functools.partial(slm.tokenize, add_bos=False)
    (no,), (not_,), (fever,) = (slm.tokenize(w, add_bos=False) for w in (" no", " not", " fever"))
    assert content_token_ids("not", tokenize, piece) == {not_}
    assert content_token_ids("no fever", tokenize, piece) == {no, fever}
    assert content_token_ids("the", tokenize, piece) == set()


@pytest.mark.model
def test_a_content_word_keeps_its_most_specific_pieces_with_gemma(slm) -> None:
    """Fails on the old filter, which left "ERCP" and "thenar" with no evidence token at all."""
    piece = piece_reader(slm)
    tokenize = functools.partial(slm.tokenize, add_bos=False)
    er, cp = tokenize(" ERCP")
    then, ar = tokenize(" thenar")
    patient, apostrophe, s = tokenize(" patient's")
    assert [piece(i) for i in (er, cp, then, ar, patient, apostrophe, s)] == [" ER", "CP", " then", "ar", " patient",
                                                                               "'", "s"]
    # no piece of more than two letters: the pieces that are not stop words count
    assert word_token_ids("ERCP", tokenize, piece) == {er, cp}
    assert word_token_ids("thenar", tokenize, piece) == {ar}  # " then" is a stop word
    # a longer piece is there: the one-letter fragment and the apostrophe do not count
    assert word_token_ids("patient's", tokenize, piece) == {patient}


# -- the meter and the trace ---------------------------------------------------------------------------


def test_meter_ignores_stop_words_on_a_byte_level_vocabulary() -> None:
    gguf = BpeGguf()
    piece = piece_reader(gguf)
    private = content_token_ids("the patient has jaundice and the liver is not swollen",
                                functools.partial(gguf.tokenize, add_bos=False), piece)
    # patient, jaundice, liver, not, swollen: 5 ids ("has" is a stop word too)
    assert private == {bpe_id(p) for p in ("Ġpatient", "Ġjaundice", "Ġliver", "Ġnot", "Ġswollen")}
    meter = LeakageMeter(frozenset(private))
    meter.observe([bpe_id("Ġthe"), bpe_id("Ġis"), bpe_id("Ċ"), bpe_id("Ġand")])
    assert meter.share == 0.0  # the old filter counted "Ġthe", "Ġis" and "Ġand" as private content
    meter.observe([bpe_id("Ġjaundice"), bpe_id("Ġnot")])
    assert meter.share == pytest.approx(2 / 5)


def test_exposure_trace_from_ledger_style_entries() -> None:
    ledger_exposures = [(5, 3, 9), (7,), (3, 2, 8)]  # LedgerEntry.exposure per step; step 1 uploaded one value
    trace = ExposureTrace(3, tuple(ledger_exposures))
    assert trace.exposed(1) == {5, 7, 3} and trace.exposed(2) == {5, 3, 7, 2}
    assert trace.top(2) == ((5, 3), (7,), (3, 2))
    assert trace.truncated(1) == ExposureTrace(1, ((5,), (7,), (3,)))
    with pytest.raises(ValueError, match="K=4 is larger"):
        trace.exposed(4)
    with pytest.raises(ValueError):
        trace.check(0)
    assert ExposureTrace(2, [[1, 2], [3]]).steps == ((1, 2), (3,))  # lists are frozen into tuples


@pytest.mark.parametrize("k, steps", [(0, ()), (2, ((1, 2, 3),)), (3, ((1, 1),)), (3, ((-1,),)), (True, ())])
def test_exposure_trace_rejects_what_was_not_recorded(k: int, steps: tuple) -> None:
    with pytest.raises(ValueError):
        ExposureTrace(k, steps)


def test_exposure_trace_from_a_cloud_transcript() -> None:
    transcript = {"exposure_k": 2, "steps": [{"step": 0, "exposure": [4, 1]}, {"step": 1, "exposure": [6]}]}
    assert ExposureTrace.from_transcript(transcript) == ExposureTrace(2, ((4, 1), (6,)))


def test_stop_words_load_lazily() -> None:
    import subprocess

    code = "import sys, edge_sdk.privacy.meter; print('stop_words' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.model
def test_llama_cpp_names_its_special_tokens(slm) -> None:
    """Control and unused tokens are special, as transformers' tokenizer marks them; words are not."""
    special = slm.special_token_ids
    index = {piece: i for i, piece in enumerate(slm.token_strings())}
    for text in (b"<bos>", b"<eos>", b"<pad>", b"<unused0>", b"<start_of_turn>"):
        assert index[text] in special, text
    assert slm.bos_token_id in special and slm.eos_token_ids <= special
    assert not special & set(slm.tokenize(" jaundice and the liver", add_bos=False))
