"""``decodeleak compare-quant``: the edge SLM quantised (llama.cpp) against its full-precision reference (transformers).

What a user validating an on-device build runs.  Quantised variants are derived from the edge GGUF with
llama.cpp's own quantiser and cached (:mod:`eval_harness.compare.quantize`).  The embedded model ships as
Q4_K_M, so **every other variant is requantised from the Q4_K_M file**, and the transformers reference is
**that same file dequantised**: the Q4_K_M line measures llama.cpp's arithmetic, the others that plus their
own rounding of Q4_K_M's weights (none can be closer to the original model than Q4_K_M).

Three passes (:mod:`eval_harness.compare.quant_audit`): the reference in the collaborative loop; every variant
teacher-forced along the reference's CoVeil generations (per step: KL(p_ref || p_quant), top-1 agreement,
top-10/100 overlap, CoVeil's decision given the same cloud row); every variant in the collaborative loop
(cloud LLM in transformers, the same for all), with the change in accuracy and each DecodeLeak metric.
Writes ``table.md``, ``summary.json``, ``drift_vs_bits.png/.pdf`` and the rows (resumable JSONL) to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from edge_sdk.cli_flags import add_dataclass_flags, add_dtype_flag
from edge_sdk.decode_settings import DecodeSettings
from eval_harness.cli.shared import csv_list, progress_bar
from eval_harness.compare.quant_audit import POLICIES

DEFAULT_VARIANTS = "Q8_0,Q4_K_M,Q3_K,Q2_K"


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``compare-quant`` on the ``decodeleak`` subcommand table."""
    parser = commands.add_parser(
        "compare-quant", help="quantised edge SLM (llama.cpp) vs its full-precision reference (transformers)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a JSON file of option defaults; flags given on the command line win")
    parser.add_argument("--variants", type=csv_list, default=csv_list(DEFAULT_VARIANTS),
                        help=f"llama.cpp quantisation types to derive from --slm (default: {DEFAULT_VARIANTS}; "
                             "Q3_K means Q3_K_M, as llama-quantize reads it)")
    parser.add_argument("--tasks", type=csv_list, default=["medpriv"],
                        help="benchmarks or JSONL files (default: medpriv)")
    parser.add_argument("--limit", type=int, default=20, help="the first N items of each task (default: 20)")
    parser.add_argument("--modes", type=csv_list, default=["cloud", "edge"], help="fusion modes (default: cloud,edge)")
    parser.add_argument("--policies", type=csv_list, default=list(POLICIES),
                        help="end-to-end policies, among undefended,coveil (default: both; coveil is required: its "
                             "reference runs are the prefixes the step-by-step comparison follows)")
    parser.add_argument("--lam", type=float, default=1.0, help="CoVeil's privacy weight λ (default: 1)")
    parser.add_argument("--space", choices=["prob", "logit"], default="prob",
                        help="fusion space of both policies (default: prob, the paper's)")
    add_dataclass_flags(parser, DecodeSettings, names=["alpha", "max_new_tokens"], helps={
        "max_new_tokens": "tokens per answer (default: the protocol's {default}; lower it on a small machine)"})
    parser.add_argument("--slm", default="embedded",
                        help="the edge model: 'embedded' or a GGUF file (the variants are derived from it)")
    parser.add_argument("--llm", default="embedded", help="the cloud model, in transformers (same family)")
    add_dtype_flag(parser, default="fp32", auto=False,
                   help="the transformers models' dtype (default: fp32, a full-precision reference)")
    parser.add_argument("--concurrency", type=int, default=8, help="items decoded at once (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-item generators (row format)")
    parser.add_argument("--cache-dir", type=Path,
                        help="where derived GGUFs are kept (default: $COVEIL_CACHE_DIR/quantized, else "
                             "~/.cache/coveil/quantized)")
    parser.add_argument("--out", type=Path, default=Path("runs/decodeleak/compare-quant"),
                        help="output directory (rows are appended to and resumed from its JSONL files)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the three passes with a progress bar, then write the table, the summary and the figure."""
    from edge_sdk.models import resolve_model
    from eval_harness.compare.quant_audit import QuantAudit, QuantComparison
    from eval_harness.compare.quantize import cached_info, derive_variant
    from eval_harness.datasets import load_task
    from eval_harness.decoding_protocol import DecodingProtocol
    from eval_harness.report.quant import drift_figure, markdown, summarise, write_summary
    from eval_harness.provenance import file_digest
    from eval_harness.sweep.execute import ReferenceSpec

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.variants:
        raise ValueError("--variants names no quantisation type")
    audit = QuantAudit(modes=tuple(args.modes), policies=tuple(args.policies), lam=args.lam, space=args.space,
                       alpha=args.alpha)
    source = resolve_model(args.slm)
    if source.gguf_path is None:
        raise ValueError(f"--slm must be a GGUF file (llama.cpp runs it, the variants are derived from it): {args.slm}")
    source_sha = str(file_digest(source.gguf_path))
    source_type = cached_info(source.gguf_path, source_sha, args.cache_dir).file_type
    variants = []
    for name in dict.fromkeys(args.variants):  # derived once per source file and type, then read from the cache
        variants.append(derive_variant(source.gguf_path, name, cache_dir=args.cache_dir, source_sha256=source_sha))
        print(f"{variants[-1].describe()}: {variants[-1].path}", flush=True)
    protocol = DecodingProtocol(max_new_tokens=args.max_new_tokens, alpha=args.alpha)
    items = {task: load_task(task, args.limit) for task in args.tasks}
    # the reference pass: both models in transformers, on this machine's CPU (or where --dtype puts them)
    spec = ReferenceSpec(slm=args.slm, llm=args.llm, dtype=args.dtype, concurrency=args.concurrency)
    runner, vocab, run = spec.build(protocol, seed=args.seed)
    metadata = run.row()
    args.out.mkdir(parents=True, exist_ok=True)
    with runner:
        comparison = QuantComparison(runner, vocab, metadata, protocol, items, audit, variants, args.out,
                                     seed=args.seed)
        with progress_bar() as progress:
            bar = progress.add_task("compare-quant: reference, end to end", total=comparison.total)

            def advance() -> None:
                progress.advance(bar)

            skipped = comparison.run_reference(advance)
            progress.update(bar, description="compare-quant: step by step along the reference's CoVeil runs")
            skipped += comparison.run_steps(advance)
            skipped += comparison.run_variants(advance, on_variant=lambda v: progress.update(
                bar, description=f"compare-quant: {v.name}, end to end"))
            progress.advance(bar, skipped)
    steps, reference_rows, variant_rows = comparison.rows()
    summary = summarise([v.to_json() for v in variants], steps, reference_rows, variant_rows)
    title = f"Quantised {source.name} (llama.cpp) vs its reference (transformers, {metadata['dtype']})"
    preamble = (
        f"Variants derived with llama.cpp's quantiser from the {source_type} file {source.gguf_path.name} "
        f"(sha256 {source_sha[:12]}): every other type is requantised from {source_type}, and the reference is "
        f"that {source_type} file dequantised, so no variant is closer to the original weights than {source_type}. "
        f"Per-step comparisons follow the reference's CoVeil (λ={args.lam}) generation in each mode; end-to-end "
        f"runs decode {sum(len(v) for v in items.values())} items per setting with the cloud LLM in transformers, "
        f"the same for every SLM. Protocol: {protocol.name}, max_new_tokens={protocol.max_new_tokens}, "
        f"α={args.alpha}, {args.space} space."
    )
    table = markdown(summary, title=title, preamble=preamble)
    (args.out / "table.md").write_text(table + "\n", encoding="utf-8")
    write_summary({**summary, "source": {"path": str(source.gguf_path), "sha256": source_sha, "file_type": source_type},
                   "metadata": metadata}, args.out / "summary.json")
    figures = drift_figure(summary, args.out, title=(
        f"{source.name} in llama.cpp vs its reference in transformers ({metadata['dtype']})\n"
        f"variants requantised from the {source_type} file; the reference is that file dequantised"))
    print(table)
    print("\n".join(str(p) for p in [args.out / "table.md", args.out / "summary.json", *figures]))
    return 0
