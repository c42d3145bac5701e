"""A custom defence plugged into the SDK: write a policy, register it, use it by name, audit its ledger.

``ConfidentTop1`` below is a cloud-side policy in a dozen lines: a ``@dataclass`` subclass of
``edge_sdk.policies.Policy`` whose fields are its parameters.  ``register_policy`` adds it to the
registry, ``make_policy("confident_top1", ...)`` builds it by name, and ``EdgeClient.generate`` runs it
like any built-in defence.  The example then decodes the same question with CoVeil and prints both
privacy ledgers side by side (what was uploaded at each step, bytes, leakage meter).

Before any model runs, ``test_confident_top1_with_fakes`` tests the policy in milliseconds: a table-driven edge model
and a scripted cloud (``edge_sdk.testing``) drive the real decoding loop through the real wire codec,
and the test reads what the policy sent off the bytes the cloud received.  Copy it into your own
test suite (pytest collects it as it is).

Run (from the repository root, in the project's virtual environment)::

    python examples/custom_policy.py --fakes                # only the test with the fakes: no model, no cloud
    python examples/custom_policy.py                        # starts a cloud adapter on loopback
    python examples/custom_policy.py --cloud HOST:PORT      # uses a running `coveil-cloud serve`
    python examples/custom_policy.py --confidence 0.3 --max-gap 0.3 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from cloud_adapter.local import cloud_or_local, split_cores
from edge_sdk.backends.llama_cpp import LlamaCppSLM
from edge_sdk.protocol import wire
from edge_sdk.client import Credentials, EdgeClient, GenerationResult
from edge_sdk.fusion import fuse
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.policies import CoVeil, Policy, make_policy, register_policy
from edge_sdk.protocol.signals import CloudUpload, FusionMode
from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.testing import ScriptedCloud, TableSLM

PRIVATE_NOTE = (
    "Visit note, 12 March: Daniel Okafor, 58, retired welder. Type 2 diabetes on metformin. Reports numbness "
    "and burning in both feet for three months, worse at night. Monofilament test: reduced sensation bilaterally."
)
PUBLIC_QUESTION = (
    "Question: What is the most likely cause of the patient's symptoms, and what should be checked next?\n"
    "Answer:"
)


@register_policy
@dataclass
class ConfidentTop1(Policy):
    """Upload one value only when the SLM is confident and already agrees with the cloud; else nothing.

    Rule (cloud-side fusion), with ``y* = argmax(alpha * p_llm + (1 - alpha) * p_slm)``::

        upload {y*: p_slm(y*)}   if p_slm(y*) >= confidence and |p_slm(y*) - p_llm(y*)| <= max_gap
        upload nothing           otherwise

    So at most one SLM value leaves the device per step, and only for a token the cloud itself rates
    about as high as the SLM does (little private information in it).  Where the private context pulls
    the SLM away from the cloud, the cloud decodes from ``p_llm`` alone.

    Args:
        confidence: least SLM probability of ``y*`` worth uploading.
        max_gap: largest ``|p_slm(y*) - p_llm(y*)|`` still uploaded.
    """

    name = "confident_top1"
    modes = frozenset({"cloud"})

    confidence: float = 0.5
    max_gap: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence <= 1.0 or not 0.0 <= self.max_gap <= 1.0:
            raise ValueError("confidence and max_gap must lie in [0, 1]")

    def llm_support(self, mode: FusionMode) -> int | None:
        # The rule reads y* = top-1 of p_fuse and p_llm(y*) only, so the cloud's sparse top-m
        # distribution suffices whenever the SDK can certify the fused top-1 from it.
        return 1

    def cloud_upload(self, p_slm: np.ndarray, p_llm: np.ndarray, *, alpha: float,
                     rng: np.random.Generator | None = None) -> CloudUpload:
        y_star = int(np.argmax(fuse(p_llm, p_slm, alpha)))
        s, ell = float(p_slm[y_star]), float(p_llm[y_star])
        if s >= self.confidence and abs(s - ell) <= self.max_gap:
            return CloudUpload.of(p_slm, np.array([y_star]))
        return CloudUpload.empty()


def test_confident_top1_with_fakes() -> None:
    """ConfidentTop1 over the real loop with no model: which values it uploads, worked out by hand.

    Six pieces; alpha = 0.3, confidence 0.5, max gap 0.2; the cloud sends its top 2 per step::

        step  SLM (after the note)        cloud                  y*         upload
        0     " nerve" .6, " damage" .2    " nerve" .5, " diabetes" .3   " nerve"   {nerve: .6}  (.6 >= .5, gap .1)
        1     " damage" .7                 " diabetes" .6, " damage" .2  " damage"  {}  (gap .5 > .2)
        2     "." .8                       "." .7                 "."        {".": .8}  (gap .1)

    y* = argmax(.3 p_llm + .7 p_slm): step 0 " nerve" .57, step 1 " damage" .55, step 2 "." .77.  With
    nothing uploaded at step 1 the cloud picks its own top, " diabetes".
    """
    pieces = ["<eos>", " nerve", " damage", " diabetes", " liver", "."]
    nerve, damage, diabetes, liver, stop = 1, 2, 3, 4, 5
    slm = TableSLM(pieces, {
        (): np.log([1e-6, 0.6, 0.2, 0.1, 0.05, 0.05]),  # right after the prompt (the note read)
        (nerve,): np.log([1e-6, 0.05, 0.7, 0.15, 0.05, 0.05]),
        (diabetes,): np.log([1e-6, 0.05, 0.05, 0.05, 0.05, 0.8]),
    }, eos_ids={0})
    cloud = ScriptedCloud(len(pieces), [np.log([1e-6, 0.5, 0.1, 0.3, 0.05, 0.05]),
                                        np.log([1e-6, 0.05, 0.2, 0.6, 0.1, 0.05]),
                                        np.log([1e-6, 0.05, 0.05, 0.05, 0.15, 0.7])], eos_ids={0})
    decoder = CollaborativeDecoder(
        slm, ConfidentTop1(confidence=0.5, max_gap=0.2), DecodeSettings(mode="cloud", max_new_tokens=3, top_m=2),
        slm_prompt=[liver, diabetes, liver], cloud_prompt=[liver], meter=LeakageMeter(frozenset({nerve, damage})),
    )
    tokens = [event.token_id for event in run_with_resume(decoder, cloud.connect)]
    assert tokens == [nerve, diabetes, stop], tokens
    uploads = [wire.decode_upload(m.signal.upload, len(pieces)) for m in cloud.edge_messages()
               if m.WhichOneof("kind") == "signal"]
    assert [u.ids.tolist() for u in uploads] == [[nerve], [], [stop]]
    assert abs(float(uploads[0].values[0]) - 0.6) < 1e-5 and abs(float(uploads[2].values[0]) - 0.8) < 1e-5
    assert not any(e.full_requested for e in decoder.ledger.entries)  # the top 2 certified every step
    for entry, upload in zip(decoder.ledger.entries, uploads):
        sent = ", ".join(f"{pieces[i]!r}: {v:.2f}" for i, v in zip(upload.ids.tolist(), upload.values.tolist()))
        print(f"fakes step {entry.step}: token {pieces[entry.token_id]!r}, uploaded {{{sent}}}")
    print(f"fakes: {decoder.ledger.summary()}")


def compare(results: dict[str, GenerationResult]) -> None:
    """Per-step uploads of each policy side by side, then one summary row per policy."""
    labels = list(results)
    steps = max(len(r.ledger.entries) for r in results.values())
    print("\nSLM values uploaded per step (leakage meter so far in brackets)")
    print(f"{'step':>4}  " + "".join(f"{label:<18}" for label in labels))
    for t in range(steps):
        cells = []
        for label in labels:
            entries = results[label].ledger.entries
            cells.append(f"{entries[t].values_uploaded} [{entries[t].leak_share:.1%}]" if t < len(entries) else "-")
        print(f"{t:>4}  " + "".join(f"{cell:<18}" for cell in cells))
    print(f"\n{'policy':<18}{'values up':>10}{'steps with upload':>19}{'bytes up':>10}{'bytes down':>12}"
          f"{'leak meter':>12}")
    for label, result in results.items():
        ledger = result.ledger
        uploading = sum(e.values_uploaded > 0 for e in ledger.entries)
        print(f"{label:<18}{ledger.values_uploaded:>10}{uploading:>19}{ledger.bytes_up:>10}{ledger.bytes_down:>12}"
              f"{ledger.leak_share:>12.1%}")
    for label, result in results.items():
        print(f"\n{label}: {result.text!r}\n  {result.ledger.summary()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fakes", action="store_true", help="only test the policy with the fakes (no model)")
    parser.add_argument("--cloud", metavar="HOST:PORT", help="a running cloud adapter (default: start one locally)")
    parser.add_argument("--token-file", help="bearer token for --cloud (if the adapter requires one)")
    parser.add_argument("--tls-ca", help="CA certificate (PEM) of a TLS --cloud (default: the system's trust roots)")
    parser.add_argument("--plaintext", action="store_true", help="no TLS to --cloud (a loopback address only)")
    parser.add_argument("--confidence", type=float, default=0.5, help="ConfidentTop1's confidence threshold")
    parser.add_argument("--max-gap", type=float, default=0.2, help="ConfidentTop1's largest edge-cloud gap")
    parser.add_argument("--lam", type=float, default=1.0, help="CoVeil's privacy weight, for the comparison")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--edge-threads", type=int, help="llama.cpp threads (default: all cores, or half of "
                                                         "them when the adapter runs on this machine too)")
    args = parser.parse_args(argv)

    test_confident_top1_with_fakes()
    print("ConfidentTop1 passed its test with the fakes")
    if args.fakes:
        return 0
    local_edge_threads, cloud_threads = split_cores()
    edge_threads = args.edge_threads or (None if args.cloud else local_edge_threads)

    custom = make_policy("confident_top1", confidence=args.confidence, max_gap=args.max_gap)  # by its name
    print(f"registered policy: {custom.describe()}")
    print(ConfidentTop1.__doc__.splitlines()[0])
    with cloud_or_local(args.cloud, threads=cloud_threads) as address:
        slm = LlamaCppSLM(n_threads=edge_threads)
        credentials = Credentials.from_files(
            token_file=args.token_file, root_cert=args.tls_ca, plaintext=args.plaintext or not args.cloud
        )
        with EdgeClient(address, slm=slm, credentials=credentials) as client:
            results = {}
            for policy in (custom, CoVeil(lam=args.lam)):
                results[policy.name] = client.generate(
                    PUBLIC_QUESTION, PRIVATE_NOTE, mode="cloud", policy=policy, max_new_tokens=args.max_new_tokens
                )
    compare(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
