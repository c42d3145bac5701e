"""CusText (Chen et al., ACL Findings 2023), edge-side: the fused argmax replaced through the exponential mechanism.

The output set of a token comes from the edge model's own token embeddings
(:class:`EmbeddingNeighbours`): by default CusText's *conservative* mapping,
in which the vocabulary is partitioned into clusters that share one output
set; optionally its *aggressive* mapping, one nearest-neighbour set per token.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from edge_sdk.backends.gguf_header import read_gguf_header
from edge_sdk.models import cache_root
from edge_sdk.privacy.accountant import ReleaseEvent
from edge_sdk.fusion import check_alpha, fuse, sample_from, top_k_ids
from edge_sdk.policies.base import Policy, require_rng
from edge_sdk.protocol.signals import FusionMode, SyncedToken
from edge_sdk.privacy.analysis import EpsilonUnit, check_epsilon, check_positive_int

if TYPE_CHECKING:
    from edge_sdk.backends.base import SLMBackend

CusTextMapping = Literal["conservative", "aggressive"]
CUSTEXT_MAPPINGS: tuple[str, ...] = ("conservative", "aggressive")


class TokenClusters:
    """A partition of the vocabulary into clusters of (at most) ``size`` tokens, built greedily.

    CusText's conservative mapping: token ids are visited in increasing order
    (the original visits words by corpus frequency; BPE/SentencePiece ids
    roughly follow merge frequency); an id not yet in a cluster opens one with
    itself and its ``size - 1`` most similar ids *not yet in any cluster*
    (cosine similarity, ties to the lower id).  Clusters are disjoint, cover
    every id, and depend only on the embeddings.  Only the last clusters to
    form may be smaller, when fewer than ``size`` ids remain.

    Building costs about ``V^2 d / size`` multiply-adds (batched matrix
    products over the ids still unassigned): ~20 s for Gemma-3's 262k x 640
    on two cores, once per embedding matrix (:func:`embedding_neighbours_for`
    caches it).
    """

    #: anchors whose similarities are computed in one matrix product
    batch = 128

    def __init__(self, unit: np.ndarray | None, size: int, *, labels: np.ndarray | None = None) -> None:
        """Build the partition of ``unit``'s rows (unit-norm embeddings), or take the one ``labels`` numbers (each
        id's cluster, as :attr:`labels` gave it; ``unit`` is then not read)."""
        self.size = check_positive_int(size, "cluster size")
        if labels is not None:
            label = np.asarray(labels, dtype=np.int64)
            if label.ndim != 1 or (label.size and (label.min() != 0 or np.unique(label).size != label.max() + 1)):
                raise ValueError("cluster labels must number the clusters 0, 1, ... without a gap")
            order = np.argsort(label, kind="stable")  # each cluster's ids ascending, clusters in label order
            self._label = label
            self._members = np.split(order, np.flatnonzero(np.diff(label[order])) + 1)
            return
        if unit is None:
            raise ValueError("give the unit rows to build the clusters from, or their labels")
        vocab = unit.shape[0]
        label = np.full(vocab, -1, dtype=np.int64)
        members: list[np.ndarray] = []
        remaining = np.arange(vocab, dtype=np.int64)
        rows = np.asarray(unit, dtype=np.float32)  # the unassigned rows, compacted now and then (float32 copies once)
        rows_ids = remaining
        while remaining.size:
            if remaining.size < 0.75 * rows_ids.size:
                rows_ids = remaining
                rows = np.asarray(unit[rows_ids], dtype=np.float32)
            taken = label[rows_ids] >= 0
            penalty = np.where(taken, np.float32(-np.inf), np.float32(0.0))
            anchors = remaining[: self.batch]
            similarities = np.asarray(unit[anchors], dtype=np.float32) @ rows.T
            positions = np.searchsorted(rows_ids, anchors)  # rows_ids stays ascending
            for j, anchor in enumerate(anchors.tolist()):
                if label[anchor] >= 0:
                    continue
                row = similarities[j]
                row += penalty
                row[positions[j]] = np.inf  # the anchor opens its own cluster
                chosen = top_k_ids(row, self.size)
                chosen = chosen[row[chosen] > -np.inf]
                ids = rows_ids[chosen]
                label[ids] = len(members)
                members.append(np.sort(ids))
                penalty[chosen] = -np.inf
            remaining = remaining[label[remaining] < 0]
        self._label = label
        self._members = members

    @property
    def labels(self) -> np.ndarray:
        """Each id's cluster number (read-only view)."""
        view = self._label.view()
        view.flags.writeable = False
        return view

    def __len__(self) -> int:
        return len(self._members)

    def __repr__(self) -> str:
        return f"TokenClusters(vocab_size={self._label.size}, size={self.size}, clusters={len(self)})"

    def of(self, token_id: int) -> np.ndarray:
        """The ids of ``token_id``'s cluster (ascending, ``token_id`` included)."""
        return self._members[int(self._label[token_id])]


class EmbeddingNeighbours:
    """Nearest tokens by cosine similarity of token-embedding rows.

    The rows are normalised once (kept in float16 if given float16, else
    float32).  :meth:`of` computes one row's similarity to every row, block by
    block in float32, and remembers the answer for up to ``cache_size`` token
    ids (oldest evicted first); :meth:`clusters` builds (once per size) the
    conservative mapping's partition.
    """

    #: Rows converted to float32 at a time (bounds the temporary memory).
    block_rows = 16384

    def __init__(self, embeddings: np.ndarray, cache_size: int = 4096) -> None:
        matrix = np.asarray(embeddings)
        if matrix.ndim != 2 or 0 in matrix.shape or not np.issubdtype(matrix.dtype, np.floating):
            raise ValueError(
                f"embeddings must be a non-empty 2-D float array [V, d], got {matrix.dtype} {matrix.shape}"
            )
        self._cache_size = check_positive_int(cache_size, "neighbour cache size")
        storage = np.float16 if matrix.dtype == np.float16 else np.float32
        self._unit = np.empty(matrix.shape, dtype=storage)
        for start in range(0, matrix.shape[0], self.block_rows):
            block = matrix[start : start + self.block_rows].astype(np.float32)
            norms = np.linalg.norm(block, axis=1, keepdims=True)
            self._unit[start : start + self.block_rows] = block / np.maximum(norms, np.finfo(np.float32).tiny)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._clusters: dict[int, TokenClusters] = {}
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return int(self._unit.shape[0])

    @property
    def dim(self) -> int:
        return int(self._unit.shape[1])

    def __repr__(self) -> str:
        return f"EmbeddingNeighbours(vocab_size={self.vocab_size}, dim={self.dim})"

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the embedding vocabulary [0, {self.vocab_size})")
        return int(token_id)

    def similarities(self, token_id: int, ids: np.ndarray | None = None) -> np.ndarray:
        """Cosine similarity of ``token_id``'s row to every row, or to the rows ``ids`` (float32)."""
        query = self._unit[self._check_id(token_id)].astype(np.float32)
        if ids is not None:
            return self._unit[np.asarray(ids)].astype(np.float32) @ query
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
        n = check_positive_int(n, "neighbour count n")
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

    def clusters(self, size: int) -> TokenClusters:
        """The conservative mapping's partition into clusters of ``size``: built on first use (~20 s for Gemma-3 on
        two cores), then kept here and, as each id's cluster number, in ``cache_root()/custext`` under the
        normalised rows' SHA-256 and ``size``, so the next process reads it (a file that does not fit the
        vocabulary is built again)."""
        size = check_positive_int(size, "cluster size")
        with self._lock:
            if size not in self._clusters:
                self._clusters[size] = self._stored_clusters(size)
            return self._clusters[size]

    def _stored_clusters(self, size: int) -> TokenClusters:
        digest = hashlib.sha256(memoryview(np.ascontiguousarray(self._unit)).cast("B")).hexdigest()
        stored = cache_root() / "custext" / f"{digest[:32]}-{self._unit.dtype}-size{size}.npy"
        try:
            label = np.load(stored, allow_pickle=False)
            if label.shape == (self.vocab_size,):
                return TokenClusters(None, size, labels=label)
        except (OSError, ValueError):
            pass
        clusters = TokenClusters(self._unit, size)
        staging: Path | None = None
        try:  # written under a temporary name and renamed: two processes building at once both land whole files
            stored.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=stored.parent, suffix=".npy", delete=False) as file:
                staging = Path(file.name)
                np.save(file, clusters.labels)
            os.replace(staging, stored)
        except OSError:  # a read-only or full disk: the clusters are still here for this process
            pass
        finally:
            if staging is not None:
                staging.unlink(missing_ok=True)  # gone once renamed; a partial write is removed
        return clusters


def load_token_embeddings(gguf_path: str | PathLike[str], dtype: type[np.floating] = np.float32) -> np.ndarray:
    """The ``token_embd.weight`` matrix ``[n_vocab, d]`` of a GGUF model, dequantised.

    GGUF lists dimensions fastest-varying first, so the tensor's shape is
    ``(d, n_vocab)``; any quantisation type ``gguf`` knows is dequantised,
    ``block_rows`` rows at a time.  ``dtype`` is ``np.float32`` (default) or
    ``np.float16``, which halves the memory of the matrix and of
    :class:`EmbeddingNeighbours` built from it but makes each uncached
    neighbour query convert every row to float32 (about 10x slower: ~0.25 s
    instead of ~0.03 s for 262,144 x 640 on one core).
    """
    if dtype not in (np.float16, np.float32):
        raise ValueError(f"embedding dtype must be numpy.float16 or numpy.float32, got {dtype}")
    import gguf  # imported here: the SDK's import stays numpy-only

    data = np.memmap(gguf_path, mode="r")
    tensor = read_gguf_header(data).tensor("token_embd.weight")
    if tensor is None:
        raise ValueError(f"{gguf_path} has no token_embd.weight tensor")
    dims, kind, offset = tensor.dims, tensor.kind, tensor.offset
    dim, n_vocab = int(dims[0]), int(np.prod(dims[1:]))
    quantised = kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    stored = np.uint8 if quantised else (np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
    shape = gguf.quants.quant_shape_to_byte_shape((n_vocab, dim), kind) if quantised else (n_vocab, dim)
    raw = np.frombuffer(data, dtype=stored, count=int(np.prod(shape)), offset=offset).reshape(shape)
    out = np.empty((n_vocab, dim), dtype=dtype)
    for start in range(0, n_vocab, EmbeddingNeighbours.block_rows):
        # a plain array, not a memmap view: gguf dequantises 16 rows at a time, and memmap slices cost ~5x more
        block = np.array(raw[start : start + EmbeddingNeighbours.block_rows])
        out[start : start + block.shape[0]] = gguf.quants.dequantize(block, kind)
    return out


#: neighbour sources by GGUF file (path, modification time, size) or by embedding matrix (its digest); the two
#: most recent are kept
_NEIGHBOURS_CACHE: dict[tuple[str | int, ...], EmbeddingNeighbours] = {}
_NEIGHBOURS_LOCK = threading.Lock()
_NEIGHBOURS_KEPT = 2


def _cached_neighbours(key: tuple[str | int, ...], build: Callable[[], np.ndarray]) -> EmbeddingNeighbours:
    with _NEIGHBOURS_LOCK:
        neighbours = _NEIGHBOURS_CACHE.get(key)
        if neighbours is None:
            neighbours = EmbeddingNeighbours(build())
            while len(_NEIGHBOURS_CACHE) >= _NEIGHBOURS_KEPT:
                del _NEIGHBOURS_CACHE[next(iter(_NEIGHBOURS_CACHE))]
            _NEIGHBOURS_CACHE[key] = neighbours
        return neighbours


def embedding_neighbours_for(gguf_path: str | PathLike[str]) -> EmbeddingNeighbours:
    """:class:`EmbeddingNeighbours` of a GGUF model's token embeddings, loaded once per file.

    A 262k x 640 matrix takes seconds to dequantise and ~0.7 GB to hold, and
    its clusters tens of seconds to build, so repeated generations with the
    same model share one instance (keyed by the resolved path, modification
    time and size, so a rewritten file is reloaded).
    """
    path = Path(gguf_path).resolve()
    stat = path.stat()
    return _cached_neighbours(("file", str(path), stat.st_mtime_ns, stat.st_size), lambda: load_token_embeddings(path))


def embedding_neighbours_of_matrix(embeddings: np.ndarray) -> EmbeddingNeighbours:
    """:class:`EmbeddingNeighbours` of a ``[V, d]`` embedding matrix, built once per matrix content (keyed by
    its SHA-256, ~0.5 s for 262k x 640 float32, so every setting of a sweep shares the clusters)."""
    matrix = np.ascontiguousarray(embeddings)
    digest = hashlib.sha256(memoryview(matrix).cast("B")).hexdigest()
    return _cached_neighbours(("matrix", digest, *matrix.shape, str(matrix.dtype)), lambda: matrix)


def embedding_neighbours_of(backend: object) -> EmbeddingNeighbours:
    """The neighbour source of an edge backend: its own embedding matrix when it has one
    (``backend.token_embeddings()``, e.g. a transformers SLM), else its GGUF file's (``backend.source.gguf_path``,
    e.g. llama.cpp)."""
    token_embeddings = getattr(backend, "token_embeddings", None)
    if token_embeddings is not None:
        return embedding_neighbours_of_matrix(token_embeddings())
    gguf_path = getattr(getattr(backend, "source", None), "gguf_path", None)
    if gguf_path is None:
        raise ValueError(
            f"CusText needs token embeddings, and backend {type(backend).__name__} has neither token_embeddings() "
            "nor source.gguf_path: pass neighbours=EmbeddingNeighbours(embeddings) explicitly"
        )
    return embedding_neighbours_for(gguf_path)


def custext_probabilities(similarities: np.ndarray, epsilon: float) -> np.ndarray:
    """The exponential mechanism over an output set::

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


def custext_output_set(
    token_id: int, neighbours: EmbeddingNeighbours, n_neighbours: int, mapping: CusTextMapping = "conservative"
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, similarities to token_id)`` of ``token_id``'s output set under ``mapping``.

    Conservative: ``token_id``'s cluster (:meth:`EmbeddingNeighbours.clusters`),
    shared by every member, so any two tokens of a cluster are
    ``eps``-indistinguishable.  Aggressive: ``token_id``'s own
    ``n_neighbours`` nearest tokens (sets overlap; tokens whose sets differ
    are told apart by the set).
    """
    if mapping == "aggressive":
        return neighbours.of(token_id, n_neighbours)
    if mapping != "conservative":
        raise ValueError(f"CusText mapping must be one of {CUSTEXT_MAPPINGS}, got {mapping!r}")
    ids = neighbours.clusters(n_neighbours).of(token_id)
    return ids, neighbours.similarities(token_id, ids)


def custext_replace(
    token_id: int,
    neighbours: EmbeddingNeighbours,
    *,
    epsilon: float,
    n_neighbours: int,
    rng: np.random.Generator,
    mapping: CusTextMapping = "conservative",
) -> int:
    """Replace ``token_id`` by a draw from :func:`custext_probabilities` over its output set."""
    ids, similarities = custext_output_set(token_id, neighbours, n_neighbours, mapping)
    return int(ids[sample_from(custext_probabilities(similarities, epsilon), rng)])


@dataclass
class CusText(Policy):
    """CusText, edge-side: the fused argmax is replaced through the exponential mechanism.

    ``y = argmax p_fuse``, then the synced token is drawn from ``y``'s output
    set (:func:`custext_output_set`: its cluster under the default
    ``mapping="conservative"``, as in the original; its ``n_neighbours``
    nearest tokens under ``"aggressive"``) with :func:`custext_probabilities`
    over the cosine similarities of the model's token embeddings.
    ``epsilon`` is the exponential mechanism's budget for **one token**, used
    as is (every grid point a distinct mechanism).

    :meth:`from_backend` reads the backend's own embedding matrix
    (``backend.token_embeddings()``, a transformers SLM) or its GGUF file's
    (``backend.source.gguf_path``, llama.cpp), once per matrix or file.

    Args:
        neighbours: the token-embedding neighbour source (required unless built by :meth:`from_backend`).
        epsilon: per-token budget (the swept parameter).
        n_neighbours: size of the output set ``|Y_x|`` (20 in the original).
        mapping: "conservative" (clusters sharing one output set) or "aggressive" (a set per token).
    """

    name = "custext"
    modes = frozenset({"edge"})
    epsilon_units: ClassVar[Mapping[str, EpsilonUnit]] = {"edge": "per_token"}

    neighbours: EmbeddingNeighbours | None = None
    epsilon: float = 5.0
    n_neighbours: int = 20
    mapping: CusTextMapping = "conservative"

    def __post_init__(self) -> None:
        if not isinstance(self.neighbours, EmbeddingNeighbours):
            raise ValueError(
                "CusText needs neighbours=EmbeddingNeighbours(embeddings), e.g. from load_token_embeddings(gguf_path), "
                "or CusText.from_backend(slm) for a backend with token_embeddings() or a GGUF file"
            )
        self.check_params(epsilon=self.epsilon, n_neighbours=self.n_neighbours, mapping=self.mapping)

    @classmethod
    def check_params(cls, **params: Any) -> None:
        """The constructor's checks of ``epsilon``, ``n_neighbours`` and ``mapping``, without the embeddings
        (:meth:`from_backend` loads those from the edge model)."""
        check_epsilon(params.get("epsilon", cls.epsilon))
        check_positive_int(params.get("n_neighbours", cls.n_neighbours), "CusText neighbour count n_neighbours")
        mapping = params.get("mapping", cls.mapping)
        if mapping not in CUSTEXT_MAPPINGS:
            raise ValueError(f"CusText mapping must be one of {CUSTEXT_MAPPINGS}, got {mapping!r}")

    def release_event(self, mode: FusionMode) -> ReleaseEvent:
        """Not DP in the private context: ``epsilon`` bounds swapping the fused token within its output set, and
        tokens of different output sets (what two contexts steer the fusion to) have disjoint outputs."""
        return ReleaseEvent.non_private(
            "CusText's epsilon covers a token swapped within its output set, not the private context"
        )

    @classmethod
    def from_backend(cls, backend: SLMBackend, **params: Any) -> CusText:
        """CusText over ``backend``'s token embeddings (:func:`embedding_neighbours_of`: its own matrix, or its
        GGUF file's; built once per matrix or file).

        ``neighbours=`` in ``params`` takes precedence; a backend with neither needs it.
        """
        if params.get("neighbours") is None:
            params["neighbours"] = embedding_neighbours_of(backend)
        return cls(**params)

    def llm_support(self, mode: FusionMode) -> int | None:
        return 1  # sanitises y* = argmax p_fuse; the draw itself reads only the embeddings

    def edge_token(
        self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float, rng: np.random.Generator | None = None
    ) -> SyncedToken:
        generator = require_rng(rng, self.name)
        fused_argmax = int(np.argmax(fuse(p_llm, p_slm, check_alpha(alpha))))
        return SyncedToken(
            custext_replace(
                fused_argmax,
                self.neighbours,
                epsilon=self.epsilon,
                n_neighbours=self.n_neighbours,
                rng=generator,
                mapping=self.mapping,
            )
        )
