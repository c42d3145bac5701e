"""``lookahead`` is a :class:`~edge_sdk.decode_settings.DecodeSettings` field: validated there, a CLI flag like the
other settings, and a generation's value wins over the client's default (``EdgeClient(lookahead=)``), on the SDK
and on the endpoint (``coveil.lookahead``).  What the edge asks for is read off the open it sends."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from edge_sdk.cli_flags import add_dataclass_flags, dataclass_from_args
from edge_sdk.client import EdgeClient
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.protocol.wire import MAX_LOOKAHEAD
from edge_sdk.testing import ScriptedCloud, TableSLM

PIECES = ["<eos>", " a", " b", " c", "q", "n", "\n", " "]
ROW = np.log([0.05, 0.5, 0.2, 0.1, 0.1, 0.03, 0.01, 0.01])


def fakes() -> tuple[TableSLM, ScriptedCloud]:
    return TableSLM(PIECES, {(): ROW}, eos_ids={0}), ScriptedCloud(len(PIECES), [ROW] * 4, eos_ids={0},
                                                                   max_lookahead=MAX_LOOKAHEAD)


def asked(cloud: ScriptedCloud) -> list[int]:
    """The run-ahead depth each session's open asked for, in order."""
    return [m.open.lookahead for m in cloud.edge_messages() if m.WhichOneof("kind") == "open"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_lookahead_that_is_not_a_count_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"lookahead must be an integer of 0 \(lockstep\) or more"):
        DecodeSettings(lookahead=bad)  # type: ignore[arg-type]


def test_the_flag_is_built_from_the_field() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, DecodeSettings, names=["lookahead"])
    assert dataclass_from_args(DecodeSettings, parser.parse_args(["--lookahead", "2"]), names=["lookahead"]) == (
        DecodeSettings(lookahead=2))
    assert parser.parse_args([]).lookahead is None  # unset: the client's default
    assert "deepest run-ahead" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--lookahead", "-1"])


def test_the_generation_s_setting_wins_over_the_client_s_default() -> None:
    slm, cloud = fakes()
    client = EdgeClient(cloud.session, slm=slm, lookahead=3)
    client.generate("q", "nnn", max_new_tokens=2)  # the client's default
    client.generate("q", "nnn", max_new_tokens=2, lookahead=0)  # an override, as any setting
    client.generate("q", "nnn", settings=DecodeSettings(max_new_tokens=2, lookahead=5))
    with client.stream("q", "nnn", max_new_tokens=2, lookahead=1) as stream:
        list(stream)
    assert asked(cloud) == [3, 0, 5, 1]
    slm, cloud = fakes()
    EdgeClient(cloud.session, slm=slm).generate("q", "nnn", max_new_tokens=2)  # in process: lockstep by default
    assert asked(cloud) == [0]
    with pytest.raises(ValueError, match="lookahead must be"):
        EdgeClient(cloud.session, slm=slm).decoder("q", "nnn", lookahead=-2)  # before any work
