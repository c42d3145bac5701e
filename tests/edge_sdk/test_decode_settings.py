"""Each decode default lives in ``DecodeSettings`` only; a call overrides a copy and refuses unknown names."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_sdk.protocol import wire
from edge_sdk.client import EdgeClient
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.testing import ScriptedCloud, TableSLM

PIECES = ["<eos>", " the", " liver", " heart", ".", "\n\n"]


def client() -> EdgeClient:
    slm = TableSLM(PIECES, {(1,): np.log([0.05, 0.05, 0.75, 0.05, 0.05, 0.05])}, eos_ids={0})
    cloud = ScriptedCloud(len(PIECES), [np.log([0.1, 0.45, 0.2, 0.1, 0.1, 0.05])] * 4, eos_ids={0})
    return EdgeClient(cloud.session, slm=slm)


def test_the_paper_defaults_are_written_in_the_settings() -> None:
    # the paper's collaborative-decoding setup: alpha = 0.3, 256 new tokens, DecodeLeak at K = 100
    settings = DecodeSettings()
    assert (settings.alpha, settings.max_new_tokens, settings.exposure_k, settings.mode) == (0.3, 256, 100, "cloud")


def test_the_wire_request_reads_its_defaults_from_the_settings() -> None:
    request = wire.SessionRequest(prompt_ids=(1,), mode="cloud")
    for name in ("alpha", "temperature", "seed", "max_new_tokens", "top_m"):
        assert getattr(request, name) == getattr(DecodeSettings(), name), name


def test_a_call_overrides_a_copy_of_the_settings_it_is_given() -> None:
    base = DecodeSettings(alpha=0.5, max_new_tokens=3, top_m=4)
    decoder = client().decoder(" the.", " liver", settings=base, mode="edge", max_new_tokens=2)
    assert decoder.settings == DecodeSettings(mode="edge", alpha=0.5, max_new_tokens=2, top_m=4)
    assert base == DecodeSettings(alpha=0.5, max_new_tokens=3, top_m=4)  # the caller's object is untouched


def test_without_settings_a_call_starts_from_the_defaults() -> None:
    decoder = client().decoder(" the.", " liver", alpha=0.6)
    assert decoder.settings == dataclasses.replace(DecodeSettings(), alpha=0.6)


def test_generate_and_stream_take_the_settings_too() -> None:
    settings = DecodeSettings(mode="edge", max_new_tokens=2)
    result = client().generate(" the.", " liver", settings=settings, policy="undefended")
    assert len(result.token_ids) == 2 and result.ledger.mode == "edge"
    with client().stream(" the.", " liver", settings=settings, policy="undefended", max_new_tokens=1) as stream:
        assert len(list(stream)) == 1


@pytest.mark.parametrize("call", ["decoder", "generate", "stream"])
def test_an_unknown_setting_is_refused_by_name(call: str) -> None:
    with pytest.raises(TypeError, match=r"unknown decode setting alfa \(DecodeSettings has: mode, alpha, "):
        getattr(client(), call)(" the.", " liver", alfa=0.5)


def test_settings_out_of_range_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"exposure_budget must lie in \[0, 1\], got 1.5"):
        DecodeSettings(exposure_budget=1.5)
    with pytest.raises(ValueError, match="exposure_budget must lie in"):
        client().decoder(" the.", " liver", exposure_budget=-0.1)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"mode": "sideways"}, "fusion mode must be one of ('cloud', 'edge'), got 'sideways'"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
    ({"top_m": 2.5}, "top_m must be a positive integer, got 2.5"),
    ({"exposure_k": True}, "exposure_k must be a positive integer, got True"),
    ({"exposure_k": -3}, "exposure_k must be a positive integer, got -3"),
])
def test_a_mode_or_count_out_of_range_is_refused_when_built(overrides: dict, message: str) -> None:
    """Every entry point (the SDK's calls, the endpoint, the TypeScript SDK's ``decodeSettings``) refuses these
    with the same words, before anything is sent."""
    with pytest.raises(ValueError) as refused:
        DecodeSettings(**overrides)
    assert str(refused.value) == message


def test_counts_may_be_numpy_integers() -> None:
    assert DecodeSettings(max_new_tokens=np.int64(3), top_m=np.int32(8)).max_new_tokens == 3
