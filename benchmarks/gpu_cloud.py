"""The cloud adapter on a GPU: served tokens/s of 1, 8 and 32 sessions against a plain batched forward.

Needs CUDA.  No weights travel: each model is built from its configuration
alone, randomly initialised in bf16 on the GPU (a real architecture and size,
so the forward's cost is the real one; the distributions are noise, which the
adapter does not care about).  The tokenizer is a synthetic one over the
configuration's vocabulary (``<t0>``, ``<t1>``, ...): the adapter only needs
token strings for the vocabulary fingerprint.

(a) ideal: ``model(input_ids[B, 1])`` per step on one equal-length batch cache
    (one batched prefill, then greedy steps reading each row's logits to numpy,
    as the adapter does), B = 1, 8, 32.
(b) served: B concurrent edge-side sessions of different prompt lengths through
    the gRPC server on loopback (``cloud_adapter.loadgen``: each client answers
    at once with its best id that does not end the generation), in lockstep and
    with run-ahead (``--lookahead``: the cloud drafts; the clients confirm its drafts).
served_vs_ideal_B (lockstep) and runahead<W>_vs_ideal_B = served tokens/s over ideal tokens/s at the same B.

Usage: python benchmarks/gpu_cloud.py [--shapes qwen2.5-7b qwen2.5-32b] [--tokens 64] [--sessions 1 8 32] [--lookahead 0 8]
Prints a table per shape, then ``<shape>_served_vs_ideal_<B>=`` and ``<shape>_served_tok_s_<B>=`` lines.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import torch

from _common import ideal_tokens_per_s, served_load
from cloud_adapter.engine import CloudEngine
from cloud_adapter.inprocess import serving
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.runners import StepBatcher

#: published configurations (the models' config.json), by name; "tiny" checks the script on a CPU
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=False),
}
#: how many ids the synthetic tokenizer defines (Qwen2.5's tokenizer defines 151,665 of the 152,064 rows)
TOKENIZER_SIZE = {"qwen2.5-7b": 151_665, "qwen2.5-32b": 151_665, "tiny": 1000}


class SyntheticTokenizer:
    """The few tokenizer calls the adapter makes, over ``n`` made-up token strings."""

    bos_token_id = None
    eos_token_id = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<t{i}>" for i in ids]

    def __call__(self, text: str, add_special_tokens: bool = False) -> Any:
        """Each character's code point, wrapped into the vocabulary (the server tokenizes a warm-up text)."""
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[1 + ord(c) % (self.n - 1) for c in text])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<t{i}>" for i in ids)


def build_llm(shape: str, device: str, dtype: torch.dtype) -> TransformersLLM:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], eos_token_id=0, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return TransformersLLM.from_loaded(model, SyntheticTokenizer(TOKENIZER_SIZE[shape]), name=shape)


def random_prompts(llm: TransformersLLM, count: int, lengths: Callable[[int], int], seed: int) -> list[list[int]]:
    """``count`` prompts of random ids (a synthetic tokenizer has no text), the i-th ``lengths(i)`` long."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, llm.vocab_size, size=lengths(i)).tolist() for i in range(count)]


def ideal(llm: TransformersLLM, batch: int, tokens: int) -> float:
    """Tokens/s of a bare batched decode of ``batch`` random prompts of 64 ids."""
    return ideal_tokens_per_s(llm, random_prompts(llm, batch, lambda i: 64, seed=batch), tokens)


def served_tokens_per_s(llm: TransformersLLM, channel: grpc.Channel, sessions: int, tokens: int,
                        lookahead: int) -> float:
    """Tokens/s of ``sessions`` concurrent edge-side sessions (prompt lengths 48..79) from their common start, each
    accepting run-ahead to ``lookahead`` (0 = lockstep; the load's clients confirm the cloud's draft)."""
    prompts = random_prompts(llm, sessions, lambda i: 48 + (i % 32), seed=1000 + sessions)
    report = served_load(llm, channel, prompts, tokens=tokens, top_m=16, lookahead=lookahead)
    return sessions * tokens / report.wall_seconds


def measure(shape: str, args: argparse.Namespace) -> dict[str, float]:
    started = time.perf_counter()
    llm = build_llm(shape, args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    params = sum(p.numel() for p in llm.model.parameters())
    print(f"\n{shape}: {params / 1e9:.2f} B parameters, {llm.dtype} on {llm.device}, built in "
          f"{time.perf_counter() - started:.1f} s; {args.tokens} tokens per sequence", flush=True)
    figures: dict[str, float] = {}
    limits = Limits(max_sessions=max(args.sessions), max_sessions_per_client=max(args.sessions),
                    max_unopened_streams=max(args.sessions) + 8, max_new_tokens=args.tokens)
    with StepBatcher(llm, batch_window_ms=args.batch_window_ms) as batcher:
        engine = CloudEngine(llm, limits, runner=batcher)
        with serving(engine, max_workers=max(args.sessions) + 16) as adapter, \
                grpc.insecure_channel(adapter.address) as channel:
            ideal(llm, 1, 4)  # warm-ups
            for lookahead in args.lookahead:
                served_tokens_per_s(llm, channel, 1, 4, lookahead)
            print(f"{'B':>4}{'lookahead':>10}{'ideal tok/s':>14}{'served tok/s':>14}{'served/ideal':>14}"
                  f"{'mean batch':>12}")
            for sessions in args.sessions:
                best_ideal = max(ideal(llm, sessions, args.tokens) for _ in range(args.repeats))
                figures[f"{shape}_ideal_tok_s_{sessions}"] = best_ideal
                for lookahead in args.lookahead:
                    served, batches = [], []
                    for _ in range(args.repeats):
                        batcher.batch_sizes.clear()
                        served.append(served_tokens_per_s(llm, channel, sessions, args.tokens, lookahead))
                        counts = batcher.batch_sizes
                        batches.append(sum(s * n for s, n in counts.items()) / max(sum(counts.values()), 1))
                    best = int(np.argmax(served))
                    ratio = served[best] / best_ideal
                    print(f"{sessions:>4}{lookahead:>10}{best_ideal:>14.1f}{served[best]:>14.1f}{ratio:>14.3f}"
                          f"{batches[best]:>12.2f}", flush=True)
                    label = "served" if lookahead == 0 else f"runahead{lookahead}"
                    figures[f"{shape}_{label}_tok_s_{sessions}"] = served[best]
                    figures[f"{shape}_{label}_vs_ideal_{sessions}"] = ratio
    del llm, engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-7b", "qwen2.5-32b"], choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (float32; with --shapes tiny)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32], help="concurrent sessions")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting (the best is kept)")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="the server's batching window")
    parser.add_argument("--lookahead", type=int, nargs="+", default=[0, 8],
                        help="run-ahead depths the sessions accept, each measured (0 = lockstep; default: 0 8)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available here: use --device cpu --shapes tiny to check the script")
    if args.device.startswith("cuda"):
        print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    figures: dict[str, float] = {}
    for shape in args.shapes:
        figures.update(measure(shape, args))
    print()
    for name, value in figures.items():
        print(f"{name}={value:.3f}")


if __name__ == "__main__":
    main()
