"""What the ``decodeleak`` commands share: comma-separated list options, the progress bar, the options of the
commands that read result files."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: a comma-separated option, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def progress_bar() -> Progress:
    """A rich progress bar: done/total, elapsed, ETA."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn())


def add_source_options(parser: argparse.ArgumentParser) -> None:
    """``--allow-code-change``, for the commands that derive tables or figures from result files."""
    parser.add_argument("--allow-code-change", action="store_true",
                        help="read rows scored by different versions of the code (their code.sha256 differs, e.g. "
                             "before and after a metric fix) as one run; without it they are refused. The output "
                             "names every code digest")
