"""``coveil-cloud``: run the cloud adapter (a gRPC decoding server over a transformers model).

Example::

    coveil-cloud serve --port 50051 --token-file tokens.txt --transcript-dir transcripts/
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloud_adapter.backends import BACKENDS, BackendSettings, build_backend
from cloud_adapter.limits import Limits
from edge_sdk.cli_flags import add_dataclass_flags, add_dtype_flag, dataclass_from_args, positive_int
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.models import ModelSource, resolve_model

if TYPE_CHECKING:
    from cloud_adapter.server import TlsConfig

log = logging.getLogger("coveil.cloud")



class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event and the record's structured ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info and record.exc_info[0] is not None:
            entry["error_type"] = record.exc_info[0].__name__
        return json.dumps(entry, default=str)


class KeyValueFormatter(logging.Formatter):
    """The usual one-line text format, followed by the record's structured ``fields`` as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return line + "".join(f" {key}={value}" for key, value in fields.items()) if fields else line


def configure_logging(*, json_lines: bool, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if json_lines else KeyValueFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


def model_source(model: str, gguf_file: str | None) -> ModelSource:
    """``--model`` (and ``--gguf-file``) → a :class:`ModelSource`."""
    if gguf_file is None:
        return resolve_model(model)
    if model == "embedded":
        raise ValueError("--gguf-file names a file inside the --model directory; pass that directory as --model")
    path = Path(model).expanduser() / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return ModelSource(name=f"{Path(model).name}/{gguf_file}", gguf_path=path.resolve())


def explain_dtype(requested: str, device: str) -> tuple[Any, str]:
    """The torch dtype ``--dtype requested`` resolves to on ``device``, and why (for the start-up log)."""
    import torch

    from cloud_adapter.hf_loading import resolve_dtype

    chosen = resolve_dtype(requested, device)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32"}.get(chosen, str(chosen))
    if requested != "auto":
        return chosen, f"{name}: requested with --dtype {requested}"
    if device.startswith("cuda"):
        why = "the GPU supports bf16" if chosen is torch.bfloat16 else "the GPU has no bf16 support"
    elif chosen is torch.bfloat16:
        why = "CPU has native bf16 kernels (AMX/AVX512-BF16)"
    else:
        why = "CPU has no native bf16 kernels, and emulated bf16 is slower than float32"
    return chosen, f"{name}: {why}"


def read_tokens(token_file: Path | None) -> list[str]:
    """Bearer tokens from ``--token-file`` (one per line, ``#`` comments) or ``$COVEIL_TOKEN``."""
    if token_file is not None:
        lines = (line.strip() for line in Path(token_file).read_text().splitlines())
        tokens = [line for line in lines if line and not line.startswith("#")]
        if not tokens:
            raise ValueError(f"token file {token_file} holds no token")
        return tokens
    env = os.environ.get("COVEIL_TOKEN", "").strip()
    return [env] if env else []


def _limit_flag(name: str) -> str:
    """``Limits`` field → flag: ``idle_timeout_s`` → ``--idle-timeout``."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def add_limit_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per :class:`~cloud_adapter.limits.Limits` field, its default and help taken from the field."""
    add_dataclass_flags(group, Limits, flag=_limit_flag, show_defaults=False)  # the formatter shows them


def limits_from_args(args: argparse.Namespace) -> Limits:
    return dataclass_from_args(Limits, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coveil-cloud",
        description="The CoVeil cloud adapter: a gRPC collaborative-decoding server over a transformers model.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve collaborative decoding over gRPC",
        description="Load the cloud LLM and serve coveil.v1.CollaborativeDecoding/Decode until SIGTERM/SIGINT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = serve.add_argument_group("model")
    model.add_argument("--model", default="embedded",
                       help="'embedded' (Gemma-3 270M shipped as a package), a transformers directory or cached hub "
                            "name, or a .gguf file (dequantised once and cached)")
    model.add_argument("--gguf-file", metavar="NAME",
                       help="load this GGUF file from inside the --model directory")
    add_dtype_flag(model, default="auto",
                   help="weights and compute dtype; auto = bf16 on GPUs and on CPUs with native bf16 kernels "
                        "(AMX/AVX512-BF16), else float32")
    model.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (ignored with --device-map)")
    model.add_argument("--threads", type=positive_int, metavar="N",
                       help="torch CPU threads (default: torch's choice, every core); when the edge model runs on "
                            "the same machine give each half its share")
    model.add_argument("--device-map", metavar="MAP",
                       help="accelerate device map, e.g. 'auto' to shard a large model over the visible GPUs "
                            "(the transformers backend; the slots backend refuses weights offloaded to cpu or disk)")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--backend", default="auto", choices=["auto", *BACKENDS.names()],
                        help="how forwards run: 'slots' (preallocated per-session KV written in place, rows summarised "
                             "on the GPU, admission by KV bytes) or 'transformers' (transformers' own caches, any "
                             "architecture); auto = slots on CUDA where the model allows it, else transformers")
    engine.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="tensor parallel over N GPUs (the slots backend): launch as `torchrun --nproc-per-node N "
                             "coveil-cloud serve --tp N ...`; rank 0 serves gRPC, the others replay its forwards")
    add_dataclass_flags(engine, BackendSettings, show_defaults=False)  # the formatter shows them

    network = serve.add_argument_group("network and security")
    network.add_argument("--host", default="127.0.0.1",
                         help="interface to listen on (0.0.0.0 or [::] for all: then use a token and TLS)")
    network.add_argument("--port", type=int, default=50051, help="TCP port (0 picks a free one)")
    network.add_argument("--ws-port", type=int, default=0, metavar="PORT",
                         help="also serve the Decode stream over WebSocket on this port, at /coveil/v1/decode (what "
                              "browsers speak; same host, tokens, TLS and limits as gRPC); 0: off")
    network.add_argument("--token-file", type=Path, metavar="FILE",
                         help="bearer tokens, one per line, each one client identity; default: $COVEIL_TOKEN; "
                              "with neither the server accepts every caller (and warns)")
    network.add_argument("--tls-cert", type=Path, metavar="PEM", help="server certificate chain (enables TLS)")
    network.add_argument("--tls-key", type=Path, metavar="PEM", help="server private key (with --tls-cert)")
    network.add_argument("--tls-client-ca", type=Path, metavar="PEM",
                         help="CA that client certificates must chain to (mutual TLS)")

    sessions = serve.add_argument_group("sessions")
    add_limit_flags(sessions)
    sessions.add_argument("--batch-window-ms", type=float, default=10.0,
                          help="the least a batched forward may wait for the sessions expected back: it waits up "
                               "to the larger of this and its recent step time for those whose edges answer "
                               "within that long; a slower session catches the next batch")
    sessions.add_argument("--transcript-dir", type=Path, metavar="DIR",
                          help="write each session's observation transcript (what the cloud saw) to "
                               "DIR/<session_id>.json")
    add_dataclass_flags(sessions, DecodeSettings, names=["exposure_k"], show_defaults=False,
                        helps={"exposure_k": "K of the per-step exposure set recorded in transcripts"})
    sessions.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                          help="on SIGTERM/SIGINT, how long in-flight sessions may continue")

    logs = serve.add_argument_group("logging")
    logs.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    logs.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    logs.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                      help="least severe level logged")
    return parser


def run_serve(args: argparse.Namespace, source: ModelSource, tls: TlsConfig | None, tokens: list[str]) -> None:
    """Load the model, warm it up and serve until SIGTERM/SIGINT."""
    from cloud_adapter.engine import CloudEngine
    from cloud_adapter.hf_loading import dtype_device
    from cloud_adapter.runners import StepBatcher
    from cloud_adapter.llm import TransformersLLM
    from cloud_adapter.server import serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    dtype, why = explain_dtype(args.dtype, dtype_device(args.device, args.device_map))
    log.info("dtype %s", why)
    start = time.perf_counter()
    if args.tp > 1:
        check_tensor_parallel_launch(args)
    llm = TransformersLLM(source, dtype=dtype, device=args.device, device_map=args.device_map,
                          tp_plan="auto" if args.tp > 1 else None)
    log.info("loaded %s (vocabulary %d) in %.1f s", llm.name, llm.vocab_size, time.perf_counter() - start)
    limits = limits_from_args(args)
    backend = "slots" if args.tp > 1 else args.backend
    model = build_backend(backend, llm, dataclass_from_args(BackendSettings, args))
    log.info("backend %s%s", type(model).__name__,
             f": {model.slots} KV slots of {model.max_len} tokens" if hasattr(model, "slots") else "")
    if args.tp > 1 and model.rank != 0:
        model.follow()  # until rank 0 stops
        return
    try:
        with StepBatcher(model, batch_window_ms=args.batch_window_ms) as batcher:
            engine = CloudEngine(llm, limits, args.transcript_dir, args.exposure_k, runner=batcher)
            serve(engine, address=f"{args.host}:{args.port}", token=tokens, tls=tls,
                  max_workers=limits.max_sessions + limits.max_unopened_streams + 8, grace_s=args.shutdown_grace,
                  ws_port=args.ws_port or None)
    finally:
        if args.tp > 1:
            model.stop_followers()


def check_tensor_parallel_launch(args: argparse.Namespace) -> None:
    """``ValueError`` unless ``--tp N`` runs under ``torchrun --nproc-per-node N`` with the slots backend."""
    world = os.environ.get("WORLD_SIZE")
    if world != str(args.tp):
        raise ValueError(f"--tp {args.tp} needs `torchrun --nproc-per-node {args.tp} coveil-cloud serve --tp {args.tp}` "
                         f"(WORLD_SIZE is {world or 'unset'})")
    if args.backend not in ("auto", "slots"):
        raise ValueError("--tp runs on the slots backend: drop --backend or pass --backend slots")
    if args.device_map is not None:
        raise ValueError("--tp and --device-map both place the weights: use one")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.batch_window_ms < 0:
        parser.error("--batch-window-ms must be non-negative")
    if not 0 <= args.ws_port <= 65535:
        parser.error(f"--ws-port must be a TCP port (1-65535), or 0 for no WebSocket route; got {args.ws_port}")
    from cloud_adapter.server import TlsConfig

    try:
        source = model_source(args.model, args.gguf_file)
        tls = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        tokens = read_tokens(args.token_file)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    configure_logging(json_lines=args.log_json, level=args.log_level)
    try:
        run_serve(args, source, tls, tokens)
    except (OSError, ValueError, RuntimeError) as exc:  # expected failures: one line, the flag that fixes it
        if args.verbose:
            raise
        print(f"coveil-cloud serve: {explain_failure(exc, args)}", file=sys.stderr)
        return 1
    return 0


def explain_failure(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for an expected failure of ``serve``."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and "bind" in text.lower():
        return f"cannot listen on {args.host}:{args.port} (is the port taken?): choose another --port or --host"
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {exc.filename} (check --model / --gguf-file)"
    if isinstance(exc, OSError):
        return f"cannot use {exc.filename or 'a file'}: {exc.strerror or exc}"
    return text


if __name__ == "__main__":
    sys.exit(main())
