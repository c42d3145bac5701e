"""``decodeleak build-benchmark``: a private-evidence benchmark from your own QA data, proposed by an LLM judge."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from edge_sdk.cli_flags import positive_float, positive_int

DESCRIPTION = """\
Split each source item into a public query with its options (what the cloud may see) and a private context
(what stays on the edge), then have an LLM judge behind an OpenAI-compatible endpoint screen each item (keep it
only if its answer needs the private context) and extract minimal private-evidence spans from the kept ones.
Every reply is validated: a span must occur verbatim in the private context and not in the public query, or it
is dropped and the reason counted. Each stage is checkpointed to DIR item by item and every judge call is cached
on disk, so a re-run (after a crash, Ctrl-C or a larger --limit) asks only for what is missing.

The judge reads every private context in full: use an endpoint you may show those records to (e.g. a server on
your own machine) when they are real people's data.

Next: decodeleak review DIR (accept, edit or reject what the judge proposed), then decodeleak finalize DIR."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from eval_harness.construction.judge import JSON_MODES, ReplyBounds

    parser = commands.add_parser("build-benchmark", help="split, screen and extract private evidence from QA data",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="*", type=Path, metavar="SOURCE.jsonl",
                        help="source files, one JSON record a line (several: e.g. MedQA's train and test files; "
                             "each item's _split is its file's name)")
    parser.add_argument("--format", choices=["medqa", "cosmosqa", "generic"],
                        help="(required) medqa: the question's last sentence is public, the vignette before it private; "
                             "cosmosqa: the question is public, the passage (context) private; generic: --fields")
    parser.add_argument("--fields", metavar="ROLE=NAME,...",
                        help="generic: the record's fields, e.g. public=question,private=notes,options=choices,"
                             "answer=label[,id=uid]; options an object of letter -> text or a list; the answer an "
                             "option key, a 0-based index or an option's exact text")
    parser.add_argument("--out", type=Path, metavar="DIR", help="the build directory (required)")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a JSON file of option defaults; flags given on the command line win")
    judge = parser.add_argument_group("the judge (any OpenAI-compatible endpoint)")
    judge.add_argument("--endpoint", metavar="URL", help="(required) e.g. https://api.openai.com/v1 or "
                                                          "http://127.0.0.1:8080/v1")
    judge.add_argument("--model", metavar="NAME", help="(required) the model the endpoint serves")
    judge.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="VAR",
                       help="the environment variable holding the key (default: OPENAI_API_KEY; a local server "
                            "needs none)")
    judge.add_argument("--json-mode", choices=JSON_MODES, default="schema",
                       help="how replies are constrained: schema (OpenAI structured outputs: OpenAI, vLLM, "
                            "llama-server; default), object-schema (llama-cpp-python's server: a grammar from the "
                            "schema), object (JSON mode), none (the prompt alone); every reply is validated anyway")
    judge.add_argument("--domain", metavar="clinical|narrative|TEXT",
                       help="picks the built-in screening prompt (clinical: patient-specific clues; narrative: "
                            "events, motives, timelines) and fills the prompts' $domain (default: clinical for "
                            "medqa, narrative for cosmosqa; generic needs it)")
    judge.add_argument("--screen-prompt", type=Path, metavar="FILE",
                       help="a screening prompt file of your own ([system] and [user] sections, $placeholders; see "
                            "eval_harness/construction/prompts/)")
    judge.add_argument("--extract-prompt", type=Path, metavar="FILE",
                       help="an extraction prompt file of your own (default: the shared built-in one)")
    judge.add_argument("--max-tokens", type=positive_int, default=512, metavar="N",
                       help="the most tokens one reply may take (default: 512)")
    judge.add_argument("--no-system-role", action="store_true",
                       help="send each prompt as one user message opening with the system text (for chat templates "
                            "without a system role; llama-cpp-python's gemma format drops system messages)")
    bounds = parser.add_argument_group(
        "reply bounds (--json-mode object-schema)", "added to the schema the server's grammar is made from, so a "
        "small model's reply stays short and within --max-tokens")
    bounds.add_argument("--max-spans", type=positive_int, default=ReplyBounds.spans, metavar="N",
                        help=f"spans per reply (default: {ReplyBounds.spans})")
    bounds.add_argument("--max-span-chars", type=positive_int, default=ReplyBounds.span_chars, metavar="N",
                        help=f"characters per span (default: {ReplyBounds.span_chars})")
    bounds.add_argument("--max-text-chars", type=positive_int, default=ReplyBounds.text_chars, metavar="N",
                        help=f"characters of the reasons and the clue (default: {ReplyBounds.text_chars})")
    judge.add_argument("--parallel", type=positive_int, default=4, metavar="N",
                       help="requests in flight at once (default: 4); a rate-limited endpoint is retried with "
                            "backoff, honouring Retry-After")
    judge.add_argument("--requests-per-minute", type=positive_float, metavar="N",
                       help="the most requests started in any minute, retries included (default: no limit): keep "
                            "under a hosted endpoint's rate limit rather than be refused by it")
    judge.add_argument("--max-retries", type=int, default=4, metavar="N",
                       help="retries of a failed call (connection, time-out, 429, 5xx; default: 4)")
    judge.add_argument("--timeout", type=positive_float, default=120.0, metavar="SECONDS", help="one call's time limit")
    judge.add_argument("--reasoning-model", action="store_true",
                       help="the judge is an OpenAI reasoning model (o1, o3, o4-mini, GPT-5 ...): send "
                            "max_completion_tokens (reasoning tokens count against --max-tokens: give it room, e.g. "
                            "4096) and no temperature, which they refuse")
    judge.add_argument("--allow-insecure-http", action="store_true",
                       help="allow an http:// --endpoint on another host (the key and every private context would "
                            "cross the network unencrypted); http:// to this machine needs no flag")
    judge.add_argument("--cache", type=Path, metavar="DIR",
                       help="where judge calls are cached, 0600 files in 0700 folders, each kept 30 days, 1 GiB in "
                            "all (default: $COVEIL_CACHE_DIR/llm-calls)")
    judge.add_argument("--no-cache", action="store_true",
                       help="cache no judge call on disk (a re-run then asks again for items not in DIR)")
    parser.add_argument("--limit", type=positive_int, metavar="N", help="the first N items (a trial run)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return parser


def run(args: argparse.Namespace) -> int:
    """Split, screen, extract; print the counts."""
    from eval_harness.construction.judge import Judge, ReplyBounds
    from eval_harness.construction.pipeline import build, sha256_file
    from eval_harness.construction.prompts import EXTRACTION_PROMPT, SCREENING_PROMPTS, load_prompt, screening_prompt
    from eval_harness.construction.sources import SOURCE_FORMATS, Fields, read_sources
    from eval_harness.llm.client import ChatClient

    missing = [flag for flag, value in (("SOURCE.jsonl", args.sources), ("--format", args.format),
                                        ("--out", args.out), ("--endpoint", args.endpoint), ("--model", args.model))
               if not value]
    if missing:
        raise ValueError(f"needs {', '.join(missing)} (on the command line or in --config)")
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be 0 or more, got {args.max_retries}")
    args.sources = [Path(source) for source in args.sources]  # a --config file gives strings
    if args.fields is not None and args.format != "generic":
        raise ValueError("--fields is for --format generic")
    if args.format == "generic" and args.fields is None:
        raise ValueError("--format generic needs --fields public=...,private=...,options=...,answer=...")
    domain = args.domain or SOURCE_FORMATS.get(args.format).domain
    if not domain:
        raise ValueError("--format generic needs --domain: clinical, narrative, or a word for your own prompts "
                         "(with --screen-prompt FILE)")
    if args.screen_prompt is None and domain not in SCREENING_PROMPTS:
        raise ValueError(f"no built-in screening prompt for the domain {domain!r}: give --screen-prompt FILE, or "
                         f"--domain {' or '.join(SCREENING_PROMPTS)}")
    screen = screening_prompt(str(args.screen_prompt) if args.screen_prompt is not None else domain)
    extract = load_prompt(args.extract_prompt or EXTRACTION_PROMPT)
    fields = Fields.parse(args.fields) if args.fields is not None else None
    for source in args.sources:
        if not source.is_file():
            raise ValueError(f"no source file {source}")
    reading = read_sources(args.sources, args.format, fields=fields, limit=args.limit)
    if not reading.items:
        raise ValueError(f"no item could be split from {', '.join(map(str, args.sources))}")
    if args.no_cache and args.cache is not None:
        raise ValueError("--no-cache and --cache DIR contradict each other: give one")
    client = ChatClient(args.endpoint, args.model, api_key_env=args.api_key_env,
                        cache_dir=None if args.no_cache else args.cache if args.cache is not None else "default",
                        max_retries=args.max_retries, timeout_s=args.timeout,
                        requests_per_minute=args.requests_per_minute, allow_insecure_http=args.allow_insecure_http)
    bounds = ReplyBounds(args.max_spans, args.max_span_chars, args.max_text_chars)
    judge = Judge(client, screen_prompt=screen, extract_prompt=extract, domain=domain, json_mode=args.json_mode,
                  max_tokens=args.max_tokens, bounds=bounds, system_role=not args.no_system_role,
                  reasoning_model=args.reasoning_model)
    manifest = {
        "format": args.format, "fields": args.fields,
        "sources": [{"path": str(s.resolve()), "sha256": sha256_file(s)} for s in args.sources],
        "domain": domain, "model": args.model, "endpoint": args.endpoint, "json_mode": args.json_mode,
        "max_tokens": args.max_tokens, "system_role": not args.no_system_role,
        "reasoning_model": True if args.reasoning_model else None,  # None: as builds made before the flag
        "bounds": dataclasses.asdict(bounds) if args.json_mode == "object-schema" else None,
        "screen_prompt": {"name": screen.name, "sha256": screen.sha256},
        "extract_prompt": {"name": extract.name, "sha256": extract.sha256},
    }
    from eval_harness.cli.shared import progress_bar

    with progress_bar() as bars:
        tasks: dict[str, object] = {}

        def progress(stage: str, total: int):  # noqa: ANN202
            tasks[stage] = bars.add_task(stage, total=total)
            return lambda counts: bars.update(tasks[stage], completed=counts.total, description=_escape(
                counts.describe()))

        summary = build(args.out, reading.items, reading.skipped, judge, manifest=manifest, parallel=args.parallel,
                        progress=progress)
    print("\n".join(summary.lines()))
    print(f"{client.calls} calls to {args.model}; the rest from the cache. Next: decodeleak review {args.out}",
          file=sys.stderr)
    return 0


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
