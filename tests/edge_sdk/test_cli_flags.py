"""One helper builds every CLI's flags from a settings dataclass; the decode flags take DecodeSettings' defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edge_sdk.cli_flags import add_dataclass_flags, add_dtype_flag, dataclass_from_args, positive_float, positive_int
from edge_sdk.decode_settings import DecodeSettings


@dataclass(frozen=True)
class Toy:
    size: int = field(default=3, metadata={"help": "how many", "type": positive_int, "metavar": "N"})
    rate: float = field(default=0.5, metadata={"help": "how fast, {default} by default", "type": float})
    where: Path | None = field(default=None, metadata={"help": "a folder", "type": Path})
    loud: bool = field(default=False, metadata={"help": "say more"})


def help_of(parser: argparse.ArgumentParser, option: str) -> str:
    return next(action.help for action in parser._actions if option in action.option_strings)


def test_each_field_becomes_a_flag_with_its_default_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Toy)
    assert help_of(parser, "--size") == "how many (default: 3)"
    assert help_of(parser, "--rate") == "how fast, 0.5 by default"  # a text that places the default itself
    assert help_of(parser, "--where") == "a folder"  # no default to show
    assert dataclass_from_args(Toy, parser.parse_args([])) == Toy()
    args = parser.parse_args(["--size", "7", "--rate", "2", "--where", "runs", "--loud"])
    assert dataclass_from_args(Toy, args) == Toy(size=7, rate=2.0, where=Path("runs"), loud=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--size", "0"])  # the field's type refuses it


def test_a_subset_a_help_of_its_own_and_a_flag_name_rule() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, Toy, names=["size"], helps={"size": "items ({default} unless told)"},
                        flag=lambda name: f"--toy-{name}")
    assert [a.option_strings for a in parser._actions[1:]] == [["--toy-size"]]
    assert help_of(parser, "--toy-size") == "items (3 unless told)"
    assert dataclass_from_args(Toy, parser.parse_args(["--toy-size", "4"]), names=["size"]) == Toy(size=4)
    with pytest.raises(ValueError, match="Toy has no field sise"):
        add_dataclass_flags(argparse.ArgumentParser(), Toy, names=["sise"])


def test_number_converters_say_what_they_need() -> None:
    assert positive_int("3") == 3 and positive_float("0.25") == 0.25
    for convert, text, message in ((positive_int, "0", "must be at least 1, got 0"),
                                   (positive_int, "x", "must be a positive integer, got 'x'"),
                                   (positive_float, "0", "must be positive, got 0.0"),
                                   (positive_float, "x", "must be a positive number, got 'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            convert(text)


def test_the_dtype_flag_offers_auto_only_where_asked() -> None:
    with_auto, without = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_dtype_flag(with_auto, default="auto", help="dtype")
    add_dtype_flag(without, default="fp32", help="dtype", auto=False)
    assert with_auto.parse_args(["--dtype", "auto"]).dtype == "auto"
    with pytest.raises(SystemExit):
        without.parse_args(["--dtype", "auto"])


def test_every_cli_takes_the_decode_defaults_from_the_settings() -> None:
    from cloud_adapter.cli import build_parser as cloud_parser
    from eval_harness.cli.coveil import build_parser as coveil_parser
    from eval_harness.cli.decodeleak import build_parser as decodeleak_parser

    defaults = DecodeSettings()
    run = decodeleak_parser().parse_args(["run", "--mode", "edge", "--policy", "coveil"])
    assert (run.alpha, run.max_new_tokens) == (defaults.alpha, defaults.max_new_tokens) == (0.3, 256)
    sweep = decodeleak_parser().parse_args(["sweep"])
    assert sweep.max_new_tokens == 256
    quant = decodeleak_parser().parse_args(["compare-quant", "--out", "q"])
    assert (quant.alpha, quant.max_new_tokens) == (0.3, 256)
    assert coveil_parser().parse_args(["demo"]).alpha == 0.3
    assert cloud_parser().parse_args(["serve"]).exposure_k == defaults.exposure_k == 100


@pytest.mark.parametrize("command", [["compare-quant", "--out", "q"], ["run", "--mode", "edge", "--policy", "coveil"],
                                     ["sweep"]])
def test_a_length_of_zero_tokens_is_refused_on_every_decodeleak_command(command: list[str]) -> None:
    from eval_harness.cli.decodeleak import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--max-new-tokens", "0"])
