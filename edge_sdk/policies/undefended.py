"""The undefended reference: the fusion the paper's leakage measurements start from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk.fusion import FusionSpace, check_space, fuse, pick_token, softmax
from edge_sdk.policies.base import Policy
from edge_sdk.protocol.signals import CloudUpload, FusionMode, SyncedToken
from edge_sdk.privacy.analysis import EpsilonUnit


@dataclass
class Undefended(Policy):
    """No defence.

    * cloud-side: upload the whole ``p_slm`` (every id; the cloud sees ``o_t = p_S``);
    * edge-side: synchronise ``argmax(alpha * p_llm + (1 - alpha) * p_slm)``, or a
      draw from it at ``temperature > 0``.

    In ``space="logit"`` the arrays are raw logits and the fusion is
    ``alpha * z_llm + (1 - alpha) * z_slm`` (a draw then comes from its softmax).
    """

    name = "undefended"
    modes = frozenset({"cloud", "edge"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"cloud": "none", "edge": "none"}

    temperature: float = 0.0
    space: FusionSpace = "prob"

    def __post_init__(self) -> None:
        check_space(self.space)

    def llm_support(self, mode: FusionMode) -> int | None:
        if mode == "cloud":
            return 0  # the upload ignores p_llm
        return 1 if self.temperature == 0.0 else None

    def cloud_upload(self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float,
                     rng: np.random.Generator | None = None) -> CloudUpload:
        return CloudUpload(np.arange(p_slm.shape[0], dtype=np.int64), p_slm, self.space)

    def edge_token(self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float,
                   rng: np.random.Generator | None = None) -> SyncedToken:
        fused = fuse(p_llm, p_slm, alpha)
        if self.space == "logit" and self.temperature > 0:
            fused = softmax(fused)  # pick_token draws from p**(1/T), and softmax(z)**(1/T) ∝ exp(z/T)
        return SyncedToken(pick_token(fused, temperature=self.temperature, rng=rng))
