"""The cloud LLM on HF transformers: one KV cache per sequence, batched decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cloud_adapter.hf_loading import load_causal_lm
from edge_sdk.models import ModelSource, embedded_model, vocab_fingerprint


@dataclass(eq=False)
class CloudSequence:
    """One session's public sequence on the cloud: its ids, KV cache and next-token logits."""

    ids: list[int]
    cache: Any
    next_logits: np.ndarray
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)


class TransformersLLM:
    """A causal LM served from transformers.

    Args:
        model: a :class:`ModelSource`; ``None`` = the embedded Gemma-3 270M.
        dtype: ``"auto"`` (bf16 where the hardware has native bf16 kernels, else
            float32), ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"`` when ``device_map`` is not set.
        device_map: passed to ``from_pretrained`` (``"auto"`` shards a large model over GPUs).
    """

    def __init__(
        self,
        model: ModelSource | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str = "cpu",
        device_map: str | None = None,
    ) -> None:
        self.source = model or embedded_model()
        self.name = self.source.name
        self.model, self.tokenizer = load_causal_lm(self.source, dtype=dtype, device=device, device_map=device_map)
        self.dtype = self.model.dtype
        self.device = self.model.device
        self.vocab_size = len(self.tokenizer)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        self._fingerprint: bytes | None = None

    # -- tokenizer ---------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        bos = self.tokenizer.bos_token_id
        return ([bos] if add_bos and bos is not None else []) + list(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def vocab_fingerprint(self) -> bytes:
        if self._fingerprint is None:
            self._fingerprint = vocab_fingerprint(self.tokenizer.convert_ids_to_tokens(list(range(self.vocab_size))))
        return self._fingerprint

    # -- decoding ----------------------------------------------------------------------------------
    def _logits_row(self, logits: torch.Tensor) -> np.ndarray:
        return logits[-1, : self.vocab_size].float().cpu().numpy()

    @torch.inference_mode()
    def open(self, prompt_ids: Sequence[int]) -> CloudSequence:
        """Prefill ``prompt_ids`` once into a fresh KV cache."""
        from transformers import DynamicCache

        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        return CloudSequence(ids=ids, cache=out.past_key_values, next_logits=self._logits_row(out.logits[0]))

    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[CloudSequence, int]]) -> None:
        """Append one token to each sequence and refresh its ``next_logits``."""
        for seq, token in batch:
            out = self.model(
                input_ids=torch.tensor([[int(token)]], device=self.device),
                past_key_values=seq.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            seq.cache = out.past_key_values
            seq.ids.append(int(token))
            seq.next_logits = self._logits_row(out.logits[0])
