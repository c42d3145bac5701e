"""CoGenesis (Zhang et al., ACL 2024), cloud-side: upload the SLM's top-``B`` probabilities.

The original code fuses on the device with the LLM's top-10 log-probabilities;
the paper's adaptation, followed here, sends the SLM's top-``B`` to the cloud
instead.  ``B`` is a support size, not a privacy budget: CoGenesis makes no DP
claim (``epsilon_units`` says "none").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk.fusion import top_k_ids
from edge_sdk.policies.base import Policy
from edge_sdk.protocol.signals import CloudUpload, FusionMode
from edge_sdk.privacy.analysis import EpsilonUnit, check_positive_int


def cogenesis_upload_ids(p_slm: np.ndarray, b: int) -> np.ndarray:
    """CoGenesis' support: ``TopB(p_slm)`` (``min(B, V)`` ids, ascending).

    The cloud receives ``p_slm`` on these ids as is: the values are *not*
    renormalised, so the cloud fuses ``alpha * p_llm + (1 - alpha) * m * p_slm``
    with ``m`` the support's indicator, exactly as for any other upload.
    """
    return np.sort(top_k_ids(p_slm, check_positive_int(b, "CoGenesis upload size B")))


@dataclass
class CoGenesis(Policy):
    """CoGenesis, cloud-side: upload ``p_slm`` on its top ``B`` ids.

    Args:
        b: upload size ``B`` (the swept parameter; 10 matches the original code).
    """

    name = "cogenesis"
    modes = frozenset({"cloud"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"cloud": "none"}

    b: int = 10

    def __post_init__(self) -> None:
        check_positive_int(self.b, "CoGenesis upload size B")

    def max_upload(self, vocab_size: int) -> int:
        return min(self.b, vocab_size)

    def llm_support(self, mode: FusionMode) -> int | None:
        return 0  # the upload ignores p_llm

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        return CloudUpload.of(p_slm, cogenesis_upload_ids(p_slm, self.b))
