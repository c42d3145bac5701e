"""``decodeleak``: DecodeLeak audits on the reference runner (both models in transformers).

``decodeleak sweep`` runs the paper's grids (or a grid config of yours) over
MedPriv/CommPriv items and appends one JSONL row per (setting, item) as it
finishes; a re-run skips what is there, so a crash or Ctrl-C loses nothing.
``decodeleak run`` is one setting.  ``decodeleak compare-quant`` checks a quantised
edge model against its full-precision reference (:mod:`eval_harness.cli.compare_quant`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edge_sdk.policies import FUSION_MODES
from eval_harness.cli import compare_quant

USAGE_ERROR = 2


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _param(text: str) -> tuple[str, float | int]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a parameter is NAME=VALUE, got {text!r}")
    number = float(value)
    return name, int(number) if number.is_integer() and "." not in value else number


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a JSON file of option defaults ({\"limit\": 20, \"tasks\": \"medpriv,commpriv\"}); "
                             "flags given on the command line win")
    parser.add_argument("--tasks", type=_csv, default=["medpriv"], help="benchmarks or JSONL files (default: medpriv)")
    parser.add_argument("--limit", type=int, help="the first N items of each task")
    parser.add_argument("--out", type=Path, default=Path("runs/decodeleak/results.jsonl"),
                        help="the JSONL results file (appended to; pairs already in it are skipped)")
    parser.add_argument("--shard", default="1/1", help="run only shard i of N (e.g. 2/8), into its own --out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the randomised policies' per-item generators")
    parser.add_argument("--concurrency", type=int, default=8, help="items decoded at once (each model's batch)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (the paper: 256)")
    parser.add_argument("--slm", default="embedded", help="the edge model: 'embedded', a GGUF or a transformers dir")
    parser.add_argument("--llm", default="embedded", help="the cloud model (same family as --slm)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="both models' dtype (auto: bf16 where the hardware has native kernels)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodeleak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sweep = commands.add_parser("sweep", help="a grid of settings over a dataset",
                                description="Run every setting of a grid config (default: the paper's grids).")
    sweep.add_argument("grid", nargs="?", type=Path, metavar="GRID",
                       help="a grid config JSON (default: the paper's grids, eval_harness/configs/paper_grids.json)")
    sweep.add_argument("--modes", type=_csv, default=list(FUSION_MODES), help="fusion modes (default: cloud,edge)")
    sweep.add_argument("--policies", type=_csv, help="only these policies (default: all in the config)")
    _common(sweep)
    run = commands.add_parser("run", help="one setting over a dataset",
                              description="One setting (mode, policy, parameters, alpha) over a dataset.")
    run.add_argument("--mode", choices=FUSION_MODES, required=True, help="fusion mode")
    run.add_argument("--policy", required=True, help="a registered policy name")
    run.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                     help="a policy parameter, e.g. --param lam=1 (repeatable)")
    run.add_argument("--alpha", type=float, default=0.3, help="the cloud LLM's fusion weight (default: 0.3)")
    _common(run)
    report = commands.add_parser("report", help="the paper's tables from result files",
                                 description="Tables per fusion mode and setting (item counts, accuracy, "
                                             "Token/ROUGE1/Span-ER@100 and AUC@100 with 95%% bootstrap intervals), "
                                             "by the paper's rules and by the release's, as Markdown and CSV.")
    report.add_argument("results", nargs="+", type=Path, help="JSONL result files (shards are merged)")
    report.add_argument("--out", type=Path, default=Path("runs/decodeleak/report"),
                        help="where tables.md and tables.csv are written")
    report.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    plot = commands.add_parser("plot", help="privacy-utility figures from result files",
                               description="Accuracy against each leakage metric at K = 100, every method of a "
                                           "fusion mode as a curve over its swept parameter, undefended marked "
                                           "(PNG and PDF per mode).")
    plot.add_argument("results", nargs="+", type=Path, help="JSONL result files (shards are merged)")
    plot.add_argument("--out", type=Path, default=Path("runs/decodeleak/plots"), help="where the figures go")
    plot.add_argument("--rules", choices=["paper", "release"], default="paper", help="which metric rules to plot")
    plot.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    compare_quant.add_parser(commands)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; options in a ``--config`` file become defaults that the command line overrides."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = getattr(args, "config", None)
    if config is None:
        return args
    import json

    try:
        options = json.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"cannot read --config {config}: {exc}")
    if not isinstance(options, dict):
        parser.error(f"--config {config} must hold a JSON object of options")
    subparser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    known = {action.dest: action for action in subparser._actions}
    defaults = {}
    for name, value in options.items():
        dest = name.replace("-", "_")
        action = known.get(dest)
        if action is None or dest in ("config", "help", "command"):
            parser.error(f"--config {config}: {args.command} has no option {name!r}")
        # through the option's own type, as if it had been typed
        defaults[dest] = action.type(value) if action.type is not None and isinstance(value, str) else value
    subparser.set_defaults(**defaults)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return execute(args)
    except KeyboardInterrupt:
        print(f"decodeleak {args.command}: interrupted; what was written so far is kept in {args.out}",
              file=sys.stderr)
        return 130
    except (ValueError, KeyError, OSError) as exc:
        if args.verbose:
            raise
        print(f"decodeleak {args.command}: {exc}", file=sys.stderr)
        return 1


def write_report(args: argparse.Namespace) -> int:
    """``decodeleak report``: reads rows only (no model library is imported)."""
    from eval_harness.report.tables import csv_text, markdown, table
    from eval_harness.sweep.store import read_rows

    rows = list(read_rows(args.results))
    sections, csv_parts = [], []
    for rules, suffix in (("paper", ""), ("release", ":release")):
        for mode in FUSION_MODES:
            cells = table([r for r in rows if r["mode"] == mode], suffix=suffix)
            if cells:
                sections.append(markdown(cells, f"## {mode}-side fusion, DecodeLeak by the {rules}'s rules "
                                                "(mean [95% bootstrap interval], %)"))
                csv_parts.append(csv_text([{"rules": rules, **c} for c in cells]))
    args.out.mkdir(parents=True, exist_ok=True)
    text = f"# DecodeLeak report: {len(rows)} rows from {len(args.results)} file(s)\n\n" + "\n".join(sections)
    (args.out / "tables.md").write_text(text)
    header, *body = "".join(csv_parts).splitlines(keepends=True) or [""]
    (args.out / "tables.csv").write_text(header + "".join(line for line in body if not line.startswith("rules,")))
    print(text)
    return 0


def write_plots(args: argparse.Namespace) -> int:
    """``decodeleak plot``: reads rows only."""
    from eval_harness.report.plots import privacy_utility
    from eval_harness.sweep.store import read_rows

    paths = privacy_utility(list(read_rows(args.results)), args.out, suffix="" if args.rules == "paper" else ":release")
    print("\n".join(str(p) for p in paths) or "no rows: nothing to plot")
    return 0


def execute(args: argparse.Namespace) -> int:
    if args.command == "report":
        return write_report(args)
    if args.command == "plot":
        return write_plots(args)
    if args.command == "compare-quant":
        return compare_quant.execute(args)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from eval_harness.datasets import load_task
    from eval_harness.protocol import DecodingProtocol
    from eval_harness.sweep.grid import Setting, expand, load_grids, parse_shard
    from eval_harness.sweep.store import ResultStore

    shard_of = parse_shard(args.shard)
    if args.command == "sweep":
        settings = expand(load_grids(args.grid), args.tasks, modes=args.modes, policies=args.policies)
    else:
        settings = [Setting(task, args.mode, args.policy, dict(args.param), args.alpha) for task in args.tasks]
    items = {task: load_task(task, args.limit) for task in args.tasks}
    protocol = DecodingProtocol(max_new_tokens=args.max_new_tokens)
    runner, vocab, metadata = _reference(args, protocol)
    total = sum(len(items[s.task]) for s in settings)
    with runner, ResultStore(args.out) as store, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(),
    ) as progress:
        bar = progress.add_task(f"decodeleak {args.command} (shard {args.shard})", total=total)
        from eval_harness.sweep.execute import run_sweep

        outcome = run_sweep(settings, items, runner, store, protocol=protocol, vocab=vocab, metadata=metadata,
                            seed=args.seed, shard_of=shard_of, on_row=lambda row: progress.advance(bar))
        progress.update(bar, total=outcome.pending, completed=outcome.written)
    print(f"{outcome.written} rows written to {args.out}; {outcome.skipped} already there; "
          f"{len(settings)} settings x {', '.join(f'{len(v)} {k}' for k, v in items.items())} items "
          f"(shard {args.shard})")
    return 0


def _reference(args: argparse.Namespace, protocol):  # noqa: ANN001, ANN202
    """The reference runner, the vocabulary the metrics read, and the metadata every row carries."""
    from cloud_adapter.llm import TransformersLLM
    from edge_sdk.leakage import piece_reader
    from edge_sdk.models import resolve_model
    from eval_harness.metrics import Vocabulary
    from eval_harness.runners.reference import ReferenceRunner
    from eval_harness.sweep.execute import SEED_POLICY, file_digest, package_version

    slm_source, llm_source = resolve_model(args.slm), resolve_model(args.llm)
    slm = TransformersLLM(slm_source, dtype=args.dtype)
    llm = TransformersLLM(llm_source, dtype=args.dtype)
    vocab = Vocabulary(lambda text: slm.tokenize(text, add_bos=False), piece_reader(slm.tokenizer))
    metadata = {
        "models": {
            "slm": {"name": slm.name, "sha256": file_digest(slm_source.gguf_path)},
            "llm": {"name": llm.name, "sha256": file_digest(llm_source.gguf_path)},
        },
        "dtype": str(llm.dtype).removeprefix("torch."),
        "backend": "reference (transformers, both models)",
        "protocol": protocol.describe(),
        "seed": args.seed,
        "seed_policy": SEED_POLICY,
        "version": package_version(),
    }
    return ReferenceRunner(slm, llm, concurrency=args.concurrency), vocab, metadata
