"""``decodeleak report`` on a synthetic results file of the paper's row size: its peak memory and its pace.

The file (``--gb`` GB, default 2) holds rows shaped as a full-trace sweep writes them: every field a real row
has, 80 metric values (4 recall metrics x 10 K x 2 rule sets), a mechanism and a privacy ledger, and an
exposure trace of ``--trace-kb`` KB (default 30: a row averages 38 KB, traces most of it) as random base64,
over a grid of 2 tasks x 2 modes x (undefended + 5 methods x 5 settings), as many items per setting as the size needs.

The report runs as a child process (``decodeleak report FILE``); its peak resident
memory is the kernel's ``ru_maxrss`` of that child (``os.wait4``), its pace the file's MB over the child's wall
time.  Nothing is held between the two: the benchmark writes the file in a stream too.

Usage: python benchmarks/report_memory.py [--gb 2] [--trace-kb 30] [--dir DIR] [--keep]
Prints rows, file_mb, report_s, then report_peak_rss_mb (target <= 400) and report_mb_per_s last.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("undefended", "coveil", "dp_logit", "dp_fusion", "custext", "invisible_ink")
KS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
TRACE_POOL = 64  # distinct random traces, cycled (generating 2 GB of random bytes would dominate the setup)


def settings() -> list[tuple[str, str, str, dict]]:
    """(task, mode, policy, params) of the synthetic grid."""
    return [(task, mode, policy, {"lam": value} if value is not None else {})
            for task in ("medpriv", "commpriv") for mode in ("cloud", "edge") for policy in METHODS
            for value in ((None,) if policy == "undefended" else (0.5, 1, 2, 4, 8))]


def synthetic_row(rng: np.random.Generator, task: str, mode: str, policy: str, params: dict, item: int,
                  trace: str) -> dict:
    """One row with every field a sweep writes, its numbers drawn from ``rng``."""
    metrics = {f"{name}@{k}{rules}": float(rng.random()) for rules in ("", ":release")
               for name in ("token_er", "rouge1_er", "span_er", "auc") for k in KS}
    tokens = int(rng.integers(8, 256))
    setting = f"{task}-{mode}-{policy}-{json.dumps(params, sort_keys=True)}"
    return {
        "key": f"{setting}-{item}", "setting": setting, "task": task, "item": f"{task}-{item:06d}", "mode": mode,
        "policy": policy, "params": params, "policy_params": {**params, "k": 50}, "epsilon_unit": "none",
        "alpha": 0.3, "predicted": "A", "answer": "A", "correct": bool(rng.random() < 0.7), "tokens": tokens,
        "finish_reason": "stop", "text": "The answer is A. " * 8, "token_ids": rng.integers(0, 262144, tokens).tolist(),
        "metrics": metrics,
        "exposure": {"codec": "int32le-xz-base64", "k": 1000, "steps": tokens, "ids": trace, "sha256": "0" * 64},
        "dataset": {"sha256": "1" * 64, "item_sha256": "2" * 64},
        "evidence": {"evidence_tokens": 12, "evidence_spans": 3}, "uploaded_values": 4000, "full_requests": 0,
        "bytes_up": 20000, "bytes_down": 900000,
        "privacy": {"guarantee": "non-private", "epsilon_spent": None, "delta": 1e-5, "accountant": "none",
                    "event": "none", "events": tokens, "max_epsilon": None, "withheld_from": None,
                    "withheld_reason": None, "note": "heuristic"},
        "mechanism": {"steps": tokens, "zero_upload_steps": int(rng.integers(0, tokens)),
                      "top1_agreement_steps": tokens, "rank_sum": tokens, "rank_mean": 1.0,
                      "rank_bins": {"1": tokens, "2-5": 0, "6-20": 0, ">20": 0}},
        "inversion": None,
        "models": {"slm": {"name": "embedded", "sha256": "3" * 64}, "llm": {"name": "embedded", "sha256": "4" * 64}},
        "dtype": "float32", "backend": "reference (transformers, both models)",
        "protocol": {"max_new_tokens": 256}, "seed": 0, "device": "cpu",
        "batching": {"concurrency": 8, "lockstep": True, "forwards": "per-sequence", "batch_invariant": True},
        "vocabulary": {"model": "embedded", "sha256": "5" * 64}, "seed_policy": "seeded", "version": "0",
        "code": {"sha256": "6" * 64},
    }


def write_results(path: Path, size: int, trace_bytes: int) -> int:
    """Write rows to ``path`` until it holds ``size`` bytes; return how many."""
    rng = np.random.default_rng(0)
    traces = [base64.b64encode(rng.bytes(trace_bytes * 3 // 4)).decode("ascii") for _ in range(TRACE_POOL)]
    grid = settings()
    written = rows = 0
    with path.open("w", encoding="utf-8") as out:
        while written < size:
            task, mode, policy, params = grid[rows % len(grid)]
            line = json.dumps(synthetic_row(rng, task, mode, policy, params, rows // len(grid),
                                            traces[rows % TRACE_POOL]), separators=(",", ":")) + "\n"
            out.write(line)
            written += len(line)
            rows += 1
    return rows


def measured_report(results: Path, out: Path) -> tuple[float, float]:
    """(peak resident MB, wall seconds) of ``decodeleak report results`` in a child process."""
    command = [sys.executable, "-c", "import sys; from eval_harness.cli.decodeleak import main; sys.exit(main())",
               "report", str(results), "--out", str(out)]
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"decodeleak report failed ({child.returncode}): {child.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024, seconds  # Linux reports ru_maxrss in KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the synthetic results file (GB, 1e9 bytes)")
    parser.add_argument("--trace-kb", type=int, default=30, help="size of each row's encoded trace (KB)")
    parser.add_argument("--dir", type=Path, help="where the file is written (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the file afterwards")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="report-memory-", dir=args.dir))
    results = directory / "results.jsonl"
    try:
        rows = write_results(results, int(args.gb * 1e9), args.trace_kb * 1000)
        mb = results.stat().st_size / 1e6
        peak, seconds = measured_report(results, directory / "report")
        print(f"rows={rows}")
        print(f"file_mb={mb:.0f}")
        print(f"report_s={seconds:.1f}")
        print(f"report_peak_rss_mb={peak:.0f}")
        print(f"report_mb_per_s={mb / seconds:.1f}")
    finally:
        if not args.keep:
            for path in sorted(directory.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            directory.rmdir()


if __name__ == "__main__":
    main()
