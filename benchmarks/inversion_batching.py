"""How fast the local inversion attacker reconstructs many private contexts at once, against one at a time.

On real MedPriv items: the reference runner first decodes ``--items`` items undefended, cloud-side, for
``--steps`` tokens with the exposure recorded at K = ``--k`` (both models the embedded Gemma-3 270M in
transformers); then :class:`~eval_harness.attacks.inversion.TransformersInversion` over the run's cloud LLM
reconstructs every item's private context from what the cloud observed, writing ``--new-tokens`` tokens each:

(a) one observation per ``generate`` call (batch 1);
(b) ``--batch`` observations per left-padded ``generate`` call (KV cache, greedy), shortest prompts first.

For each: wall time, generated tokens/s (tokens written up to each end-of-sequence) and prompt tokens/s.
The prompt lengths are printed too (the compact exposure sequence: tokens per step).  Both runs must write the
same reconstructions (greedy decoding; padding must not change them).

batch_speedup = generated tokens/s of (b) / of (a), same work.

Usage: python benchmarks/inversion_batching.py [--items N] [--steps N] [--k K] [--new-tokens N] [--batch N]
The last lines are prompt_tokens_mean, same_reconstructions and batch_speedup.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cloud_adapter.llm import TransformersLLM
from edge_sdk.cli_flags import add_dtype_flag
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.backends.pieces import piece_reader
from edge_sdk.policies import Undefended
from eval_harness.attacks.inversion import CloudObservation, TransformersInversion, exposure_lines
from eval_harness.datasets import load_task
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners.reference import ItemRun, ReferenceRunner


def attack_throughput(attack: TransformersInversion, observations: list[CloudObservation],
                      prompt_tokens: int) -> tuple[float, float, float, list[str]]:
    """(wall s, generated tokens/s, prompt tokens/s, reconstructions in observation order)."""
    attack.generated_tokens = 0
    start = time.perf_counter()
    answers = dict(attack.reconstruct_each(observations))
    wall = time.perf_counter() - start
    return wall, attack.generated_tokens / wall, prompt_tokens / wall, [answers[i] for i in range(len(observations))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=8, help="MedPriv items attacked")
    parser.add_argument("--steps", type=int, default=32, help="tokens decoded per item before the attack")
    parser.add_argument("--k", type=int, default=100, help="top-K of each step shown to the attacker")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens the attacker writes per item")
    parser.add_argument("--batch", type=int, default=8, help="observations per generate call in the batched run")
    add_dtype_flag(parser, default="fp32", help="model dtype")
    args = parser.parse_args()

    slm, llm = TransformersLLM(dtype=args.dtype), TransformersLLM(dtype=args.dtype)
    protocol = DecodingProtocol(max_new_tokens=args.steps, stop_at_answer=False)
    items = load_task("medpriv", args.items)
    runs = [ItemRun.of(protocol, item, Undefended()) for item in items]
    with ReferenceRunner(slm, llm, concurrency=min(8, args.items)) as runner:
        results = runner.run(runs, mode="cloud", alpha=DecodeSettings.alpha, max_new_tokens=args.steps, exposure_k=args.k)
    observations = [CloudObservation(run.public_prompt, result.ledger.exposure_trace())
                    for run, result in zip(runs, results)]

    piece = piece_reader(llm.tokenizer)
    single = TransformersInversion(llm, piece, k=args.k, max_new_tokens=args.new_tokens, batch_size=1)
    batched = TransformersInversion(llm, piece, k=args.k, max_new_tokens=args.new_tokens, batch_size=args.batch)
    lengths = [len(single.prompt_ids(o)) for o in observations]
    per_step = [len(llm.tokenize("\n".join(exposure_lines(o, piece, args.k)), add_bos=False)) / len(o.exposures)
                for o in observations]
    print(f"model {llm.name}, dtype {llm.dtype}, torch threads {torch.get_num_threads()}, {args.items} MedPriv "
          f"items x {args.steps} steps, K={args.k}, {args.new_tokens} tokens written per item")
    print(f"prompt tokens: mean {statistics.mean(lengths):.0f}, min {min(lengths)}, max {max(lengths)}; "
          f"exposure sequence {statistics.mean(per_step):.1f} tokens per step")

    batched.complete([single.prompt_ids(observations[0])[:16]])  # warm-up (first-call allocations)
    one = attack_throughput(single, observations, sum(lengths))
    many = attack_throughput(batched, observations, sum(lengths))
    print(f"one at a time:        {one[0]:7.1f} s, {one[1]:7.1f} generated tokens/s, {one[2]:8.1f} prompt tokens/s")
    print(f"batch {args.batch} per generate: {many[0]:7.1f} s, {many[1]:7.1f} generated tokens/s, "
          f"{many[2]:8.1f} prompt tokens/s")
    print(f"prompt_tokens_mean={statistics.mean(lengths):.0f}")
    print(f"same_reconstructions={one[3] == many[3]}")
    print(f"batch_speedup={many[1] / one[1]:.2f}")


if __name__ == "__main__":
    main()
