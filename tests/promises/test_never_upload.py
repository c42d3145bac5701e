"""``never_upload`` spellings up to case and accents, on a tiny word-piece vocabulary (no model)."""

from __future__ import annotations

import string
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from edge_sdk.privacy.masking import fold, folded_vocabulary, never_upload_ids
from edge_sdk.testing import TableSLM

PIECES = [" ", ".", "Seen", " with", " and", " Maria", "Maria", " María", "María", " MARIA", " maria", " Mar", "ía",
          "ia", " Keller", " Kéller", " KELLER", " Zoë", " Zoe", "Zoe",
          *string.ascii_letters, "í", "ì", "é", "ë", "Í", "Ì", "É", "Ë"]


def masked_pieces(pieces: list[str], spans: list[str], context: str) -> set[str]:
    """The pieces ``never_upload_ids`` masks over a vocabulary of ``pieces`` (greedy longest match, as
    :class:`~edge_sdk.testing.TableSLM` tokenizes)."""
    table = TableSLM(pieces)
    vocabulary = folded_vocabulary(pieces.__getitem__, len(pieces))
    ids = never_upload_ids(spans, context, lambda text: table.tokenize(text, add_bos=False), pieces.__getitem__,
                           vocabulary)
    return {pieces[i] for i in ids}


def masked(spans: list[str], context: str) -> set[str]:
    return masked_pieces(PIECES, spans, context)


def test_fold_ignores_case_accents_and_compatibility_forms() -> None:
    assert fold(" María") == fold("MARIA") == fold(unicodedata.normalize("NFD", "maría")) == "maria"
    assert fold("Ｍaria") == "maria"  # a fullwidth letter (NFKD)


def test_an_accented_spelling_the_model_could_produce_is_masked_with_the_plain_one() -> None:
    """Masking "Maria" left " María" (one token) unmasked: the SLM could still put its mass there."""
    assert {" Maria", "Maria", " María", "María", " MARIA", " maria"} <= masked(["Maria"], "Seen with Maria.")
    # and the other way round: the accent-free spellings of an accented span
    assert {" Maria", " María", " Kéller", " Keller", " KELLER"} <= masked(["María Kéller"], "Seen with María Kéller.")
    assert {" Zoe", "Zoe", " Zoë"} <= masked(["Zoë"], "Seen with Zoë.")


def test_a_span_matches_the_context_up_to_accents_and_every_spelling_there_is_masked() -> None:
    """The context writes "Marìa", which no single token spells (" Mar" + "ì" + "a"): those pieces are masked
    too, while punctuation never is."""
    got = masked(["Maria"], "Seen with Marìa and Maria.")
    assert {" Mar", "ì", " María"} <= got and "." not in got
    with pytest.raises(ValueError, match="does not occur"):
        masked(["Keller"], "Seen with Maria.")


def test_the_span_s_composed_compatibility_and_accent_free_spellings_are_tokenised_and_masked() -> None:
    """A spelling the model may write in other code points: every token of it is masked, not only those that
    spell a word's start (which the vocabulary rule finds).  Here "ise" of " Elo" + "ise" (the accent-free
    "Éloïse"), "ler" of " Kel" + "ler" (fullwidth "Ｋｅｌｌｅｒ" with its letters mapped), the composed "É" and "ï"
    of a span given decomposed, and "rí" (NFKC) and "ｒí" (NFC) of a fullwidth "Ｍａｒi\u0301ａ" come from those
    spellings alone."""
    fullwidth = ["Ｋ", "Ｅ", "Ｌ", "Ｒ", "ｋ", "ｅ", "ｌ", "ｒ"]  # every case of "Ｋｅｌｌｅｒ" is tokenised too
    pieces = [" ", ".", "Seen", " with", " Elo", "ise", " Kel", "ler", *string.ascii_letters, "É", "é", "Ï", "ï",
              "\u0301", "\u0308", *fullwidth]
    assert {" Elo", "ise"} <= masked_pieces(pieces, ["Éloïse"], "Seen with Éloïse.")
    assert {" Kel", "ler"} <= masked_pieces(pieces, ["Ｋｅｌｌｅｒ"], "Seen with Ｋｅｌｌｅｒ.")
    decomposed = unicodedata.normalize("NFD", "Éloïse")
    assert {"É", "ï"} <= masked_pieces(pieces, [decomposed], f"Seen with {decomposed}.")
    # fullwidth with a decomposed accent: NFC composes it in place ("ｒí"), NFKC also maps the letters ("rí")
    span = "Ｍａｒi\u0301ａ"
    pieces += ["Ｍ", "ｍ", "Ａ", "ａ", "í", "Í", "rí", "ｒí"]
    assert {"rí", "ｒí"} <= masked_pieces(pieces, [span], f"Seen with {span}.")


CJK_PIECES = [" ", "。", "患者", "山田太郎", "山田", "太郎", "山", "田", " 田", "太", "郎", " 郎", "田中", " Yamada",
              "Yamada", " YAMADA", " Yam", " Taro", " Tarō", "taro", " Tanaka", " Suzuki", "は", "さん", "(", ")",
              *string.ascii_letters]


def test_a_name_in_a_script_without_spaces_is_masked_character_by_character() -> None:
    """``山田太郎`` as one token, or ``山田`` + ``太郎``, was masked; `` 田`` alone (2.1% of the SLM's mass in the
    attack review) was not: each character of an unspaced script is a word of its own now, with and without a
    leading space.  A token holding other characters too (``田中``, another name) stays."""
    got = masked_pieces(CJK_PIECES, ["山田太郎"], "患者は山田太郎さん。")
    assert {"山田太郎", "山田", "太郎", "山", "田", " 田", "太", "郎", " 郎"} <= got
    assert not got & {"田中", "患者", "は", "さん", "。"}


@pytest.mark.parametrize(("span", "reading"), [("佐々木", "sasaki"), ("野々村", "nonomura"), ("ユーコ", "yuko"),
                                               ("ﾀﾛｳ", "taro")])
def test_names_with_japanese_marks_or_half_width_kana_are_read_whole(span: str, reading: str) -> None:
    """The iteration mark 々 and the long-vowel mark ー are inside a word (they split the run before, so 佐々木 gave
    no ``sasaki``), and half-width katakana are read as full-width (ﾀﾛｳ gave nothing)."""
    from edge_sdk.privacy.masking import romanised_words

    assert reading in romanised_words(span)


def test_a_long_span_s_readings_grow_linearly_not_as_every_run() -> None:
    """Every run of a span's readings joined grew as n^2 words (an 800-character span: 36 s and 1.6 GB): runs of
    at most four readings (a name's parts) are joined, so 300 random characters give a few thousand words."""
    import random

    from edge_sdk.privacy.masking import romanised_words

    rng = random.Random(0)
    span = "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(300))
    words = romanised_words(span)
    assert len(words) < 40 * len(span)  # all runs joined: over 45,000 pinyin words alone (300 x 301 / 2)
    assert max(map(len, words)) <= 4 * 6 * 2  # four readings of at most six letters, in pinyin or kakasi units


def test_a_chinese_or_japanese_name_is_masked_in_the_romanised_forms_the_vocabulary_holds() -> None:
    """`` Yamada`` kept 1.8% of the SLM's mass with ``山田太郎`` masked (the attack review): its readings
    (Hepburn ``yamada``, ``tarou``, and ``taro``, as written without the long vowel) are masked now, whole and
    from their first three letters, in every case and accent (`` Tarō``); other names' tokens and single
    letters are not."""
    got = masked_pieces(CJK_PIECES, ["山田太郎"], "患者は山田太郎さん。")
    assert {" Yamada", "Yamada", " YAMADA", " Yam", " Taro", " Tarō", "taro"} <= got
    assert not got & {" Tanaka", " Suzuki", *string.ascii_letters}
    pieces = [" ", "。", "王", "小", "明", "王小明", " Wang", "Wang", " Xiao", " Xiaoming", "ming", " Ming", " Hsiao",
              " Zhang", " Li", *string.ascii_letters]
    got = masked_pieces(pieces, ["王小明"], "病人王小明。")
    # pinyin wang, xiao, ming and the given name joined; Wade-Giles hsiao
    assert {" Wang", "Wang", " Xiao", " Xiaoming", "ming", " Ming", " Hsiao"} <= got
    assert not got & {" Zhang", " Li"}
    assert masked_pieces(CJK_PIECES, ["Yamada"], "患者は山田太郎 (Yamada) さん。") >= {" Yamada", "Yamada"}


def test_text_without_chinese_or_japanese_characters_imports_no_romaniser() -> None:
    code = ("import sys\nfrom edge_sdk.privacy.masking import never_upload_ids\n"
            "never_upload_ids(['Maria'], 'Seen with Maria.', lambda t: [ord(c) for c in t], chr)\n"
            "print(sorted(m for m in ('pykakasi', 'pypinyin') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "[]"
