"""The ``coveil`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from edge_sdk.cli_flags import add_dataclass_flags
from edge_sdk.client import Credentials
from edge_sdk.decode_settings import DecodeSettings


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("cloud", "edge")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are 'cloud' and/or 'edge', got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coveil",
        description="Private cloud-edge collaborative decoding: demo and DecodeLeak audits.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="laptop-to-cloud demo: undefended vs CoVeil on MedPriv and CommPriv, both fusion modes",
        description=(
            "Starts a cloud adapter on loopback with the embedded Gemma-3 270M (unless --cloud is given), runs the "
            "edge SDK over a few MedPriv and CommPriv items in cloud-side and edge-side fusion, undefended and with "
            "CoVeil, and prints accuracy, DecodeLeak evidence recall (Token-ER@100, Span-ER@100), bytes per token "
            "each way and tokens/s. Saves the table as JSON and a privacy-utility plot as PNG."
        ),
    )
    demo.add_argument("--items", type=int, default=3, help="items per dataset (default: 3)")
    demo.add_argument("--max-new-tokens", type=int, default=64,
                      help="the most tokens per answer (default: 64); a generation reasons first and ends once it "
                           "has written 'Answer: (X)', as in the DecodeLeak harness's protocol")
    demo.add_argument("--modes", type=_modes, default=["cloud", "edge"],
                      help="fusion modes, comma-separated: cloud,edge (default: both)")
    demo.add_argument("--lams", type=_floats, default=[1.0],
                      help="CoVeil privacy weights to compare with the undefended run (default: 1.0)")
    add_dataclass_flags(demo, DecodeSettings, names=["alpha"])
    demo.add_argument("--cloud", metavar="HOST:PORT",
                      help="use a running cloud adapter instead of starting one on loopback")
    demo.add_argument("--token-file", type=Path, help="bearer token for --cloud (file holding the token)")
    demo.add_argument("--tls-ca", type=Path,
                      help="CA certificate (PEM) of a TLS --cloud (default: verify against the system's trust roots)")
    demo.add_argument("--plaintext", action="store_true",
                      help="talk to --cloud without TLS (accepted for a loopback address only)")
    demo.add_argument("--model", help="model for both sides: a .gguf path (default: the embedded Gemma-3 270M)")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"),
                      help="where to write demo_results.json and privacy_utility.png (default: runs/demo)")
    demo.add_argument("-v", "--verbose", action="store_true",
                      help="log progress details, and show the full traceback of an error")

    from edge_sdk.server.cli import add_serve_parser

    edge = commands.add_parser("edge", help="the device side: serve the OpenAI API with a private context",
                               description="The device side of CoVeil.")
    edge_commands = edge.add_subparsers(dest="edge_command", required=True, metavar="COMMAND")
    serve = add_serve_parser(edge_commands)
    serve.add_argument("-v", "--verbose", action="store_true", help="show the full traceback of an error")
    return parser


#: what to check for each status an expected failure of a remote adapter carries
_STATUS_HINTS = {
    "UNAUTHENTICATED": "the adapter refused the bearer token: check --token-file",
    "PERMISSION_DENIED": "the adapter refused this client: check --token-file and the client certificate",
    "UNAVAILABLE": "cannot reach the cloud adapter: check --cloud (host:port, is it running?), and TLS: a TLS "
    "adapter needs --tls-ca (or a certificate the system trusts), a plaintext one --plaintext",
    "DEADLINE_EXCEEDED": "the cloud adapter did not answer in time: is it overloaded, or the address wrong (--cloud)?",
    "RESOURCE_EXHAUSTED": "the cloud adapter is at its session limit: retry later",
    "FAILED_PRECONDITION": "the edge and cloud models do not fit together: check --model on both sides",
}


def explain(exc: BaseException) -> str | None:
    """One line for an expected failure (and the flag that fixes it), ``None`` for a bug."""
    from edge_sdk.protocol.status import CloudError

    if isinstance(exc, CloudError):
        hint = _STATUS_HINTS.get(exc.code, "the cloud adapter ended the session")
        return f"{hint} ({exc.code}: {exc})"
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {exc.filename}" if exc.filename else str(exc)
    if isinstance(exc, OSError):
        return f"cannot use {exc.filename or 'a file'}: {exc.strerror or exc}"
    if isinstance(exc, ValueError):
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"coveil {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = explain(exc)
        if message is None or args.verbose:
            raise
        print(f"coveil {args.command}: {message}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    if args.command == "edge":
        from edge_sdk.server.cli import run_serve

        return run_serve(args)
    if args.command == "demo":
        if args.items < 1 or args.max_new_tokens < 1:
            print("coveil demo: --items and --max-new-tokens must be at least 1", file=sys.stderr)
            return 2
        credentials = Credentials.from_files(token_file=args.token_file, root_cert=args.tls_ca,
                                             plaintext=args.plaintext)
        from eval_harness.demo import run_demo  # torch and the models: after the options are checked

        run_demo(
            items_per_task=args.items,
            max_new_tokens=args.max_new_tokens,
            modes=args.modes,
            lams=args.lams,
            cloud=args.cloud,
            credentials=credentials,
            model=args.model,
            out_dir=args.out,
            alpha=args.alpha,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
