"""The tokenizer views the leakage metrics read: text → ids, id → text, ids → text."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edge_sdk.backends.pieces import PieceFamily, piece_reader


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as the metrics see it.

    Args:
        tokenize: text → ids, without BOS.
        piece: id → the token's text (a :class:`~edge_sdk.backends.pieces.PieceDecoder`, never the raw
            vocabulary string: ``"Ġthe"`` must read as ``" the"``).
        special_ids: ids a sequence decode with ``skip_special`` leaves out; ``None`` takes the
            piece reader's own (``piece.special_ids``) when it has them.
    """

    tokenize: Callable[[str], list[int]]
    piece: Callable[[int], str]
    special_ids: frozenset[int] | None = None

    @classmethod
    def from_slm(cls, slm: object, family: PieceFamily | None = None) -> Vocabulary:
        """The vocabulary of an edge backend (``tokenize(text, add_bos=...)`` and ``token_strings()``)."""
        tokenize = slm.tokenize  # type: ignore[attr-defined]
        return cls(lambda text: tokenize(text, add_bos=False), piece_reader(slm, family))

    @classmethod
    def from_hf(cls, tokenizer: object, family: PieceFamily | None = None) -> Vocabulary:
        """The vocabulary of a transformers tokenizer or a ``tokenizers.Tokenizer``."""

        def tokenize(text: str) -> list[int]:
            encoded = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
            return list(getattr(encoded, "ids", encoded))  # a tokenizers.Encoding or a list of ids

        return cls(tokenize, piece_reader(tokenizer, family))

    @property
    def specials(self) -> frozenset[int]:
        if self.special_ids is not None:
            return self.special_ids
        return frozenset(getattr(self.piece, "special_ids", ()))

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (part of a character for some byte-level tokens)."""
        read = getattr(self.piece, "piece_bytes", None)
        return read(token_id) if read is not None else self.piece(token_id).encode("utf-8")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of a token sequence, bytes joined before decoding."""
        specials = self.specials if skip_special else frozenset()
        data = b"".join(self.piece_bytes(int(i)) for i in ids if int(i) not in specials)
        return data.decode("utf-8", errors="replace")
