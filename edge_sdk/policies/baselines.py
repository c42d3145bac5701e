"""The paper's six comparison defences, adapted to cloud-edge collaborative decoding.

Each baseline is one or two pure numpy functions (the mechanism, with its
equation in the docstring) plus a small :class:`Policy` dataclass that maps
the swept privacy parameter to the mechanism's parameters
(:mod:`edge_sdk.privacy_accounting`).  Notation: ``p_slm`` is the edge SLM's
next-token distribution (private context + public query), ``p_llm`` the
cloud LLM's (public query only), ``alpha`` the fusion weight of
``p_fuse = alpha * p_llm + (1 - alpha) * p_slm``.

Cloud-side (act on the uploaded SLM values):

* :class:`CoGenesis` - upload only the SLM's top-``B`` probabilities;
* :class:`DPLogit` - Gaussian noise on the SLM vector before upload
  (a reconstruction: no source code was found);
* :class:`DPFusion` - upload the SLM distribution mixed towards the public one.

Edge-side (act on the synchronised token):

* :class:`CusText` - exponential-mechanism replacement of the fused argmax
  among its embedding neighbours;
* :class:`LDPSampler` - the locally optimal epsilon-LDP sampler with
  ``p_llm`` as the public anchor;
* :class:`DPFusion` - sample from the fused, mixed distribution;
* :class:`InvisibleInk` - clipped logit differences sampled over a top-k+ set.

Every randomised mechanism draws only from the ``numpy.random.Generator``
it is given, through :func:`edge_sdk.fusion.sample_from`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from os import PathLike

import numpy as np

from edge_sdk.fusion import check_alpha, fuse, log_probs, sample_from, softmax, top_k_ids
from edge_sdk.policies.base import CloudUpload, FusionMode, Policy, SyncedToken, require_rng
from edge_sdk.privacy_accounting import analytic_gaussian_sigma, check_epsilon, dp_fusion_beta, invisible_ink_clip

#: L2 distance between two probability vectors is at most sqrt(2) (disjoint point masses).
PROBABILITY_L2_SENSITIVITY = math.sqrt(2.0)
#: DP-Fusion's floor on probabilities inside the Renyi divergence.
RENYI_PROBABILITY_FLOOR = 1e-10


def _check_positive_int(value: int, what: str) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value}")
    return int(value)


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return delta


def _as_distribution(p: np.ndarray, what: str) -> np.ndarray:
    """``p`` as float64, renormalised; ``ValueError`` if negative, non-finite or all zero."""
    p = np.asarray(p, dtype=np.float64)
    total = p.sum()
    if p.ndim != 1 or not np.isfinite(total) or total <= 0 or p.min() < 0:
        raise ValueError(f"{what} must be a 1-D non-negative finite array with positive mass")
    return p / total


# --------------------------------------------------------------------------- CoGenesis


def cogenesis_upload_ids(p_slm: np.ndarray, b: int) -> np.ndarray:
    """CoGenesis' support: ``TopB(p_slm)`` (``min(B, V)`` ids, ascending).

    The cloud receives ``p_slm`` on these ids as is: the values are *not*
    renormalised, so the cloud fuses ``alpha * p_llm + (1 - alpha) * m * p_slm``
    with ``m`` the support's indicator, exactly as for any other upload.
    """
    return np.sort(top_k_ids(p_slm, _check_positive_int(b, "CoGenesis upload size B")))


@dataclass
class CoGenesis(Policy):
    """CoGenesis (Zhang et al., ACL 2024), cloud-side: upload the SLM's top-``B`` probabilities.

    The original code fuses on the device with the LLM's top-10; the paper's
    adaptation, followed here, sends the SLM's top-``B`` to the cloud instead.

    Args:
        b: upload size ``B`` (the swept parameter; 10 matches the original code).
    """

    name = "cogenesis"
    modes = frozenset({"cloud"})

    b: int = 10

    def __post_init__(self) -> None:
        _check_positive_int(self.b, "CoGenesis upload size B")

    def llm_support(self, mode: FusionMode) -> int | None:
        return 0  # the upload ignores p_llm

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        return CloudUpload.of(p_slm, cogenesis_upload_ids(p_slm, self.b))


# --------------------------------------------------------------------------- DP-Logit


def dp_logit_upload(
    p_slm: np.ndarray, *, sigma: float, upload_k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The Gaussian mechanism on the full SLM vector, then post-processing on the edge::

        x~ = p_slm + N(0, sigma^2 I_V)
        ids = TopK(x~, k),   values = max(x~[ids], 0)

    Only ``x~`` touches private data; selecting its top ``k`` and clamping
    into ``[0, 1]`` (the range of a probability, which the cloud enforces) are
    post-processing and cost no privacy.  The values are not
    renormalised.  Returns ``(ids, values)`` with ids by decreasing noisy value.
    """
    if not sigma > 0:
        raise ValueError(f"Gaussian noise scale sigma must be > 0, got {sigma}")
    _check_positive_int(upload_k, "DP-Logit upload size upload_k")
    noisy = rng.standard_normal(np.shape(p_slm)[0])
    noisy *= sigma
    noisy += p_slm
    ids = top_k_ids(noisy, upload_k)
    return ids, np.clip(noisy[ids], 0.0, 1.0)


@dataclass
class DPLogit(Policy):
    """DP-Logit, cloud-side: Gaussian noise on the uploaded SLM probabilities.

    **A reconstruction**: the cited work (ji2024less) could not be located,
    so this is the textbook Gaussian mechanism.  ``epsilon`` is the *per-step*
    budget: the full ``p_slm`` vector (L2 sensitivity ``sqrt 2``, since
    ``||p - p'||_2 <= sqrt 2`` for any two distributions) gets noise of scale
    ``sigma = analytic_gaussian_sigma(epsilon, delta, sqrt 2)`` (Balle & Wang
    2018), and the edge uploads the top ``upload_k`` noisy entries clamped into [0, 1].

    Args:
        epsilon: per-step privacy budget (the swept parameter).
        delta: per-step delta.
        upload_k: how many noisy entries to upload.
    """

    name = "dp_logit"
    modes = frozenset({"cloud"})

    epsilon: float = 1.0
    delta: float = 1e-5
    upload_k: int = 100
    _sigma: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive_int(self.upload_k, "DP-Logit upload size upload_k")
        self._sigma = analytic_gaussian_sigma(
            check_epsilon(self.epsilon), _check_delta(self.delta), PROBABILITY_L2_SENSITIVITY
        )

    @property
    def sigma(self) -> float:
        """The Gaussian noise scale calibrated from ``(epsilon, delta)``."""
        return self._sigma

    def llm_support(self, mode: FusionMode) -> int | None:
        return 0  # the noised upload ignores p_llm

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        generator = require_rng(rng, self.name)
        ids, values = dp_logit_upload(p_slm, sigma=self._sigma, upload_k=self.upload_k, rng=generator)
        return CloudUpload(ids, values)


# --------------------------------------------------------------------------- DP-Fusion


def _check_order(order: float) -> float:
    order = float(order)
    if not (order > 1.0 and math.isfinite(order)):
        raise ValueError(f"Renyi order must be finite and > 1, got {order}")
    return order


def _symmetric_renyi_of_floored(
    m: np.ndarray, q: np.ndarray, order: float, *, work: np.ndarray | None = None, constant: float = 0.0
) -> float:
    """``max(D_a(m||q), D_a(q||m))`` for float64 arrays already floored at 1e-10.

    With ``r = m / q``: ``sum m^a q^(1-a) = sum m * r^(a-1)`` and
    ``sum q^a m^(1-a) = sum q / r^(a-1)``; the larger sum gives the larger
    divergence since ``log(.)/(a-1)`` is increasing.  ``constant`` is added to
    both sums (entries left out of ``m`` and ``q`` that contribute equally to
    each); ``work`` is an optional scratch buffer shaped like ``m``.
    """
    work = np.divide(m, q, out=work)
    np.power(work, order - 1.0, out=work)
    forward = float(np.dot(m, work)) + constant
    np.reciprocal(work, out=work)
    backward = float(np.dot(q, work)) + constant
    return math.log(max(forward, backward)) / (order - 1.0)


def renyi_divergence(p: np.ndarray, q: np.ndarray, order: float = 2.0) -> float:
    """``D_a(p||q) = log(sum_i p_i^a q_i^(1-a)) / (a-1)`` with ``p, q`` floored at 1e-10 (not renormalised)."""
    order = _check_order(order)
    p = np.maximum(np.asarray(p, dtype=np.float64), RENYI_PROBABILITY_FLOOR)
    q = np.maximum(np.asarray(q, dtype=np.float64), RENYI_PROBABILITY_FLOOR)
    return math.log(float(np.dot(p, (p / q) ** (order - 1.0)))) / (order - 1.0)


def symmetric_renyi_divergence(p: np.ndarray, q: np.ndarray, order: float = 2.0) -> float:
    """DP-Fusion's ``D(p, q) = max(D_a(p||q), D_a(q||p))`` (floored at 1e-10 as in :func:`renyi_divergence`)."""
    order = _check_order(order)
    p = np.maximum(np.asarray(p, dtype=np.float64), RENYI_PROBABILITY_FLOOR)
    q = np.maximum(np.asarray(q, dtype=np.float64), RENYI_PROBABILITY_FLOOR)
    return _symmetric_renyi_of_floored(p, q, order)


def dp_fusion_lambda(
    p_private: np.ndarray, p_public: np.ndarray, bound: float, *, order: float = 2.0, iterations: int = 20
) -> float:
    """DP-Fusion's per-step mixing weight (Thareja et al.)::

        lambda = 1                                            if D(p_priv, p_pub) <= b
               = max{l in [0, 1] : D(l*p_priv + (1-l)*p_pub, p_pub) <= b}   otherwise
               = 0                                            if b <= 0

    with ``D`` the symmetric Renyi divergence.  The maximum is found by
    ``iterations`` bisection steps from ``[0, 1]`` keeping the feasible lower
    end; 20 steps leave a bracket of ``2^-20 < 1e-6``, the source's tolerance.
    ``D`` of the mixture is non-decreasing in ``l`` (joint quasi-convexity of
    Renyi divergences, with ``D = 0`` at ``l = 0``), so the result is
    non-decreasing in ``b``.  Each step costs a few vectorised float64 passes
    over the ids where either distribution reaches the floor (the others add
    the same constant at every weight and are counted once).
    """
    order = _check_order(order)
    _check_positive_int(iterations, "bisection iterations")
    if not bound > 0:
        return 0.0
    private = np.asarray(p_private, dtype=np.float64)
    public = np.asarray(p_public, dtype=np.float64)
    if private.shape != public.shape or private.ndim != 1:
        raise ValueError(
            f"private and public distributions must be 1-D of one length, got {private.shape} and {public.shape}"
        )
    # where both are below the floor every mixture is floored too: r = 1 and each
    # such entry adds exactly the floor to both sums, whatever the weight
    live = np.flatnonzero((private >= RENYI_PROBABILITY_FLOOR) | (public >= RENYI_PROBABILITY_FLOOR))
    dead_mass = RENYI_PROBABILITY_FLOOR * (private.size - live.size)
    private, public = private[live], public[live]
    direction = private - public
    public_floored = np.maximum(public, RENYI_PROBABILITY_FLOOR)
    mixture = np.empty_like(public)
    work = np.empty_like(public)

    def divergence_at(weight: float) -> float:
        np.multiply(direction, weight, out=mixture)
        np.add(mixture, public, out=mixture)
        np.maximum(mixture, RENYI_PROBABILITY_FLOOR, out=mixture)
        return _symmetric_renyi_of_floored(mixture, public_floored, order, work=work, constant=dead_mass)

    if divergence_at(1.0) <= bound:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = 0.5 * (low + high)
        if divergence_at(middle) <= bound:
            low = middle
        else:
            high = middle
    return low


def dp_fusion_mixture(
    p_private: np.ndarray, p_public: np.ndarray, bound: float, *, order: float = 2.0
) -> tuple[np.ndarray, float]:
    """``(lambda * p_priv + (1 - lambda) * p_pub, lambda)`` with ``lambda`` from :func:`dp_fusion_lambda` (float64)."""
    weight = dp_fusion_lambda(p_private, p_public, bound, order=order)
    public = np.asarray(p_public, dtype=np.float64)
    return public + weight * (np.asarray(p_private, dtype=np.float64) - public), weight


@dataclass
class DPFusion(Policy):
    """DP-Fusion (Thareja et al., ICLR 2026) in both fusion modes.

    The private distribution is ``p_slm``; the public one is ``p_llm``.  This
    is this project's adaptation: the original runs the same model a second
    time on the redacted (public) context, which on the edge would double the
    SLM's compute, whereas the cloud's distribution is already public.

    Epsilon mapping (one private group, worst case over ``T`` tokens)::

        b = beta = (eps - log(1/delta)/(a-1)) / (4*T)

    (:func:`~edge_sdk.privacy_accounting.dp_fusion_beta`); ``eps`` at or below
    ``log(1/delta)/(a-1)`` (about 11.5 at the defaults) gives ``b <= 0``, so
    ``lambda = 0`` and only the public distribution is used.

    * cloud-side: upload the mixture restricted to its top ``upload_k`` ids;
    * edge-side: sample the synced token from
      ``alpha * p_llm + (1 - alpha) * mixture`` (temperature 1).

    Args:
        epsilon: total privacy budget over ``max_new_tokens`` (the swept parameter).
        delta: total delta.
        order: Renyi order ``a``.
        max_new_tokens: generation length ``T`` the budget is spread over.
        upload_k: cloud-side upload size.
    """

    name = "dp_fusion"
    modes = frozenset({"cloud", "edge"})

    epsilon: float = 16.0
    delta: float = 1e-5
    order: float = 2.0
    max_new_tokens: int = 256
    upload_k: int = 100
    _bound: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive_int(self.upload_k, "DP-Fusion upload size upload_k")
        self._bound = dp_fusion_beta(
            check_epsilon(self.epsilon), max_new_tokens=self.max_new_tokens, delta=self.delta, order=self.order
        )

    @property
    def bound(self) -> float:
        """The per-token divergence bound ``b`` (negative: nothing private is used)."""
        return self._bound

    def mixture(self, p_slm: np.ndarray, p_llm: np.ndarray) -> np.ndarray:
        """This step's calibrated distribution ``lambda * p_slm + (1 - lambda) * p_llm``."""
        return dp_fusion_mixture(p_slm, p_llm, self._bound, order=self.order)[0]

    def cloud_upload(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> CloudUpload:
        mixture = self.mixture(p_slm, p_llm)
        return CloudUpload.of(mixture, top_k_ids(mixture, self.upload_k))

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        return SyncedToken(sample_from(fuse(p_llm, self.mixture(p_slm, p_llm), check_alpha(alpha)), generator))


# --------------------------------------------------------------------------- CusText


class EmbeddingNeighbours:
    """Nearest tokens by cosine similarity of token-embedding rows, computed on demand.

    The rows are normalised once (kept in float16 if given float16, else
    float32); :meth:`of` computes one row's similarity to every row, block by
    block in float32, and remembers the answer for up to ``cache_size`` token
    ids (oldest evicted first).
    """

    #: Rows converted to float32 at a time (bounds the temporary memory).
    block_rows = 16384

    def __init__(self, embeddings: np.ndarray, cache_size: int = 4096) -> None:
        matrix = np.asarray(embeddings)
        if matrix.ndim != 2 or 0 in matrix.shape or not np.issubdtype(matrix.dtype, np.floating):
            raise ValueError(
                f"embeddings must be a non-empty 2-D float array [V, d], got {matrix.dtype} {matrix.shape}"
            )
        self._cache_size = _check_positive_int(cache_size, "neighbour cache size")
        storage = np.float16 if matrix.dtype == np.float16 else np.float32
        self._unit = np.empty(matrix.shape, dtype=storage)
        for start in range(0, matrix.shape[0], self.block_rows):
            block = matrix[start : start + self.block_rows].astype(np.float32)
            norms = np.linalg.norm(block, axis=1, keepdims=True)
            self._unit[start : start + self.block_rows] = block / np.maximum(norms, np.finfo(np.float32).tiny)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def vocab_size(self) -> int:
        return int(self._unit.shape[0])

    @property
    def dim(self) -> int:
        return int(self._unit.shape[1])

    def __repr__(self) -> str:
        return f"EmbeddingNeighbours(vocab_size={self.vocab_size}, dim={self.dim})"

    def similarities(self, token_id: int) -> np.ndarray:
        """Cosine similarity of ``token_id``'s row to every row (float32, length ``V``)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the embedding vocabulary [0, {self.vocab_size})")
        query = self._unit[token_id].astype(np.float32)
        out = np.empty(self.vocab_size, dtype=np.float32)
        for start in range(0, self.vocab_size, self.block_rows):
            block = self._unit[start : start + self.block_rows]
            out[start : start + block.shape[0]] = block.astype(np.float32, copy=False) @ query
        return out

    def of(self, token_id: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` most similar tokens to ``token_id`` (itself included) and their similarities.

        Ids come by decreasing similarity, ties to the lower id, so a smaller
        ``n`` is always a prefix of a larger one (the cache relies on this).
        """
        n = _check_positive_int(n, "neighbour count n")
        cached = self._cache.get(token_id)
        if cached is None or len(cached[0]) < min(n, self.vocab_size):
            similarities = self.similarities(token_id)
            ids = top_k_ids(similarities, n)
            cached = (ids, similarities[ids])
            self._cache.pop(token_id, None)
            if len(self._cache) >= self._cache_size:
                del self._cache[next(iter(self._cache))]
            self._cache[token_id] = cached
        return cached[0][:n], cached[1][:n]


def load_token_embeddings(gguf_path: str | PathLike[str], dtype: type[np.floating] = np.float32) -> np.ndarray:
    """The ``token_embd.weight`` matrix ``[n_vocab, d]`` of a GGUF model, dequantised.

    GGUF lists dimensions fastest-varying first, so the tensor's shape is
    ``(d, n_vocab)``; any quantisation type ``gguf`` knows is dequantised.
    ``dtype`` is ``np.float32`` (default) or ``np.float16``, which halves the
    memory of the matrix and of :class:`EmbeddingNeighbours` built from it but
    makes each uncached neighbour query convert every row to float32 (about
    10x slower: ~0.25 s instead of ~0.03 s for 262,144 x 640 on one core).
    """
    if dtype not in (np.float16, np.float32):
        raise ValueError(f"embedding dtype must be numpy.float16 or numpy.float32, got {dtype}")
    import gguf  # imported here: the SDK's import stays numpy-only

    reader = gguf.GGUFReader(gguf_path)
    tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if tensor is None:
        raise ValueError(f"{gguf_path} has no token_embd.weight tensor")
    dim = int(tensor.shape[0])
    n_vocab = int(np.prod(tensor.shape[1:]))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values).reshape(n_vocab, dim).astype(dtype)


def custext_probabilities(similarities: np.ndarray, epsilon: float) -> np.ndarray:
    """The exponential mechanism over a neighbour set (Chen et al., ACL Findings 2023)::

        u(x, y) = (sim(x, y) - min sim) / (max sim - min sim)        (in [0, 1])
        Pr[y | x] = exp(eps * u(x, y) / 2) / sum_y' exp(eps * u(x, y') / 2)

    ``u`` has sensitivity 1, so this is ``eps``-DP over the set; equal
    similarities give ``u = 0`` everywhere (uniform).
    """
    epsilon = check_epsilon(epsilon)
    similarities = np.asarray(similarities, dtype=np.float64)
    if similarities.ndim != 1 or similarities.size == 0:
        raise ValueError("similarities must be a non-empty 1-D array")
    span = similarities.max() - similarities.min()
    utility = (similarities - similarities.min()) / span if span > 0 else np.zeros_like(similarities)
    weights = np.exp(0.5 * epsilon * (utility - 1.0))
    return weights / weights.sum()


def custext_replace(
    token_id: int, neighbours: EmbeddingNeighbours, *, epsilon: float, n_neighbours: int, rng: np.random.Generator
) -> int:
    """Replace ``token_id`` by a draw from :func:`custext_probabilities` over its ``n_neighbours`` nearest tokens."""
    ids, similarities = neighbours.of(token_id, n_neighbours)
    return int(ids[sample_from(custext_probabilities(similarities, epsilon), rng)])


@dataclass
class CusText(Policy):
    """CusText, edge-side: the fused argmax is replaced through the exponential mechanism.

    ``y = argmax p_fuse``, then the synced token is drawn from ``y``'s
    ``n_neighbours`` nearest tokens (cosine similarity of the model's token
    embeddings, ``y`` itself included) with :func:`custext_probabilities`.
    ``epsilon`` is the exponential mechanism's per-token budget, used as is.

    Args:
        neighbours: the token-embedding neighbour source (required).
        epsilon: per-token budget (the swept parameter).
        n_neighbours: size of the output set ``|Y_x|`` (20 in the original).
    """

    name = "custext"
    modes = frozenset({"edge"})

    neighbours: EmbeddingNeighbours | None = None
    epsilon: float = 5.0
    n_neighbours: int = 20

    def __post_init__(self) -> None:
        if not isinstance(self.neighbours, EmbeddingNeighbours):
            raise ValueError(
                "CusText needs neighbours=EmbeddingNeighbours(embeddings), e.g. from load_token_embeddings(gguf_path)"
            )
        check_epsilon(self.epsilon)
        _check_positive_int(self.n_neighbours, "CusText neighbour count n_neighbours")

    def llm_support(self, mode: FusionMode) -> int | None:
        return 1  # sanitises y* = argmax p_fuse; the draw itself reads only the embeddings

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        fused_argmax = int(np.argmax(fuse(p_llm, p_slm, check_alpha(alpha))))
        return SyncedToken(
            custext_replace(
                fused_argmax, self.neighbours, epsilon=self.epsilon, n_neighbours=self.n_neighbours, rng=generator
            )
        )


# --------------------------------------------------------------------------- LDP-Sampler


def ldp_sampler_ratio_bounds(epsilon: float, gamma: float) -> tuple[float, float]:
    """``(m, e^eps * m)`` with ``m = (gamma + 1) / (e^eps + gamma)``, computed without overflow."""
    epsilon = check_epsilon(epsilon)
    if not (gamma >= 1.0 and math.isfinite(gamma)):
        raise ValueError(f"neighbourhood ratio gamma must be finite and >= 1, got {gamma}")
    decay = math.exp(-epsilon)
    return (gamma + 1.0) * decay / (1.0 + gamma * decay), (gamma + 1.0) / (1.0 + gamma * decay)


def ldp_sampler_distribution(
    p_private: np.ndarray, p_public: np.ndarray, *, epsilon: float, gamma: float = 2.0, iterations: int = 200
) -> np.ndarray:
    """The locally optimal pure ``eps``-LDP sampler (Ghoukasian, Lee & Asoodeh, NeurIPS 2025)::

        m = (gamma + 1) / (e^eps + gamma)
        Q(x) = clip(P(x) / r, m * P0(x), e^eps * m * P0(x)),   r such that sum_x Q(x) = 1

    ``P`` private, ``P0`` public anchor (both renormalised in float64 here).
    Because ``Q / P0`` lies in ``[m, e^eps * m]`` whatever ``P`` is, the
    output is ``eps``-LDP even when ``P`` leaves the ``gamma``-neighbourhood
    of ``P0``.  Returns ``Q`` (float64, sums to 1).

    ``S(t) = sum_x clip(P(x) * t, lo(x), hi(x))`` (``t = 1/r``) is
    non-decreasing, equal to ``sum lo = m <= 1`` for small ``t`` and to
    ``S_max = sum_{P>0} hi + sum_{P=0} lo`` for large ``t``.  When
    ``S_max > 1`` the root is bisected in ``log t`` (at most ``iterations``
    steps, to relative width 1e-12, then renormalised).  When ``S_max <= 1``
    (``P``'s support ``S`` holds at most ``1/(gamma+1)`` of ``P0``'s mass,
    e.g. after float32 underflow) no ``r`` works: the limit ``r -> 0`` keeps
    ``Q = hi`` on ``S`` and scales ``P0`` off ``S`` by the constant
    ``c = (1 - e^eps * m * P0(S)) / P0(not S)``, which lies in
    ``[m, e^eps * m]`` exactly when ``S_max <= 1 <= e^eps * m``.  At
    ``eps = 0``, ``Q = P0``.
    """
    private = _as_distribution(p_private, "private distribution P")
    public = _as_distribution(p_public, "public anchor P0")
    if private.shape != public.shape:
        raise ValueError(f"P and P0 differ in length: {private.size} vs {public.size}")
    _check_positive_int(iterations, "bisection iterations")
    low_ratio, high_ratio = ldp_sampler_ratio_bounds(epsilon, gamma)
    floor = low_ratio * public
    ceiling = high_ratio * public
    support = (private > 0) & (public > 0)
    support_mass = float(public[support].sum())
    outside_mass = float(public[~support].sum())
    # S_max <= 1 reads hi * P0(S) + lo * (1 - P0(S)) <= 1, i.e. gamma * P0(S) <= P0(not S)
    # (hi - 1 = gamma * (1 - lo)), tested in that form, free of cancellation; otherwise S is
    # non-empty and the bisection below has a bracket
    if gamma * support_mass <= outside_mass:
        scale = 1.0 - (high_ratio - 1.0) * support_mass / outside_mass
        return np.where(support, ceiling, scale * public)

    scaled = np.empty_like(private)

    def mass_at(t: float) -> float:
        np.multiply(private, t, out=scaled)
        np.minimum(scaled, ceiling, out=scaled)
        np.maximum(scaled, floor, out=scaled)
        return float(scaled.sum())

    # at t_low every id sits on its floor (S = m <= 1), at t_high every id of P's support on its ceiling (S > 1)
    log_low = math.log(max(float((floor[support] / private[support]).min()), np.finfo(np.float64).tiny))
    log_high = math.log(float((ceiling[support] / private[support]).max()))
    for _ in range(iterations):
        if log_high - log_low <= 1e-12:
            break
        log_middle = 0.5 * (log_low + log_high)
        if mass_at(math.exp(log_middle)) < 1.0:
            log_low = log_middle
        else:
            log_high = log_middle
    mass_at(math.exp(log_high))
    return scaled / scaled.sum()


@dataclass
class LDPSampler(Policy):
    """LDP-Sampler, edge-side: the synced token is one draw from :func:`ldp_sampler_distribution`.

    ``P = p_slm`` (private), ``P0 = p_llm`` (public anchor); ``epsilon`` is
    the sampler's per-token pure-LDP budget, used as is.  The fusion weight
    ``alpha`` plays no part: the sampler's output replaces fusion.

    Args:
        epsilon: per-token budget (the swept parameter).
        gamma: neighbourhood ratio ``P0/gamma <= P <= gamma * P0`` the sampler is tuned for.
    """

    name = "ldp_sampler"
    modes = frozenset({"edge"})

    epsilon: float = 2.0
    gamma: float = 2.0

    def __post_init__(self) -> None:
        ldp_sampler_ratio_bounds(self.epsilon, self.gamma)

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        sampler = ldp_sampler_distribution(p_slm, p_llm, epsilon=self.epsilon, gamma=self.gamma)
        return SyncedToken(sample_from(sampler, generator))


# --------------------------------------------------------------------------- InvisibleInk


def invisible_ink_distribution(
    p_slm: np.ndarray, p_llm: np.ndarray, *, clip: float, top_k: int, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """InvisibleInk's sampling distribution for one private reference (Vinod et al., NeurIPS 2025)::

        z_pub = log p_llm,   z_priv = log p_slm
        z_bar = z_pub + clip(z_priv - z_pub, -C, C)
        V_k+  = {y : z_pub(y) >= z_pub^(k) - 2C}        (z_pub^(k): k-th largest)
        Pr[y] = softmax(z_bar / tau) restricted to V_k+

    The normalised log-probabilities (:func:`edge_sdk.fusion.log_probs`)
    stand in for logits: the softmax is shift-invariant, so this only fixes
    each model's arbitrary logit offset before the difference is clipped.
    Returns ``(ids, probabilities)`` over ``V_k+`` (ids ascending).
    """
    if not (clip >= 0 and math.isfinite(clip)):
        raise ValueError(f"clip bound C must be finite and >= 0, got {clip}")
    _check_positive_int(top_k, "InvisibleInk top_k")
    z_public = log_probs(p_llm)
    z_private = log_probs(p_slm)
    kth_public = float(z_public[top_k_ids(z_public, top_k)[-1]])
    allowed = np.flatnonzero(z_public >= np.float32(kth_public - 2.0 * clip))
    z_public = z_public[allowed]
    clipped = np.clip(z_private[allowed] - z_public, -clip, clip)
    return allowed, softmax(z_public + clipped, temperature)


@dataclass
class InvisibleInk(Policy):
    """InvisibleInk, edge-side: sample the synced token from :func:`invisible_ink_distribution`.

    Epsilon mapping (``s = 1`` private reference, ``T`` tokens, CKS conversion)::

        rho = zcdp_rho(eps, delta),  rho_token = rho / T,  C = tau * sqrt(2 * rho_token)

    (:func:`~edge_sdk.privacy_accounting.invisible_ink_clip`).  The fusion
    weight ``alpha`` plays no part.

    Args:
        epsilon: total budget over ``max_new_tokens`` (the swept parameter).
        delta: total delta.
        top_k: ``k`` of the top-k+ set.
        temperature: sampling temperature ``tau``.
        max_new_tokens: generation length ``T`` the budget is spread over.
    """

    name = "invisible_ink"
    modes = frozenset({"edge"})

    epsilon: float = 10.0
    delta: float = 1e-6
    top_k: int = 100
    temperature: float = 1.0
    max_new_tokens: int = 256
    _clip: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive_int(self.top_k, "InvisibleInk top_k")
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

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        ids, probabilities = invisible_ink_distribution(
            p_slm, p_llm, clip=self._clip, top_k=self.top_k, temperature=self.temperature
        )
        return SyncedToken(int(ids[sample_from(probabilities, generator)]))
