"""Quantised variants of a GGUF, derived locally with llama.cpp's own quantiser and cached.

``llama_cpp.llama_model_quantize`` is llama.cpp's ``llama-quantize`` as a library call: it rewrites a GGUF
with another tensor type.  The embedded model ships as Q4_K_M only, so every other type is **requantised
from the Q4_K_M file** (``allow_requantize``): each tensor is dequantised from its stored blocks and quantised
again.  A variant is therefore never closer to the original weights than the file it comes from; a Q8_0
variant is the Q4_K_M weights re-stored at 8.5 bits (a control for llama.cpp's kernels, not a better model),
and Q3_K / Q2_K add their own rounding on top of Q4_K_M's.  The full-precision reference in transformers is
the same source file dequantised (:mod:`cloud_adapter.hf_loading`), so the source type's own row measures
llama.cpp's arithmetic alone, not weight quantisation.

What a type covers is llama.cpp's choice, recorded per file (:class:`GGUFInfo`): a tensor whose rows do not
split into 256-wide k-quant blocks (Gemma-3 270M's 640-wide inputs) gets a fallback type, and the token
embedding keeps its own type.  Bits per weight are therefore read off each file, never assumed from its name.

Variants are cached as ``<cache>/quantized/<stem>.<sha256[:16] of the source>.<TYPE>.gguf`` (default cache:
``$COVEIL_CACHE_DIR``, else ``~/.cache/coveil``), written to a temporary name and renamed, so an interrupted
quantisation never leaves a file that looks finished; what each file holds is kept beside them by content
(:func:`cached_info`).
"""

from __future__ import annotations

import ctypes
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_sdk.backends.gguf_header import read_gguf_header

#: llama-quantize's short names for a k-quant family, resolved to the member it means (its CLI does the same)
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
#: the tensor llama.cpp's quantiser types separately (``token_embedding_type``); kept out of the matrices' bits
TOKEN_EMBEDDING = "token_embd.weight"


def quant_type(name: str) -> str:
    """llama.cpp's canonical type name for ``name`` (``"q3_k"`` -> ``"Q3_K_M"``); ``ValueError`` if unknown."""
    import llama_cpp

    canonical = ALIASES.get(name.upper(), name.upper())
    if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{canonical}"):
        known = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp)
                       if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ValueError(f"unknown quantisation type {name!r}; llama.cpp knows {', '.join(known + sorted(ALIASES))}")
    return canonical


@dataclass(frozen=True)
class GGUFInfo:
    """What one GGUF file holds, read from its own metadata and tensor table.

    Attributes:
        file_type: ``general.file_type`` as llama.cpp names it (``"Q4_K_M"``).
        size_bytes: the file's size.
        bits_per_weight: ``8 * sum(bytes) / sum(elements)`` over every tensor.
        matrix_bits_per_weight: the same over the 2-D weight matrices other than the token embedding:
            the tensors a quantisation type is about (the embedding keeps its own type).
        tensor_types: how many tensors are stored in each type.
    """

    path: str
    file_type: str
    size_bytes: int
    bits_per_weight: float
    matrix_bits_per_weight: float
    tensor_types: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gguf_info(path: str | Path) -> GGUFInfo:
    """Read a GGUF's file type and its bits per weight from its header (no model is loaded)."""
    import gguf

    header = read_gguf_header(path)
    file_type = header.metadata.get("general.file_type")
    if file_type is None:
        raise ValueError(f"{path}: the GGUF has no general.file_type")
    file_type = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    all_bytes = all_elements = matrix_bytes = matrix_elements = 0
    types: Counter[str] = Counter()
    for tensor in header.tensors:
        n_bytes, n_elements = tensor.n_bytes, tensor.n_elements
        all_bytes, all_elements = all_bytes + n_bytes, all_elements + n_elements
        types[tensor.kind.name] += 1
        if len([d for d in tensor.dims if d > 1]) >= 2 and tensor.name != TOKEN_EMBEDDING:
            matrix_bytes, matrix_elements = matrix_bytes + n_bytes, matrix_elements + n_elements
    if not all_elements:
        raise ValueError(f"{path}: the GGUF holds no tensors")
    return GGUFInfo(
        path=str(path),
        file_type=file_type,
        size_bytes=Path(path).stat().st_size,
        bits_per_weight=8.0 * all_bytes / all_elements,
        matrix_bits_per_weight=8.0 * matrix_bytes / matrix_elements if matrix_elements else float("nan"),
        tensor_types=dict(sorted(types.items())),
    )


def cached_info(path: str | Path, sha256: str, cache_dir: str | Path | None = None) -> GGUFInfo:
    """:func:`gguf_info`, kept as ``<cache>/info/<sha256[:16]>.json`` after the first read.

    The ``gguf`` reader parses every metadata array into Python objects (Gemma-3's 262k-entry vocabulary
    three times over; 55 s for the embedded model on a busy 2-core machine), so each file's content is read once.
    """
    directory = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "info"
    sidecar = directory / f"{sha256[:16]}.json"
    if sidecar.is_file():
        return GGUFInfo(**{**json.loads(sidecar.read_text(encoding="utf-8")), "path": str(path)})
    info = gguf_info(path)
    directory.mkdir(parents=True, exist_ok=True)
    partial = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(info.to_json()), encoding="utf-8")
    os.replace(partial, sidecar)
    return info


def default_cache_dir() -> Path:
    """``$COVEIL_CACHE_DIR/quantized`` (default ``~/.cache/coveil/quantized``), beside the dequantised models."""
    from edge_sdk.models import cache_root

    return cache_root() / "quantized"


def quantize(source: str | Path, type_name: str, target: str | Path, *, threads: int | None = None) -> None:
    """Write ``source`` requantised to ``type_name`` at ``target`` (llama.cpp's quantiser, no imatrix).

    Raises ``RuntimeError`` when llama.cpp refuses (a type that needs an importance matrix, a broken file).
    """
    import llama_cpp

    from edge_sdk.backends.llama_cpp import _route_native_logs

    _route_native_logs(llama_cpp, verbose=False)  # its per-tensor lines go to the debug log, not the terminal
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant_type(type_name)}")
    params.allow_requantize = True  # the source is itself quantised: dequantise each tensor, quantise again
    params.nthread = threads or max(1, os.cpu_count() or 1)
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {type_name} "
                           f"(llama_model_quantize returned {code})")


@dataclass(frozen=True)
class Variant:
    """One quantisation of the edge model as llama.cpp will run it.

    Attributes:
        name: the type asked for (``"Q3_K"``).
        path: the GGUF llama.cpp loads.
        sha256: the file's digest (what result rows record).
        info: what the file holds (:class:`GGUFInfo`).
        derived_from: the source's file type when this file was requantised from it; ``None`` for the source.
    """

    name: str
    path: Path
    sha256: str
    info: GGUFInfo
    derived_from: str | None

    def describe(self) -> str:
        """``"Q2_K (requantised from Q4_K_M)"`` or ``"Q4_K_M (the source file)"``."""
        origin = "the source file" if self.derived_from is None else f"requantised from {self.derived_from}"
        return f"{self.name} ({origin})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "sha256": self.sha256, "derived_from": self.derived_from,
                **{k: v for k, v in self.info.to_json().items() if k != "path"}}


def derive_variant(source: str | Path, type_name: str, *, cache_dir: str | Path | None = None,
                   source_sha256: str | None = None) -> Variant:
    """``source`` as ``type_name``: the source itself when it already is that type, else a cached requantisation.

    The cache key is the source file's sha256 and the canonical type, so a changed source never reuses
    an old variant, and a second call with the same pair returns the stored file without quantising.
    """
    from eval_harness.provenance import file_digest

    source = Path(source)
    canonical = quant_type(type_name)
    digest = source_sha256 or str(file_digest(source))
    source_info = cached_info(source, digest, cache_dir)
    if source_info.file_type == canonical:
        return Variant(type_name, source, digest, source_info, derived_from=None)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = directory / f"{source.stem}.{digest[:16]}.{canonical}.gguf"
    if not target.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            quantize(source, canonical, partial)
            written = cached_info(partial, str(file_digest(partial)), cache_dir).file_type
            if written != canonical:
                raise RuntimeError(f"llama.cpp wrote a {written} file when asked for {canonical}")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    target_digest = str(file_digest(target))
    return Variant(type_name, target, target_digest, cached_info(target, target_digest, cache_dir),
                   derived_from=source_info.file_type)
