"""``decodeleak finalize``: the reviewed benchmark as JSONL, its dataset-attributes table and length figure."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Write the items a person accepted in decodeleak review as the final JSONL in the MedPriv/CommPriv schema
(answer, options, answer_idx, _split, _id, private_context, public_query, filtered_context), readable by
decodeleak run/sweep as a task (--tasks FILE.jsonl), with the paper's dataset-attributes table (attributes.md,
attributes.csv: items, options, average public/private/evidence word counts, spans per item) and the length
distributions of the public query, private context and private evidence (length_distribution.png/.pdf)."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("finalize", help="the reviewed benchmark as JSONL, attributes table and figure",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, metavar="DIR", help="a build directory (decodeleak build-benchmark)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where the files go (default: DIR/final)")
    parser.add_argument("--name", metavar="NAME", help="the benchmark's name: NAME.jsonl and the table's first "
                                                       "column (default: DIR's name)")
    parser.add_argument("--unreviewed", action="store_true",
                        help="also take the items nobody has decided on yet, with the judge's spans (rejected "
                             "items are never taken)")
    parser.add_argument("--config", type=Path, metavar="FILE", help="a JSON file of option defaults")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return parser


def run(args: argparse.Namespace) -> int:
    from eval_harness.construction.finalize import finalize

    directory = Path(args.directory)
    name = args.name or directory.resolve().name
    out = Path(args.out) if args.out is not None else directory / "final"
    done = finalize(directory, out, name=name, include_pending=args.unreviewed)
    counts = done.counts
    left_out = "" if args.unreviewed or not counts["pending"] else (
        f"; {counts['pending']} not reviewed, left out (--unreviewed takes them)")
    beyond = _options_beyond_the_prompt(done.paths[0])
    if beyond:
        print(f"note: {beyond} items have options other than A-D; the audits' prompt "
              "(eval_harness.datasets.DecodeLeakItem.public_prompt) shows A-D only", file=sys.stderr)
    print((out / "attributes.md").read_text(encoding="utf-8"))
    print("\n".join(str(path) for path in done.paths))
    print(f"{done.rows} items written ({counts['accepted']} accepted"
          + (f", {counts['pending']} not reviewed" if args.unreviewed else "")
          + f"; {counts['rejected']} rejected{left_out})", file=sys.stderr)
    return 0


def _options_beyond_the_prompt(jsonl: Path) -> int:
    """Rows of ``jsonl`` with an option key other than A, B, C, D."""
    import json

    from eval_harness.datasets import LETTERS

    rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    return sum(1 for row in rows if set(row["options"]) - set(LETTERS))
