"""Batch-invariant forwards: a batched forward that gives each sequence bit for bit the row it gets alone.

A batched forward rounds each row differently from a forward of that row alone, because the kernels pick their
reduction order by the shape of the whole batch: a matrix product of ``M`` rows is blocked (and on the CPU
dispatched to a GEMV or a GEMM kernel) by ``M``; attention over a padded cache sums over the padded length.
Batch-invariant kernels fix each row's reduction order whatever the batch (as the batch-invariant kernels of
2025 did for vLLM and SGLang).  Here, for a transformers causal LM in float32 on the CPU:

* **matmul**: every ``nn.Linear`` computes ``y = x W^T + b`` in tiles of a fixed number of rows (the last tile
  zero-padded), so every product runs the same kernel on the same shape ``[tile, in] x [in, out]`` whatever the
  batch; a row's result does not depend on the values of the other rows of its tile.  The tile is
  :data:`ROW_TILE` in a decode step and :data:`PREFILL_TILE` in a prefill (a forward on an empty cache, one
  sequence or a padded batch of them: its positions fill a few large tiles, not many small ones); the output
  layer reads one row per sequence in either and always uses :data:`ROW_TILE`;
* **attention**: each sequence attends alone (:func:`per_row_attention`): its own keys only (the padding of
  the batch's cache dropped), ``softmax(q k^T * scale + mask) v`` over a contiguous ``[heads, T_i, d]`` copy,
  the same shapes as when it is decoded alone;
* **normalisation** (RMSNorm over the hidden size) and the elementwise layers reduce within one row already.

The per-sequence forwards (a batch of one) through the same model are the oracle: the tests and
``benchmarks/reference_batching.py --invariant`` compare every logit row of a batched step with them (0 rows
differ).  The rows are not those of the plain kernels (a tile of 8 rounds differently from a matrix-vector
product): a run's rows come from one kind of forward, and each row says which (``batching.forwards``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

#: the rows of every matrix product of a decode step (a batch of 8 decode steps fills one tile)
ROW_TILE = 8
#: the rows of every matrix product of a prefill, bar the output layer's
PREFILL_TILE = 64
#: whether the forward running in this thread is a prefill (set by the hook :func:`make_batch_invariant` adds)
_PREFILL: ContextVar[bool] = ContextVar("batch_invariant_prefill", default=False)
#: the name the attention and its mask are registered under in transformers
ATTENTION = "coveil_batch_invariant"


class TiledLinear(torch.nn.Linear):
    """``nn.Linear`` whose product runs in tiles of :data:`ROW_TILE` rows, :attr:`prefill_tile` in a prefill
    (see the module docstring)."""

    #: the tile of this layer's products in a prefill
    prefill_tile = PREFILL_TILE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tile = self.prefill_tile if _PREFILL.get() else ROW_TILE
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        pad = (-count) % tile
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        tiles = [torch.nn.functional.linear(rows[start:start + tile], self.weight, self.bias)
                 for start in range(0, rows.shape[0], tile)]
        return torch.cat(tiles)[:count].reshape(*x.shape[:-1], -1)


def _is_prefill(kwargs: dict[str, Any]) -> bool:
    """Whether a forward's keyword arguments start from an empty KV cache (or none)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache is None or cache.get_seq_length() == 0


def _enter_forward(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before each forward of the model: say whether it is a prefill, for its layers' products in this thread."""
    _PREFILL.set(_is_prefill(kwargs))


def per_row_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention one sequence at a time over its own keys: ``softmax(q_i k_i^T * scale + mask_i) v_i``.

    ``query`` is ``[B, H, q, d]``, ``key``/``value`` ``[B, KV, T, d]`` (grouped heads repeated to ``H``),
    ``attention_mask`` boolean ``[B, 1, q, T]`` (True: attend) or ``None`` (no padding: causal over the last
    ``q`` positions).  Sequence ``i`` keeps the keys any of its queries attends to (its cache without the batch's
    padding) and the queries that attend to any key (its own positions of a padded prefill), so its shapes, and
    its sums, are those of a forward of it alone; a padding query's output is 0.  Returns ``[B, q, H, d]``.
    """
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    scale = dim ** -0.5 if scaling is None else scaling
    output = query.new_zeros(batch, heads, length, value.shape[-1])
    for row in range(batch):
        if attention_mask is None:
            total = key.shape[2]
            positions = torch.arange(total, device=query.device)
            allowed = positions[None, :] <= (positions[total - length:])[:, None]  # causal, [q, T]
        else:
            allowed = attention_mask[row, 0].to(torch.bool)
        live, kept = allowed.any(1).nonzero().squeeze(1), allowed.any(0).nonzero().squeeze(1)
        mask = allowed[live][:, kept]
        keys = key[row][:, kept].repeat_interleave(groups, 0).contiguous()
        values = value[row][:, kept].repeat_interleave(groups, 0).contiguous()
        scores = torch.matmul(query[row][:, live].contiguous(), keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        output[row, :, live] = torch.matmul(torch.softmax(scores, dim=-1), values)
    return output.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, per_row_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # boolean masks, None where causal alone suffices


def make_batch_invariant(model: Any) -> Any:
    """Turn a loaded transformers model's forwards batch-invariant in place (its weights untouched; every
    ``nn.Linear`` becomes a :class:`TiledLinear`, attention :func:`per_row_attention`); returns ``model``."""
    if next(model.parameters()).device.type != "cpu" or next(model.parameters()).dtype != torch.float32:
        raise ValueError("batch-invariant forwards are built for float32 on the CPU (--dtype fp32 --device cpu)")
    _register()
    model.set_attn_implementation(ATTENTION)
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = TiledLinear
    output = model.get_output_embeddings()
    if isinstance(output, TiledLinear):
        output.prefill_tile = ROW_TILE  # one row per sequence, as in a decode step
    model.register_forward_pre_hook(_enter_forward, with_kwargs=True)
    return model


@torch.inference_mode()
def greedy_rows(llm: Any, prompts: Sequence[Sequence[int]], steps: int, *, together: bool) -> np.ndarray:
    """``[steps, items, V]``: each prompt's next-token logit row after each of ``steps`` greedy steps of a
    :class:`~cloud_adapter.llm.TransformersLLM`, the items stepped together in one forward (``together``) or each
    in a forward of its own (the oracle a batch-invariant forward is held to)."""
    seqs = [llm.open(prompt) for prompt in prompts]
    rows = []
    for _ in range(steps):
        chosen = [int(np.argmax(seq.next_logits)) for seq in seqs]
        if together:
            llm.step(list(zip(seqs, chosen)))
        else:
            for seq, token in zip(seqs, chosen):
                llm.step([(seq, token)])
        rows.append(np.stack([seq.next_logits.copy() for seq in seqs]))
    return np.stack(rows)
