"""Per-step cost of each policy, as a multiple of one np.argmax pass over the vocabulary.

The floor of any policy is one read of the vocabulary; the ratio says how many
such reads a policy costs.  Inputs are realistic peaked distributions (softmax
of Gaussian logits with a few boosted tokens), given as probabilities.

Usage: python benchmarks/policy_step.py [--repeats N]
The last three lines are coveil_upload_vs_argmax and coveil_select_vs_argmax
for a 262,144-token vocabulary, then slowest_policy_vs_argmax: the largest
ratio of any registered policy in any of its modes at either vocabulary size
(a sweep runs every policy once per token, so this is the one to keep low).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.fusion import softmax
from edge_sdk.policies import EmbeddingNeighbours, available_policies, make_policy

VOCABS = (151_936, 262_144)


def peaked_pair(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    z_llm = gen.standard_normal(vocab).astype(np.float32) * 2.0
    z_slm = z_llm + gen.standard_normal(vocab).astype(np.float32)
    z_llm[gen.integers(0, vocab, 5)] += 12.0
    z_slm[gen.integers(0, vocab, 5)] += 12.0
    return softmax(z_slm), softmax(z_llm)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Median of ``repeats`` timed calls after one warm-up (seconds)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per policy (median is reported)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    headline: dict[str, float] = {}
    slowest = 0.0
    for vocab in VOCABS:
        p_slm, p_llm = peaked_pair(vocab, seed=vocab)
        floor = best_time(lambda: np.argmax(p_llm), args.repeats)  # noqa: B023
        print(f"\nvocab {vocab:,}: np.argmax = {floor * 1e6:.1f} us")
        print(f"  {'policy':<16}{'mode':<7}{'us/step':>10}{'x argmax':>10}")
        neighbours = EmbeddingNeighbours(np.random.default_rng(1).standard_normal((vocab, 64)).astype(np.float32))
        for name in available_policies():
            # CusText's first call builds its clusters (excluded: best_time warms up); a step then costs one fusion,
            # one argmax and a 20-row similarity (64-d rows here, 640 in Gemma-3)
            policy = make_policy(name, neighbours=neighbours) if name == "custext" else make_policy(name)
            for mode in sorted(policy.modes):
                seconds = best_time(lambda: policy.decide(mode, p_slm, p_llm, alpha=DecodeSettings.alpha, rng=rng),  # noqa: B023
                                    args.repeats)
                ratio = seconds / floor
                print(f"  {name:<16}{mode:<7}{seconds * 1e6:>10.1f}{ratio:>10.1f}")
                slowest = max(slowest, ratio)
                if name == "coveil" and vocab == 262_144:
                    headline["coveil_upload_vs_argmax" if mode == "cloud" else "coveil_select_vs_argmax"] = ratio
    print()
    for key in ("coveil_upload_vs_argmax", "coveil_select_vs_argmax"):
        print(f"{key}={headline[key]:.2f}")
    print(f"slowest_policy_vs_argmax={slowest:.2f}")


if __name__ == "__main__":
    main()
