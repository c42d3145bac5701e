"""The endpoint's fixtures, collected by pytest for every module in this folder (no import needed).

The models under them are the session's (``slm``, ``gemma_llm`` in tests/conftest.py: loaded once for the whole
run); the adapter and the endpoint over them are per module, so each module's transcripts and captured log lines
hold only its own requests. A module may override ``endpoint`` (lockstep, another cloud address).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from edge_sdk.backends.llama_cpp import LlamaCppSLM
from tests.support.endpoint_stack import Cloud, Endpoint, LogCapture, capture_server_logs, start_cloud, start_endpoint


@pytest.fixture(scope="module")
def server_logs() -> Iterator[LogCapture]:
    with capture_server_logs() as capture:
        yield capture


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, gemma_llm, server_logs) -> Iterator[Cloud]:
    with start_cloud(tmp_path_factory.mktemp("transcripts"), gemma_llm) as started:
        yield started


@pytest.fixture(scope="module")
def endpoint(cloud: Cloud, slm: LlamaCppSLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    with start_endpoint(cloud.address, slm, tmp_path_factory.mktemp("endpoint")) as started:
        yield started
