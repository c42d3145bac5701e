"""The epsilon a generation spends under each DP baseline at the paper's grid points (edge_sdk.privacy.accountant).

Every step of a DP baseline's generation releases once (an upload, a drawn token), so a generation of
``T`` steps spends the accountant's epsilon after ``T`` releases, at the policy's own delta, for any two
private contexts; the heuristics (CoVeil, CoGenesis, CusText, undefended, cloud-side DP-Fusion) are
non-private from their first steered step.  Arithmetic only: no model is loaded.

Usage: python benchmarks/epsilon_ledger.py [--max-new-tokens T] [--grids PATH]
Prints one ``epsilon_<T>.<mode>.<policy>.epsilon=<grid value>=<spent>`` line per DP grid point (``inf`` for a
non-private mode; after ``#`` its delta, accountant and, where the source states one, the figure for its weaker
relation, a context against none), and last ``largest_finite_epsilon_<T>=...``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from edge_sdk.privacy.accountant import PrivacyAccountant
from edge_sdk.policies import make_policy

GRIDS = Path(__file__).resolve().parents[1] / "eval_harness" / "configs" / "paper_grids.json"
#: the baselines whose epsilon is a DP budget in at least one mode
DP_BASELINES = ("dp_logit", "dp_fusion", "ldp_sampler", "invisible_ink")


def generation_epsilon(policy_name: str, mode: str, epsilon: float, tokens: int) -> tuple[float, str]:
    """``(epsilon spent, what it is)`` of a ``tokens``-step generation, every step releasing."""
    policy = make_policy(policy_name, epsilon=epsilon).for_generation(tokens)
    accountant = PrivacyAccountant(policy.release_event(mode))
    for step in range(tokens):
        accountant.record(step, steered=True)
    summary = accountant.summary()
    spent = math.inf if summary["epsilon_spent"] is None else summary["epsilon_spent"]
    source = summary["source_relation"]
    weaker = "" if source is None else f"; a context against none (the source's relation): {source['epsilon_spent']:.4g}"
    return spent, f"delta {summary['delta']:g}, {summary['accountant']}{weaker}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=24, help="generation length T (default: 24, the demo's)")
    parser.add_argument("--grids", type=Path, default=GRIDS, help="the grid JSON (default: the paper's)")
    args = parser.parse_args()
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    grids = json.loads(args.grids.read_text())
    largest = 0.0
    for mode in ("cloud", "edge"):
        for name in DP_BASELINES:
            for epsilon in grids.get(mode, {}).get(name, {}).get("epsilon", []):
                spent, what = generation_epsilon(name, mode, epsilon, args.max_new_tokens)
                if math.isfinite(spent):
                    largest = max(largest, spent)
                print(f"epsilon_{args.max_new_tokens}.{mode}.{name}.epsilon={epsilon:g}={spent:.6g}  # {what}")
    print(f"largest_finite_epsilon_{args.max_new_tokens}={largest:.6g}")


if __name__ == "__main__":
    main()
