"""A result row's exposure trace in compact form: every step's ``E_t^k`` ids, at the cutoff ``k`` recorded.

A row's metrics are functions of its trace (and of the item and the
tokenizer), so a row that holds its trace can be re-scored without a model
(``decodeleak recompute``).  At ``k = 1000`` a step is 1,000 ids in rank
order; JSON lists would cost about 7 bytes an id.  The encoding here:

* ``int32`` little-endian: ``n`` step lengths, then every step's ids in order (``4 (n + Σ len_t)`` bytes);
* compressed with xz (``lzma``, preset 6) and written as base64;
* beside it ``sha256``, the digest of those int32 bytes before compression: an edit of the trace that leaves
  every metric as it was (a reordered tail, an id swapped for another outside the evidence) is still seen
  (:func:`decode_trace` refuses a trace that does not match it; rows written before it have none).

On the embedded pair's MedPriv traces at ``k = 1000`` that is 1.8-2.1
bytes an id before base64 (2.4-2.8 in the row): a ranked list of 1,000 of
262,144 ids carries about 2.2 bytes an id of information (the set,
``log2 C(262144, 1000)``, plus the order, ``log2 1000!``), so a cleverer
transform would gain little; xz and base64 are in every standard library.
"""

from __future__ import annotations

import base64
import hashlib
import lzma
from collections.abc import Mapping
from typing import Any

import numpy as np

from edge_sdk.privacy.meter import ExposureTrace

#: the encoding's name, written into every encoded trace (a reader refuses any other)
CODEC = "int32le-xz-base64"


def encode_trace(trace: ExposureTrace) -> dict[str, Any]:
    """``{"codec", "k", "steps", "ids", "sha256"}``: the trace at its recorded ``k``, ``ids`` as :data:`CODEC`
    says, ``sha256`` the digest of the uncompressed int32 bytes."""
    lengths = np.array([len(step) for step in trace.steps], dtype="<i4")
    ids = np.fromiter((i for step in trace.steps for i in step), dtype="<i4", count=int(lengths.sum()))
    raw = lengths.tobytes() + ids.tobytes()
    return {"codec": CODEC, "k": trace.k, "steps": len(trace.steps),
            "ids": base64.b64encode(lzma.compress(raw, preset=6)).decode("ascii"),
            "sha256": hashlib.sha256(raw).hexdigest()}


def decode_trace(encoded: Mapping[str, Any]) -> ExposureTrace:
    """The :class:`ExposureTrace` :func:`encode_trace` wrote (``ValueError`` for anything else, and for a trace
    whose bytes do not match its ``sha256``)."""
    if not isinstance(encoded, Mapping) or encoded.get("codec") != CODEC:
        codec = encoded.get("codec") if isinstance(encoded, Mapping) else type(encoded).__name__
        raise ValueError(f"not an exposure trace in {CODEC} (codec {codec!r})")
    try:
        raw = lzma.decompress(base64.b64decode(encoded["ids"], validate=True))
        n = int(encoded["steps"])
    except (KeyError, TypeError, ValueError, lzma.LZMAError) as exc:
        raise ValueError(f"a damaged exposure trace: {exc}") from None
    recorded = encoded.get("sha256")
    if recorded is not None and hashlib.sha256(raw).hexdigest() != recorded:
        raise ValueError("the exposure trace does not match its sha256: it was changed after it was written")
    data = np.frombuffer(raw, dtype="<i4")
    lengths = data[:n]
    if n < 0 or len(lengths) != n or (lengths < 0).any() or n + int(lengths.sum()) != len(data):
        raise ValueError(f"a damaged exposure trace: {len(data)} numbers do not hold {n} steps and their ids")
    ends = np.cumsum(lengths) + n
    steps = tuple(tuple(data[end - length:end].tolist()) for end, length in zip(ends, lengths))
    return ExposureTrace(int(encoded["k"]), steps)
