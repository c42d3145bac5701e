"""A step whose full row was sent when its stream broke gets that same row on the session that resumes it."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_sdk.protocol import wire
from tests.support.tiny_models import tiny_pair


class PrefillRoundsDifferently:
    """Delegates to a runner, but a one-pass prefill's last row differs in its last bit from step-by-step
    decoding (as batched kernels of another shape may round)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens_per_session = inner.tokens_per_session

    def prefill(self, prompt_ids, *, spec=None):
        seq, ns = self.inner.prefill(prompt_ids, spec=spec)
        seq.next_logits = np.nextafter(seq.next_logits, np.float32(np.inf)).astype(np.float32)
        return seq, ns

    def forward(self, seq, token_id: int) -> int:
        return self.inner.forward(seq, token_id)

    def release(self, seq) -> None:
        self.inner.release(seq)


def replies(handler: Any, message: Any) -> list[Any]:
    return [type(reply).FromString(reply.SerializeToString()) for reply in handler.handle(message)]


def test_a_full_row_asked_for_again_after_a_broken_stream_is_the_same_bytes() -> None:
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.runners import DirectRunner

    _, llm = tiny_pair()
    engine = CloudEngine(llm, runner=PrefillRoundsDifferently(DirectRunner(llm)))
    request = wire.SessionRequest(prompt_ids=tuple(llm.tokenize("Which organ is affected?")), mode="edge",
                                  vocab_fingerprint=llm.vocab_fingerprint(), edge_model="test-edge",
                                  vocab_size=llm.vocab_size, top_m=32, max_new_tokens=8)

    first = engine.session("edge-1")
    opened = replies(first, wire.encode_open(request))
    token = int(wire.decode_distribution(opened[1].distribution, llm.vocab_size).ids[0])
    replies(first, wire.encode_token(0, token))
    sent = replies(first, wire.encode_request_full(1))[0].SerializeToString()
    first.abandon("cancelled")  # the stream broke before the edge's signal for step 1

    def resumed_row(client: str) -> bytes:
        handler = engine.session(client)
        replies(handler, wire.encode_open(wire.SessionRequest(**{**vars(request), "resume_prefix": (token,)})))
        row = replies(handler, wire.encode_request_full(1))[0].SerializeToString()
        handler.abandon("closed")
        return row

    assert resumed_row("edge-2") != sent  # another client's session: recomputed (the test can tell)
    assert resumed_row("edge-1") == sent
    assert resumed_row("edge-1") != sent  # taken once: a later resume recomputes it
