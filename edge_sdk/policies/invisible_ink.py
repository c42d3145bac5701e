"""InvisibleInk (Vinod, Pillutla & Thakurta, NeurIPS 2025), edge-side: clipped logit differences, one sampled token.

The calibration from ``epsilon`` to the clip bound ``C`` is
:func:`edge_sdk.privacy.analysis.invisible_ink_clip`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from edge_sdk.privacy.accountant import ReleaseEvent
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import top_k_ids
from edge_sdk.policies.base import Policy, require_rng
from edge_sdk.protocol.signals import FusionMode, SyncedToken
from edge_sdk.policies.ldp_sampler import sample_index
from edge_sdk.privacy.analysis import EpsilonUnit, check_epsilon, check_positive_int, invisible_ink_clip

#: InvisibleInk's sampling temperature in its original code (1.2 for some of its datasets)
DEFAULT_TEMPERATURE = 1.1

_SCRATCH = threading.local()
_TINY = np.finfo(np.float32).tiny


def _check_top_k(top_k: int | None) -> int | None:
    """``None`` or 0 mean the whole vocabulary (the original's ``topk=-1``); otherwise a positive integer."""
    if top_k is None or top_k == 0:
        return None
    return check_positive_int(top_k, "InvisibleInk top_k")


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 work arrays of length ``n``, kept per thread (fresh arrays cost page faults at 262k)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None or buffers[0].shape[0] != n:
        buffers = _SCRATCH.buffers = (np.empty(n, np.float32), np.empty(n, np.float32))
    return buffers


def _invisible_ink_weights(
    p_slm: np.ndarray,
    p_llm: np.ndarray,
    clip: float,
    top_k: int | None,
    temperature: float,
    public: np.ndarray,
    private: np.ndarray,
) -> tuple[np.ndarray | None, np.ndarray]:
    """``(ids or None for all, unnormalised weights)`` of :func:`invisible_ink_distribution`, using the two buffers."""
    if not (clip >= 0 and math.isfinite(clip)):
        raise ValueError(f"clip bound C must be finite and >= 0, got {clip}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"sampling temperature must be finite and > 0, got {temperature}")
    top_k = _check_top_k(top_k)
    # log p of the renormalised rows (a row with ids masked out, e.g. end-of-generation ids while the answer is
    # unfinished, sums to less than 1), zeros mapped to the log of float32's smallest normal, as fusion.log_probs
    for row, out in ((p_llm, public), (p_slm, private)):
        total = float(np.sum(row, dtype=np.float64))
        if not (total > 0 and math.isfinite(total)):
            raise ValueError(f"InvisibleInk needs distributions with a positive finite mass, got a sum of {total}")
        np.multiply(row, np.float32(1.0 / total), out=out)
        np.maximum(out, _TINY, out=out)
        np.log(out, out=out)
    ids = None
    if top_k is not None:
        kth_public = float(public[top_k_ids(public, top_k)[-1]])
        ids = np.flatnonzero(public >= np.float32(kth_public - 2.0 * clip))
        public, private = public[ids], private[ids]
    private -= public
    np.clip(private, -clip, clip, out=private)
    private += public  # z_bar
    private -= private.max()
    if temperature != 1.0:
        private *= np.float32(1.0 / temperature)
    np.exp(private, out=private)
    return ids, private


def invisible_ink_distribution(
    p_slm: np.ndarray,
    p_llm: np.ndarray,
    *,
    clip: float,
    top_k: int | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
) -> tuple[np.ndarray, np.ndarray]:
    """InvisibleInk's sampling distribution for one private reference::

        z_pub = log p_llm,   z_priv = log p_slm        (each row renormalised to sum 1 first)
        z_bar = z_pub + clip(z_priv - z_pub, -C, C)
        V_k+  = {y : z_pub(y) >= z_pub^(k) - 2C}        (z_pub^(k): k-th largest; every y when top_k is None)
        Pr[y] = softmax(z_bar / tau) restricted to V_k+

    The normalised log-probabilities stand in for logits: the softmax is
    shift-invariant, so this only fixes each model's arbitrary logit offset
    before the difference is clipped.  Returns ``(ids, probabilities)`` over
    ``V_k+`` (ids ascending; float32).
    """
    n = np.shape(p_llm)[0]
    ids, weights = _invisible_ink_weights(
        p_slm, p_llm, clip, top_k, temperature, np.empty(n, np.float32), np.empty(n, np.float32)
    )
    weights /= weights.sum(dtype=np.float64)
    return (np.arange(n, dtype=np.int64) if ids is None else ids), weights


@dataclass
class InvisibleInk(Policy):
    """InvisibleInk, edge-side: the synced token is one draw from :func:`invisible_ink_distribution`.

    ``epsilon`` is the budget of the **whole generation**: ``(epsilon, delta)``
    over ``max_new_tokens`` tokens, through zCDP and the CKS conversion
    (``s = 1`` private reference)::

        rho = zcdp_rho(eps, delta),  rho_token = rho / T,  C = tau * sqrt(rho_token / 2)

    (between two contexts each clipped logit moves by up to 2C: rho_token = 2 (C / tau)^2)

    (:func:`~edge_sdk.privacy.analysis.invisible_ink_clip`); every grid point
    of the paper (1 to 128) is a distinct positive ``C``.  As in the original
    code the temperature is 1.1 and the top-k+ set is the whole vocabulary
    (``top_k=None``; the top-k+ expansion costs no privacy, so a positive
    ``top_k`` only trades diversity for utility).  The original generates
    ``T = 500`` tokens; the decoder sets ``max_new_tokens`` to the
    generation's own length (:meth:`for_generation`).  The fusion weight
    ``alpha`` plays no part.

    Args:
        epsilon: total budget over ``max_new_tokens`` (the swept parameter).
        delta: total delta.
        top_k: ``k`` of the top-k+ set; ``None`` or 0 for the whole vocabulary.
        temperature: sampling temperature ``tau``.
        max_new_tokens: generation length ``T`` the budget is spread over.
    """

    name = "invisible_ink"
    modes = frozenset({"edge"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"edge": "per_generation"}

    epsilon: float = 10.0
    delta: float = 1e-6
    top_k: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    max_new_tokens: int = DecodeSettings.max_new_tokens  # the generation length the budget covers
    _clip: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_top_k(self.top_k)
        self._clip = invisible_ink_clip(
            check_epsilon(self.epsilon),
            max_new_tokens=self.max_new_tokens,
            delta=self.delta,
            temperature=self.temperature,
        )

    @property
    def clip(self) -> float:
        """The logit-difference clip bound ``C`` calibrated from ``epsilon``."""
        return self._clip

    def for_generation(self, max_new_tokens: int) -> InvisibleInk:
        """The budget spread over ``max_new_tokens`` tokens (a larger clip for a shorter generation)."""
        return self if max_new_tokens == self.max_new_tokens else replace(self, max_new_tokens=max_new_tokens)

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """Each token, any two contexts: ``rho = 2 (C / tau)^2``-zCDP (each logit of ``z_bar`` moves by up to
        ``2C``); the source's relation, a context against none, moves it by ``C``: ``(C / tau)^2 / 2``."""
        return ReleaseEvent(
            "zcdp", 2.0 * (self._clip / self.temperature) ** 2, delta=self.delta, horizon=self.max_new_tokens,
            note="each token: one draw from the clipped-logit softmax",
            source_value=0.5 * (self._clip / self.temperature) ** 2,
        )

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        ids, weights = _invisible_ink_weights(
            p_slm, p_llm, self._clip, self.top_k, self.temperature, *_scratch(np.shape(p_llm)[0])
        )
        drawn = sample_index(weights, generator)
        return SyncedToken(drawn if ids is None else int(ids[drawn]))
