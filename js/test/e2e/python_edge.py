"""The Python SDK's side of the TypeScript end-to-end tests: decode one MedPriv item against a running adapter over
gRPC and print, as JSON, the tokens, every message as the edge sent and received it (the bytes on the wire) and
the ledger (each step's record but its timings, and the epsilon ledger).

    python js/test/e2e/python_edge.py --cloud 127.0.0.1:50791 --item 0 --mode edge --max-new-tokens 16

A randomised policy (``--policy dp_fusion``) needs ``--seed``: its draws come from the conformance vectors'
:class:`RecordedDraws` (a seeded numpy generator recording every draw in the order the policy took it), printed
as ``draws`` for the TypeScript SDK to hand back to its own run of the same item.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from edge_sdk._wire.coveil_pb2 import CloudMessage, EdgeMessage
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.decode_settings import DecodeSettings
from edge_sdk.decoding import CollaborativeDecoder
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import make_policy
from edge_sdk.prompts import plain_prompts
from edge_sdk.protocol.channels import GrpcChannel
from edge_sdk.protocol.connection import CloudConnection
from tests.conformance.write_vectors import RecordedDraws

MEDPRIV = Path(__file__).resolve().parents[3] / "eval_harness" / "data" / "MEDPRIV.jsonl"
#: a ledger entry's fields that are times, measured on each run (the rest are decided, and compared)
TIMINGS = ("edge_ms", "wait_ms", "cloud_forward_ms", "pace_overrun")


class RecordingChannel(GrpcChannel):
    """A gRPC channel that keeps every message's bytes, each direction."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []
        self.received: list[str] = []

    def send(self, message: EdgeMessage) -> None:
        self.sent.append(message.SerializeToString().hex())
        super().send(message)

    def receive(self) -> CloudMessage:
        message = super().receive()
        self.received.append(message.SerializeToString().hex())
        return message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cloud", required=True, help="host:port of the adapter (plaintext, loopback)")
    parser.add_argument("--item", type=int, default=0, help="MedPriv line")
    parser.add_argument("--mode", choices=("cloud", "edge"), default="edge")
    parser.add_argument("--policy", default="undefended", help="a registered policy, its default parameters")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the recorded draws a randomised policy takes (none: no draws)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lookahead", type=int, default=0)
    parser.add_argument("--canary", default="", help="text appended to the private context")
    parser.add_argument("--token", default="", help="the adapter's bearer token (none: no token)")
    args = parser.parse_args()

    item = json.loads(MEDPRIV.read_text().splitlines()[args.item])
    slm = LlamaCppSLM()
    query = f"Question: {item['public_query']}\nAnswer:"
    prompts = plain_prompts(slm, query, item["private_context"] + args.canary)
    settings = DecodeSettings(mode=args.mode, max_new_tokens=args.max_new_tokens, auto_pace_ms=None)
    draws = None if args.seed is None else RecordedDraws(args.seed)
    decoder = CollaborativeDecoder(slm, make_policy(args.policy, backend=slm), settings, slm_prompt=list(prompts.slm_ids),
                                   cloud_prompt=list(prompts.cloud_ids), meter=LeakageMeter(frozenset()), rng=draws)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    channel = RecordingChannel(grpc.insecure_channel(args.cloud), metadata=metadata)
    connection = CloudConnection(channel, lookahead=args.lookahead)
    try:
        for _event in decoder.steps(connection):
            pass
    finally:
        connection.close()
    print(json.dumps({"slm_prompt": list(prompts.slm_ids), "cloud_prompt": list(prompts.cloud_ids),
                      "tokens": decoder.tokens, "finish_reason": decoder.finish_reason,
                      "sent": channel.sent, "received": channel.received,
                      "entries": [{key: value for key, value in asdict(entry).items() if key not in TIMINGS}
                                  for entry in decoder.ledger.entries],
                      "privacy": decoder.ledger.privacy(), "draws": [] if draws is None else draws.draws}))


if __name__ == "__main__":
    main()
