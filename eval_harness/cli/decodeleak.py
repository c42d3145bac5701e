"""``decodeleak``: DecodeLeak audits, on the reference runner or on the deployed stack.

``decodeleak sweep`` runs the paper's grids (or a grid config of yours) over
MedPriv/CommPriv items and appends one JSONL row per (setting, item) as it
finishes; a re-run skips what is there, so a crash or Ctrl-C loses nothing.
``decodeleak run`` is one setting.

Runners (``--runner``): ``reference`` keeps both models in transformers in
this process; ``deployed`` audits the real stack: the edge GGUF in llama.cpp
through the SDK's gRPC client, against a cloud adapter started on loopback or
a remote one (``--cloud HOST:PORT``), the exposure read from the adapter's
transcripts (``--transcripts DIR``) and checked against the edge's ledger.

``decodeleak report`` makes the paper's tables (Markdown, CSV) from result
files, ``decodeleak plot`` its figures (PNG, PDF), ``decodeleak recompute``
re-scores every row from the file without a model.  ``decodeleak
compare-quant`` checks a quantised edge model against its full-precision
reference.  ``decodeleak build-benchmark``, ``review`` and ``finalize`` make
a benchmark of this kind from your own QA data with an LLM judge and a person
in the loop.  ``--config FILE`` (sweep, run, compare-quant and the benchmark
commands) gives option defaults as JSON; flags on the command line win.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

from eval_harness.cli import build_benchmark, compare_quant, finalize, plot, recompute, report, review, sweep
from eval_harness.cli.shared import csv_list

#: each command's module: ``add_parser(commands)`` registers it (``sweep``'s registers both ``sweep`` and ``run``),
#: ``run(args)`` executes it
COMMANDS = {"sweep": sweep, "run": sweep, "report": report, "plot": plot, "recompute": recompute,
            "build-benchmark": build_benchmark, "review": review, "finalize": finalize,
            "compare-quant": compare_quant}


def build_parser() -> argparse.ArgumentParser:
    """The ``decodeleak`` parser: every command's module adds its subparser(s), in :data:`COMMANDS`' order."""
    parser = argparse.ArgumentParser(prog="decodeleak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(commands)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; options in a ``--config`` file become defaults that the command line overrides."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = getattr(args, "config", None)
    if config is None:
        return args
    import json

    def refuse(message: str) -> NoReturn:  # one line, before anything is loaded
        parser.exit(2, f"decodeleak {args.command}: --config {config}: {message}\n")

    try:
        options = json.loads(Path(config).read_text(encoding="utf-8"))
    except OSError as exc:
        refuse(f"cannot read it ({exc.strerror or exc})")
    except json.JSONDecodeError as exc:
        refuse(f"line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg}")
    if not isinstance(options, dict):
        refuse("must hold a JSON object of options")
    subparser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]  # noqa: SLF001
    known = {action.dest: action for action in subparser._actions}  # noqa: SLF001 - argparse keeps them private
    defaults = {}
    for name, value in options.items():
        dest = name.replace("-", "_")
        action = known.get(dest)
        if action is None or dest in ("config", "help", "command"):
            refuse(f"{args.command} has no option {name!r}")
        try:
            defaults[dest] = config_value(action, value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            refuse(f"{name}: {exc}")
    subparser.set_defaults(**defaults)
    return parser.parse_args(argv)


def config_value(action: argparse.Action, value: object) -> object:
    """A ``--config`` file's ``value`` for ``action``'s option, checked as if it had been typed on the command line.

    A flag (``--verbose``) takes ``true``/``false``; a repeatable option (``--param``) a list of what one
    occurrence takes; an option of several values (``nargs``) a list of them, or one; a comma-separated list option a list of strings or one string; any other option a string
    or a number, passed through the option's own type and choices (so ``"limit": 2.5`` or ``"dtype": "bf17"``
    fails here, as it would on the command line).  ``null`` leaves the option unset.
    """
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # noqa: SLF001
        if not isinstance(value, bool):
            raise ValueError(f"takes true or false, got {json.dumps(value)}")
        return value
    if value is None:
        return None
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001
        if not isinstance(value, list):
            raise ValueError(f"takes a list (the option is repeatable), got {json.dumps(value)}")
        return [_one_value(action, item) for item in value]
    if action.nargs in ("*", "+"):  # several values (build-benchmark's SOURCE.jsonl files): a list, or one value
        return [_one_value(action, item) for item in (value if isinstance(value, list) else [value])]
    if action.type is csv_list and isinstance(value, list):
        if not all(isinstance(item, str) for item in value):
            raise ValueError(f"takes a list of names, got {json.dumps(value)}")
        value = ",".join(value)
    return _one_value(action, value)


def _one_value(action: argparse.Action, value: object) -> object:
    """One command-line value: a string, or a number written as the command line would write it."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"takes a {'string' if action.type is None else 'value'}, got {json.dumps(value)}")
    text = value if isinstance(value, str) else json.dumps(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid value {json.dumps(value)} ({exc})") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}, got {json.dumps(value)}")
    return converted


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print(f"decodeleak {args.command}: interrupted; what was written so far is kept in "
              f"{getattr(args, 'out', None) or args.directory}", file=sys.stderr)
        return 130
    except (ValueError, KeyError, OSError) as exc:
        if args.verbose:
            raise
        print(f"decodeleak {args.command}: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the cloud adapter refused or broke a session (edge_sdk.protocol.connection.CloudError)
        from eval_harness.cli.coveil import explain
        from edge_sdk.protocol.status import CloudError

        if args.verbose or not isinstance(exc, CloudError):
            raise
        print(f"decodeleak {args.command}: {explain(exc)}", file=sys.stderr)
        return 1
