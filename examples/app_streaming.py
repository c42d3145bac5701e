"""An app embedding the edge SDK: stream an answer as it is decoded, then show the privacy ledger.

The app holds a private note that never leaves the device (only the local SLM reads it) and asks a
public question.  ``EdgeClient.stream`` yields the text of each token as soon as the edge and the cloud
have agreed on it, so the app can print it live.  Afterwards the app prints the generation's privacy
ledger: per step, which signal left the device (an upload of SLM values for cloud-side fusion, or the
chosen token for edge-side fusion), how many SLM values were uploaded, the bytes each way, and the live
leakage meter (the share of the note's content tokens the cloud could have read off so far); then
``ledger.summary()``.

Run (from the repository root, in the project's virtual environment)::

    python examples/app_streaming.py                        # starts a cloud adapter on loopback
    python examples/app_streaming.py --cloud HOST:PORT      # uses a running `coveil-cloud serve`
    python examples/app_streaming.py --mode edge --lam 2 --max-new-tokens 40

Without ``--cloud`` the example starts ``coveil-cloud serve`` on a free loopback port for its duration
(the first start ever converts the embedded model once, about 40 s) and splits the machine's cores
between the adapter and the SLM, since both run on this one machine.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cloud_adapter.local import cloud_or_local, split_cores
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.client import Credentials, EdgeClient
from edge_sdk.privacy.ledger import PrivacyLedger
from edge_sdk.policies import CoVeil

PRIVATE_NOTE = (
    "Visit note, 12 March: Daniel Okafor, 58, retired welder. Type 2 diabetes on metformin. Reports numbness "
    "and burning in both feet for three months, worse at night. Monofilament test: reduced sensation bilaterally."
)
PUBLIC_QUESTION = (
    "Question: What is the most likely cause of the patient's symptoms, and what should be checked next?\n"
    "Answer:"
)


def print_ledger(ledger: PrivacyLedger, piece: Any) -> None:
    """A per-step table of what left the device."""
    print(f"\nPrivacy ledger ({ledger.policy}, {ledger.mode}-side fusion)")
    header = (f"{'step':>4}  {'token':<14}{'signal':<8}{'values up':>10}{'bytes up':>10}{'bytes down':>11}"
              f"{'leak meter':>12}")
    print(header)
    print("-" * len(header))
    for e in ledger.entries:
        token = repr(piece(e.token_id))[:13]
        flags = " (full dist.)" if e.full_requested else " (withheld)" if e.withheld else ""
        print(f"{e.step:>4}  {token:<14}{e.signal:<8}{e.values_uploaded:>10}{e.bytes_up:>10}{e.bytes_down:>11}"
              f"{e.leak_share:>12.1%}{flags}")
    print(f"\nsummary: {ledger.summary()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cloud", metavar="HOST:PORT", help="a running cloud adapter (default: start one locally)")
    parser.add_argument("--token-file", help="bearer token for --cloud (if the adapter requires one)")
    parser.add_argument("--tls-ca", help="CA certificate (PEM) of a TLS --cloud (default: the system's trust roots)")
    parser.add_argument("--plaintext", action="store_true", help="no TLS to --cloud (a loopback address only)")
    parser.add_argument("--mode", choices=["cloud", "edge"], default="cloud", help="where the distributions are fused")
    parser.add_argument("--lam", type=float, default=1.0, help="CoVeil's privacy weight lambda")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--edge-threads", type=int, help="llama.cpp threads (default: all cores, or half of "
                                                         "them when the adapter runs on this machine too)")
    args = parser.parse_args(argv)

    local_edge_threads, cloud_threads = split_cores()
    edge_threads = args.edge_threads or (None if args.cloud else local_edge_threads)
    credentials = Credentials.from_files(
            token_file=args.token_file, root_cert=args.tls_ca, plaintext=args.plaintext or not args.cloud
        )

    with cloud_or_local(args.cloud, threads=cloud_threads) as address:
        slm = LlamaCppSLM(n_threads=edge_threads)  # the embedded Gemma-3 270M (GGUF)
        with EdgeClient(address, slm=slm, credentials=credentials) as client:
            print(f"Q: {PUBLIC_QUESTION.splitlines()[0].removeprefix('Question: ')}")
            print("A:", end="", flush=True)
            stream = client.stream(PUBLIC_QUESTION, PRIVATE_NOTE, mode=args.mode, policy=CoVeil(lam=args.lam),
                                   max_new_tokens=args.max_new_tokens)
            for piece in stream:
                print(piece, end="", flush=True)  # each token's text as soon as it is decided
            print()
            print_ledger(stream.ledger, lambda i: slm.detokenize([i]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
