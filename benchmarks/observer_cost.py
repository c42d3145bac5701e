"""What the observer defences of issue 30 cost: padding in bytes per token, the public clock in ms per token.

Bytes: one generation per policy and mode over the public fakes at Gemma-3's vocabulary (262,144 ids) and the
default ``top_m`` (256), through the real codec, padded (the default) and not (``CloudConnection(padded=False)``);
bytes per token both ways, as the ledger counts them (protobuf bytes, before gRPC's 5-byte prefix, HTTP/2's 9-byte
frame header and TLS's 17 bytes, which every message pays either way).

Time: the simulated link of ``edge_sdk.testing.LinkChannel`` (``--rtt-ms``, the cloud's ``--forward-ms`` per
row) and an SLM step of ``--slm-ms``, CoVeil in both modes, lockstep and run-ahead, with the default public
clock (``auto_pace_ms``) and without it (``auto_pace_ms=None``): ms per token and the ratio; and with the pace
``"auto"`` measures on that SLM (:func:`edge_sdk.pace_calibration.calibrated_pace_ms`).

Last lines: ``pad_bytes_per_token_<mode>`` (CoVeil: what padding adds, both directions),
``auto_pace_cost_<mode>_<lockstep|run_ahead>`` (paced over unpaced ms/token) and
``calibrated_pace_cost_<mode>_<lockstep|run_ahead>`` (the same at the calibrated pace, ``calibrated_pace_ms``).

Usage: python benchmarks/observer_cost.py [--tokens 32] [--rtt-ms 40] [--forward-ms 20] [--slm-ms 20]
(``--slm-ms 5``: a device far faster than the 50 ms default pace)
"""

from __future__ import annotations

import argparse
import string
import time

import numpy as np

from edge_sdk.decoding import CollaborativeDecoder, DecodeSettings, run_with_resume
from edge_sdk.privacy.meter import LeakageMeter
from edge_sdk.pace_calibration import calibrated_pace_ms
from edge_sdk.policies import make_policy
from edge_sdk.testing import LinkChannel, ScriptedChannel, ScriptedCloud, TableSLM
from edge_sdk.protocol.connection import CloudConnection

VOCAB = 262_144
PEAK = 7


def peaked_row(vocab: int, seed: int) -> np.ndarray:
    row = np.random.default_rng(seed).normal(scale=0.5, size=vocab).astype(np.float32)
    row[PEAK] = 12.0
    return row


def bytes_per_token(policy: str, mode: str, padded: bool, tokens: int, **params: float) -> tuple[float, float]:
    """(up, down) bytes per token of one generation."""
    slm = TableSLM(["<eos>", *(f"p{i}" for i in range(1, VOCAB))], default=peaked_row(VOCAB, 1), eos_ids={0})
    cloud = ScriptedCloud(VOCAB, default=peaked_row(VOCAB, 2), eos_ids={0})
    decoder = CollaborativeDecoder(slm, make_policy(policy, **params), DecodeSettings(mode=mode, max_new_tokens=tokens),
                                   slm_prompt=[1, 2, 3], cloud_prompt=[1], meter=LeakageMeter(frozenset()),
                                   rng=np.random.default_rng(0))
    events = list(run_with_resume(decoder, lambda: CloudConnection(ScriptedChannel(cloud.session()), padded=padded),
                                  backoff_s=0.0))
    up = sum(event.entry.bytes_up for event in events) / len(events)
    down = sum(event.entry.bytes_down for event in events) / len(events)
    return up, down


def timed_slm(args: argparse.Namespace) -> tuple[TableSLM, np.ndarray]:
    """An SLM over letters whose every step takes ``--slm-ms``, and its row (one peak: every draft holds)."""
    pieces = [" ", "\n", ".", ",", *string.ascii_letters]
    row = np.full(len(pieces), -4.0, np.float32)
    row[5] = 4.0
    return TableSLM(pieces, default=row, delay_s=args.slm_ms / 1e3), row


def ms_per_token(mode: str, lookahead: int, tokens: int, args: argparse.Namespace, **settings: float | None) -> float:
    slm, row = timed_slm(args)
    vocab = slm.vocab_size
    cloud = ScriptedCloud(vocab, default=row, max_new_tokens=tokens)
    decoder = CollaborativeDecoder(slm, make_policy("coveil"),
                                   DecodeSettings(mode=mode, max_new_tokens=tokens, top_m=4, exposure_k=4, **settings),
                                   slm_prompt=[1, 2], cloud_prompt=[1], meter=LeakageMeter(frozenset()))
    channel = LinkChannel(cloud.session(), rtt_s=args.rtt_ms / 1e3, forward_s=args.forward_ms / 1e3)
    list(decoder.steps(CloudConnection(channel, lookahead=lookahead)))
    return 1e3 * (channel.arrivals[-1] - channel.arrivals[0]) / (len(channel.arrivals) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per generation (default: %(default)s)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="the simulated round trip (default: %(default)s)")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="the cloud's forward per row (default: %(default)s)")
    parser.add_argument("--slm-ms", type=float, default=20.0, help="the SLM's step (default: %(default)s)")
    args = parser.parse_args()

    print(f"bytes per token, vocabulary {VOCAB:,}, top_m {DecodeSettings.top_m}, {args.tokens} tokens")
    print(f"{'policy':<22}{'mode':<7}{'up plain':>10}{'up padded':>11}{'down plain':>12}{'down padded':>13}")
    added: dict[str, float] = {}
    cases = [("coveil", "cloud", {}), ("coveil", "edge", {}), ("coveil", "cloud", {"space": "logit"}),
             ("cogenesis", "cloud", {}), ("dp_logit", "cloud", {}), ("undefended", "cloud", {})]
    for policy, mode, params in cases:
        plain = bytes_per_token(policy, mode, False, args.tokens, **params)
        padded = bytes_per_token(policy, mode, True, args.tokens, **params)
        name = policy + ("-logit" if params else "")
        print(f"{name:<22}{mode:<7}{plain[0]:>10.1f}{padded[0]:>11.1f}{plain[1]:>12.1f}{padded[1]:>13.1f}")
        if policy == "coveil" and not params:
            added[mode] = sum(padded) - sum(plain)

    print(f"\nms per token over a simulated {args.rtt_ms:g} ms link, cloud forward {args.forward_ms:g} ms, "
          f"SLM step {args.slm_ms:g} ms, CoVeil, {args.tokens} tokens; auto_pace_ms {DecodeSettings.auto_pace_ms:g}")
    calibrated = calibrated_pace_ms(timed_slm(args)[0])
    print(f"pace_ms='auto' on this SLM: {calibrated:g} ms")
    costs: dict[str, float] = {}
    calibrated_costs: dict[str, float] = {}
    for mode in ("edge", "cloud"):
        for lookahead, name in ((0, "lockstep"), (8, "run_ahead")):
            paced = ms_per_token(mode, lookahead, args.tokens, args)
            unpaced = ms_per_token(mode, lookahead, args.tokens, args, auto_pace_ms=None)
            at_calibrated = ms_per_token(mode, lookahead, args.tokens, args, auto_pace_ms=calibrated)
            costs[f"{mode}_{name}"] = paced / unpaced
            calibrated_costs[f"{mode}_{name}"] = at_calibrated / unpaced
            print(f"{mode:<7}{name:<11} unpaced {unpaced:7.1f}  paced {paced:7.1f}  ratio {paced / unpaced:.3f}  "
                  f"calibrated {at_calibrated:7.1f}  ratio {at_calibrated / unpaced:.3f}")
        time.sleep(0.1)

    print()
    for mode in ("cloud", "edge"):
        print(f"pad_bytes_per_token_{mode}={added[mode]:.1f}")
    for key, value in costs.items():
        print(f"auto_pace_cost_{key}={value:.3f}")
    print(f"calibrated_pace_ms={calibrated:g}")
    for key, value in calibrated_costs.items():
        print(f"calibrated_pace_cost_{key}={value:.3f}")


if __name__ == "__main__":
    main()
