"""What several benchmarks measure the same way (no benchmark imports a sibling benchmark).

* :func:`ideal_tokens_per_s`: the cloud model's bare batched greedy decode, the ceiling the server's
  batching is compared with (``cloud_batching``, ``gpu_cloud``, ``reference_batching``);
* :func:`text_prompts`: equal-length prompts cut from one public text;
* :func:`served_load`: concurrent sessions through a served adapter (``cloud_adapter.loadgen``), failing
  loudly when any session failed.

The adapter itself is served by :func:`cloud_adapter.inprocess.serving`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import torch

from cloud_adapter.hf_loading import forward_with_cache
from cloud_adapter.llm import TransformersLLM
from cloud_adapter.loadgen import LoadReport, run_load

#: a public text the prompts are cut from
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to reproduce books quickly and cheaply. Within a few decades presses had spread across Europe, and the price "
    "of a book fell so far that ordinary merchants could afford small libraries of their own."
)
#: the length of each ideal-batch prompt cut from :data:`TEXT`
IDEAL_PROMPT_LENGTH = 32


def synchronize(device: torch.device | str) -> None:
    """Wait for ``device`` (a GPU runs asynchronously; the CPU needs nothing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def text_prompts(llm: TransformersLLM, batch: int, length: int = IDEAL_PROMPT_LENGTH) -> list[list[int]]:
    """``batch`` prompts of ``length`` ids each, the i-th starting at :data:`TEXT`'s i-th token."""
    ids = llm.tokenize(TEXT)
    return [ids[i : i + length] for i in range(batch)]


@torch.inference_mode()
def ideal_tokens_per_s(llm: TransformersLLM, prompts: Sequence[Sequence[int]], tokens: int) -> float:
    """Tokens/s of a bare batched greedy decode of the equal-length ``prompts``: ``len(prompts) * tokens``
    over the seconds the ``tokens`` decode steps take (the prefill not counted)."""
    from transformers import DynamicCache

    model = llm.model
    cache = DynamicCache(config=model.config)
    logits, cache = forward_with_cache(model, cache, input_ids=torch.tensor(prompts, device=llm.device),
                                       logits_to_keep=1)
    rows = logits[:, -1, : llm.vocab_size].float().cpu().numpy()
    synchronize(llm.device)
    start = time.perf_counter()
    for _ in range(tokens):
        next_ids = torch.from_numpy(rows.argmax(axis=1)).to(llm.device)[:, None]
        logits, cache = forward_with_cache(model, cache, input_ids=next_ids, logits_to_keep=1)
        rows = logits[:, -1, : llm.vocab_size].float().cpu().numpy()
    synchronize(llm.device)
    return len(prompts) * tokens / (time.perf_counter() - start)


def served_load(llm: TransformersLLM, channel: grpc.Channel, prompts: Sequence[Sequence[int]], *, tokens: int,
                top_m: int, lookahead: int = 0) -> LoadReport:
    """One edge-side session per prompt through the served adapter on ``channel``, all at once (each accepting
    run-ahead to ``lookahead``; 0 = lockstep); a ``RuntimeError`` naming the first failure when any session
    failed."""
    report = run_load(channel, [list(p) for p in prompts], fingerprint=llm.vocab_fingerprint(),
                      vocab_size=llm.vocab_size, tokens=tokens, top_m=top_m, lookahead=lookahead)
    if report.errors:
        raise RuntimeError(f"{len(report.errors)} of {len(prompts)} sessions failed: {report.errors[0]}")
    return report
