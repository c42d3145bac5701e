"""Provenance: the digests a result row carries to say what produced it.

The models (:func:`model_digest`: a GGUF file's sha256, or a checkpoint directory's over its files), the
dataset and each item (:func:`items_digest`, :func:`item_digest`), the tokenizer (:func:`tokenizer_fingerprint`),
the code (:func:`code_digest` over the three packages' sources, :func:`source_digest` once per process) and the
installed version (:func:`package_version`).  A results file written by another run is refused by comparing
them (:mod:`eval_harness.sweep.store`); Ray workers check theirs against the driver's code digest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_sdk.models import ModelSource, tokenizer_vocab_size, vocab_fingerprint

if TYPE_CHECKING:
    from eval_harness.datasets import DecodeLeakItem

#: the packages shipped to Ray workers and covered by :func:`code_digest`
CODE_PACKAGES = ("edge_sdk", "cloud_adapter", "eval_harness")


def file_digest(path: str | Path | None) -> str | None:
    """sha256 of a model file (``None`` when the model has no single file)."""
    if path is None:
        return None
    digest = hashlib.sha256()
    with Path(path).open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: the files of a transformers checkpoint that decide its outputs: weights, configs, tokenizer
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".tiktoken", ".gguf")


def cached_file_digests(paths: Sequence[Path]) -> list[str]:
    """The :func:`file_digest` of each of ``paths``, each kept in ``$COVEIL_CACHE_DIR/file-digests.json`` under
    its resolved path, size and mtime (ns), so a second run does not read a 253 MB GGUF or a 70B model's weights
    again; a file changed since (another size or mtime) is read anew."""
    cache_path = Path(os.environ.get("COVEIL_CACHE_DIR", Path.home() / ".cache" / "coveil")).expanduser() / (
        "file-digests.json")
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    digests, changed = [], False
    for path in paths:
        resolved = Path(path).resolve()
        stat = resolved.stat()
        key = f"{resolved}\t{stat.st_size}\t{stat.st_mtime_ns}"
        if key not in cache:
            cache[key], changed = file_digest(resolved), True
        digests.append(cache[key])
    if changed:
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            partial = cache_path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(cache))
            partial.replace(cache_path)
        except OSError:  # an unwritable cache (a read-only home) costs the next run a re-read, not this run
            pass
    return digests


def checkpoint_digest(directory: str | Path) -> str:
    """sha256 of a transformers checkpoint directory: over the lines ``"<relative path>\t<file sha256>\n"`` of
    its :data:`CHECKPOINT_SUFFIXES` files (hidden ones aside), in sorted path order (each file's digest from
    :func:`cached_file_digests`)."""
    root = Path(directory)
    files = sorted(path for path in root.rglob("*") if path.is_file() and path.suffix in CHECKPOINT_SUFFIXES
                   and not any(part.startswith(".") for part in path.relative_to(root).parts))
    if not files:
        raise ValueError(f"{root}: no checkpoint files ({', '.join(CHECKPOINT_SUFFIXES)})")
    lines = [f"{path.relative_to(root).as_posix()}\t{digest}\n"
             for path, digest in zip(files, cached_file_digests(files))]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def model_digest(source: ModelSource) -> str | None:
    """The row's ``sha256`` of a model: of its GGUF file, of its checkpoint directory (:func:`checkpoint_digest`;
    a hub name is looked up in the local cache), ``None`` only for a hub name that is not cached.  Either is read
    once per file version (:func:`cached_file_digests`)."""
    if source.gguf_path is not None:
        return cached_file_digests([Path(source.gguf_path)])[0]
    location = Path(str(source.hf_name_or_dir)).expanduser()
    if not location.is_dir():
        from huggingface_hub import snapshot_download

        try:
            location = Path(snapshot_download(str(source.hf_name_or_dir), local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the local cache: the row says so with None
            return None
    return checkpoint_digest(location)


def package_version() -> str:
    try:
        return version("coveil")
    except PackageNotFoundError:  # pragma: no cover - only when run from a bare checkout
        return "unknown"


def item_digest(item: DecodeLeakItem) -> str:
    """sha256 of one item's fields as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(dataclasses.asdict(item), sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode()).hexdigest()


def items_digest(items: Sequence[DecodeLeakItem]) -> str:
    """sha256 over the items' :func:`item_digest` lines ``"<digest>\\n"``, in dataset order: the dataset a run drew
    its items from (with ``--limit N``, its first N)."""
    return hashlib.sha256("".join(f"{item_digest(item)}\n" for item in items).encode()).hexdigest()


def code_dirs() -> list[Path]:
    """The directories this process imports :data:`CODE_PACKAGES` from."""
    return [Path(importlib.import_module(name).__file__).parent for name in CODE_PACKAGES]  # type: ignore[arg-type]


def code_digest(dirs: Sequence[Path] | None = None) -> str:
    """sha256 over every ``.py`` file of the packages: ``package/relative/path``, a NUL, the bytes, in path order."""
    digest = hashlib.sha256()
    for directory in code_dirs() if dirs is None else dirs:
        for path in sorted(directory.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(f"{directory.name}/{path.relative_to(directory).as_posix()}".encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The tokenizer's :func:`~edge_sdk.models.vocab_fingerprint` as hex: its own entries, output padding aside."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return vocab_fingerprint(tokens[: tokenizer_vocab_size(tokens)]).hex()


@functools.cache
def source_digest() -> str:
    """sha256 of the harness's source (:func:`code_digest`: every ``.py`` file of ``edge_sdk``,
    ``cloud_adapter`` and ``eval_harness``), once per process."""
    return code_digest()
