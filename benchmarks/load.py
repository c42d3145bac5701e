"""32 concurrent sessions against one cloud adapter on loopback: step latency, throughput, memory afterwards.

The adapter (the embedded Gemma-3 270M, dtype as ``coveil-cloud serve --dtype auto`` picks) runs in this
process with its StepBatcher; ``cloud_adapter.loadgen`` opens the sessions over gRPC, each answering every
distribution at once, so the latency measured is the adapter's (batched forward + protocol).  Memory is
the process's resident set after a warm-up round and again after each measured round has closed: a KV
cache left behind grows it round after round, while the allocator's own pools move it up and down by tens
of MiB either way.

Usage: python benchmarks/load.py [--sessions N] [--tokens T] [--rounds R]
The last lines are p50_step_ms, p95_step_ms, tokens_per_s, errors (over all measured rounds) and
rss_growth_mib (after the last round, against the warm-up baseline).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import grpc
import numpy as np
import torch

from cloud_adapter.engine import CloudEngine
from cloud_adapter.inprocess import serving
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.loadgen import run_load
from cloud_adapter.runners import StepBatcher
from eval_harness.datasets import load_task


def rss_mib() -> float:
    """This process's resident set size (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32, help="concurrent sessions")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each session decodes")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    args = parser.parse_args()

    llm = TransformersLLM(dtype="auto")
    items = load_task("medpriv", args.sessions)
    prompts = [llm.tokenize(item.public_prompt) for item in items]  # real public prompts: ragged lengths
    limits = Limits(max_sessions=args.sessions, max_sessions_per_client=args.sessions,
                    max_unopened_streams=args.sessions, max_new_tokens=args.tokens)
    print(f"model {llm.name}, dtype {llm.dtype}, torch threads {torch.get_num_threads()}, {args.sessions} sessions "
          f"x {args.tokens} tokens, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    with StepBatcher(llm) as batcher:
        engine = CloudEngine(llm, limits, runner=batcher)
        with serving(engine, max_workers=args.sessions + limits.max_unopened_streams + 8) as adapter, \
                grpc.insecure_channel(adapter.address) as channel:
            common = dict(fingerprint=llm.vocab_fingerprint(), vocab_size=llm.vocab_size, tokens=args.tokens)
            run_load(channel, prompts, **common)  # warm-up: allocator pools reach their working size
            gc.collect()
            baseline = rss_mib()
            batcher.batch_sizes.clear()
            reports, after = [], []
            for _ in range(args.rounds):
                reports.append(run_load(channel, prompts, **common))
                gc.collect()
                after.append(rss_mib())
    sizes = batcher.batch_sizes
    mean_batch = sum(size * n for size, n in sizes.items()) / max(sum(sizes.values()), 1)
    steps = [s for report in reports for s in report.step_seconds]
    errors = [e for report in reports for e in report.errors]
    wall = sum(report.wall_seconds for report in reports)
    print(f"{len(steps)} steps in {wall:.1f} s over {args.rounds} rounds; mean batch {mean_batch:.1f}; active sessions "
          f"afterwards {engine.active_sessions}")
    print(f"resident memory: {baseline:.0f} MiB after the warm-up, after each round: "
          f"{', '.join(f'{a:.0f}' for a in after)} MiB")
    for error in errors[:5]:
        print(f"error: {error}")
    print(f"p50_step_ms={np.percentile(steps, 50) * 1e3:.1f}")
    print(f"p95_step_ms={np.percentile(steps, 95) * 1e3:.1f}")
    print(f"tokens_per_s={len(steps) / wall:.1f}")
    print(f"errors={len(errors)}")
    print(f"rss_growth_mib={after[-1] - baseline:.1f}")


if __name__ == "__main__":
    main()
