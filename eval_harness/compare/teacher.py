"""Teacher forcing: every model fed the same tokens, one next-token row per step, compared step by step.

The shared prefix is a generation of the reference pair (``tokens``); step ``t``'s rows are each model's
logits after its own prompt and ``tokens[:t]``:

* the reference SLM and the cloud LLM (transformers): the prompt in one forward, then the prefix in chunks
  through the KV cache (:func:`transformers_rows`; equal to one token per forward to float rounding:
  5e-5 at most on Gemma-3 270M in float32, across its 512-token sliding window);
* each quantised SLM (llama.cpp): prefilled with the private prompt, then one token per decode call, as the
  deployed decoding loop feeds it (llama.cpp's numbers depend on how a sequence is cut into calls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_sdk.backends.base import SLMBackend
from edge_sdk.policies.base import Policy
from edge_sdk.protocol.signals import FusionMode
from edge_sdk.steps import StoppingRule
from eval_harness.compare.drift import StepDrift, StepReference

if TYPE_CHECKING:
    from cloud_adapter.llm import TransformersLLM

#: prefix tokens per teacher-forced transformers forward (bounds the [chunk, V] float32 logits held at once)
CHUNK = 32


def transformers_rows(model: TransformersLLM, prompt_ids: Sequence[int], tokens: Sequence[int], *,
                      chunk: int = CHUNK) -> Iterator[np.ndarray]:
    """Row ``t`` (``t = 0 .. len(tokens) - 1``): float32 logits [V] after ``prompt_ids + tokens[:t]``."""
    import torch
    from transformers import DynamicCache

    from cloud_adapter.hf_loading import forward_with_cache

    vocab = model.vocab_size
    with torch.inference_mode():
        logits, cache = forward_with_cache(model.model, DynamicCache(config=model.model.config),
                                           input_ids=torch.tensor([list(prompt_ids)], device=model.device),
                                           logits_to_keep=1)
        yield logits[0, -1, :vocab].float().cpu().numpy()
        prefix = list(tokens[:-1])
        for start in range(0, len(prefix), chunk):
            piece = prefix[start : start + chunk]
            logits, cache = forward_with_cache(model.model, cache,
                                               input_ids=torch.tensor([piece], device=model.device))
            yield from logits[0, :, :vocab].float().cpu().numpy()


def backend_rows(slm: SLMBackend, prompt_ids: Sequence[int], tokens: Sequence[int]) -> Iterator[np.ndarray]:
    """The same rows from an edge backend, one token per call (as the decoding loop drives it)."""
    yield slm.prefill(list(prompt_ids))
    for token in tokens[:-1]:
        yield slm.append(int(token))


def drift_along(
    tokens: Sequence[int],
    *,
    slm_prompt: Sequence[int],
    cloud_prompt: Sequence[int],
    reference: TransformersLLM,
    cloud: TransformersLLM,
    quantised: Mapping[str, SLMBackend],
    policy: Policy,
    mode: FusionMode,
    alpha: float,
    end_ids: Sequence[int],
    stopping: StoppingRule | None,
    detokenize: Callable[[list[int]], str],
) -> dict[str, list[StepDrift]]:
    """Every quantised SLM against the reference at each step of ``tokens`` (all models in lock step).

    ``end_ids`` are floored edge-side at the steps where ``stopping`` does not allow an end after the text
    so far (``detokenize(tokens[:t])``), as the decoding loop does.
    """
    if not tokens:
        return {name: [] for name in quantised}
    streams = {name: backend_rows(slm, slm_prompt, tokens) for name, slm in quantised.items()}
    drift: dict[str, list[StepDrift]] = {name: [] for name in quantised}
    rows = zip(transformers_rows(reference, slm_prompt, tokens), transformers_rows(cloud, cloud_prompt, tokens))
    for step, (z_ref, z_llm) in enumerate(rows):
        end_allowed = stopping is None or stopping.allows_end(detokenize(list(tokens[:step])))
        ref = StepReference(z_ref, z_llm, policy=policy, mode=mode, alpha=alpha,
                            end_ids=() if end_allowed else end_ids)
        for name, stream in streams.items():
            z_q = next(stream)
            if z_q.shape != z_ref.shape:
                raise ValueError(f"the {name} model has {z_q.shape[0]} vocabulary rows, the reference {z_ref.shape[0]}")
            drift[name].append(ref.compare(z_q))
    return drift
