"""What a step's decision sends the cloud: the protocol's value types (the policies produce them, the codec
encodes them, the cloud reads them).

* cloud-side fusion: a :class:`CloudUpload` (sparse SLM values); the cloud then fuses
  ``alpha * p_llm + (1 - alpha) * upload`` and picks the token (:func:`edge_sdk.fusion.cloud_scores`);
* edge-side fusion: a :class:`SyncedToken`; the edge has fused locally.

The object is both the decision and the exact payload the cloud sees, so the SDK, the cloud adapter and the
harness never re-derive it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from edge_sdk.fusion import FusionSpace, fuse_upload, top_k_ids

FusionMode = Literal["cloud", "edge"]
FUSION_MODES: tuple[str, ...] = ("cloud", "edge")


@dataclass(frozen=True, eq=False)
class CloudUpload:
    """A sparse upload of SLM values: the cloud observes exactly ``(ids, values)``.

    ``ids`` are unique token ids in ascending order; ``values[j]`` is the value
    sent for ``ids[j]`` (a probability, a noised probability, or a logit when
    ``space == "logit"``).  An empty upload is legal: the cloud then fuses with
    ``p_llm`` alone.
    """

    ids: np.ndarray
    values: np.ndarray
    space: FusionSpace = "prob"

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        values = np.asarray(self.values, dtype=np.float32).reshape(-1)
        if ids.shape != values.shape:
            raise ValueError(f"upload has {ids.size} ids but {values.size} values")
        if ids.size and np.any(np.diff(ids) <= 0):
            order = np.argsort(ids, kind="stable")
            ids, values = ids[order], values[order]
            if np.any(np.diff(ids) == 0):
                raise ValueError("upload ids must be unique")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "values", values)

    @classmethod
    def of(cls, p: np.ndarray, ids: np.ndarray, space: FusionSpace = "prob") -> CloudUpload:
        """Upload ``p`` restricted to ``ids``."""
        ids = np.sort(np.asarray(ids, dtype=np.int64))
        return cls(ids, np.asarray(p, dtype=np.float32)[ids], space)

    @classmethod
    def empty(cls, space: FusionSpace = "prob") -> CloudUpload:
        return cls(np.empty(0, np.int64), np.empty(0, np.float32), space)

    def __len__(self) -> int:
        return int(self.ids.size)

    def fuse_with(self, p_llm: np.ndarray, alpha: float) -> np.ndarray:
        """The cloud's masked fusion ``alpha * p_llm + (1 - alpha) * m * p_slm``."""
        return fuse_upload(p_llm, self.ids, self.values, alpha)

    def largest(self, limit: int) -> CloudUpload:
        """This upload, or only its ``limit`` largest values when it holds more."""
        if len(self) <= limit:
            return self
        keep = top_k_ids(self.values, limit)
        return CloudUpload(self.ids[keep], self.values[keep], self.space)

    def exposure(self, k: int) -> np.ndarray:
        """``TopK`` of the uploaded values (ids by decreasing value): DecodeLeak's ``E_t^K``."""
        if not len(self):
            return np.empty(0, np.int64)
        order = top_k_ids(self.values, min(k, len(self)))
        return self.ids[order]


@dataclass(frozen=True)
class SyncedToken:
    """Edge-side fusion: the one token id appended to the shared prefix."""

    token_id: int


Observation = CloudUpload | SyncedToken
