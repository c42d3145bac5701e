"""Timing experiments run side by side: each run sleeps on the real clock (a paced grid, a simulated link, a slow
fake SLM) for nearly all of its time, so runs that share nothing but the process take as long together as the
longest alone, and each keeps its own clock readings (two contexts compared under the same load)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def side_by_side(*runs: Callable[[], T]) -> list[T]:
    """Each of ``runs`` called in a thread of its own, all at once; their results in order (the first error is
    raised)."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [pool.submit(run) for run in runs]
        return [future.result() for future in futures]
