"""Fusion math shared by the edge SDK, the cloud adapter and the harness.

Everything here is a small pure numpy function over one decoding step's
full-vocabulary arrays.  Two fusion spaces are supported:

* ``"prob"`` (the paper's definition, the default)::

      p_fuse = alpha * p_llm + (1 - alpha) * p_slm

* ``"logit"`` (what the authors' public release does, with alpha = 0.5)::

      z_fuse = alpha * z_llm + (1 - alpha) * z_slm

  Logit fusion is a product of experts (``softmax(z_fuse)`` is proportional
  to ``p_llm**alpha * p_slm**(1-alpha)``): a token needs support from *both*
  models, whereas probability fusion is a mixture in which either model alone
  can carry a token.  The same functions serve both spaces because both are
  the same affine combination; only the meaning of the arrays changes.

Conventions: arrays are 1-D float32 over the shared vocabulary; ``TopK``
returns token ids by decreasing value with ties broken by the lower id, and
``argmax`` breaks ties the same way (numpy's first occurrence).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

FusionSpace = Literal["prob", "logit"]
FUSION_SPACES: tuple[str, ...] = ("prob", "logit")

#: members per strided group in the group-maximum pre-selection of :func:`top_k_ids`
_GROUP_SIZE = 64


def check_space(space: str) -> FusionSpace:
    """Return ``space`` if it names a fusion space, else raise ``ValueError``."""
    if space not in FUSION_SPACES:
        raise ValueError(f"fusion space must be one of {FUSION_SPACES}, got {space!r}")
    return space  # type: ignore[return-value]


def check_alpha(alpha: float) -> float:
    """Return ``alpha`` as a float if ``0 <= alpha <= 1``, else raise ``ValueError``."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"fusion weight alpha must lie in [0, 1], got {alpha}")
    return alpha


class NonFiniteError(ValueError):
    """A distribution or logits row holds NaN or an infinity (it would be mis-ranked by ``TopK``)."""


def check_finite(values: np.ndarray, what: str) -> np.ndarray:
    """Return ``values`` if every entry is finite, else raise :class:`NonFiniteError` naming ``what``.

    One float32 sum decides it (NaN and infinities propagate into it; finite
    logits or probabilities cannot overflow float32 in a sum over any
    vocabulary); only a failing row is searched for the culprit.
    """
    values = np.asarray(values)
    if values.size and not np.isfinite(values.sum(dtype=np.float32)):
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise NonFiniteError(
                f"{what} holds {bad.size} non-finite value(s) (first at id {int(bad[0])}: {values[bad[0]]}); "
                "refusing to rank or fuse it"
            )
    return values


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """``p(i) = exp(z(i)/T - max z/T) / sum_j exp(z(j)/T - max z/T)`` in float32.

    The shifted logits are float32; ``exp`` runs in float64 and is rounded once to float32, which is the correctly
    rounded float32 ``exp`` but in the rarest double-rounding cases, so the row is the same on every SIMD path
    and in every runtime that rounds ``exp`` so (TypeScript's ``Math.exp``, C's ``exp``): numpy's float32 ``exp``
    is an approximation within 2.52 ulps that differs from it at about a third of the ids.  It costs ~0.3 ms more
    per 262,144 ids.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    z = np.asarray(logits, dtype=np.float32)
    shifted = z - z.max() if temperature == 1.0 else (z - z.max()) / np.float32(temperature)
    exponent = shifted.astype(np.float64)
    np.exp(exponent, out=exponent)
    probabilities = exponent.astype(np.float32)
    # numpy's pairwise float32 sum is accurate to ~1e-6 relative here and twice as fast as a float64 one
    probabilities /= probabilities.sum()
    return probabilities


def log_probs(p: np.ndarray) -> np.ndarray:
    """``log p`` with zeros mapped to the log of float32's smallest normal (finite)."""
    return np.log(np.maximum(np.asarray(p, dtype=np.float32), np.finfo(np.float32).tiny))


def fuse(p_llm: np.ndarray, p_slm: np.ndarray, alpha: float, out: np.ndarray | None = None) -> np.ndarray:
    """``alpha * p_llm + (1 - alpha) * p_slm`` (probabilities or logits alike).

    ``out`` may be a preallocated float32 buffer of the vocabulary's size.
    """
    out = np.multiply(p_llm, np.float32(alpha), out=out, dtype=np.float32)
    scaled_slm = np.multiply(p_slm, np.float32(1.0 - alpha), dtype=np.float32)
    return np.add(out, scaled_slm, out=out)


def fuse_upload(p_llm: np.ndarray, ids: np.ndarray, values: np.ndarray, alpha: float) -> np.ndarray:
    """The cloud's masked fusion of a sparse upload.

    ``s(i) = alpha * p_llm(i) + (1 - alpha) * m(i) * p_slm(i)`` where ``m`` is 1 on
    the uploaded ``ids`` (whose uploaded values are ``values``) and 0 elsewhere.
    """
    out = np.multiply(p_llm, np.float32(alpha), dtype=np.float32)
    if len(ids):
        out[ids] += np.float32(1.0 - alpha) * np.asarray(values, dtype=np.float32)
    return out


def cloud_alpha(alpha: float, uploaded: int) -> float:
    """The weight the cloud fuses with: ``alpha``, or 1 (its own row alone) when ``alpha = 0`` and the upload holds
    nothing (``uploaded`` = 0): the fusion would then hold no information at all, only zeros to pick from."""
    return 1.0 if alpha == 0.0 and uploaded == 0 else alpha


def lowered_stop(values: np.ndarray, stop_ids: np.ndarray, *, raw_logits: bool) -> np.ndarray:
    """``values`` with the ``stop_ids`` (end-of-generation ids on a ``no_stop`` step) lowered out of the choice, in
    place; ids past the row are ignored.  Raw logits: float32's minimum.  Probabilities: the float32 just below
    ``min(0, min values)``, so no sampler weighs them and no greedy pick ties with them (at exactly 0 a row whose
    other ids all fused to 0, or below 0 with a noised upload, picked a stop id on a step that forbids one, while
    the certifier, which leaves them out, picked another)."""
    stop_ids = np.asarray(stop_ids, np.int64)
    stop_ids = stop_ids[stop_ids < values.shape[0]]
    if not stop_ids.size:
        return values
    if raw_logits:
        values[stop_ids] = np.finfo(np.float32).min
    else:
        values[stop_ids] = np.nextafter(np.float32(min(0.0, float(values.min()))), np.float32(-np.inf))
    return values


def cloud_scores(
    row: np.ndarray,
    upload_ids: np.ndarray,
    upload_values: np.ndarray,
    alpha: float,
    *,
    space: FusionSpace,
    temperature: float,
    stop_ids: np.ndarray,
) -> tuple[np.ndarray, bool]:
    """The cloud's pick rule in cloud-side fusion: the scores its token is picked from, and whether they are raw
    fused logits (greedy in logit space) rather than probabilities.

    ``s(i) = a * row(i) + (1 - a) * m(i) * u(i)`` (:func:`fuse_upload`; ``u`` the uploaded values, ``m`` 1 where
    uploaded, ``a`` = :func:`cloud_alpha`); in logit space at ``temperature > 0`` ``softmax(s)`` (:func:`pick_token`
    samples from ``p**(1/T)`` and ``softmax(z)**(1/T)`` is proportional to ``exp(z/T)``); the ``stop_ids`` lowered
    (:func:`lowered_stop`).  The pick is ``argmax s`` (ties to the lower id) or a draw.  One rule for the cloud
    adapter's session, the public fake cloud and the edge's run-ahead certifier
    (:func:`certified_cloud_pick`): a drift between them is a ``DATA_LOSS`` in production.
    """
    scores = fuse_upload(row, upload_ids, upload_values, cloud_alpha(alpha, len(upload_ids)))
    if space == "logit" and temperature > 0:
        scores = softmax(scores)
    raw_logits = space == "logit" and temperature == 0
    return lowered_stop(scores, stop_ids, raw_logits=raw_logits), raw_logits


def _sorted_by_value(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` ordered by decreasing ``values[ids]``, ties by increasing id."""
    return ids[np.lexsort((ids, -values[ids]))]


def top_k_ids(values: np.ndarray, k: int) -> np.ndarray:
    """``TopK(values)``: the ``k`` ids of largest value, by decreasing value, ties to the lower id.

    A full ``argpartition`` over a 262k vocabulary costs ~160 argmax passes.
    Instead the ids are dealt into ``G = n // 64`` strided groups
    (``{g, g + G, g + 2G, ...}``) and each group's maximum is taken in one
    vectorised pass; the ``k``-th largest group maximum ``t`` is a threshold
    that at least ``k`` values reach, and every value ``>= t`` lies in a group
    whose maximum is ``>= t``.  Only those few groups are then searched.  The
    result equals sorting the whole array (ties included).
    """
    values = np.asarray(values)
    n = values.shape[0]
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    n_groups = n // _GROUP_SIZE
    if k >= n_groups:  # small vocabularies: sort everything
        return _sorted_by_value(values, np.arange(n, dtype=np.int64))[:k]
    covered = n_groups * _GROUP_SIZE
    group_max = values[:covered].reshape(_GROUP_SIZE, n_groups).max(axis=0)
    threshold = np.partition(group_max, n_groups - k)[n_groups - k]
    groups = np.flatnonzero(group_max >= threshold)
    ids = (groups[None, :] + n_groups * np.arange(_GROUP_SIZE)[:, None]).ravel()
    if covered < n:
        ids = np.concatenate([ids, np.arange(covered, n)])
    survivors = ids[values[ids] >= threshold]
    return _sorted_by_value(values, survivors)[:k]


def in_top_k(values: np.ndarray, i: int, k: int) -> bool:
    """Whether id ``i`` belongs to ``TopK(values)`` (same tie rule) without selecting it.

    ``rank(i) = |{j : v_j > v_i}| + |{j < i : v_j = v_i}|`` and ``i`` is in the
    top ``k`` iff ``rank(i) < k``.  One comparison pass when ``i`` is clearly
    inside (``|{j : v_j >= v_i}| <= k``), up to three with many ties.
    """
    if k <= 0:
        return False
    v = values[i]
    at_least = int(np.count_nonzero(values >= v))
    if at_least <= k:
        return True  # even with every tie ranked before it, i stays inside
    above = int(np.count_nonzero(values > v))
    return above + int(np.count_nonzero(values[:i] == v)) < k


def rounding_margin(value: float | np.ndarray) -> float | np.ndarray:
    """Slack for comparing float32-derived values: ``1e-6 * |value| + 1e-12``.

    Certificates compare with this much room on the safe side, so rounding
    can only make them refuse, never accept wrongly.
    """
    return 1e-6 * np.abs(value) + 1e-12


def certify_fused_top_k(
    p_slm: np.ndarray,
    known_ids: np.ndarray,
    known_llm: np.ndarray,
    tail_bound: float,
    alpha: float,
    k: int,
) -> bool:
    """Whether a sparse ``p_llm`` pins down ``TopK(p_fuse, k)`` and its values exactly.

    The cloud sent ``p_llm`` exactly at ``known_ids`` and promised that every
    other entry is at most ``tail_bound``.  For an omitted id ``j``::

        p_fuse(j) <= alpha * tail_bound + (1 - alpha) * max_{j omitted} p_slm(j) =: ub

    so if the ``k``-th largest fused value among the known ids exceeds ``ub``,
    the top ``k`` of the fused distribution are all known ids and a decision
    that reads only them (and ``p_llm`` on them) is exactly the one the full
    distribution would give.  A small margin relative to the terms of each
    side (not to their sum, which may cancel when logits are negative) absorbs
    float32 rounding; when in doubt the answer is ``False`` (ask for the full row).
    """
    if k <= 0:
        return True
    if len(known_ids) < k:
        return len(known_ids) == p_slm.shape[0]
    fused_known = np.float32(alpha) * known_llm + np.float32(1.0 - alpha) * p_slm[known_ids]
    kth = float(np.partition(fused_known, len(fused_known) - k)[len(fused_known) - k])
    if len(known_ids) == p_slm.shape[0]:
        return True
    slm_omitted = max_omitted(p_slm, known_ids)
    upper = alpha * tail_bound + (1.0 - alpha) * slm_omitted
    # rounding scales with each side's terms, not with a sum that may cancel (logits can be negative)
    at = int(np.argmin(np.abs(fused_known - np.float32(kth))))
    terms = abs(alpha * float(known_llm[at])) + abs((1.0 - alpha) * float(p_slm[known_ids[at]]))
    return kth > upper + rounding_margin(terms + abs(alpha * tail_bound) + abs((1.0 - alpha) * slm_omitted))


def certified_cloud_pick(
    known_ids: np.ndarray,
    known_llm: np.ndarray,
    tail_bound: float,
    upload_ids: np.ndarray,
    upload_values: np.ndarray,
    alpha: float,
    vocab_size: int,
    stop_ids: np.ndarray,
) -> int | None:
    """The cloud's greedy pick (:func:`cloud_scores`) read off a sparse row and an upload when the row pins it down,
    else ``None``.

    ``s(i) = a * p_llm(i) + (1 - a) * m(i) * u(i)`` (``a`` = :func:`cloud_alpha`), with the ``stop_ids`` (the end
    set on a ``no_stop`` step) out of the choice.  Known ids have ``s`` exactly; an omitted id ``j`` has
    ``p_llm(j) <= tail_bound``, so::

        s(j) <= a * tail_bound + (1 - a) * max(u(j) over omitted uploaded j, 0 if some omitted j is not)

    The best known id is the pick when its score exceeds that bound and the second known score, each by a
    rounding margin (:func:`rounding_margin`; in doubt: ``None``).  Everything read here is what the cloud holds
    (its own row and the upload it received): whether the pick is certain tells it nothing.
    """
    alpha = cloud_alpha(alpha, len(upload_ids))
    allowed = ~np.isin(known_ids, np.asarray(stop_ids, np.int64))
    ids, llm = known_ids[allowed], np.asarray(known_llm, np.float32)[allowed]
    if not len(ids):
        return None
    slm = np.zeros(vocab_size, np.float32)
    uploaded = np.zeros(vocab_size, bool)
    slm[upload_ids], uploaded[upload_ids] = upload_values, True
    scores = np.float32(alpha) * llm + np.float32(1.0 - alpha) * slm[ids]
    order = np.argsort(-scores, kind="stable")
    best = float(scores[order[0]])
    rivals = [float(scores[order[1]])] if len(order) > 1 else []
    omitted = np.ones(vocab_size, bool)
    omitted[known_ids] = False
    if omitted.any():
        upload_part = slm[omitted & uploaded]
        if (omitted & ~uploaded).any():
            upload_part = np.append(upload_part, np.float32(0.0))
        rivals.append(alpha * tail_bound + (1.0 - alpha) * float(upload_part.max()))
    if not rivals:
        return int(ids[order[0]])
    rival = max(rivals)
    return int(ids[order[0]]) if best > rival + rounding_margin(abs(best) + abs(rival) + abs(tail_bound)) else None


def max_omitted(values: np.ndarray, known_ids: np.ndarray) -> float:
    """``max values[j]`` over the ids ``j`` not in ``known_ids`` (``-inf`` if there are none).

    One pass and no copy of the row: the known entries are set to ``-inf`` for
    the pass and restored after it.
    """
    saved = values[known_ids].copy()
    try:
        values[known_ids] = -np.inf
        return float(values.max())
    finally:
        values[known_ids] = saved


def pick_token(p: np.ndarray, *, temperature: float = 0.0, rng: np.random.Generator | None = None) -> int:
    """Greedy ``argmax p`` at temperature 0, else a draw from ``p**(1/T)`` renormalised.

    ``p`` must be non-negative (a distribution or fused scores).
    """
    if temperature == 0.0:
        return int(np.argmax(p))
    if rng is None:
        raise ValueError("sampling at temperature > 0 needs an explicit numpy Generator")
    # p**(1/T) / max p**(1/T) = exp((log p - log max p) / T): no overflow or underflow to all zeros at small T
    with np.errstate(divide="ignore"):
        log_p = np.log(np.maximum(np.asarray(p, dtype=np.float64), 0.0))
    weights = np.exp((log_p - log_p.max()) / temperature)
    return sample_from(weights, rng)


def sample_from(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One draw of an id with probability ``weights(i) / sum(weights)``.

    Uses one uniform and a cumulative sum, so the same generator state always
    gives the same id.
    """
    cdf = np.cumsum(weights, dtype=np.float64)
    total = cdf[-1]
    if not np.isfinite(total) or total <= 0:
        raise ValueError("cannot sample: weights must be finite, non-negative and not all zero")
    return int(min(np.searchsorted(cdf, rng.random() * total, side="right"), len(cdf) - 1))

