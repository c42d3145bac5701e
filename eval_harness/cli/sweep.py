"""``decodeleak sweep`` and ``decodeleak run``: DecodeLeak audits over a dataset, appended to a JSONL store.

``sweep`` decodes every setting of a grid config (default: the paper's grids), ``run`` one setting; both go
through :func:`run`: the runner ``--runner`` names (reference: both models in transformers here; deployed: the
llama.cpp edge over gRPC against a cloud adapter, audited from its transcripts), the optional inversion attack,
and, for ``sweep --backend ray`` (``--ray``), Ray tasks (:func:`sweep_on_ray`), for ``sweep --backend slurm`` a
SLURM array through submitit (:func:`sweep_on_slurm`).  A re-run skips the rows already written.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

from edge_sdk.cli_flags import add_dataclass_flags, add_dtype_flag, positive_float, positive_int
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.protocol.signals import FUSION_MODES
from eval_harness.cli.shared import csv_list, progress_bar

#: ``--ray`` without an address: start a new local Ray instance (Ray's own name for it)
LOCAL_RAY = "local"


def _ray_address(text: str) -> str:
    """A Ray address: ``auto``, ``ray://HOST:PORT`` or ``HOST:PORT`` (not a file: GRID goes before ``--ray``)."""
    host, sep, port = text.rpartition(":")
    if text in ("auto", LOCAL_RAY) or (sep and host and port.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"a Ray address is auto, ray://HOST:PORT or HOST:PORT, got {text!r} "
                                     "(a grid file goes before --ray)")


def _param(text: str) -> tuple[str, float | int | str]:
    """``NAME=VALUE``: an integer (``lam=1``), a real number (``lam=1.5``) or else the text
    (``mapping=aggressive``); whether the policy has that parameter, of that type, is checked before any
    model loads (:func:`edge_sdk.policies.check_params`)."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"a parameter is NAME=VALUE, got {text!r}")
    try:
        number = float(value)
    except ValueError:
        return name, value
    return name, int(number) if number.is_integer() and "." not in value else number


def _inversion(text: str) -> str:
    if text in ("none", "local") or text.startswith(("http://", "https://")):
        return text
    raise argparse.ArgumentTypeError(f"--inversion takes none, local or an http(s) URL, got {text!r}")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``sweep`` and ``run`` on the ``decodeleak`` subcommand table."""
    sweep = commands.add_parser("sweep", help="a grid of settings over a dataset",
                                description="Run every setting of a grid config (default: the paper's grids).")
    sweep.add_argument("grid", nargs="?", type=Path, metavar="GRID",
                       help="a grid config JSON (default: the paper's grids, eval_harness/configs/paper_grids.json)")
    sweep.add_argument("--modes", type=csv_list, default=list(FUSION_MODES), help="fusion modes (default: cloud,edge)")
    sweep.add_argument("--policies", type=csv_list, help="only these policies (default: all in the config)")
    _common(sweep)
    sweep.add_argument("--backend", choices=("local", "ray", "slurm"),
                       help="where the sweep runs: local (this process, the default), ray (Ray tasks; as --ray) or "
                            "slurm (a SLURM array through submitit); the same grid, options and rows for all three")
    _ray_flags(sweep)
    _slurm_flags(sweep)
    run = commands.add_parser("run", help="one setting over a dataset",
                              description="One setting (mode, policy, parameters, alpha) over a dataset.")
    run.add_argument("--mode", choices=FUSION_MODES, required=True, help="fusion mode")
    run.add_argument("--policy", required=True, help="a registered policy name")
    run.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                     help="a policy parameter, e.g. --param lam=1 (repeatable)")
    add_dataclass_flags(run, DecodeSettings, names=["alpha"])
    _common(run)


def _ray_flags(sweep: argparse.ArgumentParser) -> None:
    """``sweep``'s Ray group: the cluster, the shard count and each task's resources."""
    cluster = sweep.add_argument_group(
        "Ray", "run the sweep as Ray tasks, one per shard; rows come back into the one --out file on this machine")
    cluster.add_argument("--ray", nargs="?", const=LOCAL_RAY, type=_ray_address, metavar="ADDRESS",
                         help="a Ray cluster: ray://HOST:10001 (Ray Client), HOST:6379, or 'auto' (the cluster "
                              "'ray start' made on this node, or $RAY_ADDRESS); --ray alone starts a new local "
                              "instance")
    cluster.add_argument("--ray-shards", type=positive_int, metavar="N",
                         help="tasks to cut the pending pairs into (default: as many as the cluster runs at once "
                              "with the resources below)")
    cluster.add_argument("--ray-cpus-per-task", type=positive_float, default=1.0, metavar="N",
                         help="CPUs each task asks for; torch uses that many threads (default: 1)")
    cluster.add_argument("--ray-gpus-per-task", type=float, default=0.0, metavar="N",
                         help="GPUs each task asks for (default: 0); with --device cuda or --device-map auto")


def _slurm_flags(sweep: argparse.ArgumentParser) -> None:
    """``sweep``'s SLURM group: the array's size, each task's resources, and whether to wait."""
    from eval_harness.sweep.slurm import SlurmOptions

    defaults = SlurmOptions()
    cluster = sweep.add_argument_group(
        "SLURM (--backend slurm)",
        "run the sweep as one SLURM array through submitit, one task per shard, each loading the models once and "
        "writing its own file under OUT.slurm/ (0700); a preempted or timed-out task is requeued and resumes from "
        "its file; the driver waits and merges every shard into --out (a re-run merges first)")
    cluster.add_argument("--slurm-tasks", type=positive_int, default=8, metavar="N",
                         help="array tasks to cut the pending pairs into (default: 8)")
    cluster.add_argument("--slurm-partition", metavar="NAME", help="the partition (default: the cluster's)")
    cluster.add_argument("--slurm-time", type=positive_int, default=defaults.time_min, metavar="MINUTES",
                         help=f"each task's time limit; a task that reaches it is requeued and resumes (default: "
                              f"{defaults.time_min})")
    cluster.add_argument("--slurm-gpus-per-task", type=int, default=defaults.gpus_per_task, metavar="N",
                         help="GPUs per task (default: 0); with --device cuda or --device-map auto")
    cluster.add_argument("--slurm-cpus-per-task", type=positive_int, default=defaults.cpus_per_task, metavar="N",
                         help=f"CPUs per task (default: {defaults.cpus_per_task})")
    cluster.add_argument("--slurm-mem-gb", type=positive_int, metavar="GB", help="memory per task (default: the "
                                                                                  "partition's)")
    cluster.add_argument("--slurm-array-parallelism", type=positive_int, default=defaults.array_parallelism,
                         metavar="N", help=f"tasks of the array running at once (default: "
                                           f"{defaults.array_parallelism})")
    cluster.add_argument("--slurm-cluster", choices=("slurm", "local"),
                         help="slurm, or local: submitit's local executor (the same tasks as processes of this "
                              "machine, e.g. for CI) (default: slurm where sbatch is found, else local)")
    cluster.add_argument("--slurm-no-wait", action="store_true",
                         help="submit and return; a later run of the same command merges the finished shards")


def _inversion_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "inversion attack", "DecodeLeak's second stage: after an item is decoded, an attacker LLM reconstructs its "
        "private context from the public prompt and the exposure sequence (nothing else), scored by ROUGE-1 "
        "recall/F1 into the row's 'inversion' field. A re-run skips rows already written, with or without it.")
    group.add_argument("--inversion", type=_inversion, default="none", metavar="none|local|URL",
                       help="none (default); local: the run's cloud LLM (as the paper), batched; or an "
                            "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080/v1")
    group.add_argument("--inversion-model", metavar="NAME", help="the model name the endpoint serves (with a URL)")
    group.add_argument("--inversion-key-env", default="OPENAI_API_KEY", metavar="VAR",
                       help="the environment variable holding the endpoint's key (default: OPENAI_API_KEY)")
    group.add_argument("--inversion-k", type=positive_int, default=100, metavar="K",
                       help="top-K ids of each step shown to the attacker (default: 100, the paper's)")
    group.add_argument("--inversion-sequence", choices=("full", "compact"), default="full",
                       help="how the exposure sequence is written into the attack's prompt: full (every step's "
                            "top-K, then the distinct tokens, as the paper and the authors' release give it) or "
                            "compact (each step's top token and only tokens no earlier step showed; ~20x shorter) "
                            "(default: full)")
    group.add_argument("--inversion-max-tokens", type=positive_int, default=256, metavar="N",
                       help="the most tokens one reconstruction may take (default: 256)")
    group.add_argument("--inversion-batch", type=positive_int, default=8, metavar="N",
                       help="local: observations per batched generate call; URL: requests in flight (default: 8)")
    group.add_argument("--inversion-timeout", type=positive_float, default=120.0, metavar="SECONDS",
                       help="URL: one request's time limit, retried 4 times on a timeout (default: 120; a slow "
                            "local endpoint on full-sequence prompts of long generations can need more)")
    group.add_argument("--inversion-cache", type=Path, metavar="DIR",
                       help="where endpoint calls are cached, 0600 files in 0700 folders, each kept 30 days, 1 GiB "
                            "in all (default: $COVEIL_CACHE_DIR/llm-calls)")
    group.add_argument("--no-inversion-cache", action="store_true", help="cache no endpoint call on disk")
    group.add_argument("--allow-insecure-http", action="store_true",
                       help="allow an http:// --inversion URL on another host (the key and every exposure sequence "
                            "would cross the network unencrypted); http:// to this machine needs no flag")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a JSON file of option defaults ({\"limit\": 20, \"tasks\": \"medpriv,commpriv\"}); "
                             "flags given on the command line win")
    parser.add_argument("--tasks", type=csv_list, default=["medpriv"],
                        help="benchmarks or JSONL files (default: medpriv)")
    parser.add_argument("--limit", type=positive_int, help="the first N items of each task")
    parser.add_argument("--out", type=Path, default=Path("runs/decodeleak/results.jsonl"),
                        help="the JSONL results file (appended to; pairs already in it are skipped)")
    parser.add_argument("--shard", default="1/1", help="run only shard i of N (e.g. 2/8), into its own --out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the randomised policies' per-item generators")
    parser.add_argument("--concurrency", type=positive_int, default=8,
                        help="items decoded at once (reference: each model's batch; deployed: llama.cpp "
                             "instances, one EdgeClient each)")
    add_dataclass_flags(parser, DecodeSettings, names=["max_new_tokens"])
    parser.add_argument("--slm", default="embedded", help="the edge model: 'embedded', a GGUF or a transformers dir")
    parser.add_argument("--llm", default="embedded", help="the cloud model (same family as --slm)")
    add_dtype_flag(parser, default="fp32", auto=False,
                   help="both models' dtype (default: fp32, a full-precision reference; bf16 or fp16 only when "
                        "asked for, and every row and report says which)")
    batching = parser.add_mutually_exclusive_group()
    batching.add_argument("--padded-batches", action="store_true",
                          help="reference: run each lockstep batch as one padded forward (faster) instead of one "
                               "forward per item; a row then depends on which items shared its batches (rows say "
                               "batching.batch_invariant = false)")
    batching.add_argument("--batch-invariant", action="store_true",
                          help="reference, fp32 on the CPU: run each lockstep batch as one padded forward through "
                               "batch-invariant kernels (fixed-size matmul tiles, attention per item): batched, and "
                               "each row bit for bit what the item gives alone through them (rows say "
                               "batching.forwards = batch-invariant; not bitwise the per-item default's rows)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N for both models (ignored with "
                                                         "--device-map)")
    parser.add_argument("--device-map", metavar="MAP",
                        help="accelerate device map for both models, e.g. 'auto' to spread a large model over every "
                             "visible GPU (layers split across them, one copy)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--observer", action="store_true",
                        help="DecodeLeak's observer attacks: decode each item a second time with the next item's "
                             "private context (same question and setting), record both generations' message sizes "
                             "and times as an on-path observer under TLS and the cloud see them (sessions paced as "
                             "deployed over a network, so slower), and score into the row's 'observer' field "
                             "whether sizes tell the two contexts apart and the timing AUCs (decodeleak report "
                             "shows them beside Token-ER); the timing is a deployment's with --runner deployed only "
                             "(the reference runner steps its items in lockstep batches, whose waits fill the gaps)")
    _deployed_flags(parser)
    _inversion_options(parser)


def _deployed_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", choices=["reference", "deployed"], default="reference",
                        help="reference: both models in transformers, in this process (default); deployed: the edge "
                             "GGUF (--slm) in llama.cpp through the SDK's gRPC client against a cloud adapter, "
                             "audited from the adapter's transcripts")
    group = parser.add_argument_group(
        "deployed runner (--runner deployed)",
        "Without --cloud an adapter over --llm is started on loopback in this process, its transcripts written "
        "to --transcripts (default: OUT's name + '.transcripts/'). With --cloud the audit reads the remote "
        "adapter's transcripts from --transcripts (its --transcript-dir, or a copy synced from it); without "
        "--transcripts it runs anyway, resting on the edge's ledger alone (what left the device, by the same "
        "rule the adapter records), says so once, and every row's audit.exposure_source is 'edge ledger'.")
    group.add_argument("--cloud", metavar="HOST:PORT", help="a running cloud adapter to audit (default: start one)")
    group.add_argument("--token-file", type=Path, metavar="FILE", help="bearer token for --cloud")
    group.add_argument("--tls-ca", type=Path, metavar="PEM",
                       help="CA certificate of a TLS --cloud (default: the system's trust roots)")
    group.add_argument("--plaintext", action="store_true", help="no TLS to --cloud (a loopback address only)")
    group.add_argument("--transcripts", type=Path, metavar="DIR", help="where the adapter's transcripts are")
    group.add_argument("--transcript-wait", type=float, default=30.0, metavar="SECONDS",
                       help="how long to wait for an item's transcript to appear before auditing it from the "
                            "ledger (default: 30)")


def run(args: argparse.Namespace) -> int:
    """``decodeleak sweep`` and ``decodeleak run``: decode the settings over the tasks' items into ``--out``.

    Everything is checked before a model loads (:func:`_check_options`, every setting of the grid, the tasks'
    files, the results file's run); with nothing left to do no model loads at all.
    """
    from eval_harness.datasets import load_task
    from eval_harness.decoding_protocol import DecodingProtocol
    from eval_harness.sweep.grid import pending_pairs, parse_shard
    from eval_harness.sweep.store import ResultStore

    shard_of = parse_shard(args.shard)
    _check_options(args)
    settings = _settings(args)
    items = {task: load_task(task, args.limit) for task in args.tasks}
    # the rows' protocol records the fusion weight the settings decode with (one per grid config or run)
    protocol = DecodingProtocol(max_new_tokens=args.max_new_tokens,
                                alpha=settings[0].alpha if settings else DecodingProtocol.alpha)
    if _backend(args) == "ray":
        return sweep_on_ray(args, settings, items, protocol, shard_of)
    if _backend(args) == "slurm":
        return sweep_on_slurm(args, settings, items, protocol, shard_of)
    audits: Counter[str] = Counter()

    def finished(row: dict) -> None:
        progress.advance(bar)
        audit = row.get("audit")
        if audit is not None:
            audits[audit["exposure_source"] if audit.get("ledger_agrees", True) else "disagreeing"] += 1

    with ResultStore(args.out) as store:
        identity = _run_identity(args, protocol)
        store.check_run(identity)  # a file holds one run: refused before any model loads
        pending, skipped = pending_pairs(settings, items, store, shard_of)
        if not pending:
            print(_summary(args, settings, items, 0, skipped))
            return 0
        runner, vocab, metadata = _runner(args, protocol, identity)
        with runner, progress_bar() as progress:
            store.check_run(metadata)
            # the bar counts this invocation's work: a resumed sweep's ETA is over what is left
            bar = progress.add_task(f"decodeleak {args.command} (shard {args.shard})", total=len(pending))
            from eval_harness.sweep.execute import run_sweep

            outcome = run_sweep(settings, items, runner, store, protocol=protocol, vocab=vocab, metadata=metadata,
                                seed=args.seed, shard_of=shard_of, on_row=finished,
                                inversion=_attacker(args, runner), observer=args.observer)
            progress.update(bar, total=outcome.pending, completed=outcome.written)
    print(_summary(args, settings, items, outcome.written, outcome.skipped))
    if audits:
        print(audit_summary(audits))
    return 0


def _backend(args: argparse.Namespace) -> str:
    """``local``, ``ray`` or ``slurm``: ``--backend``, else ``ray`` with ``--ray`` (``run`` is always local);
    ``--ray`` with another ``--backend`` is refused."""
    backend = getattr(args, "backend", None)
    if getattr(args, "ray", None) is not None:
        if backend not in (None, "ray"):
            raise ValueError(f"--ray and --backend {backend} contradict each other: give one")
        return "ray"
    if backend == "ray":
        args.ray = LOCAL_RAY
    return backend or "local"


def _summary(args: argparse.Namespace, settings, items, written: int, skipped: int) -> str:  # noqa: ANN001
    """The closing line: rows written now and already there, of how many settings and items."""
    return (f"{written} rows written to {args.out}; {skipped} already there; "
            f"{len(settings)} settings x {', '.join(f'{len(v)} {k}' for k, v in items.items())} items "
            f"(shard {args.shard})" + ("" if args.inversion == "none" else f"; inversion by {args.inversion}")
            + ("; observer attacks" if args.observer else ""))


def _settings(args: argparse.Namespace) -> list:
    """Every setting the command decodes, each checked (policy, parameters, alpha) before any model loads."""
    from eval_harness.sweep.grid import Setting, expand, load_grids

    if args.command == "run":
        return [Setting(task, args.mode, args.policy, dict(args.param), args.alpha) for task in args.tasks]
    try:
        return expand(load_grids(args.grid), args.tasks, modes=args.modes, policies=args.policies)
    except ValueError as exc:
        source = "the paper's grids" if args.grid is None else str(args.grid)
        raise ValueError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from None


def _check_options(args: argparse.Namespace) -> None:
    """The options' values and combinations, one ``ValueError`` line for the first wrong one (no model loaded)."""
    if args.seed < 0:
        raise ValueError(f"--seed must be a non-negative integer, got {args.seed}")
    if not (args.device in ("cpu", "cuda", "mps") or re.fullmatch(r"cuda:\d+", args.device)):
        raise ValueError(f"--device is cpu, cuda or cuda:N, got {args.device!r}")
    if args.inversion.startswith("http") and not args.inversion_model:
        raise ValueError("--inversion URL needs --inversion-model NAME (the model the endpoint serves)")
    if args.inversion.startswith("http"):
        from eval_harness.llm.client import check_transport

        check_transport(args.inversion, allow_insecure_http=args.allow_insecure_http)
    if args.inversion == "local" and args.runner != "reference":
        raise ValueError("--inversion local asks the cloud model in this process: use --runner reference, or give "
                         "an OpenAI-compatible endpoint URL serving the attacker")
    backend = _backend(args)
    if args.observer and backend != "local":
        raise ValueError(f"--observer sets each item against another item's private context, which a {backend} "
                         "task may not hold: run it in a plain sweep (or --shard i/N by hand)")
    if backend == "slurm":
        if args.runner != "reference" or args.inversion != "none":
            raise ValueError("--backend slurm runs the reference runner without the inversion attack on its tasks; "
                             "audit a deployment or attack in a plain sweep (or --shard i/N by hand)")
        _check_gpus_per_task("--slurm-gpus-per-task", args.slurm_gpus_per_task, args)
    if backend == "ray":
        if args.runner != "reference":
            raise ValueError("--ray runs the reference runner on the cluster's workers; audit a deployment with "
                             "--runner deployed without --ray (or --shard i/N by hand)")
        if args.inversion != "none":
            raise ValueError("--ray runs no inversion attack (its tasks decode only): attack in a plain sweep, or "
                             "--shard i/N by hand, with --inversion")
        _check_gpus_per_task("--ray-gpus-per-task", args.ray_gpus_per_task, args)
    if args.runner == "deployed":
        _check_deployed(args)
        return
    if args.batch_invariant and (args.dtype != "fp32" or args.device != "cpu" or args.device_map is not None):
        raise ValueError("--batch-invariant: its kernels are built for float32 on the CPU (--dtype fp32 --device "
                         "cpu, no --device-map)")
    deployed_only = [flag for flag, value in (("--cloud", args.cloud), ("--token-file", args.token_file),
                                              ("--tls-ca", args.tls_ca), ("--plaintext", args.plaintext),
                                              ("--transcripts", args.transcripts)) if value]
    if deployed_only:
        raise ValueError(f"{', '.join(deployed_only)}: only for --runner deployed (the reference runner keeps "
                         "both models in this process)")


def _check_gpus_per_task(flag: str, gpus: float, args: argparse.Namespace) -> None:
    """A cluster task's GPUs: non-negative, and only with the models on a GPU."""
    if gpus < 0:
        raise ValueError(f"{flag} must be non-negative, got {gpus}")
    if gpus > 0 and args.device == "cpu" and args.device_map is None:
        raise ValueError(f"{flag} needs --device cuda or --device-map auto, or the models stay on the CPU")


def _check_deployed(args: argparse.Namespace) -> None:
    """``--runner deployed``'s options: an edge GGUF, and the flags of a local or a remote adapter."""
    from edge_sdk.protocol.channels import is_loopback
    from edge_sdk.models import resolve_model

    slm_source = resolve_model(args.slm)
    if slm_source.gguf_path is None or slm_source.hf_name_or_dir is not None:
        raise ValueError(f"the deployed runner runs the edge in llama.cpp: --slm must be 'embedded' or a .gguf "
                         f"file, got {args.slm!r}")
    if args.transcript_wait < 0:
        raise ValueError(f"--transcript-wait must be non-negative, got {args.transcript_wait}")
    if args.padded_batches or args.batch_invariant:
        raise ValueError(f"{'--padded-batches' if args.padded_batches else '--batch-invariant'}: only for the "
                         "reference runner (the deployed edge decodes each item in an llama.cpp instance of its "
                         "own)")
    remote_flags = [flag for flag, value in (("--token-file", args.token_file), ("--tls-ca", args.tls_ca),
                                             ("--plaintext", args.plaintext)) if value]
    if args.cloud is None:
        if remote_flags:
            raise ValueError(f"{', '.join(remote_flags)}: only for a remote adapter (--cloud); the local one "
                             "brings its own token and listens on loopback")
        return
    if args.llm != "embedded":
        raise ValueError("--llm names the model of a local adapter; a remote adapter (--cloud) serves its own "
                         "(each row records the model it reported: audit.cloud_model)")
    if args.plaintext and not is_loopback(args.cloud):
        raise ValueError(f"refusing --plaintext to {args.cloud}: it is not a loopback address; give the "
                         "adapter's CA (--tls-ca) or rely on the system's trust roots")
    if args.transcripts is not None and not args.transcripts.is_dir():
        raise ValueError(f"the transcript directory {args.transcripts} does not exist (--transcripts)")


def _run_identity(args: argparse.Namespace, protocol) -> dict:  # noqa: ANN001
    """The :data:`~eval_harness.sweep.store.RUN_FIELDS` the rows will carry, from the options and model files
    alone (no model loaded): what a results file from another run is refused by."""
    return _spec(args).run_identity(protocol, seed=args.seed)


def audit_summary(audits: Counter[str]) -> str:
    """One line: how many rows' exposure came from the cloud's transcripts, and whether the edge's ledger agreed."""
    from eval_harness.runners.audit import FROM_LEDGER, FROM_TRANSCRIPT

    agreeing, disagreeing, ledger = audits[FROM_TRANSCRIPT], audits["disagreeing"], audits[FROM_LEDGER]
    line = f"audit: {agreeing + disagreeing} rows from the cloud's transcripts"
    line += (f", {disagreeing} of them DISAGREE with the edge's ledger (see the rows' audit.first_disagreement)"
             if disagreeing else " (each agrees with the edge's ledger)")
    if ledger:
        line += f"; {ledger} from the edge's ledger alone (no transcript: see the rows' audit.reason)"
    return line


def _runner(args: argparse.Namespace, protocol, identity: dict):  # noqa: ANN001, ANN202
    """The runner ``--runner`` names (its models loaded), the vocabulary the metrics read, and the rows' metadata
    (``identity``, :func:`_run_identity`, and the rest)."""
    if args.runner == "deployed" and args.cloud is not None and args.transcripts is None:
        print(f"decodeleak {args.command}: no --transcripts for the adapter at {args.cloud}: the audit rests on "
              "the edge's ledger alone (rows say audit.exposure_source = 'edge ledger')", file=sys.stderr)
    runner, vocab, metadata = _spec(args).build(protocol, seed=args.seed, identity=identity)
    return runner, vocab, metadata.row()


def _spec(args: argparse.Namespace):  # noqa: ANN202
    """The spec of the runner ``--runner`` names (:data:`eval_harness.runners.RUNNERS`), from the command line;
    nothing is loaded (the Ray path sends a reference spec to each worker)."""
    from eval_harness.runners import runner_spec

    spec = runner_spec(args.runner)
    if args.runner == "deployed":
        local_transcripts = args.out.with_name(args.out.stem + ".transcripts") if args.cloud is None else None
        return spec(slm=args.slm, llm=args.llm, dtype=args.dtype, concurrency=args.concurrency, cloud=args.cloud,
                    token_file=args.token_file, tls_ca=args.tls_ca, plaintext=args.plaintext,
                    transcripts=args.transcripts or local_transcripts, transcript_wait=args.transcript_wait)
    forwards = "padded" if args.padded_batches else "batch-invariant" if args.batch_invariant else "per-sequence"
    return spec(slm=args.slm, llm=args.llm, dtype=args.dtype, device=args.device, device_map=args.device_map,
                concurrency=args.concurrency, forwards=forwards)


def _attacker(args: argparse.Namespace, runner):  # noqa: ANN001, ANN202
    """The inversion attacker the options ask for (``None`` for ``--inversion none``)."""
    from edge_sdk.backends.pieces import piece_reader
    from eval_harness.attacks.inversion import EndpointInversion, TransformersInversion

    if args.inversion == "none":
        return None
    # the shared vocabulary the exposure ids are in
    piece = piece_reader(runner.llm.tokenizer if args.runner == "reference" else runner.policy_backend)
    if args.inversion == "local":
        return TransformersInversion(runner.llm, piece, k=args.inversion_k, max_new_tokens=args.inversion_max_tokens,
                                     batch_size=args.inversion_batch, sequence=args.inversion_sequence)
    from eval_harness.llm.client import ChatClient

    if args.no_inversion_cache and args.inversion_cache is not None:
        raise ValueError("--no-inversion-cache and --inversion-cache DIR contradict each other: give one")
    client = ChatClient(args.inversion, args.inversion_model, api_key_env=args.inversion_key_env,
                        cache_dir=None if args.no_inversion_cache else args.inversion_cache
                        if args.inversion_cache is not None else "default",
                        allow_insecure_http=args.allow_insecure_http, timeout_s=args.inversion_timeout)
    return EndpointInversion(client, piece, k=args.inversion_k, max_new_tokens=args.inversion_max_tokens,
                             parallel=args.inversion_batch, sequence=args.inversion_sequence)


def sweep_on_ray(args: argparse.Namespace, settings, items, protocol, shard_of) -> int:  # noqa: ANN001
    """``decodeleak sweep --ray``: the pending pairs as Ray tasks, rows gathered into ``--out`` here.

    This process loads no model: each task builds its runner on its worker.
    """
    from rich.markup import escape

    from eval_harness.sweep import ray as on_ray
    from eval_harness.sweep.grid import pending_pairs
    from eval_harness.sweep.store import ResultStore

    try:
        ray = on_ray.require_ray()
    except ImportError as exc:
        print(f"decodeleak sweep: {exc}", file=sys.stderr)
        return 1
    with ResultStore(args.out) as store:
        if args.dtype != "auto":  # with auto each worker's hardware picks the dtype; its rows are checked as they come
            store.check_run(_spec(args).run_identity(protocol, seed=args.seed))
        pending, skipped = pending_pairs(settings, items, store, shard_of)
    if not pending:
        print(_summary(args, settings, items, 0, skipped))
        return 0
    started = on_ray.connect(args.ray)
    try:
        with ResultStore(args.out) as store:
            count = args.ray_shards or on_ray.default_shard_count(args.ray_cpus_per_task, args.ray_gpus_per_task)
            plan = on_ray.plan_shards(settings, items, store, count=count, shard_of=shard_of)
            shards = len(plan.shards)
            with progress_bar() as progress:
                bar = progress.add_task(f"decodeleak sweep on Ray ({shards} shards)", total=len(plan.pending))
                try:
                    outcome = on_ray.run_on_ray(
                        plan, items, store, spec=_spec(args), protocol=protocol, seed=args.seed,
                        cpus_per_task=args.ray_cpus_per_task, gpus_per_task=args.ray_gpus_per_task,
                        on_row=lambda row: progress.advance(bar),
                        on_failure=lambda index, reason: progress.console.print(
                            f"[red]shard {index + 1}/{shards} failed[/red]: {escape(reason)}"),
                    )
                except on_ray.ShardsFailed as exc:
                    if args.verbose:
                        raise
                    print(f"decodeleak sweep: {exc}; {exc.written} rows written to {args.out}, "
                          "a re-run resumes", file=sys.stderr)
                    return 1
    finally:
        if started:
            ray.shutdown()
    dropped = f" ({outcome.duplicates} rows of retried tasks arrived twice, kept once)" if outcome.duplicates else ""
    print(f"{outcome.written} rows written to {args.out} by {shards} Ray tasks; {plan.skipped} already there; "
          f"{len(settings)} settings x {', '.join(f'{len(v)} {k}' for k, v in items.items())} items "
          f"(shard {args.shard}){dropped}")
    return 0


def sweep_on_slurm(args: argparse.Namespace, settings, items, protocol, shard_of) -> int:  # noqa: ANN001
    """``decodeleak sweep --backend slurm``: merge finished shards into ``--out``, submit the pairs still pending
    as one SLURM array (:mod:`eval_harness.sweep.slurm`), wait and merge again.  This process loads no model."""
    from eval_harness.sweep import slurm
    from eval_harness.sweep.ray import plan_shards
    from eval_harness.sweep.store import ResultStore

    options = slurm.SlurmOptions(partition=args.slurm_partition, time_min=args.slurm_time,
                                 gpus_per_task=args.slurm_gpus_per_task, cpus_per_task=args.slurm_cpus_per_task,
                                 mem_gb=args.slurm_mem_gb, array_parallelism=args.slurm_array_parallelism,
                                 cluster=args.slurm_cluster)
    try:
        slurm.require_submitit()
    except ImportError as exc:
        print(f"decodeleak sweep: {exc}", file=sys.stderr)
        return 1
    spec = _spec(args)
    with ResultStore(args.out) as store:
        store.check_run(spec.run_identity(protocol, seed=args.seed))
        merged = slurm.merge_shards(args.out, store)
        plan = plan_shards(settings, items, store, count=args.slurm_tasks, shard_of=shard_of)
    if merged:
        print(f"{merged} rows of finished SLURM shards merged into {args.out}")
    if not plan.pending:
        print(_summary(args, settings, items, 0, plan.skipped))
        return 0
    tasks = slurm.shard_tasks(plan, items, args.out, spec=spec, protocol=protocol, seed=args.seed)
    submission = slurm.submit(tasks, options, args.out)
    print(f"submitted SLURM array {submission.array_id}: {len(tasks)} tasks, {len(plan.pending)} pairs; shards and "
          f"logs in {slurm.shard_folder(args.out)}")
    if args.slurm_no_wait:
        print("not waiting (--slurm-no-wait): run the same command again to merge the finished shards")
        return 0
    failed = slurm.failures(submission)
    with ResultStore(args.out) as store:
        written = slurm.merge_shards(args.out, store)
    for index, reason in failed:
        print(f"decodeleak sweep: shard {index + 1}/{len(tasks)} failed: {reason}", file=sys.stderr)
    print(f"{written} rows written to {args.out} by {len(tasks)} SLURM tasks; {plan.skipped} already there; "
          f"{len(settings)} settings x {', '.join(f'{len(v)} {k}' for k, v in items.items())} items "
          f"(shard {args.shard})" + (f"; {len(failed)} tasks failed, a re-run resumes them" if failed else ""))
    return 1 if failed else 0
