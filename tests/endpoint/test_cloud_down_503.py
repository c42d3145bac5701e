"""A request while the cloud adapter is known to be down (its health check said so, or the last generation could
not reach it) is answered 503 with ``Retry-After`` at once, not after the reconnects' back-off."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from edge_sdk.server.serving import CLOUD_DOWN_S
from tests.support.endpoint_stack import start_endpoint

pytestmark = pytest.mark.model


def free_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def ask(base_url: str) -> tuple[httpx.Response, float]:
    began = time.perf_counter()
    response = httpx.post(base_url + "/v1/completions", json={"model": "coveil", "prompt": "The liver", "max_tokens": 2},
                          timeout=60)
    return response, time.perf_counter() - began


def test_a_known_down_adapter_is_a_fast_503_with_retry_after(slm, tmp_path) -> None:
    with start_endpoint(free_address(), slm, tmp_path) as endpoint:
        # the first request finds out the hard way: reconnects with back-off (0.5 + 1 + 1.5 s), then 503
        first, slow = ask(endpoint.base_url)
        assert first.status_code == 503 and slow > 2.5
        second, fast = ask(endpoint.base_url)  # now known down: at once
        assert second.status_code == 503 and fast < 0.5, fast
        assert second.json()["error"]["code"] == "cloud_unavailable"
        assert 1 <= int(second.headers["Retry-After"]) <= CLOUD_DOWN_S
        assert "unreachable" in second.json()["error"]["message"]

    with start_endpoint(free_address(), slm, tmp_path) as endpoint:
        health = httpx.get(endpoint.base_url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["cloud"] == "unreachable"
        refused, fast = ask(endpoint.base_url)  # the health check said so: the first request is fast too
        assert refused.status_code == 503 and fast < 0.5 and "Retry-After" in refused.headers
