"""How well the cloud adapter batches concurrent sessions, against the ideal batched forward.

(a) The ideal: a plain equal-length batched decode on the model itself (one
    batched prefill into a DynamicCache, then ``model(input_ids[B, 1])`` per
    step, reading each row's logits to numpy), batch 8 against batch 1.
(b) The real thing: 1, 4 and 8 concurrent edge-mode sessions with different
    prompt lengths through the gRPC server on loopback (``cloud_adapter.loadgen``:
    each client answers every distribution at once with its best id that does
    not end the generation, so every session runs the full length), with run-ahead as the SDK's default
    (``--lookahead 8``: the clients confirm the cloud's draft, so the drafted forwards are the batches) or in
    lockstep (``--lookahead 0``).
(c) batch8_vs_ideal = batch8_speedup / ideal_batch8_speedup (target >= 0.8), computed in each round from
    that round's own runs; the median over the rounds is reported with its spread (min..max).

Usage: python benchmarks/cloud_batching.py [--tokens N] [--dtype auto|bf16|fp16|fp32] [--repeats R] [--lookahead N]
The last lines are batch4_speedup, ideal_batch8_speedup, batch8_speedup, batch8_vs_ideal (medians over rounds)
and batch8_vs_ideal_min, batch8_vs_ideal_max.
"""

from __future__ import annotations

import argparse

import grpc
import numpy as np
import torch

from _common import ideal_tokens_per_s, served_load, text_prompts
from cloud_adapter.engine import CloudEngine
from cloud_adapter.inprocess import serving
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.runners import StepBatcher
from edge_sdk.protocol import wire
from edge_sdk.cli_flags import add_dtype_flag

#: prompt lengths of the concurrent sessions (all different)
PROMPT_LENGTHS = (9, 14, 20, 27, 33, 38, 44, 51)
SESSION_COUNTS = (1, 4, 8)
IDEAL_BATCHES = (1, 8)


def served_decode(llm: TransformersLLM, channel: grpc.Channel, sessions: int, tokens: int, lookahead: int) -> float:
    """Seconds ``sessions`` concurrent sessions take from their common start (all prefilled) to the last finish."""
    prompts = [text_prompts(llm, 1, length)[0] for length in PROMPT_LENGTHS[:sessions]]
    return served_load(llm, channel, prompts, tokens=tokens, top_m=8, lookahead=lookahead).wall_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per sequence")
    add_dtype_flag(parser, default="auto", help="model dtype (auto = what coveil-cloud serve picks)")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="the server's batching window")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each configuration runs once per round")
    parser.add_argument("--lookahead", type=int, default=wire.MAX_LOOKAHEAD,
                        help="run-ahead depth the sessions accept (0 = lockstep)")
    args = parser.parse_args()

    llm = TransformersLLM(dtype=args.dtype)
    print(f"model {llm.name}, dtype {llm.dtype}, torch threads {torch.get_num_threads()}, {args.tokens} tokens, "
          f"median of {args.repeats} rounds, lookahead {args.lookahead}")

    configs = [f"ideal batch {b}" for b in IDEAL_BATCHES] + [f"server, {n} session(s)" for n in SESSION_COUNTS]
    runs: dict[str, list[float]] = {name: [] for name in configs}
    mean_batches: dict[str, list[float]] = {name: [] for name in configs}
    with StepBatcher(llm, batch_window_ms=args.batch_window_ms) as batcher:
        limits = Limits(max_sessions=max(SESSION_COUNTS), max_new_tokens=max(args.tokens, 1))
        engine = CloudEngine(llm, limits, runner=batcher)
        with serving(engine, max_workers=max(SESSION_COUNTS) + 16) as adapter, \
                grpc.insecure_channel(adapter.address) as channel:
            ideal_tokens_per_s(llm, text_prompts(llm, 1), 4)  # warm-ups
            served_decode(llm, channel, 1, 4, args.lookahead)
            # rounds interleave the configurations, so that a burst of other load on a shared
            # machine does not fall on one configuration only
            for _ in range(args.repeats):
                for batch in IDEAL_BATCHES:  # the server is idle meanwhile: nothing else uses the model
                    runs[f"ideal batch {batch}"].append(ideal_tokens_per_s(llm, text_prompts(llm, batch), args.tokens))
                for sessions in SESSION_COUNTS:
                    name = f"server, {sessions} session(s)"
                    batcher.batch_sizes.clear()
                    elapsed = served_decode(llm, channel, sessions, args.tokens, args.lookahead)
                    runs[name].append(sessions * args.tokens / elapsed)
                    batches = sum(batcher.batch_sizes.values())
                    mean_batches[name].append(sum(size * n for size, n in batcher.batch_sizes.items()) / batches)

    def per_round(numerator: str, denominator: str) -> np.ndarray:
        return np.array(runs[numerator]) / np.array(runs[denominator])

    ideal_speedup = per_round("ideal batch 8", "ideal batch 1")
    speedup = {n: per_round(f"server, {n} session(s)", "server, 1 session(s)") for n in SESSION_COUNTS}
    vs_ideal = speedup[8] / ideal_speedup
    print()
    print(f"{'':<22}{'tokens/s median':>16}{'min..max':>16}{'mean batch':>12}")
    for name in configs:
        values = runs[name]
        line = f"{name:<22}{np.median(values):>16.1f}{f'{min(values):.1f}..{max(values):.1f}':>16}"
        if mean_batches[name]:
            line += f"{np.median(mean_batches[name]):>12.2f}"
        print(line)
    print(f"batch8_vs_ideal per round: {', '.join(f'{v:.3f}' for v in vs_ideal)}")
    print(f"batch4_speedup={np.median(speedup[4]):.3f}")
    print(f"ideal_batch8_speedup={np.median(ideal_speedup):.3f}")
    print(f"batch8_speedup={np.median(speedup[8]):.3f}")
    print(f"batch8_vs_ideal={np.median(vs_ideal):.3f}")
    print(f"batch8_vs_ideal_min={vs_ideal.min():.3f}")
    print(f"batch8_vs_ideal_max={vs_ideal.max():.3f}")


if __name__ == "__main__":
    main()
