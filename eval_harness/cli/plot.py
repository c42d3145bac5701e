"""``decodeleak plot``: privacy-utility, leakage-vs-K and mechanism figures from result files; reads rows only."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval_harness.cli.shared import add_source_options


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plot`` on the ``decodeleak`` subcommand table."""
    plot = commands.add_parser("plot", help="privacy-utility, leakage-vs-K and mechanism figures from result files",
                               description="Per fusion mode, PNG and PDF, undefended marked in each: "
                                           "privacy_utility (accuracy against each leakage metric at K = 100, every "
                                           "method as a curve over its swept parameter); leakage_vs_k (each metric "
                                           "against K = 1..1000, one curve per setting of --policy); "
                                           "leakage_vs_k_methods (each method at its setting nearest a matched "
                                           "Token-ER@100); mechanism_cloud (zero-upload ratio and top-1 agreement "
                                           "with full fusion against lambda); mechanism_edge (mean selected-token "
                                           "rank under p_fuse and accuracy against lambda); rank_bins_edge (rank "
                                           "bins of --policy and --against at matched Token-ER@100); inversion_tradeoff (accuracy "
                                           "against the inversion's ROUGE-1 recall, per task, where rows carry "
                                           "the attack).  A figure "
                                           "whose rows are missing is skipped.")
    plot.add_argument("results", nargs="+", type=Path,
                      help="JSONL result files of one run, read once in constant memory (shards are merged; files of "
                           "different runs, or a key two files hold with different rows, are refused)")
    plot.add_argument("--out", type=Path, default=Path("runs/decodeleak/plots"),
                      help="where the figures go, with sources.json (the sha256 of every file read; each figure's "
                           "metadata names them too)")
    add_source_options(plot)
    plot.add_argument("--rules", choices=["paper", "release"], default="paper", help="which metric rules to plot")
    plot.add_argument("--policy", default="coveil",
                      help="the method drawn per setting in leakage_vs_k and the mechanism figures (default: coveil)")
    plot.add_argument("--against", default="invisible_ink",
                      help="the method rank_bins_edge compares --policy with (default: invisible_ink)")
    plot.add_argument("--match-token-er", type=float, metavar="PERCENT",
                      help="leakage_vs_k_methods: draw each method at its setting nearest this Token-ER@100 "
                           "(default: the low median over --policy's settings, a leakage one of them has)")
    plot.add_argument("--epsilon-axis", action="store_true",
                      help="also privacy_utility_epsilon: each leakage metric (at K = 100) and, in its own panel, "
                           "accuracy against the epsilon each DP baseline's generations spent (rows' privacy "
                           "ledger; the heuristics have none)")
    plot.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return plot


def run(args: argparse.Namespace) -> int:
    """``decodeleak plot``: reads rows only."""
    from eval_harness.report import plots
    from eval_harness.report.runs import read_run

    run_rows = read_run(args.results, allow_code_change=args.allow_code_change)
    rows = run_rows.rows
    suffix = "" if args.rules == "paper" else ":release"
    target = None if args.match_token_er is None else args.match_token_er / 100
    with plots.figures_record(run_rows.provenance()):
        paths = plots.privacy_utility(rows, args.out, suffix=suffix)
        if args.epsilon_axis:
            paths += plots.privacy_utility_epsilon(rows, args.out, suffix=suffix)
        paths += plots.leakage_vs_k(rows, args.out, policy=args.policy, suffix=suffix)
        paths += plots.leakage_vs_k_methods(rows, args.out, target=target, reference=args.policy, suffix=suffix)
        paths += plots.mechanism_cloud(rows, args.out, policy=args.policy)
        paths += plots.mechanism_edge(rows, args.out, policy=args.policy)
        paths += plots.rank_bins(rows, args.out, policy=args.policy, against=args.against, suffix=suffix)
        paths += plots.inversion_tradeoff(rows, args.out)
    if paths:
        (args.out / "sources.json").write_text(json.dumps(
            {"derived": [p.name for p in paths], **run_rows.provenance()}, indent=1) + "\n")
    print("\n".join(str(p) for p in paths) or "no rows: nothing to plot")
    return 0
