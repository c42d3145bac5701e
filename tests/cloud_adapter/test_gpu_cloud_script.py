"""The one prepared GPU script, ``benchmarks/gpu_cloud.py``, run end to end on the CPU at a tiny size (``--smoke``):
a GPU's few minutes are not spent on a script error.  It must exercise what the GPU run measures: both backends,
every mode (lockstep, run-ahead, vetoes, cloud-side), the slot engine's own drafting and its greedy cloud-side pick
on the device (checked there against the numpy rule on the same rows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_script_runs_end_to_end_on_the_cpu() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's packages, in the load's process too
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_cloud.py"), "--smoke", "--deadline-s", "600"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line and " " not in line)
    for backend in ("slots", "transformers"):
        for mode in ("lockstep", "runahead", "veto", "cloud"):
            assert float(figures[f"tiny_{backend}_{mode}_vs_plain_2"]) > 0
    assert float(figures["tiny_slots_engine_drafted_per_token_runahead_2"]) > 0  # the engine drafted
    assert float(figures["tiny_transformers_engine_drafted_per_token_runahead_2"]) == 0  # whole rows: sessions draft
    assert figures["tiny_slots_device_pick_checked"] == "1.000"
    assert figures["tiny_slots_admission_checked"] == "1.000"
