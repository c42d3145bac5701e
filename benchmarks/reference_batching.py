"""How fast the reference runner decodes many items at once, against the ideal and against the release's loop.

All in one run, on real MedPriv items (ragged prompts; the SLM also reads the private context), both models
the embedded Gemma-3 270M in transformers (dtype as ``--dtype``), edge-side CoVeil (lambda = 1) every step:

(a) the reference runner with 1 item in flight and with 8, over ``--items`` items x ``--tokens`` tokens.
    Decode tokens/s = tokens / (wall time - time inside prefills): the runner's forwards never overlap and a
    prefill runs while every item waits on it, so that subtraction leaves exactly the decoding.  The ideal
    below has no prefill in its clock either; prefill gains nothing from batching (its forward is already
    [L] tokens wide), and at a few dozen tokens it would otherwise be half of both runs.
(b) the ideal: a plain equal-length batched greedy decode of one model, batch 8 against batch 1
    (``_common.ideal_tokens_per_s``), in the same dtype.
(c) the authors' release's way (``leakage_fusion_core/runtime.py``): one item at a time, every step a full
    forward of both models over the whole sequence (``model(ids).logits[0, -1]``: no KV cache, logits at
    every position), then the fusion and CoVeil's edge-side rule.  Against it, the runner decodes
    ``--protocol-items`` items with the paper's protocol (``max_new_tokens`` 256, end-of-sequence masked until
    the answer letter, stop at the answer), 8 in flight as a sweep runs them (a finished item's slot takes the
    next item), end to end (prefill included).  The release is timed on the same items (or ``--release-items`` of
    them spread evenly over the list), continuing with the tokens the runner chose.  Without a cache a
    step's cost depends only on the length of the sequence it recomputes, so the release's time is estimated
    from steps timed at ``--release-samples`` evenly spaced lengths of each item's continuation, linearly
    interpolated over every length the item goes through (the cost is close to linear in the length).
    Running the release loop over whole generations takes many minutes per item here; timing it over a few
    dozen tokens instead would leave out the long sequences that make it slow.

Every timed forward runs on a thread other than the main one, as the runner's forwards do (its model worker):
with torch's default two OpenMP threads, the same batch-1 forward took 80-200 ms issued from the main thread
and 48 ms from any other thread on the shared 2-core box this was written on (46-50 ms either way with one
thread), which made the ideal and the release loop look several times slower than they are.

Rounds interleave (a) and (b) so a burst of other load on a shared machine does not fall on one configuration
only; each round's ratios use that round's runs, and the median over rounds is reported with its min..max.

batch8_speedup = (a, 8) / (a, 1);  batch8_vs_ideal = batch8_speedup / ideal batch-8 speedup (target >= 0.8).
A runner token takes a step of each model, so "runner / ideal pace" (runner tokens/s over half the one-model
ideal) says how close each run comes to the bare forwards; batch8_vs_ideal is the 8-item pace over the
1-item pace, above 1 when the 1-item run loses more to its own overheads than the 8-item run.
vs_release_loop = runner tokens/s / release tokens/s on (a)'s items and tokens (the runner with 8 in flight, both
end to end, prefill included): the same workload as batch8_speedup, as the issue sets them (target >= 20).
vs_release_loop_protocol, printed just before the last three lines, is the same ratio over (c): the paper's
protocol on this model pair.  There the answers are ragged (most a few dozen tokens, a few 256) and each item's
prefill, which batching does not shorten, weighs as much as its decoding, so the ratio is lower; with answers
of the 256 tokens a larger model reasons for it would be higher.

The runner's batches run as one forward per item unless ``--padded-batches`` (then one padded forward each,
the batching the ideal (b) measures): see ``cloud_adapter.runners.LockstepBatcher`` for why per item is the default.

With ``--invariant`` it measures only the batch-invariant forwards (``decodeleak --batch-invariant``,
:mod:`eval_harness.runners.batch_invariant`), float32, on the cloud model over the ``--items`` items' cloud
prompts, ``--tokens`` greedy steps each (prefill included): one forward per item with the default kernels (the
runner's default) against one batch-invariant forward of all items, rounds interleaved; then every item's logit
row after each step of that batched run against the item stepped alone through the same kernels, counted where
any bit differs.  batch8_invariant_vs_per_item = batched tokens/s / per-item tokens/s (target >= 2.5).  The
forwards alone, not the runner: its per-item host work (the policy, the exposure rows) is the same either way.

Usage: python benchmarks/reference_batching.py [--tokens N] [--items N] [--rounds R] [--dtype auto|bf16|fp32]
       [--padded-batches] [--threads N] [--protocol-items N] [--release-items N] [--release-samples N]
       [--invariant]
The last three lines are batch8_speedup, batch8_vs_ideal and vs_release_loop; with --invariant the last two
are invariant_row_differences and batch8_invariant_vs_per_item.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
from _common import ideal_tokens_per_s, text_prompts

from cloud_adapter.llm import TransformersLLM
from edge_sdk.cli_flags import add_dtype_flag
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.policies import CoVeil
from edge_sdk.policies.coveil import coveil_select
from eval_harness.datasets import load_task
from eval_harness.decoding_protocol import DecodingProtocol
from eval_harness.runners.batch_invariant import greedy_rows
from eval_harness.runners.reference import ItemRun, ReferenceRunner

ALPHA = DecodeSettings.alpha
T = TypeVar("T")


def off_main_thread(measure: Callable[..., T], *args: object) -> T:
    """``measure(*args)`` on a thread of its own (see the module docstring: the main thread's forwards are slow)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="measure") as pool:
        return pool.submit(measure, *args).result()


def runner_tokens_per_s(slm: TransformersLLM, llm: TransformersLLM, runs: list[ItemRun], concurrency: int,
                        tokens: int, forwards: str) -> tuple[float, float, list[list[int]]]:
    """(decode tokens/s with prefill time taken out, end-to-end tokens/s, every item's tokens)."""
    with ReferenceRunner(slm, llm, concurrency=concurrency, forwards=forwards) as runner:
        runner.run(runs[:concurrency], mode="edge", alpha=ALPHA, max_new_tokens=2)  # warm-up
        prefill_before = sum(stats.prefill_seconds for stats in runner.stats)
        start = time.perf_counter()
        results = runner.run(runs, mode="edge", alpha=ALPHA, max_new_tokens=tokens)
        elapsed = time.perf_counter() - start
        prefill = sum(stats.prefill_seconds for stats in runner.stats) - prefill_before
    produced = sum(len(r.token_ids) for r in results)
    return produced / (elapsed - prefill), produced / elapsed, [r.token_ids for r in results]


@torch.inference_mode()
def release_step_seconds(slm: TransformersLLM, llm: TransformersLLM, slm_ids: list[int], llm_ids: list[int],
                         generated: list[int]) -> float:
    """One step of the release's loop after ``generated``: both full forwards without a cache, then CoVeil."""
    start = time.perf_counter()
    z_llm = llm.model(torch.tensor([llm_ids + generated])).logits[0, -1, : llm.vocab_size].float().numpy()
    z_slm = slm.model(torch.tensor([slm_ids + generated])).logits[0, -1, : slm.vocab_size].float().numpy()
    p_llm, p_slm = (np.exp(z - z.max()) / np.exp(z - z.max()).sum() for z in (z_llm, z_slm))
    coveil_select(p_slm.astype(np.float32), p_llm.astype(np.float32), alpha=ALPHA, lam=1.0)
    return time.perf_counter() - start


def release_seconds(slm: TransformersLLM, llm: TransformersLLM, slm_ids: list[int], llm_ids: list[int],
                    continuation: Sequence[int], samples: int) -> float:
    """The release's time to decode ``continuation`` (one step per token), from ``samples`` timed steps.

    Step ``j`` (after ``j`` tokens) costs ``c(j)``; ``c`` is timed at evenly spaced ``j`` and interpolated
    linearly in between; the total is ``sum_j c(j)`` over ``j = 0 .. n-1``.
    """
    n = len(continuation)
    at = np.unique(np.linspace(0, n - 1, num=min(samples, n)).round().astype(int))
    cost = [release_step_seconds(slm, llm, slm_ids, llm_ids, list(continuation[:j])) for j in at]
    return float(np.interp(np.arange(n), at, cost).sum())


def invariant_benchmark(args: argparse.Namespace, runs: list[ItemRun]) -> None:
    """``--invariant``: the cloud model's forwards over the items' prompts, ``--tokens`` greedy steps: one forward
    per item with the default kernels (timed), all items in one batch-invariant forward (timed), and each item in
    a batch-invariant forward of its own (the oracle the batched rows are compared with, untimed)."""
    from eval_harness.runners.batch_invariant import make_batch_invariant

    plain = TransformersLLM(dtype="fp32")
    invariant = TransformersLLM(dtype="fp32")
    make_batch_invariant(invariant.model)
    prompts = [list(run.prompts(plain).cloud_ids) for run in runs]
    steps = len(prompts) * args.tokens

    def timed(llm: TransformersLLM, together: bool) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        rows = greedy_rows(llm, prompts, args.tokens, together=together)
        return steps / (time.perf_counter() - start), rows

    ratios = []
    for _ in range(args.rounds):
        per_item, _ = off_main_thread(timed, plain, False)
        batched, together = off_main_thread(timed, invariant, True)
        ratios.append(batched / per_item)
        print(f"  round: per-item forwards {per_item:6.2f}, batch-invariant batch of {len(prompts)} {batched:6.2f} "
              f"tokens/s (prefill included): {ratios[-1]:.3f}x")
    _, alone = off_main_thread(timed, invariant, False)
    differing = int((alone != together).any(axis=2).sum())
    print(f"batch8_invariant_vs_per_item per round: {summary(ratios)}")
    print(f"invariant_row_differences={differing}  (of {len(prompts)} items x {args.tokens} steps)")
    print(f"batch8_invariant_vs_per_item={np.median(ratios):.3f}")


def summary(values: Sequence[float]) -> str:
    return f"{np.median(values):8.3f}  ({min(values):.3f}..{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per item in (a)")
    parser.add_argument("--items", type=int, default=8, help="MedPriv items (the batch of the 8-item run)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (a) and (b); ratios are their medians")
    parser.add_argument("--protocol-items", type=int, default=64,
                        help="MedPriv items the runner decodes under the paper's protocol in (c)")
    parser.add_argument("--release-items", type=int, default=None,
                        help="of those, items the release loop is timed on (default: all; fewer is quicker but "
                             "compares the release on a sample of the items with the runner on all of them)")
    parser.add_argument("--release-samples", type=int, default=5,
                        help="release steps timed per item (at evenly spaced lengths)")
    add_dtype_flag(parser, default="auto", help="model dtype")
    parser.add_argument("--padded-batches", action="store_true",
                        help="the runner's padded batched forwards (decodeleak --padded-batches) instead of its "
                             "default of one forward per item, which keeps rows independent of their batch")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--invariant", action="store_true",
                        help="measure only the batch-invariant batched forwards against per-item ones (float32)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    protocol = DecodingProtocol()
    items = load_task("medpriv", args.items)
    runs = [ItemRun(item.item_id, protocol.question_prompt(item), item.private_context, CoVeil(lam=1.0),
                    public_preamble=protocol.preamble) for item in items]  # no stopping rule: a fixed length
    if args.invariant:
        print(f"float32, torch threads {torch.get_num_threads()}, {args.items} MedPriv items x {args.tokens} "
              f"tokens, edge-side CoVeil, {args.rounds} rounds")
        invariant_benchmark(args, runs)
        return
    forwards = "padded" if args.padded_batches else "per-sequence"

    slm, llm = TransformersLLM(dtype=args.dtype), TransformersLLM(dtype=args.dtype)
    print(f"model {llm.name}, dtype {llm.dtype}, torch threads {torch.get_num_threads()}, {args.items} MedPriv "
          f"items x {args.tokens} tokens, edge-side CoVeil, {args.rounds} rounds")

    speedups, vs_ideal, rows = [], [], []
    for _ in range(args.rounds):
        one, one_e2e, _ = runner_tokens_per_s(slm, llm, runs, 1, args.tokens, forwards)
        eight, eight_e2e, fixed_continuations = runner_tokens_per_s(slm, llm, runs, 8, args.tokens,
                                                                    forwards)
        ideal_one, ideal_eight = (off_main_thread(ideal_tokens_per_s, llm, text_prompts(llm, batch), args.tokens) for batch in (1, 8))
        speedups.append(eight / one)
        vs_ideal.append(speedups[-1] / (ideal_eight / ideal_one))
        rows.append((one, eight, one_e2e, eight_e2e, ideal_one, ideal_eight))
        print(f"  round: runner 1 / 8 items {one:6.1f} / {eight:6.1f} decode tokens/s ({one_e2e:.1f} / "
              f"{eight_e2e:.1f} with prefill); ideal batch 1 / 8 {ideal_one:6.1f} / {ideal_eight:6.1f} tokens/s; "
              f"batch8_vs_ideal {vs_ideal[-1]:.3f}")

    def release_tokens_per_s(timed: Sequence[tuple[ItemRun, Sequence[int]]]) -> float:
        seconds = 0.0
        for run, continuation in timed:
            prompts = run.prompts(slm)
            seconds += off_main_thread(release_seconds, slm, llm, list(prompts.slm_ids), list(prompts.cloud_ids),
                                       continuation, args.release_samples)
        return sum(len(continuation) for _, continuation in timed) / seconds

    # the release on (a)'s workload (every item the same length, so 8 in flight stay 8 to the end)
    release_fixed = release_tokens_per_s(list(zip(runs, fixed_continuations)))

    # (c): the paper's protocol, the runner end to end on every item against the release's loop on them
    protocol_items = load_task("medpriv", args.protocol_items)
    timed_count = min(args.release_items or len(protocol_items), len(protocol_items))
    spread = np.unique(np.linspace(0, len(protocol_items) - 1, num=timed_count).round().astype(int))
    print(f"  the paper's protocol: the runner on {len(protocol_items)} items, then the release loop on "
          f"{len(spread)} of them ...")
    protocol_runs = [ItemRun.of(protocol, item, CoVeil(lam=1.0)) for item in protocol_items]
    _, runner_e2e, continuations = runner_tokens_per_s(slm, llm, protocol_runs, 8, protocol.max_new_tokens,
                                                       forwards)
    timed = [(protocol_runs[i], continuations[i]) for i in spread]
    release = release_tokens_per_s(timed)
    lengths = [len(c) for c in continuations]

    print()
    print("per round, median (min..max):")
    print(f"reference runner, 1 item in flight:  {summary([r[0] for r in rows])} decode tokens/s")
    print(f"reference runner, 8 items in flight: {summary([r[1] for r in rows])} decode tokens/s")
    print(f"  the same with prefill in the clock: {summary([r[2] for r in rows])} / {summary([r[3] for r in rows])}")
    print(f"ideal batched forward, batch 1:      {summary([r[4] for r in rows])} tokens/s (one model)")
    print(f"ideal batched forward, batch 8:      {summary([r[5] for r in rows])} tokens/s (one model)")
    # a runner token takes one step of each model: the ideal pace for it is half the one-model ideal
    print(f"runner / ideal pace, 1 item:         {summary([2 * r[0] / r[4] for r in rows])}")
    print(f"runner / ideal pace, 8 items:        {summary([2 * r[1] / r[5] for r in rows])}")
    print(f"batch8_speedup per round:            {summary(speedups)}")
    print(f"batch8_vs_ideal per round:           {summary(vs_ideal)}")
    print(f"(a)'s {len(runs)} items x {args.tokens} tokens, end to end: runner, 8 in flight, "
          f"{np.median([r[3] for r in rows]):.2f} tokens/s; release loop {release_fixed:.3f} tokens/s: "
          f"{np.median([r[3] for r in rows]) / release_fixed:.2f}x")
    print(f"paper's protocol, {len(lengths)} items of {min(lengths)}..{max(lengths)} tokens (median "
          f"{np.median(lengths):.0f}): runner, 8 in flight, {runner_e2e:.2f} tokens/s end to end; release loop on "
          f"{len(timed)} of them ({sum(len(c) for _, c in timed)} tokens) {release:.3f} tokens/s "
          f"({args.release_samples} timed steps each)")
    print(f"vs_release_loop_protocol={runner_e2e / release:.2f}")
    print(f"batch8_speedup={np.median(speedups):.3f}")
    print(f"batch8_vs_ideal={np.median(vs_ideal):.3f}")
    print(f"vs_release_loop={np.median([r[3] for r in rows]) / release_fixed:.2f}")


if __name__ == "__main__":
    main()
