"""How fast the reference runner decodes many items at once, against the ideal and against the release's loop.

All in one run, on real MedPriv items (ragged prompts; the SLM also reads the private context), both models
the embedded Gemma-3 270M in transformers (dtype as ``--dtype``), edge-side CoVeil every step:

(a) the reference runner with 1 item in flight and with 8 (tokens/s over every item's tokens);
(b) the ideal: a plain equal-length batched greedy decode of one model, batch 8 against batch 1
    (``cloud_batching.ideal_tokens_per_s``), in the same dtype;
(c) the authors' release's way: one item at a time, every step a full forward of both models over the whole
    sequence (no KV cache), the fusion and CoVeil's edge-side rule in between.

batch8_speedup = (a, 8) / (a, 1);  batch8_vs_ideal = batch8_speedup / ideal batch-8 speedup (target >= 0.8);
vs_release_loop = (a, 8) / (c) (target >= 20).

Usage: python benchmarks/reference_batching.py [--tokens N] [--items N] [--dtype auto|bf16|fp32]
The last three lines are batch8_speedup, batch8_vs_ideal and vs_release_loop.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from cloud_batching import ideal_tokens_per_s

from cloud_adapter.llm import TransformersLLM
from edge_sdk.client import CONTEXT_SEPARATOR
from edge_sdk.policies import CoVeil
from edge_sdk.policies.coveil import coveil_select
from eval_harness.datasets import load_task
from eval_harness.protocol import DecodingProtocol
from eval_harness.runners.reference import ItemRun, ReferenceRunner


def runner_tokens_per_s(slm: TransformersLLM, llm: TransformersLLM, runs: list[ItemRun], concurrency: int,
                        tokens: int) -> float:
    with ReferenceRunner(slm, llm, concurrency=concurrency) as runner:
        runner.run(runs[:concurrency], mode="edge", alpha=0.3, max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        results = runner.run(runs, mode="edge", alpha=0.3, max_new_tokens=tokens)
        elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


@torch.inference_mode()
def release_loop_tokens_per_s(slm: TransformersLLM, llm: TransformersLLM, prompts: list[tuple[list[int], list[int]]],
                              tokens: int) -> float:
    """One item at a time, no KV cache: each step re-runs both models over the whole sequence."""
    start = time.perf_counter()
    produced = 0
    for slm_ids, llm_ids in prompts:
        generated: list[int] = []
        for _ in range(tokens):
            z_llm = llm.model(torch.tensor([llm_ids + generated])).logits[0, -1, : llm.vocab_size].float().numpy()
            z_slm = slm.model(torch.tensor([slm_ids + generated])).logits[0, -1, : slm.vocab_size].float().numpy()
            p_llm, p_slm = (np.exp(z - z.max()) / np.exp(z - z.max()).sum() for z in (z_llm, z_slm))
            generated.append(coveil_select(p_slm.astype(np.float32), p_llm.astype(np.float32), alpha=0.3, lam=1.0))
            produced += 1
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per item")
    parser.add_argument("--items", type=int, default=8, help="MedPriv items (the batch of the 8-item run)")
    parser.add_argument("--release-items", type=int, default=2, help="items the slow release loop decodes")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    args = parser.parse_args()

    slm, llm = TransformersLLM(dtype=args.dtype), TransformersLLM(dtype=args.dtype)
    protocol = DecodingProtocol()
    items = load_task("medpriv", args.items)
    runs = [ItemRun(item.item_id, protocol.public_prompt(item), item.private_context, CoVeil(lam=1.0))
            for item in items]
    print(f"model {llm.name}, dtype {llm.dtype}, torch threads {torch.get_num_threads()}, {args.items} MedPriv "
          f"items x {args.tokens} tokens, edge-side CoVeil")

    one = runner_tokens_per_s(slm, llm, runs, 1, args.tokens)
    eight = runner_tokens_per_s(slm, llm, runs, 8, args.tokens)
    ideal_one, ideal_eight = (ideal_tokens_per_s(llm, batch, args.tokens) for batch in (1, 8))
    prompts = [(slm.tokenize(run.private_context + CONTEXT_SEPARATOR + run.public_prompt), llm.tokenize(run.public_prompt))
               for run in runs[: args.release_items]]
    release = release_loop_tokens_per_s(slm, llm, prompts, args.tokens)

    print(f"reference runner, 1 item in flight:  {one:8.1f} tokens/s")
    print(f"reference runner, 8 items in flight: {eight:8.1f} tokens/s")
    print(f"ideal batched forward, batch 1 / 8:  {ideal_one:8.1f} / {ideal_eight:.1f} tokens/s (one model)")
    print(f"release loop (no cache, one item):   {release:8.1f} tokens/s")
    speedup = eight / one
    print(f"batch8_speedup={speedup:.3f}")
    print(f"batch8_vs_ideal={speedup / (ideal_eight / ideal_one):.3f}")
    print(f"vs_release_loop={eight / release:.2f}")


if __name__ == "__main__":
    main()
