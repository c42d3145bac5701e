"""How far a quantised edge model's next-token distribution drifts from its reference, one step at a time.

Along one shared prefix (the same tokens fed to both), step ``t`` gives the reference SLM's logits
``z_ref``, the quantised SLM's ``z_q`` and the cloud LLM's ``z_llm``; with ``p = softmax(z)``:

* ``KL(p_ref || p_q) = sum_i p_ref(i) * (log p_ref(i) - log p_q(i))`` in nats (float64 log-softmax, so
  tokens with vanishing probability neither overflow nor vanish);
* top-K overlap ``|TopK(z_ref) ∩ TopK(z_q)| / K`` (``TopK`` of the logits is ``TopK`` of the probabilities;
  ties to the lower id, as everywhere in the SDK), for K = 10 and 100;
* top-1 agreement ``argmax z_ref == argmax z_q`` (what greedy decoding of the SLM alone would pick);
* CoVeil agreement: the policy's decision on ``(x_ref, x_llm)`` equals its decision on ``(x_q, x_llm)``,
  the same cloud LLM row for both: the same upload ids cloud-side, the same synchronised token edge-side.
  ``x`` is what the decoding loop hands the policy: ``softmax(z)`` in float32 in probability space, ``z`` in
  logit space; edge-side, while the stopping rule does not yet allow an end, the end-of-generation ids are
  lowered to the space's floor in both rows, as the loop does (cloud-side the cloud is told instead).

Pure numpy: :class:`StepReference` computes the reference's side once per step and compares any number of
quantised rows with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_sdk.fusion import softmax, top_k_ids
from edge_sdk.policies.base import Policy
from edge_sdk.protocol.signals import CloudUpload, FusionMode, Observation

#: the K of the top-K overlaps reported
OVERLAP_KS = (10, 100)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log p(i) = z(i) - max z - log sum_j exp(z(j) - max z)`` in float64."""
    z = np.asarray(logits, dtype=np.float64)
    shifted = z - z.max()
    return shifted - np.log(np.exp(shifted).sum())


def _kl(log_ref: np.ndarray, log_q: np.ndarray) -> float:
    # clipped at 0: float rounding can make a KL of two equal rows a hair negative
    return max(0.0, float(np.dot(np.exp(log_ref), log_ref - log_q)))


def kl_divergence(z_ref: np.ndarray, z_q: np.ndarray) -> float:
    """``KL(softmax(z_ref) || softmax(z_q))`` in nats (>= 0; 0 exactly when the two rows differ by a constant)."""
    return _kl(log_softmax(z_ref), log_softmax(z_q))


def _overlap(top_ref: np.ndarray, top_q: np.ndarray, k: int) -> float:
    """Overlap of the first ``k`` of two id lists ordered by decreasing value."""
    k = min(k, len(top_ref))
    return len(np.intersect1d(top_ref[:k], top_q[:k])) / k


def top_k_overlap(z_ref: np.ndarray, z_q: np.ndarray, k: int) -> float:
    """``|TopK(z_ref) ∩ TopK(z_q)| / K``: the share of the reference's K best ids the other row also ranks there."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return _overlap(top_k_ids(np.asarray(z_ref), k), top_k_ids(np.asarray(z_q), k), k)


def policy_inputs(logits: np.ndarray, space: str, floored_ids: np.ndarray | None = None) -> np.ndarray:
    """The row the decoding loop gives a policy: ``softmax(z)`` (float32) or ``z``, with ``floored_ids`` at the
    space's floor (0, or float32's minimum for logits)."""
    if space == "logit":
        row = np.array(logits, dtype=np.float32)
        floor = np.finfo(np.float32).min
    else:
        row = softmax(logits)
        floor = 0.0
    if floored_ids is not None and floored_ids.size:
        row[floored_ids] = floor
    return row


def same_decision(a: Observation, b: Observation) -> bool:
    """Whether two decisions send the cloud the same thing: the same upload ids, or the same token."""
    if isinstance(a, CloudUpload) and isinstance(b, CloudUpload):
        return bool(np.array_equal(a.ids, b.ids))
    if isinstance(a, CloudUpload) or isinstance(b, CloudUpload):
        return False
    return a.token_id == b.token_id


@dataclass(frozen=True)
class StepDrift:
    """One step's comparison of a quantised row with the reference (see the module docstring)."""

    kl: float
    top1_agrees: bool
    overlaps: tuple[float, ...]  # top-K overlap for each K of OVERLAP_KS
    decision_agrees: bool


class StepReference:
    """The reference's side of one step: its log-probabilities, its top ids and the policy's decision.

    Args:
        z_ref: the reference SLM's logits.
        z_llm: the cloud LLM's logits at the same step (public prompt + the same prefix).
        policy: the policy whose decisions are compared (CoVeil); deterministic.
        mode: the fusion mode whose decision is compared.
        alpha: the cloud LLM's fusion weight.
        end_ids: end-of-generation ids to floor (edge-side) because the stopping rule does not allow an end yet.
    """

    def __init__(self, z_ref: np.ndarray, z_llm: np.ndarray, *, policy: Policy, mode: FusionMode, alpha: float,
                 end_ids: Sequence[int] = ()) -> None:
        self.policy, self.mode, self.alpha = policy, mode, alpha
        self.log_p = log_softmax(z_ref)
        self.top = top_k_ids(np.asarray(z_ref), max(OVERLAP_KS))
        self.floored = np.asarray(end_ids, dtype=np.int64) if mode == "edge" else None
        self.x_llm = policy_inputs(z_llm, policy.space, self.floored)
        self.decision = self._decide(z_ref)

    def _decide(self, z_slm: np.ndarray) -> Observation:
        return self.policy.decide(self.mode, policy_inputs(z_slm, self.policy.space, self.floored), self.x_llm,
                                  alpha=self.alpha)

    def compare(self, z_q: np.ndarray) -> StepDrift:
        """The quantised row ``z_q`` against this reference step."""
        top_q = top_k_ids(np.asarray(z_q), len(self.top))
        return StepDrift(
            kl=_kl(self.log_p, log_softmax(z_q)),
            top1_agrees=bool(self.top[0] == top_q[0]),
            overlaps=tuple(_overlap(self.top, top_q, k) for k in OVERLAP_KS),
            decision_agrees=same_decision(self.decision, self._decide(z_q)),
        )
