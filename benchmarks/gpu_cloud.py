"""The cloud adapter on a GPU: the slot engine and the transformers path side by side, against a plain forward.

Needs CUDA.  ``--smoke`` runs the whole script on the CPU at a tiny size (``--device cpu --shapes tiny
--sessions 2 --tokens 8 --lookahead 2``: one to three minutes on two busy cores;
``tests/cloud_adapter/test_gpu_cloud_script.py`` runs it), so a GPU's few minutes are not spent finding a script
error.  No weights travel: each model is built from its configuration alone, randomly initialised in bf16 on the
GPU (a real architecture and size, so the forward's cost is the real one; the rows are noise, which the adapter
does not care about).  The tokenizer is a synthetic one over the configuration's vocabulary: the adapter only
needs token strings for its fingerprint.

For each shape and backend (``--backends``):

(a) plain: a bare batched greedy decode, B = ``--sessions``: transformers' own ``model(input_ids[B, 1])`` on an
    equal-length ``DynamicCache`` for ``transformers``; ``SlotLLM.step`` over B slots for ``slots``;
(b) served: B concurrent edge-side sessions of different prompt lengths through the gRPC server on loopback, the
    load in a process of its own (``cloud_adapter.loadgen``: each answers every row at once with its best id),
    in lockstep and with run-ahead (``--lookahead``: the load confirms the cloud's drafts), and with run-ahead
    and ``--veto`` of the steps answered with the load's second choice (the drafts past them dropped), and
    cloud-side sessions with run-ahead (``cloud``: the load uploads a flat value over its row's top 4 ids, the
    cloud picks each token; on the slot engine the pick is read off the kept row on the device, one id copied
    back).  The slot engine advances run-ahead drafts itself (``StepBatcher(engine_drafts=True)``: each draft
    token read off its row as the row is computed, its step queued by the worker, no session thread on the
    way); ``<shape>_slots_engine_drafted_per_token_runahead_<B>`` counts those steps per token served;
(c) the bandwidth floor of one plain step: (weight bytes + the batch's KV bytes) / the device's measured copy
    rate (a 2 GiB device-to-device copy, read and written).

Lines printed last, per shape: ``<shape>_<backend>_plain_tok_s_<B>``, ``<shape>_<backend>_<mode>_vs_plain_<B>``
(mode: lockstep, runahead, veto), ``<shape>_<backend>_mean_batch_runahead_<B>``, ``<shape>_slots_plain_vs_floor_<B>``,
``<shape>_slots_vs_transformers_served_<B>`` (run-ahead tokens/s of the slot engine over the transformers path's).

Targets (issue: the cloud half at GPU scale): at 32 sessions with run-ahead, slots served/plain >= 0.8 (7B) and
>= 0.85 (70B widths: ``llama-70b-w20``, 20 of the 80 layers); slots plain >= 0.5 of the floor (7B) and >= 0.75
(70B widths); slots >= 3x the transformers path's tokens/s; >= 0.7 with 30% vetoed; mean batch >= 30 of 32.

Checked on the slot engine as well: the greedy cloud-side pick on the device against the numpy rule on the same
kept rows (200 random uploads, no_stop included; ``<shape>_slots_device_pick_checked``, and its time per pick,
``<shape>_slots_device_pick_us``); admission (sessions past the slots, a prompt past a slot: refused with the
numbers; ``<shape>_slots_admission_checked``), and a 2,048-token prompt joining 8 decoding sessions, prefilled 512
tokens a forward vs all at once (``<shape>_slots_join_stall_ms_chunked`` / ``_whole``: the longest gap between two
of their steps).

Usage: python benchmarks/gpu_cloud.py [--shapes qwen2.5-7b llama-70b-w20] [--backends slots transformers]
       [--tokens 64] [--sessions 1 8 32] [--lookahead 8] [--veto 0.3] [--deadline-s 450] [--smoke]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from _common import ideal_tokens_per_s, synchronize
from cloud_adapter.backends import BackendSettings, build_backend
from cloud_adapter.backends.rows import GreedyPick, RowSpec
from cloud_adapter.engine import CloudEngine
from cloud_adapter.inprocess import serving
from cloud_adapter.limits import Limits
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.loadgen import run_load_in_process
from cloud_adapter.runners import StepBatcher
from edge_sdk.fusion import cloud_scores
from edge_sdk.protocol.status import CloudError

#: published configurations (the models' config.json), by name; "tiny" checks the script on a CPU
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    "qwen2.5-32b": dict(family="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=False),
    # Llama-3.1-70B's widths with 20 of its 80 layers (19 B parameters): a step's cost per layer, on one GPU
    "llama-70b-w20": dict(family="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=20,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=False),
    "tiny": dict(family="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=False),
}
#: how many ids the synthetic tokenizer defines (Qwen2.5's tokenizer defines 151,665 of the 152,064 rows)
TOKENIZER_SIZE = {"qwen2.5-7b": 151_665, "qwen2.5-32b": 151_665, "llama-70b-w20": 128_256, "tiny": 1000}
#: prompt length of the plain batch; the served sessions' prompts are 48..79 tokens
PLAIN_PROMPT = 64
#: the long prompt that joins decoding sessions in the join check, and the sessions decoding meanwhile
JOIN_PROMPT, JOIN_DECODING = 2048, 8


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
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    config_type = {"qwen2": Qwen2Config, "llama": LlamaConfig}[spec.pop("family")]
    config = config_type(**spec, eos_token_id=0, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return TransformersLLM.from_loaded(model.eval(), SyntheticTokenizer(TOKENIZER_SIZE[shape]), name=shape)


def random_prompts(vocab: int, count: int, lengths: Callable[[int], int], seed: int) -> list[list[int]]:
    """``count`` prompts of random ids (a synthetic tokenizer has no text), the i-th ``lengths(i)`` long."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=lengths(i)).tolist() for i in range(count)]


def copy_rate_bytes_per_s(device: str) -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (the best of five)."""
    size = (1 << 31) if device.startswith("cuda") else (1 << 26)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


@torch.inference_mode()
def slots_plain_tokens_per_s(model: Any, batch: int, tokens: int) -> float:
    """Tokens/s of a bare greedy decode of ``batch`` slots on the slot engine (rows summarised, as served)."""
    seqs = [model.open(p, RowSpec(top_n=16)) for p in random_prompts(model.vocab_size, batch, lambda i: PLAIN_PROMPT,
                                                                     seed=batch)]
    synchronize(model.device)
    start = time.perf_counter()
    for _ in range(tokens):
        model.step([(seq, int(seq.next_row.ids[0])) for seq in seqs])
    synchronize(model.device)
    elapsed = time.perf_counter() - start
    for seq in seqs:
        model.release(seq)
    return batch * tokens / elapsed


def join_stall_ms(model: Any, prefill_chunk: int, steps: int = 24) -> float:
    """The longest gap between two steps of ``JOIN_DECODING`` sessions decoding through a ``StepBatcher`` while
    a ``JOIN_PROMPT``-token prompt joins them, prefilled ``prefill_chunk`` tokens a forward."""
    model.prefill_chunk = prefill_chunk
    prompts = random_prompts(model.vocab_size, JOIN_DECODING + 1, lambda i: JOIN_PROMPT if i == 0 else PLAIN_PROMPT,
                             seed=7)
    gaps: list[float] = []
    with StepBatcher(model, batch_window_ms=1.0) as batcher:
        seqs = [batcher.prefill(p, spec=RowSpec(top_n=16))[0] for p in prompts[1:]]
        halfway = threading.Barrier(JOIN_DECODING + 1)

        def decode(seq: Any) -> None:
            last = time.perf_counter()
            for i in range(steps):
                if i == steps // 4:
                    halfway.wait()
                batcher.forward(seq, int(seq.next_row.ids[0]))
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        threads = [threading.Thread(target=decode, args=(seq,)) for seq in seqs]
        for thread in threads:
            thread.start()
        halfway.wait()
        joined, _ = batcher.prefill(prompts[0], spec=RowSpec(top_n=16))
        for thread in threads:
            thread.join()
        for seq in [*seqs, joined]:
            batcher.release(seq)
    return 1e3 * max(gaps)


def check_admission(model: Any) -> str:
    """Sessions past the slots and a prompt past a slot are refused with the numbers (RESOURCE_EXHAUSTED,
    INVALID_ARGUMENT); the slots are all free again afterwards."""
    held = [model.open([1, 2, 3], RowSpec(top_n=4)) for _ in range(model.free_slots)]
    try:
        model.open([1, 2, 3], RowSpec(top_n=4))
        raise AssertionError("a session past the slots was admitted")
    except CloudError as refused:
        assert refused.code == "RESOURCE_EXHAUSTED", refused
        full = str(refused)
    for seq in held:
        model.release(seq)
    try:
        model.open([1] * model.max_len, RowSpec(top_n=4))
        raise AssertionError("a prompt past a slot was admitted")
    except CloudError as refused:
        assert refused.code == "INVALID_ARGUMENT", refused
        long = str(refused)
    assert model.free_slots == model.slots, (model.free_slots, model.slots)
    return f"{full} | {long}"


def check_device_pick(model: Any, picks: int = 200) -> float:
    """The greedy cloud-side pick read off kept rows on the device equals the numpy rule
    (:func:`~edge_sdk.fusion.cloud_scores`, ``argmax``) on the same rows brought to the host, for ``picks`` random
    uploads (probability and logit rows, with and without the end ids lowered); microseconds per device pick."""
    rng = np.random.default_rng(5)
    seqs = {space: model.open([1, 2, 3, 4], RowSpec(space, top_n=16)) for space in ("prob", "logit")}
    elapsed = 0.0
    try:
        for i in range(picks):
            space = "prob" if i % 2 else "logit"
            row = seqs[space].next_row
            host = row.full_values()
            ids = np.sort(rng.choice(model.vocab_size, size=int(rng.integers(0, 64)), replace=False)).astype(np.int64)
            values = (rng.random(len(ids)) if space == "prob" else rng.normal(size=len(ids))).astype(np.float32)
            stop = np.fromiter(model.eos_token_ids, np.int64) if i % 3 == 0 else np.empty(0, np.int64)
            pick = GreedyPick(ids, values, float(rng.choice([0.0, 0.3, 0.5, 1.0])), space, stop)
            synchronize(model.device)
            start = time.perf_counter()
            got = row.greedy_cloud_pick(pick)
            elapsed += time.perf_counter() - start
            scores, _ = cloud_scores(host, ids, values, pick.alpha, space=space, temperature=0.0, stop_ids=stop)
            assert got == int(np.argmax(scores)), (i, got, int(np.argmax(scores)))
    finally:
        for seq in seqs.values():
            model.release(seq)
    return 1e6 * elapsed / picks


def weight_bytes(llm: TransformersLLM) -> int:
    """Bytes a decode step reads of the weights (the input embedding is only gathered)."""
    embedding = llm.model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in llm.model.parameters() if p is not embedding)


def served(engine_model: Any, llm: TransformersLLM, args: argparse.Namespace, sessions: int, lookahead: int,
           veto: float, mode: str = "edge") -> tuple[float, float, float]:
    """Tokens/s, mean batch and engine-drafted steps per token of ``sessions`` concurrent sessions (``mode``:
    edge- or cloud-side fusion) from a load process of their own."""
    limits = Limits(max_sessions=sessions, max_sessions_per_client=sessions, max_unopened_streams=sessions + 8,
                    max_new_tokens=args.tokens)
    prompts = random_prompts(llm.vocab_size, sessions, lambda i: 48 + (i % 32), seed=1000 + sessions)
    with StepBatcher(engine_model, batch_window_ms=args.batch_window_ms) as batcher:
        engine = CloudEngine(llm, limits, runner=batcher)
        with serving(engine, max_workers=sessions + 16) as adapter:
            batcher.batch_sizes.clear()
            report = run_load_in_process(adapter.address, prompts, fingerprint=llm.vocab_fingerprint(),
                                         vocab_size=llm.vocab_size, tokens=args.tokens, top_m=16,
                                         lookahead=lookahead, veto_share=veto, mode=mode)
        counts = batcher.batch_sizes
        mean_batch = sum(s * n for s, n in counts.items()) / max(sum(counts.values()), 1)
        drafted = batcher.drafted_steps / max(sessions * args.tokens, 1)
    if report.errors:
        raise RuntimeError(f"{len(report.errors)} of {sessions} sessions failed: {report.errors[0]}")
    return sessions * args.tokens / report.wall_seconds, mean_batch, drafted


def measure(shape: str, args: argparse.Namespace, deadline: float) -> dict[str, float]:
    started = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    llm = build_llm(shape, args.device, dtype)
    params = sum(p.numel() for p in llm.model.parameters())
    print(f"\n{shape}: {params / 1e9:.2f} B parameters, {llm.dtype} on {llm.device}, built in "
          f"{time.perf_counter() - started:.1f} s; {args.tokens} tokens per sequence", flush=True)
    figures: dict[str, float] = {}
    rate = copy_rate_bytes_per_s(args.device)
    figures["copy_rate_gb_s"] = rate / 1e9
    served_tok_s: dict[tuple[str, int], float] = {}
    for backend in args.backends:
        if time.perf_counter() > deadline:
            print(f"deadline reached: {shape} {backend} not measured", flush=True)
            break
        if backend == "slots":
            max_len = max(PLAIN_PROMPT + 80 + args.tokens + 8, JOIN_PROMPT + 32)
            slots = max(*args.sessions, JOIN_DECODING + 1)
            engine_model = build_backend("slots", llm, BackendSettings(max_slots=slots, max_len=max_len))
            engine_model.device_rows = True  # on the CPU too (--smoke): the rows and picks a GPU keeps
        else:
            engine_model = llm
        # warm-ups: first calls build kernels and caches
        if backend == "slots":
            slots_plain_tokens_per_s(engine_model, 1, 2)
        else:
            ideal_tokens_per_s(llm, random_prompts(llm.vocab_size, 1, lambda i: PLAIN_PROMPT, seed=0), 2)
        served(engine_model, llm, args, 1, args.lookahead, 0.0)
        print(f"{'backend':>13}{'B':>4}{'plain tok/s':>13}{'mode':>10}{'served tok/s':>14}{'vs plain':>10}"
              f"{'mean batch':>12}{'engine drafts':>16}", flush=True)
        for sessions in args.sessions:
            if backend == "slots":
                plain = slots_plain_tokens_per_s(engine_model, sessions, args.tokens)
                kv = sessions * (PLAIN_PROMPT + args.tokens // 2) * engine_model.kv_bytes_per_token
                floor_s = (weight_bytes(llm) + kv) / rate
                step_s = sessions / plain  # one plain step: B tokens
                figures[f"{shape}_slots_plain_vs_floor_{sessions}"] = floor_s / step_s
            else:
                plain = ideal_tokens_per_s(llm, random_prompts(llm.vocab_size, sessions, lambda i: PLAIN_PROMPT,
                                                               seed=sessions), args.tokens)
            figures[f"{shape}_{backend}_plain_tok_s_{sessions}"] = plain
            modes = [("lockstep", 0, 0.0, "edge"), ("runahead", args.lookahead, 0.0, "edge")]
            if args.veto:
                modes.append(("veto", args.lookahead, args.veto, "edge"))
            modes.append(("cloud", args.lookahead, 0.0, "cloud"))
            for mode, lookahead, veto, fusion in modes:
                tok_s, mean_batch, drafted = served(engine_model, llm, args, sessions, lookahead, veto, fusion)
                print(f"{backend:>13}{sessions:>4}{plain:>13.1f}{mode:>10}{tok_s:>14.1f}{tok_s / plain:>10.3f}"
                      f"{mean_batch:>12.2f}{drafted:>16.2f}", flush=True)
                figures[f"{shape}_{backend}_{mode}_vs_plain_{sessions}"] = tok_s / plain
                if mode == "runahead":
                    figures[f"{shape}_{backend}_mean_batch_runahead_{sessions}"] = mean_batch
                    figures[f"{shape}_{backend}_engine_drafted_per_token_runahead_{sessions}"] = drafted
                    served_tok_s[(backend, sessions)] = tok_s
        if backend == "slots":
            pick_us = check_device_pick(engine_model)
            print(f"greedy cloud-side pick on the device = the numpy rule on the same rows: {pick_us:.0f} us a pick",
                  flush=True)
            figures[f"{shape}_slots_device_pick_checked"] = 1.0
            figures[f"{shape}_slots_device_pick_us"] = pick_us
            print(f"admission: {check_admission(engine_model)}", flush=True)
            figures[f"{shape}_slots_admission_checked"] = 1.0
            for name, chunk in (("chunked", 512), ("whole", JOIN_PROMPT)):
                stall = join_stall_ms(engine_model, chunk)
                print(f"a {JOIN_PROMPT}-token prompt joins {JOIN_DECODING} decoding sessions, prefilled {chunk} "
                      f"tokens a forward: longest step gap {stall:.1f} ms", flush=True)
                figures[f"{shape}_slots_join_stall_ms_{name}"] = stall
            engine_model.model.set_attn_implementation("sdpa")  # the transformers path reads the same weights
    for sessions in args.sessions:
        if ("slots", sessions) in served_tok_s and ("transformers", sessions) in served_tok_s:
            figures[f"{shape}_slots_vs_transformers_served_{sessions}"] = (
                served_tok_s[("slots", sessions)] / served_tok_s[("transformers", sessions)])
    del llm
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-7b", "llama-70b-w20"], choices=sorted(SHAPES))
    parser.add_argument("--backends", nargs="+", default=["slots", "transformers"], choices=["slots", "transformers"])
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (float32; with --shapes tiny)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32], help="concurrent sessions")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="the server's batching window")
    parser.add_argument("--lookahead", type=int, default=8, help="the run-ahead depth of the run-ahead modes")
    parser.add_argument("--veto", type=float, default=0.3, help="share of steps vetoed in the veto mode (0: none)")
    parser.add_argument("--deadline-s", type=float, default=450.0,
                        help="stop starting new backends past this many seconds (the GPU check's time box)")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script end to end on the CPU at a tiny size: --device cpu --shapes tiny "
                             "--sessions 2 --tokens 8 --lookahead 2")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.shapes, args.sessions, args.tokens, args.lookahead = "cpu", ["tiny"], [2], 8, 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available here: use --device cpu --shapes tiny to check the script")
    if args.device.startswith("cuda"):
        import transformers

        print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    deadline = time.perf_counter() + args.deadline_s
    figures: dict[str, float] = {}
    for shape in args.shapes:
        figures.update(measure(shape, args, deadline))
    print()
    for name, value in figures.items():
        print(f"{name}={value:.3f}")


if __name__ == "__main__":
    main()
