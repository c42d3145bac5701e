"""What a policy decides and what the cloud observes, and the policy interface.

A *policy* runs on the edge once per decoding step.  Given the SLM's and the
LLM's next-token arrays (``p_slm`` conditioned on private context + public
query, ``p_llm`` on the public query only), it produces the one message that
leaves the device:

* cloud-side fusion: a :class:`CloudUpload` (sparse SLM values); the cloud then
  fuses ``alpha * p_llm + (1 - alpha) * upload`` and picks the token;
* edge-side fusion: a :class:`SyncedToken`; the edge has fused locally.

The returned object is both the decision and the exact payload the cloud sees,
so the SDK, the cloud adapter and the harness never re-derive it.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edge_sdk.privacy.accountant import ReleaseEvent
from edge_sdk.fusion import FusionSpace, certify_fused_top_k
from edge_sdk.protocol.signals import FUSION_MODES, CloudUpload, FusionMode, Observation, SyncedToken

if TYPE_CHECKING:
    from edge_sdk.backends.base import SLMBackend

class UnsupportedModeError(ValueError):
    """A policy was asked to act in a fusion mode it does not define."""


@dataclass
class Policy(ABC):
    """Base class of every defence (and of the undefended reference).

    Subclasses are small frozen-parameter dataclasses that override
    :meth:`cloud_upload`, :meth:`edge_token` or both, declare the modes they
    support in ``modes`` and the array space they expect in ``space``.  Every
    randomised policy takes an explicit ``numpy.random.Generator``.
    """

    name: ClassVar[str] = "policy"
    modes: ClassVar[frozenset[str]] = frozenset()
    #: per mode, what the policy's epsilon means ("per_token", "per_generation", "calibration" or "none")
    epsilon_units: ClassVar[Mapping[str, str]] = {}
    #: inputs are probabilities ("prob") or logits ("logit")
    space: FusionSpace = field(default="prob", init=False)

    @classmethod
    def from_backend(cls, backend: SLMBackend, **params: Any) -> Policy:
        """Build the policy for the edge model ``backend``.

        Most policies need nothing of the model; one that does (CusText's
        embedding neighbours) overrides this, so no caller special-cases a name.
        """
        return cls(**params)

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """What one step's signal costs in privacy (the event :class:`~edge_sdk.privacy.accountant.PrivacyAccountant`
        records per releasing step).  The default: none of it is DP (``eps = inf``)."""
        return ReleaseEvent.non_private(
            f"{self.name} is a heuristic with no DP guarantee: DecodeLeak measures its protection empirically"
        )

    def for_generation(self, max_new_tokens: int) -> Policy:
        """This policy calibrated for a generation of ``max_new_tokens`` tokens.

        The decoder calls it with the generation's length; a policy whose
        calibration spreads a budget over the tokens returns a recalibrated
        copy, the others themselves.
        """
        return self

    @classmethod
    def check_params(cls, **params: Any) -> None:
        """Raise ``ValueError`` for parameters the policy would refuse, building nothing from a model.

        The default builds the policy and drops it (every check sits in the constructor); a policy that
        :meth:`from_backend` completes from the edge model checks its own parameters without it.
        """
        cls(**params)

    def llm_support(self, mode: FusionMode) -> int | None:
        """How much of ``p_llm`` the decision reads, so a sparse cloud distribution can be certified.

        ``0``: the decision ignores ``p_llm``; ``k > 0``: it reads only the top
        ``k`` ids of ``p_fuse`` and ``p_llm`` on them (see
        :func:`edge_sdk.fusion.certify_fused_top_k`); ``None``: it needs the
        full distribution.  The default is the safe ``None``.
        """
        return None

    def max_upload(self, vocab_size: int) -> int:
        """The most values one cloud-side upload of this policy holds: a public number its rule fixes (every
        padded signal is the size of the largest, :func:`edge_sdk.protocol.wire.pad_edge_message`).  The default, the
        whole vocabulary, bounds every policy."""
        return vocab_size

    def needs_full_row(self, mode: FusionMode) -> bool:
        """Whether the decision reads the cloud's whole row: the edge then asks for it at *every* step.

        Otherwise the edge decides from the cloud's top values with every
        omitted id at the public fill
        (:meth:`edge_sdk.protocol.wire.CloudDistribution.filled`) and never asks.
        Either way whether a row is asked for depends on the policy and the
        mode alone: asking only when :meth:`decide_sparse` could not certify
        a decision told a cloud that shaped its row whether the SLM's top
        token was among the ids it left out.  The default: exactly when
        :meth:`llm_support` is ``None``.
        """
        return self.llm_support(mode) is None

    def decide_sparse(
        self,
        mode: FusionMode,
        p_slm: np.ndarray,
        p_llm_lower: np.ndarray,
        known_ids: np.ndarray,
        tail_bound: float,
        *,
        alpha: float,
        rng: np.random.Generator | None = None,
    ) -> Observation | None:
        """Decide from a sparse cloud distribution, or return ``None`` if it cannot be certified.

        ``p_llm_lower`` is exact on ``known_ids`` and 0 elsewhere, where the true
        values are at most ``tail_bound``.  The default certifies through
        :meth:`llm_support` (:func:`edge_sdk.fusion.certify_fused_top_k`); a
        policy may override it with a finer certificate.  A returned decision is
        always the one the full distribution would give; ``None`` means the
        sparse row does not pin it down.  The decoding loop does not use this
        (whether it asks for a row must not depend on ``p_slm``, see
        :meth:`needs_full_row`); ``benchmarks/sparse_rows.py`` measures with it
        how often a decision from the filled row can differ from the exact one.
        """
        support = self.llm_support(mode)
        if support is None or not certify_fused_top_k(
            p_slm, known_ids, p_llm_lower[known_ids], tail_bound, alpha, support
        ):
            return None
        return self.decide(mode, p_slm, p_llm_lower, alpha=alpha, rng=rng)

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        """Choose what of ``p_slm`` to upload for cloud-side fusion."""
        raise UnsupportedModeError(f"policy {self.name!r} does not define cloud-side fusion")

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        """Choose the token to synchronise for edge-side fusion."""
        raise UnsupportedModeError(f"policy {self.name!r} does not define edge-side fusion")

    def decide(
        self,
        mode: FusionMode,
        p_slm: np.ndarray,
        p_llm: np.ndarray,
        *,
        alpha: float,
        rng: np.random.Generator | None = None,
    ) -> Observation:
        """Dispatch to :meth:`cloud_upload` or :meth:`edge_token` by fusion mode."""
        if mode == "cloud":
            return self.cloud_upload(p_slm, p_llm, alpha=alpha, rng=rng)
        if mode == "edge":
            return self.edge_token(p_slm, p_llm, alpha=alpha, rng=rng)
        raise ValueError(f"fusion mode must be one of {FUSION_MODES}, got {mode!r}")

    def describe(self) -> str:
        """A short label with the policy's parameters, for tables and ledgers."""
        params = ", ".join(
            f"{k}={v}" for k, v in vars(self).items() if not k.startswith("_") and (k != "space" or v != "prob")
        )
        return f"{self.name}({params})" if params else self.name


def require_rng(rng: np.random.Generator | None, policy: str) -> np.random.Generator:
    """Randomised mechanisms refuse to run on hidden global randomness."""
    if rng is None:
        raise ValueError(f"policy {policy!r} is randomised: pass an explicit numpy.random.Generator as rng")
    return rng
