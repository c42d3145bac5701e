"""DP-Logit, cloud-side: the Gaussian mechanism on the uploaded SLM probabilities.

**A reconstruction**: the cited work (ji2024less) could not be located, so
this is the textbook Gaussian mechanism on the full next-token vector, with a
fast vectorised draw of its noise (:func:`standard_normal_float32`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from edge_sdk.privacy.accountant import ReleaseEvent
from edge_sdk.fusion import top_k_ids
from edge_sdk.policies.base import Policy, require_rng
from edge_sdk.protocol.signals import CloudUpload, FusionMode
from edge_sdk.privacy.analysis import (
    EpsilonUnit,
    analytic_gaussian_sigma,
    check_delta,
    check_epsilon,
    check_positive_int,
)

#: L2 distance between two probability vectors is at most sqrt(2) (disjoint point masses).
PROBABILITY_L2_SENSITIVITY = math.sqrt(2.0)

#: Bits of each 64-bit draw that set the Box-Muller radius (the other 24 set the angle).
_RADIUS_BITS = 40
#: The largest |z| the draw can produce: sqrt(-2 log 2^-41), from the smallest radius uniform.
NOISE_TAIL_LIMIT = math.sqrt(2.0 * (_RADIUS_BITS + 1) * math.log(2.0))


def standard_normal_float32(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` independent standard normal draws as float32, by the Box-Muller transform.

    Each 64-bit output of ``rng``'s bit generator gives one pair: its top 40
    bits a uniform ``u = (k + 1/2) / 2^40`` in (0, 1) (rounded to float32,
    which keeps its smallest values exact), its low 24 bits an angle
    ``theta = 2 pi j / 2^24``, and ``(r cos theta, r sin theta)`` with
    ``r = sqrt(-2 log u)`` are two independent N(0, 1) draws (Box & Muller
    1958).  Vectorised, this is ~3x faster than ``Generator.standard_normal``
    at a 262k vocabulary, which draws one value at a time.

    It differs from an ideal Gaussian only by float rounding and by its tail:
    ``|z| <= sqrt(2 * 41 * log 2) = 7.539`` (:data:`NOISE_TAIL_LIMIT`), where
    ideal draws exceed 7.54 with probability ``2 * Phi(-7.54) = 4.7e-14``.
    """
    pairs = (int(n) + 1) // 2
    angle_bits = 64 - _RADIUS_BITS
    raw = rng.bit_generator.random_raw(pairs)
    out = np.empty(2 * pairs, dtype=np.float32)
    # few, reused buffers: at a 262k vocabulary every fresh temporary costs ~100 page faults
    radius, angle = out[:pairs], out[pairs:]
    np.bitwise_and(raw, np.uint64((1 << angle_bits) - 1), out=angle, casting="unsafe")
    angle *= np.float32(2.0 * math.pi / 2**angle_bits)
    np.right_shift(raw, np.uint64(angle_bits), out=raw)
    # u = (k + 1/2) / 2^40 in float32: every such u is a normal float32, so log u keeps the whole tail
    np.multiply(raw, 2.0**-_RADIUS_BITS, out=radius, casting="unsafe")
    radius += np.float32(2.0 ** -(_RADIUS_BITS + 1))
    np.log(radius, out=radius)
    radius *= np.float32(-2.0)
    np.sqrt(radius, out=radius)
    cosine = np.cos(angle)
    np.sin(angle, out=angle)
    angle *= radius
    radius *= cosine
    return out[:n]


def dp_logit_upload(
    p_slm: np.ndarray, *, sigma: float, upload_k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The Gaussian mechanism on the full SLM vector, then post-processing on the edge::

        x~ = p_slm + N(0, sigma^2 I_V)
        ids = TopK(x~, k),   values = clip(x~[ids], 0, 1)

    Every one of the ``V`` entries gets its own noise draw (the mechanism's
    guarantee needs the whole vector noised, not only the entries uploaded);
    selecting the top ``k`` and clamping into ``[0, 1]`` (the range of a
    probability, which the cloud enforces) are post-processing and cost no
    privacy.  Arithmetic is float32, the precision of the upload.  Returns
    ``(ids, values)`` with ids by decreasing noisy value.
    """
    if not sigma > 0:
        raise ValueError(f"Gaussian noise scale sigma must be > 0, got {sigma}")
    check_positive_int(upload_k, "DP-Logit upload size upload_k")
    noisy = standard_normal_float32(np.shape(p_slm)[0], rng)
    noisy *= np.float32(sigma)
    noisy += p_slm
    ids = top_k_ids(noisy, upload_k)
    return ids, np.clip(noisy[ids], 0.0, 1.0)


@dataclass
class DPLogit(Policy):
    """DP-Logit, cloud-side: Gaussian noise on the uploaded SLM probabilities.

    ``epsilon`` is the budget of **one token** (``(epsilon, delta)``-DP per
    upload): the full ``p_slm`` vector (L2 sensitivity ``sqrt 2``, since
    ``||p - p'||_2 <= sqrt 2`` for any two distributions) gets noise of scale
    ``sigma = analytic_gaussian_sigma(epsilon, delta, sqrt 2)`` (Balle & Wang
    2018), and the edge uploads the top ``upload_k`` noisy entries clamped
    into [0, 1].  Every grid point of the paper (eps from 0.01 to 64) is a
    distinct sigma.  Over ``T`` tokens the uploads compose exactly to one
    Gaussian mechanism of noise multiplier ``sigma / (sqrt 2 * sqrt T)``
    (:func:`~edge_sdk.privacy.analysis.gaussian_composition_epsilon`).

    The noise comes from :func:`standard_normal_float32` (tail cut at
    7.54 sigma; the ideal mechanism's outputs beyond it have probability below
    5e-14 per entry, which adds at most ``2 * phi(7.54) * ||p - p'||_1 / sigma
    <= 3.4e-13 / sigma`` to ``delta``).

    Args:
        epsilon: per-token privacy budget (the swept parameter).
        delta: per-token delta.
        upload_k: how many noisy entries to upload.
    """

    name = "dp_logit"
    modes = frozenset({"cloud"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"cloud": "per_token"}

    epsilon: float = 1.0
    delta: float = 1e-5
    upload_k: int = 100
    _sigma: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive_int(self.upload_k, "DP-Logit upload size upload_k")
        self._sigma = analytic_gaussian_sigma(
            check_epsilon(self.epsilon), check_delta(self.delta), PROBABILITY_L2_SENSITIVITY
        )

    @property
    def sigma(self) -> float:
        """The Gaussian noise scale calibrated from ``(epsilon, delta)``."""
        return self._sigma

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """Each upload is the Gaussian mechanism at noise multiplier ``sigma / sqrt 2``: ``sqrt 2`` bounds the
        distance of any two contexts' SLM vectors, so the relation is any two contexts (no weaker figure)."""
        return ReleaseEvent(
            "gaussian", self._sigma / PROBABILITY_L2_SENSITIVITY, delta=self.delta,
            note="each upload: the Gaussian mechanism on the whole SLM vector",
        )

    def max_upload(self, vocab_size: int) -> int:
        return min(self.upload_k, vocab_size)

    def llm_support(self, mode: FusionMode) -> int | None:
        return 0  # the noised upload ignores p_llm

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        generator = require_rng(rng, self.name)
        ids, values = dp_logit_upload(p_slm, sigma=self._sigma, upload_k=self.upload_k, rng=generator)
        return CloudUpload(ids, values)
