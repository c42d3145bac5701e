"""Batch-invariant forwards: a batched forward that gives each sequence bit for bit the row it gets alone.

A batched forward rounds each row differently from a forward of that row alone, because the kernels pick their
reduction order by the shape of the whole batch: a matrix product of ``M`` rows is blocked (and on the CPU
dispatched to a GEMV or a GEMM kernel) by ``M``; attention over a padded cache sums over the padded length.
Batch-invariant kernels fix each row's reduction order whatever the batch (as the batch-invariant kernels of
2025 did for vLLM and SGLang).  Here, for a transformers causal LM in float32 on the CPU:

* **matmul in a decode step** (a forward on a filled KV cache, one new position per sequence): every
  ``nn.Linear`` computes ``y = x W^T + b`` in tiles of :data:`ROW_TILE` rows (the last tile zero-padded), so
  every product runs the same kernel on the same shape ``[tile, in] x [in, out]`` whatever the batch; a row's
  result does not depend on the values of the other rows of its tile.  The weights are stored transposed
  (``W^T`` contiguous, the same values: a product streams its weight along the rows it is laid out in), and the
  output layer, the largest product (``[V, d]``), runs through oneDNN on a copy of its weight packed once for
  tiles of :data:`ROW_TILE` rows (:class:`PackedOutputLinear`);
* **matmul in a prefill** (a forward on an empty cache: one sequence, or a left-padded batch of them): each
  sequence's own positions are one product ``[L_i, in] x [in, out]`` on a fresh copy of its rows (the batch's
  padding dropped), exactly the product of its prefill alone; the output layer reads one row per sequence and
  tiles it as in a decode step;
* **attention**: each sequence attends alone (:func:`per_row_attention`): its own keys only (the padding of
  the batch's cache dropped), ``softmax(q k^T * scale + mask) v`` with each key head's query heads in one
  product, the same shapes as when it is decoded alone;
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
#: in the forward running in this thread: ``None`` in a decode step; in a prefill, each sequence's first
#: position (its left padding's length; set by the hook :func:`make_batch_invariant` adds)
_PREFILL_STARTS: ContextVar[list[int] | None] = ContextVar("batch_invariant_prefill_starts", default=None)
#: the name the attention and its mask are registered under in transformers
ATTENTION = "coveil_batch_invariant"


def _row_tiles(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x``'s rows ``[..., in]`` as ``[k * ROW_TILE, in]`` (zero rows after the last) and how many are real."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    pad = (-count) % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return rows, count


def _tiled(product: Any, x: torch.Tensor) -> torch.Tensor:
    """``product`` of each :data:`ROW_TILE`-row tile of ``x``'s rows, shaped back as ``x`` with the product's
    last dimension."""
    rows, count = _row_tiles(x)
    tiles = [product(rows[start:start + ROW_TILE]) for start in range(0, rows.shape[0], ROW_TILE)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:count].reshape(*x.shape[:-1], -1)


class TiledLinear(torch.nn.Linear):
    """``nn.Linear`` with batch-invariant products (see the module docstring): tiles of :data:`ROW_TILE` rows in
    a decode step, one product per sequence in a prefill; its weight stored transposed."""

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(rows, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        starts = _PREFILL_STARTS.get()
        if starts is None or x.dim() != 3:
            return _tiled(self._product, x)
        out = x.new_zeros(*x.shape[:-1], self.out_features)
        for row, start in enumerate(starts):
            out[row, start:] = self._product(x[row, start:].clone())  # a fresh, aligned copy, as alone
        return out


class PackedOutputLinear(torch.nn.Linear):
    """The output layer ``[V, d]``: tiles of :data:`ROW_TILE` rows (in a prefill too: one row per sequence)
    through oneDNN on :attr:`packed`, its weight reordered once for such tiles (a copy: the weight itself stays,
    as the input embeddings share it)."""

    packed: torch.Tensor

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise  # noqa: SLF001 - oneDNN's packed product is reached so only
        return linear(rows.contiguous(), self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tiled(self._product, x)


def _prefill_starts(kwargs: dict[str, Any]) -> list[int] | None:
    """``None`` for a forward on a filled KV cache; for a prefill (an empty cache, or none) each sequence's first
    real position: the zeros before the first 1 of its ``attention_mask`` row (0 without a mask)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        return None
    mask = kwargs.get("attention_mask")
    if mask is None:
        ids = kwargs.get("input_ids")
        return [0] * (ids if ids is not None else kwargs["inputs_embeds"]).shape[0]
    starts = [int(start) for start in (mask == 0).sum(dim=-1)] if mask.dim() == 2 else []
    if not starts or any(not bool(row[start:].all()) for row, start in zip(mask, starts)):
        raise ValueError("batch-invariant prefill: attention_mask must be [B, T] with left padding only")
    return starts


def _enter_forward(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before each forward of the model: where each sequence starts if it is a prefill, for its layers' products
    in this thread."""
    _PREFILL_STARTS.set(_prefill_starts(kwargs))


def per_row_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention one sequence at a time over its own keys: ``softmax(q_i k_i^T * scale + mask_i) v_i``.

    ``query`` is ``[B, H, q, d]``, ``key``/``value`` ``[B, KV, T, d]`` (query heads ``g * H/KV`` to
    ``(g + 1) * H/KV - 1`` read key head ``g``), ``attention_mask`` boolean ``[B, 1, q, T]`` (True: attend) or
    ``None`` (no padding: causal over the last ``q`` positions).  Sequence ``i`` keeps the keys any of its
    queries attends to (its cache without the batch's left padding: the last keys) and the queries that attend
    to any key (its own positions of a padded prefill: the last queries), so its shapes, and its sums, are those
    of a forward of it alone; a padding query's output is 0.  Returns ``[B, q, H, d]``.
    """
    batch, heads, length, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    output = query.new_zeros(batch, heads, length, value.shape[-1])
    positions = torch.arange(total, device=query.device)
    causal = positions[None, :] <= (positions[total - length:])[:, None]  # [q, T]
    for row in range(batch):
        allowed = causal if attention_mask is None else attention_mask[row, 0].to(torch.bool)
        first_query = int(allowed.any(1).to(torch.int8).argmax())
        first_key = int(allowed.any(0).to(torch.int8).argmax())
        live = length - first_query
        mask = allowed[first_query:, first_key:]
        queries = query[row, :, first_query:].reshape(kv_heads, groups * live, dim)
        keys, values = key[row, :, first_key:], value[row, :, first_key:]  # [KV, T_i, d]
        scores = torch.matmul(queries, keys.transpose(-1, -2)).reshape(heads, live, -1) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).reshape(kv_heads, groups * live, -1)
        output[row, :, first_query:] = torch.matmul(weights, values).reshape(heads, live, -1)
    return output.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, per_row_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # boolean masks, None where causal alone suffices


def make_batch_invariant(model: Any) -> Any:
    """Turn a loaded transformers model's forwards batch-invariant in place (its weights' values untouched;
    every ``nn.Linear`` becomes a :class:`TiledLinear` with its weight stored transposed, the output layer a
    :class:`PackedOutputLinear`, attention :func:`per_row_attention`); returns ``model``."""
    if next(model.parameters()).device.type != "cpu" or next(model.parameters()).dtype != torch.float32:
        raise ValueError("batch-invariant forwards are built for float32 on the CPU (--dtype fp32 --device cpu)")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("batch-invariant forwards need a torch built with oneDNN (torch.backends.mkldnn), for the "
                         "output layer's packed products")
    _register()
    model.set_attn_implementation(ATTENTION)
    output = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        if module is output:
            module.__class__ = PackedOutputLinear
            pack = torch.ops.mkldnn._reorder_linear_weight  # noqa: SLF001 - as torch's CPU compiler packs weights
            module.packed = pack(module.weight.detach(), ROW_TILE)
        else:
            module.__class__ = TiledLinear
            module.weight = torch.nn.Parameter(module.weight.detach().t().contiguous().t(), requires_grad=False)
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
