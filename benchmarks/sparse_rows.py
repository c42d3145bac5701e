"""What deciding from the cloud's top values at a public fill costs against an honest cloud, and what pacing costs.

The edge used to ask for the cloud's full row exactly when the sparse row could not certify its policy's
decision: a request that depended on ``p_slm``, which a lying cloud could aim (issue 19, N1).  Now a policy
that reads the full row asks for it at every step (``Policy.needs_full_row``), and every other one decides
from the top ``top_m`` values with each omitted id at the public fill (``CloudDistribution.public_fill``).

One run decodes a few MedPriv items on the embedded pair in this process (llama.cpp SLM, transformers cloud,
greedy, ``top_m`` = vocabulary size so that every step holds the full row).  At each step, for the
policy being run:

  exact   = the policy's decision on the full row (the generation follows it);
  filled  = its decision on the top-256 row at the public fill (same generator state, so a randomised
            policy draws alike when its inputs agree);
  before  = whether the old rule asked for the full row (``decide_sparse`` found no certificate).

(a) decision_changes = steps where ``filled`` differs from ``exact``, over every policy that decides from
    the sparse row (an upload differs if any id or value does), and their share of those steps;
(b) bytes per token, both directions, before and after:
      before = top-256 row + (request + full row if the old rule asked) + signal;
      after  = top-256 row + (request + full row if the policy reads full rows) + signal,
    where a full-vocabulary upload is cut to its 1,000 largest values after (N18).  The table also gives
    "always full" (every policy asking for the full row at every step), the other way to make the request
    public;
(c) pacing (N17): edge-side CoVeil (lam = 1) unpaced, then paced at 1.25 x the 95th percentile of the unpaced
    wall time between tokens; pace_cost = paced / unpaced median time between tokens (steps >= 1, step 0
    carries the prefills); pace_overruns = paced steps that missed their first slot.  In this process the
    cloud's forward runs in the edge's thread, so a step is SLM + cloud, not their maximum.

Usage: python benchmarks/sparse_rows.py [--items 3] [--tokens 16]
The last lines are decision_changes, decision_change_share, bytes_per_token_before, bytes_per_token_after,
pace_ms, pace_cost and pace_overruns.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOP_M = 256
PACE_FACTOR = 1.25


def same_decision(a: Any, b: Any) -> bool:
    """Whether two signals are the same bytes: a token, or an upload's ids and values."""
    from edge_sdk.protocol.signals import CloudUpload

    if isinstance(a, CloudUpload) and isinstance(b, CloudUpload):
        return np.array_equal(a.ids, b.ids) and np.array_equal(a.values, b.values)
    return a == b


@dataclass
class Tally:
    """One policy in one mode, over every step of every item."""

    steps: int = 0
    changes: int = 0
    asked_before: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    bytes_always_full: int = 0


@dataclass
class ComparingPolicy:
    """Delegates to ``inner``; at each step also decides from the step's top-256 row at the public fill and
    from the old certificate, and tallies what each would have cost.  The generation follows the exact
    decision."""

    inner: Any
    tally: Tally
    vocab_size: int
    steps: list[int] = field(default_factory=lambda: [0])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decide(self, mode: str, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float,
               rng: np.random.Generator | None = None) -> Any:
        from edge_sdk.protocol import wire
        from edge_sdk.fusion import softmax
        from edge_sdk.privacy.masking import FULL_UPLOAD_LIMIT
        from edge_sdk.protocol.signals import CloudUpload

        space, step = self.inner.space, self.steps[0]
        self.steps[0] += 1
        probabilities = softmax(p_llm) if space == "logit" else None
        sparse = wire.CloudDistribution.sparse_from(step, p_llm, TOP_M, probabilities=probabilities)
        sparse_bytes = wire.encode_distribution(sparse).ByteSize()
        full_bytes = wire.encode_distribution(wire.CloudDistribution(step, dense=p_llm)).ByteSize()
        request_bytes = wire.encode_request_full(step).ByteSize()
        reads_full = self.inner.needs_full_row(mode)
        filled = None
        if not reads_full:
            filled = self.inner.decide(mode, p_slm, sparse.filled(self.vocab_size, space), alpha=alpha,
                                       rng=copy.deepcopy(rng))
            lowest = np.float32(np.finfo(np.float32).min if space == "logit" else 0.0)
            lower = sparse.lower_dense(self.vocab_size, fill=lowest)
            certified = self.inner.decide_sparse(mode, p_slm, lower, sparse.ids, sparse.tail_bound, alpha=alpha,
                                                 rng=copy.deepcopy(rng))
        exact = self.inner.decide(mode, p_slm, p_llm, alpha=alpha, rng=rng)
        asked_before = reads_full or certified is None
        if isinstance(exact, CloudUpload):
            signal_before = wire.encode_upload(step, exact).ByteSize()
            cut = exact.largest(FULL_UPLOAD_LIMIT) if len(exact) >= self.vocab_size else exact
            signal_after = wire.encode_upload(step, cut).ByteSize()
        else:
            signal_before = signal_after = wire.encode_token(step, exact.token_id).ByteSize()
        tally = self.tally
        tally.steps += 1
        tally.changes += filled is not None and not same_decision(filled, exact)
        tally.asked_before += asked_before
        tally.bytes_before += sparse_bytes + asked_before * (request_bytes + full_bytes) + signal_before
        tally.bytes_after += sparse_bytes + reads_full * (request_bytes + full_bytes) + signal_after
        tally.bytes_always_full += sparse_bytes + request_bytes + full_bytes + signal_after
        return exact


def policies(slm: Any) -> dict[str, list[tuple[str, Any]]]:
    from edge_sdk.policies import make_policy

    coveil = [(f"coveil lam={lam:g}", make_policy("coveil", lam=lam)) for lam in (0.0, 1.0, 4.0)]
    return {
        "cloud": [*coveil, ("undefended", make_policy("undefended")), ("dp_logit", make_policy("dp_logit")),
                  ("dp_fusion", make_policy("dp_fusion"))],
        "edge": [*coveil, ("undefended", make_policy("undefended")), ("custext", make_policy("custext", backend=slm)),
                 ("dp_fusion", make_policy("dp_fusion")), ("ldp_sampler", make_policy("ldp_sampler")),
                 ("invisible_ink", make_policy("invisible_ink"))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3, help="MedPriv items (default 3)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per generation (default 16)")
    args = parser.parse_args()
    if args.items < 1 or args.tokens < 2:
        parser.error("--items must be at least 1 and --tokens at least 2")

    from tqdm import tqdm

    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.llm import TransformersLLM
    from edge_sdk.backends.llama_cpp import LlamaCppSLM
    from edge_sdk.client import EdgeClient
    from edge_sdk.policies import make_policy
    from eval_harness.datasets import load_task

    items = load_task("medpriv", args.items)
    slm = LlamaCppSLM(n_threads=1)
    engine = CloudEngine(TransformersLLM(dtype="auto"))
    client = EdgeClient(lambda: engine.session("bench"), slm=slm)
    table = policies(slm)
    tallies = {(mode, label): Tally() for mode, runs in table.items() for label, _ in runs}
    runs = [(item, mode, label, policy) for item in items for mode, pairs in table.items() for label, policy in pairs]
    for item, mode, label, policy in tqdm(runs, desc="generations", unit="gen"):
        comparing = ComparingPolicy(policy, tallies[(mode, label)], slm.vocab_size)
        client.generate(item.public_prompt, item.private_context, mode=mode, policy=comparing,
                        max_new_tokens=args.tokens, top_m=slm.vocab_size, rng=np.random.default_rng(7))

    # (c) pacing: edge-side CoVeil, unpaced then paced on a schedule set from the unpaced steps
    coveil = make_policy("coveil", lam=1.0)

    def step_ms(pace_ms: float | None) -> tuple[list[float], int]:
        """Wall time between consecutive tokens (steps >= 1: step 0 carries the prefills), and overruns."""
        intervals, overruns = [], 0
        for item in items:
            stream = client.stream(item.public_prompt, item.private_context, mode="edge", policy=coveil,
                                   max_new_tokens=args.tokens, pace_ms=pace_ms)
            times = [time.perf_counter() for _ in stream.steps()]
            intervals += [1e3 * (b - a) for a, b in itertools.pairwise(times)]
            overruns += sum(entry.pace_overrun for entry in stream.ledger.entries)
        return intervals, overruns

    step_ms(None)  # warm-up
    unpaced, _ = step_ms(None)
    pace_ms = PACE_FACTOR * float(np.percentile(unpaced, 95))
    paced, overruns = step_ms(pace_ms)

    print(f"\n{len(items)} MedPriv items x {args.tokens} new tokens, greedy, top_m {TOP_M} vs the full row "
          f"({slm.vocab_size} ids)")
    print(f"\n{'mode':<6}{'policy':<18}{'steps':>6}{'changed':>8}{'asked before':>13}{'B/token before':>16}"
          f"{'B/token after':>15}{'always full':>13}")
    sparse_steps = changes = 0
    before = after = steps = 0
    for (mode, label), tally in tallies.items():
        reads_full = dict(table[mode])[label].needs_full_row(mode)
        print(f"{mode:<6}{label:<18}{tally.steps:>6}{'-' if reads_full else tally.changes:>8}{tally.asked_before:>13}"
              f"{tally.bytes_before / tally.steps:>16.0f}{tally.bytes_after / tally.steps:>15.0f}"
              f"{tally.bytes_always_full / tally.steps:>13.0f}")
        if not reads_full:
            sparse_steps += tally.steps
            changes += tally.changes
        before += tally.bytes_before
        after += tally.bytes_after
        steps += tally.steps
    print("('-': the policy reads the full row at every step, before and after: nothing to change)")
    print(f"\npacing, edge-side CoVeil lam=1, ms between tokens (steps >= 1): unpaced median "
          f"{statistics.median(unpaced):.1f}, p95 {np.percentile(unpaced, 95):.1f}; paced at {pace_ms:.1f} ms: median "
          f"{statistics.median(paced):.1f}, p95 {np.percentile(paced, 95):.1f}; {overruns} overrun(s) in "
          f"{len(items) * args.tokens} steps")
    print(f"decision_changes={changes}")
    print(f"decision_change_share={changes / max(sparse_steps, 1):.4f}")
    print(f"bytes_per_token_before={before / steps:.0f}")
    print(f"bytes_per_token_after={after / steps:.0f}")
    print(f"pace_ms={pace_ms:.1f}")
    print(f"pace_cost={statistics.median(paced) / statistics.median(unpaced):.3f}")
    print(f"pace_overruns={overruns}")


if __name__ == "__main__":
    main()
