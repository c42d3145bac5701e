"""CoVeil: per-step privacy-utility optimisation of what the cloud observes.

Both rules minimise ``J = -U + lambda * P`` (utility ``U``, privacy cost ``P``)
with one decision per step; see the paper's section "CoVeil" and appendix
"Defense Gradient Derivation".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sdk.fusion import (
    FusionSpace,
    certify_fused_top_k,
    check_alpha,
    check_space,
    fuse,
    in_top_k,
    max_omitted,
    rounding_margin,
    top_k_ids,
)
from edge_sdk.policies.base import CloudUpload, FusionMode, Policy, SyncedToken


def _check(lam: float, k: int) -> None:
    if not lam >= 0:
        raise ValueError(f"privacy weight lam must be >= 0, got {lam}")
    if k < 1:
        raise ValueError(f"candidate pool size k must be >= 1, got {k}")


def coveil_upload_scores(
    p_slm: np.ndarray, p_llm: np.ndarray, candidates: np.ndarray, y_star: int, *, alpha: float, lam: float
) -> np.ndarray:
    """The Taylor coefficients ``g(i)`` of the cloud-side objective at ``m = 0``::

        g(i) = -(1 - alpha) * p_slm(i) * (1[i = y*] - 1/|C|) + lam * |p_slm(i) - p_llm(i)|

    for each ``i`` in ``candidates`` (``C``).
    """
    s = p_slm[candidates].astype(np.float64)
    indicator = (candidates == y_star).astype(np.float64)
    return -(1.0 - alpha) * s * (indicator - 1.0 / len(candidates)) + lam * np.abs(s - p_llm[candidates])


def coveil_upload(
    p_slm: np.ndarray,
    p_llm: np.ndarray,
    *,
    alpha: float = 0.3,
    lam: float = 1.0,
    k: int = 50,
    space: FusionSpace = "prob",
) -> np.ndarray:
    """Cloud-side CoVeil: the ids of ``p_slm`` to upload, ascending.

    ``C = TopK(p_slm, k)``, ``y* = argmax(alpha * p_llm + (1 - alpha) * p_slm)``
    and the upload is ``S = {i in C : g(i) < 0}`` with ``g`` from
    :func:`coveil_upload_scores`.

    In probability space ``g(i) >= 0`` for every ``i != y*`` (both of its
    terms are non-negative), so ``S`` is empty or ``{y*}``: the fast path
    decides only ``y* in C`` (a rank count, no selection) and the sign of
    ``g(y*)``.  Logit space runs the general rule (logits can be negative).
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    y_star = int(np.argmax(fuse(p_llm, p_slm, alpha)))
    if check_space(space) == "prob":
        return _upload_y_star_or_nothing(p_slm, y_star, float(p_llm[y_star]), alpha=alpha, lam=lam, k=k)
    candidates = top_k_ids(p_slm, k)
    g = coveil_upload_scores(p_slm, p_llm, candidates, y_star, alpha=alpha, lam=lam)
    return np.sort(candidates[g < 0])


def _upload_y_star_or_nothing(
    p_slm: np.ndarray, y_star: int, p_llm_y_star: float, *, alpha: float, lam: float, k: int
) -> np.ndarray:
    """Probability space: ``S = {y*}`` if ``y* in C`` and ``g(y*) < 0``, else empty."""
    if not in_top_k(p_slm, y_star, k):
        return np.empty(0, dtype=np.int64)
    pool = min(k, p_slm.shape[0])
    s = float(p_slm[y_star])
    g = -(1.0 - alpha) * s * (1.0 - 1.0 / pool) + lam * abs(s - p_llm_y_star)
    return np.array([y_star] if g < 0 else [], dtype=np.int64)


def coveil_upload_sparse(
    p_slm: np.ndarray,
    known_ids: np.ndarray,
    known_llm: np.ndarray,
    tail_bound: float,
    *,
    alpha: float = 0.3,
    lam: float = 1.0,
    k: int = 50,
) -> np.ndarray | None:
    """Cloud-side CoVeil (probability space) from a sparse ``p_llm``; ``None`` unless certified.

    The rule reads ``p_llm`` at ``y*`` only.  When :func:`certify_fused_top_k`
    shows that ``y* = argmax p_fuse`` is a known id (every omitted id's
    ``p_fuse`` stays below the best known one), ``y*`` is the argmax over the
    known ids (ties to the lower id, as ``np.argmax`` over the vocabulary) and
    the upload equals :func:`coveil_upload` on the full ``p_llm``, without
    fusing the whole vocabulary.
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    if not certify_fused_top_k(p_slm, known_ids, known_llm, tail_bound, alpha, 1):
        return None
    fused_known = fuse(known_llm, p_slm[known_ids], alpha)
    at_best = fused_known == fused_known.max()
    best = int(np.argmin(np.where(at_best, known_ids, np.iinfo(np.int64).max)))
    y_star = int(known_ids[best])
    return _upload_y_star_or_nothing(p_slm, y_star, float(known_llm[best]), alpha=alpha, lam=lam, k=k)


def coveil_select(
    p_slm: np.ndarray,
    p_llm: np.ndarray,
    *,
    alpha: float = 0.3,
    lam: float = 1.0,
    k: int = 50,
) -> int:
    """Edge-side CoVeil: the token to synchronise.

    ``C = TopK(p_fuse, k)``, ``y* = argmax p_fuse`` and::

        J(i) = -(p_fuse(i) - p_fuse(y*)) + lam * (p_slm(i) - p_llm(i))

    returns ``argmin_{i in C} J(i)``, ties to the higher ``p_fuse`` and then
    the lower id.  The same rule applies to logits (pass them for both arrays).
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    p_fuse = fuse(p_llm, p_slm, alpha)
    candidates = top_k_ids(p_fuse, k)  # by decreasing p_fuse, ties to the lower id
    if lam == 0.0:
        return int(candidates[0])
    fused = p_fuse[candidates].astype(np.float64)
    objective = -(fused - fused[0]) + lam * (
        p_slm[candidates].astype(np.float64) - p_llm[candidates].astype(np.float64)
    )
    # candidates are already in tie-break order, so the first minimum wins
    return int(candidates[int(np.argmin(objective))])


def _omitted_upper_bounds(
    p_slm: np.ndarray, known: np.ndarray, alpha: float, tail_bound: float, lowest: float
) -> tuple[np.ndarray, np.ndarray]:
    """The omitted ids whose ``ub(j) = alpha*b + (1-alpha)*p_slm(j)`` may reach ``lowest``, and their ``ub``.

    ``ub`` is evaluated in float64 exactly as over the whole vocabulary, but
    only on the ids a float32 pre-filter keeps: ``ub`` grows with ``p_slm(j)``,
    so every id with ``ub(j) >= lowest`` has ``p_slm(j)`` at least the cut
    below, lowered by 1e-6 of the magnitudes involved (float64 rounding is
    ~1e-16 of them); the exact test then runs on those few.  Every comparison
    of ``ub`` with a level ``>= lowest`` thus sees the same ids and values as a
    full pass would.
    """
    if alpha < 1.0:
        cut = (lowest - alpha * tail_bound) / (1.0 - alpha)
        cut -= 1e-6 * (abs(lowest) + abs(alpha * tail_bound)) / (1.0 - alpha) + 1e-30
        ids = np.flatnonzero(p_slm >= np.float32(max(cut, np.finfo(np.float32).min)))
    else:  # ub(j) = b for every omitted id
        ids = np.arange(p_slm.shape[0])
    ids = ids[~known[ids]]
    upper = alpha * tail_bound + (1.0 - alpha) * p_slm[ids].astype(np.float64)
    keep = upper >= lowest
    return ids[keep], upper[keep]


def coveil_select_sparse(
    p_slm: np.ndarray,
    p_llm_lower: np.ndarray,
    known_ids: np.ndarray,
    tail_bound: float,
    *,
    alpha: float = 0.3,
    lam: float = 1.0,
    k: int = 50,
) -> int | None:
    """Edge-side CoVeil from a sparse ``p_llm``; ``None`` unless the choice is provably the full one.

    ``p_llm_lower`` is exact on ``known_ids`` and 0 elsewhere; every omitted
    ``p_llm(j) <= b`` (``tail_bound``).  With ``p_fuse`` computed from it (exact
    on known ids, a lower bound elsewhere) and ``ub(j) = alpha*b + (1-alpha)*p_slm(j)``
    bounding an omitted token's true ``p_fuse``, the choice ``c`` (the argmin of
    ``J`` over the known tokens of ``TopK``) is certified when

    1. ``y*`` is known and beats every ``ub(j)``, so ``p_fuse(y*)`` is exact;
    2. ``c`` stays in the true ``TopK``: fewer than ``k`` tokens can reach its ``p_fuse``;
    3. every omitted ``j`` that could enter ``TopK`` (``ub(j) >= t``, ``t`` the
       ``k``-th largest lower bound) loses even at its best, ``p_llm(j) = b``::

           J(j) >= p_fuse(y*) + (lam - 1 + alpha) * p_slm(j) - (alpha + lam) * b  >  J(c)

    (``J`` decreases in ``p_llm(j)``).  Catches the steps where a token the
    cloud left out could enter ``TopK`` but could never be chosen.
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    known = np.zeros(p_slm.shape[0], dtype=bool)
    known[known_ids] = True
    p_fuse = fuse(p_llm_lower, p_slm, alpha)
    candidates = top_k_ids(p_fuse, k)
    y_star = int(candidates[0])
    fused_star = float(p_fuse[y_star])
    upper_max = alpha * tail_bound + (1.0 - alpha) * max_omitted(p_slm, known_ids)  # -inf if every id was sent
    if not known[y_star] or (np.isfinite(upper_max) and fused_star <= upper_max + rounding_margin(upper_max)):
        return None
    known_candidates = candidates[known[candidates]]
    fused = p_fuse[known_candidates].astype(np.float64)
    objective = -(fused - fused_star) + lam * (
        p_slm[known_candidates].astype(np.float64) - p_llm_lower[known_candidates].astype(np.float64)
    )
    best = int(np.argmin(objective))
    choice, fused_choice, j_choice = int(known_candidates[best]), float(fused[best]), float(objective[best])
    threshold = float(p_fuse[candidates[-1]])
    if fused_choice <= threshold:
        return None  # c sits on the edge of TopK: a tie could push it out
    lowest = threshold - rounding_margin(threshold)  # below every level ``upper`` is compared with
    omitted, upper = _omitted_upper_bounds(p_slm, known, alpha, tail_bound, lowest)
    reach_c = best + int(np.count_nonzero(upper >= fused_choice - rounding_margin(fused_choice)))
    if reach_c >= k:
        return None
    if int(np.count_nonzero(known & (p_fuse >= threshold))) > len(known_candidates):
        return None  # a known token ties the TopK boundary from outside: it could still enter
    entering = omitted[upper >= lowest]
    if entering.size:
        j_best_case = fused_star + (lam - 1.0 + alpha) * p_slm[entering].astype(np.float64) - (alpha + lam) * tail_bound
        if float(j_best_case.min()) <= j_choice + rounding_margin(j_choice):
            return None
    return choice


@dataclass
class CoVeil(Policy):
    """CoVeil in both fusion modes (the SDK's default policy).

    Args:
        lam: privacy weight lambda (0 = pure utility).
        k: candidate pool size ``|C|``.
        space: ``"prob"`` (the paper) or ``"logit"`` (the authors' release).
    """

    name = "coveil"
    modes = frozenset({"cloud", "edge"})

    lam: float = 1.0
    k: int = 50
    space: FusionSpace = "prob"

    def __post_init__(self) -> None:
        _check(self.lam, self.k)
        check_space(self.space)

    def llm_support(self, mode: FusionMode) -> int | None:
        # cloud-side reads y* = argmax p_fuse and p_llm(y*); edge-side reads TopK(p_fuse) and p_llm on it.
        # In logit space the cloud-side pool TopK(z_slm) may read z_llm anywhere, so ask for everything.
        if self.space == "logit":
            return None
        return 1 if mode == "cloud" else self.k

    def decide_sparse(self, mode, p_slm, p_llm_lower, known_ids, tail_bound, *, alpha, rng=None):
        if mode == "cloud" and self.space == "prob":
            ids = coveil_upload_sparse(p_slm, known_ids, p_llm_lower[known_ids], tail_bound, alpha=alpha,
                                       lam=self.lam, k=self.k)
            return None if ids is None else CloudUpload.of(p_slm, ids, self.space)
        decision = super().decide_sparse(mode, p_slm, p_llm_lower, known_ids, tail_bound, alpha=alpha, rng=rng)
        if decision is not None or mode != "edge" or self.space != "prob":
            return decision
        token = coveil_select_sparse(p_slm, p_llm_lower, known_ids, tail_bound, alpha=alpha, lam=self.lam, k=self.k)
        return None if token is None else SyncedToken(token)

    def cloud_upload(self, p_slm, p_llm, *, alpha, rng=None) -> CloudUpload:
        ids = coveil_upload(p_slm, p_llm, alpha=alpha, lam=self.lam, k=self.k, space=self.space)
        return CloudUpload.of(p_slm, ids, self.space)

    def edge_token(self, p_slm, p_llm, *, alpha, rng=None) -> SyncedToken:
        return SyncedToken(coveil_select(p_slm, p_llm, alpha=alpha, lam=self.lam, k=self.k))
