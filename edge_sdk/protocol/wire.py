"""Typed views of the wire protocol (``proto/coveil.proto``) and their codec.

Both ends speak in these dataclasses; :func:`encode_*` / :func:`decode_*`
turn them into protobuf messages and back.  Arrays travel as little-endian
raw bytes so decoding is a single ``np.frombuffer``.  This module imports the
generated protobuf code lazily: ``import edge_sdk`` stays numpy-only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import FusionSpace, check_finite, top_k_ids
from edge_sdk.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from edge_sdk.privacy.masking import FULL_UPLOAD_LIMIT
from edge_sdk.protocol.signals import CloudUpload, FusionMode, Observation

if TYPE_CHECKING:  # the generated message classes (edge_sdk/_wire/coveil_pb2.pyi), for annotations only
    from edge_sdk._wire.coveil_pb2 import (
        CloudMessage,
        Distribution,
        EdgeMessage,
        OpenSession,
        SessionOpened,
        TokenChosen,
        Upload,
    )

PROTOCOL_VERSION = 1
#: the deepest run-ahead (drafted steps past the last confirmed token) an edge accepts unless told otherwise;
#: the cloud's own cap too (``proto/coveil.proto``: ``OpenSession.lookahead``)
MAX_LOOKAHEAD = 8
#: the longest public prompt (tokens, BOS included) whose rows ``score_prompt`` asks for: the cloud holds the
#: prompt's logits whole, (L - 1) x V float32 (1 MiB a position on Gemma-3's 262,144 ids, 2 GiB at this cap), so
#: both sides refuse beyond it (lm-eval's default ``max_length`` of 2048 sends at most 2047 tokens)
MAX_SCORED_PROMPT_TOKENS = 2048

_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")


def pb() -> ModuleType:
    """The generated ``coveil_pb2`` module (built from proto/ at install time)."""
    try:
        from edge_sdk._wire import coveil_pb2
    except ImportError as exc:  # pragma: no cover - only on a broken install
        raise ImportError(
            "the generated wire code is missing: install the package (pip install -e '.[edge]') so that "
            "proto/coveil.proto is compiled"
        ) from exc
    return coveil_pb2


def ids_to_bytes(ids: np.ndarray) -> bytes:
    return np.asarray(ids, dtype=_U32).tobytes()


def values_to_bytes(values: np.ndarray) -> bytes:
    return np.asarray(values, dtype=_F32).tobytes()


def ids_from_bytes(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise ValueError(f"id bytes must be a multiple of 4 long, got {len(data)}")
    return np.frombuffer(data, dtype=_U32).astype(np.int64)


def values_from_bytes(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise ValueError(f"value bytes must be a multiple of 4 long, got {len(data)}")
    return np.frombuffer(data, dtype=_F32)


_MODE_TO_PB = {"cloud": 1, "edge": 2}
_MODE_FROM_PB = {1: "cloud", 2: "edge"}
_SPACE_TO_PB = {"prob": 1, "logit": 2}
_SPACE_FROM_PB = {0: "prob", 1: "prob", 2: "logit"}


@dataclass(frozen=True)
class SessionRequest:
    """Everything the edge tells the cloud when it opens a session (all of it public)."""

    prompt_ids: tuple[int, ...]
    mode: FusionMode
    alpha: float = DecodeSettings.alpha
    space: FusionSpace = "prob"
    temperature: float = DecodeSettings.temperature
    seed: int = DecodeSettings.seed
    max_new_tokens: int = DecodeSettings.max_new_tokens
    vocab_fingerprint: bytes = b""
    edge_model: str = ""
    vocab_size: int = 0
    top_m: int = DecodeSettings.top_m  # the cloud's values per sparse step unless the session asks otherwise
    resume_prefix: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: cloud-side fusion: the cloud sends the picked token's log-probability (and ``top_logprobs`` best ids')
    logprobs: bool = False
    top_logprobs: int = 0
    #: cloud-side fusion: the public JSON schema (JSON text) the cloud masks its fused row by; "" for free text
    json_schema: str = ""
    lookahead: int = 0  # the deepest run-ahead the edge accepts; 0 = lockstep
    #: the edge pads its signals to public sizes and asks the cloud to pad its own (False: what an older SDK sends)
    padded: bool = False
    #: echo with logprobs (edge-side): the cloud sends its rows at the public prompt's positions with the opening
    score_prompt: bool = False


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    cloud_model: str
    vocab_size: int
    prompt_tokens: int
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    protocol_version: int = PROTOCOL_VERSION
    lookahead: int = 0  # the run-ahead depth the cloud chose (at most the edge's); 0 = lockstep
    padded: bool = False  # the cloud pads its messages to public sizes (what the edge asked; an older adapter: no)
    #: ``score_prompt``: the cloud's row after each public prompt token but the last (``prompt_rows[i]`` predicts
    #: token ``i + 1``) and each row's value at that token (``prompt_token_values[i]``); empty when not asked
    prompt_rows: tuple[CloudDistribution, ...] = ()
    prompt_token_values: tuple[float, ...] = ()


@dataclass(frozen=True, eq=False)
class CloudDistribution:
    """The cloud's next-token distribution for one step, sparse or full.

    Sparse: exact ``values`` at ``ids`` (decreasing), every omitted entry is at
    most ``tail_bound`` and together they hold ``tail_mass``.  Full: ``dense``.
    """

    step: int
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    values: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    tail_bound: float = 0.0
    tail_mass: float = 0.0
    dense: np.ndarray | None = None
    forward_ns: int = 0
    #: run-ahead: the token at ``step - 1`` this row was computed after (``None``: lockstep, or the first step)
    assumes_token: int | None = None

    @property
    def is_full(self) -> bool:
        return self.dense is not None

    @classmethod
    def sparse_from(
        cls, step: int, values: np.ndarray, top_m: int, forward_ns: int = 0, *, probabilities: np.ndarray | None = None
    ) -> CloudDistribution:
        """Top-``top_m`` of ``values`` (probabilities, or raw logits in logit space) with its certificate.

        ``tail_bound`` is the smallest value sent (every omitted one is at most
        that); ``tail_mass`` is the probability the omitted ids hold, read off
        ``probabilities`` (the row's softmax) when ``values`` are logits.
        """
        ids = top_k_ids(values, top_m)
        return cls.from_top(step, ids, values[ids], (values if probabilities is None else probabilities)[ids],
                            values.shape[0], forward_ns)

    @classmethod
    def from_top(
        cls, step: int, ids: np.ndarray, values: np.ndarray, probs: np.ndarray, vocab_size: int, forward_ns: int = 0
    ) -> CloudDistribution:
        """A sparse row from its top ``ids`` (decreasing ``values``, ties to the lower id), with its certificate.

        ``probs`` are the row's probabilities at ``ids`` (``values`` themselves in probability space).
        ``tail_bound`` is the smallest value sent (every omitted one is at most that) and
        ``tail_mass = max(0, 1 - sum probs)`` the probability the omitted ids hold (in float64); both 0 when
        nothing is omitted.
        """
        sent = np.asarray(values, dtype=np.float32)
        omitted = vocab_size - len(ids)
        tail_bound = float(sent[-1]) if omitted and len(sent) else 0.0
        sent_mass = np.asarray(probs, dtype=np.float32).sum(dtype=np.float64)
        tail_mass = max(0.0, 1.0 - float(sent_mass)) if omitted else 0.0
        return cls(step, np.asarray(ids, dtype=np.int64), sent, tail_bound, tail_mass, None, forward_ns)

    def lower_dense(self, vocab_size: int, out: np.ndarray | None = None, fill: float = 0.0) -> np.ndarray:
        """A dense array exact where known and ``fill`` where omitted.

        ``fill`` must be a lower bound of every omitted value: 0 for
        probabilities, float32's lowest value for logits.  ``out``, a float32
        buffer of ``vocab_size`` reused across steps, saves faulting in a fresh
        megabyte each step.
        """
        if self.dense is not None:
            return self.dense
        if out is None:
            out = np.full(vocab_size, fill, dtype=np.float32)
        else:
            out.fill(fill)
        out[self.ids] = self.values
        return out

    def public_fill(self, vocab_size: int, space: FusionSpace) -> float:
        """The value a sparse row's omitted ids stand at when the edge decides from it.

        Computed from what the cloud sent only (never from the edge's own
        model), so deciding from it asks nothing of the cloud.  The omitted ids
        share the omitted mass evenly, at most the tail bound ``b``::

            prob:   fill = min(b, tail_mass / n_omitted)
            logit:  fill = min(b, log(tail_mass / n_omitted) + log Z),
                    log Z = logsumexp(sent logits) - log(1 - tail_mass)

        (in logit space the fill's softmax share is that same even share).  A
        row that lists every id has no fill; a tail mass of 0 fills with the
        lowest value of the space (0, or float32's minimum for logits).
        """
        omitted = vocab_size - len(self.ids)
        lowest = float(np.finfo(np.float32).min) if space == "logit" else 0.0
        if self.dense is not None or omitted <= 0 or self.tail_mass <= 0:
            return lowest
        share = self.tail_mass / omitted
        if space == "prob":
            return min(self.tail_bound, share)
        if not self.tail_mass < 1.0 or not len(self.values):
            return self.tail_bound
        top = float(self.values.max())
        log_z = top + float(np.log(np.exp(self.values.astype(np.float64) - top).sum())) - float(np.log1p(-self.tail_mass))
        return min(self.tail_bound, float(np.log(share)) + log_z)

    def filled(self, vocab_size: int, space: FusionSpace, out: np.ndarray | None = None) -> np.ndarray:
        """The row exact where sent and at :meth:`public_fill` where omitted (the full row itself when dense)."""
        return self.lower_dense(vocab_size, out=out, fill=self.public_fill(vocab_size, space))

    def top_ids(self, k: int) -> np.ndarray:
        """``TopK`` of the cloud's row (ids by decreasing value, ties to the lower id).

        A sparse row already lists its ids that way; it must hold at least
        ``k`` of them (``ValueError`` otherwise: ask for ``top_m >= k``).
        """
        if self.dense is not None:
            return top_k_ids(self.dense, k)
        if len(self.ids) < k:
            raise ValueError(f"the sparse distribution holds {len(self.ids)} ids, fewer than K = {k}: use top_m >= K")
        return self.ids[:k]

    def top_id(self) -> int:
        """The cloud's own most likely token (``argmax``, ties to the lower id)."""
        return int(self.top_ids(1)[0])


def step_exposure(signal: Observation, dist: CloudDistribution, k: int) -> np.ndarray:
    """DecodeLeak's ``E_t^K`` of one step, as both ends compute it (one rule, one ``K``).

    Cloud-side fusion: ``TopK`` of the uploaded SLM values
    (:meth:`~edge_sdk.policies.base.CloudUpload.exposure`).  Edge-side fusion:
    the cloud's own ``TopK`` of the step's distribution ``dist`` (``p_llm``, or
    ``z_llm`` in logit space: the same ranking).
    """
    if isinstance(signal, CloudUpload):
        return signal.exposure(k)
    return dist.top_ids(k)


def encode_open(req: SessionRequest) -> EdgeMessage:
    m = pb()
    open_msg = m.OpenSession(
        protocol_version=PROTOCOL_VERSION,
        token_ids=m.TokenIds(ids=ids_to_bytes(np.array(req.prompt_ids))),
        mode=_MODE_TO_PB[req.mode],
        space=_SPACE_TO_PB[req.space],
        alpha=req.alpha,
        temperature=req.temperature,
        seed=req.seed,
        max_new_tokens=req.max_new_tokens,
        vocab_fingerprint=req.vocab_fingerprint,
        edge_model=req.edge_model,
        vocab_size=req.vocab_size,
        top_m=req.top_m,
        resume_prefix=m.TokenIds(ids=ids_to_bytes(np.array(req.resume_prefix))),
        stop_token_ids=m.TokenIds(ids=ids_to_bytes(np.array(req.stop_token_ids))),
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        json_schema=req.json_schema,
        lookahead=req.lookahead,
        padded=req.padded,
        score_prompt=req.score_prompt,
    )
    return m.EdgeMessage(open=open_msg)


def decode_open(msg: OpenSession, tokenize: Callable[[str], Sequence[int]] | None = None) -> SessionRequest:
    """``OpenSession`` → :class:`SessionRequest`; ``tokenize(text)`` handles a text query.

    Raises ``ValueError`` with a clear message on any malformed field.
    """
    if msg.WhichOneof("public_query") == "text":
        if tokenize is None:
            raise ValueError("this endpoint needs the public query as token ids")
        prompt = tuple(int(i) for i in tokenize(msg.text))
    else:
        prompt = tuple(int(i) for i in ids_from_bytes(msg.token_ids.ids))
    if msg.mode not in _MODE_FROM_PB:
        raise ValueError("fusion mode must be FUSION_MODE_CLOUD or FUSION_MODE_EDGE")
    if msg.space not in _SPACE_FROM_PB:
        raise ValueError(f"unknown fusion space {msg.space}")
    return SessionRequest(
        prompt_ids=prompt,
        mode=_MODE_FROM_PB[msg.mode],  # type: ignore[arg-type]
        alpha=float(msg.alpha),
        space=_SPACE_FROM_PB[msg.space],  # type: ignore[arg-type]
        temperature=float(msg.temperature),
        seed=int(msg.seed),
        max_new_tokens=int(msg.max_new_tokens),
        vocab_fingerprint=bytes(msg.vocab_fingerprint),
        edge_model=msg.edge_model,
        vocab_size=int(msg.vocab_size),
        top_m=int(msg.top_m) or DecodeSettings.top_m,
        resume_prefix=tuple(int(i) for i in ids_from_bytes(msg.resume_prefix.ids)),
        stop_token_ids=tuple(int(i) for i in ids_from_bytes(msg.stop_token_ids.ids)),
        logprobs=bool(msg.logprobs),
        top_logprobs=int(msg.top_logprobs),
        json_schema=msg.json_schema,
        lookahead=int(msg.lookahead),
        padded=bool(msg.padded),
        score_prompt=bool(msg.score_prompt),
    )


def encode_opened(info: SessionInfo) -> CloudMessage:
    m = pb()
    return m.CloudMessage(
        opened=m.SessionOpened(
            session_id=info.session_id,
            protocol_version=info.protocol_version,
            cloud_model=info.cloud_model,
            vocab_size=info.vocab_size,
            prompt_tokens=info.prompt_tokens,
            eos_token_ids=m.TokenIds(ids=ids_to_bytes(np.array(sorted(info.eos_token_ids)))),
            max_new_tokens=info.max_new_tokens,
            lookahead=info.lookahead,
            padded=info.padded,
            prompt_rows=[encode_distribution(row).distribution for row in info.prompt_rows],
            prompt_token_values=values_to_bytes(np.array(info.prompt_token_values, dtype=np.float32)),
        )
    )


def decode_opened(msg: SessionOpened) -> SessionInfo:
    """``SessionOpened`` → :class:`SessionInfo` (``ValueError`` for malformed prompt rows)."""
    rows = tuple(decode_distribution(row, int(msg.vocab_size)) for row in msg.prompt_rows)
    token_values = values_from_bytes(msg.prompt_token_values)
    if token_values.size != len(rows) or any(row.step != i for i, row in enumerate(rows)):
        raise ValueError(f"the cloud sent {len(rows)} prompt rows (numbered in order?) and {token_values.size} "
                         "prompt token values")
    check_finite(token_values, "the cloud's prompt token values")
    return SessionInfo(
        session_id=msg.session_id,
        cloud_model=msg.cloud_model,
        vocab_size=int(msg.vocab_size),
        prompt_tokens=int(msg.prompt_tokens),
        eos_token_ids=frozenset(int(i) for i in ids_from_bytes(msg.eos_token_ids.ids)),
        max_new_tokens=int(msg.max_new_tokens),
        protocol_version=int(msg.protocol_version),
        lookahead=int(msg.lookahead),
        padded=bool(msg.padded),
        prompt_rows=rows,
        prompt_token_values=tuple(float(v) for v in token_values),
    )


def encode_distribution(dist: CloudDistribution) -> CloudMessage:
    m = pb()
    if dist.dense is not None:
        body = m.Distribution(step=dist.step, dense=values_to_bytes(dist.dense), forward_ns=dist.forward_ns)
    else:
        body = m.Distribution(
            step=dist.step,
            ids=ids_to_bytes(dist.ids),
            values=values_to_bytes(dist.values),
            tail_bound=dist.tail_bound,
            tail_mass=dist.tail_mass,
            forward_ns=dist.forward_ns,
        )
    if dist.assumes_token is not None:
        body.assumes_token = dist.assumes_token
    return m.CloudMessage(distribution=body)


def decode_distribution(msg: Distribution, vocab_size: int) -> CloudDistribution:
    assumes = int(msg.assumes_token) if msg.HasField("assumes_token") else None
    if msg.dense:
        dense = values_from_bytes(msg.dense)
        if dense.shape[0] != vocab_size:
            raise ValueError(f"full distribution has {dense.shape[0]} entries, vocabulary has {vocab_size}")
        check_finite(dense, "the cloud's full distribution")
        return CloudDistribution(step=int(msg.step), dense=dense, forward_ns=int(msg.forward_ns), assumes_token=assumes)
    ids, values = ids_from_bytes(msg.ids), values_from_bytes(msg.values)
    if ids.shape != values.shape:
        raise ValueError(f"sparse distribution has {ids.size} ids but {values.size} values")
    if ids.size and int(ids.max()) >= vocab_size:
        raise ValueError("sparse distribution names an id outside the vocabulary")
    check_finite(values, "the cloud's sparse distribution")
    if not (np.isfinite(msg.tail_bound) and np.isfinite(msg.tail_mass)):
        raise ValueError("the cloud's sparse distribution has a non-finite tail bound or tail mass")
    # the edge reads the cloud's top token, TopK and certificates off this order: it must be what it claims
    if values.size > 1 and not bool(np.all(values[1:] <= values[:-1])):
        raise ValueError("the cloud's sparse distribution does not list its ids by decreasing value")
    if values.size and float(msg.tail_bound) > float(values[-1]):
        raise ValueError("the cloud's tail bound exceeds a value it sent")
    if np.unique(ids).size != ids.size:
        raise ValueError("the cloud's sparse distribution lists an id twice")
    return CloudDistribution(
        step=int(msg.step),
        ids=ids,
        values=values,
        tail_bound=float(msg.tail_bound),
        tail_mass=float(msg.tail_mass),
        forward_ns=int(msg.forward_ns),
        assumes_token=assumes,
    )


def encode_upload(
    step: int, upload: CloudUpload, *, vocab_size: int | None = None, no_stop: bool = False
) -> EdgeMessage:
    """An upload of every id of the vocabulary (``0..vocab_size-1``) travels dense (values only); any other
    upload sparse (a dense one names no ids: only one that covers the whole vocabulary can be read back).

    ``no_stop``: the cloud must not pick an end-of-generation id at this step.
    """
    m = pb()
    n = len(upload)
    if n > 1 and n == vocab_size and upload.ids[0] == 0 and upload.ids[-1] == n - 1:  # unique, ascending: 0..n-1
        body = m.Upload(values=values_to_bytes(upload.values), dense=True)
    else:
        body = m.Upload(ids=ids_to_bytes(upload.ids), values=values_to_bytes(upload.values))
    return m.EdgeMessage(signal=m.StepSignal(step=step, upload=body, no_stop=no_stop))


def decode_upload(msg: Upload, vocab_size: int, space: FusionSpace = "prob") -> CloudUpload:
    """``Upload`` → :class:`CloudUpload`, the inverse of :func:`encode_upload` (a dense one lists ids
    ``0..vocab_size-1``).  Raises ``ValueError`` on malformed bytes or mismatched lengths."""
    values = values_from_bytes(msg.values)
    ids = np.arange(values.size, dtype=np.int64) if msg.dense else ids_from_bytes(msg.ids)
    if msg.dense and values.size != vocab_size:
        raise ValueError(f"a dense upload carries {values.size} values, the vocabulary has {vocab_size}")
    return CloudUpload(ids, values, space)


def encode_token(step: int, token_id: int) -> EdgeMessage:
    m = pb()
    return m.EdgeMessage(signal=m.StepSignal(step=step, token_id=int(token_id)))


def encode_request_full(step: int) -> EdgeMessage:
    m = pb()
    return m.EdgeMessage(request_full=m.FullDistributionRequest(step=step))


def encode_close() -> EdgeMessage:
    m = pb()
    return m.EdgeMessage(close=m.Close())


def encode_token_chosen(step: int, token_id: int, finished: bool, logprobs: TokenLogprobs | None = None) -> CloudMessage:
    m = pb()
    chosen = m.TokenChosen(step=step, token_id=token_id, finished=finished)
    if logprobs is not None:
        ids = np.array([i for i, _ in logprobs.top], dtype=np.int64)
        values = np.array([v for _, v in logprobs.top], dtype=np.float32)
        chosen.logprobs.CopyFrom(m.TokenLogprobs(logprob=logprobs.logprob, top_ids=ids_to_bytes(ids),
                                                 top_logprobs=values_to_bytes(values)))
    return m.CloudMessage(token=chosen)


def decode_token_logprobs(msg: TokenChosen, vocab_size: int, top_n: int) -> TokenLogprobs | None:
    """A ``TokenChosen``'s log-probabilities (``None`` when it carries none); ``ValueError`` when they are not
    log-probabilities (positive or NaN), name an id outside the vocabulary, are out of order or more than
    ``top_n`` (<= 20)."""
    if not msg.HasField("logprobs"):
        return None
    body = msg.logprobs
    ids, values = ids_from_bytes(body.top_ids), values_from_bytes(body.top_logprobs).astype(np.float64)
    if ids.shape != values.shape or ids.size > min(top_n, MAX_TOP_LOGPROBS):
        raise ValueError(f"{ids.size} top ids with {values.size} log-probabilities, at most {top_n} asked for")
    if ids.size and int(ids.max()) >= vocab_size:
        raise ValueError("a top log-probability names an id outside the vocabulary")
    logprob = float(body.logprob)
    if not logprob <= 0.0 or np.any(~(values <= 0.0)) or np.any(np.diff(values) > 0):
        raise ValueError("the log-probabilities are not ordered values <= 0")
    return TokenLogprobs(int(msg.token_id), logprob, tuple(zip(ids.tolist(), values.tolist(), strict=True)))


def encode_finished(steps: int, reason: str) -> CloudMessage:
    m = pb()
    return m.CloudMessage(finished=m.Finished(steps=steps, reason=reason))



# -- public sizes ------------------------------------------------------------------------------------------
#
# A padded message is brought to the size of its *template*: the same message with every field whose length
# could vary (a varint, a float that may be 0 and left out, a flag, the number of values uploaded) at its longest
# value, built from public settings only.  An on-path observer who reads TLS record lengths then sees sizes that
# depend on those settings and the step count, never on a token, an upload's length or a value.

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
#: the longest ``Finished.reason`` a template holds ("max_new_tokens" and every shorter reason fit)
_REASON_LENGTH = 16
#: what padding adds beyond the template, so that any message up to the template's size can be padded to it
#: (one empty entry costs 2 bytes; 1 byte cannot be added)
_PAD_SLACK = 2


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def padding_entries(extra: int) -> list[int]:
    """Lengths of ``padding`` entries that add exactly ``extra`` bytes to a message (``ValueError`` for 1).

    An entry of ``n`` bytes costs ``1 + varint_size(n) + n`` (a one-byte tag, the length, the filler).  One
    entry reaches every ``extra >= 2`` but those its length prefix jumps over (130, 16387, ...); there a second,
    empty entry (2 bytes) makes up the rest.
    """
    if extra == 0:
        return []
    if extra < 2:
        raise ValueError(f"padding cannot add {extra} byte")
    for wanted in (extra, extra - 2):
        for prefix in range(1, 6):
            n = wanted - 1 - prefix
            if n >= 0 and _varint_size(n) == prefix:
                return [n] if wanted == extra else [n, 0]
    raise AssertionError(f"no padding of {extra} bytes")  # pragma: no cover - every extra >= 2 has one


def pad_to(message: EdgeMessage | CloudMessage, size: int) -> None:
    """Append ``padding`` entries so that ``message`` serialises to exactly ``size`` bytes (it must not hold any
    yet and be at most ``size - 2`` bytes, or exactly ``size``)."""
    extra = size - message.ByteSize()
    if extra < 0 or message.padding:
        raise ValueError(f"a {message.ByteSize()}-byte message cannot be padded to {size} bytes")
    message.padding.extend(b"\0" * n for n in padding_entries(extra))


def upload_template_values(max_values: int, vocab_size: int) -> tuple[int, bool]:
    """The largest upload a step may send when the policy uploads at most ``max_values`` values: how many ids it
    lists sparse, and whether it may be dense.  An upload of every id travels dense (values only); listed sparse
    it is one cut to ``FULL_UPLOAD_LIMIT`` ids (the decoder cuts a whole-vocabulary upload under a mask)."""
    if max_values >= vocab_size:
        return min(vocab_size - 1, FULL_UPLOAD_LIMIT), True
    return max_values, False


def _upload_template(step: int, max_values: int, vocab_size: int) -> EdgeMessage:
    m = pb()
    sparse, dense = upload_template_values(max_values, vocab_size)
    largest = m.Upload(ids=b"\0" * 4 * sparse, values=b"\0" * 4 * sparse)
    if dense and 4 * vocab_size > largest.ByteSize():
        largest = m.Upload(values=b"\0" * 4 * vocab_size, dense=True)
    return m.EdgeMessage(signal=m.StepSignal(step=step, upload=largest, no_stop=True))


def pad_edge_message(message: EdgeMessage, *, vocab_size: int, max_upload: int) -> EdgeMessage:
    """``message`` padded to its public size: a step signal to that of the largest one the step may send
    (``max_upload`` values, or a token id at its longest); the open, a full-row request and a close carry no
    private length and stay as they are.  ``ValueError`` for an upload past ``max_upload``."""
    if message.WhichOneof("kind") != "signal":
        return message
    signal = message.signal
    if signal.WhichOneof("signal") == "upload":
        values = len(signal.upload.values) // 4
        if values > max_upload:
            raise ValueError(f"an upload of {values} values, more than the policy's public maximum {max_upload}")
        template = _upload_template(signal.step, max_upload, vocab_size)
    else:
        template = type(message)(signal=type(signal)(step=signal.step, token_id=_U32_MAX))
    pad_to(message, template.ByteSize() + _PAD_SLACK)
    return message


def pad_cloud_message(message: CloudMessage, request: SessionRequest) -> CloudMessage:
    """``message`` padded to its public size when the session asked (``request.padded``): a distribution, a pick
    and the end to that of the same message with every varying field at its longest (the step and how many
    values it lists are public); the session's answer to the open stays as it is."""
    kind = message.WhichOneof("kind")
    if not request.padded or kind not in ("distribution", "token", "finished"):
        return message
    template = type(message)()
    template.CopyFrom(message)
    template.ClearField("padding")
    if kind == "distribution":
        row = template.distribution
        if not row.dense:
            row.tail_bound, row.tail_mass = 1.0, 1.0
        row.forward_ns, row.assumes_token = _U64_MAX, _U32_MAX
    elif kind == "token":
        chosen = template.token
        chosen.token_id, chosen.finished = _U32_MAX, True
        if request.logprobs:
            n = max(request.top_logprobs, len(chosen.logprobs.top_ids) // 4)
            chosen.logprobs.logprob = -1.0
            chosen.logprobs.top_ids, chosen.logprobs.top_logprobs = b"\0" * 4 * n, b"\0" * 4 * n
    else:
        template.finished.reason = "x" * max(_REASON_LENGTH, len(template.finished.reason))
    pad_to(message, template.ByteSize() + _PAD_SLACK)
    return message
