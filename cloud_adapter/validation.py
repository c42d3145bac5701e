"""Input validation for the cloud adapter: pure functions over the edge's messages, testable without a model.

Every check raises :class:`~edge_sdk.protocol.status.CloudError` (a gRPC status code name and a
message) before anything of the message is applied.  Cheap checks on the raw
``OpenSession`` (:func:`check_open_message`) run before the public prompt is
tokenised or admitted, so a malformed or oversized request costs the server
nothing shared.
"""

from __future__ import annotations

import math
from collections.abc import Set
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.protocol import wire
from edge_sdk.fusion import FusionSpace
from edge_sdk.logprobs import MAX_TOP_LOGPROBS
from edge_sdk.models import VocabularyMismatchError, check_same_vocabulary
from edge_sdk.protocol.signals import CloudUpload
from edge_sdk.protocol.status import CloudError

if TYPE_CHECKING:
    from cloud_adapter.limits import Limits


#: the longest edge model name kept (it is logged and stored in the transcript)
MAX_MODEL_NAME = 256
#: the most end-of-generation ids an edge may add
MAX_STOP_IDS = 256
#: the longest JSON schema a session may carry, in characters (compiling one takes time in proportion)
MAX_JSON_SCHEMA_CHARS = 64 * 1024


def check_open_message(msg: Any, *, cloud_model: str, fingerprint: bytes, limits: Limits) -> None:
    """The checks an ``OpenSession`` must pass before its prompt is tokenised or the session admitted."""
    if len(msg.edge_model) > MAX_MODEL_NAME:
        raise CloudError("INVALID_ARGUMENT", f"the edge model's name is longer than {MAX_MODEL_NAME} characters")
    if len(msg.stop_token_ids.ids) // 4 > MAX_STOP_IDS:
        raise CloudError("INVALID_ARGUMENT", f"more than {MAX_STOP_IDS} stop token ids")
    if len(msg.json_schema) > MAX_JSON_SCHEMA_CHARS:
        raise CloudError("INVALID_ARGUMENT", f"the JSON schema is longer than {MAX_JSON_SCHEMA_CHARS} characters")
    if msg.protocol_version != wire.PROTOCOL_VERSION:
        raise CloudError(
            "FAILED_PRECONDITION",
            f"the edge speaks protocol version {msg.protocol_version}, this server speaks {wire.PROTOCOL_VERSION}",
        )
    try:
        check_same_vocabulary(msg.edge_model or "(unnamed edge model)", bytes(msg.vocab_fingerprint), cloud_model,
                              fingerprint)
    except VocabularyMismatchError as exc:
        raise CloudError("FAILED_PRECONDITION", str(exc)) from None
    if not (math.isfinite(msg.alpha) and 0.0 <= msg.alpha <= 1.0):
        raise CloudError("INVALID_ARGUMENT", f"fusion weight alpha must lie in [0, 1], got {msg.alpha}")
    if not (math.isfinite(msg.temperature) and msg.temperature >= 0):
        raise CloudError("INVALID_ARGUMENT", f"temperature must be finite and >= 0, got {msg.temperature}")
    if msg.WhichOneof("public_query") == "text":
        if len(msg.text) > limits.max_prompt_chars:
            raise CloudError(
                "INVALID_ARGUMENT", f"the public prompt holds {len(msg.text)} characters, more than this server's "
                f"{limits.max_prompt_tokens} tokens could ever hold"
            )
    elif len(msg.token_ids.ids) // 4 + len(msg.resume_prefix.ids) // 4 > limits.max_prompt_tokens:
        raise CloudError(
            "INVALID_ARGUMENT", f"prompt and resumed prefix hold more than this server's limit of "
            f"{limits.max_prompt_tokens} tokens"
        )


def validate_request(request: wire.SessionRequest, *, vocab_size: int, eos_ids: Set[int], limits: Limits) -> int:
    """Check the decoded open request against the model and limits; returns the effective ``max_new_tokens``."""
    if not request.prompt_ids:
        raise CloudError("INVALID_ARGUMENT", "the public prompt is empty")
    if len(request.prompt_ids) + len(request.resume_prefix) > limits.max_prompt_tokens:
        raise CloudError(
            "INVALID_ARGUMENT", f"prompt and resumed prefix hold {len(request.prompt_ids) + len(request.resume_prefix)}"
            f" tokens, more than this server's limit of {limits.max_prompt_tokens}"
        )
    if request.score_prompt and len(request.prompt_ids) > wire.MAX_SCORED_PROMPT_TOKENS:  # logits held whole
        raise CloudError("OUT_OF_RANGE", f"score_prompt is served for prompts of at most "
                                         f"{wire.MAX_SCORED_PROMPT_TOKENS} tokens, got {len(request.prompt_ids)}")
    for name, ids in (("prompt", request.prompt_ids), ("resume_prefix", request.resume_prefix),
                      ("stop_token_ids", request.stop_token_ids)):
        if ids and max(ids) >= vocab_size:
            raise CloudError("INVALID_ARGUMENT", f"{name} holds id {max(ids)}, outside the vocabulary of {vocab_size}")
    max_new_tokens = request.max_new_tokens or limits.max_new_tokens
    if max_new_tokens > limits.max_new_tokens:
        raise CloudError(
            "INVALID_ARGUMENT", f"max_new_tokens {max_new_tokens} exceeds this server's limit of {limits.max_new_tokens}"
        )
    if not 1 <= request.top_m <= vocab_size:
        raise CloudError("INVALID_ARGUMENT", f"top_m must lie in 1..{vocab_size}, got {request.top_m}")
    if len(request.resume_prefix) >= max_new_tokens:
        raise CloudError(
            "INVALID_ARGUMENT", f"resume_prefix holds {len(request.resume_prefix)} tokens: nothing is left of "
            f"max_new_tokens {max_new_tokens}"
        )
    if request.top_logprobs > MAX_TOP_LOGPROBS or (request.top_logprobs and not request.logprobs):
        raise CloudError("INVALID_ARGUMENT", f"top_logprobs must lie in 0..{MAX_TOP_LOGPROBS} with logprobs set, "
                            f"got {request.top_logprobs}")
    if request.mode == "edge" and (request.logprobs or request.json_schema):
        raise CloudError("INVALID_ARGUMENT", "logprobs and json_schema are for cloud-side fusion: edge-side, "
                            "the edge picks each token and applies both itself")
    stops = set(eos_ids) | set(request.stop_token_ids)
    for position, token in enumerate(request.resume_prefix):
        if token in stops:
            raise CloudError(
                "INVALID_ARGUMENT", f"resume_prefix ends the generation already (end-of-generation id at {position})"
            )
    return max_new_tokens


def all_unique(ids: np.ndarray, vocab_size: int) -> bool:
    """Whether in-range ``ids`` hold no duplicate: a strictly increasing check (what the SDK sends),
    else one mark per id; both linear, unlike ``np.unique``'s sort (170 ms on a full 262k upload)."""
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return True
    seen = np.zeros(vocab_size, dtype=bool)
    seen[ids] = True
    return int(np.count_nonzero(seen)) == ids.size


def parse_upload(upload: Any, *, vocab_size: int, max_upload: int, space: FusionSpace) -> CloudUpload:
    """An ``Upload`` message as a :class:`CloudUpload`, or ``INVALID_ARGUMENT`` saying what is wrong with it."""
    try:
        values = wire.values_from_bytes(upload.values)
        ids = wire.ids_from_bytes(upload.ids)
    except ValueError as exc:
        raise CloudError("INVALID_ARGUMENT", f"malformed upload: {exc}") from None
    if upload.dense:
        if ids.size or values.size != vocab_size:
            raise CloudError(
                "INVALID_ARGUMENT", f"a dense upload carries no ids and exactly {vocab_size} values, got "
                f"{ids.size} ids and {values.size} values"
            )
        ids = np.arange(vocab_size, dtype=np.int64)
    if ids.shape != values.shape:
        raise CloudError("INVALID_ARGUMENT", f"upload has {ids.size} ids but {values.size} values")
    if ids.size > max_upload:
        raise CloudError(
            "INVALID_ARGUMENT", f"upload holds {ids.size} ids, more than this server's limit of {max_upload}"
        )
    if ids.size:
        if int(ids.max()) >= vocab_size:
            raise CloudError("INVALID_ARGUMENT", f"upload id {int(ids.max())} is outside the vocabulary of {vocab_size}")
        if not all_unique(ids, vocab_size):
            raise CloudError("INVALID_ARGUMENT", "upload ids must be unique")
        if not np.isfinite(values).all():
            raise CloudError("INVALID_ARGUMENT", "upload values must be finite (found NaN or infinity)")
        if space == "prob" and (float(values.min()) < 0.0 or float(values.max()) > 1.0):
            raise CloudError("INVALID_ARGUMENT", "upload values are probabilities and must lie in [0, 1]")
    return CloudUpload(ids, values, space)
