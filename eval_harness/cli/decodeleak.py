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
import sys
from pathlib import Path

from eval_harness.cli import build_benchmark, compare_quant, finalize, plot, recompute, report, review, sweep

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

    try:
        options = json.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read --config {config}: {exc}")
    if not isinstance(options, dict):
        parser.error(f"--config {config} must hold a JSON object of options")
    subparser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]  # noqa: SLF001
    known = {action.dest: action for action in subparser._actions}  # noqa: SLF001 - argparse keeps them private
    defaults = {}
    for name, value in options.items():
        dest = name.replace("-", "_")
        action = known.get(dest)
        if action is None or dest in ("config", "help", "command"):
            parser.error(f"--config {config}: {args.command} has no option {name!r}")
        # through the option's own type, as if it had been typed
        defaults[dest] = action.type(value) if action.type is not None and isinstance(value, str) else value
    subparser.set_defaults(**defaults)
    return parser.parse_args(argv)


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
    except RuntimeError as exc:  # the cloud adapter refused or broke a session (edge_sdk.transport.CloudError)
        from eval_harness.cli.coveil import explain
        from edge_sdk.transport import CloudError

        if args.verbose or not isinstance(exc, CloudError):
            raise
        print(f"decodeleak {args.command}: {explain(exc)}", file=sys.stderr)
        return 1
