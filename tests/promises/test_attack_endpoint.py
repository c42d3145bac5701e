"""Attack review of issue 19 on the private endpoint (no model): a finding of the review, failing on the code the
review started from."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from edge_sdk.server.openai.protocol import ChatCompletionRequest
from edge_sdk.server.serving import EdgeServing
from edge_sdk.server.settings import ServerSettings
from tests.endpoint.test_endpoint_guards import RecordingClient, RecordingRenderer


def test_an_app_on_the_endpoint_can_pace_its_signals() -> None:
    """Finding: ``pace_ms`` (N17's defence against the cloud timing the SLM's steps, whose time grows with the
    private context) existed in the SDK only; the endpoint, the path apps take, refused ``coveil.pace_ms`` as an
    unknown field, so no app behind it could close that channel.  It is a ``coveil`` option now, passed to the
    decoder as it is, and a pace that is not positive is a 400; so is ``prefill_budget_ms`` (the open's grid)."""
    client = RecordingClient()
    serving = EdgeServing(client, RecordingRenderer(), ServerSettings(cloud="c:1"), n_ctx=512)  # type: ignore[arg-type]
    try:
        request = ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "Which organ?"}],
                                        coveil={"private_context": "notes", "pace_ms": 250,
                                                "prefill_budget_ms": 2000})
        serving.prepare_chat(request)
        assert client.settings[-1]["pace_ms"] == 250 and client.settings[-1]["prefill_budget_ms"] == 2000
        serving.prepare_chat(ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q"}]))
        assert client.settings[-1]["pace_ms"] is None  # unpaced unless asked
        assert client.settings[-1]["prefill_budget_ms"] is None
    finally:
        serving.close()
    for pace in (0, -5, float("inf")):
        for option in ("pace_ms", "prefill_budget_ms"):
            with pytest.raises(ValidationError):
                ChatCompletionRequest(model="coveil", messages=[{"role": "user", "content": "q"}],
                                      coveil={option: pace})
