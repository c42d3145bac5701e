"""``pace_ms="auto"``: a pace for the public clock measured on public work only.

The public clock (:class:`~edge_sdk.steps.Pacer`) hides the SLM's step as long as the step fits in the pace; a
pace far above the step only costs time (50 ms against a 10 ms step: 2.2-2.4x per token in run-ahead).
:func:`calibrated_pace_ms` times the SLM on a public prompt as long as its context window (the longest context a
generation can hold, where its step is slowest), takes the median of :data:`CALIBRATION_STEPS` steps, and rounds
:data:`PACE_MARGIN` times it up onto the coarse public grid :data:`PACE_GRID_MS`.  Nothing private is read: it
runs before any generation's private text is tokenised, and every generation of the client uses the one result,
so the pace is the same for a short and a long private context.  What it shows is the device's speed class,
which the pace has shown all along.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from edge_sdk.backends.base import SLMBackend

#: the paces ``"auto"`` chooses from (1-2-5 steps, ms); a step past the last is paced at a multiple of it
PACE_GRID_MS = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
#: SLM steps timed after the calibration prompt's prefill
CALIBRATION_STEPS = 8
#: the pace is at least this many times the median step: room for slower steps (a busier device) within it
PACE_MARGIN = 2.0
#: the calibration context for an SLM that states no window (``n_ctx``)
DEFAULT_CALIBRATION_TOKENS = 2048
#: public text the calibration prompt repeats to the window's length
CALIBRATION_TEXT = ("The public clock of a collaborative decoding session is measured on this public text alone, "
                    "repeated to the length of the context window. ")


def on_pace_grid(step_ms: float) -> float:
    """The first point of :data:`PACE_GRID_MS` at or above ``PACE_MARGIN * step_ms``; past the grid, the first
    multiple of its last point."""
    target = PACE_MARGIN * step_ms
    for pace in PACE_GRID_MS:
        if pace >= target:
            return pace
    return PACE_GRID_MS[-1] * math.ceil(target / PACE_GRID_MS[-1])


def calibration_ids(slm: SLMBackend, tokens: int) -> list[int]:
    """:data:`CALIBRATION_TEXT` tokenised and repeated to ``tokens`` ids."""
    unit = slm.tokenize(CALIBRATION_TEXT, add_bos=False)
    return (unit * (tokens // len(unit) + 1))[:tokens]


def calibrated_pace_ms(slm: SLMBackend, *, context_tokens: int | None = None) -> float:
    """The pace ``"auto"`` stands for on ``slm``: the median of :data:`CALIBRATION_STEPS` steps after a public
    prompt filling ``context_tokens`` (default: the SLM's ``n_ctx``, else :data:`DEFAULT_CALIBRATION_TOKENS`)
    less those steps, on the grid (:func:`on_pace_grid`).  The SLM's sequence is left holding that public prompt."""
    window: Any = context_tokens or getattr(slm, "n_ctx", None) or DEFAULT_CALIBRATION_TOKENS
    logits = slm.prefill(calibration_ids(slm, int(window) - CALIBRATION_STEPS - 1))
    steps_s = []
    for _ in range(CALIBRATION_STEPS):
        started = time.perf_counter()
        logits = slm.append(int(np.argmax(logits)))
        steps_s.append(time.perf_counter() - started)
    return on_pace_grid(1e3 * float(np.median(steps_s)))
