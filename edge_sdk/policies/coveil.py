"""CoVeil: per-step privacy-utility optimisation of what the cloud observes.

Both rules minimise ``J = -U + lambda * P`` (utility ``U``, privacy cost ``P``)
with one decision per step; see the paper's section "CoVeil" and appendix
"Defense Gradient Derivation".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import (
    FusionSpace,
    certify_fused_top_k,
    check_alpha,
    check_space,
    fuse,
    fuse_upload,
    in_top_k,
    max_omitted,
    rounding_margin,
    top_k_ids,
)
from edge_sdk.policies.base import Policy
from edge_sdk.protocol.signals import CloudUpload, FusionMode, SyncedToken


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
    alpha: float = DecodeSettings.alpha,
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
    ``g(y*)``.  ``space="logit"`` runs the authors' release on raw logits
    instead (:func:`coveil_upload_logit`).
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    if check_space(space) == "logit":
        return coveil_upload_logit(p_slm, p_llm, alpha=alpha, lam=lam, k=k)
    y_star = int(np.argmax(fuse(p_llm, p_slm, alpha)))
    return _upload_y_star_or_nothing(p_slm, y_star, float(p_llm[y_star]), alpha=alpha, lam=lam, k=k)


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
    alpha: float = DecodeSettings.alpha,
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
    alpha: float = DecodeSettings.alpha,
    lam: float = 1.0,
    k: int = 50,
    space: FusionSpace = "prob",
) -> int:
    """Edge-side CoVeil: the token to synchronise.

    ``C = TopK(p_fuse, k)``, ``y* = argmax p_fuse`` and::

        J(i) = -(p_fuse(i) - p_fuse(y*)) + lam * (p_slm(i) - p_llm(i))

    returns ``argmin_{i in C} J(i)``, ties to the higher ``p_fuse`` and then
    the lower id.  ``space="logit"`` runs the authors' release on raw logits
    instead (:func:`coveil_select_logit`).
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    if check_space(space) == "logit":
        return coveil_select_logit(p_slm, p_llm, alpha=alpha, lam=lam, k=k)
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
    alpha: float = DecodeSettings.alpha,
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


# --------------------------------------------------------------------------- logit space (the authors' release)
#
# The release works on raw model logits z (not log-probabilities) and its rules differ from the paper's
# probability-space ones in both modes.  Ties: TopK and argmax go to the lower id (np.argmax's first
# occurrence, as torch.argmax); candidate lists are ordered by decreasing z_llm, ties to the lower id.
# Arithmetic is float32 as in the release, so boundary cases (an objective of exactly 0) agree with it.


def _masked_fusion(z_slm: np.ndarray, z_llm: np.ndarray, candidates: np.ndarray, alpha: float) -> np.ndarray:
    """``r = alpha * z_llm`` with ``(1 - alpha) * z_slm`` added on ``candidates`` only (float32, full row)."""
    return fuse_upload(z_llm, candidates, z_slm[candidates], alpha)


def _release_upload_rule(
    z_slm_c: np.ndarray, z_llm_c: np.ndarray, candidates: np.ndarray, winner: int, *, alpha: float, lam: float
) -> np.ndarray:
    """``S = {c in C : -(1-alpha) z_S(c) (1[c=w] - 1/K) + lam |z_S(c) - z_L(c)| < 0}``, ascending (float32)."""
    indicator = (candidates == winner).astype(np.float32) - np.float32(1.0 / len(candidates))
    utility = np.float32(1.0 - alpha) * z_slm_c * indicator
    privacy = np.float32(lam) * np.abs(z_slm_c - z_llm_c)
    return np.sort(candidates[-utility + privacy < 0])


def coveil_upload_logit(
    z_slm: np.ndarray, z_llm: np.ndarray, *, alpha: float = 0.5, lam: float = 1.0, k: int = 50
) -> np.ndarray:
    """Cloud-side CoVeil on raw logits, as the authors' release does it: the ids of ``z_slm`` to upload.

    ::

        C  = TopK(z_S, K)
        r  = alpha * z_L,  r[C] += (1 - alpha) * z_S[C]          (the SLM counts on C only)
        w  = argmax r
        g(c) = -(1 - alpha) * z_S(c) * (1[c = w] - 1/K) + lam * |z_S(c) - z_L(c)|
        S  = {c in C : g(c) < 0}

    The cloud then fuses ``alpha * z_L + (1 - alpha) * m * z_S`` with ``m`` the
    indicator of ``S``.  Unlike probability space several ids can be uploaded,
    and an uploaded negative logit lowers its token.
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    candidates = top_k_ids(z_slm, k)
    winner = int(np.argmax(_masked_fusion(z_slm, z_llm, candidates, alpha)))
    return _release_upload_rule(
        z_slm[candidates], z_llm[candidates], candidates, winner, alpha=alpha, lam=lam
    )


def coveil_upload_logit_sparse(
    z_slm: np.ndarray,
    known_ids: np.ndarray,
    known_llm: np.ndarray,
    tail_bound: float,
    *,
    alpha: float = 0.5,
    lam: float = 1.0,
    k: int = 50,
) -> np.ndarray | None:
    """:func:`coveil_upload_logit` from the cloud's top-M logits; ``None`` unless provably the same.

    The rule reads ``z_L`` on ``C`` and everywhere through ``w = argmax r``.
    Certified when every id of ``C`` was sent and the best ``r`` over the sent
    ids beats ``alpha * b`` (``b`` = ``tail_bound`` >= every omitted ``z_L``):
    an omitted id lies outside ``C``, so its ``r = alpha * z_L <= alpha * b``.
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    candidates = top_k_ids(z_slm, k)
    position = _positions(known_ids, candidates)
    if position is None:
        return None
    r_known = np.float32(alpha) * np.asarray(known_llm, dtype=np.float32)
    in_pool = np.flatnonzero(np.isin(known_ids, candidates))
    r_known[in_pool] += np.float32(1.0 - alpha) * z_slm[known_ids[in_pool]]
    sizes = np.abs(alpha * known_llm.astype(np.float64))
    sizes[in_pool] += np.abs((1.0 - alpha) * z_slm[known_ids[in_pool]].astype(np.float64))
    winner = _certified_argmax(known_ids, r_known, sizes, alpha * tail_bound, abs(alpha * tail_bound),
                               complete=len(known_ids) == z_slm.shape[0])
    if winner is None:
        return None
    return _release_upload_rule(
        z_slm[candidates], np.asarray(known_llm, dtype=np.float32)[position], candidates, winner, alpha=alpha, lam=lam
    )


def _positions(known_ids: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
    """Where each of ``ids`` sits in ``known_ids``; ``None`` if one of them is not known."""
    order = np.argsort(known_ids, kind="stable")
    at = np.searchsorted(known_ids, ids, sorter=order)
    at = np.minimum(at, len(known_ids) - 1)
    found = order[at]
    if len(known_ids) == 0 or not np.array_equal(known_ids[found], ids):
        return None
    return found


def _certified_argmax(
    ids: np.ndarray, scores: np.ndarray, sizes: np.ndarray, omitted_bound: float, bound_size: float, *,
    complete: bool,
) -> int | None:
    """``argmax`` over the whole row, from the scores of ``ids`` and a bound on every other id's score.

    The lowest id among the best known scores wins (np.argmax's tie rule);
    ``None`` unless it beats ``omitted_bound`` by more than float32 rounding
    (an omitted id could otherwise win or tie).  Scores and bound are sums of
    weighted terms (``sizes[i]``, ``bound_size``: the sums of their terms'
    absolute values): the rounding scales with those, not with a sum that may
    nearly cancel.
    """
    best_score = scores.max()
    best = int(ids[scores == best_score].min())
    if complete:
        return best
    at = int(np.flatnonzero(ids == best)[0])
    if not float(best_score) > omitted_bound + rounding_margin(float(sizes[at]) + bound_size):
        return None
    return best


def _release_candidates(z_llm: np.ndarray, k: int, extra: list[int]) -> np.ndarray:
    """``TopK(z_L, k)`` plus ``extra``, unique, by decreasing ``z_L`` (ties to the lower id)."""
    ids = np.unique(np.concatenate([top_k_ids(z_llm, k), np.asarray(extra, dtype=np.int64)]))
    return ids[np.lexsort((ids, -z_llm[ids]))]


def _release_select_rule(
    z_slm: np.ndarray, z_llm: np.ndarray, candidates: np.ndarray, winner: int, *, alpha: float, lam: float
) -> int:
    """``argmin_{c in C} u(c) + lam * p(c)`` (first in ``C``'s order on ties), float32 as the release.

    ``u(c) = -(1-alpha) z_S(c) (1[c=w] - 1/|C|)``,
    ``p(c) = (z_S(c) - mean_C z_S) - (z_L(c) - mean_C z_L)``.
    """
    small, large = z_slm[candidates], z_llm[candidates]
    indicator = (candidates == winner).astype(np.float32) - np.float32(1.0 / len(candidates))
    utility_cost = -(np.float32(1.0 - alpha) * small * indicator)
    privacy_cost = (small - small.mean(dtype=np.float32)) - (large - large.mean(dtype=np.float32))
    return int(candidates[int(np.argmin(utility_cost + np.float32(lam) * privacy_cost))])


def coveil_select_logit(
    z_slm: np.ndarray, z_llm: np.ndarray, *, alpha: float = 0.5, lam: float = 1.0, k: int = 50
) -> int:
    """Edge-side CoVeil on raw logits, as the authors' release does it: the token to synchronise.

    ::

        f = alpha * z_L + (1 - alpha) * z_S
        C = TopK(z_L, K) ∪ {argmax f, argmax z_L}                 (ordered by decreasing z_L)
        r = alpha * z_L,  r[C] += (1 - alpha) * z_S[C],  w = argmax r
            (if w is not in C: add it to C and recompute r and w once)
        u(c) = -(1 - alpha) * z_S(c) * (1[c = w] - 1/|C|)
        p(c) = (z_S(c) - mean_C z_S) - (z_L(c) - mean_C z_L)
        choose argmin_{c in C} u(c) + lam * p(c)
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    fused_top = int(np.argmax(fuse(z_llm, z_slm, alpha)))
    candidates = _release_candidates(z_llm, k, [fused_top, int(np.argmax(z_llm))])
    winner = int(np.argmax(_masked_fusion(z_slm, z_llm, candidates, alpha)))
    if winner not in candidates:
        candidates = _release_candidates(z_llm, k, [*candidates.tolist(), winner])
        winner = int(np.argmax(_masked_fusion(z_slm, z_llm, candidates, alpha)))
    return _release_select_rule(z_slm, z_llm, candidates, winner, alpha=alpha, lam=lam)


def coveil_select_logit_sparse(
    z_slm: np.ndarray,
    known_ids: np.ndarray,
    known_llm: np.ndarray,
    tail_bound: float,
    *,
    alpha: float = 0.5,
    lam: float = 1.0,
    k: int = 50,
) -> int | None:
    """:func:`coveil_select_logit` from the cloud's top-M logits; ``None`` unless provably the same.

    With every omitted ``z_L(j) <= b``:

    1. ``TopK(z_L, K)`` is known when the ``K``-th sent value exceeds ``b``
       (``known_ids`` come by decreasing value, so it is their first ``K``);
    2. ``argmax f`` is known when the best sent ``f`` beats
       ``alpha * b + (1 - alpha) * max_{j omitted} z_S(j)``;
    3. each ``w = argmax r`` is known when the best sent ``r`` beats ``alpha * b``
       (omitted ids are outside ``C``, where ``r = alpha * z_L``).

    Then ``C``, ``w`` and both costs read only sent values.
    """
    alpha = check_alpha(alpha)
    _check(lam, k)
    vocab = z_slm.shape[0]
    known_ids = np.asarray(known_ids, dtype=np.int64)
    known_llm = np.asarray(known_llm, dtype=np.float32)
    complete = len(known_ids) == vocab
    pool = min(k, vocab)
    if len(known_ids) < pool or (not complete and len(known_ids) > pool and not known_llm[pool - 1] > tail_bound):
        return None
    if not complete and len(known_ids) == pool:
        return None  # the K-th sent value is the bound itself: an omitted id may tie it
    known_slm = z_slm[known_ids]
    fused_known = fuse(known_llm, known_slm, alpha)
    slm_omitted = max_omitted(z_slm, known_ids)
    fused_bound = alpha * tail_bound + (1.0 - alpha) * slm_omitted
    llm_sizes = np.abs(alpha * known_llm.astype(np.float64))
    slm_sizes = np.abs((1.0 - alpha) * known_slm.astype(np.float64))
    bound_size = abs(alpha * tail_bound) + (abs((1.0 - alpha) * slm_omitted) if np.isfinite(slm_omitted) else 0.0)
    fused_top = _certified_argmax(known_ids, fused_known, llm_sizes + slm_sizes, fused_bound, bound_size,
                                  complete=complete)
    if fused_top is None:
        return None
    z_llm_lower = np.full(vocab, np.finfo(np.float32).min, dtype=np.float32)  # exact on the sent ids
    z_llm_lower[known_ids] = known_llm
    top_ids = known_ids[np.lexsort((known_ids, -known_llm))[:pool]]
    candidates = _release_candidates(z_llm_lower, 0, [*top_ids.tolist(), fused_top])

    def winner_of(pool_ids: np.ndarray) -> int | None:
        r_known = np.float32(alpha) * known_llm
        inside = np.isin(known_ids, pool_ids)
        r_known[inside] += np.float32(1.0 - alpha) * known_slm[inside]
        return _certified_argmax(known_ids, r_known, np.where(inside, llm_sizes + slm_sizes, llm_sizes),
                                 alpha * tail_bound, abs(alpha * tail_bound), complete=complete)

    winner = winner_of(candidates)
    if winner is None:
        return None
    if winner not in candidates:
        candidates = _release_candidates(z_llm_lower, 0, [*candidates.tolist(), winner])
        winner = winner_of(candidates)
        if winner is None:
            return None
    return _release_select_rule(z_slm, z_llm_lower, candidates, winner, alpha=alpha, lam=lam)


@dataclass
class CoVeil(Policy):
    """CoVeil in both fusion modes (the SDK's default policy).

    Args:
        lam: privacy weight lambda (0 = pure utility).
        k: candidate pool size ``|C|``.
        space: ``"prob"`` (the paper, default) or ``"logit"`` (the authors' release: raw logits and its rules,
            :func:`coveil_upload_logit`, :func:`coveil_select_logit`; the release used ``alpha = 0.5``).
    """

    name = "coveil"
    modes = frozenset({"cloud", "edge"})
    epsilon_units = {"cloud": "none", "edge": "none"}  # a heuristic defence: no DP budget (lam is its knob)

    lam: float = 1.0
    k: int = 50
    space: FusionSpace = "prob"

    def __post_init__(self) -> None:
        _check(self.lam, self.k)
        check_space(self.space)

    def llm_support(self, mode: FusionMode) -> int | None:
        # cloud-side reads y* = argmax p_fuse and p_llm(y*); edge-side reads TopK(p_fuse) and p_llm on it.
        # Logit space has certificates of its own (decide_sparse); the generic one does not apply.
        if self.space == "logit":
            return None
        return 1 if mode == "cloud" else self.k

    def max_upload(self, vocab_size: int) -> int:
        # probability space: nothing or y*; logit space: a subset of the k candidates
        return min(1 if self.space == "prob" else self.k, vocab_size)

    def needs_full_row(self, mode: FusionMode) -> bool:
        return False  # both rules in both spaces decide from the top values at the public fill

    def decide_sparse(self, mode: FusionMode, p_slm: np.ndarray, p_llm_lower: np.ndarray, known_ids: np.ndarray,
                      tail_bound: float, *, alpha: float, rng: np.random.Generator | None = None
                      ) -> CloudUpload | SyncedToken | None:
        known_llm = p_llm_lower[known_ids]
        if self.space == "logit":
            if mode == "cloud":
                ids = coveil_upload_logit_sparse(p_slm, known_ids, known_llm, tail_bound, alpha=alpha,
                                                 lam=self.lam, k=self.k)
                return None if ids is None else CloudUpload.of(p_slm, ids, self.space)
            token = coveil_select_logit_sparse(p_slm, known_ids, known_llm, tail_bound, alpha=alpha,
                                               lam=self.lam, k=self.k)
            return None if token is None else SyncedToken(token)
        if mode == "cloud":
            ids = coveil_upload_sparse(p_slm, known_ids, known_llm, tail_bound, alpha=alpha, lam=self.lam, k=self.k)
            return None if ids is None else CloudUpload.of(p_slm, ids, self.space)
        decision = super().decide_sparse(mode, p_slm, p_llm_lower, known_ids, tail_bound, alpha=alpha, rng=rng)
        if decision is not None:
            return decision
        token = coveil_select_sparse(p_slm, p_llm_lower, known_ids, tail_bound, alpha=alpha, lam=self.lam, k=self.k)
        return None if token is None else SyncedToken(token)

    def cloud_upload(self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float,
                     rng: np.random.Generator | None = None) -> CloudUpload:
        ids = coveil_upload(p_slm, p_llm, alpha=alpha, lam=self.lam, k=self.k, space=self.space)
        return CloudUpload.of(p_slm, ids, self.space)

    def edge_token(self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float,
                   rng: np.random.Generator | None = None) -> SyncedToken:
        return SyncedToken(coveil_select(p_slm, p_llm, alpha=alpha, lam=self.lam, k=self.k, space=self.space))
