"""Log-probabilities of the chosen tokens (OpenAI's ``logprobs``/``top_logprobs``, Ollama's ``logprobs``).

They are read off the *fused* row the token was chosen from, at the side that chose it, after every mask that
applied there (end-of-generation ids on a ``no_stop`` step, the JSON schema's grammar, ``never_upload`` ids in the
SLM's row), renormalised over what is left, and before any sampling temperature::

    probability space:  log q_i = log(f_i / sum_j f_j),      f = alpha * p_llm + (1 - alpha) * p_slm (masked)
    logit space:        log q_i = z_i - logsumexp(z),          z = alpha * z_llm + (1 - alpha) * z_slm (masked)

Edge-side fusion: ``f`` is the alpha-fusion of the two rows the policy read (a sparse cloud row at its public
fill), whatever rule the policy then picks by (CoVeil's ``J`` among the top ``K``, a DP policy's draw); on a
step the exposure budget withheld, the cloud's own row, which the token was taken from.  Cloud-side fusion: the
row the cloud fused from the upload, which it sends down with the token it picked when the session asked.
A masked id has probability 0, so log-probability ``-inf``; such ids are never listed among the top ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sdk.fusion import FusionSpace, top_k_ids

#: the most alternatives per token OpenAI's API returns (``top_logprobs`` <= 20)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the ``top`` most likely ids of the same row with theirs.

    ``top`` lists ``(id, logprob)`` by decreasing log-probability, ties to the lower id.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_distribution(row: np.ndarray, space: FusionSpace) -> np.ndarray:
    """``row`` (a masked fused row) as log-probabilities in float64 (see the module docstring for both spaces).

    Probability space: entries at or below 0 are ``-inf``; a row with no mass at all is an error.  Logit space:
    float32's lowest value (what a mask sets) is ``-inf``.
    """
    values = np.asarray(row, dtype=np.float64)
    if space == "logit":
        values = np.where(values <= np.finfo(np.float32).min, -np.inf, values)  # the masks' lowest logit
        top = float(values.max())
        return values - (top + float(np.log(np.exp(values - top).sum())))
    total = float(values[values > 0].sum())
    if not total > 0:
        raise ValueError("the fused row holds no probability: no token could have been chosen from it")
    with np.errstate(divide="ignore"):
        return np.where(values > 0, np.log(np.maximum(values, 0.0)) - np.log(total), -np.inf)


def token_logprobs(row: np.ndarray, space: FusionSpace, token_id: int, top_n: int) -> TokenLogprobs:
    """The log-probability of ``token_id`` under ``row`` and the row's ``top_n`` best ids (0 <= top_n <= 20)."""
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    logq = log_distribution(row, space)
    top_ids = top_k_ids(logq, top_n) if top_n else np.empty(0, np.int64)
    top = tuple((int(i), float(logq[i])) for i in top_ids if np.isfinite(logq[i]))
    return TokenLogprobs(int(token_id), float(logq[token_id]), top)
