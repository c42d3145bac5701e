"""The endpoint's fixtures, collected by pytest for every module in this folder (no import needed).

The models under them are the session's (``slm``, ``gemma_llm`` in tests/conftest.py: loaded once for the whole
run); the adapter and the endpoint over them are per module, so each module's transcripts and captured log lines
hold only its own requests. A module may override ``endpoint`` (lockstep, another cloud address).

The endpoint's generations are paced on a 1 ms grid here, not the default 50 ms (``quick_auto_pace``): what these
tests check does not rest on when a signal leaves, and the pacer still runs. The send schedule's own promises are
tested at the default pace in tests/promises (test_observer_timing, test_pace_calibration, test_attack_wire).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.decode_settings import DecodeSettings
from tests.support.endpoint_stack import Cloud, Endpoint, LogCapture, capture_server_logs, start_cloud, start_endpoint


#: the auto pace of this folder's generations, in ms (a step takes longer: every signal leaves at once)
QUICK_AUTO_PACE_MS = 1.0


@pytest.fixture(scope="module", autouse=True)
def quick_auto_pace() -> Iterator[None]:
    """``DecodeSettings()`` defaults ``auto_pace_ms`` to :data:`QUICK_AUTO_PACE_MS` for the module (every generation
    through the endpoint builds its settings from the defaults). Each cloud-side or run-ahead step otherwise waited
    for its 50 ms slot: most of the wall time of a cloud-side reply here."""
    names = [field.name for field in dataclasses.fields(DecodeSettings)]
    defaults = DecodeSettings.__init__.__defaults__
    assert defaults is not None and len(defaults) == len(names), "every decode setting has a default"
    quick = tuple(QUICK_AUTO_PACE_MS if name == "auto_pace_ms" else value for name, value in zip(names, defaults))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeSettings.__init__, "__defaults__", quick)
        patch.setattr(DecodeSettings, "auto_pace_ms", QUICK_AUTO_PACE_MS)
        assert DecodeSettings().auto_pace_ms == QUICK_AUTO_PACE_MS
        yield


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


@pytest.fixture(scope="session")
def served_tokenizer_dir(gemma_llm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's tokenizer (read from the GGUF, no hub) saved as a transformers folder, as lm-eval's
    ``tokenizer=`` reads it: written once a run (a few seconds for its 262,144 entries), read-only after."""
    directory = tmp_path_factory.mktemp("tokenizer")
    gemma_llm.tokenizer.save_pretrained(directory)
    return directory
