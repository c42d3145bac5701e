"""Content tokens of private text, the vocabulary pieces they are read from, and what the cloud observed.

DecodeLeak counts leakage over *content* token ids: the ids of a text's
content words (stop words and punctuation excluded; negations and numbers
kept), each word tokenised with a leading space the way it appears inside a
sentence, so that it matches the ids a model generates mid-text.  The same
function serves the edge's :class:`LeakageMeter` and the harness's metrics.

Pieces
------
A vocabulary table stores each token's *piece*, not its text, and the two
tokenizer families write pieces differently:

* SentencePiece (Gemma, Llama-2, Mistral): a space is ``"▁"`` (U+2581) and a
  raw byte is ``"<0x0A>"``; every other character stands for itself.
* Byte-level BPE (GPT-2, Llama-3, Qwen2.5): every byte is mapped to one
  printable character (GPT-2's ``bytes_to_unicode``), so ``" the"`` is stored
  as ``"Ġthe"`` and ``"\\n"`` as ``"Ċ"``.

:class:`PieceDecoder` reads one family's pieces back into the bytes they
stand for; :func:`piece_reader` builds one for a backend or tokenizer.  A
filter that looks at raw pieces instead would count ``"Ġthe"`` as a content
word on every byte-level vocabulary.

Exposure
--------
:class:`ExposureTrace` is DecodeLeak's per-step exposure sequence
``E_1^k .. E_T^k`` together with the cutoff ``k`` it was recorded at; the
metrics refuse a ``K`` larger than that instead of silently reading fewer ids.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

PieceFamily = Literal["sentencepiece", "byte_level", "plain"]

#: GGUF ``tokenizer.ggml.model`` values whose pieces :class:`PieceDecoder` reads
GGUF_TOKENIZER_FAMILY: dict[str, PieceFamily] = {"llama": "sentencepiece", "t5": "sentencepiece",
                                                 "gpt2": "byte_level"}

SPM_SPACE = "\u2581"
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BPE_SPACE = "\u0120"  # "Ġ": the byte-level form of b" "

#: words every answer template contains, whatever the private context (the release drops them too)
TEMPLATE_WORDS = frozenset(
    "answer answers reason reasoning option options explanation step steps context solution brief".split()
)
#: never stop words: a negation changes what the evidence says (annotators mark "not" on its own)
NEGATIONS = frozenset(
    """no not nor never none nothing nobody nowhere neither without cannot n't
    aren't can't couldn't didn't doesn't don't hadn't hasn't haven't isn't mustn't shan't shouldn't wasn't weren't
    won't wouldn't""".split()
)
#: never stop words either: counts are evidence ("two weeks")
NUMBER_WORDS = frozenset(
    """zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
    seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million
    first second third fourth fifth once twice""".split()
)


# -- pieces ---------------------------------------------------------------------------------------


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE character for each byte, inverted: ``{"Ġ": 0x20, "Ċ": 0x0A, "a": 0x61, ...}``.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``)
    stand for themselves; the other 68 bytes, in increasing order, take the
    code points 256, 257, ... (so 0x00 is U+0100, 0x20 is U+0120 "Ġ").
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def detect_piece_family(pieces: Iterable[str]) -> PieceFamily:
    """Which family wrote these vocabulary pieces, by counting each family's marks.

    SentencePiece pieces start with ``"▁"`` or are ``<0xNN>`` byte tokens;
    byte-level pieces start with ``"Ġ"`` (a space byte).  A vocabulary with
    neither mark is taken to hold plain text.
    """
    spm = bpe = 0
    for piece in pieces:
        if piece.startswith(SPM_SPACE) or _SPM_BYTE.fullmatch(piece):
            spm += 1
        elif piece.startswith(_BPE_SPACE):
            bpe += 1
    if spm == bpe == 0:
        return "plain"
    return "byte_level" if bpe > spm else "sentencepiece"


class PieceDecoder:
    """A vocabulary's raw pieces read back into text, for either tokenizer family.

    Args:
        pieces: every token's raw vocabulary string in id order (``str``, or UTF-8 ``bytes``
            as llama.cpp's ``token_strings`` gives them).
        family: ``"sentencepiece"``, ``"byte_level"`` or ``"plain"`` (pieces are text already);
            ``None`` detects it once from the pieces (:func:`detect_piece_family`).
        special_ids: control tokens (``<eos>``, ``<|im_start|>``): read as their literal text,
            and left out of :meth:`decode` with ``skip_special=True``.
    """

    def __init__(
        self, pieces: Sequence[str | bytes], family: PieceFamily | None = None, special_ids: Iterable[int] = ()
    ) -> None:
        self._pieces = [p.decode("utf-8", errors="replace") if isinstance(p, bytes) else str(p) for p in pieces]
        if family is None:
            family = detect_piece_family(self._pieces)
        if family not in ("sentencepiece", "byte_level", "plain"):
            raise ValueError(f"unknown piece family {family!r}; expected sentencepiece, byte_level or plain")
        self.family: PieceFamily = family
        self.special_ids = frozenset(int(i) for i in special_ids)
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._pieces)

    def raw(self, token_id: int) -> str:
        """The vocabulary string as stored (``"Ġthe"``, ``"▁the"``)."""
        return self._pieces[token_id]

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for (may be part of one UTF-8 character)."""
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._read(self._pieces[token_id], token_id in self.special_ids)
        return data

    def __call__(self, token_id: int) -> str:
        """The token's text (a lone part of a multi-byte character reads as U+FFFD)."""
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.piece_bytes(token_id).decode("utf-8", errors="replace")
        return text

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of a token sequence (bytes joined before decoding, so split characters come back whole)."""
        ids = (int(i) for i in ids)
        if skip_special:
            ids = (i for i in ids if i not in self.special_ids)
        return b"".join(self.piece_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def _read(self, piece: str, special: bool) -> bytes:
        if special or self.family == "plain":
            return piece.encode("utf-8")
        if self.family == "sentencepiece":
            byte = _SPM_BYTE.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            return piece.replace(SPM_SPACE, " ").encode("utf-8")
        alphabet = byte_level_alphabet()
        # a character outside the 256-character alphabet belongs to an added token stored as plain text
        return b"".join(bytes([alphabet[ch]]) if ch in alphabet else ch.encode("utf-8") for ch in piece)


class _DetokenizingReader:
    """The fallback for a backend with no vocabulary table: one detokenisation per id."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self._detokenize = detokenize
        self.special_ids: frozenset[int] = frozenset()

    def __call__(self, token_id: int) -> str:
        return self._detokenize([int(token_id)])

    def piece_bytes(self, token_id: int) -> bytes:
        return self(token_id).encode("utf-8")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self._detokenize([int(i) for i in ids])


def piece_reader(source: object, family: PieceFamily | None = None) -> PieceDecoder | _DetokenizingReader:
    """Token id → its text, for a backend or a tokenizer, whichever family its vocabulary is.

    * an edge backend with ``token_strings()`` (:class:`~edge_sdk.backends.llama_cpp.LlamaCppSLM`):
      its raw GGUF vocabulary, with its ``special_token_ids`` as the special ids when it has
      them, else its EOS and BOS ids;
    * a transformers tokenizer (``convert_ids_to_tokens``) or a ``tokenizers.Tokenizer``
      (``id_to_token``): its raw vocabulary, and its special tokens (added ones included);
    * anything else with ``detokenize(ids)``: one detokenisation per id.

    ``family`` skips the detection (e.g. ``GGUF_TOKENIZER_FAMILY[metadata["tokenizer.ggml.model"]]``).
    """
    strings = getattr(source, "token_strings", None)
    if strings is not None:
        special = getattr(source, "special_token_ids", None)
        if special is None:
            special = set(getattr(source, "eos_token_ids", ()) or ())
            bos = getattr(source, "bos_token_id", None)
            if bos is not None and bos >= 0:
                special.add(int(bos))
        return PieceDecoder(strings(), family, special)
    if hasattr(source, "convert_ids_to_tokens"):
        size = len(source)  # type: ignore[arg-type]
        pieces = source.convert_ids_to_tokens(list(range(size)))
        added = getattr(source, "added_tokens_decoder", {})
        special = {*getattr(source, "all_special_ids", ()),
                   *(i for i, token in added.items() if getattr(token, "special", False))}
        return PieceDecoder([p if p is not None else "" for p in pieces], family, special)
    if hasattr(source, "id_to_token") and hasattr(source, "get_vocab_size"):
        size = source.get_vocab_size(with_added_tokens=True)
        pieces = [source.id_to_token(i) or "" for i in range(size)]
        added = getattr(source, "get_added_tokens_decoder", lambda: {})()
        return PieceDecoder(pieces, family, [i for i, token in added.items() if getattr(token, "special", False)])
    detokenize = getattr(source, "detokenize", None)
    if detokenize is None:
        raise TypeError(f"cannot read token pieces from {type(source).__name__}: it has no token_strings(), "
                        "convert_ids_to_tokens(), id_to_token() or detokenize()")
    return _DetokenizingReader(detokenize)


# -- content words and content tokens --------------------------------------------------------------


@functools.cache
def stop_words() -> frozenset[str]:
    """The English stop-word list of the ``stop-words`` package, plus the answer-template words,
    minus negations and number words (lower case; ``’`` written ``'``)."""
    try:
        from stop_words import get_stop_words
    except ImportError as exc:  # pragma: no cover - the edge extra installs it
        raise ImportError("content-token filtering needs the 'stop-words' package: pip install 'coveil[edge]'") from exc
    listed = {fold(word) for word in get_stop_words("en")}
    return frozenset((listed | TEMPLATE_WORDS) - NEGATIONS - NUMBER_WORDS)


def fold(word: str) -> str:
    """A word as the metrics compare words: lower case, with ``’`` written ``'``."""
    return word.lower().replace("\u2019", "'")


def _strip_edges(chunk: str) -> str:
    """``chunk`` without leading and trailing characters that are not letters or digits."""
    start, end = 0, len(chunk)
    while start < end and not chunk[start].isalnum():
        start += 1
    while end > start and not chunk[end - 1].isalnum():
        end -= 1
    return chunk[start:end]


def words(text: str) -> list[str]:
    """The words of ``text`` as they appear: whitespace-separated, edge punctuation stripped.

    Inner punctuation stays, so ``"70-year-old"``, ``"mg/dL"`` and ``"don't"`` are one word each.
    """
    return [word for chunk in text.split() if (word := _strip_edges(chunk))]


def is_number(word: str) -> bool:
    """Digits, possibly with decimal or range punctuation (``"7"``, ``"37.5"``, ``"120/80"``)."""
    return any(ch.isdigit() for ch in word) and all(ch.isdigit() or ch in ".,:/-" for ch in word)


def is_content_word(word: str) -> bool:
    """A word that counts as evidence: anything with a letter or digit that is not a stop word."""
    folded = fold(_strip_edges(word))
    return bool(folded) and (is_number(folded) or folded not in stop_words())


def piece_is_content(piece: str) -> bool:
    """Whether a token's *text* (decoded, not its raw vocabulary piece) can carry content on its own.

    No content: whitespace, punctuation, a stop word (``" the"``, ``"\\n"``, ``","``).
    """
    core = fold(_strip_edges(piece.strip()))
    return bool(core) and (is_number(core) or core not in stop_words())


def word_token_ids(word: str, tokenize: Callable[[str], list[int]], piece: Callable[[int], str]) -> set[int]:
    """The ids that stand for one content word, tokenised as ``" " + word``.

    Its number pieces always count.  Of its other pieces, the most specific
    kind it has counts: pieces of more than two letters that are not stop
    words (``"bilirubin"`` without ``"ir"``, ``"patient's"`` without ``"'s"``:
    short fragments say little and turn up in almost every exposure set);
    for a word without one (``"ERCP"`` = ``▁ER CP``, ``"no"``), its pieces
    that are not stop words; for a word of stop-word pieces alone
    (``"thereof"`` = ``▁there of``), those.  Whitespace and punctuation
    pieces never count, so every content word keeps at least one id.
    """
    cores = [(i, fold(_strip_edges(piece(i).strip()))) for i in tokenize(" " + word)]
    cores = [(i, core) for i, core in cores if core]
    ids = {i for i, core in cores if is_number(core)}
    letters = [(i, core) for i, core in cores if not is_number(core)]
    stop = stop_words()
    for keep in (lambda c: len(c) > 2 and c not in stop, lambda c: c not in stop, lambda c: True):
        chosen = {i for i, core in letters if keep(core)}
        if chosen:
            return ids | chosen
    return ids


def content_token_ids(text: str, tokenize: Callable[[str], list[int]], piece: Callable[[int], str]) -> set[int]:
    """``T(text)``: the content token ids of ``text``, the union of :func:`word_token_ids` over its
    content words (:func:`is_content_word`).

    Each word is tokenised as ``" " + word``, as it would appear mid-sentence.
    ``piece`` must give a token's text, e.g. a :class:`PieceDecoder`, never its
    raw vocabulary string.
    """
    ids: set[int] = set()
    for word in words(text):
        if is_content_word(word):
            ids |= word_token_ids(word, tokenize, piece)
    return ids


# -- what the cloud observed ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExposureTrace:
    """DecodeLeak's exposure sequence: each step's ``E_t^k`` ids, best first, recorded at cutoff ``k``.

    A step holds fewer than ``k`` ids only when fewer were observed (an upload
    smaller than ``k``).  Asking for a larger ``K`` than ``k`` is an error:
    the ids beyond ``k`` were never recorded.
    """

    k: int
    steps: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or self.k < 1:
            raise ValueError(f"an exposure trace needs a cutoff k >= 1, got {self.k!r}")
        steps = tuple(tuple(int(i) for i in step) for step in self.steps)
        for t, step in enumerate(steps):
            if len(step) > self.k:
                raise ValueError(f"step {t} holds {len(step)} ids, more than the trace's k={self.k}")
            if len(set(step)) != len(step) or any(i < 0 for i in step):
                raise ValueError(f"step {t} must hold distinct non-negative token ids, got {step}")
        object.__setattr__(self, "k", int(self.k))
        object.__setattr__(self, "steps", steps)

    @classmethod
    def from_transcript(cls, transcript: Mapping) -> ExposureTrace:
        """The trace of a cloud observation transcript (``exposure_k`` and each step's ``exposure``)."""
        return cls(int(transcript["exposure_k"]), tuple(tuple(s["exposure"]) for s in transcript["steps"]))

    def __len__(self) -> int:
        return len(self.steps)

    def check(self, k: int) -> int:
        """``k`` itself if this trace can answer for it; ``ValueError`` otherwise."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"K must be a positive integer, got {k!r}")
        if k > self.k:
            raise ValueError(f"K={k} is larger than the cutoff this trace was recorded at (k={self.k}); "
                             f"record the exposure with k >= {k}")
        return int(k)

    def top(self, k: int) -> tuple[tuple[int, ...], ...]:
        """Every step's first ``k`` ids."""
        k = self.check(k)
        return tuple(step[:k] for step in self.steps)

    def exposed(self, k: int) -> frozenset[int]:
        """``E^k``: the union of every step's first ``k`` ids."""
        return frozenset(i for step in self.top(k) for i in step)

    def truncated(self, k: int) -> ExposureTrace:
        """The same trace as if it had been recorded at cutoff ``k``."""
        return ExposureTrace(k, self.top(k))


@dataclass
class LeakageMeter:
    """What share of the private context's content tokens the cloud has observed so far.

    ``exposed`` accumulates every id that left the device or that the cloud
    could read off its own view of the step (DecodeLeak's exposure sets).
    """

    private_content_ids: frozenset[int]
    exposed: set[int] = field(default_factory=set)

    def observe(self, ids: Iterable[int] | np.ndarray) -> None:
        self.exposed.update(int(i) for i in ids)

    @property
    def leaked_ids(self) -> set[int]:
        return self.exposed & self.private_content_ids

    @property
    def share(self) -> float:
        """``|T(private) ∩ exposed| / |T(private)|`` (0 when the private context has no content tokens)."""
        if not self.private_content_ids:
            return 0.0
        return len(self.leaked_ids) / len(self.private_content_ids)
