"""The vocabulary pieces tokens are stored as, read back into the text they stand for.

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
word on every byte-level vocabulary (:mod:`edge_sdk.privacy.meter` reads token texts through it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

PieceFamily = Literal["sentencepiece", "byte_level", "plain"]

#: GGUF ``tokenizer.ggml.model`` values whose pieces :class:`PieceDecoder` reads
GGUF_TOKENIZER_FAMILY: dict[str, PieceFamily] = {"llama": "sentencepiece", "t5": "sentencepiece",
                                                 "gpt2": "byte_level"}

SPM_SPACE = "\u2581"
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BPE_SPACE = "\u0120"  # "Ġ": the byte-level form of b" "

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
