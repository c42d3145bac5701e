"""``decodeleak review``: a person accepts, edits or rejects what the judge proposed (a local page, or a CSV)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

DESCRIPTION = """\
Open a local page listing every item the judge kept, each with its private context and the proposed spans
highlighted in it: accept or reject the item, edit, remove or add spans (select text and press 'add selection').
Each decision is written to DIR/review.jsonl the moment it is made, so closing the page loses nothing.
The page answers only requests carrying this run's secret: open the address printed (it holds the secret once,
then a cookie does); any other local process is refused.

Without a browser: --export-csv FILE writes one row per item (fill in 'status' with accepted/rejected and edit
'spans', comma-separated; 'marked_private_context' shows the spans in [[ ]]), --import-csv FILE reads it back
(every row is checked first; if one is wrong, nothing is written).

Then: decodeleak finalize DIR."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("review", help="accept, edit or reject the judge's proposals (page or CSV)",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, metavar="DIR", help="a build directory (decodeleak build-benchmark)")
    parser.add_argument("--port", type=int, default=8765, help="the page's port on 127.0.0.1 (default: 8765; 0: any)")
    parser.add_argument("--no-browser", action="store_true", help="print the page's address, do not open it")
    csv_group = parser.add_mutually_exclusive_group()
    csv_group.add_argument("--export-csv", type=Path, metavar="FILE", help="write the items to a CSV and exit")
    csv_group.add_argument("--import-csv", type=Path, metavar="FILE", help="apply a reviewed CSV and exit")
    parser.add_argument("--config", type=Path, metavar="FILE", help="a JSON file of option defaults")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return parser


def _redirect_file(url: str) -> Path:
    """A page only this user can read (0600 in a fresh 0700 folder) that redirects to ``url``: the browser is opened
    on it, so the secret in ``url`` is not on the browser's command line for every local process to read (as
    Jupyter does)."""
    import html
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="decodeleak-review-")) / "open.html"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(f'<!doctype html><meta http-equiv="refresh" content="0;url={html.escape(url)}">'
                  f'<a href="{html.escape(url)}">open the review page</a>')
    return path


def run(args: argparse.Namespace) -> int:
    from eval_harness.construction.review import ReviewLog, export_csv, import_csv

    directory = Path(args.directory)
    if args.export_csv is not None:
        written = export_csv(ReviewLog(directory), args.export_csv)
        print(f"{written} items written to {args.export_csv}; fill in 'status' and edit 'spans', then "
              f"decodeleak review {directory} --import-csv {args.export_csv}")
        return 0
    if args.import_csv is not None:
        log = ReviewLog(directory)
        made = import_csv(log, args.import_csv)
        counts = log.counts()
        print(f"{sum(made.values())} decisions saved ({made['accepted']} accepted, {made['rejected']} rejected, "
              f"{made['pending']} back to review); now {counts['accepted']} accepted, {counts['rejected']} "
              f"rejected, {counts['pending']} to review")
        return 0
    from eval_harness.construction.review_server import ReviewServer

    server = ReviewServer(directory, port=args.port)
    counts = server.log.counts()
    print(f"reviewing {sum(counts.values())} items of {directory} ({counts['pending']} to review) at {server.url}; "
          "Ctrl-C to stop (every decision is already saved)", file=sys.stderr)
    opener = None if args.no_browser else _redirect_file(server.url)
    if opener is not None:
        import webbrowser

        webbrowser.open(opener.as_uri())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        counts = server.log.counts()
        print(f"stopped: {counts['accepted']} accepted, {counts['rejected']} rejected, {counts['pending']} to review "
              f"(saved in {server.log.path}); next: decodeleak finalize {directory}", file=sys.stderr)
    finally:
        if opener is not None:
            shutil.rmtree(opener.parent, ignore_errors=True)
    return 0
